"""The FP4 modes' four_over_six option (docs/kernels.md, "Four Over Six"): each block of 16 of Q, K and V takes the
scale e4m3(amax / 6) or e4m3(amax / 4), whichever quantizes the block with the smaller squared error; P keeps SPEC §1's
scale. The scale rule against a brute force written here, the phi pre-pass and the attention kernels (Triton's
interpreter) against the reference, the dispatch, and a compiled GPU test."""
import itertools
import types

import pytest
import torch

from attnqat.kernels import api, attention, describe_qk_options
from attnqat.kernels import reference as R
from attnqat.kernels.attn_qat import attn_qat_forward, nvfp4_attention
from attnqat.kernels.formats import E2M1_GRID
from attnqat.kernels.nvfp4 import dequantize_nvfp4, quantize_heads
from conftest import check_dropin_against_reference, fp4_rounding_ties, rel_err

GRID = sorted({abs(g) for g in E2M1_GRID})  # 0, 0.5, ..., 6


def e4m3_values() -> list[float]:
    """Every finite non-negative float8_e4m3fn value, from its 127 bit patterns."""
    bits = torch.arange(0, 127, dtype=torch.uint8)
    return bits.view(torch.float8_e4m3fn).float().tolist()


def brute_force_block(block: list[float], top: float) -> tuple[float, list[float]]:
    """(scale, quantized values) of one block with its largest magnitude mapped to ``top``, from first principles:
    the scale is the e4m3 value nearest amax / top (ties to the even pattern, as SPEC §1), each value the grid point
    times it nearest to value / scale (ties to the even code: the grid's even indices)."""
    amax = max(abs(x) for x in block)
    target = amax / top
    values = e4m3_values()
    best = min(range(len(values)), key=lambda i: (abs(values[i] - target), i % 2))
    s = values[best]
    if s == 0:
        return 0.0, [0.0] * len(block)
    out = []
    for x in block:
        y = abs(x) / s
        i = min(range(len(GRID)), key=lambda j: (abs(GRID[j] - y), j % 2))
        out.append(GRID[i] * s * (1 if x >= 0 else -1))
    return s, out


def shared_draw(b, h, lq, lk, d, *, seed, causal=False, q_smoothing=False):
    """Gaussian Q, K, V in bf16 drawn again while FP4 rounding would meet a tie with the option on (as
    tests/test_q_smoothing.py: conftest.fp4_rounding_ties)."""
    g = torch.Generator().manual_seed(seed)
    while True:
        q, k, v = (torch.randn(b, h, n, d, generator=g).to(torch.bfloat16) for n in (lq, lk, lk))
        if not fp4_rounding_ties(q, k, causal=causal, q_smoothing=q_smoothing, four_over_six=True):
            return q, k, v


def bound(ref):
    return 2 * rel_err(ref.to(torch.bfloat16), ref) + 1e-6


# --- The scale rule -------------------------------------------------------------------------------------------


