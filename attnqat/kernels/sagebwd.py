"""SageBwd: trainable attention with six of its seven matmuls in INT8 (SPEC §4).

    psi(X) = round(X / s),  s = max|X| / 127 over a block,  int8, round half away from zero

    forward   S  = psi(Q) psi(K_s)^T     Q per 128-row block, K_s = K - mean(K) per 64-row block
              O  = psi(P~) psi(V)        P~ = exp(S_j - m_j) per row of a key tile,
                                         s = exp(rowmax(S_j) - m_j) / 127;  V per 64-row block
    backward  S  = psi(Q) psi(K_s)^T     the int8 Q, K and scales saved by the forward
              dV = psi(P)^T psi(dO)      P per block of 1 key x BLOCK_M1 queries, dO per 128-row block
              dP = dO V^T                bf16/fp16 operands, fp32 accumulation (dS is fragile)
              dQ = psi(dS) psi(K_s)      dS per block of 1 query x BLOCK_N2 keys
              dK = psi(dS)^T psi(Q)      dS per block of 1 key x BLOCK_M1 queries

The P and dS blocks are one row of the matmul's left operand (a scale there factors out of the
sum); a first version used whole (BLOCK_N1 x BLOCK_M1) tiles, which cost a cross-warp max per tile
and lost accuracy on small entries of P.

K-smoothing needs no backward change because rows of dS sum to zero (dS K = dS K_s). Optional
Q-smoothing (Q_s = Q - mean(Q)) adds the exact bias (mean(Q) . K_s,j) to every column of S and
dK += (dS^T 1) mean(Q)^T.

Layout of this file follows Triton's fused-attention tutorial: ``@triton.jit`` pieces by role
(``_quant_rows``, ``_attn_fwd_inner``, ``_attn_fwd``, ``_attn_bwd_preprocess``, ``_attn_bwd_dkdv``,
``_attn_bwd_dq``) -> launch configs -> the launchers :func:`sagebwd_forward` / :func:`sagebwd_backward` -> their
``torch.library`` custom ops (``attnqat::sagebwd_fwd`` / ``sagebwd_bwd``, with fake implementations, so
``torch.compile`` traces them) -> :class:`_SageBwdAttention` (autograd) -> :func:`sagebwd_unchecked` (the
registry's path) -> :func:`sagebwd_attention` (the checked public function).

Interpreter notes (tests run with ``TRITON_INTERPRET=1``): INT8 and FP8 ``tl.dot`` are exact there, a bf16
``tl.dot`` is not, and float->bf16/fp8 casts round wrongly (fp8: ties away from zero, subnormals off). So the
16-bit matmuls take their operand dtype from the launcher (fp32 under the interpreter), outputs go to fp32
buffers under the interpreter and are cast by torch, all rounding to int8 is explicit fp32 arithmetic, and
rounding to e4m3 is too when ``EXACT_FP8`` (the interpreter; the GPU's cast is the same RNE, saturating).

Matmul precisions actually used, per ``pv`` (forward P V) and ``bwd`` (backward dV, dQ, dK) option
(``"int8"`` for both is the SPEC default):

    ==============  ======  ======  =========================================
    matmul          int8    fp8     bf16
    ==============  ======  ======  =========================================
    fwd QK^T        int8    int8    int8                  (any pv)
    fwd PV  (pv)    int8    e4m3    16-bit: P~ unquantized, V original
    bwd S           int8    int8    int8                  (any bwd: the saved psi(Q), psi(K))
    bwd dP          16-bit  16-bit  16-bit                (any bwd)
    bwd dV  (bwd)   int8    e4m3    16-bit: P unquantized, dO original
    bwd dQ  (bwd)   int8    e4m3    16-bit: dS unquantized, K original
    bwd dK  (bwd)   int8    e4m3    16-bit: dS unquantized, Q original
    ==============  ======  ======  =========================================

e4m3 uses the same blocks as int8 with s = max|X| / 448 (P and dS per row of the left operand; dO, Q_s
per 128 rows; K_s, V per 64 rows): ``bwd="fp8"`` keeps e4m3 copies of Q_s and K_s (K-major) beside the
int8 ones that the S recompute needs. ``bwd="bf16"`` keeps the caller's Q and K instead (the three
gradient matmuls are then FlashAttention's). The 8-bit options exist for speed: an int8 ``tl.dot`` whose
left operand is made in registers is Triton 3.6's slow path on Hopper (SPEC §6), e4m3 may not be.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from . import hopper_gluon, hopper_sagebwd
from ._common import LaunchConfig, check_qkv, default_scale, interpreting, launch_fitting, pinned_config
from .formats import LOG2E, SAGEBWD_PRECISIONS  # the pv / bwd options, in the order of the PV / BWD constexprs
from .formats import SAGEBWD_K_BLOCK as K_BLOCK, SAGEBWD_Q_BLOCK as Q_BLOCK  # SPEC §4: 128 and 64 rows
from .reference import refuse_double_backward
from .smoothing import key_bias, token_mean
INT8_MAX = 127.0
FP8_MAX = 448.0  # e4m3's largest finite value
SCALE_FLOOR = 1e-30  # s = max(amax, 1e-30) / 127: an all-zero block quantizes to zeros, not NaN
KMAJOR_ALIGN = 16  # rows of the K-major (D, L) copies start 16 bytes apart: see _kmajor_len
_empty = torch.empty  # every kernel output is allocated here: tests swap in a poisoning allocator


@triton.jit
def _round_half_away(y):
    """round(y), ties away from zero, exactly: floor(|y|) is exact, so is |y| - floor(|y|); a plain
    floor(|y| + 0.5) would round the sum first and turn 0.49999997 into 1."""
    a = tl.abs(y)
    r = tl.floor(a)
    r = r + tl.where(a - r >= 0.5, 1.0, 0.0)
    return tl.where(y < 0.0, -r, r)


@triton.jit
def _round_e4m3(y):
    """y rounded to the nearest e4m3 value, ties to even, saturating at 448, in exact fp32 arithmetic (the
    interpreter's cast rounds ties away from zero and flushes subnormals). e4m3 has 3 mantissa bits: in the
    binade [2^e, 2^(e+1)) the step is 2^(e-3), and below the smallest normal 2^-6 the step stays 2^-9."""
    a = tl.minimum(tl.abs(y), 448.0)  # 448: FP8_MAX
    e = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) - 127, -6)  # the binade's exponent (a >= 0)
    step = ((e + 124) << 23).to(tl.float32, bitcast=True)  # 2^(e - 3): biased exponent e - 3 + 127
    r = a / step  # exact: a power-of-two division
    f = tl.floor(r)
    odd = f - 2.0 * tl.floor(f * 0.5)
    up = (r - f > 0.5) | ((r - f == 0.5) & (odd == 1.0))
    out = (f + tl.where(up, 1.0, 0.0)) * step
    return tl.where(y < 0.0, -out, out)


@triton.jit
def _to_fp8(y, EXACT_FP8: tl.constexpr):
    """y as e4m3 (RNE, saturating). On the GPU that is the cast itself (cvt.rn.satfinite); under the
    interpreter (EXACT_FP8) y is rounded by arithmetic first, so the cast only meets exact e4m3 values."""
    if EXACT_FP8:
        y = _round_e4m3(y)
    return y.to(tl.float8e4nv)


@triton.jit
def _quant_tile(x, FP8: tl.constexpr, EXACT_FP8: tl.constexpr):
    """psi(x) of a whole 2-D fp32 tile: (int8 tile, fp32 scale), or e4m3 codes with s = amax / 448 (FP8).
    A NaN or inf in the tile makes the scale NaN: int8 codes cannot hold it, and max and the floor's
    maximum ignore NaN (SPEC §1: it must propagate)."""
    amax = tl.maximum(tl.max(tl.max(tl.abs(x), axis=1), axis=0), 1e-30)  # 1e-30: SCALE_FLOOR
    amax += tl.sum(tl.sum(x * 0.0, axis=1), axis=0)
    if FP8:
        s = amax / 448.0  # 448: FP8_MAX
        xq = _to_fp8(x / s, EXACT_FP8)
    else:
        s = amax / 127.0
        xq = _round_half_away(x / s).to(tl.int8)
    return xq, s


@triton.jit
def _quant_tile_rows(x, FP8: tl.constexpr, EXACT_FP8: tl.constexpr):
    """psi(x) with one scale per row of a 2-D fp32 tile: (int8 tile, fp32 scales (rows,)), or e4m3 codes
    with s = row amax / 448 (FP8). A per-row scale of the left operand factors out of the matmul, and a row
    max stays inside a warp's quad (shuffles), where a whole-tile max needs a shared-memory round trip and a
    barrier per tile. A row holding NaN or inf gets a NaN scale (+ sum(x * 0): 0, or NaN), as in _quant_tile."""
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-30) + tl.sum(x * 0.0, axis=1)  # 1e-30: SCALE_FLOOR
    if FP8:
        s = amax / 448.0
        xq = _to_fp8(x / s[:, None], EXACT_FP8)
    else:
        s = amax / 127.0
        xq = _round_half_away(x / s[:, None]).to(tl.int8)
    return xq, s


@triton.jit
def _dot8(a, b, FP8: tl.constexpr):
    """An 8-bit matmul accumulated exactly-ish: int8 x int8 -> int32 (exact) or e4m3 x e4m3 -> fp32."""
    if FP8:
        c = tl.dot(a, b)
    else:
        c = tl.dot(a, b, out_dtype=tl.int32).to(tl.float32)
    return c


@triton.jit
def _quant_rows(X, MEAN, XQ, XQT, XS, L, n_blocks,
                BLK: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_MEAN: tl.constexpr, FP8: tl.constexpr,
                EXACT_FP8: tl.constexpr, ROW: tl.constexpr, COL: tl.constexpr):
    """Quantize one BLK-row block of a contiguous (B*H, L, D) tensor, minus its per-(b, h) channel
    mean when HAS_MEAN (smoothing). int8 with s = amax / 127, or e4m3 with s = amax / 448 (FP8).
    Writes XQ as (B*H, L, D) when ROW and XQT as (B*H, D, L) when COL (rows padded: _kmajor_len): Hopper's
    8-bit wgmma reads only K-contiguous operands, and matmuls that reduce over L want the transposed copy."""
    blk = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    rows = blk * BLK + tl.arange(0, BLK)
    cols = tl.arange(0, HEAD_DIM)
    offs = bh * L * HEAD_DIM + rows[:, None] * HEAD_DIM + cols[None, :]
    mask = rows[:, None] < L
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_MEAN:
        x = tl.where(mask, x - tl.load(MEAN + bh * HEAD_DIM + cols)[None, :], 0.0)
    xq, s = _quant_tile(x, FP8, EXACT_FP8)
    if ROW:
        tl.store(XQ + offs, xq, mask=mask)
    if COL:
        lp = _kmajor_len(L)  # rows L..lp - 1 get the codes of x = 0 (masked above): zeros
        tl.store(XQT + bh * lp * HEAD_DIM + cols[None, :] * lp + rows[:, None], xq, mask=rows[:, None] < lp)
    tl.store(XS + bh * n_blocks + blk, s)


@triton.jit
def _kmajor_len(L):
    """Row length of a K-major (D, L) 8-bit copy: L rounded up to 16 (KMAJOR_ALIGN); the padding holds zero
    codes. Rows then start 16-byte aligned and loads mask at a multiple of 16, both known to the compiler (a
    multiple of a constant). With a row stride and a mask of L itself, an L that is not a multiple of 16 (Wan's
    32,760) made Triton 3.6 load these tiles one byte per thread, outside the software pipeline (no cp.async)."""
    return (L + 15) // 16 * 16


@triton.jit
def _load_kv8(X8, bh, offs_n, offs_d, n_ok, L, HEAD_DIM: tl.constexpr, KMAJOR: tl.constexpr):
    """A (len(offs_n), D) 8-bit tile of (batch*head) ``bh`` that is the B operand of a matmul reducing over rows:
    from the transposed (D, L) copy, rows padded to _kmajor_len(L), when KMAJOR (K-contiguous, what 8-bit wgmma
    needs), else row-major (L, D). ``n_ok``: offs_n < L; the K-major load masks at the padded length instead
    (16-byte vectors), reading the padding's zero codes."""
    if KMAJOR:
        lp = _kmajor_len(L)
        return tl.trans(tl.load(X8 + bh * lp * HEAD_DIM + offs_d[:, None] * lp + offs_n[None, :],
                                mask=offs_n[None, :] < lp, other=0))
    else:
        return tl.load(X8 + bh * L * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :], mask=n_ok[:, None],
                       other=0)


