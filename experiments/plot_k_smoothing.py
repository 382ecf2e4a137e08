"""The picture of docs/quality.md's "Smoothing K before FP4 attention": the share of FP4's gap each row of
experiments/k_smoothing_gap.py (CPU) and of the GPU's ``attnqat quality`` tables closes, per clip size, on the
loss and the velocity.

    python experiments/plot_k_smoothing.py --tables bench/results/rotation/k_smoothing_17x128x128.json \
        bench/results/rotation/k_smoothing_33x128x128.json bench/results/rotation/k_smoothing_49x128x128.json \
        --quality-tables bench/results/rotation/k_smoothing_gpu/shipped_33x128x128.json \
        bench/results/rotation/k_smoothing_gpu/shipped_33x256x256.json --out docs/k_smoothing.png
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
# the same rows as `attnqat quality` names them in the GPU run (runs/ of bench/gpu_qat.sh's session; K-smoothing
# alone was not a row there)
QUALITY_ROWS = {"rot": "rot", "rot_ks": "ksmooth_rot", "shipped": "qat_rot", "shipped_ks": "qat_ksmooth_rot"}


def _columns(cpu_tables: list[dict], quality_tables: list[dict]) -> list[tuple[str, dict]]:
    """(x label, {ROWS key: row}) per table: CPU ones first, then the GPU's."""
    cols = [(f"{t['size']}\nCPU, {t['clips']} clips", t["rows"]) for t in cpu_tables]
    for t in quality_tables:
        size = "x".join(str(n) for n in t["size"])
        rows = {QUALITY_ROWS[k]: r for k, r in t["rows"].items() if k in QUALITY_ROWS}
        cols.append((f"{size}\n{t['device'].replace('NVIDIA ', '')}, {t['clips']} clips", rows))
    return cols


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tables", nargs="+", required=True, type=pathlib.Path, help="experiments/k_smoothing_gap.py JSONs")
    p.add_argument("--quality-tables", nargs="*", default=[], type=pathlib.Path,
                   help="attnqat quality JSONs with rows rot, rot_ks, shipped, shipped_ks")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("docs/k_smoothing.png"))
    args = p.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = _columns([json.loads(t.read_text()) for t in args.tables],
                    [json.loads(t.read_text()) for t in args.quality_tables])
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.6), sharey=True)
    width = 0.8 / len(ROWS)
    for ax, (metric, name) in zip(axes, (("gap_closed_loss", "flow loss"), ("gap_closed_velocity", "velocity"))):
        for i, (key, label) in enumerate(ROWS.items()):
            present = [(g, rows[key][metric]) for g, (_, rows) in enumerate(cols) if key in rows]
            xs = [g + (i - len(ROWS) / 2 + 0.5) * width for g, _ in present]
            ax.bar(xs, [100 * v for _, v in present], width, color=f"C{i}", label=label)
        ax.set_xticks(range(len(cols)), [label for label, _ in cols], fontsize=7)
        ax.axhline(0, color="black", lw=0.6)
        ax.set_title(f"share of FP4's {name} gap closed (held-out clips)", fontsize=9)
    axes[0].set_ylabel("%")
    axes[0].set_ylim(top=85)  # room for the legend above the bars
    axes[0].legend(fontsize=7, loc="upper left", ncol=2)
    save_figure(fig, args.out)


if __name__ == "__main__":
    main()
