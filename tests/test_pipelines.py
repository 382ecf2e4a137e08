"""attnqat.pipelines: the Wan attention processor, patch/unpatch, the tiny model, checkpoint loading.

References: diffusers' own unpatched transformer (bit for bit for bf16), and an attention layer written
here from Wan's formulas (projections, RMSNorm across heads, RoPE as a complex rotation) around
``attention()``, independent of diffusers' processor code.
"""
import pytest
import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_wan import WanAttnProcessor

from attnqat.kernels import available_modes
from attnqat.pipelines import (AttentionTimer, AttnQATProcessor, CheckpointMismatchError, ModelNotFoundError,
                               attention_modes, build_tiny_pipeline, build_tiny_tokenizer, build_tiny_transformer,
                               load_pipeline, load_qat_checkpoint, patch_attention, patched_attention,
                               unpatch_attention)
from attnqat.kernels import attention

# Quantized modes: NVFP4 ones, and SageBwd's INT8. Their Triton kernels (run by the interpreter here)
# take bf16/fp16, so these tests use the tiny model in bf16 against the unpatched bf16 model.
FP4_MODES = ["nvfp4", "attn_qat", "attn_qat_dropin", "sage3", "sagebwd"]
# Lower bounds on cos-sim to the unpatched fp32 model, measured on the tiny model (see docs/pipeline.md):
# transformer output (attention's contribution through the random gates is small) and block 0's attn1.
COS_OUTPUT_MIN = 0.999
COS_ATTN_MIN = 0.97


def _fp4(mode):
    if mode not in available_modes():
        pytest.skip(f"mode {mode!r} not registered yet (available: {available_modes()})")
    return mode


@pytest.fixture(scope="module")
def transformer():
    return build_tiny_transformer(torch.float32)


def _inputs(seed, batch=2, frames=2, hw=8, text=24):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 16, frames, hw, hw, generator=g)
    t = torch.randint(0, 1000, (batch,), generator=g).float()
    e = torch.randn(batch, text, 32, generator=g)
    return x, t, e


@torch.no_grad()
def _run(tr, inputs):
    return tr(*inputs, return_dict=False)[0]


def _cos(a, b):
    return F.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


@pytest.mark.parametrize("layers", ["self", "all", [1]])
def test_patched_bf16_equals_unpatched_bit_for_bit(transformer, layers):
    inputs = _inputs(seed=torch.seed() % 2**31)
    ref = _run(transformer, inputs)
    try:
        patch_attention(transformer, "bf16", layers)
        out = _run(transformer, inputs)
    finally:
        unpatch_attention(transformer)
    assert torch.equal(out, ref)


def test_patched_bf16_equals_unpatched_in_bfloat16():
    tr = build_tiny_transformer(torch.bfloat16)
    inputs = [x.bfloat16() if x.is_floating_point() and x.ndim > 1 else x for x in _inputs(seed=3)]
    ref = _run(tr, inputs)
    patch_attention(tr, "bf16", "all")
    assert torch.equal(_run(tr, inputs), ref)


def _wan_attention_reference(attn, x, rotary, mode, context=None):
    """Wan 2.1 attention from its formulas, for one WanAttention module; RoPE as a complex rotation."""
    B, L, _ = x.shape
    ctx = x if context is None else context
    q = attn.norm_q(attn.to_q(x)).unflatten(2, (attn.heads, -1))      # (B, L, H, D)
    k = attn.norm_k(attn.to_k(ctx)).unflatten(2, (attn.heads, -1))
    v = attn.to_v(ctx).unflatten(2, (attn.heads, -1))
    if rotary is not None:
        cos, sin = rotary                                               # (1, L, 1, D), pairs repeated
        angle = torch.complex(cos[..., 0::2].double(), sin[..., 0::2].double())
        def rot(t):
            z = torch.view_as_complex(t.double().unflatten(-1, (-1, 2)).contiguous()) * angle
            return torch.view_as_real(z).flatten(-2).to(t.dtype)
        q, k = rot(q), rot(k)
    o = attention(q.permute(0, 2, 1, 3).contiguous(), k.permute(0, 2, 1, 3).contiguous(),
                  v.permute(0, 2, 1, 3).contiguous(), mode)
    return attn.to_out[0](o.permute(0, 2, 1, 3).reshape(B, L, -1))


