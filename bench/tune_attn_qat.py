"""Price the pieces of the Attn-QAT kernels and sweep launch configs (one device run).

    python bench/tune_attn_qat.py [--L 32760] [--heads 40]
    python bench/tune_attn_qat.py --fused-dq      # the backward: two kernels vs dQ fused by atomics, per config

Prints the median time of: the forward with/without P quantization and O' per config; the backward
(with/without phi) per dK/dV config; the dQ kernel per config. The chosen
defaults in attnqat/kernels/attn_qat.py come from this table (docs/kernels.md records it).
"""
import argparse
import itertools
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from attnqat.kernels._common import LaunchConfig  # noqa: E402
from attnqat.kernels.attn_qat import attn_qat_backward, attn_qat_forward  # noqa: E402
from bench._report import bench_ms  # noqa: E402


def safe(fn):
    try:
        return round(bench_ms(fn, 5, 30), 2)
    except Exception as e:  # a config that does not fit: report it, keep going
        return "err: " + str(e).splitlines()[0][:60]


def record(res: dict, key: str, fn) -> None:
    """Time ``fn`` (:func:`safe`), keep it under ``key`` and print it as it comes."""
    res[key] = t = safe(fn)
    print(f"{key}: {t}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--L", type=int, default=32760)
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--json", type=pathlib.Path, default=None)
    ap.add_argument("--fused-dq", action="store_true",
                    help="only the backward: two kernels vs dQ fused into the dK/dV kernel (fp32 atomics), per config")
    ap.add_argument("--round2", action="store_true",
                    help="issue 15's candidates: more forward tiles (inference, D=128), dK/dV stages, dQ tiles")
    ap.add_argument("--forward", action="store_true",
                    help="only the forward: configs x head dims, inference and training, beside cuDNN SDPA")
    args = ap.parse_args()
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, args.heads, args.L, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    do = torch.randn_like(q)
    sc = 128 ** -0.5
    res = {}

    def saved():  # what the backward reads: the training forward's outputs
        return attn_qat_forward(q, k, v, sm_scale=sc, causal=False, training=True)

    if args.round2:
        round2_sweep(res, q, k, v, do, sc, saved())
    elif args.forward:
        forward_sweep(res, q, k, v, sc)
    elif args.fused_dq:  # only the backward, as its --help says
        fused_dq_sweep(res, q, k, v, do, sc, saved())
    else:
        for cfg in [(128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 64, 8, 4), (128, 32, 8, 3),
                    (64, 32, 4, 3), (128, 128, 8, 2)]:
            c = LaunchConfig(*cfg)
            for quant, train in itertools.product((True, False), (False, True)):
                record(res, f"fwd {cfg} quant={quant} train={train}", lambda: attn_qat_forward(
                    q, k, v, sm_scale=sc, causal=False, training=train, quant_p=quant, config=c))
        backward_sweep(res, q, k, v, do, sc, saved())
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))


