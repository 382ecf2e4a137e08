"""One QAT training step of Wan 2.1 14B under FSDP + Ulysses sequence parallelism (step time, peak memory per GPU).

    torchrun --nproc-per-node 2 bench/train_step_sp.py --layers 20        # 20 of the 40 blocks on 2 GPUs
    torchrun --nproc-per-node 8 bench/train_step_sp.py                    # the whole model on 8 GPUs
    torchrun --nproc-per-node 2 bench/train_step_sp.py --fsdp 2 --optimizer adamw8bit --shard-teacher  # whole, 2 GPUs
    python -m torch.distributed.run --nproc-per-node 2 bench/train_step_sp.py --tiny   # CPU code path (gloo)

What `attnqat train` runs with configs/wan2.1-14b-sp.yaml, on random weights and latents, without a model
folder: the student (fp32 master weights) is FSDP-sharded per WanTransformerBlock with bf16 compute
(--fsdp 1: FSDP1 as configs/fsdp_wan14b.yaml, FULL_SHARD, BACKWARD_PRE, use_orig_params; --fsdp 2: fully_shard
as configs/fsdp2_wan14b.yaml), gradient checkpointing on every block; student and frozen bf16 teacher (whole on
every GPU, or with --shard-teacher sharded as the student is: train.shard_teacher) run under diffusers' Ulysses
context parallelism over all processes (train.sequence_parallel = world size); the teacher has its own random
weights (a timing needs the work, not a student that starts at its teacher); one step = teacher forward +
student forward/backward of the features-distillation loss (block features summed over the group's shards,
x N as the loop does) + grad clip + the optimizer (--optimizer: train.optimizer's adamw or adamw8bit, built by
attnqat.train.optimizers as the loop builds it; adamw8bit needs --fsdp 2). Weights are created on the meta device
and materialised shard by shard on each GPU (a 14B fp32 copy per process would not fit a node's host memory:
docs/multigpu.md).

Per student mode (bf16, attn_qat): median step time over --steps after --warmup, tokens/s, the peak GPU memory of
the fullest rank over the timed steps, and what stays allocated between steps (weights, optimizer state, teacher)
on the fullest rank. Rank 0 prints the table and, with --write, puts it in the
`## Training step: Wan 2.1 14B, FSDP + sequence parallelism` section of docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import functools
import gc
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from attnqat.kernels import REFERENCE_MODE  # noqa: E402
from attnqat.pipelines import TINY_TRANSFORMER_CONFIG  # noqa: E402
from attnqat.pipelines.launch import launch_from_env, process_group, rank_device  # noqa: E402
from attnqat.pipelines.wan_configs import WAN21_14B_TRANSFORMER_CONFIG  # noqa: E402
from attnqat.train.optimizers import OPTIMIZERS  # noqa: E402
from _report import timed_steps, update_section  # noqa: E402
import e2e  # noqa: E402 - bench/e2e.py: its latent shapes and text length


SECTION = "## Training step: Wan 2.1 14B, FSDP + sequence parallelism"
INIT_STD = 0.02  # random weights: a timing needs finite activations, not a trained model


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--modes", default="bf16,attn_qat", help="student attention modes (default bf16,attn_qat)")
    p.add_argument("--layers", type=int, help="build only this many of the 40 blocks (said in the table)")
    p.add_argument("--steps", type=int, default=3, help="timed steps (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    p.add_argument("--fsdp", type=int, choices=(1, 2), default=1,
                   help="the student's FSDP: 1 (FullyShardedDataParallel, default) or 2 (fully_shard)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw", help="train.optimizer (default adamw)")
    p.add_argument("--shard-teacher", action="store_true",
                   help="shard the frozen teacher as the student is (train.shard_teacher); default: whole on each GPU")
    p.add_argument("--tiny", action="store_true", help="the tiny model, 32 tokens, fp32, on CPU (gloo)")
    p.add_argument("--write", action="store_true", help="write the section of docs/benchmarks.md (rank 0)")
    return p.parse_args(argv)


def _randomise(module: torch.nn.Module, recurse: bool) -> None:
    """Random weights in ``module``'s tensors (each process's own part of a DTensor: a timing needs values, not the
    same ones everywhere)."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for name, t in list(module.named_parameters(recurse=recurse)) + list(module.named_buffers(recurse=recurse)):
            t = t.to_local() if isinstance(t, DTensor) else t
            if t.is_floating_point():
                t.normal_(0.0, INIT_STD) if t.dim() > 1 else t.fill_(1.0 if name.endswith("weight") else 0.0)  # norms


