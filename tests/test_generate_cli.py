"""``attnqat generate``: end to end on the tiny model (mp4 read back), and bad input → one-line error,
exit status 2, no traceback."""
import os
import subprocess
import sys

import imageio.v2 as imageio
import numpy as np
import pytest
import torch

from attnqat.cli import main
from attnqat.kernels import available_modes

SMALL = ["--model", "tiny", "--height", "64", "--width", "96", "--frames", "5", "--steps", "2", "--device", "cpu"]


def _cli(*argv, env=None, cwd=None):
    """Run the real console entry point in a fresh process (as a user would)."""
    return subprocess.run([sys.executable, "-m", "attnqat.cli", *argv], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, cwd=cwd, timeout=300)


def _read_mp4(path):
    reader = imageio.get_reader(str(path))
    try:
        return np.stack([f for f in reader]), reader.get_meta_data()
    finally:
        reader.close()


def test_generate_tiny_writes_mp4_with_requested_frames_and_size(tmp_path):
    """In its own process, all it writes to stdout and stderr read back; forked from this one (a fresh interpreter
    would spend most of the test importing: the console entry point runs in a fresh one below)."""
    from conftest import forked_process

    out = tmp_path / "corgi.mp4"
    r = forked_process(lambda: main(["generate", "--prompt", "a corgi surfing a wave", *SMALL, "--out", str(out),
                                     "--frames-dir", str(tmp_path / "png")]))
    assert r.returncode == 0, r.stderr
    assert "RANDOM weights" in r.stderr
    for key in ("total time", "per step", "attention", "peak memory", "wrote"):
        assert key in r.stderr
    assert r.stdout.strip() == str(out)
    frames, meta = _read_mp4(out)
    assert frames.shape == (5, 64, 96, 3)
    assert meta["fps"] == 16
    pngs = sorted((tmp_path / "png").glob("frame_*.png"))
    assert len(pngs) == 5 and imageio.imread(pngs[0]).shape == (64, 96, 3)
    # the mp4 holds the PNG frames up to lossy compression
    assert np.abs(frames.astype(float) - np.stack([imageio.imread(p) for p in pngs]).astype(float)).mean() < 12


TINIEST = ["--model", "tiny", "--height", "32", "--width", "32", "--frames", "5", "--steps", "1", "--device", "cpu", "--dtype", "bf16"]


@pytest.fixture(scope="module")
def bf16_video(tmp_path_factory):
    out = tmp_path_factory.mktemp("bf16") / "bf16.mp4"
    assert main(["generate", "--prompt", "p", *TINIEST, "--out", str(out)]) == 0
    return _read_mp4(out)[0]


@pytest.mark.parametrize("mode", ["attn_qat", "nvfp4", "sage3", "sagebwd"])
def test_generate_tiny_in_quantized_mode(tmp_path, capsys, bf16_video, mode):
    if mode not in available_modes():
        pytest.skip(f"mode {mode!r} not registered yet")
    # --dtype bf16: under TRITON_INTERPRET (set by conftest without a GPU) the quantized modes run their
    # Triton kernels, which take bf16/fp16; a plain CPU run uses the fp32-capable references.
    out = tmp_path / f"{mode}.mp4"
    assert main(["generate", "--prompt", "p", *TINIEST, "--mode", mode, "--out", str(out)]) == 0
    assert f"{mode} on self-attention (attn1) of all 2 blocks" in capsys.readouterr().err
    video = _read_mp4(out)[0]
    assert video.shape == bf16_video.shape == (5, 32, 32, 3)
    assert not np.array_equal(video, bf16_video)  # the mode really ran


def test_qk_rotation_changes_the_fp4_video_and_the_summary_says_so(tmp_path, capsys):
    outs = {r: tmp_path / f"{r}.mp4" for r in ("none", "hadamard")}
    for rotation, out in outs.items():
        assert main(["generate", "--prompt", "p", *TINIEST, "--mode", "nvfp4", "--qk-rotation", rotation,
                     "--out", str(out)]) == 0
        err = capsys.readouterr().err
        assert ("nvfp4 (Q, K rotated: hadamard) on self-attention" in err) == (rotation == "hadamard")
    plain, rotated = (_read_mp4(o)[0] for o in outs.values())
    assert plain.shape == rotated.shape and not np.array_equal(plain, rotated)


