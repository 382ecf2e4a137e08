"""The attention-consistency term (attnqat/train/consistency.py, ``objective.attention_consistency``) on the tiny
model (CPU, the FP4 reference path): its value and gradient against the layers' q, k, v run through
``attention`` apart, the loss it makes for every objective, that it lowers itself in a few steps, that evaluation and
inference never compute it, that the processors are unchanged without it, checkpointing, the graphed step's body,
compiled blocks, and the config's refusals.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from attnqat.kernels import REFERENCE_MODE, attention
from attnqat.pipelines import build_tiny_transformer
from attnqat.pipelines.processor import patch_attention
from attnqat.train import OBJECTIVES, Trainer, load_config, train, validate
from attnqat.train import graphed, loop
from attnqat.train.config import ObjectiveConfig
from attnqat.train.consistency import AttentionConsistency
from attnqat.train.graphed import StepGraphs
from attnqat.train.student_teacher import AutocastAttnProcessor, make_student_teacher
from attnqat.pipelines.tiny import TINY_TRANSFORMER_CONFIG

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"


@pytest.fixture(autouse=True)
def reference_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the FP4 reference path (fp32): the interpreter takes only bf16


def tiny(tmp_path, *overrides):
    return load_config(TINY, [f"output_dir={tmp_path}", "log.progress=false", "data.batch_size=2", "data.held_out=0",
                              "train.gradient_checkpointing=false", "checkpoint.every=1000", *overrides])


@pytest.fixture
def trainers():
    """``make(cfg)``: a Trainer whose feature hooks are removed after the test."""
    made = []

    def make(cfg):
        made.append(Trainer(cfg))
        return made[-1]
    yield make
    for t in made:
        t.s_cap.remove()
        if t.t_cap is not None:
            t.t_cap.remove()


def _spy_attention(monkeypatch) -> list:
    """Record every training processor's attention call: (processor, mode, query, key, value), (B, L, H, D)."""
    calls = []
    real = AutocastAttnProcessor._attention

    def spy(self, query, key, value, mode, options, parallel_config):
        calls.append((self, mode, query, key, value))
        return real(self, query, key, value, mode, options, parallel_config)
    monkeypatch.setattr(AutocastAttnProcessor, "_attention", spy)
    return calls


def _inputs(batch):
    s = batch["sigma"].view(-1, 1, 1, 1, 1)
    return dict(hidden_states=(1 - s) * batch["x0"] + s * batch["noise"], timestep=batch["sigma"] * 1000,
                encoder_hidden_states=batch["embeds"], return_dict=False)


def test_term_is_each_layers_own_fp4_error_computed_apart(tmp_path, trainers, monkeypatch):
    """The logged term of a training forward is the mean over the student's self-attention layers of
    ||attention(q, k, v, fp4) - attention(q, k, v, reference)||^2 / ||reference||^2, on the q, k, v each layer
    computed, run through ``attention`` here; its gradient to the last layer's q, k, v is that of this computation,
    through both branches (the reference output is not detached: consistency.py says why)."""
    trainer = trainers(tiny(tmp_path, "objective.attention_consistency=1.0", "train.trainable=all"))
    calls = _spy_attention(monkeypatch)
    out = trainer.losses(trainer.micro_batch(0, 0))
    student = {id(b.attn1.processor) for b in trainer.student.blocks}
    fp4 = [(q, k, v) for p, mode, q, k, v in calls if id(p) in student and mode == "attn_qat"]
    refs = [(q, k, v) for p, mode, q, k, v in calls if id(p) in student and mode == REFERENCE_MODE]
    assert len(fp4) == 2 and all(all(a is b for a, b in zip(f, r)) for f, r in zip(fp4, refs))  # the same q, k, v
    leaves = [tuple(x.detach().clone().requires_grad_() for x in qkv) for qkv in fp4]
    ratios = []
    for q, k, v in leaves:
        o = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), "attn_qat").float()
        r = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), REFERENCE_MODE).float()
        ratios.append((o - r).pow(2).sum() / r.pow(2).sum())
    want = torch.stack(ratios).mean()
    assert out["consistency"].dtype == torch.float32 and out["consistency"].dim() == 0
    assert 1e-3 < want.item() < 0.1 and abs(ratios[0].item() - ratios[1].item()) > 1e-4  # two real, different layers
    torch.testing.assert_close(out["consistency"].detach(), want.detach(), rtol=1e-5, atol=0)
    # the last layer's q, k, v reach the term through that layer alone (block 0's also through block 1)
    got = torch.autograd.grad(out["consistency"], fp4[-1])
    expected = torch.autograd.grad(want, leaves[-1])
    for g, e in zip(got, expected):
        assert e.abs().sum() > 0
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-9)


