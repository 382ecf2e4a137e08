"""train.optimizer (attnqat/train/optimizers.py) on the CPU: adamw8bit, torchao's AdamW8bit with row-aligned blocks,
a plain-tensor state_dict and a float learning rate.

- Its moments are 8-bit codes with one fp32 scale per block of a row (no block straddles two rows: FSDP shards whole
  rows), fp32 for vectors; for Wan 2.1 14B's shapes that is 2.03 bytes a weight of optimizer state instead of 8.
- It steps as torch's AdamW does, up to its 8-bit moments (the reference: torch.optim.AdamW on the same weights and
  gradients, weight decay large enough to show).
- Its state_dict holds uint8 codes and fp32 scales, stored through the checkpoint's safetensors and read back into a
  fresh optimizer, which then steps bit for bit as the uninterrupted one (dequantizing and quantizing again, the
  obvious alternative, changes codes); a training run stopped and resumed equals the uninterrupted one.
- Another optimizer's state is refused either way, and the config's refusals are one line each.
The 2-process FSDP2 checkpoints (sharded and resharded) are in tests/test_sharded_checkpoint.py.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from attnqat.train import checkpoint as ck
from attnqat.train import load_config, train, validate
from attnqat.train.checkpoint import CheckpointError
from attnqat.train.optimizers import block_size, build, check_sharding

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"
# odd shapes on purpose: rows of 256, 128 and 64 values (blocks of each), a conv weight, vectors, a small matrix
SHAPES = [(64, 256), (128, 128), (32, 5, 2, 2, 16), (256,), (8, 8)]

try:
    import torchao  # noqa: F401
    HAVE_TORCHAO = True
except ImportError:
    HAVE_TORCHAO = False
needs_torchao = pytest.mark.skipif(not HAVE_TORCHAO, reason="needs torchao (pip install torchao; the test extra has it)")


@pytest.fixture(autouse=True)
def reference_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the FP4 reference path (see tests/test_train.py)


def weights(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]  # weights of ~1: decay shows


def steps(optimizer, params, n: int, seed: int = 1, start: int = 0) -> None:
    """``n`` optimizer steps on gradients drawn from ``seed`` (step i's scale grows with i: moments that lag it)."""
    for i in range(start, start + n):
        g = torch.Generator().manual_seed(seed * 1000 + i)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * 0.1 * (i + 1)
        optimizer.step()


def adamw8bit(params, **kw):
    return build("adamw8bit", params, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, **kw)


@needs_torchao
def test_moments_are_8bit_in_blocks_within_rows():
    from torchao.optim.subclass_8bit import OptimState8bit

    params = weights()
    opt = adamw8bit(params)
    steps(opt, params, 1)
    for p in params:
        block = block_size(p)
        for key in ("exp_avg", "exp_avg_sq"):
            s = opt.state[p][key]
            if block is None:  # vectors and matrices under 4096 values: fp32, as torchao keeps them
                assert type(s) is torch.Tensor and s.dtype == torch.float32 and (p.dim() == 1 or p.numel() < 4096)
                continue
            assert isinstance(s, OptimState8bit) and s.codes.dtype == torch.uint8 and s.codes.shape == p.shape
            assert s.block_size == block and (p.numel() // p.shape[0]) % block == 0  # a block never spans two rows
    assert [block_size(p) for p in params] == [256, 128, 64, None, None]
    # Wan 2.1 14B (on the meta device): all but its vectors 8-bit, 2.03 bytes a weight of optimizer state, not 8
    from diffusers import WanTransformer3DModel

    from attnqat.pipelines.wan_configs import WAN21_14B_TRANSFORMER_CONFIG

    with torch.device("meta"):
        wan = WanTransformer3DModel(**WAN21_14B_TRANSFORMER_CONFIG)
    total = sum(p.numel() for p in wan.parameters())
    state = sum(2 * (p.numel() + 4 * p.numel() // block_size(p)) if block_size(p) else 8 * p.numel()
                for p in wan.parameters())
    fp32 = sum(p.numel() for p in wan.parameters() if block_size(p) is None)
    assert total == 14_288_491_584 and fp32 / total < 3e-4 and 2.03 < state / total < 2.04


@needs_torchao
def test_steps_as_adamw_up_to_its_8bit_moments():
    """Six steps from the same weights and gradients as torch's AdamW (lr 1e-2, weight decay 0.1 on weights of ~1:
    the decay alone moves them 1e-3 a step, more than the 8-bit error): the 8-bit moments' weights within 5% of
    AdamW's movement (measured 1.6-1.9%), the fp32 ones within 1e-4 of it (measured 1e-5: fp32 rounding)."""
    a, b, start = weights(), weights(), weights()
    steps(adamw8bit(a), a, 6)
    steps(torch.optim.AdamW(b, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1), b, 6)
    for x, y, w0 in zip(a, b, start):
        moved = (y - w0).abs().max().item()
        bound = 0.05 if block_size(x) else 1e-4
        assert moved > 0.05 and (x - y).abs().max().item() <= bound * moved, (tuple(x.shape), moved)
        assert not torch.equal(x, y) or block_size(x) is None


@needs_torchao
def test_state_dict_is_plain_tensors_that_resume_bit_for_bit(tmp_path):
    """The state as a full checkpoint holds it (get_optimizer_state_dict, flatten_optimizer, safetensors and
    optimizer.json, then set_optimizer_state_dict, as the Trainer saves and loads) into a fresh optimizer over other
    weights set to these: four more steps give the uninterrupted run's weights and moments bit for bit, and the
    learning rate stays a float that a scheduler and JSON hold. The alternative of saving the dequantized moments
    and quantizing them again on load changes codes (a block whose largest magnitude is negative has no code
    for -1)."""
    import json

    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    from torchao.optim.subclass_8bit import OptimState8bit

    full = StateDictOptions(full_state_dict=True)
    model = torch.nn.ParameterList(weights())
    opt = adamw8bit(list(model))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    for i in range(3):
        steps(opt, list(model), 1, start=i)
        sched.step()
    sd = get_optimizer_state_dict(model, opt, options=full)
    assert all(type(v) is torch.Tensor for e in sd["state"].values() for v in e.values())  # no tensor subclass
    assert sd["state"]["0"]["exp_avg_codes"].dtype == torch.uint8 and sd["state"]["0"]["exp_avg_scales"].shape == (64, 1)
    assert type(sd["param_groups"][0]["lr"]) is float and "exp_avg" in sd["state"]["3"]  # the vector's fp32 moment
    tensors, structure = ck.flatten_optimizer(sd)
    ck.write_tensors(tmp_path / "optimizer.safetensors", tensors)
    ck.write_json(tmp_path / "optimizer.json", structure)
    saved = ck.unflatten_optimizer(load_file(str(tmp_path / "optimizer.safetensors")),
                                   json.loads((tmp_path / "optimizer.json").read_text()))

    resumed = torch.nn.ParameterList(weights(seed=5))
    with torch.no_grad():
        for r, p in zip(resumed, model):
            r.copy_(p)
    opt2 = adamw8bit(list(resumed))
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 1.0 / (1 + s))
    set_optimizer_state_dict(resumed, opt2, saved, options=full)
    sched2.load_state_dict(sched.state_dict())
    for i in range(3, 7):
        for o, s, ps in ((opt, sched, list(model)), (opt2, sched2, list(resumed))):
            steps(o, ps, 1, start=i)
            s.step()
    assert all(torch.equal(x, y) for x, y in zip(model, resumed))
    for p, q in zip(model, resumed):
        assert opt.state[p].keys() == opt2.state[q].keys()
        for key, s in opt.state[p].items():
            t = opt2.state[q][key]
            assert type(s) is type(t) and torch.equal(*(x.codes if isinstance(x, OptimState8bit) else x for x in (s, t)))
    # dequantize + quantize again is not the saved state
    changed = 0
    for p in model:
        s = opt.state[p]["exp_avg"]
        if isinstance(s, OptimState8bit):
            again = OptimState8bit.zeros(s.shape, True, s.block_size, dtype=s.dtype)
            again.copy_(s.dequantize())
            changed += int((again.codes != s.codes).sum())
    assert changed > 0


@needs_torchao
def test_another_optimizers_state_is_refused():
    """adamw8bit's state into AdamW (directly, and as torch's full-state load hands it over: merged into AdamW's own
    keys), AdamW's into adamw8bit, and a state holding both kinds of moment for one weight: each a one-line
    CheckpointError before anything loads."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    model8, model32 = torch.nn.Linear(256, 64), torch.nn.Linear(256, 64)
    opt8 = adamw8bit(list(model8.parameters()))
    opt32 = build("adamw", model32.parameters(), lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    for model, opt in ((model8, opt8), (model32, opt32)):
        model(torch.randn(3, 256)).sum().backward()
        opt.step()
    before = [p.detach().clone() for p in model32.parameters()], {k: v.clone() for k, v in
                                                                   opt32.state[model32.weight].items()}
    refusals = [(lambda: opt32.load_state_dict(opt8.state_dict()), "'adamw8bit''s \\(8-bit moments\\), this run's is"),
                (lambda: set_optimizer_state_dict(model32, opt32, get_optimizer_state_dict(
                    model8, opt8, options=StateDictOptions(full_state_dict=True)),
                    options=StateDictOptions(full_state_dict=True)), "this run's is 'adamw'"),
                (lambda: opt8.load_state_dict(opt32.state_dict()), r"keeps fp32 moments for a weight of shape \(64, 256\)")]
    both = opt8.state_dict()
    both["state"][0]["exp_avg"] = torch.zeros(64, 256)
    refusals.append((lambda: opt8.load_state_dict(both), "keeps fp32 moments"))
    for load, match in refusals:
        with pytest.raises(CheckpointError, match=match) as e:
            load()
        assert "\n" not in str(e.value) and "resume with the optimizer it was trained with" in str(e.value)
    assert all(torch.equal(a, b) for a, b in zip(before[0], model32.parameters()))
    assert all(torch.equal(v, opt32.state[model32.weight][k]) for k, v in before[1].items())


@needs_torchao
def test_a_stopped_and_resumed_run_equals_the_uninterrupted_one(tmp_path):
    """The loop with train.optimizer adamw8bit (one process, full checkpoints): stopped after step 2 and resumed, the
    losses, learning rates (cosine after a warmup step) and final weights are the uninterrupted run's exactly."""
    from attnqat.train.loop import read_log

    common = ["log.progress=false", "data.held_out=0", "data.batch_size=2", "train.trainable=all",
              "train.optimizer=adamw8bit", "train.lr=1e-3", "train.lr_schedule=cosine", "train.warmup_steps=1",
              "train.max_steps=4", "checkpoint.every=2", "checkpoint.save_dtype=fp32"]
    cfg = lambda out: load_config(TINY, [f"output_dir={out}", *common])  # noqa: E731
    whole = train(cfg(tmp_path / "whole"))
    cut = train(cfg(tmp_path / "cut"), stop_after=2).losses + train(cfg(tmp_path / "cut"), resume="auto").losses
    assert cut == whole.losses and len(set(cut)) == 4
    lrs = [[float(r["lr"]) for r in read_log(tmp_path / name / "log.csv")] for name in ("whole", "cut")]
    assert lrs[0] == lrs[1] and len(set(lrs[0])) > 2
    a, b = (load_file(str(tmp_path / name / "final" / "transformer.safetensors")) for name in ("whole", "cut"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    state = load_file(str(tmp_path / "cut" / "checkpoints" / "step-0000002" / "state" / "optimizer.safetensors"))
    assert any(v.dtype == torch.uint8 for v in state.values())  # the codes, as they were


@needs_torchao
def test_a_checkpoint_of_the_other_optimizer_is_refused_before_a_model_is_built(tmp_path, monkeypatch):
    """Issue 46: a checkpoint of a train.optimizer adamw run resumed with adamw8bit failed in torch's state-dict code
    (KeyError: 'param_groups.0.maximize', after the models were built). optimizer.json now records the optimizer;
    a resume into the other one (auto or named) is a one-line CheckpointError naming both and what to do, raised
    before a model is built, and again by Trainer.load on the verified checkpoint. A checkpoint written before the
    optimizer was recorded is told by its state (8-bit codes, or param groups without AdamW's maximize), full or
    sharded. Nothing is written, and the run then resumes with its own optimizer."""
    import json

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from attnqat.train import loop

    common = ["log.progress=false", "data.held_out=0", "data.batch_size=2", "train.trainable=all", "train.lr=1e-3",
              "train.max_steps=4", "checkpoint.every=2"]
    cfg = lambda name: load_config(TINY, [f"output_dir={tmp_path / 'run'}", f"train.optimizer={name}", *common])  # noqa: E731
    train(cfg("adamw"), stop_after=2)
    step2 = tmp_path / "run" / "checkpoints" / "step-0000002"
    optimizer_json = step2 / "state" / "optimizer.json"
    log = (tmp_path / "run" / "log.csv").read_bytes()
    refused = (r"^checkpoint '.*step-0000002' holds train.optimizer 'adamw''s state, which does not load into this "
               r"run's 'adamw8bit': resume with train.optimizer=adamw, or start a new run in another output_dir$")
    with monkeypatch.context() as m:
        m.setattr(loop, "Trainer", lambda *a, **k: pytest.fail("a model was built before the refusal"))
        for resume in ("auto", str(step2)):
            with pytest.raises(CheckpointError, match=refused):
                train(cfg("adamw8bit"), resume=resume)
    structure = json.loads(optimizer_json.read_text())
    assert structure["optimizer"] == "adamw"
    # a checkpoint from before the record: told by its param groups; Trainer.load refuses it before loading anything
    del structure["optimizer"]
    ck.write_json(optimizer_json, structure)
    ck.write_manifest(step2, kind="checkpoint", step=2)
    trainer = loop.Trainer(cfg("adamw8bit"))
    try:
        with pytest.raises(CheckpointError, match=refused):
            trainer.load(step2)
        assert trainer.state.step == 0
    finally:
        trainer.s_cap.remove()
        trainer.accelerator.end_training()
    # both optimizers' states told apart, full (as saved) and sharded (optimizer.json's structure of either layout)
    model = torch.nn.Linear(256, 64)
    for name in ("adamw", "adamw8bit"):
        opt = build(name, model.parameters(), lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
        model(torch.randn(3, 256)).sum().backward()
        opt.step()
        full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
        assert ck.saved_optimizer(ck.flatten_optimizer(full)[1]) == name
        assert ck.saved_optimizer(ck.sharded_state(model, opt)[1]) == name
    assert ck.saved_optimizer({"state": {}, "param_groups": []}) is None
    assert (tmp_path / "run" / "log.csv").read_bytes() == log and [s for s, _ in ck.step_dirs(tmp_path / "run")] == [2]
    assert len(train(cfg("adamw"), resume="auto").losses) == 2  # its own optimizer resumes


def test_config_refusals_are_one_line(tmp_path, monkeypatch):
    """An unknown optimizer or teacher setting, adamw8bit without torchao (`pip install torchao`), adamw8bit under
    FSDP1, and shard_teacher 'on' without FSDP (the trainer's check, before a model is built)."""
    from attnqat.train import Trainer

    def refused(match, *overrides):
        with pytest.raises(ValueError, match=match) as e:
            validate(load_config(TINY, [f"output_dir={tmp_path}", *overrides]))
        assert "\n" not in str(e.value)

    refused("train.optimizer 'adam' is not one of adamw, adamw8bit", "train.optimizer=adam")
    refused("train.shard_teacher 'yes' is not one of auto, on, off", "train.shard_teacher=yes")
    monkeypatch.setitem(sys.modules, "torchao", None)  # as if not installed: import raises ImportError
    monkeypatch.setitem(sys.modules, "torchao.optim", None)
    refused(r"train.optimizer 'adamw8bit' needs torchao \(.*\): pip install torchao$", "train.optimizer=adamw8bit")
    monkeypatch.undo()
    with pytest.raises(ValueError, match="needs FSDP2 .*FSDP1 hands the optimizer flat 1-D shards"):
        check_sharding("adamw8bit", 1)
    for name, version in (("adamw8bit", 2), ("adamw8bit", None), ("adamw", 1)):
        check_sharding(name, version)  # accepted
    cfg = load_config(TINY, [f"output_dir={tmp_path}", "train.shard_teacher=on"])
    with pytest.raises(ValueError, match="train.shard_teacher 'on' needs FSDP"):
        Trainer(cfg)
