"""Outputs under hostile conditions, on the tiny model: two processes writing one run folder (the second is
refused naming the first; a killed holder's lock is taken over), a full disk while a checkpoint, a shard or
a set of result files is written (the old output whole, one line, exit 1, no temporary left), an output
that is (or is inside) an input, a YAML alias bomb, and Ctrl-C while a command still imports torch."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from attnqat.cli import main as cli_main

ROOT = Path(__file__).resolve().parent.parent
ENV = {k: v for k, v in os.environ.items() if k != "ATTNQAT_TRACEBACK"}
TINY = ["--config", str(ROOT / "configs" / "tiny.yaml"), "--set", "data.held_out=0", "--set", "log.progress=false",
        "--set", "data.batch_size=2"]
ENOSPC_TEXT = "Error while serializing: I/O error: No space left on device (os error 28)"  # safetensors' own words


def _snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _full_disk_after(monkeypatch, calls: int):
    """safetensors' save_file succeeds ``calls`` times, then writes part of a file and fails as on a full disk."""
    import safetensors.torch
    from safetensors import SafetensorError

    real, count = safetensors.torch.save_file, [0]

    def save_file(tensors, filename, metadata=None):
        count[0] += 1
        if count[0] > calls:
            Path(filename).write_bytes(b"\0" * 100)
            raise SafetensorError(ENOSPC_TEXT)
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    return count


def _finetune(path: Path) -> Path:
    """A QAT fine-tune of tiny (two tensors changed) as one safetensors file."""
    from safetensors.torch import save_file

    from attnqat.pipelines import build_tiny_transformer

    sd = {k: v.contiguous() for k, v in build_tiny_transformer().state_dict().items()}
    for k in list(sd)[:2]:
        sd[k] = sd[k] + 0.1
    save_file(sd, str(path))
    return path


# ------------------------------------------------------------------------------------------------ the lock
HOLDER = """
import sys
from attnqat.locking import output_lock
with output_lock(sys.argv[1], "attnqat train"):
    print("held", flush=True)
    sys.stdin.read()
"""


def _hold(target: Path) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(target)], cwd=ROOT, env=ENV, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_second_writer_is_refused_naming_the_first(tmp_path, monkeypatch, capsys):
    """A real second process (`attnqat train` on the folder another process holds; forked from this one, a new
    interpreter would spend most of the test importing) exits 75 with one line naming the holder's pid and
    command, before anything is written; precompute and export-qat likewise."""
    from conftest import forked_process

    def train_in_the_held_folder():
        os.environ.pop("ATTNQAT_TRACEBACK", None)
        return cli_main(["train", *TINY, "--output-dir", str(run_dir)])

    run_dir, data, qat = tmp_path / "run", tmp_path / "data", tmp_path / "qat.safetensors"
    holders = [_hold(run_dir), _hold(data), _hold(qat)]
    try:
        r = forked_process(train_in_the_held_folder)
        assert r.returncode == 75, r.stderr
        line = _one_line(r.stderr)
        assert line.startswith("attnqat train: busy:") and f"pid {holders[0].pid}" in line and "attnqat train" in line
        assert not run_dir.exists()

        import attnqat.pipelines.qat_export as qat_export
        import attnqat.train.precompute as pre

        monkeypatch.setattr(pre, "load_encoders", lambda *a, **k: pytest.fail("encoders loaded"))
        monkeypatch.setattr(qat_export, "export_qat_weights", lambda *a, **k: pytest.fail("exported"))
        (tmp_path / "p.txt").write_text("a red ball\n")
        capsys.readouterr()
        assert cli_main(["precompute", "--prompts", str(tmp_path / "p.txt"), "--model", "tiny", "--out", str(data),
                         "--device", "cpu"]) == 75
        assert f"pid {holders[1].pid}" in _one_line(capsys.readouterr().err)
        assert cli_main(["export-qat", "--from", str(_finetune(tmp_path / "ft.safetensors")), "--model", "tiny",
                         "--out", str(qat)]) == 75
        assert f"pid {holders[2].pid}" in _one_line(capsys.readouterr().err)
        assert not data.exists() and not qat.exists()
    finally:
        for h in holders:
            h.stdin.close()
            h.wait(timeout=30)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ft.safetensors", "p.txt"]  # the lock files went too


