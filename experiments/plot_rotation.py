"""The picture of docs/quality.md's "Rotating Q and K before FP4 attention": the share of FP4's gap each row closes
at each clip length, and per latent frame at the longest.

    python experiments/plot_rotation.py --tables bench/results/rotation/quality_17x128x128.json \
        bench/results/rotation/quality_33x128x128.json bench/results/rotation/quality_49x128x128.json \
        --out docs/rotation.png

Each table is an `attnqat quality` table.json; rows absent from a table are left out of its group.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from experiments._plot import save_figure  # noqa: E402

ROWS = {"rot": "rotation alone (base weights)", "shipped": "shipped QAT file", "shipped_rot": "shipped QAT file + rotation",
        "rot_lora": "rotation + LoRA 380 steps", "ctrl_fp4_rot": "control (bf16-trained) + rotation"}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tables", nargs="+", required=True, type=pathlib.Path)
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("docs/rotation.png"))
    args = p.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tables = [json.loads(t.read_text()) for t in args.tables]
    fig, (ax, af) = plt.subplots(1, 2, figsize=(13, 4.6))
    width = 0.8 / len(ROWS)
    for i, (key, label) in enumerate(ROWS.items()):
        for j, (metric, hatch) in enumerate((("gap_closed_loss", ""), ("gap_closed_velocity", "//"))):
            xs, ys = [], []
            for g, t in enumerate(tables):
                row = t["rows"].get(key)
                if row is not None:
                    xs.append(2 * g + j + (i - len(ROWS) / 2 + 0.5) * width)
                    ys.append(100 * row[metric])
            ax.bar(xs, ys, width, color=f"C{i}", hatch=hatch, edgecolor="white",
                   label=label if j == 0 else None)
    ax.set_xticks([2 * g + j for g in range(len(tables)) for j in (0, 1)],
                  [f"{'x'.join(map(str, t['size']))}\n{m}" for t in tables for m in ("loss", "velocity")], fontsize=8)
    ax.axhline(70, color="grey", ls="--", lw=1)
    ax.set_ylabel("share of FP4's gap closed (%)")
    ax.set_title("gap closed, H200, 32 held-out clips a size (bar: loss; hatched: velocity)", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    longest = max(tables, key=lambda t: t["size"][0])
    for i, key in enumerate(ROWS):
        row = longest["rows"].get(key)
        if row is not None:
            af.plot([100 * x for x in row["gap_closed_velocity_frames"]], "o-", color=f"C{i}", label=ROWS[key])
    af.set_xlabel("latent frame")
    af.set_ylabel("velocity gap closed (%)")
    af.set_ylim(0, 70)
    af.set_title(f"per latent frame at {'x'.join(map(str, longest['size']))}", fontsize=9)
    af.legend(fontsize=7)
    save_figure(fig, args.out)


if __name__ == "__main__":
    main()
