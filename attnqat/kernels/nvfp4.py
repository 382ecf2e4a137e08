"""NVFP4 quantization: e2m1 values with one e4m3 scale per block of 16 (SPEC §1).

    amax = max|x| over the block;  s = e4m3(amax / 6);  x^F = e2m1(x / s) * s

Two layers live here:

* ``@triton.jit`` helpers (:func:`round_e4m3`, :func:`round_e2m1`, :func:`fake_quant_tile`,
  :func:`pack_tile`, :func:`tile_keys`) that the attention kernels inline. Rounding is done by explicit
  fp32 arithmetic (integer adds on the bit pattern and the "add a magic constant" trick), never by
  float->fp8 casts, so the same code is exact under ``TRITON_INTERPRET=1`` and fast on the GPU.
* torch-facing functions: :func:`fake_quant_nvfp4` (a Triton launch on CUDA or under the interpreter, the
  torch reference otherwise); :func:`quantize_heads`, the FP4 attention kernels' pre-pass (phi of
  (B, H, L, D) Q, K, V, with sage3's smoothing, or NVFP4 storage for the native MMA); and
  :func:`quantize_nvfp4` / :func:`dequantize_nvfp4` for the packed storage format (two e2m1 codes per
  byte, element 0 in the low nibble; scales as float8_e4m3fn).

Every ``q * s`` is exactly representable in bf16 and fp16, so a 16-bit tensor-core dot over
dequantized operands with fp32 accumulation reproduces a block-scaled FP4 MMA up to summation order.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import interpreting
from .formats import E2M1_GRID, NVFP4_BLOCK as BLOCK
from .reference import e2m1_codes_ref, e4m3_scale_ref, fake_quant_nvfp4_ref


@triton.jit
def round_e4m3(x):
    """Round non-negative fp32 ``x`` to e4m3 (round-to-nearest-even, saturating at 448).

    Normal range (>= 2^-6): keep 3 of fp32's 23 mantissa bits by adding half an ulp (plus the
    tie-to-even bit) to the bit pattern and clearing the 20 low bits. Subnormal range: e4m3's spacing
    is a fixed 2^-9, and adding 1.5 * 2^14 pushes x into a binade whose ulp is 2^-9, so the fp32 add
    itself rounds to nearest even. NaN and +inf pass through (inf is not saturated: SPEC §1): NaN by an
    explicit select, since the bit add overflows a NaN with a large payload into the sign bit (-0.0); the
    GPU's NaN is 0x7FFFFFFF (the interpreter's, 0x7FC00000, does not overflow, so only a GPU showed it).
    """
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # -1048576 == ~0xFFFFF
    normal = bits.to(tl.float32, bitcast=True)
    subnormal = (x + 24576.0) - 24576.0  # 24576 = 1.5 * 2^14: ulp there is 2^-9
    s = tl.where(x < 0.015625, subnormal, normal)  # 0.015625 = 2^-6, e4m3's smallest normal
    s = tl.where((s > 448.0) & (s != float("inf")), 448.0, s)
    return tl.where(x != x, x, s)


@triton.jit
def _e2m1_magic(a):
    """1.5 * 2^(23+k) for the e2m1 spacing 2^k at a >= 0: 0.5 below 2 (k = -1), then 2^(e-1) in
    [2^e, 2^(e+1)). Built from a's exponent field with integer ops (they issue on the INT32 pipe,
    beside the FP32 work): exponent + 22, mantissa 0.5, floored at 1.5 * 2^22 (0x4AC00000).
    NaN and inf wrap negative and take the floor, so NaN still propagates through the add."""
    bits = a.to(tl.int32, bitcast=True)
    return tl.maximum((bits & 0x7F800000) + 0x0B400000, 0x4AC00000).to(tl.float32, bitcast=True)


@triton.jit
def round_e2m1_nonneg(y):
    """round_e2m1 for y >= 0 (P~): no sign handling. The clamp stays: a block whose scale lands in
    e4m3's subnormal range is rounded by up to half its spacing, and y can then exceed 6.375."""
    magic = _e2m1_magic(y)
    return tl.minimum((y + magic) - magic, 6.0)


