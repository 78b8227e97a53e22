"""Hardware profile: a YAML file describing the GPUs and the host, turned into a typed, validated object.

The schema, with every field's meaning, is `plans/hardware/SCHEMA.md`. Bundled profiles live in
`plans/hardware/<name>.yaml`; `load_profile` takes such a name or a path.
"""

import hashlib
import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from gguf.constants import GGMLQuantizationType

from planner.document import read_document
from planner.errors import StratumError
from planner.units import parse_bytes, parse_count, parse_flops, parse_rate, parse_seconds
from plans import HARDWARE_DIR

# field -> (parser, default written as in the YAML, or None when required)
_GPU_FIELDS = {
    "vram": (parse_bytes, None),
    "sms": (parse_count, None),
    "reserved": (parse_bytes, None),
    "memory_bandwidth": (parse_rate, None),
    "fp32": (parse_flops, None),
    "fp16": (parse_flops, "fp32"),
    "host_to_device": (parse_rate, None),
    "device_to_host": (parse_rate, None),
    "zero_copy_read": (parse_rate, "host_to_device"),
    "copy_latency": (parse_seconds, "10 us"),
    "read_latency": (parse_seconds, "0 us"),
    "zero_copy_latency": (parse_seconds, "read_latency"),
    "graph_node_overhead": (parse_seconds, "1 us"),
    "kernel_launch": (parse_seconds, "25 us"),
    "copy_call": (parse_seconds, "kernel_launch"),
    "event_call": (parse_seconds, "kernel_launch"),
    "l2": (parse_bytes, "0 B"),
    "host_page_table_entry": (parse_bytes, "8 B"),
}
_HOST_FIELDS = {
    "ram": (parse_bytes, None),
    "pinned_budget": (parse_bytes, None),
}


@dataclass(frozen=True)
class KernelFit:
    """How one family of this project's kernels runs on a GPU: a kernel takes latency_s plus its roofline time
    (the larger of FLOPs / fp32 and bytes / memory_bandwidth) over efficiency. Uncalibrated: the roofline.

    The tiled families (TILED_FAMILIES) are priced by their tiles instead (`codegen.cost.tiled_s`): an SM runs
    its share of a node's tiles, one tile taking its FLOPs at the SM's share of fp32 over efficiency plus
    weight_element_s for each weight element the tile dequantizes, each further tile on the SM costing
    further_tile of that (co-resident tiles overlap).

    Prefill attention (WALK_FAMILIES) may add walk_token_s: a block walks the K/V tile by tile up to its last
    row, so a chunk whose blocks all fit on the SMs at once takes the walk of its last rows' block, the
    context's positions at walk_token_s each, however few FLOPs it has; a node takes latency_s plus the larger
    of that walk and its roofline time over efficiency (BENCHMARKS.md: the demo's 256-row chunks)."""
    efficiency: float = 1.0
    latency_s: float = 0.0
    weight_element_s: float = 0.0
    further_tile: float = 1.0
    walk_token_s: float = 0.0


