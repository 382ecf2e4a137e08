"""The picture of docs/quality.md's "Smoothing K before FP4 attention": the share of FP4's gap each row of
experiments/k_smoothing_gap.py closes, per clip size, on the loss and the velocity.

    python experiments/plot_k_smoothing.py --tables bench/results/rotation/k_smoothing_17x128x128.json \
        bench/results/rotation/k_smoothing_33x128x128.json bench/results/rotation/k_smoothing_49x128x128.json \
        --out docs/k_smoothing.png
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from experiments._plot import save_figure  # noqa: E402

ROWS = {"ksmooth": "K-smoothing alone", "rot": "rotation alone", "ksmooth_rot": "rotation + K-smoothing",
        "qat_rot": "shipped QAT file + rotation (as it ships)", "qat_ksmooth_rot": "shipped QAT file + rotation + K-smoothing"}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tables", nargs="+", required=True, type=pathlib.Path)
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("docs/k_smoothing.png"))
    args = p.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tables = [json.loads(t.read_text()) for t in args.tables]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4), sharey=True)
    width = 0.8 / len(ROWS)
    for ax, (metric, name) in zip(axes, (("gap_closed_loss", "flow loss"), ("gap_closed_velocity", "velocity"))):
        for i, (key, label) in enumerate(ROWS.items()):
            xs = [g + (i - len(ROWS) / 2 + 0.5) * width for g in range(len(tables))]
            ax.bar(xs, [100 * t["rows"][key][metric] for t in tables], width, color=f"C{i}", label=label)
        ax.set_xticks(range(len(tables)), [t["size"] for t in tables])
        ax.axhline(0, color="black", lw=0.6)
        ax.set_title(f"share of FP4's {name} gap closed (CPU, {tables[0]['clips']} held-out clips a size)", fontsize=9)
    axes[0].set_ylabel("%")
    axes[0].set_ylim(top=85)  # room for the legend above the bars
    axes[0].legend(fontsize=7, loc="upper left", ncol=2)
    save_figure(fig, args.out)


if __name__ == "__main__":
    main()
