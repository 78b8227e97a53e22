"""An offline preview of the `decode_host_experts` fit (run 38's detect, which would measure it, got no device):
run 37's demo decode nodes at 0 and 128 cache slots (`nodes-demo.txt`, an event between nodes) give each expert
launch's time from the host copy beyond its time from slots; fitted as the detect fits it (`runtime.calibration_fit.fit`,
the roofline the launch's expert bytes at the bundled profile's zero-copy rate), then written into a copy of the
bundled profile for `tools/reprice_validation.py`.

    PYTHONPATH=. python3 benchmarks/results/run37/host-fit-preview.py /tmp/h200-host-preview.yaml
"""

import re
import sys
from pathlib import Path

import yaml

from planner.model import load_model
from planner.profile import Kernels, load_profile
from plans import HARDWARE_DIR
from runtime.calibration_fit import fit
from runtime.detect import kernels_document
from tools.demo import DEMO_PATH

HERE = Path(__file__).parent
BUNDLED = HARDWARE_DIR / "h200-141g.yaml"


def op_times_us(text: str) -> list:
    """[(nodes, us with events, us replayed, {op: us over every block})] of each step in decode_nodes' output."""
    steps = []
    for part in text.split("decode step after")[1:]:
        nodes, events, replayed = map(float, re.search(r"(\d+) nodes, ([\d.]+) us with events between nodes, "
                                                       r"([\d.]+) us replayed", part).groups())
        ops = {op: float(us) for op, us in re.findall(r"^\| (\w+) \| ([\d.]+) \| [\d.]+% \|$", part, re.MULTILINE)}
        steps.append((nodes, events, replayed, ops))
    return steps


def launch_us(op: str, blocks: int, ops: dict, events_us: float, replayed_us: float, nodes: float) -> float:
    """A launch's median at one step, less the events' cost a node."""
    return ops[op] / blocks - (events_us - replayed_us) / nodes


def main(out: Path):
    model, gpu = load_model(DEMO_PATH), load_profile(BUNDLED).gpus[0]
    (n0, e0, r0, host), (n1, e1, r1, slots) = op_times_us((HERE / "nodes-demo.txt").read_text())
    blocks = len(model.expert_layers)
    k = model.hparams.n_expert_used
    bytes_of = {"moe_swiglu_matmul": ("ffn_gate_exps", "ffn_up_exps"), "moe_down_matmul": ("ffn_down_exps",)}
    rooflines, added = [], []
    for op, matrices in bytes_of.items():
        expert_bytes = k * sum(model.tensor_bytes[f"blk.{model.expert_layers[0].layer}.{m}.weight"]
                               for m in matrices) / model.hparams.n_expert
        rooflines.append(expert_bytes / gpu.zero_copy_read_bytes_per_s)
        added.append((launch_us(op, blocks, host, e0, r0, n0) - launch_us(op, blocks, slots, e1, r1, n1)) / 1e6)
        print(f"{op}: {rooflines[-1] * 1e6:.2f} us of bytes at zero-copy, {added[-1] * 1e6:.2f} us added a launch")
    host_fit = fit(rooflines, added)
    print(f"decode_host_experts: efficiency {host_fit.efficiency:.3g}, latency {host_fit.latency_s * 1e6:.3g} us; "
          f"replayed step {r0:.1f} us at 0 slots, {r1:.1f} us at 128")
    document = yaml.safe_load(BUNDLED.read_text())
    document["gpus"][0]["kernels"]["decode_host_experts"] = kernels_document(
        Kernels(decode_host_experts=host_fit))["decode_host_experts"]
    out.write_text(yaml.safe_dump(document, sort_keys=False))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
