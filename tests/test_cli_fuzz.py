"""Hostile values for every flag of ``attnqat generate``, ``attnqat precompute``, ``attnqat export-qat`` and
``app.py``: each must end in exit status 2 with exactly one line on stderr (no traceback, nothing on stdout),
before any model loads, leaving no file behind and everything that existed as it was.

The commands run in-process (``attnqat.cli.main``) for speed; loading a model is
patched to fail the test, so a value that slips through validation shows as a failure, not as a
slow generation. Read-only places are real ones (/sys refuses new files even to root)."""
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnqat.cli import main as cli_main

ROOT = Path(__file__).resolve().parent.parent
HUGE = str(10 ** 12)
JUNK = "💥\u202e\ufffd"  # an emoji, a right-to-left override, the replacement character
SURROGATE = "\ud800"  # cannot be encoded: what undecodable command-line bytes can turn into
LONG_NAME = "x" * 300  # longer than a file name may be


@pytest.fixture
def world(tmp_path):
    """A folder of things that must survive every hostile run."""
    (tmp_path / "a-file").write_text("mine")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    (tmp_path / "empty").mkdir()
    (tmp_path / "keep.mp4").write_bytes(b"an old video")
    (tmp_path / "prompts.txt").write_text("a fox\n")
    (tmp_path / "blank.txt").write_text("\n# only a comment\n")
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    (tmp_path / "binary.txt").write_bytes(b"\xff\xfe\x00garbage")
    return tmp_path


def _snapshot(root):
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            out[os.path.relpath(p, root)] = (stat.S_IFMT(st.st_mode), st.st_mode & 0o7777,
                                             open(p, "rb").read() if stat.S_ISREG(st.st_mode) else None)
    return out


def _refused(capsys, run, argv, world):
    """Run ``run(argv)``; assert the refusal contract; return the error line."""
    before = _snapshot(world)
    try:
        rc = run(argv)
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    assert rc == 2, (argv, rc, err[-2000:])
    assert out == "", (argv, out)
    assert err.endswith("\n") and len(err.splitlines()) == 1, (argv, err)
    assert "Traceback" not in err and ": error: " in err, (argv, err)
    assert _snapshot(world) == before, argv
    return err


def _cases(spec):
    """{flag: [values]} -> [(flag, value)]."""
    return [(flag, v) for flag, values in spec.items() for v in values]


# ------------------------------------------------------------------------------------ attnqat generate
GENERATE = {
    "--prompt": ["", "   ", "\n", SURROGATE, "a\x00b"],
    "--negative-prompt": [SURROGATE, "\x00"],
    "--height": ["", "nan", "inf", "-1", "0", "1.5", "100", HUGE, "4112", JUNK],
    "--width": ["", "nan", "-16", "0", "8", HUGE, JUNK],
    "--frames": ["", "nan", "-1", "0", "10", HUGE, "1029", JUNK],
    "--steps": ["", "nan", "-1", "0", HUGE, "1001", JUNK],
    "--guidance": ["", "nan", "inf", "-inf", "-1", "1e400", JUNK],
    "--flow-shift": ["", "nan", "inf", "0", "-3", JUNK],
    "--seed": ["", "nan", "-1", str(2 ** 63), "1.5", JUNK],
    "--fps": ["", "nan", "0", "-1", "241", HUGE, "1.5", JUNK],
    "--mode": ["", "nope", JUNK, SURROGATE, "a\nb"],
    "--layers": ["", "-1", HUGE, "2", "0,,1", "x", JUNK],
    "--high-precision-steps": ["", " ", "first:", "first:-1", "first:2", "last:" + HUGE, "1.5", "1", "-2", HUGE,
                               "x", "0,,1", "١", JUNK, SURROGATE, "a\nb"],
    "--high-precision-blocks": ["", "2", "-3", HUGE, "x", "0,,1", JUNK, SURROGATE],
    "--high-precision-mode": ["", "nvfp4", "bf16", JUNK, SURROGATE],
    "--model": ["", " ", "{w}/a-file", "{w}/empty", "{w}/missing/m", JUNK, SURROGATE, LONG_NAME, "a\nb"],
    "--qat-checkpoint": ["", "{w}/missing.safetensors", "{w}/empty", "{w}/a-file", SURROGATE, LONG_NAME],
    "--out": ["", "{w}", "{w}/full", "{w}/a-file/v.mp4", "{w}/v.txt", "{w}/keep", "/sys/attnqat.mp4",
              "/proc/attnqat.mp4", SURROGATE + ".mp4", "a\x00.mp4", LONG_NAME + ".mp4", "{w}/a-file"],
    "--frames-dir": ["", "{w}/full", "{w}/a-file", "{w}/a-file/sub", "/sys/attnqat-frames", SURROGATE,
                     LONG_NAME, "{w}/new.mp4"],
    "--device": ["", "nope", "cuda:99", "mps", "cpu:1", JUNK] + ([] if torch.cuda.is_available() else ["cuda"]),
    "--dtype": ["", "fp8", JUNK],
}
GENERATE_OTHER = [["--offload"], ["--nope"], ["--height"], ["extra-positional"]]


