"""The objective registry and the student/teacher setup, on the tiny model (CPU).

A class registered with ``register_objective`` is all config validation and the Trainer need: its name is
accepted, its needs (a teacher, dataset latents) decide what is built and checked, and its ``"loss"`` is what a
step computes, checked here against the student's (and teacher's) forward done by hand. Training patches each
selected layer once, with the training processor, and only those layers.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from attnqat.kernels import REFERENCE_MODE
from attnqat.pipelines.processor import AttnQATProcessor, unpatch_attention
from attnqat.train import OBJECTIVES, Objective, Trainer, load_config, register_objective, validate
from attnqat.train.student_teacher import AutocastAttnProcessor, make_student_teacher

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"


@pytest.fixture(autouse=True)
def reference_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the FP4 reference path: the interpreter takes only bf16


def tiny(tmp_path, *overrides):
    return load_config(TINY, [f"output_dir={tmp_path}", "log.progress=false", "data.batch_size=2", *overrides])


@pytest.fixture
def register():
    """register_objective for one test: the classes it adds leave the registry afterwards."""
    added = []

    def add(cls):
        register_objective(cls)
        added.append(cls.name)
        return cls
    yield add
    for name in added:
        OBJECTIVES.pop(name, None)


class Shrink(Objective):
    """A test objective: the student's mean squared velocity, on Gaussian latents, without a teacher."""

    name = "shrink"
    needs_teacher = False

    @property
    def latents(self):
        return "noise"

    def terms(self, velocity, batch, gaps):
        self.gaps_seen = sorted(gaps)
        return {"loss": velocity.float().pow(2).mean()}


class MatchTeacher(Shrink):
    """A test objective: the output gap to the teacher (its loss reads the teacher's forward)."""

    name = "match_teacher"
    needs_teacher = True

    def terms(self, velocity, batch, gaps):
        self.gaps_seen = sorted(gaps)
        return {"loss": gaps["gap"]}


class ShrinkOnData(Shrink):
    """Like Shrink, on the dataset's latents (the base class's default)."""

    name = "shrink_on_data"

    @property
    def latents(self):
        return Objective.latents.fget(self)


def test_registering_a_class_is_what_config_validation_needs(tmp_path, register):
    cfg = tiny(tmp_path, "objective.type=shrink")
    with pytest.raises(ValueError, match="objective.type 'shrink' is not one of distill, flow, mix$"):
        validate(cfg)
    register(Shrink)
    validate(cfg)  # accepted: nothing else lists the objectives
    register(ShrinkOnData)
    # its needs are checked by name: dataset latents, and this data-free config has none
    with pytest.raises(ValueError, match="objective.type 'shrink_on_data' needs a dataset of video latents"):
        validate(tiny(tmp_path, "objective.type=shrink_on_data"))

    class Unsaid(Objective):  # whether it needs a teacher is for each objective to say
        name = "unsaid"

        def terms(self, velocity, batch, gaps):
            return {"loss": velocity.float().pow(2).mean()}
    with pytest.raises(TypeError, match="bool needs_teacher"):
        register(Unsaid)

    class Again(Shrink):
        name = "distill"
    with pytest.raises(ValueError, match="objective 'distill' is registered already"):
        register(Again)
    assert sorted(OBJECTIVES) == ["distill", "flow", "mix", "shrink", "shrink_on_data"]


@pytest.mark.parametrize("objective, held_out, builds_teacher", [
    (Shrink, 0, False),        # nothing asks for a teacher: none is built
    (MatchTeacher, 0, True),   # the objective's loss reads it
    (Shrink, 2, True),         # the held-out gap is measured against it
])
def test_the_objectives_needs_decide_whether_a_teacher_is_built(tmp_path, register, objective, held_out,
                                                                builds_teacher):
    register(objective)
    trainer = Trainer(tiny(tmp_path, f"objective.type={objective.name}", f"data.held_out={held_out}"))
    try:
        assert isinstance(trainer.objective, objective)
        assert (trainer.teacher is not None) == builds_teacher
        if builds_teacher:  # frozen, the reference mode in the student's layers (configs/tiny.yaml: self)
            assert not any(p.requires_grad for p in trainer.teacher.parameters())
            assert [b.attn1.processor.mode for b in trainer.teacher.blocks] == [REFERENCE_MODE] * 2
        student, teacher = trainer.student, trainer.teacher
        batch = trainer.micro_batch(0, 0)
        out = trainer.losses(batch)
        # the step's loss is the objective's, from a forward done here by hand
        s = batch["sigma"].view(-1, 1, 1, 1, 1)
        inputs = dict(hidden_states=(1 - s) * batch["x0"] + s * batch["noise"], timestep=batch["sigma"] * 1000,
                      encoder_hidden_states=batch["embeds"], return_dict=False)
        with torch.no_grad():
            velocity = student(**inputs)[0].float()
            if objective.needs_teacher:
                t = teacher(**inputs)[0].float()
                want = (velocity - t).pow(2).sum() / t.pow(2).sum()
            else:
                want = velocity.pow(2).mean()
        torch.testing.assert_close(out["loss"].detach(), want, rtol=1e-5, atol=0)
        assert out["loss"].requires_grad  # the training step's forward: the loss can be backpropagated
        assert trainer.objective.gaps_seen == (["gap", "gap_features"] if objective.needs_teacher else [])
    finally:
        trainer.s_cap.remove()
        if trainer.t_cap is not None:
            trainer.t_cap.remove()