def _grads(trainer, loss, params=None):
    params = params or [p for p in trainer.student.parameters() if p.requires_grad]
    return [g if g is not None else torch.zeros_like(p)
            for g, p in zip(torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True), params)]


def test_weight_zero_is_todays_loss_and_weight_w_adds_w_times_the_term(tmp_path, trainers):
    """Weight 0 (the default): no recorder, and the loss and gradients of the objective as a forward done by hand with
    diffusers-usable processors (``patch_attention``) gives them, bit for bit. Weight w: the same student output, the
    loss plus exactly w x the term, the gradients plus w x the term's, which reaches each FP4 layer's q/k/v
    projections and Q/K norms."""
    common = ("objective.target=output", "train.trainable=all")
    plain = trainers(tiny(tmp_path / "a", *common))
    assert plain.consistency is None
    assert all(b.attn1.processor.consistency is None for b in plain.student.blocks)
    batch = plain.micro_batch(0, 0)
    out0 = plain.losses(batch)
    assert "consistency" not in out0
    grads0 = _grads(plain, out0["loss"])

    # by hand: a fresh tiny transformer with the processors a diffusers user patches in, and a bf16 teacher
    student, teacher = build_tiny_transformer().float().train(), build_tiny_transformer().float()
    patch_attention(student, "attn_qat")
    patch_attention(teacher, REFERENCE_MODE)
    s = student(**_inputs(batch))[0].float()
    with torch.no_grad():
        t = teacher(**_inputs(batch))[0].float()
    loss = (s - t).pow(2).sum() / t.pow(2).sum()
    assert torch.equal(out0["loss"], loss)
    loss.backward()
    hand = [p.grad if p.grad is not None else torch.zeros_like(p) for p in student.parameters()]
    assert len(hand) == len(grads0) and all(torch.equal(a, b) for a, b in zip(grads0, hand))

    w = 0.375
    weighted = trainers(tiny(tmp_path / "b", *common, f"objective.attention_consistency={w}"))
    out = weighted.losses(batch)
    assert torch.equal(out["distill"], out0["loss"])  # the term changes nothing the objective sees
    assert torch.equal(out["loss"], out0["loss"] + w * out["consistency"])
    term_grads = _grads(weighted, out["consistency"])
    for g, g0, gt in zip(_grads(weighted, out["loss"]), grads0, term_grads):  # to fp32 rounding of each tensor's scale
        want = g0 + w * gt
        torch.testing.assert_close(g, want, rtol=0, atol=1e-5 * want.abs().max().item())
    names = [n for n, p in weighted.student.named_parameters() if p.requires_grad]
    reached = {n for n, g in zip(names, term_grads) if g.abs().sum() > 0}
    for i in range(2):
        for part in ("to_q", "to_k", "to_v", "norm_q", "norm_k"):
            assert f"blocks.{i}.attn1.{part}.weight" in reached, (i, part)
    assert "blocks.1.attn1.to_out.0.weight" not in reached  # after the last layer's attention: untouched


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_every_objective_adds_the_weighted_term(name):
    """``Objective.loss_terms`` for each registered objective: its own terms, plus ``consistency`` and the weight x
    it in ``loss``; without a term, its terms unchanged."""
    objective = OBJECTIVES[name](ObjectiveConfig(type=name, attention_consistency=2.5))
    g = torch.Generator().manual_seed(0)
    batch = {k: torch.randn(2, 16, 2, 4, 4, generator=g) for k in ("x0", "noise")}
    velocity = torch.randn(2, 16, 2, 4, 4, generator=g)
    gaps = {"gap": torch.tensor(0.25), "gap_features": torch.tensor(0.5)}
    c = torch.tensor(0.125)
    base = objective.terms(velocity, batch, gaps)
    assert objective.loss_terms(velocity, batch, gaps) == base
    out = objective.loss_terms(velocity, batch, gaps, c)
    assert out.keys() == {*base, "consistency"} and out["consistency"] is c
    assert torch.equal(out["loss"], base["loss"] + 2.5 * c)
    assert all(torch.equal(out[k], base[k]) for k in base if k != "loss")


