"""Shared plumbing for the kernels: interpreter detection, input validation, launch configs."""
from __future__ import annotations

import contextlib
import math
import numbers
import os
import threading
import warnings
from dataclasses import dataclass

import torch

SUPPORTED_HEAD_DIMS = (64, 128)
P_BWD_CHOICES = ("final_max", "normalized")  # attn_qat's p_bwd option (SPEC §2)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


KERNEL_DTYPES = (torch.bfloat16, torch.float16)


def needs_grad(*tensors: torch.Tensor) -> bool:
    """True when a backward can follow: grad mode is on and one of ``tensors`` requires grad."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


_RECOMPUTED = threading.local()


@contextlib.contextmanager
def saved_tensors_recomputed():
    """Inside: whatever autograd saves is thrown away and recomputed before the backward (gradient checkpointing's
    first pass: ``train``'s block checkpoint enters it through torch's ``context_fn``). attn_qat's training forward
    then computes only its output, with the inference kernel (the same bits: tests/test_attn_qat.py), and saves
    placeholders of its saved tensors' shapes (:func:`training_placeholders`): the recompute, outside this context,
    runs the training forward that the backward reads. At Wan 14B's shape the inference forward takes 41 ms against
    the training forward's 59 (H100), once per block a step."""
    before = getattr(_RECOMPUTED, "on", False)
    _RECOMPUTED.on = True
    try:
        yield
    finally:
        _RECOMPUTED.on = before


def recomputed_later() -> bool:
    """Whether a training forward runs inside :func:`saved_tensors_recomputed`. Never while torch.compile traces: a
    compiled graph would keep the answer of the pass it was traced in (the recompute would then save placeholders)."""
    return not torch.compiler.is_compiling() and getattr(_RECOMPUTED, "on", False)  # tracing never reads the flag


def training_placeholders(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Stand-ins for attn_qat's saved Q^F, K^F, V^F, O', m, l in a pass whose saved tensors are recomputed: the
    shapes, dtypes (:func:`work_dtype`, as the training forward's) and device that the checkpoint compares with the
    recompute's, one element of memory each."""
    one = lambda dtype: torch.empty((), dtype=dtype, device=q.device)  # noqa: E731
    wdt, stats = work_dtype(q.dtype), q.shape[:3]
    return (one(wdt).expand(q.shape), one(wdt).expand(k.shape), one(wdt).expand(v.shape), one(wdt).expand(q.shape),
            one(torch.float32).expand(stats), one(torch.float32).expand(stats))


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, name: str, sm_scale=None, causal=False,
              dtypes: tuple[torch.dtype, ...] = KERNEL_DTYPES, cpu_dtypes: tuple[torch.dtype, ...] = (),
              head_dims: tuple[int, ...] | None = SUPPORTED_HEAD_DIMS, kernel: bool = True) -> None:
    """Validate (B, H, L, D) attention inputs; raises ValueError naming the offending value.

    The one input check of the package: :func:`attnqat.kernels.attention` runs it once for every mode and path
    (Triton kernels and PyTorch references alike, with the mode's ``dtypes`` and ``head_dims``) and then calls
    the mode's unchecked path; the public functions of the kernel modules (``attn_qat_attention`` ...) are
    edges of their own and run it with ``kernel=True`` (CPU tensors then need the interpreter).
    ``cpu_dtypes`` are accepted on CPU only (fp32 for the references); ``head_dims=None`` takes any.
    """
    named = ((q, "q"), (k, "k"), (v, "v"))
    for t, n in named:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: {n} must be a torch.Tensor, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise ValueError(f"{name}: {n} must be a dense tensor, got layout {t.layout}")
        if t.dim() != 4:
            raise ValueError(f"{name}: {n} must be (batch, heads, seqlen, head_dim), got shape {tuple(t.shape)}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"{name}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    devices = {q.device, k.device, v.device}
    if len(devices) != 1:
        raise ValueError(f"{name}: q, k, v on different devices: {sorted(map(str, devices))}")
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: device {q.device} not supported (CUDA, or CPU)")
    allowed = dtypes + (cpu_dtypes if q.device.type == "cpu" else ())
    if q.dtype not in allowed:
        raise ValueError(f"{name}: dtype {q.dtype} not supported; use one of {tuple(str(d) for d in allowed)}")
    b, h, lq, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"{name}: k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if k.shape[0] != b or k.shape[1] != h or k.shape[3] != d:
        raise ValueError(f"{name}: q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch, heads and head_dim"
                         " (no broadcasting)")
    if 0 in q.shape or 0 in k.shape:
        raise ValueError(f"{name}: empty input (q {tuple(q.shape)}, k {tuple(k.shape)})")
    if head_dims is not None and d not in head_dims:
        raise ValueError(f"{name}: head_dim {d} not in {head_dims}")
    for t, n in named:
        if t.stride(-1) != 1 and t.shape[-1] != 1:
            raise ValueError(f"{name}: {n}'s last dim must be contiguous (stride {t.stride(-1)})")
    if sm_scale is not None and (isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real)
                                 or not math.isfinite(sm_scale) or sm_scale <= 0):
        raise ValueError(f"{name}: sm_scale must be a finite number > 0 (or None for 1/sqrt(head_dim)), "
                         f"got {sm_scale!r}")
    if not isinstance(causal, bool):
        raise ValueError(f"{name}: causal must be True or False, got {causal!r}")
    if kernel and q.device.type == "cpu" and not interpreting():
        raise ValueError(f"{name}: CPU tensors need TRITON_INTERPRET=1 (slow) or use "
                         "attnqat.kernels.attention(), which runs the PyTorch reference on CPU")


def default_scale(head_dim: int, sm_scale: float | None) -> float:
    return 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of the FP4 kernels' quantized operands and outputs: fp32 under the interpreter (exact there), else
    the input's."""
    return torch.float32 if interpreting() else dtype


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


def launch_fitting(launch, cfg: LaunchConfig, key: tuple, smaller: tuple[LaunchConfig, ...] = SMALLER_CONFIGS):
    """``launch(c)`` with c = cfg, or else the first of ``smaller`` (SMALLER_CONFIGS unless given) that fits
    the GPU.

    Triton raises OutOfResources when a kernel is loaded, before anything runs, if its config needs more
    shared memory than the GPU has. The config that launched is remembered per ``key`` (the kernel and
    whatever changes its size: device, head_dim, variant flags), so the next call goes straight to it, and
    one warning names the fallback. ``launch`` must not have side effects before its kernel launch fails
    other than recomputable ones (sage3 reruns its pre-pass). The FP4 kernels' results do not depend on
    their tiles (SPEC §2), so any of SMALLER_CONFIGS will do; sagebwd's tiles are quantization blocks, so it
    passes step-downs that keep them (``sagebwd.step_down``)."""
    from triton.runtime.errors import OutOfResources

    start = _FITTED.get((key, cfg), cfg)
    tried = []
    for c in dict.fromkeys((start, cfg, *smaller)):
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
