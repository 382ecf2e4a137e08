"""Context parallelism for patched Wan attention: diffusers' templated Ulysses and ring functions with
attnqat's attention as the per-rank op.

    transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=2))  # after patch_attention
    enable_context_parallel(transformer, "ulysses", 2)  # the same, also on a CPU-only torch (gloo)

diffusers' ``WanAttnProcessor`` passes the model's ``ParallelConfig`` to ``dispatch_attention_fn`` for
self-attention (cross-attention runs unsharded); :class:`~attnqat.pipelines.processor.AttnQATProcessor`
hands it to :func:`context_parallel_attention`, which calls diffusers'
``_templated_context_parallel_attention`` with the ``forward_op`` / ``backward_op`` pair built here.

- Ulysses (all-to-all over heads): every mode, forward and backward. diffusers' ``backward_op`` contract
  is "recompute from what ``forward_op`` saved in ctx"; our modes' backwards live in their autograd
  Functions, so ``forward_op`` runs the mode with grad enabled on detached leaves and keeps that small
  graph in ctx; ``backward_op`` is ``torch.autograd.grad`` through it (no recompute).
- Ring (key/value chunks merged with the log-sum-exp): inference only, for the modes
  :func:`attnqat.kernels.api.lse_modes` lists. diffusers' ring backward calls ``backward_op`` with each
  remote key/value chunk and the merged out / lse (a FlashAttention-style backward from lse); our trainable
  modes' backwards need their own saved statistics (Attn-QAT's O' and integer max), so that contract does
  not fit and a ring call that needs gradients is refused.

``attnqat generate --parallel`` (:mod:`attnqat.pipelines.generate`) calls :func:`enable_context_parallel` and checks
the degrees with :func:`check_degrees` before anything loads.

Refusals (one ``ValueError`` line each, before any communication): a Ulysses degree that does not divide
the head count, ring with gradients or with a mode without a log-sum-exp, ring and Ulysses together,
the ``*_anything`` variants, a device mesh whose ring / ulysses sizes differ from the degrees (world size
mismatch), causal attention.
"""
from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Any

import torch

from attnqat.kernels import attention, mode_of
from attnqat.kernels.api import attention_with_lse, lse_modes

__all__ = ["check_context_parallel", "check_degrees", "context_parallel_attention", "enable_context_parallel"]


def _cp_config(parallel_config: Any) -> Any:
    """The ContextParallelConfig inside a diffusers ParallelConfig (or the config itself), or None."""
    return getattr(parallel_config, "context_parallel_config", parallel_config)


def check_degrees(ring: int, ulysses: int, *, heads: int, mode: str, needs_grad: bool, options: dict | None = None
                  ) -> None:
    """Refuse, in one line, degrees :func:`context_parallel_attention` does not run with ``heads`` heads in
    ``mode`` (no device mesh needed: ``attnqat generate --parallel`` checks them before anything loads)."""
    with_lse = mode_of(mode).with_lse
    if ring > 1 and ulysses > 1:
        raise ValueError(f"context parallelism with ring_degree={ring} and ulysses_degree={ulysses} together is "
                         f"not supported by AttnQATProcessor yet; use one of them")
    if ulysses > 1 and heads % ulysses:
        raise ValueError(f"ulysses_degree {ulysses} does not divide the {heads} attention heads "
                         f"(Wan 2.1 14B has 40, 1.3B has 12): pick a degree that divides {heads}")
    if ring > 1:
        if needs_grad:
            raise ValueError(f"ring attention (ring_degree={ring}) is inference-only in AttnQATProcessor: mode "
                             f"{mode!r} would need a ring backward; train with ulysses_degree instead, or run "
                             f"under torch.no_grad()")
        if with_lse is None:
            raise ValueError(f"ring attention needs the log-sum-exp, which mode {mode!r} does not return; "
                             f"ring runs {', '.join(lse_modes())} (use ulysses_degree for {mode!r})")
        if (options or {}).get("k_smoothing"):
            raise ValueError(f"ring attention (ring_degree={ring}) cannot run K-smoothing: it subtracts the mean of "
                             f"all keys, which no chunk of them has; use Ulysses (ulysses_degree, --parallel "
                             f"ulysses), or K-smoothing off (k_smoothing=False, --k-smoothing off)")


