"""``mini`` as the default model of ``attnqat generate`` and ``app.py``: with its folder installed it is
the default and loads through ``WanPipeline.from_pretrained(folder)`` like real Wan weights (offline);
without it the default is ``tiny`` with a one-line note. The folder here is an untrained mini written by
``save_pipeline_folder`` (as the build ships it) with ``MINI_DIR`` pointed at it; the CPU quality smoke
at the end runs on the real shipped weights, and only where they are installed."""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import imageio.v2 as imageio
import numpy as np
import pytest
import torch

from attnqat.cli import main
from attnqat.mini import model as mini

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--height", "32", "--width", "32", "--frames", "5", "--steps", "2", "--device", "cpu"]


@pytest.fixture(scope="module")
def mini_build(tmp_path_factory):
    """An untrained mini, stored as the build stores it (bf16 transformer and text encoder, fp16 VAE,
    within the shipped size limits), with the build's record beside it."""
    from attnqat.mini.model import build_mini_pipeline, save_pipeline_folder

    folder = save_pipeline_folder(build_mini_pipeline(), tmp_path_factory.mktemp("pkg") / "mini")
    (folder / "attnqat_mini.json").write_text('{"model": "attnqat mini (test build)"}')
    return folder


@pytest.fixture
def installed(monkeypatch, mini_build):
    """This installation holds mini's weights (MINI_DIR points at the test build)."""
    monkeypatch.setattr(mini, "MINI_DIR", mini_build)
    return mini_build


@pytest.fixture
def not_installed(monkeypatch, tmp_path):
    """This installation holds no mini weights (an empty attnqat/models/mini, as before they ship)."""
    (tmp_path / "mini").mkdir()
    monkeypatch.setattr(mini, "MINI_DIR", tmp_path / "mini")
    return tmp_path / "mini"


def _generate_args(*argv):
    import argparse

    from attnqat.pipelines import generate

    p = argparse.ArgumentParser()
    generate.add_arguments(p)
    return generate.resolve_settings(p.parse_args(["--prompt", "a red ball", *argv]))


# ------------------------------------------------------------------------------------------ the switch
def test_the_default_is_mini_once_its_folder_is_installed(installed):
    from attnqat.pipelines.generate import DEFAULT_MODEL, default_model
    from attnqat.pipelines.loading import resolve_model

    assert DEFAULT_MODEL == "mini" and default_model() == "mini"
    assert resolve_model("mini") == str(installed)
    args = _generate_args("--device", "cpu")
    assert args.model == "mini" and args.model_note is None
    assert (args.frames, args.height, args.width, args.steps, args.guidance) == (33, 128, 128, 20, 5.0)
    assert args.flow_shift is None  # mini's own, from its scheduler config
    assert args.dtype == "fp32"


def test_without_the_folder_the_default_is_tiny_with_a_note(not_installed):
    from attnqat.pipelines.generate import default_model
    from attnqat.mini.model import MINI_MISSING_NOTE

    assert default_model() == "tiny"
    args = _generate_args("--device", "cpu")
    assert args.model == "tiny" and args.model_note == MINI_MISSING_NOTE
    assert (args.frames, args.height, args.width, args.steps) == (9, 64, 64, 8)
    explicit = _generate_args("--device", "cpu", "--model", "tiny")
    assert explicit.model == "tiny" and explicit.model_note is None  # asked for: no note


def test_without_the_folder_generate_runs_tiny_and_says_so_in_one_line(not_installed, tmp_path, capsys):
    out = tmp_path / "v.mp4"
    assert main(["generate", "--prompt", "p", *SMALL, "--out", str(out)]) == 0
    err = capsys.readouterr().err
    notes = [line for line in err.splitlines() if "the default model 'mini' is not in this installation" in line]
    assert len(notes) == 1 and "--model tiny" in notes[0] and "attnqat build-mini" in notes[0]
    assert "model        tiny  (RANDOM weights" in err
    # asked for explicitly: --model mini is a one-line error that says what to do
    assert main(["generate", "--prompt", "p", "--model", "mini", *SMALL, "--out", str(tmp_path / "w.mp4")]) == 2
    last = capsys.readouterr().err.strip().splitlines()
    assert len(last) == 1 and "use --model tiny" in last[0] and "attnqat build-mini" in last[0]


def test_model_defaults_per_device():
    from attnqat.pipelines.generate import model_defaults

    assert model_defaults("mini", "cpu") == dict(height=128, width=128, frames=33, steps=20, guidance=5.0,
                                                 flow_shift=None)
    assert model_defaults("mini", torch.device("cuda", 1)) == dict(height=256, width=256, frames=33, steps=25,
                                                                   guidance=5.0, flow_shift=None)
    assert model_defaults("tiny", "cuda")["height"] == 64
    assert model_defaults("./Wan2.1-T2V-1.3B-Diffusers", "cpu")["frames"] == 81