@triton.jit
def round_e2m1(y):
    """Round fp32 ``y`` to the e2m1 grid ±{0, .5, 1, 1.5, 2, 3, 4, 6}, nearest, ties to the even
    code, saturating at 6. NaN propagates.

    The grid's spacing is 0.5 below 2, 1 in [2, 4) and 2 from 4 on; adding 1.5 * 2^(23+k) moves
    |y| into a binade whose fp32 ulp is exactly that spacing 2^k, so the add rounds (RNE) and the
    subtraction is exact. Ties to even in that binade are ties to the even e2m1 code.
    """
    a = tl.abs(y)
    magic = _e2m1_magic(a)
    r = (a + magic) - magic
    r = tl.where(r > 6.0, 6.0, r)
    return tl.where(y < 0.0, -r, r)


@triton.jit
def e2m1_code(r):
    """The 4-bit e2m1 code (sign in bit 3, taken from r's sign bit so -0 keeps it) of a value r on the
    e2m1 grid, as int32."""
    a = tl.abs(r)
    idx = tl.where(a < 2.0, a * 2.0, tl.where(a < 4.0, a + 2.0, a * 0.5 + 4.0)).to(tl.int32)
    return idx | tl.where(r.to(tl.int32, bitcast=True) < 0, 8, 0)


@triton.jit
def e2m1_value(code):
    """The value of 4-bit e2m1 codes (int32): 0, .5 below code 2, then 2^(c/2 - 1) (1 + (c & 1) / 2)."""
    idx = code & 7
    mag = tl.where(idx < 2, idx.to(tl.float32) * 0.5,
                   tl.math.exp2(((idx >> 1) - 1).to(tl.float32)) * (1.0 + 0.5 * (idx & 1).to(tl.float32)))
    return tl.where((code & 8) != 0, -mag, mag)


@triton.jit
def e4m3_bits(s):
    """The float8_e4m3fn bit pattern (int32) of an e4m3 scale s >= 0 (round_e4m3's output), built from
    s's fp32 fields (no fp8 cast: exact under the interpreter too). NaN and inf map to NaN (0x7F):
    NVFP4 storage has no inf, and a non-finite block must stay non-finite (SPEC §1)."""
    b = s.to(tl.int32, bitcast=True)
    normal = ((((b >> 23) & 0xFF) - 120) << 3) | ((b >> 20) & 7)  # exponent bias 127 -> 7
    subnormal = (s * 512.0).to(tl.int32)  # s = m * 2^-9 below 2^-6
    bits = tl.where(s < 0.015625, subnormal, normal)
    return tl.where((s != s) | (s > 448.0), 0x7F, bits)


@triton.jit
def e4m3_value(bits):
    """The value (fp32) of float8_e4m3fn bit patterns (int32, sign ignored: scales are >= 0)."""
    e = (bits >> 3) & 15
    normal = (((e + 120) << 23) | ((bits & 7) << 20)).to(tl.float32, bitcast=True)
    v = tl.where(e == 0, (bits & 7).to(tl.float32) * 0.001953125, normal)  # 2^-9
    return tl.where((bits & 0x7F) == 0x7F, float("nan"), v)


# The maxima Four Over Six tries in the kernels, in order (the earlier kept on equal errors): the option's 6 and 4,
# or, set by experiments (experiments/fp4_noise_sources.py's four_over_six_tops), one of the other searches here.
# The FOUR_OVER_SIX constexpr of the kernels below is the search's number: 0 off, else its index here + 1. The
# second is _block_scale's loop over the maxima 6 - 0.5 i, made from the same formula.
FOUR_OVER_SIX_SEARCHES = ((6.0, 4.0), tuple(6.0 - 0.5 * i for i in range(7)))
four_over_six_tops: tuple[float, ...] = FOUR_OVER_SIX_SEARCHES[0]


