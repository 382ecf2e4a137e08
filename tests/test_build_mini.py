"""bench/build_mini.sh, the one command that builds the shipped mini from nothing: its three trainings run in
order as warm starts of each other with the recipe's settings, a finished build is not trained again, and bad
arguments are refused. CPU, small sizes and two steps a training (EXTRA)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "build_mini.sh"
SMALL = ["data.corpus.sizes=[[5,32,32]]", "data.corpus.size_weights=null", "data.batch_size=2", "data.corpus.pool=4",
         "data.corpus.refresh=2", "data.corpus.refresh_every=1", "data.corpus.encode_batch=2", "data.held_out=2",
         "train.max_steps=2", "train.warmup_steps=1", "checkpoint.every=2", "log.every=1", "log.eval_every=0",
         'train.mixed_precision="no"', "train.compile=false", "log.progress=false"]


def _build(out: Path, *args: str) -> subprocess.CompletedProcess:
    extra = " ".join(["--device cpu --vae-steps 1 --vae-batch 1 --vae-sizes 5x32x32 --eval-clips 1", *(f"--set {kv}" for kv in SMALL)])
    env = dict(os.environ, EXTRA=extra, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    return subprocess.run(["bash", str(SCRIPT), str(out), *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=900)


@pytest.mark.slow
def test_builds_the_three_stage_chain_and_skips_what_is_done(tmp_path):
    out = tmp_path / "build"
    run = _build(out)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert f"built: {out / 'mini6' / 'mini'}" in run.stdout
    cards = {n: json.loads((out / n / "mini" / "attnqat_mini.json").read_text()) for n in ("mini4", "mini5", "mini6")}
    # each build continues the one before: the steps and runs of the chain add up
    assert [c["transformer_steps"] for c in cards.values()] == [2, 4, 6]
    assert [r["warm_start"] for r in cards["mini6"]["runs"]] == [False, True, True]
    assert [r["stage"] for r in cards["mini6"]["timings"]] == ["vae", "transformer", "transformer", "transformer"]
    # the recipe's settings (the test's EXTRA only shrinks sizes and steps)
    shifts = [c["config"]["timesteps"]["shift"] for c in cards.values()]
    schedules = [c["config"]["train"]["lr_schedule"] for c in cards.values()]
    assert shifts == [3.0, 8.0, 8.0] and schedules == ["constant", "constant", "cosine"]
    assert cards["mini6"]["config"]["train"]["min_lr_ratio"] == 0.1
    assert all(c["config"]["train"]["from_scratch"] is (n == "mini4") for n, c in cards.items())
    # the same command again: every stage is exported, nothing is trained again
    before = {n: (out / n / "mini" / "attnqat_mini.json").read_bytes() for n in cards}
    again = _build(out)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "mini5: exported already, skipped" in again.stdout and "mini6: exported already, skipped" in again.stdout
    assert {n: (out / n / "mini" / "attnqat_mini.json").read_bytes() for n in cards} == before
    # a build killed before its export continues in its own folder (no second warm start over it)
    shutil.rmtree(out / "mini6" / "mini")
    resumed = _build(out)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    card = json.loads((out / "mini6" / "mini" / "attnqat_mini.json").read_text())
    assert card["transformer_steps"] == 6 and [r["warm_start"] for r in card["runs"]] == [False, True, True]


@pytest.mark.parametrize("args, message", [((), "usage"), (("x", "--shp"), "usage"), (("x", "--ship", "y"), "usage"),
                                           (("FILE",), "is not a folder")])
def test_bad_arguments_are_refused(tmp_path, args, message):
    (tmp_path / "FILE").write_text("a user's file")
    args = tuple(str(tmp_path / a) if a == "FILE" else a for a in args)
    run = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert run.returncode == 2 and message in run.stderr and "Traceback" not in run.stderr
    assert (tmp_path / "FILE").read_text() == "a user's file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["FILE"]  # nothing created
