"""What Four Over Six's scale search costs on the GPU, for each search the kernels' pre-pass has.

    python bench/four_over_six_search.py [--length 32760] [--heads 40]

For each entry of ``nvfp4.FOUR_OVER_SIX_SEARCHES`` (the option's 6 or 4, and the wider 6 down to 3 kept for
experiments): the pre-pass of one (1, heads, length, 128) bf16 tensor, the ``attn_qat`` inference forward and its
forward + backward with ``four_over_six=True``, and plain ``attn_qat``'s inference forward and cuDNN SDPA's forward
beside them, in ms and as ratios to cuDNN's (``triton.testing.do_bench``, one process, the same inputs). docs/quality.md ("Four Over Six") and
bench/results/four_over_six/gpu/search/ hold what it printed on an H200.
"""
from __future__ import annotations

import argparse
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from attnqat.kernels import attention, nvfp4


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", type=int, default=32760, help="tokens (default: Wan 14B at 480p x 81, 32760)")
    ap.add_argument("--heads", type=int, default=40, help="heads (default: Wan 14B's 40)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/four_over_six_search.py times the compiled kernels: it needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton.testing  # after the check: the numbers are the GPU's

    shape = (1, args.heads, args.length, 128)
    q, k, v, x = (torch.randn(shape, device="cuda").bfloat16() for _ in range(4))
    do = torch.randn_like(q)

    def forward():
        with torch.no_grad():
            attention(q, k, v, "attn_qat", four_over_six=True)

    def forward_backward():
        a, b, c = (t.detach().requires_grad_() for t in (q, k, v))
        attention(a, b, c, "attn_qat", four_over_six=True).backward(do)

    with torch.no_grad():
        plain = triton.testing.do_bench(lambda: attention(q, k, v, "attn_qat"))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):  # the ratios' denominator, as in bench/kernels.py
            cudnn = triton.testing.do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, shape {shape}; cuDNN SDPA forward "
          f"{cudnn:.2f} ms; plain attn_qat inference forward {plain:.2f} ms ({plain / cudnn:.3f}x)")
    default = nvfp4.four_over_six_tops
    try:
        for tops in nvfp4.FOUR_OVER_SIX_SEARCHES:
            nvfp4.four_over_six_tops = tops
            with torch.no_grad():
                pre = triton.testing.do_bench(lambda: nvfp4.quantize_heads(x, torch.bfloat16, four_over_six=True))
            infer = triton.testing.do_bench(forward)
            print(f"maxima {', '.join(f'{t:g}' for t in tops)}: pre-pass one tensor {pre:.2f} ms, inference forward "
                  f"{infer:.2f} ms ({infer / cudnn:.3f}x cuDNN), forward+backward "
                  f"{triton.testing.do_bench(forward_backward):.2f} ms")
    finally:
        nvfp4.four_over_six_tops = default
    return 0


if __name__ == "__main__":
    sys.exit(main())
