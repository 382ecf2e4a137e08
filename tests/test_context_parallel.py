"""Context parallelism of patched attention (attnqat/pipelines/context_parallel.py), on CPU.

- Refusals: unit tests on stand-in configs (no process group).
- Two gloo processes (forked by torch.multiprocessing, world 2): diffusers' templated Ulysses and ring functions with
  attnqat's op on sequence shards equal the one-process result (Ulysses: forward and backward, bf16 and
  attn_qat; ring: inference, bf16 / nvfp4 / attn_qat, equal up to fp32 rounding thanks to the FP4 modes'
  integer running max) — there the config is set up by hand on a CPU device mesh, as ``enable_parallelism``
  does — and so does a whole tiny patched Wan transformer under diffusers' own ``enable_parallelism``
  (forward; for Ulysses also the parameter gradients), called through ``enable_context_parallel``, which makes
  ``torch.accelerator.device_count()`` 1 for the call on a CPU-only torch (``enable_parallelism`` takes
  ``rank % device_count()``, 0 there).
"""
from __future__ import annotations

import os
import tempfile
import traceback
from types import SimpleNamespace

import pytest
import torch

from attnqat.pipelines.context_parallel import check_context_parallel, context_parallel_attention
from conftest import free_port, run_forked


# --------------------------------------------------------------------------------------------------
# Refusals
# --------------------------------------------------------------------------------------------------


def _cfg(ring=1, ulysses=1, mesh=None, **kw):
    r, u = mesh or (ring, ulysses)
    return SimpleNamespace(context_parallel_config=SimpleNamespace(
        ring_degree=ring, ulysses_degree=ulysses, ulysses_anything=False, ring_anything=False,
        _ring_mesh=SimpleNamespace(size=lambda: r), _ulysses_mesh=SimpleNamespace(size=lambda: u), **kw))


def _refusal(cfg, **kw) -> str:
    args = dict(heads=12, mode="bf16", needs_grad=False) | kw
    with pytest.raises(ValueError) as e:
        check_context_parallel(cfg, **args)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_ulysses_degree_must_divide_heads():
    msg = _refusal(_cfg(ulysses=8), heads=12)
    assert "ulysses_degree 8" in msg and "12 attention heads" in msg
    msg = _refusal(_cfg(ulysses=3), heads=40)
    assert "ulysses_degree 3" in msg and "40 attention heads" in msg
    check_context_parallel(_cfg(ulysses=4), heads=12, mode="attn_qat", needs_grad=True)
    check_context_parallel(_cfg(ulysses=8), heads=40, mode="sagebwd", needs_grad=True)


def test_ring_refuses_training_and_modes_without_lse():
    msg = _refusal(_cfg(ring=2), mode="attn_qat", needs_grad=True)
    assert "ring" in msg and "'attn_qat'" in msg and "inference-only" in msg
    msg = _refusal(_cfg(ring=2), mode="bf16", needs_grad=True)
    assert "inference-only" in msg
    for mode in ("sage3", "sagebwd"):
        msg = _refusal(_cfg(ring=2), mode=mode)
        assert f"{mode!r}" in msg and "log-sum-exp" in msg
    for mode in ("bf16", "nvfp4", "attn_qat", "attn_qat_dropin"):
        check_context_parallel(_cfg(ring=2), heads=12, mode=mode, needs_grad=False)


def test_ring_refuses_k_smoothing_and_ulysses_takes_it():
    """K-smoothing subtracts the mean of all keys, which a ring chunk does not have: refused before any chunk runs;
    Ulysses keeps each head's whole sequence and takes it."""
    msg = _refusal(_cfg(ring=2), mode="nvfp4", options={"k_smoothing": True})
    assert "cannot run K-smoothing" in msg and "ulysses_degree" in msg and "k_smoothing=False" in msg
    check_context_parallel(_cfg(ring=2), heads=12, mode="nvfp4", needs_grad=False, options={"k_smoothing": False})
    check_context_parallel(_cfg(ulysses=2), heads=12, mode="attn_qat", needs_grad=True,
                           options={"k_smoothing": True, "qk_rotation": "hadamard"})


def test_world_size_mismatch_and_unsupported_layouts():
    assert "world size mismatch" in _refusal(_cfg(ulysses=2, mesh=(1, 4)))
    assert "never set up" in _refusal(SimpleNamespace(context_parallel_config=SimpleNamespace(
        ring_degree=1, ulysses_degree=2, _ring_mesh=None, _ulysses_mesh=None)))
    assert "together" in _refusal(_cfg(ring=2, ulysses=2))
    cfg = _cfg(ulysses=2)
    cfg.context_parallel_config.ulysses_anything = True
    assert "ulysses_anything" in _refusal(cfg)