@dataclass(frozen=True)
class Kernels:
    """The calibration `stratum profile --detect` measures (`runtime.detect`): one fit per kernel family. The
    decode families serve windows of 1..8 rows (memory-bound), the prefill families chunks (compute-bound);
    `*_grouping` is the routed pairs' grouping by expert (one thread block: it follows no roofline), `*_small`
    every other kernel (norms, RoPE, adds, top-k, K/V store, embedding, argmax); `prefill_ring_batch` (a
    latency only) what a batch of the prefill ring adds to its block's routed experts beyond their one launch
    and beyond its tiles' cost; `prefill_host` (a latency only) what a prefill chunk costs the host that the
    GPU's work does not hide (its inputs staged, its logits and routing read back, the GPU waiting on the
    first launches), added to each chunk; `prefill_launch` (a latency only) the host's time to launch one node
    of a prefill pass (0: the profile's `kernel_launch`); the prefill ring's host calls as the engine makes
    them (latencies only, `runtime.ring_clock`): `prefill_ring_copy` a driver copy (0: `copy_call`),
    `prefill_ring_call` the rest of a batch (its two expert kernels' launches, its events, its Python; 0: two
    `kernel_launch` and four `event_call`), `prefill_ring_block` a streaming block's wait for its routing and
    the host's work from it to its batches (0: none). `decode_l2_*` price the decode families for a model
    whose weights fit in the GPU's L2 cache (`codegen.cost.weights_in_l2`): its steps re-read them from L2, not
    device memory, and each of its kernels' dependent loads waits for L2 (BENCHMARKS.md: a 4-block 512-wide
    model's decode nodes take about half the time of the 2048-wide calibration model's); `prefill_l2_*`
    likewise price such a model's prefill chunks (its small kernels take a fraction of the latency in the
    2048-wide model's fit, BENCHMARKS.md, validation run 18); a profile that leaves one out gives it its
    `decode_*` or `prefill_*` family's fit. `decode_host_experts` prices what a decode expert launch adds when it
    reads its experts from the mapped host copy (a cache miss) instead of slots, its roofline their bytes at
    the zero-copy read rate (BENCHMARKS.md, run 37: the demo's launches added more than their bytes and the
    link's latency priced); None where uncalibrated: the planner then prices the link's latency at each round of the
    launches' loads (`codegen.cost.decode_load_rounds`)."""
    decode_matmul: KernelFit = KernelFit()
    decode_attention: KernelFit = KernelFit()
    decode_experts: KernelFit = KernelFit()
    decode_grouping: KernelFit = KernelFit()
    decode_small: KernelFit = KernelFit()
    decode_l2_matmul: KernelFit = KernelFit()
    decode_l2_attention: KernelFit = KernelFit()
    decode_l2_experts: KernelFit = KernelFit()
    decode_l2_grouping: KernelFit = KernelFit()
    decode_l2_small: KernelFit = KernelFit()
    prefill_l2_matmul: KernelFit = KernelFit()
    prefill_l2_attention: KernelFit = KernelFit()
    prefill_l2_experts: KernelFit = KernelFit()
    prefill_l2_grouping: KernelFit = KernelFit()
    prefill_l2_small: KernelFit = KernelFit()
    prefill_matmul: KernelFit = KernelFit()
    prefill_attention: KernelFit = KernelFit()
    prefill_experts: KernelFit = KernelFit()
    prefill_grouping: KernelFit = KernelFit()
    prefill_small: KernelFit = KernelFit()
    prefill_ring_batch: KernelFit = KernelFit()
    prefill_host: KernelFit = KernelFit()
    prefill_launch: KernelFit = KernelFit()
    prefill_ring_copy: KernelFit = KernelFit()
    prefill_ring_call: KernelFit = KernelFit()
    prefill_ring_block: KernelFit = KernelFit()
    decode_host_experts: KernelFit | None = None


KERNEL_FAMILIES = tuple(f.name for f in fields(Kernels))
TILED_FAMILIES = ("prefill_matmul", "prefill_experts", "prefill_l2_matmul", "prefill_l2_experts")
WALK_FAMILIES = ("prefill_attention", "prefill_l2_attention")
# each *_l2_* family -> the family it defaults to
L2_FAMILIES = {f"{kind}_l2_{part}": f"{kind}_{part}" for kind in ("decode", "prefill")
               for part in ("matmul", "attention", "experts", "grouping", "small")}


def _rounded(value):
    if isinstance(value, float):
        return float(f"{value:.12g}")
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


