"""Time the Gluon sm_90 forward (attnqat/kernels/hopper_gluon.py) beside cuDNN and flash SDPA in the same run.

    python bench/gluon_hopper.py                         # Wan 14B's (1, 40, 32760, 128) and (1, 40, 8192, 128)
    python bench/gluon_hopper.py --shapes 1,40,8192,64 --causal

Prints one line per shape and kernel: median ms (``triton.testing.do_bench``), TFLOP/s (4*B*H*Lq*Lk*D, halved
when causal) and the ratio to cuDNN. Kernels: cuDNN and flash SDPA; ``gluon_sm90``, the bf16 Gluon forward;
``triton_fp4``, attn_qat's Triton FP4 inference forward (the ``nvfp4`` mode, its phi pre-pass included);
``gluon_fp4``, the Gluon FP4 inference forward (the same pre-pass, in tile order, included), and
``gluon_fp4_kernel``, its kernel alone on operands quantized once (the difference is the pre-pass). Then two sanity
checks: the bf16 Gluon output's relative error to cuDNN's, and the Gluon FP4 output's to the Triton FP4 one's
(same numerics: bf16 output rounding, ~3e-3). Nothing is written to docs: the kernels are not dispatched to yet.
"""
from __future__ import annotations

import argparse
import pathlib
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from bench._report import bench_ms, env_line, environment  # noqa: E402
from attnqat.kernels import hopper_gluon  # noqa: E402
from attnqat.kernels.attn_qat import nvfp4_attention  # noqa: E402
from attnqat.kernels.nvfp4 import quantize_heads  # noqa: E402


def sdpa(backend, q, k, v, causal):
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def rel_err(out, ref):
    out, ref = out.float(), ref.float()
    return ((out - ref).norm() / ref.norm()).item()


@torch.no_grad()
def run(shape, causal):
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
    err = rel_err(fns["gluon_sm90"](), fns["cudnn"]())
    err_fp4 = rel_err(fns["gluon_fp4"](), fns["triton_fp4"]())
    times = {name: bench_ms(fn) for name, fn in fns.items()}
    for name, ms in times.items():
        print(f"{str(shape):>22} causal={causal!s:<5} {name:>16}: {ms:8.2f} ms  {flops / ms / 1e9:6.0f} TFLOP/s  "
              f"{ms / times['cudnn']:.2f}x cuDNN")
    print(f"{str(shape):>22} gluon_sm90 vs cuDNN relative error {err:.2e}")
    print(f"{str(shape):>22} gluon_fp4 vs triton_fp4 relative error {err_fp4:.2e}; gluon_fp4 "
          f"{times['gluon_fp4'] / times['triton_fp4']:.2f}x triton_fp4's time")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["1,40,32760,128", "1,40,8192,128"],
                        help="B,H,L,D (self-attention, Lq = Lk = L)")
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args(argv)
    ok, why = hopper_gluon.available()
    if not ok:
        sys.exit(f"gluon_hopper: {why}")
    print(env_line(environment()))
    for shape in args.shapes:
        run(tuple(int(x) for x in shape.split(",")), args.causal)


if __name__ == "__main__":
    main()
