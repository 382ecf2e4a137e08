"""Time the Gluon sm_90 forward's kernel layouts (``hopper_gluon.FWD_VARIANTS``: "default", one 8-warp consumer
partition; "ws", two independent consumer warpgroups; "pingpong", "ws" with alternating wgmma rounds) beside cuDNN in
the same run, and check that they agree bit for bit.

    python experiments/gluon_fwd_variants.py                         # (1, 40, 32760, 128), (1, 40, 8192, 128)
    python experiments/gluon_fwd_variants.py --shapes 1,40,8192,128 --causal --stages 2

Per shape and variant: the bf16 forward (``hopper_attention``), the FP4 inference forward (``hopper_fp4_attention``,
its phi pre-pass included) and its kernel alone on operands quantized once, the Attn-QAT training forward
(``hopper_attn_qat_forward``, pre-pass included) and the training step with the warp-specialised backward
(``hopper_attn_qat_backward(variant="ws")``), each as median ms (``triton.testing.do_bench``) and its ratio to cuDNN's
forward (forward+backward for the step). Then how many output elements of each variant differ from "default"'s
(the same per-row arithmetic in the same order: 0 expected). ``--stages`` overrides the ws variants' NUM_STAGES.
"""
from __future__ import annotations

import argparse
import pathlib
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from bench._report import bench_ms, bhld_shape, env_line, environment  # noqa: E402
from attnqat.kernels import hopper_gluon  # noqa: E402
from attnqat.kernels.nvfp4 import quantize_heads  # noqa: E402


def cudnn(q, k, v, causal):
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def run(shape, causal, variants):
    b, h, length, d = shape
    q, k, v = (torch.randn(b, h, length, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    do = torch.randn_like(q)
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    times = {"cudnn_fwd": bench_ms(lambda: cudnn(q, k, v, causal)),
             "cudnn_fwd_bwd": bench_ms(lambda: cudnn(qg, kg, vg, causal).backward(do))}
    outputs = {}
    qf = quantize_heads(q, q.dtype)
    for variant in variants:
        block_n = hopper_gluon._fwd_config(variant, d, training=False)[1]
        kf, vf = (quantize_heads(t, q.dtype, key_tile=block_n) for t in (k, v))

        def step(variant=variant):
            o, o_aux, m, l, (qf_, kf_, vf_) = hopper_gluon.hopper_attn_qat_forward(q, k, v, causal=causal,
                                                                                   variant=variant)
            return hopper_gluon.hopper_attn_qat_backward(do, q, k, qf_, kf_, vf_, o_aux, m, l, causal=causal,
                                                         variant="ws")

        fns = {"bf16": lambda: hopper_gluon.hopper_attention(q, k, v, causal=causal, variant=variant),
               "fp4": lambda: hopper_gluon.hopper_fp4_attention(q, k, v, causal=causal, variant=variant),
               "fp4_kernel": lambda: hopper_gluon._launch(qf, kf, vf, length, None, causal, fp4=True,
                                                          variant=variant),
               "train_fwd": lambda: hopper_gluon.hopper_attn_qat_forward(q, k, v, causal=causal, variant=variant)}
        with torch.no_grad():
            train = fns["train_fwd"]()
            outputs[variant] = {"bf16": fns["bf16"](), "fp4": fns["fp4"](), "train_o": train[0],
                                "train_aux": train[1], "train_m": train[2], "train_l": train[3]}
            for name, fn in fns.items():
                times[f"{variant}_{name}"] = bench_ms(fn)
        times[f"{variant}_step"] = bench_ms(step)
    for name, ms in times.items():
        base = "cudnn_fwd_bwd" if name.endswith(("step", "fwd_bwd")) else "cudnn_fwd"
        print(f"{str(shape):>22} causal={causal!s:<5} {name:>22}: {ms:8.2f} ms  {ms / times[base]:.3f}x {base}")
    ref = outputs.get("default")
    for variant, outs in outputs.items():
        if ref is None or variant == "default":
            continue
        differ = {name: (t != ref[name]).sum().item() for name, t in outs.items()}
        print(f"{str(shape):>22} causal={causal!s:<5} {variant}: elements differing from default's {differ}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", type=bhld_shape, default=[(1, 40, 32760, 128), (1, 40, 8192, 128)],
                        help="B,H,L,D (self-attention, Lq = Lk = L)")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--variants", nargs="+", default=list(hopper_gluon.FWD_VARIANTS),
                        choices=hopper_gluon.FWD_VARIANTS)
    parser.add_argument("--stages", type=int, default=None, help="NUM_STAGES of the ws variants (all head dims)")
    args = parser.parse_args(argv)
    ok, why = hopper_gluon.available()
    if not ok:
        sys.exit(f"gluon_fwd_variants: {why}")
    if args.stages:
        for config in (hopper_gluon.FWD_WS_CONFIG, hopper_gluon.FWD_TRAIN_WS_CONFIG):
            for d, (block_m, block_n, _) in config.items():
                config[d] = (block_m, block_n, args.stages)
    print(env_line(environment()))
    for shape in args.shapes:
        run(shape, args.causal, args.variants)


if __name__ == "__main__":
    main()