@dataclass(frozen=True)
class GPU:
    name: str
    vram_bytes: int
    sms: int                          # streaming multiprocessors: a wave of prefill tiles is one tile an SM
    reserved_bytes: int               # CUDA context, driver, display: never ours
    memory_bandwidth_bytes_per_s: float   # achievable device read bandwidth
    fp32_flops: float
    fp16_flops: float
    host_to_device_bytes_per_s: float     # pinned copy, host to device
    device_to_host_bytes_per_s: float
    zero_copy_read_bytes_per_s: float     # a kernel reading mapped pinned host memory
    copy_latency_s: float                 # fixed cost of one async copy before bytes flow
    graph_node_overhead_s: float          # one kernel node replayed from a CUDA graph
    kernel_launch_s: float                # host time of one kernel launch (or copy) issued from Python
    copy_call_s: float                    # host time of one prefill ring copy (an expert matrix into its slot)
    event_call_s: float                   # host time of one event record, or a stream's wait on one
    l2_bytes: int = 0                     # L2 cache: a model whose weights fit decodes from it (0: none counted)
    host_page_table_entry_bytes: int = 8  # the driver's page tables mapping pinned host memory, per 4 KiB page
    read_latency_s: float = 0.0           # one dependent load from device memory, past the caches
    zero_copy_latency_s: float = 0.0      # one dependent load from mapped pinned host memory (over the link)
    kernels: Kernels = Kernels()          # this project's kernels measured on this GPU (default: the roofline)
    # (type name, rate): a decode matmul's read rate for weights of that type, as a share of the rate for Q8_0
    # weights (the type the decode families are fitted on); a type left out reads at Q8_0's
    decode_weight_rates: tuple = ()

    @property
    def usable_bytes(self) -> int:
        return self.vram_bytes - self.reserved_bytes

    def decode_weight_rate(self, type_name: str) -> float:
        """A decode kernel reads weights of this type at this share of Q8_0's bytes per second
        (`decode_weight_rates`; 1 where not measured): 4-bit types cost more instructions per byte."""
        return dict(self.decode_weight_rates).get(type_name, 1.0)