def test_steps_with_the_term_lower_it_on_held_out_inputs(tmp_path, trainers):
    """12 steps of feature distillation with weight 1 lower the term on held-out inputs (own seed) well below where
    the same 12 steps with weight 0 leave it. Measured at these settings (lr 3e-4, attention weights, batch 4),
    config seeds 0-4: weight 1 ends 25-28% below its start, weight 0 between +1.5% and -1.4%, a ratio of 0.73-0.74
    (the bar: 0.85); with o_ref detached it fell 7-10% (ratio 0.89-0.94)."""
    ends = {}
    for weight in (0.0, 1.0):
        trainer = trainers(tiny(tmp_path / str(weight), f"objective.attention_consistency={weight}", "train.lr=3e-4",
                                "data.batch_size=4", "data.held_out=8"))
        probe = trainer.consistency or AttentionConsistency(trainer.student)  # weight 0: a probe, never trained on
        start = probe.held_out_mean(trainer)
        for step in range(12):
            trainer.losses(trainer.micro_batch(step, 0))["loss"].backward()
            trainer.optimizer.step()
            trainer.optimizer.zero_grad(set_to_none=True)
        ends[weight] = probe.held_out_mean(trainer)
        print(f"weight {weight}: held-out term {start:.5f} -> {ends[weight]:.5f}")
    assert ends[1.0] < 0.85 * ends[0.0]


def test_evaluation_and_inference_do_not_compute_it(tmp_path, trainers, monkeypatch):
    """The student's reference attention runs in training forwards only: the held-out evaluation, a forward under
    no_grad or inference_mode (as diffusers' pipelines run) make no such call and record nothing."""
    trainer = trainers(tiny(tmp_path, "objective.attention_consistency=1.0", "data.held_out=2"))
    calls = _spy_attention(monkeypatch)
    student = {id(b.attn1.processor) for b in trainer.student.blocks}

    def reference_calls():
        return sum(1 for p, mode, *_ in calls if id(p) in student and mode == REFERENCE_MODE)
    batch = trainer.micro_batch(0, 0)
    trainer.losses(batch)
    assert reference_calls() == 2  # one a layer: the counter sees it
    calls.clear()
    trainer.consistency.sums = {}
    assert "consistency" not in trainer.losses(batch, grad=False)
    assert trainer.evaluate() is not None
    with torch.no_grad():
        trainer.student(**_inputs(batch))
    with torch.inference_mode():
        trainer.student(**_inputs(batch))
    assert reference_calls() == 0 and trainer.consistency.sums == {}
    assert sum(1 for p, mode, *_ in calls if id(p) in student) == 2 * 4  # the student did run: four forwards


