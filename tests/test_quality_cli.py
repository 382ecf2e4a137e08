"""``attnqat quality`` end to end on the tiny model (random weights, 5x32x32, 2 steps, 2 prompts): the files it
writes parse and agree with each other (the bf16 row is the reference: velocity distance 0, no PSNR; a row
whose forward equals nvfp4's gives nvfp4's numbers; perturbed weights move every metric; a precision schedule
lands between bf16 and FP4); an ``attnqat train`` run folder loads as a checkpoint; hostile arguments end in
one line and exit status 2 before any model loads; an output folder holding other files is refused."""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from attnqat.cli import main as cli_main
from attnqat.mini.corpus import parse_prompt
from attnqat.mini.quality import score

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--model", "tiny", "--size", "5x32x32", "--steps", "2", "--prompts", "2", "--clips", "2", "--batch", "2",
         "--device", "cpu"]


def test_modes_left_out_of_the_default_rows_have_nvfp4s_forward():
    from attnqat.mini.evaluation import base_variants
    from attnqat.kernels import attention, available_modes, mode_of

    same_forward = {m: mode_of(m).same_forward_as for m in available_modes(lambda m: m.same_forward_as)}
    assert same_forward == {"attn_qat": "nvfp4", "attn_qat_dropin": "nvfp4"}
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 64, generator=g) for _ in range(3))
    with torch.no_grad():
        for mode, same in same_forward.items():
            assert torch.equal(attention(q, k, v, mode), attention(q, k, v, same)), mode
    labels = [x.label for x in base_variants()]
    assert labels[0] == "bf16" and "nvfp4" in labels and not set(same_forward) & set(labels)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One `attnqat quality` run with every kind of row; returns (out folder, table.json, stdout)."""
    from safetensors.torch import save_file

    from attnqat.pipelines import build_tiny_transformer
    from attnqat.train import load_config, train

    tmp = tmp_path_factory.mktemp("quality")
    g = torch.Generator().manual_seed(0)
    base = build_tiny_transformer().state_dict()
    save_file({k: (v + 0.05 * torch.randn(v.shape, generator=g)).contiguous() for k, v in base.items()},
              str(tmp / "perturbed.safetensors"))
    train(load_config(ROOT / "configs" / "tiny.yaml",
                      [f"output_dir={tmp / 'qat'}", "train.max_steps=1", "train.lr=1e-3", "data.held_out=0",
                       "log.progress=false", "data.batch_size=2", "checkpoint.every=1"]))
    out = tmp / "out"
    argv = ["quality", *SMALL, "--base-modes", "bf16,nvfp4", "--variant", "same=attn_qat",
            "--variant", f"moved=bf16:{tmp / 'perturbed.safetensors'}", "--variant", f"qat=attn_qat:{tmp / 'qat'}",
            "--variant", "schedule=nvfp4", "--bf16-steps", "schedule=0", "--variant", "rot=nvfp4,qk_rotation=hadamard",
            "--flow-shift", "5", "--out", str(out)]
    import io
    from contextlib import redirect_stdout

    buf = io.StringIO()
    with redirect_stdout(buf):
        assert cli_main(argv) == 0
    return out, json.loads((out / "table.json").read_text()), buf.getvalue(), tmp


def test_outputs_exist_parse_and_agree(run):
    from PIL import Image

    out, table, stdout, _ = run
    assert sorted(p.name for p in out.iterdir()) == ["grid.png", "table.json", "table.md"]
    json.loads((out / "table.json").read_text(), parse_constant=lambda c: pytest.fail(f"{c} in table.json"))
    md = (out / "table.md").read_text()
    assert md.strip() in stdout  # the table is printed too
    order = ["bf16", "nvfp4", "same", "moved", "qat", "schedule", "rot"]
    assert table["format"] == "attnqat-quality" and table["order"] == order
    # --flow-shift reached the sampler (read back off the pipeline's scheduler) and the table says it
    assert table["flow_shift"] == 5.0 and "flow shift 5," in md
    assert table["references"] == {"bf16": "bf16", "fp4": "nvfp4", "video": "bf16"}
    for label in order:
        assert f"**{label}**" in md
    rows = table["rows"]
    assert len(table["prompts"]) == 2 and len(table["detections"]["moved"]) == 2 and table["size"] == [5, 32, 32]

    ref = rows["bf16"]  # the reference: distance 0, no PSNR / SSIM to itself, marked "ref"
    assert ref["velocity_distance"] == 0 and ref["psnr"] is None and ref["ssim"] is None
    assert "| ref | ref |" in md.splitlines()[2]
    assert rows["nvfp4"]["gap_closed_loss"] == 0 and ref["gap_closed_loss"] == 1
    # velocity: the bf16 end is distance 0, so the gap closed is 1 - distance / nvfp4's distance
    assert rows["nvfp4"]["gap_closed_velocity"] == 0 and ref["gap_closed_velocity"] == 1
    assert rows["moved"]["gap_closed_velocity"] == pytest.approx(
        1 - rows["moved"]["velocity_distance"] / rows["nvfp4"]["velocity_distance"])
    for label in order[1:]:
        r = rows[label]
        assert r["nonfinite_videos"] == 0
        assert 0 < r["psnr"] <= table["psnr_cap_db"] and -1 <= r["ssim"] <= 1, label
        assert all(0 <= r[f"acc_{k}"] <= 1 for k in ("colour", "shape", "motion", "all")), label
        # the row's accuracies are score() of its saved detections against the prompts' truth
        acc = score(table["detections"][label], [parse_prompt(text) for text in table["prompts"]])
        assert [r[f"acc_{k}"] for k in ("colour", "shape", "motion", "direction", "all")] == [
            acc[k] for k in ("colour", "shape", "motion", "direction", "all")], label
    # attn_qat's forward is nvfp4's: the same numbers, exactly
    for key in ("flow_loss", "velocity_distance", "psnr", "ssim", "acc_all"):
        assert rows["same"][key] == rows["nvfp4"][key], key
    # FP4 moves the model a little, perturbed weights a lot
    assert 0 < rows["nvfp4"]["velocity_distance"] < 0.01
    moved = rows["moved"]
    assert moved["velocity_distance"] > 0.1 and moved["flow_loss"] != ref["flow_loss"]
    assert moved["psnr"] < rows["nvfp4"]["psnr"] and moved["ssim"] < rows["nvfp4"]["ssim"]
    # bf16 attention on the noise levels of step 0: closer to bf16 than nvfp4 everywhere
    assert 0 < rows["schedule"]["velocity_distance"] < rows["nvfp4"]["velocity_distance"]
    assert [v["high_precision"] for v in table["variants"] if v["label"] == "schedule"] == [
        {"steps": "0", "blocks": "", "mode": "bf16"}]
    # a row's mode options: run (other numbers than the same mode without them), kept and shown; the FP4 reference
    # stays the plain nvfp4 row
    assert [v["options"] for v in table["variants"] if v["label"] == "rot"] == [{"qk_rotation": "hadamard"}]
    assert "| **rot** | nvfp4, qk_rotation=hadamard | base |" in md
    assert rows["rot"]["velocity_distance"] != rows["nvfp4"]["velocity_distance"]
    # the run folder's final/ weights were used (trained at a high lr for one step: they moved)
    assert table["weight_files"]["qat"].endswith(os.path.join("qat", "final", "transformer.safetensors"))
    assert rows["qat"]["velocity_distance"] != rows["nvfp4"]["velocity_distance"]
    with Image.open(out / "grid.png") as im:
        assert im.size[0] > 2 * 3 * 96 and im.size[1] > len(order) * 96


def test_per_frame_columns_agree_with_the_averages(run):
    """Per latent frame (5 video frames: 2 latent frames) and per video frame, beside every average."""
    from attnqat.mini.quality import presence

    out, table, stdout, _ = run
    rows = table["rows"]
    for label in table["order"]:
        r = rows[label]
        assert len(r["flow_loss_frames"]) == 2 and len(r["velocity_distance_frames"]) == 2
        # every latent frame holds as many positions: the loss is the mean of the per-frame losses
        assert r["flow_loss"] == pytest.approx(np.mean(r["flow_loss_frames"]), rel=1e-6), label
        assert all(0 <= x <= 1 for x in r["presence"]["per_frame"]) and len(r["presence"]["per_frame"]) == 5
        # presence is recomputed from the saved per-frame colours and the prompts' truth
        readings = [{"found": [c is not None for c in d["colour_frames"]], "colour": d["colour_frames"],
                     "shape": [None] * 5} for d in table["detections"][label]]
        truth = [parse_prompt(text) for text in table["prompts"]]
        again = presence(readings, [{"colour": t["colour"]} for t in truth])
        assert {k: again[k] for k in ("present", "frames", "last", "per_frame")} == {
            k: r["presence"][k] for k in ("present", "frames", "last", "per_frame")}, label
        if label != "bf16":
            assert r["psnr"] == pytest.approx(np.mean(r["psnr_frames"]), rel=1e-9) and len(r["psnr_frames"]) == 5
            assert r["ssim"] == pytest.approx(np.mean(r["ssim_frames"]), rel=1e-9)
    assert rows["bf16"]["velocity_distance_frames"] == [0, 0] and rows["bf16"]["psnr_frames"] is None
    assert rows["nvfp4"]["gap_closed_loss_frames"] == [0, 0] and rows["bf16"]["gap_closed_loss_frames"] == [1, 1]
    assert rows["same"]["flow_loss_frames"] == rows["nvfp4"]["flow_loss_frames"]
    md = (out / "table.md").read_text()
    per_frame = md.split("| row | flow loss per latent frame")[1]
    loss = rows["moved"]["flow_loss_frames"]
    assert f"| **moved** | {loss[0]:.4f} / {loss[0]:.4f} / {loss[1]:.4f} | {max(loss):.4f} ({int(np.argmax(loss))}) |" \
        in per_frame  # 2 latent frames: the middle one is the first
    assert "| **bf16** |" in per_frame and "| ref | ref |" in per_frame and "last 5" in per_frame


def test_flow_metrics_per_latent_frame_match_an_independent_computation():
    from attnqat.mini.evaluation import EVAL_SIGMAS, Variant, flow_metrics
    from attnqat.pipelines import build_tiny_transformer

    transformer = build_tiny_transformer()
    g = torch.Generator().manual_seed(3)
    x0 = torch.randn(3, 16, 3, 4, 4, generator=g)
    x0[:, :, 2] *= 4  # the last latent frame far off the data: its loss stands out
    embeds = torch.randn(3, 8, transformer.config.text_dim, generator=g)
    rows = flow_metrics(transformer, [Variant("bf16"), Variant("fp4", "nvfp4")], x0, embeds, seed=5, batch=2)
    noise = torch.randn((len(EVAL_SIGMAS),) + tuple(x0.shape), generator=torch.Generator().manual_seed(5))
    expected = torch.zeros(3, dtype=torch.float64)
    with torch.no_grad():
        for si, sigma in enumerate(EVAL_SIGMAS):
            xt = (1 - sigma) * x0 + sigma * noise[si]
            v = transformer(hidden_states=xt, timestep=torch.full((3,), sigma * 1000.0), encoder_hidden_states=embeds,
                            return_dict=False)[0]
            expected += ((v - (noise[si] - x0)) ** 2).double().mean((0, 1, 3, 4)) / len(EVAL_SIGMAS)
    assert rows["bf16"]["flow_loss_frames"] == pytest.approx(expected.tolist(), rel=1e-4)
    assert rows["bf16"]["flow_loss_frames"][2] > 2 * max(rows["bf16"]["flow_loss_frames"][:2])
    assert len(rows["fp4"]["velocity_distance_frames"]) == 3 and min(rows["fp4"]["velocity_distance_frames"]) > 0


def test_checkpoint_forms_resolve_to_the_exported_weights(run):
    from attnqat.pipelines.loading import checkpoint_weights_path

    qat = run[3] / "qat"
    final = str(qat / "final" / "transformer.safetensors")
    step = qat / "checkpoints" / "step-0000001"
    assert checkpoint_weights_path(qat) == final and checkpoint_weights_path(qat / "final") == final
    assert checkpoint_weights_path(step) == str(step / "transformer.safetensors")
    os.rename(qat / "final", qat / "final.away")  # a run stopped before its end: the newest checkpoint
    try:
        assert checkpoint_weights_path(qat) == str(step / "transformer.safetensors")
    finally:
        os.rename(qat / "final.away", qat / "final")


def test_an_earlier_output_is_rewritten_other_folders_are_refused(run, tmp_path, capsys, monkeypatch):
    from attnqat.mini import quality_cli

    out = run[0]
    assert quality_cli.is_our_output(out)
    # a second run into the same folder replaces the three files (the cheapest run: one row, one prompt)
    before = (out / "table.json").read_text()
    argv = ["quality", *SMALL, "--base-modes", "bf16", "--prompts", "1", "--clips", "1", "--out", str(out)]
    assert cli_main(argv) == 0
    after = json.loads((out / "table.json").read_text())
    assert after["order"] == ["bf16"] and (out / "table.json").read_text() != before
    (out / "table.json").write_text(before)  # leave the module's run as it was for the other tests
    # a folder with someone else's file is refused before any model loads ...
    import attnqat.pipelines.loading as loading

    monkeypatch.setattr(loading, "load_pipeline", lambda *a, **k: pytest.fail("a model loaded"))
    (tmp_path / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert cli_main(["quality", *SMALL, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "not empty" in err
    # ... unless --overwrite (which replaces only the three names)
    args = quality_cli.resolve_settings(_namespace(["quality", *SMALL, "--out", str(tmp_path), "--overwrite"]))
    assert args.out == tmp_path and (tmp_path / "notes.txt").read_text() == "mine"


def test_overwrite_on_a_full_disk_keeps_the_old_set_whole(run, tmp_path, capsys, monkeypatch):
    """--overwrite into a folder holding an earlier set and a user's file; grid.png (written last) fails as on a
    full disk: the old table.json, table.md and grid.png are all kept, one line, exit 1, nothing else left."""
    import shutil

    from PIL import Image

    out = tmp_path / "out"
    shutil.copytree(run[0], out)
    (out / "notes.txt").write_text("mine")
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def full_disk(self, fp, *a, **k):
        Path(fp).write_bytes(b"\x89PNG")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Image.Image, "save", full_disk)
    capsys.readouterr()
    argv = ["quality", *SMALL, "--base-modes", "bf16", "--prompts", "1", "--clips", "1", "--out", str(out), "--overwrite"]
    assert cli_main(argv) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("attnqat quality: failed:") and "No space left on device" in lines[-1]
    assert "existing files were left unchanged" in lines[-1] and not any("Traceback" in x for x in lines)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def _namespace(argv):
    from attnqat.cli import build_parser

    return build_parser("quality").parse_args(argv)


HOSTILE = [
    ["--prompts", "0"], ["--prompts", "x"], ["--prompts", "100000"], ["--clips", "-1"], ["--steps", "0"],
    ["--steps", "1001"], ["--size", "4x32x32"], ["--size", "5x30x32"], ["--size", "5x32"], ["--size", ""],
    ["--size", "5x32x99999"], ["--guidance", "nan"], ["--guidance", "-1"], ["--flow-shift", "0"], ["--flow-shift", "inf"], ["--seed", "-1"], ["--batch", "0"],
    ["--corpus-seed", "-3"], ["--grid-prompts", "0"], ["--variant", "noequals"], ["--variant", "a=nope"],
    ["--variant", "a=bf16:{w}/missing.safetensors"], ["--variant", "a=bf16:{w}/garbage.safetensors"],
    ["--variant", "a=bf16:{w}/empty"], ["--variant", "a b=bf16"], ["--variant", "=bf16"], ["--variant", "bf16=nvfp4"],
    ["--variant", "x=bf16:"], ["--variant", "\ud800=bf16"], ["--base-modes", "nope"], ["--base-modes", ""],
    ["--bf16-steps", "x=0"], ["--bf16-steps", "bf16=0"], ["--variant", "h=nvfp4", "--bf16-steps", "h=9"],
    ["--variant", "h=nvfp4", "--bf16-steps", "h=a"], ["--variant", "h=nvfp4", "--bf16-steps", "h=0,1"],
    ["--variant", "h=nvfp4", "--bf16-steps", "h=0", "--bf16-steps", "h=1"], ["--bf16-steps", "nolabel"],
    ["--fp4-reference", "nope"], ["--bf16-reference", "\ud800"], ["--model", "{w}/missing"], ["--model", ""],
    ["--device", "tpu"], ["--device", "cuda:99"], ["--out", "{w}/a-file"], ["--out", "{w}/full"],
    ["--out", "/sys/attnqat-quality"], ["--out", "x" * 300], ["--frobnicate"],
]


def test_hostile_arguments_are_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    import attnqat.pipelines.loading as loading

    monkeypatch.setattr(loading, "load_pipeline", lambda *a, **k: pytest.fail("a model loaded"))
    (tmp_path / "a-file").write_text("mine")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    (tmp_path / "empty").mkdir()
    (tmp_path / "garbage.safetensors").write_bytes(b"not a safetensors file")
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    for extra in HOSTILE:
        extra = [x.replace("{w}", str(tmp_path)) for x in extra]
        argv = ["quality", *SMALL, "--out", str(tmp_path / "new"), *extra]
        try:
            rc = cli_main(argv)
        except SystemExit as e:
            rc = e.code
        out, err = capsys.readouterr()
        assert rc == 2, (extra, rc, err)
        assert out == "" and len(err.splitlines()) == 1 and "Traceback" not in err, (extra, err)
        assert err.startswith("attnqat quality: error: "), (extra, err)
        assert sorted(str(p) for p in tmp_path.rglob("*")) == before, extra
    # the default model is the shipped mini: absent here, that too is one line
    if not (ROOT / "attnqat" / "models" / "mini" / "model_index.json").is_file():
        assert cli_main(["quality", "--out", str(tmp_path / "new")]) == 2
        assert "attnqat build-mini" in capsys.readouterr().err


def test_help_imports_no_torch():
    r = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import sys
        from attnqat.cli import main
        try:
            main(["quality", "--help"])
        except SystemExit as e:
            assert e.code == 0
        print("HEAVY", sorted(m for m in ("torch", "diffusers", "PIL", "tqdm") if m in sys.modules), file=sys.stderr)
    """)], capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert r.returncode == 0 and "HEAVY []" in r.stderr, r.stderr
    assert "--variant" in r.stdout and "LABEL=MODE[,KEY=VALUE...][:CHECKPOINT]" in r.stdout


