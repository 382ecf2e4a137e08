"""AttnQATProcessor (attnqat/pipelines/processor.py) against diffusers' own WanAttnProcessor on the same weights, and
the contracts a patched transformer keeps: torch.compile(fullgraph=True) in every mode family, deepcopy, pickling,
state_dict, diffusers' attention-backend choice, unpatching.

References: diffusers' processor as installed (bf16 mode: bit for bit, in fp32 and bf16, T2V self- and
cross-attention, I2V's added image K/V, fused projections, RoPE), and for the other modes diffusers' processor with
its attention call replaced by ``attention(mode)`` (everything around the attention is diffusers' code): a change in
diffusers' Wan attention makes these fail. Compiled runs are compared with eager runs of the same model.
"""
import copy
import io
import pickle

import pytest
import torch
from conftest import rel_err
from diffusers.models import attention_dispatch
from diffusers.models.attention_dispatch import _AttentionBackendRegistry, attention_backend
from diffusers.models.transformers import transformer_wan
from diffusers.models.transformers.transformer_wan import WanAttention, WanAttnProcessor, WanRotaryPosEmbed

from attnqat.kernels import attention
from attnqat.kernels.api import available_modes, mode_of
from attnqat.pipelines import (AttentionTimer, AttnQATProcessor, PrecisionSchedule, TINY_TRANSFORMER_CONFIG,
                               attention_modes, build_tiny_transformer, patch_attention, patched_attention,
                               unpatch_attention)

pytestmark = pytest.mark.usefixtures("one_thread")

DIM, HEADS, HEAD_DIM = 128, 2, 64
IMAGE_TOKENS, TEXT_TOKENS = 8, 512  # I2V: diffusers splits encoder states as [image tokens, the last 512]


def _module(kind: str, dtype: torch.dtype, fused: bool) -> WanAttention:
    """A WanAttention as Wan builds them: "self" (attn1), "cross" (attn2, T2V) or "i2v" (attn2 with the image
    K/V projections), with random weights (norm weights too, so RMSNorm's scale matters)."""
    attn = WanAttention(DIM, HEADS, HEAD_DIM, eps=1e-6, added_kv_proj_dim=DIM if kind == "i2v" else None,
                        cross_attention_dim_head=None if kind == "self" else HEAD_DIM,
                        processor=WanAttnProcessor())
    with torch.no_grad():
        for name, p in attn.named_parameters():  # linears at unit gain; norm weights around 1; biases small
            scale = p.shape[-1] ** -0.5 if p.ndim == 2 else 0.2
            p.copy_(torch.randn_like(p) * scale + ("norm" in name))
    if fused:
        attn.fuse_projections()
    return attn.to(dtype).eval()


def _inputs(kind: str, dtype: torch.dtype, tokens: int = 32):
    """(hidden_states, encoder_hidden_states, rotary_emb) for ``kind``; RoPE tables from diffusers' own module for
    a 2-frame 8x8 latent (32 tokens), as the transformer passes them."""
    x = torch.randn(2, tokens, DIM).to(dtype)
    if kind == "self":
        rotary = WanRotaryPosEmbed(HEAD_DIM, (1, 2, 2), 1024)(torch.zeros(1, 16, 2, 8, 8))
        return x, None, rotary
    context = IMAGE_TOKENS + TEXT_TOKENS if kind == "i2v" else 24
    return x, torch.randn(2, context, DIM).to(dtype), None


def _call(attn, proc, x, context, rotary):
    attn.set_processor(proc)
    return attn(x, context, None, rotary)