def test_causal_refused():
    q = torch.randn(1, 8, 2, 64)
    with pytest.raises(ValueError, match="causal"):
        context_parallel_attention(q, q, q, "bf16", parallel_config=_cfg(ulysses=2), is_causal=True)


# --------------------------------------------------------------------------------------------------
# Two gloo processes
# --------------------------------------------------------------------------------------------------

WORLD = 2


def _setup(rank: int, ring: int, ulysses: int):
    from diffusers import ContextParallelConfig
    from diffusers.models._modeling_parallel import ParallelConfig
    from torch.distributed.device_mesh import init_device_mesh

    cp = ContextParallelConfig(ring_degree=ring, ulysses_degree=ulysses)
    mesh = init_device_mesh("cpu", cp.mesh_shape, mesh_dim_names=cp.mesh_dim_names)
    config = ParallelConfig(context_parallel_config=cp)
    config.setup(rank, WORLD, torch.device("cpu"), mesh=mesh)
    return config


def _inputs(seed: int, s: int = 128, h: int = 4, d: int = 64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, s, h, d, generator=g) for _ in range(4)]  # q, k, v, grad_out in (B, S, H, D)


def _one_process(mode, q, k, v, do=None):
    from attnqat.kernels.api import attention

    if do is None:
        with torch.no_grad():
            return attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mode).transpose(1, 2), None
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = attention(*(x.transpose(1, 2) for x in leaves), mode).transpose(1, 2)
    out.backward(do)
    return out.detach(), [x.grad for x in leaves]


def _check_attention(rank: int, results: dict):
    for layout, (ring, ulysses), cases in (
            ("ulysses", (1, 2), [("bf16", True), ("attn_qat", True), ("nvfp4", False), ("sage3", False)]),
            ("ring", (2, 1), [("bf16", False), ("nvfp4", False), ("attn_qat", False)])):
        config = _setup(rank, ring, ulysses)
        for i, (mode, grad) in enumerate(cases):
            q, k, v, do = _inputs(seed=i)
            ref, ref_grads = _one_process(mode, q, k, v, do if grad else None)
            shard = lambda x: x.chunk(WORLD, dim=1)[rank]  # noqa: E731 - sequence shard, as the CP hooks do
            leaves = [shard(x).clone().requires_grad_(grad) for x in (q, k, v)]
            with torch.set_grad_enabled(grad):
                out = context_parallel_attention(*leaves, mode, parallel_config=config)
            key = f"{layout}/{mode}"
            results[key] = [(out.detach() - shard(ref)).abs().max().item()]
            if grad:
                out.backward(shard(do))
                results[key] += [(x.grad - shard(g)).abs().max().item() for x, g in zip(leaves, ref_grads)]
        if ring > 1:  # training under ring: refused in one line, before any communication
            q = _inputs(0)[0].chunk(WORLD, dim=1)[rank].requires_grad_()
            try:
                context_parallel_attention(q, q, q, "attn_qat", parallel_config=config)
            except ValueError as e:
                results["ring/train"] = str(e)


def _tiny_wan(heads: int = 4):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=64,
                                 in_channels=4, out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64,
                                 num_layers=2, rope_max_seq_len=64).eval()


def _wan_inputs():
    g = torch.Generator().manual_seed(1)
    return dict(hidden_states=torch.randn(1, 4, 2, 8, 8, generator=g), timestep=torch.tensor([500]),
                encoder_hidden_states=torch.randn(1, 16, 32, generator=g), return_dict=False)


