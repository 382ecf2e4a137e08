"""Wan 2.1's attention (diffusers' ``WanAttention``) with its attention call done by
:func:`attnqat.kernels.api.attention`.

    patch_attention(pipe.transformer, "attn_qat")        # attn1 (self-attention) of every block
    patch_attention(pipe.transformer, "nvfp4", "all")    # attn1 and attn2 (cross-attention, 512 text tokens)
    patch_attention(pipe.transformer, "bf16", [0, 1])    # attn1 of blocks 0 and 1 only
    patch_attention(pipe.transformer, "attn_qat", schedule=PrecisionSchedule(first=2, blocks=(0,)))
                                                         # bf16 in block 0 always, and on steps the
                                                         # schedule's callback switches (schedule.py)
    unpatch_attention(pipe.transformer)                  # the processors that were there before

:class:`AttnQATProcessor` computes what diffusers' ``WanAttnProcessor`` computes, op for op (the Q/K/V
projections, fused or not, the Q/K RMSNorm across heads, RoPE, I2V's added image K/V, the output
projection), except the attention itself: diffusers calls ``dispatch_attention_fn`` on (B, L, H, D)
tensors, this processor calls ``attention(query.transpose(1, 2), ...)`` (views, no copies). In ``bf16``
mode its output equals diffusers' bit for bit; tests/test_processor.py checks that against diffusers' own
processor on the same weights, so a change in diffusers shows up there. ``__call__`` is an ordinary
method: ``torch.compile(transformer, fullgraph=True)`` traces it with the attention's custom ops inside
the graph, and a processor deep-copies and pickles with the model.

Processors hold no weights: patching, switching mode and unpatching change no parameter and no
state-dict key. A processor patched with a :class:`~attnqat.pipelines.schedule.PrecisionSchedule`
also knows its high-precision mode; its ``high_precision`` flag (flipped per denoising step by the
schedule's callback) picks which of its two modes the next call runs.

diffusers' ways of choosing an attention backend (``model.set_attention_backend(...)``, the
``attention_backend(...)`` context) pick among diffusers' own kernels; a patched layer runs attnqat's
mode instead, so while one is in force a patched layer refuses to run (one ``ValueError`` line) rather
than ignore it. Layers left unpatched follow them as usual.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Literal, Union

import torch
import torch.nn.functional as F
from diffusers.models.attention_dispatch import DIFFUSERS_ATTN_BACKEND, AttentionBackendName, _AttentionBackendRegistry
from diffusers.models.transformers.transformer_wan import WanAttention, WanAttnProcessor

from attnqat.kernels import REFERENCE_MODE, attention, mode_of

from .context_parallel import context_parallel_attention
from .schedule import PrecisionSchedule, SwitchableProcessor

__all__ = ["AttnQATProcessor", "AttentionTimer", "patch_attention", "unpatch_attention", "patched_attention",
           "processors_swapped", "attention_modes"]

Layers = Union[Literal["self", "all"], Iterable[int]]

# Where patch_attention records, per patched layer, the processor it replaced and the one it put in
# (an attribute of the transformer, so deepcopy and pickling carry it with the model).
_PATCHED_ATTR = "_attnqat_patched"

# The backend diffusers' dispatch uses when nothing chose one (its DIFFUSERS_ATTN_BACKEND environment
# variable, "native" by default); any other active backend was chosen by attention_backend() or
# set_attention_backend().
_DEFAULT_BACKEND = AttentionBackendName(DIFFUSERS_ATTN_BACKEND)

# Wan's I2V layers get [image tokens, 512 text tokens] as encoder_hidden_states (diffusers hard-codes it too).
_TEXT_TOKENS = 512


class AttentionTimer:
    """Accumulates the time spent inside patched attention calls. Hand one to :func:`patch_attention`.

    On CUDA it records a pair of CUDA events around every call (no synchronisation while running;
    :meth:`total_seconds` synchronises once); on CPU it uses ``time.perf_counter``. Disabled
    (``enabled = False``) it costs one attribute check per call. It times eager runs only: under
    ``torch.compile`` an enabled timer is refused (a compiled graph has no per-call timing points).
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

    def __getstate__(self) -> dict:
        """Copies and pickles carry the time so far (CUDA events do not pickle: they are summed first)."""
        self.total_seconds()
        return dict(self.__dict__, _events=[])