@pytest.fixture
def no_model_loads(monkeypatch):
    import attnqat.demo
    import attnqat.pipelines.loading as loading
    import attnqat.train.precompute as precompute

    def boom(*a, **kw):
        raise AssertionError("a model started loading: a hostile value passed validation")

    monkeypatch.setattr(loading, "load_pipeline", boom)
    monkeypatch.setattr(precompute, "load_encoders", boom)
    monkeypatch.setattr(attnqat.demo.DemoEngine, "load", boom)


def test_generate_refuses_hostile_values(world, capsys, no_model_loads):
    base = ["generate", "--prompt", "p", "--model", "tiny", "--height", "32", "--width", "32", "--frames", "5", "--steps", "1",
            "--device", "cpu", "--out", str(world / "new.mp4")]
    cases = [[flag, v.format(w=world)] for flag, v in _cases(GENERATE)] + GENERATE_OTHER
    for extra in cases:
        err = _refused(capsys, cli_main, base + extra, world)
        assert err.startswith("attnqat generate: error: "), (extra, err)
    assert len(cases) >= 120


# ---------------------------------------------------------------------------------- attnqat precompute
PRECOMPUTE = {
    "--prompts": ["", "{w}/missing.txt", "{w}", "/sys", "{w}/blank.txt", "{w}/bad.jsonl", "{w}/binary.txt",
                  SURROGATE, LONG_NAME],
    "--out": ["", "{w}/a-file", "{w}/full", "{w}/a-file/sub", "/sys/attnqat-data", SURROGATE, LONG_NAME],
    "--model": ["", "{w}/empty", "{w}/a-file", JUNK, SURROGATE],
    "--max-length": ["", "nan", "0", "-1", HUGE, "4097", JUNK],
    "--shard-size": ["", "nan", "0", "-1", JUNK],
    "--batch-size": ["", "nan", "0", "-1", JUNK],
    "--height": ["", "nan", "-1", HUGE],
    "--width": ["0", HUGE],
    "--frames": ["0", "-5", HUGE],
    "--device": ["", "nope", "cuda:99", JUNK],
}
PRECOMPUTE_OTHER = [["--videos", "--height", "100"], ["--videos", "--frames", "10"], ["--videos"], ["--nope"]]


def test_precompute_refuses_hostile_values(world, capsys, no_model_loads):
    base = ["precompute", "--prompts", str(world / "prompts.txt"), "--out", str(world / "data-new"),
            "--device", "cpu", "--max-length", "8"]
    cases = [[flag, v.format(w=world)] for flag, v in _cases(PRECOMPUTE)] + PRECOMPUTE_OTHER
    for extra in cases:
        err = _refused(capsys, cli_main, base + extra, world)
        assert err.startswith("attnqat precompute: error: "), (extra, err)
    assert len(cases) >= 55


