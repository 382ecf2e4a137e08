"""Plot docs/bench_kernels.json (written by bench/kernels.py) as time ratios to cuDNN: docs/kernels.png.

    python bench/plot_kernels.py [--json docs/bench_kernels.json] [--out docs/kernels.png]
"""
import argparse
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]

FORWARD = [("flash_fwd", "flash SDPA"), ("attn_qat_infer", "nvfp4 / attn_qat (inference)"),
           ("sage3_infer", "sage3"), ("sagebwd_infer", "sagebwd"), ("attn_qat_train_fwd", "attn_qat (training fwd)")]
TRAINING = [("flash_fwdbwd", "flash SDPA"), ("attn_qat_fwdbwd", "attn_qat"),
            ("attn_qat_triton_fwdbwd", "attn_qat, all Triton"), ("sagebwd_fwdbwd", "sagebwd"),
            ("sagebwd_16bit_fwdbwd", "sagebwd (pv, bwd = bf16)")]


def main():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=pathlib.Path, default=ROOT / "docs" / "bench_kernels.json")
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / "docs" / "kernels.png")
    args = ap.parse_args()
    data = json.loads(args.json.read_text())
    env, rows = data["env"], data["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for ax, (title, keys, base) in zip(axes, (("forward", FORWARD, "cudnn_fwd"), ("forward + backward", TRAINING, "cudnn_fwdbwd"))):
        width = 0.8 / len(rows)
        for i, r in enumerate(rows):
            present = [(k, label) for k, label in keys if k in r]
            ratios = [r[k] / r[base] for k, _ in present]
            xs = [j + i * width for j in range(len(present))]
            bars = ax.bar(xs, ratios, width, label=f"L = {r['L']}")
            for x, v in zip(xs, ratios):
                ax.text(x, v + 0.04, f"{v:.2f}", ha="center", fontsize=7)
        ax.axhline(1.0, color="black", lw=0.8, ls="--")
        ax.set_xticks([j + width * (len(rows) - 1) / 2 for j in range(len(present))], [lbl for _, lbl in present],
                      rotation=15, fontsize=8)
        ax.set_ylabel(f"time / cuDNN SDPA ({title})")
        ax.set_title(f"{title}, (1, 40, L, 128) bf16")
        ax.legend(fontsize=8)
    fig.suptitle(f"{env['device']}; torch {env['torch']}, triton {env['triton']}; {env['date']} (lower is better; "
                 "dashed = cuDNN)", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