def _check_model(rank: int, results: dict):
    """A tiny patched Wan through diffusers' own ``enable_parallelism`` (via ``enable_context_parallel``: its one
    accelerator lookup, ``rank % torch.accelerator.device_count()``, is given a count of 1, the CPU is the
    device), against the same model unsharded: output, and for Ulysses the parameter gradients (summed over ranks)."""
    from attnqat.pipelines import context_parallel as cp_module
    from attnqat.pipelines import patch_attention
    from attnqat.pipelines import processor as processor_module

    calls = []
    original = processor_module.context_parallel_attention  # the name the processor calls
    processor_module.context_parallel_attention = lambda *a, **kw: calls.append(1) or original(*a, **kw)
    try:
        cases = (("ulysses", (1, 2), "attn_qat", False), ("ring", (2, 1), "nvfp4", False),
                 ("ulysses", (1, 2), "sage3", True))  # True: patched again after enable_parallelism
        for layout, (ring, ulysses), mode, late in cases:
            calls.clear()
            train = mode == "attn_qat"  # Ulysses trains through; ring and sage3 are inference-only
            model = _tiny_wan()
            patch_attention(model, mode)
            with torch.set_grad_enabled(train):
                ref = model(**_wan_inputs())[0]
                if train:
                    (ref * _weights(ref)).sum().backward()
            ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            model.zero_grad(set_to_none=True)
            assert not calls
            cp_module.enable_context_parallel(model, layout, ring * ulysses)
            assert torch.accelerator.device_count() == 0  # the count was 1 only during the call
            if late:  # the processors patch_attention puts in now must keep the parallel config
                patch_attention(model, "bf16")
                patch_attention(model, mode)
            with torch.set_grad_enabled(train):
                out = model(**_wan_inputs())[0]
                if train:
                    (out * _weights(out)).sum().backward()
            key = f"model/{layout}/{mode}" + ("/late" if late else "")
            results[key] = [(out.detach() - ref.detach()).abs().max().item(), ref.abs().max().item()]
            results[key + "/calls"] = len(calls)  # one per self-attention (2 blocks)
            if train:
                worst = 0.0
                for n, p in model.named_parameters():
                    if n in ref_grads:
                        g = p.grad.clone()
                        torch.distributed.all_reduce(g)  # each rank holds its shard's contribution
                        worst = max(worst, ((g - ref_grads[n]).abs().max() / ref_grads[n].abs().max().clamp_min(1e-12)).item())
                results[key + "/grad"] = worst
    finally:
        processor_module.context_parallel_attention = original
    # `generate --compile --parallel`: diffusers' split hook on blocks.0 runs inside the block's fullgraph trace
    for layout, mode in (("ulysses", "attn_qat"), ("ring", "nvfp4")):
        model = _tiny_wan()
        patch_attention(model, mode)
        with torch.no_grad():
            ref = model(**_wan_inputs())[0]
        cp_module.enable_context_parallel(model, layout, 2)
        model.compile_repeated_blocks(fullgraph=True, backend="aot_eager")
        with torch.no_grad():
            out = model(**_wan_inputs())[0]
        results[f"model/{layout}/{mode}/compiled"] = [(out - ref).abs().max().item(), ref.abs().max().item()]
    # `train.compile` under sequence parallelism: the blocks compiled as the loop compiles them there (the
    # attention's templated function with gradients runs between two graphs), trained through
    model = _tiny_wan()
    patch_attention(model, "attn_qat")
    ref = model(**_wan_inputs())[0]
    (ref * _weights(ref)).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    cp_module.enable_context_parallel(model, "ulysses", 2)
    for block in model.blocks:
        block.compile(dynamic=False, fullgraph=False, backend="aot_eager")
    out = model(**_wan_inputs())[0]
    (out * _weights(out)).sum().backward()
    worst = 0.0
    for n, p in model.named_parameters():
        if n in ref_grads:
            g = p.grad.clone()
            torch.distributed.all_reduce(g)
            worst = max(worst, ((g - ref_grads[n]).abs().max() / ref_grads[n].abs().max().clamp_min(1e-12)).item())
    results["model/ulysses/attn_qat/compiled/train"] = [(out - ref).abs().max().item(), ref.abs().max().item(),
                                                        worst, len(ref_grads)]


def _weights(x):
    return torch.linspace(-1, 1, x.numel()).reshape(x.shape)


def _worker(rank: int, port: int, out_dir: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=WORLD)
    results: dict = {}
    try:
        _check_attention(rank, results)
        _check_model(rank, results)
    except Exception:  # noqa: BLE001 - reported to the parent
        results["error"] = traceback.format_exc()
    finally:
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def distributed_results():
    with tempfile.TemporaryDirectory() as tmp:  # forked: spawned processes imported for most of the fixture's 24 s
        run_forked(_worker, (free_port(), tmp), WORLD, "the context-parallel processes")
        results = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(WORLD)]
    for r in results:
        assert "error" not in r, r.get("error")
    return results


@pytest.mark.parametrize("mode", ["bf16", "attn_qat", "nvfp4", "sage3"])
def test_ulysses_equals_one_process(distributed_results, mode):
    """Ulysses moves whole heads: every rank computes exactly what one process does for those heads."""
    for r in distributed_results:
        errs = r[f"ulysses/{mode}"]
        assert max(errs) <= 1e-6, (mode, errs)  # output (and dq, dk, dv for the trainable modes)


