"""Sharded training checkpoints (``checkpoint.format: sharded``, the default under FSDP) on the tiny model, in two
processes over gloo under real FSDP sharding (CPU):

- each process writes its own shard (torch.distributed.checkpoint through safetensors), nothing is gathered, and a
  run stopped and resumed gives the uninterrupted run's losses and final weights exactly;
- a checkpoint whose write one process fails (a full disk) or dies in (a real kill) leaves the previous checkpoint
  whole, and --resume auto continues from it exactly;
- a sharded checkpoint of two processes loads into one (DCP reshards) with the very values a full checkpoint of
  the same run holds, and nothing is unpickled while it loads (DCP's own FileSystemReader, the control, unpickles);
- shard files the manifest does not list, or pieces that do not cover a tensor, are refused by name;
- train.optimizer adamw8bit: its 8-bit moments (uint8 codes and fp32 block scales, sharded as the weights' rows) are
  split between the processes' shards, a run stopped and resumed gives the uninterrupted run's losses and weights
  exactly, and one plain process loads the 2-process shards into exactly what the same run's full checkpoint holds;
- the teacher: these runs shard it (train.shard_teacher auto under FSDP); the run with a whole replica
  (train.shard_teacher: off) has the same losses.

accelerate (1.15) offers FSDP on GPUs only: on the CPU it builds a MULTI_CPU (DDP) state whatever the config says.
torch's FSDP itself runs on the CPU over gloo, so :func:`fsdp_accelerator` puts accelerate's state into FSDP by hand
(one unit per WanTransformerBlock, as configs/fsdp_wan14b.yaml): ``prepare`` then shards the student, and each
process holds half of every block. The runs use FSDP2; FSDP1's sharded state (what the config's fsdp_version 1
gives DCP) is saved and loaded without the loop (see :func:`fsdp_accelerator` for why).
"""
from __future__ import annotations

import errno
import json
import os
import traceback
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from attnqat.train import checkpoint as ck
from attnqat.train import load_config, train
from attnqat.train.checkpoint import CheckpointError
from attnqat.train.loop import read_log

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"
# all weights trained (FSDP's flat parameters with every requires_grad alike), a cosine schedule after a warmup step
# (a scheduler state that did not come back shows), checkpoints at 2 and 4
COMMON = ["log.progress=false", "data.held_out=1", "data.batch_size=2", "train.trainable=all", "objective.target=output",
          "train.lr_schedule=cosine", "train.warmup_steps=1", "train.max_steps=4", "checkpoint.every=2",
          "checkpoint.keep=2", "checkpoint.save_dtype=fp32"]

pytestmark = pytest.mark.usefixtures("one_thread")  # the forked processes run one thread: so does this one


@pytest.fixture(autouse=True)
def reference_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the PyTorch reference attention (see tests/test_train.py)


def cfg(out, *overrides):
    return load_config(TINY, [f"output_dir={out}", *COMMON, *overrides])


def fsdp_accelerator(version: int = 2):
    """This process's accelerator, in accelerate's FSDP state (``version`` 2: fully_shard; 1: FullyShardedDataParallel
    with configs/fsdp_wan14b.yaml's FULL_SHARD) with one unit per WanTransformerBlock, on the CPU. The state is shared
    by two singletons (AcceleratorState copies PartialState's when it is built again), so both are set; the device
    is the plain "cpu" FSDP1 compares its own with.

    The loop runs under FSDP2: under FSDP1 on the CPU, accelerate's gather of the exported weights (FSDP1's
    FULL_STATE_DICT with offload_to_cpu) crashes the process (SIGSEGV in torch's state-dict hook, torch 2.13 CPU).
    FSDP1's sharded state (ShardedTensor, where FSDP2 has DTensor) is tested without the loop, below."""
    from accelerate import Accelerator
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    acc = Accelerator(cpu=True)
    acc.state.fsdp_plugin = FullyShardedDataParallelPlugin(
        fsdp_version=version, reshard_after_forward="FULL_SHARD" if version == 1 else True,
        auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["WanTransformerBlock"],
        use_orig_params=True, sync_module_states=False)
    for state in (acc.state, PartialState()):
        state.distributed_type = DistributedType.FSDP
        state.device = torch.device("cpu")
    return acc


