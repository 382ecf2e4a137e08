"""QAT weights shipped beside a model (:mod:`attnqat.pipelines.qat_weights`): ``attnqat export-qat`` writes the
tensors a fine-tune changed, loading applies them over the base they were made for and refuses any other,
and ``attnqat generate --mode attn_qat``, the demo's Attn-QAT column and ``attnqat quality`` use them.

The base is an untrained mini written by ``save_pipeline_folder`` (bf16, as the build ships it); the
fine-tunes are that transformer with fresh random changes to its self-attention (what an attention-only
QAT run changes), saved in fp32 as ``attnqat train`` saves its checkpoints.
"""
from __future__ import annotations

import glob
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from attnqat.cli import main
from attnqat.mini import model as mini
from attnqat.pipelines.loading import (CheckpointMismatchError, load_qat_checkpoint, load_transformer,
                                       read_qat_checkpoint)
from attnqat.pipelines.qat_export import export_qat_weights
from attnqat.pipelines.qat_weights import FORMAT, MAX_BYTES, read_qat_weights, serialize, weights_fingerprint

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--height", "32", "--width", "32", "--frames", "5", "--steps", "2", "--device", "cpu"]
BF16 = torch.bfloat16


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(BF16).contiguous().view(torch.int16)


def _attention(name: str) -> bool:
    return ".attn1." in name


@pytest.fixture(scope="module")
def mini_base(tmp_path_factory):
    """An untrained mini folder, stored as the build stores it (bf16 transformer)."""
    from attnqat.mini.model import build_mini_pipeline, save_pipeline_folder

    return save_pipeline_folder(build_mini_pipeline(), tmp_path_factory.mktemp("base") / "mini")


def _base_state(folder) -> dict[str, torch.Tensor]:
    return load_transformer(str(folder), dtype=torch.float32).state_dict()


def _finetune(base: dict, path: Path, *, change=_attention) -> dict[str, torch.Tensor]:
    """``base`` with fresh random changes to the tensors ``change`` selects, saved in fp32 at ``path``. Another
    tensor (unless selected) moves in fp32 by less than bf16 resolves: a change the shipped bf16 model cannot
    hold, so not one (2^-12 relative is below half a bf16 step, 2^-9)."""
    state = {k: (v + 0.05 * torch.randn_like(v) if change(k) else v).contiguous() for k, v in base.items()}
    if not change("proj_out.weight"):
        state["proj_out.weight"] = base["proj_out.weight"].to(BF16).float() * (1 + 2 ** -12)
        assert not torch.equal(state["proj_out.weight"], base["proj_out.weight"])
    save_file(state, str(path))
    return state


@pytest.fixture(scope="module")
def shipped(mini_base, tmp_path_factory):
    """A copy of the base folder with an attention-only fine-tune exported into it as mini's QAT weights:
    (folder, the fine-tune's state dict, the base's state dict)."""
    folder = tmp_path_factory.mktemp("pkg") / "mini"
    shutil.copytree(mini_base, folder)
    base = _base_state(mini_base)
    tuned = _finetune(base, folder.parent / "finetune.safetensors")
    export_qat_weights(folder.parent / "finetune.safetensors", str(mini_base), folder / mini.MINI_QAT_WEIGHTS)
    return folder, tuned, base


@pytest.fixture
def installed(monkeypatch, shipped):
    monkeypatch.setattr(mini, "MINI_DIR", shipped[0])
    return shipped


# ------------------------------------------------------------------------------------ export and load
def test_export_writes_the_changed_tensors_and_loading_applies_them_over_the_base(mini_base, tmp_path, poison):
    base = _base_state(mini_base)
    tuned = _finetune(base, tmp_path / "ft.safetensors")
    out = export_qat_weights(tmp_path / "ft.safetensors", str(mini_base), tmp_path / "q" / "attn_qat.safetensors",
                             trained="attention-only test fine-tune")
    changed = {k for k in base if _attention(k)}
    assert set(out.tensors) == changed  # proj_out.weight moved in fp32 only: not a change in bf16
    assert all(v.dtype == BF16 for v in out.tensors.values())
    size = out.path.stat().st_size
    assert 3e6 < size <= MAX_BYTES, size  # mini's self-attention: ~4 MB of its 18 MB
    with safe_open(str(out.path), framework="pt") as f:
        meta = f.metadata()
    assert meta == {"format": FORMAT, "tensors": "subset", "base": weights_fingerprint(base), "dtype": "bfloat16",
                    "trained": "attention-only test fine-tune"}
    assert [p.name for p in out.path.parent.iterdir()] == ["attn_qat.safetensors"]  # no temporary file left

    transformer = load_transformer(str(mini_base), dtype=torch.float32)
    full = read_qat_checkpoint(transformer, out.path)
    assert all(torch.equal(v, base[k]) for k, v in transformer.state_dict().items())  # reading changed nothing
    load_qat_checkpoint(transformer, out.path)
    for name, value in transformer.state_dict().items():
        want = tuned[name].to(BF16).float() if name in changed else base[name]
        assert torch.equal(value, want), name
        assert torch.equal(full[name], value.to(full[name].dtype)), name
        if name in changed:
            assert torch.equal(_bits(value), _bits(tuned[name])), name