def four_over_six_search(on: bool) -> int:
    """The FOUR_OVER_SIX constexpr for the option ``on``: 0, or the number of :data:`four_over_six_tops` in
    :data:`FOUR_OVER_SIX_SEARCHES` (a ValueError naming those the kernels have, for any other)."""
    if not on:
        return 0
    tops = tuple(float(t) for t in four_over_six_tops)
    if tops not in FOUR_OVER_SIX_SEARCHES:
        raise ValueError(f"the kernels' Four Over Six tries the maxima {' or '.join(map(str, FOUR_OVER_SIX_SEARCHES))}"
                         f", not {tops} (the reference tries any: reference.four_over_six_scale's tops)")
    return FOUR_OVER_SIX_SEARCHES.index(tops) + 1


@triton.jit
def _phi_error(xb, s):
    """The squared error of phi with block scales ``s`` over each block of 16 (float32 sums)."""
    e = round_e2m1(tl.math.div_rn(xb, tl.where(s > 0.0, s, 1.0)[:, :, None])) * s[:, :, None] - xb
    return tl.sum(e * e, axis=2)


@triton.jit
def _block_scale(xb, amax, FOUR_OVER_SIX: tl.constexpr):
    """The e4m3 scale of each block of 16 along xb's last axis (xb (ROWS, COLS/16, 16), amax (ROWS, COLS/16)):
    e4m3(amax / 6) (SPEC §1), or with FOUR_OVER_SIX the one of e4m3(amax / 6) and e4m3(amax / 4) whose phi has
    the smaller squared error (the six on equal errors; reference.four_over_six_scale); FOUR_OVER_SIX 2: of the
    maxima 6, 5.5, ..., 3, the first with the least error (FOUR_OVER_SIX_SEARCHES). True division, as
    fake_quant_tile's EXACT_DIV. A non-finite amax stays the scale (every error NaN: the six is kept)."""
    tl.static_assert(FOUR_OVER_SIX >= 0 and FOUR_OVER_SIX <= 2)
    s = round_e4m3(tl.math.div_rn(amax, 6.0))
    if FOUR_OVER_SIX == 1:
        s4 = round_e4m3(tl.math.div_rn(amax, 4.0))
        s = tl.where(_phi_error(xb, s4) < _phi_error(xb, s), s4, s)
    elif FOUR_OVER_SIX == 2:
        err = _phi_error(xb, s)
        for i in tl.static_range(1, 7):  # the maxima 5.5 down to 3: FOUR_OVER_SIX_SEARCHES[1] after the 6
            st = round_e4m3(tl.math.div_rn(amax, 6.0 - 0.5 * i))
            et = _phi_error(xb, st)
            s = tl.where(et < err, st, s)
            err = tl.where(et < err, et, err)
    return s