def test_bench_writes_the_docs_section_and_picture(tmp_path):
    """bench/quality.py (its main, in this process: a subprocess would spend most of the test importing): attnqat
    quality's table into its section of DOCS/quality.md (the rest of the page left alone), the numbers to
    quality.json, and the grid as the page's picture, scaled down to --picture-width in 256 colours (the full grid
    stays in --out)."""
    from PIL import Image

    from conftest import load_script

    bench = load_script(ROOT / "bench" / "quality.py", "bench_quality")
    docs, out = tmp_path / "docs", tmp_path / "q"
    assert bench.main([*SMALL, "--base-modes", "bf16", "--prompts", "1", "--clips", "1", "--out", str(out),
                       "--docs", str(docs), "--picture-width", "40"]) == 0
    assert json.loads((docs / "quality.json").read_text())["rows"]
    page = (docs / "quality.md").read_text()
    section = page.split("<!-- BEGIN quality -->")[1].split("<!-- END quality -->")[0]
    assert "| **bf16** (bf16 ref.) |" in section and "](quality.png)" in section and "--model tiny" in section
    assert "No measured results yet: `bench/quality.py`" not in section
    assert page.split("<!-- BEGIN quality -->")[0] == (ROOT / "docs" / "quality.md").read_text().split(
        "<!-- BEGIN quality -->")[0]  # the rest of the page is left alone
    with Image.open(out / "grid.png") as grid, Image.open(docs / "quality.png") as small:
        assert grid.width > 40 and small.size == (40, round(grid.height * 40 / grid.width)) and small.mode == "P"
        # the same picture: the scaled-down grid, within what the 256-colour palette rounds
        expected = np.asarray(grid.convert("RGB").resize(small.size, Image.LANCZOS), dtype=np.float64)
        assert np.abs(np.asarray(small.convert("RGB"), dtype=np.float64) - expected).mean() < 4