def test_the_base_fingerprint_holds_in_every_dtype_and_not_for_other_weights(mini_base):
    base = _base_state(mini_base)
    print_fp32 = weights_fingerprint(base)
    assert weights_fingerprint({k: v.to(BF16) for k, v in base.items()}) == print_fp32
    assert weights_fingerprint({k: v.to(torch.float16) for k, v in base.items()}) == print_fp32
    other = dict(base, **{"proj_out.bias": base["proj_out.bias"] + 0.01})
    assert weights_fingerprint(other) != print_fp32
    renamed = {("x" + k if k == "proj_out.bias" else k): v for k, v in base.items()}
    assert weights_fingerprint(renamed) != print_fp32


@pytest.fixture(scope="module")
def tiny_qat(tmp_path_factory):
    """QAT weights of the tiny transformer: (the file, the fine-tune's state dict)."""
    from attnqat.pipelines import build_tiny_transformer

    folder = tmp_path_factory.mktemp("tiny")
    tuned = _finetune(build_tiny_transformer().state_dict(), folder / "ft.safetensors")
    return export_qat_weights(folder / "ft.safetensors", "tiny", folder / "q.safetensors").path, tuned


def test_qat_weights_refuse_other_base_weights_and_load_nothing(tiny_qat):
    from attnqat.pipelines import build_tiny_transformer

    other = build_tiny_transformer()
    with torch.no_grad():
        other.proj_out.bias.add_(0.01)  # not a tensor the file holds: the base differs all the same
    before = {k: v.clone() for k, v in other.state_dict().items()}
    for load in (load_qat_checkpoint, read_qat_checkpoint):
        with pytest.raises(CheckpointMismatchError, match=r"were made for other base weights \(base fingerprint "
                                                          r"[0-9a-f]{12}, this transformer's [0-9a-f]{12}\).*"
                                                          r"--qat-checkpoint none") as e:
            load(other, tiny_qat[0])
        assert "\n" not in str(e.value)
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())


def test_qat_weights_refuse_unknown_keys_wrong_shapes_and_a_bad_header(tiny_qat, tmp_path):
    from attnqat.pipelines import build_tiny_transformer

    transformer = build_tiny_transformer()
    fingerprint = weights_fingerprint(transformer.state_dict())
    tensors = load_file(str(tiny_qat[0]))
    cases = {"unknown": ({**tensors, "blocks.9.attn1.to_q.weight": torch.zeros(2, 2, dtype=BF16)},
                         r"do not match this transformer \(2 blocks\): 1 unexpected keys \(blocks.9.attn1.to_q.weight"),
             "shape": ({**tensors, "blocks.0.attn1.to_q.weight": torch.zeros(3, 128, dtype=BF16)},
                       r"1 shape mismatches \(blocks.0.attn1.to_q.weight: checkpoint \(3, 128\) vs model \(128, 128\)")}
    for name, (state, message) in cases.items():
        (tmp_path / f"{name}.safetensors").write_bytes(serialize(state, fingerprint, "test"))
        with pytest.raises(CheckpointMismatchError, match=message):
            load_qat_checkpoint(transformer, tmp_path / f"{name}.safetensors")
    from safetensors.torch import save

    (tmp_path / "no_base.safetensors").write_bytes(save(tensors, metadata={"format": FORMAT, "tensors": "subset"}))
    with pytest.raises(CheckpointMismatchError, match="not a QAT weights file of this attnqat version"):
        load_qat_checkpoint(transformer, tmp_path / "no_base.safetensors")
    assert torch.equal(transformer.state_dict()["blocks.0.attn1.to_q.weight"],
                       build_tiny_transformer().state_dict()["blocks.0.attn1.to_q.weight"])


