"""SageAttention3, emulated on the shared FP4 forward kernel (SPEC §3; inference only).

    K_s = K - mean_tokens(K);  per 128 query rows: Q_s = Q - q̄,  ΔS = q̄ K_s^T (fp32)
    S   = (phi(Q_s) phi(K_s)^T + ΔS) * scale;  two-level P (2688);  V quantized along tokens

The pre-pass is four launches: K's token mean (torch), then ``attn_qat._quantize_rows`` smoothing and
quantizing Q (its own 128-row means), K and V (blocks of 16 tokens), then ``_delta_s`` for ΔS in fp32.
The attention itself is ``attn_qat._attn_fwd`` with ``SMOOTH_Q=True`` adding ΔS, so the online softmax
(integer running max) and phi(P) are the very code the other FP4 modes run.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_qkv, default_scale, interpreting
from .attn_qat import _work_dtype, attn_qat_forward, quantize_heads
from .reference import SAGE3_Q_BLOCK


@triton.jit
def _delta_s(K, KMean, QMean, DS, stride_kb, stride_kh, stride_kl, H, LK, NQB,
             HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_QB: tl.constexpr):
    """ΔS[bh, i, keys] = q̄_i · (K - k̄)^T over every 128-row query block i, for BLOCK_N keys; fp32
    products and sums (an "ieee" dot: no tf32 rounding), as SPEC §3 asks."""
    bh = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    k = tl.load(K + (bh // H) * stride_kb + (bh % H) * stride_kh + offs_n[None, :] * stride_kl + offs_d[:, None],
                mask=offs_n[None, :] < LK, other=0.0).to(tl.float32)
    k_s = k - tl.load(KMean + bh * HEAD_DIM + offs_d)[:, None]  # (HEAD_DIM, BLOCK_N): K_s^T
    for start in range(0, NQB, BLOCK_QB):
        rows = start + tl.arange(0, BLOCK_QB)
        q_bar = tl.load(QMean + (bh * NQB + rows[:, None]) * HEAD_DIM + offs_d[None, :], mask=rows[:, None] < NQB,
                        other=0.0)
        ds = tl.dot(q_bar, k_s, input_precision="ieee")
        tl.store(DS + (bh * NQB + rows[:, None]) * LK + offs_n[None, :], ds,
                 mask=(rows[:, None] < NQB) & (offs_n[None, :] < LK))


def sage3_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sm_scale: float | None = None,
                    causal: bool = False) -> torch.Tensor:
    """SageAttention3 (emulated NVFP4 with Q/K smoothing and two-level P). Inference only.

    Arguments:
        q: (batch, heads, seqlen_q, head_dim); k, v: (batch, heads, seqlen_k, head_dim); bf16/fp16;
            head_dim 64 or 128.
        sm_scale: softmax scale, default 1/sqrt(head_dim).
        causal: top-left aligned causal mask.
    Return:
        (batch, heads, seqlen_q, head_dim) in q's dtype and stride order.
    """
    check_qkv(q, k, v, name="sage3_attention")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise ValueError("sage3_attention is inference-only (no backward): call it under torch.no_grad()")
    from .ops import sage3_fwd

    return sage3_fwd(q, k, v, default_scale(q.shape[-1], sm_scale), causal)


def sage3_forward(q, k, v, *, sm_scale: float, causal: bool) -> torch.Tensor:
    """The launch behind the ``attnqat::sage3_fwd`` custom op: smoothing pre-pass, then the FP4 forward."""
    wdt = _work_dtype(q.dtype)
    b, h, lk, d = k.shape
    k_mean = k.mean(dim=2, dtype=torch.float32).contiguous()
    qf, q_mean = quantize_heads(q, wdt, block_mean=SAGE3_Q_BLOCK)
    kf = quantize_heads(k, wdt, center=k_mean)
    vf = quantize_heads(v, wdt, tokens=True)
    nqb = q_mean.shape[2]
    delta_s = torch.empty((b, h, nqb, lk), dtype=torch.float32, device=q.device)
    block_n = 32 if interpreting() else 64
    _delta_s[(triton.cdiv(lk, block_n), b * h)](k, k_mean, q_mean, delta_s, k.stride(0), k.stride(1), k.stride(2),
                                                h, lk, nqb, HEAD_DIM=d, BLOCK_N=block_n, BLOCK_QB=32)
    o, *_ = attn_qat_forward(q, k, v, sm_scale=sm_scale, causal=causal, training=False,
                             operands=(qf, kf, vf), delta_s=delta_s)
    return o.to(q.dtype)
