"""Flash-attention forward, and the Attn-QAT backward, for Hopper (sm_90) in Gluon: TMA, mbarriers, wgmma and
warp specialisation.

The algorithm is FlashAttention's online softmax (exp2, running row max m and row sum l), laid out the way
FlashAttention-3 lays it out on H100, which plain Triton does not emit on sm_90:

- a **load partition** (one warp, few registers) issues TMA copies: the Q tile once, then K and V tiles into a
  ring of ``NUM_STAGES`` shared-memory slots, each slot guarded by a ``ready`` mbarrier (TMA's byte count
  lands) and an ``empty`` one (the MMA that read it finished);
- **consumer partitions** run both matmuls on wgmma: S = Q K^T with both operands in shared memory, O += P V with
  P from registers. Each overlaps one block's softmax with the tensor cores by issuing S_{j} = Q K_j^T and then
  O += P_{j-1} V_{j-1} before waiting for S_j alone (FlashAttention-3's intra-warpgroup pipelining); the PV of
  block j-1 runs while block j's softmax computes. Three layouts (``FWD_VARIANTS``), the same numbers: "default",
  one partition of 8 warps (two warpgroups in lockstep over 128 rows); "ws", two independent warpgroups of 64 rows
  (the default partition and a worker), so one's softmax runs under the other's wgmmas; "pingpong", "ws" with the
  two warpgroups' wgmma rounds alternating through a pair of mbarriers (FlashAttention-3's scheduler barrier).
  Only the ragged and causal-diagonal key tiles pay for the mask (inference variants); the training variant skips
  the rescale of O and O' on tiles where no row's running max moved.

Inputs are (batch, heads, seqlen, head_dim) with any strides whose last dim is contiguous; each is read
through a 4-d TMA descriptor, so ragged tails (Lq, Lk not multiples of the tiles, Lq != Lk) come back
zero-filled from TMA, keys past Lk are masked to -inf, and output rows past Lq are clipped by the TMA store.
Causal masking is top-left aligned (SDPA's ``is_causal``).

Three variants of the one kernel, constexprs apart (``FP4``, ``TRAINING``): :func:`hopper_attention`, bf16/fp16
attention; :func:`hopper_fp4_attention`, the FP4 inference forward of SPEC §2 (attn_qat's Triton forward's
numerics): a pre-pass writes phi(Q), phi(K), phi(V) exactly in bf16 (K and V rows in tile order), and the softmax
partition quantizes P in registers (:func:`_fp4_step`) before the P V wgmma; :func:`hopper_attn_qat_forward`, the
Attn-QAT training forward: the FP4 variant plus a third wgmma per tile for the auxiliary output O' (unquantized
P~ times V^F), O' and the row statistics m, l written as the Triton training forward writes them, so its Triton
backward runs on them unchanged. The pipeline is the same. ``STATS`` (which training implies) writes m and l: the FP4
inference forward with ``return_stats``, ring attention's (``api.attention_with_lse``).

:func:`hopper_attn_qat_backward` is attn_qat's Triton backward (SPEC §2: S recomputed from Q^F, K^F, P^F = phi(P~)/l
with the saved integer max, D = rowsum(dO O')) on wgmma and TMA, from the same saved tensors: a dK/dV kernel per key
block (K^F, V^F rows in tile order, so phi's 16-key blocks lie in one thread as in the forward; P^F and dS through
shared memory for the two wgmmas that read them transposed) and a dQ kernel per query block (dS from registers), each
streaming its other operands through a double-buffered TMA ring; no warp specialisation, every wgmma waited for within
its step. ``variant="ws"`` runs both warp-specialised instead (FlashAttention-3's backward layout: a load warp, two
independent consumer warpgroups of 64 keys, or of 64 queries, each).

``kernels.api`` dispatches to this module on sm_90 (:func:`gluon_sm90`): attn_qat's training step (the "ws" training
forward and the "ws" backward) and the FP4 inference forward of nvfp4, attn_qat and attn_qat_dropin ("pingpong"),
through custom ops; the Triton kernels stay the portable path. :func:`available` says whether it
can run here (Triton's Gluon API for Hopper, an sm_90 GPU); :func:`compile_forward` and :func:`compile_backward`
compile the kernels for sm_90a without a GPU. Triton 3.6 and 3.9 name the TMA copies differently (``async_copy_global_to_shared`` /
``async_copy_shared_to_global`` in 3.6, ``async_load`` / ``async_store`` in 3.9, where the old names raise);
:data:`_tma_load` / :data:`_tma_store` bind whichever this Triton has.
"""
from __future__ import annotations

import os
import warnings

import torch
import triton

from ._common import check_qkv, default_scale, interpreting, needs_grad, recomputed_later, training_placeholders
from ._hardware import compile_for
from .formats import LOG2E  # exp(x) = exp2(x * log2(e)): the softmax runs in exp2, the MUFU instruction
from .attn_qat import BWD_CONFIG_ENV, DQ_CONFIG_ENV, FWD_CONFIG_ENV, _attn_bwd_preprocess, _phi_blocks, _round_p
from .nvfp4 import quantize_heads, tile_keys
from .reference import refuse_double_backward

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    _MISSING = "" if hasattr(gl, "warp_specialize") else "triton.experimental.gluon has no warp_specialize"
except (ImportError, AttributeError) as exc:  # Triton older than 3.6: no Gluon Hopper API
    _MISSING = f"Triton {triton.__version__} lacks Gluon's Hopper API ({exc}); needs Triton >= 3.6"

HEAD_DIMS = (64, 128)
# (BLOCK_M, BLOCK_N, NUM_STAGES, num_warps) per head_dim. Two consumer warpgroups (8 warps) each own 64 of
# BLOCK_M=128 query rows, as FlashAttention-3's forward; 2 stages of K and V plus Q fit H100's 227 KB of shared
# memory at head_dim 128 (32 + 2*32 + 2*32 KB), 3 stages at head_dim 64.
FWD_CONFIG = {64: (128, 128, 3, 8), 128: (128, 128, 2, 8)}
# The training variant holds O' beside O (64 more fp32 registers per thread at head_dim 128): 64-key tiles, as the
# Triton training forward; its O' leaves through a tile of its own (Q + stages * (K + V) + O' at head_dim 128:
# 32 + 3 * 32 + 32 KB).
FWD_TRAIN_CONFIG = {64: (128, 64, 3, 8), 128: (128, 64, 3, 8)}
# The warp-specialised forwards (variants "ws" and "pingpong"), (BLOCK_M, BLOCK_N, NUM_STAGES) per head_dim: two
# independent consumer warpgroups of BLOCK_M = 64 rows each (a program owns 128 rows, as above; each thread holds
# what it holds in the 8-warp variant) plus the load warp. More stages fit: Q 2 * 16 + 3 * (32 + 32) = 224 KB at
# head_dim 128 with 128-key tiles; training 2 * 16 + 2 * 16 (O') + 4 * (16 + 16) = 192 KB with 64-key tiles.
FWD_WS_CONFIG = {64: (64, 128, 4), 128: (64, 128, 3)}
FWD_TRAIN_WS_CONFIG = {64: (64, 64, 4), 128: (64, 64, 4)}
FWD_VARIANTS = ("default", "ws", "pingpong")
# The backward's two kernels, (BLOCK_M, BLOCK_N, num_warps) per head_dim: BLOCK_M = 16 * num_warps query rows (one
# 16-row wgmma slab per warp), BLOCK_N keys. dK/dV: a program owns BLOCK_N = 64 keys (as the Triton backward's
# untransposed 128x64/8, its one tile without spills) and steps over 128 queries at a time; double-buffered Q^F and dO
# plus K^F, V^F and the P^F, dS tiles: 2*(32 + 32) + 2*16 + 2*16 KB at head_dim 128. dQ: a program owns 128 queries
# and steps over 64-key tiles; Q^F, dO, double-buffered K^F and V^F: 32 + 32 + 2*(16 + 16) KB.
BWD_DKDV_CONFIG = {64: (128, 64, 8), 128: (128, 64, 8)}
BWD_DQ_CONFIG = {64: (128, 64, 8), 128: (128, 64, 8)}
# The warp-specialised dK/dV kernel (variant="ws"), (BLOCK_M, BLOCK_N, NUM_STAGES) per head_dim: two consumer
# warpgroups of BLOCK_N = 64 keys each (a program owns 128 keys), BLOCK_M = 64 queries per step (one m64 wgmma per
# consumer for S and dP; dK and dV hold 64 keys x head_dim, 2 * 64 fp32 registers per thread at head_dim 128), and
# a 4-slot Q^F, dO ring (a consumer may run up to 2 steps ahead of the other and the copies still have a step to
# land) beside K^F, V^F and each consumer's P^F, dS tiles: at head_dim 128 2 * 2 * 16 + 2 * 2 * 8 + 4 * (16 + 16) =
# 224 KB of H100's 227, at 64 2 * 2 * 8 + 2 * 2 * 8 + 4 * (8 + 8) KB.
BWD_WS_CONFIG = {64: (64, 64, 4), 128: (64, 64, 4)}
# Its dQ kernel, likewise: two consumer warpgroups of BLOCK_M = 64 queries each (their Q^F, dO tiles loaded once),
# BLOCK_N = 64-key tiles of K^F, V^F through a NUM_STAGES ring: at head_dim 128 2 * (16 + 16) + 4 * (16 + 16) KB.
BWD_DQ_WS_CONFIG = {64: (64, 64, 4), 128: (64, 64, 4)}
BWD_VARIANTS = ("default", "ws")


def available(device: torch.device | str | None = None) -> tuple[bool, str]:
    """Whether the Gluon Hopper forward can run on ``device`` (default: the current CUDA device), and if not,
    the one reason why."""
    if _MISSING:
        return False, _MISSING
    if interpreting():
        return False, "TRITON_INTERPRET is set: Gluon kernels do not run in Triton's interpreter"
    if not torch.cuda.is_available():
        return False, "no CUDA GPU"
    device = torch.device("cuda" if device is None else device)
    if device.type != "cuda":
        return False, f"device {device} is not a CUDA GPU"
    cap = torch.cuda.get_device_capability(device)
    if cap != (9, 0):
        return False, f"GPU is sm_{cap[0]}{cap[1]}; this kernel uses wgmma and setmaxnreg of sm_90 (H100/H200)"
    return True, "Gluon sm_90 forward available"


