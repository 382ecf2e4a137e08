"""The FP4 modes' q_smoothing option (docs/kernels.md, "Q smoothing"): per 128-row query block, Q minus its mean
q̄ is quantized and the mean's logits ΔS = q̄ K^T are added back unquantized; the backward recomputes S with ΔS,
takes dQ straight through Q - q̄ and adds (dS^T 1) q̄^T to dK. References, kernels (Triton's interpreter), the API."""
import math
import types
from pathlib import Path

import pytest
import torch

from attnqat.kernels import api, attention, describe_qk_options
from attnqat.kernels import reference as R
from attnqat.kernels.api import attention_with_lse
from attnqat.kernels.attn_qat import attn_qat_attention, attn_qat_forward, nvfp4_attention
from attnqat.kernels.formats import LOG2E
from attnqat.kernels.rotation import hadamard_matrix
from attnqat.train import load_config, validate
from conftest import check_dropin_against_reference, fp4_rounding_ties, rel_err


def shared_offset_qkv(b, h, lq, lk, d, *, offset=3.0, dtype=torch.bfloat16, seed=None, causal=False,
                      away_from_ties=True):
    """Q = randn + offset * (one random row vector shared by every query of a head): the case Q smoothing is for.
    Drawn again while FP4 rounding would meet a tie (conftest.fp4_rounding_ties, on the smoothed logits): there the
    kernel and the reference may round to neighbouring values (SPEC §1), beyond the bf16 bound of the tests.
    ``away_from_ties=False`` for the GPU's sizes: among millions of logits some tie is all but certain, so the
    redraw would never end (it hung the GPU test), and a few neighbouring roundings sit well inside its bounds."""
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    while True:
        q = torch.randn(b, h, lq, d, generator=g) + offset * torch.randn(b, h, 1, d, generator=g)
        k, v = (torch.randn(b, h, lk, d, generator=g) for _ in range(2))
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        if not away_from_ties or not fp4_rounding_ties(q, k, causal=causal, q_smoothing=True):
            return q, k, v


def bound(ref):
    """As tests/test_attn_qat.py: at most twice what rounding the exact result to bf16 costs."""
    return 2 * rel_err(ref.to(torch.bfloat16), ref) + 1e-6


# --- The reference: the ΔS algebra ---------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_reference_without_phi_is_exact_attention(causal):
    """Without phi the smoothed logits phi(Q_s) K^T + ΔS are Q K^T again (float32 rounding), so the attention is
    exact attention; without ΔS (a control) they are not. The means are per block of 128 rows, the last partial."""
    q, k, v = shared_offset_qkv(1, 2, 200, 150, 64, dtype=torch.float32, seed=0)
    scale = 64 ** -0.5
    s, qs, _, q_rows = R.fp4_logits_ref(q, k, sm_scale=scale, causal=causal, q_smoothing=True, quantize=False)
    for rows in (slice(0, 128), slice(128, 200)):  # the blocks' means, written out: 128 rows, then 72
        assert torch.allclose(q_rows[:, :, rows], q[:, :, rows].double().mean(2, keepdim=True).float(), atol=1e-6)
    exact_s = R._logits_log2(q, k, scale, causal)
    assert rel_err(torch.nan_to_num(s, neginf=0.0), torch.nan_to_num(exact_s, neginf=0.0)) < 1e-6
    out = torch.softmax(s / LOG2E, dim=-1) @ v
    assert rel_err(out, R.attention_fp32(q.double(), k.double(), v.double(), sm_scale=scale, causal=causal)) < 1e-6
    without = R._logits_log2(qs, k, scale, causal)  # phi(Q_s) K^T alone (phi off): the control
    assert rel_err(torch.softmax(without / LOG2E, dim=-1) @ v, out) > 0.1