def _materialise(module: torch.nn.Module, device: torch.device, dtype: torch.dtype | None = None) -> None:
    """FSDP1's param_init_fn: this module's own meta tensors become real ones on ``device``, random."""
    module.to_empty(device=device, recurse=False)
    _randomise(module, recurse=False)
    if dtype is not None:
        module.to(dtype)


def _meta_model(config: dict, layers: int):
    from diffusers import WanTransformer3DModel

    with torch.device("meta"):
        return WanTransformer3DModel(**dict(config, num_layers=layers))


def _student(config, layers, mode, device, sp, tiny, fsdp):
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock
    from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision, MixedPrecisionPolicy, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    from attnqat.train import sequence_parallel
    from attnqat.train.student_teacher import block_checkpoint, patch_for_training

    model = _meta_model(config, layers)
    patch_for_training(model, mode, "self")
    model.enable_gradient_checkpointing(block_checkpoint())  # FSDP2's input casts too
    sequence_parallel.enable(model, sp)  # before wrapping, as the loop does: FSDP calls the hooked forwards
    if fsdp == 2:  # configs/fsdp2_wan14b.yaml: what accelerate's FSDP2 prepare does with it
        bf16 = MixedPrecisionPolicy() if tiny else MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                        reduce_dtype=torch.bfloat16)
        for block in model.blocks:
            fully_shard(block, mp_policy=bf16, reshard_after_forward=True)
        fully_shard(model, mp_policy=bf16, reshard_after_forward=True)
        model.to_empty(device=device)  # each process's shards only
        _randomise(model, recurse=True)
        return model
    mixed = None if tiny else MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                             buffer_dtype=torch.bfloat16)
    return FSDP(model, auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                          transformer_layer_cls={WanTransformerBlock}),
                sharding_strategy=ShardingStrategy.FULL_SHARD, backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
                mixed_precision=mixed, use_orig_params=True, device_id=device,
                param_init_fn=functools.partial(_materialise, device=device))


def _teacher(config, layers, device, dtype, sp, student, shard):
    """The frozen teacher in ``dtype``: whole on this device, or (``shard``) sharded as ``student`` is, by the
    loop's own ``shard_teacher``."""
    from torch.distributed.fsdp import FSDPModule

    from attnqat.train import sequence_parallel
    from attnqat.train.student_teacher import patch_for_training, shard_teacher

    model = _meta_model(config, layers).to(dtype)
    if not shard:
        for module in model.modules():
            _materialise(module, device, None)
    model.eval().requires_grad_(False)
    patch_for_training(model, "bf16", "self")
    sequence_parallel.enable(model, sp)
    if shard:
        model = shard_teacher(model, student, device, param_init_fn=functools.partial(_materialise, device=device))
        if isinstance(model, FSDPModule):  # FSDP2: on the meta device until here
            model.to_empty(device=device)
            _randomise(model, recurse=True)
    return model


