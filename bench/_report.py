"""Write one benchmark's section of docs/benchmarks.md between markers, leaving the others alone."""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import platform

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "benchmarks.md"
HEADER = "# Benchmarks\n\nEvery table is written by a script in `bench/`; ratios are to cuDNN SDPA (or bf16) measured in the same run.\n"


def bhld_shape(text: str) -> tuple[int, int, int, int]:
    """An argparse ``type=`` for an attention shape written B,H,L,D (e.g. 1,40,8192,128): a malformed one is
    argparse's one usage line."""
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 4 or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not four positive integers B,H,L,D, e.g. 1,40,8192,128")
    return shape


def bench_ms(fn, warmup=25, rep=100) -> float:
    """Median time of ``fn`` in ms (``triton.testing.do_bench``: CUDA events, warm-up and rep in ms)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def timed_steps(step, *, warmup: int, steps: int, device, before_each=None) -> tuple[list[float], list[float]]:
    """``warmup`` untimed calls of ``step`` (which returns a loss), the CUDA peak-memory counter reset, then
    ``steps`` timed calls (wall time, CUDA-synchronised; ``before_each`` runs untimed before each, e.g. a
    barrier). Returns (seconds per call, losses)."""
    import time

    import torch

    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    times, losses = [], []
    for _ in range(steps):
        if before_each is not None:
            before_each()
        t0 = time.perf_counter()
        losses.append(step())
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return times, losses


def environment() -> dict:
    import torch
    import triton

    env = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "triton": triton.__version__,
           "python": platform.python_version()}
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    else:
        env["device"] = "CPU"
    return env


def env_line(env: dict) -> str:
    return (f"Device: {env['device']}; torch {env['torch']}, triton {env['triton']}"
            + (f", CUDA {env['cuda']}" if env.get("cuda") else "") + f"; {env['date']}.")


def update_section(name: str, markdown: str, doc: pathlib.Path = DOC) -> None:
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    text = doc.read_text() if doc.exists() else HEADER
    block = f"{begin}\n{markdown.rstrip()}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)


def write_json(path: pathlib.Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2))
