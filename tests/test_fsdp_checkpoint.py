"""Gradient checkpointing under FSDP2 with bf16 compute (student_teacher.block_checkpoint, fsdp_cast_inputs), on
two gloo processes (CPU), the tiny model: every block and the root under fully_shard with
MixedPrecisionPolicy(param_dtype=bf16), as accelerate's FSDP2 prepare and bench/train_step_sp.py wrap the student.

torch before 2.13 does not cast a block's inputs when the backward reruns it (pytorch#159359): the rotary embedding
reached the forward in bf16 and the recompute in fp32, and the whole Wan 14B step stopped in its first backward on
H200s (torch 2.11). This torch casts there, so the test puts the old behaviour back (the hook's cast skipped while
FSDP is in its pre-backward state) and checks that:
- diffusers' own checkpointing fails under it as the H200 run did (the emulation is the bug);
- block_checkpoint's gradients are those of the same model without checkpointing, bit for bit, with and without
  save_attention, under the old behaviour and under this torch's;
- fsdp_cast_inputs casts floating tensors, nested ones too, to the policy's dtype, leaves others alone, and leaves
  a module that is no FSDP2 module, or whose policy casts nothing, as it is.
"""
from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_thread")


@contextmanager
def cast_skipped_in_recompute():
    """FSDP2's pre-forward hook as torch < 2.13 has it: no input cast while the backward reruns a block."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    original = FSDPState._cast_forward_inputs

    def cast(self, args, kwargs):
        if self._training_state == TrainingState.PRE_BACKWARD:
            return args, kwargs
        return original(self, args, kwargs)

    FSDPState._cast_forward_inputs = cast
    try:
        yield
    finally:
        FSDPState._cast_forward_inputs = original


def _model(checkpointing):
    """The tiny transformer under fully_shard (bf16 compute over fp32 weights), seeded alike on every process;
    ``checkpointing``: None (none), "diffusers" (its default function) or block_checkpoint's save_attention."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from attnqat.pipelines import build_tiny_transformer
    from attnqat.train.student_teacher import block_checkpoint, patch_for_training

    torch.manual_seed(0)
    model = build_tiny_transformer().float()
    patch_for_training(model, "bf16", "self")
    if checkpointing == "diffusers":
        model.enable_gradient_checkpointing()
    elif checkpointing is not None:
        model.enable_gradient_checkpointing(block_checkpoint(save_attention=checkpointing))
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=bf16)
    fully_shard(model, mp_policy=bf16)
    return model


def _grads(checkpointing) -> dict[str, torch.Tensor]:
    """Every weight's gradient (this process's shard) after one forward and backward of the same inputs."""
    model = _model(checkpointing)
    g = torch.Generator().manual_seed(1)
    out = model(hidden_states=torch.randn(2, 16, 2, 8, 8, generator=g), timestep=torch.tensor([500.0, 120.0]),
                encoder_hidden_states=torch.randn(2, 8, 32, generator=g), return_dict=False)[0]
    out.float().square().mean().backward()
    return {n: p.grad.to_local().clone() for n, p in model.named_parameters()}


def _casts() -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from attnqat.train.student_teacher import fsdp_cast_inputs

    args = (torch.ones(2), (torch.zeros(3, dtype=torch.float64), torch.arange(3)), 7, None)
    casting = fully_shard(torch.nn.Linear(2, 2), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    inert = fully_shard(torch.nn.Linear(2, 2), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                             cast_forward_inputs=False))
    no_dtype = fully_shard(torch.nn.Linear(2, 2))
    cast = fsdp_cast_inputs(casting, args)
    return {"cast": [str(cast[0].dtype), str(cast[1][0].dtype), str(cast[1][1].dtype), cast[2], cast[3]],
            "values": cast[0].float().tolist() == [1.0, 1.0],
            "untouched": [fsdp_cast_inputs(m, args) is args for m in (inert, no_dtype, torch.nn.Linear(2, 2))]}


def _rank(rank: int) -> dict:
    reference = _grads(None)
    result = {"casts": _casts(), "equal": {}}
    with cast_skipped_in_recompute():
        try:
            _grads("diffusers")
            result["old_torch_diffusers"] = "ran"
        except torch.utils.checkpoint.CheckpointError as e:
            result["old_torch_diffusers"] = str(e).splitlines()[0]
        for save in (False, True):
            grads = _grads(save)
            result["equal"][f"old torch, save_attention={save}"] = all(
                torch.equal(grads[n], reference[n]) for n in reference)
    grads = _grads(False)
    result["equal"]["this torch"] = all(torch.equal(grads[n], reference[n]) for n in reference)
    result["zero"] = [n for n, g in reference.items() if g.numel() and not bool(g.abs().sum() > 0)]
    return result


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from conftest import gloo_ranks

    return gloo_ranks(_rank, tmp_path_factory.mktemp("fsdp_checkpoint"), "the FSDP2 checkpointing processes")


def test_the_emulated_old_torch_fails_as_the_h200_run_did(ranks):
    for r in ranks:
        assert "different metadata" in r["old_torch_diffusers"], r["old_torch_diffusers"]


def test_block_checkpoint_gradients_equal_no_checkpointing(ranks):
    for r in ranks:
        assert not r["zero"], r["zero"]
        assert r["equal"] and all(r["equal"].values()), r["equal"]


def test_fsdp_cast_inputs(ranks):
    for r in ranks:
        assert r["casts"]["cast"] == ["torch.bfloat16", "torch.bfloat16", "torch.int64", 7, None]
        assert r["casts"]["values"]
        assert r["casts"]["untouched"] == [True, True, True]
