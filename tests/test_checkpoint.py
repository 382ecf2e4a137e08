"""attnqat.train checkpoints, on the tiny model (CPU): nothing lost, nothing silent.

- a folder holding a run is refused unless --resume or --overwrite (which deletes only that run);
- log.csv survives a kill at any point of a resume's rewrite;
- a kill at every kind of file-system step of a run (checkpoint, final export, log, config) is recovered by
  --resume auto: the same final weights and losses as an uninterrupted run, no .tmp/.old left;
- a corrupt checkpoint is caught by its sha256 manifest and --resume auto falls back, saying so;
- --resume never unpickles anything: a malicious pickle in a checkpoint folder is never run;
- a finished run resumed just (re)writes final/.
"""
from __future__ import annotations

import functools
import hashlib
import os
import pickle
import random
import re
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from attnqat.train import load_config, train
from attnqat.train import checkpoint as ck
from attnqat.train.checkpoint import CheckpointError
from attnqat.train.loop import read_log

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"
SMALL = ["log.progress=false", "data.held_out=0", "data.batch_size=2", "train.trainable=all", "objective.target=output",
         "train.lr_schedule=cosine", "train.warmup_steps=1"]


# One intra-op thread for the module, its fixtures' runs included: the tests that fork processes (which cannot use
# this one's OpenMP threads) compare their runs with this process's, sum for sum; it costs the tiny model nothing
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def reference_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the PyTorch reference attention (see tests/test_train.py)


def cfg(out, *overrides):
    return load_config(TINY, [f"output_dir={out}", *SMALL, *overrides])


def snapshot(root: Path) -> dict:
    """Every path under root with the sha256 of its content (None for folders)."""
    return {p.relative_to(root).as_posix(): (None if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(root.rglob("*"))}


def final_weights(out: Path) -> dict:
    return load_file(str(out / "final" / "transformer.safetensors"))


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.rglob("*") if p.name.endswith((".tmp", ".old")))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, one_thread):
    """An uninterrupted 5-step run (checkpoints at 2, 4, 5): its losses and final weights."""
    out = tmp_path_factory.mktemp("reference")
    r = train(cfg(out, "train.max_steps=5", "checkpoint.every=2", "checkpoint.keep=2"))
    assert len(set(r.losses)) == 5
    return {"losses": r.losses, "final": final_weights(out), "rows": read_log(out / "log.csv")}


# the kill test's run: 4 steps, checkpoints at 2 and 4, keep 1 (step-2 is pruned once step-4 is written): every kind
# of file-system step of the 5-step reference in 41 kill points instead of 54, on shorter runs; a resume from step-2
# still trains two steps, so a scheduler state that was not restored shows (the optimizer's lr only covers one)
SHORT = ("train.max_steps=4", "checkpoint.every=2", "checkpoint.keep=1")


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, one_thread):
    """A copy factory of that run stopped after step 4 (checkpoints step-2 and step-4, log rows 1..4)."""
    out = tmp_path_factory.mktemp("stopped") / "run"
    train(cfg(out, "train.max_steps=5", "checkpoint.every=2"), stop_after=4)

    def copy(dest: Path) -> Path:
        shutil.copytree(out, dest)
        return dest
    return copy


# --- 1. a folder that holds a run ---------------------------------------------------------------------------------

def test_a_folder_holding_a_run_is_refused_and_left_alone(tmp_path):
    """Before: a second run into the same folder silently mixed with the first (its old checkpoints outranked the
    new ones in pruning, the log was cut, --resume auto then picked the old run)."""
    train(cfg(tmp_path, "train.max_steps=4", "checkpoint.every=2"))
    before = snapshot(tmp_path)
    with pytest.raises(ValueError, match="already holds a training run .*--resume auto.*--overwrite"):
        train(cfg(tmp_path, "train.max_steps=3", "checkpoint.every=1"))
    assert snapshot(tmp_path) == before


