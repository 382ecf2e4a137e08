"""The FP4 modes' Q/K options: qk_rotation (Q and K rotated along head_dim by a Hadamard matrix) and k_smoothing
(K's mean over the sequence subtracted), both before FP4 attention and both exact in high precision."""
import math

import pytest
import torch

from attnqat.kernels import attention
from attnqat.kernels.api import attention_with_lse
from attnqat.kernels import reference as R
from attnqat.kernels.rotation import hadamard_matrix
from conftest import rel_err

FP4_MODES = ["nvfp4", "attn_qat", "attn_qat_dropin"]


def sylvester(d: int) -> torch.Tensor:
    """An independent Hadamard matrix: Kronecker powers of [[1, 1], [1, -1]], normalized, in float64."""
    h = torch.ones(1, 1, dtype=torch.float64)
    for _ in range(int(math.log2(d))):
        h = torch.kron(torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64), h)
    return h / math.sqrt(d)


def qkv(d=64, lq=80, lk=144, dtype=torch.float32, outliers=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, n, d, generator=g) for n in (lq, lk, lk))
    if outliers:  # a few large channels, as RMS-normed, RoPE'd Q and K have
        q[..., 3] *= 12
        k[..., 3] *= 12
        k[..., 40 % d] += 6
    return q.to(dtype), k.to(dtype), v.to(dtype)


@pytest.mark.parametrize("d", [16, 64, 128])
def test_hadamard_matrix_is_the_orthogonal_sylvester_matrix(d):
    h = hadamard_matrix(d)
    assert h.dtype == torch.float32 and h.shape == (d, d)
    assert torch.equal(h.double(), sylvester(d).float().double())
    assert torch.allclose(h.double() @ h.double().T, torch.eye(d, dtype=torch.float64), atol=1e-6)
    for bad in (0, 48, 96):
        with pytest.raises(ValueError, match="power-of-two head_dim"):
            hadamard_matrix(bad)


@pytest.mark.parametrize("mode", FP4_MODES)
@pytest.mark.parametrize("d", [64, 128])
def test_rotated_fp4_attention_is_the_reference_on_rotated_q_and_k(mode, d):
    q, k, v = qkv(d)
    h = sylvester(d)
    with torch.no_grad():
        out = attention(q, k, v, mode, qk_rotation="hadamard")
        plain = attention(q, k, v, mode)
    ref = R.nvfp4_attention_ref((q.double() @ h).float(), (k.double() @ h).float(), v)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert rel_err(out, ref) < 1e-5 < rel_err(plain, ref)  # the rotation happened, and it is the one asked for
    # in exact arithmetic the rotation changes nothing: the same attention without FP4
    exact = torch.nn.functional.scaled_dot_product_attention
    assert rel_err(exact(q.double() @ h, k.double() @ h, v.double()), exact(q.double(), k.double(), v.double())) < 1e-12
    with torch.no_grad():
        assert torch.equal(attention(q, k, v, mode, qk_rotation="none"), plain)


def test_rotation_lowers_fp4_error_on_outlier_channels():
    q, k, v = qkv(outliers=True)
    exact = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
    with torch.no_grad():
        plain = rel_err(attention(q, k, v, "nvfp4"), exact)
        rotated = rel_err(attention(q, k, v, "nvfp4", qk_rotation="hadamard"), exact)
    assert rotated < 0.8 * plain


def test_attn_qat_gradients_flow_back_through_the_rotation():
    q, k, v = (t.requires_grad_() for t in qkv(lq=48, lk=48))
    do = torch.randn_like(q)
    grads = torch.autograd.grad((attention(q, k, v, "attn_qat", qk_rotation="hadamard") * do).sum(), (q, k, v))
    h = sylvester(64).float()
    qr, kr = (q.detach() @ h).requires_grad_(), (k.detach() @ h).requires_grad_()
    vr = v.detach().clone().requires_grad_()
    dqr, dkr, dvr = torch.autograd.grad((R.attn_qat_attention_ref(qr, kr, vr) * do).sum(), (qr, kr, vr))
    for got, want in zip(grads, (dqr @ h.T, dkr @ h.T, dvr)):  # d/dq of f(q H) is (df) Hᵀ
        assert torch.isfinite(got).all() and rel_err(got, want) < 1e-4


def test_bf16_inputs_stay_bf16_and_nonfinite_rows_stay_nonfinite():
    q, k, v = qkv(dtype=torch.bfloat16)
    q[0, 1, 5, 7] = float("nan")
    with torch.no_grad():
        out = attention(q, k, v, "nvfp4", qk_rotation="hadamard")
    assert out.dtype == torch.bfloat16
    assert not torch.isfinite(out[0, 1, 5]).any() and torch.isfinite(out[0, 0]).all()
    assert torch.isfinite(out[0, 1, :5]).all() and torch.isfinite(out[0, 1, 6:]).all()


@pytest.mark.parametrize("mode", ["bf16", "sage3", "sagebwd"])
def test_modes_outside_the_nvfp4_family_refuse_it(mode):
    with pytest.raises(ValueError, match="qk_rotation"):
        with torch.no_grad():
            attention(*qkv(dtype=torch.bfloat16), mode, qk_rotation="hadamard")
    with pytest.raises(ValueError, match="qk_rotation 'random' not in"):
        attention(*qkv(), "attn_qat", qk_rotation="random")


