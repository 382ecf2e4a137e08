"""`attnqat train` turns every user mistake into one line on stderr and exit status 2: hostile --set values
for every config key, absurd sizes, non-finite numbers, malformed overrides, bad paths and flags. Each case
runs in-process (attnqat.cli.main) against a folder that already holds a run and a file of the user's, and
must leave every file there as it was (no file created, none changed or deleted).
"""
from __future__ import annotations

import dataclasses
import hashlib
import time
from pathlib import Path

import pytest
import torch

from attnqat.cli import main
from attnqat.train import TrainConfig, train
from attnqat.train.config import load_config

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"


@pytest.fixture(autouse=True)
def reference_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def leaf_keys(cls=TrainConfig, prefix="") -> dict[str, type]:
    """Every config key (section.key) with its annotation."""
    out = {}
    hints = __import__("typing").get_type_hints(cls)
    for f in dataclasses.fields(cls):
        h = hints[f.name]
        if dataclasses.is_dataclass(h):
            out.update(leaf_keys(h, f"{prefix}{f.name}."))
        else:
            out[prefix + f.name] = h
    return out


KEYS = leaf_keys()
OPTIONAL = {"data.path", "train.teacher_dtype", "data.corpus.size_weights"}  # null is legal there
BOOLS = {k for k, h in KEYS.items() if h is bool}
# Values no key accepts (with the exceptions named below), as YAML text.
GENERIC = ["null", ".nan", ".inf", "-.inf", "1e999", "-1", "[]", "{a: 1}", "true", "''", "'" + "x" * 5000 + "'",
           "[[[[1]]]]", "&a [*a]", "2026-01-01", "{1: 2}", "'\u202e\u0000'"]
# legal after all: null where a key is optional, true for booleans, a folder or trackers' project named 1e999 (YAML
# reads it as a string), no trackers
SKIP = {(k, "null") for k in OPTIONAL} | {(k, "true") for k in BOOLS} | {("output_dir", "1e999"),
                                                                          ("log.project", "1e999"), ("log.trackers", "[]")}
# Well-typed but absurd: past the limits docs/training.md gives (LIMITS and the size limits), or inconsistent.
ABSURD = [
    "train.max_steps=10000000", "train.max_steps=0", "seed=4294967296", "seed=-5", "data.held_out_seed=-1",
    "objective.teacher_steps=100000", "train.lr=2", "train.lr=0", "train.lr=-1e-320", "train.eps=10", "train.eps=0",
    "timesteps.shift=1e6", "timesteps.shift=0", "train.gradient_accumulation_steps=100000",
    "objective.output_weight=1e9", "objective.flow_weight=-1", "data.batch_size=1000000000",
    "data.held_out=1000000000", "data.text_len=1000000000", "data.latent_shape=[16, 100000, 100000, 100000]",
    "data.latent_shape=[16, 2, 8]", "data.latent_shape=[16, 2, 8, 0]", "data.latent_shape=[16, true, 8, 8]",
    "train.warmup_steps=25", "train.weight_decay=1e6", "train.min_lr_ratio=2", "train.betas=[1, 0.5]",
    "train.betas=[0.9]", "train.betas=[0.9, .nan]", "train.betas=[0.9, '0.99']", "timesteps.min_sigma=1.5",
    "timesteps.max_sigma=2", "attention.layers=[0, 99]", "attention.layers=[true]", "attention.layers=[]",
    "attention.options={p_bwd: nope}", "attention.options={p_bwd: 1}", "attention.mode=attn",
    "attention.options={smooth_k: 1}", "attention.mode=nvfp4", "model=/nonexistent/model",
    "data.path=/nonexistent/data", "objective.type=flow", "train.sequence_parallel=2", "train.sequence_parallel=0",
    "train.lora.rank=0", "train.lora.alpha=0", "train.lora.dropout=1", "train.lora.target_modules=[to_q, to_q]",
    "train.lora.target_modules=[' to_q']",
] + ([] if torch.cuda.is_available() else ["train.mixed_precision=fp16"])  # fp16 needs a GPU
ABSURD_KEYS = {s.split("=", 1)[0] for s in ABSURD}
MALFORMED = ["train.lr", "=1", ".lr=1", "train..lr=1", "train.lr.x=1", "nosuch.key=1", "train=5", "train.lr=[1",
             "train.lr=!!python/object/apply:os.system ['touch pwned']", "train.lr={", "train.lr=@x", "a" * 10000,
             "train.lr=1: 2: 3"]


