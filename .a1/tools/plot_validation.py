"""docs/validation.png from `benchmarks/validate.py --json` files: the planner's predicted tok/s against the
measured, prefill and decode, a point per (budget, prompt), the diagonal and its 10% band; and the device
memory each engine took beyond its plan. A row of three panels for the Qwen3-30B-A3B shape, and one for the demo
model where `--demo` gives its files.

    python3 tools/plot_validation.py benchmarks/results/validate-2026-12-01.json [more.json ...] \\
        [--demo validate-demo.json ...] -o docs/validation.png

Needs matplotlib, which is not a dependency of stratum (like torch for tools/train_demo.py): install it where
you plot. In each row the first file is drawn solid, the others faded, labelled by their file names.
"""

import argparse
import json
from pathlib import Path

ROWS = (("runs", "the Qwen3-30B-A3B shape at Q8_0, 6 blocks", "memory budget (GB)"),
        ("demo", "the demo model (plans/demo, 25 MB)", "memory budget (MiB)"))


def draw_row(plt, axes, paths: list, title: str, budget_label: str) -> None:
    for index, path in enumerate(paths):
        rows = json.loads(Path(path).read_text())
        # a colour per budget by its rank in its run: runs label a fraction of a model's bytes differently
        # once the plan's bytes change
        budgets = sorted({row["budget"] for row in rows}, key=lambda b: float(b.split()[0]))
        colours = {budget: plt.cm.viridis(i / max(1, len(budgets) - 1)) for i, budget in enumerate(budgets)}
        alpha, label = (1.0, Path(path).stem) if index == 0 else (0.3, Path(path).stem)
        first_prompt = min(row["prompt"] for row in rows)
        for axis, phase in zip(axes[:2], ("prefill", "decode")):
            for row in rows:
                axis.scatter(row[f"{phase} tok/s"], row[f"{phase} predicted"], color=colours[row["budget"]],
                             alpha=alpha, s=20 + row["prompt"] / 64, edgecolor="black" if index == 0 else "none",
                             linewidth=0.4,
                             label=row["budget"] if index == 0 and row["prompt"] == first_prompt else None)
        axes[2].scatter([float(row["budget"].split()[0]) for row in rows],
                        [row["allocated - plan MiB"] for row in rows], alpha=alpha, color="tab:red",
                        label=label, s=18)
    for axis, phase in zip(axes[:2], ("prefill", "decode")):
        values = [v for line in axis.collections for v in line.get_offsets().ravel()]
        low, high = min(values) * 0.8, max(values) * 1.25
        axis.plot([low, high], [low, high], color="black", linewidth=0.8)
        axis.fill_between([low, high], [low * 0.9, high * 0.9], [low * 1.1, high * 1.1], color="grey", alpha=0.2,
                          label="within 10%")
        axis.set(xscale="log", yscale="log", xlim=(low, high), ylim=(low, high), xlabel=f"measured {phase} tok/s",
                 ylabel=f"predicted {phase} tok/s", title=f"{title}\n{phase}: predicted against measured (size: prompt)")
        axis.legend(fontsize=7, loc="upper left")
    axes[2].axhline(0, color="black", linewidth=0.8)
    axes[2].set(xscale="log", xlabel=budget_label, ylabel="allocated beyond the plan (MiB)",
                title=f"{title}\ndevice memory beyond the plan's bytes")
    axes[2].legend(fontsize=7)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="validate.py --json files of the Qwen3-30B-A3B shape")
    parser.add_argument("--demo", nargs="*", default=[], help="validate.py --model demo --json files")
    parser.add_argument("-o", "--output", default="docs/validation.png")
    args = parser.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(getattr(args, name), title, budget) for name, title, budget in ROWS if getattr(args, name)]
    figure, axes = plt.subplots(len(rows), 3, figsize=(15, 5.2 * len(rows)), squeeze=False)
    for row_axes, (paths, title, budget) in zip(axes, rows):
        draw_row(plt, row_axes, paths, title, budget)
    figure.suptitle("stratum's plan against the H200 (benchmarks/validate.py)", fontsize=10)
    figure.tight_layout()
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.output, dpi=110)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
