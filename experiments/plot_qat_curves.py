"""Training curves of QAT fine-tunes side by side: training loss, gradient norm (before clipping) and the
held-out FP4 flow loss of each run's log.csv (what `attnqat train` writes), as one picture.

    python experiments/plot_qat_curves.py flow=runs/mini_qat/flow/log.csv dropin=runs/mini_qat/dropin/log.csv ... \
        --fp4 0.0740 --bf16 0.0676 --out docs/qat_curves.png

--fp4 / --bf16: the held-out flow loss of the base model in FP4 and in bf16 attention (drawn as the two
ends of the gap on the held-out panel). A run trained in bf16 attention (the control) evaluates in bf16: its
held-out curve is drawn dashed.
"""
from __future__ import annotations

import argparse
import csv
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from experiments._plot import save_figure  # noqa: E402


def read_log(path: pathlib.Path) -> dict[str, list]:
    """The columns of an `attnqat train` log.csv: step, loss, grad_norm (every logged step) and the held-out
    rows (step, eval_flow) where the run evaluated."""
    rows = list(csv.DictReader(path.open()))
    train = [r for r in rows if r.get("loss")]
    held = [r for r in rows if r.get("eval_flow")]
    return {"step": [int(r["step"]) for r in train], "loss": [float(r["loss"]) for r in train],
            "grad_norm": [float(r["grad_norm"]) for r in train],
            "eval_step": [int(r["step"]) for r in held], "eval_flow": [float(r["eval_flow"]) for r in held]}


def smooth(values: list[float], k: int = 5) -> list[float]:
    """Trailing mean over k logged steps (the per-step loss jumps with the batch's noise levels)."""
    return [sum(values[max(0, i - k + 1):i + 1]) / len(values[max(0, i - k + 1):i + 1]) for i in range(len(values))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", metavar="LABEL=LOG_CSV")
    p.add_argument("--fp4", type=float, help="held-out flow loss of the base model in FP4 attention (step 0)")
    p.add_argument("--bf16", type=float, help="held-out flow loss of the base model in bf16 attention")
    p.add_argument("--bf16-runs", default="", help="comma-separated labels of runs trained in bf16 attention")
    p.add_argument("--out", type=pathlib.Path, required=True)
    args = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bf16_runs = set(filter(None, args.bf16_runs.split(",")))
    # the held-out panel shows the gap between the two ends; a run far outside it (a diverging one) is named
    # with its values instead of squashing every other curve
    top = None if None in (args.fp4, args.bf16) else args.fp4 + 0.6 * (args.fp4 - args.bf16)
    fig, (ax_loss, ax_gn, ax_eval) = plt.subplots(1, 3, figsize=(15, 4.2))
    for item in args.runs:
        label, _, path = item.partition("=")
        log = read_log(pathlib.Path(path))
        line, = ax_loss.plot(log["step"], smooth(log["loss"]), label=label, lw=1.2)
        ax_gn.plot(log["step"], log["grad_norm"], color=line.get_color(), lw=0.9, label=label)
        start = [0] if args.fp4 is not None and label not in bf16_runs else []
        first = [args.fp4] if start else []
        off = [f"{v:.3f}" for v in log["eval_flow"] if top is not None and v > top]
        name = label + (" (scored in bf16)" if label in bf16_runs else "") + (
            f" (off scale: {', '.join(off)})" if off else "")
        ax_eval.plot(start + log["eval_step"], first + log["eval_flow"], "o" + ("--" if label in bf16_runs else "-"),
                     color=line.get_color(), label=name)
    for value, name in ((args.fp4, "base, FP4"), (args.bf16, "base, bf16")):
        if value is not None:
            ax_eval.axhline(value, color="grey", lw=0.8, ls=":")
            ax_eval.annotate(name, (0, value), textcoords="offset points", xytext=(4, 3), fontsize=8, color="grey")
    ax_loss.set(title="training loss (mean of 5 logged steps)", xlabel="step", yscale="log")
    ax_gn.set(title="gradient norm before clipping (clip 1.0)", xlabel="step", yscale="log")
    ax_eval.set(title="held-out flow loss (32 clips, training's eval)", xlabel="step")
    if top is not None:
        ax_eval.set_ylim(args.bf16 - 0.4 * (args.fp4 - args.bf16), top)
    ax_gn.legend(fontsize=8)
    ax_eval.legend(fontsize=7)
    save_figure(fig, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
