"""The graphed training step (attnqat/train/graphed.py) and its loop, which reads each step's values one step later
(attnqat/train/lagged.py), against the eager loop: the same losses, gradients, log rows, weights, EMA and optimizer
state, the same stop at a non-finite step, checkpoints that resume across the two. On a CPU the graph's body runs
without a graph (what is captured on a GPU) and the lag with plain copies; on a GPU (``-m gpu``) the replayed graphs
themselves, on mini's corpus at two video sizes.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from attnqat.train import load_config, train
from attnqat.train import graphed, loop
from attnqat.train.checkpoint import NonFiniteTrainingError
from attnqat.train.graphed import TERMS, StepGraphs
from attnqat.train.lagged import LaggedReads
from attnqat.train.loop import Trainer, read_log

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


def _fused_adamw(monkeypatch):
    """The eager loop's AdamW built fused, as the graphed loop's is, so that the two runs differ only in the loop. The
    multi-tensor AdamW the eager loop builds otherwise lands an ulp away from the fused one on some weights on some
    CPUs (an AMD EPYC, torch 2.13: 55-342 of 16,384 after three steps; these tests passed without this on the machine
    they were written on), and FP4 rounding downstream grows that past fp32 rounding within a few steps."""
    real = loop.optimizers.build

    def build(name, params, **kw):
        return real(name, params, **{**kw, "fused": True if name == "adamw" else kw.get("fused")})

    monkeypatch.setattr(loop.optimizers, "build", build)


def _trainers(monkeypatch) -> list:
    """Every Trainer built from here on, kept to be looked at after train() returns or raises."""
    made = []
    real = Trainer.__init__

    def init(self, *a, **k):
        real(self, *a, **k)
        made.append(self)

    monkeypatch.setattr(Trainer, "__init__", init)
    return made


TIMING = ("step_s", "elapsed_s", "tokens_per_s", "peak_gib", "peak_reserved_gib")  # the clock's and the allocator's columns: the only
# ones two runs may differ in


def _close(a, b, rtol: float = 1e-6) -> bool:
    return (math.isnan(a) and math.isnan(b)) or math.isclose(a, b, rel_tol=rtol, abs_tol=0)


def _assert_same_log(a: Path, b: Path) -> None:
    """Two log.csv files hold the same rows, cell for cell but the timing columns: the same steps, the same empty
    cells, numbers equal to fp32 rounding (NaN where the other has NaN)."""
    ra, rb = read_log(a), read_log(b)
    assert [r["step"] for r in ra] == [r["step"] for r in rb]
    for x, y in zip(ra, rb):
        assert x.keys() == y.keys()
        for k in x.keys() - set(TIMING):
            same = (x[k] == y[k]) if "" in (x[k], y[k]) else _close(float(x[k]), float(y[k]))
            assert same, (x["step"], k, x[k], y[k])


def _assert_close_tensors(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-6, atol=1e-12, msg=lambda m: f"{what} {k}: {m}")


def _assert_same_checkpoint(a: Path, b: Path) -> None:
    """Two checkpoints hold the same training state: master weights, EMA, optimizer tensors (step counts, moments),
    the scheduler and the trainer's step and position."""
    _assert_close_tensors(load_file(a / "state" / "model.safetensors"), load_file(b / "state" / "model.safetensors"),
                          "weight")
    assert (a / "ema.safetensors").exists() == (b / "ema.safetensors").exists()
    if (a / "ema.safetensors").exists():
        _assert_close_tensors(load_file(a / "ema.safetensors"), load_file(b / "ema.safetensors"), "EMA")
    _assert_close_tensors(load_file(a / "state" / "optimizer.safetensors"),
                          load_file(b / "state" / "optimizer.safetensors"), "optimizer")
    for name in ("state/scheduler.json", "trainer_state.json"):
        assert (a / name).read_text() == (b / name).read_text(), name


