"""Attn-QAT: FP4 (NVFP4) attention with a matching backward, fused in Triton (SPEC §2).

Forward (flash-style over key tiles, exponents in log2 units):

    S = Q^F K^F^T * scale * log2(e)
    m_new = max(m, ceil(rowmax(S_j)))            integer running max: tiles rescale by powers of 2,
    P~_j  = 2688 * 2^(S_j - m_new)               which phi commutes with, so O is tile-width free
    l = 2^(m - m_new) l + rowsum(P~_j);  O = 2^(m - m_new) O + phi(P~_j) V^F_j
    O' = 2^(m - m_new) O' + P~_j V^F_j           (training only: the high-precision auxiliary output)

Backward: recompute S from the same Q^F, K^F (principle 1), P^F = phi(P~)/l with the saved integer max
(the forward's quantized P), D = rowsum(dO * O') (principle 2), dV = P^F^T dO, dP = dO V^F^T,
dS = P (dP - D), dQ = dS K^F scale, dK = dS^T Q^F scale; straight-through to Q, K, V.

``q_smoothing`` (SMOOTH_Q, off by default; docs/kernels.md, "Q smoothing"): per 128-row query block Q^F = phi(Q - q̄)
and S gains ΔS = q̄ K^T, in the forward and the backward's recomputes; dK gains (dS^T 1) q̄^T scale, and dQ goes
straight through Q - q̄ (q̄'s own gradient is dropped).

``four_over_six`` (off by default; docs/kernels.md, "Four Over Six"): the phi pre-pass picks each Q, K and V
block's scale, e4m3(amax / 6) or e4m3(amax / 4), by the smaller quantization error; the kernels are unchanged.

The file reads top to bottom, in the order of Triton's fused-attention tutorial and FlashAttention's
layers: ``@triton.jit`` helpers -> ``_attn_fwd`` -> ``_attn_bwd_preprocess`` -> ``_attn_bwd_dkdv`` ->
``_attn_bwd_dq`` -> launch configs -> the launchers :func:`attn_qat_forward` / :func:`attn_qat_backward`
-> their ``torch.library`` custom ops (``attnqat::attn_qat_fwd`` / ``attn_qat_bwd``, with fake
implementations, so ``torch.compile`` traces them) -> ``AttnQATFunction`` -> the modes' paths on checked inputs
(:func:`attn_qat_unchecked` ..., what the registry calls) -> the public functions (:func:`attn_qat_attention` ...).
The phi pre-pass over head_dim (``quantize_heads``) lives in ``nvfp4.py``, what the GPU can do (fp8 cast,
block-scaled FP4 MMAs, compiles without a GPU) in ``_hardware.py``. ``QUANT_P=False`` turns the same
forward into plain attention over quantized Q, K, V (tests use it to isolate P's quantization).

On the GPU the dots take bf16/fp16 operands; phi's outputs are exact there (SPEC §1), so this is the
exact emulation of block-scaled FP4 MMAs. Under ``TRITON_INTERPRET=1`` every dot runs in fp32
(the interpreter's bf16 dot is wrong) and outputs land in fp32 buffers (its bf16 casts round wrongly).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._common import (P_BWD_CHOICES, LaunchConfig, check_qkv, default_scale, interpreting, launch_fitting,
                      needs_grad, pinned_config, recomputed_later, training_placeholders, work_dtype)
from ._hardware import compile_for, first_that_compiles, fp4_mma_arch, fp8_cast
from .formats import LOG2E, SAGE3_Q_BLOCK
from .nvfp4 import fake_quant_tile, quantize_heads, round_e2m1_nonneg, round_e4m3, tile_keys, unpack_tile
from .reference import refuse_double_backward

# P~ = 2688 * 2^x = 2^(x + log2 2688): the kernels fold the scale into exp2 as the literal
# 11.392317422778761 = log2(2688) (a literal: Triton kernels read no Python globals).


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b; IEEE (constexpr: the interpreter path) forces exact fp32 products, not tf32."""
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _dot_fp4(a, a_scale, b, b_scale, acc, IEEE: tl.constexpr):
    """acc + a @ b over NVFP4 storage (a: (M, K/2) codes with (M, K/16) scale bits; b: (K/2, N) codes packed
    along K with (N, K/16) scale bits), fp32. The GPU runs Triton's tl.dot_scaled, the native block-scaled
    FP4 MMA on sm_100/sm_120. The interpreter decodes and takes an fp32 dot: its dot_scaled reads every
    scale as e8m0, which NVFP4's e4m3 scales are not."""
    if IEEE:
        af = unpack_tile(a, a_scale, a.shape[0], 2 * a.shape[1])
        bf = tl.trans(unpack_tile(tl.trans(b), b_scale, b.shape[1], 2 * b.shape[0]))
        return tl.dot(af, bf, acc, input_precision="ieee")
    else:
        return tl.dot_scaled(a, a_scale.to(tl.float8e4nv, bitcast=True), "e2m1",
                             b, b_scale.to(tl.float8e4nv, bitcast=True), "e2m1", acc=acc)


@triton.jit
def _through_mma(x, COLS: tl.constexpr):
    """x @ I, exactly x (one product per sum, fp32 accumulation; rows stay apart, so NaN stays in its row).

    Why: a loaded tile that is tl.dot's left operand stays in shared memory and is read back on every
    iteration of the key loop; a tile that comes out of an MMA goes to the operand layout in registers, as
    P does. For Q at 128x128 that frees 32 KB: sage3's ΔS tile then fits beside 3-stage 128x128 K and V
    tiles, and the nvfp4 forward ran 48.9 against 51.3 ms at (1, 40, 32760, 128) on an H100 (head_dim 64,
    128x128 tiles: 36.7 against 38.0). It costs where the registers are short: with 64-key tiles (53.7
    against 52.7 ms; head_dim 64: 41.5 against 32.5) and in training, where O' holds 64 more (128x128:
    87.8 against 72.5), so the forward takes it only for inference with 128-key tiles."""
    c = tl.arange(0, COLS)
    return tl.dot(x, tl.where(c[:, None] == c[None, :], 1.0, 0.0).to(x.dtype)).to(x.dtype)


