"""Untrusted model folders and weight files (attnqat/pipelines/model_folder.py): a config that sizes a model
beyond reason, of the wrong type, or unlike its weights; pickled weights; FIFOs and other special files. Each is
refused in one line, before any model is built or any weight read, and the command-line tools exit with
status 2 (attnqat/cli.py)."""
from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from attnqat.cli import main
from attnqat.pipelines.loading import check_model, load_pipeline, load_transformer
from attnqat.mini.model import MINI_QAT_WEIGHTS, mini_folder
from attnqat.pipelines.model_folder import ModelConfigError

ROOT = Path(__file__).resolve().parent.parent
TINIEST = ["--height", "32", "--width", "32", "--frames", "1", "--steps", "1", "--device", "cpu"]


@pytest.fixture
def folder(tmp_path):
    """A copy of the shipped mini folder (its QAT weights left out): an editable, loadable model folder."""
    return Path(shutil.copytree(mini_folder(), tmp_path / "model", ignore=shutil.ignore_patterns(MINI_QAT_WEIGHTS)))


def _edit(folder: Path, component: str, **values) -> None:
    path = folder / component / "config.json"
    config = json.loads(path.read_text())
    config.update(values)
    path.write_text(json.dumps(config))


@pytest.fixture
def no_model_built(monkeypatch):
    """Building any diffusers or transformers model fails the test: a refusal must come before."""
    import diffusers
    import transformers

    def built(*args, **kwargs):
        raise AssertionError("a model was built from a folder that should have been refused")

    for cls in (diffusers.WanTransformer3DModel, diffusers.AutoencoderKLWan, transformers.UMT5EncoderModel):
        monkeypatch.setattr(cls, "__init__", built)


def _refused_fast(call, message: str) -> str:
    start = time.perf_counter()
    with pytest.raises(ModelConfigError, match=message) as e:
        call()
    assert time.perf_counter() - start < 0.5  # read JSON and headers only (the 10^6-wide config took 117 s)
    assert "\n" not in str(e.value)
    return str(e.value)


HOSTILE = [  # component, config values, the message (each from the round that found them, then neighbours)
    ("transformer", dict(attention_head_dim=10 ** 6, num_layers=10000),
     r"num_layers 10,000 is above the limit of 400 \(Wan 2.1 14B has 40 blocks; the limit is 10x that\)"),
    ("transformer", dict(attention_head_dim=10 ** 6),
     r"attention_head_dim 1,000,000 is above the limit of 1,280 \(Wan 2.1's heads are 128 wide"),
    ("transformer", dict(attention_head_dim=1e6), r"attention_head_dim must be a whole number, got 1000000.0"),
    ("transformer", dict(num_layers=10000), "num_layers 10,000 is above the limit of 400"),
    ("transformer", dict(num_attention_heads=-4), "num_attention_heads -4 must be at least 1"),
    ("transformer", dict(num_layers="8"), "num_layers must be a whole number, got '8'"),
    ("transformer", dict(num_layers=0), "num_layers 0 must be at least 1"),
    ("transformer", dict(num_layers=True), "num_layers must be a whole number, got True"),
    ("transformer", dict(num_layers=None), "num_layers must be a whole number, got None"),
    ("transformer", dict(ffn_dim=2 ** 40), "ffn_dim 1,099,511,627,776 is above the limit of 138,240"),
    ("transformer", dict(num_attention_heads=400, attention_head_dim=1280),
     r"num_attention_heads x attention_head_dim 512,000 is above the limit of 51,200"),
    ("transformer", dict(patch_size=[1, 2]), r"patch_size must be a list of 3 whole numbers, got \[1, 2\]"),
    ("transformer", dict(in_channels=[16]), r"in_channels must be a whole number, got \[16\]"),
    ("transformer", dict(num_layers=9), r"num_layers is 9, but the weights beside it hold 8 blocks \(0 to 7\)"),
    ("transformer", dict(num_layers=7), r"num_layers is 7, but the weights beside it hold 8 blocks"),
    ("vae", dict(z_dim="16"), "z_dim must be a whole number, got '16'"),
    ("vae", dict(dim_mult=[1, 2, 10 ** 9]), "dim_mult entry 1,000,000,000 is above the limit of 16"),
    ("text_encoder", dict(vocab_size=10 ** 12), "vocab_size 1,000,000,000,000 is above the limit of 2,563,840"),
    ("text_encoder", dict(d_model=-1), "d_model -1 must be at least 1"),
    ("text_encoder", dict(num_layers=3), r"num_layers is 3, but the weights beside it hold 2 blocks"),
]


@pytest.mark.parametrize("component, values, message", HOSTILE, ids=[f"{c}-{v}"[:60] for c, v, _ in HOSTILE])
def test_hostile_configs_are_refused_before_any_model_is_built(folder, no_model_built, component, values, message):
    _edit(folder, component, **values)
    text = _refused_fast(lambda: check_model(str(folder)), message)
    assert f"{component}/config.json in {str(folder)!r}" in text
    _refused_fast(lambda: load_pipeline(str(folder)), message)  # the library path is checked at the same edge
    if component == "transformer":
        _refused_fast(lambda: load_transformer(str(folder)), message)