@dataclass(frozen=True)
class Host:
    ram_bytes: int
    pinned_budget_bytes: int


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    gpus: tuple[GPU, ...]
    host: Host
    source: str

    @property
    def fingerprint(self) -> str:
        """Hash of the figures (not of the file's text): reformatting a profile keeps its plans valid."""
        gpus = [asdict(g) for g in self.gpus]
        for figures in gpus:        # an uncalibrated profile keeps the fingerprint it had before calibration
            # and a family left uncalibrated (None) the fingerprint the profile had before the family existed
            figures["kernels"] = {family: fit for family, fit in figures["kernels"].items() if fit is not None}
            if figures["kernels"] == {f: fit for f, fit in asdict(Kernels()).items() if fit is not None}:
                del figures["kernels"]
            if figures["zero_copy_latency_s"] == figures["read_latency_s"]:     # unmeasured: nothing priced
                del figures["zero_copy_latency_s"], figures["read_latency_s"]
            if not figures["decode_weight_rates"]:      # unmeasured: the fingerprint from before they existed
                del figures["decode_weight_rates"]
        figures = {"gpus": gpus, "host": asdict(self.host)}
        # '0.98 us' and '980 ns' differ in the last bit of a float: hash 12 significant digits
        text = json.dumps(_rounded(figures), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def with_vram(self, vram_bytes: int) -> "Profile":
        """The same machine with a smaller (emulated) card: what the H200 runs to behave like an 8 GB card."""
        gpus = tuple(replace(g, vram_bytes=vram_bytes) for g in self.gpus)
        return replace(self, gpus=gpus, name=f"{self.name}@{vram_bytes // 2**20}MiB")


def bundled_profiles() -> list[str]:
    return sorted(p.stem for p in HARDWARE_DIR.glob("*.yaml"))


def profile_for_gpu(gpu_name: str) -> str:
    """The bundled profile of one GPU named `gpu_name` (as the CUDA driver names it, in any case)."""
    for name in bundled_profiles():
        if [gpu.name.lower() for gpu in load_profile(name).gpus] == [gpu_name.lower()]:
            return name
    raise StratumError(f"no bundled hardware profile is for this GPU ({gpu_name}); give --hardware, one of "
                       f"{', '.join(bundled_profiles())}, or a profile YAML")


def load_profile(name_or_path) -> Profile:
    path = Path(name_or_path)
    if not path.suffix and not path.exists():
        path = HARDWARE_DIR / f"{name_or_path}.yaml"
        if not path.exists():
            raise StratumError(
                f"no bundled hardware profile named {name_or_path!r}; bundled: {', '.join(bundled_profiles())}"
                " (or give a path to a profile YAML)")
    return parse_profile(read_document(path, "hardware profile"), source=str(path), default_name=path.stem)


def parse_profile(document, source: str, default_name: str = "profile") -> Profile:
    if not isinstance(document, dict):
        raise StratumError("expected a mapping with 'gpus' and 'host'", source=source)
    _refuse_unknown(document, {"name", "description", "gpus", "host"}, source, "")
    gpus_doc = document.get("gpus")
    if not isinstance(gpus_doc, list) or not gpus_doc:
        raise StratumError("expected a non-empty list of GPUs", source=source, field="gpus")
    gpus = tuple(_parse_gpu(g, source, f"gpus[{i}]") for i, g in enumerate(gpus_doc))
    host_doc = document.get("host")
    if not isinstance(host_doc, dict):
        raise StratumError("expected a mapping with 'ram' and 'pinned_budget'", source=source, field="host")
    _refuse_unknown(host_doc, set(_HOST_FIELDS), source, "host.")
    host_values = _parse_fields(host_doc, _HOST_FIELDS, source, "host.")
    host = Host(ram_bytes=host_values["ram"], pinned_budget_bytes=host_values["pinned_budget"])
    if host.pinned_budget_bytes > host.ram_bytes:
        raise StratumError("is larger than host.ram", source=source, field="host.pinned_budget")
    return Profile(name=str(document.get("name", default_name)), description=str(document.get("description", "")),
                   gpus=gpus, host=host, source=source)


def _parse_gpu(doc, source: str, where: str) -> GPU:
    if not isinstance(doc, dict):
        raise StratumError("expected a mapping of GPU fields", source=source, field=where)
    _refuse_unknown(doc, set(_GPU_FIELDS) | {"name", "kernels", "decode_weight_rates"}, source, where + ".")
    v = _parse_fields(doc, _GPU_FIELDS, source, where + ".")
    if v["reserved"] >= v["vram"]:
        raise StratumError("must be smaller than vram", source=source, field=where + ".reserved")
    for field in ("memory_bandwidth", "fp32", "fp16", "host_to_device", "device_to_host", "zero_copy_read"):
        if v[field] <= 0:
            raise StratumError("must be positive", source=source, field=f"{where}.{field}")
    return GPU(name=str(doc.get("name", "GPU")), vram_bytes=v["vram"], sms=v["sms"], reserved_bytes=v["reserved"],
               memory_bandwidth_bytes_per_s=v["memory_bandwidth"], fp32_flops=v["fp32"], fp16_flops=v["fp16"],
               host_to_device_bytes_per_s=v["host_to_device"], device_to_host_bytes_per_s=v["device_to_host"],
               zero_copy_read_bytes_per_s=v["zero_copy_read"], copy_latency_s=v["copy_latency"],
               graph_node_overhead_s=v["graph_node_overhead"], kernel_launch_s=v["kernel_launch"],
               copy_call_s=v["copy_call"], event_call_s=v["event_call"],
               l2_bytes=v["l2"], host_page_table_entry_bytes=v["host_page_table_entry"],
               read_latency_s=v["read_latency"], zero_copy_latency_s=v["zero_copy_latency"],
               kernels=_parse_kernels(doc.get("kernels", {}), source, where + ".kernels"),
               decode_weight_rates=_parse_weight_rates(doc.get("decode_weight_rates", {}), source,
                                                       where + ".decode_weight_rates"))


def _parse_weight_rates(doc, source: str, where: str) -> tuple:
    """`decode_weight_rates: {Q4_K: 0.375, Q6_K: 0.272}`: GGML type names, each a positive rate (Q8_0's is 1)."""
    if not isinstance(doc, dict):
        raise StratumError("expected a mapping of GGML type names to rates, such as {Q4_K: 0.375}", source=source,
                           field=where)
    rates = []
    for name, rate in doc.items():
        if str(name).upper() not in GGMLQuantizationType.__members__:
            raise StratumError("is not a GGML type name (such as Q4_K, Q6_K, Q8_0)", source=source,
                               field=f"{where}.{name}")
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate <= 4:
            raise StratumError("must be a rate in (0, 4], Q8_0's being 1, such as 0.375", source=source,
                               field=f"{where}.{name}")
        rates.append((str(name).upper(), float(rate)))
    return tuple(sorted(rates))


def _parse_kernels(doc, source: str, where: str) -> Kernels:
    """`kernels: {family: {efficiency: 0.58, latency: 7 us}, ...}` (a tiled family may add `weight_element` and
    `further_tile`, prefill attention `walk_token`); a family left out keeps the roofline, a `decode_l2_*` one
    its `decode_*` family's fit."""
    if not isinstance(doc, dict):
        raise StratumError("expected a mapping of kernel families", source=source, field=where)
    _refuse_unknown(doc, set(KERNEL_FAMILIES), source, where + ".")
    fits = {}
    for family, fit in doc.items():
        at = f"{where}.{family}"
        if not isinstance(fit, dict):
            raise StratumError("expected a mapping with efficiency and latency", source=source, field=at)
        tiled = {"weight_element", "further_tile"} if family in TILED_FAMILIES else set()
        walk = {"walk_token"} if family in WALK_FAMILIES else set()
        _refuse_unknown(fit, {"efficiency", "latency"} | tiled | walk, source, at + ".")
        efficiency = _fraction(fit.get("efficiency", 1.0), "a fraction of the roofline in (0, 1], such as 0.58",
                               source, at + ".efficiency")
        further = _fraction(fit.get("further_tile", 1.0), "a fraction of a first tile's time in (0, 1], such as "
                            "0.82", source, at + ".further_tile")
        latency = parse_seconds(fit["latency"], source=source, field=at + ".latency") if "latency" in fit else 0.0
        weight_element = (parse_seconds(fit["weight_element"], source=source, field=at + ".weight_element")
                          if "weight_element" in fit else 0.0)
        walk_token = (parse_seconds(fit["walk_token"], source=source, field=at + ".walk_token")
                      if "walk_token" in fit else 0.0)
        fits[family] = KernelFit(efficiency, latency, weight_element, further, walk_token)
    for family, fallback in L2_FAMILIES.items():
        if family not in fits and fallback in fits:
            fits[family] = fits[fallback]
    return Kernels(**fits)


def _fraction(value, expected: str, source: str, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise StratumError(f"must be {expected}", source=source, field=field)
    return float(value)


def _parse_fields(doc: dict, fields: dict, source: str, prefix: str) -> dict:
    values = {}
    for field, (parse, default) in fields.items():
        if field in doc:
            values[field] = parse(doc[field], source=source, field=prefix + field)
        elif default is None:
            raise StratumError("missing (required)", source=source, field=prefix + field)
        elif default in values:     # defaults to another field's value
            values[field] = values[default]
        else:
            values[field] = parse(default)
    return values


def _refuse_unknown(doc: dict, known: set, source: str, prefix: str):
    unknown = sorted(set(map(str, doc)) - known)
    if unknown:
        raise StratumError(f"unknown field; known fields: {', '.join(sorted(known))}", source=source,
                           field=prefix + unknown[0])
