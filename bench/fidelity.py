"""Output fidelity of every attention mode against exact fp32 attention.

    python bench/fidelity.py [--L 4096] [--heads 2] [--device cpu|cuda] [--no-write]

Two input families at (1, H, L, 128), bf16:
  (a) Gaussian q, k, v;
  (b) heavy-tailed, like real DiT activations: 4 K channels carry a large constant offset (shared by
      all tokens), 4 Q channels have 8x the magnitude, 2% of query rows are peaked (aligned with
      one key, so their softmax is nearly one-hot), V has Student-t(3) tails.
On CPU the modes run their PyTorch references (the same numerics as the kernels); on CUDA, the Triton
kernels. Reports relative L2 error and cosine similarity of O; writes a table to docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from attnqat.kernels import attention, available_modes  # noqa: E402
from attnqat.kernels.reference import attention_fp32  # noqa: E402
from bench._report import env_line, environment, update_section, write_json, ROOT  # noqa: E402

INFERENCE_MODES = ["bf16", "sage3", "nvfp4", "attn_qat", "sagebwd"]


def gaussian(L, heads, d, gen, device):
    return tuple(torch.randn(1, heads, L, d, generator=gen).to(device) for _ in range(3))


def heavy_tailed(L, heads, d, gen, device):
    q = torch.randn(1, heads, L, d, generator=gen)
    k = torch.randn(1, heads, L, d, generator=gen)
    v = torch.distributions.StudentT(3.0).sample((1, heads, L, d))
    ch = torch.randperm(d, generator=gen)[:8]
    k[..., ch[:4]] += 8.0  # shared offset: what K-smoothing removes
    q[..., ch[4:]] *= 8.0  # large-magnitude Q channels
    rows = torch.randperm(L, generator=gen)[: max(1, L // 50)]
    keys = torch.randint(0, L, (len(rows),), generator=gen)
    q[:, :, rows] = 3.0 * k[:, :, keys] / k[:, :, keys].norm(dim=-1, keepdim=True) * d ** 0.5  # peaked rows
    return q.to(device), k.to(device), v.to(device)


def measure(L=4096, heads=2, d=128, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # StudentT.sample draws from the global generator
    rows = []
    modes = [m for m in INFERENCE_MODES if m in available_modes()]
    for family, make in (("gaussian", gaussian), ("heavy-tailed", heavy_tailed)):
        q, k, v = make(L, heads, d, gen, device)
        exact = attention_fp32(q, k, v)
        qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
        for mode in modes:
            with torch.no_grad():
                out = attention(qb, kb, vb, mode=mode).float()
            err = ((out - exact).norm() / exact.norm()).item()
            cos = torch.nn.functional.cosine_similarity(out.flatten(), exact.flatten(), dim=0).item()
            rows.append({"inputs": family, "mode": mode, "rel_l2": err, "cos": cos})
            print(f"{family:12s} {mode:9s} rel-L2 {err:.4f}  cos {cos:.5f}", flush=True)
    return rows


def markdown(rows, env, L, heads):
    lines = [f"## Fidelity: attention output vs exact fp32 (1, {heads}, {L}, 128), bf16 inputs", "",
             env_line(env) + (" Modes ran their PyTorch references (same numerics as the kernels)."
                              if env["device"] == "CPU" else " Modes ran their Triton kernels."), "",
             "| mode | Gaussian rel-L2 | Gaussian cos | heavy-tailed rel-L2 | heavy-tailed cos |", "|---|---|---|---|---|"]
    by = {(r["inputs"], r["mode"]): r for r in rows}
    for mode in dict.fromkeys(r["mode"] for r in rows):
        g, h = by[("gaussian", mode)], by[("heavy-tailed", mode)]
        lines.append(f"| {mode} | {g['rel_l2']:.4f} | {g['cos']:.5f} | {h['rel_l2']:.4f} | {h['cos']:.5f} |")
    lines += ["", "Heavy-tailed: 4 K channels offset by +8, 4 Q channels x8, 2% peaked query rows, V ~ Student-t(3). "
              "`attn_qat` without grad is the `nvfp4` forward (QAT changes the weights, not the inference numerics)."]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--L", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    env = environment()
    if args.device == "cpu":
        env["device"] = "CPU"
    rows = measure(args.L, args.heads, device=args.device)
    md = markdown(rows, env, args.L, args.heads)
    print(md)
    if not args.no_write:
        update_section("fidelity", md)
        write_json(ROOT / "docs" / "bench_fidelity.json", {"env": env, "rows": rows})


if __name__ == "__main__":
    main()