if not _MISSING:
    # The load partition only issues TMA: one warp, and setmaxnreg hands its registers to the softmax warps.
    LOADER_WARPS = gl.constexpr(1)
    LOADER_REGS = gl.constexpr(24)
    # The warp-specialised backward's second consumer warpgroup (a worker partition): as many registers as the
    # default one gets, 240 (setmaxnreg's largest multiple of 8 that leaves the loader its 24 within 64K).
    WS_CONSUMER_REGS = gl.constexpr(240)

    @gluon.constexpr_function
    def _wgmma_layout(num_warps, n, k=16):
        """wgmma's accumulator layout for a (16 * num_warps, n) tile: instruction M=16 per warp, warps stacked along
        M (4 per warpgroup), N = the whole tile, K = 256 bits of the operands: 16 bf16 elements, or (k=32) 32 int8
        ones (the registers hold the same (row, column) elements either way)."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, k])

    @gluon.jit
    def _kv_ring(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, off_b, off_h, n_blocks,
                 BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
        """K_j and V_j into ring slot j % NUM_STAGES as soon as it is free (its empty barrier: every consumer
        arrived)."""
        for j in range(n_blocks):
            slot = j % NUM_STAGES
            # A fresh barrier is in phase 0, so waiting on parity 1 passes: the first lap finds every slot free.
            free_phase = ((j // NUM_STAGES) & 1) ^ 1
            mbarrier.wait(k_empty.index(slot), free_phase)
            mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)  # out-of-bounds rows count too
            _tma_load(k_desc, [off_b, off_h, j * BLOCK_N, 0], k_ready.index(slot), k_bufs.index(slot))
            mbarrier.wait(v_empty.index(slot), free_phase)
            mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
            _tma_load(v_desc, [off_b, off_h, j * BLOCK_N, 0], v_ready.index(slot), v_bufs.index(slot))

    @gluon.jit
    def _attn_load(q_desc, k_desc, v_desc, q_bufs, k_bufs, v_bufs, q_ready, k_ready, v_ready, k_empty, v_empty,
                   off_b, off_h, off_m, n_blocks, seqlen_q, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                   CONSUMERS: gl.constexpr):
        """Load partition: each consumer's Q tile once (on its q_ready barrier; a consumer whose rows all lie past
        Lq gets none: no TMA box wholly out of bounds), then the K, V ring."""
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
        for c in gl.static_range(CONSUMERS):
            live = off_m + c * BLOCK_M < seqlen_q
            mbarrier.expect(q_ready.index(c), q_desc.block_type.nbytes, live)
            _tma_load(q_desc, [off_b, off_h, off_m + c * BLOCK_M, 0], q_ready.index(c), q_bufs.index(c), pred=live)
        _kv_ring(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, off_b, off_h, n_blocks, BLOCK_N,
                 NUM_STAGES)

    @gluon.jit
    def _take_turn(turn, r, PARITY: gl.constexpr, PINGPONG: gl.constexpr):
        """PINGPONG: wait for this consumer's turn to issue its round r of wgmmas: the first consumer (PARITY 1) until
        the other has issued round r - 1 (round 0 passes: a fresh barrier), the second until the first has issued
        round r (FlashAttention-3's warp scheduler barrier: the two warpgroups' matmul rounds alternate, so one's
        softmax runs under the other's matmuls)."""
        if PINGPONG:
            mbarrier.wait(turn, (r & 1) ^ PARITY)

    @gluon.jit
    def _pass_turn(turn, PINGPONG: gl.constexpr):
        """PINGPONG: hand the tensor cores to the other consumer once this round's wgmmas are issued."""
        if PINGPONG:
            mbarrier.arrive(turn, count=1)

    @gluon.jit
    def _issue_scores(q, k_bufs, k_ready, j, zero, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                      NUM_STAGES: gl.constexpr):
        """Start S_j = Q K_j^T on the tensor cores once K_j has landed; returns wgmma's pending accumulator."""
        slot = j % NUM_STAGES
        mbarrier.wait(k_ready.index(slot), (j // NUM_STAGES) & 1)
        k = k_bufs.index(slot).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0))  # a view: wgmma reads K^T in place
        return warpgroup_mma(q, k, zero, use_acc=False, is_async=True)

    @gluon.jit
    def _v_tile(v_bufs, v_ready, j, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr):
        """V_j's shared-memory tile once it has landed, for O += P_j V_j (P from registers) and, training,
        O' += P~_j V_j (waiting once: a second wait on the barrier would cost a warpgroup barrier)."""
        slot = j % NUM_STAGES
        mbarrier.wait(v_ready.index(slot), (j // NUM_STAGES) & 1)
        return v_bufs.index(slot).reshape([BLOCK_N, HEAD_DIM])

    @gluon.jit
    def _masked(s, j, offs_m, seqlen_k, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, FP4: gl.constexpr):
        """S_j with -inf where its key is past Lk (TMA's zero fill of the ragged tail, or the FP4 pre-pass's
        zero rows) or, causal, after the query. Column n holds key j*BLOCK_N + n, or with FP4 (K and V rows in
        tile order) key j*BLOCK_N + tile_keys(n)."""
        cols = gl.arange(0, BLOCK_N, gl.SliceLayout(0, s.type.layout))
        if FP4:
            cols = tile_keys(cols, BLOCK_N)
        offs_n = j * BLOCK_N + cols
        keep = offs_n[None, :] < seqlen_k
        if CAUSAL:
            keep = keep & (offs_m[:, None] >= offs_n[None, :])
        return gl.where(keep, s, -float("inf"))

    @gluon.jit
    def _unmasked_tiles(off_m, seqlen_k, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
        """How many leading key tiles of BLOCK_N keys query rows off_m, off_m + 1, ... see whole: none of their keys
        is past Lk nor, causal, after row off_m. _masked would keep every element of those; as in Triton's tutorial
        only the ragged and diagonal tiles pay for the compare and select (a uniform branch per tile)."""
        n = seqlen_k // BLOCK_N
        if CAUSAL:
            n = gl.minimum(n, (off_m + 1) // BLOCK_N)
        return n

    @gluon.jit
    def _bf16_step(s, m_i, l_i, qk_scale, FIRST: gl.constexpr):
        """FlashAttention's online softmax step in log2 units: (P_j unnormalised, alpha = 2^(m - m_new), m_new,
        l_new). FIRST (constexpr: block 0) starts m and l; its alpha is unused (nothing is accumulated yet)."""
        s = s * qk_scale
        if FIRST:
            m_new = gl.max(s, axis=1)  # finite for every row: key 0 is always attended
            alpha = m_new
            p = gl.exp2(s - m_new[:, None])
            l_new = gl.sum(p, axis=1)
        else:
            m_new = gl.maximum(m_i, gl.max(s, axis=1))
            alpha = gl.exp2(m_i - m_new)
            p = gl.exp2(s - m_new[:, None])
            l_new = l_i * alpha + gl.sum(p, axis=1)
        return p, alpha, m_new, l_new

    @gluon.jit
    def _fp4_step(s, m_i, l_i, qk_scale, BLOCK_N: gl.constexpr, FIRST: gl.constexpr, FP16: gl.constexpr,
                  TRAINING: gl.constexpr):
        """SPEC §2's step, as attn_qat's Triton forward computes it: integer running max m, P~ = 2688 2^(S - m),
        l from the unquantized P~, P_j = phi(P~) along keys in blocks of 16. TRAINING also returns P~ itself in
        the dot's dtype (O''s operand), else P_j again (unused).

        K's rows are in tile order, so each thread's accumulator columns hold BLOCK_N/4 consecutive keys:
        viewed as (rows, BLOCK_N/64, 8, 4, 2), axes 1 and 3 name a 16-key block and axes 2 and 4 its keys,
        all in one thread's registers (a reshape of wgmma's accumulator, no data moves), so the block max and
        sum need no shuffles. m, l and alpha stay (rows, 1, 1, 1, 1) in that view."""
        BLOCK_M: gl.constexpr = s.shape[0]
        s5 = gl.reshape(s, [BLOCK_M, BLOCK_N // 64, 8, 4, 2])
        smax = gl.max(gl.max(s5, axis=4, keep_dims=True), axis=2, keep_dims=True)  # each block's max S
        row_max = gl.max(gl.max(smax, axis=1, keep_dims=True), axis=3, keep_dims=True)  # registers, then lanes
        if FIRST:
            m_i = gl.full_like(row_max, float("-inf"))
            l_i = gl.zeros_like(row_max)
        # qk_scale > 0, so max(s) * qk_scale = max(s * qk_scale); it then rides in one FMA with -base below
        m_new = gl.maximum(m_i, gl.ceil(row_max * qk_scale))
        seen = m_new > float("-inf")  # rows that have met a visible key
        alpha = gl.where(seen, gl.exp2(m_i - m_new), 1.0)
        base = gl.where(seen, m_new - 11.392317422778761, 0.0)  # P~ = 2^(S scale - base); 11.39... = log2(2688)
        xmax = smax * qk_scale - base  # log2 of each block's max P~
        sc = (gl.exp2(xmax) * (1.0 / 6.0)).to(gl.float8e4nv).to(gl.float32)  # s = e4m3(amax / 6), RNE
        # a block whose s rounds to 0 quantizes to 0; its y stay <= 1 (and finite) for l
        ls = gl.where(sc > 0.0, gl.log2(gl.where(sc > 0.0, sc, 1.0)), gl.maximum(xmax, -126.0))
        s_l = gl.where(sc > 0.0, sc, gl.exp2(ls))
        y5 = gl.exp2(s5 * qk_scale - (base + ls))  # P~ / s, no per-element division
        block_sum = gl.sum(gl.sum(y5, axis=4, keep_dims=True), axis=2, keep_dims=True)
        l_new = l_i * alpha + gl.sum(gl.sum(block_sum * s_l, axis=1, keep_dims=True), axis=3, keep_dims=True)
        p_dtype: gl.constexpr = gl.float16 if FP16 else gl.bfloat16
        if TRAINING:
            p_aux = gl.reshape((y5 * s_l).to(p_dtype), [BLOCK_M, BLOCK_N])  # P~ = s * y, unquantized
        y5, sc = gl.broadcast(y5, sc)
        p = gl.reshape(_round_p(y5, sc, False, FP16), [BLOCK_M, BLOCK_N])  # e2m1(y) * s in the dot's dtype, exact
        if not TRAINING:
            p_aux = p
        return p, p_aux, alpha, m_new, l_new

    @gluon.jit
    def _softmax_step(s, m_i, l_i, qk_scale, dtype: gl.constexpr, BLOCK_N: gl.constexpr, FIRST: gl.constexpr,
                      FP4: gl.constexpr, TRAINING: gl.constexpr):
        """One key block's softmax on masked S_j: (P_j in dtype and S's layout, P~_j likewise for O' when
        TRAINING (else P_j again), alpha, m_new, l_new)."""
        if FP4:
            p, p_aux, alpha, m_new, l_new = _fp4_step(s, m_i, l_i, qk_scale, BLOCK_N, FIRST, dtype == gl.float16,
                                                      TRAINING)
            p = gl.convert_layout(p, s.type.layout, assert_trivial=True)  # the reshapes moved nothing
            if TRAINING:
                p_aux = gl.convert_layout(p_aux, s.type.layout, assert_trivial=True)
            else:
                p_aux = p
        else:
            p, alpha, m_new, l_new = _bf16_step(s, m_i, l_i, qk_scale, FIRST)
            p = p.to(dtype)
            p_aux = p
        return p, p_aux, alpha, m_new, l_new

    @gluon.jit
    def _per_row(x, layout: gl.constexpr):
        """A per-row statistic as a (BLOCK_M,) vector in ``layout`` (the FP4 step keeps them 5-d); moves no data."""
        return gl.convert_layout(gl.reshape(x, [x.shape[0]]), layout, assert_trivial=True)

    @gluon.jit
    def _attn_softmax_mma(o_desc, aux_desc, m_ptr, l_ptr, q_smem, aux_smem, k_bufs, v_bufs, q_ready, k_ready,
                          v_ready, k_empty, v_empty, turn_wait, turn_pass, off_b, off_h, off_m, n_blocks, seqlen_q,
                          seqlen_k, qk_scale, num_heads, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                          HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, FP4: gl.constexpr,
                          TRAINING: gl.constexpr, STATS: gl.constexpr, PARITY: gl.constexpr,
                          PINGPONG: gl.constexpr, num_warps: gl.constexpr):
        """A consumer partition (BLOCK_M rows at off_m on num_warps warps): both matmuls and the online softmax, then
        O / l through shared memory and TMA. TRAINING adds O' += P~_j V_j (a third wgmma, issued after
        P_{j-1} V_{j-1} and overlapped alike) and O' / l through its own shared-memory tile; STATS, m and l per row.
        PINGPONG alternates each round of wgmma issues with the other consumer's (_take_turn, _pass_turn). Rows
        all past Lq (the second consumer of the last query block) get no Q tile: the partition still steps
        through every key tile (the ring waits for both consumers) on whatever its tile holds, and stores
        nothing."""
        s_layout: gl.constexpr = _wgmma_layout(num_warps, BLOCK_N)
        o_layout: gl.constexpr = _wgmma_layout(num_warps, HEAD_DIM)
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        acc_row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
        dtype: gl.constexpr = q_smem.dtype

        offs_m = off_m + gl.arange(0, BLOCK_M, row_layout)
        zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
        if TRAINING:
            acc_aux = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
        live = off_m < seqlen_q
        if TRAINING:  # the training variant masks every tile: the 1.3B QAT step ran 0.8% faster so (4,703-4,707
            n_unmasked = 0  # against 4,738-4,753 ms, H100, alternating runs in one call; why, not measured)
        else:
            n_unmasked = _unmasked_tiles(off_m, seqlen_k, BLOCK_N, CAUSAL)
        mbarrier.wait(q_ready, 0, pred=live)
        q = q_smem.reshape([BLOCK_M, HEAD_DIM])

        # Block 0 alone: its logits start the running max.
        _take_turn(turn_wait, 0, PARITY, PINGPONG)
        s = _issue_scores(q, k_bufs, k_ready, 0, zero, BLOCK_N, HEAD_DIM, NUM_STAGES)
        _pass_turn(turn_pass, PINGPONG)
        s = warpgroup_mma_wait(0, deps=[s])
        mbarrier.arrive(k_empty.index(0), count=1)
        s = _masked(s, 0, offs_m, seqlen_k, BLOCK_N, CAUSAL, FP4)
        p, p_aux, alpha, m_i, l_i = _softmax_step(s, None, None, qk_scale, dtype, BLOCK_N, True, FP4, TRAINING)
        p = gl.convert_layout(p, p_layout)
        if TRAINING:
            p_aux = gl.convert_layout(p_aux, p_layout)

        for j in range(1, n_blocks):
            # S_j first, then P_{j-1} V_{j-1} (and P~_{j-1} V_{j-1}); waiting until only those are pending leaves
            # them running while block j's softmax computes (wgmma groups complete in issue order).
            _take_turn(turn_wait, j, PARITY, PINGPONG)
            s = _issue_scores(q, k_bufs, k_ready, j, zero, BLOCK_N, HEAD_DIM, NUM_STAGES)
            v = _v_tile(v_bufs, v_ready, j - 1, BLOCK_N, HEAD_DIM, NUM_STAGES)
            acc = warpgroup_mma(p, v, acc, is_async=True)
            if TRAINING:
                acc_aux = warpgroup_mma(p_aux, v, acc_aux, is_async=True)
            _pass_turn(turn_pass, PINGPONG)
            if TRAINING:
                s = warpgroup_mma_wait(2, deps=[s])
            else:
                s = warpgroup_mma_wait(1, deps=[s])
            mbarrier.arrive(k_empty.index(j % NUM_STAGES), count=1)
            if j >= n_unmasked:  # a uniform branch: most tiles skip the compare and select on every element
                s = _masked(s, j, offs_m, seqlen_k, BLOCK_N, CAUSAL, FP4)
            p_next, p_aux_next, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, qk_scale, dtype, BLOCK_N, False, FP4,
                                                                TRAINING)
            alpha_acc = _per_row(alpha, acc_row_layout)
            if TRAINING:
                # Whether any row's max moved (alpha != 1, NaN included), decided for the whole warpgroup (a
                # cross-warp reduction, before the wait so that it runs under the PV wgmma): multiplying by 1 changes
                # nothing, and once the running max settles most tiles skip the rescale of O and O', 2 FMULs per S
                # element of the 64-key tiles. The inference forwards (1 FMUL per element of 128-key tiles) gained
                # nothing measurable from it, and Triton 3.9's ptxas gives their head_dim-128 kernels a stack frame.
                rescale = gl.max(gl.where(alpha_acc == 1.0, 0, 1), axis=0) > 0
            else:
                rescale = True
            # P_{j-1} stays a dependency until its wgmma is done: its registers are that MMA's A operand.
            if TRAINING:
                acc, acc_aux, p, p_aux = warpgroup_mma_wait(0, deps=[acc, acc_aux, p, p_aux])
            else:
                acc, p = warpgroup_mma_wait(0, deps=[acc, p])
            mbarrier.arrive(v_empty.index((j - 1) % NUM_STAGES), count=1)
            if rescale:
                acc = acc * alpha_acc[:, None]
                if TRAINING:
                    acc_aux = acc_aux * alpha_acc[:, None]
            p = gl.convert_layout(p_next, p_layout)
            if TRAINING:
                p_aux = gl.convert_layout(p_aux_next, p_layout)

        _take_turn(turn_wait, n_blocks, PARITY, PINGPONG)
        v = _v_tile(v_bufs, v_ready, n_blocks - 1, BLOCK_N, HEAD_DIM, NUM_STAGES)
        acc = warpgroup_mma(p, v, acc, is_async=True)
        if TRAINING:
            acc_aux = warpgroup_mma(p_aux, v, acc_aux, is_async=True)
        _pass_turn(turn_pass, PINGPONG)
        if TRAINING:
            acc, acc_aux, p, p_aux = warpgroup_mma_wait(0, deps=[acc, acc_aux, p, p_aux])
        else:
            acc, p = warpgroup_mma_wait(0, deps=[acc, p])
        l_acc = _per_row(l_i, acc_row_layout)[:, None]

        # Q's slot is free once the last S finished (above): O goes out through it; TMA clips rows past Lq.
        if live:
            q.store((acc / l_acc).to(dtype))
            if TRAINING:
                aux_smem.reshape([BLOCK_M, HEAD_DIM]).store((acc_aux / l_acc).to(dtype))
            fence_async_shared()
            _tma_store(o_desc, [off_b, off_h, off_m, 0], q_smem)
            if TRAINING:
                _tma_store(aux_desc, [off_b, off_h, off_m, 0], aux_smem)
            if STATS:
                # m and l per row, (B, H, Lq) fp32 contiguous: the backward's P~ = 2688 2^(S - m) and P = P~ / l, or
                # ring attention's log-sum-exp
                rows = (off_b * num_heads + off_h) * seqlen_q + offs_m
                gl.store(m_ptr + rows, _per_row(m_i, row_layout), mask=offs_m < seqlen_q)
                gl.store(l_ptr + rows, _per_row(l_i, row_layout), mask=offs_m < seqlen_q)
            tma.store_wait(0)

    @gluon.jit
    def _attn_fwd(q_desc, k_desc, v_desc, o_desc, aux_desc, m_ptr, l_ptr, seqlen_q, seqlen_k, qk_scale, num_heads,
                  HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr, NUM_STAGES: gl.constexpr,
                  FP4: gl.constexpr, TRAINING: gl.constexpr, STATS: gl.constexpr, CONSUMERS: gl.constexpr,
                  PINGPONG: gl.constexpr, num_warps: gl.constexpr):
        """One program per (CONSUMERS * BLOCK_M query rows, batch * head): allocate the ring and its barriers, then
        fork into the load partition and CONSUMERS softmax/MMA partitions of BLOCK_M rows each (the Q descriptor's
        tile): one of num_warps warps (the "default" variant: 8 warps, two warpgroups in lockstep), or two
        independent warpgroups of 4 ("ws": the default partition and a worker, as FlashAttention-3's forward;
        PINGPONG alternates their wgmma rounds). TRAINING (FP4 only) also writes O' through aux_desc; STATS (FP4
        only; TRAINING implies it) the row statistics m, l to m_ptr, l_ptr; otherwise those are not touched."""
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
        gl.static_assert(q_desc.block_type.shape[3] == HEAD_DIM)
        gl.static_assert(not FP4 or BLOCK_N % 64 == 0)  # _fp4_step: each thread holds whole 16-key blocks
        gl.static_assert(FP4 or not TRAINING)  # O' is SPEC §2's auxiliary output: the FP4 forward's
        gl.static_assert(FP4 or not STATS)  # m is the FP4 forward's integer running max
        gl.static_assert(STATS or not TRAINING)  # the backward reads m and l
        gl.static_assert(CONSUMERS == 1 or (CONSUMERS == 2 and num_warps == 4))
        gl.static_assert(CONSUMERS == 2 or not PINGPONG)
        off_m = gl.program_id(0) * (CONSUMERS * BLOCK_M)
        off_b = gl.program_id(1) // num_heads
        off_h = gl.program_id(1) % num_heads
        if CAUSAL:  # top-left aligned: query i sees keys 0..i, so blocks past the program's last row are skipped
            # (every consumer steps through all of them: the first one's last tiles may be masked out whole)
            n_blocks = gl.cdiv(gl.minimum(seqlen_k, off_m + CONSUMERS * BLOCK_M), BLOCK_N)
        else:
            n_blocks = gl.cdiv(seqlen_k, BLOCK_N)

        q_smem = gl.allocate_shared_memory(q_desc.dtype, [CONSUMERS] + q_desc.block_type.shape, q_desc.layout)
        if TRAINING:  # O' leaves through a tile of its own: Q's slot carries O at the same time
            aux_smem = gl.allocate_shared_memory(aux_desc.dtype, [CONSUMERS] + aux_desc.block_type.shape,
                                                 aux_desc.layout)
        else:
            aux_smem = q_smem
        k_bufs = gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_bufs = gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES] + v_desc.block_type.shape, v_desc.layout)
        q_ready = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for c in gl.static_range(CONSUMERS):
            mbarrier.init(q_ready.index(c), count=1)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=CONSUMERS)  # a slot is free once every consumer is done with it
            mbarrier.init(v_empty.index(i), count=CONSUMERS)
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        fence_async_shared()

        if CONSUMERS == 1:
            gl.warp_specialize([
                (_attn_softmax_mma, (o_desc, aux_desc, m_ptr, l_ptr, q_smem.index(0), aux_smem.index(0), k_bufs,
                                     v_bufs, q_ready.index(0), k_ready, v_ready, k_empty, v_empty, turn.index(0),
                                     turn.index(1), off_b, off_h, off_m, n_blocks, seqlen_q, seqlen_k, qk_scale,
                                     num_heads, BLOCK_M, BLOCK_N, HEAD_DIM, NUM_STAGES, CAUSAL, FP4, TRAINING, STATS,
                                     1, False, num_warps)),
                (_attn_load, (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_ready, k_ready, v_ready, k_empty,
                              v_empty, off_b, off_h, off_m, n_blocks, seqlen_q, BLOCK_N, NUM_STAGES, CONSUMERS)),
            ], [LOADER_WARPS], [LOADER_REGS])
        else:
            gl.warp_specialize([
                (_attn_softmax_mma, (o_desc, aux_desc, m_ptr, l_ptr, q_smem.index(0), aux_smem.index(0), k_bufs,
                                     v_bufs, q_ready.index(0), k_ready, v_ready, k_empty, v_empty, turn.index(0),
                                     turn.index(1), off_b, off_h, off_m, n_blocks, seqlen_q, seqlen_k, qk_scale,
                                     num_heads, BLOCK_M, BLOCK_N, HEAD_DIM, NUM_STAGES, CAUSAL, FP4, TRAINING, STATS,
                                     1, PINGPONG, num_warps)),
                (_attn_softmax_mma, (o_desc, aux_desc, m_ptr, l_ptr, q_smem.index(1), aux_smem.index(1), k_bufs,
                                     v_bufs, q_ready.index(1), k_ready, v_ready, k_empty, v_empty, turn.index(1),
                                     turn.index(0), off_b, off_h, off_m + BLOCK_M, n_blocks, seqlen_q, seqlen_k,
                                     qk_scale, num_heads, BLOCK_M, BLOCK_N, HEAD_DIM, NUM_STAGES, CAUSAL, FP4,
                                     TRAINING, STATS, 0, PINGPONG, num_warps)),
                (_attn_load, (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_ready, k_ready, v_ready, k_empty,
                              v_empty, off_b, off_h, off_m, n_blocks, seqlen_q, BLOCK_N, NUM_STAGES, CONSUMERS)),
            ], [num_warps, LOADER_WARPS], [WS_CONSUMER_REGS, LOADER_REGS])

    # -----------------------------------------------------------------------------------------------------------
    # Backward (SPEC §2), attn_qat's Triton backward on wgmma: D = rowsum(dO O') (attn_qat's Triton pre-pass), then
    # a dK/dV kernel per key block and a dQ kernel per query block. Q^F, dO (dK/dV) or K^F, V^F (dQ) stream through
    # a double-buffered ring by TMA; the loop issues the next tile's copies before it computes on this one.
    # -----------------------------------------------------------------------------------------------------------

    @gluon.jit
    def _issue_pair(a_desc, b_desc, a_bufs, b_bufs, ready, slot, off_b, off_h, row):
        """TMA copies of the row tile at ``row`` of two (B, H, L, D) tensors (Q^F and dO, or K^F and V^F) into ring
        slot ``slot``; both complete on its one ready barrier (out-of-bounds rows come zero-filled and count)."""
        bar = ready.index(slot)
        mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
        _tma_load(a_desc, [off_b, off_h, row, 0], bar, a_bufs.index(slot))
        _tma_load(b_desc, [off_b, off_h, row, 0], bar, b_bufs.index(slot))

    @gluon.jit
    def _row_stats(m_ptr, l_ptr, delta_ptr, bh, offs_m, seqlen_q):
        """m, 1/l and D of query rows offs_m ((B, H, Lq) fp32 contiguous); rows past Lq read m = 0, l = 1, D = 0,
        so with their zero-filled Q^F and dO they add nothing to dK, dV (as in the Triton backward)."""
        ok = offs_m < seqlen_q
        rows = bh * seqlen_q + offs_m
        m = gl.load(m_ptr + rows, mask=ok, other=0.0)
        inv_l = 1.0 / gl.load(l_ptr + rows, mask=ok, other=1.0)
        delta = gl.load(delta_ptr + rows, mask=ok, other=0.0)
        return m, inv_l, delta

    @gluon.jit
    def _bwd_p(s, m, inv_l, qk_scale, QUANT: gl.constexpr, FP16: gl.constexpr):
        """From masked S (queries x keys, wgmma's accumulator layout): P~ = 2688 2^(S - m) (fp32, unquantized: dS's
        factor is P = P~ / l, taken where dS is, so that P~ alone stays live meanwhile) and, QUANT (keys in tile
        order: each thread holds whole 16-key blocks), P^F = phi(P~) / l in fp32 (dV's operand once in the dot's
        dtype: FP16 picks fp16's rounding of phi, else bf16's), as attn_qat's dK/dV kernel computes them
        (_phi_blocks, block maxima from S). Without QUANT the second value is P~ again."""
        t = s * qk_scale - (m - 11.392317422778761)[:, None]  # log2 P~: P~ = 2688 2^(S - m), 11.39... = log2(2688)
        p_tilde = gl.exp2(t)
        if QUANT:
            BLOCK_M: gl.constexpr = s.shape[0]
            BLOCK_N: gl.constexpr = s.shape[1]
            # the forward's view: axes 1 and 3 name a 16-key block, 2 and 4 its keys, all in one thread; exp2 is
            # monotone, so each block's max P~ is exp2 of its max log2 P~ (one exp2 per block)
            t5 = gl.reshape(t, [BLOCK_M, BLOCK_N // 64, 8, 4, 2])
            amax = gl.exp2(gl.max(gl.max(t5, axis=4, keep_dims=True), axis=2, keep_dims=True))
            pf = _phi_blocks(gl.reshape(p_tilde, [BLOCK_M, BLOCK_N // 64, 8, 4, 2]), amax, False, FP16, True)
            pf = gl.convert_layout(gl.reshape(pf, [BLOCK_M, BLOCK_N]), s.type.layout, assert_trivial=True)
            pf = pf.to(gl.float32) * inv_l[:, None]
        else:
            pf = p_tilde
        return p_tilde, pf

    @gluon.jit
    def _attn_bwd_dkdv(q_desc, do_desc, kf_ptr, vf_ptr, m_ptr, l_ptr, delta_ptr, dk_ptr, dv_ptr, stride_kb, stride_kh,
                       stride_kl, seqlen_q, seqlen_k, qk_scale, sm_scale, num_heads, BLOCK_N: gl.constexpr,
                       CAUSAL: gl.constexpr, num_warps: gl.constexpr):
        """One key block of BLOCK_N keys per program, looping over query blocks of BLOCK_M = 16 * num_warps rows:
        S = Q^F K^T and dP = dO V^T (wgmma, both operands in shared memory), P and phi(P~) in registers, then
        dV += P^F^T dO and dK += dS^T Q^F with P^F and dS through shared memory (wgmma reads them transposed).
        K^F and V^F are loaded once, their rows in tile order (tile_keys), so each 16-key block of P lies in one
        thread as in the forward; dK, dV leave in key order (dK times sm_scale)."""
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
        HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
        dtype: gl.constexpr = q_desc.dtype
        gl.static_assert(BLOCK_M == 16 * num_warps)  # S and dP: one 16-row wgmma slab of queries per warp
        gl.static_assert(BLOCK_N % 64 == 0)  # _bwd_p: each thread holds whole 16-key blocks
        # S, dP: (queries, keys), warps along queries. dK, dV: (keys, head_dim), warpgroups stacked along keys as far
        # as BLOCK_N allows (64 rows each), then side by side along head_dim.
        KV_WARPS_M: gl.constexpr = min(num_warps, BLOCK_N // 16)
        KV_WARPS_N: gl.constexpr = num_warps // KV_WARPS_M
        s_layout: gl.constexpr = _wgmma_layout(num_warps, BLOCK_N)
        kv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[KV_WARPS_M, KV_WARPS_N],
                                                            instr_shape=[16, HEAD_DIM // KV_WARPS_N, 16])
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        # 16-byte global accesses for K, V, dK, dV: 8 elements per thread along head_dim
        io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (HEAD_DIM // 8), HEAD_DIM // 8], [num_warps, 1],
                                                   [1, 0])
        tile_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

        bh = gl.program_id(1)
        off_b = bh // num_heads
        off_h = bh % num_heads
        n0 = gl.program_id(0) * BLOCK_N
        tile_rows = gl.arange(0, BLOCK_N, gl.SliceLayout(1, io_layout))
        keys = n0 + tile_keys(tile_rows, BLOCK_N)  # row c of the tiles holds key n0 + tile_keys(c)
        cols = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, io_layout))
        key_ok = (keys < seqlen_k)[:, None]
        kv_offs = (bh.to(gl.int64) * seqlen_k + keys)[:, None] * HEAD_DIM + cols[None, :]  # K^F, V^F contiguous
        k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], tile_layout,
                                           gl.load(kf_ptr + kv_offs, mask=key_ok, other=0.0))
        v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], tile_layout,
                                           gl.load(vf_ptr + kv_offs, mask=key_ok, other=0.0))
        p_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], tile_layout)
        ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], tile_layout)
        q_bufs = gl.allocate_shared_memory(dtype, [2] + q_desc.block_type.shape, q_desc.layout)
        do_bufs = gl.allocate_shared_memory(dtype, [2] + do_desc.block_type.shape, do_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(ready.index(i), count=1)
        fence_async_shared()  # K, V's stores and the barriers' init, before wgmma and TMA use them

        zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
        dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
        dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
        kt = k_smem.permute((1, 0))
        vt = v_smem.permute((1, 0))
        # causal (top-left): queries before the key block never see it
        lo = (n0 // BLOCK_M) * BLOCK_M if CAUSAL else 0
        n_steps = gl.cdiv(seqlen_q - lo, BLOCK_M)  # <= 0 when causal and the block starts past Lq: dK = dV = 0
        if n_steps > 0:
            _issue_pair(q_desc, do_desc, q_bufs, do_bufs, ready, 0, off_b, off_h, lo)
        for i in range(n_steps):
            slot = i % 2
            off_m = lo + i * BLOCK_M
            if i + 1 < n_steps:  # the other slot's readers (step i-1's wgmmas) have all been waited for
                _issue_pair(q_desc, do_desc, q_bufs, do_bufs, ready, 1 - slot, off_b, off_h, off_m + BLOCK_M)
            offs_m = off_m + gl.arange(0, BLOCK_M, row_layout)
            m, inv_l, delta = _row_stats(m_ptr, l_ptr, delta_ptr, bh, offs_m, seqlen_q)
            mbarrier.wait(ready.index(slot), (i // 2) & 1)
            q = q_bufs.index(slot).reshape([BLOCK_M, HEAD_DIM])
            do = do_bufs.index(slot).reshape([BLOCK_M, HEAD_DIM])
            s = warpgroup_mma(q, kt, zero, use_acc=False, is_async=True)
            dp = warpgroup_mma(do, vt, zero, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(1, deps=[s])  # dP still runs while P and phi(P~) compute
            s = _masked(s, gl.program_id(0), offs_m, seqlen_k, BLOCK_N, CAUSAL, True)
            p_tilde, pf = _bwd_p(s, m, inv_l, qk_scale, True, dtype == gl.float16)
            # P^F and dS go to shared memory for the wgmmas that read them transposed (each writer fences its own
            # stores for the async proxy before the barrier that the compiler places ahead of those wgmmas). dV's
            # wgmma is issued as soon as P^F is there, and runs while dS computes: groups complete in issue order,
            # so waiting until one group is left pending waits for dP alone.
            p_smem.store(pf.to(dtype))
            fence_async_shared()
            dv = warpgroup_mma(p_smem.permute((1, 0)), do, dv, is_async=True)
            dp = warpgroup_mma_wait(1, deps=[dp])
            ds_smem.store((p_tilde * inv_l[:, None] * (dp - delta[:, None])).to(dtype))  # dS = P (dP - D)
            fence_async_shared()
            dk = warpgroup_mma(ds_smem.permute((1, 0)), q, dk, is_async=True)
            dv, dk = warpgroup_mma_wait(0, deps=[dv, dk])

        out_offs = off_b.to(gl.int64) * stride_kb + off_h * stride_kh + keys[:, None] * stride_kl + cols[None, :]
        gl.store(dk_ptr + out_offs, gl.convert_layout((dk * sm_scale).to(dk_ptr.dtype.element_ty), io_layout),
                 mask=key_ok)
        gl.store(dv_ptr + out_offs, gl.convert_layout(dv.to(dv_ptr.dtype.element_ty), io_layout), mask=key_ok)

    @gluon.jit
    def _dq_step(q, do, k, v, dq, zero, j, offs_m, m, inv_l, delta, seqlen_k, qk_scale, CAUSAL: gl.constexpr):
        """One key tile j of a dQ kernel (keys in order), both its variants: S = Q^F K^T and dP = dO V^T by wgmma, dS =
        P (dP - D) with the unquantized P, then dQ += dS K^F with dS from registers (wgmma's A operand, as the
        forward's P); every wgmma waited for. Returns dQ."""
        BLOCK_N: gl.constexpr = k.shape[0]
        ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq.type.layout, k_width=2)
        s = warpgroup_mma(q, k.permute((1, 0)), zero, use_acc=False, is_async=True)
        dp = warpgroup_mma(do, v.permute((1, 0)), zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(1, deps=[s])
        s = _masked(s, j, offs_m, seqlen_k, BLOCK_N, CAUSAL, False)
        p_tilde, _ = _bwd_p(s, m, inv_l, qk_scale, False, False)
        dp = warpgroup_mma_wait(0, deps=[dp])
        ds = gl.convert_layout((p_tilde * inv_l[:, None] * (dp - delta[:, None])).to(q.dtype), ds_layout)
        dq = warpgroup_mma(ds, k, dq, is_async=True)
        dq, ds = warpgroup_mma_wait(0, deps=[dq, ds])
        return dq

    @gluon.jit
    def _attn_bwd_dq(q_desc, do_desc, k_desc, v_desc, dq_desc, m_ptr, l_ptr, delta_ptr, seqlen_q, seqlen_k, qk_scale,
                     sm_scale, num_heads, CAUSAL: gl.constexpr, num_warps: gl.constexpr):
        """One query block of BLOCK_M = 16 * num_warps rows per program, looping over key tiles (keys in order):
        S = Q^F K^T and dP = dO V^T, dS = P (dP - D) with the unquantized P, then dQ += dS K^F with dS from
        registers (wgmma's A operand, as the forward's P); dQ times sm_scale leaves by TMA through Q's slot."""
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
        HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
        dtype: gl.constexpr = q_desc.dtype
        gl.static_assert(BLOCK_M == 16 * num_warps)
        s_layout: gl.constexpr = _wgmma_layout(num_warps, BLOCK_N)
        dq_layout: gl.constexpr = _wgmma_layout(num_warps, HEAD_DIM)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

        bh = gl.program_id(1)
        off_b = bh // num_heads
        off_h = bh % num_heads
        off_m = gl.program_id(0) * BLOCK_M
        if CAUSAL:  # top-left aligned: key tiles past the block's last row are skipped
            n_blocks = gl.cdiv(gl.minimum(seqlen_k, off_m + BLOCK_M), BLOCK_N)
        else:
            n_blocks = gl.cdiv(seqlen_k, BLOCK_N)
        q_smem = gl.allocate_shared_memory(dtype, [1] + q_desc.block_type.shape, q_desc.layout)  # a ring of one
        do_smem = gl.allocate_shared_memory(dtype, [1] + do_desc.block_type.shape, do_desc.layout)
        k_bufs = gl.allocate_shared_memory(dtype, [2] + k_desc.block_type.shape, k_desc.layout)
        v_bufs = gl.allocate_shared_memory(dtype, [2] + v_desc.block_type.shape, v_desc.layout)
        q_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_ready.index(0), count=1)
        for i in gl.static_range(2):
            mbarrier.init(ready.index(i), count=1)
        fence_async_shared()

        _issue_pair(q_desc, do_desc, q_smem, do_smem, q_ready, 0, off_b, off_h, off_m)
        _issue_pair(k_desc, v_desc, k_bufs, v_bufs, ready, 0, off_b, off_h, 0)  # n_blocks >= 1: key 0 is seen
        offs_m = off_m + gl.arange(0, BLOCK_M, row_layout)
        m, inv_l, delta = _row_stats(m_ptr, l_ptr, delta_ptr, bh, offs_m, seqlen_q)
        zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
        dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, dq_layout)
        mbarrier.wait(q_ready.index(0), 0)
        q = q_smem.index(0).reshape([BLOCK_M, HEAD_DIM])
        do = do_smem.index(0).reshape([BLOCK_M, HEAD_DIM])
        for j in range(n_blocks):
            slot = j % 2
            if j + 1 < n_blocks:  # the other slot's readers (tile j-1's wgmmas) have all been waited for
                _issue_pair(k_desc, v_desc, k_bufs, v_bufs, ready, 1 - slot, off_b, off_h, (j + 1) * BLOCK_N)
            mbarrier.wait(ready.index(slot), (j // 2) & 1)
            k = k_bufs.index(slot).reshape([BLOCK_N, HEAD_DIM])
            v = v_bufs.index(slot).reshape([BLOCK_N, HEAD_DIM])
            dq = _dq_step(q, do, k, v, dq, zero, j, offs_m, m, inv_l, delta, seqlen_k, qk_scale, CAUSAL)

        q.store((dq * sm_scale).to(dtype))  # Q's slot is free: the last wgmma that read it is done
        fence_async_shared()
        _tma_store(dq_desc, [off_b, off_h, off_m, 0], q_smem.index(0))
        tma.store_wait(0)

    # -----------------------------------------------------------------------------------------------------------
    # The warp-specialised dK/dV kernel (hopper_attn_qat_backward(variant="ws")), FlashAttention-3's backward layout:
    # a program owns 2 * 64 keys, one consumer warpgroup per 64 of them, each with its own K^F, V^F tiles, dK and dV
    # accumulators and P^F, dS tiles, so the two never wait for each other; a one-warp load partition streams Q^F
    # and dO in 64-query tiles through a NUM_STAGES ring that both consume (a slot is free once both have arrived).
    # One warpgroup's phi and dS arithmetic then runs while the other's wgmmas hold the tensor cores.
    # -----------------------------------------------------------------------------------------------------------

    @gluon.jit
    def _dkdv_ws_load(q_desc, do_desc, q_bufs, do_bufs, ready, empty, off_b, off_h, lo, n_steps,
                      NUM_STAGES: gl.constexpr):
        """Load partition: Q^F and dO of query tile i into ring slot i % NUM_STAGES once both consumers freed it."""
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
        for i in range(n_steps):
            slot = i % NUM_STAGES
            # A fresh barrier is in phase 0, so waiting on parity 1 passes: the first lap finds every slot free.
            mbarrier.wait(empty.index(slot), ((i // NUM_STAGES) & 1) ^ 1)
            _issue_pair(q_desc, do_desc, q_bufs, do_bufs, ready, slot, off_b, off_h, lo + i * BLOCK_M)

    @gluon.jit
    def _dkdv_ws_steps(q_bufs, do_bufs, k_smem, v_smem, p_smem, ds_smem, ready, empty, m_ptr, l_ptr, delta_ptr, bh,
                       key_tile, lo, n_steps, seqlen_q, seqlen_k, qk_scale, kv_layout: gl.constexpr,
                       NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, WARPS: gl.constexpr):
        """One consumer's n_steps >= 1 steps (dK unscaled, dV). Per step, as _attn_bwd_dkdv's: S and dP by wgmma,
        P~ and P^F = phi(P~) / l in registers, dV += P^F^T dO and dK += dS^T Q^F from shared memory; dV and dK are
        left running into the next step, whose S queues behind them (the wait for S covers them; then the ring
        slot they read is released)."""
        BLOCK_M: gl.constexpr = q_bufs.shape[3]
        HEAD_DIM: gl.constexpr = q_bufs.shape[4]
        BLOCK_N: gl.constexpr = k_smem.shape[0]
        dtype: gl.constexpr = q_bufs.dtype
        s_layout: gl.constexpr = _wgmma_layout(WARPS, BLOCK_N)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

        zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
        dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
        dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
        kt = k_smem.permute((1, 0))
        vt = v_smem.permute((1, 0))
        for i in range(n_steps):
            slot = i % NUM_STAGES
            offs_m = lo + i * BLOCK_M + gl.arange(0, BLOCK_M, row_layout)
            m, inv_l, delta = _row_stats(m_ptr, l_ptr, delta_ptr, bh, offs_m, seqlen_q)
            mbarrier.wait(ready.index(slot), (i // NUM_STAGES) & 1)
            q = q_bufs.index(slot).reshape([BLOCK_M, HEAD_DIM])
            do = do_bufs.index(slot).reshape([BLOCK_M, HEAD_DIM])
            s = warpgroup_mma(q, kt, zero, use_acc=False, is_async=True)
            # groups complete in issue order: S done means the last step's dV and dK are too (P^F, dS, its slot free)
            s, dv, dk = warpgroup_mma_wait(0, deps=[s, dv, dk])
            mbarrier.arrive(empty.index((i + NUM_STAGES - 1) % NUM_STAGES), count=1, pred=i > 0)
            s = _masked(s, key_tile, offs_m, seqlen_k, BLOCK_N, CAUSAL, True)
            p_tilde, pf = _bwd_p(s, m, inv_l, qk_scale, True, dtype == gl.float16)
            p_smem.store(pf.to(dtype))
            fence_async_shared()
            # dP is issued only now, with dV: during phi its accumulator would be 32 more live registers per thread
            # (Triton 3.6 spills at head_dim 128), and the other consumer's wgmmas fill the tensor cores meanwhile
            dp = warpgroup_mma(do, vt, zero, use_acc=False, is_async=True)
            dv = warpgroup_mma(p_smem.permute((1, 0)), do, dv, is_async=True)
            dp = warpgroup_mma_wait(1, deps=[dp])  # dV runs on while dS computes
            ds_smem.store((p_tilde * inv_l[:, None] * (dp - delta[:, None])).to(dtype))  # dS = P (dP - D)
            fence_async_shared()
            dk = warpgroup_mma(ds_smem.permute((1, 0)), q, dk, is_async=True)
            # dV and dK are the last two groups: waiting until two are pending waits for nothing, it only hands them
            # to the next step as accumulators in registers (the loop carries one type), still running
            dv, dk = warpgroup_mma_wait(2, deps=[dv, dk])
        dv, dk = warpgroup_mma_wait(0, deps=[dv, dk])
        return dk, dv

    @gluon.jit
    def _dkdv_ws_mma(q_bufs, do_bufs, k_smem, v_smem, p_smem, ds_smem, ready, empty, m_ptr, l_ptr, delta_ptr,
                     dk_head, dv_head, stride_kl, bh, key_tile, lo, n_steps, seqlen_q, seqlen_k, qk_scale, sm_scale,
                     NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, WARPS: gl.constexpr):
        """One consumer warpgroup: the 64 keys of key tile ``key_tile`` (K^F, V^F rows in tile order in k_smem,
        v_smem) against every query tile of the ring (_dkdv_ws_steps), then dK * sm_scale and dV out (dk_head,
        dv_head: this (batch, head)'s first row, so that fewer scalars stay live through the loop)."""
        HEAD_DIM: gl.constexpr = q_bufs.shape[4]
        BLOCK_N: gl.constexpr = k_smem.shape[0]
        kv_layout: gl.constexpr = _wgmma_layout(WARPS, HEAD_DIM)
        dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
        dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
        # Only a loop that runs: on a path that skips it, the zeros' moves would reach the final wgmma wait, and ptxas
        # then serialises every wgmma of the kernel (its C7515 advisory).
        if n_steps > 0:
            dk, dv = _dkdv_ws_steps(q_bufs, do_bufs, k_smem, v_smem, p_smem, ds_smem, ready, empty, m_ptr, l_ptr,
                                    delta_ptr, bh, key_tile, lo, n_steps, seqlen_q, seqlen_k, qk_scale, kv_layout,
                                    NUM_STAGES, CAUSAL, WARPS)

        # dK, dV leave from wgmma's registers (no layout conversion, whose scratch shared memory would come on top of
        # the ring), rows back in key order
        tile_rows = gl.arange(0, BLOCK_N, gl.SliceLayout(1, kv_layout))
        keys = key_tile * BLOCK_N + tile_keys(tile_rows, BLOCK_N)
        cols = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, kv_layout))
        out_offs = keys[:, None] * stride_kl + cols[None, :]
        key_ok = (keys < seqlen_k)[:, None]
        gl.store(dk_head + out_offs, (dk * sm_scale).to(dk_head.dtype.element_ty), mask=key_ok)
        gl.store(dv_head + out_offs, dv.to(dv_head.dtype.element_ty), mask=key_ok)

    @gluon.jit
    def _attn_bwd_dkdv_ws(q_desc, do_desc, kf_ptr, vf_ptr, m_ptr, l_ptr, delta_ptr, dk_ptr, dv_ptr, stride_kb,
                          stride_kh, stride_kl, seqlen_q, seqlen_k, qk_scale, sm_scale, num_heads,
                          BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                          num_warps: gl.constexpr):
        """The dK/dV kernel, warp-specialised: one program per CONSUMERS * BLOCK_N keys (BLOCK_N = 64 per consumer
        warpgroup), stepping over query tiles of BLOCK_M = 64 rows that a load partition streams by TMA. Numerics as
        _attn_bwd_dkdv (P^F and dS element for element; dK, dV accumulate the same 16-query chunks in the same order,
        in 64-query steps instead of 128)."""
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
        HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
        CONSUMERS: gl.constexpr = 2
        dtype: gl.constexpr = q_desc.dtype
        gl.static_assert(num_warps == 4)  # the default partition is the first consumer warpgroup
        gl.static_assert(BLOCK_M == 16 * num_warps)  # S and dP: one 16-row wgmma slab of queries per warp
        gl.static_assert(BLOCK_N == 64)  # a consumer's dK, dV: one m64 wgmma tile of keys
        tile_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

        bh = gl.program_id(1)
        off_b = bh // num_heads
        off_h = bh % num_heads
        n0 = gl.program_id(0) * (CONSUMERS * BLOCK_N)
        k_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, BLOCK_N, HEAD_DIM], tile_layout)
        v_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, BLOCK_N, HEAD_DIM], tile_layout)
        # K^F, V^F rows in tile order (tile_keys), one tile per consumer, by 16-byte loads (8 elements per thread
        # along head_dim)
        io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (HEAD_DIM // 8), HEAD_DIM // 8], [num_warps, 1],
                                                   [1, 0])
        cols = gl.arange(0, HEAD_DIM, gl.SliceLayout(0, io_layout))
        for c in gl.static_range(CONSUMERS):
            keys = n0 + c * BLOCK_N + tile_keys(gl.arange(0, BLOCK_N, gl.SliceLayout(1, io_layout)), BLOCK_N)
            key_ok = (keys < seqlen_k)[:, None]
            kv_offs = (bh.to(gl.int64) * seqlen_k + keys)[:, None] * HEAD_DIM + cols[None, :]  # contiguous
            k_smem.index(c).store(gl.load(kf_ptr + kv_offs, mask=key_ok, other=0.0))
            v_smem.index(c).store(gl.load(vf_ptr + kv_offs, mask=key_ok, other=0.0))
        p_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, BLOCK_M, BLOCK_N], tile_layout)
        ds_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, BLOCK_M, BLOCK_N], tile_layout)
        q_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES] + q_desc.block_type.shape, q_desc.layout)
        do_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES] + do_desc.block_type.shape, do_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=CONSUMERS)  # a slot is free once every consumer is done with it
        fence_async_shared()  # K, V's stores and the barriers' init, before wgmma and TMA use them

        # causal (top-left): queries before the program's keys never see them (the second consumer's first step,
        # its queries all before its keys, is masked out whole)
        lo = (n0 // BLOCK_M) * BLOCK_M if CAUSAL else 0
        n_steps = gl.maximum(gl.cdiv(seqlen_q - lo, BLOCK_M), 0)  # 0 when causal and the keys start past Lq
        key_tile = gl.program_id(0) * CONSUMERS
        head = off_b.to(gl.int64) * stride_kb + off_h * stride_kh
        dk_head = dk_ptr + head
        dv_head = dv_ptr + head
        gl.warp_specialize([
            (_dkdv_ws_mma, (q_bufs, do_bufs, k_smem.index(0), v_smem.index(0), p_smem.index(0), ds_smem.index(0),
                            ready, empty, m_ptr, l_ptr, delta_ptr, dk_head, dv_head, stride_kl, bh,
                            key_tile, lo, n_steps, seqlen_q, seqlen_k, qk_scale, sm_scale, NUM_STAGES, CAUSAL,
                            num_warps)),
            (_dkdv_ws_mma, (q_bufs, do_bufs, k_smem.index(1), v_smem.index(1), p_smem.index(1), ds_smem.index(1),
                            ready, empty, m_ptr, l_ptr, delta_ptr, dk_head, dv_head, stride_kl, bh,
                            key_tile + 1, lo, n_steps, seqlen_q, seqlen_k, qk_scale, sm_scale, NUM_STAGES, CAUSAL,
                            num_warps)),
            (_dkdv_ws_load, (q_desc, do_desc, q_bufs, do_bufs, ready, empty, off_b, off_h, lo, n_steps, NUM_STAGES)),
        ], [num_warps, LOADER_WARPS], [WS_CONSUMER_REGS, LOADER_REGS])

    # The warp-specialised dQ kernel (variant="ws"): a program owns 2 * 64 queries, one consumer warpgroup per 64 of
    # them (its own Q^F, dO tiles and dQ accumulator; dS stays in registers, so the two share nothing but the ring);
    # a one-warp load partition streams K^F and V^F in 64-key tiles through a NUM_STAGES ring that both consume.

    @gluon.jit
    def _issue_consumer_tiles(a_desc, b_desc, a_bufs, b_bufs, bars, off_b, off_h, row0, seqlen,
                              CONSUMERS: gl.constexpr):
        """A load partition's first copies: consumer c's row tile at row0 + c * BLOCK of two (B, H, L, D) tensors
        (Q and dO for a dQ kernel, K and V for a dK/dV kernel), once, on its barrier bars[c]. A consumer whose rows
        all lie past ``seqlen`` gets none (no TMA box wholly out of bounds)."""
        BLOCK: gl.constexpr = a_desc.block_type.shape[2]
        for c in gl.static_range(CONSUMERS):
            live = row0 + c * BLOCK < seqlen
            bar = bars.index(c)
            mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, live)
            _tma_load(a_desc, [off_b, off_h, row0 + c * BLOCK, 0], bar, a_bufs.index(c), pred=live)
            _tma_load(b_desc, [off_b, off_h, row0 + c * BLOCK, 0], bar, b_bufs.index(c), pred=live)

    @gluon.jit
    def _dq_ws_load(q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, k_bufs, v_bufs, q_ready, ready, empty, off_b,
                    off_h, off_m, n_blocks, seqlen_q, CONSUMERS: gl.constexpr, NUM_STAGES: gl.constexpr):
        """Load partition: each consumer's Q^F and dO tiles once (on its q_ready barrier), then K^F_j and V^F_j into
        ring slot j % NUM_STAGES once both consumers freed it. A consumer whose rows all lie past Lq gets no tiles (no
        TMA box wholly out of bounds) and does not wait for them: it computes on whatever its tiles hold, into rows
        that the dQ store clips."""
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
        _issue_consumer_tiles(q_desc, do_desc, q_bufs, do_bufs, q_ready, off_b, off_h, off_m, seqlen_q, CONSUMERS)
        for j in range(n_blocks):
            slot = j % NUM_STAGES
            mbarrier.wait(empty.index(slot), ((j // NUM_STAGES) & 1) ^ 1)  # the first lap passes (fresh barriers)
            _issue_pair(k_desc, v_desc, k_bufs, v_bufs, ready, slot, off_b, off_h, j * BLOCK_N)

    @gluon.jit
    def _dq_ws_mma(q_slot, do_slot, k_bufs, v_bufs, q_ready, ready, empty, dq_desc, m_ptr, l_ptr, delta_ptr, bh,
                   off_b, off_h, off_m, n_blocks, seqlen_q, seqlen_k, qk_scale, sm_scale, NUM_STAGES: gl.constexpr,
                   CAUSAL: gl.constexpr, WARPS: gl.constexpr):
        """One consumer warpgroup: its BLOCK_M queries at off_m against every key tile of the ring, as _attn_bwd_dq's
        steps (S, dP by wgmma, dS = P (dP - D) in registers, dQ += dS K^F with dS as wgmma's register operand);
        dQ * sm_scale leaves by TMA through its Q^F tile."""
        BLOCK_M: gl.constexpr = q_slot.shape[2]
        HEAD_DIM: gl.constexpr = q_slot.shape[3]
        BLOCK_N: gl.constexpr = k_bufs.shape[3]
        dtype: gl.constexpr = q_slot.dtype
        s_layout: gl.constexpr = _wgmma_layout(WARPS, BLOCK_N)
        dq_layout: gl.constexpr = _wgmma_layout(WARPS, HEAD_DIM)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

        offs_m = off_m + gl.arange(0, BLOCK_M, row_layout)
        m, inv_l, delta = _row_stats(m_ptr, l_ptr, delta_ptr, bh, offs_m, seqlen_q)
        zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
        dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, dq_layout)
        mbarrier.wait(q_ready, 0, pred=off_m < seqlen_q)  # rows all past Lq: no tiles come (_dq_ws_load)
        q = q_slot.reshape([BLOCK_M, HEAD_DIM])
        do = do_slot.reshape([BLOCK_M, HEAD_DIM])
        for j in range(n_blocks):
            slot = j % NUM_STAGES
            mbarrier.wait(ready.index(slot), (j // NUM_STAGES) & 1)
            k = k_bufs.index(slot).reshape([BLOCK_N, HEAD_DIM])
            v = v_bufs.index(slot).reshape([BLOCK_N, HEAD_DIM])
            dq = _dq_step(q, do, k, v, dq, zero, j, offs_m, m, inv_l, delta, seqlen_k, qk_scale, CAUSAL)
            mbarrier.arrive(empty.index(slot), count=1)

        if off_m < seqlen_q:  # rows all past Lq: nothing to store (and no TMA box wholly out of bounds)
            q.store((dq * sm_scale).to(dtype))  # Q's tile is free: the last wgmma that read it is done
            fence_async_shared()
            _tma_store(dq_desc, [off_b, off_h, off_m, 0], q_slot)
            tma.store_wait(0)

    @gluon.jit
    def _attn_bwd_dq_ws(q_desc, do_desc, k_desc, v_desc, dq_desc, m_ptr, l_ptr, delta_ptr, seqlen_q, seqlen_k,
                        qk_scale, sm_scale, num_heads, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                        num_warps: gl.constexpr):
        """The dQ kernel, warp-specialised: one program per CONSUMERS * BLOCK_M queries (BLOCK_M = 64 per consumer
        warpgroup), stepping over key tiles of BLOCK_N that a load partition streams by TMA. Numerics as
        _attn_bwd_dq's (64-query rows per wgmma either way: the same dQ)."""
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
        HEAD_DIM: gl.constexpr = q_desc.block_type.shape[3]
        BLOCK_N: gl.constexpr = k_desc.block_type.shape[2]
        CONSUMERS: gl.constexpr = 2
        dtype: gl.constexpr = q_desc.dtype
        gl.static_assert(num_warps == 4)  # the default partition is the first consumer warpgroup
        gl.static_assert(BLOCK_M == 16 * num_warps)

        bh = gl.program_id(1)
        off_b = bh // num_heads
        off_h = bh % num_heads
        off_m = gl.program_id(0) * (CONSUMERS * BLOCK_M)
        if CAUSAL:  # top-left aligned: key tiles past the program's last row are skipped (the first consumer's
            # last tile may be masked out whole: both consume every tile of the ring)
            n_blocks = gl.cdiv(gl.minimum(seqlen_k, off_m + CONSUMERS * BLOCK_M), BLOCK_N)
        else:
            n_blocks = gl.cdiv(seqlen_k, BLOCK_N)
        q_bufs = gl.allocate_shared_memory(dtype, [CONSUMERS] + q_desc.block_type.shape, q_desc.layout)
        do_bufs = gl.allocate_shared_memory(dtype, [CONSUMERS] + do_desc.block_type.shape, do_desc.layout)
        k_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES] + v_desc.block_type.shape, v_desc.layout)
        q_ready = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for c in gl.static_range(CONSUMERS):
            mbarrier.init(q_ready.index(c), count=1)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=CONSUMERS)  # a slot is free once every consumer is done with it
        fence_async_shared()

        gl.warp_specialize([
            (_dq_ws_mma, (q_bufs.index(0), do_bufs.index(0), k_bufs, v_bufs, q_ready.index(0), ready, empty, dq_desc,
                          m_ptr, l_ptr, delta_ptr, bh, off_b, off_h, off_m, n_blocks, seqlen_q, seqlen_k, qk_scale,
                          sm_scale, NUM_STAGES, CAUSAL, num_warps)),
            (_dq_ws_mma, (q_bufs.index(1), do_bufs.index(1), k_bufs, v_bufs, q_ready.index(1), ready, empty, dq_desc,
                          m_ptr, l_ptr, delta_ptr, bh, off_b, off_h, off_m + BLOCK_M, n_blocks, seqlen_q, seqlen_k,
                          qk_scale, sm_scale, NUM_STAGES, CAUSAL, num_warps)),
            (_dq_ws_load, (q_desc, do_desc, k_desc, v_desc, q_bufs, do_bufs, k_bufs, v_bufs, q_ready, ready, empty,
                           off_b, off_h, off_m, n_blocks, seqlen_q, CONSUMERS, NUM_STAGES)),
        ], [num_warps, LOADER_WARPS], [WS_CONSUMER_REGS, LOADER_REGS])

def _tile_layout(block: list[int], dtype: torch.dtype):
    """The shared-memory layout of a TMA tile (128-byte swizzle for a 64- or 128-wide bf16/fp16 row)."""
    return gl.NVMMASharedLayout.get_default_for(block, getattr(gl, str(dtype).removeprefix("torch.")))


def _descriptor(t: torch.Tensor, rows: int) -> "TensorDescriptor":
    """A 4-d TMA descriptor over (B, H, L, D) ``t`` that loads or stores one (1, 1, rows, D) tile."""
    return _tile_descriptor(t, [1, 1, rows, t.shape[3]])


def _tile_descriptor(t: torch.Tensor, block: list[int]) -> "TensorDescriptor":
    """A 4-d TMA descriptor over ``t`` (its shape and strides, e.g. a K-major copy's padded row stride) that loads
    or stores one ``block``-shaped tile."""
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, _tile_layout(block, t.dtype))


