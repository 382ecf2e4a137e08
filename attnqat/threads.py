"""A sane default for torch's CPU thread count.

torch starts one intra-op thread per core it sees, and in a container it often sees the host's
cores, not the few this process may use (CPU affinity, a cgroup CPU quota). Many more threads than
usable CPUs make every step spin and wait: on a 2-CPU container, CPU steps of the tiny model ran
about 100x slower. The command-line tools call :func:`limit_torch_threads` before their work.

The user's choice wins: with ``OMP_NUM_THREADS`` (or ``MKL_NUM_THREADS``) set, nothing changes.

OpenMP's threads also spin while they wait for work; when another process holds a core, the spinning
threads take the CPU from the one doing the work: the CPU quick start took 109-209 s instead of 29 s on
2 cores beside one busy process. :func:`prefer_passive_waits` makes them sleep instead (free when the cores
are idle), unless the user set ``OMP_WAIT_POLICY``; OpenMP reads it once, when torch loads.
"""
from __future__ import annotations

import math
import os

__all__ = ["usable_cpus", "limit_torch_threads", "prefer_passive_waits"]

USER_SETTINGS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def _cgroup_cpu_quota(root: str = "/sys/fs/cgroup") -> float | None:
    """CPUs allowed by the cgroup's CPU quota (v2 ``cpu.max``, v1 ``cfs_quota_us``), None if unlimited."""
    try:
        with open(os.path.join(root, "cpu.max")) as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(root, "cpu", "cpu.cfs_quota_us")) as f:
            quota = int(f.read())
        with open(os.path.join(root, "cpu", "cpu.cfs_period_us")) as f:
            period = int(f.read())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask, capped by the cgroup quota (at least 1)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        n = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    if quota is not None:
        n = min(n, math.ceil(quota))
    return max(1, n)


def limit_torch_threads() -> int | None:
    """Lower torch's intra-op thread count to :func:`usable_cpus` when it is above it and the user set
    no thread count. Return: the new count, or None when nothing changed."""
    if any(os.environ.get(k, "").strip() for k in USER_SETTINGS):
        return None
    import torch

    n = usable_cpus()
    if torch.get_num_threads() > n:
        torch.set_num_threads(n)
        return n
    return None


def prefer_passive_waits() -> None:
    """``OMP_WAIT_POLICY=PASSIVE`` unless the user set it (call before torch is imported: OpenMP reads it once)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