@pytest.mark.parametrize("mode", ["bf16", "nvfp4", "attn_qat"])
def test_ring_equals_one_process(distributed_results, mode):
    """Ring merges per-chunk outputs with the log-sum-exp; for the FP4 modes the integer running max makes
    that the one-pass result up to fp32 rounding."""
    for r in distributed_results:
        assert r[f"ring/{mode}"][0] <= 3e-6, (mode, r[f"ring/{mode}"])


def test_ring_training_refused(distributed_results):
    for r in distributed_results:
        assert "inference-only" in r["ring/train"] and "\n" not in r["ring/train"]


@pytest.mark.parametrize("case", ["ulysses/attn_qat", "ring/nvfp4", "ulysses/sage3/late"])
def test_patched_wan_under_context_parallel(distributed_results, case):
    """The patched model equals itself unsharded; "late": patch_attention called again after
    enable_parallelism (its new processors take the parallel config of the ones they replace)."""
    for r in distributed_results:
        err, scale = r[f"model/{case}"]
        assert r[f"model/{case}/calls"] == 2  # the processors did run the context-parallel path
        assert err <= 1e-5 * max(scale, 1.0), (case, err, scale)
        if case == "ulysses/attn_qat":  # trained through: parameter gradients, summed over ranks
            assert r[f"model/{case}/grad"] <= 1e-5, r[f"model/{case}/grad"]


def test_compiled_blocks_under_context_parallel(distributed_results):
    """Blocks compiled after enable_parallelism: with fullgraph=True and no gradients (``generate --compile
    --parallel ulysses|ring``), dynamo traces diffusers' split hook, whose argument lookup enable_context_parallel cached
    beforehand; trained through (``train.compile`` with ``train.sequence_parallel``: no fullgraph, the Ulysses
    attention between two graphs). Outputs, and the parameter gradients summed over ranks, equal the unsharded,
    uncompiled model's."""
    for r in distributed_results:
        for case in ("ulysses/attn_qat", "ring/nvfp4"):
            err, scale = r[f"model/{case}/compiled"]
            assert err <= 1e-5 * max(scale, 1.0), (case, err, scale)
        err, scale, grad, n_grads = r["model/ulysses/attn_qat/compiled/train"]
        assert err <= 1e-5 * max(scale, 1.0), (err, scale)
        assert n_grads > 0 and grad <= 1e-5, (grad, n_grads)  # parameter gradients, summed over ranks


# --------------------------------------------------------------------------------------------------
# attention_with_lse (what the ring merge needs), single process
# --------------------------------------------------------------------------------------------------


def _merge(parts):
    """Ring's merge of (out, lse) chunk results, as exact as fp32 allows."""
    lse = torch.logsumexp(torch.stack([l for _, l in parts]), 0)
    return sum(torch.exp(l - lse)[..., None] * o.float() for o, l in parts), lse


@pytest.mark.parametrize("mode", ["bf16", "nvfp4", "attn_qat", "attn_qat_dropin"])
def test_lse_chunks_merge_to_one_pass_reference(mode):
    from attnqat.kernels.api import attention, attention_with_lse

    q, k, v = (torch.randn(1, 2, 96, 64) for _ in range(3))
    out, lse = attention_with_lse(q, k, v, mode)
    assert torch.equal(out, attention(q, k, v, mode))
    if mode == "bf16":
        torch.testing.assert_close(lse, torch.logsumexp(q @ k.transpose(-1, -2) / 8, -1))
    merged, merged_lse = _merge([attention_with_lse(q, k[:, :, a:b], v[:, :, a:b], mode)
                                 for a, b in ((0, 16), (16, 64), (64, 96))])
    # SPEC §2: with the integer max, O is tile-width free to <= 3e-6 (fp32 rounding, and e4m3 block scales that
    # leave the normal range for keys ~15 log2 units below the row max); ring chunks are tiles of another width
    torch.testing.assert_close(merged, out, rtol=0, atol=3e-6)
    torch.testing.assert_close(merged_lse, lse, rtol=0, atol=4e-6)