def _attn1_io(tr, inputs):
    """Block 0's attn1: its input, rotary embedding and output in one forward (via hooks)."""
    seen = {}
    def hook(module, args, kwargs, out):
        seen["x"], seen["rotary"], seen["out"] = args[0], args[3], out
    h = tr.blocks[0].attn1.register_forward_hook(hook, with_kwargs=True)
    try:
        model_out = _run(tr, inputs)
    finally:
        h.remove()
    return seen, model_out


def test_processor_matches_independent_wan_attention(transformer):
    inputs = _inputs(seed=11)
    patch_attention(transformer, "bf16")
    try:
        seen, _ = _attn1_io(transformer, inputs)
    finally:
        unpatch_attention(transformer)
    with torch.no_grad():
        ref = _wan_attention_reference(transformer.blocks[0].attn1, seen["x"], seen["rotary"], "bf16")
    torch.testing.assert_close(seen["out"], ref, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def transformer_bf16():
    return build_tiny_transformer(torch.bfloat16)


@pytest.mark.parametrize("mode", FP4_MODES)
def test_fp4_mode_changes_output_but_stays_close(transformer_bf16, mode):
    mode, transformer = _fp4(mode), transformer_bf16
    inputs = [x.bfloat16() if x.ndim > 1 else x for x in _inputs(seed=torch.seed() % 2**31)]
    seen_ref, ref = _attn1_io(transformer, inputs)
    patch_attention(transformer, mode)
    try:
        seen, out = _attn1_io(transformer, inputs)
    finally:
        unpatch_attention(transformer)
    assert not torch.equal(out, ref)
    assert (out - ref).abs().max() > 1e-4
    cos_out, cos_attn = _cos(out, ref), _cos(seen["out"], seen_ref["out"])
    print(f"{mode}: cos(transformer out) {cos_out:.6f}, cos(block 0 attn1 out) {cos_attn:.6f}")
    assert cos_out > COS_OUTPUT_MIN
    assert cos_attn > COS_ATTN_MIN
    # The FP4 error is the mode's own: the same mode around independently computed Q, K, V agrees far
    # better than FP4 does with exact attention (a layout bug, e.g. heads/tokens swapped, would not).
    with torch.no_grad():
        indep = _wan_attention_reference(transformer.blocks[0].attn1, seen["x"], seen["rotary"], mode)
    assert 1 - _cos(seen["out"], indep) < 0.1 * (1 - cos_attn)


def test_default_patches_only_self_attention_and_unpatch_restores(transformer):
    before = {name: m.processor for name, m in transformer.named_modules() if hasattr(m, "processor")}
    timer = AttentionTimer()
    names = patch_attention(transformer, "bf16", timer=timer)
    try:
        assert names == ["blocks.0.attn1", "blocks.1.attn1"]
        for name, m in transformer.named_modules():
            if name.endswith("attn1"):
                assert isinstance(m.processor, AttnQATProcessor) and m.processor.mode == "bf16"
            elif name.endswith("attn2"):
                assert m.processor is before[name]
        _run(transformer, _inputs(seed=1))
        assert timer.calls == 2 and timer.total_seconds() > 0
    finally:
        unpatch_attention(transformer)
    after = {name: m.processor for name, m in transformer.named_modules() if hasattr(m, "processor")}
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    assert all(type(p) is WanAttnProcessor for p in after.values())
    unpatch_attention(transformer)  # idempotent


def test_layer_selection_and_repatching(transformer):
    try:
        assert patch_attention(transformer, "bf16", "all") == [
            "blocks.0.attn1", "blocks.1.attn1", "blocks.0.attn2", "blocks.1.attn2"]
        assert set(attention_modes(transformer).values()) == {"bf16"}
        # a new patch replaces the old one: layers not selected now go back to diffusers
        assert patch_attention(transformer, "bf16", [1]) == ["blocks.1.attn1"]
        assert attention_modes(transformer) == {"blocks.0.attn1": "diffusers", "blocks.0.attn2": "diffusers",
                                                "blocks.1.attn1": "bf16", "blocks.1.attn2": "diffusers"}
        assert patch_attention(transformer, "bf16", [0], cross_attention=True) == ["blocks.0.attn1", "blocks.0.attn2"]
    finally:
        unpatch_attention(transformer)
    assert set(attention_modes(transformer).values()) == {"diffusers"}


def test_patched_attention_context_restores_previous_patch(transformer):
    patch_attention(transformer, "bf16", [0])
    try:
        with patched_attention(transformer, "bf16", "all"):
            assert set(attention_modes(transformer).values()) == {"bf16"}
        assert attention_modes(transformer)["blocks.0.attn1"] == "bf16"
        assert attention_modes(transformer)["blocks.1.attn1"] == "diffusers"
    finally:
        unpatch_attention(transformer)
    assert set(attention_modes(transformer).values()) == {"diffusers"}


def test_patching_keeps_weights_and_state_dict(transformer):
    sd = {k: v.clone() for k, v in transformer.state_dict().items()}
    ptrs = {k: p.data_ptr() for k, p in transformer.named_parameters()}
    modes = ["bf16"] + [m for m in FP4_MODES if m in available_modes()]
    for mode in modes:  # switching modes is swapping processors: no parameter is reallocated
        patch_attention(transformer, mode, "all")
        assert {k: p.data_ptr() for k, p in transformer.named_parameters()} == ptrs
        new = transformer.state_dict()
        assert new.keys() == sd.keys() and all(torch.equal(new[k], sd[k]) for k in sd)
    unpatch_attention(transformer)


def test_bad_arguments_are_refused(transformer):
    with pytest.raises(ValueError, match="unknown attention mode 'nope'; available: bf16"):
        patch_attention(transformer, "nope")
    with pytest.raises(ValueError, match="out of range"):
        patch_attention(transformer, "bf16", [2])
    with pytest.raises(ValueError, match="layers must be"):
        patch_attention(transformer, "bf16", "cross")
    with pytest.raises(TypeError, match="WanTransformer3DModel"):
        patch_attention(torch.nn.Linear(2, 2), "bf16")
    assert set(attention_modes(transformer).values()) == {"diffusers"}  # nothing half-patched
    attn = transformer.blocks[0].attn1
    x = torch.randn(1, 4, attn.inner_dim)
    with pytest.raises(ValueError, match="`attention_mask` is not supported"):
        AttnQATProcessor("bf16")(attn, x, attention_mask=torch.ones(1, 1, 4, 4, dtype=torch.bool))
    proc = AttnQATProcessor("bf16")
    proc._attention_backend = "flash"
    with pytest.raises(ValueError, match="unpatch_attention"):
        proc(attn, x)


def test_tiny_pipeline_is_deterministic_and_patched_bf16_is_exact():
    a, b = build_tiny_pipeline(), build_tiny_pipeline()
    for name in ("transformer", "text_encoder", "vae"):
        sa, sb = getattr(a, name).state_dict(), getattr(b, name).state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert a.transformer.config.attention_head_dim == 64
    tok = build_tiny_tokenizer()
    ids = tok("a corgi surfing").input_ids
    assert ids[-1] == tok.eos_token_id and tok.decode(ids, skip_special_tokens=True) == "a corgi surfing"
    kwargs = dict(prompt="a corgi", negative_prompt="blurry", height=32, width=32, num_frames=5,
                  num_inference_steps=2, output_type="latent", max_sequence_length=32)
    ref = a(**kwargs, generator=torch.Generator().manual_seed(0)).frames
    patch_attention(a.transformer, "bf16", "all")
    out = a(**kwargs, generator=torch.Generator().manual_seed(0)).frames
    assert torch.equal(out, ref)


def test_qat_checkpoint_roundtrip_and_mismatch(tmp_path, transformer):
    from safetensors.torch import save_file

    tr = build_tiny_transformer()
    state = {k: v + 0.01 * torch.randn_like(v) for k, v in tr.state_dict().items()}
    save_file(state, tmp_path / "qat.safetensors")
    patch_attention(tr, "bf16")
    load_qat_checkpoint(tr, tmp_path / "qat.safetensors")
    assert all(torch.equal(tr.state_dict()[k], state[k]) for k in state)
    assert attention_modes(tr)["blocks.0.attn1"] == "bf16"  # processors kept

    fresh = build_tiny_transformer()
    save_file({k: v for k, v in state.items() if not k.startswith("blocks.1.")}, tmp_path / "short.safetensors")
    with pytest.raises(CheckpointMismatchError, match="missing keys .*blocks.1"):
        load_qat_checkpoint(fresh, tmp_path / "short.safetensors")
    wide = dict(state, **{"proj_out.weight": torch.zeros(64, 256)})
    save_file(wide, tmp_path / "wide.safetensors")
    with pytest.raises(CheckpointMismatchError, match=r"shape mismatches \(proj_out.weight"):
        load_qat_checkpoint(fresh, tmp_path / "wide.safetensors")
    assert torch.equal(fresh.state_dict()["proj_out.weight"], transformer.state_dict()["proj_out.weight"])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_qat_checkpoint(fresh, tmp_path / "nope.safetensors")


def test_missing_models_say_how_to_download(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist.*huggingface-cli download"):
        load_pipeline(str(tmp_path / "Wan2.1-T2V-1.3B-Diffusers"))
    with pytest.raises(ModelNotFoundError, match="model_index.json is missing"):
        load_pipeline(str(tmp_path))
    # a hub id that is neither cached nor reachable: tests/test_generate_cli.py (needs HF_HUB_OFFLINE at start-up)


def test_e2e_benchmark_code_path_on_tiny_model(tmp_path):
    """bench/e2e.py --tiny --compile (its main, in this process: a subprocess would spend most of the test
    importing): diffusers' own processor first, each mode eager and under torch.compile(fullgraph=True); its own
    section of the docs page (the compiled one, between its markers) replaced, the rest (the eager table, the other
    sections and their markers) left alone."""
    import json
    from pathlib import Path

    from conftest import load_script

    e2e = load_script(Path(__file__).resolve().parents[1] / "bench" / "e2e.py", "bench_e2e")
    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\n## Kernels\n\nkeep me\n\n<!-- BEGIN e2e -->\n## End-to-end: Wan 2.1 14B transformer "
                    "step\n\neager\n<!-- END e2e -->\n\n<!-- BEGIN e2e_compiled -->\n## End-to-end, compiled: Wan 2.1 14B "
                    "transformer step\n\nold\n<!-- END e2e_compiled -->\n\n<!-- BEGIN later -->\n## Later\n\n"
                    "keep me too\n<!-- END later -->\n")
    assert e2e.main(["--tiny", "--modes", "bf16,diffusers", "--compile", "--compile-backend", "aot_eager",
                     "--repeats", "1", "--docs", str(docs), "--json", str(tmp_path / "e2e.json")]) == 0
    torch._dynamo.reset()
    res = json.loads((tmp_path / "e2e.json").read_text())["results"]
    assert [r["mode"] for r in res] == ["diffusers", "bf16"]
    assert res[0]["attention_calls_per_step"] == 0 and res[1]["attention_calls_per_step"] == 4  # 2 blocks x 2
    assert 0 < res[1]["attention_s"] < res[1]["step_s"]
    for r in res:
        assert r["compiled_step_s"] > 0 and r["compiled_rel_err"] < 1e-5, r
    text = docs.read_text()
    assert text.count("## End-to-end, compiled") == 1 and "old" not in text
    assert text.count("<!-- BEGIN e2e_compiled -->\n## End-to-end, compiled") == 1
    assert text.count("<!-- END e2e_compiled -->") == 1
    assert "<!-- BEGIN e2e -->\n## End-to-end: Wan 2.1 14B transformer step\n\neager\n<!-- END e2e -->" in text
    assert "keep me\n" in text and "\n<!-- BEGIN later -->\n## Later\n\nkeep me too\n<!-- END later -->" in text
    assert "| mode | step (s) | × diffusers | compiled step (s) | compiled × diffusers |" in text
    assert "| diffusers | " in text and "| bf16 | " in text and "(aot_eager)" in text


def _bench_rank(rank: int, main, port: int, argv: list, out_dir: str):
    """Rank ``rank`` of 2 running a bench script's ``main(argv)`` as torchrun starts it, in a process forked from
    this one (the script loaded before the fork); its exit status and output go to OUT_DIR/rank<rank>.json."""
    import contextlib
    import io
    import json
    import traceback
    from pathlib import Path

    from conftest import as_torchrun_rank

    as_torchrun_rank(rank, 2, port)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except BaseException:  # noqa: BLE001 - reported to the parent
            status = traceback.format_exc()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"status": status, "stdout": out.getvalue(),
                                                             "stderr": err.getvalue()}))