@triton.jit
def pack_tile(x, ROWS: tl.constexpr, COLS: tl.constexpr, FOUR_OVER_SIX: tl.constexpr = False):
    """phi of a (ROWS, COLS) fp32 tile along axis 1 in NVFP4 storage: (codes (ROWS, COLS/2) uint8, two per
    byte, element 0 in the low nibble; scale bits (ROWS, COLS/16) uint8, float8_e4m3fn patterns).
    Same numerics as fake_quant_tile(EXACT_DIV, PROPAGATE_NAN, FOUR_OVER_SIX): a non-finite block gets a NaN
    scale."""
    xb = tl.reshape(x, (ROWS, COLS // 16, 16))
    amax = tl.max(tl.abs(xb), axis=2) + tl.sum(xb * 0.0, axis=2)
    s = _block_scale(xb, amax, FOUR_OVER_SIX)
    r = round_e2m1(tl.math.div_rn(xb, tl.where(s > 0.0, s, 1.0)[:, :, None]))
    codes = e2m1_code(tl.where(s[:, :, None] > 0.0, r, 0.0))
    lo, hi = tl.split(tl.reshape(codes, (ROWS, COLS // 2, 2)))
    return (lo | (hi << 4)).to(tl.uint8), e4m3_bits(s).to(tl.uint8)


@triton.jit
def unpack_tile(codes, scale_bits, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Inverse of pack_tile: q * s as a (ROWS, COLS) fp32 tile."""
    c = codes.to(tl.int32)
    vals = e2m1_value(tl.reshape(tl.join(c & 15, c >> 4), (ROWS, COLS)))
    s = e4m3_value(scale_bits.to(tl.int32))
    return tl.reshape(tl.reshape(vals, (ROWS, COLS // 16, 16)) * s[:, :, None], (ROWS, COLS))


@triton.jit
def fake_quant_tile(x, ROWS: tl.constexpr, COLS: tl.constexpr, AXIS: tl.constexpr,
                    EXACT_DIV: tl.constexpr, PROPAGATE_NAN: tl.constexpr, NONNEG: tl.constexpr = False,
                    FOUR_OVER_SIX: tl.constexpr = False):
    """phi(x) for a 2-D fp32 tile, blocks of 16 along ``AXIS`` (0 or 1); returns fp32.

    EXACT_DIV: constexpr so the hot loop can use a reciprocal multiply (SPEC §1 allows it: results
    differ from true division only at rounding ties, by one grid step). PROPAGATE_NAN: constexpr so
    kernels whose input cannot hold NaN skip the extra reduction; with it, a NaN (or inf) anywhere in
    a block makes the whole block non-finite, like the reference (GPU max ignores NaN otherwise).
    NONNEG: constexpr for P (>= 0): block max and rounding without sign handling.
    FOUR_OVER_SIX: constexpr (AXIS 1, EXACT_DIV): each block's scale is _block_scale's Four Over Six choice.
    A block whose scale rounds to 0 needs no select: y is then x (exact path) or 0, and q = r * 0 = 0.
    """
    tl.static_assert(AXIS == 0 or AXIS == 1)
    tl.static_assert(not FOUR_OVER_SIX or (AXIS == 1 and EXACT_DIV))
    if AXIS == 1:
        tl.static_assert(COLS % 16 == 0)
        xb = tl.reshape(x, (ROWS, COLS // 16, 16))
        if NONNEG:
            amax = tl.max(xb, axis=2)
        else:
            amax = tl.max(tl.abs(xb), axis=2)
        if PROPAGATE_NAN:
            amax += tl.sum(xb * 0.0, axis=2)  # NaN if the block holds NaN or inf
        if EXACT_DIV:
            s = _block_scale(xb, amax, FOUR_OVER_SIX)
            safe = tl.where(s > 0.0, s, 1.0)
            y = tl.math.div_rn(xb, safe[:, :, None])
        else:
            s = round_e4m3(amax * (1.0 / 6.0))
            inv = tl.where(s > 0.0, 1.0 / tl.where(s > 0.0, s, 1.0), 0.0)  # no 1/0 even in dead lanes
            y = xb * inv[:, :, None]
        if NONNEG:
            q = round_e2m1_nonneg(y) * s[:, :, None]
        else:
            q = round_e2m1(y) * s[:, :, None]
        return tl.reshape(q, (ROWS, COLS))
    else:
        tl.static_assert(ROWS % 16 == 0)
        xb = tl.reshape(x, (ROWS // 16, 16, COLS))
        if NONNEG:
            amax = tl.max(xb, axis=1)
        else:
            amax = tl.max(tl.abs(xb), axis=1)
        if PROPAGATE_NAN:
            amax += tl.sum(xb * 0.0, axis=1)
        if EXACT_DIV:
            s = round_e4m3(tl.math.div_rn(amax, 6.0))
            safe = tl.where(s > 0.0, s, 1.0)
            y = tl.math.div_rn(xb, safe[:, None, :])
        else:
            s = round_e4m3(amax * (1.0 / 6.0))
            inv = tl.where(s > 0.0, 1.0 / tl.where(s > 0.0, s, 1.0), 0.0)  # no 1/0 even in dead lanes
            y = xb * inv[:, None, :]
        if NONNEG:
            q = round_e2m1_nonneg(y) * s[:, None, :]
        else:
            q = round_e2m1(y) * s[:, None, :]
        return tl.reshape(q, (ROWS, COLS))


@triton.jit
def tile_keys(c, BLOCK_N: tl.constexpr):
    """The key (offset in its tile) that column offset c of an attention forward's BLOCK_N-key tile holds
    (BLOCK_N a multiple of 64): key (BLOCK_N/4) r + 2j + e sits in column 8j + 2r + e.

    Hopper's and Ampere's MMA accumulators give lane r of each quad the columns 8j + 2r + {0, 1}, so each
    lane then holds BLOCK_N/4 consecutive keys: every 16-key NVFP4 block of P lies in one thread's registers
    and its max and sum need no shuffles (attn_qat._key_order). sage3 stores ΔS in this order too."""
    return (BLOCK_N // 4) * ((c // 2) % 4) + 2 * (c // 8) + c % 2


@triton.jit
def tile_column(key, BLOCK_N: tl.constexpr):
    """Inverse of tile_keys: the column of a BLOCK_N-key tile that holds the key at offset ``key`` in it."""
    quarter = key // (BLOCK_N // 4)
    inner = key % (BLOCK_N // 4)
    return 8 * (inner // 2) + 2 * quarter + inner % 2


@triton.jit
def _fake_quant_rows_kernel(X, Y, n_rows, n_cols, stride_xr, stride_yr, pre_scale,
                            BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """phi along the last axis of a (n_rows, n_cols) view; tails are zero-padded (padding never
    changes a block's amax)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    x = tl.load(X + rows[:, None] * stride_xr + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    q = fake_quant_tile(x * pre_scale, BLOCK_R, BLOCK_C, 1, True, True)
    q = tl.math.div_rn(q, pre_scale)
    tl.store(Y + rows[:, None] * stride_yr + cols[None, :], q, mask=mask)


@triton.jit
def _quantize_rows(X, XF, XS, Mean, XIn, stride_b, stride_h, stride_l, H, L, L_OUT,
                   HEAD_DIM: tl.constexpr, BLOCK_L: tl.constexpr, CENTER: tl.constexpr, AXIS: tl.constexpr,
                   PACK: tl.constexpr, KEY_TILE: tl.constexpr = 0, BOTH_ORDERS: tl.constexpr = False,
                   FOUR_OVER_SIX: tl.constexpr = False):
    """phi over (BLOCK_L, HEAD_DIM) tiles: along head_dim (AXIS=1) or in blocks of 16 tokens (AXIS=0,
    SageAttention3's V). CENTER (constexpr, SageAttention3's smoothing): 0 none; 1 subtract Mean[bh]
    (K's token mean); 2 subtract the tile's own row mean (Q per 128 rows) and store it to Mean[bh, tile].
    PACK (constexpr, AXIS=1 only): store NVFP4 storage instead of q * s, codes to XF (B*H, L, HEAD_DIM/2)
    uint8 and scale bits to XS (B*H, L, HEAD_DIM/16), for the native block-scaled MMA.
    KEY_TILE (constexpr; 0: rows in order): store row n of each KEY_TILE-row tile at tile_column(n), the order
    in which a forward over KEY_TILE-key tiles wants keys (tile_keys), into XF (B*H, L_OUT, HEAD_DIM) with L_OUT
    = L rounded up to whole tiles; the rows past L are written as zeros.
    BOTH_ORDERS (constexpr, with KEY_TILE): also store the rows in order into XIn (B*H, L, HEAD_DIM), from the same
    load and the same phi: one read of X for the two layouts (the Gluon forward's and the backwards').
    FOUR_OVER_SIX (constexpr, AXIS=1 only): the block scales chosen as _block_scale does.
    Padded rows are zeros, which never change a block's scale."""
    bh = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L)
    cols = tl.arange(0, HEAD_DIM)
    row_ok = rows[:, None] < L
    x_ptrs = X + (bh // H) * stride_b + (bh % H) * stride_h + rows[:, None] * stride_l + cols[None, :]
    x = tl.load(x_ptrs, mask=row_ok, other=0.0).to(tl.float32)
    if CENTER == 1:
        x = tl.where(row_ok, x - tl.load(Mean + bh * HEAD_DIM + cols)[None, :], 0.0)
    elif CENTER == 2:
        count = tl.minimum(L - tl.program_id(0) * BLOCK_L, BLOCK_L)
        mean = tl.sum(x, axis=0) / count
        tl.store(Mean + (bh * tl.num_programs(0) + tl.program_id(0)) * HEAD_DIM + cols, mean)
        x = tl.where(row_ok, x - mean[None, :], 0.0)
    if PACK:
        tl.static_assert(AXIS == 1)
        codes, scale_bits = pack_tile(x, BLOCK_L, HEAD_DIM, FOUR_OVER_SIX)
        half = tl.arange(0, HEAD_DIM // 2)
        tl.store(XF + bh * L * (HEAD_DIM // 2) + rows[:, None] * (HEAD_DIM // 2) + half[None, :], codes, mask=row_ok)
        blocks = tl.arange(0, HEAD_DIM // 16)
        tl.store(XS + bh * L * (HEAD_DIM // 16) + rows[:, None] * (HEAD_DIM // 16) + blocks[None, :], scale_bits,
                 mask=row_ok)
    else:
        xf = fake_quant_tile(x, BLOCK_L, HEAD_DIM, AXIS, True, True, False, FOUR_OVER_SIX)
        if KEY_TILE:
            tl.static_assert(KEY_TILE % BLOCK_L == 0 or BLOCK_L % KEY_TILE == 0)
            out_rows = (rows // KEY_TILE) * KEY_TILE + tile_column(rows % KEY_TILE, KEY_TILE)
            out_ok = rows[:, None] < L_OUT
        else:
            out_rows = rows
            out_ok = row_ok
        tl.store(XF + bh * L_OUT * HEAD_DIM + out_rows[:, None] * HEAD_DIM + cols[None, :],
                 xf.to(XF.dtype.element_ty), mask=out_ok)
        if BOTH_ORDERS:
            tl.static_assert(KEY_TILE > 0)
            tl.store(XIn + bh * L * HEAD_DIM + rows[:, None] * HEAD_DIM + cols[None, :],
                     xf.to(XIn.dtype.element_ty), mask=row_ok)


def fake_quant_nvfp4(x: torch.Tensor, dim: int = -1, block: int = 16, pre_scale: float = 1.0) -> torch.Tensor:
    """NVFP4 fake quantization phi (SPEC §1): quantize to e2m1 with e4m3 block scales and dequantize.

    Arguments:
        x: any float tensor.
        dim: the axis the blocks run along (the axis the following matmul reduces over).
        block: elements per scale block; NVFP4 fixes it at 16.
        pre_scale: quantize ``pre_scale * x`` and divide the result by it (SageAttention3's two-level
            scaling of P uses 2688 = 448 * 6).
    Return:
        a tensor of x's shape and dtype holding phi(x). Exact in bf16/fp16 (unless pre_scale != 1).

    CUDA tensors run the Triton kernel; CPU tensors run it under ``TRITON_INTERPRET=1`` and the torch
    reference otherwise.
    """
    if block != BLOCK:
        raise ValueError(f"NVFP4 blocks are 16 elements, got block={block}")
    if not x.is_floating_point():
        raise ValueError(f"fake_quant_nvfp4 needs a float tensor, got {x.dtype}")
    if not (x.is_cuda or interpreting()):
        return fake_quant_nvfp4_ref(x, dim=dim, pre_scale=pre_scale)
    if x.numel() == 0:
        return x.clone()
    xt = x.movedim(dim, -1)
    shape = xt.shape
    rows = xt.reshape(-1, shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=torch.float32, device=x.device)
    block_r, block_c = 16, 128
    grid = (triton.cdiv(rows.shape[0], block_r), triton.cdiv(rows.shape[1], block_c))
    _fake_quant_rows_kernel[grid](rows, out, rows.shape[0], rows.shape[1], rows.stride(0), out.stride(0),
                                  float(pre_scale), BLOCK_R=block_r, BLOCK_C=block_c)
    return out.to(x.dtype).reshape(shape).movedim(-1, dim)


def quantize_heads(x: torch.Tensor, dtype: torch.dtype, *, tokens: bool = False, center: torch.Tensor | None = None,
                   block_mean: int | None = None, packed: bool = False, key_tile: int = 0, both_orders: bool = False,
                   four_over_six: bool = False):
    """phi of a (B, H, L, D) tensor -> contiguous (B, H, L, D) in ``dtype``: along head_dim, or along
    tokens (``tokens=True``). ``center`` (B, H, D) fp32 is subtracted first; ``block_mean=n`` subtracts
    each block of n rows' own mean and also returns those means, (B, H, ceil(L/n), D) fp32.
    ``packed=True`` (along head_dim only) returns NVFP4 storage instead, a pair: codes (B, H, L, D/2) uint8
    and scales (B, H, L, D/16) float8_e4m3fn, as :func:`attnqat.kernels.quantize_nvfp4` lays them out.
    ``key_tile=n`` (plain phi along head_dim only) returns (B, H, ceil(L/n)*n, D) with each n-row tile's rows in
    the order a forward over n-key tiles reads them (``tile_keys``; the Gluon forward's K and V), zeros past L.
    ``both_orders=True`` (with ``key_tile``) returns a pair, (keys in order (B, H, L, D) contiguous, the key_tile
    layout above), from one pass: x is read once and both are written (the Gluon training forward's K and V, which
    its kernel reads in tile order and the backwards read in key order); each equals its one-order call exactly.
    ``four_over_six=True`` (along head_dim only): each block's scale is Four Over Six's choice
    (:func:`attnqat.kernels.reference.four_over_six_scale`), in every layout above, over the maxima
    :data:`four_over_six_tops` (6 and 4 unless an experiment set the wider search)."""
    b, h, n, d = x.shape
    if packed and tokens:
        raise ValueError("quantize_heads: packed storage is along head_dim only")
    if four_over_six and tokens:
        raise ValueError("quantize_heads: four_over_six is along head_dim only")
    if key_tile and (packed or tokens or block_mean or center is not None):
        raise ValueError("quantize_heads: key_tile is for plain phi along head_dim")
    if both_orders and not key_tile:
        raise ValueError("quantize_heads: both_orders needs key_tile (the second order)")
    n_out = triton.cdiv(n, key_tile) * key_tile if key_tile else n
    out = torch.empty((b, h, n_out, d // 2 if packed else d), dtype=torch.uint8 if packed else dtype, device=x.device)
    in_order = torch.empty((b, h, n, d), dtype=dtype, device=x.device) if both_orders else out
    scales = torch.empty((b, h, n, d // 16), dtype=torch.uint8, device=x.device) if packed else out
    block_l = block_mean or (32 if interpreting() else 64)
    num_warps = 8 if block_l >= 128 else 4
    if tokens and not interpreting():
        # blocks of 16 tokens: one warp per 16 rows keeps each block's max in one warp (0.26 ms against
        # 0.88 for 64 rows / 4 warps at (1, 40, 32760, 128) on an H100)
        block_l, num_warps = 16, 1
    grid = (triton.cdiv(n_out, block_l), b * h)
    mean = center
    if block_mean:
        mean = torch.empty((b, h, grid[0], d), dtype=torch.float32, device=x.device)
    elif center is None:
        mean = out  # unused
    _quantize_rows[grid](x, out, scales, mean, in_order, x.stride(0), x.stride(1), x.stride(2), h, n, n_out,
                         HEAD_DIM=d, BLOCK_L=block_l, CENTER=2 if block_mean else (0 if center is None else 1),
                         AXIS=0 if tokens else 1, PACK=packed, KEY_TILE=key_tile, BOTH_ORDERS=both_orders,
                         FOUR_OVER_SIX=four_over_six_search(four_over_six), num_warps=num_warps)
    if both_orders:
        return in_order, out
    if packed:
        out = (out, scales.view(torch.float8_e4m3fn))
    return (out, mean) if block_mean else out


def _blocks_last(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, int]:
    """Move ``dim`` last and zero-pad it to a multiple of 16; returns (blocks (..., nb, 16), length)."""
    xt = x.movedim(dim, -1).float()
    n = xt.shape[-1]
    pad = (-n) % BLOCK
    if pad:
        xt = torch.nn.functional.pad(xt, (0, pad))
    return xt.reshape(*xt.shape[:-1], -1, BLOCK), n


def quantize_nvfp4(x: torch.Tensor, dim: int = -1, block: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize to packed NVFP4 storage.

    Return:
        packed: uint8, x's shape with ``dim`` halved (rounded up to a multiple of 16 first); two e2m1
            codes per byte, element 0 in the low nibble, sign in bit 3 of each code.
        scales: float8_e4m3fn, x's shape with ``dim`` divided by 16 (rounded up).
    Non-finite blocks cannot be stored: they raise ``ValueError``.
    """
    if block != BLOCK:
        raise ValueError(f"NVFP4 blocks are 16 elements, got block={block}")
    xb, _ = _blocks_last(x, dim)
    if not torch.isfinite(xb).all():
        raise ValueError("quantize_nvfp4: input holds NaN or inf, which NVFP4 storage cannot represent")
    s = e4m3_scale_ref(xb.abs().amax(dim=-1))
    safe = torch.where(s > 0, s, torch.ones_like(s))
    codes = e2m1_codes_ref(torch.where(s[..., None] > 0, xb / safe[..., None], torch.zeros_like(xb)))
    codes = codes.reshape(*codes.shape[:-2], -1)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return packed.movedim(-1, dim).contiguous(), s.to(torch.float8_e4m3fn).movedim(-1, dim).contiguous()


def dequantize_nvfp4(packed: torch.Tensor, scales: torch.Tensor, dim: int = -1,
                     dtype: torch.dtype = torch.bfloat16, length: int | None = None) -> torch.Tensor:
    """Inverse of :func:`quantize_nvfp4`: returns ``q * s`` in ``dtype`` (exact in bf16/fp16).

    ``length`` trims the zero padding of a quantized axis whose size was not a multiple of 16.
    """
    p = packed.movedim(dim, -1).to(torch.int32)
    codes = torch.stack((p & 0xF, p >> 4), dim=-1).reshape(*p.shape[:-1], -1)
    grid = torch.tensor(E2M1_GRID, device=packed.device)
    mag = grid[codes & 0x7]
    val = torch.where((codes & 0x8) != 0, -mag, mag)
    s = scales.movedim(dim, -1).float()
    val = (val.reshape(*val.shape[:-1], -1, BLOCK) * s[..., None]).reshape(val.shape)
    if length is not None:
        val = val[..., :length]
    return val.to(dtype).movedim(-1, dim)
