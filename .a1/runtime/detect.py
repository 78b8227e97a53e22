"""`stratum profile --detect`: measure this machine's GPU and write a hardware profile (plans/hardware/SCHEMA.md).

Measured, with a line of progress each: free and total device memory (`reserved` is what is not free, plus a
margin for the modules this project loads), device read bandwidth, the FP32 FMA peak numba code reaches, pinned
copies each way, a kernel reading mapped host memory (zero-copy), one small copy's latency, a graph node's
overhead and a kernel launch from Python (`runtime.ceilings`); then the calibration of this project's kernel
families (`runtime.calibrate`) and the decode matmul's rate for each weight type (`runtime.decode_rates`). The
profile is written with every figure and how it was measured; a second run on the same machine gives figures
within a few percent (BENCHMARKS.md shows two).
"""

import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

from codegen.lower.cuda import SIMULATOR, cuda, device_name
from planner.errors import StratumError
from planner.profile import KERNEL_FAMILIES, TILED_FAMILIES, WALK_FAMILIES, load_profile
from runtime import ceilings

MODULE_MARGIN_BYTES = 512 << 20    # kernel modules, graphs and fragmentation after the context's own use
PINNED_SHARE = 0.75                # of host RAM that the profile lets stratum page-lock


def detect(path: Path, name: str | None = None, calibrate: bool = True, samples: Path | None = None,
           note=print) -> Path:
    """Measure this GPU (device 0) and write its profile to `path`; returns the path. `samples`: also write
    the calibration's timed nodes there (JSON: `runtime.calibration_fit.Sample`'s fields), so its fits can be
    examined or redone without the GPU (`runtime.calibration_fit.fit_families`)."""
    if SIMULATOR or not cuda.is_available():
        raise StratumError("--detect measures a real NVIDIA GPU, and none is usable here"
                           + (" (NUMBA_ENABLE_CUDASIM=1 selects the simulator)" if SIMULATOR else
                              " (no CUDA driver or device)"))
    gpu_name = device_name()
    started = time.perf_counter()
    free_bytes, total_bytes = cuda.current_context().get_memory_info()
    device = cuda.get_current_device()
    note(f"{gpu_name}: {total_bytes / 2**30:.1f} GiB, {free_bytes / 2**30:.1f} GiB free, "
         f"{device.L2_CACHE_SIZE / 2**20:.0f} MiB of L2")
    figures = {}
    for field, what, measure, unit, scale in (
            ("memory_bandwidth", "device read bandwidth", ceilings.read_bandwidth_bytes_per_s, "GB/s", 1e9),
            ("fp32", "FP32 FMA peak", ceilings.fp32_peak_flops, "TFLOPS", 1e12),
            ("host_to_device", "pinned copy, host to device", ceilings.pinned_copy_bytes_per_s, "GB/s", 1e9),
            ("device_to_host", "pinned copy, device to host",
             lambda: ceilings.pinned_copy_bytes_per_s(to_device=False), "GB/s", 1e9),
            ("zero_copy_read", "a kernel reading mapped host memory", ceilings.zero_copy_read_bytes_per_s, "GB/s", 1e9),
            ("copy_latency", "a 4 KiB pinned copy", ceilings.copy_latency_s, "us", 1e-6),
            ("read_latency", "a dependent load from device memory", ceilings.read_latency_s, "us", 1e-6),
            ("zero_copy_latency", "a dependent load from mapped host memory", ceilings.zero_copy_read_latency_s,
             "us", 1e-6),
            ("graph_node_overhead", "a CUDA graph's empty node", ceilings.graph_node_overhead_s, "us", 1e-6),
            ("kernel_launch", "a kernel launched from Python", ceilings.kernel_launch_s, "us", 1e-6),
            ("copy_call", "a prefill ring copy issued from Python", ceilings.copy_call_s, "us", 1e-6),
            ("event_call", "an event call issued from Python", ceilings.event_call_s, "us", 1e-6),
            ("host_page_table_entry", "page tables per 4 KiB page pinned on the host",
             lambda: round(ceilings.host_page_table_entry_bytes()), "B", 1)):
        value = measure() / scale
        figures[field] = f"{value:.4g} {unit}"
        note(f"  {what}: {figures[field]}")
    ram_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    reserved_bytes = min(total_bytes - (1 << 20), total_bytes - free_bytes + MODULE_MARGIN_BYTES)
    document = {
        "name": name or path.stem,
        "description": f"{gpu_name}, measured by stratum profile --detect on {time.strftime('%Y-%m-%d')}: "
                       "every figure is this machine's, the kernels block this project's kernels on it.",
        "gpus": [{"name": gpu_name, "vram": f"{total_bytes} B", "sms": device.MULTIPROCESSOR_COUNT,
                  "reserved": f"{reserved_bytes} B", "l2": f"{device.L2_CACHE_SIZE} B", **figures}],
        "host": {"ram": f"{ram_bytes} B", "pinned_budget": f"{int(ram_bytes * PINNED_SHARE)} B"},
    }
    _write(path, document)
    if calibrate:
        from runtime.calibrate import calibrate as fit_kernels
        note("calibrating this project's kernels (a Qwen3-30B-A3B-shaped model of 4 blocks, then a small model "
             "of its architecture; the first run compiles their kernels, two or three minutes)")
        with tempfile.TemporaryDirectory() as folder:
            measured = Path(folder) / "measured.yaml"
            _write(measured, document)
            kernels, timed = fit_kernels(measured, load_profile(measured).gpus[0], note=note)
        if samples is not None:
            samples.parent.mkdir(parents=True, exist_ok=True)
            samples.write_text(json.dumps([sample._asdict() for sample in timed], indent=1))
        document["gpus"][0]["kernels"] = kernels_document(kernels)
        _write(path, document)
        from runtime.decode_rates import decode_weight_rates
        note("the decode matmul's read rate for each weight type, against Q8_0's (the type calibrated above)")
        document["gpus"][0]["decode_weight_rates"] = decode_weight_rates(np.random.default_rng(2026), note=note)
        _write(path, document)
    load_profile(path)      # what was written reads back
    note(f"wrote {path} in {time.perf_counter() - started:.0f} s")
    return path


def kernels_document(kernels) -> dict:
    """A profile's `kernels:` block: each family's fit to 3 significant digits (a kernel that follows no
    roofline, such as the one-block grouping, fits far below 1%: rounded to decimals it would read as 0)."""
    document = {}
    for family in KERNEL_FAMILIES:
        fit = getattr(kernels, family)
        if fit is None:         # uncalibrated (`Kernels.decode_host_experts`)
            continue
        document[family] = {"efficiency": float(f"{fit.efficiency:.3g}"), "latency": f"{fit.latency_s * 1e6:.3g} us"}
        if family in TILED_FAMILIES:
            document[family].update(weight_element=f"{fit.weight_element_s * 1e9:.3g} ns",
                                    further_tile=float(f"{fit.further_tile:.3g}"))
        if family in WALK_FAMILIES and fit.walk_token_s:
            document[family]["walk_token"] = f"{fit.walk_token_s * 1e9:.3g} ns"
    return document


def _write(path: Path, document: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# written by stratum profile --detect; fields: plans/hardware/SCHEMA.md\n"
                    + yaml.safe_dump(document, sort_keys=False, width=110))
