"""Time the Gluon sm_90 forward (attnqat/kernels/hopper_gluon.py) beside cuDNN and flash SDPA in the same run.

    python bench/gluon_hopper.py                         # Wan 14B's (1, 40, 32760, 128) and (1, 40, 8192, 128)
    python bench/gluon_hopper.py --shapes 1,40,8192,64 --causal

Prints one line per shape and kernel: median ms (``triton.testing.do_bench``), TFLOP/s (4*B*H*Lq*Lk*D, halved when
causal; forward+backward rows 3.5 times that: a backward is 2.5 forwards, as FlashAttention counts) and the ratio to
cuDNN's forward (forward rows) or cuDNN's forward+backward (``*_fwd_bwd`` rows). Kernels: cuDNN and flash SDPA;
``gluon_sm90``, the bf16 Gluon forward; ``triton_fp4``, attn_qat's Triton FP4 inference forward (the ``nvfp4`` mode,
its phi pre-pass included); ``gluon_fp4``, the Gluon FP4 inference forward (the same pre-pass, in tile order,
included), and ``gluon_fp4_kernel``, its kernel alone on operands quantized once (the difference is the pre-pass).
Training: ``triton_qat_fwd``, attn_qat's Triton training forward (O, O', m, l; pre-pass included);
``gluon_qat_fwd``, the Gluon training forward (its pre-pass, which writes phi(K), phi(V) in key and in tile order,
included) and ``gluon_qat_kernel`` its kernel alone; ``cudnn_fwd_bwd``, ``triton_qat_fwd_bwd`` (attn_qat's autograd,
Triton forward and backward), ``gluon_qat_fwd_bwd`` (the Gluon training forward, then attn_qat's Triton backward
on what it saves) and ``gluon_pair_fwd_bwd`` (the Gluon training forward, then the Gluon backward
``hopper_attn_qat_backward``), ``gluon_pair_ws_fwd_bwd`` (the same with its warp-specialised kernels,
``variant="ws"``) and ``triton_fwd_gluon_ws_bwd`` (attn_qat's Triton training forward, then that backward); backward
alone on one training forward's saved tensors, ``triton_qat_bwd`` (``attn_qat_backward``), ``gluon_qat_bwd`` and
``gluon_qat_bwd_ws`` (the D pre-pass included; TFLOP/s at 2.5 forwards, the ratio to cuDNN's forward+backward). Then
sanity checks: the bf16 Gluon output's relative error to cuDNN's, the Gluon FP4 output's to the Triton FP4 one's, the
Gluon training forward's O and O' to the Triton training forward's (same numerics: bf16 output rounding, ~3e-3), and
both Gluon backwards' dQ, dK, dV to the Triton backward's on the same saved tensors.
Nothing is written to docs. The Gluon rows run the "default" forward layout; `experiments/gluon_fwd_variants.py` times
the others (what `attention()` dispatches to: docs/kernels.md).
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
from attnqat.kernels.attn_qat import (attn_qat_attention, attn_qat_backward, attn_qat_forward,  # noqa: E402
                                     nvfp4_attention)
from attnqat.kernels.nvfp4 import quantize_heads  # noqa: E402


def sdpa(backend, q, k, v, causal):
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def rel_err(out, ref):
    out, ref = out.float(), ref.float()
    return ((out - ref).norm() / ref.norm()).item()


def training_fns(q, k, v, qf, causal, ws=True):
    """The training rows' functions (forward, and forward + backward on leaf copies of q, k, v); qf: phi(q). ws:
    include the rows of the backward's warp-specialised variant."""
    b, h, length, d = q.shape
    scale = d ** -0.5
    block_n = hopper_gluon.FWD_TRAIN_CONFIG[d][1]
    kt, vt = (quantize_heads(t, q.dtype, key_tile=block_n) for t in (k, v))
    out = torch.empty_like(q)
    aux, stats = torch.empty_like(q), tuple(torch.empty(b, h, length, device=q.device) for _ in range(2))  # O'; m, l
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    do = torch.randn_like(q)

    def cudnn_fwd_bwd():
        sdpa(SDPBackend.CUDNN_ATTENTION, qg, kg, vg, causal).backward(do)

    def triton_fwd_bwd():
        attn_qat_attention(qg, kg, vg, causal=causal).backward(do)

    def gluon_fwd_bwd():
        o, o_aux, m, l, (qf_, kf_, vf_) = hopper_gluon.hopper_attn_qat_forward(q, k, v, causal=causal)
        return attn_qat_backward(do, q, k, qf_, kf_, vf_, o_aux, m, l, sm_scale=scale, causal=causal)

    def gluon_pair_fwd_bwd(variant="default"):
        o, o_aux, m, l, (qf_, kf_, vf_) = hopper_gluon.hopper_attn_qat_forward(q, k, v, causal=causal)
        return hopper_gluon.hopper_attn_qat_backward(do, q, k, qf_, kf_, vf_, o_aux, m, l, causal=causal,
                                                     variant=variant)

    def triton_fwd_gluon_ws_bwd():
        o, o_aux, m, l, (qf_, kf_, vf_) = attn_qat_forward(q, k, v, sm_scale=scale, causal=causal, training=True)
        return hopper_gluon.hopper_attn_qat_backward(do, q, k, qf_, kf_, vf_, o_aux, m, l, causal=causal, variant="ws")

    # one training forward's saved tensors for the backward-only rows (both backwards read the same)
    _, o_aux, m, l, (qf_s, kf_s, vf_s) = attn_qat_forward(q, k, v, sm_scale=scale, causal=causal, training=True)
    bwd_args = (do, q, k, qf_s, kf_s, vf_s, o_aux, m, l)
    fwd = {"triton_qat_fwd": lambda: attn_qat_forward(q, k, v, sm_scale=scale, causal=causal, training=True),
           "gluon_qat_fwd": lambda: hopper_gluon.hopper_attn_qat_forward(q, k, v, causal=causal),
           "gluon_qat_kernel": lambda: hopper_gluon._launch(qf, kt, vt, length, None, causal, fp4=True, out=out,
                                                            aux=aux, stats=stats)}
    bwd = {"triton_qat_bwd": lambda: attn_qat_backward(*bwd_args, sm_scale=scale, causal=causal),
           "gluon_qat_bwd": lambda: hopper_gluon.hopper_attn_qat_backward(*bwd_args, causal=causal),
           "gluon_qat_bwd_ws": lambda: hopper_gluon.hopper_attn_qat_backward(*bwd_args, causal=causal, variant="ws")}
    fwd_bwd = {"cudnn_fwd_bwd": cudnn_fwd_bwd, "triton_qat_fwd_bwd": triton_fwd_bwd, "gluon_qat_fwd_bwd": gluon_fwd_bwd,
               "gluon_pair_fwd_bwd": gluon_pair_fwd_bwd, "gluon_pair_ws_fwd_bwd": lambda: gluon_pair_fwd_bwd("ws"),
               "triton_fwd_gluon_ws_bwd": triton_fwd_gluon_ws_bwd}
    if not ws:
        for rows in (bwd, fwd_bwd):
            for name in [name for name in rows if "_ws" in name]:
                del rows[name]
    return fwd, bwd, fwd_bwd