def test_a_killed_holders_lock_is_taken_over(tmp_path):
    from attnqat.locking import lock_path, output_lock

    target = tmp_path / "run"
    holder = _hold(target)
    holder.kill()
    holder.wait(timeout=30)
    lock = lock_path(target)
    assert f'"pid": {holder.pid}' in lock.read_text()  # the file outlives its process: it is not the lock
    said = []
    with output_lock(target, "attnqat train", log=said.append):
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert len(said) == 1 and f"pid {holder.pid}" in said[0] and "no longer running" in said[0]
    assert not lock.exists() and list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------------------------- a full disk
def test_train_on_a_full_disk_is_one_line_and_leaves_no_partial_checkpoint(tmp_path):
    """A real process (forked from this one: a new interpreter would spend most of the test importing) whose
    safetensors writes fail as on a full disk from the 6th file on (step 1's checkpoint has 4 files; step 2's
    second fails): one line, exit 1, step 1's checkpoint whole, no .tmp."""
    from conftest import forked_process

    out = tmp_path / "run"

    def train_on_a_full_disk():
        os.environ.pop("ATTNQAT_TRACEBACK", None)
        _full_disk_after(pytest.MonkeyPatch(), 5)  # in the forked process only
        return cli_main(["train", *TINY, "--set", "train.max_steps=3", "--set", "checkpoint.every=1",
                         "--output-dir", str(out)])

    r = forked_process(train_on_a_full_disk)
    assert r.returncode == 1, r.stderr[-3000:]
    # one line of ours; diffusers warns once when the teacher is cast (not a failure)
    line = _one_line("\n".join(x for x in r.stderr.splitlines() if not x.startswith("There are modules in Wan")))
    assert line.startswith("attnqat train: failed: could not write") and "No space left on device" in line
    assert "step-0000002.tmp/transformer.safetensors" in line
    left = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert left == ["step-0000001"] and not list(out.rglob("*.tmp")) and not (out / "final").exists()
    from attnqat.train.checkpoint import read_manifest

    read_manifest(out / "checkpoints" / "step-0000001")  # still whole


def test_precompute_on_a_full_disk_keeps_the_old_output(tmp_path, monkeypatch, capsys):
    (tmp_path / "p.txt").write_text("".join(f"prompt {i}\n" for i in range(4)))
    out = tmp_path / "data"
    argv = ["precompute", "--prompts", str(tmp_path / "p.txt"), "--model", "tiny", "--out", str(out),
            "--max-length", "8", "--shard-size", "2", "--device", "cpu"]
    assert cli_main(argv) == 0
    before = _snapshot(out)
    (tmp_path / "p.txt").write_text("".join(f"other prompt {i}\n" for i in range(4)))
    _full_disk_after(monkeypatch, 1)  # the second shard fails
    capsys.readouterr()
    assert cli_main(argv) == 1
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("attnqat precompute: failed:") and "No space left on device" in line
    assert _snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "p.txt"]


def test_a_killed_precomputes_temporary_folders_are_removed_by_the_next_run(tmp_path):
    from attnqat.train.precompute import precompute

    (tmp_path / "p.txt").write_text("a red ball\n")
    out = tmp_path / "data"
    killed = tmp_path / ".data.0123456789ab.tmp"  # as a run killed while writing its second shard leaves it
    killed.mkdir()
    (killed / "shard-00000.safetensors").write_bytes(b"x" * 10)
    (killed / "shard-00001.safetensors.tmp").write_bytes(b"x" * 5)
    users = [tmp_path / ".data.fedcba987654.tmp", tmp_path / ".data.notours.tmp"]  # not precompute's: kept
    for u in users:
        u.mkdir()
        (u / "notes.txt").write_text("mine")
    said = []
    precompute(str(tmp_path / "p.txt"), str(out), max_length=8, device="cpu", log=said.append)
    assert not killed.exists() and all((u / "notes.txt").read_text() == "mine" for u in users)
    assert any(str(killed) in s and "interrupted run" in s for s in said)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["data", "p.txt", *(u.name for u in users)])


