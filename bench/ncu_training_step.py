"""Nsight Compute profile of one training step (forward + backward) of an attention mode through ``attention()`` on a
GPU: what each kernel spends its time on (docs/kernels.md, "The Gluon sm_90 backward"; docs/sagebwd.md).

    ncu --profile-from-start off --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis \
        --section Occupancy python bench/ncu_training_step.py [--mode sagebwd] [--shape 1,40,8192,128] > ncu.txt

One untimed step first (compiles and caches the kernels), then the profiled step between cudaProfilerStart and
cudaProfilerStop, so ncu replays only that step's kernels: for attn_qat the pre-pass, the training forward, D =
rowsum(dO O'), the dK/dV kernel and the dQ kernel of whatever path ``attention(mode="attn_qat")`` dispatches here
(``backend_info()["attn_qat_training"]`` is printed first, whatever the mode); for sagebwd its pre-passes, forward and backward kernels
with the SPEC numerics (the mode's default options).
"""
from __future__ import annotations

import argparse
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from attnqat.kernels import attention, available_modes, backend_info  # noqa: E402
from bench._report import bhld_shape  # noqa: E402

TRAINABLE = available_modes(lambda m: m.trainable)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", type=bhld_shape, default=(1, 40, 8192, 128), help="B,H,L,D (default 1,40,8192,128)")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--mode", choices=TRAINABLE, default="attn_qat", help="the attention mode (default attn_qat)")
    args = p.parse_args(argv)
    b, h, length, d = args.shape
    if not torch.cuda.is_available():
        sys.exit("bench/ncu_training_step.py needs a CUDA GPU")
    print(f"mode {args.mode}; attn_qat training here:", backend_info()["attn_qat_training"], flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(b, h, length, d, device="cuda", generator=g).to(torch.bfloat16) for _ in range(4))

    def step():
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        attention(*leaves, mode=args.mode, causal=args.causal).backward(do)

    step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    step()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