def test_reference_picks_the_better_of_the_two_scales_block_by_block():
    """Against the brute force: each block's result is the one of its two quantizations (max to 6, max to 4) with
    the smaller squared error (6 on equal errors); so never worse than SPEC §1's, and often better."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 16, generator=g) * torch.rand(40, 1, generator=g) * 3
    x[0] = torch.tensor([5.0] * 8 + [4.0] * 8)  # 4 falls between grid points scaled to 6 (3.25, 4.875), not to 4
    x[1] = torch.tensor([6.0, 3.0, 1.5, 0.5] * 4)  # on the grid with max 6: exact at 6
    got = R.fake_quant_nvfp4_ref(x, four_over_six=True)
    took_four = 0
    for row, out in zip(x.tolist(), got):
        (_, q6), (_, q4) = brute_force_block(row, 6.0), brute_force_block(row, 4.0)
        e6 = sum((a - b) ** 2 for a, b in zip(q6, row))
        e4 = sum((a - b) ** 2 for a, b in zip(q4, row))
        want = q4 if e4 < e6 else q6
        took_four += e4 < e6
        assert out.tolist() == pytest.approx(want, abs=0), row
    assert torch.equal(got[1], x[1]) and not torch.equal(got[0], R.fake_quant_nvfp4_ref(x[:1])[0])
    assert 5 < took_four < 35  # both scales occur
    err = lambda y: (y - x).square().sum(-1)  # noqa: E731
    assert (err(got) <= err(R.fake_quant_nvfp4_ref(x))).all()


def test_reference_rule_with_more_maxima_takes_the_best_of_them_in_order():
    """four_over_six_scale's ``tops`` (the experiments' wider search): each block's scale is, of the brute force's
    scales for those maxima, the first with the least squared error; (6, 4) is the option's rule exactly."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(60, 16, generator=g) * torch.rand(60, 1, generator=g) * 3
    tops = (6.0, 5.5, 5.0, 4.5, 4.0, 3.5, 3.0)
    got = R.four_over_six_scale(x, tops=tops)[:, 0]
    picked = set()
    for row, s in zip(x.tolist(), got.tolist()):
        tried = [brute_force_block(row, t) for t in tops]
        errs = [sum((a - b) ** 2 for a, b in zip(q, row)) for _, q in tried]
        first_best = min(range(len(tops)), key=lambda i: (errs[i], i))
        assert s == tried[first_best][0], row
        picked.add(first_best)
    assert len(picked) >= 4  # several maxima win somewhere
    assert torch.equal(R.four_over_six_scale(x, tops=(6.0, 4.0)), R.four_over_six_scale(x))
    err = lambda y: (y - x).square().sum(-1)  # noqa: E731
    wide = R._quantize_blocks(x, R.four_over_six_scale(x, tops=tops))
    two = R.fake_quant_nvfp4_ref(x, four_over_six=True)
    assert (err(wide) <= err(two)).all() and (err(wide) < err(two)).any()


def test_reference_keeps_non_finite_and_zero_blocks():
    """NaN in, NaN out (the whole block); inf too; an all-zero block stays zero; along any dim."""
    x = torch.randn(3, 32)
    x[0, 3], x[1, 20], x[2, :16] = float("nan"), float("inf"), 0.0
    got = R.fake_quant_nvfp4_ref(x, four_over_six=True)
    assert got[0, :16].isnan().all() and got[0, 16:].isfinite().all()
    assert got[1, 16:].isnan().all() and got[1, :16].isfinite().all()
    assert (got[2, :16] == 0).all()
    assert torch.equal(R.fake_quant_nvfp4_ref(x.T, dim=0, four_over_six=True).T.nan_to_num(7.0), got.nan_to_num(7.0))


# --- The phi pre-pass (Triton under the interpreter) ----------------------------------------------------------


@pytest.mark.parametrize("layout", ["plain", "packed", "key_tile", "block_mean"])
def test_pre_pass_matches_reference(layout, poison):
    """quantize_heads(four_over_six=True) in each layout against the reference (its choice compares float32 sums of
    squares in another order: none of these draws sits that close to a tie, so they agree exactly)."""
    x = (torch.randn(1, 2, 96, 64) * torch.rand(1, 2, 96, 1) * 4).to(torch.bfloat16)
    x[0, 0, 5, 16:32] = float("nan")
    want = R.fake_quant_nvfp4_ref(x.float(), four_over_six=True)
    if layout == "plain":
        got = quantize_heads(x, torch.float32, four_over_six=True)
    elif layout == "packed":
        got = dequantize_nvfp4(*quantize_heads(x, torch.float32, packed=True, four_over_six=True)).float()
    elif layout == "key_tile":
        got, tiles = quantize_heads(x, torch.float32, key_tile=64, both_orders=True, four_over_six=True)
        # the tile layout holds each 64-row tile's rows in another order (test_nvfp4 checks the order): per tile
        # the same values, with zero rows for the keys past L
        padded = torch.nn.functional.pad(want, (0, 0, 0, 128 - 96))
        assert tiles.shape == padded.shape
        for t in range(2):
            a, b = (y[:, :, 64 * t:64 * (t + 1)].nan_to_num(7.0).flatten().sort().values for y in (tiles, padded))
            assert torch.equal(a, b)
    else:
        got, mean = quantize_heads(x, torch.float32, block_mean=32, four_over_six=True)
        rows = mean.repeat_interleave(32, dim=2)
        want = R.fake_quant_nvfp4_ref(x.float() - rows, four_over_six=True)
    assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))
    assert got[0, 0, 5, 16:32].isnan().all() and not got[0, 0, 5, :16].isnan().any()
    if layout == "plain":
        assert not torch.equal(got.nan_to_num(7.0), quantize_heads(x, torch.float32).nan_to_num(7.0))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("packed", [False, True])