def _tma_strides_ok(t: torch.Tensor) -> bool:
    """Whether TMA can address ``t``'s layout: 16-byte aligned strides, unit last stride, and no broadcast (stride
    0) dimension, which a TMA descriptor cannot express (autograd hands the backward such a dO, e.g. the gradient
    of a sum). A layout question only: fake tensors (torch.compile) answer it too."""
    size = t.element_size()
    return all(s * size % 16 == 0 and (s > 0 or n == 1) for s, n in zip(t.stride()[:3], t.shape[:3])) \
        and t.stride(3) == 1


def _tma_ok(t: torch.Tensor) -> bool:
    """Whether TMA can read or write ``t``: a 16-byte aligned base and :func:`_tma_strides_ok`."""
    return t.data_ptr() % 16 == 0 and _tma_strides_ok(t)


def _tma_ready(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when TMA can read it, else a contiguous copy in fresh (aligned) storage: ``t.contiguous()`` would
    hand back a contiguous view whose base sits off the 16-byte boundary unchanged."""
    return t if _tma_ok(t) else t.clone(memory_format=torch.contiguous_format)


def _fwd_config(variant: str, head_dim: int, training: bool) -> tuple[int, int, int, int, int, bool]:
    """The forward's launch for ``variant``: (BLOCK_M per consumer, BLOCK_N, NUM_STAGES, num_warps, CONSUMERS,
    PINGPONG)."""
    if variant == "default":
        block_m, block_n, stages, warps = (FWD_TRAIN_CONFIG if training else FWD_CONFIG)[head_dim]
        return block_m, block_n, stages, warps, 1, False
    if variant not in FWD_VARIANTS:
        raise ValueError(f"hopper_gluon: forward variant {variant!r} not in {FWD_VARIANTS}")
    block_m, block_n, stages = (FWD_TRAIN_WS_CONFIG if training else FWD_WS_CONFIG)[head_dim]
    return block_m, block_n, stages, 4, 2, variant == "pingpong"


def _launch(q, k, v, seqlen_k: int, sm_scale: float | None, causal: bool, fp4: bool, out=None,
            aux=None, stats=None, variant: str = "default") -> torch.Tensor:
    """Run the kernel over TMA-ready (B, H, L, D) q, k, v (k, v: at least seqlen_k rows) into ``out`` (default: a
    new contiguous (B, H, Lq, D) tensor in q's dtype), which it returns. ``stats`` = (m, l) ((B, H, Lq) fp32
    contiguous, FP4 only): the kernel writes the row statistics there. ``aux`` (with ``stats``) runs the training
    variant (its own tiles: FWD_TRAIN_CONFIG, FWD_TRAIN_WS_CONFIG), which also writes O' ((B, H, Lq, D) contiguous,
    q's dtype) there."""
    batch, heads, seqlen_q, head_dim = q.shape
    training = aux is not None
    assert stats is not None or not training  # the backward reads m and l
    block_m, block_n, stages, warps, consumers, pingpong = _fwd_config(variant, head_dim, training)
    if out is None:
        out = torch.empty(batch, heads, seqlen_q, head_dim, dtype=q.dtype, device=q.device)
    # Without training the kernel does not touch O', nor without stats m and l (constexpr-dead code): out stands in
    # for them, so an inference call allocates nothing beyond its outputs (compile_forward types them alike)
    o_aux = aux if training else out
    m, l = stats if stats is not None else (out, out)
    grid = (triton.cdiv(seqlen_q, consumers * block_m), batch * heads)
    _attn_fwd[grid](_descriptor(q, block_m), _descriptor(k, block_n), _descriptor(v, block_n),
                    _descriptor(out, block_m), _descriptor(o_aux, block_m), m, l, seqlen_q, seqlen_k,
                    default_scale(head_dim, sm_scale) * LOG2E, heads, HEAD_DIM=head_dim, CAUSAL=bool(causal),
                    NUM_STAGES=stages, FP4=fp4, TRAINING=training, STATS=stats is not None, CONSUMERS=consumers,
                    PINGPONG=pingpong, num_warps=warps)
    return out


