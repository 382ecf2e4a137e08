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