# ---------------------------------------------------------------------------------------------------
# ΔS, the Q-smoothing bias (sage3, and the q_smoothing option of the FP4 modes)
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _bf16_bits(x):
    """x (fp32 whose low 16 bits are 0) as bf16, by its bits: exact, with no rounding cast."""
    return (x.to(tl.int32, bitcast=True) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _delta_s(K, KMean, QMean, DS, stride_kb, stride_kh, stride_kl, H, LK, NQB, DS_STRIDE,
             HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_QB: tl.constexpr, KEY_TILE: tl.constexpr,
             CENTER_K: tl.constexpr, IEEE: tl.constexpr):
    """ΔS[bh, i, :, keys] = q̄_i · (K - k̄)^T for every 128-row query block i and BLOCK_N keys, computed in
    fp32 and stored as bf16 parts hi, mid, lo (hi + mid + lo = ΔS exactly). KEY_TILE > 0: in the column order
    of the forward's KEY_TILE-wide tiles (nvfp4.tile_keys) so that its loads are contiguous; 0: keys in order
    (the backward kernels', which gather them). CENTER_K (constexpr: sage3's K smoothing) subtracts k̄ = KMean;
    without it (q_smoothing) ΔS = q̄_i K^T. Padding keys (LK <= key < DS_STRIDE) get q̄ · (0 - k̄): finite,
    as the forward needs.

    The GPU runs the dot as three tf32 tensor-core products (hi*hi + hi*lo + lo*hi: relative error
    4e-7 against fp32 at L=32760; an exact "ieee" dot ran 30x slower); the interpreter runs it in fp32."""
    bh = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # where ΔS is stored
    if KEY_TILE:
        keys = (offs_n // KEY_TILE) * KEY_TILE + tile_keys(offs_n % KEY_TILE, KEY_TILE)  # the key stored there
    else:
        keys = offs_n
    offs_d = tl.arange(0, HEAD_DIM)
    k = tl.load(K + (bh // H) * stride_kb + (bh % H) * stride_kh + keys[None, :] * stride_kl + offs_d[:, None],
                mask=keys[None, :] < LK, other=0.0).to(tl.float32)
    if CENTER_K:
        k = k - tl.load(KMean + bh * HEAD_DIM + offs_d)[:, None]  # (HEAD_DIM, BLOCK_N): K_s^T
    for start in range(0, NQB, BLOCK_QB):
        rows = start + tl.arange(0, BLOCK_QB)
        q_bar = tl.load(QMean + (bh * NQB + rows[:, None]) * HEAD_DIM + offs_d[None, :], mask=rows[:, None] < NQB,
                        other=0.0)
        if IEEE:
            ds = tl.dot(q_bar, k, input_precision="ieee")
        else:
            ds = tl.dot(q_bar, k, input_precision="tf32x3")
        # hi + mid + lo = ds exactly: each keeps the top 8 significant bits of what is left (truncation
        # by masking, so the interpreter's rounding casts never enter); the last remainder has <= 8.
        hi = (ds.to(tl.int32, bitcast=True) & -65536).to(tl.float32, bitcast=True)
        mid = ((ds - hi).to(tl.int32, bitcast=True) & -65536).to(tl.float32, bitcast=True)
        lo = ds - hi - mid
        ptrs = DS + ((bh * NQB + rows[:, None]).to(tl.int64) * 3) * DS_STRIDE + offs_n[None, :]
        mask = (rows[:, None] < NQB) & (offs_n[None, :] < DS_STRIDE)
        tl.store(ptrs, _bf16_bits(hi), mask=mask)
        tl.store(ptrs + DS_STRIDE, _bf16_bits(mid), mask=mask)
        tl.store(ptrs + 2 * DS_STRIDE, _bf16_bits(lo), mask=mask)


@triton.jit
def _delta_s_row(ds_base, offs_n, LK, DS_STRIDE):
    """One query block's ΔS (keys in order, _delta_s with KEY_TILE=0) at keys offs_n, in fp32: hi + mid + lo,
    exact (8 + 8 + <= 8 significant bits); 0 past LK. The backward kernels start S's accumulator from it, so S
    sums as the forward's does (ΔS first, then Q K^T)."""
    ok = offs_n < LK
    hi = tl.load(ds_base + offs_n, mask=ok, other=0.0).to(tl.float32)
    mid = tl.load(ds_base + DS_STRIDE + offs_n, mask=ok, other=0.0).to(tl.float32)
    lo = tl.load(ds_base + 2 * DS_STRIDE + offs_n, mask=ok, other=0.0).to(tl.float32)
    return (hi + mid) + lo



# ---------------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _load_keys(base, offs_n, offs_d, LK, ROW_LEN: tl.constexpr, MASK: tl.constexpr, TRANSPOSED: tl.constexpr):
    """Rows offs_n (columns offs_d) of a row-major (LK, ROW_LEN) array, e.g. a (BLOCK_N, HEAD_DIM) tile of
    K^F or V^F, or its transpose; MASK (constexpr) only for the ragged last tile, so full tiles load
    without a predicate. Rows past LK read as 0."""
    if TRANSPOSED:
        ptrs = base + offs_n[None, :] * ROW_LEN + offs_d[:, None]
        in_bounds = offs_n[None, :] < LK
    else:
        ptrs = base + offs_n[:, None] * ROW_LEN + offs_d[None, :]
        in_bounds = offs_n[:, None] < LK
    if MASK:
        return tl.load(ptrs, mask=in_bounds, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def _key_order(BLOCK_N: tl.constexpr):
    """The key (offset in the tile) that each column of S holds.

    Hopper's and Ampere's MMA accumulators give lane r of each quad the columns 8j + 2r + {0, 1}.
    Loading key (BLOCK_N/4) r + 2j + e into column 8j + 2r + e hands each lane BLOCK_N/4 consecutive
    keys, so every 16-key quantization block of P lies in one thread's registers and its max and sum
    need no shuffles. K's and V's rows are permuted alike, so P V is unchanged; masks use these keys.
    """
    return tile_keys(tl.arange(0, BLOCK_N), BLOCK_N)


@triton.jit
def _e4m3(x, FP8_CAST: tl.constexpr):
    """e4m3(x) for finite x >= 0: the hardware's round-to-nearest-even cast where there is one (sm_89+),
    integer arithmetic elsewhere (the interpreter, whose fp8 cast rounds wrongly, and Ampere)."""
    if FP8_CAST:
        return x.to(tl.float8e4nv).to(tl.float32)
    else:
        return round_e4m3(x)


def _round_p_ptx(ty: str, one: int, magic: int, six: int, exponent_mask: int) -> tl.constexpr:
    """_round_p's packed 16-bit PTX for ``ty`` (bf16 or f16), given the format's bit patterns of 1, of the
    rounding constant (1.5 * 2^mantissa bits: 96 for bf16, 768 for f16), of 6 and of its exponent field."""
    def x2(h):
        return f"0x{h:04X}{h:04X}"

    return tl.constexpr(f"""{{
            .reg .b32 h, e, one, c, nc, six, nz;
            mov.b32 one, {x2(one)};
            mov.b32 c, {x2(magic)};
            mov.b32 nc, {x2(magic | 0x8000)};
            mov.b32 six, {x2(six)};
            mov.b32 nz, 0x80008000;
            cvt.rz.{ty}x2.f32 h, $2, $1;
            or.b32 h, h, 0x00010001;
            and.b32 e, h, {x2(exponent_mask)};
            max.{ty}x2 e, e, one;
            fma.rn.{ty}x2 h, e, c, h;
            fma.rn.{ty}x2 h, e, nc, h;
            min.{ty}x2 h, h, six;
            fma.rn.{ty}x2 $0, h, $3, nz;
            }}""")


_ROUND_P_BF16X2 = _round_p_ptx("bf16", one=0x3F80, magic=0x42C0, six=0x40C0, exponent_mask=0x7F80)
_ROUND_P_F16X2 = _round_p_ptx("f16", one=0x3C00, magic=0x6200, six=0x4600, exponent_mask=0x7C00)


@triton.jit
def _round_p(y, scale, IEEE: tl.constexpr, FP16: tl.constexpr):
    """phi's rounding step for P: e2m1(y) * scale, y = P~ / s >= 0, returned in the dot's dtype.

    The GPU runs it in packed 16-bit arithmetic, two elements per instruction: y is truncated to
    16 bits with the lowest bit forced to 1 (round to odd, so truncation never creates a rounding
    tie), then rounded to the e2m1 grid by the magic-number FMA at the spacing read from y's exponent,
    clamped at 6 and multiplied by the block scale (exact: 2 x 4 significant bits). This equals
    rounding the fp32 y directly except when y is exactly a tie (then it rounds up, not to even).
    The interpreter (no inline asm) computes the same in fp32 arithmetic.
    """
    if IEEE:
        bits = y.to(tl.int32, bitcast=True)
        if FP16:  # fp16 keeps 10 of fp32's 23 mantissa bits
            h = (bits & -8192) | 8192  # -8192 == ~0x1FFF
        else:  # bf16 keeps 7
            h = (bits & -65536) | 65536
        return round_e2m1_nonneg(h.to(tl.float32, bitcast=True)) * scale
    else:
        scale16 = scale.to(tl.float16 if FP16 else tl.bfloat16)
        return tl.inline_asm_elementwise(_ROUND_P_F16X2 if FP16 else _ROUND_P_BF16X2, "=r,r,r,r",
                                         [y, scale16], dtype=scale16.dtype, is_pure=True, pack=2)


@triton.jit
def _add_delta_s(s, ds_base, start_n, DS_STRIDE, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """S + ΔS for the key tile at start_n (SageAttention3's Q-smoothing correction), on the tensor cores.

    ΔS is stored as three bf16 rows hi, mid, lo with hi + mid + lo = ΔS exactly (_delta_s), so
    S + ΔS = S + [1 1 1 0 ...] @ [hi; mid; lo; 0 ...]: one more k=16 MMA chained on S's accumulator.
    Adding fp32 ΔS in registers instead cost an FMA per element and the ΔS row's registers: 62.1 ms at
    (1, 40, 32760, 128) on an H100 against 58.3 ms for this form (docs/kernels.md). The rows are stored
    in _key_order's column order and padded (finite) to whole tiles, so the load is contiguous and
    unmasked along keys."""
    rows = tl.arange(0, 16)
    cols = start_n + tl.arange(0, BLOCK_N)
    parts = tl.load(ds_base + rows[:, None] * DS_STRIDE + cols[None, :], mask=rows[:, None] < 3, other=0.0)
    ones = tl.where(rows[None, :] < 3, 1.0, 0.0) + tl.zeros([BLOCK_M, 16], dtype=tl.float32)
    if IEEE:
        parts = parts.to(tl.float32)
    else:
        ones = ones.to(tl.bfloat16)
    return _dot(ones, parts, s, IEEE)


@triton.jit
def _attn_fwd_inner(acc, acc_aux, l_i, m_i, q, q_scale, k_base, ks_base, v_base, ds_base, DS_STRIDE, offs_m, lo, hi,
                    LK, qk_scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    MASK: tl.constexpr, CAUSAL: tl.constexpr, TRAINING: tl.constexpr, QUANT_P: tl.constexpr,
                    IEEE: tl.constexpr, SMOOTH_Q: tl.constexpr, FP16: tl.constexpr, FP8_CAST: tl.constexpr,
                    PACKED_QK: tl.constexpr):  # 0: bf16 operands; 1, 2: NVFP4 storage (2: S from a runtime zero)
    """Key tiles [lo, hi). MASK (constexpr, as in Triton's tutorial): only the ragged last tile and the
    causal diagonal pay for masking; full tiles skip the compare and select on every element.

    S is viewed as (rows, BLOCK_N/64, 8, 4, 2) so that axes 1 and 3 index the 16-key blocks (see
    _key_order). Per block: its max P~ gives the scale s (one exp2 per block, exp2 is monotone), and
    the elements are computed directly as y = P~ / 2^ls = 2^(S scale - base - ls), ls = log2 s, so no
    per-element division or multiply is needed before rounding; l adds s * sum(y).

    Rescaling the accumulator only when a row max grows (FA4-style, with a block-uniform branch) was
    measured slower on the H100 than rescaling every tile: the branch needs a cross-warp reduction.
    """
    offs_d = tl.arange(0, HEAD_DIM)
    dot_ty = v_base.dtype.element_ty
    key_order = _key_order(BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + key_order
        v = _load_keys(v_base, offs_n, offs_d, LK, HEAD_DIM, MASK, False)
        s = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if PACKED_QK == 2:  # a runtime zero: Triton 3.6 and 3.7 fail to compile a constant-zero-initialised
            s += qk_scale * 0.0  # dot_scaled inside a loop for sm_100 (TritonGPUOptimizeAccumulatorInit)
        if SMOOTH_Q:  # ΔS first: its small MMA then overlaps the previous tile's P V (52.6 vs 55.1 ms after Q K)
            s = _add_delta_s(s, ds_base, start_n, DS_STRIDE, BLOCK_M, BLOCK_N, IEEE)
        if PACKED_QK:  # K^F as codes (keys, HEAD_DIM/2) and scale bits (keys, HEAD_DIM/16)
            kt = _load_keys(k_base, offs_n, tl.arange(0, HEAD_DIM // 2), LK, HEAD_DIM // 2, MASK, True)
            ks = _load_keys(ks_base, offs_n, tl.arange(0, HEAD_DIM // 16), LK, HEAD_DIM // 16, MASK, False)
            s = _dot_fp4(q, q_scale, kt, ks, s, IEEE)
        else:
            kt = _load_keys(k_base, offs_n, offs_d, LK, HEAD_DIM, MASK, True)
            s = _dot(q, kt, s, IEEE)
        if MASK:
            valid = offs_n[None, :] < LK
            if CAUSAL:
                valid = valid & (offs_n[None, :] <= offs_m[:, None])
            s = tl.where(valid, s, float("-inf"))
        s5 = tl.reshape(s, (BLOCK_M, BLOCK_N // 64, 8, 4, 2))
        smax = tl.max(tl.max(s5, axis=4), axis=2)  # (rows, BLOCK_N/64, 4): each 16-key block's max S
        # qk_scale > 0, so max(s) * qk_scale = max(s * qk_scale); it then rides in one FMA with -base below
        m_new = tl.maximum(m_i, tl.math.ceil(tl.max(tl.max(smax, axis=1), axis=1) * qk_scale))
        seen = m_new > float("-inf")  # rows that have met a visible key
        alpha = tl.where(seen, tl.math.exp2(m_i - m_new), 1.0)
        # P~ = 2688 * 2^(S scale - m) = 2^(S scale - base); 11.39... = log2(2688)
        base = tl.where(seen, m_new - 11.392317422778761, 0.0)
        xmax = smax * qk_scale - base[:, None, None]  # log2 of each block's max P~
        if QUANT_P:
            sc = _e4m3(tl.math.exp2(xmax) * (1.0 / 6.0), FP8_CAST)  # s = e4m3(amax / 6)
            # a block whose s rounds to 0 quantizes to 0; its y stay <= 1 (and finite) for l
            ls = tl.where(sc > 0.0, tl.math.log2(tl.where(sc > 0.0, sc, 1.0)), tl.maximum(xmax, -126.0))
            s_l = tl.where(sc > 0.0, sc, tl.math.exp2(ls))
        else:
            ls = tl.zeros_like(xmax)
            s_l = tl.full(xmax.shape, 1.0, tl.float32)
        y5 = tl.math.exp2(s5 * qk_scale - (base[:, None, None] + ls)[:, :, None, :, None])
        block_sum = tl.sum(tl.sum(y5, axis=4), axis=2)
        l_i = l_i * alpha + tl.sum(tl.sum(block_sum * s_l, axis=1), axis=1)
        if QUANT_P:
            pq = _round_p(y5, tl.broadcast_to(sc[:, :, None, :, None], y5.shape), IEEE, FP16)
        else:
            pq = y5 * s_l[:, :, None, :, None]
        acc = _dot(tl.reshape(pq, (BLOCK_M, BLOCK_N)).to(dot_ty), v, acc * alpha[:, None], IEEE)
        if TRAINING:
            p = tl.reshape(y5 * s_l[:, :, None, :, None], (BLOCK_M, BLOCK_N))  # P~, unquantized
            acc_aux = _dot(p.to(dot_ty), v, acc_aux * alpha[:, None], IEEE)
        m_i = m_new
    return acc, acc_aux, l_i, m_i


@triton.jit
def _attn_fwd(QF, KF, VF, QS, KS, O, OAux, M, Lsum, DeltaS,
              stride_ob, stride_oh, stride_ol,
              H, LQ, LK, NQB, DS_STRIDE, qk_scale,
              HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              CAUSAL: tl.constexpr, TRAINING: tl.constexpr, QUANT_P: tl.constexpr,
              IEEE: tl.constexpr, SMOOTH_Q: tl.constexpr, FP16: tl.constexpr, FP8_CAST: tl.constexpr,
              PACKED_QK: tl.constexpr):
    """One block of BLOCK_M query rows per program. SMOOTH_Q (constexpr: SageAttention3's
    Q-smoothing, sage3's and the FP4 modes' q_smoothing option): add the fp32 correction ΔS of the row's 128-row
    block to Q^F K^F^T. DeltaS: (B*H, blocks of 128 rows, 3, DS_STRIDE) bf16, ΔS = hi + mid + lo (_delta_s).
    PACKED_QK (constexpr, the native path, 1 or 2): QF, KF hold NVFP4 codes (B*H, L, HEAD_DIM/2) and QS, KS
    their scale bits (B*H, L, HEAD_DIM/16), and S comes from the block-scaled FP4 MMA (_dot_fp4; 2 starts S
    from a runtime zero, see _attn_fwd_inner)."""
    tl.static_assert(BLOCK_N % 64 == 0)  # _key_order: each lane holds whole 16-key blocks
    if SMOOTH_Q:
        tl.static_assert(128 % BLOCK_M == 0)  # a program's rows share one 128-row smoothing block
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    if PACKED_QK:
        q = _load_keys(QF + bh * LQ * (HEAD_DIM // 2), offs_m, tl.arange(0, HEAD_DIM // 2), LQ, HEAD_DIM // 2,
                       True, False)
        q_scale = _load_keys(QS + bh * LQ * (HEAD_DIM // 16), offs_m, tl.arange(0, HEAD_DIM // 16), LQ,
                             HEAD_DIM // 16, True, False)
        k_base = KF + bh * LK * (HEAD_DIM // 2)
        ks_base = KS + bh * LK * (HEAD_DIM // 16)
    else:
        q = _load_keys(QF + bh * LQ * HEAD_DIM, offs_m, offs_d, LQ, HEAD_DIM, True, False)
        if not IEEE and not TRAINING and BLOCK_N >= 128:  # see _through_mma for where it pays
            q = _through_mma(q, HEAD_DIM)
        q_scale = q
        k_base = KF + bh * LK * HEAD_DIM
        ks_base = KS
    v_base = VF + bh * LK * HEAD_DIM
    if SMOOTH_Q:
        ds_base = DeltaS + (bh * NQB + start_m * BLOCK_M // 128).to(tl.int64) * 3 * DS_STRIDE
    else:
        ds_base = DeltaS

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    acc_aux = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    # Causal (top-left aligned): keys beyond this block's last row are never visible, and keys up to
    # its first row are visible to every row. Tiles ending before that (and before LK) need no mask.
    if CAUSAL:
        hi = tl.minimum(LK, (start_m + 1) * BLOCK_M)
        full_hi = (tl.minimum(start_m * BLOCK_M + 1, LK) // BLOCK_N) * BLOCK_N
    else:
        hi = LK
        full_hi = (LK // BLOCK_N) * BLOCK_N
    acc, acc_aux, l_i, m_i = _attn_fwd_inner(
        acc, acc_aux, l_i, m_i, q, q_scale, k_base, ks_base, v_base, ds_base, DS_STRIDE, offs_m, 0, full_hi, LK,
        qk_scale, HEAD_DIM, BLOCK_M, BLOCK_N, False, CAUSAL, TRAINING, QUANT_P, IEEE, SMOOTH_Q, FP16, FP8_CAST,
        PACKED_QK)
    acc, acc_aux, l_i, m_i = _attn_fwd_inner(
        acc, acc_aux, l_i, m_i, q, q_scale, k_base, ks_base, v_base, ds_base, DS_STRIDE, offs_m, full_hi, hi, LK,
        qk_scale, HEAD_DIM, BLOCK_M, BLOCK_N, True, CAUSAL, TRAINING, QUANT_P, IEEE, SMOOTH_Q, FP16, FP8_CAST,
        PACKED_QK)

    inv_l = 1.0 / l_i
    o_mask = offs_m[:, None] < LQ
    o_ptrs = O + (bh // H) * stride_ob + (bh % H) * stride_oh + offs_m[:, None] * stride_ol + offs_d[None, :]
    tl.store(o_ptrs, (acc * inv_l[:, None]).to(O.dtype.element_ty), mask=o_mask)
    if TRAINING:
        tl.store(OAux + bh * LQ * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :],
                 (acc_aux * inv_l[:, None]).to(OAux.dtype.element_ty), mask=o_mask)
    tl.store(M + bh * LQ + offs_m, m_i, mask=offs_m < LQ)
    tl.store(Lsum + bh * LQ + offs_m, l_i, mask=offs_m < LQ)


# ---------------------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------------------


@triton.jit
def _attn_bwd_preprocess(OAux, DO, Delta, stride_dob, stride_doh, stride_dol, H, LQ,
                         HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """D = rowsum(dO * O') (principle 2: O', not the FP4 O)."""
    bh = tl.program_id(1)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = offs_m[:, None] < LQ
    o = tl.load(OAux + bh * LQ * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DO + (bh // H) * stride_dob + (bh % H) * stride_doh + offs_m[:, None] * stride_dol + offs_d[None, :],
                 mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(Delta + bh * LQ + offs_m, delta, mask=offs_m < LQ)


@triton.jit
def _key_blocks(x, TRANSPOSED: tl.constexpr):
    """A 2-D tile of S or P viewed so that its 16-key quantization blocks have axes of their own, a pure
    relabelling of the MMA accumulator's registers (no data moves). Keys x queries (TRANSPOSED, keys in their
    natural order): (keys/16, 16, queries), a block's keys on axis 1. Queries x keys with the keys in
    _key_order: (queries, keys/64, 8, 4, 2) as in the forward, axes 1 and 3 naming the block, 2 and 4 its keys."""
    if TRANSPOSED:
        return tl.reshape(x, (x.shape[0] // 16, 16, x.shape[1]))
    else:
        return tl.reshape(x, (x.shape[0], x.shape[1] // 64, 8, 4, 2))


@triton.jit
def _key_block_max(xb, TRANSPOSED: tl.constexpr):
    """Each 16-key block's max in a _key_blocks view, the block's own axes kept (size 1), so it broadcasts."""
    if TRANSPOSED:
        return tl.max(xb, axis=1, keep_dims=True)
    else:
        return tl.max(tl.max(xb, axis=4, keep_dims=True), axis=2, keep_dims=True)


@triton.jit
def _per_query(x, TRANSPOSED: tl.constexpr):
    """A (BLOCK_M,) per-query vector shaped to broadcast against a _key_blocks view."""
    if TRANSPOSED:
        return x[None, None, :]
    else:
        return x[:, None, None, None, None]


@triton.jit
def _phi_blocks(p, amax, IEEE: tl.constexpr, FP16: tl.constexpr, FP8_CAST: tl.constexpr):
    """phi(p) for p >= 0 in a _key_blocks view, given each block's max ``amax`` (broadcastable), in the dot's
    dtype (fp32 under the interpreter). The numbers of fake_quant_tile(EXACT_DIV=False, NONNEG=True): scale
    s = e4m3(amax * (1/6)), y = p * (1/s); then _round_p's packed rounding, which differs from
    fake_quant_tile's only where y is exactly a rounding tie (it rounds up there, like the forward)."""
    sc = _e4m3(amax * (1.0 / 6.0), FP8_CAST)
    inv = tl.where(sc > 0.0, 1.0 / tl.where(sc > 0.0, sc, 1.0), 0.0)  # a block whose scale is 0 quantizes to 0
    return _round_p(p * inv, tl.broadcast_to(sc, p.shape), IEEE, FP16)


@triton.jit
def _attn_bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, dq_base, M, Lsum, Delta, DeltaS, QMean, bh, offs_n, lo, hi,
                         stride_dol, LQ, LK, NQB, DS_STRIDE, qk_scale,
                         HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
                         CAUSAL: tl.constexpr, P_NORMALIZED: tl.constexpr, QUANT_P: tl.constexpr,
                         IEEE: tl.constexpr, FUSED_DQ: tl.constexpr, TRANSPOSED: tl.constexpr,
                         PHI_FROM_S: tl.constexpr, FP16: tl.constexpr, FP8_CAST: tl.constexpr, SMOOTH_Q: tl.constexpr):
    """Query blocks [lo, hi) for one key block. MASK (constexpr): only ragged blocks and the causal diagonal pay
    for it. FUSED_DQ: also dQ += dS K^F from this S recompute, added atomically into an fp32 buffer (five MMAs
    per tile pair instead of seven over the two kernels; the price is the atomic traffic).

    TRANSPOSED (constexpr, two layouts to time against each other): S held as keys x queries, so P^T and dS^T
    come out of the MMA as dV's and dK's left operands, but a 16-key block of P spans 8 lanes (shuffles, and
    every lane repeats the block's scale arithmetic); or as queries x keys with the keys in _key_order, as in
    the forward, so every block lies in one thread, and P^T, dS^T pass through shared memory to their MMAs.
    PHI_FROM_S (constexpr): phi as the forward does it (_phi_blocks: block maxima taken on S before the exp2,
    packed rounding); False keeps the former fake_quant_tile on P~ (transposed only), to test and time against.
    SMOOTH_Q (constexpr, the q_smoothing option): S starts from the query block's ΔS row (keys in order), and dK
    gains (dS^T 1) q̄^T, the share of dS^T Q that the quantized Q_s = Q - q̄ lacks (SPEC §4's Q-smoothing term).
    A query tile lies in one 128-row block (the launcher checks that BLOCK_M divides 128, and tiles start at
    multiples of BLOCK_M).
    """
    offs_d = tl.arange(0, HEAD_DIM)
    dot_ty = k.dtype
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        # Q^F (its transpose when TRANSPOSED); padded query rows read as 0 and need no mask further on:
        # their dO and D are 0, so they add nothing to dK, dV
        q = _load_keys(q_base, offs_m, offs_d, LQ, HEAD_DIM, MASK, TRANSPOSED)
        if MASK:
            row_ok = offs_m < LQ
            m = tl.load(M + bh * LQ + offs_m, mask=row_ok, other=0.0)
            inv_l = 1.0 / tl.load(Lsum + bh * LQ + offs_m, mask=row_ok, other=1.0)
            delta = tl.load(Delta + bh * LQ + offs_m, mask=row_ok, other=0.0)
            do = tl.load(do_base + offs_m[:, None] * stride_dol + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        else:
            m = tl.load(M + bh * LQ + offs_m)
            inv_l = 1.0 / tl.load(Lsum + bh * LQ + offs_m)
            delta = tl.load(Delta + bh * LQ + offs_m)
            do = tl.load(do_base + offs_m[:, None] * stride_dol + offs_d[None, :])
        do = do.to(dot_ty)
        if SMOOTH_Q:
            block = (bh * NQB + start_m // 128).to(tl.int64)  # the tile's 128-row smoothing block
            ds_row = _delta_s_row(DeltaS + block * 3 * DS_STRIDE, offs_n, LK, DS_STRIDE)
        # Padded keys are masked: they would enter the 16-key quantization blocks of real keys. With SMOOTH_Q
        # padded query rows are masked too: their S is ΔS, not 0, and 2^(ΔS scale + 11.4) may overflow to inf,
        # which times their zero dO would make NaN.
        if TRANSPOSED:
            if SMOOTH_Q:
                s = _dot(k, q, ds_row[:, None] + tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), IEEE)
            else:
                s = _dot(k, q, tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), IEEE)
            if MASK:
                valid = offs_n[:, None] < LK
                if CAUSAL:
                    valid = valid & (offs_n[:, None] <= offs_m[None, :])
                if SMOOTH_Q:
                    valid = valid & (offs_m[None, :] < LQ)
                s = tl.where(valid, s, float("-inf"))
        else:
            if SMOOTH_Q:
                s = _dot(q, tl.trans(k), ds_row[None, :] + tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), IEEE)
            else:
                s = _dot(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), IEEE)
            if MASK:
                valid = offs_n[None, :] < LK
                if CAUSAL:
                    valid = valid & (offs_n[None, :] <= offs_m[:, None])
                if SMOOTH_Q:
                    valid = valid & (offs_m[:, None] < LQ)
                s = tl.where(valid, s, float("-inf"))
        sb = _key_blocks(s, TRANSPOSED)
        base = _per_query(m - 11.392317422778761, TRANSPOSED)  # P~ = 2688 * 2^(S - m) = 2^(S - base)
        inv_lb = _per_query(inv_l, TRANSPOSED)
        p_tilde = tl.math.exp2(sb * qk_scale - base)
        p = p_tilde * inv_lb  # P = P~ / l, unquantized (dS)
        if not QUANT_P:
            pf = p
        elif PHI_FROM_S:
            # exp2 and the FMA before it are monotone, so a block's max P~ is exp2 of its max S, bit for bit:
            # one exp2 per block, and the scale's arithmetic need not wait for the elements' exp2
            amax = tl.math.exp2(_key_block_max(sb, TRANSPOSED) * qk_scale - base)
            if P_NORMALIZED:
                pf = _phi_blocks(p, amax * inv_lb, IEEE, FP16, FP8_CAST)  # rounding is monotone too
            else:
                pf = _phi_blocks(p_tilde, amax, IEEE, FP16, FP8_CAST).to(tl.float32) * inv_lb
        else:
            tl.static_assert(TRANSPOSED)  # fake_quant_tile's blocks are 16 consecutive rows: natural key order
            if P_NORMALIZED:
                pf = fake_quant_tile(tl.reshape(p, s.shape), BLOCK_N, BLOCK_M, 0, False, False, True)
            else:
                pf = fake_quant_tile(tl.reshape(p_tilde, s.shape), BLOCK_N, BLOCK_M, 0, False, False, True) * inv_lb
        pf = tl.reshape(pf, s.shape).to(dot_ty)
        p = tl.reshape(p, s.shape)
        if TRANSPOSED:
            dv = _dot(pf, do, dv, IEEE)
            ds = p * (_dot(v, tl.trans(do), tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), IEEE) - delta[None, :])
            dk = _dot(ds.to(dot_ty), tl.trans(q), dk, IEEE)
            if SMOOTH_Q:
                ds_sum = tl.sum(ds, axis=1)  # dS^T 1 over the tile's queries, in fp32
        else:
            dv = _dot(tl.trans(pf), do, dv, IEEE)
            ds = p * (_dot(do, tl.trans(v), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), IEEE) - delta[:, None])
            dk = _dot(tl.trans(ds.to(dot_ty)), q, dk, IEEE)
            if SMOOTH_Q:
                ds_sum = tl.sum(ds, axis=0)
        if SMOOTH_Q:  # dK += (dS^T 1) q̄^T: rank 1, BLOCK_N x HEAD_DIM FMAs (the dK MMA: BLOCK_M times more)
            dk += ds_sum[:, None] * tl.load(QMean + block * HEAD_DIM + offs_d)[None, :]
        if FUSED_DQ:
            if TRANSPOSED:
                ds = tl.trans(ds)
            dq = _dot(ds.to(dot_ty), k, tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32), IEEE)
            dq_ptrs = dq_base + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
            if MASK:
                tl.atomic_add(dq_ptrs, dq, mask=(offs_m < LQ)[:, None], sem="relaxed")
            else:
                tl.atomic_add(dq_ptrs, dq, sem="relaxed")
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(QF, KF, VF, DO, M, Lsum, Delta, DK, DV, DQAcc, DeltaS, QMean,
                   stride_dob, stride_doh, stride_dol,
                   stride_kb, stride_kh, stride_kl,
                   H, LQ, LK, NQB, DS_STRIDE, qk_scale, sm_scale,
                   HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   CAUSAL: tl.constexpr, P_NORMALIZED: tl.constexpr, IEEE: tl.constexpr, QUANT_P: tl.constexpr,
                   FUSED_DQ: tl.constexpr = False, TRANSPOSED: tl.constexpr = True, PHI_FROM_S: tl.constexpr = True,
                   FP16: tl.constexpr = False, FP8_CAST: tl.constexpr = False, SMOOTH_Q: tl.constexpr = False):
    """One key block per program, looping over query blocks: dV = P^F^T dO, dK = dS^T Q^F * scale.
    QUANT_P=False drops phi (benchmarks use it to price the quantization). FUSED_DQ: also dS K^F into DQAcc
    ((B*H, LQ, HEAD_DIM) fp32, zeroed; unscaled), and no dQ kernel runs. TRANSPOSED, PHI_FROM_S: see
    _attn_bwd_dkdv_inner. SMOOTH_Q (constexpr: the q_smoothing option; off, the kernel is as without it): DeltaS
    (B*H, NQB, 3, DS_STRIDE) bf16, ΔS in exact parts with keys in order (_delta_s with KEY_TILE=0), QMean
    (B*H, NQB, HEAD_DIM) fp32 the 128-row block means q̄; QF holds phi(Q - q̄). The program owns its keys, so their
    order is free: K, V are loaded, and dK, dV stored, in the order whose 16-key blocks the layout keeps together
    (_key_order unless TRANSPOSED)."""
    start_n = tl.program_id(0)
    bh = tl.program_id(1)
    if SMOOTH_Q:
        tl.static_assert(128 % BLOCK_M == 0)  # a query tile's rows share one 128-row smoothing block
    if TRANSPOSED:
        tl.static_assert(BLOCK_N % 16 == 0)
        offs_n = start_n * BLOCK_N + tl.arange(0, BLOCK_N)
    else:
        tl.static_assert(BLOCK_N % 64 == 0)  # _key_order: each lane holds whole 16-key blocks
        offs_n = start_n * BLOCK_N + _key_order(BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    k = _load_keys(KF + bh * LK * HEAD_DIM, offs_n, offs_d, LK, HEAD_DIM, True, False)
    v = _load_keys(VF + bh * LK * HEAD_DIM, offs_n, offs_d, LK, HEAD_DIM, True, False)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    q_base = QF + bh * LQ * HEAD_DIM
    do_base = DO + (bh // H) * stride_dob + (bh % H) * stride_doh
    dq_base = DQAcc + bh * LQ * HEAD_DIM
    # Query blocks: [lo, mid) masked (causal: the diagonal; queries before this key block never see it),
    # [mid, full_hi) unmasked, [full_hi, LQ) masked (the ragged last block). A ragged key block masks all.
    if CAUSAL:
        lo = (start_n * BLOCK_N // BLOCK_M) * BLOCK_M
        mid = tl.minimum(tl.cdiv((start_n + 1) * BLOCK_N, BLOCK_M) * BLOCK_M, LQ)
    else:
        lo = 0
        mid = 0
    mid = tl.where((start_n + 1) * BLOCK_N <= LK, mid, LQ)
    full_hi = tl.maximum(mid, (LQ // BLOCK_M) * BLOCK_M)
    dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, dq_base, M, Lsum, Delta, DeltaS, QMean, bh, offs_n,
                                  lo, mid, stride_dol, LQ, LK, NQB, DS_STRIDE, qk_scale, HEAD_DIM, BLOCK_M, BLOCK_N,
                                  True, CAUSAL, P_NORMALIZED, QUANT_P, IEEE, FUSED_DQ, TRANSPOSED, PHI_FROM_S, FP16,
                                  FP8_CAST, SMOOTH_Q)
    dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, dq_base, M, Lsum, Delta, DeltaS, QMean, bh, offs_n,
                                  mid, full_hi, stride_dol, LQ, LK, NQB, DS_STRIDE, qk_scale, HEAD_DIM, BLOCK_M,
                                  BLOCK_N, False, CAUSAL, P_NORMALIZED, QUANT_P, IEEE, FUSED_DQ, TRANSPOSED, PHI_FROM_S,
                                  FP16, FP8_CAST, SMOOTH_Q)
    dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, q_base, do_base, dq_base, M, Lsum, Delta, DeltaS, QMean, bh, offs_n,
                                  full_hi, LQ, stride_dol, LQ, LK, NQB, DS_STRIDE, qk_scale, HEAD_DIM, BLOCK_M,
                                  BLOCK_N, True, CAUSAL, P_NORMALIZED, QUANT_P, IEEE, FUSED_DQ, TRANSPOSED, PHI_FROM_S,
                                  FP16, FP8_CAST, SMOOTH_Q)
    out = (bh // H) * stride_kb + (bh % H) * stride_kh + offs_n[:, None] * stride_kl + offs_d[None, :]
    tl.store(DK + out, (dk * sm_scale).to(DK.dtype.element_ty), mask=offs_n[:, None] < LK)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=offs_n[:, None] < LK)


@triton.jit
def _attn_bwd_dq_inner(dq, q, do, m, inv_l, delta, k_base, v_base, ds_base, offs_m, lo, hi, LK, DS_STRIDE, qk_scale,
                       HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
                       CAUSAL: tl.constexpr, IEEE: tl.constexpr, SMOOTH_Q: tl.constexpr):
    """Key tiles [lo, hi) for one query block; MASK only for the ragged last tile and the causal diagonal
    (padded query rows need none: their dO and D are 0, so their dS is 0, or NaN with SMOOTH_Q where ΔS overflows
    P, which stays in those rows and is not stored). SMOOTH_Q: S starts from the block's ΔS row (ds_base); dQ
    is dS K^F as without it (straight through Q_s = Q - q̄)."""
    offs_d = tl.arange(0, HEAD_DIM)
    dot_ty = q.dtype
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kt = _load_keys(k_base, offs_n, offs_d, LK, HEAD_DIM, MASK, True)
        vt = _load_keys(v_base, offs_n, offs_d, LK, HEAD_DIM, MASK, True)
        if SMOOTH_Q:
            s0 = _delta_s_row(ds_base, offs_n, LK, DS_STRIDE)[None, :] + tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        else:
            s0 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        s = _dot(q, kt, s0, IEEE)
        if MASK:
            valid = offs_n[None, :] < LK
            if CAUSAL:
                valid = valid & (offs_n[None, :] <= offs_m[:, None])
            s = tl.where(valid, s, float("-inf"))
        p = tl.math.exp2(s * qk_scale - (m[:, None] - 11.392317422778761)) * inv_l[:, None]  # P = P~ / l
        dp = _dot(do, vt, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), IEEE)
        ds = p * (dp - delta[:, None])
        dq = _dot(ds.to(dot_ty), tl.trans(kt), dq, IEEE)
    return dq


@triton.jit
def _attn_bwd_dq(QF, KF, VF, DO, M, Lsum, Delta, DQ, DeltaS,
                 stride_dob, stride_doh, stride_dol,
                 stride_qb, stride_qh, stride_ql,
                 H, LQ, LK, NQB, DS_STRIDE, qk_scale, sm_scale,
                 HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 CAUSAL: tl.constexpr, IEEE: tl.constexpr, SMOOTH_Q: tl.constexpr = False):
    """One query block per program, looping over key blocks: dQ = sum_j dS_j K^F_j * scale. SMOOTH_Q: S with the
    block's ΔS (DeltaS as _attn_bwd_dkdv's)."""
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    if SMOOTH_Q:
        tl.static_assert(128 % BLOCK_M == 0)  # the program's rows share one 128-row smoothing block
        ds_base = DeltaS + (bh * NQB + start_m * BLOCK_M // 128).to(tl.int64) * 3 * DS_STRIDE
    else:
        ds_base = DeltaS
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    dot_ty = QF.dtype.element_ty
    row_ok = offs_m < LQ
    q = tl.load(QF + bh * LQ * HEAD_DIM + offs_m[:, None] * HEAD_DIM + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    do = tl.load(DO + (bh // H) * stride_dob + (bh % H) * stride_doh + offs_m[:, None] * stride_dol + offs_d[None, :],
                 mask=row_ok[:, None], other=0.0).to(dot_ty)
    m = tl.load(M + bh * LQ + offs_m, mask=row_ok, other=0.0)
    inv_l = 1.0 / tl.load(Lsum + bh * LQ + offs_m, mask=row_ok, other=1.0)
    delta = tl.load(Delta + bh * LQ + offs_m, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    k_base = KF + bh * LK * HEAD_DIM
    v_base = VF + bh * LK * HEAD_DIM
    if CAUSAL:  # as in the forward: tiles ending at or before the block's first row need no mask
        hi = tl.minimum(LK, (start_m + 1) * BLOCK_M)
        full_hi = (tl.minimum(start_m * BLOCK_M + 1, LK) // BLOCK_N) * BLOCK_N
    else:
        hi = LK
        full_hi = (LK // BLOCK_N) * BLOCK_N
    dq = _attn_bwd_dq_inner(dq, q, do, m, inv_l, delta, k_base, v_base, ds_base, offs_m, 0, full_hi, LK, DS_STRIDE,
                            qk_scale, HEAD_DIM, BLOCK_M, BLOCK_N, False, CAUSAL, IEEE, SMOOTH_Q)
    dq = _attn_bwd_dq_inner(dq, q, do, m, inv_l, delta, k_base, v_base, ds_base, offs_m, full_hi, hi, LK, DS_STRIDE,
                            qk_scale, HEAD_DIM, BLOCK_M, BLOCK_N, True, CAUSAL, IEEE, SMOOTH_Q)
    out = DQ + (bh // H) * stride_qb + (bh % H) * stride_qh + offs_m[:, None] * stride_ql + offs_d[None, :]
    tl.store(out, (dq * sm_scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])


# ---------------------------------------------------------------------------------------------------
# Launch configs
# ---------------------------------------------------------------------------------------------------

# (BLOCK_M, BLOCK_N, num_warps, num_stages), in one place. Pin with ATTNQAT_FWD_CONFIG /
# ATTNQAT_BWD_CONFIG / ATTNQAT_DQ_CONFIG="128,64,8,3" for tests, benchmarks and tuning (docs/environment.md).
# Any of them pins attn_qat's Triton training kernels: on sm_90 they then run instead of the Gluon ones
# (hopper_gluon.gluon_sm90).
FWD_CONFIG_ENV, BWD_CONFIG_ENV, DQ_CONFIG_ENV = "ATTNQAT_FWD_CONFIG", "ATTNQAT_BWD_CONFIG", "ATTNQAT_DQ_CONFIG"
# Measured on an H100 at (1, 40, 32760, 128) by bench/tune_attn_qat.py (docs/kernels.md has the table).
# Inference forward: 128x128 tiles, 8 warps, 3 stages (50.9 ms vs 53-54 ms for 64x64/4 and 128x64/8); at
# head_dim 64, 128x64/8 (32.5 ms vs 38.1 for 128x128).
FWD_CONFIG_GPU = {64: LaunchConfig(128, 64, 8, 3), 128: LaunchConfig(128, 128, 8, 3)}
# Training forward: at 128, 70.9 vs 72.5 ms; at 64, 64x64/4/3 (H200, mini's (32, 4, 2304, 64), bench/tune_attn_qat.py
# --head-dim-64, 2026-11-28: 0.77 ms against 0.96 for 128x64/8/3 and 0.89 for 128x128/8/3)
FWD_TRAIN_CONFIG_GPU = {64: LaunchConfig(64, 64, 4, 3), 128: LaunchConfig(128, 64, 8, 3)}
# Backward, dK/dV kernel (BLOCK_M queries per step, BLOCK_N keys per program), per layout (TRANSPOSED, see
# _attn_bwd_dkdv_inner). Measured on an H200 at (1, 40, 32760, 128), the whole backward with phi from S
# (bench/tune_attn_qat.py --bwd-phi, 2026-11-24; cuDNN fwd+bwd 140.9 ms): untransposed 128x64/8/2 168.7 ms
# (3 stages need 243 KB of shared memory: more than Hopper's 227), 64x64/4/3 180.1, 128x128/8/2 272.8;
# transposed 32x64/4/4 181.1, 32x64/4/3 191.3 (the former phi there: 218.4). Compiled for sm_90 (Triton 3.9),
# untransposed 128x64/8 is the one tile that does not spill (7 spill stores; 64x128/8: 394, 128x128/8: 319).
# At head_dim 64 (H200, mini's (32, 4, 2304, 64), --head-dim-64, 2026-11-28; cuDNN fwd+bwd 1.48 ms), the whole
# backward: untransposed 64x64/4/3 1.48 ms, 64x64/4/2 1.60, 128x128/8/2 1.69, 128x64/8/2 1.99; transposed 32x128/4/3
# 2.13, 32x64/4/4 2.24. BWD_TRANSPOSED picks the layout per head_dim (attn_qat_backward's transposed= overrides it).
# dQ: 128x64 (at 64: 1.48 ms, against 1.49-1.72 for five other tiles).
BWD_CONFIG_GPU = {True: {64: LaunchConfig(32, 64, 4, 4), 128: LaunchConfig(32, 64, 4, 4)},
                  False: {64: LaunchConfig(64, 64, 4, 3), 128: LaunchConfig(128, 64, 8, 2)}}
BWD_TRANSPOSED = {64: False, 128: False}
DQ_CONFIG_GPU = {64: LaunchConfig(128, 64, 8, 3), 128: LaunchConfig(128, 64, 8, 3)}
# Interpreter: small tiles keep numpy arrays small; the result does not depend on them. Kernels whose keys
# are in _key_order (the forward, the untransposed dK/dV kernel) need BLOCK_N >= 64.
CONFIG_INTERPRET = LaunchConfig(32, 32, 4, 1)
CONFIG_INTERPRET_64 = LaunchConfig(32, 64, 4, 1)


def fwd_config(head_dim: int, training: bool) -> LaunchConfig:
    if interpreting():
        return pinned_config(FWD_CONFIG_ENV) or CONFIG_INTERPRET_64
    table = FWD_TRAIN_CONFIG_GPU if training else FWD_CONFIG_GPU
    return pinned_config(FWD_CONFIG_ENV) or table[head_dim]


def bwd_transposed(head_dim: int) -> bool:
    """The dK/dV kernel's default layout at ``head_dim`` (BWD_TRANSPOSED; transposed at head dims never timed)."""
    return BWD_TRANSPOSED.get(head_dim, True)


def bwd_config(head_dim: int, transposed: bool) -> LaunchConfig:
    if interpreting():
        return pinned_config(BWD_CONFIG_ENV) or (CONFIG_INTERPRET if transposed else CONFIG_INTERPRET_64)
    return pinned_config(BWD_CONFIG_ENV) or BWD_CONFIG_GPU[transposed][head_dim]


def dq_config(head_dim: int) -> LaunchConfig:
    if interpreting():
        return pinned_config(DQ_CONFIG_ENV) or CONFIG_INTERPRET
    return pinned_config(DQ_CONFIG_ENV) or DQ_CONFIG_GPU[head_dim]


# ---------------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------------


def native_fp4(device: torch.device) -> int:
    """Whether (non-zero) the inference forward runs Q K^T on the GPU's native block-scaled FP4 MMA
    (tl.dot_scaled over NVFP4 storage): a Blackwell GPU (sm_100/sm_120) and a Triton that compiles the
    forward's NVFP4 dot_scaled for it. The value is the kernel's PACKED_QK. ATTNQAT_NATIVE_FP4=0 keeps the
    bf16 emulation."""
    arch = fp4_mma_arch(device)
    return native_qk_form(arch) if arch else 0


@functools.lru_cache(maxsize=None)
def native_qk_form(arch: int) -> int:
    """The PACKED_QK form of the inference forward that this Triton compiles for sm_<arch> (a compile only,
    no GPU needed): 1 (dot_scaled as is), 2 (from a runtime zero accumulator: Triton 3.6/3.7 on sm_100),
    or 0 (no NVFP4 dot_scaled there: Triton 3.6 on sm_90, for instance; the exact emulation runs)."""
    cfg = FWD_CONFIG_GPU[128]
    return first_that_compiles(lambda form: compile_forward(arch, cfg, HEAD_DIM=128, CAUSAL=False, SMOOTH_Q=False,
                                                            PACKED_QK=form), (1, 2))


def compile_forward(arch: int, cfg: LaunchConfig, **constexprs):
    """Compile the inference forward (bf16, quantized P) for sm_<arch> without a GPU; ``constexprs`` set
    HEAD_DIM, CAUSAL, SMOOTH_Q and PACKED_QK. Returns Triton's compiled kernel (``.asm["ptx"]`` etc.)."""
    packed = constexprs["PACKED_QK"]
    ptrs = {"QF": "*u8" if packed else "*bf16", "KF": "*u8" if packed else "*bf16", "QS": "*u8", "KS": "*u8",
            "VF": "*bf16", "O": "*bf16", "OAux": "*bf16", "M": "*fp32", "Lsum": "*fp32", "DeltaS": "*bf16"}
    const = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, TRAINING=False, QUANT_P=True, IEEE=False, FP16=False,
                 FP8_CAST=arch >= 89, **constexprs)
    return compile_for(_attn_fwd, arch, types={**ptrs, "qk_scale": "fp32"}, constexprs=const, aligned=tuple(ptrs),
                       num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def compile_backward(arch: int, cfg: LaunchConfig, **constexprs):
    """Compile the dK/dV kernel (bf16, phi of P~ with the final max) for sm_<arch> without a GPU; ``constexprs``
    set HEAD_DIM, CAUSAL and TRANSPOSED, and may set its other flags (default: QUANT_P, PHI_FROM_S, no FUSED_DQ, no
    SMOOTH_Q)."""
    ptrs = {**dict.fromkeys(("QF", "KF", "VF", "DO", "DK", "DV", "DeltaS"), "*bf16"),
            **dict.fromkeys(("M", "Lsum", "Delta", "DQAcc", "QMean"), "*fp32")}
    const = {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "P_NORMALIZED": False, "IEEE": False, "QUANT_P": True,
             "FUSED_DQ": False, "PHI_FROM_S": True, "FP16": False, "FP8_CAST": arch >= 89, **constexprs}
    return compile_for(_attn_bwd_dkdv, arch, types={**ptrs, "qk_scale": "fp32", "sm_scale": "fp32"},
                       constexprs=const, aligned=tuple(ptrs), num_warps=cfg.num_warps, num_stages=cfg.num_stages)


DELTA_S_TILE = (64, 64)  # (keys, query blocks) per step of _delta_s on the GPU; (128, 64), (128, 128) were slower
DELTA_S_BYTES = 2 << 30  # ΔS past this is made for groups of heads in turn (delta_s_head_groups)


def delta_s_width(lk: int, block_n: int) -> int:
    """ΔS row length for a forward over block_n-key tiles: Lk padded to whole tiles (it loads whole tiles unmasked)."""
    return triton.cdiv(lk, block_n) * block_n


def delta_s_head_groups(b: int, h: int, lq: int, width: int) -> list[slice]:
    """Head ranges, in order, whose ΔS ((B, heads, ceil(Lq/128), 3, width) bf16: Lq/128 x width x 6 bytes a head)
    stays within DELTA_S_BYTES, one head at least: one range when the whole fits. Q smoothing's and sage3's ΔS is
    10 GiB for Wan 14B's 40 heads at 720p in one piece."""
    per_head = b * triton.cdiv(lq, SAGE3_Q_BLOCK) * 3 * width * 2
    group = max(1, min(h, DELTA_S_BYTES // per_head))
    return [slice(h0, min(h, h0 + group)) for h0 in range(0, h, group)]


def _into_heads(full, part, hs: slice, heads: int):
    """Copy ``part`` (a tensor, None, or a tuple of them: what a launcher returns for the heads ``hs``) into ``full``
    (the same structure over all ``heads``; None: allocated like ``part``, contiguous, by the first group's call)
    and return ``full``."""
    if part is None:
        return None
    if isinstance(part, tuple):
        return tuple(_into_heads(f, p, hs, heads) for f, p in zip(full or (None,) * len(part), part))
    if full is None:
        full = part.new_empty((part.shape[0], heads, *part.shape[2:]))
    full[:, hs] = part
    return full


def delta_s_parts(k: torch.Tensor, q_mean: torch.Tensor, width: int, key_tile: int,
                  k_mean: torch.Tensor | None = None) -> torch.Tensor:
    """ΔS = q̄ (K - k̄)^T (k̄ = ``k_mean`` (B, H, D) fp32: sage3's K smoothing; None: ΔS = q̄ K^T, q_smoothing's)
    for the 128-row block means ``q_mean`` (B, H, ceil(Lq/128), D) fp32 of Q, as (B, H, ceil(Lq/128), 3, width)
    bf16 exact parts hi, mid, lo (_delta_s). ``key_tile`` > 0: columns in the order of the forward's key_tile-wide
    tiles, ``width`` a whole number of them; 0: keys in order (the backward kernels'), ``width`` >= Lk."""
    b, h, lk, d = k.shape
    nqb = q_mean.shape[2]
    delta_s = torch.empty((b, h, nqb, 3, width), dtype=torch.bfloat16, device=k.device)
    block_n = 32 if interpreting() else DELTA_S_TILE[0]
    _delta_s[(triton.cdiv(width, block_n), b * h)](
        k, k if k_mean is None else k_mean, q_mean, delta_s, k.stride(0), k.stride(1), k.stride(2), h, lk, nqb,
        delta_s.stride(3), HEAD_DIM=d, BLOCK_N=block_n, BLOCK_QB=32 if interpreting() else DELTA_S_TILE[1],
        KEY_TILE=key_tile, CENTER_K=k_mean is not None, IEEE=interpreting(), num_stages=2)
    return delta_s


def _empty_like_layout(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Like ``torch.empty_like(x, dtype=dtype)``: keeps x's stride order, so a (B, L, H, D) caller's
    ``.transpose(1, 2)`` view gets an output it can transpose back for free."""
    return torch.empty_like(x, dtype=dtype)


def check_smoothing_tile(cfg: LaunchConfig, what: str) -> None:
    """Refuse a launch config whose query tiles would straddle two 128-row smoothing blocks (a pinned one)."""
    if SAGE3_Q_BLOCK % cfg.block_m:
        raise ValueError(f"{what} with q_smoothing needs BLOCK_M dividing {SAGE3_Q_BLOCK} (one smoothing block per "
                         f"query tile), got {cfg}")


def attn_qat_forward(q, k, v, *, sm_scale: float, causal: bool, training: bool, quant_p: bool = True,
                     quant_qkv: bool = True, config: LaunchConfig | None = None, operands: tuple | None = None,
                     delta_s: torch.Tensor | None = None, packed_qk: int | bool | None = None,
                     q_smoothing: bool = False, four_over_six: bool = False):
    """Launch the forward. Returns (o, o_aux | None, m, l, (q^F, k^F, v^F)); o in q's layout.

    ``quant_qkv=False`` and ``quant_p=False`` give plain high-precision attention through the same
    kernel (the drop-in ablation's backward needs its m and l). ``operands`` passes ready (B, H, L, D)
    contiguous work-dtype Q^F, K^F, V^F and ``delta_s`` (B, H, ceil(Lq/128), 3, Lk padded to whole tiles)
    bf16 the Q-smoothing correction as three exact parts, in the tiles' column order (sage3 prepares both).
    ``packed_qk``: Q K^T on the native block-scaled FP4 MMA over NVFP4 storage (then Q^F and K^F in
    ``operands`` are (codes, scales) pairs from ``quantize_heads(packed=True)``); an int picks the kernel
    form (see native_qk_form), True is 1; default: :func:`native_fp4`, for inference.
    ``q_smoothing`` (the FP4 modes' option; docs/kernels.md, "Q smoothing"): Q minus its 128-row block means q̄
    is quantized, and ΔS = q̄ K^T (K as given, unquantized) rides in through SMOOTH_Q; the operands then come back
    as (q^F, k^F, v^F, q̄), q̄ (B, H, ceil(Lq/128), D) fp32, all that attn_qat_backward's ``q_mean`` needs.
    ``four_over_six`` (the FP4 modes' option; docs/kernels.md, "Four Over Six"): the pre-pass picks each Q, K and V
    block's scale as Four Over Six does (nvfp4.quantize_heads); the kernels take the operands as they are.
    """
    b, h, lq, d = q.shape
    lk = k.shape[2]
    cfg = config or fwd_config(d, training)
    wdt = work_dtype(q.dtype)
    fp16 = q.dtype == torch.float16
    if packed_qk is None:
        packed_qk = native_fp4(q.device) if not training and quant_qkv else 0
    elif packed_qk and (training or not quant_qkv):
        raise ValueError("attn_qat_forward: packed_qk is for the quantized inference forward")
    packed_qk = int(packed_qk)
    if q_smoothing and (operands is not None or delta_s is not None or not quant_qkv):
        raise ValueError("attn_qat_forward: q_smoothing prepares its own operands and ΔS, from quantized Q, K, V")
    if four_over_six and (operands is not None or not quant_qkv):
        raise ValueError("attn_qat_forward: four_over_six is the pre-pass's: it needs quantize_qkv and no operands")
    groups = delta_s_head_groups(b, h, lq, delta_s_width(lk, cfg.block_n)) if q_smoothing else []
    if len(groups) > 1:  # ΔS for all heads at once would pass DELTA_S_BYTES: the heads in groups, in turn
        o = out = None
        for hs in groups:
            o_g, *rest = attn_qat_forward(q[:, hs], k[:, hs], v[:, hs], sm_scale=sm_scale, causal=causal,
                                          training=training, quant_p=quant_p, config=config, packed_qk=packed_qk,
                                          q_smoothing=True, four_over_six=four_over_six)
            if o is None:
                o = _empty_like_layout(q, o_g.dtype)
            o[:, hs] = o_g
            out = _into_heads(out, tuple(rest), hs, q.shape[1])
        return (o, *out)
    q_mean = None
    if operands is not None:
        qf, kf, vf = operands
    elif quant_qkv:  # q_smoothing (checked above to come with quant_qkv): Q minus its block means, q̄ kept for ΔS
        if q_smoothing:
            qf, q_mean = quantize_heads(q, wdt, block_mean=SAGE3_Q_BLOCK, packed=packed_qk,
                                        four_over_six=four_over_six)
        else:
            qf = quantize_heads(q, wdt, packed=packed_qk, four_over_six=four_over_six)
        kf = quantize_heads(k, wdt, packed=packed_qk, four_over_six=four_over_six)
        vf = quantize_heads(v, wdt, four_over_six=four_over_six)
    else:
        qf, kf, vf = (t.to(wdt).contiguous() for t in (q, k, v))
    if packed_qk:
        (qf, qs), (kf, ks) = qf, kf
        qs, ks = qs.view(torch.uint8), ks.view(torch.uint8)
    else:
        qs = ks = qf  # unused
    o = _empty_like_layout(q, wdt)
    o_aux = torch.empty((b, h, lq, d), dtype=wdt, device=q.device) if training else o
    m = torch.empty((b, h, lq), dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)

    def launch(c, delta_s=delta_s):
        if q_smoothing:  # ΔS laid out for c's key tiles: a step-down (launch_fitting) lays it out again
            check_smoothing_tile(c, "the FP4 forward")
            delta_s = delta_s_parts(k, q_mean, delta_s_width(lk, c.block_n), c.block_n)
        _attn_fwd[(triton.cdiv(lq, c.block_m), b * h)](
            qf, kf, vf, qs, ks, o, o_aux, m, l, vf if delta_s is None else delta_s,
            o.stride(0), o.stride(1), o.stride(2),
            h, lq, lk, 0 if delta_s is None else delta_s.shape[2], 0 if delta_s is None else delta_s.stride(3),
            sm_scale * LOG2E,
            HEAD_DIM=d, BLOCK_M=c.block_m, BLOCK_N=c.block_n, CAUSAL=causal, TRAINING=training,
            QUANT_P=quant_p, IEEE=interpreting(), SMOOTH_Q=delta_s is not None, FP16=fp16,
            FP8_CAST=fp8_cast(q.device), PACKED_QK=packed_qk, num_warps=c.num_warps, num_stages=c.num_stages)

    if delta_s is not None:  # laid out for cfg's tiles: sage3_forward finds the config that fits
        launch(cfg)
    else:
        launch_fitting(launch, cfg, ("attn_qat forward", q.device, d, training, packed_qk, q_smoothing))
    if q_smoothing:
        return o, (o_aux if training else None), m, l, (qf, kf, vf, q_mean)
    return o, (o_aux if training else None), m, l, (qf, kf, vf)


def attn_qat_backward(do, q, k, qf, kf, vf, o_aux, m, l, *, sm_scale: float, causal: bool,
                      p_bwd: str = "final_max", config: LaunchConfig | None = None,
                      config_dq: LaunchConfig | None = None, quant_p: bool = True, fused_dq: bool = False,
                      transposed: bool | None = None, phi_from_s: bool = True, q_mean: torch.Tensor | None = None):
    """Launch the backward. Returns (dq, dk, dv) in the layouts and dtype of q and k.

    ``config`` is the dK/dV kernel's (BLOCK_M: queries per step, BLOCK_N: keys per program),
    ``config_dq`` the dQ kernel's; ``quant_p=False`` drops phi(P) (benchmarks, the drop-in ablation).
    ``transposed``: the dK/dV kernel's layout (TRANSPOSED, see _attn_bwd_dkdv_inner; default: bwd_transposed(head_dim)).
    Two ablation-only variants stay for tests/test_attn_qat.py (which holds them equal to the default) and
    bench/tune_attn_qat.py (which times them, ``--fused-dq`` and ``--bwd-phi``); nothing else sets them:
    ``fused_dq=True``: dQ from the dK/dV kernel's S recompute by fp32 atomics instead of a second kernel (6-53%
    slower than two kernels per tile on an H100, docs/kernels.md); its sums run in another order, so dQ differs
    from the two-kernel dQ by fp32 rounding.
    ``phi_from_s=False``: phi as fake_quant_tile on P~ (transposed only) instead of from S.
    Neither ``transposed`` nor ``phi_from_s`` changes a number: dk, dv are the same bit for bit at the same tiles
    (tested under the interpreter).
    ``q_mean``: the q_smoothing forward's q̄ (its operands' fourth; then ``qf`` is phi(Q - q̄)). S is recomputed
    with ΔS = q̄ K^T from ``k`` by the forward's own _delta_s (so bit for bit its ΔS), dQ = dS K^F scale goes
    straight through Q - q̄ (q̄'s own gradient is dropped), and dK gains (dS^T 1) q̄^T scale per 128-row block.
    """
    b, h, lq, d = qf.shape
    if transposed is None:
        transposed = bwd_transposed(d)
    if not (phi_from_s or transposed):
        raise ValueError("attn_qat_backward: phi_from_s=False (phi by fake_quant_tile on P~) needs transposed=True")
    lk = kf.shape[2]
    cfg = config or bwd_config(d, transposed)
    cfg_dq = config_dq or dq_config(d)
    groups = delta_s_head_groups(b, h, lq, lk) if q_mean is not None else []
    if len(groups) > 1:  # as the forward: ΔS for groups of heads in turn, each group's saved tensors made contiguous
        dq, dk = _empty_like_layout(q, q.dtype), _empty_like_layout(k, k.dtype)
        dv = torch.empty_like(dk)
        for hs in groups:
            part = attn_qat_backward(do[:, hs], q[:, hs], k[:, hs], *(t[:, hs].contiguous() for t in
                                                                      (qf, kf, vf, o_aux, m, l)),
                                     sm_scale=sm_scale, causal=causal, p_bwd=p_bwd, config=config,
                                     config_dq=config_dq, quant_p=quant_p, fused_dq=fused_dq, transposed=transposed,
                                     phi_from_s=phi_from_s, q_mean=q_mean[:, hs].contiguous())
            for full, got in zip((dq, dk, dv), part):
                full[:, hs] = got
        return dq, dk, dv
    wdt = work_dtype(q.dtype)
    if do.stride(-1) != 1:
        do = do.contiguous()
    delta = torch.empty_like(m)
    _attn_bwd_preprocess[(triton.cdiv(lq, 64), b * h)](o_aux, do, delta, do.stride(0), do.stride(1), do.stride(2),
                                                       h, lq, HEAD_DIM=d, BLOCK_M=64)
    dq = _empty_like_layout(q, wdt)
    dk = _empty_like_layout(k, wdt)
    dv = torch.empty_like(dk)  # same layout as dk: one set of strides for both stores
    dq_acc = torch.zeros(b, h, lq, d, device=q.device, dtype=torch.float32) if fused_dq else dk
    smooth = q_mean is not None
    # keys in order (KEY_TILE=0): the backward kernels gather ΔS at their own key offsets
    delta_s = delta_s_parts(k, q_mean, lk, 0) if smooth else dk
    nqb, ds_stride = (delta_s.shape[2], delta_s.stride(3)) if smooth else (0, 0)

    def launch_dkdv(c):  # a tile that does not fit the GPU's shared memory: launch_fitting steps down
        if smooth:
            check_smoothing_tile(c, "the backward (dK/dV)")
        _attn_bwd_dkdv[(triton.cdiv(lk, c.block_n), b * h)](
            qf, kf, vf, do, m, l, delta, dk, dv, dq_acc, delta_s, q_mean if smooth else delta,
            do.stride(0), do.stride(1), do.stride(2), dk.stride(0), dk.stride(1), dk.stride(2),
            h, lq, lk, nqb, ds_stride, sm_scale * LOG2E, sm_scale,
            HEAD_DIM=d, BLOCK_M=c.block_m, BLOCK_N=c.block_n, CAUSAL=causal, IEEE=interpreting(),
            P_NORMALIZED=(p_bwd == "normalized"), QUANT_P=quant_p, FUSED_DQ=fused_dq, TRANSPOSED=transposed,
            PHI_FROM_S=phi_from_s, FP16=q.dtype == torch.float16, FP8_CAST=fp8_cast(q.device), SMOOTH_Q=smooth,
            num_warps=c.num_warps, num_stages=c.num_stages)

    launch_fitting(launch_dkdv, cfg, ("attn_qat backward (dK/dV)", q.device, d, transposed, fused_dq, smooth))
    if fused_dq:
        dq.copy_(dq_acc.mul_(sm_scale))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(k.dtype)

    def launch_dq(c):  # 128x64/8/3 needs 116 KB on sm_89 (99 KB there): launch_fitting steps down
        if smooth:
            check_smoothing_tile(c, "the backward (dQ)")
        _attn_bwd_dq[(triton.cdiv(lq, c.block_m), b * h)](
            qf, kf, vf, do, m, l, delta, dq, delta_s, do.stride(0), do.stride(1), do.stride(2),
            dq.stride(0), dq.stride(1), dq.stride(2), h, lq, lk, nqb, ds_stride, sm_scale * LOG2E, sm_scale,
            HEAD_DIM=d, BLOCK_M=c.block_m, BLOCK_N=c.block_n, CAUSAL=causal, IEEE=interpreting(), SMOOTH_Q=smooth,
            num_warps=c.num_warps, num_stages=c.num_stages)

    launch_fitting(launch_dq, cfg_dq, ("attn_qat backward (dQ)", q.device, d, smooth))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(k.dtype)


# ---------------------------------------------------------------------------------------------------
# torch.library custom ops over the launches, with fake (shape-only) implementations, so torch.compile
# traces models that use them without graph breaks; Dynamo traces the autograd Functions below.
#
#     attnqat::attn_qat_fwd  (q, k, v, sm_scale, causal, training, q_smoothing=False, four_over_six=False)
#                            -> (o, o_aux, m, l, q^F, k^F, v^F, q̄)   (q̄: empty without q_smoothing)
#     attnqat::attn_qat_bwd  (do, q, k, q^F, k^F, v^F, o_aux, m, l, sm_scale, causal, p_bwd, q̄=None) -> (dq, dk, dv)
#     attnqat::attn_qat_dropin_bwd  (do, q, k, v, o, sm_scale, causal) -> (dq, dk, dv)   (the ablation's backward)
# ---------------------------------------------------------------------------------------------------


def _q_mean_shape(q: torch.Tensor) -> tuple[int, ...]:
    """q̄'s shape, (B, H, ceil(Lq/128), D): one mean per 128-row smoothing block."""
    b, h, lq, d = q.shape
    return b, h, triton.cdiv(lq, SAGE3_Q_BLOCK), d


@torch.library.custom_op("attnqat::attn_qat_fwd", mutates_args=(), device_types=("cuda", "cpu"))
def attn_qat_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, causal: bool,
                 training: bool, q_smoothing: bool = False, four_over_six: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                            torch.Tensor, torch.Tensor]:
    o, o_aux, m, l, (qf, kf, vf, *q_mean) = attn_qat_forward(q, k, v, sm_scale=sm_scale, causal=causal,
                                                             training=training, q_smoothing=q_smoothing,
                                                             four_over_six=four_over_six)
    if o_aux is None:  # inference: an empty placeholder (custom ops return tensors, not None)
        o_aux = o.new_empty(0)
    return o.to(q.dtype), o_aux, m, l, qf, kf, vf, q_mean[0] if q_smoothing else m.new_empty(0)


@attn_qat_fwd.register_fake
def _(q, k, v, sm_scale, causal, training, q_smoothing=False, four_over_six=False):
    b, h, lq, d = q.shape
    wdt = work_dtype(q.dtype)
    aux = q.new_empty((b, h, lq, d), dtype=wdt) if training else q.new_empty(0, dtype=wdt)
    return (torch.empty_like(q), aux, q.new_empty((b, h, lq), dtype=torch.float32),
            q.new_empty((b, h, lq), dtype=torch.float32), q.new_empty(q.shape, dtype=wdt),
            k.new_empty(k.shape, dtype=wdt), v.new_empty(v.shape, dtype=wdt),
            q.new_empty(_q_mean_shape(q) if q_smoothing else (0,), dtype=torch.float32))


@torch.library.custom_op("attnqat::attn_qat_bwd", mutates_args=(), device_types=("cuda", "cpu"))
def attn_qat_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, qf: torch.Tensor, kf: torch.Tensor,
                 vf: torch.Tensor, o_aux: torch.Tensor, m: torch.Tensor, l: torch.Tensor, sm_scale: float,
                 causal: bool, p_bwd: str, q_mean: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return attn_qat_backward(do, q, k, qf, kf, vf, o_aux, m, l, sm_scale=sm_scale, causal=causal, p_bwd=p_bwd,
                             q_mean=q_mean)


@attn_qat_bwd.register_fake
def _(do, q, k, qf, kf, vf, o_aux, m, l, sm_scale, causal, p_bwd, q_mean=None):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(k)


@torch.library.custom_op("attnqat::attn_qat_dropin_bwd", mutates_args=(), device_types=("cuda", "cpu"))
def attn_qat_dropin_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                        sm_scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # m and l of the unquantized logits (a FlashAttention forward would have saved its LSE), then the backward
    # without phi, D from the FP4 forward's O
    _, _, m, l, (qc, kc, vc) = attn_qat_forward(q, k, v, sm_scale=sm_scale, causal=causal, training=False,
                                                quant_p=False, quant_qkv=False)
    return attn_qat_backward(do, q, k, qc, kc, vc, o.contiguous(), m, l, sm_scale=sm_scale, causal=causal,
                             quant_p=False)


@attn_qat_dropin_bwd.register_fake
def _(do, q, k, v, o, sm_scale, causal):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(k)


# ---------------------------------------------------------------------------------------------------
# Autograd
# ---------------------------------------------------------------------------------------------------


class AttnQATFunction(torch.autograd.Function):
    """FP4 forward that saves Q^F, K^F, V^F, O', m, l (and q̄ with q_smoothing); the matching FP4-consistent
    backward."""

    @staticmethod
    def forward(ctx, q, k, v, sm_scale, causal, p_bwd, q_smoothing=False, four_over_six=False):
        ctx.sm_scale, ctx.causal, ctx.p_bwd, ctx.q_smoothing = sm_scale, causal, p_bwd, q_smoothing
        if recomputed_later():  # checkpointing's first pass: the output alone (_common.saved_tensors_recomputed)
            q_mean = torch.empty((), dtype=torch.float32, device=q.device)
            q_mean = q_mean.expand(_q_mean_shape(q)) if q_smoothing else q_mean.new_empty(0)
            ctx.save_for_backward(q, k, *training_placeholders(q, k, v), q_mean)
            return attn_qat_fwd(q, k, v, sm_scale, causal, False, q_smoothing, four_over_six)[0]
        o, o_aux, m, l, qf, kf, vf, q_mean = attn_qat_fwd(q, k, v, sm_scale, causal, True, q_smoothing,
                                                          four_over_six)
        ctx.save_for_backward(q, k, qf, kf, vf, o_aux, m, l, q_mean)
        return o

    @staticmethod
    def backward(ctx, do):
        refuse_double_backward("attn_qat")
        q, k, qf, kf, vf, o_aux, m, l, q_mean = ctx.saved_tensors
        dq, dk, dv = attn_qat_bwd(do, q, k, qf, kf, vf, o_aux, m, l, ctx.sm_scale, ctx.causal, ctx.p_bwd,
                                  q_mean if ctx.q_smoothing else None)
        return dq, dk, dv, None, None, None, None, None


class AttnQATDropinFunction(torch.autograd.Function):
    """The paper's failing ablation: FP4 forward, then a standard high-precision FlashAttention
    backward (P recomputed from unquantized Q, K; no phi; D = rowsum(dO * O) with the FP4 O)."""

    @staticmethod
    def forward(ctx, q, k, v, sm_scale, causal, q_smoothing=False, four_over_six=False):
        o = attn_qat_fwd(q, k, v, sm_scale, causal, False, q_smoothing, four_over_six)[0]
        ctx.save_for_backward(q, k, v, o)
        ctx.sm_scale, ctx.causal = sm_scale, causal
        return o

    @staticmethod
    def backward(ctx, do):
        refuse_double_backward("attn_qat_dropin")
        q, k, v, o = ctx.saved_tensors
        dq, dk, dv = attn_qat_dropin_bwd(do, q, k, v, o, ctx.sm_scale, ctx.causal)
        return dq, dk, dv, None, None, None, None


# ---------------------------------------------------------------------------------------------------
# The modes' paths (inputs already checked: the registry calls them after attention()'s one check), then the
# public functions, which check their inputs first
# ---------------------------------------------------------------------------------------------------


def nvfp4_unchecked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sm_scale: float | None = None,
                    causal: bool = False, q_smoothing: bool = False, four_over_six: bool = False) -> torch.Tensor:
    """The FP4 inference forward (nvfp4's, and attn_qat's and attn_qat_dropin's without grad) through its custom
    op, without O'."""
    return attn_qat_fwd(q, k, v, default_scale(q.shape[-1], sm_scale), causal, False, q_smoothing, four_over_six)[0]


def attn_qat_unchecked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sm_scale: float | None = None,
                       causal: bool = False, p_bwd: str = "final_max", q_smoothing: bool = False,
                       four_over_six: bool = False) -> torch.Tensor:
    """:func:`attn_qat_attention` on checked inputs."""
    if needs_grad(q, k, v):
        return AttnQATFunction.apply(q, k, v, default_scale(q.shape[-1], sm_scale), causal, p_bwd, q_smoothing,
                                     four_over_six)
    return nvfp4_unchecked(q, k, v, sm_scale=sm_scale, causal=causal, q_smoothing=q_smoothing,
                           four_over_six=four_over_six)


def attn_qat_dropin_unchecked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sm_scale: float | None = None,
                              causal: bool = False, q_smoothing: bool = False,
                              four_over_six: bool = False) -> torch.Tensor:
    """:func:`attn_qat_dropin_attention` on checked inputs (``q_smoothing`` and ``four_over_six`` change the FP4
    forward only: the high-precision backward's logits are Q K^T with or without them)."""
    if needs_grad(q, k, v):
        return AttnQATDropinFunction.apply(q, k, v, default_scale(q.shape[-1], sm_scale), causal, q_smoothing,
                                           four_over_six)
    return nvfp4_unchecked(q, k, v, sm_scale=sm_scale, causal=causal, q_smoothing=q_smoothing,
                           four_over_six=four_over_six)


def attn_qat_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sm_scale: float | None = None,
                       causal: bool = False, p_bwd: str = "final_max", q_smoothing: bool = False,
                       four_over_six: bool = False) -> torch.Tensor:
    """Attn-QAT attention: NVFP4 forward with the matching backward (SPEC §2).

    Arguments:
        q: (batch, heads, seqlen_q, head_dim); k, v: (batch, heads, seqlen_k, head_dim); bf16 or fp16;
            head_dim 64 or 128; any strides with a contiguous last dim. CUDA, or CPU under
            ``TRITON_INTERPRET=1``.
        sm_scale: softmax scale, default 1/sqrt(head_dim).
        causal: top-left aligned causal mask (SDPA's ``is_causal``).
        p_bwd: ``"final_max"`` (default: the backward quantizes P~ = 2688 * 2^(S - m) with the saved
            integer max, i.e. exactly the forward's quantized P) or ``"normalized"`` (the published
            code's phi of the normalized P; an ablation that loses dV at long sequence lengths).
        q_smoothing: quantize Q minus its mean over each block of 128 query rows and add the mean's logits
            q̄ K^T back unquantized (docs/kernels.md, "Q smoothing"; off by default). The backward recomputes S
            with them, dQ goes straight through Q - q̄ (the gradient through q̄ is dropped) and dK gains
            (dS^T 1) q̄^T * scale per block.
        four_over_six: each block of 16 of Q, K and V takes the scale e4m3(amax / 6) or e4m3(amax / 4) whose
            quantization error is smaller (Four Over Six, docs/kernels.md; off by default: SPEC §1's amax / 6).
            P keeps SPEC §1's scales. The backward uses the forward's Q^F, K^F, V^F, so it matches.
    Return:
        out: (batch, heads, seqlen_q, head_dim), q's dtype and stride order.

    Without grad (inference) it runs the forward alone and skips the auxiliary output O'.
    """
    check_qkv(q, k, v, name="attn_qat_attention", sm_scale=sm_scale, causal=causal)
    if p_bwd not in P_BWD_CHOICES:
        raise ValueError(f"p_bwd {p_bwd!r} not in {P_BWD_CHOICES}")
    _check_switches(q_smoothing=q_smoothing, four_over_six=four_over_six)
    return attn_qat_unchecked(q, k, v, sm_scale=sm_scale, causal=causal, p_bwd=p_bwd, q_smoothing=q_smoothing,
                              four_over_six=four_over_six)


def attn_qat_dropin_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sm_scale: float | None = None,
                              causal: bool = False, q_smoothing: bool = False,
                              four_over_six: bool = False) -> torch.Tensor:
    """The ``attn_qat_dropin`` ablation: NVFP4 forward, high-precision backward (unstable in training).
    Arguments and return as :func:`attn_qat_attention`."""
    check_qkv(q, k, v, name="attn_qat_dropin_attention", sm_scale=sm_scale, causal=causal)
    _check_switches(q_smoothing=q_smoothing, four_over_six=four_over_six)
    return attn_qat_dropin_unchecked(q, k, v, sm_scale=sm_scale, causal=causal, q_smoothing=q_smoothing,
                                     four_over_six=four_over_six)


def _check_switches(**switches) -> None:
    for name, value in switches.items():
        if type(value) is not bool:
            raise ValueError(f"{name} {value!r} not in (False, True)")


def nvfp4_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sm_scale: float | None = None,
                    causal: bool = False, q_smoothing: bool = False, four_over_six: bool = False) -> torch.Tensor:
    """Naive NVFP4 attention (inference only): phi on Q, K, V along head_dim and on P along keys.
    Arguments and return as :func:`attn_qat_attention`."""
    check_qkv(q, k, v, name="nvfp4_attention", sm_scale=sm_scale, causal=causal)
    _check_switches(q_smoothing=q_smoothing, four_over_six=four_over_six)
    if needs_grad(q, k, v):
        raise ValueError("nvfp4_attention is inference-only (no backward): call it under torch.no_grad() "
                         "or train with attn_qat_attention")
    return nvfp4_unchecked(q, k, v, sm_scale=sm_scale, causal=causal, q_smoothing=q_smoothing,
                           four_over_six=four_over_six)
