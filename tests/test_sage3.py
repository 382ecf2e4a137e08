"""SageAttention3's fused pre-pass (SPEC §3): smoothing, quantization and ΔS vs the reference."""
import pytest
import torch

from attnqat.kernels import reference as R
from attnqat.kernels._common import LaunchConfig
from attnqat.kernels.sage3 import sage3_prepass
from conftest import rel_err


@pytest.mark.parametrize("lq,lk,d", [(300, 77, 64), (128, 200, 128)])
def test_prepass_matches_reference(lq, lk, d, poison):
    _check_prepass(lq, lk, d, "cpu", torch.float32)  # the interpreter's work dtype


def _check_prepass(lq, lk, d, device, wdt):
    torch.manual_seed(0)
    q, k, v = ((torch.randn(2, 3, n, d, device=device) + 2.0 * torch.randn(d, device=device)).to(torch.bfloat16)
               for n in (lq, lk, lk))
    # (B, L, H, D) views, as diffusers passes them
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    qf, kf, vf, ds = sage3_prepass(q, k, v, LaunchConfig(64, 64))
    assert qf.dtype == kf.dtype == vf.dtype == wdt
    # ΔS as three bf16 parts, rows padded to whole 64-key tiles with finite values
    assert ds.dtype == torch.bfloat16 and ds.shape[-2] == 3 and ds.shape[-1] == -(-lk // 64) * 64
    assert torch.isfinite(ds).all()
    q_s, k_s, ds_ref = R.sage3_smooth(q, k)
    hi, mid, lo = ds.float().unbind(-2)
    ds = (hi + mid) + lo  # exact in fp32: 8 + 8 + <= 8 significant bits
    # stored in the forward's column order (nvfp4.tile_keys): position 8j + 2r + e of each 64-key tile
    # holds key 16r + 2j + e
    pos = torch.arange(ds.shape[-1], device=device)
    c = pos % 64
    keys = pos - c + 16 * ((c // 2) % 4) + 2 * (c // 8) + c % 2
    ds = torch.empty_like(ds).index_copy_(-1, keys, ds)[..., :lk]
    assert (mid.abs() <= hi.abs() * 2 ** -7).all() and (lo.abs() <= mid.abs() * 2 ** -7).all()
    # the smoothed values agree to fp32 rounding, so quantized elements agree except at rounding ties
    for got, want in ((qf, R.fake_quant_nvfp4_ref(q_s)), (kf, R.fake_quant_nvfp4_ref(k_s))):
        assert (got.float() != want).float().mean() < 1e-3
        assert rel_err(got.float(), want) < 1e-2
    assert torch.equal(vf.float(), R.fake_quant_nvfp4_ref(v.float(), dim=2))
    assert rel_err(ds, ds_ref) < 1e-5


@pytest.mark.gpu
def test_gpu_prepass_matches_reference(poison):
    _check_prepass(4000, 3000, 128, "cuda", torch.bfloat16)


def test_heads_in_groups_when_delta_s_is_large(monkeypatch, poison):
    """A ΔS budget smaller than one head's runs the heads one by one, with the same result."""
    from attnqat.kernels import attn_qat as attn_qat_module, sage3
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 3, n, 64).to(torch.bfloat16) for n in (130, 90, 90))
    whole = sage3.sage3_forward(q, k, v, sm_scale=0.125, causal=False)
    monkeypatch.setattr(attn_qat_module, "DELTA_S_BYTES", 1)
    assert torch.equal(sage3.sage3_forward(q, k, v, sm_scale=0.125, causal=False), whole)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_token_mean_is_each_heads_own(device, poison):
    """smoothing.token_mean: each head's mean is the same whatever other heads the tensor holds and however they
    are laid out, as Ulysses's ranks (H / N heads each, after an all-to-all) need; a GPU's torch.mean was not, at
    Wan's 40 heads and 32,760 tokens. Against a float64 mean; NaN stays in its own head and column."""
    from attnqat.kernels.smoothing import token_mean
    n, h, d = (32760, 40, 128) if device == "cuda" else (300, 4, 64)
    x = (torch.randn(1, n, h, d, device=device) * 3 + torch.randn(d, device=device)).to(torch.bfloat16)
    x[0, n // 3, 1, 5] = float("nan")
    whole = token_mean(x.transpose(1, 2))  # diffusers' (B, L, H, D) projection, viewed as (B, H, L, D)
    want = x.double().mean(dim=1)
    assert whole.dtype == torch.float32 and whole.shape == (1, h, d)
    assert torch.equal(whole.isnan(), want.isnan()) and whole[0, 1, 5].isnan()
    ok = ~want.isnan()
    assert (whole.double()[ok] - want[ok]).abs().max() <= 1e-5
    ranks = 4 if h % 4 == 0 else 2
    for r in range(ranks):
        hs = slice(r * h // ranks, (r + 1) * h // ranks)
        rank_heads = x[:, :, hs].transpose(1, 2).contiguous()  # one rank's heads after Ulysses' all-to-all
        got = token_mean(rank_heads)
        assert torch.equal(got.isnan(), whole[:, hs].isnan()) and torch.equal(got.nan_to_num(), whole[:, hs].nan_to_num())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("smooth_k", [False, True])
def test_key_bias_is_each_heads_own(device, smooth_k, poison):
    """smoothing.key_bias, sagebwd's Q-smoothing bias ((K - mean K) . mean Q, scaled) for every key: against
    float64, NaN kept to its head and key, and one rank's heads give those heads of the whole bit for bit (a
    GPU's batched matmul did not: 2e-5 apart for 10 heads of 40 at 32,760 keys)."""
    from attnqat.kernels.smoothing import key_bias, token_mean
    n, h, d = (32760, 40, 128) if device == "cuda" else (200, 4, 64)
    k = (torch.randn(1, n, h, d, device=device) * 2 + torch.randn(d, device=device)).to(torch.bfloat16)
    qmean = torch.randn(1, h, d, device=device)
    k[0, n // 2, 2, 7] = float("nan")
    kt = k.transpose(1, 2)  # diffusers' (B, L, H, D) projection, viewed as (B, H, L, D)
    kmean = token_mean(kt).nan_to_num() if smooth_k else None
    whole = key_bias(kt, kmean, qmean, 0.7)
    ks = kt.double() - (kmean.double()[:, :, None] if smooth_k else 0)
    want = (ks @ qmean.double()[..., None]).squeeze(-1) * 0.7
    assert whole.dtype == torch.float32 and whole.shape == (1, h, n)
    assert torch.equal(whole.isnan(), want.isnan()) and whole[0, 2, n // 2].isnan() and whole.isnan().sum() == 1
    ok = ~want.isnan()
    assert (whole.double()[ok] - want[ok]).abs().max() <= 1e-5 * want[ok].abs().max()
    for hs in (slice(0, h // 4), slice(h // 4, h // 2)):
        got = key_bias(kt[:, hs].contiguous(), kmean[:, hs].contiguous() if smooth_k else None,
                       qmean[:, hs].contiguous(), 0.7)
        assert torch.equal(got.nan_to_num(), whole[:, hs].nan_to_num())
        assert torch.equal(got.isnan(), whole[:, hs].isnan())


@pytest.mark.gpu
def test_sage3_ulysses_heads_bitwise(poison):
    """sage3 of one Ulysses rank's heads equals those heads of the whole forward, bit for bit, at Wan 14B's
    480p shape (the 4-GPU step was 1e-2 apart before K's mean became smoothing.token_mean)."""
    from attnqat.kernels import sage3
    q, k, v = (torch.randn(1, 32760, 40, 128, device="cuda").to(torch.bfloat16) for _ in range(3))
    whole = sage3.sage3_forward(*(t.transpose(1, 2) for t in (q, k, v)), sm_scale=128 ** -0.5, causal=False)
    for hs in (slice(0, 10), slice(30, 40)):
        part = sage3.sage3_forward(*(t[:, :, hs].transpose(1, 2).contiguous() for t in (q, k, v)),
                                   sm_scale=128 ** -0.5, causal=False)
        assert torch.equal(part, whole[:, hs])
