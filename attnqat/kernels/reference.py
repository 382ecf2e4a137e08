"""Slow, readable PyTorch references for every attention mode (SPEC §1-4).

Tests and benchmarks compare the Triton kernels against these; on CPU, :func:`attnqat.kernels.attention`
runs them directly. They compute in float32 and are written to be independent of the kernels' tricks:
the quantizer picks the nearest e2m1 grid point by distance (not by rounding arithmetic) and rounds
scales with torch's own float8 cast.

All attention functions take (batch, heads, seqlen, head_dim) tensors. ``causal`` masks are aligned
top-left, as in ``torch.nn.functional.scaled_dot_product_attention``: query i sees keys 0..i.
"""
from __future__ import annotations

import math

import torch

from .nvfp4 import BLOCK, E2M1_GRID, P_SCALE

LOG2E = 1.4426950408889634

# ---------------------------------------------------------------------------------------------------
# NVFP4 (SPEC §1)
# ---------------------------------------------------------------------------------------------------


def e4m3_scale_ref(amax: torch.Tensor) -> torch.Tensor:
    """s = e4m3(amax / 6): round-to-nearest-even, saturating at 448; inf and NaN pass through."""
    s = amax.float() / 6.0
    finite = torch.isfinite(s)
    rounded = s.clamp(max=448.0).nan_to_num(0.0).to(torch.float8_e4m3fn).float()
    return torch.where(finite, rounded, s)


