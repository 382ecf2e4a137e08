"""train.save_attention: gradient checkpointing that keeps the attention outputs
(attnqat/train/student_teacher.py, block_checkpoint), on the tiny model (2 blocks) on CPU.

The gradients equal plain checkpointing's to the bit, in bf16 (SDPA) and in attn_qat (its Triton kernels, in the
interpreter, under bf16 autocast as `attnqat train` runs them); the self-attention forward runs once per block and
step instead of twice and the cross-attention (fewer keys than queries) is rerun, counted by a dispatch mode below
selective checkpointing's, which sees only the calls that really run; every trainable mode's forward is an op it
keeps; the config refuses it without gradient checkpointing.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from attnqat.kernels import attention, available_modes
from attnqat.pipelines import build_tiny_transformer
from attnqat.train import load_config, validate
from attnqat.train.student_teacher import (SAVED_ATTENTION_OPS, block_checkpoint, patch_for_training,
                                           saved_attention_ops)

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = 2  # the tiny model's
SDPA_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
AQ_FWD = torch.ops.attnqat.attn_qat_fwd.default
# Each mode's attention forwards in one forward of the tiny model on CPU, (op, "self" or "cross"): attn1 (the mode,
# 32 queries over 32 keys) and attn2 (the cross-attention, diffusers' SDPA over 8 text tokens) of every block.
# attn_qat runs its kernels (the interpreter) on the bf16 Q, K, V that autocast gives it.
MODES = {"bf16": (None, {(SDPA_CPU, "self"): BLOCKS, (SDPA_CPU, "cross"): BLOCKS}),
         "attn_qat": (torch.bfloat16, {(AQ_FWD, "self"): BLOCKS, (SDPA_CPU, "cross"): BLOCKS})}


class AttentionCalls(TorchDispatchMode):
    """Counts the calls of the attention ops that really run, as (op, "self" or "cross": fewer keys than queries), in
    the forward and, after :meth:`start_backward`, in the backward. Entered outside the checkpoints, it sits below
    selective checkpointing's dispatch modes: a call they answer from their cache never reaches it. With ``poison``,
    what the self-attention calls return in the backward is NaN, so a backward that reran one and used its result
    gives NaN gradients (the cross-attention is meant to rerun: its results stay)."""

    def __init__(self, poison: bool = False):
        super().__init__()
        self.ops, self.poison = set(saved_attention_ops()), poison
        self.forward_calls, self.backward_calls = Counter(), Counter()
        self.calls = self.forward_calls

    def start_backward(self):
        self.calls = self.backward_calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func not in self.ops:
            return out
        kind = "cross" if args[1].shape[-2] < args[0].shape[-2] else "self"  # (B, H, L, D) query, key
        self.calls[func, kind] += 1
        if not self.poison or self.calls is self.forward_calls or kind == "cross":
            return out
        return tree_map(lambda t: torch.full_like(t, float("nan")) if isinstance(t, torch.Tensor)
                        and t.is_floating_point() else t, out)


def step(mode: str, save_attention: bool, poison: bool):
    """One forward and backward of the tiny model in ``mode`` under diffusers' gradient checkpointing, with
    block_checkpoint if ``save_attention``, counted by :class:`AttentionCalls` (``poison``: in the
    backward). Returns (the gradients, the AttentionCalls)."""
    autocast, _ = MODES[mode]
    torch.manual_seed(0)
    model = build_tiny_transformer().train()
    patch_for_training(model, mode)
    model.enable_gradient_checkpointing(block_checkpoint(save_attention))
    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(1, 16, 2, 8, 8, generator=g), timestep=torch.tensor([500.0]),
                  encoder_hidden_states=torch.randn(1, 8, 32, generator=g), return_dict=False)
    with AttentionCalls(poison) as calls:
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            out = model(**inputs)[0]
        weights = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
        calls.start_backward()
        (out.float() * weights).sum().backward()
    return {n: p.grad for n, p in model.named_parameters()}, calls


@pytest.mark.parametrize("mode", MODES)
def test_gradients_equal_plain_checkpointing_and_the_attention_runs_once(mode):
    """Plain checkpointing runs each attention forward twice per block and step (forward, recompute). With
    save_attention the self-attention runs once and only the cross-attention reruns, and the gradients equal plain
    checkpointing's bit for bit though everything a self-attention op would return in the backward is NaN. The
    control: plain checkpointing under that poison gives NaN."""
    _, forward_calls = MODES[mode]
    reference, calls = step(mode, save_attention=False, poison=False)
    assert calls.forward_calls == forward_calls and calls.backward_calls == forward_calls
    assert all(g is not None and torch.isfinite(g).all() for g in reference.values())
    assert sum(bool(g.abs().sum() > 0) for g in reference.values()) > len(reference) // 2

    saved, calls = step(mode, save_attention=True, poison=True)
    assert calls.forward_calls == forward_calls
    assert calls.backward_calls == {key: n for key, n in forward_calls.items() if key[1] == "cross"}
    for name, g in reference.items():
        assert torch.equal(saved[name], g), name

    poisoned, _ = step(mode, save_attention=False, poison=True)
    assert any(torch.isnan(g).any() for g in poisoned.values())


def test_plain_checkpointing_runs_the_inference_forward_first_and_the_gradients_stay(monkeypatch):
    """Plain checkpointing discards what the forward saves and recomputes it in the backward: attn_qat's first pass
    runs its inference forward (no O', placeholders saved: kernels._common.saved_tensors_recomputed), the recompute
    its training forward, and the output and gradients equal those of the same model trained without
    checkpointing (the training forward once), bit for bit, in the interpreter. Without the context (a plain
    torch checkpoint) every pass is the training forward."""
    from attnqat.kernels import attn_qat as aq

    flags = []
    real = aq.attn_qat_fwd
    monkeypatch.setattr(aq, "attn_qat_fwd", lambda *a: flags.append(a[5]) or real(*a))  # a[5]: training

    def run(checkpointing):
        torch.manual_seed(0)
        model = build_tiny_transformer().train()
        patch_for_training(model, "attn_qat")
        if checkpointing is not None:
            model.enable_gradient_checkpointing(checkpointing)
        g = torch.Generator().manual_seed(1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(hidden_states=torch.randn(1, 16, 2, 8, 8, generator=g), timestep=torch.tensor([500.0]),
                        encoder_hidden_states=torch.randn(1, 8, 32, generator=g), return_dict=False)[0]
        (out.float() * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
        return out.detach(), {n: p.grad for n, p in model.named_parameters()}

    out, grads = run(None)
    assert flags == [True] * BLOCKS
    flags.clear()
    c_out, c_grads = run(block_checkpoint(False))
    assert flags == [False] * BLOCKS + [True] * BLOCKS  # the forward's passes, then the backward's recomputes
    assert torch.equal(c_out, out)
    for name, g in grads.items():
        assert torch.equal(c_grads[name], g), name
    assert sum(bool(g.abs().sum() > 0) for g in grads.values()) > len(grads) // 2
    flags.clear()

    def torch_checkpoint(block, *args):
        return torch.utils.checkpoint.checkpoint(block.__call__, *args, use_reentrant=False)

    run(torch_checkpoint)
    assert flags == [True] * (2 * BLOCKS)


@pytest.mark.parametrize("mode", available_modes(lambda m: m.trainable))
def test_every_trainable_mode_runs_an_op_it_keeps(mode):
    """Each trainable mode's forward under grad (on the Triton interpreter, as on a GPU) runs an op of
    saved_attention_ops(): a mode with a new forward op must add it to SAVED_ATTENTION_OPS."""
    q, k, v = (torch.randn(1, 1, 16, 64, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    with AttentionCalls() as calls:
        attention(q, k, v, mode)
    assert sum(calls.forward_calls.values()) == 1, (mode, calls.forward_calls)


def test_the_kept_ops_include_every_attnqat_training_forward():
    """An attnqat op of SAVED_ATTENTION_OPS always exists (a renamed one would be skipped as a missing SDPA backend
    is); so do the SDPA backends of every build (flash, efficient, the CPU's)."""
    found = {op._schema.name for op in saved_attention_ops()}
    assert {n for n in SAVED_ATTENTION_OPS if n.startswith("attnqat::")} <= found
    assert {"aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
            "aten::_scaled_dot_product_flash_attention_for_cpu"} <= found


def test_config_refuses_save_attention_without_checkpointing(tmp_path):
    def checked(*overrides):
        return validate(load_config(ROOT / "configs" / "tiny.yaml", [f"output_dir={tmp_path}", *overrides]))

    with pytest.raises(ValueError, match="^train.save_attention needs train.gradient_checkpointing: ") as e:
        checked("train.gradient_checkpointing=false", "train.save_attention=true")
    assert "\n" not in str(e.value)
    assert checked("train.save_attention=true").config.train.save_attention
    assert not checked("train.gradient_checkpointing=false").config.train.save_attention


@pytest.mark.parametrize("save_attention", [False, True])
def test_trainer_checkpoints_the_student_as_configured(tmp_path, save_attention):
    from attnqat.train import Trainer

    cfg = load_config(ROOT / "configs" / "tiny.yaml", [f"output_dir={tmp_path}", "data.held_out=0",
                                                       f"train.save_attention={str(save_attention).lower()}"])
    trainer = Trainer(cfg)
    student = trainer.accelerator.unwrap_model(trainer.student)  # diffusers checkpoints each of its blocks with
    func = student._gradient_checkpointing_func                # this function
    assert student.gradient_checkpointing
    assert func.__qualname__ == block_checkpoint().__qualname__, func
    assert func.saves_attention is save_attention


def test_bench_train_step_says_which_checkpointing_it_used(monkeypatch, capsys):
    """bench/train_step.py --save-attention: the printed table and the docs section it would write say so;
    with --no-checkpointing it is refused."""
    import sys

    from conftest import load_script

    bench = load_script(ROOT / "bench" / "train_step.py", "bench_train_step")
    report = sys.modules["_report"]
    written = []
    monkeypatch.setattr(report, "update_section", lambda name, md: written.append(md))
    assert bench.main(["--tiny", "--modes", "bf16", "--save-attention", "--write"]) == 0
    said = "gradient checkpointing on every block, keeping the attention outputs"
    assert said in capsys.readouterr().out and said in written[0]
    assert bench.main(["--tiny", "--modes", "bf16", "--write"]) == 0
    assert "gradient checkpointing on every block (the backward recomputes the attention)" in written[1]
    with pytest.raises(SystemExit):
        bench.parse_args(["--save-attention", "--no-checkpointing"])