def _check(q, k, v, name, sm_scale, causal, variant, inference_only=False):
    """The inputs' one check (ValueError), then whether the kernel can run here (RuntimeError)."""
    check_qkv(q, k, v, name=name, sm_scale=sm_scale, causal=causal, head_dims=HEAD_DIMS)
    if variant not in FWD_VARIANTS:
        raise ValueError(f"{name}: variant {variant!r} not in {FWD_VARIANTS}")
    if inference_only and needs_grad(q, k, v):
        raise ValueError(f"{name} is inference-only (no backward): call it under torch.no_grad()")
    _runnable(name, q.device)


def _runnable(name: str, device: torch.device) -> None:
    """RuntimeError naming why the kernels cannot run on ``device``, if they cannot."""
    ok, why = available(device)
    if not ok:
        raise RuntimeError(f"{name}: {why}")


def hopper_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sm_scale: float | None = None,
                     causal: bool = False, variant: str = "default") -> torch.Tensor:
    """Softmax(Q K^T * sm_scale) V with the Gluon sm_90 forward.

    Arguments:
        q: (batch, heads, seqlen_q, head_dim); k, v: (batch, heads, seqlen_k, head_dim); bf16 or fp16, on an
            sm_90 GPU, head_dim 64 or 128; any strides whose last dim is contiguous.
        sm_scale: softmax scale; default 1/sqrt(head_dim).
        causal: top-left aligned causal mask (SDPA's ``is_causal``).
        variant: the forward's kernel layout, the same numbers either way: ``"default"`` (one consumer partition
            of 8 warps, two warpgroups in lockstep), ``"ws"`` (two independent consumer warpgroups of 64 rows) or
            ``"pingpong"`` (``"ws"`` with the two warpgroups' wgmma rounds alternating, FlashAttention-3's
            schedule).
    Return:
        (batch, heads, seqlen_q, head_dim) in q's dtype, a new tensor.
    """
    _check(q, k, v, "hopper_attention", sm_scale, causal, variant)
    return _launch(_tma_ready(q), _tma_ready(k), _tma_ready(v), k.shape[2], sm_scale, causal, fp4=False,
                   variant=variant)


