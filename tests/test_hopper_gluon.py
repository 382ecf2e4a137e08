"""The Gluon sm_90 kernels (attnqat/kernels/hopper_gluon.py): the forward's variants and the backward's two kernels
compile for sm_90a on any machine whose Triton has Gluon's Hopper API; on an H100/H200 the bf16 forward matches SDPA,
the FP4 and training ones attn_qat's Triton forward and the PyTorch reference, and the backward attn_qat's Triton
backward and the reference, on ragged, causal and Lq != Lk shapes."""
import re
import warnings

import pytest
import torch
import torch.nn.functional as F

from attnqat.kernels import hopper_gluon
from attnqat.kernels import reference as R
from attnqat.kernels.attn_qat import attn_qat_attention, attn_qat_backward, attn_qat_forward, nvfp4_attention
from attnqat.kernels.nvfp4 import quantize_heads
from conftest import compiled_outside_interpreter, rel_err

H100_SHARED_BYTES = 227 * 1024  # the most dynamic shared memory one block may use on sm_90


# A compile script's head: record(key, compiled) keeps the PTX, the shared memory, ptxas's resource usage and three
# counts from the SASS (full wgmma waits, HGMMA and IGMMA instructions: bf16 and int8 wgmma); the script prints `out`
# as its last line.
COMPILE_HEAD = """
import json, re, subprocess, tempfile
import triton
from attnqat.kernels.hopper_gluon import compile_backward, compile_forward
out = {}
def record(key, compiled):
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "--dump-resource-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "-sass", f.name], capture_output=True,
                              text=True).stdout
    out[key] = {"ptx": compiled.asm["ptx"], "shared": compiled.metadata.shared,
                "usage": re.search(r"REG:\\d+ STACK:\\d+ SHARED:\\d+ LOCAL:\\d+", usage)[0],
                "full_waits": sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x0"), "hgmma": sass.count("HGMMA."),
                "igmma": sass.count("IGMMA.")}
"""
COMPILE = COMPILE_HEAD + """
for head_dim, causal in ((64, False), (128, True)):
    for variant in ("bf16", "fp4", "train"):
        record(f"{head_dim},{variant}", compile_forward(head_dim, causal, fp4=variant == "fp4",
                                                        training=variant == "train"))
        record(f"{head_dim},{variant},ws", compile_forward(head_dim, causal, fp4=variant == "fp4",
                                                           training=variant == "train", variant="ws"))
record("128,fp4,pingpong", compile_forward(128, True, fp4=True, variant="pingpong"))
record("128,fp4,pingpong,stats", compile_forward(128, True, fp4=True, variant="pingpong", stats=True))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled():
    """The three variants compiled for sm_90a at head_dim 64 (non-causal) and 128 (causal): PTX, shared memory
    and ptxas's resource usage. A compile only, outside the interpreter (whose gl.max is not compilable), in a
    subprocess, once for the module's tests."""
    if hopper_gluon._MISSING:
        pytest.skip(f"cannot compile the Gluon sm_90 forward here: {hopper_gluon._MISSING}")
    return compiled_outside_interpreter(COMPILE, timeout=300)


def test_forward_compiles_for_sm90a(compiled):
    """The kernel lowers to what makes it a Hopper kernel: sm_90a wgmma with P as a register operand, 4-d TMA copies
    completing on mbarriers, setmaxnreg from the warp-specialised load partition (240 registers for the two
    consumer warpgroups); no spills (no local memory or stack), and it fits in H100's shared memory. The FP4
    variant adds P's quantization in registers only: the hardware e4m3 cast of the block scales and the packed
    bf16 e2m1 rounding, and no shuffle, shared-memory traffic or barrier beyond the bf16 variant's (its 16-key
    blocks lie in one thread; its reshapes are asserted free at compile time)."""
    out = compiled
    for head_dim in (64, 128):
        bf16 = out[f"{head_dim},bf16"]["ptx"]
        fp4 = out[f"{head_dim},fp4"]["ptx"]
        assert "cvt.rn.satfinite.e4m3x2.f32" in fp4 and "cvt.rn.satfinite.e4m3x2.f32" not in bf16
        assert "fma.rn.bf16x2" in fp4
        for op in ("st.shared", "ld.shared", "bar.sync", "bar.arrive", "shfl.sync"):
            assert fp4.count(op) == bf16.count(op), op
    for key, variant in out.items():
        head_dim, kind, layout = (key.split(",") + ["default"])[:3]
        head_dim = int(head_dim)
        ptx, shared = variant["ptx"], variant["shared"]
        assert ".target sm_90a" in ptx
        block_n = hopper_gluon._fwd_config(layout, head_dim, kind == "train")[1]
        # S = Q K^T: both operands in shared memory (64-bit descriptors); O += P V: P in four registers
        assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{block_n}k16\.f32\.bf16\.bf16 \{{[^}}]*\}}, %rd", ptx)
        assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{head_dim}k16\.f32\.bf16\.bf16 "
                         r"\{[^}]*\}, \{%r\d+,%r\d+,%r\d+,%r\d+\}", ptx)
        # TMA loads (Triton 3.6 writes the destination as shared::cluster, 3.9 as shared::cta) and the store
        assert re.search(r"cp\.async\.bulk\.tensor\.4d\.shared::\w+\.global\.mbarrier::complete_tx::bytes", ptx)
        assert "cp.async.bulk.tensor.4d.global.shared::cta" in ptx
        assert "setmaxnreg.dec.sync.aligned.u32 \t24;" in ptx and "setmaxnreg.inc.sync.aligned.u32 \t240;" in ptx
        assert re.fullmatch(r"REG:\d+ STACK:0 SHARED:\d+ LOCAL:0", variant["usage"]), (key, variant["usage"])
        assert shared <= H100_SHARED_BYTES


def test_ws_forwards_run_two_consumer_warpgroups(compiled):
    """The warp-specialised forwards ("ws", "pingpong") are the 8-warp kernel's consumer code twice, once per
    warpgroup partition (twice its wgmmas and e4m3 casts; 240 registers each, the load warp 24), with barriers scoped
    to one warpgroup (bar.sync id, 128), and they fit H100's shared memory with their deeper rings. "pingpong" adds
    one mbarrier wait and one arrive per wgmma round and consumer (the turn hand-off) and nothing else."""
    for key in [key for key in compiled if key.endswith((",ws", ",pingpong"))]:
        ptx = compiled[key]["ptx"]
        default = compiled[key.rsplit(",", 1)[0]]["ptx"]
        assert ptx.count("wgmma.mma_async") == 2 * default.count("wgmma.mma_async"), key
        assert ptx.count("cvt.rn.satfinite.e4m3x2.f32") == 2 * default.count("cvt.rn.satfinite.e4m3x2.f32"), key
        assert re.search(r"bar\.sync\s+\d+, 128;", ptx), key
        assert compiled[key]["shared"] > compiled[key.rsplit(",", 1)[0]]["shared"]  # the deeper K, V ring
    ws, pingpong = compiled["128,fp4,ws"]["ptx"], compiled["128,fp4,pingpong"]["ptx"]
    for op in ("mbarrier.arrive", "mbarrier.try_wait"):  # rounds: tile 0, the loop, the last P V; two consumers
        assert pingpong.count(op) == ws.count(op) + 2 * 3, op
    for op in ("wgmma.mma_async", "st.shared", "ld.shared", "shfl.sync"):
        assert pingpong.count(op) == ws.count(op), op


