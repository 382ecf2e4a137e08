"""The attention API: every mode vs its reference, inference-only refusals, dispatch by device."""
import os
import warnings

import pytest
import torch

from attnqat.kernels import attention, available_modes, backend_info
from attnqat.kernels import reference as R
from conftest import fp4_rounding_ties, rel_err

FP4_INFERENCE = {"nvfp4": R.nvfp4_attention_ref, "sage3": R.sage3_attention_ref}


def qkv(lq=97, lk=130, d=64, dtype=torch.bfloat16, offset=0.0, device="cpu"):
    return tuple((torch.randn(1, 2, n, d, device=device) + offset).to(dtype) for n in (lq, lk, lk))


def bound(ref):
    ref = ref.float()
    return 2 * rel_err(ref.to(torch.bfloat16), ref) + 1e-6


def test_registry_lists_every_mode():
    assert {"bf16", "nvfp4", "sage3", "attn_qat", "attn_qat_dropin", "sagebwd"} <= set(available_modes())
    with pytest.raises(ValueError, match="unknown attention mode 'fp3'.*attn_qat"):
        attention(*qkv(), mode="fp3")


@pytest.mark.parametrize("mode", sorted(FP4_INFERENCE))
@pytest.mark.parametrize("causal", [False, True])
def test_inference_modes_match_reference(mode, causal, poison):
    q, k, v = qkv(offset=1.5)
    with torch.no_grad():
        out = attention(q, k, v, mode=mode, causal=causal)
    ref = FP4_INFERENCE[mode](q, k, v, causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    # the reference returns bf16 too: compare against its fp32 value through the sage3/nvfp4 tile loop
    assert rel_err(out, ref) <= 2e-3


@pytest.mark.parametrize("mode", ["nvfp4", "sage3"])
def test_inference_only_modes_refuse_grad(mode):
    q, k, v = (t.requires_grad_() for t in qkv())
    with pytest.raises(ValueError, match="inference-only"):
        attention(q, k, v, mode=mode)


def test_attn_qat_without_grad_equals_nvfp4(poison):
    q, k, v = qkv()
    with torch.no_grad():
        assert torch.equal(attention(q, k, v, mode="attn_qat"), attention(q, k, v, mode="nvfp4"))


def test_dropin_backward_is_high_precision_with_fp4_output(poison):
    q, k, v = qkv(lq=64, lk=96)
    while fp4_rounding_ties(q, k, backward=None):  # see conftest: kernel and reference may round those apart
        q, k, v = qkv(lq=64, lk=96)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o = attention(q, k, v, mode="attn_qat_dropin")
    do = torch.randn_like(o)
    o.backward(do)
    o_fp4 = R.attn_qat_forward_ref(q.detach(), k.detach(), v.detach(), training=False)[0]  # fp32
    want = R.attention_bwd_fp32(q.detach(), k.detach(), v.detach(), o_fp4, do)
    for got, w in zip((q.grad, k.grad, v.grad), want):
        assert rel_err(got, w) <= bound(w) + 2e-3
    # and the forward is the FP4 one
    assert rel_err(o, o_fp4) <= bound(o_fp4)


def test_sage3_beats_nvfp4_on_offset_inputs():
    """SageAttention3's smoothing removes a shared offset in K (and per-block in Q) before FP4."""
    q, k, v = qkv(lq=256, lk=256, offset=3.0)
    exact = R.attention_fp32(q, k, v)
    with torch.no_grad():
        e_sage = rel_err(attention(q, k, v, mode="sage3"), exact)
        e_fp4 = rel_err(attention(q, k, v, mode="nvfp4"), exact)
    assert e_sage < e_fp4


def test_plain_cpu_runs_the_references(monkeypatch):
    """Without the interpreter, CPU tensors take the PyTorch reference path (fp32 accepted, trainable)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert backend_info("cpu")["path"] == "pytorch-reference"
    q, k, v = (t.requires_grad_() for t in qkv(dtype=torch.float32))
    o = attention(q, k, v, mode="attn_qat")
    o.sum().backward()
    ro = R.attn_qat_forward_ref(q.detach(), k.detach(), v.detach(), training=False)[0]
    assert torch.equal(o.detach(), ro)
    assert q.grad is not None and torch.isfinite(q.grad).all()
    with torch.no_grad():
        assert torch.equal(attention(q, k, v, mode="sage3"), R.sage3_attention_ref(q, k, v))


def test_fp32_cpu_tensors_take_the_reference_even_under_the_interpreter():
    q, k, v = qkv(dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(attention(q, k, v, mode="nvfp4"), R.nvfp4_attention_ref(q, k, v))


def test_options_are_checked():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="takes no options"):
        with torch.no_grad():
            attention(q, k, v, mode="sage3", qk_rotation="hadamard")
    with pytest.raises(ValueError,
                       match="takes options qk_rotation, k_smoothing, q_smoothing, four_over_six; got .'p_bwd'"):
        with torch.no_grad():
            attention(q, k, v, mode="nvfp4", p_bwd="final_max")
    with pytest.raises(ValueError, match="p_bwd"):
        attention(q, k, v, mode="attn_qat", p_bwd="bogus")


def test_bf16_mode_is_sdpa():
    q, k, v = qkv(dtype=torch.float32)
    assert torch.equal(attention(q, k, v), torch.nn.functional.scaled_dot_product_attention(q, k, v))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", sorted(FP4_INFERENCE))
def test_gpu_inference_modes(mode):
    q, k, v = qkv(lq=4096, lk=4096, d=128, offset=1.0, device="cuda")
    with torch.no_grad():
        out = attention(q, k, v, mode=mode)
    ref = FP4_INFERENCE[mode](q, k, v)
    assert rel_err(out, ref) <= 5e-3


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["nvfp4", "sage3", "attn_qat"])
def test_gpu_config_too_large_for_shared_memory_falls_back(mode, monkeypatch, poison):
    """A launch config that needs more shared memory than the GPU has (5 stages of 128x128 K and V tiles:
    320 KB; an H100 has 227 KB, consumer GPUs 99 KB) steps down to one that fits, says so once, and
    gives the reference's result; training too (attn_qat with grad)."""
    from attnqat.kernels import _common

    monkeypatch.setattr(_common, "_FITTED", {})
    monkeypatch.setenv("ATTNQAT_FWD_CONFIG", "128,128,8,5")
    q, k, v = qkv(lq=1000, lk=1500, d=128, offset=1.0, device="cuda")
    with torch.no_grad(), pytest.warns(UserWarning, match="does not fit this GPU"):
        out = attention(q, k, v, mode=mode)
    assert rel_err(out, FP4_INFERENCE.get(mode, R.nvfp4_attention_ref)(q, k, v)) <= 5e-3
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*does not fit")  # the fallback is remembered: said once
        assert torch.equal(attention(q, k, v, mode=mode), out)
    if mode == "attn_qat":  # training: the forward, and the backward's dQ kernel
        monkeypatch.setenv("ATTNQAT_DQ_CONFIG", "128,128,8,5")
        qg = q.clone().requires_grad_()
        with pytest.warns(UserWarning, match="does not fit this GPU"):
            out_train = attention(qg, k, v, mode=mode)
        assert rel_err(out_train, out) <= 5e-3
        do = torch.randn_like(out_train)
        with pytest.warns(UserWarning, match=r"backward \(dQ\).*does not fit this GPU"):
            out_train.backward(do)
        monkeypatch.delenv("ATTNQAT_DQ_CONFIG")
        monkeypatch.delenv("ATTNQAT_FWD_CONFIG")
        qd = q.clone().requires_grad_()
        attention(qd, k, v, mode=mode).backward(do)
        assert rel_err(qg.grad, qd.grad) <= 1e-3


def test_torch_compile_traces_without_graph_breaks():
    """The kernels are torch.library custom ops with fake implementations: fullgraph compile works,
    forward and backward, and gives the eager result."""
    q, k, v = qkv(lq=64, lk=64)

    def fwd(q, k, v):
        return attention(q, k, v, mode="attn_qat") * 2

    compiled = torch.compile(fwd, fullgraph=True, backend="aot_eager")
    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
    qb, kb, vb = (t.clone().requires_grad_() for t in (q, k, v))
    oa, ob = fwd(qa, ka, va), compiled(qb, kb, vb)
    assert torch.equal(oa, ob)
    oa.sum().backward()
    ob.sum().backward()
    assert torch.equal(qa.grad, qb.grad) and torch.equal(ka.grad, kb.grad) and torch.equal(va.grad, vb.grad)
    with torch.no_grad():
        for mode in ("sage3", "nvfp4"):
            eager = attention(q, k, v, mode=mode)
            graph = torch.compile(lambda a, b, c: attention(a, b, c, mode=mode), fullgraph=True, backend="aot_eager")
            assert torch.equal(graph(q, k, v), eager)


def test_dropin_backward_op_passes_opcheck():
    """attn_qat_dropin's backward custom op: schema (no mutation, no aliasing), its fake against the real outputs
    (shapes, dtypes and strides: q in diffusers' (B, L, H, D) layout as a transposed view), AOTAutograd."""
    from attnqat.kernels.attn_qat import attn_qat_dropin_bwd, attn_qat_fwd

    q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in qkv(lq=48, lk=80))
    o = attn_qat_fwd(q, k, v, 0.125, True, False)[0]
    torch.library.opcheck(attn_qat_dropin_bwd, (torch.randn_like(o), q, k, v, o, 0.125, True))