def test_mini_qat_config_and_every_driver_run_validate():
    """configs/mini_qat.yaml with each of bench/gpu_qat.sh's switches is a valid config for the mini model."""
    from attnqat.mini.model import MINI_TRANSFORMER_CONFIG
    from attnqat.train.config import load_config, validate

    driver = (ROOT / "bench" / "gpu_qat.sh").read_text()
    runs = {"flow": [], "distill_output": ["objective.type=distill", "objective.target=output"],
            "pbwd_normalized": ["attention.options.p_bwd=normalized"], "dropin": ["attention.mode=attn_qat_dropin"],
            "bf16_control": ["attention.mode=bf16"]}
    for name, sets in runs.items():
        assert f"{name})" in driver and all(s in driver for s in sets), name
        cfg = load_config(ROOT / "configs" / "mini_qat.yaml", sets)
        validate(cfg, transformer_config=dict(MINI_TRANSFORMER_CONFIG), device_type="cuda")
        assert cfg.data.source == "corpus" and cfg.train.max_steps == 4000 and 1e-5 <= cfg.train.lr <= 1e-4
    assert load_config(ROOT / "configs" / "mini_qat.yaml", runs["pbwd_normalized"]).attention.options == \
        {"p_bwd": "normalized"}
    assert load_config(ROOT / "configs" / "mini_qat.yaml").objective.type == "flow"