def test_a_kill_between_the_two_renames_of_a_replacement_is_undone(tmp_path):
    """A kill after the old output was moved aside and before the new one was renamed in: the next run puts
    the old one back first (and then replaces it as usual)."""
    from attnqat.outputs import remove_stale_temps
    from attnqat.train.precompute import is_partial_output

    old = tmp_path / ".data.0123456789ab.old"
    old.mkdir()
    (old / "index.json").write_text("{}")
    remove_stale_temps(tmp_path / "data", is_partial_output)
    assert (tmp_path / "data" / "index.json").read_text() == "{}" and not old.exists()


# ---------------------------------------------------------------------------------- outputs are not inputs
def test_export_qat_never_writes_over_its_fine_tune(tmp_path, monkeypatch, capsys):
    import attnqat.pipelines.qat_export as qat_export

    ft = _finetune(tmp_path / "ft.safetensors")
    before = ft.read_bytes()
    (tmp_path / "link.safetensors").symlink_to(ft)
    os.link(ft, tmp_path / "hard.safetensors")
    run = tmp_path / "run" / "final"
    run.mkdir(parents=True)
    os.link(ft, run / "transformer.safetensors")
    (tmp_path / "sub").mkdir()  # sub/../ft.safetensors names ft.safetensors
    monkeypatch.setattr(qat_export, "export_qat_weights", lambda *a, **k: pytest.fail("exported"))
    for frm, out in ((ft, ft), (ft, tmp_path / "sub" / ".." / "ft.safetensors"), (ft, tmp_path / "link.safetensors"),
                     (tmp_path / "link.safetensors", ft), (ft, tmp_path / "hard.safetensors"),
                     (tmp_path / "run", run / "transformer.safetensors"), (tmp_path / "run", run / "new.safetensors")):
        capsys.readouterr()
        assert cli_main(["export-qat", "--from", str(frm), "--model", "tiny", "--out", str(out)]) == 2, (frm, out)
        line = _one_line(capsys.readouterr().err)
        assert line.startswith("attnqat export-qat: error: --out") and "--from" in line, line
    assert ft.read_bytes() == before
    # a model folder's inputs are the files it loads from: the QAT weights mini ships may be written beside them
    from attnqat.checks import check_not_input
    from attnqat.pipelines.loading import model_inputs

    mini = ROOT / "attnqat" / "models" / "mini"
    check_not_input("--out", mini / "attn_qat.safetensors", model_inputs("--model", "mini"))
    with pytest.raises(ValueError, match="is inside --model"):
        check_not_input("--out", mini / "transformer" / "x.safetensors", model_inputs("--model", "mini"))


def test_no_command_writes_over_or_into_what_it_reads(tmp_path, monkeypatch, capsys):
    import attnqat.pipelines.loading as loading
    import attnqat.train.precompute as pre

    monkeypatch.setattr(loading, "load_pipeline", lambda *a, **k: pytest.fail("a model loaded"))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    _finetune(ckpt / "transformer.safetensors")
    data = tmp_path / "data"  # a precompute output: train's data.path, and precompute's --out and --prompts
    (tmp_path / "p.txt").write_text("a red ball\n")
    pre.precompute(str(tmp_path / "p.txt"), str(data), max_length=8, device="cpu", log=lambda msg: None)
    cases = {
        "generate": ["generate", "--prompt", "a red ball", "--model", "tiny", "--mode", "attn_qat",
                     "--qat-checkpoint", str(ckpt), "--out", str(ckpt / "v.mp4"), "--device", "cpu"],
        "quality": ["quality", "--model", "tiny", "--variant", f"qat=attn_qat:{ckpt}", "--out", str(ckpt / "q"),
                    "--device", "cpu"],
        "train": ["train", *TINY, "--set", f"data.path={data}", "--output-dir", str(data / "run")],
        "precompute": ["precompute", "--prompts", str(data / "index.json"), "--model", "tiny", "--out", str(data),
                       "--device", "cpu"],
    }
    monkeypatch.setattr(pre, "load_encoders", lambda *a, **k: pytest.fail("encoders loaded"))
    before = _snapshot(tmp_path)
    for command, argv in cases.items():
        capsys.readouterr()
        assert cli_main(argv) == 2, command
        line = _one_line(capsys.readouterr().err)
        assert line.startswith(f"attnqat {command}: error:") and "inside" in line, line
    assert _snapshot(tmp_path) == before