def _bench_on_two_ranks(name: str, argv: list, tmp_path) -> list[dict]:
    """bench/NAME.py on two gloo processes, forked rather than started by torchrun (whose processes would import
    torch and diffusers again, most of such a test's time); each rank's status, stdout and stderr."""
    import json
    import sys
    from pathlib import Path

    from conftest import free_port, load_script, run_forked

    path = list(sys.path)
    try:
        bench = load_script(Path(__file__).resolve().parents[1] / "bench" / f"{name}.py", f"bench_{name}")
    finally:  # the script puts bench/ first on sys.path, where its kernels.py would pass for the kernels package
        sys.path[:] = path
    run_forked(_bench_rank, (bench.main, free_port(), argv, str(tmp_path)), 2, f"bench/{name}.py's 2 processes")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        assert r["status"] == 0, (r["status"], r["stderr"][-3000:])
    return ranks


def test_multigpu_benchmark_code_path_on_two_cpu_processes(tmp_path):
    """bench/multigpu.py as under torchrun (2 gloo processes, tiny model): the 1-process and 2-process steps run in
    one job, only rank 0 writes, and the 2-process output equals the 1-process one (ring: each rank's 16 tokens
    are whole NVFP4 blocks, so the FP4 result is the one-pass result up to fp32 rounding)."""
    import json

    docs = tmp_path / "benchmarks.md"
    docs.write_text("# Benchmarks\n\n## Kernels\n\nkeep me\n")
    _bench_on_two_ranks("multigpu", ["--tiny", "--parallel", "ring", "--modes", "bf16,nvfp4", "--warmup", "0",
                                     "--repeats", "1", "--docs", str(docs), "--json", str(tmp_path / "mg.json")], tmp_path)
    rows = json.loads((tmp_path / "mg.json").read_text())["results"]
    assert [r["mode"] for r in rows] == ["bf16", "nvfp4"]
    for r in rows:
        assert r["finite"] and r["one_s"] > 0 and r["many_s"] > 0 and r["gap"] <= 3e-6, r
    text = docs.read_text()
    assert "keep me" in text and text.count("## Multi-GPU: Wan 2.1 14B step, ring on 2 GPUs") == 1 and "| tiny | 32 | nvfp4 |" in text


