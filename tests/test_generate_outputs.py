"""``attnqat generate`` never reports a video it did not write, and never loses one it had: output
paths are checked before anything loads; the mp4 and the PNG folder are written under temporary
names and moved into place only once complete (a full disk is simulated by a writer that raises
ENOSPC mid-write); NaN/inf latents stop the run before anything is written."""
import errno
import os

import imageio.v2 as imageio
import numpy as np
import pytest

from attnqat.cli import main
from attnqat.pipelines.generate import read_video, write_mp4, write_pngs

TINIEST = ["--model", "tiny", "--height", "32", "--width", "32", "--frames", "5", "--steps", "2", "--device", "cpu"]


def _snapshot(root):
    """Every path under ``root`` with its bytes (folders as None)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = None
        for f in filenames:
            p = os.path.join(dirpath, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = fh.read()
    return out


def _one_line(err):
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def old_video(tmp_path):
    """An existing good video that a failed run must leave byte for byte."""
    path = tmp_path / "keep.mp4"
    write_mp4(np.full((3, 32, 32, 3), 200, np.uint8), path)
    return path


@pytest.fixture
def no_loading(monkeypatch):
    """Fail the test if a model starts loading (output checks must come first)."""
    import attnqat.pipelines.loading as loading

    def boom(*a, **kw):
        raise AssertionError("a model was loaded before the output path was checked")

    monkeypatch.setattr(loading, "load_pipeline", boom)


@pytest.mark.parametrize("case", ["folder", "parent-is-file", "parent-missing", "suffix", "read-only",
                                  "frames-dir-not-empty", "frames-dir-is-file", "frames-dir-parent-missing"])
def test_bad_output_paths_refused_before_loading(tmp_path, capsys, no_loading, case):
    (tmp_path / "a-file").write_text("mine")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    out, extra, message = str(tmp_path / "v.mp4"), [], None
    if case == "folder":
        out, message = str(tmp_path / "full"), "is a folder"
    elif case == "parent-is-file":
        out, message = str(tmp_path / "a-file" / "v.mp4"), "is a file, not a folder"
    elif case == "parent-missing":  # a typo is not made into new folders
        out, message = str(tmp_path / "typo" / "v.mp4"), f"its folder {str(tmp_path / 'typo')!r} does not exist"
    elif case == "suffix":
        out, message = str(tmp_path / "v.txt"), "must end in .mp4"
    elif case == "read-only":  # /sys refuses new files even to root, unlike a chmod'ed folder
        out, message = "/sys/attnqat-test.mp4", "cannot write in '/sys'"
    elif case == "frames-dir-not-empty":
        extra, message = ["--frames-dir", str(tmp_path / "full")], "already exists and is not empty"
    elif case == "frames-dir-is-file":
        extra, message = ["--frames-dir", str(tmp_path / "a-file")], "is a file, not a folder"
    elif case == "frames-dir-parent-missing":
        extra, message = ["--frames-dir", str(tmp_path / "typo" / "f")], "does not exist; create it first"
    before = _snapshot(tmp_path)
    assert main(["generate", "--prompt", "p", *TINIEST, "--out", out, *extra]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("attnqat generate: error: ") and message in line, line
    assert _snapshot(tmp_path) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_folder_refused_before_loading(tmp_path, capsys, no_loading):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        assert main(["generate", "--prompt", "p", *TINIEST, "--out", str(ro / "v.mp4")]) == 2
        assert "cannot write in" in _one_line(capsys.readouterr().err)
    finally:
        ro.chmod(0o755)


def _failing_writer(monkeypatch, after: int, exc=None):
    """imageio's writer, but ``append_data`` raises ``exc`` (a full disk by default) after ``after``
    frames; with ``exc=False`` it silently drops the frames after ``after`` instead."""
    real = imageio.get_writer

    class Writer:
        def __init__(self, *a, **kw):
            self.w, self.n = real(*a, **kw), 0

        def append_data(self, frame):
            self.n += 1
            if self.n > after:
                if exc is False:
                    return
                raise exc or OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.w.append_data(frame)

        def close(self):
            self.w.close()

        def __enter__(self):
            return self

        def __exit__(self, *exc_info):
            self.close()

    monkeypatch.setattr(imageio, "get_writer", Writer)


def test_disk_full_mid_write_keeps_the_old_video(tmp_path, capsys, monkeypatch, old_video):
    before = _snapshot(tmp_path)
    _failing_writer(monkeypatch, after=2)
    assert main(["generate", "--prompt", "p", *TINIEST, "--out", str(old_video)]) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    line = captured.err.strip().splitlines()[-1]  # after the tiny model's note and the progress bar
    assert line.startswith("attnqat generate: failed: ") and "No space left on device" in line, line
    assert "existing file was left unchanged" in line
    assert "wrote" not in captured.err and captured.out == ""
    assert _snapshot(tmp_path) == before  # the old video byte for byte, no temporary file left


def test_video_that_does_not_read_back_is_not_reported_as_written(tmp_path, capsys, monkeypatch):
    _failing_writer(monkeypatch, after=2, exc=False)  # the writer "succeeds" with 2 of 5 frames
    out = tmp_path / "v.mp4"
    assert main(["generate", "--prompt", "p", *TINIEST, "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "reads back as 2 frames" in err and "nothing was written" in err and "wrote" not in err
    assert list(tmp_path.iterdir()) == []  # no video, no temporary file


def test_frames_dir_failure_leaves_no_partial_folder(tmp_path, capsys, monkeypatch):
    real = imageio.imwrite
    calls = []

    def imwrite(path, frame, *a, **kw):
        calls.append(path)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, frame, *a, **kw)

    monkeypatch.setattr(imageio, "imwrite", imwrite)
    out, frames_dir = tmp_path / "v.mp4", tmp_path / "frames"
    assert main(["generate", "--prompt", "p", *TINIEST, "--out", str(out), "--frames-dir", str(frames_dir)]) == 1
    err = capsys.readouterr().err
    assert "No space left on device" in err and f"the video '{out}' was written" in err
    assert read_video(out).shape == (5, 32, 32, 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v.mp4"]  # no frames folder, no temporary one


def test_non_finite_latents_stop_the_run_and_write_nothing(tmp_path, capsys, monkeypatch, old_video):
    import attnqat.pipelines.processor as processor

    real_patch = processor.patch_attention
    calls = []

    def patch_then_poison(transformer, *a, **kw):
        names = real_patch(transformer, *a, **kw)

        def nan_out(module, args, output):
            calls.append(1)
            return output * float("nan")

        transformer.proj_out.register_forward_hook(nan_out)
        return names

    monkeypatch.setattr(processor, "patch_attention", patch_then_poison)
    before = _snapshot(tmp_path)
    assert main(["generate", "--prompt", "p", *TINIEST, "--out", str(old_video),
                 "--frames-dir", str(tmp_path / "frames")]) == 1
    err = capsys.readouterr().err
    assert "denoising step 1 of 2 produced NaN or infinite latents" in err and "nothing was written" in err
    assert len(calls) == 2  # cond + uncond of step 1, then it stopped
    assert _snapshot(tmp_path) == before


def test_write_functions_replace_only_when_complete(tmp_path):
    frames = np.random.default_rng(0).integers(0, 256, (5, 32, 48, 3), dtype=np.uint8)
    out = tmp_path / "v.mp4"
    out.write_bytes(b"old")
    assert write_mp4(frames, out) == out and read_video(out).shape == frames.shape
    pngs = write_pngs(frames, tmp_path / "empty-is-fine")
    assert [imageio.imread(p).tolist() for p in pngs] == [f.tolist() for f in frames]  # lossless
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "mine.txt").write_text("mine")
    with pytest.raises(OSError, match="could not write folder"):
        write_pngs(frames, tmp_path / "taken")
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["mine.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty-is-fine", "taken", "v.mp4"]
