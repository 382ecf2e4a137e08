"""train.sequence_parallel (attnqat/train/sequence_parallel.py) on CPU, over gloo (accelerate's MULTI_CPU: DDP,
the student and the teacher under diffusers' Ulysses ``enable_parallelism``).

The tiny model, 2 steps of feature distillation with every weight trainable (fp32, gradient checkpointing):
- 2 processes with ``sequence_parallel: 2`` end with the weights, losses and gradient norms of 1 process on the
  same batches; a run stopped after step 1 and resumed repeats the uninterrupted one exactly;
- 4 processes with ``sequence_parallel: 2`` (two groups, DDP across them) end as 2 plain DDP processes do;
- a LoRA run (``train.trainable: lora``: its teacher is the student's own module) on 2 processes with
  ``sequence_parallel: 2`` ends as on 1 process; a LoRA student and its teacher in torch's FSDP1 (not through the
  loop) compute what the unsharded model does.
The config's refusals are one line each. FSDP + sequence parallelism is not tested here: accelerate 1.15 makes
a CPU run MULTI_CPU (DDP) whatever the FSDP settings say (docs/multigpu.md).
"""
from __future__ import annotations

import os
import traceback
from pathlib import Path

import pytest
import torch

from attnqat.train import load_config, train, validate
from conftest import as_torchrun_rank, free_port, run_forked

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"
# every weight trainable (the gradient of each reaches it through the sharded sequence), 2 samples a step
COMMON = ["log.progress=false", "train.max_steps=2", "data.batch_size=2", "data.held_out=2", "train.trainable=all",
          "checkpoint.every=1", "train.lr_schedule=cosine"]
SP2 = ["train.sequence_parallel=2"]
LORA = ["train.trainable=lora", "train.lora.rank=4"]
# per world size: (output folder, overrides, train() arguments), run in this order on one process group
RUNS = {2: [("sp", SP2, {}), ("cut", SP2, {"stop_after": 1}), ("cut", SP2, {"resume": "auto"}),
            ("dp", [], {}),                 # plain DDP over 2 processes: the reference of the 4-process run
            ("sp_lora", SP2 + LORA, {}),
            ("sp_compiled", SP2 + ["train.compile=true"], {})],  # blocks compiled around the Ulysses attention
        4: [("sp4", SP2, {})]}              # two sequence groups of 2, DDP across them


@pytest.fixture(autouse=True)
def reference_path(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the FP4 reference path (see tests/test_train.py)


def _worker(rank: int, world: int, port: int, root: str):
    """The runs of RUNS[world], one after another on one gloo process group (accelerate's MULTI_CPU)."""
    from accelerate import Accelerator

    as_torchrun_rank(rank, world, port)
    # train() ends by destroying the process group; keep it for the next run of this worker
    Accelerator.end_training = lambda self: None
    losses = {}
    try:
        for i, (name, overrides, kwargs) in enumerate(RUNS[world]):
            cfg = load_config(TINY, [f"output_dir={root}/{name}", *COMMON, *overrides])
            losses[f"{name}/{i}"] = train(cfg, **kwargs).losses
        if world == 2:
            losses["fsdp"] = _fsdp_under_sequence_parallel(rank)
            losses["fsdp_lora"] = _fsdp_lora_teacher()
    except Exception:  # noqa: BLE001 - reported to the parent
        losses["error"] = traceback.format_exc()
    finally:
        torch.save(losses, os.path.join(root, f"world{world}-rank{rank}.pt"))
        torch.distributed.destroy_process_group()


def _fsdp_under_sequence_parallel(rank: int) -> tuple[float, float]:
    """The patched tiny model under Ulysses (2) inside torch's FSDP1 as configs/fsdp_wan14b.yaml has accelerate
    build it (one unit per WanTransformerBlock, use_orig_params), in the loop's order: patch, gradient
    checkpointing, enable_parallelism, wrap. Returns the output's and the (loss x 2) gradients' largest
    difference from the unsharded model (relative)."""
    import functools

    from diffusers.models.transformers.transformer_wan import WanTransformerBlock
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    from attnqat.pipelines import build_tiny_transformer
    from attnqat.train import sequence_parallel
    from attnqat.train.student_teacher import patch_for_training

    def model():
        m = build_tiny_transformer().train()
        patch_for_training(m, "attn_qat")
        m.enable_gradient_checkpointing()
        return m

    g = torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(1, 16, 2, 8, 8, generator=g), timestep=torch.tensor([500.0]),
                  encoder_hidden_states=torch.randn(1, 8, 32, generator=g), return_dict=False)
    ref = model()
    ref_out = ref(**inputs)[0]
    weights = torch.linspace(-1, 1, ref_out.numel()).reshape(ref_out.shape)
    (ref_out * weights).sum().backward()
    sharded = model()
    sequence_parallel.enable(sharded, sequence_parallel.setup(2, rank, 2, "cpu"))
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={WanTransformerBlock})
    wrapped = FullyShardedDataParallel(sharded, auto_wrap_policy=policy, use_orig_params=True,
                                       device_id=torch.device("cpu"))
    out = wrapped(**inputs)[0]
    (out * weights * 2).sum().backward()  # x sequence_parallel: FSDP averages over the 2 processes
    worst = 0.0
    with FullyShardedDataParallel.summon_full_params(wrapped, with_grads=True):
        grads = {n.replace("_fsdp_wrapped_module.", ""): p.grad for n, p in sharded.named_parameters()}
        for n, p in ref.named_parameters():
            worst = max(worst, ((grads[n] - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-12)).item())
    return (out - ref_out).abs().max().item(), worst