# ----------------------------------------------------------------------------------- attnqat export-qat
EXPORT = {
    "--from": ["", "{w}/missing.safetensors", "{w}/empty", "{w}/a-file", SURROGATE, LONG_NAME],
    "--model": ["", " ", "{w}/a-file", "{w}/empty", "{w}/missing/m", JUNK, SURROGATE],
    "--out": ["", "{w}", "{w}/full", "{w}/a-file/q.safetensors", "{w}/q.txt", "/sys/q.safetensors",
              SURROGATE + ".safetensors", LONG_NAME + ".safetensors"],
    "--trained": ["", " ", SURROGATE, "a\x00b", "x" * 201],
}


def test_export_qat_refuses_hostile_values(world, capsys, monkeypatch):
    import attnqat.pipelines.loading as loading
    import attnqat.pipelines.qat_export as qat_export
    from safetensors.torch import save_file

    from attnqat.pipelines import build_tiny_transformer

    def boom(*a, **kw):
        raise AssertionError("a model started loading: a hostile value passed validation")

    monkeypatch.setattr(loading, "load_transformer", boom)
    monkeypatch.setattr(qat_export, "load_transformer", boom)  # export-qat's own import of it
    save_file(build_tiny_transformer().state_dict(), str(world / "ft.safetensors"))
    base = ["export-qat", "--from", str(world / "ft.safetensors"), "--model", "tiny", "--out",
            str(world / "new.safetensors")]
    cases = [[flag, v.format(w=world)] for flag, v in _cases(EXPORT)] + [["--nope"], ["--out"]]
    for extra in cases:
        err = _refused(capsys, cli_main, base + extra, world)
        assert err.startswith("attnqat export-qat: error: "), (extra, err)
    assert len(cases) >= 28


# --------------------------------------------------------------------------------------------- app.py
def _demo_main(argv: list[str]) -> int:  # what ``python app.py ARGV`` runs
    return cli_main(["demo", *argv])


@pytest.fixture
def busy_port():
    """A port something already listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


APP = {
    "--port": ["", "nan", "-1", "0", "65536", HUGE, JUNK, "{busy}"],
    "--host": ["", " ", JUNK, SURROGATE, "not a host", "-bad-", "256.1.1.1", "a\nb"],
    "--out-dir": ["", "{w}/a-file", "{w}/a-file/sub", "/sys/attnqat-demo", SURROGATE, LONG_NAME],
    "--model": ["", "{w}/empty", "{w}/a-file", JUNK, SURROGATE],
    "--qat-checkpoint": ["", "{w}/missing.safetensors", "{w}/empty", "{w}/a-file"],
    "--modes": ["", "nope", "bf16,,sage3", JUNK, SURROGATE],
    "--device": ["", "nope", "cuda:99", JUNK],
    "--dtype": ["", "fp8"],
}


def test_app_refuses_hostile_values(world, capsys, no_model_loads, busy_port):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    base = ["--port", str(free), "--device", "cpu", "--out-dir", str(world / "app-out")]
    cases = [[flag, v.format(w=world, busy=busy_port)] for flag, v in _cases(APP)] + [["--nope"], ["--port"]]
    for extra in cases:
        err = _refused(capsys, _demo_main, base + extra, world)
        assert err.startswith("attnqat demo: error: "), (extra, err)
    assert len(cases) >= 40


def test_port_in_use_is_one_line_in_a_real_process(busy_port, tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "app.py"), "--port", str(busy_port), "--out-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2, r.stderr
    assert r.stderr == (f"attnqat demo: error: --port {busy_port} is in use on 127.0.0.1; stop what listens there or pick "
                        f"another port (e.g. --port {busy_port + 1})\n")
    assert r.stdout == "" and list(tmp_path.iterdir()) == []
