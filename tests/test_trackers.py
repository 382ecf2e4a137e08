"""Training metrics to accelerate's trackers (``log.trackers``; ``log.tensorboard: true`` is "tensorboard" among
them), beside log.csv, on the tiny model (CPU): TensorBoard's event files hold log.csv's rows as scalars at their
steps; a tracker that is unknown or not installed is refused in one line before anything is built or written."""
from __future__ import annotations

from pathlib import Path

import pytest

from attnqat.train import checkpoint as ck
from attnqat.train import load_config, train
from attnqat.train.loop import read_log

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"


@pytest.fixture(autouse=True)
def reference_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the PyTorch reference attention (see tests/test_train.py)


def cfg(out, *overrides):
    return load_config(TINY, [f"output_dir={out}", "log.progress=false", "train.max_steps=3", "checkpoint.every=3",
                              "data.batch_size=2", "data.held_out=2", "log.every=1", *overrides])


def test_tensorboard_events_hold_the_logged_rows(tmp_path):
    pytest.importorskip("tensorboard")  # the "test" extra installs it
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    train(cfg(out, "log.tensorboard=true", "log.project=qat-tiny", "train.lr_schedule=cosine"))
    rows = read_log(out / "log.csv")
    assert [int(r["step"]) for r in rows] == [1, 2, 3]
    events = EventAccumulator(str(out / ck.TRACKERS / "qat-tiny")).Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss", "gap", "grad_norm", "lr", "tokens_per_s", "step_s"} <= tags
    assert {"eval_gap_output", "eval_gap_features"} <= tags  # the held-out columns of the last row
    assert "step" not in tags and "loss_flow" not in tags  # the step is each scalar's x; empty columns are left out
    for tag in ("loss", "gap", "grad_norm", "lr"):
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        want = [(int(r["step"]), pytest.approx(float(r[tag]), rel=1e-6)) for r in rows]  # TensorBoard keeps float32
        assert got == want, tag
    assert len({e.value for e in events.Scalars("lr")}) == 3  # the cosine schedule: the rows really differ
    # the run's config went along as hyperparameters (accelerate's init_trackers writes hparams.yml beside them)
    hparams = list((out / ck.TRACKERS / "qat-tiny").rglob("hparams.yml"))
    assert len(hparams) == 1 and "train.max_steps: 3" in hparams[0].read_text()
    # --overwrite knows the folder as the run's own; a file of the user's in it keeps it out
    assert out / ck.TRACKERS in ck.run_artifacts(out)
    (out / ck.TRACKERS / "notes.txt").write_text("mine")
    assert out / ck.TRACKERS not in ck.run_artifacts(out)


def test_an_unknown_or_missing_tracker_is_refused_before_anything_is_written(tmp_path, monkeypatch, capsys):
    import accelerate.tracking

    from attnqat.cli import main

    def run(*sets):
        capsys.readouterr()
        rc = main(["train", "--config", str(TINY), "--output-dir", str(tmp_path / "run"), "--set", "log.progress=false",
                   *[a for s in sets for a in ("--set", s)]])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and "Traceback" not in err[0], err
        return err[0]

    assert "log.trackers entry 'tensorbord' is not one of tensorboard, wandb" in run("log.trackers=[tensorbord]")
    assert "log.trackers must be a list of tracker names" in run("log.trackers=[[wandb]]")
    assert "log.project" in run("log.project='../up'")
    # a package accelerate does not find (here: TensorBoard, hidden from it) is named, with what to install; accelerate
    # itself would leave the tracker out without a word
    monkeypatch.setattr(accelerate.tracking, "get_available_trackers", lambda: [])
    for sets in (["log.trackers=[tensorboard]"], ["log.tensorboard=true"]):
        assert "log.trackers names tensorboard, which is not installed: pip install tensorboard" in run(*sets)
    assert not (tmp_path / "run").exists()


def test_an_accelerator_must_log_to_the_trackers_the_config_names(tmp_path):
    """The config is the one place that says where metrics go: an accelerator built elsewhere with other trackers is
    refused in one line before a model is built; built with :func:`~attnqat.train.loop.tracking`'s arguments, it
    is taken."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from attnqat.train import Trainer
    from attnqat.train.loop import tracking

    with pytest.raises(ValueError, match=r"the accelerator logs to no tracker, the config's log.trackers to "
                                         r"\['tensorboard'\]"):
        Trainer(cfg(tmp_path / "a", "log.trackers=[tensorboard]"), Accelerator(cpu=True))
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    c = cfg(tmp_path / "b", "log.trackers=[tensorboard]")
    trainer = Trainer(c, Accelerator(cpu=True, **tracking(c)))
    assert [str(getattr(t, "value", t)) for t in trainer.accelerator.log_with] == ["tensorboard"]