def _fsdp_lora_teacher() -> tuple[float, float]:
    """A LoRA student (fp32 frozen weights and adapter, as the loop loads them under FSDP1) inside torch's FSDP1 as
    configs/fsdp_wan14b.yaml has accelerate build it, with its AdapterOffTeacher called through the wrapper, two
    steps of (student - teacher)^2: the largest difference of the outputs and of the adapter's gradients from the
    unsharded model's (relative)."""
    import functools

    from diffusers.models.transformers.transformer_wan import WanTransformerBlock
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    from attnqat.pipelines import build_tiny_transformer
    from attnqat.pipelines.lora import DEFAULT_TARGETS
    from attnqat.train.student_teacher import make_student_teacher

    def model():
        torch.manual_seed(0)  # the adapter's A
        student, teacher = make_student_teacher(build_tiny_transformer(), "attn_qat", trainable="lora", lora=dict(
            rank=4, alpha=4.0, target_modules=DEFAULT_TARGETS, dropout=0.0))
        for n, p in student.named_parameters():
            if ".lora_B." in n:  # B starts at zero: the adapter would change nothing
                p.data.copy_(torch.linspace(-0.1, 0.1, p.numel()).reshape(p.shape))
        return student, teacher

    g = torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(1, 16, 2, 8, 8, generator=g), timestep=torch.tensor([500.0]),
                  encoder_hidden_states=torch.randn(1, 8, 32, generator=g), return_dict=False)
    ref, ref_teacher = model()
    with torch.no_grad():
        ref_t = ref_teacher(**inputs)[0]
    ref_s = ref(**inputs)[0]
    (ref_s - ref_t).pow(2).sum().backward()
    student, teacher = model()
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={WanTransformerBlock})
    wrapped = FullyShardedDataParallel(student, auto_wrap_policy=policy, use_orig_params=True,
                                       device_id=torch.device("cpu"))
    teacher.forward_module = wrapped  # as the Trainer sets it
    for _ in range(2):  # the second step after the teacher switched the adapter off and on again
        wrapped.zero_grad()
        with torch.no_grad():
            out_t = teacher(**inputs)[0]
        out_s = wrapped(**inputs)[0]
        (out_s - out_t).pow(2).sum().backward()
    out_err = max((out_t - ref_t).abs().max().item(), (out_s - ref_s).abs().max().item())
    worst = 0.0
    with FullyShardedDataParallel.summon_full_params(wrapped, with_grads=True):
        grads = {n.replace("_fsdp_wrapped_module.", ""): p.grad for n, p in student.named_parameters()}
        for n, p in ref.named_parameters():
            if p.requires_grad:
                worst = max(worst, ((grads[n] - p.grad).abs().max() / p.grad.abs().max().clamp_min(1e-12)).item())
    return out_err, worst


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "final" / "transformer.safetensors"))


