"""Plot bench/multigpu.py's results (bench/results/multigpu/LAYOUT_NGPU.json) as speedups over one GPU:
docs/multigpu_scaling.png, one group of bars per layout, GPU count and resolution, one bar per mode, the ideal
(N) dashed and each bar's distance to the one-GPU output written under it (0: bitwise).

    python bench/plot_multigpu.py [--results bench/results/multigpu] [--out docs/multigpu_scaling.png]
"""
import argparse
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load(folder: pathlib.Path) -> list[dict]:
    """Every multigpu JSON in ``folder``: Ulysses first, then by GPU count."""
    runs = [json.loads(p.read_text()) for p in folder.glob("*gpu.json")]
    if not runs:
        raise SystemExit(f"plot_multigpu.py: error: no *gpu.json in {folder} (bench/multigpu.py writes them)")
    return sorted(runs, key=lambda run: (run["meta"]["parallel"] != "ulysses", run["meta"]["world"]))


def main(argv=None) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=pathlib.Path, default=ROOT / "bench" / "results" / "multigpu")
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / "docs" / "multigpu_scaling.png")
    args = ap.parse_args(argv)
    runs = load(args.results)
    groups = [(run["meta"], res, [r for r in run["results"] if r["resolution"] == res])
              for run in runs for res in dict.fromkeys(r["resolution"] for r in run["results"])]
    modes = list(dict.fromkeys(r["mode"] for _, _, rows in groups for r in rows))
    fig, ax = plt.subplots(figsize=(2.2 + 1.6 * len(groups), 4.2))
    width = 0.8 / len(modes)
    labelled = set()
    for g, (meta, res, rows) in enumerate(groups):
        ax.hlines(meta["world"], g - 0.45, g + 0.45, colors="black", linestyles="--", lw=0.8)
        for r in rows:
            x = g - 0.4 + width * (modes.index(r["mode"]) + 0.5)
            ax.bar(x, r["speedup"], width, color=f"C{modes.index(r['mode'])}",
                   label=None if r["mode"] in labelled else r["mode"])
            labelled.add(r["mode"])
            ax.text(x, r["speedup"] + 0.05, f"{r['speedup']:.2f}×", ha="center", fontsize=7)
            ax.text(x, 0.08, "0" if r["gap"] == 0 else f"{r['gap']:.0e}", ha="center", fontsize=6, rotation=90,
                    color="white")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{m['parallel']} {m['world']} GPUs\n{res}" for m, res, _ in groups])
    ax.set_ylabel("speedup over one GPU (dashed: ideal)")
    meta = runs[0]["meta"]
    ax.set_title(f"{meta['model']}, one denoising step: {meta['device']}, torch {meta['torch']}, {meta['date']}\n"
                 "(in each bar: the output's distance to one GPU's, 0 = bitwise)", fontsize=9)
    ax.set_ylim(0, max(m["world"] for m, _, _ in groups) * 1.18)
    ax.legend(fontsize=8, loc="upper center", ncol=len(modes))
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp.png")
    fig.savefig(tmp, dpi=120)
    tmp.replace(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