def qkv_projections(attn: WanAttention, hidden_states: torch.Tensor,
                    encoder_hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q from ``hidden_states``, K and V from ``encoder_hidden_states``; through the fused linears after
    ``transformer.fuse_qkv_projections()`` (to_qkv in self-attention, to_kv in cross-attention)."""
    if attn.fused_projections:
        if not attn.is_cross_attention:
            return attn.to_qkv(hidden_states).chunk(3, dim=-1)
        key, value = attn.to_kv(encoder_hidden_states).chunk(2, dim=-1)
        return attn.to_q(hidden_states), key, value
    return attn.to_q(hidden_states), attn.to_k(encoder_hidden_states), attn.to_v(encoder_hidden_states)


def _added_kv_projections(attn: WanAttention, image_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """I2V's image K and V (fused into to_added_kv after ``fuse_qkv_projections()``)."""
    if attn.fused_projections:
        return attn.to_added_kv(image_states).chunk(2, dim=-1)
    return attn.add_k_proj(image_states), attn.add_v_proj(image_states)


def _rotate(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """Wan's RoPE on (B, L, H, D): each pair (x1, x2) of head_dim rotated by its angle. The same ops in the
    same order as diffusers' (products in the tables' dtype, float64 or float32, rounded once into x's
    dtype), so bf16 mode stays bit-equal to diffusers."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]  # the tables hold each angle twice (pairs repeated)
    sin = freqs_sin[..., 1::2]
    # stacked, not written into empty_like(x)'s even and odd slots as diffusers does (the same values): Inductor
    # fused those two strided writes with the RMSNorm before them into a kernel 6x slower than this one (mini's
    # compiled training step on an H200: 9.7 of 51 ms a step; stacked, 43 ms in all; docs/benchmarks.md)
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2).to(x.dtype)


class AttnQATProcessor(WanAttnProcessor, SwitchableProcessor):
    """Wan's attention processor with the attention call done by :func:`attnqat.kernels.api.attention`.

    Arguments:
        mode: an attention mode (see :func:`attnqat.kernels.available_modes`).
        timer: optional :class:`AttentionTimer` that times every attention call of this processor (eager only).
        high_precision_mode: the mode calls run in while ``high_precision`` is True (set per denoising
            step by :class:`~attnqat.pipelines.schedule.PrecisionSwitch`); None: always ``mode``.
        options: mode-specific keywords passed to ``attention`` (e.g. ``p_bwd`` for ``attn_qat``); they
            belong to ``mode``: the high-precision mode runs without them.

    Called as diffusers calls any Wan processor: ``processor(attn, hidden_states, encoder_hidden_states,
    attention_mask, rotary_emb)`` with (batch, seqlen, dim) states; returns (batch, seqlen, dim).

    Supported: what Wan 2.1 text-to-video and image-to-video use (no attention mask), and context
    parallelism (``transformer.enable_parallelism``: Ulysses for every mode, ring for inference; see
    :mod:`attnqat.pipelines.context_parallel`). An attention mask or a diffusers attention backend
    (see the module docstring) is refused by name.
    """

    def __init__(self, mode: str, *, timer: AttentionTimer | None = None, high_precision_mode: str | None = None,
                 **options: Any):
        super().__init__()
        mode_of(mode).check_options(options)  # the processors are the pipeline's edge: what they hold is valid
        if high_precision_mode is not None:
            mode_of(high_precision_mode)
        self.mode = mode
        self.high_precision_mode = high_precision_mode
        self.high_precision = False  # flipped per denoising step by a PrecisionSwitch
        self.timer = timer
        self.options = options

    def __call__(self, attn: WanAttention, hidden_states: torch.Tensor,
                 encoder_hidden_states: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                 rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        if attention_mask is not None:
            raise ValueError(f"`attention_mask` is not supported by AttnQATProcessor (mode {self.mode!r})")
        backend = self._attention_backend or _AttentionBackendRegistry._active_backend
        if backend != _DEFAULT_BACKEND:
            raise ValueError(f"diffusers attention backend {AttentionBackendName(backend).value!r} is selected for this "
                             f"layer (set_attention_backend() or attention_backend()), but it is patched to run "
                             f"attnqat's {self.mode!r} attention: unpatch_attention() to use that backend, or select "
                             f"{_DEFAULT_BACKEND.value!r} again (reset_attention_backend(), attention_backend("
                             f"{_DEFAULT_BACKEND.value!r}))")
        self_attention = encoder_hidden_states is None
        image_states = None
        if attn.add_k_proj is not None:  # I2V cross-attention: [image tokens, 512 text tokens]
            split = encoder_hidden_states.shape[1] - _TEXT_TOKENS
            image_states, encoder_hidden_states = encoder_hidden_states[:, :split], encoder_hidden_states[:, split:]
        query, key, value = qkv_projections(attn, hidden_states,
                                            hidden_states if self_attention else encoder_hidden_states)
        query = attn.norm_q(query).unflatten(2, (attn.heads, -1))  # (B, L, H, D)
        key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        if rotary_emb is not None:
            query = _rotate(query, *rotary_emb)
            key = _rotate(key, *rotary_emb)

        # diffusers shards only self-attention over context-parallel ranks (cross-attention runs whole).
        out = self._attend(query, key, value, self._parallel_config if self_attention else None)
        if image_states is not None:
            key_img, value_img = _added_kv_projections(attn, image_states)
            key_img = attn.norm_added_k(key_img).unflatten(2, (attn.heads, -1))
            out_img = self._attend(query, key_img, value_img.unflatten(2, (attn.heads, -1)), None)
            out = out + out_img
        return attn.to_out[1](attn.to_out[0](out))

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                parallel_config: Any) -> torch.Tensor:
        """(B, L, H, D) query, key, value -> (B, L, H * D) in query's dtype, in the active mode."""
        mode, options = self._active()
        timer = self.timer
        if timer is not None and timer.enabled:
            if torch.compiler.is_compiling():
                raise ValueError("an enabled AttentionTimer cannot time attention inside torch.compile: patch "
                                 "without a timer, or with AttentionTimer(enabled=False)")
            with timer.measure(query.device):
                out = self._attention(query, key, value, mode, options, parallel_config)
        else:
            out = self._attention(query, key, value, mode, options, parallel_config)
        return out.flatten(2, 3).type_as(query)

    def _attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mode: str, options: dict,
                   parallel_config: Any) -> torch.Tensor:
        """The attention call itself: (B, L, H, D) in and out."""
        if parallel_config is not None:
            if getattr(parallel_config, "context_parallel_config", None) is None:
                raise ValueError("AttnQATProcessor supports context parallelism only (a `parallel_config` without "
                                 "a context_parallel_config, e.g. tensor parallelism, is not supported)")
            return context_parallel_attention(query, key, value, mode, parallel_config=parallel_config, **options)
        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        if mode == REFERENCE_MODE:
            # diffusers' own call (its native backend), so bf16 costs nothing diffusers does not. attention()'s bf16
            # adds a non-finite marker for callers whose q or k may hold an inf (SDPA turns a -inf logit into a
            # zero weight); here Q and K come out of RMSNorm across heads, which turns an inf into NaN, and NaN
            # reaches the output through SDPA itself (tests/test_processor.py, test_inf_input_gives_nan_output).
            return F.scaled_dot_product_attention(q, k, v).transpose(1, 2)
        return attention(q, k, v, mode, **options).transpose(1, 2)

    @property
    def active_mode(self) -> str:
        """The mode the next call runs: ``high_precision_mode`` while ``high_precision`` is set, else ``mode``."""
        return self._active()[0]

    def _active(self) -> tuple[str, dict]:
        """(mode, options) of the next call: the high-precision mode runs without ``mode``'s options."""
        if self.high_precision and self.high_precision_mode:
            return self.high_precision_mode, {}
        return self.mode, self.options

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
    """Undo :func:`patch_attention`: every layer that still holds the processor patching put in gets back the
    processor it had before; a layer whose processor was replaced since (``set_processor``,
    ``set_attn_processor``) keeps that one. A no-op on an unpatched model."""
    patched: dict[str, tuple[Any, AttnQATProcessor]] = transformer.__dict__.pop(_PATCHED_ATTR, {})
    for name, (original, ours) in patched.items():
        module = transformer.get_submodule(name)
        if module.get_processor() is ours:
            _keep_parallel_config(ours, original)
            module.set_processor(original)


def _keep_parallel_config(old: Any, new: Any) -> None:
    """``enable_parallelism`` writes its config into the processors it finds at that moment: a processor that
    replaces one later (patching or unpatching after it) must carry it on, or that layer's attention would run
    on its rank's shard of the sequence alone."""
    config = getattr(old, "_parallel_config", None)
    if config is not None:
        new._parallel_config = config


def patch_attention(transformer: torch.nn.Module, mode: str, layers: Layers = "self", *,
                    cross_attention: bool | None = None, timer: AttentionTimer | None = None,
                    schedule: PrecisionSchedule | None = None,
                    processor_class: type[AttnQATProcessor] = AttnQATProcessor, **options: Any) -> list[str]:
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
        processor_class: the processor built for each layer: :class:`AttnQATProcessor` or a subclass (training
            uses one that casts fp32 q/k/v to the autocast dtype).
        options: mode-specific keywords for ``attention`` (e.g. ``p_bwd="normalized"``), for ``mode``
            only (the schedule's high-precision mode runs without them).
    Return:
        the names of the patched modules, e.g. ``["blocks.0.attn1", "blocks.1.attn1"]``.

    Calling it again replaces the previous patch (layers not selected this time go back to diffusers'
    processors). Weights and state-dict keys are never touched.
    """
    # The processors check the mode and the options (built below before anything changes), the schedule its
    # high-precision mode; this is for an unknown mode to be named first, also when every layer is a
    # high-precision block.
    mode_of(mode)
    names = _targets(transformer, layers, cross_attention)
    high_mode, high_blocks = None, set()
    if schedule is not None:
        high_mode = schedule.mode
        high_blocks = set(schedule.resolve_blocks(len(transformer.blocks)))
        patched_blocks = {_block_of(name) for name in names}
        outside = sorted(high_blocks - patched_blocks)
        if outside:
            raise ValueError(f"high-precision blocks {outside} are not among the patched blocks "
                             f"{sorted(patched_blocks)}: select them in `layers` too")
    new = {}
    for name in names:  # built (and their options checked) before anything changes
        if _block_of(name) in high_blocks:  # high precision at every step; mode's options are not its
            new[name] = processor_class(high_mode, timer=timer, high_precision_mode=high_mode)
        else:
            new[name] = processor_class(mode, timer=timer, high_precision_mode=high_mode, **options)
    unpatch_attention(transformer)
    patched = {}
    for name, proc in new.items():
        module = transformer.get_submodule(name)
        original = module.get_processor()
        _keep_parallel_config(original, proc)
        module.set_processor(proc)
        patched[name] = (original, proc)
    transformer.__dict__[_PATCHED_ATTR] = patched
    return names


@contextmanager
def patched_attention(transformer: torch.nn.Module, mode: str, layers: Layers = "self",
                      **kwargs: Any) -> Iterator[list[str]]:
    """``with patched_attention(transformer, "nvfp4"): ...``: patch, then :func:`unpatch_attention` and put an
    earlier patch back on the layers that got their pre-patch processor back."""
    previous: dict[str, tuple[Any, AttnQATProcessor]] = dict(transformer.__dict__.get(_PATCHED_ATTR, {}))
    try:
        yield patch_attention(transformer, mode, layers, **kwargs)
    finally:
        unpatch_attention(transformer)
        restored = {}
        for name, (original, ours) in previous.items():
            module = transformer.get_submodule(name)
            if module.get_processor() is original:
                _keep_parallel_config(original, ours)
                module.set_processor(ours)
                restored[name] = (original, ours)
        if restored:
            transformer.__dict__[_PATCHED_ATTR] = restored


@contextmanager
def processors_swapped(swaps: Iterable[tuple[WanAttention, AttnQATProcessor]]) -> Iterator[None]:
    """``with processors_swapped([(module, processor), ...]): ...``: inside the block each attention module runs the
    processor paired with it (which takes on the context-parallel config of the one it replaces); after it, even when
    the block raises, its own processor again. Unlike :func:`patched_attention`, which builds new processors each
    time, the caller builds them once: a compiled block then meets the same objects on every call (the LoRA
    teacher's forward, ``attnqat.train.student_teacher.AdapterOffTeacher``, swaps its processors in every step)."""
    before = []
    try:
        for module, processor in swaps:
            current = module.get_processor()
            _keep_parallel_config(current, processor)
            module.set_processor(processor)
            before.append((module, current))
        yield
    finally:
        for module, processor in reversed(before):
            module.set_processor(processor)


def attention_modes(transformer: torch.nn.Module) -> dict[str, str]:
    """``{"blocks.0.attn1": "attn_qat", "blocks.0.attn2": "diffusers", ...}`` for every attention module:
    the mode its next call runs (:attr:`AttnQATProcessor.active_mode`)."""
    out = {}
    for name, module in transformer.named_modules():
        if isinstance(module, WanAttention):
            proc = module.get_processor()
            out[name] = proc.active_mode if isinstance(proc, AttnQATProcessor) else "diffusers"
    return out
