"""Swap the attention call of diffusers' Wan 2.1 transformer for :func:`attnqat.kernels.api.attention`.

    patch_attention(pipe.transformer, "attn_qat")        # attn1 (self-attention) of every block
    patch_attention(pipe.transformer, "nvfp4", "all")    # attn1 and attn2 (cross-attention, 512 text tokens)
    patch_attention(pipe.transformer, "bf16", [0, 1])    # attn1 of blocks 0 and 1 only
    patch_attention(pipe.transformer, "attn_qat", schedule=PrecisionSchedule(first=2, blocks=(0,)))
                                                         # bf16 in block 0 always, and on steps the
                                                         # schedule's callback switches (schedule.py)
    unpatch_attention(pipe.transformer)                  # diffusers' own processors again

:class:`AttnQATProcessor` is diffusers' ``WanAttnProcessor`` with one change: where diffusers calls
``dispatch_attention_fn(query, key, value, ...)`` on (B, L, H, D) tensors, it calls
``attention(query.transpose(1, 2), ...)`` (views, no copies) and transposes back. Everything else
(the Q/K/V projections, the Q/K RMSNorm, RoPE, the output projection, I2V's added K/V) is
diffusers' own code, run unchanged: the processor runs ``WanAttnProcessor.__call__``'s code object
with ``dispatch_attention_fn`` bound to this processor's attention in a private copy of its globals.
diffusers' module is never modified, and two processors in different modes never share state.

Processors hold no weights: patching, switching mode and unpatching change no parameter and no
state-dict key, and switching mode costs nothing but creating a few small Python objects. A
processor patched with a :class:`~attnqat.pipelines.schedule.PrecisionSchedule` also knows its
high-precision mode; its ``high_precision`` flag (flipped per denoising step by the schedule's
callback) picks which of its two modes the next call runs.
"""
from __future__ import annotations

import time
import types
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Literal, Union

import torch
from diffusers.models.transformers.transformer_wan import WanAttention, WanAttnProcessor

from attnqat.kernels.api import attention, available_modes

if TYPE_CHECKING:
    from .schedule import PrecisionSchedule

__all__ = ["AttnQATProcessor", "AttentionTimer", "patch_attention", "unpatch_attention", "patched_attention",
           "attention_modes"]

Layers = Union[Literal["self", "all"], Iterable[int]]

# The name under which diffusers' WanAttnProcessor.__call__ looks up the attention function.
_DISPATCH_NAME = "dispatch_attention_fn"
if _DISPATCH_NAME not in WanAttnProcessor.__call__.__code__.co_names:  # pragma: no cover - depends on diffusers
    import diffusers

    raise ImportError(f"attnqat.pipelines expects diffusers' WanAttnProcessor.__call__ to call {_DISPATCH_NAME}() "
                      f"(true in diffusers 0.33-0.42); diffusers {diffusers.__version__} does not. "
                      f"Install a diffusers release in that range.")

# Where patch_attention keeps the processors it replaced (an attribute of the transformer, not global).
_ORIGINALS_ATTR = "_attnqat_original_processors"


class AttentionTimer:
    """Accumulates the time spent inside patched attention calls. Hand one to :func:`patch_attention`.

    On CUDA it records a pair of CUDA events around every call (no synchronisation while running;
    :meth:`total_seconds` synchronises once); on CPU it uses ``time.perf_counter``. Disabled
    (``enabled = False``) it costs one attribute check per call.
    """

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._cpu_seconds = 0.0
        self.calls = 0

    @contextmanager
    def measure(self, device: torch.device) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        self.calls += 1
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._cpu_seconds += time.perf_counter() - t0

    def total_seconds(self) -> float:
        """Total attention time so far, in seconds (synchronises CUDA once)."""
        if self._events:
            torch.cuda.synchronize()
            self._cpu_seconds += sum(s.elapsed_time(e) for s, e in self._events) / 1e3
            self._events.clear()
        return self._cpu_seconds

    def reset(self) -> None:
        self._events.clear()
        self._cpu_seconds = 0.0
        self.calls = 0