def forward_sweep(res, q, k, v, sc):
    """Forward configs x head dims, inference and training, beside cuDNN SDPA."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        record(res, "cudnn fwd", lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
        q64, k64, v64 = (t[..., :64].contiguous() for t in (q, k, v))
        record(res, "cudnn fwd d=64", lambda: torch.nn.functional.scaled_dot_product_attention(q64, k64, v64))
    for cfg in [(64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (256, 64, 16, 3)]:
        c = LaunchConfig(*cfg)
        for d, train in ((128, False), (128, True), (64, False)):
            qd, kd, vd = (t[..., :d] for t in (q, k, v))
            record(res, f"fwd {cfg} d={d} train={train}", lambda: attn_qat_forward(
                qd, kd, vd, sm_scale=sc, causal=False, training=train, config=c))


def round2_sweep(res, q, k, v, do, sc, saved):
    """Tiles not in the first sweeps, beside cuDNN: the inference forward (the FP4 floor is 1.25x cuDNN), the
    dK/dV kernel's pipeline depth, and the dQ kernel's tiles (no phi there: SageBwd's 16-bit dQ liked 128x32)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    o, o_aux, m, l, (qf, kf, vf) = saved
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        record(res, "cudnn fwd", lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
    for cfg in [(128, 128, 8, 3), (128, 128, 8, 4), (128, 64, 4, 3), (128, 128, 4, 3), (64, 128, 4, 3),
                (128, 256, 8, 2), (256, 128, 16, 2), (128, 64, 8, 4)]:
        c = LaunchConfig(*cfg)
        record(res, f"fwd infer {cfg}", lambda: attn_qat_forward(q, k, v, sm_scale=sc, causal=False, training=False,
                                                                 config=c))
    dq_fixed = LaunchConfig(128, 64, 8, 3)
    for cfg in [(32, 64, 4, 3), (32, 64, 4, 4), (32, 64, 4, 2), (32, 128, 4, 4), (64, 64, 4, 4)]:
        c = LaunchConfig(*cfg)
        record(res, f"bwd dkdv={cfg}", lambda: attn_qat_backward(
            do, q, k, qf, kf, vf, o_aux, m, l, sm_scale=sc, causal=False, config=c, config_dq=dq_fixed))
    dkdv_fixed = LaunchConfig(32, 64, 4, 3)
    for cfg in [(128, 32, 4, 3), (128, 64, 4, 3), (128, 32, 8, 3), (64, 64, 4, 4), (128, 32, 4, 4)]:
        c = LaunchConfig(*cfg)
        record(res, f"bwd dq={cfg}", lambda: attn_qat_backward(
            do, q, k, qf, kf, vf, o_aux, m, l, sm_scale=sc, causal=False, config=dkdv_fixed, config_dq=c))


def fused_dq_sweep(res, q, k, v, do, sc, saved):
    """The route "one S recompute for dK, dV and dQ" of issue 15: two kernels vs FUSED_DQ per dK/dV config,
    beside cuDNN's fwd and fwd+bwd in the same run."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    o, o_aux, m, l, (qf, kf, vf) = saved
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        record(res, "cudnn fwd", lambda: torch.nn.functional.scaled_dot_product_attention(*leaves))
        record(res, "cudnn fwd+bwd", lambda: torch.nn.functional.scaled_dot_product_attention(*leaves).backward(do))
    for cfg, fused in itertools.product([(32, 64, 4, 3), (64, 64, 4, 3), (64, 128, 8, 3), (32, 128, 4, 3),
                                         (128, 64, 8, 3), (128, 128, 8, 2)], (False, True)):
        c = LaunchConfig(*cfg)
        record(res, f"bwd dkdv={cfg} fused_dq={fused}", lambda: attn_qat_backward(
            do, q, k, qf, kf, vf, o_aux, m, l, sm_scale=sc, causal=False, config=c, fused_dq=fused))


def backward_sweep(res, q, k, v, do, sc, saved):
    """dK/dV configs with and without phi (dQ kernel fixed), then dQ configs (dK/dV kernel fixed)."""
    o, o_aux, m, l, (qf, kf, vf) = saved
    dq_fixed = LaunchConfig(128, 64, 8, 3)
    for cfg in [(64, 128, 8, 3), (32, 128, 4, 3), (64, 128, 8, 2), (32, 128, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2),
                (32, 64, 4, 3)]:
        c = LaunchConfig(*cfg)
        for quant in (True, False):
            record(res, f"bwd dkdv={cfg} quant={quant}", lambda: attn_qat_backward(
                do, q, k, qf, kf, vf, o_aux, m, l, sm_scale=sc, causal=False, config=c, config_dq=dq_fixed,
                quant_p=quant))
    dkdv_fixed = LaunchConfig(64, 128, 8, 3)
    print(f"dQ configs, dK/dV kernel fixed at {tuple(dkdv_fixed.__dict__.values())}:", flush=True)
    for cfg in [(128, 64, 8, 3), (128, 32, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2), (128, 64, 4, 3), (64, 128, 8, 3)]:
        c = LaunchConfig(*cfg)
        record(res, f"bwd dq={cfg}", lambda: attn_qat_backward(
            do, q, k, qf, kf, vf, o_aux, m, l, sm_scale=sc, causal=False, config=dkdv_fixed, config_dq=c))


if __name__ == "__main__":
    main()
