"""SageAttention3, emulated on the shared FP4 forward kernel (SPEC §3; inference only).

    K_s = K - mean_tokens(K);  per 128 query rows: Q_s = Q - q̄,  ΔS = q̄ K_s^T (fp32)
    S   = (phi(Q_s) phi(K_s)^T + ΔS) * scale;  two-level P (2688);  V quantized along tokens

The smoothing and the quantization of Q_s, K_s (along head_dim) and V (blocks of 16 tokens) run as a
pre-pass; the attention itself is ``attn_qat._attn_fwd`` with ``SMOOTH_Q=True`` adding ΔS, so the
online softmax (integer running max) and phi(P) are the very code the other FP4 modes run.
"""
from __future__ import annotations

import torch

from ._common import check_qkv, default_scale
from .attn_qat import _work_dtype, attn_qat_forward, quantize_heads
from .nvfp4 import fake_quant_nvfp4
from .reference import sage3_smooth


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
    q_s, k_s, delta_s = sage3_smooth(q, k)
    operands = (quantize_heads(q_s, wdt), quantize_heads(k_s, wdt),
                fake_quant_nvfp4(v, dim=2).to(wdt).contiguous())
    o, *_ = attn_qat_forward(q, k, v, sm_scale=sm_scale, causal=causal, training=False,
                             operands=operands, delta_s=delta_s.contiguous())
    return o.to(q.dtype)
