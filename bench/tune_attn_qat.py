"""Price the pieces of the Attn-QAT kernels and sweep launch configs (one device run).

    python bench/tune_attn_qat.py [--L 32760] [--heads 40]
    python bench/tune_attn_qat.py --fused-dq      # the backward: two kernels vs dQ fused by atomics, per config
    python bench/tune_attn_qat.py --bwd-phi       # the dK/dV kernel's phi: former vs from S, per layout and tile
    python bench/tune_attn_qat.py --head-dim-64 [--batch 32 --heads 4 --L 2304]   # mini's training shape

Prints the median time of: the forward with/without P quantization and O' per config; the backward
(with/without phi) per dK/dV config; the dQ kernel per config. The chosen
defaults in attnqat/kernels/attn_qat.py come from this table (docs/kernels.md records it).
"""
import argparse
import itertools
import json
import os
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from attnqat.kernels._common import LaunchConfig  # noqa: E402
from attnqat.kernels.attn_qat import BWD_CONFIG_GPU, attn_qat_backward, attn_qat_forward  # noqa: E402
from attnqat.outputs import write_file_atomically  # noqa: E402
from bench._report import bench_ms  # noqa: E402


def safe(fn, warmup=5, rep=30):
    """Median ms of ``fn`` (warm-up and repetitions in ms, as triton.testing.do_bench), or the error's first line."""
    try:
        return round(bench_ms(fn, warmup, rep), 2)
    except Exception as e:  # a config that does not fit: report it, keep going
        return "err: " + str(e).splitlines()[0][:60]