def test_pre_pass_wider_search_matches_reference(packed, device, monkeypatch, poison):
    """The kernels' second search (nvfp4.FOUR_OVER_SIX_SEARCHES: 6 down to 3 in steps of 0.5, what experiments set
    through nvfp4.four_over_six_tops) against the reference's rule with those maxima; NaN kept to its block; other
    maxima are refused by name (the reference alone tries any)."""
    from attnqat.kernels import nvfp4

    x = (torch.randn(1, 2, 96, 64) * torch.rand(1, 2, 96, 1) * 4).to(torch.bfloat16)
    x[0, 1, 7, 32:48] = float("nan")
    wide = nvfp4.FOUR_OVER_SIX_SEARCHES[1]
    xb = x.float().reshape(1, 2, 96, 4, 16)
    want = R._quantize_blocks(xb, R.four_over_six_scale(xb, tops=wide)).reshape(x.shape)
    x = x.to(device)
    run = (lambda: dequantize_nvfp4(*quantize_heads(x, torch.float32, packed=True, four_over_six=True)).float()) \
        if packed else (lambda: quantize_heads(x, torch.float32, four_over_six=True))
    two = run()
    monkeypatch.setattr(nvfp4, "four_over_six_tops", wide)
    got = run().cpu()
    two = two.cpu()
    assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))
    assert got[0, 1, 7, 32:48].isnan().all() and not got[0, 1, 7, :32].isnan().any()
    assert not torch.equal(got.nan_to_num(7.0), two.nan_to_num(7.0))  # the search picks other scales somewhere
    err = lambda y: (y.nan_to_num() - x.cpu().float().nan_to_num()).square().sum()  # noqa: E731
    assert err(got) < err(two)
    monkeypatch.setattr(nvfp4, "four_over_six_tops", (6.0, 5.0))
    with pytest.raises(ValueError, match=r"tries the maxima .* not \(6\.0, 5\.0\)"):
        run()


def test_pre_pass_refuses_tokens():
    with pytest.raises(ValueError, match="four_over_six is along head_dim only"):
        quantize_heads(torch.zeros(1, 1, 16, 64), torch.float32, tokens=True, four_over_six=True)


# --- The attention kernels against the reference (interpreter) ------------------------------------------------


@pytest.mark.parametrize("causal, q_smoothing", [(False, False), (True, True)])
def test_attn_qat_forward_and_backward_match_reference(causal, q_smoothing, poison):
    """attn_qat with four_over_six (training forward, then the backward, which takes the forward's Q^F, K^F, V^F)
    against the reference, outputs poisoned; and with Q smoothing; and a control: the option moved the output."""
    q, k, v = (t.requires_grad_() for t in shared_draw(1, 2, 160, 96, 64, seed=1, causal=causal,
                                                        q_smoothing=q_smoothing))
    o = attention(q, k, v, "attn_qat", causal=causal, four_over_six=True, q_smoothing=q_smoothing)
    do = torch.randn_like(o)
    o.backward(do)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    ro, ro_aux, rm, rl = R.attn_qat_forward_ref(qd, kd, vd, causal=causal, four_over_six=True, q_smoothing=q_smoothing)
    want = R.attn_qat_backward_ref(qd, kd, vd, ro_aux, do, rm, rl, causal=causal, four_over_six=True,
                                   q_smoothing=q_smoothing)
    assert o.dtype == torch.bfloat16 and rel_err(o, ro) <= bound(ro)
    for got, w in zip((q.grad, k.grad, v.grad), want):
        assert rel_err(got, w) <= bound(w)
    plain = R.attn_qat_forward_ref(qd, kd, vd, causal=causal, q_smoothing=q_smoothing)[0]
    assert rel_err(o, plain) > 10 * bound(ro)