def test_same_seed_same_video_and_qat_checkpoint_is_used(tmp_path, capsys):
    from safetensors.torch import save_file

    from attnqat.pipelines import build_tiny_transformer

    outs = [tmp_path / f"{i}.mp4" for i in range(3)]
    for o in outs[:2]:
        assert main(["generate", "--prompt", "p", *SMALL, "--seed", "7", "--out", str(o)]) == 0
    state = {k: v * 1.5 if k == "proj_out.weight" else v for k, v in build_tiny_transformer().state_dict().items()}
    save_file(state, tmp_path / "qat.safetensors")
    assert main(["generate", "--prompt", "p", *SMALL, "--seed", "7", "--out", str(outs[2]),
                 "--qat-checkpoint", str(tmp_path / "qat.safetensors")]) == 0
    v0, v1, v2 = (_read_mp4(o)[0] for o in outs)
    assert np.array_equal(v0, v1)
    assert not np.array_equal(v0, v2)


def _save_other_architecture(path):
    from diffusers import WanTransformer3DModel
    from safetensors.torch import save_file

    from attnqat.pipelines import TINY_TRANSFORMER_CONFIG

    other = WanTransformer3DModel(**{**TINY_TRANSFORMER_CONFIG, "num_layers": 3, "attention_head_dim": 32})
    save_file(other.state_dict(), path)


BAD = [
    (["--height", "100"], "--height 100 is not a positive multiple of 16.*nearest valid: 96 or 112"),
    (["--width", "8"], "--width 8 is not a positive multiple of 16.*nearest valid: 16"),
    (["--frames", "10"], "--frames 10 is not of the form 4k\\+1.*nearest valid: 9"),
    (["--frames", "12"], "nearest valid: 13"),
    (["--frames", "0"], "nearest valid: 1"),
    (["--steps", "0"], "--steps 0 must be at least 1"),
    (["--mode", "fp3"], "unknown --mode 'fp3'; available: bf16"),
    (["--qk-rotation", "random", "--mode", "nvfp4"], "--qk-rotation 'random': choose one of auto, none, hadamard"),
    (["--qk-rotation", "hadamard"], "--qk-rotation hadamard needs an FP4 --mode \\(nvfp4, attn_qat, attn_qat_dropin\\), not bf16"),
    (["--k-smoothing", "yes", "--mode", "nvfp4"], "--k-smoothing 'yes': choose one of auto, on, off"),
    (["--k-smoothing", "on", "--mode", "sage3"], "--k-smoothing on needs an FP4 --mode \\(nvfp4, attn_qat, attn_qat_dropin\\), not sage3"),
    (["--q-smoothing", "maybe", "--mode", "nvfp4"], "--q-smoothing 'maybe': choose one of auto, on, off"),
    (["--q-smoothing", "on", "--mode", "sage3"], "--q-smoothing on needs an FP4 --mode \\(nvfp4, attn_qat, attn_qat_dropin\\), not sage3"),
    (["--layers", "0,x"], "--layers '0,x'"),
    (["--layers", "0,7"], "block indices \\[7\\] out of range"),
    (["--model", "{tmp}/missing-model"], "model folder .*missing-model' does not exist; download it once with "
                                         "`huggingface-cli download Wan-AI/Wan2.1-T2V-1.3B-Diffusers"),
    (["--model", "{tmp}"], "is not a diffusers-format Wan 2.1 folder: model_index.json is missing"),
    (["--qat-checkpoint", "{tmp}/nope.safetensors"], "--qat-checkpoint .* does not exist"),
    (["--qat-checkpoint", "{tmp}/other.safetensors"], "does not match this transformer \\(2 blocks\\): 27 unexpected keys "
                                                      "\\(blocks.2.*; 66 shape mismatches \\(blocks.0.attn1"),
    (["--qat-checkpoint", "{tmp}/garbage.safetensors"], "not a readable safetensors file"),
    (["--device", "cuda:0" if not torch.cuda.is_available() else "nope"], "--device"),
    (["--offload", "--device", "cpu"], "--offload needs a CUDA device"),
]