def run(shape, causal, ws=True):
    b, h, length, d = shape
    q, k, v = (torch.randn(b, h, length, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    flops = 4 * b * h * length * length * d / (2 if causal else 1)
    block_n = hopper_gluon.FWD_CONFIG[d][1]
    qf = quantize_heads(q, q.dtype)
    kf, vf = (quantize_heads(t, q.dtype, key_tile=block_n) for t in (k, v))
    fns = {"cudnn": lambda: sdpa(SDPBackend.CUDNN_ATTENTION, q, k, v, causal),
           "flash": lambda: sdpa(SDPBackend.FLASH_ATTENTION, q, k, v, causal),
           "gluon_sm90": lambda: hopper_gluon.hopper_attention(q, k, v, causal=causal),
           "triton_fp4": lambda: nvfp4_attention(q, k, v, causal=causal),
           "gluon_fp4": lambda: hopper_gluon.hopper_fp4_attention(q, k, v, causal=causal),
           "gluon_fp4_kernel": lambda: hopper_gluon._launch(qf, kf, vf, length, None, causal, fp4=True)}
    train, bwd, fwd_bwd = training_fns(q, k, v, qf, causal, ws)  # phi(q) is the same for both kernels' launches
    fns.update(train)
    with torch.no_grad():
        err = rel_err(fns["gluon_sm90"](), fns["cudnn"]())
        err_fp4 = rel_err(fns["gluon_fp4"](), fns["triton_fp4"]())
        gluon_train, triton_train = fns["gluon_qat_fwd"](), fns["triton_qat_fwd"]()
        err_o, err_aux = (rel_err(gluon_train[i], triton_train[i]) for i in (0, 1))
        del gluon_train, triton_train
        triton_grads, gluon_grads = bwd["triton_qat_bwd"](), bwd["gluon_qat_bwd"]()
        err_grads = [rel_err(g, t) for g, t in zip(gluon_grads, triton_grads)]
        if ws:
            ws_grads = bwd["gluon_qat_bwd_ws"]()
            err_grads_ws = [rel_err(g, t) for g, t in zip(ws_grads, triton_grads)]
            # the same chunks summed in the same order: bit-identical expected (0 elements differing)
            ws_differ = [(g != w).sum().item() for g, w in zip(gluon_grads, ws_grads)]
            del ws_grads
        del triton_grads, gluon_grads
        times = {name: bench_ms(fn) for name, fn in {**fns, **bwd}.items()}
    times.update({name: bench_ms(fn) for name, fn in fwd_bwd.items()})
    for name, ms in times.items():
        if name in fwd_bwd:
            base, work = "cudnn_fwd_bwd", 3.5 * flops
        elif name in bwd:  # beside cuDNN's forward+backward: the backward's share of the training step's budget
            base, work = "cudnn_fwd_bwd", 2.5 * flops
        else:
            base, work = "cudnn", flops
        print(f"{str(shape):>22} causal={causal!s:<5} {name:>18}: {ms:8.2f} ms  {work / ms / 1e9:6.0f} TFLOP/s  "
              f"{ms / times[base]:.2f}x {base}")
    print(f"{str(shape):>22} gluon_sm90 vs cuDNN relative error {err:.2e}")
    print(f"{str(shape):>22} gluon_fp4 vs triton_fp4 relative error {err_fp4:.2e}; gluon_fp4 "
          f"{times['gluon_fp4'] / times['triton_fp4']:.2f}x triton_fp4's time")
    print(f"{str(shape):>22} gluon_qat_fwd vs triton_qat_fwd relative error O {err_o:.2e}, O' {err_aux:.2e}; "
          f"gluon_qat_fwd {times['gluon_qat_fwd'] / times['triton_qat_fwd']:.2f}x triton_qat_fwd's time, "
          f"gluon_qat_fwd_bwd {times['gluon_qat_fwd_bwd'] / times['triton_qat_fwd_bwd']:.2f}x triton_qat_fwd_bwd's")
    print(f"{str(shape):>22} gluon_qat_bwd vs triton_qat_bwd relative error dQ {err_grads[0]:.2e}, dK {err_grads[1]:.2e}, "
          f"dV {err_grads[2]:.2e}; gluon_qat_bwd {times['gluon_qat_bwd'] / times['triton_qat_bwd']:.2f}x "
          f"triton_qat_bwd's time, gluon_pair_fwd_bwd {times['gluon_pair_fwd_bwd'] / times['triton_qat_fwd_bwd']:.2f}x "
          f"triton_qat_fwd_bwd's")
    if not ws:
        return
    print(f"{str(shape):>22} gluon_qat_bwd_ws vs triton_qat_bwd relative error dQ {err_grads_ws[0]:.2e}, dK "
          f"{err_grads_ws[1]:.2e}, dV {err_grads_ws[2]:.2e}; elements differing from gluon_qat_bwd's dQ, dK, dV "
          f"{ws_differ}; gluon_qat_bwd_ws "
          f"{times['gluon_qat_bwd_ws'] / times['gluon_qat_bwd']:.2f}x gluon_qat_bwd's time, "
          f"{times['gluon_qat_bwd_ws'] / times['triton_qat_bwd']:.2f}x triton_qat_bwd's; gluon_pair_ws_fwd_bwd "
          f"{times['gluon_pair_ws_fwd_bwd'] / times['cudnn_fwd_bwd']:.2f}x cudnn_fwd_bwd, triton_fwd_gluon_ws_bwd "
          f"{times['triton_fwd_gluon_ws_bwd'] / times['cudnn_fwd_bwd']:.2f}x")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", type=bhld_shape, default=[(1, 40, 32760, 128), (1, 40, 8192, 128)],
                        help="B,H,L,D (self-attention, Lq = Lk = L)")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--no-ws", action="store_true", help="leave out the warp-specialised backward's rows")
    args = parser.parse_args(argv)
    ok, why = hopper_gluon.available()
    if not ok:
        sys.exit(f"gluon_hopper: {why}")
    print(env_line(environment()))
    for shape in args.shapes:
        run(shape, args.causal, ws=not args.no_ws)


if __name__ == "__main__":
    main()