def test_a_mini_build_folder_given_as_a_path_gets_minis_defaults(mini_build):
    from attnqat.demo import model_kind
    from attnqat.pipelines.generate import model_defaults

    assert model_defaults(str(mini_build), "cpu")["height"] == 128
    assert model_kind(str(mini_build)) == "mini" and model_kind("mini") == "mini"
    assert model_kind("tiny") == "tiny" and model_kind("./Wan2.1-T2V-1.3B-Diffusers") == "real"


def test_app_default_model_and_note(installed, monkeypatch, tmp_path):
    app = _app()
    args = app.parse_args(["--port", "1"])
    assert args.model == "mini" and args.model_note is None
    monkeypatch.setattr(mini, "MINI_DIR", tmp_path / "absent")
    args = app.parse_args(["--port", "1"])
    assert args.model == "tiny" and "not in this installation" in args.model_note
    assert app.parse_args(["--model", "tiny"]).model_note is None


def _app():
    from attnqat import demo_app

    return demo_app


# ----------------------------------------------------------------------------- loading through the folder
def test_mini_loads_with_from_pretrained_in_the_right_dtypes(installed, monkeypatch):
    from diffusers import WanPipeline

    from attnqat.pipelines import load_pipeline

    calls = []
    original = WanPipeline.from_pretrained.__func__

    def spy(cls, target, *a, **kw):
        calls.append(target)
        return original(cls, target, *a, **kw)

    monkeypatch.setattr(WanPipeline, "from_pretrained", classmethod(spy))
    pipe = load_pipeline("mini", dtype=torch.bfloat16, device="cpu")
    assert calls == [str(installed)]
    assert pipe.transformer.dtype == torch.bfloat16
    assert pipe.vae.dtype == torch.float32  # stored fp16, runs fp32
    assert pipe.text_encoder.dtype == torch.float32  # stored bf16; small: fp32 as training encodes
    assert pipe.scheduler.config.flow_shift == mini.MINI_FLOW_SHIFT  # from the folder's scheduler config
    assert len(pipe.transformer.blocks) == mini.MINI_TRANSFORMER_CONFIG["num_layers"]


def test_generate_mini_end_to_end_offline_in_a_real_process(mini_build, tmp_path):
    """``attnqat generate`` with no --model in a fresh process, network off: mini is the default and
    loads with ``WanPipeline.from_pretrained(folder)``; the mp4 reads back with every frame."""
    out = tmp_path / "square.mp4"
    script = (
        "import sys; from pathlib import Path\n"
        "import attnqat.mini.model as m\n"
        f"m.MINI_DIR = Path({str(mini_build)!r})\n"
        "from diffusers import WanPipeline\n"
        "orig = WanPipeline.from_pretrained.__func__\n"
        "def spy(cls, target, *a, **kw):\n"
        "    print('FROM_PRETRAINED', target, file=sys.stderr)\n"
        "    return orig(cls, target, *a, **kw)\n"
        "WanPipeline.from_pretrained = classmethod(spy)\n"
        "from attnqat.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", script, "generate", "--prompt",
                        "a blue square moves up over a checkered background", *SMALL, "--out", str(out)],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"FROM_PRETRAINED {mini_build}" in r.stderr
    assert "model        mini" in r.stderr and "RANDOM" not in r.stderr and "not in this installation" not in r.stderr
    assert "of all 8 blocks" in r.stderr
    assert "torch_dtype" not in r.stderr  # no deprecation noise on the default path
    assert r.stdout.strip() == str(out)
    reader = imageio.get_reader(str(out))
    try:
        frames = np.stack([f for f in reader])
    finally:
        reader.close()
    assert frames.shape == (5, 32, 32, 3)