def test_inference_forward_and_reference_modes_agree(poison):
    """nvfp4 (the inference forward at head_dim 128, Lq != Lk): the kernel's m exactly and O to fp32 rounding; the
    registry's reference paths (CPU without the interpreter) give the same; dropin's forward is nvfp4's."""
    q, k, v = shared_draw(1, 1, 130, 80, 128, seed=2)
    ro, _, rm, rl = R.attn_qat_forward_ref(q, k, v, training=False, four_over_six=True)
    o, _, m, l, _ = attn_qat_forward(q, k, v, sm_scale=128 ** -0.5, causal=False, training=False, four_over_six=True)
    assert torch.equal(m, rm) and rel_err(o, ro) < 1e-5 and rel_err(l, rl) < 1e-5
    with torch.no_grad():
        out = nvfp4_attention(q, k, v, four_over_six=True)
        assert rel_err(out, ro) <= bound(ro)
        assert torch.equal(R.nvfp4_attention_ref(q, k, v, four_over_six=True), ro.to(torch.bfloat16))
        assert torch.equal(attention(q, k, v, "attn_qat_dropin", four_over_six=True), out)


def test_dropin_trains_with_it_and_nan_stays_visible(poison):
    """attn_qat_dropin under grad (interpreter): the option's FP4 forward, the reference's high-precision backward;
    and a NaN in one query row of attn_qat comes out as NaN in that row's output, not a finite value."""
    q, k, v = shared_draw(1, 1, 130, 64, 64, seed=8)
    check_dropin_against_reference(*(t.clone().requires_grad_() for t in (q, k, v)), four_over_six=True)
    bad = q.clone()
    bad[0, 0, 7, 3] = float("nan")
    with torch.no_grad():
        out = attention(bad, k, v, "attn_qat", four_over_six=True)
    assert out[0, 0, 7].isnan().all() and out[0, 0, :7].isfinite().all() and out[0, 0, 8:].isfinite().all()


