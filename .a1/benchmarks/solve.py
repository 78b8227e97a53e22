"""How fast the planner is: `solve` for every bundled card on one core, and `stratum plan` as a whole process.

    python benchmarks/solve.py

Prints a table: median and worst of repeated solves (the model and profile already loaded: the search and
the plan's assembly), and the wall time of a fresh `stratum plan` process reading a header-only GGUF of the
card (with a 151k-token vocabulary, as real files carry) and writing the plan. The target: GLM-4.5 (355B,
93 blocks) under 100 ms median, the whole process under 1 s.
"""

import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from planner.model import bundled_cards, load_model
from planner.profile import load_profile
from planner.search import solve
from plans import HARDWARE_DIR, MODELS_DIR
from tests.ggufs import write_header_only

REPEATS = 9


def main():
    work = Path(tempfile.mkdtemp(prefix="stratum-bench-"))
    # a workstation host: GLM-4.5's experts (191 GiB) need more pinned memory than a bundled profile's host
    document = yaml.safe_load((HARDWARE_DIR / "rtx-5090-32g.yaml").read_text())
    document["host"] = {"ram": "512 GiB", "pinned_budget": "448 GiB"}
    (work / "workstation.yaml").write_text(yaml.safe_dump(document))
    profile = load_profile(work / "workstation.yaml")
    tokens = {"tokenizer.ggml.tokens": [f"token{i}" for i in range(151552)]}
    print(f"{'model card':26} {'blocks':>6} {'solve median':>13} {'solve worst':>12} {'stratum plan':>13}")
    for card in bundled_cards():
        model = load_model(card)
        seconds = []
        for _ in range(REPEATS):
            start = time.perf_counter()
            solve(hardware=profile, model=model, context=32768, kv="q8_0")
            seconds.append(time.perf_counter() - start)
        gguf = work / f"{card}.gguf"
        write_header_only(MODELS_DIR / f"{card}.yaml", gguf, tokens)
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "planner.cli", "plan", "--hardware", str(work / "workstation.yaml"),
                        "--model", str(gguf), "--context", "32768", "--kv", "q8_0", "-o", str(work / "plan.yaml")],
                       check=True, capture_output=True)
        process = time.perf_counter() - start
        print(f"{card:26} {model.hparams.n_layer:6} {statistics.median(seconds) * 1e3:10.1f} ms "
              f"{max(seconds) * 1e3:9.1f} ms {process * 1e3:10.0f} ms")


if __name__ == "__main__":
    main()
