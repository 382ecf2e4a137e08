"""SageAttention3, emulated on the shared FP4 forward kernel (SPEC §3; inference only).

    K_s = K - mean_tokens(K);  per 128 query rows: Q_s = Q - q̄,  ΔS = q̄ K_s^T (fp32)
    S   = (phi(Q_s) phi(K_s)^T + ΔS) * scale;  two-level P (2688);  V quantized along tokens

The pre-pass is four launches: K's token mean (torch), then ``nvfp4.quantize_heads`` smoothing and
quantizing Q (its own 128-row means), K and V (blocks of 16 tokens), then ``attn_qat.delta_s_parts`` for ΔS
in fp32, stored as three exact bf16 parts (shared with the FP4 modes' ``q_smoothing``). The attention itself
is ``attn_qat._attn_fwd`` with ``SMOOTH_Q=True`` adding ΔS through one more k=16 MMA, so the online softmax
(integer running max) and phi(P) are the very code the other FP4 modes run.

Top to bottom: launch config and pre-pass -> :func:`sage3_forward` (the launch) -> its custom op
``attnqat::sage3_fwd`` (with a fake implementation, so ``torch.compile`` traces it) -> :func:`sage3_unchecked`
(the registry's path) -> :func:`sage3_attention` (the checked public function).
"""
from __future__ import annotations

import torch

from ._common import LaunchConfig, check_qkv, default_scale, launch_fitting, needs_grad, work_dtype
from .attn_qat import attn_qat_forward, delta_s_head_groups, delta_s_parts, delta_s_width, fwd_config, native_fp4
from .formats import SAGE3_Q_BLOCK
from .nvfp4 import quantize_heads
from .smoothing import token_mean


def sage3_config(head_dim: int) -> LaunchConfig:
    """The forward's launch config for sage3: the FP4 inference forward's (pin with ATTNQAT_FWD_CONFIG), whose
    rows must lie in one 128-row smoothing block. At head_dim 128 its 128x128 tiles fit shared memory beside
    the ΔS tile because Q sits in registers (attn_qat._through_mma): 52.6 ms at (1, 40, 32760, 128) on an
    H100 against 59.7 for 128x64, which sage3 ran before."""
    cfg = fwd_config(head_dim, training=False)
    if 128 % cfg.block_m:
        raise ValueError(f"sage3 needs BLOCK_M dividing 128 (one smoothing block per program), got {cfg}")
    return cfg


def sage3_prepass(q, k, v, cfg: LaunchConfig, packed: bool = False):
    """Smoothing and quantization for the forward launched with ``cfg``: returns Q^F, K^F, V^F (work dtype,
    contiguous (B, H, L, D)) and ΔS, (B, H, ceil(Lq/128), 3, Lk padded to whole cfg.block_n tiles) bf16
    (see _delta_s). ``packed``: Q^F and K^F as NVFP4 storage, (codes, scales) pairs (the native path)."""
    wdt = work_dtype(q.dtype)
    b, h, lk, d = k.shape
    k_mean = token_mean(k)
    qf, q_mean = quantize_heads(q, wdt, block_mean=SAGE3_Q_BLOCK, packed=packed)
    kf = quantize_heads(k, wdt, center=k_mean, packed=packed)
    vf = quantize_heads(v, wdt, tokens=True)
    delta_s = delta_s_parts(k, q_mean, delta_s_width(lk, cfg.block_n), cfg.block_n, k_mean=k_mean)
    return qf, kf, vf, delta_s


def sage3_forward(q, k, v, *, sm_scale: float, causal: bool, packed_qk: int | None = None) -> torch.Tensor:
    """The launch behind the ``attnqat::sage3_fwd`` custom op: smoothing pre-pass, then the FP4 forward, with
    the first launch config that fits the GPU (``launch_fitting``: ΔS is laid out for the forward's tiles, so
    a fallback reruns the pre-pass). ``packed_qk``: as attn_qat_forward's (default: native_fp4)."""
    if packed_qk is None:
        packed_qk = native_fp4(q.device)
    return launch_fitting(lambda cfg: _sage3_heads(q, k, v, cfg, sm_scale, causal, packed_qk),
                          sage3_config(q.shape[-1]), ("sage3 forward", q.device, q.shape[-1], packed_qk))


def _sage3_heads(q, k, v, cfg: LaunchConfig, sm_scale: float, causal: bool, packed_qk: int) -> torch.Tensor:
    """sage3 over groups of heads whose ΔS fits in ``attn_qat.DELTA_S_BYTES`` (attn_qat.delta_s_head_groups)."""
    b, h, lq, d = q.shape
    groups = delta_s_head_groups(b, h, lq, delta_s_width(k.shape[2], cfg.block_n))
    out = torch.empty_like(q) if len(groups) > 1 else None
    for hs in groups:
        qh, kh, vh = q[:, hs], k[:, hs], v[:, hs]
        qf, kf, vf, delta_s = sage3_prepass(qh, kh, vh, cfg, packed=bool(packed_qk))
        o, *_ = attn_qat_forward(qh, kh, vh, sm_scale=sm_scale, causal=causal, training=False,
                                 operands=(qf, kf, vf), delta_s=delta_s, config=cfg, packed_qk=packed_qk)
        if out is None:
            return o.to(q.dtype)
        out[:, hs] = o
    return out


@torch.library.custom_op("attnqat::sage3_fwd", mutates_args=(), device_types=("cuda", "cpu"))
def sage3_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, causal: bool) -> torch.Tensor:
    return sage3_forward(q, k, v, sm_scale=sm_scale, causal=causal)


@sage3_fwd.register_fake
def _(q, k, v, sm_scale, causal):
    return torch.empty_like(q)


def sage3_unchecked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sm_scale: float | None = None,
                    causal: bool = False) -> torch.Tensor:
    """:func:`sage3_attention` on checked inputs, without grad (the registry's path: attention() checked them)."""
    return sage3_fwd(q, k, v, default_scale(q.shape[-1], sm_scale), causal)


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
    check_qkv(q, k, v, name="sage3_attention", sm_scale=sm_scale, causal=causal)
    if needs_grad(q, k, v):
        raise ValueError("sage3_attention is inference-only (no backward): call it under torch.no_grad()")
    return sage3_unchecked(q, k, v, sm_scale=sm_scale, causal=causal)