def test_reference_dk_term_is_the_block_means_share():
    """The backward's dK algebra: dS^T Q_s + (dS^T 1) q̄^T = dS^T Q, per block. Checked on the reference's own
    pieces: dK with the term against dS^T (Q_s + q̄) computed here, dK without it differs."""
    q, k, v = shared_offset_qkv(1, 1, 200, 96, 64, dtype=torch.float32, seed=1)
    do = torch.randn(1, 1, 200, 64)
    o, o_aux, m, l = R.attn_qat_forward_ref(q, k, v, q_smoothing=True)
    dq, dk, dv = R.attn_qat_backward_ref(q, k, v, o_aux, do, m, l, q_smoothing=True)
    _, dk_without, _ = R.attn_qat_backward_ref(q, k, v, o_aux, do, m, l, q_smoothing=True, dk_mean_term=False)
    # the term, from the pieces: (dK - dK_without) / scale = sum over each block's rows of dS_ij q̄_i
    q_s, q_bar, _ = R.q_block_means_ref(q)
    s, qf, kf, q_rows = R.fp4_logits_ref(q, k, q_smoothing=True)
    p = 2688.0 * torch.exp2(s - m[..., None]) / l[..., None]
    ds = p * (do @ R.fake_quant_nvfp4_ref(v).transpose(-1, -2) - (do * o_aux).sum(-1, keepdim=True))
    term = sum(ds[:, :, b0:b0 + 128].sum(2)[..., None] * q_bar[:, :, i, None, :]
               for i, b0 in enumerate(range(0, 200, 128)))
    assert rel_err((dk - dk_without) * math.sqrt(64), term) < 1e-5
    assert rel_err(dk_without, dk) > 0.1


# --- The kernels against the reference (interpreter) ----------------------------------------------------------

# (B, H, Lq, Lk, D, causal): a partial last query block (200 = 128 + 72, 160 = 128 + 32), Lq != Lk, both head dims
SHAPES = [(1, 2, 200, 200, 64, False), (1, 1, 160, 96, 64, True)]


@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_forward_and_backward_match_reference(shape, poison):
    """attn_qat with q_smoothing (training forward, then the backward) against the reference, outputs poisoned
    (conftest.poison: every torch.empty is NaN); and a control: the reference's dK without the rank-1 term
    (dS^T 1) q̄^T is far from the kernel's."""
    b, h, lq, lk, d, causal = shape
    q, k, v = (t.requires_grad_() for t in shared_offset_qkv(b, h, lq, lk, d, causal=causal))
    o = attention(q, k, v, "attn_qat", causal=causal, q_smoothing=True)  # the registry's path: Triton's kernels
    do = torch.randn_like(o)
    o.backward(do)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    ro, ro_aux, rm, rl = R.attn_qat_forward_ref(qd, kd, vd, causal=causal, q_smoothing=True)
    want = R.attn_qat_backward_ref(qd, kd, vd, ro_aux, do, rm, rl, causal=causal, q_smoothing=True)
    assert o.dtype == torch.bfloat16 and rel_err(o, ro) <= bound(ro)
    for got, w in zip((q.grad, k.grad, v.grad), want):
        assert got.dtype == torch.bfloat16 and rel_err(got, w) <= bound(w)
    _, dk_without, _ = R.attn_qat_backward_ref(qd, kd, vd, ro_aux, do, rm, rl, causal=causal, q_smoothing=True,
                                               dk_mean_term=False)
    assert rel_err(k.grad, dk_without) > 0.1  # the rank-1 term matters, and the kernel has it
    plain = R.attn_qat_forward_ref(qd, kd, vd, causal=causal)[0]
    assert rel_err(o, plain) > 10 * bound(ro)  # the option did something


@pytest.mark.parametrize("training", [True, False])
def test_heads_in_groups_when_delta_s_is_large(training, monkeypatch, poison):
    """A ΔS budget smaller than one head's (attn_qat.DELTA_S_BYTES) makes the forward and the backward run the heads
    one by one (batch 2, so each head's slice of the saved tensors is strided): the same outputs, saved tensors and
    gradients, bit for bit; and the split does happen (a spy counts the ΔS made)."""
    from attnqat.kernels import attn_qat as A

    q, k, v = shared_offset_qkv(2, 3, 200, 90, 64, seed=7)
    do = torch.randn_like(q)
    scale = 64 ** -0.5

    def run():
        fwd = A.attn_qat_forward(q, k, v, sm_scale=scale, causal=False, training=training, q_smoothing=True)
        if not training:
            return fwd, ()
        o, o_aux, m, l, (qf, kf, vf, q_mean) = fwd
        return fwd, A.attn_qat_backward(do, q, k, qf, kf, vf, o_aux, m, l, sm_scale=scale, causal=False,
                                        q_mean=q_mean)

    whole, whole_grads = run()
    made = []
    parts = A.delta_s_parts
    monkeypatch.setattr(A, "delta_s_parts", lambda k, *a, **kw: made.append(k.shape[1]) or parts(k, *a, **kw))
    monkeypatch.setattr(A, "DELTA_S_BYTES", 1)
    split, split_grads = run()
    assert made == [1] * (6 if training else 3)  # one head at a time, in the forward and in the backward
    flat = lambda x: [t for y in x for t in (flat(y) if isinstance(y, tuple) else [y])]  # noqa: E731
    for a, b in zip(flat(whole) + list(whole_grads), flat(split) + list(split_grads)):
        assert (a is None and b is None) or (a.shape == b.shape and torch.equal(a, b))
    assert split[0].stride() == whole[0].stride()  # O in q's layout either way