def check_context_parallel(parallel_config: Any, *, heads: int, mode: str, needs_grad: bool,
                           options: dict | None = None) -> None:
    """Refuse, in one line, the context-parallel settings :func:`context_parallel_attention` does not run."""
    cp = _cp_config(parallel_config)
    ring, ulysses = int(cp.ring_degree or 1), int(cp.ulysses_degree or 1)
    check_degrees(ring, ulysses, heads=heads, mode=mode, needs_grad=needs_grad, options=options)
    if getattr(cp, "ulysses_anything", False) or getattr(cp, "ring_anything", False):
        raise ValueError("ContextParallelConfig's ulysses_anything / ring_anything are not supported by "
                         "AttnQATProcessor; use plain ulysses or ring")
    ring_mesh, ulysses_mesh = getattr(cp, "_ring_mesh", None), getattr(cp, "_ulysses_mesh", None)
    if ring_mesh is None or ulysses_mesh is None:
        raise ValueError("the ContextParallelConfig was never set up (no device mesh): enable it through "
                         "transformer.enable_parallelism(config=...)")
    if (ring_mesh.size(), ulysses_mesh.size()) != (ring, ulysses):
        raise ValueError(f"context parallel world size mismatch: ring_degree {ring} x ulysses_degree {ulysses}, "
                         f"but the device mesh's ring x ulysses dimensions hold {ring_mesh.size()} x "
                         f"{ulysses_mesh.size()} processes")


def _ops(mode: str, options: dict, needs_grad: bool):
    """diffusers' templated ``forward_op`` / ``backward_op`` over attnqat's ``mode`` ((B, S, H, D) layout)."""

    def forward_op(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False, return_lse=False, _save_ctx=True, _parallel_config=None):
        if return_lse:  # ring: inference only (checked before the call)
            out, lse = attention_with_lse(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                          mode, sm_scale=scale, causal=is_causal, **options)
            return out.transpose(1, 2), lse.transpose(1, 2)  # (B, S, H, D), (B, S, H)
        if not needs_grad:
            out = attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), mode,
                            sm_scale=scale, causal=is_causal, **options)
            return out.transpose(1, 2)
        # Inside an autograd.Function's forward grad is off: run the mode's own differentiable op on
        # detached leaves with grad on, and keep that graph for backward_op.
        with torch.enable_grad():
            leaves = [x.detach().requires_grad_() for x in (query, key, value)]
            out = attention(*(x.transpose(1, 2) for x in leaves), mode, sm_scale=scale, causal=is_causal,
                            **options).transpose(1, 2)
        if _save_ctx:
            ctx.attnqat_graph = (out, leaves)
        return out.detach()

    def backward_op(ctx, grad_out, *args, **overrides):
        if overrides:  # ring's per-chunk call (query=, key=, ..., lse=); refused before the forward
            raise RuntimeError("AttnQATProcessor has no ring backward (refused before the forward normally)")
        out, leaves = ctx.attnqat_graph
        del ctx.attnqat_graph
        return torch.autograd.grad(out, leaves, grad_out)

    return forward_op, backward_op


def context_parallel_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mode: str, *,
                               parallel_config: Any, scale: float | None = None, is_causal: bool = False,
                               **options: Any) -> torch.Tensor:
    """attnqat's ``mode`` through diffusers' templated context-parallel attention. (B, S_local, H, D) in and
    out, like ``dispatch_attention_fn``; ``parallel_config`` a set-up diffusers ``ParallelConfig``."""
    from diffusers.models.attention_dispatch import _templated_context_parallel_attention

    if is_causal:
        raise ValueError("causal attention is not supported under context parallelism (diffusers' templated "
                         "functions refuse it too)")
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (query, key, value))
    check_context_parallel(parallel_config, heads=query.shape[2], mode=mode, needs_grad=needs_grad, options=options)
    if not hasattr(parallel_config, "context_parallel_config"):
        from diffusers.models._modeling_parallel import ParallelConfig

        parallel_config = ParallelConfig(context_parallel_config=parallel_config)
    forward_op, backward_op = _ops(mode, options, needs_grad)
    templated = _templated_outside_compile if needs_grad else _templated_context_parallel_attention
    return templated(query, key, value, None, 0.0, False, scale, False, False, forward_op=forward_op,
                     backward_op=backward_op, _parallel_config=parallel_config)