def record(res: dict, key: str, fn) -> None:
    """Time ``fn`` (:func:`safe`), keep it under ``key`` and print it as it comes."""
    res[key] = t = safe(fn)
    print(f"{key}: {t}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--L", type=int, default=None, help="sequence length (default 32760; --head-dim-64: 2304)")
    ap.add_argument("--heads", type=int, default=None, help="heads (default 40; --head-dim-64: 4)")
    ap.add_argument("--json", type=pathlib.Path, default=None)
    ap.add_argument("--fused-dq", action="store_true",
                    help="only the backward: two kernels vs dQ fused into the dK/dV kernel (fp32 atomics), per config")
    ap.add_argument("--round2", action="store_true",
                    help="a second round of candidates: more forward tiles (inference, D=128), dK/dV stages, dQ tiles")
    ap.add_argument("--forward", action="store_true",
                    help="only the forward: configs x head dims, inference and training, beside cuDNN SDPA")
    ap.add_argument("--bwd-phi", action="store_true",
                    help="only the backward: the dK/dV kernel's former phi vs phi from S, per layout and tile, with "
                         "QUANT_P=False beside, and cuDNN fwd+bwd; JSON to --json or $OUT/bwd_phi.json")
    ap.add_argument("--head-dim-64", action="store_true",
                    help="the training kernels at head_dim 64 (mini's, whose backward layout and tiles were never "
                         "timed) at --batch x --heads x --L (default mini's 33x256x256 step: 32 x 4 x 2304), every "
                         "forward, dK/dV (both layouts) and dQ tile beside cuDNN; JSON to --json or $OUT/d64.json")
    ap.add_argument("--batch", type=int, default=32, help="--head-dim-64: the batch")
    ap.add_argument("--budget", type=float, default=270.0,
                    help="--bwd-phi, --head-dim-64: seconds after which the rows not yet run are skipped (one GPU call < 5 min)")
    args = ap.parse_args()
    if args.bwd_phi and args.json is None and os.environ.get("OUT"):
        args.json = pathlib.Path(os.environ["OUT"]) / "bwd_phi.json"
    if args.head_dim_64:
        if args.json is None and os.environ.get("OUT"):
            args.json = pathlib.Path(os.environ["OUT"]) / "d64.json"
        res = head_dim_64_sweep(args.batch, args.heads or 4, args.L or 2304, time.monotonic() + args.budget)
        if args.json:
            write_file_atomically(args.json, lambda tmp: tmp.write_text(json.dumps(res, indent=1)))
        return
    torch.manual_seed(0)
    args.heads, args.L = args.heads or 40, args.L or 32760
    q, k, v = (torch.randn(1, args.heads, args.L, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    do = torch.randn_like(q)
    sc = 128 ** -0.5
    res = {}

    def saved():  # what the backward reads: the training forward's outputs
        return attn_qat_forward(q, k, v, sm_scale=sc, causal=False, training=True)

    if args.bwd_phi:
        bwd_phi_sweep(res, q, k, v, do, sc, saved(), args.json, time.monotonic() + args.budget)
    elif args.round2:
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
        write_file_atomically(args.json, lambda tmp: tmp.write_text(json.dumps(res, indent=1)))


def head_dim_64_sweep(batch: int, heads: int, length: int, deadline: float) -> dict:
    """The training kernels at head_dim 64 and one training shape: cuDNN's fwd and fwd+bwd, the training forward
    per tile, the whole backward per dK/dV layout and tile (dQ at its default), then per dQ tile (dK/dV at the
    best), each config once its tile compiles; rows past ``deadline`` are skipped."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from attnqat.kernels.attn_qat import bwd_config, bwd_transposed, dq_config
    torch.manual_seed(0)
    q, k, v = (torch.randn(batch, heads, length, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    do = torch.randn_like(q)
    sc = 64 ** -0.5
    tile = lambda c: [c.block_m, c.block_n, c.num_warps, c.num_stages]  # noqa: E731
    res = {"shape": [batch, heads, length, 64], "device": torch.cuda.get_device_name(),
           "default": {"dkdv_transposed": bwd_transposed(64), "dkdv": tile(bwd_config(64, bwd_transposed(64))),
                       "dq": tile(dq_config(64))}}

    def timed(key, fn):
        if time.monotonic() > deadline:
            res[key] = "skipped: budget"
            return
        record(res, key, fn)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        timed("cudnn fwd", lambda: torch.nn.functional.scaled_dot_product_attention(*leaves))
        timed("cudnn fwd+bwd", lambda: torch.nn.functional.scaled_dot_product_attention(*leaves).backward(do))
    # what training runs (attention() picks the kernels), then the Gluon sm_90 variants beside the Triton tiles
    from attnqat.kernels import attention, hopper_gluon
    timed("attention(attn_qat) fwd+bwd", lambda: attention(*leaves, mode="attn_qat").backward(do))
    if hopper_gluon.available(q.device)[0]:
        for variant in hopper_gluon.FWD_VARIANTS:
            timed(f"gluon fwd train {variant}",
                  lambda: hopper_gluon.hopper_attn_qat_forward(q, k, v, sm_scale=sc, variant=variant))
        o, o_aux, m, l, (qf, kf, vf) = hopper_gluon.hopper_attn_qat_forward(q, k, v, sm_scale=sc)
        for variant in hopper_gluon.BWD_VARIANTS:
            timed(f"gluon bwd {variant}", lambda: hopper_gluon.hopper_attn_qat_backward(
                do, q, k, qf, kf, vf, o_aux, m, l, sm_scale=sc, variant=variant))
    for cfg in [(128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 64, 4, 3), (64, 128, 4, 3), (64, 64, 4, 2),
                (128, 128, 8, 2), (64, 64, 4, 4)]:  # the forward orders keys in 64-blocks: BLOCK_N >= 64
        c = LaunchConfig(*cfg)
        timed(f"fwd train {cfg}", lambda: attn_qat_forward(q, k, v, sm_scale=sc, causal=False, training=True, config=c))
    o, o_aux, m, l, (qf, kf, vf) = attn_qat_forward(q, k, v, sm_scale=sc, causal=False, training=True)
    bwd = {}
    for transposed, cfgs in ((True, [(32, 64, 4, 4), (32, 64, 4, 3), (64, 64, 4, 3), (32, 128, 4, 3), (64, 64, 8, 3),
                                     (64, 128, 8, 2)]),
                             (False, [(128, 64, 8, 2), (64, 64, 4, 3), (128, 64, 8, 3), (64, 128, 8, 2),
                                      (128, 128, 8, 2), (64, 64, 4, 2)])):
        for cfg in cfgs:
            c = LaunchConfig(*cfg)
            key = f"bwd transposed={transposed} dkdv={cfg}"
            timed(key, lambda: attn_qat_backward(do, q, k, qf, kf, vf, o_aux, m, l, sm_scale=sc, causal=False,
                                                 config=c, transposed=transposed))
            if isinstance(res[key], float):
                bwd[(transposed, cfg)] = res[key]
    if bwd:
        transposed, cfg = min(bwd, key=bwd.get)
        best = LaunchConfig(*cfg)
        for dq in [(128, 64, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3), (128, 64, 4, 3), (128, 128, 8, 2),
                   (64, 32, 4, 3)]:
            c = LaunchConfig(*dq)
            timed(f"bwd transposed={transposed} dkdv={cfg} dq={dq}", lambda: attn_qat_backward(
                do, q, k, qf, kf, vf, o_aux, m, l, sm_scale=sc, causal=False, config=best, transposed=transposed,
                config_dq=c))
    return res


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
    """The route "one S recompute for dK, dV and dQ": two kernels vs FUSED_DQ per dK/dV config,
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


def bwd_phi_sweep(res, q, k, v, do, sc, saved, json_path, deadline):
    """The dK/dV kernel's phi(P) (attn_qat_backward's phi_from_s, transposed): the former fake_quant_tile on P~
    (transposed layout only) vs phi from S (block maxima of S, packed rounding) in both layouts, and QUANT_P=False
    to price phi, at each layout's default tile and nearby ones; the dQ kernel at its default. Beside each time,
    the relative error of dk and dv to the former phi at the default tile (bf16 outputs: ~1e-3 from the order of
    the fp32 sums where the tiles differ; a wrong store or mask would show as O(1)). The JSON is rewritten after
    every row, so a run cut short keeps what it measured."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    o, o_aux, m, l, (qf, kf, vf) = saved
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def keep(key, value):
        res[key] = value
        print(f"{key}: {value}", flush=True)
        if json_path:
            write_file_atomically(json_path, lambda tmp: tmp.write_text(json.dumps(res, indent=1)))

    def bwd(cfg, **kw):
        return attn_qat_backward(do, q, k, qf, kf, vf, o_aux, m, l, sm_scale=sc, causal=False,
                                 config=LaunchConfig(*cfg), **kw)

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        keep("cudnn fwd+bwd", safe(lambda: torch.nn.functional.scaled_dot_product_attention(*leaves).backward(do),
                                   100, 800))
    t_default = tuple(BWD_CONFIG_GPU[True][128].__dict__.values())
    u_default = tuple(BWD_CONFIG_GPU[False][128].__dict__.values())
    try:  # the reference of the rel_err columns
        base = bwd(t_default, transposed=True, phi_from_s=False)
    except Exception as e:
        keep("former phi at the default tile", "err: " + str(e).splitlines()[0][:80])
        base = None
    rows = [("former phi", t_default, dict(transposed=True, phi_from_s=False))]
    for tile in dict.fromkeys((t_default, (32, 64, 4, 3), (32, 64, 4, 4), (64, 64, 4, 3))):  # defaults first, once
        rows += [("phi from S", tile, dict(transposed=True)), ("no phi", tile, dict(transposed=True, quant_p=False))]
    for tile in dict.fromkeys((u_default, (128, 64, 8, 2), (64, 64, 4, 3), (128, 128, 8, 2))):
        rows += [("phi from S", tile, dict(transposed=False)), ("no phi", tile, dict(transposed=False, quant_p=False))]
    rows += [("former phi", tile, dict(transposed=True, phi_from_s=False))
             for tile in dict.fromkeys(((32, 64, 4, 3), (32, 64, 4, 4), (64, 64, 4, 3))) if tile != t_default]
    for name, tile, kw in rows:
        key = f"bwd {name} {'transposed' if kw['transposed'] else 'untransposed'} dkdv={tile}"
        if time.monotonic() > deadline:
            keep(key, "skipped: --budget spent")
            continue
        try:
            _, dk, dv = bwd(tile, **kw)
            errs = ([round(((a.double() - b.double()).norm() / b.double().norm()).item(), 5)
                     for a, b in ((dk, base[1]), (dv, base[2]))] if base and kw.get("quant_p", True) else None)
        except Exception as e:  # a config that does not compile or fit: report it, keep going
            keep(key, "err: " + str(e).splitlines()[0][:80])
            continue
        keep(key, {"ms": safe(lambda: bwd(tile, **kw), 100, 800), "rel_err_dk_dv": errs})  # ~4 runs of ~200 ms


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
