"""SageBwd (SPEC §4, ``pv="int8"``, ``bwd="int8"``) for Hopper (sm_90) in Gluon: its forward, dK/dV and dQ kernels on
int8 wgmma (and bf16 for dP), warp-specialised as FlashAttention-3's kernels (a one-warp TMA load partition, two
consumer warpgroups of 64 rows that share nothing but the ring).

The numbers are the Triton kernels' (``sagebwd._attn_fwd``, ``_attn_bwd_dkdv``, ``_attn_bwd_dq``) element for
element: the same S from psi(Q), psi(K_s) and their block scales, the same online softmax and psi(P~) per row of a
key tile, the same P, dP, dS and per-row int8 blocks (P and dS per key over 64 queries for dK/dV, dS per query
over 64 keys for dQ), int32 products scaled and added to fp32 accumulators in the same order. What changes is where
the work runs:

- **forward**, one program per 128 queries (64 per consumer), stepping over 64-key tiles of psi(K) and psi(V)^T
  (the K-major copy): S by wgmma from shared memory, the softmax and psi(P~) in registers, P~ V with psi(P~) as
  wgmma's register operand; tile j's S is issued with tile j-1's P~ V (FlashAttention-3's intra-warpgroup
  pipelining).

- **dK/dV**, one program per 128 keys (64 per consumer), stepping over 64-query tiles. Each step computes
  S^T = psi(K) psi(Q)^T (keys x queries) rather than S, so P^T and dS^T come out of wgmma's accumulator with one
  key per row: their per-key int8 blocks are row maxima (a quad's shuffles), and psi(P^T), psi(dS^T) feed
  dV += psi(P)^T psi(dO) and dK += psi(dS)^T psi(Q_s) as wgmma's register operand, with no trip through shared
  memory. The B operands reduce over queries, so they are the K-major (D, L) int8 copies that the forward and
  the pre-pass already make (``kmajor_empty``): the ring carries psi(Q) (row-major, for S^T), psi(Q)^T, dO (bf16,
  for dP^T = V dO^T) and psi(dO)^T per query tile.
- **dQ**, one program per 128 queries (64 per consumer), stepping over 64-key tiles of psi(K), psi(K)^T and V:
  S, dP by wgmma, dS = P (dP - D) and its per-query int8 block in registers, dQ += psi(dS) psi(K_s) with dS as the
  register operand.

The int8 products are exact (int32), so splitting dK/dV's 128 keys over two warpgroups changes nothing; dP is a
bf16 wgmma with fp32 accumulation over head_dim in 16-element steps, as Triton's. ``sagebwd.sagebwd_forward`` and
``sagebwd_backward`` run these kernels on sm_90 for the int8 defaults with K-major copies and no Q-smoothing
(``sagebwd.gluon_forward``, ``gluon_backward`` decide); the Triton kernels stay the portable path and the reference
the GPU tests compare against. Design notes and measurements: docs/sagebwd.md ("Speed").
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._hardware import compile_for
from .formats import LOG2E, SAGEBWD_K_BLOCK, SAGEBWD_Q_BLOCK
from .hopper_gluon import _MISSING, _SHORT, _tile_desc_type, _tile_descriptor, _tma_ready

if not _MISSING:
    from .hopper_gluon import (LOADER_REGS, LOADER_WARPS, WS_CONSUMER_REGS, TensorDescriptor, _issue_consumer_tiles,
                               _tma_load, _wgmma_layout, fence_async_shared, gl, gluon, mbarrier, warpgroup_mma,
                               warpgroup_mma_wait)

BLOCK = 64  # rows per consumer warpgroup and per ring tile, both kernels: the int8 blocks of P and dS
CONSUMERS = 2  # consumer warpgroups per program
DKDV_STAGES = {64: 4, 128: 3}  # ring depth by head_dim: 40 KB a slot at 128 (psi(Q), psi(Q)^T, dO, psi(dO)^T)
DQ_STAGES = {64: 4, 128: 4}  # 32 KB a slot at 128 (psi(K), psi(K)^T, V)
FWD_STAGES = {64: 4, 128: 4}  # 16 KB a slot at 128 (psi(K), psi(V)^T)
WARPS = 4  # the default partition: the first consumer warpgroup

if not _MISSING:
    _WARPS = gl.constexpr(WARPS)  # the kernels' view of the launch constants
    _CONSUMERS = gl.constexpr(CONSUMERS)

    @gluon.jit
    def _max_nan(a, b):
        """max that returns NaN when either is NaN (max.NaN.f32): a row maximum that a NaN anywhere in it makes NaN."""
        return gl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

    @gluon.jit
    def _round_half_away_int8(y):
        """round(y) as int8, ties away from zero, exactly, for |y| <= 128 (here |y| <= 127): sagebwd's
        _round_half_away and the cast in three instructions instead of nine. trunc(y + copysign(0.5 - 2^-25, y)) is
        round-half-away for every fp32 |y| <= 128 (checked exhaustively): with 0.5 a y of 0.5 - 2^-25 would round
        up (the sum's tie goes to 1.0), with 0.5 - 2^-25 every tie k + 0.5 still lands on k + 1. The copysign is one
        bitwise op, the truncation the cast. NaN or inf gives some code: such a row's scale is NaN (_quant_rows), so
        its products are NaN anyway."""
        sign = y.to(gl.int32, bitcast=True) & -2147483648
        h = (sign | 0x3EFFFFFF).to(gl.float32, bitcast=True)  # 0x3EFFFFFF: 0.5 - 2^-25
        return (y + h).to(gl.int8)

    @gluon.jit
    def _mul_rn(a, b):
        """a * b rounded on its own (mul.rn.f32): ptxas may not fuse it with the add that follows into one FMA, which
        would round the sum, not the product and the sum (the division it stands for is never fused)."""
        a, b = gl.broadcast(a, b)
        return gl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=gl.float32, is_pure=True,
                                         pack=1)

    @gluon.jit
    def _quant_rows(x, a_layout: gl.constexpr):
        """psi(x) with one scale per row (sagebwd._quant_tile_rows, int8, bit for bit): the int8 codes in
        ``a_layout`` (wgmma's register operand) and the scales s = max(row amax, 1e-30) / 127, NaN for a row holding
        NaN or inf (the Triton kernel adds sum(x * 0) for that; here one NaN-propagating max: m - m is NaN for
        m = inf or NaN, and +0 otherwise, as the sum of signed zeros is)."""
        m = gl.reduce(gl.abs(x), 1, _max_nan)
        s = (gl.maximum(m, 1e-30) + (m - m)) / 127.0
        # x / s as the Triton kernel's division computes it (div.full.f32: x times the approximate reciprocal of s,
        # with power-of-two rescaling for operands at the ends of the range), with the reciprocal taken once per
        # row: s >= 1e-30 / 127 is a normal number and at most 2^121, so no rescaling applies to it, and where one
        # would apply to x (|x / s| far below 0.5) the code rounds to 0 either way
        xq = _round_half_away_int8(_mul_rn(x, (1.0 / s)[:, None]))
        return gl.convert_layout(xq, a_layout), s

    @gluon.jit
    def _rows(x, layout: gl.constexpr):
        """A per-row vector moved to ``layout`` (the row slice of another wgmma accumulator: the same rows)."""
        return gl.convert_layout(x, layout)

    @gluon.jit
    def _barriers(n: gl.constexpr, count: gl.constexpr):
        """n mbarriers in shared memory, each initialised to complete once ``count`` arrivals (and any expected TMA
        bytes) have come."""
        bars = gl.allocate_shared_memory(gl.int64, [n, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(n):
            mbarrier.init(bars.index(i), count=count)
        return bars

    @gluon.jit
    def _tiles(desc, n: gl.constexpr):
        """n shared-memory tiles for ``desc``'s TMA copies (a ring, or one per consumer)."""
        return gl.allocate_shared_memory(desc.dtype, [n] + desc.block_type.shape, desc.layout)

    @gluon.jit
    def _program(num_heads, ROWS: gl.constexpr):
        """(batch * head, batch, head, first row) of this program, which owns ROWS rows along grid axis 0."""
        bh = gl.program_id(1)
        return bh, bh // num_heads, bh % num_heads, gl.program_id(0) * ROWS

    @gluon.jit
    def _ring_barriers(NUM_STAGES: gl.constexpr):
        """The barriers every kernel here uses: one per consumer for its own tiles (loaded once), and the ring's ready
        and empty ones (a slot is free once every consumer is done with it)."""
        return _barriers(_CONSUMERS, 1), _barriers(NUM_STAGES, 1), _barriers(NUM_STAGES, _CONSUMERS)

    @gluon.jit
    def _query_program(q_desc, k_desc, seqlen_k, num_heads, QBLK: gl.constexpr, KBLK: gl.constexpr,
                       CAUSAL: gl.constexpr, num_warps: gl.constexpr):
        """A program of _CONSUMERS * BLOCK_M queries (the forward's, dQ's) stepping over BLOCK_N-key tiles (the
        descriptors' tiles): (batch * head, batch, head, first query, key tiles). The key tiles: every one, or, causal
        (top-left aligned), those up to its last query (the first consumer's last tile may be masked out whole, as in
        the Triton kernels' 128-query programs)."""
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
        gl.static_assert(num_warps == _WARPS)
        gl.static_assert(BLOCK_M == 16 * num_warps)  # a consumer's rows: one m64 wgmma tile
        gl.static_assert(KBLK % BLOCK_N == 0)  # one K (and V) block scale per key tile
        gl.static_assert(QBLK % (_CONSUMERS * BLOCK_M) == 0)  # causal: the program's rows end on a tile boundary
        bh, off_b, off_h, m0 = _program(num_heads, _CONSUMERS * BLOCK_M)
        if CAUSAL:
            n_blocks = gl.cdiv(gl.minimum(seqlen_k, m0 + _CONSUMERS * BLOCK_M), BLOCK_N)
        else:
            n_blocks = gl.cdiv(seqlen_k, BLOCK_N)
        return bh, off_b, off_h, m0, n_blocks

    # -----------------------------------------------------------------------------------------------------------
    # dK/dV: a program owns _CONSUMERS * 64 keys; the load partition brings each consumer's psi(K) and V tile once,
    # then streams the query tiles through a NUM_STAGES ring that both consumers read (a slot is free once both
    # arrived on its empty barrier).
    # -----------------------------------------------------------------------------------------------------------

    @gluon.jit
    def _dkdv_load(k8_desc, v_desc, q8_desc, qt_desc, do_desc, dot_desc, lse_ptr, delta_ptr, k_smem, v_smem, q8_bufs,
                   qt_bufs, do_bufs, dot_bufs, lse_bufs, delta_bufs, kv_ready, ready, empty, bh, off_b, off_h, n0, lo,
                   n_steps, seqlen_q, seqlen_k, NUM_STAGES: gl.constexpr):
        """Load partition. Per query tile: psi(Q), psi(Q)^T, dO, psi(dO)^T by TMA and the tile's lse and D by plain
        loads into shared memory (lse = inf, D = 0 past Lq: P = 0 there), stored before the arrive that the
        consumers' wait on the slot's ready barrier acquires; the consumers then read them without a global load's
        latency in their step. A consumer whose keys all lie past Lk gets no K, V (no TMA box wholly out of bounds);
        it computes on whatever its tiles hold, into rows the stores mask."""
        BLOCK_M: gl.constexpr = q8_desc.block_type.shape[2]
        row_layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])  # one warp
        _issue_consumer_tiles(k8_desc, v_desc, k_smem, v_smem, kv_ready, off_b, off_h, n0, seqlen_k, _CONSUMERS)
        nbytes: gl.constexpr = (q8_desc.block_type.nbytes + qt_desc.block_type.nbytes + do_desc.block_type.nbytes
                                + dot_desc.block_type.nbytes)
        for i in range(n_steps):
            slot = i % NUM_STAGES
            # a fresh barrier is in phase 0, so waiting on parity 1 passes: the first lap finds every slot free
            mbarrier.wait(empty.index(slot), ((i // NUM_STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            row = lo + i * BLOCK_M
            queries = row + gl.arange(0, BLOCK_M, row_layout)
            ok = queries < seqlen_q
            lse_bufs.index(slot).store(gl.load(lse_ptr + bh * seqlen_q + queries, mask=ok, other=float("inf")))
            delta_bufs.index(slot).store(gl.load(delta_ptr + bh * seqlen_q + queries, mask=ok, other=0.0))
            mbarrier.expect(bar, nbytes)  # an arrive: releases the stores above to the consumers' wait
            _tma_load(q8_desc, [off_b, off_h, row, 0], bar, q8_bufs.index(slot))
            _tma_load(qt_desc, [off_b, off_h, 0, row], bar, qt_bufs.index(slot))
            _tma_load(do_desc, [off_b, off_h, row, 0], bar, do_bufs.index(slot))
            _tma_load(dot_desc, [off_b, off_h, 0, row], bar, dot_bufs.index(slot))

    @gluon.jit
    def _scaled_products(a8, b_tile, acc0, acc1, scale, layout: gl.constexpr):
        """acc_h += (a8 b_h) * scale[:, None] for the two column halves h of the (K-major, sliced along its rows)
        B tile: int32 wgmmas of N = head_dim / 2, one at a time, so that one half's product (32 registers a thread)
        is live beside dK and dV, not a whole one. ``layout``: the halves' (acc0's)."""
        HALF: gl.constexpr = b_tile.shape[0] // 2
        zero = gl.zeros(acc0.shape, gl.int32, layout)
        scale = _rows(scale, gl.SliceLayout(1, layout))[:, None]
        prod = warpgroup_mma(a8, b_tile.slice(0, HALF).permute((1, 0)), zero, use_acc=False, is_async=True)
        prod = warpgroup_mma_wait(0, deps=[prod])
        acc0 += prod.to(gl.float32) * scale
        prod = warpgroup_mma(a8, b_tile.slice(HALF, HALF).permute((1, 0)), zero, use_acc=False, is_async=True)
        prod = warpgroup_mma_wait(0, deps=[prod])
        acc1 += prod.to(gl.float32) * scale
        return acc0, acc1

    @gluon.jit
    def _dkdv_mma(k_smem, v_smem, q8_bufs, qt_bufs, do_bufs, dot_bufs, lse_bufs, delta_bufs, kv_ready, ready, empty,
                  sq_ptr, sk_ptr, sdo_ptr, dk_ptr, dv_ptr, bh, n0, lo, n_steps, seqlen_q, seqlen_k, nq_blocks,
                  nk_blocks, qk_scale, sm_scale, QBLK: gl.constexpr, KBLK: gl.constexpr, NUM_STAGES: gl.constexpr,
                  CAUSAL: gl.constexpr):
        """One consumer warpgroup: the 64 keys at n0 against every query tile of the ring, then dK * sm_scale and dV
        out from wgmma's registers. dK and dV are kept as two column halves each (_scaled_products)."""
        BLOCK_N: gl.constexpr = k_smem.shape[2]
        BLOCK_M: gl.constexpr = q8_bufs.shape[3]
        HEAD_DIM: gl.constexpr = q8_bufs.shape[4]
        s_layout: gl.constexpr = _wgmma_layout(_WARPS, BLOCK_M)  # dP^T, P^T: (keys, queries)
        s8_layout: gl.constexpr = _wgmma_layout(_WARPS, BLOCK_M, 32)  # S^T's int32
        kv_layout: gl.constexpr = _wgmma_layout(_WARPS, HEAD_DIM // 2, 32)  # a half of dK, dV and its int32 product
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=kv_layout, k_width=4)  # int8 A
        key_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        query_layout: gl.constexpr = gl.SliceLayout(0, s_layout)

        keys = n0 + gl.arange(0, BLOCK_N, key_layout)
        colterm = gl.where(keys < seqlen_k, 0.0, float("-inf"))  # keys past Lk get P = 0
        # one K block per consumer (BLOCK_N divides KBLK): the Triton kernel's per-key row_scale, all equal (a
        # consumer whose keys all lie past Lk has no block: 1, unused)
        k_scale = gl.load(sk_ptr + bh * nk_blocks + n0 // KBLK, mask=n0 < seqlen_k, other=1.0) * qk_scale
        k8 = k_smem.reshape([BLOCK_N, HEAD_DIM])
        v = v_smem.reshape([BLOCK_N, HEAD_DIM])
        s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.int32, s8_layout)
        dp_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
        dk0 = gl.zeros([BLOCK_N, HEAD_DIM // 2], gl.float32, kv_layout)
        dk1 = gl.zeros([BLOCK_N, HEAD_DIM // 2], gl.float32, kv_layout)
        dv0 = gl.zeros([BLOCK_N, HEAD_DIM // 2], gl.float32, kv_layout)
        dv1 = gl.zeros([BLOCK_N, HEAD_DIM // 2], gl.float32, kv_layout)
        mbarrier.wait(kv_ready, 0, pred=n0 < seqlen_k)
        for i in range(n_steps):
            slot = i % NUM_STAGES
            off_m = lo + i * BLOCK_M
            sq = gl.load(sq_ptr + bh * nq_blocks + off_m // QBLK)  # BLOCK_M divides QBLK: one Q and dO scale
            sdo = gl.load(sdo_ptr + bh * nq_blocks + off_m // QBLK)
            mbarrier.wait(ready.index(slot), (i // NUM_STAGES) & 1)
            q8 = q8_bufs.index(slot).reshape([BLOCK_M, HEAD_DIM])
            do = do_bufs.index(slot).reshape([BLOCK_M, HEAD_DIM])
            st = warpgroup_mma(k8, q8.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            st = warpgroup_mma_wait(0, deps=[st])
            st = gl.convert_layout(st.to(gl.float32), s_layout) * (k_scale * sq) + colterm[:, None]
            if CAUSAL:
                queries = off_m + gl.arange(0, BLOCK_M, query_layout)
                st = gl.where(queries[None, :] >= keys[:, None], st, float("-inf"))
            pt = gl.exp2(st - lse_bufs.index(slot).load(query_layout)[None, :])  # lse = inf past Lq: P = 0
            p8, sp = _quant_rows(pt, a_layout)  # one scale per key over the BLOCK_M queries
            dpt = warpgroup_mma(v, do.permute((1, 0)), dp_zero, use_acc=False, is_async=True)
            dpt = warpgroup_mma_wait(0, deps=[dpt])
            ds8, sds = _quant_rows(pt * (dpt - delta_bufs.index(slot).load(query_layout)[None, :]), a_layout)  # dS^T
            dv0, dv1 = _scaled_products(p8, dot_bufs.index(slot).reshape([HEAD_DIM, BLOCK_M]), dv0, dv1, sp * sdo,
                                        kv_layout)
            dk0, dk1 = _scaled_products(ds8, qt_bufs.index(slot).reshape([HEAD_DIM, BLOCK_M]), dk0, dk1, sds * sq,
                                        kv_layout)
            mbarrier.arrive(empty.index(slot), count=1)  # every wgmma that read the slot is done

        rows = n0 + gl.arange(0, BLOCK_N, gl.SliceLayout(1, kv_layout))
        cols = gl.arange(0, HEAD_DIM // 2, gl.SliceLayout(0, kv_layout))
        offs = (bh.to(gl.int64) * seqlen_k + rows)[:, None] * HEAD_DIM + cols[None, :]
        ok = (rows < seqlen_k)[:, None]
        out_dtype: gl.constexpr = dk_ptr.dtype.element_ty
        gl.store(dk_ptr + offs, (dk0 * sm_scale).to(out_dtype), mask=ok)
        gl.store(dk_ptr + offs + HEAD_DIM // 2, (dk1 * sm_scale).to(out_dtype), mask=ok)
        gl.store(dv_ptr + offs, dv0.to(out_dtype), mask=ok)
        gl.store(dv_ptr + offs + HEAD_DIM // 2, dv1.to(out_dtype), mask=ok)

    @gluon.jit
    def _sagebwd_dkdv(k8_desc, v_desc, q8_desc, qt_desc, do_desc, dot_desc, sq_ptr, sk_ptr, sdo_ptr, lse_ptr,
                      delta_ptr, dk_ptr, dv_ptr, seqlen_q, seqlen_k, nq_blocks, nk_blocks, qk_scale, sm_scale,
                      num_heads, QBLK: gl.constexpr, KBLK: gl.constexpr, NUM_STAGES: gl.constexpr,
                      CAUSAL: gl.constexpr, num_warps: gl.constexpr):
        """dK and dV of _CONSUMERS * 64 keys per program (dK, dV contiguous (B, H, Lk, D) in dO's dtype)."""
        BLOCK_N: gl.constexpr = k8_desc.block_type.shape[2]
        BLOCK_M: gl.constexpr = q8_desc.block_type.shape[2]
        gl.static_assert(num_warps == _WARPS)
        gl.static_assert(BLOCK_M == 16 * num_warps)  # S^T's queries: one wgmma N of 64
        gl.static_assert(BLOCK_N == 64)  # a consumer's keys: one m64 wgmma tile
        gl.static_assert(KBLK % BLOCK_N == 0)
        gl.static_assert(QBLK % BLOCK_M == 0)
        bh, off_b, off_h, n0 = _program(num_heads, _CONSUMERS * BLOCK_N)
        k_smem = _tiles(k8_desc, _CONSUMERS)
        v_smem = _tiles(v_desc, _CONSUMERS)
        q8_bufs = _tiles(q8_desc, NUM_STAGES)
        qt_bufs = _tiles(qt_desc, NUM_STAGES)
        do_bufs = _tiles(do_desc, NUM_STAGES)
        dot_bufs = _tiles(dot_desc, NUM_STAGES)
        row_smem: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])  # lse, D: read whole by every consumer
        lse_bufs = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_M], row_smem)
        delta_bufs = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, BLOCK_M], row_smem)
        kv_ready, ready, empty = _ring_barriers(NUM_STAGES)
        fence_async_shared()

        # causal (top-left): queries before the program's keys never see them (the second consumer's first step is
        # masked out whole, as in the Triton kernel's 128-key programs)
        lo = n0 if CAUSAL else 0
        n_steps = gl.maximum(gl.cdiv(seqlen_q - lo, BLOCK_M), 0)
        gl.warp_specialize([
            (_dkdv_mma, (k_smem.index(0), v_smem.index(0), q8_bufs, qt_bufs, do_bufs, dot_bufs, lse_bufs, delta_bufs,
                         kv_ready.index(0), ready, empty, sq_ptr, sk_ptr, sdo_ptr, dk_ptr, dv_ptr, bh, n0, lo,
                         n_steps, seqlen_q, seqlen_k, nq_blocks, nk_blocks, qk_scale, sm_scale, QBLK, KBLK,
                         NUM_STAGES, CAUSAL)),
            (_dkdv_mma, (k_smem.index(1), v_smem.index(1), q8_bufs, qt_bufs, do_bufs, dot_bufs, lse_bufs, delta_bufs,
                         kv_ready.index(1), ready, empty, sq_ptr, sk_ptr, sdo_ptr, dk_ptr, dv_ptr, bh,
                         n0 + BLOCK_N, lo, n_steps, seqlen_q, seqlen_k, nq_blocks, nk_blocks, qk_scale, sm_scale,
                         QBLK, KBLK, NUM_STAGES, CAUSAL)),
            (_dkdv_load, (k8_desc, v_desc, q8_desc, qt_desc, do_desc, dot_desc, lse_ptr, delta_ptr, k_smem, v_smem,
                          q8_bufs, qt_bufs, do_bufs, dot_bufs, lse_bufs, delta_bufs, kv_ready, ready, empty, bh, off_b,
                          off_h, n0, lo, n_steps, seqlen_q, seqlen_k, NUM_STAGES)),
        ], [num_warps, LOADER_WARPS], [WS_CONSUMER_REGS, LOADER_REGS])

    # -----------------------------------------------------------------------------------------------------------
    # dQ: a program owns _CONSUMERS * 64 queries; the load partition brings each consumer's psi(Q) and dO tile once,
    # then streams the key tiles (psi(K), psi(K)^T, V) through a NUM_STAGES ring that both consumers read.
    # -----------------------------------------------------------------------------------------------------------

    @gluon.jit
    def _dq_load(q8_desc, do_desc, k8_desc, kt_desc, v_desc, q8_smem, do_smem, k8_bufs, kt_bufs, v_bufs, q_ready,
                 ready, empty, off_b, off_h, m0, n_blocks, seqlen_q, NUM_STAGES: gl.constexpr):
        """Load partition. A consumer whose queries all lie past Lq gets no psi(Q), dO (no TMA box wholly out of
        bounds); it computes on whatever its tiles hold, into rows the store masks."""
        BLOCK_N: gl.constexpr = k8_desc.block_type.shape[2]
        _issue_consumer_tiles(q8_desc, do_desc, q8_smem, do_smem, q_ready, off_b, off_h, m0, seqlen_q, _CONSUMERS)
        nbytes: gl.constexpr = k8_desc.block_type.nbytes + kt_desc.block_type.nbytes + v_desc.block_type.nbytes
        for j in range(n_blocks):
            slot = j % NUM_STAGES
            mbarrier.wait(empty.index(slot), ((j // NUM_STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, nbytes)
            _tma_load(k8_desc, [off_b, off_h, j * BLOCK_N, 0], bar, k8_bufs.index(slot))
            _tma_load(kt_desc, [off_b, off_h, 0, j * BLOCK_N], bar, kt_bufs.index(slot))
            _tma_load(v_desc, [off_b, off_h, j * BLOCK_N, 0], bar, v_bufs.index(slot))

    @gluon.jit
    def _dq_mma(q8_smem, do_smem, k8_bufs, kt_bufs, v_bufs, q_ready, ready, empty, sq_ptr, sk_ptr, lse_ptr,
                delta_ptr, dq_ptr, bh, m0, n_blocks, seqlen_q, seqlen_k, nq_blocks, nk_blocks, qk_scale, sm_scale,
                QBLK: gl.constexpr, KBLK: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr):
        """One consumer warpgroup: the 64 queries at m0 against every key tile of the ring, then dQ * sm_scale out
        from wgmma's registers."""
        BLOCK_M: gl.constexpr = q8_smem.shape[2]
        HEAD_DIM: gl.constexpr = q8_smem.shape[3]
        BLOCK_N: gl.constexpr = k8_bufs.shape[3]
        s_layout: gl.constexpr = _wgmma_layout(_WARPS, BLOCK_N)  # dP, P: (queries, keys)
        s8_layout: gl.constexpr = _wgmma_layout(_WARPS, BLOCK_N, 32)  # S's int32
        dq_layout: gl.constexpr = _wgmma_layout(_WARPS, HEAD_DIM, 32)  # dQ and its int32 product
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq_layout, k_width=4)
        query_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        key_layout: gl.constexpr = gl.SliceLayout(0, s_layout)

        queries = m0 + gl.arange(0, BLOCK_M, query_layout)
        q_ok = queries < seqlen_q
        row_scale = gl.load(sq_ptr + bh * nq_blocks + queries // QBLK, mask=q_ok, other=0.0) * qk_scale
        lse = gl.load(lse_ptr + bh * seqlen_q + queries, mask=q_ok, other=float("inf"))  # inf: P = 0 past Lq
        delta = gl.load(delta_ptr + bh * seqlen_q + queries, mask=q_ok, other=0.0)
        q8 = q8_smem.reshape([BLOCK_M, HEAD_DIM])
        do = do_smem.reshape([BLOCK_M, HEAD_DIM])
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.int32, s8_layout)
        dp_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
        prod_zero = gl.zeros([BLOCK_M, HEAD_DIM], gl.int32, dq_layout)
        dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, dq_layout)
        mbarrier.wait(q_ready, 0, pred=m0 < seqlen_q)
        # the step's K block scale (BLOCK_N divides KBLK: one), loaded a step ahead (past the last block: 1, unused)
        sk_next = gl.load(sk_ptr + bh * nk_blocks)
        for j in range(n_blocks):
            slot = j % NUM_STAGES
            keys = j * BLOCK_N + gl.arange(0, BLOCK_N, key_layout)
            colterm = gl.where(keys < seqlen_k, 0.0, float("-inf"))
            sk = sk_next
            sk_next = gl.load(sk_ptr + bh * nk_blocks + ((j + 1) * BLOCK_N) // KBLK, mask=j + 1 < n_blocks, other=1.0)
            mbarrier.wait(ready.index(slot), (j // NUM_STAGES) & 1)
            k8 = k8_bufs.index(slot).reshape([BLOCK_N, HEAD_DIM])
            kt = kt_bufs.index(slot).reshape([HEAD_DIM, BLOCK_N])
            v = v_bufs.index(slot).reshape([BLOCK_N, HEAD_DIM])
            s = warpgroup_mma(q8, k8.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            dp = warpgroup_mma(do, v.permute((1, 0)), dp_zero, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(1, deps=[s])  # dP runs on while P computes
            s = gl.convert_layout(s.to(gl.float32), s_layout) * (row_scale * sk)[:, None] + colterm[None, :]
            if CAUSAL:
                s = gl.where(keys[None, :] <= queries[:, None], s, float("-inf"))
            p = gl.exp2(s - lse[:, None])
            dp = warpgroup_mma_wait(0, deps=[dp])
            ds8, sds = _quant_rows(p * (dp - delta[:, None]), a_layout)  # one scale per query over BLOCK_N keys
            prod = warpgroup_mma(ds8, kt.permute((1, 0)), prod_zero, use_acc=False, is_async=True)
            prod = warpgroup_mma_wait(0, deps=[prod])
            mbarrier.arrive(empty.index(slot), count=1)  # every wgmma that read the slot is done
            dq += prod.to(gl.float32) * _rows(sds * sk, gl.SliceLayout(1, dq_layout))[:, None]

        rows = m0 + gl.arange(0, BLOCK_M, gl.SliceLayout(1, dq_layout))
        cols = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, dq_layout))
        offs = (bh.to(gl.int64) * seqlen_q + rows)[:, None] * HEAD_DIM + cols[None, :]
        gl.store(dq_ptr + offs, (dq * sm_scale).to(dq_ptr.dtype.element_ty), mask=(rows < seqlen_q)[:, None])

    @gluon.jit
    def _sagebwd_dq(q8_desc, do_desc, k8_desc, kt_desc, v_desc, sq_ptr, sk_ptr, lse_ptr, delta_ptr, dq_ptr, seqlen_q,
                    seqlen_k, nq_blocks, nk_blocks, qk_scale, sm_scale, num_heads, QBLK: gl.constexpr,
                    KBLK: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, num_warps: gl.constexpr):
        """dQ of _CONSUMERS * 64 queries per program (dQ contiguous (B, H, Lq, D) in dO's dtype)."""
        BLOCK_M: gl.constexpr = q8_desc.block_type.shape[2]
        bh, off_b, off_h, m0, n_blocks = _query_program(q8_desc, k8_desc, seqlen_k, num_heads, QBLK, KBLK, CAUSAL,
                                                        num_warps)
        q8_smem = _tiles(q8_desc, _CONSUMERS)
        do_smem = _tiles(do_desc, _CONSUMERS)
        k8_bufs = _tiles(k8_desc, NUM_STAGES)
        kt_bufs = _tiles(kt_desc, NUM_STAGES)
        v_bufs = _tiles(v_desc, NUM_STAGES)
        q_ready, ready, empty = _ring_barriers(NUM_STAGES)
        fence_async_shared()

        gl.warp_specialize([
            (_dq_mma, (q8_smem.index(0), do_smem.index(0), k8_bufs, kt_bufs, v_bufs, q_ready.index(0), ready, empty,
                       sq_ptr, sk_ptr, lse_ptr, delta_ptr, dq_ptr, bh, m0, n_blocks, seqlen_q, seqlen_k, nq_blocks,
                       nk_blocks, qk_scale, sm_scale, QBLK, KBLK, NUM_STAGES, CAUSAL)),
            (_dq_mma, (q8_smem.index(1), do_smem.index(1), k8_bufs, kt_bufs, v_bufs, q_ready.index(1), ready, empty,
                       sq_ptr, sk_ptr, lse_ptr, delta_ptr, dq_ptr, bh, m0 + BLOCK_M, n_blocks, seqlen_q, seqlen_k,
                       nq_blocks, nk_blocks, qk_scale, sm_scale, QBLK, KBLK, NUM_STAGES, CAUSAL)),
            (_dq_load, (q8_desc, do_desc, k8_desc, kt_desc, v_desc, q8_smem, do_smem, k8_bufs, kt_bufs, v_bufs,
                        q_ready, ready, empty, off_b, off_h, m0, n_blocks, seqlen_q, NUM_STAGES)),
        ], [num_warps, LOADER_WARPS], [WS_CONSUMER_REGS, LOADER_REGS])


    # -----------------------------------------------------------------------------------------------------------
    # Forward (pv="int8"): a program owns CONSUMERS * 64 queries; the load partition brings each consumer's psi(Q)
    # tile once, then streams psi(K) and psi(V)^T (the K-major copy: P V reduces over keys) in 64-key tiles through a
    # NUM_STAGES ring that both consumers read. The online softmax is the Triton kernel's, row for row.
    # -----------------------------------------------------------------------------------------------------------

    @gluon.jit
    def _fwd_load(q8_desc, k8_desc, vt_desc, q8_smem, k8_bufs, vt_bufs, q_ready, ready, empty, off_b, off_h, m0,
                  n_blocks, seqlen_q, NUM_STAGES: gl.constexpr):
        """Load partition: each consumer's psi(Q) tile (none for a consumer whose rows all lie past Lq), then the
        ring."""
        BLOCK_M: gl.constexpr = q8_desc.block_type.shape[2]
        BLOCK_N: gl.constexpr = k8_desc.block_type.shape[2]
        for c in gl.static_range(_CONSUMERS):
            live = m0 + c * BLOCK_M < seqlen_q
            bar = q_ready.index(c)
            mbarrier.expect(bar, q8_desc.block_type.nbytes, live)
            _tma_load(q8_desc, [off_b, off_h, m0 + c * BLOCK_M, 0], bar, q8_smem.index(c), pred=live)
        nbytes: gl.constexpr = k8_desc.block_type.nbytes + vt_desc.block_type.nbytes
        for j in range(n_blocks):
            slot = j % NUM_STAGES
            mbarrier.wait(empty.index(slot), ((j // NUM_STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, nbytes)
            _tma_load(k8_desc, [off_b, off_h, j * BLOCK_N, 0], bar, k8_bufs.index(slot))
            _tma_load(vt_desc, [off_b, off_h, 0, j * BLOCK_N], bar, vt_bufs.index(slot))

    @gluon.jit
    def _fwd_softmax(s, j, rows, row_scale, sk, sv, m_i, l_i, m0, seqlen_k, s_layout: gl.constexpr,
                     a_layout: gl.constexpr, CAUSAL: gl.constexpr):
        """Tile j's step of sagebwd._attn_fwd_inner (pv int8) on its int32 S, with the tile's K and V block scales sk,
        sv: (psi(P~) in ``a_layout``, alpha, the scale of its P V product c * sv / 127, m, l)."""
        BLOCK_N: gl.constexpr = s.shape[1]
        keys = j * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(0, s_layout))
        colterm = gl.where(keys < seqlen_k, 0.0, float("-inf"))
        s = gl.convert_layout(s.to(gl.float32), s_layout) * (row_scale * sk)[:, None] + colterm[None, :]
        if CAUSAL:
            if j * BLOCK_N + BLOCK_N > m0:  # a tile that reaches past this consumer's first row
                s = gl.where(keys[None, :] <= rows[:, None], s, float("-inf"))
        rowmax = gl.max(s, 1)
        m_new = gl.maximum(m_i, rowmax)
        # rows with no visible key in this tile: exponentiate against 0 so e = 0, not NaN
        e = gl.exp2(s - gl.where(rowmax == float("-inf"), 0.0, rowmax)[:, None])
        c = gl.exp2(rowmax - m_new)  # max of this tile's P~ row: exp(rowmax(S_j) - m_j)
        alpha = gl.exp2(m_i - m_new)
        l_new = l_i * alpha + gl.sum(e, 1) * c
        # psi(P~) = round(127 e) with s = c / 127; e >= 0, so the truncating cast of 127 e + 0.5 is the Triton
        # kernel's floor and cast
        p8 = gl.convert_layout((e * 127.0 + 0.5).to(gl.int8), a_layout)
        return p8, alpha, c * (sv / 127.0), m_new, l_new

    @gluon.jit
    def _fwd_mma(q8_smem, k8_bufs, vt_bufs, q_ready, ready, empty, sq_ptr, sk_ptr, sv_ptr, o_ptr, lse_ptr, bh, m0,
                 n_blocks, seqlen_q, seqlen_k, nq_blocks, nk_blocks, qk_scale, QBLK: gl.constexpr, KBLK: gl.constexpr,
                 NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr):
        """One consumer warpgroup: its 64 queries at m0 against every key tile of the ring (sagebwd._attn_fwd_inner's
        step with pv int8), then O = acc / l and the log2-domain LSE = m + log2(l) out from registers."""
        BLOCK_M: gl.constexpr = q8_smem.shape[2]
        HEAD_DIM: gl.constexpr = q8_smem.shape[3]
        BLOCK_N: gl.constexpr = k8_bufs.shape[3]
        s_layout: gl.constexpr = _wgmma_layout(_WARPS, BLOCK_N)  # S, P~: (queries, keys)
        s8_layout: gl.constexpr = _wgmma_layout(_WARPS, BLOCK_N, 32)
        o_layout: gl.constexpr = _wgmma_layout(_WARPS, HEAD_DIM, 32)  # O's accumulator and the P V product
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

        rows = m0 + gl.arange(0, BLOCK_M, row_layout)
        row_ok = rows < seqlen_q
        row_scale = gl.load(sq_ptr + bh * nq_blocks + rows // QBLK, mask=row_ok, other=0.0) * qk_scale
        q8 = q8_smem.reshape([BLOCK_M, HEAD_DIM])
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.int32, s8_layout)
        pv_zero = gl.zeros([BLOCK_M, HEAD_DIM], gl.int32, o_layout)
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_layout)
        l_i = gl.zeros([BLOCK_M], gl.float32, row_layout)
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
        o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
        mbarrier.wait(q_ready, 0, pred=m0 < seqlen_q)
        # FlashAttention-3's intra-warpgroup pipelining: tile j's S is issued together with tile j-1's P V, so j's
        # softmax runs while that product does; j-1's product is folded into O after it (O * alpha_{j-1} + P V *
        # scale_{j-1}: the Triton kernel's two operations, in its order). Tile 0 (there is always one) starts it.
        mbarrier.wait(ready.index(0), 0)
        s = warpgroup_mma(q8, k8_bufs.index(0).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)
        s = warpgroup_mma_wait(0, deps=[s])
        # a tile's K and V block scales (BLOCK_N divides KBLK: one each), each loaded a tile ahead of its use
        sk_ptr += bh * nk_blocks
        sv_ptr += bh * nk_blocks
        sk_next = gl.load(sk_ptr + BLOCK_N // KBLK, mask=n_blocks > 1, other=1.0)
        sv_next = gl.load(sv_ptr + BLOCK_N // KBLK, mask=n_blocks > 1, other=1.0)
        p8, alpha, pv_scale, m_i, l_i = _fwd_softmax(s, 0, rows, row_scale, gl.load(sk_ptr), gl.load(sv_ptr), m_i,
                                                     l_i, m0, seqlen_k, s_layout, a_layout, CAUSAL)
        for j in range(1, n_blocks):
            slot = j % NUM_STAGES
            prev = (j - 1) % NUM_STAGES
            sk = sk_next
            sv = sv_next
            sk_next = gl.load(sk_ptr + ((j + 1) * BLOCK_N) // KBLK, mask=j + 1 < n_blocks, other=1.0)
            sv_next = gl.load(sv_ptr + ((j + 1) * BLOCK_N) // KBLK, mask=j + 1 < n_blocks, other=1.0)
            mbarrier.wait(ready.index(slot), (j // NUM_STAGES) & 1)
            s = warpgroup_mma(q8, k8_bufs.index(slot).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0)), s_zero,
                              use_acc=False, is_async=True)
            prod = warpgroup_mma(p8, vt_bufs.index(prev).reshape([HEAD_DIM, BLOCK_N]).permute((1, 0)), pv_zero,
                                 use_acc=False, is_async=True)
            s = warpgroup_mma_wait(1, deps=[s])  # P_{j-1} V_{j-1} runs on through this tile's softmax
            p8_j, alpha_j, pv_scale_j, m_i, l_i = _fwd_softmax(s, j, rows, row_scale, sk, sv, m_i, l_i, m0, seqlen_k,
                                                               s_layout, a_layout, CAUSAL)
            prod = warpgroup_mma_wait(0, deps=[prod])
            mbarrier.arrive(empty.index(prev), count=1)  # both wgmmas that read the slot are done
            acc = acc * _rows(alpha, o_rows)[:, None]
            acc += prod.to(gl.float32) * _rows(pv_scale, o_rows)[:, None]
            p8, alpha, pv_scale = p8_j, alpha_j, pv_scale_j
        last = (n_blocks - 1) % NUM_STAGES
        prod = warpgroup_mma(p8, vt_bufs.index(last).reshape([HEAD_DIM, BLOCK_N]).permute((1, 0)), pv_zero,
                             use_acc=False, is_async=True)
        prod = warpgroup_mma_wait(0, deps=[prod])
        mbarrier.arrive(empty.index(last), count=1)
        acc = acc * _rows(alpha, o_rows)[:, None]
        acc += prod.to(gl.float32) * _rows(pv_scale, o_rows)[:, None]

        o = acc / _rows(l_i, o_rows)[:, None]
        gl.store(lse_ptr + bh * seqlen_q + rows, m_i + gl.log2(l_i), mask=row_ok)
        out_rows = m0 + gl.arange(0, BLOCK_M, o_rows)
        cols = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, o_layout))
        offs = (bh.to(gl.int64) * seqlen_q + out_rows)[:, None] * HEAD_DIM + cols[None, :]
        gl.store(o_ptr + offs, o.to(o_ptr.dtype.element_ty), mask=(out_rows < seqlen_q)[:, None])

    @gluon.jit
    def _sagebwd_fwd(q8_desc, k8_desc, vt_desc, sq_ptr, sk_ptr, sv_ptr, o_ptr, lse_ptr, seqlen_q, seqlen_k, nq_blocks,
                     nk_blocks, qk_scale, num_heads, QBLK: gl.constexpr, KBLK: gl.constexpr, NUM_STAGES: gl.constexpr,
                     CAUSAL: gl.constexpr, num_warps: gl.constexpr):
        """O and LSE of CONSUMERS * 64 queries per program (O contiguous (B, H, Lq, D), LSE (B, H, Lq) fp32)."""
        BLOCK_M: gl.constexpr = q8_desc.block_type.shape[2]
        bh, off_b, off_h, m0, n_blocks = _query_program(q8_desc, k8_desc, seqlen_k, num_heads, QBLK, KBLK, CAUSAL,
                                                        num_warps)
        q8_smem = _tiles(q8_desc, _CONSUMERS)
        k8_bufs = _tiles(k8_desc, NUM_STAGES)
        vt_bufs = _tiles(vt_desc, NUM_STAGES)
        q_ready, ready, empty = _ring_barriers(NUM_STAGES)
        fence_async_shared()

        gl.warp_specialize([
            (_fwd_mma, (q8_smem.index(0), k8_bufs, vt_bufs, q_ready.index(0), ready, empty, sq_ptr, sk_ptr, sv_ptr,
                        o_ptr, lse_ptr, bh, m0, n_blocks, seqlen_q, seqlen_k, nq_blocks, nk_blocks, qk_scale, QBLK,
                        KBLK, NUM_STAGES, CAUSAL)),
            (_fwd_mma, (q8_smem.index(1), k8_bufs, vt_bufs, q_ready.index(1), ready, empty, sq_ptr, sk_ptr, sv_ptr,
                        o_ptr, lse_ptr, bh, m0 + BLOCK_M, n_blocks, seqlen_q, seqlen_k, nq_blocks, nk_blocks, qk_scale,
                        QBLK, KBLK, NUM_STAGES, CAUSAL)),
            (_fwd_load, (q8_desc, k8_desc, vt_desc, q8_smem, k8_bufs, vt_bufs, q_ready, ready, empty, off_b, off_h, m0,
                         n_blocks, seqlen_q, NUM_STAGES)),
        ], [num_warps, LOADER_WARPS], [WS_CONSUMER_REGS, LOADER_REGS])


def sagebwd_dkdv_dq(do: torch.Tensor, q8: torch.Tensor, qt: torch.Tensor, k8: torch.Tensor, kt: torch.Tensor,
                    v: torch.Tensor, sq: torch.Tensor, sk: torch.Tensor, dot: torch.Tensor, sdo: torch.Tensor,
                    lse: torch.Tensor, delta: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, *,
                    sm_scale: float, causal: bool, q_block: int, k_block: int) -> None:
    """Launch the dK/dV and dQ kernels into dq, dk, dv (contiguous (B, H, L, D) in dO's dtype), from what
    ``sagebwd_backward`` holds after its pre-pass: dO and V contiguous; psi(Q_s), psi(K_s) row-major int8 and
    their K-major copies qt, kt (``kmajor_empty`` views); psi(dO)'s K-major copy dot; the block scales sq, sk, sdo
    ((B, H, n) fp32; ``q_block``, ``k_block`` rows each); the log2-domain lse and D = rowsum(dO O)."""
    b, h, lq, d = q8.shape
    lk = k8.shape[2]
    do, v = _tma_ready(do), _tma_ready(v)  # contiguous, but a view's base may sit off TMA's 16-byte alignment
    qk_scale = sm_scale * LOG2E
    rows, cols = [1, 1, BLOCK, d], [1, 1, d, BLOCK]
    tile = _tile_descriptor
    _sagebwd_dkdv[(triton.cdiv(lk, CONSUMERS * BLOCK), b * h)](
        tile(k8, rows), tile(v, rows), tile(q8, rows), tile(qt, cols), tile(do, rows), tile(dot, cols), sq, sk, sdo,
        lse, delta, dk, dv, lq, lk, sq.shape[-1], sk.shape[-1], qk_scale, sm_scale, h, QBLK=q_block, KBLK=k_block,
        NUM_STAGES=DKDV_STAGES[d], CAUSAL=causal, num_warps=WARPS)
    _sagebwd_dq[(triton.cdiv(lq, CONSUMERS * BLOCK), b * h)](
        tile(q8, rows), tile(do, rows), tile(k8, rows), tile(kt, cols), tile(v, rows), sq, sk, lse, delta, dq, lq, lk,
        sq.shape[-1], sk.shape[-1], qk_scale, sm_scale, h, QBLK=q_block, KBLK=k_block, NUM_STAGES=DQ_STAGES[d],
        CAUSAL=causal, num_warps=WARPS)


def sagebwd_forward_sm90(q8: torch.Tensor, k8: torch.Tensor, vt: torch.Tensor, sq: torch.Tensor, sk: torch.Tensor,
                         sv: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, *, sm_scale: float, causal: bool,
                         q_block: int, k_block: int) -> None:
    """Launch the forward into o (contiguous (B, H, Lq, D)) and lse ((B, H, Lq) fp32, log2 units), from what
    ``sagebwd_forward`` holds after its pre-pass: psi(Q_s), psi(K_s) row-major int8, psi(V)'s K-major copy vt (a
    ``kmajor_empty`` view) and the block scales sq, sk, sv ((B, H, n) fp32; ``q_block``, ``k_block`` rows each)."""
    b, h, lq, d = q8.shape
    lk = k8.shape[2]
    rows, cols = [1, 1, BLOCK, d], [1, 1, d, BLOCK]
    _sagebwd_fwd[(triton.cdiv(lq, CONSUMERS * BLOCK), b * h)](
        _tile_descriptor(q8, rows), _tile_descriptor(k8, rows), _tile_descriptor(vt, cols), sq, sk, sv, o, lse, lq, lk,
        sq.shape[-1], sk.shape[-1], sm_scale * LOG2E, h, QBLK=q_block, KBLK=k_block, NUM_STAGES=FWD_STAGES[d],
        CAUSAL=causal, num_warps=WARPS)


def _int8_tile_types(head_dim: int) -> tuple[str, str]:
    """The signature types of the kernels' int8 TMA tiles: (BLOCK, head_dim) row-major and (head_dim, BLOCK) K-major."""
    return (_tile_desc_type([1, 1, BLOCK, head_dim], torch.int8), _tile_desc_type([1, 1, head_dim, BLOCK], torch.int8))


def compile_backward(head_dim: int, causal: bool, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Compile the two kernels for sm_90a without a GPU (what a launch at ``head_dim`` builds); returns
    {"dkdv": ..., "dq": ...}, Triton's compiled kernels."""
    if _MISSING:
        raise RuntimeError(f"hopper_sagebwd: {_MISSING}")
    rows8, cols8 = _int8_tile_types(head_dim)
    rows16 = _tile_desc_type([1, 1, BLOCK, head_dim], dtype)
    fp32 = dict.fromkeys(("sq_ptr", "sk_ptr", "sdo_ptr", "lse_ptr", "delta_ptr"), "*fp32")
    scalars = {"qk_scale": "fp32", "sm_scale": "fp32"}
    common = {"QBLK": SAGEBWD_Q_BLOCK, "KBLK": SAGEBWD_K_BLOCK, "CAUSAL": bool(causal), "num_warps": WARPS}
    dkdv = compile_for(_sagebwd_dkdv, 90, types={"k8_desc": rows8, "v_desc": rows16, "q8_desc": rows8,
                                                 "qt_desc": cols8, "do_desc": rows16, "dot_desc": cols8, **fp32,
                                                 "dk_ptr": f"*{_SHORT[dtype]}", "dv_ptr": f"*{_SHORT[dtype]}",
                                                 **scalars},
                       aligned=(*fp32, "dk_ptr", "dv_ptr"), num_warps=WARPS, num_stages=1,
                       constexprs={**common, "NUM_STAGES": DKDV_STAGES[head_dim]})
    fp32.pop("sdo_ptr")
    dq = compile_for(_sagebwd_dq, 90, types={"q8_desc": rows8, "do_desc": rows16, "k8_desc": rows8,
                                             "kt_desc": cols8, "v_desc": rows16, **fp32, "dq_ptr": f"*{_SHORT[dtype]}",
                                             **scalars},
                     aligned=(*fp32, "dq_ptr"), num_warps=WARPS, num_stages=1,
                     constexprs={**common, "NUM_STAGES": DQ_STAGES[head_dim]})
    return {"dkdv": dkdv, "dq": dq}


def compile_forward(head_dim: int, causal: bool, dtype: torch.dtype = torch.bfloat16):
    """Compile the forward for sm_90a without a GPU (what a launch at ``head_dim`` with an output of ``dtype``
    builds); returns Triton's compiled kernel."""
    if _MISSING:
        raise RuntimeError(f"hopper_sagebwd: {_MISSING}")
    rows8, cols8 = _int8_tile_types(head_dim)
    fp32 = dict.fromkeys(("sq_ptr", "sk_ptr", "sv_ptr", "lse_ptr"), "*fp32")
    return compile_for(_sagebwd_fwd, 90, types={"q8_desc": rows8, "k8_desc": rows8, "vt_desc": cols8, **fp32,
                                                "o_ptr": f"*{_SHORT[dtype]}", "qk_scale": "fp32"},
                       aligned=(*fp32, "o_ptr"), num_warps=WARPS, num_stages=1,
                       constexprs={"QBLK": SAGEBWD_Q_BLOCK, "KBLK": SAGEBWD_K_BLOCK, "CAUSAL": bool(causal),
                                   "num_warps": WARPS, "NUM_STAGES": FWD_STAGES[head_dim]})