@torch.compiler.disable
def _templated_outside_compile(*args: Any, **kwargs: Any) -> torch.Tensor:
    """diffusers' templated function with gradients, run eagerly under ``torch.compile``: its backward_op
    differentiates the graph forward_op kept in ctx (:func:`_ops`), which dynamo cannot trace
    (``torch.autograd.grad``). A compiled block breaks its graph here, so ``train.compile`` under sequence
    parallelism compiles blocks without ``fullgraph`` (attnqat.train.loop); without gradients the call traces."""
    from diffusers.models.attention_dispatch import _templated_context_parallel_attention

    return _templated_context_parallel_attention(*args, **kwargs)


@contextmanager
def _cpu_counts_as_one_device():
    """diffusers' ``enable_parallelism`` (0.42.1) places each rank on
    ``torch.device(accelerator, rank % torch.accelerator.device_count())``; a CPU-only torch counts 0
    accelerators, so that is a ZeroDivisionError. There every rank's device is the one CPU, so a count of 1
    is the true answer to the question diffusers asks: patched only for the call, only where torch has no
    accelerator (a GPU build is left alone: diffusers builds its device mesh there, see
    :func:`enable_context_parallel`)."""
    if torch.accelerator.current_accelerator() is not None:
        yield
        return
    device_count = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: 1
    try:
        yield
    finally:
        torch.accelerator.device_count = device_count


def enable_context_parallel(transformer: torch.nn.Module, layout: str, degree: int, mesh: Any = None) -> None:
    """``transformer.enable_parallelism`` with ``ContextParallelConfig(ulysses_degree=degree)`` (``layout``
    "ulysses") or ``(ring_degree=degree)`` ("ring"), after :func:`~attnqat.pipelines.patch_attention`; the
    process group must be up. diffusers builds its device mesh over the whole world on torch's accelerator, or
    on the CPU where torch has none (the CPU-only case needs :func:`_cpu_counts_as_one_device`); ``mesh``, a
    DeviceMesh with "ring" and "ulysses" dimensions, puts it over a sub-group instead (training's sequence
    groups, :mod:`attnqat.train.sequence_parallel`)."""
    from diffusers import ContextParallelConfig

    if layout not in ("ulysses", "ring"):
        raise ValueError(f"context-parallel layout {layout!r} not in ('ulysses', 'ring')")
    config = ContextParallelConfig(**{f"{layout}_degree": degree}, **({"mesh": mesh} if mesh is not None else {}))
    with _cpu_counts_as_one_device():
        transformer.enable_parallelism(config=config)
    _cache_forward_signatures(transformer)


def _cache_forward_signatures(transformer: torch.nn.Module) -> None:
    """diffusers' split hooks (0.42.1, ``ModuleForwardMetadata``) find an argument's position from
    ``inspect.signature(cls.forward)`` on the hooked module's first call, then cache it. Under
    ``torch.compile(fullgraph=True)`` that first call is traced, and dynamo cannot trace ``inspect`` (on the
    H200, torch 2.11: "Unexpected type in sourceless builder"), so ``--compile --parallel`` failed in the
    first block. The cache is filled here, eagerly, with diffusers' own rule (the forward's parameters after
    ``self``); the traced call then only reads a dict."""
    for module in transformer.modules():
        registry = getattr(module, "_diffusers_hook", None)
        for hook in (registry.hooks.values() if registry is not None else ()):
            metadata = getattr(hook, "module_forward_metadata", None)
            if metadata is not None and metadata.cached_parameter_indices is None:
                names = list(inspect.signature(metadata._cls.forward).parameters)[1:]
                metadata.cached_parameter_indices = {name: i for i, name in enumerate(names)}
