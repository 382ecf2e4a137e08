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


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["demo", "--help"]])
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
    elif argv[0] == "demo":
        assert "--qat-checkpoint" in r.stdout and "--share" in r.stdout
    else:
        assert "--prompt" in r.stdout and "--frames-dir" in r.stdout


def test_command_table_help_equals_the_modules_help():
    for name, (module_name, help_line, check) in COMMANDS.items():
        assert importlib.import_module(module_name).HELP == help_line, name
        if check is not None:
            module_name, func = check.split(":")
            assert callable(getattr(importlib.import_module(module_name), func))


def test_every_user_command_is_in_the_table_and_the_old_entry_points_run_it():
    """The demo page and the mini build are commands too; ``python app.py`` and ``python -m attnqat.train.mini``
    (which scripts call) still run them."""
    assert {"generate", "train", "precompute", "quality", "export-qat", "build-mini", "demo"} <= set(COMMANDS)
    r = subprocess.run([sys.executable, str(ROOT / "app.py"), "--help"], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert r.returncode == 0 and "usage: attnqat demo" in r.stdout and "--qat-checkpoint" in r.stdout, r.stderr
    r = subprocess.run([sys.executable, "-m", "attnqat.train.mini", "--help"], capture_output=True, text=True,
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert r.returncode == 0 and "--vae-minutes" in r.stdout and "attnqat build-mini" in r.stdout, r.stderr


def test_demo_without_gradio_is_one_line_and_status_2(tmp_path):
    """Valid arguments, gradio missing (made so, where it is installed): one line naming what to install."""
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = _run_in_fresh_python(f"""
        import sys
        sys.modules["gradio"] = None  # `import gradio` raises ImportError, as where it is not installed
        from attnqat.cli import main
        sys.exit(main(["demo", "--model", "tiny", "--device", "cpu", "--port", "{port}",
                       "--out-dir", {str(tmp_path)!r}]))
    """)
    assert r.returncode == 2, r.stderr
    assert r.stderr == "attnqat demo: error: the demo needs gradio: pip install -e '.[app]'\n"
    assert r.stdout == "" and list(tmp_path.iterdir()) == []


def test_build_mini_refusals_are_one_line_and_create_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    for argv, message in [(["--minutes", "0"], "--minutes must be in (0, 1440], got 0.0"),
                          (["--vae-decoder-dim", "64"], "--vae-decoder-dim needs --vae-train decoder"),
                          (["--vae-batch", "0"], "--vae-batch must be a number above 0, got 0.0"),
                          (["--vae-batch", "nan"], "--vae-batch must be a number above 0, got nan"),
                          (["--from", str(tmp_path)], "no attnqat_mini.json there")]:
        assert main(["build-mini", "--out", str(out), *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("attnqat build-mini: error: ") and message in err and err.count("\n") == 1, err
    with pytest.raises(SystemExit) as e:
        main(["build-mini", "--out", str(out), "--vae-sizes", "32x128x128"])
    assert e.value.code == 2 and "4k+1" in capsys.readouterr().err
    assert not out.exists()


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


def test_the_console_script_lets_openmp_threads_sleep_before_torch_loads():
    """OMP_WAIT_POLICY=PASSIVE is set before any command imports torch (OpenMP reads it once, at load), unless
    the user chose a policy: spinning waits made the CPU quick start 4-7x slower beside one busy process."""
    snippet = ("import os, sys\n"
               "from attnqat import cli, threads\n"
               "real = threads.prefer_passive_waits\n"
               "seen = []\n"
               "threads.prefer_passive_waits = lambda: (seen.append('torch' in sys.modules), real())\n"
               "code = cli.main(['generate', '--prompt', 'p', '--frames', '10'])\n"
               "print(code, seen, os.environ.get('OMP_WAIT_POLICY'))\n")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    for policy, want in [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")]:
        if policy:
            env["OMP_WAIT_POLICY"] = policy
        out = subprocess.run([sys.executable, "-c", snippet], env=env, capture_output=True, text=True, timeout=120)
        assert out.stdout.split() == ["2", "[False]", want], out.stdout + out.stderr


def test_the_console_script_sets_the_thread_default(monkeypatch, capsys):
    from attnqat import threads

    calls = []
    monkeypatch.setattr(threads, "limit_torch_threads", lambda: calls.append(1))
    assert main(["generate", "--prompt", "p", "--frames", "10"]) == 2
    assert calls == [1]