def hopper_fp4_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sm_scale: float | None = None,
                         causal: bool = False, variant: str = "default", return_stats: bool = False,
                         four_over_six: bool = False):
    """The FP4 inference forward (``nvfp4``, and ``attn_qat`` without grad; SPEC §2) with the Gluon sm_90
    forward: the numerics of attn_qat's Triton forward, on the warp-specialised pipeline.

    Q K^T runs over exactly dequantized NVFP4 operands: the pre-pass (``nvfp4.quantize_heads``) writes
    phi(Q), phi(K), phi(V) along head_dim as q * s in q's dtype, exact in bf16 and fp16 (SPEC §1), so a bf16
    wgmma with fp32 accumulation over them is the block-scaled FP4 product up to summation order. K and V are
    written in tile order (``key_tile``), which puts every 16-key block of P in one thread; P is then quantized
    in registers (integer running max, P~ = 2688 2^(S - m), phi along keys) before the P V wgmma.

    Arguments as :func:`hopper_attention`. Inference only: inputs that require grad are refused.
    ``return_stats``: also return each row's integer running max m (log2 units) and the row sum l of the
    unquantized P~ = 2688 2^(S - m), as attn_qat's Triton forward returns them (ring attention's log-sum-exp).
    ``four_over_six``: the pre-pass picks each Q, K, V block's scale as Four Over Six does (the FP4 modes' option,
    docs/kernels.md); the kernel is the same.
    Return:
        o, (batch, heads, seqlen_q, head_dim) in q's dtype and stride order (contiguous where TMA cannot write that
        layout), a new tensor, as attn_qat's Triton forward returns it; with ``return_stats``, (o, m, l), m and l
        (batch, heads, seqlen_q) fp32.
    """
    _check(q, k, v, "hopper_fp4_attention", sm_scale, causal, variant, inference_only=True)
    block_n = _fwd_config(variant, q.shape[3], training=False)[1]
    qf = quantize_heads(q, q.dtype, four_over_six=four_over_six)
    kf, vf = (quantize_heads(t, q.dtype, key_tile=block_n, four_over_six=four_over_six) for t in (k, v))
    stats = _row_stats_like(q) if return_stats else None
    o = _launch(qf, kf, vf, k.shape[2], sm_scale, causal, fp4=True, out=_output_like(q), stats=stats,
                variant=variant)
    return (o, *stats) if return_stats else o