class AttnQATProcessor(WanAttnProcessor):
    """diffusers' ``WanAttnProcessor`` with its attention call done by :func:`attnqat.kernels.api.attention`.

    Arguments:
        mode: an attention mode (see :func:`attnqat.kernels.available_modes`).
        timer: optional :class:`AttentionTimer` that times every attention call of this processor.
        high_precision_mode: the mode calls run in while ``high_precision`` is True (set per denoising
            step by :class:`~attnqat.pipelines.schedule.PrecisionSwitch`); None: always ``mode``.
        options: mode-specific keywords passed to ``attention`` (e.g. ``p_bwd`` for ``attn_qat``); they
            belong to ``mode``: the high-precision mode runs without them.

    Supported: what Wan 2.1 text-to-video uses (no attention mask, no dropout, diffusers' default attention
    backend), and context parallelism (``transformer.enable_parallelism``: Ulysses for every mode, ring for
    inference; see :mod:`attnqat.pipelines.context_parallel`); anything else is refused by name.
    """

    def __init__(self, mode: str, *, timer: AttentionTimer | None = None, high_precision_mode: str | None = None,
                 **options: Any):
        super().__init__()
        for m in (mode, high_precision_mode):
            if m is not None and m not in available_modes():
                raise ValueError(f"unknown attention mode {m!r}; available: {', '.join(available_modes())}")
        self.mode = mode
        self.high_precision_mode = high_precision_mode
        self.high_precision = False  # flipped per denoising step by a PrecisionSwitch
        self.timer = timer
        self.options = options
        # diffusers' __call__, run as is, except that its global `dispatch_attention_fn` is ours.
        base = WanAttnProcessor.__call__
        scope = dict(base.__globals__)
        scope[_DISPATCH_NAME] = self._dispatch
        self._call = types.FunctionType(base.__code__, scope, base.__name__, base.__defaults__, base.__closure__)
        self._call.__kwdefaults__ = base.__kwdefaults__

    # Dynamo resolves the globals of an inlined function through its module, not through the private
    # copy above, so it would trace diffusers' own dispatch. Run the processor outside the graph: under
    # torch.compile each patched attention is one graph break; the rest of the transformer compiles.
    @torch.compiler.disable
    def __call__(self, attn: WanAttention, hidden_states: torch.Tensor,
                 encoder_hidden_states: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                 rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        return self._call(self, attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)

    @property
    def active_mode(self) -> str:
        """The mode the next call runs: ``high_precision_mode`` while ``high_precision`` is set, else ``mode``."""
        return self._active()[0]

    def _active(self) -> tuple[str, dict]:
        """(mode, options) of the next call: the high-precision mode runs without ``mode``'s options."""
        if self.high_precision and self.high_precision_mode:
            return self.high_precision_mode, {}
        return self.mode, self.options

    def _dispatch(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                  scale: float | None = None, enable_gqa: bool = False,
                  attention_kwargs: dict[str, Any] | None = None, *, backend: Any = None,
                  parallel_config: Any = None) -> torch.Tensor:
        """Stands in for diffusers' ``dispatch_attention_fn``: (B, L, H, D) in, (B, L, H, D) out."""
        if attn_mask is not None:
            raise ValueError(f"`attn_mask` is not supported by AttnQATProcessor (mode {self.mode!r})")
        if dropout_p:
            raise ValueError(f"`dropout_p`={dropout_p} is not supported by AttnQATProcessor")
        if enable_gqa:
            raise ValueError("`enable_gqa` is not supported by AttnQATProcessor")
        if attention_kwargs:
            raise ValueError(f"`attention_kwargs` {sorted(attention_kwargs)} are not supported by AttnQATProcessor")
        if backend is not None:
            raise ValueError(f"a diffusers attention backend ({backend}) was set on a patched processor; "
                             f"AttnQATProcessor runs attnqat's {self.mode!r} attention: call "
                             f"unpatch_attention() before set_attention_backend()")
        mode, options = self._active()
        measured = self.timer.measure(query.device) if self.timer is not None else nullcontext()
        if parallel_config is not None and getattr(parallel_config, "context_parallel_config", None) is not None:
            from .context_parallel import context_parallel_attention

            with measured:
                return context_parallel_attention(query, key, value, mode, parallel_config=parallel_config,
                                                  scale=scale, is_causal=is_causal, **options)
        if parallel_config is not None:
            raise ValueError("AttnQATProcessor supports context parallelism only (`parallel_config` without a "
                             "context_parallel_config, e.g. tensor parallelism, is not supported)")
        with measured:
            out = attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), mode,
                            sm_scale=scale, causal=is_causal, **options)
        return out.transpose(1, 2)  # (B, L, H, D) as diffusers expects; its caller does .type_as(query)

    def __repr__(self) -> str:
        opts = "".join(f", {k}={v!r}" for k, v in self.options.items())
        high = f", high_precision_mode={self.high_precision_mode!r}" if self.high_precision_mode else ""
        return f"AttnQATProcessor(mode={self.mode!r}{high}{opts})"