def test_training_patches_each_selected_layer_once(monkeypatch):
    """make_student_teacher with layers [1]: one training processor per selected layer (student and teacher),
    the other layers untouched, and the patch is undone as patch_attention's is."""
    from attnqat.pipelines import build_tiny_transformer

    built = []
    init = AttnQATProcessor.__init__

    def counting_init(self, mode, **kwargs):
        built.append((type(self), mode))
        init(self, mode, **kwargs)
    monkeypatch.setattr(AttnQATProcessor, "__init__", counting_init)
    transformer = build_tiny_transformer().float()
    originals = {n: m.processor for n, m in transformer.named_modules() if hasattr(m, "processor")}
    student, teacher = make_student_teacher(transformer, "attn_qat", [1], teacher_dtype=torch.bfloat16,
                                            trainable="attention")
    assert sorted(built, key=str) == sorted([(AutocastAttnProcessor, "attn_qat"),
                                             (AutocastAttnProcessor, REFERENCE_MODE)], key=str)
    for model, mode in ((student, "attn_qat"), (teacher, REFERENCE_MODE)):
        assert type(model.blocks[1].attn1.processor) is AutocastAttnProcessor
        assert model.blocks[1].attn1.processor.mode == mode
        for name in ("blocks.0.attn1", "blocks.0.attn2", "blocks.1.attn2"):
            assert not isinstance(model.get_submodule(name).processor, AttnQATProcessor), name
    assert teacher.blocks[1].attn1.to_q.weight.dtype == torch.bfloat16
    assert {n for n, p in student.named_parameters() if p.requires_grad} == \
        {n for n, _ in student.blocks[1].attn1.named_parameters(prefix="blocks.1.attn1")}
    unpatch_attention(student)
    assert student.blocks[1].attn1.processor is originals["blocks.1.attn1"]

    built.clear()
    transformer = build_tiny_transformer().float()
    student, teacher = make_student_teacher(transformer, "attn_qat", "self", with_teacher=False)
    assert teacher is None and built == [(AutocastAttnProcessor, "attn_qat")] * 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("teacher_grad", [False, True])
def test_nmse_matches_autograds_formula_bit_for_bit_and_saves_no_float32_copy(dtype, teacher_grad):
    """objectives.nmse: the value and the gradients equal autograd's through the plain formula, bit for bit, for a
    frozen teacher (training) and one that wants its gradient; with a frozen one, what it keeps for the backward is
    its two inputs, not a float32 s - t per call (27 GB over Wan 14B's 40 blocks)."""
    from attnqat.train.objectives import nmse

    g = torch.Generator().manual_seed(7)
    s0, t0 = (torch.randn(3, 50, 24, generator=g).to(dtype) for _ in range(2))
    weight = torch.rand((), generator=g) + 0.5  # an upstream gradient that is not 1

    def plain(s, t):
        s32, t32 = s.float(), t.float()
        return (s32 - t32).pow(2).sum() / t32.pow(2).sum().clamp_min(1e-12)

    got, want = [], []
    for fn, out in ((nmse, got), (plain, want)):
        s, t = s0.clone().requires_grad_(), t0.clone().requires_grad_(teacher_grad)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(x) or x, lambda x: x):
            value = fn(s, t)
        (value * weight).backward()
        out += [value, s.grad, t.grad, saved]
    for a, b in zip(got[:2], want[:2]):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert got[1].abs().sum() > 0
    if teacher_grad:
        assert torch.equal(got[2], want[2]) and got[2].abs().sum() > 0
    else:
        assert got[2] is None and want[2] is None
    if dtype == torch.bfloat16 and not teacher_grad:  # the plain formula keeps a float32 s - t; nmse none that size
        assert any(x.dtype == torch.float32 and x.shape == s0.shape for x in want[3])
        assert not any(x.dtype == torch.float32 and x.shape == s0.shape for x in got[3])
