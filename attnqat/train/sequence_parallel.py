"""Sequence parallelism (Ulysses) for training: ``train.sequence_parallel: N``.

The world of W = D x N processes is cut into D groups of N consecutive processes (process r is in group
r // N, its data-parallel rank). Within a group, the student and the teacher run under diffusers'
``enable_parallelism(config=ContextParallelConfig(ulysses_degree=N, mesh=...))``; across the world, DDP or
FSDP (accelerate) runs as without it. What each process of a group does:

- it draws the same micro-batch as the others (the batch is a function of the data-parallel rank);
- diffusers' hooks (Wan's ``_cp_plan``) give it 1/N of the sequence: the input of ``blocks.0`` and the RoPE
  tables are split, the output is gathered after ``proj_out``; self-attention all-to-alls heads
  (:mod:`attnqat.pipelines.context_parallel`), cross-attention sees all 512 text tokens;
- every loss term holds the whole sample's value on every process of the group, and its gradient on a
  process is the part that flows through that process's shard: the output's all-gather passes back only
  the local chunk (diffusers' ``AllGatherFunction``), and :func:`sum_over_group` does the same for sums
  over the sharded block features.

Gradient scale: a sample's gradient is the SUM of its group's per-process gradients, while DDP / FSDP
AVERAGE over all W processes. The loop multiplies the loss by N: mean over W of N x share
= (1/D) x sum over groups of their full gradients, the data-parallel mean.

The device mesh is ``(dp, ring, ulysses) = (D, 1, N)``; diffusers' ``ContextParallelConfig(mesh=...)`` takes
the ``ring`` x ``ulysses`` sub-mesh from it, so W > N works (its default mesh spans the whole world).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from attnqat.pipelines.context_parallel import enable_context_parallel

MESH_DIMS = ("dp", "ring", "ulysses")  # diffusers' ContextParallelConfig looks up "ring" and "ulysses" by name


@dataclass
class SequenceParallel:
    """This process's place: ``degree`` processes share a sample; ``dp_rank`` of ``dp_size`` groups."""
    degree: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    mesh: Any = None    # DeviceMesh (dp, ring, ulysses); None when degree is 1
    group: Any = None   # the process group of this process's sequence group; None when degree is 1

    @property
    def leader(self) -> int:
        """Global rank of the first process of this process's group."""
        return self.dp_rank * self.degree


def setup(degree: int, rank: int, world: int, device_type: str) -> SequenceParallel:
    """Build the (dp, ring, ulysses) mesh (every process must call this; it creates process groups)."""
    if degree == 1:
        return SequenceParallel(1, rank, world)
    if world % degree:
        raise ValueError(f"train.sequence_parallel {degree} does not divide the {world} processes")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (world // degree, 1, degree), mesh_dim_names=MESH_DIMS)
    return SequenceParallel(degree, rank // degree, world // degree, mesh, mesh["ulysses"].get_group())


def enable(model: torch.nn.Module, sp: SequenceParallel) -> None:
    """diffusers' Ulysses context parallelism on ``model`` over this process's group (after patch_attention,
    before accelerate's prepare: the hooks sit in the modules' ``forward``, which DDP / FSDP call)."""
    enable_context_parallel(model, "ulysses", sp.degree, mesh=sp.mesh)


class _SumOverGroup(torch.autograd.Function):
    """Forward: the sum of ``x`` over the group (the whole sample's value on every process). Backward: the
    gradient goes to the local ``x`` unchanged, this process's share, as the output's all-gather does."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        out = x.clone()
        torch.distributed.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def sum_over_group(x: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
    """A per-shard sum (e.g. of squared feature errors) summed over the sequence group; the identity at degree 1."""
    return x if sp.degree == 1 else _SumOverGroup.apply(x, sp.group)


def share_batch(batch: dict[str, torch.Tensor], sp: SequenceParallel) -> dict[str, torch.Tensor]:
    """The group leader's tensors on every process of the group (for batches computed on the device, such as
    corpus clips encoded by the VAE, which need not be bitwise equal on two GPUs)."""
    if sp.degree == 1:
        return batch
    for t in batch.values():
        torch.distributed.broadcast(t, src=sp.leader, group=sp.group)
    return batch