def test_processors_run_as_before_with_and_without_a_recorder():
    """The training processor without a recorder computes what ``patch_attention``'s processor (the one diffusers
    users get) computes, output and gradients, bit for bit; with one, the output is the same still (the term is a
    side output), recorded only with grad; ``remove`` detaches it."""
    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(2, 16, 2, 8, 8, generator=g), timestep=torch.tensor([700.0, 80.0]),
                  encoder_hidden_states=torch.randn(2, 8, TINY_TRANSFORMER_CONFIG["text_dim"], generator=g),
                  return_dict=False)

    def run(model):
        model.zero_grad(set_to_none=True)
        out = model(**inputs)[0]
        out.square().mean().backward()
        return out.detach(), [p.grad for p in model.parameters()]
    diffusers_usable = build_tiny_transformer().float()
    patch_attention(diffusers_usable, "attn_qat")
    want, want_grads = run(diffusers_usable)
    training, _ = make_student_teacher(build_tiny_transformer().float(), "attn_qat", with_teacher=False)
    assert type(training.blocks[0].attn1.processor) is AutocastAttnProcessor
    out, grads = run(training)
    assert torch.equal(out, want) and all(torch.equal(a, b) for a, b in zip(grads, want_grads))
    recorder = AttentionConsistency(training)
    with torch.no_grad(), recorder.recording():
        assert torch.equal(training(**inputs)[0], want)
    assert recorder.sums == {}
    with recorder.recording():
        out, _ = run(training)
    assert torch.equal(out, want) and sorted(recorder.sums) == [0, 1]
    recorder.remove()
    assert all(b.attn1.processor.consistency is None for b in training.blocks)


@pytest.mark.parametrize("checkpointing", ["plain", "save_attention"])
def test_gradient_checkpointing_gives_the_same_term_and_gradients(tmp_path, trainers, checkpointing):
    """With gradient checkpointing (diffusers' default, or keeping the attention outputs) the recompute runs the
    reference branch again: the same term and gradients as without, and nothing of the recompute is kept (its sums
    would hold the recomputed activations until the next step)."""
    overrides = ["objective.attention_consistency=1.0", "train.trainable=all"]
    eager = trainers(tiny(tmp_path / "a", *overrides))
    ckpt = trainers(tiny(tmp_path / "b", *overrides, "train.gradient_checkpointing=true",
                         f"train.save_attention={str(checkpointing == 'save_attention').lower()}"))
    batch = eager.micro_batch(0, 0)
    a, b = eager.losses(batch), ckpt.losses(batch)
    assert torch.equal(a["consistency"], b["consistency"]) and torch.equal(a["loss"], b["loss"])
    recorded = dict(ckpt.consistency.sums)
    a["loss"].backward()
    b["loss"].backward()
    kept = ckpt.consistency.sums  # the forward's tensors, the same objects, and no recomputed ones
    assert kept.keys() == recorded.keys() and all(x is y for k in kept for x, y in zip(kept[k], recorded[k]))
    assert ckpt.consistency._recomputed is None
    pairs = list(zip(eager.student.parameters(), ckpt.student.parameters()))
    assert all(pa.grad.abs().sum() > 0 for pa, _ in pairs if pa.grad is not None)
    for pa, pb in pairs:
        torch.testing.assert_close(pb.grad, pa.grad, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("logged", [True, False], ids=["terms-with-consistency", "terms-as-on-main"])
def test_graph_body_and_eager_loop_train_alike_and_log_the_term(tmp_path, monkeypatch, logged):
    """Three steps through the graphed step's body (uncaptured, as on a CPU) and the eager loop: the same losses,
    the term inside them. log.csv's loss_consistency is filled where graphed.TERMS names "consistency" (one line
    there) and empty where it does not; the run works either way."""
    if logged:
        terms = (*graphed.TERMS, "consistency") if "consistency" not in graphed.TERMS else graphed.TERMS
        monkeypatch.setattr(graphed, "TERMS", terms)
        monkeypatch.setattr(loop, "TERMS", terms)
    else:
        terms = tuple(t for t in graphed.TERMS if t != "consistency")
        monkeypatch.setattr(graphed, "TERMS", terms)
        monkeypatch.setattr(loop, "TERMS", terms)
    steps = ["train.max_steps=3", "objective.attention_consistency=0.5"]
    eager = train(tiny(tmp_path / "eager", *steps))
    with monkeypatch.context() as m:
        m.setattr(loop, "use_graphs", lambda cfg, device_type, world_size: True)  # the fused AdamW a graphed run has
        m.setattr(Trainer, "step_graphs",
                  lambda self: StepGraphs(self, self.cfg.train.gradient_accumulation_steps, capture=False))
        fast = train(tiny(tmp_path / "fast", *steps))
    for key in ("loss", "loss_distill", "loss_consistency"):
        a, b = [r[key] for r in eager.log_rows], [r[key] for r in fast.log_rows]
        if key == "loss_consistency" and not logged:
            assert a == b == ["", "", ""]
        else:
            assert all(isinstance(x, float) for x in a) and torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-6)
    if logged:
        for r in eager.log_rows:
            assert r["loss"] == pytest.approx(r["loss_distill"] + 0.5 * r["loss_consistency"], rel=1e-6)
            assert r["loss_consistency"] > 1e-3
    header = (tmp_path / "eager" / "log.csv").read_text().splitlines()[0].split(",")
    assert "loss_consistency" in header


