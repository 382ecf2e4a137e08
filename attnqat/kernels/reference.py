"""Slow, readable PyTorch references for every attention mode (SPEC §1-4).

Tests and benchmarks compare the Triton kernels against these; on CPU, :func:`attnqat.kernels.attention`
runs them directly. They compute in float32 and are written to be independent of the kernels' tricks:
the quantizer picks the nearest e2m1 grid point by distance (not by rounding arithmetic) and rounds
scales with torch's own float8 cast. They import nothing from the kernels (``tests/test_structure.py``
checks it): only torch and the format constants of ``formats.py``.

All attention functions take (batch, heads, seqlen, head_dim) tensors. ``causal`` masks are aligned
top-left, as in ``torch.nn.functional.scaled_dot_product_attention``: query i sees keys 0..i.
"""
from __future__ import annotations

import math

import torch

from .formats import (E2M1_GRID, E4M3_MAX, LOG2E, NVFP4_BLOCK as BLOCK, P_SCALE, SAGE3_Q_BLOCK, SAGEBWD_K_BLOCK,
                      SAGEBWD_PRECISIONS, SAGEBWD_Q_BLOCK)

# ---------------------------------------------------------------------------------------------------
# NVFP4 (SPEC §1)
# ---------------------------------------------------------------------------------------------------


def e4m3_scale_ref(amax: torch.Tensor, top: float = 6.0) -> torch.Tensor:
    """s = e4m3(amax / top) (SPEC §1: top 6): round-to-nearest-even, saturating at 448; inf and NaN pass through."""
    s = amax.float() / top
    finite = torch.isfinite(s)
    rounded = s.clamp(max=448.0).nan_to_num(0.0).to(torch.float8_e4m3fn).float()
    return torch.where(finite, rounded, s)


