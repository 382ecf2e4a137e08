"""LoRA-QAT (``train.trainable: lora``, attnqat/pipelines/lora.py, student_teacher.AdapterOffTeacher) on the tiny
model (CPU): only the adapter trains, the teacher is the base model with the reference attention, resume is exact,
the LoRA file loads through diffusers' ``load_lora_weights`` and attnqat's ``--qat-checkpoint`` and reproduces the
trained student, export-qat merges it, and the config's refusals are one line each.

The FP4 attention runs its PyTorch reference path (TRITON_INTERPRET off, as in tests/test_train.py).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from attnqat.kernels import REFERENCE_MODE
from attnqat.pipelines import build_tiny_pipeline, build_tiny_transformer, load_qat_checkpoint, patch_attention
from attnqat.pipelines.loading import read_qat_checkpoint
from attnqat.pipelines.lora import LORA_FILE
from attnqat.pipelines.processor import attention_modes
from attnqat.train import load_config, train, validate
from attnqat.train.loop import Trainer, _train
from attnqat.train.student_teacher import FeatureCapture

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"
# rank 8 on the default targets (attention projections and FFN linears of both blocks: 20 layers); a large lr so that
# 4 steps move the adapter far from its start (B starts at zero)
LORA = ["train.trainable=lora", "train.lora.rank=8", "train.lora.alpha=16", "train.lr=1e-3", "train.max_steps=4",
        "checkpoint.every=2", "data.batch_size=2", "data.held_out=2", "train.lr_schedule=cosine", "log.progress=false"]


@pytest.fixture(autouse=True)
def reference_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


def _config(out, *overrides):
    return load_config(TINY, [f"output_dir={out}", *LORA, *overrides])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 4-step LoRA run (its Trainer kept for inspection), and the same run stopped after step 2 and resumed."""
    root = tmp_path_factory.mktemp("lora")
    with pytest.MonkeyPatch.context() as m:
        m.setenv("TRITON_INTERPRET", "0")
        cfg = _config(root / "full")
        trainer = Trainer(cfg)
        full = _train(trainer, cfg, None, None, False)
        first = train(_config(root / "cut"), stop_after=2)
        rest = train(_config(root / "cut"), resume="auto")
    return root, trainer, full, first.losses + rest.losses


def _inputs(seed: int, batch: int = 2) -> dict:
    g = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(batch, 16, 2, 8, 8, generator=g), timestep=torch.tensor([300.0, 800.0]),
                encoder_hidden_states=torch.randn(batch, 8, 32, generator=g), return_dict=False)


def _student(trainer):
    return trainer.accelerator.unwrap_model(trainer.student)


def test_only_the_adapter_trains(run):
    """The adapter's weights are all that is trainable, fp32, and moved; every weight of the base is bit for bit the
    tiny model's after 4 steps; the checkpoint's state holds the adapter alone."""
    root, trainer, full, _ = run
    student = _student(trainer)
    names = trainer.trainable_names
    assert len(names) == 2 * 20 and all(".lora_A." in n or ".lora_B." in n for n in names)
    params = dict(student.named_parameters())
    assert all(params[n].dtype == torch.float32 and params[n].requires_grad for n in names)
    assert all(params[n].abs().max() > 0 for n in names if ".lora_B." in n)  # B started at zero
    base = {k.replace(".base_layer.", "."): v for k, v in student.state_dict().items() if ".lora_" not in k}
    fresh = build_tiny_transformer().state_dict()
    assert base.keys() == fresh.keys()
    assert all(torch.equal(base[k], fresh[k]) for k in fresh)
    assert not any(p.requires_grad for n, p in params.items() if n not in set(names))
    state = load_file(str(root / "full" / "checkpoints" / "step-0000004" / "state" / "model.safetensors"))
    assert sorted(state) == names
    assert len(set(full.losses)) == 4


def test_resume_reproduces_the_uninterrupted_run(run):
    root, _, full, resumed = run
    assert resumed == pytest.approx(full.losses, rel=1e-6, abs=0)
    a, b = (load_file(str(root / name / "final" / LORA_FILE)) for name in ("full", "cut"))
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=0, atol=1e-6) for k in a)