def smoothed(k: torch.Tensor) -> torch.Tensor:
    """An independent K-smoothing: the mean key over the sequence subtracted, in float64."""
    k = k.double()
    return k - k.sum(dim=2, keepdim=True) / k.shape[2]


@pytest.mark.parametrize("mode", FP4_MODES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_smoothed_fp4_attention_is_the_reference_on_smoothed_k(mode, d, causal):
    """k_smoothing runs the FP4 reference on K minus its mean, alone and before the rotation; exact attention, causal
    or not, does not change when K loses its mean (every logit of a row moves by the same amount)."""
    q, k, v = qkv(d, lq=96, lk=96, outliers=True)
    h = sylvester(d)
    with torch.no_grad():
        out = attention(q, k, v, mode, causal=causal, k_smoothing=True)
        both = attention(q, k, v, mode, causal=causal, k_smoothing=True, qk_rotation="hadamard")
        plain = attention(q, k, v, mode, causal=causal)
        assert torch.equal(attention(q, k, v, mode, causal=causal, k_smoothing=False), plain)
    ref = R.nvfp4_attention_ref(q, smoothed(k).float(), v, causal=causal)
    ref_both = R.nvfp4_attention_ref((q.double() @ h).float(), (smoothed(k) @ h).float(), v, causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert rel_err(out, ref) < 1e-5 < rel_err(plain, ref)
    assert rel_err(both, ref_both) < 1e-5 < rel_err(out, ref_both)
    exact = torch.nn.functional.scaled_dot_product_attention
    assert rel_err(exact(q.double(), smoothed(k), v.double(), is_causal=causal),
                   exact(q.double(), k.double(), v.double(), is_causal=causal)) < 1e-12


def test_smoothing_lowers_fp4_error_when_keys_share_an_offset():
    q, k, v = qkv()
    k = k + 4 * torch.randn(1, 2, 1, 64, generator=torch.Generator().manual_seed(1))  # an offset every key shares
    exact = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
    with torch.no_grad():
        plain = rel_err(attention(q, k, v, "nvfp4"), exact)
        smooth = rel_err(attention(q, k, v, "nvfp4", k_smoothing=True), exact)
    assert smooth < 0.8 * plain


def test_attn_qat_gradients_flow_back_through_the_smoothing():
    q, k, v = (t.requires_grad_() for t in qkv(lq=48, lk=48, outliers=True))
    do = torch.randn_like(q)
    grads = torch.autograd.grad((attention(q, k, v, "attn_qat", k_smoothing=True) * do).sum(), (q, k, v))
    qs, ks, vs = q.detach().clone().requires_grad_(), smoothed(k.detach()).float().requires_grad_(), \
        v.detach().clone().requires_grad_()
    dq, dks, dv = torch.autograd.grad((R.attn_qat_attention_ref(qs, ks, vs) * do).sum(), (qs, ks, vs))
    dk = dks - dks.mean(dim=2, keepdim=True)  # d/dk of f(k - mean(k)): the mean's share taken back out
    for got, want in zip(grads, (dq, dk, dv)):
        assert torch.isfinite(got).all() and rel_err(got, want) < 1e-4


def test_smoothing_spreads_a_nonfinite_key_over_its_head_only():
    q, k, v = qkv(dtype=torch.bfloat16)
    k[0, 1, 9, 3] = float("nan")
    with torch.no_grad():
        out = attention(q, k, v, "nvfp4", k_smoothing=True)
    assert out.dtype == torch.bfloat16
    assert not torch.isfinite(out[0, 1]).any() and torch.isfinite(out[0, 0]).all()


def test_ring_attentions_entry_refuses_smoothing():
    """attention_with_lse (ring attention's per-chunk call) refuses k_smoothing: a chunk's mean is not the whole's."""
    q, k, v = qkv(dtype=torch.bfloat16)
    with torch.no_grad():
        with pytest.raises(ValueError, match="k_smoothing subtracts the mean of all keys.*Ulysses"):
            attention_with_lse(q, k, v, "nvfp4", k_smoothing=True)
        out, lse = attention_with_lse(q, k, v, "nvfp4", k_smoothing=False)
    assert torch.equal(out, attention(q, k, v, "nvfp4").to(out.dtype)) and torch.isfinite(lse).all()
    with pytest.raises(ValueError, match="k_smoothing"):
        with torch.no_grad():
            attention(q, k, v, "sage3", k_smoothing=True)
    with pytest.raises(ValueError, match="k_smoothing 1 not in"):
        attention(*qkv(), "attn_qat", k_smoothing=1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("mode", ["nvfp4", "attn_qat"])
@pytest.mark.parametrize("smooth", [False, True])
def test_gpu_kernels_with_rotation_match_the_reference(mode, smooth):
    q, k, v = (t.cuda() for t in qkv(d=128, lq=300, lk=300, dtype=torch.bfloat16))
    h = sylvester(128).float().cuda()
    with torch.no_grad():
        out = attention(q, k, v, mode, qk_rotation="hadamard", k_smoothing=smooth)
    kf = smoothed(k).float() if smooth else k.float()
    qr, kr = ((t.float() @ h).to(torch.bfloat16) for t in (q, kf))
    ref = R.nvfp4_attention_ref(qr.float().cpu(), kr.float().cpu(), v.float().cpu())
    assert rel_err(out.float().cpu(), ref) < 5e-3