def test_training_variant_adds_the_aux_mma_and_the_statistics(compiled):
    """The training variant is the FP4 one plus O': per key tile two register-operand wgmmas (P V^F and P~ V^F)
    where the FP4 one has one, the unquantized P~'s bf16 conversion, two TMA stores of the output tile (O, O')
    where it has one, and global stores of m and l; P's quantization as the FP4 variant (e4m3 cast, packed
    rounding), and beyond it no shuffle, shared-memory traffic or barrier but the rescale decision's one cross-warp
    reduction per tile (V_j's barrier is waited on once for both of its wgmmas)."""
    for head_dim in (64, 128):
        fp4 = compiled[f"{head_dim},fp4"]["ptx"]
        train = compiled[f"{head_dim},train"]["ptx"]
        block_n = hopper_gluon.FWD_TRAIN_CONFIG[head_dim][1]
        scores = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{block_n}k16\.f32\.bf16\.bf16 \{{[^}}]*\}}, %rd",
                            train)
        pv = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{head_dim}k16\.f32\.bf16\.bf16 \{{[^}}]*\}}, \{{%r",
                        train)
        # two call sites each (tile 0, the loop): S over head_dim/16 k-steps; P V and P~ V over block_n/16
        assert len(scores) == 2 * head_dim // 16
        assert len(pv) == 2 * 2 * block_n // 16
        assert "cvt.rn.satfinite.e4m3x2.f32" in train and "fma.rn.bf16x2" in train
        store = "cp.async.bulk.tensor.4d.global.shared::cta"
        assert train.count(store) == 2 * fp4.count(store)
        assert "st.global" in train and "st.global" not in fp4
        # past the barriers' set-up, whose unrolled loop Triton 3.6 splits by a bar.sync per few stages (the
        # training variant has 3 at head_dim 128, the FP4 one 2)
        train, fp4 = (ptx[ptx.rindex("mbarrier.init"):] for ptx in (train, fp4))
        extra = {op: train.count(op) - fp4.count(op) for op in ("st.shared", "ld.shared", "bar.sync", "bar.arrive",
                                                                  "shfl.sync")}
        # the reduction over the consumer's rows (whether any alpha differs from 1): Triton 3.9 writes it with one
        # shared-memory store, load and barrier and no more shuffles than the FP4 variant (by count); 3.6 with 2, 2,
        # 3 and 6 shuffles of its own
        assert extra["bar.arrive"] == 0 and 0 <= extra["shfl.sync"] <= 6, extra
        assert 1 <= extra["st.shared"] <= 2 and 1 <= extra["ld.shared"] <= 2 and 1 <= extra["bar.sync"] <= 3, extra


def test_stats_variant_adds_the_row_statistics_only(compiled):
    """The FP4 inference forward with its row statistics (ring attention's, ``return_stats``) is the FP4 one plus
    the global stores of m and l: nothing else changes (no O', no third wgmma, no more shared-memory traffic or
    barriers; its shared memory 32 bytes more, Triton 3.6 and 3.9)."""
    fp4, stats = compiled["128,fp4,pingpong"], compiled["128,fp4,pingpong,stats"]
    assert "st.global" not in fp4["ptx"] and stats["ptx"].count("st.global") >= 2
    assert 0 <= stats["shared"] - fp4["shared"] <= 64 and stats["hgmma"] == fp4["hgmma"]
    for op in ("wgmma.mma_async", "cp.async.bulk.tensor", "st.shared", "ld.shared", "bar.sync", "shfl.sync"):
        assert stats["ptx"].count(op) == fp4["ptx"].count(op), op


@pytest.mark.parametrize("fn", [hopper_gluon.hopper_attention, hopper_gluon.hopper_fp4_attention,
                                hopper_gluon.hopper_attn_qat_forward])
def test_unavailable_says_why(fn):
    ok, why = hopper_gluon.available()
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0) and not hopper_gluon._MISSING:
        pytest.skip("this machine can run the kernel")
    assert not ok and why and "\n" not in why
    with pytest.raises(RuntimeError, match=re.escape(why)):
        q = torch.randn(1, 1, 8, 64, dtype=torch.bfloat16, device="cuda" if torch.cuda.is_available() else "cpu")
        fn(q, q, q)


def test_fp4_forward_refuses_grad_and_bad_inputs_first(device):
    """Input errors come before the hardware check, on any machine: the FP4 forward has no backward."""
    q = torch.randn(1, 1, 8, 64, dtype=torch.bfloat16, device=device, requires_grad=True)
    with pytest.raises(ValueError, match="inference-only"):
        hopper_gluon.hopper_fp4_attention(q, q, q)
    with pytest.raises(ValueError, match="head_dim 32"):
        hopper_gluon.hopper_fp4_attention(*(torch.randn(1, 1, 8, 32, dtype=torch.bfloat16, device=device)
                                            for _ in range(3)))
    x = q.detach()
    for fn in (hopper_gluon.hopper_attention, hopper_gluon.hopper_fp4_attention, hopper_gluon.hopper_attn_qat_forward):
        with pytest.raises(ValueError, match=r"variant 'fast' not in \('default', 'ws', 'pingpong'\)"):
            fn(x, x, x, variant="fast")


def test_training_forward_checks_inputs_first(device):
    """The training forward takes inputs that require grad (autograd is its caller's); bad inputs are refused before
    the hardware check, on any machine."""
    with pytest.raises(ValueError, match="head_dim 32"):
        hopper_gluon.hopper_attn_qat_forward(*(torch.randn(1, 1, 8, 32, dtype=torch.bfloat16, device=device,
                                                           requires_grad=True) for _ in range(3)))
    with pytest.raises(ValueError, match="dtype"):
        hopper_gluon.hopper_attn_qat_forward(*(torch.randn(1, 1, 8, 64, dtype=torch.float64, device=device)
                                               for _ in range(3)))


def test_tma_ready_copies_what_a_descriptor_cannot_express():
    """A broadcast (stride 0) dimension, as autograd's dO of a sum, a stride TMA cannot take, or a contiguous view whose
    base sits off the 16-byte boundary is copied to a contiguous, aligned tensor of the same values; strided views TMA
    can read ((B, L, H, D) tensors seen as (B, H, L, D), slices along L) are passed as they are."""
    wide = torch.randn(2, 100, 3, 64).transpose(1, 2)
    off = torch.randn(2 * 3 * 100 * 64 + 1, dtype=torch.bfloat16)[1:].view(2, 3, 100, 64)
    assert off.is_contiguous() and off.data_ptr() % 16
    for t in (torch.randn(2, 3, 1, 64).expand(2, 3, 100, 64), torch.randn(2, 3, 100, 65)[..., :64], off):
        assert not hopper_gluon._tma_ok(t)
        ready = hopper_gluon._tma_ready(t)
        assert ready.is_contiguous() and ready.data_ptr() % 16 == 0 and hopper_gluon._tma_ok(ready)
        assert torch.equal(ready, t)
    for t in (wide, wide[:, :, :50], torch.randn(1, 1, 8, 64).expand(1, 1, 8, 64)):
        assert hopper_gluon._tma_ready(t) is t


