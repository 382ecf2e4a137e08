"""A precision schedule for inference: high-precision attention (``bf16``, or ``sagebwd``'s INT8) on
chosen denoising steps and in chosen transformer blocks, the patched (FP4) mode everywhere else.
SageAttention3's authors recommend keeping the first and/or last steps in high precision.

    from attnqat.pipelines import PrecisionSchedule, patch_attention
    schedule = PrecisionSchedule.parse("first:2,last:1", blocks="0,-1")  # = PrecisionSchedule(2, 1, blocks=(0, -1))
    patch_attention(pipe.transformer, "attn_qat", schedule=schedule)     # blocks 0 and -1: bf16 at every step
    pipe(prompt, num_inference_steps=50, callback_on_step_end=schedule.callback(pipe.transformer, 50))

The text form (``attnqat generate --high-precision-steps / --high-precision-blocks``):

- steps: comma-separated items, each ``first:K`` (the first K steps), ``last:K`` (the last K steps)
  or a step index (0-based; negative counts from the end: ``-1`` is the last step); e.g.
  ``first:2,last:1``, ``0,1,-1``, ``first:3,10``. A step named twice is one step.
- blocks: comma-separated block indices (negative from the end), e.g. ``0,-1``.

Both are checked against the run (the number of steps, of blocks) with one-line ``ValueError``\\ s.

How the switch works: :func:`~attnqat.pipelines.patch_attention` gives every patched processor the
schedule's high-precision mode (the processors of the high-precision blocks run it always). The
callback, a diffusers ``callback_on_step_end``, flips one flag per processor
(``AttnQATProcessor.high_precision``): no re-patching, nothing allocated. diffusers calls it *after*
step ``i`` (after the scheduler's update), so it sets step ``i + 1``'s precision; step 0's is set
when the callback is made (or by :meth:`PrecisionSwitch.start`), and after the last step every
processor is back in its own mode.

Which modes are high-precision is read from the mode registry (``Mode.high_precision``) when a schedule is made.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

from attnqat.checks import show
from attnqat.kernels import available_modes

__all__ = ["PrecisionSchedule", "PrecisionSwitch", "SwitchableProcessor", "parse_steps", "parse_blocks"]

_INDEX = re.compile(r"-?[0-9]+")  # ASCII digits only (int() would also take "١" or "1_0")
_RANGE = re.compile(r"(first|last):([0-9]+)")
_MAX_DIGITS = 9  # more is out of range for any run (steps are at most 1000, Wan has 40 blocks)


def _show(value: Any) -> str:
    return show(value, 60)


def _check_high_precision_mode(mode: Any, what: str = "high-precision mode") -> None:
    """Refuse a ``mode`` whose record does not say ``high_precision`` (an unknown name too), naming ``what``."""
    allowed = available_modes(lambda m: m.high_precision)
    if not isinstance(mode, str) or mode not in allowed:
        raise ValueError(f"{what} {_show(mode)} not in {', '.join(allowed)}")


def _items(text: Any, flag: str) -> list[str]:
    if not isinstance(text, str):
        raise ValueError(f"{flag} must be text, got {_show(text)}")
    if not text.strip():
        raise ValueError(f"{flag} is empty")
    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise ValueError(f"{flag} {_show(text)}: an empty item between commas")
    return items


def _index(item: str, flag: str, text: str, what: str) -> int:
    if not _INDEX.fullmatch(item):
        forms = "first:K, last:K or a step index" if what == "step" else "a block index"
        raise ValueError(f"{flag} {_show(text)}: {_show(item)} is not {forms} (a whole number; negative counts "
                         f"from the end)")
    if len(item.lstrip("-")) > _MAX_DIGITS:
        raise ValueError(f"{flag} {_show(text)}: {what} {_show(item)} is out of range")
    return int(item)


def parse_steps(text: str, flag: str = "steps") -> tuple[int, int, tuple[int, ...]]:
    """``"first:2,last:1,5,-3"`` -> ``(first, last, steps)`` = ``(2, 1, (-3, 5))``; ``flag`` names the
    value in error messages (e.g. ``"--high-precision-steps"``)."""
    first = last = None
    steps = set()
    for item in _items(text, flag):
        m = _RANGE.fullmatch(item)
        if m:
            if len(m.group(2)) > _MAX_DIGITS:
                raise ValueError(f"{flag} {_show(text)}: {_show(item)} is out of range")
            k = int(m.group(2))
            if m.group(1) == "first":
                if first is not None:
                    raise ValueError(f"{flag} {_show(text)}: first:K given twice")
                first = k
            else:
                if last is not None:
                    raise ValueError(f"{flag} {_show(text)}: last:K given twice")
                last = k
        else:
            steps.add(_index(item, flag, text, "step"))
    return first or 0, last or 0, tuple(sorted(steps))


def parse_blocks(text: str, flag: str = "blocks") -> tuple[int, ...]:
    """``"0,-1"`` -> ``(-1, 0)`` (sorted, each once)."""
    return tuple(sorted({_index(item, flag, text, "block") for item in _items(text, flag)}))


def _check_ints(name: str, values: Any) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise ValueError(f"{name} must be a sequence of whole numbers, got {_show(values)}")
    values = tuple(values)
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int)]
    if bad:
        raise ValueError(f"{name} must be whole numbers, got {_show(bad)}")
    return tuple(sorted(set(values)))


def _resolve(indices: tuple[int, ...], n: int, what: str, flag: str) -> list[int]:
    bad = [i for i in indices if not -n <= i < n]
    if bad:
        where = f"{n} denoising steps" if what == "step" else f"a transformer of {n} blocks"
        raise ValueError(f"{flag}: {what} {'indices' if len(bad) > 1 else 'index'} {bad} out of range for {where} "
                         f"(0..{n - 1}, or -{n}..-1 from the end)")
    return sorted({i % n for i in indices})


def _spans(indices) -> str:
    """``[0, 1, 2, 7]`` -> ``"0-2, 7"``."""
    out, run = [], []
    for i in sorted(indices):
        if run and i != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(i)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out)


@dataclass(frozen=True)
class PrecisionSchedule:
    """Which denoising steps and transformer blocks run attention in a high-precision ``mode``.

    Arguments:
        first: the first ``first`` denoising steps run in high precision (0: none).
        last: the last ``last`` steps run in high precision.
        steps: more steps, by index (0-based; negative from the end: -1 is the last step).
        blocks: transformer blocks whose patched attention runs in high precision at every step
            (negative from the end).
        mode: the high-precision mode: a mode whose record says ``high_precision`` (``bf16``, the default, or
            ``sagebwd``).
        num_blocks: the transformer's block count ``blocks`` were resolved against (None: not yet); set by
            :meth:`for_blocks`, which a command calls once at its edge, so that nothing inward resolves them again.
        num_steps, high_steps: the run's number of denoising steps and its 0-based high-precision steps, resolved
            from ``first``, ``last`` and ``steps`` (None: not yet); set together by :meth:`for_steps`, which a
            command calls once at its edge: the callback and :meth:`describe` then read them as they are.

    Indices are checked against a run by :meth:`resolve_steps` / :meth:`resolve_blocks` (the number
    of steps and blocks is not known before); ``steps`` and ``blocks`` are kept sorted, each once.
    """
    first: int = 0
    last: int = 0
    steps: tuple[int, ...] = ()
    blocks: tuple[int, ...] = ()
    mode: str = "bf16"
    num_blocks: int | None = field(default=None, repr=False, compare=False)
    num_steps: int | None = field(default=None, repr=False, compare=False)
    high_steps: frozenset[int] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        for name in ("first", "last"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be a whole number >= 0, got {_show(v)}")
        object.__setattr__(self, "steps", _check_ints("steps", self.steps))
        object.__setattr__(self, "blocks", _check_ints("blocks", self.blocks))
        _check_high_precision_mode(self.mode)
        n = self.num_blocks
        if n is not None:
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"num_blocks must be a whole number >= 1, got {_show(n)}")
            if not all(0 <= i < n for i in self.blocks):
                raise ValueError(f"blocks {list(self.blocks)} are not resolved 0-based indices of {n} blocks: "
                                 f"use for_blocks({n})")
        n, high = self.num_steps, self.high_steps
        if (n is None) != (high is None) or not (n is None or (
                not isinstance(n, bool) and isinstance(n, int) and n >= 1 and isinstance(high, frozenset)
                and all(type(i) is int and 0 <= i < n for i in high))):
            raise ValueError(f"num_steps and high_steps are a run's step count and its resolved steps (a frozenset of "
                             f"0-based indices), set together by for_steps; got {_show(n)}, {_show(high)}")

    @classmethod
    def parse(cls, steps: str | None = None, blocks: str | None = None, mode: str = "bf16", *,
              flags: tuple[str, str, str] = ("steps", "blocks", "mode")) -> "PrecisionSchedule":
        """A schedule from its text form (the module docstring): ``parse("first:2,last:1", "0,-1")``.
        ``None`` leaves a part empty; ``flags`` name the three values in error messages."""
        first, last, indices = (0, 0, ()) if steps is None else parse_steps(steps, flags[0])
        block_indices = () if blocks is None else parse_blocks(blocks, flags[1])
        _check_high_precision_mode(mode, flags[2])
        return cls(first, last, indices, block_indices, mode)

    @property
    def empty(self) -> bool:
        """True when no step and no block runs in high precision."""
        return not (self.first or self.last or self.steps or self.blocks)

    def steps_text(self) -> str:
        """The steps in :meth:`parse`'s form (``"first:2,last:1,5"``; ``""`` for none)."""
        parts = [f"first:{self.first}"] * bool(self.first) + [f"last:{self.last}"] * bool(self.last)
        return ",".join(parts + [str(i) for i in self.steps])

    def blocks_text(self) -> str:
        return ",".join(map(str, self.blocks))

    def resolve_steps(self, num_steps: int, flag: str = "high-precision steps") -> frozenset[int]:
        """The 0-based high-precision steps of a run of ``num_steps`` steps (those :meth:`for_steps` resolved, when
        it did); ``ValueError`` for a ``first``/``last`` above ``num_steps`` or an index out of range."""
        if self.num_steps is not None:
            if num_steps != self.num_steps:
                raise ValueError(f"{flag}: the schedule's steps were resolved for a run of {self.num_steps} "
                                 f"denoising steps, not {_show(num_steps)}")
            return self.high_steps
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
            raise ValueError(f"the number of denoising steps must be a whole number >= 1, got {_show(num_steps)}")
        for name, k in (("first", self.first), ("last", self.last)):
            if k > num_steps:
                raise ValueError(f"{flag}: {name}:{k} is more than the run's {num_steps} denoising steps")
        chosen = set(range(self.first)) | set(range(num_steps - self.last, num_steps))
        return frozenset(chosen | set(_resolve(self.steps, num_steps, "step", flag)))

    def resolve_blocks(self, num_blocks: int, flag: str = "high-precision blocks") -> list[int]:
        """The 0-based high-precision blocks of a transformer of ``num_blocks`` blocks (those :meth:`for_blocks`
        resolved, when it did)."""
        if self.num_blocks is None:
            return _resolve(self.blocks, num_blocks, "block", flag)
        if num_blocks != self.num_blocks:
            raise ValueError(f"{flag}: the schedule's blocks were resolved for a transformer of {self.num_blocks} "
                             f"blocks, not {_show(num_blocks)}")
        return list(self.blocks)

    def for_steps(self, num_steps: int, flag: str = "high-precision steps") -> "PrecisionSchedule":
        """This schedule with its steps resolved, once, for a run of ``num_steps`` denoising steps (``ValueError``
        naming ``flag`` for a ``first``/``last`` above ``num_steps`` or an index out of range)."""
        if self.num_steps is not None:
            self.resolve_steps(num_steps, flag)  # resolved already: the same count, or a ValueError
            return self
        return replace(self, num_steps=num_steps, high_steps=self.resolve_steps(num_steps, flag))

    def for_blocks(self, num_blocks: int, flag: str = "high-precision blocks") -> "PrecisionSchedule":
        """This schedule with its blocks resolved, once, against a transformer of ``num_blocks`` blocks
        (0-based; ``ValueError`` naming ``flag`` for an index out of range)."""
        if self.num_blocks is not None:
            self.resolve_blocks(num_blocks, flag)  # resolved already: the same count, or a ValueError
            return self
        return replace(self, blocks=tuple(_resolve(self.blocks, num_blocks, "block", flag)), num_blocks=num_blocks)

    def describe(self, num_steps: int, num_blocks: int) -> str:
        """One line for a run's summary, e.g. ``"bf16 on steps 0-1, 49 of 50 (first:2,last:1); in
        blocks 0, 39 at every step"``."""
        steps, blocks = sorted(self.resolve_steps(num_steps)), self.resolve_blocks(num_blocks)
        parts = []
        if steps:
            parts.append(f"on step{'s' * (len(steps) > 1)} {_spans(steps)} of {num_steps} ({self.steps_text()})")
        if blocks:
            parts.append(f"in block{'s' * (len(blocks) > 1)} {_spans(blocks)} of {num_blocks} at every step")
        return f"{self.mode} " + "; ".join(parts) if parts else "no step or block in high precision"

    def callback(self, transformer, num_steps: int) -> "PrecisionSwitch":
        """The ``callback_on_step_end`` for a run of ``num_steps`` steps of a transformer patched with
        this schedule (:class:`PrecisionSwitch`; it sets step 0's precision now)."""
        return PrecisionSwitch(transformer, self, num_steps)


