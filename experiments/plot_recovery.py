"""How much of FP4's cost training gives back on mini, against the ceiling (docs/quality.md): one picture.

    B=bench/results
    python experiments/plot_recovery.py \
      --curve "width 1 (9.1M)=$B/ceiling/equal_step/width1_bf16_log.csv,$B/ceiling/equal_step/width1_attn_qat_log.csv" \
      --curve "width 2 (36M)=$B/ceiling/equal_step/width2_bf16_log.csv,$B/ceiling/equal_step/width2_attn_qat_log.csv" \
      --curve "width 1 rerun, the FP4 run rotated=$B/ceiling/rotation/bf16_log.csv,$B/ceiling/rotation/attn_qat_hadamard_log.csv" \
      --frames "ceiling, width 1, step 4,500=$B/ceiling/equal_step/width1_quality_33x256x256.json:s_fp4" \
      --frames "ceiling, width 2, step 3,000=$B/ceiling/equal_step/width2_quality_33x256x256.json:s_fp4" \
      --frames "ceiling with the rotation, width 1, step 3,000=$B/ceiling/rotation/quality_33x256x256.json:s_fp4" \
      --frames "rotation alone (no training)=$B/rotation/round2/quality_33x256x256.json:rot" \
      --frames "shipped QAT file + rotation=$B/rotation/round2/quality_33x256x256.json:shipped_rot" \
      --frames "QAT with rotation (rot_distill_5e-5)=$B/rotation/round2/quality_33x256x256.json:rot_distill_5e-5" \
      --out docs/recovery.png

Left (where --curve is given): the held-out flow loss of each --curve pair of `attnqat train` logs (a run trained in
bf16 attention, evaluated in bf16, and the same recipe trained in FP4, evaluated in FP4), as the training evaluated
them. Then one panel per video size of the --frames tables: the gap closed per latent frame, (FP4 - X) / (FP4 -
bf16) on the flow loss, of each --frames row of an `attnqat quality` table.json (each table's own references),
with --bar drawn across. Q smoothing's rows at two sizes (docs/quality.md, "Smoothing Q"):

    G=bench/results/q_smoothing/gpu
    python experiments/plot_recovery.py --out docs/q_smoothing.png \
      --frames "rotation alone=$G/qat_qs_vs_control_33x256x256.json:rot" ... \
      --frames "rotation alone=$G/qat_qs_vs_control_33x128x128.json:rot" ...
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from experiments._plot import save_figure  # noqa: E402
from experiments.plot_ceiling import held_out  # noqa: E402


def _pair(text: str, what: str) -> tuple[str, str]:
    if "=" not in text:
        raise SystemExit(f"{what} {text!r}: expected LABEL=VALUE")
    label, value = text.split("=", 1)
    return label, value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--curve", action="append", default=[], help="LABEL=BF16_LOG,FP4_LOG (log.csv files)")
    p.add_argument("--frames", action="append", default=[], help="LABEL=TABLE_JSON:ROW")
    p.add_argument("--bar", type=float, default=0.7, help="the share of the gap drawn across (default 0.7)")
    p.add_argument("--out", type=pathlib.Path, required=True)
    args = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    frames = []  # (label, size, row of its table), in the order given
    for text in args.frames:
        label, source = _pair(text, "--frames")
        path, row = source.rsplit(":", 1)
        table = json.loads(pathlib.Path(path).read_text())
        if row not in table["rows"]:
            raise SystemExit(f"--frames {text!r}: no row {row!r} in {path} (rows: {', '.join(table['rows'])})")
        frames.append((label, "x".join(map(str, table["size"])), table["rows"][row]))
    sizes = list(dict.fromkeys(size for _, size, _ in frames))
    panels = (1 if args.curve else 0) + len(sizes)
    if panels == 0:
        raise SystemExit("nothing to draw: give --curve or --frames")
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 6.2), squeeze=False)
    axes = list(axes[0])
    if args.curve:
        ax_eval = axes.pop(0)
        for i, text in enumerate(args.curve):
            label, logs = _pair(text, "--curve")
            bf16_log, fp4_log = logs.split(",")
            for path, style, kind in ((bf16_log, "-", "trained and evaluated in bf16"),
                                      (fp4_log, "--", "trained and evaluated in FP4")):
                curve = held_out(pathlib.Path(path))
                ax_eval.plot(list(curve), list(curve.values()), style, color=f"C{i}", label=f"{label}: {kind}")
        ax_eval.set(title="held-out flow loss (training's evaluation)", xlabel="step", yscale="log")
        ax_eval.legend(fontsize=8)
    colours = {label: f"C{i + 2}" for i, label in enumerate(dict.fromkeys(label for label, _, _ in frames))}
    for size, ax in zip(sizes, axes):  # a label keeps its colour in every panel
        for label, r in ((label, r) for label, s, r in frames if s == size):
            gap = r["gap_closed_loss_frames"]
            ax.plot(range(len(gap)), gap, "o-", ms=4, color=colours[label],
                    label=f"{label}: {r['gap_closed_loss']:.1%} overall")
        ax.axhline(args.bar, color="grey", ls=":", label=f"{args.bar:.0%}")
        ax.set(title=f"flow-loss gap closed per latent frame ({size})", xlabel="latent frame", ylim=(0, 1))
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13))  # below: the lines fill it
    save_figure(fig, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