def _row_stats_like(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty m and l for q's rows: (B, H, Lq) fp32 contiguous, what the kernel writes (the fakes call this too)."""
    return tuple(q.new_empty(q.shape[:3], dtype=torch.float32) for _ in range(2))


def _output_like(q: torch.Tensor) -> torch.Tensor:
    """The FP4 forwards' O (inference and training): in q's stride order as the Triton forward's, contiguous where
    TMA cannot write that layout (the custom ops' fakes call this too, so their strides are the real ones)."""
    o = torch.empty_like(q)
    return o if _tma_strides_ok(o) else q.new_empty(q.shape)


def hopper_attn_qat_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, sm_scale: float | None = None,
                            causal: bool = False, variant: str = "default", four_over_six: bool = False):
    """The Attn-QAT training forward (SPEC §2 with the auxiliary output O') with the Gluon sm_90 forward: what
    ``attn_qat.attn_qat_forward(training=True)`` computes and saves for its backward, in the same layouts, so that
    ``attn_qat.attn_qat_backward`` takes its results unchanged.

    The FP4 variant's pipeline (:func:`hopper_fp4_attention`) with a third wgmma per key tile, O' += P~_j V^F_j
    (P~ = 2688 2^(S - m) unquantized, in the dot's dtype, as the Triton forward), issued after P_j V^F_j and
    overlapped alike, on 64-key tiles (FWD_TRAIN_CONFIG: O' holds 64 more fp32 registers per thread at
    head_dim 128). The pre-pass writes phi(K), phi(V) in two orders from one read each (``quantize_heads``'s
    ``both_orders``): in key order for the backward, in tile order for the kernel.

    Arguments as :func:`hopper_attention` (inputs may require grad: this is a launcher, autograd is the caller's;
    the variants' training tiles: FWD_TRAIN_CONFIG, FWD_TRAIN_WS_CONFIG); ``four_over_six`` as
    :func:`hopper_fp4_attention`'s (the backward takes the forward's qf, kf, vf, so it follows).
    Return:
        (o, o_aux, m, l, (qf, kf, vf)): o (B, H, Lq, D) in q's dtype and stride order, the FP4 output;
        o_aux (B, H, Lq, D) contiguous in q's dtype, O'; m, l (B, H, Lq) fp32, the integer running max (log2
        units) and the row sum of the unquantized P~; qf, kf, vf contiguous phi(q), phi(k), phi(v) in q's dtype,
        keys in order. All new tensors.
    """
    _check(q, k, v, "hopper_attn_qat_forward", sm_scale, causal, variant)
    batch, heads, seqlen_q, head_dim = q.shape
    block_n = _fwd_config(variant, head_dim, training=True)[1]
    qf = quantize_heads(q, q.dtype, four_over_six=four_over_six)
    (kf, k_tiles), (vf, v_tiles) = (quantize_heads(t, q.dtype, key_tile=block_n, both_orders=True,
                                                   four_over_six=four_over_six) for t in (k, v))
    o = _output_like(q)
    o_aux = torch.empty(batch, heads, seqlen_q, head_dim, dtype=q.dtype, device=q.device)
    m, l = _row_stats_like(q)
    _launch(qf, k_tiles, v_tiles, k.shape[2], sm_scale, causal, fp4=True, out=o, aux=o_aux, stats=(m, l),
            variant=variant)
    return o, o_aux, m, l, (qf, kf, vf)