def test_overwrite_deletes_only_what_the_run_wrote(tmp_path, reference):
    old = train(cfg(tmp_path, "train.max_steps=6", "checkpoint.every=3", "checkpoint.keep=3"))
    assert old.steps == 6
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "clip.mp4").write_bytes(b"\x00" * 10)
    (tmp_path / "checkpoints" / "README").write_text("mine too")
    (tmp_path / "checkpoints" / "step-0000003.old").mkdir()  # an interrupted commit of the old run
    r = train(cfg(tmp_path, "train.max_steps=5", "checkpoint.every=2", "checkpoint.keep=2"), overwrite=True)
    assert r.losses == pytest.approx(reference["losses"], rel=0, abs=0)  # a clean run: the reference's
    assert (tmp_path / "notes.txt").read_text() == "mine" and (tmp_path / "data" / "clip.mp4").stat().st_size == 10
    assert (tmp_path / "checkpoints" / "README").read_text() == "mine too"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["README", "step-0000004", "step-0000005"]
    assert [int(x["step"]) for x in read_log(tmp_path / "log.csv")] == [1, 2, 3, 4, 5]
    assert same_weights(final_weights(tmp_path), reference["final"])
    with pytest.raises(ValueError, match="exclude each other"):
        train(cfg(tmp_path, "train.max_steps=5"), resume="auto", overwrite=True)


def test_foreign_final_or_log_is_never_replaced(tmp_path):
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "my.bin").write_bytes(b"1")
    with pytest.raises(ValueError, match="not written by attnqat"):
        train(cfg(tmp_path, "train.max_steps=1"), overwrite=True)
    shutil.rmtree(tmp_path / "final")
    (tmp_path / "log.csv").write_text("date,amount\n")
    with pytest.raises(ValueError, match="not an attnqat log"):
        train(cfg(tmp_path, "train.max_steps=1"))
    assert (tmp_path / "log.csv").read_text() == "date,amount\n"


# --- 2. the log -----------------------------------------------------------------------------------------------------

class Killed(BaseException):
    """A simulated kill: not an Exception, so nothing on the way handles it."""


def test_log_survives_a_kill_at_every_point_of_the_resume_rewrite(tmp_path, reference, stopped, monkeypatch):
    """Before: a resume rewrote log.csv in place ("w" then the kept rows): a kill in between left it empty.
    Now the rows up to the checkpoint go to log.csv.tmp, then one rename; kill before, between and after."""
    out = stopped(tmp_path / "run")  # checkpoints 2 and 4, log rows 1..4
    shutil.rmtree(out / "checkpoints" / "step-0000004")  # resume from 2: the rewrite drops rows 3 and 4
    rows = read_log(out / "log.csv")
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4]
    real_replace, real_fsync = os.replace, os.fsync
    for point in ("open", "fsync", "replace"):
        shutil.copytree(out, tmp_path / point)
        run = tmp_path / point

        if point == "replace":
            monkeypatch.setattr(ck.os, "replace", lambda a, b: (_ for _ in ()).throw(Killed()) if str(a).endswith("log.csv.tmp")
                                else real_replace(a, b))
        elif point == "fsync":
            def fsync(fd, real=real_fsync):
                if os.readlink(f"/proc/self/fd/{fd}").endswith("log.csv.tmp"):
                    raise Killed()
                return real(fd)
            monkeypatch.setattr(ck.os, "fsync", fsync)
        else:
            real_open = open

            def opener(path, *a, **k):
                if str(path).endswith("log.csv.tmp"):
                    raise Killed()
                return real_open(path, *a, **k)
            monkeypatch.setattr("builtins.open", opener)
        with pytest.raises(Killed):
            train(cfg(run, "train.max_steps=5", "checkpoint.every=2"), resume="auto")
        monkeypatch.undo()
        assert read_log(run / "log.csv") == rows, point  # the old log, whole
        train(cfg(run, "train.max_steps=5", "checkpoint.every=2"), resume="auto")
        assert read_log(run / "log.csv")[:2] == rows[:2]  # the kept history, unchanged
        assert [int(x["step"]) for x in read_log(run / "log.csv")] == [1, 2, 3, 4, 5]
        assert [float(x["loss"]) for x in read_log(run / "log.csv")] == reference["losses"]
        assert leftovers(run) == []


def test_a_line_cut_by_a_kill_is_dropped(tmp_path, reference, stopped):
    out = stopped(tmp_path / "run")
    with open(out / "log.csv", "a") as f:
        f.write("5,0.12")  # a kill in the middle of a row: no newline
    assert [int(x["step"]) for x in read_log(out / "log.csv")] == [1, 2, 3, 4]
    train(cfg(out, "train.max_steps=5", "checkpoint.every=2"), resume="auto")
    text = (out / "log.csv").read_text()
    # header + 5 rows, each of the header's fields: the cut row neither on its own line nor glued to the next
    # (a substring test failed on a float in the timing column that held "5,0.12")
    lines = text.splitlines()
    assert text.count("\n") == 6 and "5,0.12" not in lines, text
    assert all(line.count(",") == lines[0].count(",") for line in lines), text
    assert [float(x["loss"]) for x in read_log(out / "log.csv")] == reference["losses"]