# ------------------------------------------------------------------------------------- mini's vocabulary
def test_unknown_words_are_the_words_minis_tokenizer_reads_only_as_unk():
    from attnqat.mini.corpus import WORD_SYNONYMS, Corpus, caption_words

    tok = mini.build_mini_tokenizer()
    unk = tok.unk_token_id
    known_text = " ".join(w for w in caption_words() if w.isalpha()) + " " + " ".join(WORD_SYNONYMS)
    assert mini.unknown_words(tok, known_text) == [] and mini.vocabulary_note(tok, known_text) is None
    corpus = Corpus(3, "held_out")
    assert not any(mini.unknown_words(tok, corpus.caption_of(i)) for i in range(200))
    prompt = "A Cat playing PIANO, 3 cats' tails; a cat's toy: über-naïve red ball moves left"
    words = mini.unknown_words(tok, prompt)
    assert words == ["cat", "playing", "piano", "cats", "tails", "cat's", "toy", "über", "naïve"]
    # independent check: each word alone, through the tokenizer; reported iff it holds <unk>
    for w in ["cat", "playing", "red", "ball", "moves", "left", "a", "über", "violet", "scarlet"]:
        assert (unk in tok(w, add_special_tokens=False)["input_ids"]) == (w in words), w
    assert mini.vocabulary_note(tok, "a cat playing piano") == (
        "mini does not know: cat, playing, piano (it knows colours, shapes, motions and backgrounds: see "
        "docs/corpus.md)")
    many = " ".join(f"word{'x' * i}" for i in range(1, 16)).replace("word", "zq")  # 15 unknown words
    note = mini.vocabulary_note(tok, many)
    shown = note.split(": ", 1)[1].split(" and 3 more (it knows")[0]
    assert shown.split(", ") == mini.unknown_words(tok, many)[:mini.MAX_UNKNOWN_SHOWN] and "\n" not in note


def test_generate_on_mini_names_the_words_it_does_not_know_and_goes_on(mini_build, tmp_path, capsys):
    tiniest = ["--height", "32", "--width", "32", "--frames", "1", "--steps", "1", "--device", "cpu"]
    out = tmp_path / "cat.mp4"
    assert main(["generate", "--model", str(mini_build), "--prompt", "a cat playing piano", *tiniest,
                 "--out", str(out)]) == 0
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if "does not know" in x]
    assert lines == ["NOTE: mini does not know: cat, playing, piano (it knows colours, shapes, motions and "
                     "backgrounds: see docs/corpus.md)."]
    assert out.is_file() and "wrote" in err  # it goes on
    assert main(["generate", "--model", str(mini_build), "--prompt", "a violet dot rises", *tiniest,
                 "--out", str(tmp_path / "dot.mp4")]) == 0
    assert "does not know" not in capsys.readouterr().err
    assert main(["generate", "--model", "tiny", "--prompt", "a cat playing piano", *tiniest,
                 "--out", str(tmp_path / "tiny.mp4")]) == 0
    assert "does not know" not in capsys.readouterr().err  # tiny reads bytes: every word is known to it


# ----------------------------------------------------------------------------------------------- demo
def test_demo_limits_and_defaults_for_mini():
    from attnqat.demo import SIZE_LIMITS, WORK_LIMITS, page_defaults, request_work, validate_request

    assert SIZE_LIMITS["mini"] == dict(height=256, width=256, frames=33, steps=50)
    assert page_defaults("mini", "cpu") == dict(height=128, width=128, frames=33, steps=20, guidance=5.0,
                                                flow_shift=None)
    assert page_defaults("mini", "cuda")["height"] == 256
    ok = dict(model="mini", prompt="a red ball", height=128, width=128, frames=33, steps=20, seed=0,
              modes=["bf16", "sage3", "attn_qat", "nvfp4"])
    validate_request(**ok)  # the CPU defaults in every mode
    validate_request(**{**ok, "height": 256, "width": 256, "steps": 25})  # the GPU defaults in every mode
    for change, message in ((dict(frames=37), "frames 37 is above this demo's limit of 33 for the mini model"),
                            (dict(height=272), "height 272 is above this demo's limit of 256 for the mini model"),
                            (dict(steps=51), "steps 51 is above this demo's limit of 50 for the mini model"),
                            (dict(height=256, width=256, steps=26), "the work of 256x256, 33 frames, 25 steps")):
        with pytest.raises(ValueError, match=message):
            validate_request(**{**ok, **change})
    assert request_work(**WORK_LIMITS["mini"][0]) == 256 * 256 * 33 * 25 * 4