def _check_saved(do, q, k, saved: dict) -> None:
    """The backward's one check of what the forward saved (ValueError naming the tensor): shapes, dtypes, and the
    contiguity the kernels index by (the forwards return them so)."""
    batch, heads, seqlen_q, _ = q.shape
    if tuple(do.shape) != tuple(q.shape) or do.dtype != q.dtype:
        raise ValueError(f"hopper_attn_qat_backward: do must be {tuple(q.shape)} {q.dtype}, got {tuple(do.shape)} "
                         f"{do.dtype}")
    stats = ((batch, heads, seqlen_q), torch.float32)
    want = {"qf": (q.shape, q.dtype), "kf": (k.shape, q.dtype), "vf": (k.shape, q.dtype), "o_aux": (q.shape, q.dtype),
            "m": stats, "l": stats}
    for name, t in saved.items():
        shape, dtype = want[name]
        if tuple(t.shape) != tuple(shape) or t.dtype != dtype or not t.is_contiguous():
            raise ValueError(f"hopper_attn_qat_backward: {name} must be contiguous {tuple(shape)} {dtype} (as the "
                             f"training forward returns it), got {tuple(t.shape)} {t.dtype} strides {t.stride()}")


def _bwd_kernels(variant: str, head_dim: int):
    """The backward's two kernels for ``variant`` at ``head_dim``, each as (kernel, BLOCK_M, BLOCK_N, num_warps,
    constexprs beyond CAUSAL, num_warps and dK/dV's BLOCK_N, rows per program along its grid axis: keys for dK/dV,
    queries for dQ). The warp-specialised kernels launch with their first consumer warpgroup's 4 warps (the workers
    come on top), and a program owns two consumers' tiles."""
    if variant == "ws":
        block_m, block_n, stages = BWD_WS_CONFIG[head_dim]
        dkdv = (_attn_bwd_dkdv_ws, block_m, block_n, 4, {"NUM_STAGES": stages}, 2 * block_n)
        block_m, block_n, stages = BWD_DQ_WS_CONFIG[head_dim]
        return dkdv, (_attn_bwd_dq_ws, block_m, block_n, 4, {"NUM_STAGES": stages}, 2 * block_m)
    block_m, block_n, warps = BWD_DKDV_CONFIG[head_dim]
    dkdv = (_attn_bwd_dkdv, block_m, block_n, warps, {}, block_n)
    block_m, block_n, warps = BWD_DQ_CONFIG[head_dim]
    return dkdv, (_attn_bwd_dq, block_m, block_n, warps, {}, block_m)


def hopper_attn_qat_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, qf: torch.Tensor, kf: torch.Tensor,
                             vf: torch.Tensor, o_aux: torch.Tensor, m: torch.Tensor, l: torch.Tensor, *,
                             sm_scale: float | None = None, causal: bool = False, variant: str = "default"):
    """The Attn-QAT backward (SPEC §2) with the Gluon sm_90 kernels: what ``attn_qat.attn_qat_backward`` computes,
    from the same inputs into the same outputs, on wgmma and TMA. With :func:`hopper_attn_qat_forward` it replaces
    the Triton pair.

    Three launches: D = rowsum(dO O') (attn_qat's Triton pre-pass, unchanged); the dK/dV kernel, one program per
    BLOCK_N keys stepping over query blocks: S = Q^F K^F^T and dP = dO V^F^T by wgmma, P = P~ / l and
    P^F = phi(P~) / l in registers (P~ = 2688 2^(S - m) with the saved integer max; K^F, V^F rows loaded in tile
    order, so each 16-key block of P lies in one thread), then dV += P^F^T dO and dK += dS^T Q^F by wgmma reading
    P^F and dS = P (dP - D) from shared memory; the dQ kernel, one program per query block stepping over key tiles:
    dQ += dS K^F, dS from registers. Tiles: BWD_DKDV_CONFIG, BWD_DQ_CONFIG.

    Arguments:
        do: (batch, heads, seqlen_q, head_dim), the output's gradient in q's dtype; any strides with a contiguous
            last dim.
        q, k: the forward's inputs: their layouts set dq's and dk's, dv's (values are not read).
        qf, kf, vf, o_aux, m, l: what :func:`hopper_attn_qat_forward` (or ``attn_qat_forward(training=True)``)
            returns: phi(q), phi(k), phi(v) contiguous in q's dtype with keys in order; O' (batch, heads, seqlen_q,
            head_dim) contiguous; m, l (batch, heads, seqlen_q) fp32 contiguous.
        sm_scale: the forward's softmax scale; default 1/sqrt(head_dim).
        causal: the forward's top-left aligned causal mask.
        variant: the kernels: ``"default"`` (_attn_bwd_dkdv and _attn_bwd_dq, 8 warps sharing each step, no warp
            specialisation; the one that has run on a GPU) or ``"ws"`` (_attn_bwd_dkdv_ws and _attn_bwd_dq_ws,
            warp-specialised as FlashAttention-3's backward: a load warp streaming 64-row tiles through an mbarrier
            ring and two consumer warpgroups that share nothing else, so one's softmax/phi arithmetic overlaps the
            other's wgmmas; BWD_WS_CONFIG, BWD_DQ_WS_CONFIG; opt-in until a GPU run proves it). The same numbers:
            P, P^F and dS element for element, and every wgmma chain sums the same 16-row chunks in the same order
            (64-query steps only split dK's and dV's), so bit-identical results are expected.
    Return:
        (dq, dk, dv): dq in q's dtype and stride order; dk, dv in k's dtype and stride order; new tensors.
    """
    check_qkv(q, k, k, name="hopper_attn_qat_backward", sm_scale=sm_scale, causal=causal, head_dims=HEAD_DIMS)
    _check_saved(do, q, k, {"qf": qf, "kf": kf, "vf": vf, "o_aux": o_aux, "m": m, "l": l})
    if variant not in BWD_VARIANTS:
        raise ValueError(f"hopper_attn_qat_backward: variant {variant!r} not in {BWD_VARIANTS}")
    _runnable("hopper_attn_qat_backward", q.device)
    batch, heads, seqlen_q, head_dim = q.shape
    seqlen_k = k.shape[2]
    scale = default_scale(head_dim, sm_scale)
    do = _tma_ready(do)
    delta = torch.empty_like(m)
    _attn_bwd_preprocess[(triton.cdiv(seqlen_q, 64), batch * heads)](o_aux, do, delta, *do.stride()[:3], heads,
                                                                      seqlen_q, HEAD_DIM=head_dim, BLOCK_M=64)
    dk = torch.empty_like(k)  # k's stride order, as the Triton backward's
    dv = torch.empty_like(dk)
    (dkdv_kernel, block_m, block_n, warps, extra, keys), (dq_kernel, *dq_tiles) = _bwd_kernels(variant, head_dim)
    dkdv_kernel[(triton.cdiv(seqlen_k, keys), batch * heads)](
        _descriptor(qf, block_m), _descriptor(do, block_m), kf, vf, m, l, delta, dk, dv, *dk.stride()[:3], seqlen_q,
        seqlen_k, scale * LOG2E, scale, heads, BLOCK_N=block_n, CAUSAL=causal, num_warps=warps, **extra)
    dq = torch.empty_like(q)
    if not _tma_ok(dq):
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    block_m, block_n, warps, extra, queries = dq_tiles
    dq_kernel[(triton.cdiv(seqlen_q, queries), batch * heads)](
        _descriptor(qf, block_m), _descriptor(do, block_m), _descriptor(kf, block_n), _descriptor(vf, block_n),
        _descriptor(dq, block_m), m, l, delta, seqlen_q, seqlen_k, scale * LOG2E, scale, heads, CAUSAL=causal,
        num_warps=warps, **extra)
    return dq, dk, dv


def _desc_type(rows: int, head_dim: int, dtype: torch.dtype) -> str:
    """Triton's signature type of a :func:`_descriptor` over (B, H, L, head_dim) ``dtype`` with ``rows``-row tiles."""
    return _tile_desc_type([1, 1, rows, head_dim], dtype)