def _rank(rank: int, jobs: list, out_dir: str):
    """Rank ``rank % 2`` of job ``rank // 2`` ((port, name, fn) each): ``fn(rank)`` under FSDP on 2 gloo processes;
    its result (or traceback) goes to OUT_DIR/NAME-<rank>.json."""
    from conftest import as_torchrun_rank

    port, name, fn = jobs[rank // 2]
    as_torchrun_rank(rank % 2, 2, port)
    try:
        result = {"ok": fn(rank % 2)}
    except BaseException as e:  # noqa: BLE001 - reported to the test
        result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    Path(out_dir, f"{name}-{rank % 2}.json").write_text(json.dumps(result))


def run_jobs(tmp: Path, *jobs: tuple[str, object]) -> dict[str, list[dict]]:
    """Each (name, fn) of ``jobs`` on its own 2 FSDP processes, all at once; {name: [rank 0's result, rank 1's]}."""
    from conftest import free_port, run_forked

    run_forked(_rank, ([(free_port(), name, fn) for name, fn in jobs], str(tmp)), 2 * len(jobs), "the FSDP runs")
    return {name: [json.loads((tmp / f"{name}-{r}.json").read_text()) for r in (0, 1)] for name, _ in jobs}


def fsdp_train(out, *overrides, **kw):
    """A job: train on the FSDP accelerator; its losses and the checkpoint layout accelerate's state gave."""
    def job(rank):
        acc = fsdp_accelerator()
        r = train(cfg(out, *overrides), accelerator=acc, **kw)
        return {"losses": r.losses, "distributed_type": acc.distributed_type.value}
    return job


def ok(results: list[dict]) -> list:
    for r in results:
        assert "ok" in r, r.get("traceback", r)[-3000:]
    return [r["ok"] for r in results]


ADAMW8BIT = ["train.optimizer=adamw8bit", "train.lr=1e-3"]  # lr: steps that move the 8-bit moments' codes
try:
    import torchao  # noqa: F401
    HAVE_TORCHAO = True
except ImportError:
    HAVE_TORCHAO = False


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """2-process FSDP runs side by side: the uninterrupted one (checkpoint.format auto), the same stopped after step 2
    (sharded checkpoint step-2), and one stopped there with checkpoint.format: full (the reference state) and a whole
    teacher on each process (train.shard_teacher: off); with torchao, the same three with train.optimizer adamw8bit,
    the stopped one with checkpoint.export: false (the two-GPU Wan 14B run's settings)."""
    tmp = tmp_path_factory.mktemp("fsdp")
    jobs = [("whole", fsdp_train(tmp / "whole")), ("cut", fsdp_train(tmp / "cut", stop_after=2)),
            ("full", fsdp_train(tmp / "full", "checkpoint.format=full", "train.shard_teacher=off", stop_after=2))]
    if HAVE_TORCHAO:
        jobs += [("whole8", fsdp_train(tmp / "whole8", *ADAMW8BIT)),
                 ("cut8", fsdp_train(tmp / "cut8", *ADAMW8BIT, "checkpoint.export=false", stop_after=2)),
                 ("full8", fsdp_train(tmp / "full8", *ADAMW8BIT, "checkpoint.format=full", stop_after=2))]
    with pytest.MonkeyPatch.context() as m:
        m.setenv("TRITON_INTERPRET", "0")
        results = {k: ok(v) for k, v in run_jobs(tmp, *jobs).items()}
    whole = results["whole"]
    assert whole[0]["distributed_type"] == "FSDP" and whole[0]["losses"] == whole[1]["losses"]
    assert len(set(whole[0]["losses"])) == 4
    # the replicated teacher's run: the same losses as the sharded teacher's (the distillation target is its output)
    assert results["full"][0]["losses"] == whole[0]["losses"][:2]
    copy_run(tmp / "cut", tmp / "stopped")  # kept as it is: the tests below resume copies of it
    return {"tmp": tmp, "losses": whole[0]["losses"], "cut": tmp / "cut", "full": tmp / "full", "whole": tmp / "whole",
            "stopped": tmp / "stopped", "losses8": results.get("whole8", [{}])[0].get("losses"),
            **{k: tmp / k for k in ("whole8", "cut8", "full8")}}


def copy_run(src: Path, dest: Path) -> Path:
    import shutil

    shutil.copytree(src, dest)
    return dest


def shard_pieces(ckpt: Path) -> dict[str, dict[str, int]]:
    """{shard file: {tensor: elements in it}} of a sharded checkpoint."""
    out = {}
    for f in sorted((ckpt / ck.SHARDS).iterdir()):
        with safe_open(str(f), framework="pt") as s:
            out[f.name] = {k: s.get_slice(k).get_shape() for k in s.keys()}
    return {name: {k: int(torch.Size(shape).numel()) for k, shape in d.items()} for name, d in out.items()}


def test_each_process_writes_its_shard_and_a_resume_is_exact(runs, tmp_path):
    ckpt = runs["cut"] / "checkpoints" / "step-0000002"
    manifest = ck.verify(ckpt)
    assert manifest["layout"] == "sharded"  # checkpoint.format auto, under FSDP
    assert not (ckpt / "state" / "model.safetensors").exists() and not (ckpt / "state" / "optimizer.safetensors").exists()
    assert not [p for p in ckpt.rglob("*") if p.suffix in (".pkl", ".bin", ".pt", ".pth", ".metadata")]
    pieces = shard_pieces(ckpt)
    assert sorted(pieces) == ["shard-00001-model-00001-of-00001.safetensors",
                              "shard-00002-model-00001-of-00001.safetensors"]
    # every block weight is split between the two files, half each: no process wrote a gathered copy
    whole = load_file(str(runs["full"] / "checkpoints" / "step-0000002" / "state" / "model.safetensors"))
    block = "blocks.0.ffn.net.0.proj.weight"
    for kind in (f"model/{block}", f"optimizer/{block}/exp_avg_sq"):
        assert [p[kind] for p in pieces.values()] == [whole[block].numel() // 2] * 2, kind
    # resumed in two fresh FSDP processes: steps 3 and 4 as the uninterrupted run's, the final weights the same
    resumed = ok(run_jobs(tmp_path, ("resume", fsdp_train(runs["cut"], resume="auto")))["resume"])
    assert resumed[0]["losses"] == runs["losses"][2:]
    assert [float(r["loss"]) for r in read_log(runs["cut"] / "log.csv")] == runs["losses"]
    a, b = (load_file(str(runs[k] / "final" / "transformer.safetensors")) for k in ("cut", "whole"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_bf16_teacher_read_again_for_sharding_is_the_copy_a_replica_would_be(runs, tmp_path):
    """Under FSDP the teacher to shard is loaded from the model again (in its dtype), after the student is sharded;
    a whole replica is copied from the student (cast_copy). In bf16 (diffusers keeps some modules in fp32 when it
    loads, the copy casts them) both give the same losses, and not the fp32 teacher's."""
    bf16 = "train.teacher_dtype=bf16"
    results = {k: ok(v) for k, v in run_jobs(tmp_path, ("sharded", fsdp_train(tmp_path / "s", bf16, stop_after=2)),
                                             ("replica", fsdp_train(tmp_path / "r", bf16, "train.shard_teacher=off",
                                                                    stop_after=2))).items()}
    sharded, replica = (results[k][0]["losses"] for k in ("sharded", "replica"))
    assert sharded == replica and len(sharded) == 2
    assert sharded != runs["losses"][:2]


def test_attention_only_training_shards_and_resumes_exactly(tmp_path):
    """train.trainable: attention under FSDP2 (each block's unit then holds trainable and frozen weights): the run
    stopped at its step-2 checkpoint and resumed in fresh processes repeats the uninterrupted run's losses, and only
    the self-attention weights moved."""
    attn = "train.trainable=attention"
    jobs = (("whole", fsdp_train(tmp_path / "whole", attn)), ("cut", fsdp_train(tmp_path / "cut", attn, stop_after=2)))
    results = {k: ok(v) for k, v in run_jobs(tmp_path, *jobs).items()}
    losses = results["whole"][0]["losses"]
    assert len(losses) == 4 and results["cut"][0]["losses"] == losses[:2]
    resumed = ok(run_jobs(tmp_path, ("resume", fsdp_train(tmp_path / "cut", attn, resume="auto")))["resume"])
    assert resumed[0]["losses"] == losses[2:]
    from attnqat.pipelines.tiny import build_tiny_transformer

    base = build_tiny_transformer().state_dict()
    final = load_file(str(tmp_path / "cut" / "final" / "transformer.safetensors"))
    moved = {k for k in final if not torch.equal(final[k].float(), base[k].float())}
    assert moved and all(".attn1." in k for k in moved), sorted(moved)


def leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.rglob("*") if p.name.endswith((".tmp", ".old")))


def failing_shard_write(how: str):
    """A job: resume the stopped run (step 2) to step 4, and in process 1 fail the write of its shard of step-4: a
    full disk (OSError ENOSPC), or a real kill (os._exit, no cleanup; the launcher then stops process 0)."""
    def job(rank):
        from attnqat.train import shard_writer

        real, calls = shard_writer.write_piece, []

        def write_piece(*a, **kw):  # writes one piece of a shard, after its header: the file is half written
            calls.append(1)
            if rank == 1 and len(calls) == 1:  # this run's first checkpoint: step-4
                if how == "kill":
                    os._exit(9)
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(*a, **kw)

        shard_writer.write_piece = write_piece
        return fsdp_train(OUT[how], resume="auto")(rank)
    return job


OUT: dict[str, Path] = {}  # the run folder of each failing job (set before the processes fork)


def test_a_failed_or_killed_shard_write_leaves_the_last_checkpoint(runs, tmp_path):
    """One process cannot write its shard of step-4 (a full disk), or dies writing it (a real kill). Either way
    step-2 stays whole and --resume auto continues from it to the uninterrupted run's losses and weights; the full
    disk stops both processes with the same one-line error and leaves no step-4.tmp."""
    from torch.multiprocessing import ProcessExitedException

    OUT.update(kill=copy_run(runs["stopped"], tmp_path / "kill"), disk=copy_run(runs["stopped"], tmp_path / "disk"))
    with pytest.raises(ProcessExitedException, match="exit code 9"):
        run_jobs(tmp_path, ("killed", failing_shard_write("kill")))
    # no step-4: at most its partial copy (process 0 deletes it if it sees the failure before it is stopped)
    ckpts = OUT["kill"] / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) in (["step-0000002"], ["step-0000002", "step-0000004.tmp"])
    assert not (ckpts / "step-0000004.tmp" / "manifest.json").exists()
    assert ck.verify(ckpts / "step-0000002")["step"] == 2
    results = run_jobs(tmp_path, ("disk", failing_shard_write("disk")),
                       ("resume", fsdp_train(OUT["kill"], resume="auto")))
    for r in results["disk"]:
        assert "OutputWriteError" in r.get("error", "") and "process 1 could not write its shard" in r["error"], r
        assert "No space left on device" in r["error"] and "\n" not in r["error"]
    assert [p.name for p in (OUT["disk"] / "checkpoints").iterdir()] == ["step-0000002"]
    assert ck.verify(OUT["disk"] / "checkpoints" / "step-0000002")["step"] == 2
    assert not (OUT["disk"] / "final").exists()
    resumed = ok(results["resume"])  # the recovery removed the killed write; step-2 continued
    assert resumed[0]["losses"] == runs["losses"][2:]
    assert leftovers(OUT["kill"]) == []
    a, b = (load_file(str(d / "final" / "transformer.safetensors")) for d in (OUT["kill"], runs["whole"]))
    assert all(torch.equal(a[k], b[k]) for k in b)


def _no_unpickling_while(fn, control) -> dict:
    """Run ``control()`` then ``fn()`` in this (forked) process, counting what the unpickler does: the audit event
    "pickle.find_class" (every unpickler, C or Python, raises it for each class or function a pickle names) and
    calls of pickle.load / loads / Unpickler and torch.load. The control must be seen; during ``fn`` nothing may
    happen, and pickle.load / loads / Unpickler and torch.load raise."""
    import pickle
    import sys

    seen = {"control": 0, "fn": 0}
    phase = ["control"]
    sys.addaudithook(lambda event, args: event == "pickle.find_class" and seen.__setitem__(phase[0], seen[phase[0]] + 1))
    control()

    def refuse(*a, **kw):
        seen["fn"] += 1
        raise AssertionError("something was unpickled")

    phase[0] = "fn"
    pickle.load = pickle.loads = pickle.Unpickler = torch.load = refuse
    out = fn()
    return {**out, **seen}


def test_two_processes_shards_load_into_one_with_nothing_unpickled(runs, tmp_path):
    """World size 2 -> 1: the sharded step-2 of the 2-process FSDP run, resumed by one plain process (DCP puts the
    pieces together), holds exactly the weights and optimizer state that the same run's full checkpoint
    (checkpoint.format: full, gathered by FSDP) holds. Loading it unpickles nothing; the control does: DCP's
    default FileSystemWriter/Reader pair on a small state, whose .metadata is a pickle."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from attnqat.train import Trainer
    from conftest import forked_process

    ckpt = runs["stopped"] / "checkpoints" / "step-0000002"
    full = runs["full"] / "checkpoints" / "step-0000002"

    def control():
        import torch.distributed.checkpoint as dcp

        dcp.save({"x": torch.ones(3)}, checkpoint_id=str(tmp_path / "dcp_default"))
        dcp.load({"x": torch.zeros(3)}, checkpoint_id=str(tmp_path / "dcp_default"))

    def load_in_one_process():
        from attnqat.train.checkpoint import unflatten_optimizer

        trainer = Trainer(cfg(tmp_path / "one"))
        assert trainer.accelerator.num_processes == 1
        trainer.resume_from(str(ckpt))
        got_model = trainer.student.state_dict()
        got_opt = get_optimizer_state_dict(trainer.student, trainer.optimizer.optimizer,
                                           options=StateDictOptions(full_state_dict=True))
        want_model = load_file(str(full / "state" / "model.safetensors"))
        want_opt = unflatten_optimizer(load_file(str(full / "state" / "optimizer.safetensors")),
                                       json.loads((full / "state" / "optimizer.json").read_text()))
        same_model = got_model.keys() == want_model.keys() and all(torch.equal(got_model[k], want_model[k])
                                                                    for k in want_model)
        same_opt = (got_opt["state"].keys() == want_opt["state"].keys()
                    and all(torch.equal(got_opt["state"][p][k], v) for p, d in want_opt["state"].items()
                            for k, v in d.items())
                    and got_opt["param_groups"] == [dict(g) for g in want_opt["param_groups"]])
        # the state really moved: a fresh trainer's differs
        fresh = Trainer(cfg(tmp_path / "fresh")).student.state_dict()
        return {"model": same_model, "optimizer": same_opt, "step": trainer.state.step,
                "scheduler": trainer.scheduler.last_epoch, "fresh_differs": not all(torch.equal(fresh[k], want_model[k])
                                                                                    for k in want_model)}

    result = {}

    def child():
        result.update(_no_unpickling_while(load_in_one_process, control))
        print("RESULT " + json.dumps(result))

    p = forked_process(child)
    assert p.returncode == 0, p.stderr[-3000:]
    result = json.loads(next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))[7:])
    assert result["control"] > 0  # the detector sees DCP's own pickle
    assert result["fn"] == 0, result  # ours: nothing unpickled
    assert result == {**result, "model": True, "optimizer": True, "step": 2, "scheduler": 2, "fresh_differs": True}


def test_shard_files_not_in_the_manifest_or_missing_pieces_are_refused(runs, tmp_path):
    """DCP's reader opens every safetensors file in the shards folder: one the manifest does not list is refused by
    name, never read. A crafted checkpoint (its manifest rewritten) that lacks a process's shard is refused for the
    pieces it lacks, before anything loads."""
    run = copy_run(runs["stopped"], tmp_path / "run")
    ckpt = run / "checkpoints" / "step-0000002"
    shards = ckpt / ck.SHARDS
    stray = shards / "shard-00003-model-00001-of-00001.safetensors"
    stray.write_bytes((shards / "shard-00002-model-00001-of-00001.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match="does not hold exactly the shard files its manifest.json lists "
                                              r"\(shard-00003"):
        train(cfg(tmp_path / "a"), resume=str(ckpt))
    stray.unlink()
    # without process 0's shard, the pieces of process 1 (the second half of each block weight) leave a hole
    (shards / "shard-00001-model-00001-of-00001.safetensors").unlink()
    ck.write_manifest(ckpt, kind="checkpoint", step=2, layout="sharded")
    with pytest.raises(CheckpointError, match=r"the pieces of \S+ in state/shards/ cover \d+ of its \d+ elements"):
        train(cfg(tmp_path / "b"), resume=str(ckpt))
    assert not (tmp_path / "a" / "final").exists() and not (tmp_path / "b" / "final").exists()


def same_optimizer_state(a: dict, b: dict) -> bool:
    """Two FQN-keyed optimizer state dicts hold the same tensors, compared by FQN and key (flatten_optimizer's t0,
    t1, ... follow each dict's own order of parameters, which FSDP1's gather and a plain optimizer's differ in)."""
    return a["state"].keys() == b["state"].keys() and all(
        a["state"][p].keys() == b["state"][p].keys() and all(torch.equal(a["state"][p][k], b["state"][p][k])
                                                             for k in a["state"][p])
        for p in a["state"])


def test_fsdp1_sharded_state_round_trips_and_reshards(tmp_path):
    """FSDP1 (configs/fsdp_wan14b.yaml's version: ShardedTensor pieces) through the same functions the loop calls:
    two processes save their shards after an AdamW step, load them into a fresh FSDP1 model and optimizer of another
    initialisation, and one plain process loads them too; every copy holds FSDP1's own full gather of the saved
    model and optimizer state, exactly."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    from attnqat.pipelines import build_tiny_transformer
    from attnqat.outputs import save_safetensors

    folder = tmp_path / "ckpt"
    whole = StateDictOptions(full_state_dict=True, cpu_offload=False)  # with offload_to_cpu, FSDP1 crashes on the CPU

    def fresh(acc, seed):
        torch.manual_seed(seed)
        model = build_tiny_transformer().float()
        return acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01))

    def gathered(model, opt):
        return get_model_state_dict(model, options=whole), get_optimizer_state_dict(model, opt, options=whole)

    def job(rank):
        acc = fsdp_accelerator(version=1)
        model, opt = fresh(acc, 0)
        torch.manual_seed(10 + rank)  # each process its own batch
        out = model(hidden_states=torch.randn(1, 16, 2, 8, 8), timestep=torch.tensor([500.0]),
                    encoder_hidden_states=torch.randn(1, 8, 32), return_dict=False)[0]
        acc.backward(out.pow(2).mean())
        opt.step()
        tensors, structure = ck.sharded_state(model, opt.optimizer)
        assert type(tensors["model/blocks.0.ffn.net.0.proj.weight"]).__name__ == "ShardedTensor"
        ck.save_sharded(folder / ck.SHARDS, tensors)
        want_model, want_opt = gathered(model, opt.optimizer)
        if rank == 0:
            want_tensors, want_structure = ck.flatten_optimizer(want_opt)
            save_safetensors(folder / "want_model.safetensors", want_model)
            save_safetensors(folder / "want_optimizer.safetensors", want_tensors)
            (folder / "structure.json").write_text(json.dumps({"saved": structure, "want": want_structure}))
        acc.wait_for_everyone()
        manifest = {"files": {f"{ck.SHARDS}/{p.name}": {} for p in (folder / ck.SHARDS).iterdir()}}
        model2, opt2 = fresh(acc, 1)
        ck.load_sharded(folder, manifest, model2, opt2.optimizer, structure)
        got_model, got_opt = gathered(model2, opt2.optimizer)
        return {"model": all(torch.equal(got_model[k], v) for k, v in want_model.items()),
                "optimizer": same_optimizer_state(got_opt, want_opt)}

    results = ok(run_jobs(tmp_path, ("fsdp1", job))["fsdp1"])
    assert all(r["model"] and r["optimizer"] for r in results), results
    # one plain process: the pieces of both put together (DCP's resharding, ShardedTensor -> whole tensors)
    structure = json.loads((folder / "structure.json").read_text())
    manifest = {"files": {f"{ck.SHARDS}/{p.name}": {} for p in (folder / ck.SHARDS).iterdir()}}
    model = build_tiny_transformer().float()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ck.load_sharded(folder, manifest, model, opt, structure["saved"])
    want_model = load_file(str(folder / "want_model.safetensors"))
    got = model.state_dict()
    assert got.keys() == want_model.keys() and all(torch.equal(got[k], want_model[k]) for k in got)
    want_opt = ck.unflatten_optimizer(load_file(str(folder / "want_optimizer.safetensors")), structure["want"])
    assert same_optimizer_state(get_optimizer_state_dict(model, opt, options=whole), want_opt)
    assert opt.param_groups[0]["weight_decay"] == 0.01  # the saved hyperparameters, not this optimizer's default
    assert any(not torch.equal(v, build_tiny_transformer().float().state_dict()[k]) for k, v in got.items())


@pytest.mark.skipif(not HAVE_TORCHAO, reason="needs torchao (pip install torchao; the test extra has it)")
def test_adamw8bit_shards_hold_its_8bit_moments_and_resume_exactly(runs, tmp_path):
    """train.optimizer adamw8bit under FSDP2: each process's shard holds half of each block weight's moment codes
    (uint8) and of their scales, nothing dequantized; stopped after step 2 and resumed in two fresh processes, the
    losses and final weights are the uninterrupted run's exactly."""
    ckpt = runs["cut8"] / "checkpoints" / "step-0000002"
    assert ck.verify(ckpt)["layout"] == "sharded"
    block = "blocks.0.ffn.net.0.proj.weight"  # (256, 128): blocks of 128, one row each
    files = sorted((ckpt / ck.SHARDS).iterdir())
    with safe_open(str(files[0]), framework="pt") as f:
        assert f.get_slice(f"optimizer/{block}/exp_avg_codes").get_dtype() == "U8"
        assert f"optimizer/{block}/exp_avg" not in f.keys()
    pieces = shard_pieces(ckpt)
    for kind, whole in ((f"optimizer/{block}/exp_avg_codes", 256 * 128), (f"optimizer/{block}/exp_avg_scales", 256),
                        (f"optimizer/{block}/exp_avg_sq_codes", 256 * 128), (f"model/{block}", 256 * 128)):
        assert [p[kind] for p in pieces.values()] == [whole // 2] * 2, kind
    assert len(set(runs["losses8"])) == 4 and runs["losses8"][:1] == runs["losses"][:1]  # the step before AdamW's
    resumed = ok(run_jobs(tmp_path, ("resume8", fsdp_train(runs["cut8"], *ADAMW8BIT, resume="auto")))["resume8"])
    assert resumed[0]["losses"] == runs["losses8"][2:]
    a, b = (load_file(str(runs[k] / "final" / "transformer.safetensors")) for k in ("cut8", "whole8"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.skipif(not HAVE_TORCHAO, reason="needs torchao (pip install torchao; the test extra has it)")
def test_a_checkpoint_without_its_export_resumes_and_says_how_to_get_its_weights(runs, tmp_path):
    """checkpoint.export: false: the step checkpoint holds the training state and no weights file (nothing gathered);
    generate's loader refuses it in one line naming the command that writes its weights, and that command (resumed
    in one process into a new output_dir at the checkpoint's step) writes final/ with exactly the weights the same
    run's exporting checkpoint holds."""
    from attnqat.pipelines.loading import checkpoint_weights_path
    from conftest import forked_process

    ckpt, full = (runs[k] / "checkpoints" / "step-0000002" for k in ("cut8", "full8"))
    assert ck.verify(ckpt)["layout"] == "sharded" and (ckpt / ck.SHARDS).is_dir()
    assert not [p.name for p in ckpt.iterdir() if p.suffix == ".safetensors"]
    with pytest.raises(FileNotFoundError, match=r"checkpoint\.export: false") as e:
        checkpoint_weights_path(ckpt)
    assert "\n" not in str(e.value) and "--set output_dir=NEW --set train.max_steps=2" in str(e.value)
    new = tmp_path / "weights"

    def resume_at_its_step():
        train(cfg(new, *ADAMW8BIT, "train.max_steps=2"), resume=str(ckpt))

    p = forked_process(resume_at_its_step)
    assert p.returncode == 0, p.stderr[-3000:]
    got, want = (load_file(str(d / "transformer.safetensors")) for d in (new / "final", full))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.skipif(not HAVE_TORCHAO, reason="needs torchao (pip install torchao; the test extra has it)")
def test_adamw8bit_shards_of_two_processes_load_into_one(runs, tmp_path):
    """World size 2 -> 1 for the 8-bit moments: the blocks lie within rows, so they reshard as the weights do. One
    plain process resuming the sharded step-2 holds exactly the weights and optimizer state (codes, scales, the
    vectors' fp32 moments, steps) of the same run's full checkpoint (FSDP's own gather)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from attnqat.train import Trainer
    from conftest import forked_process

    ckpt, full = (runs[k] / "checkpoints" / "step-0000002" for k in ("cut8", "full8"))

    def load_in_one_process():
        trainer = Trainer(cfg(tmp_path / "one", *ADAMW8BIT))
        trainer.resume_from(str(ckpt))
        got_model = trainer.student.state_dict()
        got_opt = get_optimizer_state_dict(trainer.student, trainer.optimizer.optimizer,
                                           options=StateDictOptions(full_state_dict=True))
        want_model = load_file(str(full / "state" / "model.safetensors"))
        want_opt = ck.unflatten_optimizer(load_file(str(full / "state" / "optimizer.safetensors")),
                                          json.loads((full / "state" / "optimizer.json").read_text()))
        codes = [k for d in want_opt["state"].values() for k in d if k.endswith("_codes")]
        print("RESULT " + json.dumps({
            "model": got_model.keys() == want_model.keys() and all(torch.equal(got_model[k], want_model[k])
                                                                   for k in want_model),
            "optimizer": same_optimizer_state(got_opt, want_opt), "codes": len(codes)}))

    p = forked_process(load_in_one_process)
    assert p.returncode == 0, p.stderr[-3000:]
    result = json.loads(next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))[7:])
    assert result["model"] and result["optimizer"] and result["codes"] > 20, result
