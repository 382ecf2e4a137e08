"""``attnqat generate --parallel ulysses|ring`` on two gloo processes (CPU), against independent one-process runs.

The two processes are forked from this one with torch.multiprocessing; each sets the variables torchrun sets (RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) and calls the console script's ``main`` with the same arguments,
as ``torchrun --nproc-per-node 2 -m attnqat generate ...`` does (faster than torchrun: the two processes start
once for all cases, with this one's imports). Checked, for Ulysses with attn_qat and ring with nvfp4: every rank's final latents equal
those of a one-process run in this process (which never joins a process group), and rank 0's PNG frames its
frames; rank 0 alone writes and prints; a refusal of rank 0's output check stops both ranks with one line each.
The refusals that need no second process run in this one.
"""
from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
import traceback
from pathlib import Path

import imageio.v2 as imageio
import numpy as np
import pytest
import torch

from attnqat.cli import main
from attnqat.pipelines.generate import read_video
from conftest import free_port, run_forked

WORLD = 2
# 32 tokens (2 latent frames x 4 x 4 patches), split 16 + 16: each rank's keys whole NVFP4 blocks (16), which ring
# needs to equal one process (docs/multigpu.md). fp32 (the CPU default): the modes run their exact
# PyTorch references, so the parallel run can be held to fp32 rounding (in bf16 ring rounds each chunk's output).
TINIEST = ["--prompt", "p", "--model", "tiny", "--height", "64", "--width", "64", "--frames", "5", "--steps", "2",
           "--dtype", "fp32", "--device", "cpu"]
CASES = [("ulysses", "attn_qat"), ("ring", "nvfp4")]
LATENT_TOLERANCE = 1e-5  # relative to the largest latent: fp32 rounding of per-shard matmuls, and ring's merge
FRAME_TOLERANCE = 1  # uint8 steps: latents fp32-rounding apart can land on either side of a rounding boundary


@contextlib.contextmanager
def _recorded(record: dict):
    """Record what ``attnqat generate`` writes (its write_mp4 / write_pngs calls) and its final latents."""
    from attnqat.pipelines import generate

    originals = generate.write_mp4, generate.write_pngs, generate.generate_video
    write_mp4, write_pngs, generate_video = originals
    record.update(writes=[], latents=None)

    def run(*args, **kwargs):
        result = generate_video(*args, **kwargs)
        record["latents"] = result.latents.detach().cpu().clone()
        return result

    generate.write_mp4 = lambda frames, path, **kw: record["writes"].append(str(path)) or write_mp4(frames, path, **kw)
    generate.write_pngs = lambda frames, folder: record["writes"].append(str(folder)) or write_pngs(frames, folder)
    generate.generate_video = run
    try:
        yield record
    finally:
        generate.write_mp4, generate.write_pngs, generate.generate_video = originals


def _launched_main(rank: int, port: int, argv: list[str]) -> dict:
    """``main(argv)`` as rank ``rank`` of a torchrun launch: its exit status, what it printed, wrote, computed."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    out, err, record = io.StringIO(), io.StringIO(), {}
    with _recorded(record), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(["generate", *argv])
    return dict(record, status=status, stdout=out.getvalue(), stderr=err.getvalue())


def _worker(rank: int, runs: list, out_dir: str):
    torch.set_num_threads(1)
    results = {}
    try:
        for name, port, argv in runs:
            results[name] = _launched_main(rank, port, argv)
    except Exception:  # noqa: BLE001 - reported to the parent
        results["error"] = traceback.format_exc()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


def _frames(folder: Path) -> np.ndarray:
    return np.stack([imageio.imread(p) for p in sorted(folder.glob("frame_*.png"))]).astype(int)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The parallel runs (both ranks' results) and the one-process runs they are compared with."""
    root = tmp_path_factory.mktemp("parallel")
    plan = [(f"{layout}/{mode}", free_port(), [*TINIEST, "--parallel", layout, "--mode", mode,
                                                  "--out", str(root / layout / "v.mp4"),
                                                  "--frames-dir", str(root / layout / "png")])
            for layout, mode in CASES]
    for folder in {layout for layout, _ in CASES} | {"bf16", "attn_qat", "nvfp4"}:  # each run's output folder
        (root / folder).mkdir()
    (root / "a_folder.mp4").mkdir()  # --out names a folder: refused by rank 0's output check
    plan.append(("refused", free_port(), [*TINIEST, "--parallel", "ulysses", "--out", str(root / "a_folder.mp4")]))
    with tempfile.TemporaryDirectory() as tmp:
        run_forked(_worker, (plan, tmp), WORLD, "the parallel generate processes")
        ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(WORLD)]
    for r in ranks:
        assert "error" not in r, r.get("error")
    one_process = {}
    for mode in ("bf16", "attn_qat", "nvfp4"):
        with _recorded({}) as record:
            assert main(["generate", *TINIEST, "--mode", mode, "--out", str(root / mode / "v.mp4"),
                         "--frames-dir", str(root / mode / "png")]) == 0
        one_process[mode] = dict(frames=_frames(root / mode / "png"), latents=record["latents"])
    return root, ranks, one_process


