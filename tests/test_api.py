"""The attention API: every mode vs its reference, inference-only refusals, dispatch by device."""
import warnings

import pytest
import torch

from attnqat.kernels import attention, available_modes, backend_info
from attnqat.kernels import reference as R
from conftest import rel_err

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
    q, k, v = (t.requires_grad_() for t in qkv(lq=64, lk=96))
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