def test_lse_kernel_path_matches_reference():
    """The Triton path's lse (from the kernel's integer max and row sum; CPU interpreter here) equals the
    reference's, and its chunks merge to its one-pass output."""
    from attnqat.kernels.api import attention_with_lse

    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0") and not torch.cuda.is_available():
        pytest.skip("needs the Triton interpreter or a GPU")
    q, k, v = (torch.randn(1, 1, 128, 64).bfloat16() for _ in range(3))
    out, lse = attention_with_lse(q, k, v, "nvfp4")
    ref_out, ref_lse = attention_with_lse(q.float(), k.float(), v.float(), "nvfp4")
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.float(), ref_out, rtol=0, atol=2e-2)
    merged, _ = _merge([attention_with_lse(q, k[:, :, a:b], v[:, :, a:b], "nvfp4") for a, b in ((0, 64), (64, 128))])
    torch.testing.assert_close(merged, out.float(), rtol=0, atol=2e-2)


ULYSSES_CASES = [("nvfp4", {}, False), ("sage3", {}, False), ("attn_qat", {}, True),
                 ("attn_qat", {"q_smoothing": True, "four_over_six": True, "qk_rotation": "hadamard"}, True),
                 ("sagebwd", {}, True), ("sagebwd", {"smooth_q": True}, True)]


@pytest.mark.gpu
@pytest.mark.parametrize("mode,options,train", ULYSSES_CASES,
                         ids=[f"{m}-{'-'.join(o) or 'default'}" for m, o, _ in ULYSSES_CASES])
def test_one_ranks_heads_equal_the_whole_on_gpu(mode, options, train):
    """What Ulysses needs of every mode on a GPU, at Wan 14B's 480p shape (40 heads, 32,760 tokens): the output
    (and for the trainable modes dq, dk, dv) of one rank's 10 heads, laid out as after the all-to-all, equal those
    heads of the whole call bit for bit. (sage3's K mean through torch.mean did not: smoothing.token_mean.)"""
    from attnqat.kernels.api import attention

    torch.manual_seed(0)
    qkv = [torch.randn(1, 32760, 40, 128, device="cuda").bfloat16() for _ in range(3)]
    do = torch.randn(1, 40, 32760, 128, device="cuda").bfloat16()
    hs = slice(10, 20)

    def run(q, k, v, grad_out):
        q, k, v = (t.detach().requires_grad_(train) for t in (q, k, v))
        out = attention(q, k, v, mode, **options)
        if not train:
            return [out]
        out.backward(grad_out)
        return [out, q.grad, k.grad, v.grad]

    whole = run(*(t.transpose(1, 2) for t in qkv), do)
    part = run(*(t[:, :, hs].transpose(1, 2).contiguous() for t in qkv), do[:, hs].contiguous())
    for name, w, p in zip(("out", "dq", "dk", "dv"), whole, part):
        assert torch.equal(p, w[:, hs]), (name, (p.float() - w[:, hs].float()).abs().max().item())


@pytest.mark.gpu
def test_bf16_lse_on_cuda_matches_reference():
    """bf16's CUDA path (FlashAttention's own log-sum-exp, what ring runs on GPUs): the lse is the fp32 logits'
    (natural log), the output SDPA's, and key chunks merge to the one-pass output to bf16 rounding."""
    from attnqat.kernels.api import attention, attention_with_lse

    q, k, v = (torch.randn(1, 4, 1000, 128, device="cuda").bfloat16() for _ in range(3))
    out, lse = attention_with_lse(q, k, v, "bf16")
    assert lse.shape == (1, 4, 1000) and lse.dtype == torch.float32
    torch.testing.assert_close(lse, torch.logsumexp(q.float() @ k.float().transpose(-1, -2) / 128 ** 0.5, -1),
                               rtol=0, atol=1e-3)
    # outputs ~0.1 here: a few bf16 ulps
    torch.testing.assert_close(out.float(), attention(q, k, v, "bf16").float(), rtol=0, atol=4e-3)
    merged, merged_lse = _merge([attention_with_lse(q, k[:, :, a:b], v[:, :, a:b], "bf16")
                                 for a, b in ((0, 500), (500, 1000))])
    torch.testing.assert_close(merged, out.float(), rtol=0, atol=4e-3)
    torch.testing.assert_close(merged_lse, lse, rtol=0, atol=1e-3)


def test_lse_refusals():
    from attnqat.kernels.api import attention_with_lse

    q = torch.randn(1, 1, 16, 64)
    for mode in ("sage3", "sagebwd"):
        with pytest.raises(ValueError, match="log-sum-exp"):
            attention_with_lse(q, q, q, mode)
    with pytest.raises(ValueError, match="inference-only"):
        attention_with_lse(q.requires_grad_(), q, q, "nvfp4")
