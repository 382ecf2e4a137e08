"""attnqat.pipelines.schedule: the precision schedule for inference (high-precision attention on chosen
denoising steps and blocks, FP4 elsewhere).

The switching is checked on real WanPipeline runs of the tiny model: a spy on the attention call of
the patched processors records which mode each block's attention actually ran at each denoising step
(the step counted from the transformer's own calls, not from the schedule), against the expected
schedule. The extreme schedules are compared with plain runs: every step in high precision is the
bf16 run exactly, no step is the FP4 run exactly (and the two differ, so the comparison can fail).
The tiny pipeline runs in fp32 on the CPU here: the FP4 modes take their PyTorch references.
"""
import re

import numpy as np
import pytest
import torch

import attnqat.pipelines.processor as processor_module
from attnqat.pipelines import (AttnQATProcessor, PrecisionSchedule, attention_modes, build_tiny_pipeline,
                               patch_attention, unpatch_attention)
from attnqat.pipelines.schedule import parse_blocks, parse_steps

FP4 = "attn_qat"
STEPS = 5
CALL = dict(prompt="a corgi", negative_prompt="blurry", height=32, width=32, num_frames=5, guidance_scale=5.0,
            output_type="latent", max_sequence_length=32)  # guidance > 1: cond + uncond, 2 calls per step


# ------------------------------------------------------------------------------------------- parsing
@pytest.mark.parametrize("text, expected", [
    ("first:2,last:1", (2, 1, ())),
    ("0,1,-1", (0, 0, (-1, 0, 1))),
    (" first:3 , 10 ", (3, 0, (10,))),
    ("last:4", (0, 4, ())),
    ("2,2,-0", (0, 0, (0, 2))),          # a step named twice is one step
    ("first:0", (0, 0, ())),
])
def test_parse_steps_accepts(text, expected):
    assert parse_steps(text) == expected


HOSTILE_STEPS = ["", " ", ",", "0,", ",1", "0,,1", "first:", "first:-1", "first:x", "last:2.0", "1.5", "1e3",
                 "0x10", "1_0", "١", "１", "x", "first", "first:2,first:3", "last:1,last:1", "FIRST:2", "first: 2x",
                 "9" * 30, "first:" + "9" * 30, "0\x001", "0;1", "[0, 1]", "\ud800", "💥"]


@pytest.mark.parametrize("text", HOSTILE_STEPS, ids=[repr(t)[:20] for t in HOSTILE_STEPS])
def test_parse_steps_rejects_with_one_line(text):
    with pytest.raises(ValueError) as e:
        parse_steps(text, "--high-precision-steps")
    msg = str(e.value)
    assert msg.startswith("--high-precision-steps") and "\n" not in msg, msg


@pytest.mark.parametrize("text", ["", ",", "0,,1", "first:1", "a", "1.0", "-", "--1", "9" * 12])
def test_parse_blocks_rejects(text):
    with pytest.raises(ValueError, match="^blocks"):
        parse_blocks(text)


