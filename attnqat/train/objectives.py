"""The pieces of an Attn-QAT training step: student/teacher setup, noised inputs, feature capture, losses.

Flow matching (Wan 2.1, rectified flow): with clean latents x0, noise e and sigma in [0, 1],

    x_t = (1 - sigma) x0 + sigma e,   timestep = 1000 sigma,   velocity target v = e - x0

sigma is drawn uniformly, or "shifted" as Wan's scheduler shifts it: sigma' = s sigma / (1 + (s-1) sigma).

Distillation: the student (``attn_qat`` attention) and the frozen teacher (same initial weights, bf16
attention) see the same x_t, timestep and prompt embeddings. ``output`` matches the velocity
predictions; ``features`` also matches every ``WanTransformerBlock``'s output hidden states (SPEC §7).
Both use the normalized MSE ||s - t||^2 / ||t||^2, so blocks of different scale weigh alike.
"""
from __future__ import annotations

import copy
from contextlib import contextmanager

import torch

from attnqat.kernels import REFERENCE_MODE
from attnqat.pipelines import AttnQATProcessor, patch_attention


def nmse(student: torch.Tensor, teacher: torch.Tensor, eps: float = 1e-12, total=None) -> torch.Tensor:
    """||s - t||^2 / ||t||^2 over the whole tensor, in float32. ``total``: for tensors that are one process's
    part of a larger one (sequence shards), a function that sums a local sum over the processes holding the
    parts (:func:`attnqat.train.sequence_parallel.sum_over_group`)."""
    s, t = student.float(), teacher.float()
    err, ref = (s - t).pow(2).sum(), t.pow(2).sum()
    if total is not None:
        err, ref = total(err), total(ref)
    return err / ref.clamp_min(eps)


class AutocastAttnProcessor(AttnQATProcessor):
    """:class:`AttnQATProcessor` that casts fp32 Q/K/V to the autocast dtype when autocast is on.

    With fp32 master weights under bf16 autocast, Wan's RMSNorm on Q/K (fp32 weight) and RoPE hand the
    attention fp32 tensors. torch's SDPA is on autocast's low-precision list, so the bf16 mode would run
    in bf16 anyway; the FP4 Triton kernels take only bf16/fp16. Casting here gives both the same inputs.
    """

    def _attention(self, query, key, value, *args, **kwargs):
        dev = query.device.type
        if query.dtype == torch.float32 and torch.is_autocast_enabled(dev):
            dt = torch.get_autocast_dtype(dev)
            query, key, value = query.to(dt), key.to(dt), value.to(dt)
        return super()._attention(query, key, value, *args, **kwargs)


def patch_for_training(transformer: torch.nn.Module, mode: str, layers="self", **options) -> list[str]:
    """``patch_attention`` with :class:`AutocastAttnProcessor` processors (same layers, same mode)."""
    names = patch_attention(transformer, mode, layers, **options)
    for name in names:
        transformer.get_submodule(name).set_processor(AutocastAttnProcessor(mode, **options))
    return names


def cast_copy(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``copy.deepcopy(module).to(dtype)`` without its full-precision intermediate: each floating-point
    parameter and buffer is cast as it is copied (through deepcopy's memo), so the peak is the original
    plus the copy in ``dtype`` (Wan 14B in fp32 with a bf16 teacher: 86 GB, not 114 GB, a process)."""
    memo: dict[int, object] = {}
    for t in [*module.parameters(), *module.buffers()]:
        if t.is_floating_point() and id(t) not in memo:
            c = t.detach().to(dtype, copy=True)
            memo[id(t)] = torch.nn.Parameter(c, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else c
    return copy.deepcopy(module, memo).to(dtype)  # .to: whatever else Module.to casts (complex buffers)


def make_student_teacher(transformer: torch.nn.Module, mode: str, layers="self", options: dict | None = None,
                         teacher_dtype: torch.dtype = torch.float32, trainable: str = "all"):
    """(student, teacher): the student trains ``mode`` attention; the teacher is a frozen deep copy with
    bf16 (exact SDPA) attention in the same layers, cast to ``teacher_dtype``. ``trainable="attention"``
    leaves only the patched attention modules' weights trainable."""
    teacher = cast_copy(transformer, teacher_dtype).eval().requires_grad_(False)
    patch_for_training(teacher, REFERENCE_MODE, layers)
    student = transformer.train().requires_grad_(True)
    names = patch_for_training(student, mode, layers, **(options or {}))
    if trainable == "attention":
        student.requires_grad_(False)
        for name in names:
            student.get_submodule(name).requires_grad_(True)
    return student, teacher


class FeatureCapture:
    """Forward hooks on every ``WanTransformerBlock`` of a transformer, recording output hidden states.

    Only records while :meth:`capturing` is active, so the recomputation of gradient checkpointing
    during backward adds nothing (and keeps nothing alive).
    """

    def __init__(self, transformer: torch.nn.Module):
        from diffusers.models.transformers.transformer_wan import WanTransformerBlock

        self.features: dict[int, torch.Tensor] = {}
        self._on = False
        blocks = [m for m in transformer.modules() if isinstance(m, WanTransformerBlock)]
        if not blocks:
            raise TypeError(f"no WanTransformerBlock in {type(transformer).__name__}")
        self._handles = [b.register_forward_hook(self._hook(i)) for i, b in enumerate(blocks)]

    def _hook(self, i):
        def hook(module, args, output):
            if self._on:
                self.features[i] = output
        return hook

    @contextmanager
    def capturing(self):
        self.features = {}
        self._on = True
        try:
            yield self.features
        finally:
            self._on = False

    def remove(self):
        for h in self._handles:
            h.remove()


def sample_sigmas(n: int, generator: torch.Generator, sampling: str, shift: float, lo: float, hi: float) -> torch.Tensor:
    u = torch.rand(n, generator=generator, dtype=torch.float64)
    if sampling == "shifted":
        u = shift * u / (1 + (shift - 1) * u)
    return (lo + (hi - lo) * u).float()


def noised(x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    s = sigma.view(-1, *([1] * (x0.dim() - 1))).to(x0.dtype)
    return (1 - s) * x0 + s * noise


@torch.no_grad()
def teacher_samples(teacher, noise: torch.Tensor, embeds: torch.Tensor, steps: int, shift: float) -> torch.Tensor:
    """Clean latents from the teacher: ``steps`` Euler steps of the flow ODE from ``noise`` (no guidance)."""
    sig = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
    sig = (shift * sig / (1 + (shift - 1) * sig)).tolist()
    x = noise
    dt = next(teacher.parameters()).dtype
    for a, b in zip(sig[:-1], sig[1:]):
        t = torch.full((x.shape[0],), a * 1000.0, device=x.device)
        v = teacher(hidden_states=x.to(dt), timestep=t, encoder_hidden_states=embeds.to(dt), return_dict=False)[0]
        x = x + (b - a) * v.float()
    return x
