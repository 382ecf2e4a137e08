"""train.shard_teacher (student_teacher.shard_teacher): the frozen teacher copy sharded as FSDP shards the student, on
two gloo processes (CPU), the tiny model.

- Under FSDP2 (fully_shard) and FSDP1 (configs/fsdp_wan14b.yaml's FULL_SHARD), with and without Ulysses sequence
  parallelism (2), the sharded bf16 teacher's outputs and every block's features are the replicated teacher's bit
  for bit, over two forwards; each process holds half its weights before and after them (resharded after each
  forward: no backward comes to free them).
- The Trainer under FSDP2 (accelerate's state set by hand, as tests/test_sharded_checkpoint.py does) shards it with
  train.shard_teacher auto, keeps it whole with off; a LoRA run's teacher stays the student's own module.
The loop with the sharded teacher (its losses equal the replicated teacher's; exact resume) is in
tests/test_sharded_checkpoint.py.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"

pytestmark = pytest.mark.usefixtures("one_thread")


def _held(module: torch.nn.Module) -> int:
    """Weight values this process holds in ``module`` now (a DTensor's local part; FSDP1's views of its shard)."""
    from torch.distributed.tensor import DTensor

    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in module.parameters())


def _teachers(rank: int) -> dict:
    """For FSDP 1 and 2, without and with sequence parallelism: (outputs equal, features equal, held / whole before,
    after the forwards) of the sharded teacher against the replicated one."""
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

    from attnqat.pipelines import build_tiny_transformer
    from attnqat.train import sequence_parallel
    from attnqat.train.student_teacher import FeatureCapture, make_student_teacher, shard_teacher

    g = torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(2, 16, 2, 8, 8, generator=g).bfloat16(),
                  timestep=torch.tensor([500.0, 120.0]),
                  encoder_hidden_states=torch.randn(2, 8, 32, generator=g).bfloat16(), return_dict=False)

    def student_and_teacher(sp):
        torch.manual_seed(0)  # the same weights in every process and every build
        student, teacher = make_student_teacher(build_tiny_transformer().float(), "attn_qat",
                                                teacher_dtype=torch.bfloat16)
        if sp is not None:
            sequence_parallel.enable(teacher, sp)
        return student, teacher

    def run(teacher):
        cap = FeatureCapture(teacher)
        outs = []
        for _ in range(2):
            with torch.no_grad(), cap.capturing() as feats:
                outs.append((teacher(**inputs)[0], dict(feats)))
        cap.remove()
        return outs

    results = {}
    for sp_degree in (1, 2):
        sp = sequence_parallel.setup(2, rank, 2, "cpu") if sp_degree == 2 else None
        _, replicated = student_and_teacher(sp)
        want = run(replicated)
        whole = _held(replicated)
        for version in (1, 2):
            student, teacher = student_and_teacher(sp)
            if version == 2:
                for block in student.blocks:
                    fully_shard(block)
                like = fully_shard(student)
            else:
                like = FullyShardedDataParallel(student, device_id=torch.device("cpu"), use_orig_params=True)
            sharded = shard_teacher(teacher, like, torch.device("cpu"))
            before = _held(sharded)
            got = run(sharded)
            results[f"fsdp{version}/sp{sp_degree}"] = {
                "outputs": all(torch.equal(a[0], b[0]) for a, b in zip(got, want)),
                "features": all(a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in b[1])
                                for a, b in zip(got, want)) and len(want[0][1]) == 2,
                "dtype": str(got[0][0].dtype), "held": [before / whole, _held(sharded) / whole]}
    return results


def _trainers(rank: int) -> dict:
    """The Trainer's teacher under FSDP2 for train.shard_teacher auto and off, and a LoRA run's."""
    from torch.distributed.fsdp import FSDPModule

    from attnqat.train import Trainer, load_config
    from attnqat.train.student_teacher import AdapterOffTeacher
    from test_sharded_checkpoint import fsdp_accelerator

    out = {}
    for name, overrides in (("auto", []), ("off", ["train.shard_teacher=off"]),
                            ("lora", ["train.trainable=lora", "train.lora.rank=4"])):
        cfg = load_config(TINY, ["output_dir=/nonexistent/never-written", "log.progress=false", *overrides])
        trainer = Trainer(cfg, accelerator=fsdp_accelerator())
        t = trainer.teacher
        out[name] = {"fsdp2": isinstance(t, FSDPModule), "lora_teacher": isinstance(t, AdapterOffTeacher),
                     "held": _held(t) if isinstance(t, torch.nn.Module) else None,
                     "whole": sum(p.numel() for p in trainer.accelerator.unwrap_model(trainer.student).parameters())}
        trainer.s_cap.remove()
        trainer.t_cap.remove()
    return out


def _rank(rank: int) -> dict:
    return {"teachers": _teachers(rank), "trainers": _trainers(rank)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from conftest import gloo_ranks

    with pytest.MonkeyPatch.context() as m:
        m.setenv("TRITON_INTERPRET", "0")  # the FP4 reference path (see tests/test_train.py)
        return gloo_ranks(_rank, tmp_path_factory.mktemp("teacher"), "the teacher-sharding processes")


def test_sharded_teacher_computes_the_replicated_teachers_outputs_and_features(ranks):
    for r in ranks:
        assert sorted(r["teachers"]) == ["fsdp1/sp1", "fsdp1/sp2", "fsdp2/sp1", "fsdp2/sp2"]
        for name, t in r["teachers"].items():
            assert t["outputs"] and t["features"] and t["dtype"] == "torch.bfloat16", (name, t)


def test_each_process_holds_half_the_teacher_before_and_after_its_forward(ranks):
    """About half: FSDP1 pads its flat shards and FSDP2 splits dim 0, so a process's part is within a few
    percent of 1/2; the two parts add up to the whole (FSDP1: the whole plus padding)."""
    for name in ranks[0]["teachers"]:
        held = [r["teachers"][name]["held"] for r in ranks]
        for before, after in held:
            assert 0.45 < before < 0.55 and after == before, (name, held)
        assert 1.0 <= held[0][0] + held[1][0] < 1.01, (name, held)


def test_the_trainer_shards_its_teacher_under_fsdp_unless_told_not_to(ranks):
    for r in ranks:
        t = r["trainers"]
        assert t["auto"]["fsdp2"] and 0.45 < t["auto"]["held"] / t["auto"]["whole"] < 0.55, t["auto"]
        assert not t["off"]["fsdp2"] and t["off"]["held"] == t["off"]["whole"], t["off"]
        assert t["lora"]["lora_teacher"] and not t["lora"]["fsdp2"], t["lora"]  # the student's module, as it was