def _targets(transformer: torch.nn.Module, layers: Layers, cross_attention: bool | None) -> list[str]:
    """Names (``blocks.{i}.attn1`` ...) of the attention modules that ``layers`` selects."""
    blocks = getattr(transformer, "blocks", None)
    if blocks is None or not all(isinstance(getattr(b, "attn1", None), WanAttention) for b in blocks):
        raise TypeError(f"expected a diffusers WanTransformer3DModel (blocks with WanAttention attn1/attn2), "
                        f"got {type(transformer).__name__}")
    n = len(blocks)
    if isinstance(layers, str):
        if layers not in ("self", "all"):
            raise ValueError(f"layers must be 'self', 'all' or block indices, got {layers!r}")
        indices = list(range(n))
        if cross_attention is None:
            cross_attention = layers == "all"
    else:
        indices = sorted({int(i) for i in layers})
        bad = [i for i in indices if not 0 <= i < n]
        if bad:
            raise ValueError(f"block indices {bad} out of range: the transformer has {n} blocks (0..{n - 1})")
        cross_attention = bool(cross_attention)
    names = [f"blocks.{i}.attn1" for i in indices]
    if cross_attention:
        names += [f"blocks.{i}.attn2" for i in indices]
    return names


def _block_of(name: str) -> int:
    """``"blocks.3.attn1"`` -> 3."""
    return int(name.split(".")[1])


def unpatch_attention(transformer: torch.nn.Module) -> None:
    """Put back the processors that :func:`patch_attention` replaced (no-op on an unpatched model)."""
    originals: dict[str, Any] = transformer.__dict__.pop(_ORIGINALS_ATTR, {})
    for name, proc in originals.items():
        module = transformer.get_submodule(name)
        _keep_parallel_config(module.get_processor(), proc)
        module.set_processor(proc)


def _keep_parallel_config(old: Any, new: Any) -> None:
    """``enable_parallelism`` writes its config into the processors it finds at that moment: a processor that
    replaces one later (patching or unpatching after it) must carry it on, or that layer's attention would run
    on its rank's shard of the sequence alone."""
    config = getattr(old, "_parallel_config", None)
    if config is not None:
        new._parallel_config = config