@pytest.mark.parametrize("layout,mode", CASES)
def test_parallel_run_equals_one_process_run(runs, layout, mode):
    """Final latents of every rank equal the one-process latents (fp32, the reference path: Ulysses moves whole
    heads, ring merges chunks exactly up to fp32 rounding); rank 0's frames equal the one-process frames."""
    root, ranks, one_process = runs
    ref = one_process[mode]["latents"]
    for r in ranks:
        latents = r[f"{layout}/{mode}"]["latents"]
        assert latents.shape == ref.shape
        assert (latents - ref).abs().max() <= LATENT_TOLERANCE * ref.abs().max()
    # Every rank gathered the same tokens after proj_out, so every rank stepped the same latents.
    assert torch.equal(ranks[0][f"{layout}/{mode}"]["latents"], ranks[1][f"{layout}/{mode}"]["latents"])
    # The tolerance sees attention: the one-process run with bf16 attention lies far outside it.
    assert (one_process["bf16"]["latents"] - ref).abs().max() > 100 * LATENT_TOLERANCE * ref.abs().max()
    video = _frames(root / layout / "png")
    assert video.shape == one_process[mode]["frames"].shape == (5, 64, 64, 3)
    assert np.abs(video - one_process[mode]["frames"]).max() <= FRAME_TOLERANCE
    assert read_video(root / layout / "v.mp4").shape == (5, 64, 64, 3)


@pytest.mark.parametrize("layout,mode", CASES)
def test_only_rank_0_writes_and_prints(runs, layout, mode):
    root, ranks, _ = runs
    first, other = (r[f"{layout}/{mode}"] for r in ranks)
    assert first["status"] == other["status"] == 0, (first["stderr"], other["stderr"])
    assert first["writes"] == [str(root / layout / "v.mp4"), str(root / layout / "png")]
    assert other["writes"] == [] and other["stdout"] == ""
    assert "wrote" not in other["stderr"] and "RANDOM weights" not in other["stderr"]
    assert first["stdout"].strip() == str(root / layout / "v.mp4")
    assert f"parallel     {layout} over 2 processes" in first["stderr"]
    assert sorted(p.name for p in (root / layout).iterdir()) == ["png", "v.mp4"]  # no temporary file left
    assert len(list((root / layout / "png").iterdir())) == 5


def test_rank_0_output_refusal_stops_every_rank(runs):
    root, ranks, _ = runs
    for r in ranks:
        result = r["refused"]
        assert result["status"] == 2 and result["writes"] == []
        lines = result["stderr"].strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("attnqat generate: error: --out"), result["stderr"]
        assert "is a folder" in lines[0]


# --------------------------------------------------------------------------------------------------
# Refusals that need no second process (each before any process group or model)
# --------------------------------------------------------------------------------------------------