@pytest.mark.parametrize("overrides", [
    # distillation of block features, attention weights only, gradient checkpointing (tiny's own settings)
    [],
    # two micro-batches a step, every weight, the output target, clipping that bites, a cosine schedule
    ["train.gradient_accumulation_steps=2", "train.trainable=all", "objective.target=output",
     "train.grad_clip=1e-4", "train.gradient_checkpointing=false", "train.lr_schedule=cosine"],
    # distillation on the teacher's own samples (the teacher runs in the batch, outside the graph)
    ["objective.target=output", "objective.latents=teacher", "objective.teacher_steps=2",
     "train.gradient_checkpointing=false"],
    # the lag's kinds of step: lagged ones around a held-out evaluation (step 3) and a checkpoint (step 4), read at
    # once, a row every other step, an EMA, clipping off
    ["train.max_steps=6", "train.ema_decay=0.9", "train.grad_clip=0", "log.every=2", "data.held_out=2",
     "log.eval_every=3", "checkpoint.every=4"],
], ids=["features", "accum-clip", "teacher-latents", "ema-eval-checkpoint"])
def test_graph_body_trains_as_the_eager_loop(tmp_path, monkeypatch, overrides):
    """Four (six) steps through the graphed path (its body, uncaptured; each step's values read one step later) and
    through the eager loop: every loss term, every gradient the optimizer reads, every log.csv row but its timing
    columns, and the last checkpoint's weights, EMA and optimizer state equal to fp32 rounding."""
    steps = ["train.max_steps=4", "data.batch_size=2", *overrides]
    eager_grads, fast_grads = [], []
    with monkeypatch.context() as m:
        _fused_adamw(m)
        _record_grads(m, eager_grads)
        eager = train(tiny(tmp_path / "eager", *steps))
    with monkeypatch.context() as m:
        _graph_body(m, fast_grads)
        fast = train(tiny(tmp_path / "fast", *steps))
    n = eager.steps
    assert fast.steps == n and len(eager.losses) == len(fast.losses) == len(eager_grads) == len(fast_grads) == n
    assert [r["step"] for r in fast.log_rows] == [r["step"] for r in eager.log_rows]
    for key in ("loss", "loss_distill", "loss_flow", "gap", "grad_norm"):
        a = [r[key] for r in eager.log_rows]
        b = [r[key] for r in fast.log_rows]
        assert (a == b) if "" in a else torch.allclose(torch.tensor(a, dtype=torch.float64),
                                                        torch.tensor(b, dtype=torch.float64), rtol=1e-6, atol=0), key
    assert all(g.abs().sum() > 0 for g in eager_grads[-1])  # the gradients are real, not zeros on both sides
    for ge, gf in zip(eager_grads, fast_grads):
        for a, b in zip(ge, gf):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-12)
    assert [_close(a, b) for a, b in zip(fast.losses, eager.losses)] == [True] * n
    _assert_same_log(tmp_path / "fast" / "log.csv", tmp_path / "eager" / "log.csv")
    checkpoint = f"checkpoints/step-{n:07d}"
    _assert_same_checkpoint(tmp_path / "fast" / checkpoint, tmp_path / "eager" / checkpoint)
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


@pytest.mark.parametrize("how, bad_step", [("loss", 2), ("loss", 4), ("lr", 2)], ids=["mid-run", "last-step", "lr"])
def test_a_nonfinite_step_stops_the_lagged_loop_where_the_eager_loop_stops(tmp_path, monkeypatch, how, bad_step):
    """A NaN loss at step N of 4: the graphed loop, which reads step N's values only once step N+1 is queued (mid-run;
    the last step is read at once), stops at step N with the eager loop's error and log, and its weights, EMA and
    optimizer state (step counts included) are the eager loop's: those after step N-1. Step N's update and step
    N+1's were skipped on the device. An inf learning rate, known on the host, stops it before step N's update."""
    if how == "loss":
        real = Trainer.losses

        def losses(self, batch, *, grad=True):
            out = real(self, batch, grad=grad)
            if grad and self.state.step == bad_step - 1:  # in step N's forward, in either loop
                out["loss"] = out["loss"] * float("nan")
            return out

        monkeypatch.setattr(Trainer, "losses", losses)
    else:
        real_lambda = loop.lr_lambda
        monkeypatch.setattr(loop, "lr_lambda", lambda cfg: lambda s: float("inf") if s == bad_step - 1
                            else real_lambda(cfg)(s))
    runs = {}
    for name in ("eager", "fast"):
        with monkeypatch.context() as m:
            if name == "fast":
                _graph_body(m, [])
            else:
                _fused_adamw(m)
            made = _trainers(m)
            with pytest.raises(NonFiniteTrainingError, match=f"step {bad_step}: non-finite {how} (nan|inf)") as e:
                train(tiny(tmp_path / name, "train.max_steps=4", "data.batch_size=2", "train.ema_decay=0.9",
                           "checkpoint.every=3"))
        runs[name] = made[0], str(e.value).replace(str(tmp_path / name), "OUT")
    (eager, eager_error), (fast, fast_error) = runs["eager"], runs["fast"]
    assert fast_error == eager_error
    _assert_same_log(tmp_path / "fast" / "log.csv", tmp_path / "eager" / "log.csv")
    assert read_log(tmp_path / "fast" / "log.csv")[-1]["step"] == str(bad_step)
    assert fast.state.step == eager.state.step == bad_step - 1
    student = lambda t: t.accelerator.unwrap_model(t.student).state_dict()  # noqa: E731
    _assert_close_tensors(student(fast), student(eager), "weight")
    _assert_close_tensors(fast.ema, eager.ema, "EMA")
    opt_state = lambda t: {f"{i}/{k}": v for i, s in enumerate(t._raw_optimizer().state.values())  # noqa: E731
                           for k, v in s.items()}
    assert all(float(v) == bad_step - 1 for k, v in opt_state(fast).items() if k.endswith("/step"))
    _assert_close_tensors(opt_state(fast), opt_state(eager), "optimizer")
    assert float(fast._raw_optimizer().found_inf) == (how == "loss")  # the lag's flag stopped the updates, or the host