@triton.jit
def _attn_fwd_inner(acc, l_i, m_i, q, row_scale, K8, V8, SK, SV, BIAS, bh, kv_base, ks_base, offs_m, lo, hi, Lk,
                    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, KBLK: tl.constexpr,
                    CAUSAL_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, PV: tl.constexpr, KMAJOR: tl.constexpr,
                    EXACT_FP8: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """Key tiles [lo, hi) of one query block. CAUSAL_MASK: constexpr so tiles wholly below the
    diagonal skip the compare; ragged key tails are masked through ``colterm`` (-inf) instead."""
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < Lk
        kT = tl.load(K8 + kv_base + offs_n[None, :] * HEAD_DIM + offs_d[:, None], mask=n_ok[None, :], other=0)
        sk = tl.load(SK + ks_base + start_n // KBLK)  # BLOCK_N divides KBLK: one K scale per tile
        colterm = tl.where(n_ok, 0.0, float("-inf"))
        if HAS_BIAS:
            colterm += tl.load(BIAS + kv_base // HEAD_DIM + offs_n, mask=n_ok, other=0.0)  # (B*H, Lk)
        s = tl.dot(q, kT, out_dtype=tl.int32).to(tl.float32) * (row_scale * sk)[:, None] + colterm[None, :]
        if CAUSAL_MASK:
            s = tl.where(offs_n[None, :] <= offs_m[:, None], s, float("-inf"))
        rowmax = tl.max(s, 1)
        m_new = tl.maximum(m_i, rowmax)
        # rows with no visible key in this tile: exponentiate against 0 so e = 0, not NaN
        e = tl.exp2(s - tl.where(rowmax == float("-inf"), 0.0, rowmax)[:, None])
        c = tl.exp2(rowmax - m_new)  # max of this tile's P~ row: exp(rowmax(S_j) - m_j)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(e, 1) * c
        acc = acc * alpha[:, None]
        if PV == 0:  # int8: psi(P~) = round(127 e) with s = c / 127; e >= 0 so floor(x + .5) suffices
            p8 = tl.floor(e * 127.0 + 0.5).to(tl.int8)
            v = _load_kv8(V8, bh, offs_n, offs_d, n_ok, Lk, HEAD_DIM, KMAJOR)
            sv = tl.load(SV + ks_base + start_n // KBLK)
            acc += tl.dot(p8, v, out_dtype=tl.int32).to(tl.float32) * (c * (sv / 127.0))[:, None]
        elif PV == 1:  # fp8 e4m3: P~ / s = 448 e, s = c / 448
            p8 = _to_fp8(e * 448.0, EXACT_FP8)
            v = _load_kv8(V8, bh, offs_n, offs_d, n_ok, Lk, HEAD_DIM, KMAJOR).to(tl.float8e4nv, bitcast=True)
            sv = tl.load(SV + ks_base + start_n // KBLK)
            acc += tl.dot(p8, v) * (c * (sv / 448.0))[:, None]
        else:  # 16-bit (fp32 under the interpreter): V8 is the original V, P~ = e * c unquantized
            v = tl.load(V8 + kv_base + offs_n[:, None] * HEAD_DIM + offs_d[None, :], mask=n_ok[:, None], other=0.0)
            acc += tl.dot((e * c[:, None]).to(DOT_DTYPE), v.to(DOT_DTYPE))
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(Q8, K8, V8, SQ, SK, SV, BIAS, Out, LSE, Lq, Lk, qk_scale, nq_blocks, nk_blocks,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
              QBLK: tl.constexpr, KBLK: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr,
              PV: tl.constexpr, KMAJOR: tl.constexpr, EXACT_FP8: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """One program per (BLOCK_M query rows, batch*head). Writes O (Out's dtype) and the log2-domain
    log-sum-exp LSE = m + log2(l) that the backward recomputes P with."""
    tl.static_assert(KBLK % BLOCK_N == 0)  # one K (and V) scale per key tile
    tl.static_assert(BLOCK_M % BLOCK_N == 0)  # causal: the diagonal starts on a tile boundary
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    m_ok = offs_m < Lq
    q = tl.load(Q8 + bh * Lq * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :], mask=m_ok[:, None], other=0)
    row_scale = tl.load(SQ + bh * nq_blocks + offs_m // QBLK, mask=m_ok, other=0.0) * qk_scale
    kv_base = bh * Lk * HEAD_DIM
    ks_base = bh * nk_blocks
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    if CAUSAL:  # top-left aligned: row i sees keys 0..i
        hi_full = tl.minimum(start_m, Lk)
    else:
        hi_full = Lk
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, row_scale, K8, V8, SK, SV, BIAS, bh, kv_base, ks_base, offs_m,
                                    0, hi_full, Lk, BLOCK_N, HEAD_DIM, KBLK, False, HAS_BIAS, PV, KMAJOR,
                                    EXACT_FP8, DOT_DTYPE)
    if CAUSAL:
        acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, row_scale, K8, V8, SK, SV, BIAS, bh, kv_base, ks_base,
                                        offs_m, hi_full, tl.minimum(start_m + BLOCK_M, Lk), Lk,
                                        BLOCK_N, HEAD_DIM, KBLK, True, HAS_BIAS, PV, KMAJOR, EXACT_FP8, DOT_DTYPE)
    o = acc / l_i[:, None]
    tl.store(LSE + bh * Lq + offs_m, m_i + tl.log2(l_i), mask=m_ok)
    tl.store(Out + bh * Lq * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :],
             o.to(Out.dtype.element_ty), mask=m_ok[:, None])


@triton.jit
def _attn_bwd_preprocess(O, DO, DELTA, DO8, SDO, Lq, n_blocks,
                         BLK: tl.constexpr, HEAD_DIM: tl.constexpr, KMAJOR: tl.constexpr, BWD: tl.constexpr,
                         EXACT_FP8: tl.constexpr):
    """Delta = rowsum(dO * O), and psi(dO) per BLK-row block (used by dV = P^T dO) unless BWD == 2
    (16-bit dV reads dO itself): int8 codes (BWD 0) or e4m3 codes with s = amax / 448 (BWD 1)."""
    blk = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    rows = blk * BLK + tl.arange(0, BLK)
    cols = tl.arange(0, HEAD_DIM)
    offs = bh * Lq * HEAD_DIM + rows[:, None] * HEAD_DIM + cols[None, :]
    mask = rows[:, None] < Lq
    o = tl.load(O + offs, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(DELTA + bh * Lq + rows, tl.sum(o * do, 1), mask=rows < Lq)
    if BWD != 2:
        do8, s = _quant_tile(do, BWD == 1, EXACT_FP8)
        if KMAJOR:  # (B*H, D, Lq), rows padded (_kmajor_len): dV = P^T dO reduces over Lq
            lp = _kmajor_len(Lq)  # rows Lq..lp - 1: zero codes (dO masked to 0)
            tl.store(DO8 + bh * lp * HEAD_DIM + cols[None, :] * lp + rows[:, None], do8, mask=rows[:, None] < lp)
        else:
            tl.store(DO8 + offs, do8, mask=mask)
        tl.store(SDO + bh * n_blocks + blk, s)


@triton.jit
def _grad_mma(acc, ds, XB, SXB, bh, xs_base, offs, ok, L, start, x8T, sx, HEAD_DIM: tl.constexpr,
              XBLK: tl.constexpr, DOT_DTYPE: tl.constexpr, KMAJOR: tl.constexpr, BWD: tl.constexpr,
              EXACT_FP8: tl.constexpr):
    """acc += dS X, the backward's two gradient matmuls (dK = dS^T Q in the dK/dV kernel, whose dS is already
    transposed; dQ = dS K in the dQ kernel). X's rows ``offs`` (``ok``: inside L) of (batch*head) ``bh`` start
    at ``start``.
    BWD 2: 16-bit, X = XB, the caller's Q or K. Else psi(dS) psi(X) (1: e4m3, 0: int8) with one scale per row of
    dS: X8 from XB (K-major int8 or e4m3 copy; e4m3 scales in SXB per XBLK rows) or, int8 row-major, the
    transposed tile ``x8T`` the S recompute loaded, with its scale ``sx``."""
    offs_d = tl.arange(0, HEAD_DIM)
    if BWD == 2:
        xb = tl.load(XB + bh * L * HEAD_DIM + offs[:, None] * HEAD_DIM + offs_d[None, :], mask=ok[:, None], other=0.0)
        acc += tl.dot(ds.to(DOT_DTYPE), xb.to(DOT_DTYPE))
    else:
        ds8, sds = _quant_tile_rows(ds, BWD == 1, EXACT_FP8)
        if KMAJOR:
            xb = _load_kv8(XB, bh, offs, offs_d, ok, L, HEAD_DIM, True)
        elif BWD == 1:
            xb = _load_kv8(XB, bh, offs, offs_d, ok, L, HEAD_DIM, False)
        else:
            xb = tl.trans(x8T)
        if BWD == 1:
            xb = xb.to(tl.float8e4nv, bitcast=True)
            sxb = tl.load(SXB + xs_base + start // XBLK)
        else:
            sxb = sx
        acc += _dot8(ds8, xb, BWD == 1) * (sds * sxb)[:, None]
    return acc


@triton.jit
def _attn_bwd_dkdv_inner(dk, dv, colsum, k8, v, row_scale, colterm, Q8, QB, SQ, SQB, DO, DOB, SDO, LSE, DELTA,
                         bh, q_base, qs_base, offs_n, lo, hi, Lq,
                         BLOCK_M1: tl.constexpr, HEAD_DIM: tl.constexpr, QBLK: tl.constexpr,
                         CAUSAL_MASK: tl.constexpr, SMOOTH_Q: tl.constexpr, DOT_DTYPE: tl.constexpr,
                         KMAJOR: tl.constexpr, BWD: tl.constexpr, EXACT_FP8: tl.constexpr):
    offs_d = tl.arange(0, HEAD_DIM)
    for start_m in range(lo, hi, BLOCK_M1):
        offs_m = start_m + tl.arange(0, BLOCK_M1)
        m_ok = offs_m < Lq
        qT = tl.load(Q8 + q_base + offs_m[None, :] * HEAD_DIM + offs_d[:, None], mask=m_ok[None, :], other=0)
        sq = tl.load(SQ + qs_base + start_m // QBLK)  # BLOCK_M1 divides QBLK: one Q (and dO) scale per tile
        sT = tl.dot(k8, qT, out_dtype=tl.int32).to(tl.float32) * (row_scale * sq)[:, None] + colterm[:, None]
        if CAUSAL_MASK:
            sT = tl.where(offs_m[None, :] >= offs_n[:, None], sT, float("-inf"))
        lse = tl.load(LSE + q_base // HEAD_DIM + offs_m, mask=m_ok, other=float("inf"))  # inf: P = 0 past Lq
        pT = tl.exp2(sT - lse[None, :])
        delta = tl.load(DELTA + q_base // HEAD_DIM + offs_m, mask=m_ok, other=0.0)
        if BWD == 2:  # dV += P^T dO, 16-bit; dO is loaded once, and transposed for dP as in the tutorial
            do = tl.load(DO + q_base + offs_m[:, None] * HEAD_DIM + offs_d[None, :], mask=m_ok[:, None],
                         other=0.0).to(DOT_DTYPE)
            dv += tl.dot(pT.to(DOT_DTYPE), do)
            dpT = tl.dot(v, tl.trans(do))
        else:  # dV += psi(P)^T psi(dO), int8 or e4m3
            p8, sp = _quant_tile_rows(pT, BWD == 1, EXACT_FP8)  # one scale per key over the BLOCK_M1 queries
            do8 = _load_kv8(DOB, bh, offs_m, offs_d, m_ok, Lq, HEAD_DIM, KMAJOR)
            if BWD == 1:
                do8 = do8.to(tl.float8e4nv, bitcast=True)
            sdo = tl.load(SDO + qs_base + start_m // QBLK)
            dv += _dot8(p8, do8, BWD == 1) * (sp * sdo)[:, None]
            # dP^T = V dO^T in 16-bit: the one matmul SageBwd keeps out of 8 bits
            doT = tl.load(DO + q_base + offs_m[None, :] * HEAD_DIM + offs_d[:, None], mask=m_ok[None, :], other=0.0)
            dpT = tl.dot(v, doT.to(DOT_DTYPE))
        dsT = pT * (dpT - delta[None, :])
        if SMOOTH_Q:
            colsum += tl.sum(dsT, 1)
        # dK += dS^T Q (bf16: the caller's Q, so no Q-smoothing correction) or psi(dS)^T psi(Q_s)
        dk = _grad_mma(dk, dsT, QB, SQB, bh, qs_base, offs_m, m_ok, Lq, start_m, qT, sq, HEAD_DIM, QBLK,
                       DOT_DTYPE, KMAJOR, BWD, EXACT_FP8)
    return dk, dv, colsum


@triton.jit
def _attn_bwd_dkdv(Q8, QB, K8, V, SQ, SQB, SK, BIAS, QMEAN, DO, DOB, SDO, LSE, DELTA, DK, DV,
                   Lq, Lk, qk_scale, sm_scale, nq_blocks, nk_blocks,
                   BLOCK_M1: tl.constexpr, BLOCK_N1: tl.constexpr, HEAD_DIM: tl.constexpr,
                   QBLK: tl.constexpr, KBLK: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                   DOT_DTYPE: tl.constexpr, KMAJOR: tl.constexpr, BWD: tl.constexpr, EXACT_FP8: tl.constexpr,
                   DK_MEAN_TERM: tl.constexpr):
    """One program per (BLOCK_N1 keys, batch*head): dK and dV of those keys, looping over queries.

    dK's B operand QB is psi(Q_s): int8 (BWD 0; K-major copy, or Q8 itself when not KMAJOR) or e4m3 (BWD 1,
    scales SQB), or the caller's Q (BWD 2). dV's DOB is psi(dO) (BWD 0, 1; scales SDO); BWD 2 reads DO.
    DK_MEAN_TERM: Q-smoothing with a quantized Q_s operand adds (dS^T 1) mean(Q)^T."""
    tl.static_assert(QBLK % BLOCK_M1 == 0)
    tl.static_assert(BLOCK_N1 % BLOCK_M1 == 0)  # causal: the diagonal starts on a tile boundary
    start_n = tl.program_id(0) * BLOCK_N1
    bh = tl.program_id(1).to(tl.int64)
    offs_n = start_n + tl.arange(0, BLOCK_N1)
    offs_d = tl.arange(0, HEAD_DIM)
    n_ok = offs_n < Lk
    kv_offs = bh * Lk * HEAD_DIM + offs_n[:, None] * HEAD_DIM + offs_d[None, :]
    k8 = tl.load(K8 + kv_offs, mask=n_ok[:, None], other=0)
    v = tl.load(V + kv_offs, mask=n_ok[:, None], other=0.0).to(DOT_DTYPE)
    row_scale = tl.load(SK + bh * nk_blocks + offs_n // KBLK, mask=n_ok, other=0.0) * qk_scale
    colterm = tl.where(n_ok, 0.0, float("-inf"))  # keys past Lk get P = 0
    if HAS_BIAS:
        colterm += tl.load(BIAS + bh * Lk + offs_n, mask=n_ok, other=0.0)
    dk = tl.zeros([BLOCK_N1, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N1, HEAD_DIM], tl.float32)
    colsum = tl.zeros([BLOCK_N1], tl.float32)
    q_base = bh * Lq * HEAD_DIM
    qs_base = bh * nq_blocks
    if CAUSAL:  # queries >= start_n see these keys; the first BLOCK_N1 of them straddle the diagonal
        lo_full = start_n + BLOCK_N1
        dk, dv, colsum = _attn_bwd_dkdv_inner(dk, dv, colsum, k8, v, row_scale, colterm, Q8, QB, SQ, SQB, DO, DOB,
                                              SDO, LSE, DELTA, bh, q_base, qs_base, offs_n, start_n,
                                              tl.minimum(lo_full, Lq), Lq, BLOCK_M1, HEAD_DIM, QBLK,
                                              True, DK_MEAN_TERM, DOT_DTYPE, KMAJOR, BWD, EXACT_FP8)
    else:
        lo_full = 0
    dk, dv, colsum = _attn_bwd_dkdv_inner(dk, dv, colsum, k8, v, row_scale, colterm, Q8, QB, SQ, SQB, DO, DOB,
                                          SDO, LSE, DELTA, bh, q_base, qs_base, offs_n, lo_full, Lq, Lq,
                                          BLOCK_M1, HEAD_DIM, QBLK, False, DK_MEAN_TERM, DOT_DTYPE, KMAJOR, BWD,
                                          EXACT_FP8)
    if DK_MEAN_TERM:  # Q-smoothing: dK = dS^T Q_s + (dS^T 1) mean(Q)^T
        dk += colsum[:, None] * tl.load(QMEAN + bh * HEAD_DIM + offs_d)[None, :]
    tl.store(DK + kv_offs, (dk * sm_scale).to(DK.dtype.element_ty), mask=n_ok[:, None])
    tl.store(DV + kv_offs, dv.to(DV.dtype.element_ty), mask=n_ok[:, None])


@triton.jit
def _attn_bwd_dq_inner(dq, q8, do, row_scale, lse, delta, K8, KB, V, SK, SKB, BIAS, bh, kv_base, ks_base, offs_m,
                       lo, hi, Lk, BLOCK_N2: tl.constexpr, HEAD_DIM: tl.constexpr, KBLK: tl.constexpr,
                       CAUSAL_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_DTYPE: tl.constexpr,
                       KMAJOR: tl.constexpr, BWD: tl.constexpr, EXACT_FP8: tl.constexpr):
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in range(lo, hi, BLOCK_N2):
        offs_n = start_n + tl.arange(0, BLOCK_N2)
        n_ok = offs_n < Lk
        kT = tl.load(K8 + kv_base + offs_n[None, :] * HEAD_DIM + offs_d[:, None], mask=n_ok[None, :], other=0)
        vT = tl.load(V + kv_base + offs_n[None, :] * HEAD_DIM + offs_d[:, None], mask=n_ok[None, :], other=0.0)
        sk = tl.load(SK + ks_base + start_n // KBLK)  # BLOCK_N2 divides KBLK: one K scale per tile
        colterm = tl.where(n_ok, 0.0, float("-inf"))
        if HAS_BIAS:
            colterm += tl.load(BIAS + kv_base // HEAD_DIM + offs_n, mask=n_ok, other=0.0)
        s = tl.dot(q8, kT, out_dtype=tl.int32).to(tl.float32) * (row_scale * sk)[:, None] + colterm[None, :]
        if CAUSAL_MASK:
            s = tl.where(offs_n[None, :] <= offs_m[:, None], s, float("-inf"))
        p = tl.exp2(s - lse[:, None])
        dp = tl.dot(do, vT.to(DOT_DTYPE))  # 16-bit dP = dO V^T
        ds = p * (dp - delta[:, None])
        # dQ += dS K (bf16: the caller's K) or psi(dS) psi(K_s): rows of dS sum to 0, so dS K = dS K_s
        dq = _grad_mma(dq, ds, KB, SKB, bh, ks_base, offs_n, n_ok, Lk, start_n, kT, sk, HEAD_DIM, KBLK,
                       DOT_DTYPE, KMAJOR, BWD, EXACT_FP8)
    return dq


@triton.jit
def _attn_bwd_dq(Q8, K8, KB, V, SQ, SK, SKB, BIAS, DO, LSE, DELTA, DQ, Lq, Lk, qk_scale, sm_scale, nq_blocks,
                 nk_blocks, BLOCK_M2: tl.constexpr, BLOCK_N2: tl.constexpr, HEAD_DIM: tl.constexpr,
                 QBLK: tl.constexpr, KBLK: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr,
                 DOT_DTYPE: tl.constexpr, KMAJOR: tl.constexpr, BWD: tl.constexpr, EXACT_FP8: tl.constexpr):
    """One program per (BLOCK_M2 queries, batch*head): dQ of those queries, looping over keys. dQ's B
    operand KB is psi(K_s): int8 (BWD 0; K-major copy, or K8 itself when not KMAJOR) or e4m3 (BWD 1, scales
    SKB), or the caller's K (BWD 2)."""
    tl.static_assert(KBLK % BLOCK_N2 == 0)
    tl.static_assert(BLOCK_M2 % BLOCK_N2 == 0)
    start_m = tl.program_id(0) * BLOCK_M2
    bh = tl.program_id(1).to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M2)
    offs_d = tl.arange(0, HEAD_DIM)
    m_ok = offs_m < Lq
    q_offs = bh * Lq * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    q8 = tl.load(Q8 + q_offs, mask=m_ok[:, None], other=0)
    do = tl.load(DO + q_offs, mask=m_ok[:, None], other=0.0).to(DOT_DTYPE)
    row_scale = tl.load(SQ + bh * nq_blocks + offs_m // QBLK, mask=m_ok, other=0.0) * qk_scale
    lse = tl.load(LSE + bh * Lq + offs_m, mask=m_ok, other=float("inf"))  # inf: P = 0 past Lq
    delta = tl.load(DELTA + bh * Lq + offs_m, mask=m_ok, other=0.0)
    dq = tl.zeros([BLOCK_M2, HEAD_DIM], tl.float32)
    kv_base = bh * Lk * HEAD_DIM
    ks_base = bh * nk_blocks
    if CAUSAL:
        hi_full = tl.minimum(start_m, Lk)
    else:
        hi_full = Lk
    dq = _attn_bwd_dq_inner(dq, q8, do, row_scale, lse, delta, K8, KB, V, SK, SKB, BIAS, bh, kv_base, ks_base,
                            offs_m, 0, hi_full, Lk, BLOCK_N2, HEAD_DIM, KBLK, False, HAS_BIAS, DOT_DTYPE, KMAJOR, BWD,
                            EXACT_FP8)
    if CAUSAL:
        dq = _attn_bwd_dq_inner(dq, q8, do, row_scale, lse, delta, K8, KB, V, SK, SKB, BIAS, bh, kv_base, ks_base,
                                offs_m, hi_full, tl.minimum(start_m + BLOCK_M2, Lk), Lk, BLOCK_N2, HEAD_DIM, KBLK,
                                True, HAS_BIAS, DOT_DTYPE, KMAJOR, BWD, EXACT_FP8)
    tl.store(DQ + q_offs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=m_ok[:, None])


# ---------------------------------------------------------------------------------------------------
# Launch configs
# ---------------------------------------------------------------------------------------------------

# Fixed tiles, one place. Constraints (static_asserts above): fwd BLOCK_N and dQ's BLOCK_N2 divide
# K_BLOCK=64 (one K/V scale per reduction tile); dK/dV's BLOCK_M1 divides Q_BLOCK=128; the int8 MMA
# needs a reduction of >= 32. The tile shapes also define the P and dS quantization blocks, so the
# reference takes them as arguments (see :func:`launch_configs`).
_GPU_CONFIGS = {  # (fwd, dkdv, dq) for head_dim 64 / 128 on Hopper
    64: (LaunchConfig(128, 64, 4, 3), LaunchConfig(64, 128, 8, 2), LaunchConfig(128, 64, 8, 2)),
    128: (LaunchConfig(128, 64, 8, 3), LaunchConfig(64, 128, 8, 2), LaunchConfig(128, 64, 8, 2)),
}
# 16-bit matmuls (pv="bf16" for the forward, bwd="bf16" for dK/dV and dQ) have no quantization block to keep and
# want smaller tiles: measured on an H100 at (1, 40, 32760, 128), experiments/sagebwd_variants.py (docs/sagebwd.md):
# fwd 45.6 -> 39.2 ms with 4 warps; fwd+bwd 222 -> 212 ms (dK/dV 32x64, 4 stages) and 211 ms (dQ 128x32).
_GPU_CONFIGS_16BIT = {
    64: _GPU_CONFIGS[64],  # not measured at head_dim 64: the 8-bit tiles
    128: (LaunchConfig(128, 64, 4, 3), LaunchConfig(32, 64, 4, 4), LaunchConfig(128, 32, 4, 3)),
}
# Interpreter: small tiles so the odd test sizes cross several tiles and both causal loop phases.
_INTERP_CONFIGS = (LaunchConfig(64, 32), LaunchConfig(32, 64), LaunchConfig(64, 32))
_ENV = ("ATTNQAT_SAGEBWD_FWD_CONFIG", "ATTNQAT_SAGEBWD_DKDV_CONFIG", "ATTNQAT_SAGEBWD_DQ_CONFIG")


def launch_configs(head_dim: int, pv: str = "int8", bwd: str = "int8") -> dict[str, LaunchConfig]:
    """The tiles the next launch will use: ``{"fwd": .., "dkdv": .., "dq": ..}`` (the 16-bit ones for
    ``pv="bf16"`` / ``bwd="bf16"``). Each can be pinned
    with ``ATTNQAT_SAGEBWD_{FWD,DKDV,DQ}_CONFIG="BLOCK_M,BLOCK_N[,WARPS[,STAGES]]"`` (for dK/dV the
    first number is BLOCK_M1 (queries), the second BLOCK_N1 (keys))."""
    if interpreting():
        base = _INTERP_CONFIGS
    else:
        eight, sixteen = _GPU_CONFIGS[head_dim], _GPU_CONFIGS_16BIT[head_dim]
        base = (sixteen if pv == "bf16" else eight)[:1] + (sixteen if bwd == "bf16" else eight)[1:]
    out = {}
    for name, cfg, env in zip(("fwd", "dkdv", "dq"), base, _ENV):
        out[name] = pinned_config(env) or cfg
    f, kv, dq = out["fwd"], out["dkdv"], out["dq"]
    if K_BLOCK % f.block_n or f.block_m % f.block_n:
        raise ValueError(f"sagebwd fwd config {f}: BLOCK_N must divide {K_BLOCK} and BLOCK_M")
    if Q_BLOCK % kv.block_m or kv.block_n % kv.block_m:
        raise ValueError(f"sagebwd dkdv config {kv}: BLOCK_M1 must divide {Q_BLOCK} and BLOCK_N1")
    if K_BLOCK % dq.block_n or dq.block_m % dq.block_n:
        raise ValueError(f"sagebwd dq config {dq}: BLOCK_N2 must divide {K_BLOCK} and BLOCK_M2")
    return out


def step_down(cfg: LaunchConfig, keep: str) -> tuple[LaunchConfig, ...]:
    """Smaller configs to try, in order, when ``cfg`` needs more shared memory than the GPU has (see
    ``_common.launch_fitting``): fewer stages (2), then half the other tile side with 4 warps, then both
    sides equal and 1 stage. The side named by ``keep`` (``"m"``: BLOCK_M, ``"n"``: BLOCK_N) never changes:
    it is a quantization block (fwd BLOCK_N: P~ per row of a key tile; dK/dV BLOCK_M1: P and dS per key over
    BLOCK_M1 queries; dQ BLOCK_N2: dS per query over BLOCK_N2 keys), so every step computes the same
    function. The other side only groups work per program and stays a multiple of the kept one, as the
    kernels' static_asserts require. Under the interpreter the GPU tiles' steps give bit-identical outputs;
    with 32-wide tiles a rare element moves by an fp32 ulp (numpy's fp32 dot for the 16-bit dP sums in a
    shape-dependent order).

    Measured by compiling for sm_80/86/90 on the CPU with Triton 3.6 (head_dim 128): the tuned configs need at
    most 91 KB on sm_80/sm_86 and 132 KB on sm_90 (dK/dV, its K-major loads pipelined), inside every GPU's
    limit, so this is insurance for pinned or retuned configs and other GPUs and Triton versions; no GPU has
    run it."""
    kept = cfg.block_m if keep == "m" else cfg.block_n
    free = cfg.block_n if keep == "m" else cfg.block_m

    def make(other, warps, stages):
        return LaunchConfig(kept, other, warps, stages) if keep == "m" else LaunchConfig(other, kept, warps, stages)

    steps = (make(free, cfg.num_warps, min(cfg.num_stages, 2)),
             make(max(kept, free // 2), 4, min(cfg.num_stages, 2)),
             make(kept, 4, 1))
    return tuple(c for c in dict.fromkeys(steps) if c != cfg)


def _gluon(device: torch.device, head_dim: int, precision: str, km: bool, smooth_q: bool, pins: tuple[str, ...],
           what: str, option: str) -> tuple[bool, str]:
    """gluon_forward's and gluon_backward's one decision (``precision``: the value of ``option``, pv or bwd;
    ``pins``: the launch-config variables of the Triton kernels it would replace)."""
    if not (precision == "int8" and km and not smooth_q and head_dim in hopper_gluon.HEAD_DIMS):
        return False, f"the Gluon {what} covers {option}='int8' with K-major copies, no smooth_q, head_dim 64 or 128"
    pinned = [name for name in pins if os.environ.get(name)]
    if pinned:
        return False, f"{' and '.join(pinned)} pin the Triton kernels' launch config"
    if os.environ.get(hopper_gluon.GLUON_ENV, "1") == "0":
        return False, f"{hopper_gluon.GLUON_ENV}=0"
    return hopper_gluon.available_or_warn(device, "sagebwd's forward and backward")


def gluon_forward(device: torch.device, head_dim: int, pv: str, km: bool, smooth_q: bool) -> tuple[bool, str]:
    """Whether :func:`sagebwd_forward` runs the Gluon sm_90 forward (``hopper_sagebwd``, the same numbers) instead of
    the Triton one, and why not: for the SPEC's int8 P V (``pv="int8"``) reading K-major copies, without
    Q-smoothing, at head_dim 64 or 128, on an sm_90 GPU where Gluon runs; not with ATTNQAT_GLUON=0 nor with the
    forward's launch config pinned (which asks for the Triton kernel)."""
    return _gluon(device, head_dim, pv, km, smooth_q, _ENV[:1], "forward", "pv")


def gluon_backward(device: torch.device, head_dim: int, bwd: str, km: bool, smooth_q: bool) -> tuple[bool, str]:
    """Whether :func:`sagebwd_backward` runs the Gluon sm_90 dK/dV and dQ kernels (``hopper_sagebwd``, the same
    numbers) instead of the Triton ones, and why not: they cover the SPEC's int8 backward (``bwd="int8"``) reading
    K-major copies, without Q-smoothing, at head_dim 64 or 128, on an sm_90 GPU where Gluon runs; not with
    ATTNQAT_GLUON=0 nor with a dK/dV or dQ launch config pinned (which asks for the Triton kernels)."""
    return _gluon(device, head_dim, bwd, km, smooth_q, _ENV[1:], "backward", "bwd")


def kmajor() -> bool:
    """Whether the kernels read the B operand of every L-reducing 8-bit matmul (P V, P^T dO, dS^T Q,
    dS K) from a transposed (D, L) int8 copy. Default on; ``ATTNQAT_SAGEBWD_KMAJOR=0`` reads the
    row-major copy through ``tl.trans`` instead: an ablation kept for tests/test_sagebwd.py and the benchmarks
    that time it (experiments/run_sagebwd_gpu.sh, experiments/sagebwd_variants.py)."""
    return os.environ.get("ATTNQAT_SAGEBWD_KMAJOR", "1") != "0"


def _kmajor_rows(n: int) -> int:
    """The row length of a K-major copy of n rows: n rounded up to KMAJOR_ALIGN (the kernels' _kmajor_len)."""
    return triton.cdiv(n, KMAJOR_ALIGN) * KMAJOR_ALIGN


def kmajor_empty(b: int, h: int, d: int, n: int, *, dtype: torch.dtype, device, empty=None) -> torch.Tensor:
    """An uninitialised (b, h, d, n) K-major copy as the kernels read it: a view of (b, h, d, n rounded up to
    KMAJOR_ALIGN), so that its rows start 16 bytes apart (``_kmajor_len``; the kernel that fills it writes zero
    codes into the padding); ``empty``: the allocator (``torch.empty`` or a fake implementation's
    ``new_empty``)."""
    padded = (empty or _empty)((b, h, d, _kmajor_rows(n)), dtype=dtype, device=device)
    return padded[..., :n]


def _as_kmajor(x: torch.Tensor) -> torch.Tensor:
    """x, a (B, H, D, L) K-major copy, laid out as :func:`kmajor_empty` makes one (what the kernels assume): x
    itself when it is, else a copy."""
    b, h, d, n = x.shape
    row = _kmajor_rows(n)
    if x.stride() == (h * d * row, d * row, row, 1):
        return x
    out = kmajor_empty(b, h, d, n, dtype=x.dtype, device=x.device)
    out.copy_(x)
    out.as_strided((b, h, d, row), out.stride())[..., n:].zero_()  # the padding the kernels read: zero codes
    return out


def quantize_int8_rows(x: torch.Tensor, block: int, mean: torch.Tensor | None = None, fp8: bool = False,
                       row: bool = True, col: bool = False):
    """psi(x - mean) per ``block`` rows of a contiguous (B, H, L, D) tensor.

    Return:
        xq: (B, H, L, D) int8 (float8_e4m3fn when ``fp8``), or None unless ``row``;
        xqt: the same codes as (B, H, D, L) (a :func:`kmajor_empty` view: rows padded), or None unless ``col``;
        scales: (B, H, ceil(L / block)) float32.
    """
    b, h, n, d = x.shape
    nb = triton.cdiv(n, block)
    dt = torch.float8_e4m3fn if fp8 else torch.int8
    xq = _empty(x.shape, dtype=dt, device=x.device) if row else None
    xqt = kmajor_empty(b, h, d, n, dtype=dt, device=x.device) if col else None
    s = _empty(b, h, nb, dtype=torch.float32, device=x.device)
    _quant_rows[(nb, b * h)](x, mean if mean is not None else s, xq if row else xqt, xqt if col else xq, s, n, nb,
                             BLK=block, HEAD_DIM=d, HAS_MEAN=mean is not None, FP8=fp8, EXACT_FP8=interpreting(),
                             ROW=row, COL=col)
    return xq, xqt, s


def _dot_dtype(x: torch.Tensor):
    """Operand dtype of the 16-bit matmuls: x's, or fp32 under the interpreter (its bf16 dot is wrong)."""
    if interpreting():
        return tl.float32
    return tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16


def _e4m3_operand(x: torch.Tensor, block: int, mean: torch.Tensor | None, km: bool):
    """e4m3 codes of x_s = x - mean with s = amax / 448 per ``block`` rows, K-major when ``km``, as int8 bits
    (masked loads need an integer 'other'), and their scales: bwd="fp8"'s right operand of dQ = dS K (x = K)
    or dK = dS^T Q (x = Q)."""
    xq, xqt, s = quantize_int8_rows(x, block, mean, fp8=True, row=not km, col=km)
    return (xqt if km else xq).view(torch.int8), s


def _gradient_operand(x: torch.Tensor, x8: torch.Tensor, sx: torch.Tensor, xg: torch.Tensor, sxg: torch.Tensor,
                      bwd: str, km: bool):
    """The right operand of dQ = dS K (x = K) or dK = dS^T Q (x = Q) and its block scales, per ``bwd``, from
    what :func:`sagebwd_forward` returned: int8: psi(x_s), x8 (its K-major copy xg when ``km``); fp8: the e4m3
    codes xg and scales sxg; bf16: x itself (sx unused)."""
    if bwd == "int8":
        return (xg if km else x8), sx
    if bwd == "fp8":
        return xg, sxg
    return x, sx


# ---------------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------------


def sagebwd_forward(q, k, v, *, sm_scale: float, causal: bool, smooth_k: bool, smooth_q: bool, pv: str, bwd: str,
                    training: bool, km: bool):
    """Launch the forward (quantization pre-pass, then ``_attn_fwd``).

    Returns (o, lse, q8, k8, sq, sk, qg, sqg, kg, skg, bias, qmean): O in q's dtype and the log2-domain
    log-sum-exp; psi(Q_s), psi(K_s) and their block scales; with ``training``, the backward's gradient operands
    made here (bwd int8 with ``km``: the K-major int8 copies qg, kg; fp8: e4m3 codes qg, kg and scales sqg, skg;
    see :func:`_gradient_operand`); Q-smoothing's per-key bias (log2 units) and mean(Q). None where there is
    none. ``km``: the 8-bit B operands are K-major copies (:func:`kmajor`). All (B, H, ., .) contiguous.
    """
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    b, h, lq, d = q.shape
    lk = k.shape[2]
    interp = interpreting()
    cfg = launch_configs(d, pv, bwd)["fwd"]
    qk_scale = sm_scale * LOG2E  # exponents in log2 units: exp(x) = exp2(x * log2(e))
    kmean = token_mean(k) if smooth_k else None
    qmean = token_mean(q) if smooth_q else None
    col8 = km and training and bwd == "int8"  # the K-major int8 copies serve only the int8 dQ and dK
    q8, q8t, sq = quantize_int8_rows(q, Q_BLOCK, qmean, col=col8)
    k8, k8t, sk = quantize_int8_rows(k, K_BLOCK, kmean, col=col8)
    pv_code = SAGEBWD_PRECISIONS.index(pv)
    if pv_code < 2:
        v8, v8t, sv = quantize_int8_rows(v, K_BLOCK, fp8=pv_code == 1, row=not km, col=km)
        v8 = (v8t if km else v8).view(torch.int8)  # fp8 codes travel as int8 bits (masked loads need an 'other')
    else:
        v8, sv = v, sk  # sv unused
    bias = None
    if smooth_q:  # S = Q_s K_s^T + mean(Q) . K_s,j: the exact rank-1 part, in fp32, log2 units
        bias = key_bias(k, kmean, qmean, qk_scale)
    o = _empty(q.shape, dtype=torch.float32 if interp else q.dtype, device=q.device)
    lse = _empty(b, h, lq, dtype=torch.float32, device=q.device)
    if gluon_forward(q.device, d, pv, km, smooth_q)[0]:
        hopper_sagebwd.sagebwd_forward_sm90(q8, k8, v8, sq, sk, sv, o, lse, sm_scale=sm_scale, causal=causal,
                                            q_block=Q_BLOCK, k_block=K_BLOCK)
        return _forward_outputs(q, k, o, lse, q8, k8, sq, sk, q8t, k8t, bias, qmean, training, bwd, km, kmean)

    def launch(f):
        _attn_fwd[(triton.cdiv(lq, f.block_m), b * h)](
            q8, k8, v8, sq, sk, sv, bias if bias is not None else sk, o, lse, lq, lk, qk_scale,
            sq.shape[-1], sk.shape[-1], BLOCK_M=f.block_m, BLOCK_N=f.block_n, HEAD_DIM=d, QBLK=Q_BLOCK,
            KBLK=K_BLOCK, CAUSAL=causal, HAS_BIAS=bias is not None, PV=pv_code, KMAJOR=km and pv_code < 2,
            EXACT_FP8=interp, DOT_DTYPE=_dot_dtype(q), num_warps=f.num_warps, num_stages=f.num_stages)

    launch_fitting(launch, cfg, ("sagebwd forward", q.device, d, causal, pv_code, km, smooth_q),
                   step_down(cfg, keep="n"))
    return _forward_outputs(q, k, o, lse, q8, k8, sq, sk, q8t, k8t, bias, qmean, training, bwd, km, kmean)


def _forward_outputs(q, k, o, lse, q8, k8, sq, sk, q8t, k8t, bias, qmean, training, bwd, km, kmean):
    """:func:`sagebwd_forward`'s return value once O and the LSE are computed: O in q's dtype, and the backward's
    gradient operands (bwd fp8: e4m3 copies made here; int8: the K-major int8 copies the pre-pass made)."""
    o = o.to(q.dtype)
    if training and bwd == "fp8":
        (qg, sqg), (kg, skg) = _e4m3_operand(q, Q_BLOCK, qmean, km), _e4m3_operand(k, K_BLOCK, kmean, km)
    else:
        qg, kg, sqg, skg = q8t, k8t, None, None
    return o, lse, q8, k8, sq, sk, qg, sqg, kg, skg, bias, qmean


def sagebwd_backward(do, q8, qb, k8, kb, v, sq, sqb, sk, skb, bias, qmean, o, lse, *, sm_scale: float, causal: bool,
                     smooth_q: bool, km: bool, bwd: str):
    """Launch the backward: ``_attn_bwd_preprocess``, then ``_attn_bwd_dkdv`` and ``_attn_bwd_dq``. Takes
    :func:`sagebwd_forward`'s outputs, with the gradient operands qb, kb and their scales picked by
    :func:`_gradient_operand` (bias and qmean are read only with ``smooth_q``). Returns (dq, dk, dv) in O's
    dtype, contiguous (B, H, L, D)."""
    bwd_code = SAGEBWD_PRECISIONS.index(bwd)
    do, v = do.contiguous(), v.contiguous()
    if km and bwd_code < 2:  # the K-major 8-bit copies: rows padded, as made by sagebwd_forward
        qb, kb = _as_kmajor(qb), _as_kmajor(kb)
    else:  # row-major 8-bit copies, or (bwd bf16) the caller's Q, K
        qb, kb = qb.contiguous(), kb.contiguous()
    b, h, lq, d = o.shape
    lk = k8.shape[2]
    interp = interpreting()
    cfg = launch_configs(d, bwd=bwd)  # the dK/dV and dQ tiles depend on bwd alone
    qk_scale = sm_scale * LOG2E
    dot_dtype = _dot_dtype(o)
    nq = triton.cdiv(lq, Q_BLOCK)
    delta = _empty(b, h, lq, dtype=torch.float32, device=o.device)
    if bwd_code < 2:  # psi(dO): int8 or e4m3 codes, K-major for dV = P^T dO when km
        dt = torch.float8_e4m3fn if bwd_code == 1 else torch.int8
        do8 = (kmajor_empty(b, h, d, lq, dtype=dt, device=o.device) if km
               else _empty(do.shape, dtype=dt, device=o.device))
        sdo = _empty(b, h, nq, dtype=torch.float32, device=o.device)
    else:  # 16-bit dV reads dO itself
        do8 = sdo = delta  # unused
    _attn_bwd_preprocess[(nq, b * h)](o, do, delta, do8, sdo, lq, nq, BLK=Q_BLOCK, HEAD_DIM=d, KMAJOR=km,
                                      BWD=bwd_code, EXACT_FP8=interp)
    dob = do8.view(torch.int8) if bwd_code < 2 else do
    gdt = torch.float32 if interp else o.dtype
    dq = _empty(b, h, lq, d, dtype=gdt, device=o.device)
    dk = _empty(b, h, lk, d, dtype=gdt, device=o.device)
    dv = _empty(b, h, lk, d, dtype=gdt, device=o.device)
    if gluon_backward(o.device, d, bwd, km, smooth_q)[0]:
        hopper_sagebwd.sagebwd_dkdv_dq(do, q8, qb, k8, kb, v, sq, sk, dob, sdo, lse, delta, dq, dk, dv,
                                       sm_scale=sm_scale, causal=causal, q_block=Q_BLOCK, k_block=K_BLOCK)
        return dq, dk, dv
    has_bias = smooth_q
    variant = (o.device, d, causal, km, has_bias, bwd_code)

    def launch_dkdv(kv):
        _attn_bwd_dkdv[(triton.cdiv(lk, kv.block_n), b * h)](
            q8, qb, k8, v, sq, sqb, sk, bias if has_bias else sk, qmean if has_bias else sk, do, dob,
            sdo, lse, delta, dk, dv, lq, lk, qk_scale, sm_scale, nq, sk.shape[-1],
            BLOCK_M1=kv.block_m, BLOCK_N1=kv.block_n, HEAD_DIM=d, QBLK=Q_BLOCK, KBLK=K_BLOCK,
            CAUSAL=causal, HAS_BIAS=has_bias, DOT_DTYPE=dot_dtype, KMAJOR=km, BWD=bwd_code,
            EXACT_FP8=interp, DK_MEAN_TERM=has_bias and bwd_code < 2,
            num_warps=kv.num_warps, num_stages=kv.num_stages)

    def launch_dq(c):
        _attn_bwd_dq[(triton.cdiv(lq, c.block_m), b * h)](
            q8, k8, kb, v, sq, sk, skb, bias if has_bias else sk, do, lse, delta, dq, lq, lk, qk_scale,
            sm_scale, nq, sk.shape[-1], BLOCK_M2=c.block_m, BLOCK_N2=c.block_n, HEAD_DIM=d, QBLK=Q_BLOCK,
            KBLK=K_BLOCK, CAUSAL=causal, HAS_BIAS=has_bias, DOT_DTYPE=dot_dtype, KMAJOR=km, BWD=bwd_code,
            EXACT_FP8=interp, num_warps=c.num_warps, num_stages=c.num_stages)

    launch_fitting(launch_dkdv, cfg["dkdv"], ("sagebwd backward (dK/dV)", *variant), step_down(cfg["dkdv"], keep="m"))
    launch_fitting(launch_dq, cfg["dq"], ("sagebwd backward (dQ)", *variant), step_down(cfg["dq"], keep="n"))
    dt = o.dtype
    return dq.to(dt), dk.to(dt), dv.to(dt)


# ---------------------------------------------------------------------------------------------------
# torch.library custom ops over the launches, with fake (shape-only) implementations, so torch.compile
# traces models that use them without graph breaks; Dynamo traces the autograd Function below.
#
#     attnqat::sagebwd_fwd  (q, k, v, sm_scale, causal, smooth_k, smooth_q, pv, bwd, training, km)
#                           -> (o, lse, q8, k8, sq, sk, qg, sqg, kg, skg, bias, qmean)
#     attnqat::sagebwd_bwd  (do, q8, qb, k8, kb, v, sq, sqb, sk, skb, bias, qmean, o, lse, sm_scale, causal,
#                            smooth_q, km, bwd) -> (dq, dk, dv)
#
# A custom op returns tensors only: what sagebwd_forward leaves out (None) is an empty tensor here.
# ---------------------------------------------------------------------------------------------------

_FWD_DTYPES = (None, torch.float32, torch.int8, torch.int8, torch.float32, torch.float32, torch.int8, torch.float32,
               torch.int8, torch.float32, torch.float32, torch.float32)  # of each output; None: q's


@torch.library.custom_op("attnqat::sagebwd_fwd", mutates_args=(), device_types=("cuda", "cpu"))
def sagebwd_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, causal: bool, smooth_k: bool,
                smooth_q: bool, pv: str, bwd: str, training: bool,
                km: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                   torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    out = sagebwd_forward(q, k, v, sm_scale=sm_scale, causal=causal, smooth_k=smooth_k, smooth_q=smooth_q, pv=pv,
                          bwd=bwd, training=training, km=km)
    return tuple(q.new_empty(0, dtype=dt) if t is None else t for t, dt in zip(out, _FWD_DTYPES))


@sagebwd_fwd.register_fake
def _(q, k, v, sm_scale, causal, smooth_k, smooth_q, pv, bwd, training, km):
    b, h, lq, d = q.shape
    lk = k.shape[2]
    nq, nk = triton.cdiv(lq, Q_BLOCK), triton.cdiv(lk, K_BLOCK)
    codes = training and (bwd == "fp8" or (bwd == "int8" and km))  # qg, kg: K-major int8 or e4m3 copies
    scales = training and bwd == "fp8"  # sqg, skg
    shapes = ((b, h, lq, d), (b, h, lq), (b, h, lq, d), (b, h, lk, d), (b, h, nq), (b, h, nk),
              ((b, h, d, lq) if km else (b, h, lq, d)) if codes else (0,), (b, h, nq) if scales else (0,),
              ((b, h, d, lk) if km else (b, h, lk, d)) if codes else (0,), (b, h, nk) if scales else (0,),
              (b, h, lk) if smooth_q else (0,), (b, h, d) if smooth_q else (0,))
    out = [q.new_empty(s, dtype=dt or q.dtype) for s, dt in zip(shapes, _FWD_DTYPES)]
    if codes and km:  # qg, kg: K-major copies with padded rows (kmajor_empty)
        for i in (6, 8):
            out[i] = kmajor_empty(*shapes[i], dtype=out[i].dtype, device=q.device, empty=q.new_empty)
    return tuple(out)


@torch.library.custom_op("attnqat::sagebwd_bwd", mutates_args=(), device_types=("cuda", "cpu"))
def sagebwd_bwd(do: torch.Tensor, q8: torch.Tensor, qb: torch.Tensor, k8: torch.Tensor, kb: torch.Tensor,
                v: torch.Tensor, sq: torch.Tensor, sqb: torch.Tensor, sk: torch.Tensor, skb: torch.Tensor,
                bias: torch.Tensor, qmean: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, sm_scale: float,
                causal: bool, smooth_q: bool, km: bool, bwd: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return sagebwd_backward(do, q8, qb, k8, kb, v, sq, sqb, sk, skb, bias, qmean, o, lse, sm_scale=sm_scale,
                            causal=causal, smooth_q=smooth_q, km=km, bwd=bwd)


@sagebwd_bwd.register_fake
def _(do, q8, qb, k8, kb, v, sq, sqb, sk, skb, bias, qmean, o, lse, sm_scale, causal, smooth_q, km, bwd):
    return o.new_empty(q8.shape), o.new_empty(k8.shape), o.new_empty(k8.shape)


# ---------------------------------------------------------------------------------------------------
# Autograd
# ---------------------------------------------------------------------------------------------------


class _SageBwdAttention(torch.autograd.Function):
    """The INT8 forward, saving psi(Q_s), psi(K_s), V, O, the log-sum-exp and the gradient operands; the
    SageBwd backward."""

    @staticmethod
    def forward(ctx, q, k, v, sm_scale, causal, smooth_k, smooth_q, pv, bwd, km):
        o, lse, q8, k8, sq, sk, qg, sqg, kg, skg, bias, qmean = sagebwd_fwd(q, k, v, sm_scale, causal, smooth_k,
                                                                             smooth_q, pv, bwd, True, km)
        qb, sqb = _gradient_operand(q, q8, sq, qg, sqg, bwd, km)
        kb, skb = _gradient_operand(k, k8, sk, kg, skg, bwd, km)
        ctx.save_for_backward(q8, qb, k8, kb, v, sq, sqb, sk, skb, bias, qmean, o, lse)
        ctx.sm_scale, ctx.causal, ctx.smooth_q, ctx.km, ctx.bwd = sm_scale, causal, smooth_q, km, bwd
        return o

    @staticmethod
    def backward(ctx, do):
        refuse_double_backward("sagebwd")
        dq, dk, dv = sagebwd_bwd(do, *ctx.saved_tensors, ctx.sm_scale, ctx.causal, ctx.smooth_q, ctx.km, ctx.bwd)
        return dq, dk, dv, None, None, None, None, None, None, None


def sagebwd_unchecked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sm_scale: float | None = None,
                      causal: bool = False, smooth_k: bool = True, smooth_q: bool = False,
                      pv: str = "int8", bwd: str = "int8") -> torch.Tensor:
    """:func:`sagebwd_attention` on checked inputs and options (the registry's path)."""
    args = (default_scale(q.shape[-1], sm_scale), bool(causal), bool(smooth_k), bool(smooth_q), pv, bwd)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return _SageBwdAttention.apply(q, k, v, *args, kmajor())
    return sagebwd_fwd(q, k, v, *args, False, kmajor())[0]  # inference: no backward-only operands


def sagebwd_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sm_scale: float | None = None,
                      causal: bool = False, smooth_k: bool = True, smooth_q: bool = False,
                      pv: str = "int8", bwd: str = "int8") -> torch.Tensor:
    """SageBwd attention (SPEC §4): INT8 forward and backward, trainable.

    Arguments:
        q: (batch, nheads, seqlen_q, head_dim); k, v: (batch, nheads, seqlen_k, head_dim); bf16 or fp16,
            head_dim 64 or 128, any lengths (seqlen_q may differ from seqlen_k). CUDA tensors, or CPU
            tensors under ``TRITON_INTERPRET=1``.
        sm_scale: softmax scale; default 1/sqrt(head_dim).
        causal: top-left aligned causal mask (as SDPA's ``is_causal``): query i sees keys 0..i.
        smooth_k: subtract the per-(batch, head) channel mean of K before quantizing (default on: it
            removes K's shared offset at no cost in accuracy or in the backward).
        smooth_q: also smooth Q (off by default; costs a per-key bias and a rank-1 dK correction).
        pv: precision of the forward P V: ``"int8"`` (SPEC, default), ``"fp8"`` (e4m3 P~ and V, same blocks,
            s = max / 448) or ``"bf16"`` (unquantized P~ and V in the input dtype).
        bwd: precision of the backward's dV = P^T dO, dQ = dS K, dK = dS^T Q: ``"int8"`` (SPEC, default),
            ``"fp8"`` (e4m3 with the int8 blocks and s = max / 448) or ``"bf16"`` (P, dS unquantized; dO, Q, K
            the caller's; the input dtype). The S recompute stays INT8 and dP 16-bit in every option.
    Return:
        (batch, nheads, seqlen_q, head_dim) in q's dtype. The backward returns dq, dk, dv in q's dtype.
    """
    check_qkv(q, k, v, name="sagebwd_attention", sm_scale=sm_scale, causal=causal)
    if pv not in SAGEBWD_PRECISIONS:
        raise ValueError(f"sagebwd_attention: pv {pv!r} not in {SAGEBWD_PRECISIONS}")
    if bwd not in SAGEBWD_PRECISIONS:
        raise ValueError(f"sagebwd_attention: bwd {bwd!r} not in {SAGEBWD_PRECISIONS}")
    return sagebwd_unchecked(q, k, v, sm_scale=sm_scale, causal=causal, smooth_k=smooth_k, smooth_q=smooth_q, pv=pv,
                             bwd=bwd)