def test_schedule_values_are_checked_and_resolved():
    assert parse_blocks("0,-1,0") == (-1, 0)
    s = PrecisionSchedule.parse("first:2,last:1,-3", "0,-1")
    assert s == PrecisionSchedule(first=2, last=1, steps=(-3,), blocks=(0, -1))
    assert s.steps_text() == "first:2,last:1,-3" and s.blocks_text() == "-1,0"
    assert s.resolve_steps(8) == {0, 1, 5, 7}
    assert s.resolve_steps(3) == {0, 1, 2}  # overlapping parts
    assert s.resolve_blocks(40) == [0, 39]
    assert s.describe(8, 40) == "bf16 on steps 0-1, 5, 7 of 8 (first:2,last:1,-3); in blocks 0, 39 of 40 at every step"
    assert PrecisionSchedule().empty and PrecisionSchedule(first=0).empty and not PrecisionSchedule(last=1).empty
    assert PrecisionSchedule(steps=[3, 1, 3]).steps == (1, 3)
    with pytest.raises(ValueError, match=r"steps: step index \[8\] out of range for 8 denoising steps \(0..7, or -8"):
        PrecisionSchedule(steps=(8,)).resolve_steps(8, "steps")
    with pytest.raises(ValueError, match=r"step index \[-9\] out of range"):
        PrecisionSchedule(steps=(-9,)).resolve_steps(8)
    with pytest.raises(ValueError, match="last:9 is more than the run's 8 denoising steps"):
        PrecisionSchedule(last=9).resolve_steps(8)
    with pytest.raises(ValueError, match=r"block index \[2\] out of range for a transformer of 2 blocks"):
        PrecisionSchedule(blocks=(2,)).resolve_blocks(2)
    for bad, message in [(dict(first=-1), "first must be a whole number >= 0"), (dict(last=True), "last must be"),
                         (dict(first=1.0), "first must be"), (dict(steps=("1",)), "steps must be whole numbers"),
                         (dict(steps="01"), "steps must be a sequence"), (dict(blocks=(0.5,)), "blocks must be"),
                         (dict(mode="nvfp4"), "high-precision mode 'nvfp4' not in bf16, sagebwd")]:
        with pytest.raises(ValueError, match=message):
            PrecisionSchedule(**bad)
    with pytest.raises(ValueError, match="mode 'fp4' not in bf16, sagebwd"):
        PrecisionSchedule.parse("0", mode="fp4")
    with pytest.raises(ValueError, match="number of denoising steps must be"):
        s.resolve_steps(0)


def test_for_blocks_resolves_once_and_is_then_read_as_it_is(monkeypatch):
    import attnqat.pipelines.schedule as schedule_module

    s = PrecisionSchedule.parse("first:1", "0,-1")
    bound = s.for_blocks(40)
    assert (bound.blocks, bound.num_blocks, s.num_blocks) == ((0, 39), 40, None)
    assert bound == PrecisionSchedule(first=1, blocks=(0, 39)) and bound.steps_text() == "first:1"
    resolve = schedule_module._resolve
    monkeypatch.setattr(schedule_module, "_resolve", lambda indices, n, what, flag: pytest.fail(
        "blocks resolved again") if what == "block" else resolve(indices, n, what, flag))
    assert bound.resolve_blocks(40) == [0, 39] and bound.for_blocks(40) is bound
    assert bound.describe(4, 40) == "bf16 on step 0 of 4 (first:1); in blocks 0, 39 of 40 at every step"
    with pytest.raises(ValueError, match="^--b: the schedule's blocks were resolved for a transformer of 40 blocks, "
                                         "not 30$"):
        bound.for_blocks(30, "--b")
    with pytest.raises(ValueError, match=r"blocks \[-1\] are not resolved 0-based indices of 40 blocks"):
        PrecisionSchedule(blocks=(-1,), num_blocks=40)
    with pytest.raises(ValueError, match="num_blocks must be a whole number >= 1"):
        PrecisionSchedule(num_blocks=0)


def test_for_steps_resolves_once_and_is_then_read_as_it_is(monkeypatch):
    import attnqat.pipelines.schedule as schedule_module

    s = PrecisionSchedule.parse("first:2,-1", "0")
    bound = s.for_steps(8, "--s").for_blocks(40)
    assert (bound.num_steps, bound.high_steps, bound.num_blocks, s.num_steps) == (8, {0, 1, 7}, 40, None)
    assert bound == PrecisionSchedule(first=2, steps=(-1,), blocks=(0,)) and bound.steps_text() == "first:2,-1"
    monkeypatch.setattr(schedule_module, "_resolve", lambda *a: pytest.fail("resolved again"))
    assert bound.resolve_steps(8) == {0, 1, 7} and bound.for_steps(8) is bound
    assert bound.describe(8, 40) == "bf16 on steps 0-1, 7 of 8 (first:2,-1); in block 0 of 40 at every step"
    with pytest.raises(ValueError, match="^--s: the schedule's steps were resolved for a run of 8 denoising steps, "
                                         "not 5$"):
        bound.for_steps(5, "--s")
    with pytest.raises(ValueError, match="--s: first:2 is more than the run's 1 denoising steps"):
        s.for_steps(1, "--s")
    for bad in (dict(num_steps=8), dict(high_steps=frozenset({0})), dict(num_steps=2, high_steps=frozenset({2})),
                dict(num_steps=2, high_steps={0})):
        with pytest.raises(ValueError, match="num_steps and high_steps are a run's step count"):
            PrecisionSchedule(**bad)


