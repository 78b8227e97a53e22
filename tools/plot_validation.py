"""docs/validation.png from `benchmarks/validate.py --json` files: the planner's predicted tok/s against the
measured, prefill and decode, a point per (budget, prompt), the diagonal and its 10% band; and the device
memory each engine took beyond its plan.

    python3 tools/plot_validation.py benchmarks/results/validate-2026-12-01.json [more.json ...] -o docs/validation.png

Needs matplotlib, which is not a dependency of stratum (like torch for tools/train_demo.py): install it where
you plot. The first file is drawn solid, the others faded, labelled by their file names.
"""

import argparse
import json
from pathlib import Path


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="validate.py --json files")
    parser.add_argument("-o", "--output", default="docs/validation.png")
    args = parser.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    budgets = []
    for index, path in enumerate(args.runs):
        rows = json.loads(Path(path).read_text())
        budgets = budgets or sorted({row["budget"] for row in rows}, key=lambda b: float(b.split()[0]))
        colours = {budget: plt.cm.viridis(i / max(1, len(budgets) - 1)) for i, budget in enumerate(budgets)}
        alpha, label = (1.0, Path(path).stem) if index == 0 else (0.3, Path(path).stem)
        for axis, phase in zip(axes[:2], ("prefill", "decode")):
            for row in rows:
                axis.scatter(row[f"{phase} tok/s"], row[f"{phase} predicted"], color=colours[row["budget"]],
                             alpha=alpha, s=20 + row["prompt"] / 64, edgecolor="black" if index == 0 else "none",
                             linewidth=0.4, label=row["budget"] if index == 0 and row["prompt"] == 512 else None)
        axes[2].scatter([float(row["budget"].split()[0]) for row in rows],
                        [row["allocated - plan MiB"] for row in rows], alpha=alpha, color="tab:red",
                        label=label, s=18)
    for axis, phase in zip(axes[:2], ("prefill", "decode")):
        low, high = (min(v for line in axis.collections for v in line.get_offsets().ravel()) * 0.8,
                     max(v for line in axis.collections for v in line.get_offsets().ravel()) * 1.25)
        axis.plot([low, high], [low, high], color="black", linewidth=0.8)
        axis.fill_between([low, high], [low * 0.9, high * 0.9], [low * 1.1, high * 1.1], color="grey", alpha=0.2,
                          label="within 10%")
        axis.set(xscale="log", yscale="log", xlim=(low, high), ylim=(low, high), xlabel=f"measured {phase} tok/s",
                 ylabel=f"predicted {phase} tok/s", title=f"{phase}: predicted against measured (size: prompt)")
        axis.legend(fontsize=7, loc="upper left")
    axes[2].axhline(0, color="black", linewidth=0.8)
    axes[2].set(xscale="log", xlabel="memory budget (GB)", ylabel="allocated beyond the plan (MiB)",
                title="device memory beyond the plan's bytes")
    axes[2].legend(fontsize=7)
    figure.suptitle("stratum's plan against the H200 (Qwen3-30B-A3B shape at Q8_0, 6 blocks; benchmarks/validate.py)",
                    fontsize=10)
    figure.tight_layout()
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.output, dpi=110)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