def _tile_key(c, block_n):
    """SPEC-independent restatement of nvfp4.tile_keys: column 8j + 2r + e of a tile holds key (block_n/4) r + 2j + e."""
    j, r, e = c // 8, (c // 2) % 4, c % 2
    return (block_n // 4) * r + 2 * j + e


@pytest.mark.parametrize("n,block_n", [(200, 64), (97, 128), (256, 128)])
def test_key_tile_prepass_is_phi_in_tile_order(n, block_n, device, poison):
    """quantize_heads(key_tile=n), the FP4 forward's K and V: phi along head_dim, each tile's rows in tile order,
    zeros (not left unwritten) past the last key; a NaN row stays in its row."""
    x = torch.randn(2, 3, n, 64, device=device) * 3
    x[1, 2, n // 2, 5] = float("nan")
    got = quantize_heads(x, torch.float32, key_tile=block_n)
    tiles = -(-n // block_n)
    want = torch.zeros(2, 3, tiles * block_n, 64, device=device)
    want[:, :, :n] = R.fake_quant_nvfp4_ref(x)
    cols = torch.arange(tiles * block_n, device=device)
    order = (cols // block_n) * block_n + _tile_key(cols % block_n, block_n)
    assert got.shape == (2, 3, tiles * block_n, 64)
    torch.testing.assert_close(got, want[:, :, order], rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(got).sum() == 16  # the NaN's block of 16, in its row only


@pytest.mark.parametrize("n,block_n", [(200, 64), (97, 128), (128, 64)])
def test_both_orders_prepass_is_the_two_one_order_passes(n, block_n, device, poison):
    """quantize_heads(key_tile=n, both_orders=True), the Gluon training forward's K and V pre-pass: one read, two
    writes, each equal to its one-order call bit for bit (NaN included), on ragged lengths and a (B, L, H, D) input
    seen as (B, H, L, D)."""
    x = (torch.randn(2, n, 3, 64, device=device) * 3).transpose(1, 2)
    x[1, 2, n // 2, 5] = float("nan")
    in_order, tiles = quantize_heads(x, torch.float32, key_tile=block_n, both_orders=True)
    assert in_order.is_contiguous() and tiles.is_contiguous()
    torch.testing.assert_close(in_order, quantize_heads(x, torch.float32), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(tiles, quantize_heads(x, torch.float32, key_tile=block_n), rtol=0, atol=0,
                               equal_nan=True)
    with pytest.raises(ValueError, match="both_orders needs key_tile"):
        quantize_heads(x, torch.float32, both_orders=True)


# (B, H, Lq, Lk, D, causal, layout) for both variants' GPU tests: ragged lengths, Lq != Lk both ways, both head dims
GPU_SHAPES = [
    (1, 2, 97, 97, 64, False, "bhld"),
    (1, 2, 1025, 1025, 128, True, "bhld"),
    (2, 3, 300, 1025, 128, False, "blhd"),   # Lq < Lk, both ragged
    (2, 3, 1025, 300, 64, True, "blhd"),     # Lq > Lk causal: rows past Lk see every key
    (1, 4, 4096, 512, 128, False, "bhld"),   # Wan's cross-attention: 512 text tokens
    (1, 2, 4096, 4096, 64, True, "bhld"),
    (1, 1, 1, 129, 64, True, "bhld"),
    (1, 1, 1, 129, 128, True, "bhld"),
]


def _inputs(b, h, lq, lk, d, layout):
    """bf16 q, k, v; ``"bhld"`` contiguous, ``"blhd"`` diffusers' (B, L, H, D) tensors seen as (B, H, L, D)."""
    def one(n):
        t = torch.randn(b, n, h, d, device="cuda") if layout == "blhd" else torch.randn(b, h, n, d, device="cuda")
        t = t.to(torch.bfloat16)
        return t.transpose(1, 2) if layout == "blhd" else t
    return one(lq), one(lk), one(lk)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", hopper_gluon.FWD_VARIANTS)
@pytest.mark.parametrize("b,h,lq,lk,d,causal,layout", GPU_SHAPES)
def test_gpu_matches_sdpa(b, h, lq, lk, d, causal, layout, variant, poison):
    ok, why = hopper_gluon.available()
    if not ok:
        pytest.skip(why)
    q, k, v = _inputs(b, h, lq, lk, d, layout)
    out = hopper_gluon.hopper_attention(q, k, v, causal=causal, variant=variant)
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


def _fp4_bound(ref):
    """attn_qat's GPU criterion: twice what rounding the exact result to bf16 costs, plus 2e-3 for the rare P
    element that compiled exp2 (approximate) puts on the neighbouring grid value (SPEC §1 allows it)."""
    return 2 * rel_err(ref.to(torch.bfloat16), ref) + 2e-3


@pytest.mark.gpu
@pytest.mark.parametrize("variant", hopper_gluon.FWD_VARIANTS)
@pytest.mark.parametrize("b,h,lq,lk,d,causal,layout", GPU_SHAPES)
def test_gpu_fp4_matches_triton_forward_and_reference(b, h, lq, lk, d, causal, layout, variant, poison):
    """The Gluon FP4 forward against attn_qat's Triton FP4 forward (the nvfp4 mode, same numerics) and the PyTorch
    reference (SPEC §2 in fp32). Both kernels are held to the same bound against the reference, and to each
    other; a forward that skipped P's quantization would be ~0.1 off (FP4 noise), far outside it."""
    ok, why = hopper_gluon.available()
    if not ok:
        pytest.skip(why)
    q, k, v = _inputs(b, h, lq, lk, d, layout)
    with torch.no_grad():
        out = hopper_gluon.hopper_fp4_attention(q, k, v, causal=causal, variant=variant)
        triton_out = nvfp4_attention(q, k, v, causal=causal)
    ref = R.attn_qat_forward_ref(q, k, v, causal=causal, training=False)[0]
    assert out.shape == (b, h, lq, d) and out.dtype == torch.bfloat16
    assert torch.isfinite(out).all()
    assert rel_err(triton_out, ref) <= _fp4_bound(ref)
    assert rel_err(out, ref) <= _fp4_bound(ref)
    assert rel_err(out, triton_out) <= _fp4_bound(ref)
    # and it is FP4 attention, not exact attention (FP4 noise: ~0.1-0.2 relative)
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)
    assert rel_err(out, exact) > 5 * rel_err(out, ref)


@pytest.mark.gpu
def test_gpu_fp4_sm_scale_fp16_and_nan_stays_in_its_head(poison):
    """A non-default sm_scale, fp16 inputs (P's rounding in f16x2), and a NaN in one head's V: its block of 16 values
    turns NaN in every row of that head's output and nowhere else (the tile-order pre-pass keeps rows apart and
    pads with zeros)."""
    ok, why = hopper_gluon.available()
    if not ok:
        pytest.skip(why)
    q, k, v = (t.to(torch.float16) for t in _inputs(1, 2, 300, 333, 128, "bhld"))
    with torch.no_grad():
        out = hopper_gluon.hopper_fp4_attention(q, k, v, sm_scale=0.3)
        ref = R.attn_qat_forward_ref(q, k, v, sm_scale=0.3, training=False)[0]
        assert out.dtype == torch.float16
        assert rel_err(out, ref) <= 2 * rel_err(ref.to(torch.float16), ref) + 2e-3
        assert rel_err(out, nvfp4_attention(q, k, v, sm_scale=0.3)) <= 2 * rel_err(ref.to(torch.float16), ref) + 2e-3
        v[0, 1, 7, 3] = float("nan")
        out = hopper_gluon.hopper_fp4_attention(q, k, v)
    assert torch.isfinite(out[0, 0]).all() and torch.isfinite(out[0, 1, :, 16:]).all()
    assert torch.isnan(out[0, 1, :, :16]).all()


def _stats_match(m, l, want_m, want_l):
    """Row statistics agree: the integer running max m exactly (a row whose max logit lands on an integer in one
    summation order and not the other may differ by 1, on at most 0.1% of rows), and the row sum of
    P~ = 2688 2^(S - m) brought to a common max, l 2^m, to fp32 summation order."""
    assert m.dtype == l.dtype == torch.float32
    differ = m != want_m
    assert differ.float().mean().item() <= 1e-3 and (m - want_m).abs().max().item() <= 1
    assert rel_err(l.double() * torch.exp2(m.double()), want_l.double() * torch.exp2(want_m.double())) <= 1e-4


def _assert_gradients(grads, triton_grads, refs, likes):
    """dQ, dK, dV finite, in the shape, dtype and stride order of ``likes`` (q, k, k), and within the Triton backward's
    own bound against the reference (attn_qat's GPU tests'), of the reference and of the Triton path's gradients,
    which are held to that bound too."""
    for got, tri, ref, like in zip(grads, triton_grads, refs, likes):
        assert got.shape == like.shape and got.dtype == like.dtype and got.stride() == like.stride()
        assert torch.isfinite(got).all()
        if not ref.any():  # a single causal query attends one key: the exact dQ is 0, FP4's is rounding noise
            assert got.float().abs().max() <= 2 * tri.float().abs().max() + 1e-6
            continue
        bound = _fp4_bound(ref)
        assert rel_err(tri, ref) <= bound
        assert rel_err(got, ref) <= bound
        assert rel_err(got, tri) <= bound


@pytest.mark.gpu
@pytest.mark.parametrize("variant", hopper_gluon.FWD_VARIANTS)
@pytest.mark.parametrize("b,h,lq,lk,d,causal,layout", GPU_SHAPES)
def test_gpu_training_forward_matches_triton_forward_and_reference(b, h, lq, lk, d, causal, layout, variant,
                                                                   poison):
    """The Gluon training forward against attn_qat's Triton training forward and the PyTorch reference (SPEC §2 in
    fp32): every output, O (FP4), O' (the auxiliary high-precision output), m and l, and the quantized operands
    the backward reads, in the Triton forward's dtypes, shapes and strides. Outputs start as NaN (poison): an
    element left unwritten fails."""
    ok, why = hopper_gluon.available()
    if not ok:
        pytest.skip(why)
    q, k, v = _inputs(b, h, lq, lk, d, layout)
    scale = d ** -0.5
    o, o_aux, m, l, (qf, kf, vf) = hopper_gluon.hopper_attn_qat_forward(q, k, v, causal=causal, variant=variant)
    t_o, t_aux, t_m, t_l, (t_qf, t_kf, t_vf) = attn_qat_forward(q, k, v, sm_scale=scale, causal=causal,
                                                                training=True)
    r_o, r_aux, r_m, r_l = R.attn_qat_forward_ref(q, k, v, causal=causal, training=True)
    for got, want in ((o, t_o), (o_aux, t_aux), (m, t_m), (l, t_l), (qf, t_qf), (kf, t_kf), (vf, t_vf)):
        assert got.shape == want.shape and got.dtype == want.dtype and got.stride() == want.stride()
        assert torch.isfinite(got).all()
    for got, want in ((qf, t_qf), (kf, t_kf), (vf, t_vf)):  # the backward's operands (same pre-pass, keys in order)
        assert torch.equal(got, want)
    _stats_match(m, l, t_m, t_l)
    _stats_match(m, l, r_m, r_l)
    for got, tri, ref in ((o, t_o, r_o), (o_aux, t_aux, r_aux)):
        assert rel_err(tri, ref) <= _fp4_bound(ref)
        assert rel_err(got, ref) <= _fp4_bound(ref)
        assert rel_err(got, tri) <= _fp4_bound(ref)
    # O is FP4 attention and O' is not: they differ by FP4 noise (~0.1), far outside the bounds above. Not for a
    # single causal query: it attends one key, P is exactly 1 in both, and O and O' nearly agree (0.6% at d=64, H100)
    if lq > 1:
        assert rel_err(o, r_aux) > 5 * _fp4_bound(r_aux)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", hopper_gluon.FWD_VARIANTS)
@pytest.mark.parametrize("d", [64, 128])
def test_gpu_training_forward_rescales_the_rows_whose_max_moves_late(d, variant, poison):
    """The training forward skips the rescale of O and O' on a tile where no row's running max moved, decided once
    for a whole warpgroup. Rows whose max jumps in a late key tile, one at a time, in different warps and consumers
    of a program (and their neighbours, whose maxima stay), still match the reference row by row: a rescale skipped
    wrongly would leave a jumping row's earlier tiles 2^15 or more too large against its l, an error of order 1
    (3.6-6.6 on row 5 with the skip forced everywhere, H100). The per-row bound is 10x the tensor's: one key carries nearly all of a jumping row's
    weight, so a P element that compiled exp2 puts on the neighbouring grid value is not diluted (0.0026-0.0035 at
    head_dim 128 against the tensor bound's 0.002, H100)."""
    ok, why = hopper_gluon.available()
    if not ok:
        pytest.skip(why)
    q, k, v = _inputs(1, 2, 1000, 1000, d, "bhld")
    jumps = {5: 990, 40: 700, 77: 450, 120: 200, 250: 999}  # query row: the key planted for it (later tiles first)
    for row, key in jumps.items():
        k[:, :, key] = (2 * q[:, :, row]).to(k.dtype)  # its logit ~2 sqrt(d): 2^15 and more above its earlier max
    o, o_aux, m, l, _ = hopper_gluon.hopper_attn_qat_forward(q, k, v, variant=variant)
    r_o, r_aux, r_m, r_l = R.attn_qat_forward_ref(q, k, v, training=True)
    _stats_match(m, l, r_m, r_l)
    for got, ref in ((o, r_o), (o_aux, r_aux)):
        assert torch.isfinite(got).all()
        for row in sorted({*jumps, *(r + 1 for r in jumps)}):
            assert rel_err(got[:, :, row], ref[:, :, row]) <= 10 * _fp4_bound(ref[:, :, row]), row
        assert rel_err(got, ref) <= _fp4_bound(ref)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [v for v in hopper_gluon.FWD_VARIANTS if v != "default"])
@pytest.mark.parametrize("b,h,lq,lk,d,causal,layout", GPU_SHAPES)
def test_gpu_forward_variants_agree_bit_for_bit(b, h, lq, lk, d, causal, layout, variant, poison):
    """The warp-specialised forwards run each row's softmax and matmuls as the 8-warp one does (the same key tiles in
    the same order, 64-row wgmmas either way), so every output of every forward kind equals the default variant's
    exactly, including the last program's rows past Lq, which a dead second consumer must leave unwritten."""
    ok, why = hopper_gluon.available()
    if not ok:
        pytest.skip(why)
    q, k, v = _inputs(b, h, lq, lk, d, layout)
    with torch.no_grad():
        for fn in (hopper_gluon.hopper_attention, hopper_gluon.hopper_fp4_attention,
                   hopper_gluon.hopper_attn_qat_forward):
            want, got = (fn(q, k, v, causal=causal, variant=name) for name in ("default", variant))
            want, got = (torch.utils._pytree.tree_leaves(t) for t in (want, got))
            assert len(want) == len(got)
            for w, g in zip(want, got):
                assert g.shape == w.shape and g.stride() == w.stride()
                assert torch.equal(g, w), (fn.__name__, (g != w).sum().item())


@pytest.mark.gpu
@pytest.mark.parametrize("backward", ["triton_bwd", "gluon_bwd", "gluon_bwd_ws"])
@pytest.mark.parametrize("b,h,lq,lk,d,causal,layout", [GPU_SHAPES[i] for i in (0, 1, 2, 3)])
def test_gpu_gluon_forward_then_backward_matches_triton_path(b, h, lq, lk, d, causal, layout, backward, poison):
    """A backward run on what the Gluon training forward saves, the Triton one (attn_qat_backward, unchanged) or the
    Gluon one (hopper_attn_qat_backward: the Gluon pair; gluon_bwd_ws with variant="ws", its warp-specialised
    kernels), gives the all-Triton path's gradients (attn_qat_attention's autograd) and the reference's (SPEC §2's
    backward on the reference forward's O', m, l), to the bound the Triton path has against the reference."""
    ok, why = hopper_gluon.available()
    if not ok:
        pytest.skip(why)
    q, k, v = (t.detach().requires_grad_() for t in _inputs(b, h, lq, lk, d, layout))
    do = torch.randn(b, h, lq, d, device="cuda").to(torch.bfloat16)
    attn_qat_attention(q, k, v, causal=causal).backward(do)
    o, o_aux, m, l, (qf, kf, vf) = hopper_gluon.hopper_attn_qat_forward(q, k, v, causal=causal)
    saved = (qf, kf, vf, o_aux, m, l)
    if backward == "triton_bwd":
        grads = attn_qat_backward(do, q, k, *saved, sm_scale=d ** -0.5, causal=causal)
    else:
        variant = "ws" if backward == "gluon_bwd_ws" else "default"
        grads = hopper_gluon.hopper_attn_qat_backward(do, q, k, *saved, causal=causal, variant=variant)
    r_o, r_aux, r_m, r_l = R.attn_qat_forward_ref(q.detach(), k.detach(), v.detach(), causal=causal)
    refs = R.attn_qat_backward_ref(q.detach(), k.detach(), v.detach(), r_aux, do, r_m, r_l, causal=causal)
    _assert_gradients(grads, (q.grad, k.grad, v.grad), refs, (q, k, k))


@pytest.mark.gpu
def test_gpu_training_sm_scale_fp16_and_nan_stays_in_its_head(poison):
    """A non-default sm_scale and fp16 inputs (P's rounding and P~'s conversion in f16), and a NaN in one head's V:
    O and O' turn NaN in that head's first block of 16 values and nowhere else; m and l stay finite (V does not
    enter them)."""
    ok, why = hopper_gluon.available()
    if not ok:
        pytest.skip(why)
    q, k, v = (t.to(torch.float16) for t in _inputs(1, 2, 300, 333, 128, "bhld"))
    o, o_aux, m, l, _ = hopper_gluon.hopper_attn_qat_forward(q, k, v, sm_scale=0.3)
    r_o, r_aux, r_m, r_l = R.attn_qat_forward_ref(q, k, v, sm_scale=0.3)
    assert o.dtype == o_aux.dtype == torch.float16
    for got, ref in ((o, r_o), (o_aux, r_aux)):
        assert rel_err(got, ref) <= 2 * rel_err(ref.to(torch.float16), ref) + 2e-3
    _stats_match(m, l, r_m, r_l)
    v[0, 1, 7, 3] = float("nan")
    o, o_aux, m, l, _ = hopper_gluon.hopper_attn_qat_forward(q, k, v)
    for out in (o, o_aux):
        assert torch.isfinite(out[0, 0]).all() and torch.isfinite(out[0, 1, :, 16:]).all()
        assert torch.isnan(out[0, 1, :, :16]).all()
    assert torch.isfinite(m).all() and torch.isfinite(l).all()


# --- The backward (hopper_attn_qat_backward) -----------------------------------------------------------------------

COMPILE_BACKWARD = COMPILE_HEAD + """
for head_dim, causal in ((64, False), (128, True)):
    for name, compiled in compile_backward(head_dim, causal).items():
        record(f"{head_dim},{name}", compiled)
    for name, compiled in compile_backward(head_dim, causal, variant="ws").items():
        record(f"{head_dim},{name}_ws", compiled)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled_backward():
    """The backward's two kernels compiled for sm_90a at head_dim 64 (non-causal) and 128 (causal), as `compiled`, and
    the warp-specialised pair (variant="ws") beside them."""
    if hopper_gluon._MISSING:
        pytest.skip(f"cannot compile the Gluon sm_90 backward here: {hopper_gluon._MISSING}")
    return compiled_outside_interpreter(COMPILE_BACKWARD, timeout=300)


def test_backward_compiles_for_sm90a(compiled_backward):
    """Both backward kernels lower to sm_90a wgmma fed by 4-d TMA copies completing on mbarriers, without spills and
    within H100's shared memory. dK/dV: S and dP with both operands in shared memory, dV += P^F^T dO and dK += dS^T Q^F
    reading both operands transposed from shared memory (wgmma's transpose flags), phi(P~) in registers (the e4m3
    cast of the block scales, packed bf16 e2m1 rounding) with no shuffle for it (each 16-key block in one thread).
    dQ: dQ += dS K^F with dS from registers, no phi, and dQ out by a TMA store."""
    for key, kernel in compiled_backward.items():
        head_dim = int(key.split(",")[0])
        ptx = kernel["ptx"]
        assert ".target sm_90a" in ptx
        assert re.search(r"cp\.async\.bulk\.tensor\.4d\.shared::\w+\.global\.mbarrier::complete_tx::bytes", ptx)
        assert kernel["shared"] <= H100_SHARED_BYTES
        if key.endswith("_ws"):
            _assert_ws_kernel(key, head_dim, ptx, kernel["usage"])
            # ptxas did not serialise the wgmmas (its advisory C7515 puts a full wait after every one): per consumer
            # two full waits, dK/dV's for S (with the last step's dV, dK) and after the loop, dQ's for dP and dQ
            assert kernel["hgmma"] >= 24 and kernel["full_waits"] <= 4, (key, kernel["hgmma"], kernel["full_waits"])
            continue
        assert re.fullmatch(r"REG:\d+ STACK:0 SHARED:\d+ LOCAL:0", kernel["usage"]), (key, kernel["usage"])
        if key.endswith("dkdv"):
            block_m, block_n, warps = hopper_gluon.BWD_DKDV_CONFIG[head_dim]
            # S, dP: (queries, keys) from shared memory, untransposed (K^F, V^F read as K-major B)
            scores = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{block_n}k16\.f32\.bf16\.bf16 \{{[^}}]*\}}, "
                                r"%rd\d+, %rd\d+, [^;]*, 0, 0;", ptx)
            assert len(scores) == 2 * head_dim // 16
            # dV, dK: (keys, head_dim split over the warpgroups) over block_m queries, A and B both transposed
            n_kv = head_dim // (warps // min(warps, block_n // 16))
            grads = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{n_kv}k16\.f32\.bf16\.bf16 \{{[^}}]*\}}, "
                               r"%rd\d+, %rd\d+, [^;]*, 1, 1;", ptx)
            assert len(grads) == 2 * block_m // 16
            assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "fma.rn.bf16x2" in ptx
            assert ptx.count("shfl.sync") <= 3  # the TMA issue's leader election, not phi: no butterfly reductions
            assert "shfl.sync.bfly" not in ptx
        else:
            block_m, block_n, warps = hopper_gluon.BWD_DQ_CONFIG[head_dim]
            assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{head_dim}k16\.f32\.bf16\.bf16 "
                             r"\{[^}]*\}, \{%r\d+,%r\d+,%r\d+,%r\d+\}", ptx)  # dS from registers
            assert "cvt.rn.satfinite.e4m3x2.f32" not in ptx
            assert "cp.async.bulk.tensor.4d.global.shared::cta" in ptx


def _assert_ws_kernel(key, head_dim, ptx, usage):
    """A warp-specialised backward kernel (variant="ws"): a one-warp load partition at 24 registers and two consumer
    warpgroups at 240 (setmaxnreg), whose barriers are scoped to one warpgroup (bar.sync id, 128); per consumer S and
    dP (64 queries x 64 keys) from shared memory. dK/dV: dV, dK (64 keys x head_dim) reading P^F and dS transposed
    from shared memory, phi without shuffles. dQ: dQ += dS K^F with dS from registers, out by a TMA store. No local
    memory; Triton 3.6's ptxas keeps one loop-invariant 32-bit value of the causal dK/dV kernel on the stack at
    head_dim 128 (8 bytes: a spill store before the loop, a reload from L1 per step), so a stack of at most 8 bytes."""
    match = re.fullmatch(r"REG:\d+ STACK:(\d+) SHARED:\d+ LOCAL:0", usage)
    assert match and int(match[1]) <= 8, (key, usage)
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+24;", ptx)
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+240;", ptx)
    assert re.search(r"bar\.sync\s+\d+, 128;", ptx)
    scores = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n64k16\.f32\.bf16\.bf16 \{[^}]*\}, %rd\d+, %rd\d+, "
                        r"[^;]*, 0, 0;", ptx)
    assert len(scores) == 2 * 2 * head_dim // 16  # two consumers, S and dP
    if key.endswith("dkdv_ws"):
        grads = re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{head_dim}k16\.f32\.bf16\.bf16 \{{[^}}]*\}}, "
                           r"%rd\d+, %rd\d+, [^;]*, 1, 1;", ptx)
        assert len(grads) == 2 * 2 * 64 // 16  # two consumers, dV and dK over 64 queries
        assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "shfl.sync.bfly" not in ptx
    else:
        assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{head_dim}k16\.f32\.bf16\.bf16 "
                         r"\{[^}]*\}, \{%r\d+,%r\d+,%r\d+,%r\d+\}", ptx)  # dS from registers
        assert "cvt.rn.satfinite.e4m3x2.f32" not in ptx
        assert "cp.async.bulk.tensor.4d.global.shared::cta" in ptx

def test_backward_checks_inputs_first(device):
    """Bad saved tensors are refused by name before the hardware check, on any machine; with good ones, a machine that
    cannot run the kernel says why."""
    q = torch.randn(1, 2, 8, 64, dtype=torch.bfloat16, device=device)
    k = torch.randn(1, 2, 12, 64, dtype=torch.bfloat16, device=device)
    stats = torch.zeros(1, 2, 8, device=device)
    good = dict(do=q, q=q, k=k, qf=q, kf=k, vf=k, o_aux=q, m=stats, l=stats)
    bad = {"kf": k[:, :, :8], "vf": k.transpose(2, 3).contiguous().transpose(2, 3), "m": stats.double(),
           "o_aux": q.float(), "do": q[:, :1]}
    ok, why = hopper_gluon.available()
    for name, t in bad.items():
        with pytest.raises(ValueError, match=f"hopper_attn_qat_backward: {name} must be"):
            hopper_gluon.hopper_attn_qat_backward(**{**good, name: t})
    with pytest.raises(ValueError, match="head_dim 32"):
        x = torch.randn(1, 1, 8, 32, dtype=torch.bfloat16, device=device)
        hopper_gluon.hopper_attn_qat_backward(x, x, x, x, x, x, x, stats[:, :1], stats[:, :1])
    with pytest.raises(ValueError, match="variant 'fast' not in"):
        hopper_gluon.hopper_attn_qat_backward(**good, variant="fast")
    if not ok:
        with pytest.raises(RuntimeError, match=re.escape(why)):
            hopper_gluon.hopper_attn_qat_backward(**good)


def _backward_case(b, h, lq, lk, d, causal, layout, dtype=torch.bfloat16, sm_scale=None):
    """Inputs, dO, the Triton training forward's saved tensors, the Triton backward's gradients on them, and the
    reference's (SPEC §2's backward on the reference forward's O', m, l), fp32."""
    q, k, v = (t.to(dtype) for t in _inputs(b, h, lq, lk, d, layout))
    do = torch.randn(b, h, lq, d, device="cuda").to(dtype)
    scale = d ** -0.5 if sm_scale is None else sm_scale
    _, o_aux, m, l, (qf, kf, vf) = attn_qat_forward(q, k, v, sm_scale=scale, causal=causal, training=True)
    saved = (qf, kf, vf, o_aux, m, l)
    triton_grads = attn_qat_backward(do, q, k, *saved, sm_scale=scale, causal=causal)
    _, r_aux, r_m, r_l = R.attn_qat_forward_ref(q, k, v, sm_scale=sm_scale, causal=causal)
    refs = R.attn_qat_backward_ref(q, k, v, r_aux, do, r_m, r_l, sm_scale=sm_scale, causal=causal)
    return q, k, v, do, saved, triton_grads, refs


@pytest.mark.gpu
@pytest.mark.parametrize("variant", hopper_gluon.BWD_VARIANTS)
@pytest.mark.parametrize("b,h,lq,lk,d,causal,layout", GPU_SHAPES)
def test_gpu_backward_matches_triton_backward_and_reference(b, h, lq, lk, d, causal, layout, variant, poison):
    """The Gluon backward on what the Triton training forward saved: dQ, dK, dV against the Triton backward on the same
    tensors and against the reference, to the Triton backward's own bound against the reference (its GPU tests'),
    in the dtypes and stride orders of q and k; outputs start as NaN (poison), so an unwritten element fails (key
    blocks no query sees when causal with Lq < Lk, ragged tails)."""
    ok, why = hopper_gluon.available()
    if not ok:
        pytest.skip(why)
    q, k, v, do, saved, triton_grads, refs = _backward_case(b, h, lq, lk, d, causal, layout)
    grads = hopper_gluon.hopper_attn_qat_backward(do, q, k, *saved, causal=causal, variant=variant)
    _assert_gradients(grads, triton_grads, refs, (q, k, k))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", hopper_gluon.BWD_VARIANTS)
def test_gpu_backward_fp16_and_sm_scale(variant, poison):
    """fp16 inputs (phi's packed rounding and the dot in f16) and a non-default sm_scale, against both."""
    ok, why = hopper_gluon.available()
    if not ok:
        pytest.skip(why)
    q, k, v, do, saved, triton_grads, refs = _backward_case(1, 2, 300, 333, 128, True, "bhld", torch.float16, 0.3)
    grads = hopper_gluon.hopper_attn_qat_backward(do, q, k, *saved, sm_scale=0.3, causal=True, variant=variant)
    for got, tri, ref in zip(grads, triton_grads, refs):
        assert got.dtype == torch.float16 and torch.isfinite(got).all()
        bound = 2 * rel_err(ref.to(torch.float16), ref) + 2e-3
        assert rel_err(got, ref) <= bound and rel_err(got, tri) <= bound


# ---------------------------------------------------------------------------------------------------
# attn_qat's training step on sm_90: the Gluon backward behind attention(mode="attn_qat")
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cap,warns", [((9, 0), True), ((8, 0), False)])
def test_gluon_sm90_choice_and_its_one_warning(cap, warns, monkeypatch):
    """The decision kernels.api takes per call: the Gluon backward where it can run, unless ATTNQAT_GLUON=0; where
    an sm_90 GPU cannot run it (Triton < 3.6), a warning names why (elsewhere the Triton path is simply the path)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    dev = torch.device("cuda")
    monkeypatch.setattr(hopper_gluon, "available", lambda device=None: (True, "Gluon sm_90 forward available"))
    assert hopper_gluon.gluon_sm90(dev) == (True, "Gluon sm_90 forward available")
    monkeypatch.setenv(hopper_gluon.GLUON_ENV, "0")
    assert hopper_gluon.gluon_sm90(dev) == (False, "ATTNQAT_GLUON=0")
    monkeypatch.delenv(hopper_gluon.GLUON_ENV)
    monkeypatch.setenv("ATTNQAT_DQ_CONFIG", "128,64,8,3")  # tuning the Triton kernels asks for those kernels
    assert hopper_gluon.gluon_sm90(dev) == (False, "ATTNQAT_DQ_CONFIG pin the Triton kernels' launch config")
    monkeypatch.setenv("ATTNQAT_FWD_CONFIG", "128,64,8,3")
    assert hopper_gluon.gluon_sm90(dev) == (
        False, "ATTNQAT_FWD_CONFIG and ATTNQAT_DQ_CONFIG pin the Triton kernels' launch config")
    monkeypatch.delenv("ATTNQAT_DQ_CONFIG")
    assert hopper_gluon.gluon_sm90(dev) == (False, "ATTNQAT_FWD_CONFIG pin the Triton kernels' launch config")
    monkeypatch.delenv("ATTNQAT_FWD_CONFIG")
    monkeypatch.setattr(hopper_gluon, "available", lambda device=None: (False, "Triton 3.5.1 lacks Gluon's Hopper API"))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert hopper_gluon.gluon_sm90(dev) == (False, "Triton 3.5.1 lacks Gluon's Hopper API")
    assert len(seen) == warns and all("Triton 3.5.1 lacks" in str(w.message) for w in seen)


@pytest.mark.gpu
def test_gpu_attention_trains_with_the_gluon_kernels(monkeypatch):
    """On an H100/H200, attention(mode="attn_qat") trains at head_dim 128 with the warp-specialised Gluon forward and
    backward (each called once per step, and backend_info says so; at 64 with the Triton pair, TRAINING_HEAD_DIMS), and its output and gradients are the Triton path's bit for bit
    (ATTNQAT_GLUON=0 runs that one); p_bwd="normalized" keeps the Triton kernels."""
    from attnqat.kernels import attention, backend_info

    ok, why = hopper_gluon.available()
    if not ok:
        pytest.skip(why)
    calls = []
    for name in ("hopper_attn_qat_forward", "hopper_attn_qat_backward"):
        real = getattr(hopper_gluon, name)
        monkeypatch.setattr(hopper_gluon, name, lambda *a, _real=real, _name=name, **kw: calls.append(
            (_name, kw.get("variant"))) or _real(*a, **kw))
    q, k, v = _inputs(1, 2, 300, 333, 128, "bhld")
    do = torch.randn_like(q)

    def step(**options):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        o = attention(*leaves, mode="attn_qat", **options)
        o.backward(do)
        return [o.detach(), *(t.grad for t in leaves)]

    gluon = step()
    assert calls == [("hopper_attn_qat_forward", "ws"), ("hopper_attn_qat_backward", "ws")]
    leaves = [t.detach().clone().requires_grad_() for t in _inputs(1, 2, 300, 333, 64, "bhld")]
    attention(*leaves, mode="attn_qat").backward(torch.randn_like(leaves[0]))
    assert len(calls) == 2 and leaves[0].grad.isfinite().all()  # head_dim 64 trains on the Triton pair
    assert backend_info()["attn_qat_training"] == ("Gluon sm_90 kernels (ws forward, ws backward) at head_dim 128, "
                                                   "triton at the others")
    monkeypatch.setenv(hopper_gluon.GLUON_ENV, "0")
    triton_path = step()
    assert len(calls) == 2 and backend_info()["attn_qat_training"] == "triton (ATTNQAT_GLUON=0)"
    for got, want in zip(gluon, triton_path):
        assert torch.isfinite(got).all() and torch.equal(got, want)
    monkeypatch.delenv(hopper_gluon.GLUON_ENV)
    step(p_bwd="normalized")
    assert len(calls) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["nvfp4", "attn_qat", "attn_qat_dropin"])
def test_gpu_fp4_inference_runs_the_gluon_forward(mode, monkeypatch, poison):
    """On an H100/H200 the FP4 inference forward of every FP4 mode (no grad) is the Gluon pingpong forward, called
    once per call (backend_info says so), and its output is the Triton forward's bit for bit at head_dim 128
    (ATTNQAT_GLUON=0 runs that one), in q's stride order (diffusers' (B, L, H, D) layout kept)."""
    from attnqat.kernels import attention, backend_info

    ok, why = hopper_gluon.available()
    if not ok:
        pytest.skip(why)
    calls = []
    real = hopper_gluon.hopper_fp4_attention
    monkeypatch.setattr(hopper_gluon, "hopper_fp4_attention", lambda *a, **kw: calls.append(kw.get("variant")) or
                        real(*a, **kw))
    q, k, v = _inputs(2, 3, 300, 1025, 128, "blhd")
    with torch.no_grad():
        gluon = attention(q, k, v, mode=mode)
        assert calls == ["pingpong"] and backend_info()["fp4_inference"] == \
            "Gluon sm_90 forward (pingpong) at head_dim 128, triton at the others"
        attention(*(t[..., :64] for t in (q, k, v)), mode=mode)  # head_dim 64: the Triton forward, faster there
        assert calls == ["pingpong"]
        monkeypatch.setenv(hopper_gluon.GLUON_ENV, "0")
        triton_out = attention(q, k, v, mode=mode)
    assert len(calls) == 1 and backend_info()["fp4_inference"] == "triton (ATTNQAT_GLUON=0)"
    assert gluon.stride() == triton_out.stride() == torch.empty_like(q).stride()
    assert torch.isfinite(gluon).all() and torch.equal(gluon, triton_out)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("mode", ["nvfp4", "attn_qat"])
def test_gpu_forward_with_lse_runs_the_gluon_forward(mode, causal, monkeypatch, poison):
    """attention_with_lse (ring attention's forward) of the FP4 modes on an H100/H200 runs the Gluon forward with
    its row statistics at head_dim 128 (once per call) and the Triton one at 64; its output equals the Triton
    path's (ATTNQAT_GLUON=0) bit for bit and its log-sum-exp to fp32 rounding, on ragged Lq != Lk; and the
    log-sum-exp is the reference's."""
    from attnqat.kernels.api import attention_with_lse

    ok, why = hopper_gluon.available()
    if not ok:
        pytest.skip(why)
    calls = []
    real = hopper_gluon.hopper_fp4_attention
    monkeypatch.setattr(hopper_gluon, "hopper_fp4_attention", lambda *a, **kw: calls.append(kw.get("return_stats"))
                        or real(*a, **kw))
    q, k, v = _inputs(2, 3, 300, 1025, 128, "blhd")
    with torch.no_grad():
        o, lse = attention_with_lse(q, k, v, mode=mode, causal=causal)
        assert calls == [True]
        attention_with_lse(*(t[..., :64] for t in (q, k, v)), mode=mode, causal=causal)
        assert calls == [True]
        monkeypatch.setenv(hopper_gluon.GLUON_ENV, "0")
        t_o, t_lse = attention_with_lse(q, k, v, mode=mode, causal=causal)
    assert len(calls) == 1
    assert torch.isfinite(o).all() and torch.equal(o, t_o)
    assert lse.shape == t_lse.shape == q.shape[:3] and lse.dtype == torch.float32
    torch.testing.assert_close(lse, t_lse, rtol=0, atol=1e-5)
    # the exact log-sum-exp of the scaled logits over phi(Q), phi(K), in float64
    qf, kf = (R.fake_quant_nvfp4_ref(t.float()).double() for t in (q, k))
    logits = qf @ kf.transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:  # top-left: query i sees keys 0..i
        logits = logits.masked_fill(torch.ones(300, 1025, dtype=torch.bool, device=q.device).triu(1), -float("inf"))
    torch.testing.assert_close(lse.double(), torch.logsumexp(logits, -1), rtol=0, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["fp4_fwd_sm90", "fp4_fwd_stats_sm90", "attn_qat_fwd_sm90"])
def test_gpu_forward_op_passes_opcheck(op):
    """attnqat::fp4_fwd_sm90 (the FP4 inference forward), attnqat::fp4_fwd_stats_sm90 (the same with m and l) and
    attnqat::attn_qat_fwd_sm90 (the training forward): schema, their fakes against the real outputs (q in
    diffusers' (B, L, H, D) layout)."""
    ok, why = hopper_gluon.available()
    if not ok:
        pytest.skip(why)
    q, k, v = _inputs(1, 2, 96, 160, 64, "blhd")
    torch.library.opcheck(getattr(hopper_gluon, op), (q, k, v, 0.125, True))


@pytest.mark.gpu
def test_gpu_backward_op_passes_opcheck():
    """attnqat::attn_qat_bwd_sm90, the custom op autograd and torch.compile see: schema (no mutation, no aliasing),
    its fake against the real outputs (shapes, dtypes, strides: q in diffusers' (B, L, H, D) layout as a transposed
    view), AOTAutograd."""
    ok, why = hopper_gluon.available()
    if not ok:
        pytest.skip(why)
    q, k, v = _inputs(1, 2, 96, 160, 64, "blhd")
    o, o_aux, m, l, (qf, kf, vf) = attn_qat_forward(q, k, v, sm_scale=0.125, causal=True, training=True)
    torch.library.opcheck(hopper_gluon.attn_qat_bwd_sm90, (torch.randn_like(o), q, k, qf, kf, vf, o_aux, m, l, 0.125,
                                                          True))


@pytest.mark.gpu
@pytest.mark.parametrize("d", [128, 64])  # the Gluon pair (TRAINING_HEAD_DIMS), the Triton pair
def test_gpu_checkpointed_attention_runs_the_inference_forward_first_with_the_same_gradients(d):
    """Under the training loop's block checkpoint (student_teacher.block_checkpoint), attention(mode="attn_qat")'s
    first pass runs the FP4 inference forward and the backward's recompute the training forward
    (kernels._common.saved_tensors_recomputed): the output and the gradients equal an unchecked step's bit for
    bit, which holds only if the inference and training forwards give the same O on the GPU."""
    from attnqat.kernels import attention
    from attnqat.train.student_teacher import block_checkpoint

    ok, why = hopper_gluon.available()
    if not ok:
        pytest.skip(why)
    torch.manual_seed(0)
    proj = torch.nn.Linear(d, 3 * d, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2, 3, 700, d, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2, 3, 700, d, device="cuda", dtype=torch.bfloat16)

    class Block(torch.nn.Module):
        def forward(self, x):
            return attention(*proj(x).chunk(3, dim=-1), mode="attn_qat")

    def run(checkpointed):
        proj.zero_grad(set_to_none=True)
        leaf = x.clone().requires_grad_()
        out = block_checkpoint(False)(Block(), leaf) if checkpointed else Block()(leaf)
        (out.float() * w).sum().backward()
        return [out.detach(), leaf.grad, proj.weight.grad.clone()]

    for got, want in zip(run(True), run(False)):
        assert torch.isfinite(got).all() and torch.equal(got, want)
