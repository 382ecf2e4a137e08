"""The graphed training step (attnqat/train/graphed.py) against the eager loop: the same losses, gradients and
weights. On a CPU the graph's body runs without a graph (what is captured on a GPU); on a GPU (``-m gpu``) the
replayed graphs themselves, on mini's corpus at two video sizes.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from attnqat.train import load_config, train
from attnqat.train import graphed, loop
from attnqat.train.graphed import TERMS, StepGraphs
from attnqat.train.loop import Trainer

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"
MINI_QAT = ROOT / "configs" / "mini_qat.yaml"


@pytest.fixture(autouse=True)
def reference_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the FP4 reference path (fp32) on CPU, as tests/test_train.py


def tiny(tmp_path, *overrides):
    return load_config(TINY, [f"output_dir={tmp_path}", "log.progress=false", "data.held_out=0",
                              "checkpoint.every=1000", *overrides])


def _graph_body(monkeypatch, grads_seen: list):
    """Make the loop take the graphed path with the graph's body run directly (no CUDA here), and the fused AdamW a
    graphed run steps with (on the CPU here), recording the gradients each optimizer step reads."""
    def step_graphs(self):
        return StepGraphs(self, self.cfg.train.gradient_accumulation_steps, capture=False)

    monkeypatch.setattr(loop, "use_graphs", lambda cfg, device_type, world_size: True)
    monkeypatch.setattr(Trainer, "step_graphs", step_graphs)
    _record_grads(monkeypatch, grads_seen)


def _record_grads(monkeypatch, grads_seen: list):
    real_step = torch.optim.AdamW.step

    def step(opt, *a, **k):
        grads_seen.append([p.grad.clone() for g in opt.param_groups for p in g["params"] if p.grad is not None])
        return real_step(opt, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)


@pytest.mark.parametrize("overrides", [
    # distillation of block features, attention weights only, gradient checkpointing (tiny's own settings)
    [],
    # two micro-batches a step, every weight, the output target, clipping that bites, a cosine schedule
    ["train.gradient_accumulation_steps=2", "train.trainable=all", "objective.target=output",
     "train.grad_clip=1e-4", "train.gradient_checkpointing=false", "train.lr_schedule=cosine"],
    # distillation on the teacher's own samples (the teacher runs in the batch, outside the graph)
    ["objective.target=output", "objective.latents=teacher", "objective.teacher_steps=2",
     "train.gradient_checkpointing=false"],
], ids=["features", "accum-clip", "teacher-latents"])
def test_graph_body_trains_as_the_eager_loop(tmp_path, monkeypatch, overrides):
    """Four steps through the graphed path (its body, uncaptured) and through the eager loop: every loss term,
    every gradient the optimizer reads, and the final weights equal to fp32 rounding (here: exactly)."""
    steps = ["train.max_steps=4", "data.batch_size=2", *overrides]
    eager_grads, fast_grads = [], []
    with monkeypatch.context() as m:
        _record_grads(m, eager_grads)
        eager = train(tiny(tmp_path / "eager", *steps))
    with monkeypatch.context() as m:
        _graph_body(m, fast_grads)
        fast = train(tiny(tmp_path / "fast", *steps))
    assert len(eager.losses) == len(fast.losses) == 4 and len(eager_grads) == len(fast_grads) == 4
    for key in ("loss", "loss_distill", "loss_flow", "gap", "grad_norm"):
        a = [r[key] for r in eager.log_rows]
        b = [r[key] for r in fast.log_rows]
        assert (a == b) if "" in a else torch.allclose(torch.tensor(a, dtype=torch.float64),
                                                        torch.tensor(b, dtype=torch.float64), rtol=1e-6, atol=0), key
    assert all(g.abs().sum() > 0 for g in eager_grads[-1])  # the gradients are real, not zeros on both sides
    for ge, gf in zip(eager_grads, fast_grads):
        for a, b in zip(ge, gf):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-12)
    from safetensors.torch import load_file
    we = load_file(tmp_path / "eager" / "final" / "transformer.safetensors")
    wf = load_file(tmp_path / "fast" / "final" / "transformer.safetensors")
    assert we.keys() == wf.keys()
    for k in we:
        torch.testing.assert_close(wf[k], we[k], rtol=1e-6, atol=1e-12)


def test_graphed_path_stops_before_a_nonfinite_update(tmp_path, monkeypatch):
    """The graphed path reads the loss and the gradient norm before each optimizer step, as the eager loop does:
    a NaN gradient stops training there, and no weight changes."""
    _graph_body(monkeypatch, [])
    real = StepGraphs._body

    def poisoned(self, batch):
        out = real(self, batch)
        if self.trainer.state.step == 2:
            self.params[0].grad.fill_(float("nan"))
        return out

    monkeypatch.setattr(StepGraphs, "_body", poisoned)
    from attnqat.train.checkpoint import NonFiniteTrainingError
    with pytest.raises(NonFiniteTrainingError, match="step 3: non-finite grad_norm"):
        train(tiny(tmp_path, "train.max_steps=4", "data.batch_size=2", "checkpoint.every=2"))


def test_cuda_graphs_setting(tmp_path):
    """``train.cuda_graphs``: auto/on/off; ``on`` where graphs cannot run is refused before a model is built,
    naming why; auto there steps eagerly."""
    from attnqat.train import validate
    with pytest.raises(ValueError, match="train.cuda_graphs 'on' cannot be used here: it needs a CUDA device"):
        validate(tiny(tmp_path, "train.cuda_graphs=on"), device_type="cpu", world_size=1)
    with pytest.raises(ValueError, match="train.cuda_graphs 'maybe' is not one of auto, on, off"):
        validate(tiny(tmp_path, "train.cuda_graphs=maybe"), device_type="cpu", world_size=1)
    cfg = tiny(tmp_path, "train.cuda_graphs=on", "train.gradient_checkpointing=false")
    with pytest.raises(ValueError, match="several processes"):
        validate(cfg, device_type="cuda", world_size=2)
    assert graphed.use_graphs(cfg, "cuda", 1)
    assert graphed.unsupported(tiny(tmp_path), "cuda", 1).startswith("gradient checkpointing")
    assert not graphed.use_graphs(tiny(tmp_path), "cuda", 1)  # auto: eager where it cannot
    assert not graphed.use_graphs(tiny(tmp_path, "train.cuda_graphs=off", "train.gradient_checkpointing=false"),
                                  "cuda", 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager-blocks", "compiled-blocks"])
def test_gpu_replayed_graphs_equal_the_eager_step(tmp_path, compiled):
    """mini's QAT fine-tune (attn_qat, bf16 autocast, corpus clips at two video sizes, each captured once): at
    every step the replayed graph's loss terms and gradients equal an eager forward + backward of the same batch
    at the same weights, which the optimizer then moves (so a replay that read stale weights or inputs fails)."""
    cfg = load_config(MINI_QAT, [f"model={ROOT / 'attnqat' / 'models' / 'mini'}", f"output_dir={tmp_path}",
                                 "data.held_out=0", "data.batch_size=4", "data.corpus.pool=16",
                                 "data.corpus.refresh=2", "data.corpus.refresh_every=1",
                                 "data.corpus.sizes=[[9,128,128],[9,64,64]]", "data.corpus.size_weights=[1,1]",
                                 "train.cuda_graphs=on", f"train.compile={str(compiled).lower()}", "train.lr=1e-3"])
    trainer = Trainer(cfg)
    graphs = trainer.step_graphs()
    assert graphs is not None and trainer.graphs
    for step in range(6):
        batch = trainer.micro_batch(step, 0)
        fast = {k: v.item() for k, v in graphs.forward_backward(batch).items()}
        g_fast = [g.clone() for g in graphs.grads]
        graphs.zero_grad()
        out = trainer.losses(batch)
        out["loss"].backward()
        eager = {k: out[k].item() for k in TERMS if k in out}
        assert fast.keys() == eager.keys() and "loss" in fast
        for k in fast:
            assert fast[k] == pytest.approx(eager[k], rel=1e-3), (step, k)
        flat = lambda gs: torch.cat([g.float().flatten() for g in gs])  # noqa: E731
        ge = flat(graphs.grads)
        assert ge.abs().sum() > 0
        cos = torch.nn.functional.cosine_similarity(flat(g_fast), ge, dim=0)
        assert cos > 0.9999, (step, cos)  # atomics in the attention backward may reorder sums
        trainer.optimizer.step()
        graphs.zero_grad()
        # the eager graph dropped before the next capture: alive, it keeps AccumulateGrad nodes made on the default
        # stream, which the next capture's backward would sync with (CUDA refuses it; torch warns as much)
        del out
    assert len(graphs.graphs) == 2


def test_a_failed_capture_falls_back_to_the_eager_body_under_auto(tmp_path, monkeypatch, capsys):
    """``auto``: a capture that fails (here: the capture itself raising, as CUDA does for a forbidden call) is said
    in one line and the run goes on eagerly, with the gradients the warm-up left thrown away; ``on`` raises."""
    trainer_cfg = tiny(tmp_path, "train.max_steps=2", "data.batch_size=2")
    grads = []
    _record_grads(monkeypatch, grads)

    def record(self, inputs):
        self._body(inputs)  # a warm-up's gradient, which must be dropped
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore")

    monkeypatch.setattr(StepGraphs, "_record", record)
    monkeypatch.setattr(loop, "use_graphs", lambda cfg, device_type, world_size: True)  # the fused AdamW, as graphed
    monkeypatch.setattr(Trainer, "step_graphs", lambda self: StepGraphs(self, 1, capture=True, fallback=True))
    fast = train(trainer_cfg)
    assert "capturing the step as a CUDA graph failed (CUDA error: operation not permitted when stream is " \
           "capturing); training on eagerly" in capsys.readouterr().out
    eager_grads = []
    with monkeypatch.context() as m:
        _record_grads(m, eager_grads)
        m.setattr(Trainer, "step_graphs", lambda self: None)
        eager = train(tiny(tmp_path / "eager", "train.max_steps=2", "data.batch_size=2"))
    assert fast.losses == eager.losses
    for a, b in zip(grads, eager_grads):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-12)
    monkeypatch.setattr(Trainer, "step_graphs", lambda self: StepGraphs(self, 1, capture=True, fallback=False))
    with pytest.raises(RuntimeError, match="not permitted"):
        train(tiny(tmp_path / "on", "train.max_steps=2", "data.batch_size=2"))