@pytest.mark.parametrize("extra,message", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_input_gives_one_line_error(tmp_path, capsys, extra, message):
    import re

    _save_other_architecture(tmp_path / "other.safetensors")
    (tmp_path / "garbage.safetensors").write_bytes(b"not a safetensors file at all")
    argv = ["generate", "--prompt", "p", *SMALL[:-2], *[a.format(tmp=tmp_path) for a in extra],
            "--out", str(tmp_path / "v.mp4")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("attnqat generate: error: ")
    assert re.search(message, last), last
    assert "Traceback" not in err
    assert not (tmp_path / "v.mp4").exists()


def test_bad_input_exit_status_in_a_real_process(tmp_path):
    r = _cli("generate", "--prompt", "p", "--frames", "10", "--out", str(tmp_path / "v.mp4"))
    assert r.returncode == 2
    assert r.stderr.strip() == ("attnqat generate: error: --frames 10 is not of the form 4k+1 (Wan's VAE keeps the "
                                "first frame and compresses the rest by 4); nearest valid: 9")


def test_usage_errors_and_help(capsys):
    with pytest.raises(SystemExit) as e:  # argparse's own usage error: status 2, no traceback
        main(["generate", "--frames", "9"])
    assert e.value.code == 2 and "--prompt" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["generate", "--help"])
    assert e.value.code == 0
    help_text = capsys.readouterr().out
    for flag in ("--prompt", "--negative-prompt", "--model", "--mode", "--qat-checkpoint", "--height", "--width",
                 "--frames", "--steps", "--guidance", "--flow-shift", "--seed", "--out", "--dtype", "--device",
                 "--offload", "--compile", "--frames-dir", "--layers", "--parallel"):
        assert flag in help_text


def test_hub_id_not_cached_and_offline_says_how_to_download(tmp_path):
    r = _cli("generate", "--prompt", "p", "--model", "Wan-AI/Wan2.1-T2V-14B-Diffusers", "--device", "cpu",
             env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert ("model 'Wan-AI/Wan2.1-T2V-14B-Diffusers' is not in the local Hugging Face cache and could not be "
            "downloaded") in r.stderr
    assert "huggingface-cli download Wan-AI/Wan2.1-T2V-14B-Diffusers --local-dir" in r.stderr


def test_missing_ffmpeg_plugin_is_one_clear_line_before_generating(tmp_path, capsys, monkeypatch):
    """Without imageio-ffmpeg imageio would pick another writer for '.mp4' and fail late with an
    unrelated error: the command refuses up front and says what to install."""
    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)  # import now raises ImportError
    out = tmp_path / "v.mp4"
    assert main(["generate", "--prompt", "p", *TINIEST, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "pip install imageio-ffmpeg" in err and "Traceback" not in err
    assert not out.exists()


def test_frames_dir_alone_writes_pngs_and_needs_no_ffmpeg(tmp_path, capsys, monkeypatch):
    """--frames-dir without --out: the PNGs are the output (no video, no default video.mp4 in the working folder),
    and imageio-ffmpeg is not needed (GPU machines often lack it); the frames are the video's frames (the same
    seed written as mp4 + PNGs)."""
    monkeypatch.chdir(tmp_path)
    both = tmp_path / "both"
    assert main(["generate", "--prompt", "p", *TINIEST, "--out", str(tmp_path / "v.mp4"), "--frames-dir",
                 str(both)]) == 0
    capsys.readouterr()
    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)  # import now raises ImportError
    alone = tmp_path / "alone"
    assert main(["generate", "--prompt", "p", *TINIEST, "--frames-dir", str(alone)]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == str(alone)
    assert f"5 PNGs in {alone}" in captured.err and "no video" in captured.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alone", "both", "v.mp4"]  # no video.mp4
    names = sorted(p.name for p in alone.iterdir())
    assert names == sorted(p.name for p in both.iterdir()) and len(names) == 5
    for name in names:
        assert np.array_equal(imageio.imread(alone / name), imageio.imread(both / name))
    # a video asked for still needs the plugin, refused before generating
    assert main(["generate", "--prompt", "p", *TINIEST, "--out", str(tmp_path / "w.mp4")]) == 2
    assert "pip install imageio-ffmpeg" in capsys.readouterr().err