def test_kernel_inference_forward_matches_reference_at_head_dim_128(poison):
    """The inference forward (nvfp4, no O') at head_dim 128, Lq != Lk, and its internals in the interpreter's fp32
    buffers: the integer max exactly, O and l to fp32 rounding; q̄ is the 128-row block means."""
    q, k, v = shared_offset_qkv(1, 1, 200, 144, 128)
    with torch.no_grad():
        out = nvfp4_attention(q, k, v, q_smoothing=True)
    ro, _, rm, rl = R.attn_qat_forward_ref(q, k, v, training=False, q_smoothing=True)
    assert out.dtype == torch.bfloat16 and rel_err(out, ro) <= bound(ro)
    o, o_aux, m, l, (qf, kf, vf, q_mean) = attn_qat_forward(q, k, v, sm_scale=128 ** -0.5, causal=False,
                                                            training=False, q_smoothing=True)
    assert o_aux is None and torch.equal(m, rm) and rel_err(o, ro) < 1e-5 and rel_err(l, rl) < 1e-5
    assert q_mean.shape == (1, 1, 2, 128) and rel_err(q_mean, R.q_block_means_ref(q)[1]) < 1e-6


def test_dropin_kernel_smooths_its_forward_only(poison):
    """attn_qat_dropin with q_smoothing under grad (interpreter): the smoothed FP4 forward, the high-precision
    backward of the reference (which q_smoothing does not change: exact logits are Q K^T either way)."""
    check_dropin_against_reference(*(t.requires_grad_() for t in shared_offset_qkv(1, 1, 130, 64, 64)),
                                   q_smoothing=True)


def test_q_smoothing_lowers_fp4_error_when_queries_share_an_offset():
    """On Q with a large offset every query shares, Q smoothing brings the FP4 forward closer to exact attention
    (reference path, float32 CPU tensors), and the kernel's output (interpreter, bf16) as well."""
    q, k, v = shared_offset_qkv(1, 2, 200, 200, 64, dtype=torch.float32, seed=2)
    exact = R.attention_fp32(q.double(), k.double(), v.double())
    with torch.no_grad():
        plain = rel_err(attention(q, k, v, "nvfp4"), exact)
        smooth = rel_err(attention(q, k, v, "nvfp4", q_smoothing=True), exact)
        qb, kb, vb = (t.to(torch.bfloat16) for t in (q, k, v))
        kernel = rel_err(nvfp4_attention(qb, kb, vb, q_smoothing=True), exact)
    print(f"FP4 error vs exact: plain {plain:.4f}, q_smoothing {smooth:.4f} (kernel {kernel:.4f})")
    assert smooth < 0.7 * plain and kernel < 0.7 * plain


# --- The API: composition, refusals, routing ------------------------------------------------------------------


def test_composes_with_rotation_and_k_smoothing():
    """q_smoothing runs on the Q, K the kernel receives: after the Hadamard rotation and K smoothing; off, it
    changes nothing; and the option travels through every FP4 mode (attn_qat_dropin's forward is nvfp4's)."""
    q, k, v = shared_offset_qkv(1, 2, 160, 96, 64, dtype=torch.float32, seed=3)
    h = hadamard_matrix(64)
    with torch.no_grad():
        both = attention(q, k, v, "nvfp4", q_smoothing=True, qk_rotation="hadamard", k_smoothing=True)
        assert torch.equal(attention(q, k, v, "nvfp4", q_smoothing=False), attention(q, k, v, "nvfp4"))
        for mode in ("attn_qat", "attn_qat_dropin"):
            assert torch.equal(attention(q, k, v, mode, q_smoothing=True), attention(q, k, v, "nvfp4", q_smoothing=True))
    ks = k - k.mean(dim=2, keepdim=True)
    ref = R.nvfp4_attention_ref(q @ h, ks @ h, v, q_smoothing=True)
    assert rel_err(both, ref) < 1e-5 < rel_err(both, R.nvfp4_attention_ref(q @ h, ks @ h, v))
    assert "Q smoothed per 128-row block" in describe_qk_options({"q_smoothing": True, "qk_rotation": "hadamard"})
    assert describe_qk_options({"q_smoothing": False}) == []


