"""bench/build_mini.sh, the one command that builds the shipped mini from nothing: the VAE's trainings (a 17-frame
VAE, then the shipped VAE's whole-VAE training and three of its decoder alone) and the transformer's four runs, in
order, as warm starts of each other with the recipe's settings; a finished build is not trained again, and bad
arguments are refused. CPU, small sizes, one VAE step (of one clip) and two transformer steps a training (EXTRA)."""
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


def _build(out: Path, *args: str, sets: tuple[str, ...] = (), **env_vars: str) -> subprocess.CompletedProcess:
    # --vae-batch 0.02: one 5x32x32 clip a VAE step (1 would be 54 of them, 17x128x128's pixels: 8 s a training)
    extra = " ".join(["--device cpu --vae-steps 1 --vae-batch 0.02 --vae-sizes 5x32x32 --eval-clips 1",
                      *(f"--set {kv}" for kv in (*SMALL, *sets))])
    env = dict(os.environ, EXTRA=extra, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               **env_vars)
    return subprocess.run(["bash", str(SCRIPT), str(out), *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=900)


@pytest.mark.slow  # ~2.5 minutes on 2 cores (ten interpreter starts that each train)
def test_builds_the_whole_chain_and_skips_what_is_done(tmp_path):
    out = tmp_path / "build"
    run = _build(out)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert f"built: {out / 't4' / 'mini'}" in run.stdout
    runs = ("t1", "t2", "t3", "t4")
    cards = {n: json.loads((out / n / "mini" / "attnqat_mini.json").read_text()) for n in runs}
    # the VAE: the 17-frame one on its own, then the shipped VAE's four trainings (the whole VAE, then its decoder)
    assert [r["stage"] for r in json.loads((out / "vae17" / "timings.json").read_text())] == ["vae"]
    vae_rows = json.loads((out / "vae" / "timings.json").read_text())
    assert [r["trained"] for r in vae_rows] == ["all", "decoder", "decoder", "decoder"]
    # each run continues the one before: the steps and runs of the chain add up, the VAE's trainings counted once
    assert [c["transformer_steps"] for c in cards.values()] == [2, 4, 6, 8]
    assert [r["warm_start"] for r in cards["t4"]["runs"]] == [False, True, True, True]
    assert [r["stage"] for r in cards["t4"]["timings"]] == ["vae"] * 4 + ["transformer"] * 4
    assert cards["t4"]["timings"][:4] == vae_rows
    # the recipe's settings (the test's EXTRA only shrinks sizes, pools and steps)
    train = [c["config"]["train"] for c in cards.values()]
    assert [c["config"]["timesteps"]["shift"] for c in cards.values()] == [8.0] * 4
    assert [t["lr_schedule"] for t in train] == ["constant", "constant", "cosine", "cosine"]
    assert [t["lr"] for t in train] == [3e-4, 3e-4, 3e-4, 1e-4] and train[3]["min_lr_ratio"] == 0.0
    assert [t["from_scratch"] for t in train] == [True, False, False, False]
    # the same command again: every training is recorded, nothing is trained again
    files = [out / n / "mini" / "attnqat_mini.json" for n in runs] + [out / n / "timings.json" for n in ("vae17", "vae")]
    before = {f: f.read_bytes() for f in files}
    again = _build(out)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "vae: VAE training 4 done already, skipped" in again.stdout
    assert all(f"{n}: exported already, skipped" in again.stdout for n in runs)
    assert {f: f.read_bytes() for f in files} == before
    # a run killed before its export continues in its own folder (no second warm start over it)
    shutil.rmtree(out / "t4" / "mini")
    resumed = _build(out)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    card = json.loads((out / "t4" / "mini" / "attnqat_mini.json").read_text())
    assert card["transformer_steps"] == 8 and [r["warm_start"] for r in card["runs"]] == [False, True, True, True]


def test_a_trained_vae_and_a_stop_after_a_run(tmp_path):
    """VAE=: no VAE is trained, the runs encode with that build's VAE and their cards count its VAE trainings;
    UNTIL=: the chain stops after that run's export and the same command continues it (the full-length ceiling,
    bench/gpu_ceiling.sh, trains the chain with FP4 attention over two device sessions this way)."""
    out, shipped = tmp_path / "build", ROOT / "attnqat" / "models" / "mini"
    fp4 = ("attention.mode=attn_qat", "attention.options.qk_rotation=hadamard")
    first = _build(out, sets=fp4, VAE=str(shipped), UNTIL="t1")
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    assert f"stopped after t1 (UNTIL): {out / 't1' / 'mini'}" in first.stdout
    assert sorted(p.name for p in out.iterdir()) == ["t1", "vae_timings.json"]  # no VAE folders, no t2
    vae_rows = [r for r in json.loads((shipped / "attnqat_mini.json").read_text())["timings"] if r["stage"] == "vae"]
    card = json.loads((out / "t1" / "mini" / "attnqat_mini.json").read_text())
    assert card["timings"][:4] == vae_rows and [r["stage"] for r in card["timings"]] == ["vae"] * 4 + ["transformer"]
    assert card["config"]["attention"] == {"mode": "attn_qat", "layers": "self", "options": {"qk_rotation": "hadamard"}}
    # the export's VAE is the given one, as it was (the export stores it in fp16, as the shipped one is stored)
    from safetensors.torch import load_file
    given = load_file(shipped / "vae" / "diffusion_pytorch_model.safetensors")
    exported = load_file(out / "t1" / "mini" / "vae" / "diffusion_pytorch_model.safetensors")
    assert given.keys() == exported.keys() and all(given[k].equal(exported[k]) for k in given)
    # the same command again: the run is recorded, nothing trains (the warm starts of later runs: the test above)
    t1 = (out / "t1" / "mini" / "attnqat_mini.json").read_bytes()
    again = _build(out, sets=fp4, VAE=str(shipped), UNTIL="t1")
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    assert "t1: exported already, skipped" in again.stdout and not (out / "t2").exists()
    assert (out / "t1" / "mini" / "attnqat_mini.json").read_bytes() == t1


@pytest.mark.parametrize("env, message", [({"UNTIL": "t5"}, "UNTIL must be t1, t2, t3 or t4"),
                                          ({"VAE": "NOWHERE"}, "is not an exported build")])
def test_bad_knobs_are_refused(tmp_path, env, message):
    env = {k: str(tmp_path / v) if v == "NOWHERE" else v for k, v in env.items()}
    run = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], capture_output=True, text=True, cwd=tmp_path,
                         timeout=60, env=dict(os.environ, **env))
    assert run.returncode == 2 and message in run.stderr and "Traceback" not in run.stderr
    assert list(tmp_path.iterdir()) == []  # nothing created


@pytest.mark.parametrize("args, message", [((), "usage"), (("x", "--shp"), "usage"), (("x", "--ship", "y"), "usage"),
                                           (("FILE",), "is not a folder")])
def test_bad_arguments_are_refused(tmp_path, args, message):
    (tmp_path / "FILE").write_text("a user's file")
    args = tuple(str(tmp_path / a) if a == "FILE" else a for a in args)
    run = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert run.returncode == 2 and message in run.stderr and "Traceback" not in run.stderr
    assert (tmp_path / "FILE").read_text() == "a user's file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["FILE"]  # nothing created
