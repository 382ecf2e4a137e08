"""SageAttention3's fused pre-pass (SPEC §3): smoothing, quantization and ΔS vs the reference."""
import pytest
import torch

from attnqat.kernels import reference as R
from attnqat.kernels.attn_qat import quantize_heads
from attnqat.kernels.sage3 import _delta_s
from conftest import rel_err


def _prepass(q, k, v, wdt):
    """The kernel pre-pass of sage3_forward, piece by piece."""
    import triton
    b, h, lk, d = k.shape
    k_mean = k.mean(dim=2, dtype=torch.float32).contiguous()
    qf, q_mean = quantize_heads(q, wdt, block_mean=R.SAGE3_Q_BLOCK)
    kf = quantize_heads(k, wdt, center=k_mean)
    vf = quantize_heads(v, wdt, tokens=True)
    ds = torch.empty((b, h, q_mean.shape[2], lk), dtype=torch.float32, device=q.device)
    _delta_s[(triton.cdiv(lk, 32), b * h)](k, k_mean, q_mean, ds, k.stride(0), k.stride(1), k.stride(2), h, lk,
                                           q_mean.shape[2], HEAD_DIM=d, BLOCK_N=32, BLOCK_QB=32)
    return qf, kf, vf, ds


@pytest.mark.parametrize("lq,lk,d", [(300, 77, 64), (128, 200, 128)])
def test_prepass_matches_reference(lq, lk, d, poison):
    _check_prepass(lq, lk, d, "cpu", torch.float32)


def _check_prepass(lq, lk, d, device, wdt):
    torch.manual_seed(0)
    q, k, v = ((torch.randn(2, 3, n, d, device=device) + 2.0 * torch.randn(d, device=device)).to(torch.bfloat16)
               for n in (lq, lk, lk))
    # (B, L, H, D) views, as diffusers passes them
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    qf, kf, vf, ds = _prepass(q, k, v, wdt)
    q_s, k_s, ds_ref = R.sage3_smooth(q, k)
    # the smoothed values agree to fp32 rounding, so quantized elements agree except at rounding ties
    for got, want in ((qf, R.fake_quant_nvfp4_ref(q_s)), (kf, R.fake_quant_nvfp4_ref(k_s))):
        assert (got.float() != want).float().mean() < 1e-3
        assert rel_err(got.float(), want) < 1e-2
    assert torch.equal(vf.float(), R.fake_quant_nvfp4_ref(v.float(), dim=2))
    assert rel_err(ds, ds_ref) < 1e-5


@pytest.mark.gpu
def test_gpu_prepass_matches_reference(poison):
    _check_prepass(4000, 3000, 128, "cuda", torch.bfloat16)
