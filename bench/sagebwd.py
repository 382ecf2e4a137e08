"""SageBwd benchmark: forward and forward+backward beside cuDNN and flash SDPA in the same run.

    python bench/sagebwd.py                 # default shapes; writes docs/benchmarks_sagebwd.{md,json}
    python bench/sagebwd.py --quick         # one small shape, no files
    python bench/sagebwd.py --sweep         # also time a small launch-config grid (fwd, dK/dV, dQ)

``run_sagebwd_bench(...)`` returns one dict per (shape, implementation) for bench/kernels.py.
Times are medians of ``triton.testing.do_bench``. TFLOP/s count 4*B*H*Lq*Lk*D for a forward and
2.5x that for a backward (halved when causal), as FlashAttention does; SageBwd's INT8 matmuls are
counted as the same operations.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from attnqat.kernels import reference as R  # noqa: E402
from bench._report import bench_ms, environment  # noqa: E402
from attnqat.kernels.sagebwd import launch_configs, sagebwd_attention  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
# (batch, heads, seqlen, head_dim, causal): Wan 2.1 14B at 480p, and an LLM-like causal shape
DEFAULT_SHAPES = ((1, 40, 32760, 128, False), (4, 16, 8192, 128, True))
VARIANTS = ("int8", "fp8", "bf16")  # forward PV precision; everything else is the same kernel


def _fns(impl, q, k, v, do, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if impl in ("cudnn", "flash"):
        backend = SDPBackend.CUDNN_ATTENTION if impl == "cudnn" else SDPBackend.FLASH_ATTENTION

        def fwd():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    else:
        pv = impl.split("-", 1)[1]

        def fwd():
            return sagebwd_attention(q, k, v, causal=causal, pv=pv)

    def fwd_bwd():
        fwd().backward(do)

    return fwd, fwd_bwd


def run_sagebwd_bench(shapes=DEFAULT_SHAPES, variants=VARIANTS, warmup=25, rep=100) -> list[dict]:
    """Time cuDNN, flash and SageBwd (each ``pv`` variant) at each (B, H, L, D, causal).

    Return:
        rows: dicts with name, shape, causal, fwd_ms, fwdbwd_ms, fwd_tflops, fwdbwd_tflops,
        fwd_vs_cudnn, fwdbwd_vs_cudnn, fwdbwd_vs_flash (time ratios: < 1 is faster than the baseline).
    """
    rows = []
    for b, h, n, d, causal in shapes:
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        do = torch.randn_like(q)
        flops = 4.0 * b * h * n * n * d * (0.5 if causal else 1.0)
        base = {}
        for impl in ("cudnn", "flash", *(f"sagebwd-{p}" for p in variants)):
            f, fb = _fns(impl, q, k, v, do, causal)
            try:
                t_f = bench_ms(f, warmup, rep)
                t_fb = bench_ms(lambda: (fb(), setattr(q, "grad", None), setattr(k, "grad", None),
                                         setattr(v, "grad", None)), warmup, rep)
            except Exception as e:  # noqa: BLE001 - a failing variant is reported, the others still run
                print(f"{impl} {(b, h, n, d)} causal={causal}: FAILED {type(e).__name__}: {e}", flush=True)
                continue
            base.setdefault(impl, (t_f, t_fb))
            row = {"name": impl, "shape": [b, h, n, d], "causal": causal, "fwd_ms": t_f, "fwdbwd_ms": t_fb,
                   "fwd_tflops": flops / t_f * 1e-9, "fwdbwd_tflops": 3.5 * flops / t_fb * 1e-9}
            if "cudnn" in base:
                row["fwd_vs_cudnn"] = t_f / base["cudnn"][0]
                row["fwdbwd_vs_cudnn"] = t_fb / base["cudnn"][1]
            if "flash" in base:
                row["fwdbwd_vs_flash"] = t_fb / base["flash"][1]
            rows.append(row)
            print(_fmt_row(row), flush=True)
        del q, k, v, do
        torch.cuda.empty_cache()
    return rows


def sweep_configs(shape=(1, 40, 32760, 128, False), warmup=10, rep=30) -> list[dict]:
    """Time a small grid of pinned launch configs (env ATTNQAT_SAGEBWD_*_CONFIG) for each kernel."""
    b, h, n, d, causal = shape
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    grids = {
        "ATTNQAT_SAGEBWD_FWD_CONFIG": ["128,64,4,3", "128,32,4,3", "64,64,4,3"],
        "ATTNQAT_SAGEBWD_DKDV_CONFIG": ["32,128,4,2", "64,128,4,3", "64,64,4,3"],
        "ATTNQAT_SAGEBWD_DQ_CONFIG": ["128,32,4,2", "64,64,4,3", "128,64,4,3"],
    }
    out = []
    for env, cfgs in grids.items():
        for cfg in cfgs:
            os.environ[env] = cfg
            try:
                if env.endswith("FWD_CONFIG"):
                    t = bench_ms(lambda: sagebwd_attention(q, k, v, causal=causal), warmup, rep)
                else:  # the backward's tiles are fixed at forward time: time forward + backward
                    t = bench_ms(lambda: torch.autograd.grad(sagebwd_attention(q, k, v, causal=causal), (q, k, v), do),
                                 warmup, rep)
            except Exception as e:  # noqa: BLE001
                print(f"sweep {env}={cfg}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
                t = float("nan")
            finally:
                del os.environ[env]
            out.append({"env": env, "config": cfg, "ms": t, "shape": list(shape[:4]), "causal": causal,
                        "what": "fwd" if env.endswith("FWD_CONFIG") else "fwd+bwd"})
            print(f"sweep {env}={cfg}: {t:.3f} ms", flush=True)
    return out


def accuracy_inputs(dist: str, shape, device) -> tuple[torch.Tensor, ...]:
    """q, k, v, dO in bf16 for one input distribution: "gaussian", "student_t3" (raw, the stress case) or
    "student_t3_qknorm" (per-token RMSNorm on Q and K, as in Wan); K gets a shared per-channel offset, which
    K-smoothing removes. Seeded: every script that compares options sees the same inputs."""
    b, h, n, d = shape
    g = torch.Generator().manual_seed(1)
    if dist == "gaussian":
        q, k, v = (torch.randn(b, h, n, d, generator=g) for _ in range(3))
    else:
        torch.manual_seed(1)
        t = torch.distributions.StudentT(3.0)
        q, k, v = (t.sample((b, h, n, d)) for _ in range(3))
        if dist.endswith("qknorm"):
            q, k = (F.rms_norm(x, (d,)) for x in (q, k))
    k = k + 2.0 * torch.randn(d, generator=g)
    do = torch.randn(b, h, n, d, generator=g)
    return tuple(x.to(device, torch.bfloat16) for x in (q, k, v, do))


def accuracy(shapes=((1, 4, 2048, 128), (1, 4, 2048, 64)), device="cuda", variants=("int8",)) -> list[dict]:
    """Cos-sim of O, dQ, dK, dV against exact fp32 attention on Gaussian, Student-t(3) and
    Student-t(3) inputs with per-token RMSNorm on Q and K (QK-norm, as in Wan)."""
    rows = []
    for b, h, n, d in shapes:
        for dist in ("gaussian", "student_t3", "student_t3_qknorm"):
            for causal in (False, True):
                for pv in variants:
                    q, k, v, do = accuracy_inputs(dist, (b, h, n, d), device)
                    exact_o = R.attention_fp32(q, k, v, causal=causal)
                    exact = (exact_o, *R.attention_bwd_fp32(q, k, v, exact_o, do, causal=causal))
                    qq, kk, vv = (x.clone().requires_grad_(True) for x in (q, k, v))
                    if device == "cuda":
                        o = sagebwd_attention(qq, kk, vv, causal=causal, pv=pv)
                    else:  # the reference path (the kernel equals it: tests/test_sagebwd.py)
                        o = R.sagebwd_attention_ref(qq, kk, vv, causal=causal)
                    o.backward(do)
                    got = (o, qq.grad, kk.grad, vv.grad)
                    row = {"shape": [b, h, n, d], "dist": dist, "causal": causal, "pv": pv,
                           "path": "triton" if device == "cuda" else "reference"}
                    for name, x, e in zip(("o", "dq", "dk", "dv"), got, exact):
                        row[f"cos_{name}"] = F.cosine_similarity(x.float().flatten(), e.float().flatten(), dim=0).item()
                        row[f"relerr_{name}"] = ((x.float() - e).norm() / e.norm()).item()
                    rows.append(row)
                    print("accuracy", {kk_: (round(vv_, 5) if isinstance(vv_, float) else vv_) for kk_, vv_ in row.items()},
                          flush=True)
    return rows


def _fmt_row(r: dict) -> str:
    b, h, n, d = r["shape"]
    vs = lambda key: f"{r[key]:.2f}x" if key in r else "-"  # noqa: E731
    return (f"| {r['name']} | ({b}, {h}, {n}, {d}) | {'yes' if r['causal'] else 'no'} | {r['fwd_ms']:.2f} | "
            f"{r['fwdbwd_ms']:.2f} | {vs('fwd_vs_cudnn')} | {vs('fwdbwd_vs_cudnn')} | {vs('fwdbwd_vs_flash')} | "
            f"{r['fwdbwd_tflops']:.0f} |")


def to_markdown(env: dict, rows: list[dict], acc: list[dict], sweep: list[dict]) -> str:
    lines = ["# SageBwd benchmarks", "",
             f"Device: {env['device']}; torch {env['torch']}, triton {env['triton']}"
             + (f", CUDA {env['cuda']}" if env.get("cuda") else "") + f"; {env['date']}. "
             "Written by `bench/sagebwd.py`; medians of `triton.testing.do_bench`; ratios are time ratios "
             "to the baseline in the same run (< 1 is faster). bf16 inputs.", "",
             "`sagebwd-int8` is SPEC §4 (INT8 PV); `sagebwd-fp8` runs the forward PV in e4m3; `sagebwd-bf16` "
             "runs it in bf16 (P unquantized). All three share the INT8 QK^T and the same backward "
             "(INT8 S, dV, dQ, dK; bf16 dP).", "",
             "| impl | shape (B, H, L, D) | causal | fwd ms | fwd+bwd ms | fwd / cuDNN | fwd+bwd / cuDNN | "
             "fwd+bwd / flash | fwd+bwd TFLOP/s |", "|---|---|---|---|---|---|---|---|---|"]
    lines += [_fmt_row(r) for r in rows]
    if acc:
        lines += ["", "Accuracy: cos-sim vs exact fp32 attention (O and its gradients), bf16 inputs, K offset +2N(0,1) "
                  "per channel.", "", "| path | shape | inputs | causal | pv | O | dQ | dK | dV |",
                  "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {a['path']} | {tuple(a['shape'])} | {a['dist']} | {'yes' if a['causal'] else 'no'} | {a['pv']} | "
                  f"{a['cos_o']:.5f} | {a['cos_dq']:.5f} | {a['cos_dk']:.5f} | {a['cos_dv']:.5f} |" for a in acc]
    if sweep:
        lines += ["", "Launch-config sweep (ms):", "", "| kernel env | config | ms |", "|---|---|---|"]
        lines += [f"| {s['env']} | {s['config']} | {s['ms']:.3f} |" for s in sweep]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one small shape; write nothing")
    ap.add_argument("--sweep", action="store_true", help="also time a launch-config grid")
    ap.add_argument("--no-accuracy", action="store_true")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=str(ROOT / "docs"), help="folder for benchmarks_sagebwd.{md,json}")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/sagebwd.py needs a CUDA GPU")
    variants = tuple(args.variants.split(","))
    env = environment()
    print(env, {k: str(v) for k, v in launch_configs(128).items()}, flush=True)
    shapes = ((1, 8, 4096, 128, False),) if args.quick else DEFAULT_SHAPES
    rows = run_sagebwd_bench(shapes, variants)
    acc = [] if (args.quick or args.no_accuracy) else accuracy(variants=variants)
    sweep = sweep_configs() if args.sweep else []
    md = to_markdown(env, rows, acc, sweep)
    print(md)
    if not args.quick:
        out = pathlib.Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "benchmarks_sagebwd.md").write_text(md)
        (out / "benchmarks_sagebwd.json").write_text(json.dumps(
            {"env": env, "configs": {k: str(v) for k, v in launch_configs(128).items()},
             "rows": rows, "accuracy": acc, "sweep": sweep}, indent=1))


if __name__ == "__main__":
    main()