def run_mode(mode, args, config, layers, latent, device, sp):
    from attnqat.train import optimizers, sequence_parallel
    from attnqat.train.objectives import nmse
    from attnqat.train.student_teacher import FeatureCapture

    dtype = torch.float32 if args.tiny else torch.bfloat16
    student = _student(config, layers, mode, device, sp, args.tiny, args.fsdp)
    teacher = _teacher(config, layers, device, dtype, sp, student, args.shard_teacher)
    opt = optimizers.build(args.optimizer, student.parameters(), lr=1e-6, betas=(0.9, 0.999), eps=1e-8,
                           weight_decay=0.01)
    s_cap, t_cap = FeatureCapture(student), FeatureCapture(teacher)
    g = torch.Generator().manual_seed(0)  # the same sample on every process of the group
    x = torch.randn(1, *latent, generator=g).to(device)
    emb = torch.randn(1, 32 if args.tiny else e2e.TEXT_TOKENS, config["text_dim"], generator=g).to(device)
    ts = torch.rand(1, generator=g).to(device) * 1000
    total = functools.partial(sequence_parallel.sum_over_group, sp=sp)

    def step() -> float:
        with torch.no_grad(), t_cap.capturing() as tf:
            t_out = teacher(hidden_states=x.to(dtype), timestep=ts, encoder_hidden_states=emb.to(dtype),
                            return_dict=False)[0]
            tf = dict(tf)
        with s_cap.capturing() as sf:
            s_out = student(hidden_states=x, timestep=ts, encoder_hidden_states=emb, return_dict=False)[0]
            sf = dict(sf)
        loss = torch.stack([nmse(sf[i], tf[i], total=total) for i in sorted(tf)]).mean() + nmse(s_out, t_out)
        (loss * sp.degree).backward()  # the loop's gradient scale: FSDP averages, the group's shares add up
        if args.fsdp == 1:
            student.clip_grad_norm_(1.0)
        else:  # DTensor gradients: torch's clip reduces their norms over the mesh
            torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    times, losses = timed_steps(step, warmup=args.warmup, steps=args.steps, device=device,
                                before_each=torch.distributed.barrier)  # every rank starts the step together
    gib = [torch.cuda.max_memory_allocated(device) / 2**30, torch.cuda.memory_allocated(device) / 2**30] \
        if device.type == "cuda" else [0.0, 0.0]
    peak = torch.tensor(gib, device=device)  # peak over the timed steps; what stays between steps
    torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    s_cap.remove()
    t_cap.remove()
    # Every rank is done with this mode's process groups (diffusers made some for its mesh) before any rank
    # frees them: a gloo group torn down while a peer still talks to it aborts the process.
    torch.distributed.barrier()
    del student, teacher, opt
    gc.collect()
    torch.distributed.barrier()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"mode": mode, "step_s": statistics.median(times), "peak_gib": float(peak[0]),
            "resident_gib": float(peak[1]), "loss": losses[-1], "finite": all(torch.isfinite(torch.tensor(losses)))}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.optimizer == "adamw8bit" and args.fsdp != 2:
        print("bench/train_step_sp.py: error: --optimizer adamw8bit needs --fsdp 2 (train.optimizer: its 8-bit moments "
              "shard as the weights' rows; FSDP1 hands the optimizer flat shards)", file=sys.stderr)
        return 2
    launch = launch_from_env()
    if launch is None:
        print("bench/train_step_sp.py: error: run it under torchrun --nproc-per-node N (N >= 2)", file=sys.stderr)
        return 2
    config = TINY_TRANSFORMER_CONFIG if args.tiny else WAN21_14B_TRANSFORMER_CONFIG
    latent = e2e.TINY_LATENT if args.tiny else e2e.LATENT_480P  # 32 / 32,760 tokens
    layers = args.layers or config["num_layers"]
    tokens = latent[1] * (latent[2] // 2) * (latent[3] // 2)
    n = launch.world_size
    if config["num_attention_heads"] % n or tokens % n:
        print(f"bench/train_step_sp.py: error: {n} processes must divide the {config['num_attention_heads']} heads "
              f"and the {tokens} tokens", file=sys.stderr)
        return 2
    device = rank_device(launch, "cpu" if args.tiny else "cuda")
    with process_group(device):
        from attnqat.train import sequence_parallel

        sp = sequence_parallel.setup(n, launch.rank, n, device.type)
        results = []
        for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
            r = run_mode(mode, args, config, layers, latent, device, sp)
            r["tokens_per_s"] = tokens / r["step_s"]
            results.append(r)
            if launch.rank == 0:
                print(f"{mode:>10}: step {r['step_s']:.3f} s  peak {r['peak_gib']:.1f} GiB, between steps "
                      f"{r['resident_gib']:.1f} GiB (fullest rank)  loss {r['loss']:.4g}", flush=True)
        if launch.rank != 0:
            return 0
    base = next((r for r in results if r["mode"] == REFERENCE_MODE), None)
    lines = ["| student attention | step (s) | × bf16 | tokens/s | peak memory per GPU (GiB) | between steps (GiB) |",
             "|---|---|---|---|---|---|"]
    for r in results:
        ratio = f"{r['step_s'] / base['step_s']:.2f}" if base else "–"
        peak, resident = (f"{r['peak_gib']:.1f}", f"{r['resident_gib']:.1f}") if not args.tiny else ("n/a (CPU)",) * 2
        lines.append(f"| `{r['mode']}` | {r['step_s']:.3f} | {ratio} | {r['tokens_per_s']:.0f} | {peak} | {resident} |")
    table = "\n".join(lines)
    print(table)
    if args.write:
        what = ("the tiny model (CPU code path)" if args.tiny else
                f"Wan 2.1 14B, {layers} of 40 blocks" if layers != 40 else "Wan 2.1 14B, all 40 blocks")
        teacher = "sharded as the student" if args.shard_teacher else "whole on every GPU"
        md = (f"{SECTION}\n\n`torchrun --nproc-per-node {n} bench/train_step_sp.py "
              f"{' '.join(sys.argv[1:] if argv is None else argv)}`: {what}, random weights, latents {latent} "
              f"({tokens:,} tokens, {tokens // n:,} per GPU), features distillation from a frozen bf16 teacher "
              f"({teacher}), FSDP{args.fsdp} FULL_SHARD per block with bf16 compute over fp32 master weights, Ulysses "
              f"over {n} GPUs, gradient checkpointing, {args.optimizer}. Median of {args.steps} steps after "
              f"{args.warmup} warm-up.\n\n{table}\n")
        update_section("train_step_sp", md, ROOT / "docs" / "benchmarks.md")
    return 0 if all(r["finite"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