# ------------------------------------------------------------------------------------ tiny pipeline
@pytest.fixture(scope="module")
def pipe():
    p = build_tiny_pipeline()
    p.set_progress_bar_config(disable=True)
    return p


@pytest.fixture
def clean(pipe):
    yield pipe
    unpatch_attention(pipe.transformer)


def _run(pipe, steps=STEPS, callback=None, seed=0):
    """Fresh latents of one pipeline call (a new tensor every call)."""
    with torch.no_grad():
        return pipe(**CALL, num_inference_steps=steps, generator=torch.Generator().manual_seed(seed),
                    callback_on_step_end=callback).frames


class _Spy:
    """Records (denoising step, attention module, mode) of every attention call of the patched
    processors. The step is counted from the transformer's own calls (``per_step`` of them a step)."""

    def __init__(self, pipe, monkeypatch, per_step=2):
        self.calls, self.module, self.forwards, self.per_step = [], None, 0, per_step
        tr = pipe.transformer
        self.hooks = [tr.register_forward_pre_hook(self._forward)]
        for name, m in tr.named_modules():
            if name.endswith(("attn1", "attn2")):
                self.hooks.append(m.register_forward_pre_hook(lambda mod, args, name=name: self._enter(name)))
        real = processor_module.AttnQATProcessor._attention  # every attention call of a processor, mode in hand

        def spy(proc, q, k, v, mode, *args):
            self.calls.append(((self.forwards - 1) // self.per_step, self.module, mode))
            return real(proc, q, k, v, mode, *args)

        monkeypatch.setattr(processor_module.AttnQATProcessor, "_attention", spy)

    def _forward(self, module, args):
        self.forwards += 1

    def _enter(self, name):
        self.module = name

    def modes(self):
        """{(step, module): mode}; each module is called once per transformer call, so per step
        ``per_step`` times, always in the same mode."""
        out = {}
        for step, module, mode in self.calls:
            assert out.setdefault((step, module), mode) == mode, (step, module, out[(step, module)], mode)
        return out

    def remove(self):
        for h in self.hooks:
            h.remove()


def _expected(schedule, steps, fp4, patched_blocks=(0, 1), n_blocks=2):
    high_steps, high_blocks = schedule.resolve_steps(steps), set(schedule.resolve_blocks(n_blocks))
    return {(s, f"blocks.{b}.attn1"): schedule.mode if s in high_steps or b in high_blocks else fp4
            for s in range(steps) for b in patched_blocks}


@pytest.mark.parametrize("text, blocks", [("first:1,last:1", None), ("0,2,-1", "-1"), ("-2", None),
                                          ("last:2", "0"), ("first:5", None)])
def test_callback_switches_modes_at_exactly_the_right_steps(clean, monkeypatch, text, blocks):
    pipe = clean
    schedule = PrecisionSchedule.parse(text, blocks)
    patch_attention(pipe.transformer, FP4, schedule=schedule)
    spy = _Spy(pipe, monkeypatch)
    try:
        _run(pipe, callback=schedule.callback(pipe.transformer, STEPS))
    finally:
        spy.remove()
    assert spy.forwards == 2 * STEPS and len(spy.calls) == 2 * STEPS * 2  # 2 blocks' attn1, cond + uncond
    assert spy.modes() == _expected(schedule, STEPS, FP4)
    # after the run every processor is back in its own mode (block -1 stays bf16: patched so)
    assert attention_modes(pipe.transformer)["blocks.0.attn1"] == ("bf16" if blocks == "0" else FP4)
    assert not any(p.high_precision for p in _processors(pipe))


def _processors(pipe):
    return [m.processor for m in pipe.transformer.modules() if isinstance(getattr(m, "processor", None),
                                                                             AttnQATProcessor)]


def test_switching_allocates_no_processor_and_sagebwd_is_a_high_precision_mode(clean, monkeypatch):
    pipe = clean
    schedule = PrecisionSchedule(last=2, mode="sagebwd")
    patch_attention(pipe.transformer, FP4, "all", schedule=schedule)
    before = _processors(pipe)
    spy = _Spy(pipe, monkeypatch)
    try:
        _run(pipe, steps=3, callback=schedule.callback(pipe.transformer, 3))
    finally:
        spy.remove()
    assert _processors(pipe) == before and all(a is b for a, b in zip(_processors(pipe), before))
    modes = spy.modes()
    assert len(modes) == 3 * 4  # attn1 and attn2 of 2 blocks
    assert {m for (s, _), m in modes.items() if s == 0} == {FP4}
    assert {m for (s, _), m in modes.items() if s in (1, 2)} == {"sagebwd"}


def test_all_steps_high_precision_is_the_bf16_run_and_no_steps_the_fp4_run(clean, poison):
    pipe = clean
    patch_attention(pipe.transformer, "bf16")
    bf16 = _run(pipe)
    patch_attention(pipe.transformer, FP4)
    fp4 = _run(pipe)
    assert torch.isfinite(bf16).all() and torch.isfinite(fp4).all()
    assert not torch.equal(bf16, fp4)  # the comparisons below can fail

    results = {}
    for text in ("first:5", "last:5", "0,1,2,3,4", "first:3,last:2", "first:0", "-1", "first:2"):
        schedule = PrecisionSchedule.parse(text)
        patch_attention(pipe.transformer, FP4, schedule=schedule)
        results[text] = _run(pipe, callback=schedule.callback(pipe.transformer, STEPS))
        assert results[text] is not bf16 and results[text] is not fp4
    for text in ("first:5", "last:5", "0,1,2,3,4", "first:3,last:2"):
        assert torch.equal(results[text], bf16), text
    assert torch.equal(results["first:0"], fp4)
    for text in ("-1", "first:2"):  # some steps: neither run
        assert not torch.equal(results[text], bf16) and not torch.equal(results[text], fp4), text
    # every block in high precision is bf16 at every step, without any callback
    patch_attention(pipe.transformer, FP4, schedule=PrecisionSchedule(blocks=(0, 1)))
    assert torch.equal(_run(pipe), bf16)


def test_blocks_option_of_patch_attention(clean):
    tr = clean.transformer
    names = patch_attention(tr, FP4, "all", schedule=PrecisionSchedule(blocks=(-1,)), p_bwd="normalized")
    assert names == ["blocks.0.attn1", "blocks.1.attn1", "blocks.0.attn2", "blocks.1.attn2"]
    assert attention_modes(tr) == {"blocks.0.attn1": FP4, "blocks.0.attn2": FP4, "blocks.1.attn1": "bf16",
                                   "blocks.1.attn2": "bf16"}
    high, low = tr.blocks[1].attn1.processor, tr.blocks[0].attn1.processor
    assert high.options == {} and low.options == {"p_bwd": "normalized"}  # FP4's options are not bf16's
    assert low.high_precision_mode == high.high_precision_mode == "bf16"
    low.high_precision = True
    assert attention_modes(tr)["blocks.0.attn1"] == "bf16"
    with pytest.raises(ValueError, match=r"high-precision blocks \[0\] are not among the patched blocks \[1\]"):
        patch_attention(tr, FP4, [1], schedule=PrecisionSchedule(blocks=(0,)))
    with pytest.raises(ValueError, match=r"block index \[2\] out of range for a transformer of 2 blocks"):
        patch_attention(tr, FP4, schedule=PrecisionSchedule(blocks=(2,)))
    patch_attention(tr, FP4, [1], schedule=PrecisionSchedule(blocks=(1,)))
    assert attention_modes(tr) == {"blocks.0.attn1": "diffusers", "blocks.0.attn2": "diffusers",
                                   "blocks.1.attn1": "bf16", "blocks.1.attn2": "diffusers"}


def test_callback_refuses_what_it_cannot_schedule(clean):
    pipe, schedule = clean, PrecisionSchedule(first=1)
    with pytest.raises(ValueError, match="no attention layer of this transformer is patched"):
        schedule.callback(pipe.transformer, 2)
    patch_attention(pipe.transformer, FP4)  # without the schedule: its processors know no high-precision mode
    with pytest.raises(ValueError, match="patched with high-precision mode None, not this schedule's 'bf16'"):
        schedule.callback(pipe.transformer, 2)
    patch_attention(pipe.transformer, FP4, schedule=schedule)
    with pytest.raises(ValueError, match="made for 3 denoising steps, but the pipeline runs 2"):
        _run(pipe, steps=2, callback=schedule.callback(pipe.transformer, 3))
    assert not any(p.high_precision for p in _processors(pipe))
    switch = schedule.callback(pipe.transformer, 2)
    _run(pipe, steps=2, callback=switch)
    with pytest.raises(ValueError, match="expected no step .*call start\\(\\) before each pipeline call"):
        _run(pipe, steps=2, callback=switch)  # reused without start()
    switch.start()
    _run(pipe, steps=2, callback=switch)
    with pytest.raises(ValueError, match=r"step index \[5\] out of range for 2 denoising steps"):
        PrecisionSchedule(steps=(5,)).callback(pipe.transformer, 2)


def test_evaluation_variants_use_the_schedule(clean):
    from attnqat.mini.evaluation import Variant, generate_videos

    pipe = clean
    size = dict(height=32, width=32, frames=5, steps=2, guidance=5.0, batch=1)
    bf16, _ = generate_videos(pipe, Variant("bf16"), ["a fox"], **size)
    fp4, _ = generate_videos(pipe, Variant("fp4", FP4), ["a fox"], **size)
    every, _ = generate_videos(pipe, Variant("every", FP4, high_precision_steps=(0, -1)), ["a fox"], **size)
    as_schedule, _ = generate_videos(pipe, Variant("s", FP4, high_precision_steps=PrecisionSchedule(first=2)),
                                  ["a fox"], **size)
    one, _ = generate_videos(pipe, Variant("one", FP4, high_precision_steps=(-1,)), ["a fox"], **size)
    assert not np.array_equal(bf16, fp4)
    assert np.array_equal(every, bf16) and np.array_equal(as_schedule, bf16)
    assert not np.array_equal(one, bf16) and not np.array_equal(one, fp4)
    assert Variant("x").schedule is None and Variant("x", high_precision_steps=(1,)).schedule.steps == (1,)
    assert set(attention_modes(pipe.transformer).values()) == {"diffusers"}  # left unpatched


# -------------------------------------------------------------------------------- attnqat generate
GEN = ["--model", "tiny", "--height", "32", "--width", "32", "--frames", "5", "--steps", "3", "--device", "cpu"]


def _generate(tmp_path, name, *extra):
    from attnqat.cli import main

    folder = tmp_path / name
    assert main(["generate", "--prompt", "p", *GEN, "--out", str(tmp_path / f"{name}.mp4"),
                 "--frames-dir", str(folder), *extra]) == 0
    import imageio.v2 as imageio

    return np.stack([imageio.imread(p) for p in sorted(folder.glob("frame_*.png"))])


def test_generate_high_precision_flags_end_to_end(tmp_path, capsys, monkeypatch):
    bf16 = _generate(tmp_path, "bf16")
    fp4 = _generate(tmp_path, "fp4", "--mode", FP4)
    assert not np.array_equal(bf16, fp4)
    assert "precision    " not in capsys.readouterr().err

    every = _generate(tmp_path, "every", "--mode", FP4, "--high-precision-steps", "first:2,last:1")
    err = capsys.readouterr().err
    assert "precision    bf16 on steps 0-2 of 3 (first:2,last:1); attn_qat elsewhere" in err
    assert np.array_equal(every, bf16)
    none = _generate(tmp_path, "none", "--mode", FP4, "--high-precision-steps", "first:0")
    assert np.array_equal(none, fp4)

    # which mode each block ran at each step: 2 blocks' attn1, cond + uncond, so 4 calls a step
    seen = []
    real = processor_module.attention
    monkeypatch.setattr(processor_module, "attention", lambda q, k, v, mode, **kw: seen.append(mode) or real(
        q, k, v, mode, **kw))
    some = _generate(tmp_path, "some", "--mode", FP4, "--high-precision-steps", "-1",
                     "--high-precision-blocks", "0", "--high-precision-mode", "sagebwd")
    assert len(seen) == 3 * 4
    ran = {(j // 4, j % 2): mode for j, mode in enumerate(seen)}
    assert ran == {(0, 0): "sagebwd", (0, 1): FP4, (1, 0): "sagebwd", (1, 1): FP4,
                   (2, 0): "sagebwd", (2, 1): "sagebwd"}
    assert "precision    sagebwd on step 2 of 3 (-1); in block 0 of 2 at every step; attn_qat elsewhere" in \
        capsys.readouterr().err
    assert not np.array_equal(some, fp4) and not np.array_equal(some, bf16)


BAD = [
    (["--high-precision-steps", "first:4"], "--high-precision-steps: first:4 is more than the run's 3 denoising steps"),
    (["--high-precision-steps", "3"], r"--high-precision-steps: step index \[3\] out of range for 3 denoising steps"),
    (["--high-precision-steps=-4,0"], r"step index \[-4\] out of range"),  # '=': argparse takes -4,0 for a flag
    (["--high-precision-steps", ""], "--high-precision-steps is empty"),
    (["--high-precision-steps", "first:2,x"], "--high-precision-steps 'first:2,x': 'x' is not first:K, last:K or a "
                                              "step index"),
    (["--high-precision-steps", "0,,1"], "an empty item between commas"),
    (["--high-precision-blocks", "2"], r"--high-precision-blocks: block index \[2\] out of range for a transformer "
                                       r"of 2 blocks \(0..1, or -2..-1 from the end\)"),
    (["--high-precision-blocks", "one"], "'one' is not a block index"),
    (["--layers", "0", "--high-precision-blocks", "1"], r"blocks \[1\] are not among --layers 0"),
    (["--high-precision-mode", "sagebwd"], "--high-precision-mode needs --high-precision-steps or "
                                           "--high-precision-blocks"),
    (["--high-precision-steps", "0", "--high-precision-mode", "nvfp4"], "--high-precision-mode 'nvfp4' not in bf16, "
                                                                         "sagebwd"),
]


@pytest.mark.parametrize("extra, message", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_generate_refuses_bad_schedules_before_loading(tmp_path, capsys, monkeypatch, extra, message):
    import attnqat.pipelines.loading as loading
    from attnqat.cli import main

    monkeypatch.setattr(loading, "load_pipeline", lambda *a, **k: pytest.fail("the model started loading"))
    assert main(["generate", "--prompt", "p", *GEN, "--out", str(tmp_path / "v.mp4"), *extra]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("attnqat generate: error: "), err
    assert re.search(message, err), err
    assert not (tmp_path / "v.mp4").exists()


@pytest.mark.parametrize("config_known", [True, False], ids=["model-folder", "hub-id"])
def test_generate_decides_the_blocks_and_the_layout_once(tmp_path, capsys, monkeypatch, config_known):
    """One generate run resolves --high-precision-steps once (at the edge), --high-precision-blocks once and checks
    the layout once: before loading where the model's config reads, after loading for a hub id (whose config is
    known only then)."""
    import attnqat.pipelines.generate as generate_module
    import attnqat.pipelines.loading as loading
    import attnqat.pipelines.schedule as schedule_module

    if not config_known:
        monkeypatch.setattr(loading, "model_transformer_config", lambda model: None)
    calls = {"steps": 0, "blocks": 0, "layout": 0}
    resolve, layout = schedule_module._resolve, generate_module.check_parallel_layout

    def counted_resolve(indices, n, what, flag):
        calls["steps" if what == "step" else "blocks"] += 1
        return resolve(indices, n, what, flag)

    def counted_layout(args, config):
        calls["layout"] += config["num_layers"] == 2  # the tiny transformer's config, never a stand-in
        return layout(args, config)

    monkeypatch.setattr(schedule_module, "_resolve", counted_resolve)
    monkeypatch.setattr(generate_module, "check_parallel_layout", counted_layout)
    _generate(tmp_path, "once", "--mode", FP4, "--high-precision-blocks=-1", "--high-precision-steps", "first:1")
    assert calls == {"steps": 1, "blocks": 1, "layout": 1}
    assert ("precision    bf16 on step 0 of 3 (first:1); in block 1 of 2 at every step; attn_qat elsewhere"
            in capsys.readouterr().err)


def test_generate_help_documents_the_flags(capsys):
    from attnqat.cli import main

    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for must in ("--high-precision-steps SPEC", "first:K (the first K steps)", "last:K", "e.g. first:2,last:1",
                 "--high-precision-blocks LIST", "--high-precision-mode MODE", "bf16 (default) or sagebwd"):
        assert must in text, must


# ------------------------------------------------------------------------------------------ the demo
def test_demo_runs_fp4_columns_with_bf16_first_and_last_steps(tmp_path, clean):
    from attnqat.demo import DemoEngine, validate_request

    pipe = clean
    engine = DemoEngine(pipe, model="tiny", device=torch.device("cpu"), dtype=torch.float32)
    size = dict(height=32, width=32, frames=5, steps=3, seed=1)
    plain = engine.run("p", modes=["nvfp4"], out_dir=tmp_path / "plain", **size)
    every = engine.run("p", modes=["nvfp4"], out_dir=tmp_path / "every", high_precision_steps=2, **size)
    some = engine.run("p", modes=["nvfp4"], out_dir=tmp_path / "some", high_precision_steps=1, **size)
    assert np.array_equal(plain[0].frames, every[0].frames)  # bf16 column: no schedule
    assert not np.array_equal(plain[1].frames, plain[0].frames)
    assert np.array_equal(every[1].frames, every[0].frames) and np.isinf(every[1].psnr)
    assert not np.array_equal(some[1].frames, plain[1].frames) and not np.array_equal(some[1].frames,
                                                                                      some[0].frames)
    assert plain[1].precision is None and some[0].precision is None
    assert some[1].precision == "bf16 on steps 0, 2 of 3 (first:1,last:1)"
    assert some[1].summary()["precision"] == some[1].precision
    req = dict(model="tiny", prompt="p", height=32, width=32, frames=5, steps=3, seed=0, modes=["bf16", "nvfp4"])
    for k, message in [(4, "between 0 and the 3 steps"), (-1, "between 0 and the 3 steps"),
                       (1.5, "must be a whole number")]:
        with pytest.raises(ValueError, match=message):
            validate_request(**req, high_precision_steps=k)
