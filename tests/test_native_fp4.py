"""The native block-scaled FP4 path (sm_100/sm_120): NVFP4 storage from the pre-pass, Q K^T through
tl.dot_scaled, and the choice of path. No Blackwell GPU runs here: the interpreter checks the numerics of
the same kernel (its _dot_fp4 decodes the storage), and a compile for sm_100/sm_120 checks that the
forward lowers to the block-scaled MMA instructions."""

import pytest
import torch

from attnqat.kernels import backend_info, quantize_nvfp4
from attnqat.kernels import reference as R
from attnqat.kernels.attn_qat import attn_qat_forward, native_fp4
from attnqat.kernels.nvfp4 import quantize_heads
from attnqat.kernels.sage3 import sage3_forward
from conftest import compiled_outside_interpreter, rel_err


@pytest.fixture
def poison_all(monkeypatch):
    """Like conftest's poison, for every dtype: floats NaN, integers 0x5A (a valid-looking code pair)."""
    empty = torch.empty

    def _fill(t):
        return t.fill_(float("nan") if t.is_floating_point() else 0x5A)

    monkeypatch.setattr(torch, "empty", lambda *a, **kw: _fill(empty(*a, **kw)))


def test_packed_prepass_is_the_storage_format(poison_all):
    """quantize_heads(packed=True) writes SPEC §1's storage bit for bit: codes two per byte, element 0 low,
    scales float8_e4m3fn; across all-zero, e4m3-subnormal and large blocks, and -0 codes."""
    torch.manual_seed(1)
    x = torch.randn(2, 3, 45, 128) * torch.logspace(-5, 4, 128)
    x[0, 0, 3, :16] = 0.0
    x[1, 2, 7, 16:32] = -1e-4  # rounds to -0 in its block
    x = x.to(torch.bfloat16)
    codes, scales = quantize_heads(x, torch.float32, packed=True)
    want_codes, want_scales = quantize_nvfp4(x.float())
    assert codes.dtype == torch.uint8 and scales.dtype == torch.float8_e4m3fn
    assert torch.equal(codes, want_codes)
    assert torch.equal(scales.view(torch.uint8), want_scales.view(torch.uint8))


def test_packed_prepass_keeps_non_finite_blocks_non_finite(poison_all):
    x = torch.randn(1, 1, 4, 64)
    x[0, 0, 1, 5] = float("nan")
    x[0, 0, 2, 40] = float("inf")
    _, scales = quantize_heads(x, torch.float32, packed=True)  # fp32: under the interpreter a bf16 NaN missed the block max
    s = scales.float()[0, 0]
    assert s[1, 0].isnan() and s[2, 2].isnan()  # NVFP4 storage has no inf: NaN scale
    assert torch.isfinite(s[0]).all() and torch.isfinite(s[3]).all()
    assert torch.isfinite(s[1, 1:]).all() and torch.isfinite(s[2, :2]).all()


@pytest.mark.parametrize("lq,lk,d,causal", [(70, 100, 64, False), (64, 130, 128, True), (129, 64, 128, False)])
def test_packed_forward_equals_the_emulation(lq, lk, d, causal, poison):
    """Q K^T over NVFP4 storage gives exactly the bf16 emulation's output, which follows the reference."""
    torch.manual_seed(2)
    q, k, v = (torch.randn(2, 2, n, d).to(torch.bfloat16) for n in (lq, lk, lk))
    scale = d ** -0.5
    emulated = attn_qat_forward(q, k, v, sm_scale=scale, causal=causal, training=False, packed_qk=0)[0]
    for form in (1, 2):
        packed = attn_qat_forward(q, k, v, sm_scale=scale, causal=causal, training=False, packed_qk=form)[0]
        assert torch.equal(packed, emulated)
    ref = R.nvfp4_attention_ref(q, k, v, causal=causal)
    assert rel_err(packed, ref) <= 2e-3