def test_an_output_in_a_folder_that_does_not_exist_is_refused_by_every_command(tmp_path, monkeypatch, capsys):
    """A mistyped output path is refused in one line before anything loads, instead of creating a tree of folders:
    generate's --out and --frames-dir, quality's, precompute's and export-qat's --out, the demo's --out-dir (each
    may itself be new: only the folder it is in must exist). train's output_dir is the exception: its parents are
    created, as its default runs/attnqat needs."""
    import attnqat.pipelines.loading as loading
    import attnqat.pipelines.qat_export as qat_export
    import attnqat.train.precompute as pre
    from attnqat import demo

    def boom(*a, **k):
        pytest.fail("a model loaded")

    monkeypatch.setattr(loading, "load_pipeline", boom)
    monkeypatch.setattr(loading, "load_transformer", boom)
    monkeypatch.setattr(qat_export, "load_transformer", boom)  # export-qat's own import of it
    monkeypatch.setattr(pre, "load_encoders", boom)
    monkeypatch.setattr(demo, "load_pipeline", boom)  # the demo's own import of it
    _finetune(tmp_path / "ft.safetensors")
    (tmp_path / "p.txt").write_text("a red ball\n")
    typo = tmp_path / "typo" / "deeper"
    generate = ["generate", "--prompt", "p", "--model", "tiny", "--height", "32", "--width", "32", "--frames", "5",
                "--steps", "1", "--device", "cpu"]
    cases = {
        "generate --out": ["attnqat generate", [*generate, "--out", str(typo / "v.mp4")]],
        "generate --frames-dir": ["attnqat generate", [*generate, "--out", str(tmp_path / "v.mp4"),
                                                       "--frames-dir", str(typo / "frames")]],
        "quality --out": ["attnqat quality", ["quality", "--model", "tiny", "--device", "cpu", "--out", str(typo / "q")]],
        "precompute --out": ["attnqat precompute", ["precompute", "--prompts", str(tmp_path / "p.txt"), "--model", "tiny",
                                                    "--device", "cpu", "--out", str(typo / "data")]],
        "export-qat --out": ["attnqat export-qat", ["export-qat", "--from", str(tmp_path / "ft.safetensors"), "--model",
                                                    "tiny", "--out", str(typo / "q.safetensors")]],
    }
    before = _snapshot(tmp_path)
    for name, (prog, argv) in cases.items():
        assert cli_main(argv) == 2, name
        line = _one_line(capsys.readouterr().err)
        assert line.startswith(f"{prog}: error:") and f"its folder {str(typo)!r} does not exist" in line, (name, line)
    assert cli_main(["demo", "--model", "tiny", "--device", "cpu", "--out-dir", str(typo / "demo")]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("attnqat demo: error:") and f"its folder {str(typo)!r} does not exist" in line, line
    assert _snapshot(tmp_path) == before  # nothing created


# -------------------------------------------------------------------------------------------------- YAML
def test_a_yaml_alias_bomb_is_refused_at_once(tmp_path):
    """9 levels of 10 aliases (1.1 KB; 10**9 leaves once expanded). Run in a child process with a memory cap (a
    GiB above what it holds when forked), so that a loader that expands it fails this test instead of the
    machine."""
    from attnqat.train.config import load_config
    from conftest import forked_process

    lines = ["level_0: &level_0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"level_{i}: &level_{i} [" + ", ".join([f"*level_{i - 1}"] * 10) + "]" for i in range(1, 10)]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(lines) + "\n")
    assert bomb.stat().st_size < 2048
    flow = "{" + ", ".join(lines) + "}"  # the same as one --set value

    def child():
        import resource

        held = int(Path("/proc/self/statm").read_text().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (held + (1 << 30), held + (1 << 30)))
        for args in ((bomb, []), (ROOT / "configs" / "tiny.yaml", ["train.lr=" + flow])):
            t = time.perf_counter()
            try:
                load_config(*args)
            except ValueError as e:
                print(f"{time.perf_counter() - t:.3f}", str(e).splitlines()[0][:300], flush=True)

    r = forked_process(child, timeout=120)
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and len(lines) == 2, (r.stdout, r.stderr[-2000:])
    for line in lines:
        seconds, message = line.split(" ", 1)
        assert float(seconds) < 0.5 and "aliases" in message, line


def test_mixed_precision_no_is_the_string_no(tmp_path):
    from attnqat.train.config import load_config, validate

    cfg = load_config(ROOT / "configs" / "tiny.yaml", ["train.mixed_precision=no"])
    assert cfg.train.mixed_precision == "no"
    validate(cfg)
    (tmp_path / "c.yaml").write_text((ROOT / "configs" / "tiny.yaml").read_text().replace('"no"', "no"))
    assert load_config(tmp_path / "c.yaml").train.mixed_precision == "no"
    assert load_config(ROOT / "configs" / "tiny.yaml", ["log.csv=false"]).log.csv is False
    with pytest.raises(ValueError, match="must be true or false, got 'yes'"):
        load_config(ROOT / "configs" / "tiny.yaml", ["log.csv=yes"])


# ----------------------------------------------------------------------------------------- Ctrl-C early
@pytest.mark.parametrize("command, delays", [("train", (0.3, 1.3)), ("precompute", (0.8, 2.0))])
def test_ctrl_c_while_importing_is_one_line_and_130(tmp_path, command, delays):
    """Ctrl-C at each of ``delays`` seconds after the start, while torch imports (1-5 s); an import cut part way
    broke numpy. The command finishes its imports before it stops (the interrupt waits for them), so each run costs
    a whole import (~5 s): the runs of the two delays start together, one process a core, each its own folder (the
    two commands share the import path, so they share the four moments between them)."""
    (tmp_path / "p.txt").write_text("a red ball\n")

    def argv(i):
        return {"train": ["train", *TINY, "--output-dir", str(tmp_path / f"run{i}")],
                "precompute": ["precompute", "--prompts", str(tmp_path / "p.txt"), "--model", "tiny", "--out",
                               str(tmp_path / f"data{i}"), "--device", "cpu"]}[command]

    # as a terminal starts a command: SIGINT at its default. A suite started in the background (`nohup ... &`)
    # ignores SIGINT, and a command inherits that (it then ran to the end, exit 0); a handler is not inherited
    ignored = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        runs = [subprocess.Popen([sys.executable, "-m", "attnqat.cli", *argv(i)], cwd=ROOT, env=ENV,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(len(delays))]
    finally:
        signal.signal(signal.SIGINT, ignored)
    try:
        start = time.perf_counter()
        for p, delay in zip(runs, delays):
            time.sleep(max(0.0, start + delay - time.perf_counter()))
            assert p.poll() is None, "the command ended before the signal"
            p.send_signal(signal.SIGINT)
        for p, delay in zip(runs, delays):
            _, err = p.communicate(timeout=120)
            assert p.returncode == 130, (delay, p.returncode, err[-3000:])
            assert _one_line(err) == f"attnqat {command}: interrupted", delay
    finally:
        for p in runs:
            if p.poll() is None:
                p.kill()
                p.communicate()