def patch_attention(transformer: torch.nn.Module, mode: str, layers: Layers = "self", *,
                    cross_attention: bool | None = None, timer: AttentionTimer | None = None,
                    schedule: PrecisionSchedule | None = None, **options: Any) -> list[str]:
    """Run the selected attention layers of a Wan transformer through attnqat's ``mode``.

    Arguments:
        transformer: a diffusers ``WanTransformer3DModel`` (e.g. ``pipe.transformer``).
        mode: one of :func:`attnqat.kernels.available_modes` (``"bf16"``, ``"attn_qat"``, ...).
        layers: ``"self"`` (default, the paper's setting: ``attn1`` of every block), ``"all"``
            (``attn1`` and the cross-attention ``attn2`` of every block), or block indices
            (``attn1`` of those blocks).
        cross_attention: also patch ``attn2`` of the selected blocks; default: only for ``"all"``.
        timer: an :class:`AttentionTimer` shared by the new processors, to measure attention time.
        schedule: a :class:`~attnqat.pipelines.schedule.PrecisionSchedule`: the patched layers of its
            ``blocks`` (which must be among the selected ones) run in its high-precision ``mode``
            always; every other patched layer also learns that mode, for the denoising steps that
            ``schedule.callback(transformer, num_steps)`` switches to high precision.
        options: mode-specific keywords for ``attention`` (e.g. ``p_bwd="normalized"``), for ``mode``
            only (the schedule's high-precision mode runs without them).
    Return:
        the names of the patched modules, e.g. ``["blocks.0.attn1", "blocks.1.attn1"]``.

    Calling it again replaces the previous patch (layers not selected this time go back to diffusers'
    processors). Weights and state-dict keys are never touched.
    """
    if mode not in available_modes():
        raise ValueError(f"unknown attention mode {mode!r}; available: {', '.join(available_modes())}")
    names = _targets(transformer, layers, cross_attention)
    high_mode, high_blocks = None, set()
    if schedule is not None:
        high_mode = schedule.mode
        if high_mode not in available_modes():
            raise ValueError(f"the schedule's high-precision mode {high_mode!r} is not registered; available: "
                             f"{', '.join(available_modes())}")
        high_blocks = set(schedule.resolve_blocks(len(transformer.blocks)))
        patched_blocks = {_block_of(name) for name in names}
        outside = sorted(high_blocks - patched_blocks)
        if outside:
            raise ValueError(f"high-precision blocks {outside} are not among the patched blocks "
                             f"{sorted(patched_blocks)}: select them in `layers` too")
    unpatch_attention(transformer)
    originals = {}
    for name in names:
        module = transformer.get_submodule(name)
        originals[name] = module.get_processor()
        if _block_of(name) in high_blocks:  # high precision at every step; mode's options are not its
            proc = AttnQATProcessor(high_mode, timer=timer, high_precision_mode=high_mode)
        else:
            proc = AttnQATProcessor(mode, timer=timer, high_precision_mode=high_mode, **options)
        _keep_parallel_config(originals[name], proc)
        module.set_processor(proc)
    transformer.__dict__[_ORIGINALS_ATTR] = originals
    return names


@contextmanager
def patched_attention(transformer: torch.nn.Module, mode: str, layers: Layers = "self",
                      **kwargs: Any) -> Iterator[list[str]]:
    """``with patched_attention(transformer, "nvfp4"): ...``: patch, then restore the previous state."""
    previous = {name: transformer.get_submodule(name).get_processor()
                for name in transformer.__dict__.get(_ORIGINALS_ATTR, {})}
    previous_originals = dict(transformer.__dict__.get(_ORIGINALS_ATTR, {}))
    try:
        yield patch_attention(transformer, mode, layers, **kwargs)
    finally:
        unpatch_attention(transformer)
        for name, proc in previous.items():
            transformer.get_submodule(name).set_processor(proc)
        if previous_originals:
            transformer.__dict__[_ORIGINALS_ATTR] = previous_originals


def attention_modes(transformer: torch.nn.Module) -> dict[str, str]:
    """``{"blocks.0.attn1": "attn_qat", "blocks.0.attn2": "diffusers", ...}`` for every attention module:
    the mode its next call runs (:attr:`AttnQATProcessor.active_mode`)."""
    out = {}
    for name, module in transformer.named_modules():
        if isinstance(module, WanAttention):
            proc = module.get_processor()
            out[name] = proc.active_mode if isinstance(proc, AttnQATProcessor) else "diffusers"
    return out
