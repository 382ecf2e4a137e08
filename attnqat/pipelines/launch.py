"""Several processes for ``attnqat generate --parallel``: the launch torchrun describes in the environment,
the process group around the run, and rank 0's checks shared with every rank.

    torchrun --nproc-per-node 2 -m attnqat generate --parallel ulysses --prompt ... --out v.mp4

torchrun (and ``accelerate launch`` on GPUs) sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT in each process; ``init_process_group`` reads them (its ``env://`` default). Each process uses
``cuda:LOCAL_RANK`` with NCCL, or the CPU with gloo where torch has no accelerator (how the tests run it).
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = ["Launch", "LAUNCH_HINT", "launch_from_env", "rank_device", "process_group", "shared_check"]

# accelerate launch starts GPU processes through torch.distributed.run (its multi_gpu_launcher), so they get the
# same variables; on the CPU (accelerate 1.15, --cpu) it starts one process, which --parallel refuses.
LAUNCH_HINT = ("launch it with torchrun --nproc-per-node N -m attnqat generate ... (on GPUs also accelerate launch "
               "--num_processes N -m attnqat generate ...)")
# What a launcher sets besides WORLD_SIZE; without them init_process_group fails with a longer story.
_LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Launch:
    """This process's place in a distributed launch."""
    rank: int        # 0 .. world_size - 1; rank 0 decodes and writes the video
    local_rank: int  # its index on this machine: its GPU
    world_size: int


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
    text = environ.get(name)
    if text is None or not text.strip():
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"environment variable {name}={text!r} is not an integer; {LAUNCH_HINT}") from None


def launch_from_env(environ: Mapping[str, str] | None = None) -> Launch | None:
    """The launch the environment describes, or None for one process (WORLD_SIZE unset or 1)."""
    environ = os.environ if environ is None else environ
    world = _env_int(environ, "WORLD_SIZE")
    if world is None or world == 1:
        return None
    if world < 1:
        raise ValueError(f"environment variable WORLD_SIZE={world} is not a process count; {LAUNCH_HINT}")
    missing = [name for name in _LAUNCH_VARIABLES if not environ.get(name, "").strip()]
    if missing:
        raise ValueError(f"WORLD_SIZE={world} but {', '.join(missing)} not set; {LAUNCH_HINT}")
    rank, local_rank = _env_int(environ, "RANK"), _env_int(environ, "LOCAL_RANK")
    if not 0 <= rank < world or not 0 <= local_rank < world:
        raise ValueError(f"RANK={rank}, LOCAL_RANK={local_rank} outside 0..{world - 1} (WORLD_SIZE={world}); "
                         f"{LAUNCH_HINT}")
    return Launch(rank=rank, local_rank=local_rank, world_size=world)


def rank_device(launch: Launch, requested: str | None):
    """This process's device: ``cuda:LOCAL_RANK`` where CUDA is used (``requested`` "cuda", or None with a GPU
    available), else the CPU; ``requested`` was checked by :func:`attnqat.checks.check_device`."""
    import torch
    import torch.distributed as dist

    wanted = torch.device(requested) if requested is not None else None
    if wanted is not None and wanted.type == "cuda" and wanted.index is not None:
        raise ValueError(f"--device {requested} with --parallel: each process uses cuda:LOCAL_RANK; "
                         f"pass --device cuda or leave it out")
    use_cuda = wanted.type == "cuda" if wanted is not None else torch.cuda.is_available()
    if use_cuda:
        count = torch.cuda.device_count()
        if launch.local_rank >= count:
            raise ValueError(f"LOCAL_RANK {launch.local_rank}, but this machine has {count} CUDA GPU(s): start at "
                             f"most {count} processes on it (--nproc-per-node {count})")
        if not dist.is_nccl_available():
            raise ValueError("--parallel on GPUs needs torch.distributed's NCCL backend, which this torch build lacks")
        return torch.device("cuda", launch.local_rank)
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is not None:  # diffusers' enable_parallelism builds its device mesh on this accelerator
        raise ValueError(f"--parallel on the CPU needs a CPU-only torch build: diffusers puts the device mesh "
                         f"on torch's accelerator ({accelerator.type}); leave --device out to use the GPUs")
    if not dist.is_available() or not dist.is_gloo_available():
        raise ValueError("--parallel on the CPU needs torch.distributed's gloo backend, which this torch build lacks")
    return torch.device("cpu")


@contextmanager
def process_group(device, timeout_minutes: float | None = None) -> Iterator[None]:
    """The default process group (NCCL on a CUDA ``device``, gloo on the CPU) from the launch's environment,
    destroyed on the way out, error or not. ``timeout_minutes``: how long a collective may wait (torch's
    default, 10 minutes, when None; benchmarks where one rank times alone need more)."""
    import datetime

    import torch
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.set_device(device)  # before NCCL starts, so each rank's communicator is on its own GPU
    timeout = datetime.timedelta(minutes=timeout_minutes) if timeout_minutes else None
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout)
    try:
        yield
        # every rank done before any tears its group down: a rank that left first while rank 0 still worked was
        # aborted by gloo ("terminate called without an active exception") on a loaded 2-CPU CI machine. Only on
        # success: a rank that failed is not coming, and torchrun stops the others when it exits.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def shared_check(launch: Launch, check: Callable[[], object]) -> None:
    """Run ``check`` on rank 0 only and stop every rank with its one-line refusal.

    For what only rank 0 touches (the output paths: on several machines the others may not even see that
    folder): a refusal on rank 0 alone would leave the others waiting in their first collective. A
    ValueError, OSError or ImportError (bad arguments) is shared; anything else is a bug, raised on rank 0
    only (torchrun then stops the others)."""
    import torch.distributed as dist

    error, message = None, [None]
    if launch.rank == 0:
        try:
            check()
        except (ValueError, OSError, ImportError) as e:
            error, message = e, [str(e) or type(e).__name__]
    dist.broadcast_object_list(message, src=0)
    if error is not None:
        raise error
    if message[0] is not None:
        raise ValueError(message[0])