def test_the_teacher_is_the_base_model_with_reference_attention(run):
    """The teacher's output and block features equal a separate tiny model's with bf16 attention bit for bit; after
    it, and after a teacher forward that raises, the student is back: FP4 processors, the adapter on and trainable."""
    _, trainer, _, _ = run
    student, teacher = _student(trainer), trainer.teacher
    reference = build_tiny_transformer()
    patch_attention(reference, REFERENCE_MODE)
    ref_cap = FeatureCapture(reference)
    x = _inputs(1)
    with torch.no_grad():
        before = student(**x)[0]
        with trainer.t_cap.capturing() as t_feat, trainer.s_cap.capturing() as s_feat:
            out = teacher(**x)[0]
        with ref_cap.capturing() as r_feat:
            ref = reference(**x)[0]
        after = student(**x)[0]
    assert torch.equal(out, ref)
    assert sorted(t_feat) == sorted(r_feat) == [0, 1] and all(torch.equal(t_feat[i], r_feat[i]) for i in r_feat)
    assert (before - ref).abs().max() > 1e-3 * ref.abs().max()  # the student differs: adapter and FP4 attention
    assert torch.equal(after, before)

    def student_is_back():
        assert set(attention_modes(student).values()) == {"attn_qat", "diffusers"}
        assert all(p.requires_grad for n, p in student.named_parameters() if n in set(trainer.trainable_names))

    student_is_back()
    handle = student.blocks[1].register_forward_hook(lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    try:
        with pytest.raises(RuntimeError, match="boom"), torch.no_grad():
            teacher(**x)
    finally:
        handle.remove()
    student_is_back()
    with torch.no_grad():
        assert torch.equal(student(**x)[0], before)


def test_the_lora_file_reproduces_the_student(run, capsys):
    """final/'s LoRA file: diffusers' load_lora_weights into a fresh tiny pipeline, and attnqat's --qat-checkpoint
    (fused: load_qat_checkpoint, read_qat_checkpoint), give the trained student's output on fresh inputs; the base
    alone does not. `attnqat generate --qat-checkpoint` takes the run folder."""
    root, trainer, _, _ = run
    final = root / "full" / "final"
    x = _inputs(2)
    with torch.no_grad():
        want = _student(trainer)(**x)[0]
    pipe = build_tiny_pipeline()
    patch_attention(pipe.transformer, "attn_qat")
    with torch.no_grad():
        base = pipe.transformer(**x)[0]
        pipe.load_lora_weights(str(final))
        adapted = pipe.transformer(**x)[0]
    assert (base - want).abs().max() > 1e-3 * want.abs().max()  # the adapter matters
    torch.testing.assert_close(adapted, want, rtol=1e-5, atol=1e-6)

    fused = build_tiny_transformer()
    load_qat_checkpoint(fused, root / "full")  # the run folder: its final/
    patch_attention(fused, "attn_qat")
    assert not any("lora" in k for k in fused.state_dict())  # fused, no adapter left behind
    with torch.no_grad():
        torch.testing.assert_close(fused(**x)[0], want, rtol=1e-5, atol=1e-6)
    plain = build_tiny_transformer()
    state = read_qat_checkpoint(plain, final / LORA_FILE)
    assert all(torch.equal(v, build_tiny_transformer().state_dict()[k]) for k, v in plain.state_dict().items())
    assert all(torch.equal(state[k], v) for k, v in fused.state_dict().items())

    from attnqat.cli import main
    capsys.readouterr()
    assert main(["generate", "--prompt", "x", "--model", "tiny", "--mode", "attn_qat", "--qat-checkpoint",
                 str(root / "full"), "--steps", "1", "--height", "32", "--width", "32", "--frames", "5",
                 "--out", str(root / "v.mp4")]) == 0
    assert (root / "v.mp4").stat().st_size > 0


def test_export_qat_merges_the_lora(run, tmp_path):
    """export-qat of a LoRA run: the adapted layers' weights with the LoRA fused in, in bf16, nothing else."""
    from attnqat.pipelines.qat_export import export_qat_weights

    root, _, _, _ = run
    written = export_qat_weights(root / "full", "tiny", tmp_path / "qat.safetensors")
    fused = load_qat_checkpoint(build_tiny_transformer(), root / "full" / "final").state_dict()
    adapted = {k.replace("transformer.", "").split(".lora_")[0] + ".weight"
               for k in load_file(str(root / "full" / "final" / LORA_FILE))}
    assert set(written.tensors) == adapted
    assert all(torch.equal(v, fused[k].to(torch.bfloat16)) for k, v in written.tensors.items())


def test_a_lora_of_another_model_is_refused(run, tmp_path):
    """A LoRA naming a layer the transformer lacks, or of another width, is one line (diffusers alone would skip such
    keys with a warning), and the transformer is left as it was."""
    from attnqat.errors import CheckpointMismatchError

    root, _, _, _ = run
    good = load_file(str(root / "full" / "final" / LORA_FILE))
    key = next(k for k in good if k.endswith("lora_A.weight"))
    for name, bad in (("extra", {**good, key.replace("blocks.0", "blocks.7"): good[key].clone()}),
                      ("narrow", {**good, key: good[key][:, :-1].contiguous()})):
        save_file(bad, str(tmp_path / f"{name}.safetensors"))
        t = build_tiny_transformer()
        with pytest.raises(CheckpointMismatchError, match="does not match this transformer") as e:
            load_qat_checkpoint(t, tmp_path / f"{name}.safetensors")
        assert "\n" not in str(e.value)
        assert all(torch.equal(v, build_tiny_transformer().state_dict()[k]) for k, v in t.state_dict().items())


@pytest.mark.parametrize("override, message", [
    ("train.lora.rank=0", "train.lora.rank must be >= 1"),
    ("train.lora.rank=129", "train.lora.rank 129 > 128"),
    ("train.lora.alpha=-1", "train.lora.alpha must be > 0"),
    ("train.lora.dropout=1", r"train.lora.dropout must be in \[0, 1\)"),
    ("train.lora.target_modules=[]", "train.lora.target_modules must be a list of distinct module names"),
    ("train.lora.target_modules=[to_q, to_q]", "train.lora.target_modules must be a list of distinct"),
    ("train.lora.target_modules=[to_qq]", "'to_qq' names no layer"),
    ("train.lora.target_modules=[attn1]", "selects blocks.0.attn1 .WanAttention., not a linear layer"),
    ("train.lora.ranks=4", "unknown config key train.lora.ranks"),
    ("train.teacher_dtype=bf16", "needs train.mixed_precision 'bf16'"),
])
def test_config_refusals_are_one_line(tmp_path, override, message):
    with pytest.raises(ValueError, match=message) as e:
        validate(_config(tmp_path, override))
    assert "\n" not in str(e.value)


def test_without_peft_a_lora_run_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` raises ImportError
    validate(load_config(TINY, [f"output_dir={tmp_path}"]))  # other runs do not need it
    with pytest.raises(ImportError, match="train.trainable 'lora' needs peft, which is not installed: pip install "
                                          "peft") as e:
        validate(_config(tmp_path))
    assert "\n" not in str(e.value)