def test_attn_qat_trains_through_rotation_with_q_smoothing():
    """Gradients of attn_qat with q_smoothing through the rotation (reference path): the reference backward on the
    rotated Q, K, rotated back."""
    q, k, v = (t.requires_grad_() for t in shared_offset_qkv(1, 1, 140, 64, 64, dtype=torch.float32, seed=4))
    do = torch.randn_like(q)
    grads = torch.autograd.grad((attention(q, k, v, "attn_qat", qk_rotation="hadamard", q_smoothing=True) * do).sum(),
                                (q, k, v))
    h = hadamard_matrix(64)
    qr, kr = (x.detach() @ h for x in (q, k))
    o, o_aux, m, l = R.attn_qat_forward_ref(qr, kr, v.detach(), q_smoothing=True)
    dqr, dkr, dv = R.attn_qat_backward_ref(qr, kr, v.detach(), o_aux, do, m, l, q_smoothing=True)
    for got, want in zip(grads, (dqr @ h.T, dkr @ h.T, dv)):
        assert torch.isfinite(got).all() and rel_err(got, want) < 1e-4


def test_bad_values_are_refused():
    q, k, v = shared_offset_qkv(1, 1, 32, 32, 64, dtype=torch.float32, seed=5)
    for bad in (1, "true", None):
        with pytest.raises(ValueError, match=f"q_smoothing {bad!r} not in"):
            attention(q, k, v, "attn_qat", q_smoothing=bad)
    with pytest.raises(ValueError, match="q_smoothing 1 not in"):
        attn_qat_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), q_smoothing=1)
    for mode in ("bf16", "sage3", "sagebwd"):
        with pytest.raises(ValueError, match="q_smoothing"), torch.no_grad():
            attention(q, k, v, mode, q_smoothing=True)


def test_a_pinned_tile_across_smoothing_blocks_is_refused(monkeypatch):
    """A pinned forward tile of 256 query rows would straddle two 128-row blocks: refused by name."""
    monkeypatch.setenv("ATTNQAT_FWD_CONFIG", "256,64,8,3")
    q, k, v = shared_offset_qkv(1, 1, 64, 64, 64, seed=6)
    with pytest.raises(ValueError, match="q_smoothing needs BLOCK_M dividing 128"), torch.no_grad():
        nvfp4_attention(q, k, v, q_smoothing=True)


def test_ring_attention_merges_key_chunks_with_q_smoothing():
    """attention_with_lse takes q_smoothing: q̄ is over this call's queries and ΔS per key, so two chunks of keys
    merged by their log-sum-exp give the one-pass output (reference path; chunks of whole 64-key tiles)."""
    q, k, v = shared_offset_qkv(1, 2, 150, 192, 64, dtype=torch.float32, seed=7)
    with torch.no_grad():
        whole, lse = attention_with_lse(q, k, v, "nvfp4", q_smoothing=True)
        parts = [attention_with_lse(q, k[:, :, s], v[:, :, s], "nvfp4", q_smoothing=True)
                 for s in (slice(0, 128), slice(128, 192))]
    merged_lse = torch.logsumexp(torch.stack([p[1] for p in parts]), dim=0)
    merged = sum(o * torch.exp(l - merged_lse)[..., None] for o, l in parts)
    assert rel_err(merged, whole) < 1e-5 and rel_err(merged_lse, lse) < 1e-6
    assert rel_err(whole, attention(q, k, v, "nvfp4", q_smoothing=True)) == 0


def test_gluon_sm90_is_never_taken_with_q_smoothing(monkeypatch):
    """The one dispatch decision: where the Gluon sm_90 kernels would run, q_smoothing runs the Triton ones."""
    monkeypatch.setattr(api.hopper_gluon, "gluon_sm90", lambda device: (True, ""))
    q = types.SimpleNamespace(is_cuda=True, shape=(1, 1, 8, 128), device="cuda")
    dims = (128,)
    assert api._gluon_sm90(q, dims, False) and not api._gluon_sm90(q, dims, True)
    assert api._gluon_fp4_inference(q) != api._gluon_fp4_inference(q, True)


def test_training_config_accepts_the_option(tmp_path):
    """attention.options.q_smoothing: true passes the training config's check for attn_qat; a bad value does not."""
    tiny = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
    cfg = load_config(tiny, [f"output_dir={tmp_path}", "attention.mode=attn_qat", "attention.options.q_smoothing=true"])
    assert cfg.attention.options == {"q_smoothing": True}
    validate(cfg)
    with pytest.raises(ValueError, match="q_smoothing 'yes' not in"):
        validate(load_config(tiny, [f"output_dir={tmp_path}", "attention.options.q_smoothing=yes"]))