def test_lowers_fp4_error_on_gaussian_inputs():
    """What the option is for: the FP4 forward nearer exact attention (float32 inputs, reference path). Measured
    here: 0.189 -> 0.176 relative error (P keeps SPEC §1's scales)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 256, 64, generator=g) for _ in range(3))
    exact = R.attention_fp32(q.double(), k.double(), v.double())
    plain = rel_err(R.nvfp4_attention_ref(q, k, v), exact)
    fos = rel_err(R.nvfp4_attention_ref(q, k, v, four_over_six=True), exact)
    assert fos < 0.96 * plain, (fos, plain)


def test_composes_with_rotation_and_the_smoothings():
    """Every combination with the other Q/K options runs, through the registry on the CPU reference, and says so."""
    q, k, v = (torch.randn(1, 2, 40, 64) for _ in range(3))
    for rot, ks, qs in itertools.product(("none", "hadamard"), (False, True), (False, True)):
        options = dict(qk_rotation=rot, k_smoothing=ks, q_smoothing=qs, four_over_six=True)
        with torch.no_grad():
            out = attention(q, k, v, "nvfp4", **options)
        assert out.isfinite().all()
        assert describe_qk_options(options)[-1] == "Q, K, V block scales: Four Over Six"


def test_bad_values_are_refused():
    q = torch.randn(1, 1, 16, 64)
    with pytest.raises(ValueError, match="four_over_six"):
        attention(q, q, q, "nvfp4", four_over_six="yes")
    with pytest.raises(ValueError, match="takes no options"):
        attention(q, q, q, "bf16", four_over_six=True)


@pytest.mark.parametrize("forward", ["inference", "training"])
def test_gluon_forwards_launch_on_the_options_pre_pass(forward, monkeypatch, poison):
    """The Gluon sm_90 forwards share the pre-pass: with the option their kernel receives Four Over Six's Q^F and
    K^F, V^F in tile order (the launch replaced by a spy: the kernel itself needs an H100 / H200; it is unchanged),
    and the training forward returns the keys-in-order K^F, V^F its backward takes."""
    from attnqat.kernels import hopper_gluon

    seen = []
    monkeypatch.setattr(hopper_gluon, "_check", lambda *a, **kw: None)
    monkeypatch.setattr(hopper_gluon, "_launch", lambda qf, kf, vf, *a, **kw: seen.append((qf, kf, vf)) or kw["out"])
    q, k, v = shared_draw(1, 2, 130, 100, 128, seed=6)
    training = forward == "training"
    block_n = hopper_gluon._fwd_config("default", 128, training=training)[1]
    if training:
        *_, (qf, kf, vf) = hopper_gluon.hopper_attn_qat_forward(q, k, v, four_over_six=True)
        for got, x in ((qf, q), (kf, k), (vf, v)):
            assert torch.equal(got, R.fake_quant_nvfp4_ref(x.float(), four_over_six=True).to(x.dtype))
    else:
        hopper_gluon.hopper_fp4_attention(q, k, v, four_over_six=True)
    (qf, k_tiles, v_tiles), = seen
    assert torch.equal(qf, quantize_heads(q, q.dtype, four_over_six=True))
    for got, x in ((k_tiles, k), (v_tiles, v)):
        assert torch.equal(got, quantize_heads(x, x.dtype, key_tile=block_n, four_over_six=True))
        assert not torch.equal(got, quantize_heads(x, x.dtype, key_tile=block_n))


def test_dispatch_hands_the_option_to_the_gluon_path(monkeypatch):
    """Where the Gluon sm_90 kernels run (a stand-in says so), the inference forward and training get four_over_six;
    q_smoothing still sends both to the Triton kernels."""
    monkeypatch.setattr(api.hopper_gluon, "gluon_sm90", lambda device: (True, ""))
    fake = types.SimpleNamespace(is_cuda=True, shape=(1, 1, 8, 128), device="cuda")
    assert api._gluon_fp4_inference(fake) and not api._gluon_fp4_inference(fake, q_smoothing=True)
    calls = []
    monkeypatch.setattr(api, "_gluon_fp4_inference", lambda q, q_smoothing=False: True)
    monkeypatch.setattr(api.hopper_gluon, "fp4_fwd_sm90", lambda *a: calls.append(("infer", a[-1])))
    monkeypatch.setattr(api, "_gluon_sm90", lambda q, dims, q_smoothing: True)
    monkeypatch.setattr(api.hopper_gluon.HopperAttnQATFunction, "apply", lambda *a: calls.append(("train", a[-1])))
    q = torch.randn(1, 1, 8, 128, dtype=torch.bfloat16, requires_grad=True)
    with torch.no_grad():
        api._fp4_inference(q, q, q, four_over_six=True)
    api._attn_qat_kernel(q, q, q, four_over_six=True)
    assert calls == [("infer", True), ("train", True)]


def test_forward_op_with_four_over_six_passes_opcheck():
    """attnqat::attn_qat_fwd with four_over_six=True: schema, fake against real outputs, AOTAutograd."""
    from attnqat.kernels.attn_qat import attn_qat_fwd

    q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in shared_draw(1, 1, 40, 40, 64, seed=4))
    torch.library.opcheck(attn_qat_fwd, (q, k, v, 0.125, False, True, False, True))


@pytest.mark.gpu
@pytest.mark.parametrize("q_smoothing", [False, True])
def test_gpu_matches_reference(q_smoothing, poison):
    """Compiled kernels (head_dim 128, a partial last block) against the reference, forward and backward, with the
    option (and Q smoothing): the training path and the inference forward."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 1000, 128, generator=g).to(torch.bfloat16).cuda().requires_grad_()
               for _ in range(3))
    opts = dict(four_over_six=True, q_smoothing=q_smoothing)
    o = attention(q, k, v, "attn_qat", **opts)
    do = torch.randn_like(o)
    o.backward(do)
    cpu = [t.detach().float().cpu() for t in (q, k, v, do)]
    ro, ro_aux, rm, rl = R.attn_qat_forward_ref(*cpu[:3], **opts)
    want = R.attn_qat_backward_ref(*cpu[:3], ro_aux, cpu[3], rm, rl, **opts)
    assert rel_err(o.float().cpu(), ro) < 5e-3
    for got, w in zip((q.grad, k.grad, v.grad), want):
        assert rel_err(got.float().cpu(), w) < 1e-2
    with torch.no_grad():
        assert rel_err(attention(q, k, v, "nvfp4", **opts).float().cpu(), ro) < 5e-3
