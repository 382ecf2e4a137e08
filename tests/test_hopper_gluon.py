"""The Gluon sm_90 forward (attnqat/kernels/hopper_gluon.py): it compiles for sm_90a on any machine whose Triton
has Gluon's Hopper API, and on an H100/H200 it matches SDPA on ragged, causal and Lq != Lk shapes."""
import re

import pytest
import torch
import torch.nn.functional as F

from attnqat.kernels import hopper_gluon
from conftest import compiled_outside_interpreter, rel_err

H100_SHARED_BYTES = 227 * 1024  # the most dynamic shared memory one block may use on sm_90


COMPILE = """
import json
from attnqat.kernels.hopper_gluon import compile_forward
out = {}
for head_dim, causal in ((64, False), (128, True)):
    compiled = compile_forward(head_dim, causal)
    out[head_dim] = {"ptx": compiled.asm["ptx"], "shared": compiled.metadata.shared}
print(json.dumps(out))
"""


def test_forward_compiles_for_sm90a():
    """At head_dim 64 (non-causal) and 128 (causal) the kernel lowers to what makes it a Hopper kernel: sm_90a
    wgmma with P as a register operand, 4-d TMA copies completing on mbarriers, setmaxnreg from the
    warp-specialised load partition; and it fits in H100's shared memory. A compile only, outside the
    interpreter (whose gl.max is not compilable), in a subprocess."""
    if hopper_gluon._MISSING:
        pytest.skip(f"cannot compile the Gluon sm_90 forward here: {hopper_gluon._MISSING}")
    out = compiled_outside_interpreter(COMPILE, timeout=300)
    for head_dim in (64, 128):
        ptx, shared = out[str(head_dim)]["ptx"], out[str(head_dim)]["shared"]
        assert ".target sm_90a" in ptx
        block_n = hopper_gluon.FWD_CONFIG[head_dim][1]
        # S = Q K^T: both operands in shared memory (64-bit descriptors); O += P V: P in four registers
        assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{block_n}k16\.f32\.bf16\.bf16 \{{[^}}]*\}}, %rd", ptx)
        assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{head_dim}k16\.f32\.bf16\.bf16 "
                         r"\{[^}]*\}, \{%r\d+,%r\d+,%r\d+,%r\d+\}", ptx)
        # TMA loads (Triton 3.6 writes the destination as shared::cluster, 3.9 as shared::cta) and the store
        assert re.search(r"cp\.async\.bulk\.tensor\.4d\.shared::\w+\.global\.mbarrier::complete_tx::bytes", ptx)
        assert "cp.async.bulk.tensor.4d.global.shared::cta" in ptx
        assert "setmaxnreg.dec.sync.aligned.u32" in ptx and "setmaxnreg.inc.sync.aligned.u32" in ptx
        assert shared <= H100_SHARED_BYTES


def test_unavailable_says_why():
    ok, why = hopper_gluon.available()
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and not hopper_gluon._MISSING:
        pytest.skip("this machine can run the kernel")
    assert not ok and why and "\n" not in why
    with pytest.raises(RuntimeError, match=re.escape(why)):
        q = torch.randn(1, 1, 8, 64, dtype=torch.bfloat16, device="cuda" if torch.cuda.is_available() else "cpu")
        hopper_gluon.hopper_attention(q, q, q)


def _inputs(b, h, lq, lk, d, layout):
    """bf16 q, k, v; ``"bhld"`` contiguous, ``"blhd"`` diffusers' (B, L, H, D) tensors seen as (B, H, L, D)."""
    def one(n):
        t = torch.randn(b, n, h, d, device="cuda") if layout == "blhd" else torch.randn(b, h, n, d, device="cuda")
        t = t.to(torch.bfloat16)
        return t.transpose(1, 2) if layout == "blhd" else t
    return one(lq), one(lk), one(lk)


@pytest.mark.gpu
@pytest.mark.parametrize("b,h,lq,lk,d,causal,layout", [
    (1, 2, 97, 97, 64, False, "bhld"),
    (1, 2, 1025, 1025, 128, True, "bhld"),
    (2, 3, 300, 1025, 128, False, "blhd"),   # Lq < Lk, both ragged
    (2, 3, 1025, 300, 64, True, "blhd"),     # Lq > Lk causal: rows past Lk see every key
    (1, 4, 4096, 512, 128, False, "bhld"),   # Wan's cross-attention: 512 text tokens
    (1, 1, 1, 129, 64, True, "bhld"),
])
def test_gpu_matches_sdpa(b, h, lq, lk, d, causal, layout, poison):
    ok, why = hopper_gluon.available()
    if not ok:
        pytest.skip(why)
    q, k, v = _inputs(b, h, lq, lk, d, layout)
    out = hopper_gluon.hopper_attention(q, k, v, causal=causal)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)
    torch_bf16 = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert out.shape == (b, h, lq, d) and out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()
    # FlashAttention's criterion: no worse than twice what PyTorch's own bf16 attention loses
    assert rel_err(out, ref) <= 2 * rel_err(torch_bf16, ref) + 1e-4


@pytest.mark.gpu
def test_gpu_sm_scale_and_rows_independent(poison):
    """A non-default sm_scale is applied, and a NaN in one head's values stays in that head (the ragged tail of
    another head is never read: TMA zero-fills past Lk)."""
    ok, why = hopper_gluon.available()
    if not ok:
        pytest.skip(why)
    q, k, v = _inputs(1, 2, 200, 200, 128, "bhld")
    out = hopper_gluon.hopper_attention(q, k, v, sm_scale=0.3)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=0.3)
    assert rel_err(out, ref) <= 2 * rel_err(F.scaled_dot_product_attention(q, k, v, scale=0.3), ref) + 1e-4
    v[0, 1] = float("nan")
    out = hopper_gluon.hopper_attention(q, k, v)
    assert torch.isfinite(out[0, 0]).all() and torch.isnan(out[0, 1]).all()
