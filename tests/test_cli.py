"""The ``attnqat`` console script itself: fast help that imports no torch, one-line usage errors,
the command table kept equal to the modules' own HELP, and the CPU thread default."""
import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from attnqat.cli import COMMANDS, main

ROOT = Path(__file__).resolve().parent.parent


def _run_in_fresh_python(code: str, env=None):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, timeout=120)


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"]])
def test_help_imports_neither_torch_nor_diffusers(argv):
    r = _run_in_fresh_python(f"""
        import sys
        from attnqat.cli import main
        try:
            main({argv!r})
        except SystemExit as e:
            assert e.code == 0, e.code
        heavy = sorted(m for m in ("torch", "diffusers", "triton", "transformers", "gradio") if m in sys.modules)
        print("HEAVY", heavy, file=sys.stderr)
    """)
    assert r.returncode == 0, r.stderr
    assert "HEAVY []" in r.stderr, r.stderr
    assert "usage: attnqat" in r.stdout
    if argv == ["--help"]:
        for name in COMMANDS:
            assert name in r.stdout
    else:
        assert "--prompt" in r.stdout and "--frames-dir" in r.stdout


def test_command_table_help_equals_the_modules_help():
    for name, (module_name, help_line, check) in COMMANDS.items():
        assert importlib.import_module(module_name).HELP == help_line, name
        if check is not None:
            module_name, func = check.split(":")
            assert callable(getattr(importlib.import_module(module_name), func))


def test_usage_errors_are_one_line(capsys):
    for argv in ([], ["generate", "--frames", "x", "--prompt", "p"], ["nope"], ["generate", "--prompt", "p", "--dtype",
                                                                                "fp8"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1, err
        assert "error:" in err and "--help" in err and "usage:" not in err


def test_package_names_load_lazily():
    r = _run_in_fresh_python("""
        import sys
        import attnqat, attnqat.pipelines, attnqat.pipelines.generate
        assert "torch" not in sys.modules
        from attnqat.pipelines import load_pipeline, TINY_NOTICE
        assert callable(load_pipeline) and "RANDOM" in TINY_NOTICE
        assert "available_modes" in dir(attnqat) or callable(attnqat.available_modes)
        assert "bf16" in attnqat.available_modes()
        print("OK")
    """)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr


# ------------------------------------------------------------------------------------ CPU threads
def test_thread_default_caps_torch_to_usable_cpus_unless_the_user_chose(monkeypatch):
    import torch

    from attnqat import threads

    before = torch.get_num_threads()
    try:
        for k in threads.USER_SETTINGS:
            monkeypatch.delenv(k, raising=False)
        monkeypatch.setattr(threads, "usable_cpus", lambda: 1)
        torch.set_num_threads(3)
        assert threads.limit_torch_threads() == 1 and torch.get_num_threads() == 1
        assert threads.limit_torch_threads() is None  # already within the CPUs: unchanged
        torch.set_num_threads(3)
        monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's setting wins
        assert threads.limit_torch_threads() is None and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_usable_cpus_follow_affinity_and_cgroup_quota(tmp_path, monkeypatch):
    from attnqat import threads

    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert threads._cgroup_cpu_quota(str(tmp_path)) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert threads._cgroup_cpu_quota(str(tmp_path)) is None
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    monkeypatch.setattr(threads, "_cgroup_cpu_quota", lambda: 1.5)
    assert threads.usable_cpus() == 2  # 64 CPUs visible, a quota of 1.5 CPUs
    monkeypatch.setattr(threads, "_cgroup_cpu_quota", lambda: None)
    assert threads.usable_cpus() == 64


def test_the_console_script_sets_the_thread_default(monkeypatch, capsys):
    from attnqat import threads

    calls = []
    monkeypatch.setattr(threads, "limit_torch_threads", lambda: calls.append(1))
    assert main(["generate", "--prompt", "p", "--frames", "10"]) == 2
    assert calls == [1]
