"""The ceiling of QAT on mini (docs/quality.md): a model trained from scratch with FP4 attention in the loop beside
the same recipe in bf16, as one picture.

    python experiments/plot_ceiling.py --bf16-log bench/results/ceiling/bf16_from_scratch_log.csv \
        --fp4-log bench/results/ceiling/attn_qat_from_scratch_log.csv \
        --quality bench/results/ceiling/quality_33x256x256.json --out docs/ceiling.png

Left: each run's held-out flow loss as its training evaluated it (32 held-out clips, the training's noise levels,
each run in its own attention: bf16 for the bf16-trained run, FP4 for the FP4-trained one). Middle: their ratio at
the same steps, beside the FP4 cost of the bf16-trained run (its loss in FP4 over its loss in bf16, from the
quality table: what training with FP4 in the loop would have to beat). Right: the quality table's flow loss per
latent frame (fixed noise levels 0.1-0.9) of the rows given by --rows.
"""
from __future__ import annotations

import argparse
import csv
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from experiments._plot import save_figure  # noqa: E402


def held_out(path: pathlib.Path) -> dict[int, float]:
    """step -> eval_flow of an `attnqat train` log.csv (the rows where the run evaluated)."""
    return {int(r["step"]): float(r["eval_flow"]) for r in csv.DictReader(path.open()) if r.get("eval_flow")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bf16-log", type=pathlib.Path, required=True)
    p.add_argument("--fp4-log", type=pathlib.Path, required=True)
    p.add_argument("--quality", type=pathlib.Path, required=True, help="attnqat quality's table.json")
    p.add_argument("--rows", default="s_bf16,s_bf16_fp4,s_fp4",
                   help="the quality rows: bf16-trained in bf16, bf16-trained in FP4, FP4-trained in FP4")
    p.add_argument("--out", type=pathlib.Path, required=True)
    args = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bf16, fp4 = held_out(args.bf16_log), held_out(args.fp4_log)
    table = json.loads(args.quality.read_text())
    rows = args.rows.split(",")
    flow = {r: table["rows"][r]["flow_loss"] for r in rows}
    fig, (ax_eval, ax_ratio, ax_frames) = plt.subplots(1, 3, figsize=(15, 4.2))
    ax_eval.plot(list(bf16), list(bf16.values()), "o-", ms=3, label="trained in bf16 (evaluated in bf16)")
    ax_eval.plot(list(fp4), list(fp4.values()), "o-", ms=3, label="trained in FP4 (evaluated in FP4)")
    ax_eval.set(title="held-out flow loss (training's evaluation)", xlabel="step", yscale="log")
    shared = sorted(set(bf16) & set(fp4))
    ax_ratio.plot(shared, [fp4[s] / bf16[s] for s in shared], "o-", ms=3, color="C1",
                  label="FP4-trained / bf16-trained, same step")
    cost = flow[rows[1]] / flow[rows[0]]
    ax_ratio.axhline(cost, color="C3", ls="--", label=f"bf16-trained run in FP4 / in bf16: {cost:.3f} (quality table)")
    ax_ratio.axhline(1.0, color="grey", lw=0.8)
    ax_ratio.set(title="the cost of FP4 attention", xlabel="step", ylabel="loss ratio")
    labels = {rows[0]: "bf16-trained, bf16", rows[1]: "bf16-trained, FP4", rows[2]: "FP4-trained, FP4"}
    for r in rows:
        frames = table["rows"][r]["flow_loss_frames"]
        ax_frames.plot(range(len(frames)), frames, "o-", ms=3, label=f"{labels[r]} (mean {flow[r]:.4f})")
    ax_frames.set(title="quality table: flow loss per latent frame", xlabel="latent frame")
    for ax in (ax_eval, ax_ratio, ax_frames):
        ax.legend(fontsize=8)
    save_figure(fig, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