def _run_processes(world: int, root: Path) -> list[dict]:
    """_worker on ``world`` forked processes (conftest's run_forked: spawned ones would import torch and diffusers
    again, 60 s for this file on a small shared CPU)."""
    run_forked(_worker, (world, free_port(), str(root)), world, f"{world} training processes")
    results = [torch.load(root / f"world{world}-rank{r}.pt") for r in range(world)]
    for r in results:
        assert "error" not in r, r["error"]
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sp")
    with pytest.MonkeyPatch.context() as m:
        m.setenv("TRITON_INTERPRET", "0")  # the FP4 reference path, in the forked processes too
        results = {world: _run_processes(world, root) for world in RUNS}
        results[1] = [{name: train(load_config(TINY, [f"output_dir={root}/{name[:-2]}", *COMMON, *extra])).losses
                       for name, extra in (("one/0", []), ("one_lora/0", LORA))}]
    return root, results


def _assert_same_training(root: Path, run: str, reference: str, losses: list[list[float]], reference_losses):
    """Same losses and gradient norms (up to fp32 rounding), same weights after 2 AdamW steps (a few units in the
    last place of each weight, and a thousandth of the largest step; measured: at most 6e-8, an ulp of a weight
    near 1, against steps of 4.5e-5)."""
    from attnqat.train.loop import read_log

    assert all(x == losses[0] for x in losses)  # reduced over the processes: the same on every one
    assert losses[0] == pytest.approx(reference_losses, rel=1e-6, abs=0)  # measured: 4.5e-7
    # AdamW hardly sees a gradient's scale; the norm does: 2x without the loss scaling, 1/2 without the sharding
    norms = [[float(r["grad_norm"]) for r in read_log(root / name / "log.csv")] for name in (run, reference)]
    assert norms[0] == pytest.approx(norms[1], rel=1e-5, abs=0)
    assert len((root / run / "log.csv").read_text().splitlines()) == 3  # header + a row per step, written once
    init, ref, got = _weights_at_step_0(), _weights(root / reference), _weights(root / run)
    moved = max((ref[k] - init[k]).abs().max().item() for k in ref)
    assert moved > 1e-5  # AdamW moved the weights by about lr per step (lr 3e-5)
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=4 * torch.finfo(torch.float32).eps, atol=1e-3 * moved)


def _weights_at_step_0() -> dict[str, torch.Tensor]:
    from attnqat.pipelines import build_tiny_transformer

    return {k: v.float() for k, v in build_tiny_transformer().state_dict().items()}


def test_one_sequence_group_of_two_equals_one_process(runs):
    """2 processes, sequence_parallel 2: both draw the one process's batch (data-parallel rank 0), and the
    loss x 2 before DDP's mean makes the gradient the group's sum."""
    root, results = runs
    _assert_same_training(root, "sp", "one", [r["sp/0"] for r in results[2]], results[1][0]["one/0"])


def test_two_sequence_groups_equal_two_process_data_parallel(runs):
    """4 processes, sequence_parallel 2 (mesh dp x ring x ulysses = 2 x 1 x 2, diffusers on its ring x ulysses
    sub-mesh): groups {0, 1} and {2, 3} train on the batches of data-parallel ranks 0 and 1, as 2 plain DDP
    processes do."""
    root, results = runs
    _assert_same_training(root, "sp4", "dp", [r["sp4/0"] for r in results[4]], results[2][0]["dp/3"])


def test_fsdp_wrapping_keeps_the_sequence_parallel_hooks(runs):
    """Not the loop (accelerate 1.15 makes a CPU run DDP whatever its FSDP settings say), but the composition the
    loop relies on under FSDP: diffusers' hooks and the processors survive FSDP1's wrapping, the output equals
    the unsharded model's, and the gradients (loss x 2, FSDP's mean) equal its gradients."""
    _, results = runs
    for r in results[2]:
        out_err, grad_err = r["fsdp"]
        assert out_err <= 1e-6 and grad_err <= 1e-5, r["fsdp"]  # measured: 0 and 8.5e-7


def test_a_lora_run_under_sequence_parallel_equals_one_process(runs):
    """The LoRA teacher (the student's module, adapter off, reference processors swapped in) runs sharded as the
    student does: the same losses, gradient norms and adapter weights as one process."""
    from safetensors.torch import load_file

    from attnqat.pipelines.lora import LORA_FILE
    from attnqat.train.loop import read_log

    root, results = runs
    losses = [r["sp_lora/4"] for r in results[2]]
    assert all(x == losses[0] for x in losses)
    assert losses[0] == pytest.approx(results[1][0]["one_lora/0"], rel=1e-6, abs=0)
    norms = [[float(r["grad_norm"]) for r in read_log(root / name / "log.csv")] for name in ("sp_lora", "one_lora")]
    assert norms[0] == pytest.approx(norms[1], rel=1e-5, abs=0)
    got, ref = (load_file(str(root / name / "final" / LORA_FILE)) for name in ("sp_lora", "one_lora"))
    moved = max(ref[k].abs().max().item() for k in ref if ".lora_B." in k)  # B starts at zero
    assert got.keys() == ref.keys() and moved > 1e-5
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=4 * torch.finfo(torch.float32).eps, atol=1e-3 * moved)


