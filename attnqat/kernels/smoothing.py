"""Token means for K and Q smoothing (sage3's K_s = K - mean_tokens(K); sagebwd's smooth_k / smooth_q), and
Q smoothing's per-key bias (mean(Q) . K_s,j).

One Triton kernel rather than ``x.mean(dim=2, dtype=torch.float32)``: on a GPU, torch splits a long reduction over
more thread blocks when there are fewer outputs, so a head's mean depended on how many heads the tensor held. Under
Ulysses each rank holds H / N heads, and sage3's 14B step at 480p on 4 H200s came out 1e-2 (relative) away from the
one-GPU step, where every other mode was bitwise equal (docs/multigpu.md). Here each (batch, head, column block)
program sums its rows in BLOCK_L-row tiles in token order, then the tile's rows: the order depends on L alone.
The bias likewise: ``ks @ qmean`` (a batched matmul) came out 2e-5 apart for one rank's 10 heads against the same
heads of 40 on an H200 (cuBLAS picks its kernel by the batch), and sagebwd's output with ``smooth_q`` 1e-4 apart.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import interpreting


@triton.jit
def _token_mean(X, Mean, stride_b, stride_h, stride_l, H, L,
                HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr):
    bh = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    rows = tl.arange(0, BLOCK_L)
    base = X + (bh // H).to(tl.int64) * stride_b + (bh % H).to(tl.int64) * stride_h
    acc = tl.zeros((BLOCK_L, BLOCK_D), dtype=tl.float32)
    for start in range(0, L, BLOCK_L):
        r = start + rows
        ptrs = base + r[:, None].to(tl.int64) * stride_l + cols[None, :]
        acc += tl.load(ptrs, mask=r[:, None] < L, other=0.0).to(tl.float32)
    tl.store(Mean + bh * HEAD_DIM + cols, tl.sum(acc, axis=0) / L)


def token_mean(x: torch.Tensor) -> torch.Tensor:
    """Mean over the tokens of (B, H, L, D) ``x`` (last dim contiguous), (B, H, D) float32: a Triton launch on
    CUDA and under the interpreter, torch's mean elsewhere. Each head's mean is the same whatever other heads
    ``x`` holds and however they are laid out; NaN and inf propagate."""
    b, h, n, d = x.shape
    if not (x.is_cuda or interpreting()) or x.numel() == 0:
        return x.mean(dim=2, dtype=torch.float32)
    if x.stride(3) != 1:
        x = x.contiguous()
    mean = torch.empty((b, h, d), dtype=torch.float32, device=x.device)
    block_d = min(d, 32)
    _token_mean[(b * h, d // block_d)](x, mean, x.stride(0), x.stride(1), x.stride(2), h, n,
                                      HEAD_DIM=d, BLOCK_D=block_d, BLOCK_L=64)
    return mean


@triton.jit
def _key_bias(K, KMean, QMean, Bias, stride_b, stride_h, stride_l, H, L, scale,
              HEAD_DIM: tl.constexpr, BLOCK_L: tl.constexpr, SMOOTH_K: tl.constexpr):
    bh = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    cols = tl.arange(0, HEAD_DIM)
    base = K + (bh // H).to(tl.int64) * stride_b + (bh % H).to(tl.int64) * stride_h
    k = tl.load(base + rows[:, None].to(tl.int64) * stride_l + cols[None, :], mask=rows[:, None] < L, other=0.0)
    k = k.to(tl.float32)
    if SMOOTH_K:
        k -= tl.load(KMean + bh * HEAD_DIM + cols)[None, :]
    bias = tl.sum(k * tl.load(QMean + bh * HEAD_DIM + cols)[None, :], axis=1) * scale
    tl.store(Bias + bh.to(tl.int64) * L + rows, bias, mask=rows < L)


def key_bias(k: torch.Tensor, kmean: torch.Tensor | None, qmean: torch.Tensor, scale: float) -> torch.Tensor:
    """Q smoothing's per-key bias, ``((k - kmean) . qmean) * scale`` for every key of (B, H, L, D) ``k`` (kmean
    None: ``k . qmean``), (B, H, L) float32: a Triton launch on CUDA and under the interpreter (one program per
    head and 64 keys, the dot in a fixed order: the same whatever other heads ``k`` holds), torch elsewhere."""
    b, h, n, d = k.shape
    if not (k.is_cuda or interpreting()) or k.numel() == 0:
        ks = k.float() - kmean[:, :, None, :] if kmean is not None else k.float()
        return (ks @ qmean[..., None]).squeeze(-1) * scale
    if k.stride(3) != 1:
        k = k.contiguous()
    bias = torch.empty((b, h, n), dtype=torch.float32, device=k.device)
    block_l = 64
    _key_bias[(b * h, triton.cdiv(n, block_l))](
        k, qmean if kmean is None else kmean.contiguous(), qmean.contiguous(), bias, k.stride(0), k.stride(1),
        k.stride(2), h, n, scale, HEAD_DIM=d, BLOCK_L=block_l, SMOOTH_K=kmean is not None)
    return bias