def _tile_desc_type(block: list[int], dtype: torch.dtype) -> str:
    """Triton's signature type of a :func:`_tile_descriptor` of ``dtype`` with ``block``-shaped tiles."""
    return f"tensordesc<{_SHORT[dtype]}[{', '.join(map(str, block))}],{_tile_layout(block, dtype)!r}>"


_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.int8: "i8"}  # Triton's names in signatures


def compile_forward(head_dim: int, causal: bool, dtype: torch.dtype = torch.bfloat16, fp4: bool = False,
                    training: bool = False, variant: str = "default", stats: bool = False):
    """Compile the forward (``fp4``: the FP4 inference variant, ``stats`` with its row statistics; ``training``:
    the Attn-QAT training variant, FP4 with O' and the row statistics) for sm_90a without a GPU (what a launch at
    ``head_dim`` would build); returns Triton's compiled kernel (``.asm["ptx"]``, ``.asm["cubin"]``,
    ``.metadata.shared``, ...)."""
    if _MISSING:
        raise RuntimeError(f"hopper_gluon: {_MISSING}")
    block_m, block_n, stages, warps, consumers, pingpong = _fwd_config(variant, head_dim, training)
    rows_m, rows_n = (_desc_type(rows, head_dim, dtype) for rows in (block_m, block_n))
    stats = stats or training
    stat_type = "*fp32" if stats else f"*{_SHORT[dtype]}"  # _launch passes the output for untouched statistics
    types = {"q_desc": rows_m, "k_desc": rows_n, "v_desc": rows_n, "o_desc": rows_m, "aux_desc": rows_m,
             "m_ptr": stat_type, "l_ptr": stat_type, "qk_scale": "fp32"}
    return compile_for(_attn_fwd, 90, types=types, aligned=("m_ptr", "l_ptr"), num_warps=warps, num_stages=stages,
                       constexprs={"HEAD_DIM": head_dim, "CAUSAL": bool(causal), "NUM_STAGES": stages,
                                   "FP4": bool(fp4 or stats), "TRAINING": bool(training), "STATS": bool(stats),
                                   "CONSUMERS": consumers, "PINGPONG": pingpong, "num_warps": warps})


def compile_backward(head_dim: int, causal: bool, dtype: torch.dtype = torch.bfloat16,
                     variant: str = "default") -> dict:
    """Compile the backward's two kernels for sm_90a without a GPU (what :func:`hopper_attn_qat_backward` at
    ``head_dim`` with ``variant`` would build); returns {"dkdv": ..., "dq": ...}, Triton's compiled kernels."""
    if _MISSING:
        raise RuntimeError(f"hopper_gluon: {_MISSING}")
    stats = dict.fromkeys(("m_ptr", "l_ptr", "delta_ptr"), "*fp32")
    scalars = {"qk_scale": "fp32", "sm_scale": "fp32"}
    tiles = dict.fromkeys(("kf_ptr", "vf_ptr", "dk_ptr", "dv_ptr"), f"*{_SHORT[dtype]}")
    # dK's strides are multiples of 16 at every head_dim here (a launch specialises on that: 16-byte stores)
    strides = ("stride_kb", "stride_kh", "stride_kl")
    (kernel, block_m, block_n, warps, extra, _), (dq_kernel, *dq_tiles) = _bwd_kernels(variant, head_dim)
    rows_m = _desc_type(block_m, head_dim, dtype)
    dkdv = compile_for(kernel, 90, types={"q_desc": rows_m, "do_desc": rows_m, **tiles, **stats, **scalars},
                       aligned=(*tiles, *stats, *strides), num_warps=warps, num_stages=1,
                       constexprs={"BLOCK_N": block_n, "CAUSAL": bool(causal), "num_warps": warps, **extra})
    block_m, block_n, warps, extra, _ = dq_tiles
    rows_m, rows_n = (_desc_type(rows, head_dim, dtype) for rows in (block_m, block_n))
    dq = compile_for(dq_kernel, 90, types={"q_desc": rows_m, "do_desc": rows_m, "k_desc": rows_n, "v_desc": rows_n,
                                           "dq_desc": rows_m, **stats, **scalars},
                     aligned=tuple(stats), num_warps=warps, num_stages=1,
                     constexprs={"CAUSAL": bool(causal), "num_warps": warps, **extra})
    return {"dkdv": dkdv, "dq": dq}


# ---------------------------------------------------------------------------------------------------
# attn_qat's training step on sm_90: this module's training forward and its warp-specialised backward, the
# same numbers as the Triton path. Measured at Wan 14B's shape on an H100 (docs/benchmarks.md): forward +
# backward 217.9 ms against the Triton forward + this backward's 229.8 and the all-Triton 250.5 (cuDNN 159.2).
# kernels.api decides when (gluon_sm90), through this autograd Function and its two custom ops, and the FP4 inference
# forward's custom op.
# ---------------------------------------------------------------------------------------------------

GLUON_ENV = "ATTNQAT_GLUON"  # "0": the FP4 modes run the Triton kernels on sm_90 too (A/B runs, debugging)
# The kernel layouts each job runs (H100, (1, 40, 32760, 128), experiments/gluon_fwd_variants.py; docs/benchmarks.md;
# cuDNN's forward 37.3 ms in the same runs):
TRAINING_FWD_VARIANT = "ws"  # 59.3 ms against "default" 71.7 and "pingpong" 60.3 (its pre-pass included)
TRAINING_BWD_VARIANT = "ws"  # the backward kernels training runs: 0.87x the "default" variant's time
# The FP4 inference forward: 42.6-43.3 ms against "ws" 42.7-44.1 and "default" 56.7 (two runs; before the mask split
# pingpong led ws by 4.3 ms, 47.3 against 51.6)
INFERENCE_FWD_VARIANT = "pingpong"
# The head dims whose FP4 inference forward runs here; at 64 attn_qat's Triton forward is as fast or faster (H100,
# nvfp4 through attention(): (1, 12, 32760, 64) 10.03 ms both; causal (1, 24, 16384, 64) 2.87-2.89 against 2.80,
# (2, 24, 4096, 64) 0.50-0.53 against 0.46), at 128 slower ((1, 40, 32760, 128) 1.12x against 1.41x cuDNN's forward;
# causal (1, 40, 8192, 128) 1.70 against 2.01 ms).
INFERENCE_HEAD_DIMS = (128,)
# The head dims whose attn_qat training (forward + backward) runs here. At 64 the Triton pair is faster since its
# head_dim-64 tiles were timed (attn_qat.BWD_CONFIG_GPU; H200, fwd+bwd through attention(), 2026-11-28, Gluon against
# Triton: (32, 4, 2304, 64) 2.66 / 2.33 ms, (32, 4, 576, 64) 1.85 / 1.65, (1, 12, 32760, 64) 40.6 / 39.3, causal
# (2, 24, 4096, 64) 1.88 / 1.71; with the former transposed Triton tiles the Gluon pair led, 40.3-41.0 against
# 57.9-58.4 ms at (1, 12, 32760, 64)). At 128 the Gluon pair leads (1.24-1.36x cuDNN against 1.65x).
TRAINING_HEAD_DIMS = (128,)


def gluon_sm90(device: torch.device) -> tuple[bool, str]:
    """Whether the FP4 modes' kernels on ``device`` (attn_qat's training step, forward and backward, and the FP4
    inference forward of nvfp4, attn_qat and attn_qat_dropin) are the Gluon sm_90 ones, and the reason
    (backend_info's line): not with ATTNQAT_GLUON=0, nor with a launch config of the Triton kernels pinned.
    Where the GPU is an sm_90 one and Gluon cannot run (Triton older than 3.6), one warning says so: those modes
    fall back to the Triton kernels, slower by about 1.1-1.2x."""
    if os.environ.get(GLUON_ENV, "1") == "0":
        return False, f"{GLUON_ENV}=0"
    pinned = [name for name in (FWD_CONFIG_ENV, BWD_CONFIG_ENV, DQ_CONFIG_ENV) if os.environ.get(name)]
    if pinned:  # a launch config pinned for the Triton kernels asks for those kernels
        return False, f"{' and '.join(pinned)} pin the Triton kernels' launch config"
    return available_or_warn(device, "the FP4 modes")


def available_or_warn(device: torch.device, who: str) -> tuple[bool, str]:
    """:func:`available`, and where the GPU is an sm_90 one and Gluon cannot run (Triton older than 3.6), one warning
    that ``who`` falls back to its Triton kernels."""
    ok, why = available(device)
    if not ok and device.type == "cuda" and torch.cuda.is_available() \
            and torch.cuda.get_device_capability(device) == (9, 0):
        warnings.warn(f"attnqat: the Gluon sm_90 kernels are unavailable ({why}); {who} use the Triton kernels",
                      stacklevel=3)
    return ok, why


@torch.library.custom_op("attnqat::fp4_fwd_sm90", mutates_args=(), device_types=("cuda",))
def fp4_fwd_sm90(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, causal: bool,
                 four_over_six: bool = False) -> torch.Tensor:
    """The FP4 inference forward on sm_90 (:func:`hopper_fp4_attention`, INFERENCE_FWD_VARIANT)."""
    return hopper_fp4_attention(q, k, v, sm_scale=sm_scale, causal=causal, variant=INFERENCE_FWD_VARIANT,
                                four_over_six=four_over_six)


@fp4_fwd_sm90.register_fake
def _(q, k, v, sm_scale, causal, four_over_six=False):
    return _output_like(q)


@torch.library.custom_op("attnqat::fp4_fwd_stats_sm90", mutates_args=(), device_types=("cuda",))
def fp4_fwd_stats_sm90(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float,
                       causal: bool, four_over_six: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The FP4 inference forward on sm_90 with its row statistics (o, m, l): ring attention's forward."""
    return hopper_fp4_attention(q, k, v, sm_scale=sm_scale, causal=causal, variant=INFERENCE_FWD_VARIANT,
                                return_stats=True, four_over_six=four_over_six)


@fp4_fwd_stats_sm90.register_fake
def _(q, k, v, sm_scale, causal, four_over_six=False):
    return (_output_like(q), *_row_stats_like(q))


@torch.library.custom_op("attnqat::attn_qat_fwd_sm90", mutates_args=(), device_types=("cuda",))
def attn_qat_fwd_sm90(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, causal: bool,
                      four_over_six: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                            torch.Tensor, torch.Tensor, torch.Tensor]:
    o, o_aux, m, l, (qf, kf, vf) = hopper_attn_qat_forward(q, k, v, sm_scale=sm_scale, causal=causal,
                                                           variant=TRAINING_FWD_VARIANT, four_over_six=four_over_six)
    return o, o_aux, m, l, qf, kf, vf


@attn_qat_fwd_sm90.register_fake
def _(q, k, v, sm_scale, causal, four_over_six=False):
    return (_output_like(q), q.new_empty(q.shape), *_row_stats_like(q), q.new_empty(q.shape),
            k.new_empty(k.shape, dtype=q.dtype),
            v.new_empty(v.shape, dtype=q.dtype))


@torch.library.custom_op("attnqat::attn_qat_bwd_sm90", mutates_args=(), device_types=("cuda",))
def attn_qat_bwd_sm90(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, qf: torch.Tensor, kf: torch.Tensor,
                      vf: torch.Tensor, o_aux: torch.Tensor, m: torch.Tensor, l: torch.Tensor, sm_scale: float,
                      causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return hopper_attn_qat_backward(do, q, k, qf, kf, vf, o_aux, m, l, sm_scale=sm_scale, causal=causal,
                                    variant=TRAINING_BWD_VARIANT)


@attn_qat_bwd_sm90.register_fake
def _(do, q, k, qf, kf, vf, o_aux, m, l, sm_scale, causal):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(k)


class HopperAttnQATFunction(torch.autograd.Function):
    """attn_qat's AttnQATFunction on sm_90: the Gluon training forward and backward (the same numbers, the same
    saved tensors)."""

    @staticmethod
    def forward(ctx, q, k, v, sm_scale, causal, four_over_six=False):
        if recomputed_later():  # checkpointing's first pass: the output alone (_common.saved_tensors_recomputed)
            ctx.save_for_backward(q, k, *training_placeholders(q, k, v))
            ctx.sm_scale, ctx.causal = sm_scale, causal
            return fp4_fwd_sm90(q, k, v, sm_scale, causal, four_over_six)
        o, o_aux, m, l, qf, kf, vf = attn_qat_fwd_sm90(q, k, v, sm_scale, causal, four_over_six)
        ctx.save_for_backward(q, k, qf, kf, vf, o_aux, m, l)
        ctx.sm_scale, ctx.causal = sm_scale, causal
        return o

    @staticmethod
    def backward(ctx, do):
        refuse_double_backward("attn_qat")
        q, k, qf, kf, vf, o_aux, m, l = ctx.saved_tensors
        dq, dk, dv = attn_qat_bwd_sm90(do, q, k, qf, kf, vf, o_aux, m, l, ctx.sm_scale, ctx.causal)
        return dq, dk, dv, None, None, None