def test_demo_engine_defaults_to_mini_and_the_page_uses_minis_ranges(installed, tmp_path):
    pytest.importorskip("gradio", reason="the demo needs gradio: pip install -e '.[app]'")
    import gradio as gr

    from attnqat.demo import DemoEngine

    engine = DemoEngine.load(device="cpu")
    assert engine.model == "mini" and engine.guidance == 5.0
    runs = engine.run("a red ball slides left", modes=["bf16"], height=32, width=32, frames=5, steps=2, seed=0,
                      out_dir=tmp_path / "req")
    assert runs[0].frames.shape == (5, 32, 32, 3)

    demo = _app().build_demo(engine, ["bf16"], str(tmp_path))
    sliders = {b.label: b for b in demo.blocks.values() if isinstance(b, gr.Slider)}
    assert {k: (sliders[k].maximum, sliders[k].value) for k in ("Steps", "Height", "Width", "Frames (4k+1)")} == {
        "Steps": (50, 20), "Height": (256, 128), "Width": (256, 128), "Frames (4k+1)": (33, 33)}
    prompt = next(b for b in demo.blocks.values() if isinstance(b, gr.Textbox) and b.label == "Prompt")
    assert prompt.value == "a blue square moves up over a checkered background"
    text = " ".join(str(b.value) for b in demo.blocks.values() if isinstance(b, gr.Markdown))
    assert "attnqat's own small Wan 2.1-architecture model" in text and "RANDOM" not in text

    # a prompt outside mini's words: the page names them (a warning and a line under BF16) and goes on
    import asyncio
    import warnings

    assert engine.vocabulary_note("a red ball slides left") is None
    handler = _app().make_handler(engine, ["bf16"], tmp_path)

    async def drive():
        return [o async for o in handler("a cat playing piano", 0, 1, 32, 32, 1, [], progress=lambda *a, **k: None)]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yields = asyncio.run(drive())
    note = "mini does not know: cat, playing, piano (it knows colours, shapes, motions and backgrounds"
    assert note in yields[-1][1] and yields[-1][0]  # bf16's metrics, and its video was made
    assert yields[-1][-1]["vocabulary_note"].startswith(note)
    assert any(note in str(w.message) for w in caught)  # gr.Warning outside a page request: a Python warning


# ---------------------------------------------------------------------------------------- packaging
def test_package_data_covers_every_file_of_a_mini_folder(mini_build, tmp_path):
    """pyproject.toml's package-data patterns for attnqat/models/mini match every file the build writes
    (so `pip install .` ships the whole folder) and nothing of its temporary siblings."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["attnqat"]
    pkg = tmp_path / "attnqat"
    shutil.copytree(mini_build, pkg / "models" / "mini")
    shutil.copytree(mini_build, pkg / "models" / "mini.tmp")
    files = {str(p.relative_to(pkg)) for p in (pkg / "models" / "mini").rglob("*") if p.is_file()}
    matched = {str(Path(m).relative_to(pkg)) for pat in patterns for m in glob.glob(str(pkg / pat), recursive=True)
               if Path(m).is_file()}
    assert files <= matched, sorted(files - matched)
    assert not any(m.startswith("models/mini.tmp") for m in matched)
    assert {"models/mini/model_index.json", "models/mini/attnqat_mini.json",
            "models/mini/tokenizer/tokenizer.json"} <= files


# ------------------------------------------------------------------------- the shipped weights (once there)
@pytest.mark.slow
@pytest.mark.skipif(not mini.mini_installed(), reason="mini's weights are not in this installation "
                    "(attnqat/models/mini); this smoke runs once they are committed")
def test_shipped_mini_quality_smoke_on_cpu(tmp_path):
    """The shipped folder is within the size limits and, through the default command (`attnqat generate`
    with no --model and no size flags: 33x128x128, the default steps, on the CPU), draws the asked colour
    in both of the first 2 held-out prompts (red, green), as the detector reads it. Two because each run is a
    whole default generation (half a minute of CI); mini draws the asked colour in each of the first 8
    held-out prompts at these seeds, so a miss is a regression, not chance. The two run side by side, in
    processes forked from this one (one thread each; the suite has two cores)."""
    import functools

    from attnqat.mini.evaluation import held_out_prompts
    from attnqat.mini.model import check_folder_size
    from attnqat.mini.quality import detect
    from attnqat.mini.quality_cli import _corpus_seed
    from conftest import forked_processes

    check_folder_size(mini.MINI_DIR)
    prompts = held_out_prompts(2, seed=_corpus_seed("mini"))
    t0 = time.perf_counter()
    runs = forked_processes(*(functools.partial(main, ["generate", "--prompt", prompt, "--device", "cpu", "--seed",
                                                       str(i), "--out", str(tmp_path / f"{i}.mp4"),
                                                       "--frames-dir", str(tmp_path / f"frames{i}")])
                              for i, (prompt, _) in enumerate(prompts)), timeout=600)
    took = time.perf_counter() - t0
    hits, report = 0, []
    for i, ((prompt, truth), run) in enumerate(zip(prompts, runs)):
        assert run.returncode == 0, run.stderr[-2000:]
        assert "model        mini" in run.stderr and "33 frames 128x128" in run.stderr, run.stderr[-2000:]
        video = np.stack([imageio.imread(p) for p in sorted((tmp_path / f"frames{i}").glob("frame_*.png"))])
        found = detect(video)
        hits += found["colour"] == truth["colour"]
        report.append(f"{prompt!r}: asked {truth['colour']}, found {found['colour']}")
    assert hits == len(prompts), "; ".join(report) + f" ({took:.0f} s for both)"