# --- Compiled (no GPU here: a compile for sm_90; the GPU test runs with `pytest -m gpu`) -------------------------

COMPILE_SMOOTHED = """
import json, multiprocessing
from concurrent.futures import ProcessPoolExecutor
from attnqat.kernels import attn_qat as A
from attnqat.kernels._hardware import compile_for
def compiled(which):
    if which == "dkdv":
        return which, A.compile_backward(90, A.BWD_CONFIG_GPU[False][128], HEAD_DIM=128, CAUSAL=True, TRANSPOSED=False,
                                         SMOOTH_Q=True).metadata.shared
    fwd = which == "fwd"
    cfg = A.FWD_TRAIN_CONFIG_GPU[128] if fwd else A.DQ_CONFIG_GPU[128]
    ptrs = dict.fromkeys(("QF", "KF", "VF", "DeltaS") + (("O", "OAux") if fwd else ("DO", "DQ")), "*bf16")
    ptrs.update(dict.fromkeys(("M", "Lsum") + (() if fwd else ("Delta",)), "*fp32"))
    const = dict(HEAD_DIM=128, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=True, IEEE=False, SMOOTH_Q=True)
    if fwd:
        ptrs.update(QS="*u8", KS="*u8")
        const.update(TRAINING=True, QUANT_P=True, FP16=False, FP8_CAST=True, PACKED_QK=0)
    scalars = {"qk_scale": "fp32"} if fwd else {"qk_scale": "fp32", "sm_scale": "fp32"}
    kern = compile_for(A._attn_fwd if fwd else A._attn_bwd_dq, 90, types={**ptrs, **scalars}, constexprs=const,
                       aligned=tuple(ptrs), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return which, kern.metadata.shared
with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("fork")) as pool:
    print(json.dumps(dict(pool.map(compiled, ("dkdv", "fwd", "dq")))))
"""


@pytest.mark.slow  # three compiles for sm_90 (~25 s of one core) in two forked processes: 10-15 s on 2 cores
def test_smoothed_kernels_compile_for_hopper():
    """The SMOOTH_Q training forward, dK/dV and dQ kernels compile for sm_90 at their default head_dim-128 tiles
    and fit an H100's 227 KB of shared memory (measured: forward 133,120 B against 131,072 without SMOOTH_Q; dK/dV
    116,224 either way; dQ 163,840). A compile only, outside the interpreter, in a subprocess."""
    from conftest import compiled_outside_interpreter

    out = compiled_outside_interpreter(COMPILE_SMOOTHED, timeout=900)
    assert set(out) == {"dkdv", "fwd", "dq"} and all(0 < v <= 227 * 1024 for v in out.values()), out


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_matches_reference(causal, poison):
    """Compiled kernels (head_dim 128, a partial last block) against the reference, forward and backward."""
    drawn = shared_offset_qkv(1, 2, 1000, 1000, 128, causal=causal, away_from_ties=False)
    q, k, v = (t.cuda().requires_grad_() for t in drawn)
    o = attention(q, k, v, "attn_qat", causal=causal, q_smoothing=True)
    do = torch.randn_like(o)
    o.backward(do)
    cpu = [t.detach().float().cpu() for t in (q, k, v, do)]
    ro, ro_aux, rm, rl = R.attn_qat_forward_ref(*cpu[:3], causal=causal, q_smoothing=True)
    want = R.attn_qat_backward_ref(*cpu[:3], ro_aux, cpu[3], rm, rl, causal=causal, q_smoothing=True)
    assert rel_err(o.float().cpu(), ro) < 5e-3
    for got, w in zip((q.grad, k.grad, v.grad), want):
        assert rel_err(got.float().cpu(), w) < 1e-2


def test_forward_op_with_q_smoothing_passes_opcheck():
    """attnqat::attn_qat_fwd with q_smoothing=True (training: q̄ is its eighth output): schema, its fake against the
    real outputs (shapes, dtypes, strides; q in diffusers' (B, L, H, D) layout), AOTAutograd."""
    from attnqat.kernels.attn_qat import attn_qat_fwd

    q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in shared_offset_qkv(1, 1, 130, 64, 64))
    torch.library.opcheck(attn_qat_fwd, (q, k, v, 0.125, False, True, True))
    assert attn_qat_fwd(q, k, v, 0.125, False, True, True)[7].shape == (1, 1, 2, 64)