KINDS = ["self", "cross", "i2v"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
@pytest.mark.parametrize("kind", KINDS)
def test_bf16_mode_equals_diffusers_processor_bit_for_bit(kind, fused, dtype, poison):
    """Forward, and for fp32 the gradients of the inputs and every weight, equal diffusers' own processor's."""
    attn = _module(kind, dtype, fused)
    x, context, rotary = _inputs(kind, dtype)
    train = dtype == torch.float32
    results = []
    for proc in (WanAttnProcessor(), AttnQATProcessor("bf16")):
        attn.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(train)
        with torch.set_grad_enabled(train):
            out = _call(attn, proc, xi, context, rotary)
        grads = []
        if train:
            out.backward(torch.ones_like(out))
            grads = [xi.grad] + [p.grad for p in attn.parameters() if p.grad is not None]
        results.append((out.detach(), grads))
    (ref, ref_grads), (out, grads) = results
    assert torch.isfinite(ref).all() and torch.equal(out, ref)
    assert len(grads) == len(ref_grads) and all(torch.equal(g, r) for g, r in zip(grads, ref_grads))


@pytest.mark.parametrize("mode", ["attn_qat", "sagebwd", "sage3"])
@pytest.mark.parametrize("kind", KINDS)
def test_other_modes_equal_diffusers_processor_around_the_same_attention(kind, mode, monkeypatch):
    """Every mode: the output equals diffusers' processor with only its attention call replaced by attnqat's
    ``attention(mode)`` (projections, norms, RoPE, I2V's second attention and the output projection diffusers').
    The modes' PyTorch references (TRITON_INTERPRET=0): the composition is under test here, not the kernels."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    attn = _module(kind, torch.bfloat16, fused=False)
    x, context, rotary = _inputs(kind, torch.bfloat16)

    def dispatch(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
                 attention_kwargs=None, *, backend=None, parallel_config=None):
        assert attn_mask is None and not is_causal and scale is None and backend is None and parallel_config is None
        return attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), mode).transpose(1, 2)

    with torch.no_grad():
        out = _call(attn, AttnQATProcessor(mode), x, context, rotary)
        monkeypatch.setattr(transformer_wan, "dispatch_attention_fn", dispatch)
        ref = _call(attn, WanAttnProcessor(), x, context, rotary)
        monkeypatch.setattr(transformer_wan, "dispatch_attention_fn", attention_dispatch.dispatch_attention_fn)
        exact = _call(attn, WanAttnProcessor(), x, context, rotary)
    assert torch.equal(out, ref)
    assert not torch.equal(out, exact)  # the mode did run (its quantization changes the output)


def test_i2v_transformer_patched_bf16_equals_unpatched():
    """A whole I2V-configured transformer (image embedder, added K/V in every attn2), every layer patched."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    tr = WanTransformer3DModel(**dict(TINY_TRANSFORMER_CONFIG, image_dim=48, added_kv_proj_dim=128)).eval()
    x, t = torch.randn(1, 16, 2, 8, 8), torch.tensor([300.0])
    text, image = torch.randn(1, TEXT_TOKENS, 32), torch.randn(1, 4, 48)
    with torch.no_grad():
        ref = tr(x, t, text, encoder_hidden_states_image=image, return_dict=False)[0]
        patch_attention(tr, "bf16", "all")
        out = tr(x, t, text, encoder_hidden_states_image=image, return_dict=False)[0]
    assert torch.equal(out, ref)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("kind", ["self", "cross"])
def test_nonfinite_input_gives_nonfinite_output(kind, bad):
    """bf16 mode calls SDPA without attention()'s non-finite marker: RMSNorm across heads turns an inf in Q or K
    into NaN, so an inf or NaN in the layer's input still reaches the output (SPEC §1)."""
    attn = _module(kind, torch.float32, fused=False)
    x, context, rotary = _inputs(kind, torch.float32)
    target = x if context is None else context
    target[1, 5, 7] = bad
    with torch.no_grad():
        out = _call(attn, AttnQATProcessor("bf16"), x, context, rotary)
    assert torch.isfinite(out[0]).all()  # the other batch element is untouched
    assert not torch.isfinite(out[1]).all(-1).any()  # every row of the poisoned one: key 5 is in every row


# --- The transformer: copies, pickling, state_dict ----------------------------------------------------------------

def _tiny(dtype=torch.bfloat16):
    return build_tiny_transformer(dtype)


def _tiny_inputs(dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    return (torch.randn(1, 16, 2, 8, 8, generator=g).to(dtype), torch.tensor([500.0]),
            torch.randn(1, 24, 32, generator=g).to(dtype))


@torch.no_grad()
def _run(tr, inputs):
    return tr(*inputs, return_dict=False)[0]


def test_deepcopy_gives_independent_processors():
    """An EMA or teacher copy: its mode, timer and precision-schedule flag are its own, both ways."""
    schedule = PrecisionSchedule(first=1)
    tr, timer, inputs = _tiny(), AttentionTimer(), _tiny_inputs()
    patch_attention(tr, "attn_qat", schedule=schedule, timer=timer)
    fp4 = _run(tr, inputs)
    switch = schedule.callback(tr, 2)  # step 0 in high precision: bf16
    high = _run(tr, inputs)
    switch.finish()
    assert not torch.equal(fp4, high)
    timer.reset()

    twin = copy.deepcopy(tr)
    procs = [m.processor for m in twin.modules() if isinstance(getattr(m, "processor", None), AttnQATProcessor)]
    assert len(procs) == 2 and procs[0].timer is procs[1].timer and procs[0].timer is not timer
    schedule.callback(twin, 2)  # the copy's flag only
    assert torch.equal(_run(twin, inputs), high) and torch.equal(_run(tr, inputs), fp4)
    assert timer.calls == procs[0].timer.calls == 2  # each timer counts its own model's calls (2 blocks)
    switch.start()  # the original's flag only; the copy is still on its step 0
    assert torch.equal(_run(tr, inputs), high) and torch.equal(_run(twin, inputs), high)
    schedule.callback(twin, 2).finish()
    assert torch.equal(_run(twin, inputs), fp4) and torch.equal(_run(tr, inputs), high)
    switch.finish()

    patch_attention(twin, "bf16", schedule=None)  # re-patching or unpatching the copy leaves the original alone
    assert attention_modes(tr)["blocks.0.attn1"] == "attn_qat" and attention_modes(twin)["blocks.0.attn1"] == "bf16"
    unpatch_attention(twin)
    assert type(twin.blocks[0].attn1.processor) is WanAttnProcessor
    assert isinstance(tr.blocks[0].attn1.processor, AttnQATProcessor) and torch.equal(_run(tr, inputs), fp4)


@pytest.mark.parametrize("how", ["torch.save", "pickle"])
def test_patched_model_pickles(how):
    tr, timer, inputs = _tiny(), AttentionTimer(), _tiny_inputs()
    patch_attention(tr, "attn_qat", "all", schedule=PrecisionSchedule(blocks=(1,)), timer=timer)
    ref = _run(tr, inputs)
    assert timer.calls == 4
    if how == "torch.save":
        buf = io.BytesIO()
        torch.save(tr, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
    else:
        loaded = pickle.loads(pickle.dumps(tr))
    assert attention_modes(loaded) == attention_modes(tr) == {
        "blocks.0.attn1": "attn_qat", "blocks.0.attn2": "attn_qat", "blocks.1.attn1": "bf16", "blocks.1.attn2": "bf16"}
    assert loaded.blocks[0].attn1.processor.timer.calls == 4  # the count so far travels with it
    assert torch.equal(_run(loaded, inputs), ref)
    assert loaded.blocks[0].attn1.processor.timer.calls == 8 and timer.calls == 4
    unpatch_attention(loaded)
    assert all(type(m.processor) is WanAttnProcessor for m in loaded.modules() if isinstance(m, WanAttention))
    assert isinstance(tr.blocks[0].attn1.processor, AttnQATProcessor)


def test_state_dict_round_trip_between_patched_models():
    """Patching adds no state: a patched model's state_dict loads strictly into another patched (or unpatched)
    model, which then gives the same output."""
    src, inputs = _tiny(), _tiny_inputs()
    with torch.no_grad():
        for p in src.parameters():
            p.add_(0.01 * torch.randn_like(p))
    dst, plain = _tiny(), _tiny()
    for m in (src, dst):
        patch_attention(m, "attn_qat", "all")
    state = src.state_dict()
    assert state.keys() == plain.state_dict().keys()
    dst.load_state_dict(state, strict=True)
    plain.load_state_dict(state, strict=True)
    assert not torch.equal(_run(plain, inputs), _run(src, inputs))  # the FP4 attention is in the patched ones
    assert torch.equal(_run(dst, inputs), _run(src, inputs))


# --- diffusers' attention-backend choice, unpatching ---------------------------------------------------------------

@pytest.fixture
def restore_backend():
    """set_attention_backend also sets diffusers' process-wide active backend (reset_attention_backend does not
    undo that): put it back after the test."""
    active = _AttentionBackendRegistry._active_backend
    yield
    _AttentionBackendRegistry.set_active_backend(active)


def test_diffusers_attention_backend_is_refused_not_ignored(restore_backend):
    tr, inputs = _tiny(torch.float32), _tiny_inputs(torch.float32)
    patch_attention(tr, "bf16")
    ref = _run(tr, inputs)
    with attention_backend("_native_math"):
        with pytest.raises(ValueError, match=r"diffusers attention backend '_native_math' is selected .* "
                                             r"attnqat's 'bf16' attention: unpatch_attention\(\)"):
            _run(tr, inputs)
    assert torch.equal(_run(tr, inputs), ref)  # outside the context: runs again
    tr.set_attention_backend("_native_math")
    with pytest.raises(ValueError, match="'_native_math' is selected"):
        _run(tr, inputs)
    tr.reset_attention_backend()
    with attention_backend(attention_dispatch.DIFFUSERS_ATTN_BACKEND):
        assert torch.equal(_run(tr, inputs), ref)
    unpatch_attention(tr)  # unpatched, the layers follow diffusers' choice again
    with attention_backend("_native_math"):
        _run(tr, inputs)


def test_unpatch_restores_what_was_there_and_keeps_later_processors():
    """unpatch_attention gives each still-patched layer the processor it had before patching; a processor set on a
    layer after patching stays (here a user's own, then diffusers' set_attn_processor on the whole model)."""
    tr = _tiny()
    before = {n: m.processor for n, m in tr.named_modules() if isinstance(m, WanAttention)}
    patch_attention(tr, "attn_qat", "all")
    mine = WanAttnProcessor()
    tr.blocks[1].attn1.set_processor(mine)
    with patched_attention(tr, "nvfp4", [0]):  # a nested patch is undone the same way
        assert attention_modes(tr)["blocks.0.attn1"] == "nvfp4" and tr.blocks[1].attn1.processor is mine
        other = WanAttnProcessor()
        tr.blocks[0].attn2.set_processor(other)  # replaces the outer patch's processor while nested
    assert attention_modes(tr)["blocks.0.attn1"] == "attn_qat" and tr.blocks[0].attn2.processor is other
    unpatch_attention(tr)
    after = {n: m.processor for n, m in tr.named_modules() if isinstance(m, WanAttention)}
    assert after["blocks.1.attn1"] is mine and after["blocks.0.attn2"] is other
    assert after["blocks.0.attn1"] is before["blocks.0.attn1"] and after["blocks.1.attn2"] is before["blocks.1.attn2"]

    patch_attention(tr, "attn_qat")
    tr.set_attn_processor(WanAttnProcessor())
    fresh = {n: m.processor for n, m in tr.named_modules() if isinstance(m, WanAttention)}
    unpatch_attention(tr)
    assert all(tr.get_submodule(n).processor is p for n, p in fresh.items())


def test_options_are_checked_when_the_processor_is_made():
    with pytest.raises(ValueError, match="attention mode 'attn_qat' takes options p_bwd, qk_rotation, k_smoothing, q_smoothing, four_over_six; got \\['p_fwd'\\]"):
        patch_attention(_tiny(), "attn_qat", p_fwd="x")
    with pytest.raises(ValueError, match="p_bwd 'nope' not in"):
        AttnQATProcessor("attn_qat", p_bwd="nope")


# --- torch.compile(fullgraph=True) ---------------------------------------------------------------------------------

def _one_mode_per_layer(modes, dtype=torch.bfloat16):
    """The tiny transformer with its attention layers (attn1, attn2 of each block) in ``modes``, one each in turn;
    copies of the last block are appended until every mode has a layer."""
    tr = _tiny(dtype)
    while 2 * len(tr.blocks) < len(modes):
        tr.blocks.append(copy.deepcopy(tr.blocks[-1]))
    layers = [m for m in tr.modules() if isinstance(m, WanAttention)]
    for i, layer in enumerate(layers):
        layer.set_processor(AttnQATProcessor(modes[i % len(modes)]))
    return tr


def _eager_and_compiled(tr, inputs, *, train, backend="aot_eager"):
    """Run ``tr`` eager, then ``torch.compile(tr, fullgraph=True, backend=backend)``: ((output, every weight's
    gradient when ``train``) of each, the compiled model)."""
    torch._dynamo.reset()
    tr.requires_grad_(train)

    def step(model):
        tr.zero_grad(set_to_none=True)
        with torch.set_grad_enabled(train):
            out = model(*inputs, return_dict=False)[0]
        if train:
            out.float().square().mean().backward()
        return out.detach(), [p.grad for p in tr.parameters()] if train else []

    eager = step(tr)
    compiled = torch.compile(tr, fullgraph=True, backend=backend)
    return eager, step(compiled), compiled


def _compiled_matches_eager(tr, inputs, *, train):
    """Compiled against eager, output and gradients. aot_eager: Dynamo and AOTAutograd trace the whole graph (what
    fullgraph tests) without Inductor's C++ build, and run the attention custom ops as eager does, so the output is
    eager's bit for bit; the GPU test below and bench/e2e.py --compile compile with Inductor."""
    (eager_out, eager_grads), (out, grads), compiled = _eager_and_compiled(tr, inputs, train=train)
    torch.testing.assert_close(out, eager_out, rtol=0, atol=0)
    assert len(grads) == len(eager_grads) == (len(list(tr.parameters())) if train else 0)
    for a, b in zip(grads, eager_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    return compiled


def test_compile_fullgraph_bf16_inference_training_and_refusals(restore_backend):
    tr, inputs = _tiny(torch.float32), _tiny_inputs(torch.float32)
    patch_attention(tr, "bf16", "all")
    compiled = _compiled_matches_eager(tr, inputs, train=True)
    tr.requires_grad_(False)
    with attention_backend("_native_math"), pytest.raises(Exception, match="attention backend '_native_math'"):
        _run(compiled, inputs)  # Dynamo guards on the active backend: the refusal reaches compiled code too
    tr.blocks[0].attn1.processor.timer = AttentionTimer()
    with pytest.raises(Exception, match="an enabled AttentionTimer cannot time attention inside torch.compile"):
        _run(compiled, inputs)
    tr.blocks[0].attn1.processor.timer = AttentionTimer(enabled=False)
    assert torch.equal(_run(compiled, inputs), _run(tr, inputs))
    torch._dynamo.reset()


@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_compile_fullgraph_every_mode(train):
    """Every registered mode (inference), every trainable one (training: the backward under compile too), one per
    attention layer of one model, on the Triton kernels (the interpreter, bf16): their custom ops sit in the
    graph, so it traces without a break and computes what eager does."""
    modes = [m for m in available_modes() if mode_of(m).trainable or not train]
    assert {"bf16", "attn_qat", "sagebwd"} <= set(modes)
    _compiled_matches_eager(_one_mode_per_layer(modes), _tiny_inputs(), train=train)
    torch._dynamo.reset()


def test_compile_fullgraph_references_training(monkeypatch):
    """The trainable modes' PyTorch references (plain CPU, TRITON_INTERPRET=0, what a CPU training run takes),
    one per attention layer: forward and backward compile too."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    modes = [m for m in available_modes() if mode_of(m).trainable]
    _compiled_matches_eager(_one_mode_per_layer(modes), _tiny_inputs(), train=True)
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
def test_gpu_compile_fullgraph_every_mode_inductor(train):
    """On the GPU with Inductor (what ``attnqat generate --compile`` and bench/e2e.py --compile run): every mode, one
    per attention layer, compiles whole, and the output (and, training, the weights' gradients) stays within a few
    bf16 roundings of eager: Inductor fuses the bf16 projections, norms and RoPE around the attention and rounds
    them differently, which a quantizing attention may pass on as a neighbouring grid value (4.4e-3 for bf16 mode,
    4.6e-3 for attn_qat, measured on an H100); a wrong graph is off by order 1."""
    modes = [m for m in available_modes() if mode_of(m).trainable or not train]
    tr = _one_mode_per_layer(modes).cuda()
    inputs = tuple(x.cuda() for x in _tiny_inputs())
    (eager_out, eager_grads), (out, grads), _ = _eager_and_compiled(tr, inputs, train=train, backend="inductor")
    err = rel_err(out, eager_out)
    grad_err = rel_err(torch.cat([g.flatten() for g in grads]), torch.cat([g.flatten() for g in eager_grads])) \
        if train else 0.0
    print(f"\ninductor vs eager, modes {modes}: output {err:.2e}, gradients {grad_err:.2e}")
    assert torch.isfinite(out).all() and err <= 3e-2
    assert grad_err <= 5e-2
    torch._dynamo.reset()


def test_compile_repeated_blocks_sage3_and_schedule_flag():
    """diffusers' regional compile (each WanTransformerBlock, fullgraph, in place) in sage3; flipping the
    precision-schedule flag afterwards is seen by the compiled blocks (Dynamo guards on it)."""
    torch._dynamo.reset()
    schedule = PrecisionSchedule(first=1)
    tr, inputs = _tiny(), _tiny_inputs()
    patch_attention(tr, "sage3", "all", schedule=schedule)
    fp4 = _run(tr, inputs)
    switch = schedule.callback(tr, 2)
    high = _run(tr, inputs)
    switch.finish()
    assert not torch.equal(high, fp4)
    tr.compile_repeated_blocks(fullgraph=True, backend="aot_eager")
    assert torch.equal(_run(tr, inputs), fp4)
    switch.start()
    assert torch.equal(_run(tr, inputs), high)
    switch.finish()
    assert torch.equal(_run(tr, inputs), fp4)
    torch._dynamo.reset()
