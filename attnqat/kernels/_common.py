"""Shared plumbing for the kernels: interpreter detection, input validation, launch configs."""
from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass

import torch

SUPPORTED_HEAD_DIMS = (64, 128)
LOG2E = 1.4426950408889634  # exponents are kept in log2 units: exp(x) = exp2(x * log2(e))


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, name: str,
              dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)) -> None:
    """Validate (B, H, L, D) attention inputs for a Triton kernel; raises ValueError with the values."""
    for t, n in ((q, "q"), (k, "k"), (v, "v")):
        if t.dim() != 4:
            raise ValueError(f"{name}: {n} must be (batch, heads, seqlen, head_dim), got shape {tuple(t.shape)}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"{name}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in dtypes:
        raise ValueError(f"{name}: dtype {q.dtype} not supported; use one of {tuple(str(d) for d in dtypes)}")
    b, h, lq, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"{name}: k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if k.shape[0] != b or k.shape[1] != h or k.shape[3] != d:
        raise ValueError(f"{name}: q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch, heads and head_dim")
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"{name}: head_dim {d} not in {SUPPORTED_HEAD_DIMS}")
    if lq == 0 or k.shape[2] == 0:
        raise ValueError(f"{name}: empty sequence (Lq={lq}, Lk={k.shape[2]})")
    for t, n in ((q, "q"), (k, "k"), (v, "v")):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: {n}'s last dim must be contiguous (stride {t.stride(-1)})")
    devices = {q.device, k.device, v.device}
    if len(devices) != 1:
        raise ValueError(f"{name}: q, k, v on different devices: {sorted(map(str, devices))}")
    if q.device.type == "cpu" and not interpreting():
        raise ValueError(f"{name}: CPU tensors need TRITON_INTERPRET=1 (slow) or use "
                         "attnqat.kernels.attention(), which runs the PyTorch reference on CPU")
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: device {q.device} not supported (CUDA, or CPU under the interpreter)")


def default_scale(head_dim: int, sm_scale: float | None) -> float:
    return 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes and launch parameters of one attention kernel launch."""
    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2

    @classmethod
    def parse(cls, text: str) -> "LaunchConfig":
        """``"128,64,8,3"`` -> block_m=128, block_n=64, num_warps=8, num_stages=3."""
        parts = [int(p) for p in text.replace(" ", "").split(",") if p]
        if len(parts) < 2 or len(parts) > 4:
            raise ValueError(f"launch config {text!r}: expected 'BLOCK_M,BLOCK_N[,WARPS[,STAGES]]'")
        return cls(*parts)


def pinned_config(env: str) -> LaunchConfig | None:
    """A config pinned by environment variable (tests and benchmarks), else None."""
    text = os.environ.get(env)
    return LaunchConfig.parse(text) if text else None


# Shared memory per block: the tuned configs fill an H100's 227 KB; an A100 has 163 KB, consumer GPUs
# (sm_86, sm_89, sm_120) 99 KB. These step down for them, in order.
SMALLER_CONFIGS = (LaunchConfig(128, 64, 8, 3), LaunchConfig(128, 64, 8, 2), LaunchConfig(64, 64, 4, 2))
_FITTED: dict = {}  # (key, requested config) -> the config that launched


def launch_fitting(launch, cfg: LaunchConfig, key: tuple):
    """``launch(c)`` with c = cfg, or else the first of SMALLER_CONFIGS that fits the GPU.

    Triton raises OutOfResources when a kernel is loaded, before anything runs, if its config needs more
    shared memory than the GPU has. The config that launched is remembered per ``key`` (the kernel and
    whatever changes its size: device, head_dim, variant flags), so the next call goes straight to it, and
    one warning names the fallback. ``launch`` must not have side effects before its kernel launch fails
    other than recomputable ones (sage3 reruns its pre-pass)."""
    from triton.runtime.errors import OutOfResources

    start = _FITTED.get((key, cfg), cfg)
    tried = []
    for c in dict.fromkeys((start, cfg, *SMALLER_CONFIGS)):
        try:
            out = launch(c)
        except OutOfResources as err:
            tried.append(f"{c}: {err}")
            continue
        if (key, cfg) not in _FITTED:
            _FITTED[(key, cfg)] = c
            if c != cfg:
                warnings.warn(f"{key[0]}: launch config {cfg} does not fit this GPU ({tried[0]}); using {c}",
                              stacklevel=3)
        return out
    raise RuntimeError(f"{key[0]}: no launch config fits this GPU:\n  " + "\n  ".join(tried))