def e2m1_codes_ref(y: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 code (0..15, sign in bit 3) for finite ``y``, ties to the even code, saturating.

    The midpoints between neighbouring grid values split the magnitudes into the 8 codes' intervals
    (exact comparisons in float64, which holds every float32 exactly); a magnitude exactly on a
    midpoint is a tie between its two neighbours and takes the even code. NaN gives code 0 (callers
    zero non-finite blocks first)."""
    grid = torch.tensor(E2M1_GRID, dtype=torch.float64, device=y.device)
    mids = (grid[1:] + grid[:-1]) / 2  # 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5: exact
    a = y.double().abs()
    code = torch.bucketize(a, mids)  # mids[i-1] < a <= mids[i] -> i; above 5 -> 7 (saturates at 6)
    tie = (code < 7) & (a == mids[code.clamp(max=6)])
    code = torch.where(tie & (code % 2 == 1), code + 1, code)  # odd code on a tie: the even one above
    code = torch.where(torch.isnan(a), torch.zeros_like(code), code)
    return code.int() | ((y < 0).int() << 3)


def _quantize_blocks(xb: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """q * s for blocks ``xb`` (..., 16) with scales ``s`` (..., 1): NaN where s is not finite, 0 where s is 0."""
    bad = ~torch.isfinite(s)
    safe = torch.where((s > 0) & ~bad, s, torch.ones_like(s))
    codes = e2m1_codes_ref(torch.where(bad, torch.zeros_like(xb), xb / safe))
    grid = torch.tensor(E2M1_GRID, device=xb.device)
    mag = grid[codes & 0x7]
    q = torch.where((codes & 0x8) != 0, -mag, mag) * s
    return torch.where(bad, torch.full_like(q, float("nan")), torch.where(s > 0, q, torch.zeros_like(q)))


def four_over_six_scale(xb: torch.Tensor, tops: tuple[float, ...] = (6.0, 4.0)) -> torch.Tensor:
    """Four Over Six's block scale (Cook et al. 2025, arXiv 2512.02010; the FP4 modes' ``four_over_six`` option,
    docs/kernels.md): of s6 = e4m3(amax / 6) (SPEC §1) and s4 = e4m3(amax / 4), the one whose phi has the smaller
    squared error over the block (float32 sums; s6 on equal errors). s4 maps the block's largest magnitude to the
    grid value 4 (or up to 6 when e4m3 rounds s4 down), where the grid's last step, 4 to 6, is widest: blocks whose
    values cluster near their max lose less. Both are NVFP4 (e2m1 codes, one e4m3 scale a block), so the FP4 MMA
    takes either unchanged. ``xb`` (..., 16) float32 blocks; returns (..., 1). Non-finite blocks keep s6 (NaN or
    inf: the block comes out NaN). Kernels sum the squares in another order, so where the two errors are within
    float32 rounding of each other they may pick the other scale (as accurate, to that rounding).
    ``tops``: the maxima tried, in order, the earlier kept on equal errors; the option's are (6, 4). Others are
    for experiments (experiments/fp4_noise_sources.py --four-over-six-tops): the kernels try 6 and 4 only."""
    amax = xb.abs().amax(dim=-1)

    def scale_and_error(top: float):
        s = e4m3_scale_ref(amax, top=top)[..., None]
        return s, (_quantize_blocks(xb, s) - xb).square().sum(dim=-1, keepdim=True)

    best, best_err = scale_and_error(tops[0])
    for top in tops[1:]:
        s, err = scale_and_error(top)
        better = err < best_err
        best, best_err = torch.where(better, s, best), torch.where(better, err, best_err)
    return best


def fake_quant_nvfp4_ref(x: torch.Tensor, dim: int = -1, pre_scale: float = 1.0,
                         four_over_six: bool = False) -> torch.Tensor:
    """phi(x) (SPEC §1) along ``dim`` in blocks of 16; returns x's dtype. A block holding NaN or inf
    comes out all NaN; an all-zero or all-tiny block (amax/6 rounds to 0) comes out zero.
    ``four_over_six``: each block's scale is :func:`four_over_six_scale`'s choice."""
    xt = x.movedim(dim, -1).float() * pre_scale
    n = xt.shape[-1]
    pad = (-n) % BLOCK
    if pad:
        xt = torch.nn.functional.pad(xt, (0, pad))
    xb = xt.reshape(*xt.shape[:-1], -1, BLOCK)
    s = four_over_six_scale(xb) if four_over_six else e4m3_scale_ref(xb.abs().amax(dim=-1))[..., None]
    q = _quantize_blocks(xb, s)
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


def _fp4_online_softmax(s, vf, *, block_n: int, training: bool):
    """The tile loop shared by the FP4 forwards: integer running max, P~ = 2688 * 2^(S - m),
    l and O' from the unquantized P~, O from phi(P~) (blocks of 16 keys). ``s`` in log2 units."""
    if block_n % BLOCK:
        raise ValueError(f"block_n {block_n} must be a multiple of 16")
    shape = s.shape[:-1]
    m = torch.full(shape, float("-inf"), device=s.device)
    l = torch.zeros(shape, device=s.device)
    o = torch.zeros(*shape, vf.shape[-1], device=s.device)
    o_aux = torch.zeros_like(o) if training else None
    for j in range(0, s.shape[-1], block_n):
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