def test_compiled_blocks_under_sequence_parallel_train_as_one_process(runs):
    """train.compile with sequence_parallel 2: each block compiled in pieces around the templated Ulysses
    attention (its backward cannot be traced: attnqat.pipelines.context_parallel), the losses and gradient norms of
    one eager process to Inductor's rounding."""
    from attnqat.train.loop import read_log

    root, results = runs
    losses = [r["sp_compiled/5"] for r in results[2]]
    assert all(x == losses[0] for x in losses) and len(losses[0]) == 2
    assert losses[0] == pytest.approx(results[1][0]["one/0"], rel=1e-5, abs=0)
    norms = [[float(r["grad_norm"]) for r in read_log(root / name / "log.csv")] for name in ("sp_compiled", "one")]
    assert norms[0] == pytest.approx(norms[1], rel=1e-4, abs=0)


def test_fsdp1_runs_the_lora_teacher(runs):
    """Not the loop either: a LoRA student in torch's FSDP1 (the wrapping configs/fsdp_wan14b.yaml asks of accelerate)
    with its AdapterOffTeacher called through the wrapper gives the unsharded outputs and adapter gradients."""
    _, results = runs
    for r in results[2]:
        out_err, grad_err = r["fsdp_lora"]
        assert out_err <= 1e-6 and grad_err <= 1e-5, r["fsdp_lora"]


def test_resume_under_sequence_parallel_is_exact(runs):
    root, results = runs
    for r in results[2]:
        assert len(r["cut/1"]) == 1 and r["cut/1"] + r["cut/2"] == r["sp/0"]
    cut, whole = _weights(root / "cut"), _weights(root / "sp")
    assert all(torch.equal(cut[k], whole[k]) for k in whole)


@pytest.mark.parametrize("override, world, message", [
    ("train.sequence_parallel=2", 1, "must divide the process count 1"),
    ("train.sequence_parallel=2", 3, "must divide the process count 3"),
    ("train.sequence_parallel=4", 4, "the transformer's 2 attention heads"),
    ("train.sequence_parallel=0", 2, "train.sequence_parallel must be >= 1"),
])
def test_refusals_are_one_line(tmp_path, override, world, message):
    with pytest.raises(ValueError, match=message) as e:
        validate(load_config(TINY, [f"output_dir={tmp_path}", override]), world_size=world)
    assert "\n" not in str(e.value)


def test_cli_refuses_in_one_line_before_any_process_group(tmp_path, capsys, monkeypatch):
    """The CLI checks against the launcher's WORLD_SIZE (torchrun, accelerate launch) before building anything."""
    from attnqat.cli import main

    argv = ["train", "--config", str(TINY), "--output-dir", str(tmp_path / "run")]
    for world, degree, message in (("3", 2, "must divide the process count 3"), ("4", 4, "2 attention heads")):
        monkeypatch.setenv("WORLD_SIZE", world)
        assert main(argv + ["--set", f"train.sequence_parallel={degree}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "run").exists()


def test_tokens_must_split_evenly(tmp_path):
    from attnqat.pipelines.wan_configs import WAN21_1_3B_TRANSFORMER_CONFIG, WAN21_14B_TRANSFORMER_CONFIG

    cfg = load_config(TINY, [f"output_dir={tmp_path}", "train.sequence_parallel=2", "data.latent_shape=[16, 1, 6, 6]"])
    with pytest.raises(ValueError, match="must divide the 9 tokens of latent shape"):
        validate(cfg, world_size=2)
    cfg = load_config(ROOT / "configs" / "wan2.1-14b-sp.yaml", ["data.path=null"])
    assert cfg.train.sequence_parallel == 8
    validate(cfg, transformer_config=WAN21_14B_TRANSFORMER_CONFIG, device_type="cuda", world_size=16)  # 32,760 tokens / 8
    with pytest.raises(ValueError, match="12 attention heads"):
        validate(cfg, transformer_config=WAN21_1_3B_TRANSFORMER_CONFIG, device_type="cuda", world_size=16)