def test_the_lagged_loop_stops_on_time_checkpoints_and_resumes_as_an_uninterrupted_run(tmp_path, monkeypatch):
    """The graphed loop stopped by the time limit after step 3 (no checkpoint step: the limit alone makes it read step 3
    at once, with step 2's values still on their way), then resumed to step 6, leaves the checkpoints, log and final
    weights of an uninterrupted graphed run. Checkpoints cross between it and the synchronous loop both ways (the
    eager loop, stepping the same fused AdamW): the lag saves no state of its own."""
    common = ["train.max_steps=6", "data.batch_size=2", "train.ema_decay=0.9", "checkpoint.every=4",
              "objective.target=output", "train.trainable=all", "train.lr_schedule=cosine", "train.warmup_steps=2"]
    cfg = lambda name: tiny(tmp_path / name, *common)  # noqa: E731
    _graph_body(monkeypatch, [])
    made = _trainers(monkeypatch)
    full = train(cfg("full"))
    part = train(cfg("part"), stop_after=5)  # the last step of a call is read before it returns, checkpoint or not
    assert part.steps == 5 and part.losses == full.losses[:5]
    assert [r["step"] for r in read_log(tmp_path / "part" / "log.csv")] == ["1", "2", "3", "4", "5"]
    # a clock past the limit once 3 steps are queued
    monkeypatch.setattr(loop, "_out_of_time", lambda limit, t0: limit is not None and made[-1].state.step >= 3)
    cut = train(cfg("cut"), time_limit=1.0)
    assert cut.steps == 3 and len(cut.losses) == 3 and not (tmp_path / "cut" / "final").exists()
    assert sorted(p.name for p in (tmp_path / "cut" / "checkpoints").iterdir()) == ["step-0000003"]
    rest = train(cfg("cut"), resume="auto")
    assert rest.steps == 6 and cut.losses + rest.losses == full.losses
    with monkeypatch.context() as m:  # the synchronous loop writes step 4, the lagged one goes on
        m.setattr(Trainer, "step_graphs", lambda self: None)
        train(cfg("sync-lag"), stop_after=4)
    train(cfg("sync-lag"), resume="auto")
    train(cfg("lag-sync"), stop_after=4)  # and the other way round
    with monkeypatch.context() as m:
        m.setattr(Trainer, "step_graphs", lambda self: None)
        train(cfg("lag-sync"), resume="auto")
    for name in ("cut", "sync-lag", "lag-sync"):
        _assert_same_log(tmp_path / name / "log.csv", tmp_path / "full" / "log.csv")
        for step in (4, 6):
            _assert_same_checkpoint(tmp_path / name / "checkpoints" / f"step-{step:07d}",
                                    tmp_path / "full" / "checkpoints" / f"step-{step:07d}")
        _assert_close_tensors(load_file(tmp_path / name / "final" / "transformer.safetensors"),
                              load_file(tmp_path / "full" / "final" / "transformer.safetensors"), name)


def test_the_ema_gate_is_the_plain_update_or_none(tmp_path):
    """Trainer.update_ema with the lag's flag: at 0 bit for bit the plain update (its lerp weight 1 - d above and
    below 1/2, where lerp computes differently), at 1 no change at all."""
    trainer = Trainer(tiny(tmp_path, "train.ema_decay=0.999"))
    with torch.no_grad():
        for p in trainer._ema_weights:
            p.add_(torch.randn_like(p))
    start = {k: v.clone() for k, v in trainer.ema.items()}
    for step in (0, 30):  # d = 0.1 and 31/40: weights 0.9 and 0.225
        plain = {k: v.clone() for k, v in start.items()}
        trainer.ema = plain
        trainer.update_ema(step)
        for flag, want in ((0.0, plain), (1.0, start)):
            trainer.ema = {k: v.clone() for k, v in start.items()}
            trainer.update_ema(step, skip=torch.tensor(flag))
            assert all(torch.equal(trainer.ema[k], want[k]) for k in want), (step, flag)
        assert not all(torch.equal(plain[k], start[k]) for k in start)


