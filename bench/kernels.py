"""Kernel benchmark: attn_qat (inference forward, training forward, forward+backward) beside cuDNN and
flash SDPA in the same run, at Wan 2.1 14B's attention shape (1, 40, L, 128).

    python bench/kernels.py                      # L = 8192, 32760; writes docs/benchmarks.md + JSON
    python bench/kernels.py --lengths 8192 --no-write
    python bench/kernels.py --sweep              # also time the forward/backward launch-config grid

Times are medians of ``triton.testing.do_bench``; TFLOP/s count 4*B*H*Lq*Lk*D for a forward and
2.5x that for a backward (five matmuls instead of two), as FlashAttention does.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from bench._report import ROOT, bench_ms, env_line, environment, update_section, write_json  # noqa: E402
from attnqat.kernels import attention, backend_info, hopper_gluon  # noqa: E402
from attnqat.kernels.hopper_gluon import GLUON_ENV  # noqa: E402
from attnqat.kernels._common import LaunchConfig  # noqa: E402
from attnqat.kernels.attn_qat import attn_qat_attention, attn_qat_backward, attn_qat_forward  # noqa: E402


#: attn_qat's options timed in their own columns: the column's name -> the option set True
OPTION_COLUMNS = {"qs": "q_smoothing", "fos": "four_over_six"}


def sdpa_fns(backend, q, k, v, do):
    def fwd():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v)

    def fwd_bwd():
        with sdpa_kernel(backend):
            o = F.scaled_dot_product_attention(q, k, v)
        o.backward(do)

    return fwd, fwd_bwd


def attn_qat_fns(q, k, v, do, fwd_cfg=None, bwd_cfg=None):
    scale = q.shape[-1] ** -0.5

    gluon = fwd_cfg is None and q.is_cuda and hopper_gluon.gluon_sm90(q.device)[0]

    def infer():  # what a user runs (the Gluon forward on sm_90), or the Triton forward at a swept config
        if fwd_cfg is None:
            with torch.no_grad():
                return attention(q, k, v, mode="attn_qat")
        return attn_qat_forward(q, k, v, sm_scale=scale, causal=False, training=False, config=fwd_cfg)

    def train_fwd():  # likewise: the training forward attention(mode="attn_qat") runs
        if gluon:
            return hopper_gluon.attn_qat_fwd_sm90(q, k, v, scale, False)
        return attn_qat_forward(q, k, v, sm_scale=scale, causal=False, training=True, config=fwd_cfg)

    saved = attn_qat_forward(q, k, v, sm_scale=scale, causal=False, training=True, config=fwd_cfg)

    def bwd():
        o, o_aux, m, l, (qf, kf, vf) = saved
        return attn_qat_backward(do, q, k, qf, kf, vf, o_aux, m, l, sm_scale=scale, causal=False, config=bwd_cfg)

    def fwd_bwd():  # what a user runs: on sm_90 with Gluon, the Gluon forward and backward
        attention(q, k, v, mode="attn_qat").backward(do)

    def fwd_bwd_triton():  # the portable pair, the Triton forward and backward
        attn_qat_attention(q, k, v).backward(do)

    return infer, train_fwd, bwd, fwd_bwd, fwd_bwd_triton


def run(lengths, heads=40, head_dim=128, batch=1, sweep=False):
    rows, sweeps = [], []
    for L in lengths:
        torch.manual_seed(0)
        q, k, v = (torch.randn(batch, heads, L, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        do = torch.randn_like(q)
        flops_f = 4.0 * batch * heads * L * L * head_dim
        res = {"L": L, "shape": [batch, heads, L, head_dim]}
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            f, fb = sdpa_fns(backend, q, k, v, do)
            res[f"{name}_fwd"] = bench_ms(f)
            res[f"{name}_fwdbwd"] = bench_ms(fb)
        infer, train_fwd, bwd, fwd_bwd, fwd_bwd_triton = attn_qat_fns(q, k, v, do)
        res["attn_qat_infer"] = bench_ms(infer)
        res["attn_qat_train_fwd"] = bench_ms(train_fwd)
        res["attn_qat_bwd"] = bench_ms(bwd)
        res["attn_qat_fwdbwd"] = bench_ms(fwd_bwd)
        res["attn_qat_triton_fwdbwd"] = bench_ms(fwd_bwd_triton)
        for mode in ("nvfp4", "sage3", "sagebwd"):  # every mode's inference forward, through the public API
            def infer_mode(mode=mode):
                with torch.no_grad():
                    return attention(q, k, v, mode=mode)
            res[f"{mode}_infer"] = bench_ms(infer_mode)

        for name, option in OPTION_COLUMNS.items():  # attn_qat with one of its options (docs/kernels.md)
            def option_infer(option=option):
                with torch.no_grad():
                    return attention(q, k, v, mode="attn_qat", **{option: True})
            res[f"attn_qat_{name}_infer"] = bench_ms(option_infer)

            def option_fwd_bwd(option=option):
                attention(q, k, v, mode="attn_qat", **{option: True}).backward(do)
            res[f"attn_qat_{name}_fwdbwd"] = bench_ms(option_fwd_bwd)

        def sagebwd_fwd_bwd():
            attention(q, k, v, mode="sagebwd").backward(do)
        res["sagebwd_fwdbwd"] = bench_ms(sagebwd_fwd_bwd)

        def sagebwd_triton_fwd_bwd():  # the portable Triton kernels, where the Gluon sm_90 ones would run
            before = os.environ.get(GLUON_ENV)
            os.environ[GLUON_ENV] = "0"
            try:
                attention(q, k, v, mode="sagebwd").backward(do)
            finally:
                if before is None:
                    os.environ.pop(GLUON_ENV)
                else:
                    os.environ[GLUON_ENV] = before
        res["sagebwd_triton_fwdbwd"] = bench_ms(sagebwd_triton_fwd_bwd)

        def sagebwd_16bit_fwd_bwd():  # INT8 QK^T and S recompute only; PV, dV, dQ, dK in bf16 (docs/sagebwd.md)
            attention(q, k, v, mode="sagebwd", pv="bf16", bwd="bf16").backward(do)
        res["sagebwd_16bit_fwdbwd"] = bench_ms(sagebwd_16bit_fwd_bwd)
        res["tflops"] = {k_: (flops_f * (3.5 if "fwdbwd" in k_ else 2.5 if k_.endswith("_bwd") else 1.0)) / (ms * 1e9)
                         for k_, ms in res.items() if isinstance(ms, float)}
        rows.append(res)
        print(f"L={L}: " + ", ".join(f"{k_} {v_:.2f} ms" for k_, v_ in res.items() if isinstance(v_, float)), flush=True)
        if sweep:
            sweeps += sweep_configs(q, k, v, do, L)
        del q, k, v, do
        torch.cuda.empty_cache()
    return rows, sweeps


def sweep_configs(q, k, v, do, L):
    out = []
    for bm, bn, w, s in [(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3),
                         (128, 64, 8, 2), (64, 128, 4, 3), (256, 64, 8, 2)]:
        cfg = LaunchConfig(bm, bn, w, s)
        infer, train_fwd, *_ = attn_qat_fns(q, k, v, do, fwd_cfg=cfg)
        try:
            r = {"L": L, "kind": "fwd", "config": [bm, bn, w, s], "infer": bench_ms(infer, 5, 20),
                 "train_fwd": bench_ms(train_fwd, 5, 20)}
        except Exception as e:  # out of resources for this shape: record and move on
            r = {"L": L, "kind": "fwd", "config": [bm, bn, w, s], "error": str(e).splitlines()[0][:120]}
        print("sweep", r, flush=True)
        out.append(r)
    for bm, bn, w, s in [(64, 64, 4, 3), (32, 128, 4, 3), (64, 128, 8, 3), (128, 64, 8, 3), (64, 64, 8, 2),
                         (32, 64, 4, 3), (128, 128, 8, 2)]:
        cfg = LaunchConfig(bm, bn, w, s)
        _, _, bwd, *_ = attn_qat_fns(q, k, v, do, bwd_cfg=cfg)
        try:
            r = {"L": L, "kind": "bwd", "config": [bm, bn, w, s], "bwd": bench_ms(bwd, 5, 20)}
        except Exception as e:
            r = {"L": L, "kind": "bwd", "config": [bm, bn, w, s], "error": str(e).splitlines()[0][:120]}
        print("sweep", r, flush=True)
        out.append(r)
    return out


def markdown(rows, env) -> str:
    lines = ["## Kernels: Attn-QAT vs SDPA (bf16, B=1, H=40, D=128, non-causal)", "", env_line(env), "",
             f"`attention(mode=\"attn_qat\")` trained in this run with: {env.get('attn_qat_training', 'triton')}; "
             f"its inference forward (and nvfp4's) ran: {env.get('fp4_inference', 'triton')}; "
             "\"inference fwd\" and \"training fwd\": those forwards (with their phi pre-pass); \"all Triton\": the "
             "Triton forward and backward.", "",
             "| L | cuDNN fwd | flash fwd | attn_qat inference fwd | attn_qat training fwd | cuDNN fwd+bwd | "
             "flash fwd+bwd | attn_qat fwd+bwd | attn_qat fwd+bwd, all Triton |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c, cb = r["cudnn_fwd"], r["cudnn_fwdbwd"]
        lines.append(
            f"| {r['L']} | {c:.2f} ms | {r['flash_fwd']:.2f} ms ({r['flash_fwd'] / c:.2f}x) | "
            f"{r['attn_qat_infer']:.2f} ms ({r['attn_qat_infer'] / c:.2f}x) | "
            f"{r['attn_qat_train_fwd']:.2f} ms ({r['attn_qat_train_fwd'] / c:.2f}x) | {cb:.2f} ms | "
            f"{r['flash_fwdbwd']:.2f} ms ({r['flash_fwdbwd'] / cb:.2f}x) | "
            f"{r['attn_qat_fwdbwd']:.2f} ms ({r['attn_qat_fwdbwd'] / cb:.2f}x) | "
            f"{r['attn_qat_triton_fwdbwd']:.2f} ms ({r['attn_qat_triton_fwdbwd'] / cb:.2f}x) |")
    options = [f"attn_qat_{name}_{kind}" for name in OPTION_COLUMNS for kind in ("infer", "fwdbwd")]
    extra = [k_ for k_ in ("nvfp4_infer", "sage3_infer", *options, "sagebwd_infer", "sagebwd_fwdbwd",
                           "sagebwd_triton_fwdbwd", "sagebwd_16bit_fwdbwd") if k_ in rows[0]]
    if extra:
        lines += ["", "Every mode's inference forward (no grad) through `attnqat.kernels.attention`, and SageBwd "
                  "training, same run (ratio to cuDNN fwd, or cuDNN fwd+bwd for `*_fwdbwd`; SageBwd ran: "
                  f"{env.get('sagebwd', 'triton')}; `sagebwd_triton`: its Triton kernels (`ATTNQAT_GLUON=0`); "
                  "`sagebwd_16bit`: `pv=\"bf16\", bwd=\"bf16\"`, INT8 only in QK^T and its recompute; `attn_qat_qs`: "
                  "`attn_qat` with `q_smoothing=True`, the Triton kernels with ΔS; `attn_qat_fos`: with "
                  "`four_over_six=True`, the kernels of plain `attn_qat` after a pre-pass that quantizes twice):", "",
                  "| L | " + " | ".join(extra) + " |", "|---|" + "---|" * len(extra)]
        for r in rows:
            cells = [f"{r[k_]:.2f} ms ({r[k_] / (r['cudnn_fwdbwd'] if k_.endswith('fwdbwd') else r['cudnn_fwd']):.2f}x)"
                     for k_ in extra]
            lines.append(f"| {r['L']} | " + " | ".join(cells) + " |")
    lines += ["", "TFLOP/s (4·B·H·L²·D per forward, 2.5x that per backward):", "",
              "| L | " + " | ".join(rows[0]["tflops"]) + " |", "|---|" + "---|" * len(rows[0]["tflops"])]
    for r in rows:
        lines.append(f"| {r['L']} | " + " | ".join(f"{t:.0f}" for t in r["tflops"].values()) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 32760])
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--sweep", action="store_true", help="also time a grid of launch configs")
    ap.add_argument("--no-write", action="store_true", help="print only; leave docs/ alone")
    ap.add_argument("--json", type=pathlib.Path, default=ROOT / "docs" / "bench_kernels.json")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench/kernels.py needs a CUDA GPU")
    env = environment()
    info = backend_info()
    env.update({key: info[key] for key in ("attn_qat_training", "fp4_inference", "sagebwd") if key in info})
    rows, sweeps = run(args.lengths, heads=args.heads, sweep=args.sweep)
    md = markdown(rows, env)
    print(md)
    if not args.no_write:
        update_section("kernels", md)
        write_json(args.json, {"env": env, "rows": rows, "sweep": sweeps})


if __name__ == "__main__":
    main()