def test_compiled_block_fullgraph_records_the_same_term(monkeypatch):
    """A block compiled in place with ``fullgraph=True`` (as ``train.compile`` does; aot_eager here, Inductor's C++
    build being minutes on a CPU) under gradient checkpointing: no graph break, and the same term and gradients as
    eager, and the next step compiles nothing new. Only block 0 is compiled, to keep it quick; the other block runs
    eagerly beside it."""
    torch._dynamo.reset()
    student, _ = make_student_teacher(build_tiny_transformer().float(), "attn_qat", with_teacher=False)
    student.enable_gradient_checkpointing()
    recorder = AttentionConsistency(student)
    g = torch.Generator().manual_seed(2)
    inputs = dict(hidden_states=torch.randn(2, 16, 2, 8, 8, generator=g), timestep=torch.tensor([500.0, 300.0]),
                  encoder_hidden_states=torch.randn(2, 8, TINY_TRANSFORMER_CONFIG["text_dim"], generator=g),
                  return_dict=False)

    def step():
        student.zero_grad(set_to_none=True)
        with recorder.recording():
            out = student(**inputs)[0]
        term = recorder.term()
        (out.square().mean() + term).backward()
        return term.detach(), [p.grad.clone() for p in student.parameters()]
    eager_term, eager_grads = step()
    counter = CompileCounterWithBackend("aot_eager")
    student.blocks[0].compile(fullgraph=True, backend=counter, dynamic=False)
    try:
        term, grads = step()
        frames = counter.frame_count  # the forward's graph and the recompute's
        step()
        assert counter.frame_count == frames  # a new step's recorder dict recompiles nothing
    finally:
        torch._dynamo.reset()
    assert torch.equal(term, eager_term)
    for a, b in zip(grads, eager_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-9)


def test_config_checks(tmp_path):
    """A finite weight >= 0 (at most 1000, as the other weights); above 0 only with an FP4 trainable mode."""
    validate(tiny(tmp_path, "objective.attention_consistency=1.0"))
    validate(tiny(tmp_path, "objective.attention_consistency=0.5", "attention.mode=attn_qat_dropin"))
    validate(tiny(tmp_path, "attention.mode=sagebwd"))  # 0: any mode
    for value, message in (("-0.5", "objective.attention_consistency must be a finite number >= 0, got -0.5$"),
                           ("2000", "objective.attention_consistency must be <= 1000, got 2000.0: a loss term's"),
                           (".nan", "config key objective.attention_consistency must be a finite number"),
                           ("true", "config key objective.attention_consistency must be a number")):
        with pytest.raises(ValueError, match=message):
            validate(tiny(tmp_path, f"objective.attention_consistency={value}"))
    for mode in ("bf16", "sagebwd"):
        with pytest.raises(ValueError, match=f"^objective.attention_consistency 1 needs an FP4 trainable "
                                             f"attention.mode \\(attn_qat, attn_qat_dropin\\), got '{mode}'"):
            validate(tiny(tmp_path, "objective.attention_consistency=1", f"attention.mode={mode}"))
    cfg = tiny(tmp_path)
    cfg.objective.attention_consistency = math.nan  # set past load_config's own check: validate refuses it too
    with pytest.raises(ValueError, match="must be a finite number >= 0, got nan"):
        validate(cfg)