def test_lagged_reads_gate_the_fused_adamw_from_the_first_nonfinite_step_on():
    """LaggedReads: the values come back as sent; the first NaN or inf sets the flag for good, and the fused AdamW
    skips every update from there (the weights, moments and step counts stay); an unfused optimizer is refused."""
    w = torch.nn.Parameter(torch.ones(5))
    opt = torch.optim.AdamW([w], lr=0.1, fused=True)
    reads = LaggedReads(opt, torch.device("cpu"))

    def step(loss: float) -> list[float]:
        w.grad = torch.full_like(w, loss)
        sent = reads.send([torch.tensor(loss)], w.grad.norm())
        opt.step()
        return reads.receive(sent)

    assert step(0.5) == [0.5, pytest.approx(0.5 * 5 ** 0.5)] and reads.bad.item() == 0.0
    after = w.detach().clone(), {k: v.clone() for k, v in opt.state[w].items()}
    assert not torch.equal(after[0], torch.ones(5)) and after[1]["step"].item() == 1
    for loss in (float("inf"), 0.5, 0.25):  # the finite ones after it are skipped too
        step(loss)
        assert reads.bad.item() == 1.0 and torch.equal(w.detach(), after[0])
        assert all(torch.equal(v, after[1][k]) for k, v in opt.state[w].items())
    with pytest.raises(ValueError, match="needs the fused AdamW"):
        LaggedReads(torch.optim.AdamW([w]), torch.device("cpu"))


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_lagged_loop_stops_at_a_nonfinite_step_with_the_state_before_it(tmp_path, monkeypatch):
    """mini's QAT fine-tune through train() with replayed graphs, pinned copies and events: a NaN in step 4's clean
    latents (a graph input, so the replay itself computes it) stops the run at step 4 with the synchronous check's
    error, after step 5 was queued; the weights, EMA and optimizer state are bit for bit those step 3 left."""
    cfg = load_config(MINI_QAT, [f"model={ROOT / 'attnqat' / 'models' / 'mini'}", f"output_dir={tmp_path}",
                                 "data.held_out=0", "data.batch_size=4", "data.corpus.pool=16",
                                 "data.corpus.refresh=2", "data.corpus.refresh_every=1",
                                 "data.corpus.sizes=[[9,128,128],[9,64,64]]", "data.corpus.size_weights=[1,1]",
                                 "train.cuda_graphs=on", "train.max_steps=8", "train.warmup_steps=2",
                                 "train.ema_decay=0.9", "checkpoint.every=1000", "log.every=1", "log.progress=false"])
    real_batch, real_advance = Trainer.micro_batch, Trainer.advance_to
    saved = {}

    def micro_batch(self, step, micro):
        batch = real_batch(self, step, micro)
        return dict(batch, x0=batch["x0"] * float("nan")) if step == 3 else batch

    def advance_to(self, steps):
        real_advance(self, steps)
        if steps == 3 and not saved:  # queued behind step 3's update: a copy of what it leaves
            saved["weights"] = [p.detach().clone() for p in self._raw_optimizer().param_groups[0]["params"]]
            saved["ema"] = [v.clone() for v in self.ema.values()]
            saved["optimizer"] = [{k: v.clone() for k, v in s.items()} for s in self._raw_optimizer().state.values()]

    monkeypatch.setattr(Trainer, "micro_batch", micro_batch)
    monkeypatch.setattr(Trainer, "advance_to", advance_to)
    made = _trainers(monkeypatch)
    with pytest.raises(NonFiniteTrainingError, match="step 4: non-finite loss nan"):
        train(cfg)
    trainer = made[0]
    opt = trainer._raw_optimizer()
    assert opt.param_groups[0]["fused"] and float(opt.found_inf) == 1.0 and trainer.state.step == 3
    assert all(torch.equal(p, q) for p, q in zip(opt.param_groups[0]["params"], saved["weights"]))
    assert all(torch.equal(a, b) for a, b in zip(trainer.ema.values(), saved["ema"]))
    for state, before in zip(opt.state.values(), saved["optimizer"]):
        assert float(state["step"]) == 3 and all(torch.equal(state[k], before[k]) for k in before)
    rows = read_log(tmp_path / "log.csv")
    assert [r["step"] for r in rows] == ["1", "2", "3", "4"] and rows[-1]["loss"] == "nan"


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