# --- Input contract: one check, the same on the Triton path and the reference path -----------------------------

MODES = ["bf16", "nvfp4", "sage3", "attn_qat", "attn_qat_dropin", "sagebwd"]
PATHS = {"reference": "0", "interpreter": "1"}  # TRITON_INTERPRET: bf16 CPU tensors take the kernels under "1"


def _t(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape).to(dtype)


def _good():
    return _t(1, 2, 24, 64), _t(1, 2, 40, 64), _t(1, 2, 40, 64)


# (name, build () -> (q, k, v, kwargs), message, modes the value is legal for)
BAD_INPUTS = [
    ("int32", lambda: (*(torch.randint(-3, 3, (1, 2, 24, 64), dtype=torch.int32) for _ in range(3)), {}), "dtype", ()),
    ("bool", lambda: (*(torch.ones(1, 2, 24, 64, dtype=torch.bool) for _ in range(3)), {}), "dtype", ()),
    ("float64", lambda: (*(_t(1, 2, 24, 64, dtype=torch.float64) for _ in range(3)), {}), "dtype", ()),
    ("mixed dtypes", lambda: (_t(1, 2, 24, 64), _t(1, 2, 40, 64, dtype=torch.float16), _t(1, 2, 40, 64), {}),
     "share a dtype", ()),
    ("3-D q", lambda: (_t(2, 24, 64), _t(1, 2, 40, 64), _t(1, 2, 40, 64), {}), "batch, heads, seqlen, head_dim", ()),
    ("5-D k", lambda: (_t(1, 2, 24, 64), _t(1, 1, 2, 40, 64), _t(1, 2, 40, 64), {}), "batch, heads, seqlen", ()),
    ("broadcast batch", lambda: (_t(1, 2, 24, 64), _t(2, 2, 40, 64), _t(2, 2, 40, 64), {}), "must agree", ()),
    ("broadcast heads", lambda: (_t(1, 2, 24, 64), _t(1, 1, 40, 64), _t(1, 1, 40, 64), {}), "must agree", ()),
    ("k, v lengths differ", lambda: (_t(1, 2, 24, 64), _t(1, 2, 40, 64), _t(1, 2, 41, 64), {}), "shapes differ", ()),
    ("v head_dim differs", lambda: (_t(1, 2, 24, 64), _t(1, 2, 40, 64), _t(1, 2, 40, 128), {}), "shapes differ", ()),
    ("q head_dim differs", lambda: (_t(1, 2, 24, 128), _t(1, 2, 40, 64), _t(1, 2, 40, 64), {}), "must agree", ()),
    ("head_dim 96", lambda: (*(_t(1, 2, 24, 96) for _ in range(3)), {}), "head_dim 96", ("bf16",)),
    ("head_dim 32", lambda: (*(_t(1, 2, 24, 32) for _ in range(3)), {}), "head_dim 32", ("bf16",)),
    ("strided last dim", lambda: (*(_t(1, 2, 64, 24).transpose(-1, -2) for _ in range(3)), {}), "contiguous", ()),
    ("empty Lq", lambda: (_t(1, 2, 0, 64), _t(1, 2, 40, 64), _t(1, 2, 40, 64), {}), "empty", ()),
    ("empty Lk", lambda: (_t(1, 2, 24, 64), _t(1, 2, 0, 64), _t(1, 2, 0, 64), {}), "empty", ()),
    ("empty batch", lambda: (*(_t(0, 2, 24, 64) for _ in range(3)), {}), "empty", ()),
    ("sm_scale 0", lambda: (*_good(), {"sm_scale": 0.0}), "sm_scale", ()),
    ("sm_scale < 0", lambda: (*_good(), {"sm_scale": -0.125}), "sm_scale", ()),
    ("sm_scale nan", lambda: (*_good(), {"sm_scale": float("nan")}), "sm_scale", ()),
    ("sm_scale inf", lambda: (*_good(), {"sm_scale": float("inf")}), "sm_scale", ()),
    ("sm_scale str", lambda: (*_good(), {"sm_scale": "0.1"}), "sm_scale", ()),
    ("sm_scale bool", lambda: (*_good(), {"sm_scale": True}), "sm_scale", ()),
    ("sm_scale tensor", lambda: (*_good(), {"sm_scale": torch.tensor(0.1)}), "sm_scale", ()),
    ("causal str", lambda: (*_good(), {"causal": "yes"}), "causal", ()),
    ("causal int", lambda: (*_good(), {"causal": 1}), "causal", ()),
    ("q a list", lambda: ([[[[0.0] * 64]]], *_good()[1:], {}), "torch.Tensor", ()),
    ("sparse k", lambda: (_t(1, 2, 24, 64), torch.randn(1, 2, 40, 64).to_sparse(), _t(1, 2, 40, 64), {}),
     "dense tensor", ()),
    ("devices differ", lambda: (_t(1, 2, 24, 64), _t(1, 2, 40, 64).to("meta"), _t(1, 2, 40, 64), {}),
     "different devices", ()),
    ("meta device", lambda: (*(_t(1, 2, 24, 64).to("meta") for _ in range(3)), {}), "not supported", ()),
    ("unknown option", lambda: (*_good(), {"bogus": 1}), "takes", ()),
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_inputs_are_refused_the_same_on_every_path(case, mode, path, monkeypatch):
    """The input contract of docs/kernels.md ((B, H, L, D), bf16/fp16 (+ fp32 on CPU or for bf16), D in {64, 128}
    (any for bf16), contiguous last dim, same batch/heads/dtype/device, sm_scale finite > 0, causal a bool) is
    enforced by one check before dispatch: the same ValueError whether the Triton kernels or the references
    would run."""
    name, build, message, legal_for = case
    monkeypatch.setenv("TRITON_INTERPRET", PATHS[path])
    q, k, v, kwargs = build()
    if mode in legal_for:
        with torch.no_grad():
            assert attention(q, k, v, mode=mode, **kwargs).shape == q.shape
        return
    with pytest.raises(ValueError, match=message) as err:
        with torch.no_grad():
            attention(q, k, v, mode=mode, **kwargs)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_kernel_entry_points_refuse_the_same_inputs(case):
    """The lower-level Triton entry points run the same check (here under the interpreter)."""
    from attnqat.kernels.attn_qat import attn_qat_attention, attn_qat_dropin_attention, nvfp4_attention
    from attnqat.kernels.sage3 import sage3_attention
    from attnqat.kernels.sagebwd import sagebwd_attention

    name, build, message, _ = case
    q, k, v, kwargs = build()
    if name == "unknown option":
        return  # keyword arguments of a Python function: a TypeError there, as for any function
    for fn in (attn_qat_attention, attn_qat_dropin_attention, nvfp4_attention, sage3_attention, sagebwd_attention):
        with pytest.raises(ValueError, match=message):
            with torch.no_grad():
                fn(q, k, v, **kwargs)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("mode", MODES)
def test_valid_inputs_run_on_every_path(mode, path, monkeypatch, poison):
    """The control for the table: what the contract allows runs on both paths (Lq != Lk, causal, an explicit
    sm_scale, a (B, L, H, D) transpose view, fp16) and gives a finite output of q's shape and dtype."""
    monkeypatch.setenv("TRITON_INTERPRET", PATHS[path])
    q = torch.randn(1, 24, 2, 64).bfloat16().transpose(1, 2)
    k, v = (torch.randn(1, 40, 2, 64).bfloat16().transpose(1, 2) for _ in range(2))
    for dtype, causal, scale in ((torch.bfloat16, True, 0.2), (torch.float16, False, None)):
        with torch.no_grad():
            out = attention(q.to(dtype), k.to(dtype), v.to(dtype), mode=mode, causal=causal, sm_scale=scale)
        assert out.shape == q.shape and out.dtype == dtype and torch.isfinite(out).all()


# --- NaN and inf stay visible (SPEC §1) ---------------------------------------------------------------------------

TRAINABLE = {"bf16", "attn_qat", "attn_qat_dropin", "sagebwd"}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("causal", [False, True])
def test_nonfinite_inputs_stay_visible(mode, path, causal, monkeypatch, poison):
    """The propagation rule (docs/kernels.md): a NaN or +-inf in q's row i makes output row i
    non-finite; one in k's or v's row j makes every row that attends key j non-finite (all rows; rows i >= j
    when causal). Other rows may follow (shared block scales and means). For trainable modes the backward
    keeps it too: dq and dk hold a non-finite value, and dv as well when the bad value was in q or k
    (dV = P^T dO does not read V). Each case: fresh inputs, a random bad position, on both paths.

    The nine cases (q, k or v) x (NaN, inf, -inf) run as one call: batch b holds the bad value in q, k or v,
    and head h of it one of the three values (a random pairing), every (b, h) its own attention; each is
    checked on its own slice of the output and the gradients."""
    monkeypatch.setenv("TRITON_INTERPRET", PATHS[path])
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    lq, lk = 40, 72
    q, k, v = (torch.randn(3, 3, n, 64, generator=g).bfloat16() for n in (lq, lk, lk))
    cases = []
    for b, which in enumerate("qkv"):
        t = {"q": q, "k": k, "v": v}[which]
        for head, bad in zip(torch.randperm(3, generator=g).tolist(), (float("nan"), float("inf"), float("-inf"))):
            row = int(torch.randint(min(t.shape[2], lq) if causal else t.shape[2], (1,), generator=g))  # seen
            col = int(torch.randint(64, (1,), generator=g))
            t[b, head, row, col] = bad
            cases.append((b, head, which, row, f"{mode}/{path}: {bad} in {which}[{b}, {head}, {row}, {col}], "
                                               f"causal={causal}, seed {seed}"))
    grad = mode in TRAINABLE
    leaves = [x.clone().requires_grad_(grad) for x in (q, k, v)]
    with torch.set_grad_enabled(grad):
        out = attention(*leaves, mode=mode, causal=causal)
    if grad:
        out.backward(torch.randn(out.shape, generator=g).to(out.dtype))
    for b, head, which, row, where in cases:
        rows_bad = ~torch.isfinite(out[b, head].float()).all(-1)
        expect = torch.zeros(lq, dtype=torch.bool)
        if which == "q":
            expect[row] = True
        else:
            expect[row if causal else 0:] = True
        assert rows_bad[expect].all(), f"{where}: finite rows {(expect & ~rows_bad).nonzero().flatten().tolist()}"
        if grad:
            dq, dk, dv = (x.grad[b, head] for x in leaves)
            assert not torch.isfinite(dq).all() and not torch.isfinite(dk).all(), f"{where}: finite dq/dk"
            if which != "v":
                assert not torch.isfinite(dv).all(), f"{where}: finite dv"


def test_bf16_mode_marks_only_the_rows_that_saw_the_bad_value():
    """SDPA alone returns finite rows for a -inf key (a -inf logit is a zero weight); the bf16 mode marks exactly
    the rows that attend it and leaves every other row equal to SDPA's."""
    q, k, v = (torch.randn(1, 2, 40, 64) for _ in range(3))
    k[0, 1, 30, 3] = float("-inf")
    q[0, 1, :, 3] = q[0, 1, :, 3].abs() + 0.1  # so every logit of key 30 is -inf, none +inf (which gives NaN)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    got = attention(q, k, v, mode="bf16", causal=True)
    assert torch.isfinite(want[0, 1, 30:]).all()  # what the mode fixes
    assert torch.equal(got[0, 0], want[0, 0]) and torch.equal(got[0, 1, :30], want[0, 1, :30])
    assert torch.isnan(got[0, 1, 30:]).all()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("mode", sorted(TRAINABLE))
def test_a_key_with_only_minus_inf_logits_still_marks_the_gradients(mode, path, monkeypatch, poison):
    """The case the random draws above meet about once in forty runs: a -inf in k that only the last query row
    attends (causal), against a positive q entry, so its one logit is -inf and a backward from unquantized Q, K
    (bf16, the drop-in ablation) gets a finite P. The output row, dq, dk and dv must stay non-finite anyway."""
    monkeypatch.setenv("TRITON_INTERPRET", PATHS[path])
    q, k, v = (torch.randn(1, 2, n, 64).bfloat16() for n in (40, 72, 72))
    col = int(torch.randint(64, (1,)))
    k[0, 1, 39, col] = float("-inf")
    q[0, 1, 39, col] = q[0, 1, 39, col].abs() + 0.1
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = attention(*leaves, mode=mode, causal=True)
    assert not torch.isfinite(out[0, 1, 39]).all()
    out.backward(torch.randn(out.shape).to(out.dtype))
    for name, x in zip("qkv", leaves):
        assert not torch.isfinite(x.grad).all(), f"{mode}/{path}: finite d{name}"


# --- second-order gradients -------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("mode", sorted(TRAINABLE))
def test_double_backward_raises_instead_of_a_wrong_value(mode, path, monkeypatch):
    """Gradients of gradients (a gradient penalty, a Hessian-vector product) through a trainable mode raise: the
    FP4 and INT8 backwards are hand-written, so a graph through them would give wrong second-order values (they
    were 79-102% off fp64's) or silently none. bf16 is PyTorch's SDPA, which raises on its own. A first-order
    backward is unaffected (the rest of this file)."""
    monkeypatch.setenv("TRITON_INTERPRET", PATHS[path])
    q, k, v = (torch.randn(1, 2, n, 64).bfloat16().requires_grad_() for n in (24, 40, 40))
    out = attention(q, k, v, mode=mode)
    expected = (RuntimeError, "not implemented") if mode == "bf16" else \
        (NotImplementedError, f"attention mode '{mode}' has no second-order gradients")
    with pytest.raises(expected[0], match=expected[1]):
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v), create_graph=True)
        torch.autograd.grad(sum(g.float().sum() for g in grads), (q, k, v), allow_unused=True)