def e2m1_codes_ref(y: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 code (0..15, sign in bit 3) for finite ``y``, ties to the even code, saturating."""
    grid = torch.tensor(E2M1_GRID, dtype=torch.float64, device=y.device)
    a = y.double().abs()
    dist = (a[..., None] - grid).abs()  # exact in float64 for float32 inputs
    is_min = dist == dist.amin(dim=-1, keepdim=True)
    even = torch.arange(8, device=y.device) % 2 == 0
    even_min = is_min & even
    code = torch.where(even_min.any(-1), even_min.int().argmax(-1), is_min.int().argmax(-1))
    return code | ((y < 0).int() << 3)


def fake_quant_nvfp4_ref(x: torch.Tensor, dim: int = -1, pre_scale: float = 1.0) -> torch.Tensor:
    """phi(x) (SPEC §1) along ``dim`` in blocks of 16; returns x's dtype. A block holding NaN or inf
    comes out all NaN; an all-zero or all-tiny block (amax/6 rounds to 0) comes out zero."""
    xt = x.movedim(dim, -1).float() * pre_scale
    n = xt.shape[-1]
    pad = (-n) % BLOCK
    if pad:
        xt = torch.nn.functional.pad(xt, (0, pad))
    xb = xt.reshape(*xt.shape[:-1], -1, BLOCK)
    s = e4m3_scale_ref(xb.abs().amax(dim=-1))[..., None]
    bad = ~torch.isfinite(s)
    safe = torch.where((s > 0) & ~bad, s, torch.ones_like(s))
    codes = e2m1_codes_ref(torch.where(bad, torch.zeros_like(xb), xb / safe))
    grid = torch.tensor(E2M1_GRID, device=x.device)
    mag = grid[codes & 0x7]
    q = torch.where((codes & 0x8) != 0, -mag, mag) * s
    q = torch.where(bad, torch.full_like(q, float("nan")), torch.where(s > 0, q, torch.zeros_like(q)))
    q = q.reshape(*xt.shape)[..., :n] / pre_scale
    return q.to(x.dtype).movedim(-1, dim)


# ---------------------------------------------------------------------------------------------------
# Exact attention and shared pieces
# ---------------------------------------------------------------------------------------------------


def _scale(q: torch.Tensor, sm_scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else float(sm_scale)


def causal_mask(lq: int, lk: int, device) -> torch.Tensor:
    """True where query i may attend key j (top-left aligned: j <= i)."""
    return torch.ones(lq, lk, dtype=torch.bool, device=device).tril()


def attention_fp32(q, k, v, *, sm_scale=None, causal=False) -> torch.Tensor:
    """Exact softmax attention in float32 (float64 if given float64); returns that dtype."""
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    s = (q.to(dt) @ k.to(dt).transpose(-1, -2)) * _scale(q, sm_scale)
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    return torch.softmax(s, dim=-1) @ v.to(dt)


def attention_bwd_fp32(q, k, v, o, do, *, sm_scale=None, causal=False):
    """Standard (FlashAttention-style) attention gradients in float32 from unquantized q, k, v and
    D = rowsum(dO * O) with the given O. Used by the drop-in ablation and as exact gradients."""
    scale = _scale(q, sm_scale)
    qf, kf, vf, dof = q.float(), k.float(), v.float(), do.float()
    s = (qf @ kf.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    p = torch.softmax(s, dim=-1)
    delta = (dof * o.float()).sum(-1, keepdim=True)
    dv = p.transpose(-1, -2) @ dof
    ds = p * (dof @ vf.transpose(-1, -2) - delta)
    return ds @ kf * scale, ds.transpose(-1, -2) @ qf * scale, dv


# ---------------------------------------------------------------------------------------------------
# Attn-QAT (SPEC §2); nvfp4 is its forward without O'
# ---------------------------------------------------------------------------------------------------


def _logits_log2(qf, kf, scale, causal):
    s = (qf @ kf.transpose(-1, -2)) * (scale * LOG2E)
    if causal:
        s = s.masked_fill(~causal_mask(qf.shape[-2], kf.shape[-2], qf.device), float("-inf"))
    return s


def attn_qat_forward_ref(q, k, v, *, sm_scale=None, causal=False, block_n: int = 64, training: bool = True):
    """Tile-wise Attn-QAT forward with the integer running max and the 2688 P scale (SPEC §2).

    Return:
        o: (B, H, Lq, D) float32, the FP4 output O.
        o_aux: float32 O' (P unquantized, V^F), or None when ``training`` is False.
        m: (B, H, Lq) float32, the final integer running max (log2 units).
        l: (B, H, Lq) float32, the row sum of the unquantized P~ = 2688 * 2^(S - m).
    """
    if block_n % BLOCK:
        raise ValueError(f"block_n {block_n} must be a multiple of 16")
    scale = _scale(q, sm_scale)
    qf, kf, vf = (fake_quant_nvfp4_ref(t.float()) for t in (q, k, v))
    s = _logits_log2(qf, kf, scale, causal)
    lk = k.shape[-2]
    shape = q.shape[:-1]
    m = torch.full(shape, float("-inf"), device=q.device)
    l = torch.zeros(shape, device=q.device)
    o = torch.zeros(*shape, v.shape[-1], device=q.device)
    o_aux = torch.zeros_like(o) if training else None
    for j in range(0, lk, block_n):
        s_j = s[..., j:j + block_n]
        m_new = torch.maximum(m, torch.ceil(s_j.amax(dim=-1)))
        alpha = torch.exp2(m - m_new).nan_to_num(0.0)  # first tile: 2^(-inf - m_new) = 0
        p = P_SCALE * torch.exp2(s_j - m_new[..., None])
        l = alpha * l + p.sum(-1)
        o = alpha[..., None] * o + fake_quant_nvfp4_ref(p, dim=-1) @ vf[..., j:j + block_n, :]
        if training:
            o_aux = alpha[..., None] * o_aux + p @ vf[..., j:j + block_n, :]
        m = m_new
    o = o / l[..., None]
    if training:
        o_aux = o_aux / l[..., None]
    return o, o_aux, m, l


def attn_qat_backward_ref(q, k, v, o_aux, do, m, l, *, sm_scale=None, causal=False, p_bwd: str = "final_max"):
    """Attn-QAT backward (SPEC §2): recompute S from Q^F, K^F; P^F = phi(P~)/l with the saved integer
    max; D = rowsum(dO * O'); straight-through to q, k, v. ``p_bwd="normalized"`` is the published
    code's choice (phi of the normalized P), kept for ablations. Returns float32 (dq, dk, dv)."""
    if p_bwd not in ("final_max", "normalized"):
        raise ValueError(f"p_bwd {p_bwd!r} not in ('final_max', 'normalized')")
    scale = _scale(q, sm_scale)
    qf, kf, vf = (fake_quant_nvfp4_ref(t.float()) for t in (q, k, v))
    dof = do.float()
    s = _logits_log2(qf, kf, scale, causal)
    p_tilde = P_SCALE * torch.exp2(s - m[..., None])
    p = p_tilde / l[..., None]
    if p_bwd == "final_max":
        p_fp4 = fake_quant_nvfp4_ref(p_tilde, dim=-1) / l[..., None]
    else:
        p_fp4 = fake_quant_nvfp4_ref(p, dim=-1)
    delta = (dof * o_aux.float()).sum(-1, keepdim=True)
    dv = p_fp4.transpose(-1, -2) @ dof
    ds = p * (dof @ vf.transpose(-1, -2) - delta)
    return ds @ kf * scale, ds.transpose(-1, -2) @ qf * scale, dv


def forward_quantized_p_ref(q, k, v, *, sm_scale=None, causal=False, block_n: int = 64) -> torch.Tensor:
    """The normalized quantized P that the tile-wise forward actually multiplied V^F with:
    phi(P~_j) computed with the running max at tile j, rescaled to the final max, divided by l.
    ``P^T dO`` with it is the forward-consistent dV of SPEC §2's second property."""
    scale = _scale(q, sm_scale)
    qf, kf = fake_quant_nvfp4_ref(q.float()), fake_quant_nvfp4_ref(k.float())
    s = _logits_log2(qf, kf, scale, causal)
    m = torch.full(q.shape[:-1], float("-inf"), device=q.device)
    tiles, maxes = [], []
    for j in range(0, k.shape[-2], block_n):
        s_j = s[..., j:j + block_n]
        m = torch.maximum(m, torch.ceil(s_j.amax(dim=-1)))
        tiles.append(fake_quant_nvfp4_ref(P_SCALE * torch.exp2(s_j - m[..., None]), dim=-1))
        maxes.append(m)
    l = sum((P_SCALE * torch.exp2(s[..., j:j + block_n] - m[..., None])).sum(-1)
            for j in range(0, k.shape[-2], block_n))
    return torch.cat([t * torch.exp2(mj - m)[..., None] for t, mj in zip(tiles, maxes)], dim=-1) / l[..., None]