def test_packed_sage3_equals_the_emulation(poison):
    torch.manual_seed(3)
    q, k, v = ((torch.randn(1, 2, n, 64) + 3.0 * torch.randn(64)).to(torch.bfloat16) for n in (150, 150, 150))
    emulated = sage3_forward(q, k, v, sm_scale=0.125, causal=False, packed_qk=0)
    packed = sage3_forward(q, k, v, sm_scale=0.125, causal=False, packed_qk=2)
    assert torch.equal(packed, emulated)
    assert rel_err(packed, R.sage3_attention_ref(q, k, v, sm_scale=0.125)) <= 2e-3


def test_packed_path_is_inference_only():
    q = torch.randn(1, 1, 64, 64).to(torch.bfloat16)
    with pytest.raises(ValueError, match="inference"):
        attn_qat_forward(q, q, q, sm_scale=0.125, causal=False, training=True, packed_qk=1)


def test_cpu_reports_the_emulation():
    assert not native_fp4(torch.device("cpu"))
    assert "emulat" in backend_info("cpu")["fp4_qk"]


# Six compiles (~5 s each, one core) in two forked processes, three each: the suite runs on two cores
COMPILE = """
import json, multiprocessing, re
from concurrent.futures import ProcessPoolExecutor
from attnqat.kernels._common import SMALLER_CONFIGS, LaunchConfig
from attnqat.kernels.attn_qat import FWD_CONFIG_GPU, compile_forward, native_qk_form
def native(arch):
    form = native_qk_form(arch)
    got = {"form": form}
    if form:
        ptx = compile_forward(arch, LaunchConfig(128, 64, 8, 3), HEAD_DIM=128, CAUSAL=True, SMOOTH_Q=True,
                              PACKED_QK=form).asm["ptx"]
        got["mma"] = sorted(set(re.findall(r"(?:tcgen05\\.mma|mma\\.sync)\\S*", ptx)))
    # shared memory of the largest inference forward (sage3, head_dim 128) on 99 KB GPUs: the tuned tiles with
    # the native path on sm_120; the first smaller config (launch_fitting's) with the emulation on sm_86
    if arch == 120:
        got["shared"] = compile_forward(120, FWD_CONFIG_GPU[128], HEAD_DIM=128, CAUSAL=False, SMOOTH_Q=True,
                                        PACKED_QK=form).metadata.shared
    if arch == 86:
        got["shared"] = compile_forward(86, SMALLER_CONFIGS[0], HEAD_DIM=128, CAUSAL=False, SMOOTH_Q=True,
                                        PACKED_QK=0).metadata.shared
    return arch, got
with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("fork")) as pool:
    got = dict(pool.map(native, (120, 100, 86)))  # 120's three compiles in one, 100's two and 86's one in the other
out = {arch: {k: v for k, v in got[arch].items() if k != "shared"} for arch in (100, 120)}
out["shared"] = {"120": got[120]["shared"], "86": got[86]["shared"]}
print(json.dumps(out))
"""


def test_forward_compiles_to_blackwell_block_scaled_mma():
    """The forward with PACKED_QK (and sage3's ΔS, causal masking) lowers to NVFP4 block-scaled MMAs for
    sm_100 (tcgen05 kind::mxf4nvf4) and sm_120 (mma.sync kind::mxf4nvf4), and the forward fits the 99 KB of
    shared memory of consumer GPUs (sm_120 natively with the tuned tiles, sm_86 emulated after one step
    down). A compile only, outside the interpreter, in a subprocess."""
    out = compiled_outside_interpreter(COMPILE, timeout=600)
    for arch in ("100", "120"):
        assert out[arch]["form"] in (1, 2), out
        assert any("kind::mxf4nvf4" in m and "block_scale" in m for m in out[arch]["mma"]), out
    assert max(out["shared"].values()) <= 99 * 1024, out  # sm_86/89/120: 99 KB per block


@pytest.mark.gpu
def test_gpu_path_choice_matches_the_hardware():
    dev = torch.device("cuda")
    major = torch.cuda.get_device_capability(dev)[0]
    info = backend_info(dev)
    if major in (10, 12):
        assert native_fp4(dev) and "native" in info["fp4_qk"]
    else:
        assert not native_fp4(dev) and "emulat" in info["fp4_qk"]