def q_block_means_ref(q):
    """Per 128-row query block i (SAGE3_Q_BLOCK, the last one may be partial): q̄_i = mean_rows(Q_i). Returns
    float32 (q_s = Q - q̄ of each row's block, q_bar (B, H, ceil(Lq/128), D), q̄ of each row (B, H, Lq, D))."""
    qf = q.float()
    lq = q.shape[2]
    nb = -(-lq // SAGE3_Q_BLOCK)
    pad = nb * SAGE3_Q_BLOCK - lq
    sums = torch.nn.functional.pad(qf, (0, 0, 0, pad)).reshape(*q.shape[:2], nb, SAGE3_Q_BLOCK, q.shape[3]).sum(3)
    counts = torch.full((nb,), float(SAGE3_Q_BLOCK), device=q.device)
    counts[-1] = lq - (nb - 1) * SAGE3_Q_BLOCK
    q_bar = sums / counts[:, None]
    rows = q_bar.repeat_interleave(SAGE3_Q_BLOCK, dim=2)[:, :, :lq]
    return qf - rows, q_bar, rows


def fp4_logits_ref(q, k, *, sm_scale=None, causal=False, q_smoothing: bool = False, quantize: bool = True,
                   four_over_six: bool = False):
    """The FP4 modes' logits S in log2 units (SPEC §2), from Q^F = phi(Q), K^F = phi(K) along head_dim.

    ``q_smoothing`` (SPEC §3's forward smoothing without its K smoothing): per 128-row query block i,
    Q_s = Q - q̄_i is quantized instead of Q and the bias ΔS_i = q̄_i K^T (float32, K unquantized) is added:
    S = (phi(Q_s) phi(K)^T + ΔS) * scale * log2(e). Without phi that is Q K^T again, so it moves only where FP4
    rounding falls. ``quantize=False`` drops phi on Q and K (tests use it to show that algebra).
    ``four_over_six``: phi with Four Over Six's block scales (:func:`four_over_six_scale`).
    Returns float32 (s, q^F, k^F, q̄ of each row (B, H, Lq, D) or None)."""
    scale = _scale(q, sm_scale)
    fq = (lambda x: fake_quant_nvfp4_ref(x, four_over_six=four_over_six)) if quantize else (lambda x: x)
    if not q_smoothing:
        qf, kf = fq(q.float()), fq(k.float())
        return _logits_log2(qf, kf, scale, causal), qf, kf, None
    q_s, _, q_rows = q_block_means_ref(q)
    qf, kf = fq(q_s), fq(k.float())
    delta_s = q_rows @ k.float().transpose(-1, -2)  # ΔS, materialized per row: q̄ of its block times K^T
    s = (qf @ kf.transpose(-1, -2) + delta_s) * (scale * LOG2E)
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    return s, qf, kf, q_rows


def attn_qat_forward_ref(q, k, v, *, sm_scale=None, causal=False, block_n: int = 64, training: bool = True,
                         q_smoothing: bool = False, four_over_six: bool = False):
    """Tile-wise Attn-QAT forward with the integer running max and the 2688 P scale (SPEC §2); ``q_smoothing``:
    the logits of :func:`fp4_logits_ref` with Q smoothed per 128-row block (docs/kernels.md, "Q smoothing");
    ``four_over_six``: Q, K and V quantized with Four Over Six's block scales (P as SPEC §1 has it).

    Return:
        o: (B, H, Lq, D) float32, the FP4 output O.
        o_aux: float32 O' (P unquantized, V^F), or None when ``training`` is False.
        m: (B, H, Lq) float32, the final integer running max (log2 units).
        l: (B, H, Lq) float32, the row sum of the unquantized P~ = 2688 * 2^(S - m).
    """
    s = fp4_logits_ref(q, k, sm_scale=sm_scale, causal=causal, q_smoothing=q_smoothing,
                       four_over_six=four_over_six)[0]
    vf = fake_quant_nvfp4_ref(v.float(), four_over_six=four_over_six)
    return _fp4_online_softmax(s, vf, block_n=block_n, training=training)


def attn_qat_backward_ref(q, k, v, o_aux, do, m, l, *, sm_scale=None, causal=False, p_bwd: str = "final_max",
                          q_smoothing: bool = False, dk_mean_term: bool = True, four_over_six: bool = False):
    """Attn-QAT backward (SPEC §2): recompute S from Q^F, K^F; P^F = phi(P~)/l with the saved integer
    max; D = rowsum(dO * O'); straight-through to q, k, v. ``p_bwd="normalized"`` is the published
    code's choice (phi of the normalized P), kept for ablations. Returns float32 (dq, dk, dv).

    ``q_smoothing``: S recomputed with ΔS as the forward has it; dQ = dS K^F * scale, straight through
    Q_s = Q - q̄ (the gradient through q̄ is dropped); dK = dS^T Q^F * scale + (dS^T 1) q̄^T * scale per query
    block (SPEC §4's Q-smoothing term), here as dS^T (1 q̄^T of each row's block). ``dk_mean_term=False`` drops
    that term (a test's control: it shows the term matters). ``four_over_six``: Q^F, K^F, V^F as the forward's."""
    if p_bwd not in ("final_max", "normalized"):
        raise ValueError(f"p_bwd {p_bwd!r} not in ('final_max', 'normalized')")
    scale = _scale(q, sm_scale)
    s, qf, kf, q_rows = fp4_logits_ref(q, k, sm_scale=sm_scale, causal=causal, q_smoothing=q_smoothing,
                                       four_over_six=four_over_six)
    vf = fake_quant_nvfp4_ref(v.float(), four_over_six=four_over_six)
    dof = do.float()
    p_tilde = P_SCALE * torch.exp2(s - m[..., None])
    p = p_tilde / l[..., None]
    if p_bwd == "final_max":
        p_fp4 = fake_quant_nvfp4_ref(p_tilde, dim=-1) / l[..., None]
    else:
        p_fp4 = fake_quant_nvfp4_ref(p, dim=-1)
    delta = (dof * o_aux.float()).sum(-1, keepdim=True)
    dv = p_fp4.transpose(-1, -2) @ dof
    ds = p * (dof @ vf.transpose(-1, -2) - delta)
    dk = ds.transpose(-1, -2) @ qf
    if q_smoothing and dk_mean_term:  # sum over each block's rows of dS_ij q̄_i = (dS^T 1) q̄^T per block
        dk = dk + ds.transpose(-1, -2) @ q_rows
    return ds @ kf * scale, dk * scale, dv


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


def refuse_double_backward(mode: str) -> None:
    """Raise in an attention backward (the references' and the kernels') that runs with ``create_graph=True``
    (grad mode is on inside a backward exactly then). The backwards are hand-written, not traced from
    differentiable ops, so a graph built through them would give wrong second-order gradients, or none at all
    where the saved tensors are quantized copies."""
    if torch.is_grad_enabled():
        raise NotImplementedError(f"attention mode {mode!r} has no second-order gradients (double backward): "
                                  f"its backward is hand-written and not differentiable; take gradients through "
                                  f"it without create_graph=True")


class _AttnQATRef(torch.autograd.Function):
    """Differentiable Attn-QAT on plain tensors (CPU training of the tiny model). ``dropin`` swaps in
    the paper's failing ablation: FP4 forward, standard high-precision backward with D from the FP4 O."""

    @staticmethod
    def forward(ctx, q, k, v, sm_scale, causal, p_bwd, dropin, q_smoothing, four_over_six):
        o, o_aux, m, l = attn_qat_forward_ref(q, k, v, sm_scale=sm_scale, causal=causal, training=not dropin,
                                              q_smoothing=q_smoothing, four_over_six=four_over_six)
        ctx.save_for_backward(q, k, v, o if dropin else o_aux, m, l)
        ctx.args = (sm_scale, causal, p_bwd, dropin, q_smoothing, four_over_six)
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        sm_scale, causal, p_bwd, dropin, q_smoothing, four_over_six = ctx.args
        refuse_double_backward("attn_qat_dropin" if dropin else "attn_qat")
        q, k, v, o_saved, m, l = ctx.saved_tensors
        if dropin:
            dq, dk, dv = attention_bwd_fp32(q, k, v, o_saved, do, sm_scale=sm_scale, causal=causal)
        else:
            dq, dk, dv = attn_qat_backward_ref(q, k, v, o_saved, do, m, l, sm_scale=sm_scale, causal=causal,
                                               p_bwd=p_bwd, q_smoothing=q_smoothing, four_over_six=four_over_six)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None


def attn_qat_attention_ref(q, k, v, *, sm_scale=None, causal=False, p_bwd: str = "final_max",
                           q_smoothing: bool = False, four_over_six: bool = False):
    """Reference ``attn_qat`` mode: FP4 forward, Attn-QAT backward (differentiable)."""
    return _AttnQATRef.apply(q, k, v, sm_scale, causal, p_bwd, False, q_smoothing, four_over_six)


def attn_qat_dropin_attention_ref(q, k, v, *, sm_scale=None, causal=False, q_smoothing: bool = False,
                                  four_over_six: bool = False):
    """Reference ``attn_qat_dropin`` mode: FP4 forward, high-precision FlashAttention-style backward (which
    ``q_smoothing`` and ``four_over_six`` leave as it is: without phi the smoothed logits are Q K^T)."""
    return _AttnQATRef.apply(q, k, v, sm_scale, causal, "final_max", True, q_smoothing, four_over_six)


def nvfp4_attention_ref(q, k, v, *, sm_scale=None, causal=False, q_smoothing: bool = False,
                        four_over_six: bool = False):
    """Reference ``nvfp4`` mode (naive FP4 attention, inference): the Attn-QAT forward without O'."""
    return attn_qat_forward_ref(q, k, v, sm_scale=sm_scale, causal=causal, training=False,
                                q_smoothing=q_smoothing, four_over_six=four_over_six)[0].to(q.dtype)


# ---------------------------------------------------------------------------------------------------
# SageAttention3, emulated (SPEC §3; inference only)
# ---------------------------------------------------------------------------------------------------

def sage3_smooth(q, k):
    """K_s = K - mean_tokens(K); per 128-row query block i: q̄_i = mean_rows(Q_i), Q_s = Q - q̄_i,
    ΔS_i = q̄_i K_s^T. Returns float32 (q_s, k_s, delta_s (B, H, ceil(Lq/128), Lk))."""
    kf = k.float()
    k_s = kf - kf.mean(dim=2, keepdim=True)
    q_s, q_bar, _ = q_block_means_ref(q)
    return q_s, k_s, q_bar @ k_s.transpose(-1, -2)


def sage3_attention_ref(q, k, v, *, sm_scale=None, causal=False, block_n: int = 64):
    """SageAttention3 emulated: S = (phi(Q_s) phi(K_s)^T + ΔS) * scale; P~ with the 2688 two-level
    scale; V quantized in blocks of 16 along tokens. Same online softmax as the FP4 modes (integer
    running max, so the result is tile-width free). Returns q's dtype."""
    scale = _scale(q, sm_scale)
    q_s, k_s, delta_s = sage3_smooth(q, k)
    qf, kf = fake_quant_nvfp4_ref(q_s), fake_quant_nvfp4_ref(k_s)
    vf = fake_quant_nvfp4_ref(v.float(), dim=2)
    s = (qf @ kf.transpose(-1, -2) + delta_s.repeat_interleave(SAGE3_Q_BLOCK, dim=2)[:, :, :q.shape[2]])
    s = s * (scale * LOG2E)
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    return _fp4_online_softmax(s, vf, block_n=block_n, training=False)[0].to(q.dtype)

# ---------------------------------------------------------------------------------------------------
# SageBwd (SPEC §4)
# ---------------------------------------------------------------------------------------------------
# Written from SPEC §4 with dequantized float32 matmuls (products of int8 codes summed over at most
# 128 terms are exact in float32). The tile arguments name the kernel's tiles because the P~, P and
# dS quantization blocks are the kernel's tiles; the defaults are the GPU tiles. psi(Q) and psi(dO) take
# one scale per SAGEBWD_Q_BLOCK = 128 rows, psi(K) and psi(V) one per SAGEBWD_K_BLOCK = 64 (formats.py).


def int8_round_ref(y: torch.Tensor) -> torch.Tensor:
    """Round half away from zero, exactly (in float64) for float32 ``y``."""
    y = y.double()
    return (torch.sign(y) * torch.floor(y.abs() + 0.5)).float()


def int8_fake_quant_ref(x: torch.Tensor, block_rows: int, block_cols: int | None = None) -> torch.Tensor:
    """psi(x) * s over (block_rows x block_cols) tiles of the last two dims (whole rows when
    ``block_cols`` is None): s = max(max|x|, 1e-30) / 127, codes round(x / s) in float32."""
    return block_fake_quant_ref(x, block_rows, block_cols, fmt="int8")


def e4m3_round_ref(y: torch.Tensor) -> torch.Tensor:
    """y rounded to e4m3 (round-to-nearest-even, saturating at 448) by torch's own float8 cast."""
    return y.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()


def block_fake_quant_ref(x: torch.Tensor, block_rows: int, block_cols: int | None = None,
                         fmt: str = "int8") -> torch.Tensor:
    """8-bit fake quantization over (block_rows x block_cols) tiles of the last two dims (whole rows when
    ``block_cols`` is None), one float32 scale per tile. ``fmt="int8"``: s = max(max|x|, 1e-30) / 127, codes
    round(x / s) half away from zero (psi); ``fmt="fp8"``: s = max(max|x|, 1e-30) / 448, codes e4m3(x / s)."""
    x = x.float()
    r, c = x.shape[-2:]
    bc = c if block_cols is None else block_cols
    pr, pc = (-r) % block_rows, (-c) % bc
    xp = torch.nn.functional.pad(x, (0, pc, 0, pr))
    t = xp.reshape(*x.shape[:-2], (r + pr) // block_rows, block_rows, (c + pc) // bc, bc)
    amax = t.abs().amax(dim=(-3, -1), keepdim=True).clamp_min(1e-30)
    if fmt == "int8":
        s = amax / 127.0
        codes = int8_round_ref(t / s)
    elif fmt == "fp8":
        s = amax / E4M3_MAX
        codes = e4m3_round_ref(t / s)
    else:
        raise ValueError(f"block_fake_quant_ref: fmt {fmt!r} not in ('int8', 'fp8')")
    return (codes * s).reshape(xp.shape)[..., :r, :c]


def _sagebwd_logits_ref(q, k, scale, causal, smooth_k, smooth_q):
    """S in log2 units from psi(Q_s), psi(K_s) (+ the Q-smoothing bias); also returns the unquantized
    Q_s, K_s and mean(Q) (or None)."""
    qf, kf = q.float(), k.float()
    ks = kf - kf.mean(dim=-2, keepdim=True) if smooth_k else kf
    qmean = qf.mean(dim=-2, keepdim=True) if smooth_q else None
    qs = qf - qmean if smooth_q else qf
    qd = int8_fake_quant_ref(qs, SAGEBWD_Q_BLOCK)
    kd = int8_fake_quant_ref(ks, SAGEBWD_K_BLOCK)
    s = (qd @ kd.transpose(-1, -2)) * (scale * LOG2E)
    if smooth_q:  # mean(Q) . K_s,j, unquantized: Q_s K_s^T + 1 mean(Q)^T K_s^T = Q K_s^T
        s = s + (qmean @ ks.transpose(-1, -2)) * (scale * LOG2E)
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    return s, qs, ks, qmean


def sagebwd_forward_ref(q, k, v, *, sm_scale=None, causal=False, smooth_k=True, smooth_q=False,
                        block_n: int = 64, pv: str = "int8"):
    """SageBwd forward (SPEC §4), tile by tile over ``block_n`` keys (the kernel's BLOCK_N).

    Per tile j with running max m_j: e = exp2(S_j - rowmax(S_j)) and c = exp2(rowmax(S_j) - m_j); l sums the
    unquantized P~ = c e. The P~ V matmul per ``pv``: ``"int8"`` psi(P~_j) = floor(127 e + 1/2) with row scale
    c / 127 and psi(V) per 64 rows; ``"fp8"`` e4m3(448 e) with row scale c / 448 and V in e4m3 per 64 rows
    (s = max / 448); ``"bf16"`` c e V unquantized (float32 here; the kernel rounds P~ to 16 bits).
    Return:
        o: (B, H, Lq, D) float32; lse: (B, H, Lq) float32, m + log2(l) (log2 units).
    """
    if pv not in SAGEBWD_PRECISIONS:
        raise ValueError(f"sagebwd_forward_ref: pv {pv!r} not in {SAGEBWD_PRECISIONS}")
    scale = _scale(q, sm_scale)
    s, _, _, _ = _sagebwd_logits_ref(q, k, scale, causal, smooth_k, smooth_q)
    vd = v.float() if pv == "bf16" else block_fake_quant_ref(v, SAGEBWD_K_BLOCK, fmt=pv)
    code_max = {"int8": 127.0, "fp8": E4M3_MAX, "bf16": 1.0}[pv]
    shape = q.shape[:-1]
    m = torch.full(shape, float("-inf"), device=q.device)
    l = torch.zeros(shape, device=q.device)
    o = torch.zeros(*shape, v.shape[-1], device=q.device)
    for j in range(0, k.shape[-2], block_n):
        s_j = s[..., j:j + block_n]
        rowmax = s_j.amax(dim=-1)
        m_new = torch.maximum(m, rowmax)
        e = torch.exp2(s_j - torch.where(rowmax == float("-inf"), 0.0, rowmax)[..., None])
        c = torch.exp2(rowmax - m_new)
        alpha = torch.exp2(m - m_new).nan_to_num(0.0)  # first tile: 2^(-inf - m_new) = 0
        if pv == "int8":
            p_codes = torch.floor(e * 127.0 + 0.5)
        elif pv == "fp8":
            p_codes = e4m3_round_ref(e * E4M3_MAX)
        else:
            p_codes = e
        l = alpha * l + e.sum(-1) * c
        o = alpha[..., None] * o + (p_codes @ vd[..., j:j + block_n, :]) * (c / code_max)[..., None]
        m = m_new
    return o / l[..., None], m + torch.log2(l)


def sagebwd_backward_ref(q, k, v, o, do, lse, *, sm_scale=None, causal=False, smooth_k=True, smooth_q=False,
                         block_m1: int = 64, block_n2: int = 64, bwd: str = "int8"):
    """SageBwd backward (SPEC §4) from the forward's ``o`` and ``lse``: INT8 S recompute; dP = dO V^T
    unquantized; dV, dQ, dK per ``bwd``. ``"int8"`` (SPEC) and ``"fp8"`` (e4m3, s = max / 448) quantize with
    the same blocks: P and dS for dV / dK per one key x ``block_m1`` queries (the kernel's BLOCK_M1), dS for
    dQ per one query x ``block_n2`` keys (BLOCK_N2), dO and Q_s per 128 rows, K_s per 64 rows. ``"bf16"``
    multiplies the unquantized P, dS with the caller's dO, Q, K (float32 here). Returns float32 (dq, dk, dv)."""
    if bwd not in SAGEBWD_PRECISIONS:
        raise ValueError(f"sagebwd_backward_ref: bwd {bwd!r} not in {SAGEBWD_PRECISIONS}")
    scale = _scale(q, sm_scale)
    s, qs, ks, qmean = _sagebwd_logits_ref(q, k, scale, causal, smooth_k, smooth_q)
    dof = do.float()
    p = torch.exp2(s - lse[..., None])
    delta = (dof * o.float()).sum(-1, keepdim=True)
    ds = p * (dof @ v.float().transpose(-1, -2) - delta)
    if bwd == "bf16":  # FlashAttention's gradient matmuls: dS^T Q needs no Q-smoothing term
        return ds @ k.float() * scale, ds.transpose(-1, -2) @ q.float() * scale, p.transpose(-1, -2) @ dof

    def fq(x, rows, cols=None):
        return block_fake_quant_ref(x, rows, cols, fmt=bwd)

    dv = fq(p, block_m1, 1).transpose(-1, -2) @ fq(dof, SAGEBWD_Q_BLOCK)
    dk = fq(ds, block_m1, 1).transpose(-1, -2) @ fq(qs, SAGEBWD_Q_BLOCK)
    if smooth_q:  # dS^T Q = dS^T Q_s + (dS^T 1) mean(Q)^T
        dk = dk + ds.sum(dim=-2)[..., None] * qmean
    dq = fq(ds, 1, block_n2) @ fq(ks, SAGEBWD_K_BLOCK)
    return dq * scale, dk * scale, dv


class _SageBwdRef(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sm_scale, causal, smooth_k, smooth_q, pv, bwd):
        o, lse = sagebwd_forward_ref(q, k, v, sm_scale=sm_scale, causal=causal, smooth_k=smooth_k,
                                     smooth_q=smooth_q, pv=pv)
        o = o.to(q.dtype)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args = dict(sm_scale=sm_scale, causal=causal, smooth_k=smooth_k, smooth_q=smooth_q, bwd=bwd)
        return o

    @staticmethod
    def backward(ctx, do):
        refuse_double_backward("sagebwd")
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = sagebwd_backward_ref(q, k, v, o, do, lse, **ctx.args)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None


def sagebwd_attention_ref(q, k, v, *, sm_scale=None, causal=False, smooth_k=True, smooth_q=False, pv="int8",
                          bwd="int8"):
    """Differentiable SageBwd on plain PyTorch (any device, any float dtype): the reference forward
    and, through autograd, the reference backward, with the kernel's ``pv`` and ``bwd`` options (GPU tiles).
    Returns q's dtype."""
    return _SageBwdRef.apply(q, k, v, sm_scale, causal, smooth_k, smooth_q, pv, bwd)