# --- 3. a kill anywhere -----------------------------------------------------------------------------------------------

class KillAt:
    """Records the file-system steps that make a write durable or visible (os.replace, os.fsync, shutil.rmtree,
    in attnqat.train.checkpoint and loop), each as its name and paths, and raises Killed at number ``n`` (never for
    ``n=0``)."""

    def __init__(self, monkeypatch, n: int):
        self.n, self.steps, self.where = n, [], None
        for name in ("replace", "fsync"):  # ck.os and loop.os are the os module
            monkeypatch.setattr(os, name, self._wrap(getattr(os, name), f"os.{name}"))
        monkeypatch.setattr(shutil, "rmtree", self._wrap(shutil.rmtree, "rmtree"))

    def _wrap(self, real, name):
        def f(*a, **k):
            paths = [os.readlink(f"/proc/self/fd/{x}") if name == "os.fsync" else str(x) for x in a]
            self.steps.append((name, *paths))
            if len(self.steps) == self.n:
                self.where = f"{name}{tuple(x[-40:] for x in paths)}"
                raise Killed(self.where)
            return real(*a, **k)
        return f


def kill_point_kinds(steps: list[tuple], out: Path) -> dict[tuple, list[int]]:
    """The kill points (1-based numbers of ``steps``) by kind: a step, and the step before it (what a kill there
    leaves is that one done and this one not). The fsyncs of the data files of a folder being written (before its
    manifest) are one step: a kill at any of them leaves that .tmp folder with some data files and no manifest."""
    def general(step):
        return (step[0], *(re.sub(r"\.tmp/(?!manifest\.json\.tmp$).*", ".tmp/<data file>", p.replace(str(out), ""))
                           for p in step[1:]))
    kinds: dict[tuple, list[int]] = {}
    for n, step in enumerate(steps, 1):
        kinds.setdefault((general(step), general(steps[n - 2]) if n > 1 else None), []).append(n)
    return kinds


def test_a_kill_at_every_step_is_recovered_by_resume(tmp_path, monkeypatch):
    """Kill a 4-step run (SHORT) at every kind of file-system step (checkpoints at 2 and 4, the pruning of step-2,
    the final export, the log and config writes; among the data files of one folder being written, a random one
    per run); then kill the resume at a random step too; a last --resume auto must give the uninterrupted run's
    final weights and losses, a complete log, and no .tmp / .old left (nothing deleted that was the only copy).
    The kill points are shared by two processes forked from this one, side by side (the suite has two cores)."""
    from conftest import forked_processes

    with monkeypatch.context() as m:  # the uninterrupted run, its file-system steps recorded
        recorder = KillAt(m, 0)
        reference = train(cfg(tmp_path / "whole", *SHORT))
    assert len(set(reference.losses)) == 4 and len(recorder.steps) >= 40, recorder.steps
    reference_final = final_weights(tmp_path / "whole")
    kinds = kill_point_kinds(recorder.steps, tmp_path / "whole")
    rng = random.Random(int.from_bytes(os.urandom(4), "little"))
    # each kill point, whether to kill the resume as well (its recovery included) and where
    plan = [(n, rng.random() < 0.5, rng.randint(1, 30)) for n in sorted(rng.choice(ns) for ns in kinds.values())]

    def trials(part):
        for n, kill_the_resume, second_at in part:
            t0 = time.perf_counter()
            out = tmp_path / f"kill{n}"
            with monkeypatch.context() as m:
                killer = KillAt(m, n)
                with pytest.raises(Killed):
                    train(cfg(out, *SHORT))
            assert killer.steps[:n] == [tuple(p.replace("/whole", f"/kill{n}") for p in s)
                                        for s in recorder.steps[:n]]  # the same run, up to the step killed
            second = None
            if kill_the_resume and out.exists():
                with monkeypatch.context() as m:
                    k2 = KillAt(m, second_at)
                    try:
                        train(cfg(out, *SHORT), resume="auto")
                    except Killed:
                        second = k2.where
            train(cfg(out, *SHORT), resume="auto")
            where = f"kill at {killer.where}, then {second}"
            assert same_weights(final_weights(out), reference_final), where
            assert ck.verify(out / "final")["step"] == 4, where
            rows = read_log(out / "log.csv")
            assert [int(x["step"]) for x in rows] == [1, 2, 3, 4], where
            assert [float(x["loss"]) for x in rows] == reference.losses, where
            assert leftovers(out) == [], where
            assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-0000004"], where
            print(f"TRIAL {time.perf_counter() - t0:.2f} {where}", flush=True)
            shutil.rmtree(out)

    runs = forked_processes(functools.partial(trials, plan[0::2]), functools.partial(trials, plan[1::2]),
                            timeout=900)
    for run in runs:
        assert run.returncode == 0, run.stderr[-4000:]
    done = [line.split(" ", 2) for run in runs for line in run.stdout.splitlines() if line.startswith("TRIAL ")]
    assert len(done) == len(plan)
    print(f"\n{len(done)} kill points ({len(recorder.steps)} steps) recovered, {sum(float(t) for _, t, _ in done):.1f} s")