def test_the_shipped_folder_and_a_copy_pass(folder):
    check_model(str(folder))
    check_model("mini")


def test_cli_exits_2_with_one_line_and_writes_nothing(folder, tmp_path, capsys):
    """num_layers 0 gave a video made by no blocks and exit 0; a string gave a traceback."""
    for values in (dict(num_layers=0), dict(num_layers="8")):
        _edit(folder, "transformer", **values)
        out = tmp_path / "v.mp4"
        assert main(["generate", "--model", str(folder), "--prompt", "p", *TINIEST, "--out", str(out)]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and len(captured.err.splitlines()) == 1, captured.err
        assert captured.err.startswith("attnqat generate: error: transformer/config.json in ")
        assert not out.exists()


def test_train_refuses_the_folder_in_its_check_and_its_run(folder, tmp_path, capsys):
    _edit(folder, "transformer", num_layers="8")
    for extra in (["--check"], ["--set", "train.max_steps=1"]):
        run = tmp_path / f"run{len(extra)}"
        assert main(["train", "--config", str(ROOT / "configs" / "tiny.yaml"), "--set", f"model={folder}",
                     "--output-dir", str(run), *extra]) == 2
        err = capsys.readouterr().err
        assert err.splitlines() == [f"attnqat train: error: transformer/config.json in {str(folder)!r}: num_layers "
                                    f"must be a whole number, got '8'"]
        assert not run.exists()


class _Payload:
    """A pickle that creates a file when unpickled."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("component, name", [("text_encoder", "pytorch_model.bin"),
                                             ("transformer", "diffusion_pytorch_model.bin"),
                                             ("vae", "diffusion_pytorch_model.bin")])
def test_pickled_weights_are_refused_in_one_line_and_never_unpickled(folder, tmp_path, capsys, component, name):
    """A pytorch_model.bin as the text encoder's weights gave a 51-line UnpicklingError traceback."""
    for f in (folder / component).glob("diffusion_pytorch_model*.safetensors*"):
        f.unlink()
    (folder / component / "model.safetensors").unlink(missing_ok=True)
    marker = tmp_path / "unpickled"
    (folder / component / name).write_bytes(pickle.dumps({"weight": _Payload(marker)}))
    message = f"{component}/{name} in {str(folder)!r} holds pickled weights: attnqat loads only .safetensors"
    _refused_fast(lambda: load_pipeline(str(folder)), message)
    assert main(["generate", "--model", str(folder), "--prompt", "p", *TINIEST, "--out", str(tmp_path / "v.mp4")]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and message in err
    assert not marker.exists()


def _run_cli(*args, timeout=120) -> subprocess.CompletedProcess:
    """``attnqat ...`` in its own process (forked from this one: a new interpreter would spend most of the test
    importing): a FIFO that is read blocks it, not the test."""
    from conftest import forked_process

    return forked_process(lambda: main(list(args)), timeout=timeout)


def test_a_fifo_as_qat_checkpoint_is_refused_at_once(tmp_path):
    """A FIFO given as --qat-checkpoint blocked for ever; so did one named like a weights file in a folder."""
    fifo = tmp_path / "qat.safetensors"
    os.mkfifo(fifo)
    r = _run_cli("generate", "--model", "tiny", "--prompt", "p", *TINIEST, "--qat-checkpoint", str(fifo),
                 "--out", str(tmp_path / "v.mp4"))
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert r.stderr.splitlines() == [f"attnqat generate: error: --qat-checkpoint: QAT checkpoint {str(fifo)!r} "
                                     f"is a FIFO; only regular files are read"]
    shards = tmp_path / "shards"
    shards.mkdir()
    os.mkfifo(shards / "model.safetensors")
    r = _run_cli("export-qat", "--from", str(shards), "--model", "tiny", "--out", str(tmp_path / "q.safetensors"))
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and "is a FIFO" in r.stderr, r.stderr


@pytest.mark.parametrize("where", ["transformer/diffusion_pytorch_model-00001-of-00002.safetensors",
                                   "text_encoder/model.safetensors", "vae/config.json", "model_index.json"])
def test_special_files_in_a_model_folder_are_refused(folder, where):
    path = folder / where
    path.unlink()
    os.mkfifo(path)
    # in this process: the check must not open the FIFO (opening one for reading blocks until a writer comes)
    _refused_fast(lambda: check_model(str(folder)), f"{str(path)!r} is a FIFO; only regular files are read")


def test_a_folder_where_a_weights_file_belongs_and_a_symlink_loop_are_refused(folder):
    weights = folder / "text_encoder" / "model.safetensors"
    weights.unlink()
    weights.mkdir()
    _refused_fast(lambda: check_model(str(folder)), "is a folder; only regular files are read")
    weights.rmdir()
    weights.symlink_to(weights)
    _refused_fast(lambda: check_model(str(folder)), "Too many levels of symbolic links")