def test_multigpu_plot_draws_the_results_and_names_a_missing_folder(tmp_path):
    """bench/plot_multigpu.py draws the committed bench/results/multigpu/ JSONs into a PNG (written under a temporary
    name, then renamed); a folder without results is one line, not a traceback."""
    from pathlib import Path

    from conftest import load_script

    root = Path(__file__).resolve().parents[1]
    plot = load_script(root / "bench" / "plot_multigpu.py", "bench_plot_multigpu")
    out = tmp_path / "scaling.png"
    assert plot.main(["--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and [p.name for p in tmp_path.iterdir()] == ["scaling.png"]
    with pytest.raises(SystemExit, match="no \\*gpu.json in"):
        plot.main(["--results", str(tmp_path), "--out", str(tmp_path / "x.png")])


def test_fsdp_sequence_parallel_training_step_benchmark_on_two_cpu_processes(tmp_path):
    """bench/train_step_sp.py as under torchrun (2 gloo processes, tiny model): the FSDP1 + Ulysses training step
    runs for both student modes, with finite losses, and rank 0 alone prints the table."""
    ranks = _bench_on_two_ranks("train_step_sp", ["--tiny", "--steps", "1", "--warmup", "1"], tmp_path)
    assert "| `bf16` |" in ranks[0]["stdout"] and "| `attn_qat` |" in ranks[0]["stdout"]
    assert ranks[0]["stdout"].count("| `bf16` |") == 1 and "| `bf16` |" not in ranks[1]["stdout"]


def test_lean_training_step_benchmark_on_two_cpu_processes(tmp_path, capsys):
    """bench/train_step_sp.py --fsdp 2 --optimizer adamw8bit --shard-teacher (what the whole 14B on two H200s runs)
    on 2 gloo processes, tiny model: the FSDP2 student, the teacher sharded by the loop's shard_teacher, torchao's
    8-bit AdamW built as the loop builds it; a finite loss, rank 0 alone prints the table. adamw8bit with FSDP1 is
    refused in one line before any process starts talking."""
    import sys
    from pathlib import Path

    from conftest import load_script

    pytest.importorskip("torchao")
    ranks = _bench_on_two_ranks("train_step_sp", ["--tiny", "--steps", "1", "--warmup", "1", "--modes", "attn_qat",
                                                  "--fsdp", "2", "--optimizer", "adamw8bit", "--shard-teacher"],
                                tmp_path)
    out = ranks[0]["stdout"]
    assert "| `attn_qat` |" in out and "| `attn_qat` |" not in ranks[1]["stdout"]
    path = list(sys.path)
    try:
        bench = load_script(Path(__file__).resolve().parents[1] / "bench" / "train_step_sp.py", "bench_train_step_sp")
    finally:  # the script puts bench/ first on sys.path
        sys.path[:] = path
    capsys.readouterr()
    assert bench.main(["--tiny", "--optimizer", "adamw8bit"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--optimizer adamw8bit needs --fsdp 2" in err[0]


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["attn_qat", "sage3", "nvfp4"])
def test_compiled_and_offloaded_generation_match_eager_on_gpu(mode):
    """What `attnqat generate --compile` and `--offload` run, with the compiled Triton kernels: diffusers' regional
    compile of every block (fullgraph) and its model CPU offload give the video of the eager, resident pipeline
    (tiny model, bf16, 4 steps), up to bf16 rounding under compilation."""
    from attnqat.pipelines.generate import generate_video
    from attnqat.mini.quality import psnr

    device = torch.device("cuda")

    def video(compiled: bool, offload: bool):
        torch._dynamo.reset()
        pipe = load_pipeline("tiny", dtype=torch.bfloat16, device=None if offload else device)
        timer = AttentionTimer(enabled=not compiled)  # as generate: a compiled graph has no timing points
        patch_attention(pipe.transformer, mode, timer=timer)
        if offload:
            pipe.enable_model_cpu_offload(device=device)
        if compiled:
            pipe.transformer.compile_repeated_blocks(fullgraph=True)
        pipe.set_progress_bar_config(disable=True)
        return generate_video(pipe, "a fox", height=64, width=64, frames=9, steps=4, guidance=5.0, seed=0,
                              timer=timer, device=device).frames

    eager = video(False, False)
    assert eager.shape == (9, 64, 64, 3) and eager.std() > 0
    for compiled, offload in ((True, False), (False, True), (True, True)):
        db, _ = psnr(eager, video(compiled, offload))
        assert db > 30, (mode, compiled, offload, db)
    torch._dynamo.reset()