def test_a_finished_run_resumed_rewrites_a_missing_final(tmp_path, reference):
    train(cfg(tmp_path, "train.max_steps=5", "checkpoint.every=2"))
    shutil.rmtree(tmp_path / "final")
    log = (tmp_path / "log.csv").read_bytes()
    r = train(cfg(tmp_path, "train.max_steps=5", "checkpoint.every=2"), resume="auto")
    assert r.steps == 5 and r.losses == [] and r.final_checkpoint == str(tmp_path / "final")
    assert same_weights(final_weights(tmp_path), reference["final"])
    assert (tmp_path / "log.csv").read_bytes() == log
    # intact: nothing rewritten
    before = snapshot(tmp_path / "final")
    train(cfg(tmp_path, "train.max_steps=5", "checkpoint.every=2"), resume="auto")
    assert snapshot(tmp_path / "final") == before
    # a kill between the two renames of an export left final.old and final.tmp: the complete .tmp wins
    os.replace(tmp_path / "final", tmp_path / "final.old")
    shutil.copytree(tmp_path / "final.old", tmp_path / "final.tmp")
    train(cfg(tmp_path, "train.max_steps=5", "checkpoint.every=2"), resume="auto")
    assert leftovers(tmp_path) == [] and same_weights(final_weights(tmp_path), reference["final"])
    # only final.old (the .tmp was partial): it is put back, not deleted
    os.replace(tmp_path / "final", tmp_path / "final.old")
    (tmp_path / "final.tmp").mkdir()
    (tmp_path / "final.tmp" / "transformer.safetensors").write_bytes(b"partial")
    train(cfg(tmp_path, "train.max_steps=5", "checkpoint.every=2"), resume="auto")
    assert leftovers(tmp_path) == [] and same_weights(final_weights(tmp_path), reference["final"])
    # a final/ of an earlier max_steps is stale: a longer run re-exports it
    r = train(cfg(tmp_path, "train.max_steps=6", "checkpoint.every=2"), resume="auto")
    assert r.steps == 6 and ck.verify(tmp_path / "final")["step"] == 6


# --- 4. corruption -----------------------------------------------------------------------------------------------------