LAUNCH = dict(RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
REFUSALS = [
    ({}, ["--parallel", "ulysses"], "--parallel ulysses needs several processes and this is one (WORLD_SIZE is unset); "
                                    "launch it with torchrun --nproc-per-node N -m attnqat generate"),
    ({"WORLD_SIZE": "1"}, ["--parallel", "ring"], "WORLD_SIZE is 1"),
    ({**LAUNCH, "WORLD_SIZE": "2"}, [], "2 processes were launched (WORLD_SIZE=2) without --parallel"),
    ({**LAUNCH, "WORLD_SIZE": "3"}, ["--parallel", "ulysses", "--height", "48"],  # 24 tokens
     "--parallel ulysses over 3 processes: ulysses_degree 3 does not divide the 2 attention heads"),
    ({**LAUNCH, "WORLD_SIZE": "2"}, ["--parallel", "ring", "--mode", "sage3"],
     "--parallel ring over 2 processes: ring attention needs the log-sum-exp, which mode 'sage3' does not return"),
    ({**LAUNCH, "WORLD_SIZE": "2"}, ["--parallel", "ring", "--high-precision-steps", "first:1",
                                     "--high-precision-mode", "sagebwd"], "mode 'sagebwd' does not return"),
    ({**LAUNCH, "WORLD_SIZE": "3"}, ["--parallel", "ring"],
     "--parallel ring over 3 processes: the video's 32 tokens do not split into 3 equal shares"),
    ({**LAUNCH, "WORLD_SIZE": "2"}, ["--parallel", "ring", "--offload"], "--offload with --parallel is not supported"),
    ({**LAUNCH, "WORLD_SIZE": "2"}, ["--parallel", "ring", "--mode", "nvfp4", "--k-smoothing", "on"],
     "--parallel ring over 2 processes: ring attention (ring_degree=2) cannot run K-smoothing"),
    ({"WORLD_SIZE": "2", "RANK": "0"}, ["--parallel", "ring"], "WORLD_SIZE=2 but LOCAL_RANK, MASTER_ADDR, MASTER_PORT "
                                                             "not set"),
]


@pytest.mark.parametrize("env,extra,message", REFUSALS, ids=[" ".join(r[1]) + " " + str(r[0].get("WORLD_SIZE"))
                                                              for r in REFUSALS])
def test_refusals_are_one_line(tmp_path, capsys, monkeypatch, env, extra, message):
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["generate", *TINIEST, *extra, "--out", str(tmp_path / "v.mp4")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("attnqat generate: error: ") and message in err, err
    assert not torch.distributed.is_initialized()
    assert list(tmp_path.iterdir()) == []


def test_python_dash_m_attnqat_is_the_console_script(monkeypatch, capsys):
    """``torchrun ... -m attnqat generate`` starts the package as a module: ``python -m attnqat`` runs the CLI."""
    import runpy

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "argv", ["attnqat", "generate", *TINIEST, "--parallel", "ulysses"])
    with pytest.raises(SystemExit) as e:
        runpy.run_module("attnqat", run_name="__main__")
    assert e.value.code == 2
    assert capsys.readouterr().err.startswith("attnqat generate: error: --parallel ulysses needs several processes")


def test_notes_when_the_video_is_not_the_one_process_video():
    from argparse import Namespace

    from attnqat.pipelines.generate import parallel_note
    from attnqat.pipelines.launch import Launch
    from attnqat.pipelines.tiny import TINY_TRANSFORMER_CONFIG

    def note(parallel, mode, height, world=2):
        args = Namespace(launch=Launch(rank=0, local_rank=0, world_size=world), parallel=parallel, mode=mode,
                         height=height, width=64, frames=5)
        return parallel_note(args, TINY_TRANSFORMER_CONFIG)

    assert note("ring", "nvfp4", 64) is None  # 32 tokens: 16 a rank
    for mode in ("nvfp4", "attn_qat", "attn_qat_dropin"):  # 24 tokens: 12 a rank
        assert "each rank holds 12 of the video's tokens, not a multiple of 16" in note("ring", mode, 48)
    assert note("ring", "bf16", 48) is None and note("ulysses", "nvfp4", 48) is None
    # Wan 2.1 at 480p, 81 frames: 32760 tokens, 16380 a rank on 2 GPUs
    assert "16380" in parallel_note(Namespace(launch=Launch(0, 0, 2), parallel="ring", mode="nvfp4", height=480,
                                              width=832, frames=81), {"patch_size": [1, 2, 2]})
    # --compile: the compiled blocks see a rank's share; with the ring note, both
    compiled = dict(launch=Launch(0, 0, 2), mode="attn_qat", height=64, width=64, frames=5, compile=True)
    for parallel in ("ulysses", "ring"):
        text = parallel_note(Namespace(parallel=parallel, **compiled), TINY_TRANSFORMER_CONFIG)
        assert text.startswith("--compile with --parallel") and "to the bit" in text and "\n" not in text
    both = parallel_note(Namespace(parallel="ring", **{**compiled, "height": 48}), TINY_TRANSFORMER_CONFIG)
    assert both.startswith("each rank holds 12") and "; --compile with --parallel" in both
    uncompiled = Namespace(parallel="ulysses", **{**compiled, "compile": False})
    assert parallel_note(uncompiled, TINY_TRANSFORMER_CONFIG) is None
    one_process = Namespace(launch=None, compile=True, parallel=None, mode="bf16")
    assert parallel_note(one_process, TINY_TRANSFORMER_CONFIG) is None