@pytest.fixture(scope="module")
def existing_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    train(load_config(TINY, [f"output_dir={root / 'run'}", "log.progress=false", "train.max_steps=2",
                             "data.held_out=0", "data.batch_size=1", "checkpoint.every=1"]))
    (root / "run" / "notes.txt").write_text("the user's")
    (root / "afile").write_text("x")
    (root / "empty").mkdir()
    (root / "yaml_list.yaml").write_text("- 1\n- 2\n")
    (root / "bad.yaml").write_text("model: [\n")
    (root / "tagged.yaml").write_text("model: !!python/object/apply:os.system ['touch pwned']\n")
    (root / "binary.yaml").write_bytes(bytes(range(256)) * 4)
    (root / "huge.yaml").write_text("# " + "x" * (2 << 20) + "\n")
    (root / "unknown.yaml").write_text("modle: tiny\n")
    return root


def snapshot(root: Path) -> dict:
    return {p.relative_to(root).as_posix(): (None if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(root.rglob("*"))}


def stat_snapshot(root: Path) -> dict:
    """Every path under root with its file's size, mtime (ns) and inode (None for folders): a write, a replace or a
    truncation changes one of them. Cheap enough for every one of the ~1000 cases (hashing the run's files each
    time cost half the test); the content hashes are compared before and after them all."""
    def stat(p):
        st = p.stat()
        return st.st_size, st.st_mtime_ns, st.st_ino

    return {p.relative_to(root).as_posix(): (None if p.is_dir() else stat(p)) for p in sorted(root.rglob("*"))}


def cases(root: Path) -> list[tuple[str, list[str]]]:
    run = str(root / "run")
    base = ["train", "--config", str(TINY), "--set", "log.progress=false"]
    into_run = base + ["--output-dir", run, "--resume", "auto"]  # the existing run: a value must be refused first
    out = []
    for key, hint in KEYS.items():
        for v in GENERIC:
            if (key, v) not in SKIP:  # (--output-dir would override output_dir: that key goes alone)
                argv = (base + ["--resume", "auto"]) if key == "output_dir" else into_run
                out.append((f"--set {key}={v[:20]}", argv + ["--set", f"{key}={v}"]))
    out += [(f"--set {s[:40]}", into_run + ["--set", s]) for s in ABSURD]
    out += [(f"malformed --set {s[:30]}", into_run + ["--set", s]) for s in MALFORMED]
    ckpt = str(root / "run" / "checkpoints" / "step-0000002")
    out += [
        ("--max-steps abc", base + ["--output-dir", run, "--max-steps", "abc"]),
        ("--max-steps -5", base + ["--output-dir", run, "--resume", "auto", "--max-steps", "-5"]),
        ("--max-steps 1e3", base + ["--output-dir", run, "--max-steps", "1e3"]),
        ("--max-steps ''", base + ["--output-dir", run, "--max-steps", ""]),
        ("--max-steps huge", base + ["--output-dir", run, "--resume", "auto", "--max-steps", "9" * 30]),
        ("--max-steps (no value)", base + ["--output-dir", run, "--max-steps"]),
        ("--stop-after 0", base + ["--output-dir", run, "--resume", "auto", "--stop-after", "0"]),
        ("--stop-after x", base + ["--output-dir", run, "--stop-after", "x"]),
        ("--resume ''", base + ["--output-dir", run, "--resume", ""]),
        ("--resume ' '", base + ["--output-dir", run, "--resume", " "]),
        ("--resume missing", base + ["--output-dir", run, "--resume", str(root / "nope")]),
        ("--resume a file", base + ["--output-dir", run, "--resume", str(root / "afile")]),
        ("--resume an empty folder", base + ["--output-dir", run, "--resume", str(root / "empty")]),
        ("--resume the run folder", base + ["--output-dir", run, "--resume", run]),
        ("--resume final/", base + ["--output-dir", run, "--resume", str(root / "run" / "final")]),
        ("--resume past max_steps", base + ["--output-dir", run, "--resume", ckpt, "--max-steps", "1"]),
        ("--resume + --overwrite", base + ["--output-dir", run, "--resume", "auto", "--overwrite"]),
        ("no --resume into a run", base + ["--output-dir", run]),
        ("--output-dir a file", base + ["--output-dir", str(root / "afile")]),
        ("--output-dir under a file", base + ["--output-dir", str(root / "afile" / "sub")]),
        ("--output-dir ''", base + ["--output-dir", ""]),
        ("--output-dir too long", base + ["--output-dir", str(root / ("x" * 5000))]),
        ("--output-dir (no value)", base + ["--output-dir"]),
        ("--config missing", ["train", "--config", str(root / "nope.yaml"), "--output-dir", run]),
        ("--config a folder", ["train", "--config", str(root), "--output-dir", run]),
        ("--config a list", ["train", "--config", str(root / "yaml_list.yaml"), "--output-dir", run]),
        ("--config bad YAML", ["train", "--config", str(root / "bad.yaml"), "--output-dir", run]),
        ("--config a python tag", ["train", "--config", str(root / "tagged.yaml"), "--output-dir", run]),
        ("--config binary", ["train", "--config", str(root / "binary.yaml"), "--output-dir", run]),
        ("--config 2 MB", ["train", "--config", str(root / "huge.yaml"), "--output-dir", run]),
        ("--config an unknown key", ["train", "--config", str(root / "unknown.yaml"), "--output-dir", run]),
        ("no --config", ["train", "--output-dir", run]),
        ("--set (no value)", base + ["--output-dir", run, "--set"]),
    ]
    return out


def test_hostile_values_exit_2_in_one_line_and_touch_nothing(existing_run, capsys, monkeypatch):
    root = existing_run
    monkeypatch.chdir(root)  # a relative path a case might create lands where the snapshot sees it
    before, stats = snapshot(root), stat_snapshot(root)
    t0 = time.perf_counter()
    all_cases = cases(root)
    failures = []
    for name, argv in all_cases:
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse's own errors (a flag without its value)
            rc = e.code
        except Exception as e:  # a traceback: the CLI would print it
            rc = f"{type(e).__name__}: {str(e)[:100]}"
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        ok = (rc == 2 and len(lines) == 1 and lines[0].startswith("attnqat train: error: ")
              and "Traceback" not in err and len(lines[0]) < 600)
        if not ok:
            failures.append(f"{name}: rc={rc}, stderr={err[-300:]!r}")
        elif stat_snapshot(root) != stats:
            now = stat_snapshot(root)
            failures.append(f"{name}: changed files: {sorted(set(now.items()) ^ set(stats.items()))[:3]}")
            stats = now
    took = time.perf_counter() - t0
    print(f"\n{len(all_cases)} hostile cases in {took:.1f} s")
    assert not failures, "\n".join(failures[:20]) + f"\n({len(failures)} of {len(all_cases)})"
    assert snapshot(root) == before  # and every file's content, once after them all
    assert not (root / "pwned").exists()
    # the control: the same harness accepts a valid request
    assert main(["train", "--config", str(TINY), "--output-dir", str(root / "run"), "--resume", "auto", "--check"]) == 0
    assert snapshot(root) == before


def test_limits_are_documented():
    from attnqat.train.config import LIMITS
    text = (ROOT / "docs" / "training.md").read_text()
    for key, (hi, why) in LIMITS.items():
        assert f"`{key}`" in text and why in text, key
    assert ABSURD_KEYS <= set(KEYS)


def test_overwrite_from_the_cli(existing_run, tmp_path, capsys):
    import shutil
    run = shutil.copytree(existing_run / "run", tmp_path / "run")
    argv = ["train", "--config", str(TINY), "--output-dir", str(run), "--set", "log.progress=false",
            "--set", "data.held_out=0", "--set", "data.batch_size=1", "--max-steps", "1"]
    assert main(argv) == 2 and "already holds a training run" in capsys.readouterr().err
    assert main(argv + ["--overwrite"]) == 0
    assert "--overwrite removed the earlier run" in capsys.readouterr().out
    assert (run / "notes.txt").read_text() == "the user's"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-0000001"]


def test_fp16_is_checked_for_the_device_the_run_gets(tmp_path, monkeypatch, capsys):
    """train.mixed_precision=fp16 is judged by the device the trainer's accelerator will use: accepted where torch
    reports a GPU, refused where it reports none or the launcher asks for the CPU (`accelerate launch --cpu`)."""
    argv = ["train", "--config", str(TINY), "--output-dir", str(tmp_path / "run"), "--set",
            "train.mixed_precision=fp16", "--check"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert main(argv) == 0 and "config OK" in capsys.readouterr().out
    monkeypatch.setenv("ACCELERATE_USE_CPU", "true")
    assert main(argv) == 2 and "'fp16' needs a GPU; use 'no' on CPU" in capsys.readouterr().err
    monkeypatch.delenv("ACCELERATE_USE_CPU")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(argv) == 2 and "'fp16' needs a GPU; use 'no' on CPU" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_run_from_the_cli_validates_its_config_once(tmp_path, monkeypatch):
    from attnqat.train import cli, config, loop

    calls = []

    def counting(*args, **kwargs):
        calls.append(kwargs)
        return config.validate(*args, **kwargs)

    monkeypatch.setattr(cli, "validate", counting)
    monkeypatch.setattr(loop, "validate", counting)
    assert main(["train", "--config", str(TINY), "--output-dir", str(tmp_path / "run"), "--set", "log.progress=false",
                 "--set", "data.held_out=0", "--set", "data.batch_size=1", "--max-steps", "1"]) == 0
    assert len(calls) == 1 and (tmp_path / "run" / "final").is_dir()