def _flip(p: Path):
    b = bytearray(p.read_bytes())
    b[len(b) // 2] ^= 0x01
    p.write_bytes(bytes(b))


CORRUPTIONS = {
    "flipped bit in the weights": lambda d: _flip(d / "state" / "model.safetensors"),
    "flipped bit in the optimizer": lambda d: _flip(d / "state" / "optimizer.safetensors"),
    "truncated optimizer": lambda d: (d / "state" / "optimizer.safetensors").write_bytes(
        (d / "state" / "optimizer.safetensors").read_bytes()[:100]),
    "edited scheduler state": lambda d: (d / "state" / "scheduler.json").write_text(
        (d / "state" / "scheduler.json").read_text().replace("0", "1", 1)),
    "missing rng file": lambda d: (d / "state" / "rng-0.safetensors").unlink(),
    "missing manifest": lambda d: (d / "manifest.json").unlink(),
    "garbage manifest": lambda d: (d / "manifest.json").write_text("{not json"),
    "manifest of another format": lambda d: (d / "manifest.json").write_text('{"format": "x"}'),
    "trainer state edited": lambda d: (d / "trainer_state.json").write_text('{"step": 4, "position": 1}'),
}


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_a_corrupt_latest_checkpoint_falls_back_to_the_newest_intact_one(tmp_path, reference, stopped, corruption,
                                                                        capsys):
    out = stopped(tmp_path / "run")  # step-2, step-4
    CORRUPTIONS[corruption](out / "checkpoints" / "step-0000004")
    capsys.readouterr()
    r = train(cfg(out, "train.max_steps=5", "checkpoint.every=2"), resume="auto")
    said = capsys.readouterr().out
    assert "step-0000004" in said and "falling back" in said and "resumed from" in said and "step-0000002" in said
    assert r.losses == reference["losses"][2:]  # steps 3..5, exactly as the uninterrupted run
    assert same_weights(final_weights(out), reference["final"])
    assert (out / "checkpoints" / "step-0000004.corrupt").is_dir()  # kept for inspection, never loaded


def test_corrupt_explicit_checkpoint_and_no_intact_one_are_refused(tmp_path, stopped):
    out = stopped(tmp_path / "run")
    _flip(out / "checkpoints" / "step-0000004" / "transformer.safetensors")
    with pytest.raises(CheckpointError, match="transformer.safetensors is corrupt"):
        train(cfg(out, "train.max_steps=5", "checkpoint.every=2"), resume=str(out / "checkpoints" / "step-0000004"))
    _flip(out / "checkpoints" / "step-0000002" / "state" / "model.safetensors")
    with pytest.raises(CheckpointError, match="no intact checkpoint"):
        train(cfg(out, "train.max_steps=5", "checkpoint.every=2"), resume="auto")
    assert not (out / "final").exists()


def test_a_checkpoint_of_another_model_or_trainable_set_is_refused_by_name(tmp_path, monkeypatch):
    train(cfg(tmp_path / "a", "train.max_steps=1"))
    ckpt = str(tmp_path / "a" / "checkpoints" / "step-0000001")
    with pytest.raises(CheckpointError, match="trained another set of weights"):
        train(cfg(tmp_path / "b", "train.max_steps=2", "train.trainable=attention"), resume=ckpt)
    from attnqat.pipelines import TINY_TRANSFORMER_CONFIG
    monkeypatch.setitem(TINY_TRANSFORMER_CONFIG, "num_layers", 3)
    with pytest.raises(CheckpointError, match="does not fit model 'tiny'"):
        train(cfg(tmp_path / "c", "train.max_steps=2"), resume=ckpt)
    assert not (tmp_path / "b" / "final").exists() and not (tmp_path / "c" / "final").exists()


# --- 6. no unpickling ----------------------------------------------------------------------------------------------------

class _Marker:
    """Unpickling this creates a file: the proof that something was unpickled."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _plant(folder: Path, marker: Path) -> list[str]:
    """A pickle at every name accelerate's load_state reads (and a few more)."""
    names = ["optimizer.bin", "pytorch_model.bin", "scheduler.bin", "scaler.pt", "random_states_0.pkl",
             "custom_checkpoint_0.pkl", "custom_checkpoint_1.pkl", "sampler.bin"]
    for n in names:
        (folder / "state" / n).write_bytes(pickle.dumps(_Marker(marker)))
    return names


def test_resume_never_unpickles(tmp_path, reference):
    """Before: --resume ran accelerate's load_state, which unpickles the RNG states (weights_only=False) and the
    custom objects: a checkpoint from someone else could run code. Now nothing in a checkpoint is unpickled."""
    marker = tmp_path / "pwned"
    out = tmp_path / "run"
    train(cfg(out, "train.max_steps=5", "checkpoint.every=2"), stop_after=2)
    ckpt = out / "checkpoints" / "step-0000002"
    assert not [p for p in ckpt.rglob("*") if p.suffix in (".pkl", ".bin", ".pt", ".pth")]
    # pickles beside a valid checkpoint: not listed in its manifest, so never opened
    _plant(ckpt, marker)
    r = train(cfg(out, "train.max_steps=5", "checkpoint.every=2"), resume="auto")
    assert not marker.exists()
    assert r.losses == reference["losses"][2:]
    # a pickle in place of the optimizer state: the sha256 differs, the checkpoint is refused, still not unpickled
    shutil.rmtree(out)
    train(cfg(out, "train.max_steps=5", "checkpoint.every=2"), stop_after=2)
    (ckpt / "state" / "optimizer.safetensors").write_bytes(pickle.dumps(_Marker(marker)))
    with pytest.raises(CheckpointError, match="optimizer.safetensors"):
        train(cfg(out, "train.max_steps=5", "checkpoint.every=2"), resume=str(ckpt))
    assert not marker.exists()
    # a checkpoint in accelerate's pickle layout (older attnqat): refused by name, from the CLI too
    legacy = tmp_path / "legacy" / "checkpoints" / "step-0000002"
    (legacy / "state").mkdir(parents=True)
    _plant(legacy, marker)
    (legacy / "transformer.safetensors").write_bytes(b"")
    from attnqat.cli import main
    assert main(["train", "--config", str(TINY), "--output-dir", str(tmp_path / "legacy"),
                 "--set", "log.progress=false", "--resume", str(legacy)]) == 2
    assert main(["train", "--config", str(TINY), "--output-dir", str(tmp_path / "legacy"),
                 "--set", "log.progress=false", "--resume", "auto"]) == 2
    assert not marker.exists()


def test_a_crafted_checkpoint_with_a_valid_manifest_is_still_only_data(tmp_path, stopped):
    """The manifest proves integrity, not origin: anyone can write one. A crafted checkpoint is safe because it
    is read as tensors and JSON only, and the JSON is checked: a scheduler state that would set other attributes
    (LambdaLR.load_state_dict sets every key it is given) and a trainer state of the wrong type are refused."""
    import json
    out = stopped(tmp_path / "run")
    ckpt = out / "checkpoints" / "step-0000004"
    sched = json.loads((ckpt / "state" / "scheduler.json").read_text())
    (ckpt / "state" / "scheduler.json").write_text(json.dumps({**sched, "optimizer": "x"}))
    ck.write_manifest(ckpt, kind="checkpoint", step=4)
    with pytest.raises(CheckpointError, match="scheduler.json"):
        train(cfg(out, "train.max_steps=5", "checkpoint.every=2"), resume=str(ckpt))
    (ckpt / "state" / "scheduler.json").write_text(json.dumps(sched))
    (ckpt / "trainer_state.json").write_text('{"step": "4; import os", "position": 8}')
    ck.write_manifest(ckpt, kind="checkpoint", step=4)
    with pytest.raises(CheckpointError, match="trainer_state.json"):
        train(cfg(out, "train.max_steps=5", "checkpoint.every=2"), resume=str(ckpt))


def test_a_real_sigkill_during_the_final_export(tmp_path, reference, capsys):
    """The in-process kills above raise; this one is a real SIGKILL (no finally, no flush), in a separate
    process, between the two renames of the final export (final -> final.old done, final.tmp -> final not). The
    recovery reads only the folder, so `attnqat train --resume auto` runs in this process (a second interpreter
    would only add its imports; the killed process is forked from this one for the same reason)."""
    import signal

    from attnqat.cli import main
    from conftest import forked_process

    out = tmp_path / "run"
    args = ["train", "--config", str(TINY), "--output-dir", str(out), "--max-steps", "5",
            *[a for o in SMALL + ["checkpoint.every=2"] for a in ("--set", o)]]
    train(cfg(out, "train.max_steps=5", "checkpoint.every=2"))  # a complete run: final/ exists, the export repeats
    shutil.rmtree(out / "checkpoints" / "step-0000005")  # so the resume trains step 5 and exports again

    def killed_on_the_second_rename():
        real = os.replace

        def replace(a, b):
            if str(a).endswith("final.tmp"):
                os.kill(os.getpid(), signal.SIGKILL)
            return real(a, b)

        os.replace = replace  # in the forked process only
        return main([*args, "--resume", "auto"])

    p = forked_process(killed_on_the_second_rename)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    assert not (out / "final").exists() and (out / "final.old").is_dir() and (out / "final.tmp").is_dir()
    capsys.readouterr()
    assert main([*args, "--resume", "auto"]) == 0
    assert "finished the interrupted write" in capsys.readouterr().out and leftovers(out) == []
    assert same_weights(final_weights(out), reference["final"])