class SwitchableProcessor:
    """What a :class:`PrecisionSwitch` drives: an attention processor that runs ``high_precision_mode`` while its
    ``high_precision`` flag is set, else its own mode (:class:`~attnqat.pipelines.processor.AttnQATProcessor`
    is one). Defined here, below the processor, so that the switch finds the processors without importing them."""

    high_precision: bool = False
    high_precision_mode: str | None = None


class PrecisionSwitch:
    """A diffusers ``callback_on_step_end`` that runs a :class:`PrecisionSchedule`'s steps in its
    high-precision mode on a transformer patched with that schedule
    (``patch_attention(transformer, mode, schedule=schedule)``).

    Made by :meth:`PrecisionSchedule.callback`. It sets step 0's precision when made; for another
    pipeline call with the same switch call :meth:`start` first. It checks that the pipeline runs
    the number of steps it was made for, and that its calls come in step order.
    """

    def __init__(self, transformer, schedule: PrecisionSchedule, num_steps: int):
        self.schedule, self.num_steps = schedule, num_steps
        self.high_steps = schedule.resolve_steps(num_steps)
        self.processors = [m.processor for m in transformer.modules()
                           if isinstance(getattr(m, "processor", None), SwitchableProcessor)]
        if not self.processors:
            raise ValueError("no attention layer of this transformer is patched: call "
                             "patch_attention(transformer, mode, schedule=schedule) first")
        other = sorted({str(p.high_precision_mode) for p in self.processors
                        if p.high_precision_mode != schedule.mode})
        if other:
            raise ValueError(f"the transformer was patched with high-precision mode {', '.join(other)}, not this "
                             f"schedule's {schedule.mode!r}: patch it with patch_attention(..., schedule=schedule)")
        self.step: int | None = None
        self.start()

    def start(self) -> None:
        """Set step 0's precision (before a pipeline call)."""
        self._set(0)

    def finish(self) -> None:
        """Every processor back in its own mode (after the last step, or after a failed call)."""
        for p in self.processors:
            p.high_precision = False
        self.step = None

    def _set(self, step: int) -> None:
        high = step in self.high_steps
        for p in self.processors:
            p.high_precision = high
        self.step = step

    def __call__(self, pipe, step_index: int, timestep, callback_kwargs: dict) -> dict:
        runs = getattr(pipe, "_num_timesteps", None)
        if isinstance(runs, int) and runs != self.num_steps:
            self.finish()
            raise ValueError(f"the precision schedule was made for {self.num_steps} denoising steps, but the "
                             f"pipeline runs {runs}")
        if step_index != self.step:
            expected = "no step (its run is over)" if self.step is None else f"step {self.step}"
            self.finish()
            raise ValueError(f"the precision schedule expected {expected} and was called after step {step_index}; "
                             f"call start() before each pipeline call")
        if step_index + 1 < self.num_steps:
            self._set(step_index + 1)
        else:
            self.finish()
        return {}