def test_a_plain_file_of_some_tensors_keeps_the_full_state_dict_rule(tiny_qat, tmp_path):
    """Only the metadata makes a file QAT weights: the same tensors without it are a full state dict that
    lacks keys, refused as before."""
    from attnqat.pipelines import build_tiny_transformer

    save_file(load_file(str(tiny_qat[0])), str(tmp_path / "plain.safetensors"))
    with pytest.raises(CheckpointMismatchError, match=r"QAT checkpoint .* does not match this transformer "
                                                      r"\(2 blocks\): \d+ missing keys \(blocks.0.attn2"):
        load_qat_checkpoint(build_tiny_transformer(), tmp_path / "plain.safetensors")


def test_a_model_folder_given_as_checkpoint_is_its_transformer_not_the_qat_weights_beside_it(shipped):
    folder, _, base = shipped
    transformer = load_transformer(str(folder), dtype=torch.float32)
    with torch.no_grad():
        for p in transformer.parameters():
            p.zero_()
    load_qat_checkpoint(transformer, folder)
    assert all(torch.equal(v, base[k]) for k, v in transformer.state_dict().items())


# ----------------------------------------------------------------------------------- export's refusals
def test_export_refuses_a_full_finetune_over_12_mb_in_one_line_and_writes_nothing(mini_base, tmp_path, capsys):
    _finetune(_base_state(mini_base), tmp_path / "full.safetensors", change=lambda k: True)
    out = tmp_path / "attn_qat.safetensors"
    assert main(["export-qat", "--from", str(tmp_path / "full.safetensors"), "--model", str(mini_base),
                 "--out", str(out), "--storage", "subset"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]  # not diffusers' shard bar
    assert len(err) == 1 and err[0].startswith("attnqat export-qat: error: QAT weights of"), err
    assert "would be 18.2 MB as subset (" in err[0] and "over the 12 MB limit of a shipped file" in err[0], err
    assert "train.trainable=attention" in err[0] and "fp8-delta" in err[0]
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["full.safetensors"]


def _fp8_round_bound(delta: torch.Tensor) -> torch.Tensor:
    """Per element, the most that storing ``delta`` (2+ dims) as float8_e4m3fn with a per-row scale s (the row's
    largest |change| maps to 448) may move it: half a step of e4m3 at the value (3 mantissa bits: |x| 2^-4 for
    normals, 2^-10 s below 2^-6 s), plus fp32 slack."""
    rows = delta.reshape(delta.shape[0], -1)
    s = rows.abs().amax(1, keepdim=True) / 448
    return (rows.abs() * 2 ** -4 + s * 2 ** -10 + 1e-7 * (1 + rows.abs())).reshape(delta.shape)


def test_a_full_finetune_ships_as_fp8_changes_that_load_within_fp8_rounding(mini_base, tmp_path, poison):
    """A fine-tune of every weight (18 MB in bf16) is stored as its changes in FP8 (auto), under 12 MB; loading
    adds them to the base: every weight within FP8 rounding of the change, the change's error ~1% of it."""
    base = _base_state(mini_base)
    tuned = _finetune(base, tmp_path / "full.safetensors", change=lambda k: True)
    out = export_qat_weights(tmp_path / "full.safetensors", str(mini_base), tmp_path / "q.safetensors",
                             trained="full test fine-tune")
    assert out.storage == "fp8-delta" and 8e6 < out.path.stat().st_size <= MAX_BYTES, out.path.stat().st_size
    with safe_open(str(out.path), framework="pt") as f:
        meta = f.metadata()
    assert meta["tensors"] == "fp8-delta" and meta["dtype"] == "float8_e4m3fn"
    assert set(out.tensors) == set(base)
    transformer = load_transformer(str(mini_base), dtype=torch.float32)
    load_qat_checkpoint(transformer, out.path)
    errors, sizes = 0.0, 0.0
    for name, value in transformer.state_dict().items():
        delta = tuned[name] - base[name]
        got = value - base[name]
        if delta.ndim >= 2:
            assert out.tensors[name].dtype == torch.float8_e4m3fn
            assert ((got - delta).abs() <= _fp8_round_bound(delta)).all(), name
        else:  # biases and norms: the change in bf16
            assert torch.allclose(got, delta.to(BF16).float(), rtol=0, atol=1e-6 * (1 + base[name].abs().max())), name
        errors += float((got - delta).square().sum())
        sizes += float(delta.square().sum())
    assert (errors / sizes) ** 0.5 < 0.03  # e4m3's RMS rounding error is ~1.5% of a Gaussian change
    # the same file through read_qat_checkpoint (what attnqat quality uses): the same values
    fresh = load_transformer(str(mini_base), dtype=torch.float32)
    full = read_qat_checkpoint(fresh, out.path)
    assert all(torch.equal(full[k], v) for k, v in transformer.state_dict().items())


def test_fp8_changes_files_that_are_malformed_are_refused(mini_base, tmp_path):
    base = _base_state(mini_base)
    _finetune(base, tmp_path / "full.safetensors", change=lambda k: True)
    out = export_qat_weights(tmp_path / "full.safetensors", str(mini_base), tmp_path / "q.safetensors")
    stored = load_file(str(out.path))
    with safe_open(str(out.path), framework="pt") as f:
        meta = f.metadata()
    name = "blocks.0.attn1.to_q.weight"
    for broken, why in [({k: v for k, v in stored.items() if k != "scale:" + name}, f"{name}'s scale is missing"),
                        (dict(stored, **{name: stored[name].float()}), f"{name} is torch.float32, not float8"),
                        (dict(stored, **{"scale:nothing": torch.ones(3)}), "scales without an FP8 tensor")]:
        save_file(broken, str(tmp_path / "bad.safetensors"), metadata=meta)
        transformer = load_transformer(str(mini_base), dtype=torch.float32)
        with pytest.raises(CheckpointMismatchError, match="are malformed: .*" + why.replace("(", r"\(")):
            load_qat_checkpoint(transformer, tmp_path / "bad.safetensors")
        assert all(torch.equal(v, base[k]) for k, v in transformer.state_dict().items())  # nothing loaded


def test_export_refuses_another_architecture_and_an_unchanged_finetune(mini_base, tiny_qat, tmp_path, capsys):
    tiny_ft = tiny_qat[0].parent / "ft.safetensors"
    assert main(["export-qat", "--from", str(tiny_ft), "--model", str(mini_base), "--out",
                 str(tmp_path / "a.safetensors")]) == 2
    assert "does not match this transformer (8 blocks): " in capsys.readouterr().err
    save_file(_base_state(mini_base), str(tmp_path / "same.safetensors"))
    assert main(["export-qat", "--from", str(tmp_path / "same.safetensors"), "--model", str(mini_base), "--out",
                 str(tmp_path / "b.safetensors")]) == 2
    assert "equals the base model" in capsys.readouterr().err
    assert {p.name for p in tmp_path.iterdir()} == {"same.safetensors"}  # nothing written


def test_export_command_writes_and_reports(tiny_qat, tmp_path, capsys):
    out = tmp_path / "q.safetensors"
    assert main(["export-qat", "--from", str(tiny_qat[0].parent / "ft.safetensors"), "--model", "tiny",
                 "--out", str(out), "--trained", "a test"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"wrote {out}: 20 tensors that differ from tiny's in bf16") and "trained: a test" in line
    assert read_qat_weights(out).trained == "a test"


def test_the_qk_options_a_finetune_trained_under_travel_with_its_weights(tmp_path, capsys, monkeypatch):
    """A run trained with attention.options qk_rotation and k_smoothing: its checkpoint's config says so, export-qat
    records them (or what --qk-rotation / --k-smoothing say), and `attnqat generate`, `attnqat quality`'s rows and the
    demo's Attn-QAT column run the weights with them unless told otherwise."""
    from attnqat.pipelines.loading import trained_attention_options, trained_mode_options
    from attnqat.train import load_config, train

    run = tmp_path / "run"
    train(load_config(Path(__file__).parents[1] / "configs" / "tiny.yaml",
                      [f"output_dir={run}", "log.progress=false", "train.max_steps=2", "train.warmup_steps=1",
                       "data.batch_size=1", "data.held_out=0", "attention.options.qk_rotation=hadamard",
                       "attention.options.k_smoothing=true"]))
    both = {"qk_rotation": "hadamard", "k_smoothing": True}
    assert trained_attention_options(run) == trained_attention_options(run / "final") == both
    auto, none = tmp_path / "auto.safetensors", tmp_path / "none.safetensors"
    assert main(["export-qat", "--from", str(run), "--model", "tiny", "--out", str(auto)]) == 0
    assert capsys.readouterr().out.strip().endswith("; Q, K rotated: hadamard; K smoothed")
    assert main(["export-qat", "--from", str(run), "--model", "tiny", "--out", str(none), "--qk-rotation", "none",
                 "--k-smoothing", "off"]) == 0
    assert {k: read_qat_weights(auto).options[k] for k in both} == both
    assert trained_attention_options(auto) == {**both, "q_smoothing": False, "four_over_six": False}  # all recorded
    assert trained_attention_options(none) == {"qk_rotation": "none", "k_smoothing": False, "q_smoothing": False,
                                              "four_over_six": False}
    assert not {"qk_rotation", "k_smoothing"} & set(safe_open(str(none), "pt").metadata())  # read as before
    assert trained_attention_options(run / "final" / "transformer.safetensors") == both  # the config beside it
    plain = tmp_path / "plain.safetensors"
    save_file(load_file(str(run / "final" / "transformer.safetensors")), plain)
    assert trained_attention_options(plain) is None  # nothing says

    bogus = tmp_path / "bogus"  # a checkpoint whose config names values no mode takes: run without them
    bogus.mkdir()
    save_file(load_file(str(run / "final" / "transformer.safetensors")), bogus / "transformer.safetensors")
    (bogus / "config.yaml").write_text("attention:\n  options:\n    qk_rotation: spiral\n    k_smoothing: maybe\n")
    assert trained_attention_options(bogus) == {"qk_rotation": "spiral", "k_smoothing": "maybe"}
    assert trained_mode_options("attn_qat", bogus) == {}
    assert trained_mode_options("attn_qat", auto) == both and trained_mode_options("sage3", auto) == {}
    small = ["--model", "tiny", "--prompt", "p", "--height", "32", "--width", "32", "--frames", "5", "--steps", "2"]
    for weights, extra, said in ((auto, [], "attn_qat (Q, K rotated: hadamard; K smoothed) on"),
                                 (auto, ["--k-smoothing", "off"], "attn_qat (Q, K rotated: hadamard) on"),
                                 (auto, ["--qk-rotation", "none"], "attn_qat (K smoothed) on"),
                                 (none, ["--k-smoothing", "on"], "attn_qat (K smoothed) on"),
                                 (none, [], "attn_qat on"), (auto, ["--mode", "bf16"], "bf16 on")):
        out = tmp_path / f"v{len(list(tmp_path.glob('v*.mp4')))}.mp4"
        mode = [] if "--mode" in extra else ["--mode", "attn_qat"]
        assert main(["generate", *small, *mode, "--qat-checkpoint", str(weights), *extra, "--out", str(out)]) == 0
        assert f"attention    {said}" in capsys.readouterr().err, (weights, extra)

    # attnqat quality: a row of such weights in an FP4 mode runs them as trained, unless the row says otherwise
    from attnqat.cli import build_parser
    from attnqat.mini import quality_cli

    rows = [f"auto=attn_qat:{auto}", f"told=attn_qat,qk_rotation=none,k_smoothing=false:{auto}",
            f"none=attn_qat:{none}", f"exact=bf16:{auto}", f"run=nvfp4:{run}", "base=attn_qat,p_bwd=normalized"]
    argv = ["quality", "--model", "tiny", "--size", "5x32x32", "--device", "cpu", "--base-modes", "bf16,nvfp4",
            "--out", str(tmp_path / "q")] + [a for r in rows for a in ("--variant", r)]
    args = quality_cli.resolve_settings(build_parser("quality").parse_args(argv))
    assert {label: options for label, _, _, _, options in args.rows} == {
        "bf16": {}, "nvfp4": {}, "auto": both, "told": {"qk_rotation": "none", "k_smoothing": False}, "none": {},
        "exact": {}, "run": both, "base": {"p_bwd": "normalized"}}

    # the demo's Attn-QAT column runs such weights with their options, the other columns without
    from attnqat import demo
    from attnqat.demo import DemoEngine

    patched = []
    original = demo.patch_attention
    monkeypatch.setattr(demo, "patch_attention", lambda t, mode, **kw: patched.append(
        (mode, kw.get("qk_rotation"), kw.get("k_smoothing"))) or original(t, mode, **kw))
    for weights, options in ((auto, ("hadamard", True)), (none, (None, None))):
        patched.clear()
        engine = DemoEngine.load("tiny", qat_checkpoint=str(weights), device="cpu", dtype="fp32")
        engine.run("a red ball", modes=["attn_qat", "nvfp4"], height=32, width=32, frames=5, steps=1, seed=0,
                   out_dir=tmp_path / f"demo_{options[0]}")
        assert patched == [("bf16", None, None), ("attn_qat", *options), ("nvfp4", None, None)], patched
        said = "(Q, K rotated: hadamard; K smoothed, as its file records)"
        assert (said in engine.weights("attn_qat")) == (options[0] is not None)
        assert engine.weights("nvfp4") is None


@pytest.mark.parametrize("option, said", [("q_smoothing", "Q smoothed per 128-row block"),
                                          ("four_over_six", "Q, K, V block scales: Four Over Six")])
def test_switched_options_travel_with_their_weights(option, said, tmp_path, capsys):
    """A run trained with a switched attention option (attnqat.trained_options.SWITCHED) on: export-qat records it
    (unless its flag says off), and `attnqat generate` and `attnqat quality`'s rows run the weights with it unless
    told otherwise."""
    from attnqat.cli import build_parser
    from attnqat.mini import quality_cli
    from attnqat.pipelines.loading import trained_attention_options, trained_mode_options
    from attnqat.train import load_config, train
    from attnqat.trained_options import flag

    run = tmp_path / "run"
    train(load_config(Path(__file__).parents[1] / "configs" / "tiny.yaml",
                      [f"output_dir={run}", "log.progress=false", "train.max_steps=2", "train.warmup_steps=1",
                       "data.batch_size=1", "data.held_out=0", f"attention.options.{option}=true"]))
    assert trained_attention_options(run) == {option: True}
    auto, off = tmp_path / "auto.safetensors", tmp_path / "off.safetensors"
    assert main(["export-qat", "--from", str(run), "--model", "tiny", "--out", str(auto)]) == 0
    assert capsys.readouterr().out.strip().endswith(f"; {said}")
    assert main(["export-qat", "--from", str(run), "--model", "tiny", "--out", str(off), flag(option), "off"]) == 0
    assert read_qat_weights(auto).options[option] and not read_qat_weights(off).options[option]
    assert safe_open(str(auto), "pt").metadata()[option] == "true"
    assert option not in safe_open(str(off), "pt").metadata()  # files without it read as before
    assert trained_mode_options("attn_qat", auto) == {option: True} and trained_mode_options("attn_qat", off) == {}
    small = ["--model", "tiny", "--prompt", "p", "--height", "32", "--width", "32", "--frames", "5", "--steps", "2",
             "--mode", "attn_qat"]
    for weights, extra, words in ((auto, [], f"attn_qat ({said}) on"),
                                  (auto, [flag(option), "off"], "attn_qat on"),
                                  (off, [flag(option), "on"], f"attn_qat ({said}) on")):
        out = tmp_path / f"q{len(list(tmp_path.glob('q*.mp4')))}.mp4"
        assert main(["generate", *small, "--qat-checkpoint", str(weights), *extra, "--out", str(out)]) == 0
        assert f"attention    {words}" in capsys.readouterr().err, (weights, extra)
    rows = [f"auto=attn_qat:{auto}", f"told=attn_qat,{option}=false:{auto}", f"run=nvfp4:{run}"]
    argv = ["quality", "--model", "tiny", "--size", "5x32x32", "--device", "cpu", "--base-modes", "bf16",
            "--out", str(tmp_path / "qq")] + [a for r in rows for a in ("--variant", r)]
    args = quality_cli.resolve_settings(build_parser("quality").parse_args(argv))
    assert {label: options for label, _, _, _, options in args.rows} == {
        "bf16": {}, "auto": {option: True}, "told": {option: False}, "run": {option: True}}


# ---------------------------------------------------------------------------------------------- generate
@pytest.fixture
def spy_generation(monkeypatch):
    """The transformer's weights at each generation (CPU copies), in order."""
    from attnqat import demo
    from attnqat.pipelines import generate

    seen = []
    original = generate.generate_video

    def spy(pipe, *a, **kw):
        seen.append({k: v.detach().clone() for k, v in pipe.transformer.state_dict().items()})
        return original(pipe, *a, **kw)

    monkeypatch.setattr(generate, "generate_video", spy)  # what `attnqat generate` calls
    monkeypatch.setattr(demo, "generate_video", spy)  # the demo imported the name
    return seen


def _expected(shipped, qat: bool) -> dict[str, torch.Tensor]:
    _, tuned, base = shipped
    return {k: tuned[k].to(BF16).float() if qat and _attention(k) else v for k, v in base.items()}


def _same(state: dict, want: dict) -> bool:
    return set(state) == set(want) and all(torch.equal(state[k], want[k]) for k in want)


def test_generate_attn_qat_on_mini_runs_the_shipped_weights_and_says_so(installed, spy_generation, tmp_path, capsys):
    path = installed[0] / mini.MINI_QAT_WEIGHTS
    assert main(["generate", "--prompt", "a red ball", "--mode", "attn_qat", *SMALL,
                 "--out", str(tmp_path / "v.mp4")]) == 0
    err = capsys.readouterr().err
    assert f"weights      shipped QAT fine-tune {path}\n" in err
    assert _same(spy_generation[0], _expected(installed, qat=True))
    # the shipped folder given as a path is mini too
    assert main(["generate", "--prompt", "a red ball", "--model", str(installed[0]), "--mode", "attn_qat", *SMALL,
                 "--out", str(tmp_path / "w.mp4")]) == 0
    assert f"weights      shipped QAT fine-tune {path}\n" in capsys.readouterr().err
    assert _same(spy_generation[1], _expected(installed, qat=True))


def test_generate_runs_the_base_weights_with_qat_checkpoint_none_and_in_other_modes(installed, spy_generation,
                                                                                      tmp_path, capsys):
    assert main(["generate", "--prompt", "p", "--mode", "attn_qat", "--qat-checkpoint", "none", *SMALL,
                 "--out", str(tmp_path / "v.mp4")]) == 0
    assert "weights      base weights (--qat-checkpoint none)\n" in capsys.readouterr().err
    assert main(["generate", "--prompt", "p", "--mode", "nvfp4", *SMALL, "--out", str(tmp_path / "w.mp4")]) == 0
    err = capsys.readouterr().err
    assert "weights " not in err and "QAT" not in err
    assert all(_same(s, _expected(installed, qat=False)) for s in spy_generation) and len(spy_generation) == 2


def test_generate_without_shipped_weights_says_it_runs_the_base(monkeypatch, mini_base, tmp_path, capsys):
    monkeypatch.setattr(mini, "MINI_DIR", mini_base)
    assert main(["generate", "--prompt", "p", "--mode", "attn_qat", *SMALL, "--out", str(tmp_path / "v.mp4")]) == 0
    assert "weights      base weights (no QAT fine-tune installed)\n" in capsys.readouterr().err


def test_generate_refuses_shipped_weights_of_another_base_in_one_line(installed, monkeypatch, tmp_path, capsys):
    """Shipped QAT weights made for other base weights than the folder's transformer (here: a fingerprint of
    nothing) stop the run with one line that names the way out; --qat-checkpoint none still runs."""
    folder = tmp_path / "mini"
    shutil.copytree(installed[0], folder)
    tensors = load_file(str(folder / mini.MINI_QAT_WEIGHTS))
    (folder / mini.MINI_QAT_WEIGHTS).write_bytes(serialize(tensors, "0" * 64, "for another base"))
    monkeypatch.setattr(mini, "MINI_DIR", folder)
    assert main(["generate", "--prompt", "p", "--mode", "attn_qat", *SMALL, "--out", str(tmp_path / "v.mp4")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1 and "were made for other base weights (base fingerprint 000000000000" in err[0], err
    assert "--qat-checkpoint none" in err[0]
    assert main(["generate", "--prompt", "p", "--mode", "attn_qat", "--qat-checkpoint", "none", *SMALL,
                 "--out", str(tmp_path / "v.mp4")]) == 0


# ---------------------------------------------------------------------------------------------- the demo
def _demo_runs(engine, tmp_path):
    return engine.run("a red ball", modes=["attn_qat", "nvfp4"], height=32, width=32, frames=5, steps=1, seed=0,
                      out_dir=tmp_path)


def test_demo_attn_qat_column_runs_the_shipped_weights_and_the_others_the_base(installed, spy_generation, tmp_path):
    from attnqat.demo import DemoEngine

    engine = DemoEngine.load(device="cpu", dtype="fp32")
    assert engine.model == "mini" and engine.qat_shipped
    assert engine.label("attn_qat") == "Attn-QAT"
    assert engine.weights("attn_qat") == "the QAT fine-tune shipped with the model attn_qat.safetensors"
    runs = _demo_runs(engine, tmp_path)
    assert [r.mode for r in runs] == ["bf16", "attn_qat", "nvfp4"]
    assert [_same(s, _expected(installed, qat=True)) for s in spy_generation] == [False, True, False]
    assert [_same(s, _expected(installed, qat=False)) for s in spy_generation] == [True, False, True]
    assert (runs[1].label, runs[1].weights) == ("Attn-QAT", engine.weights("attn_qat"))
    assert runs[0].weights is None and runs[2].weights is None


def test_demo_explicit_checkpoint_wins_and_none_opts_out(installed, tiny_qat, tmp_path):
    from attnqat.demo import NO_CHECKPOINT_LABEL, DemoEngine

    folder, tuned, _ = installed
    explicit = folder.parent / "finetune.safetensors"  # the full fine-tune the shipped file was exported from
    engine = DemoEngine.load(device="cpu", dtype="fp32", qat_checkpoint=str(explicit))
    assert not engine.qat_shipped and engine.weights("attn_qat") == "QAT checkpoint finetune.safetensors"
    assert torch.equal(engine._weights["qat"]["proj_out.weight"], tuned["proj_out.weight"])  # the full file's
    plain = DemoEngine.load(device="cpu", dtype="fp32", qat_checkpoint="none")
    assert plain.qat_checkpoint is None and plain.label("attn_qat") == NO_CHECKPOINT_LABEL
    assert plain.weights("attn_qat") == "no QAT checkpoint: plain FP4 attention"


def test_app_checks_and_names_the_shipped_weights(installed, tmp_path):
    pytest.importorskip("gradio", reason="the demo needs gradio: pip install -e '.[app]'")

    import socket

    import gradio as gr

    from attnqat.demo import DemoEngine, demo_modes

    from attnqat import demo_app as app
    with socket.socket() as s:  # a free port, for check_args
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = app.parse_args(["--port", str(port), "--qat-checkpoint", "none"])
    assert app.check_args(args)[0] == ["bf16", *[m for m in demo_modes() if m != "bf16"]]  # "none" is no path
    engine = DemoEngine.load(device="cpu", dtype="fp32")
    demo = app.build_demo(engine, ["bf16", "attn_qat"], str(tmp_path))
    text = " ".join(str(b.value) for b in demo.blocks.values() if isinstance(b, gr.Markdown))
    assert "runs the QAT fine-tune shipped with the model (`attn_qat.safetensors`)" in text
    assert "--qat-checkpoint none" in text


# ------------------------------------------------------------------------------------------- quality
def test_quality_variant_takes_qat_weights(tiny_qat):
    from attnqat.pipelines import build_tiny_transformer
    from attnqat.mini.quality_cli import load_variants, parse_variant

    path, tuned = tiny_qat
    assert parse_variant(f"qat=attn_qat:{path}") == ("qat", "attn_qat", str(path), {})
    assert parse_variant(f"q=attn_qat, qk_rotation=hadamard ,p_bwd=normalized:{path}") == (
        "q", "attn_qat", str(path), {"qk_rotation": "hadamard", "p_bwd": "normalized"})
    assert parse_variant("s=sagebwd,smooth_k=false")[3] == {"smooth_k": False}
    for bad in ("q=attn_qat,qk_rotation", "q=attn_qat,qk_rotation=hadamard,qk_rotation=none", "q=bf16,qk_rotation=hadamard",
                "q=attn_qat,qk_rotation=random"):
        with pytest.raises(ValueError, match="--variant q"):
            parse_variant(bad)
    transformer = build_tiny_transformer()
    base = {k: v.clone() for k, v in transformer.state_dict().items()}
    variants, files = load_variants([("bf16", "bf16", None, None, {}),
                                     ("qat", "attn_qat", str(path), None, {"qk_rotation": "hadamard"})], transformer)
    assert variants[1].options == {"qk_rotation": "hadamard"} and variants[0].options == {}
    weights = variants[1].weights
    assert files == {"qat": str(path)} and set(weights) == set(base)
    assert all(torch.equal(weights[k], tuned[k].to(BF16) if _attention(k) else base[k]) for k in base)
    assert all(torch.equal(v, base[k]) for k, v in transformer.state_dict().items())


# ------------------------------------------------------------------------------------------- packaging
def test_package_data_and_folder_size_cover_the_qat_weights(shipped, tmp_path):
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    folder = shipped[0]
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["attnqat"]
    pkg = tmp_path / "attnqat"
    shutil.copytree(folder, pkg / "models" / "mini")
    matched = {str(Path(m).relative_to(pkg)) for pat in patterns for m in glob.glob(str(pkg / pat))}
    assert "models/mini/attn_qat.safetensors" in matched
    # the model (~18 MB here) and its QAT weights (~4 MB) each within their own limit
    qat_size = (folder / mini.MINI_QAT_WEIGHTS).stat().st_size
    model_size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) - qat_size
    assert mini.check_folder_size(folder) == model_size <= mini.MAX_FOLDER_BYTES  # the QAT weights: not counted
    big = pkg / "models" / "mini" / mini.MINI_QAT_WEIGHTS
    with open(big, "r+b") as f:
        f.truncate(mini.MAX_QAT_WEIGHTS_BYTES + 1)
    with pytest.raises(ValueError, match="over the 12 MB limit of shipped QAT weights"):
        mini.check_folder_size(pkg / "models" / "mini")
