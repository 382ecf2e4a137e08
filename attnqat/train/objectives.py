"""The training objectives: what each needs (a teacher, where its clean latents come from) and its loss.

Flow matching (Wan 2.1, rectified flow): with clean latents x0, noise e and sigma in [0, 1],

    x_t = (1 - sigma) x0 + sigma e,   timestep = 1000 sigma,   velocity target v = e - x0

sigma is drawn uniformly, or "shifted" as Wan's scheduler shifts it: sigma' = s sigma / (1 + (s-1) sigma).

Distillation: the student (``attn_qat`` attention) and the frozen teacher (same initial weights, bf16
attention) see the same x_t, timestep and prompt embeddings. ``output`` matches the velocity
predictions; ``features`` also matches every ``WanTransformerBlock``'s output hidden states (SPEC §7).
Both use the normalized MSE ||s - t||^2 / ||t||^2, so blocks of different scale weigh alike.

An objective is a small class registered under its ``objective.type`` name (:data:`OBJECTIVES`).
``config.objective_of`` picks it once, when the config is validated; the ``Trainer`` builds a teacher if it
``needs_teacher``, draws the clean latents its ``latents`` names, and optimizes the ``"loss"`` its
:meth:`Objective.terms` returns (plus, with ``objective.attention_consistency`` > 0, the weighted
attention-consistency term: :meth:`Objective.loss_terms`, :mod:`.consistency`).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch


class _SquaredError(torch.autograd.Function):
    """sum((s - t)^2) in float32, saving ``s`` and ``t`` as they are for the backward instead of autograd's float32
    copy of s - t: with ``features`` distillation that copy is one per block (Wan 14B at 480p x 81: 671 MB each,
    27 GB over 40 blocks, against inputs that are alive anyway). The same values and gradient, bit for bit: the
    gradient is g * 2 * (s - t) in float32, cast to s's dtype, as autograd's pow, sub and cast backwards compute it
    (tests/test_objectives.py). For a frozen teacher only: :func:`nmse` takes autograd's path when it needs t's
    gradient."""

    @staticmethod
    def forward(ctx, student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(student, teacher)
        return (student.float() - teacher.float()).pow(2).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        s, t = ctx.saved_tensors
        return (grad * 2 * (s.float() - t.float())).to(s.dtype), None  # the teacher is frozen (nmse)


def nmse(student: torch.Tensor, teacher: torch.Tensor, eps: float = 1e-12, total=None) -> torch.Tensor:
    """||s - t||^2 / ||t||^2 over the whole tensor, in float32. ``total``: for tensors that are one process's
    part of a larger one (sequence shards), a function that sums a local sum over the processes holding the
    parts (:func:`attnqat.train.sequence_parallel.sum_over_group`)."""
    if teacher.requires_grad:  # never in training (the teacher is frozen): autograd's own graph, both gradients
        s, t = student.float(), teacher.float()
        err, ref = (s - t).pow(2).sum(), t.pow(2).sum()
    else:
        err, ref = _SquaredError.apply(student, teacher), teacher.float().pow(2).sum()
    if total is not None:
        err, ref = total(err), total(ref)
    return err / ref.clamp_min(eps)


def teacher_gaps(student: torch.Tensor, student_features: dict, teacher: torch.Tensor, teacher_features: dict,
                 total=None) -> dict[str, torch.Tensor]:
    """The student-teacher gap of one micro-batch: ``gap``, the nmse of the outputs (whole on every process),
    and ``gap_features``, the mean over blocks of the nmse of their output hidden states (sequence shards under
    sequence parallelism: ``total`` sums over the group, as in :func:`nmse`)."""
    return {"gap": nmse(student, teacher),
            "gap_features": torch.stack([nmse(student_features[i], teacher_features[i], total=total)
                                         for i in sorted(teacher_features)]).mean()}


def flow_loss(velocity: torch.Tensor, batch: dict) -> torch.Tensor:
    """The flow-matching loss: the predicted ``velocity`` against noise - x0."""
    return (velocity.float() - (batch["noise"] - batch["x0"]).float()).pow(2).mean()


def sample_sigmas(n: int, generator: torch.Generator, sampling: str, shift: float, lo: float, hi: float) -> torch.Tensor:
    u = torch.rand(n, generator=generator, dtype=torch.float64)
    if sampling == "shifted":
        u = shift * u / (1 + (shift - 1) * u)
    return (lo + (hi - lo) * u).float()


def noised(x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    s = sigma.view(-1, *([1] * (x0.dim() - 1))).to(x0.dtype)
    return (1 - s) * x0 + s * noise


@torch.no_grad()
def teacher_samples(teacher, noise: torch.Tensor, embeds: torch.Tensor, steps: int, shift: float,
                    dtype: torch.dtype) -> torch.Tensor:
    """Clean latents from the teacher (whose weights are in ``dtype``): ``steps`` Euler steps of the flow ODE from
    ``noise`` (no guidance)."""
    sig = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
    sig = (shift * sig / (1 + (shift - 1) * sig)).tolist()
    x = noise
    dt = dtype
    for a, b in zip(sig[:-1], sig[1:]):
        t = torch.full((x.shape[0],), a * 1000.0, device=x.device)
        v = teacher(hidden_states=x.to(dt), timestep=t, encoder_hidden_states=embeds.to(dt), return_dict=False)[0]
        x = x + (b - a) * v.float()
    return x


class Objective(ABC):
    """A training objective, built from the config's ``objective`` section (``config.ObjectiveConfig``).

    Arguments:
        cfg: the ``objective`` section; the keys an objective reads are its own (``target``, ``flow_weight``...).

    Subclasses set ``name`` (the ``objective.type`` that selects them) and ``needs_teacher``, and are added to
    :data:`OBJECTIVES` with :func:`register_objective`.
    """

    name: ClassVar[str]
    needs_teacher: ClassVar[bool]  # its loss reads the teacher's forward (gap, gap_features)

    def __init__(self, cfg):
        self.cfg = cfg

    @property
    def latents(self) -> str:
        """Where the clean latents x0 come from: ``dataset`` (the data's video latents), ``noise`` (Gaussian,
        data-free) or ``teacher`` (the teacher's samples from noise)."""
        return "dataset"

    @property
    def latents_setting(self) -> str:
        """The setting that asks for dataset latents, as a message names it."""
        return f"objective.type {self.name!r}"

    @property
    def label(self) -> str:
        """The objective as the run's first line and ``--check`` print it."""
        return self.name

    def check(self, data_source: str) -> None:
        """Refuse (ValueError) what this objective cannot do with ``data.source``; ``config.validate`` calls it."""

    @abstractmethod
    def terms(self, velocity: torch.Tensor, batch: dict, gaps: dict) -> dict[str, torch.Tensor]:
        """The loss terms of one micro-batch, ``"loss"`` (the one optimized) among them.

        Arguments:
            velocity: the student's output, (batch, C, F, H, W).
            batch: ``x0``, ``noise``, ``sigma``, ``embeds``.
            gaps: :func:`teacher_gaps` when the teacher ran (always if ``needs_teacher``), else empty.
        Return:
            named scalars; ``distill`` and ``flow`` are logged as log.csv's ``loss_distill``, ``loss_flow``.
        """

    def loss_terms(self, velocity: torch.Tensor, batch: dict, gaps: dict,
                   consistency: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """:meth:`terms`, and with ``consistency`` (the attention-consistency term of the training forward,
        :mod:`.consistency`) that term too, added to ``"loss"`` with weight ``objective.attention_consistency``;
        whatever the objective, so no subclass repeats it. Logged as log.csv's ``loss_consistency``."""
        out = self.terms(velocity, batch, gaps)
        if consistency is None:
            return out
        return {**out, "consistency": consistency, "loss": out["loss"] + self.cfg.attention_consistency * consistency}


OBJECTIVES: dict[str, type[Objective]] = {}


def register_objective(cls: type[Objective]) -> type[Objective]:
    """Make ``cls`` selectable as ``objective.type: <cls.name>`` (a class decorator)."""
    if not (isinstance(cls, type) and issubclass(cls, Objective) and isinstance(getattr(cls, "name", None), str)
            and isinstance(getattr(cls, "needs_teacher", None), bool)):
        raise TypeError(f"{cls!r} is not an Objective subclass with a str name and a bool needs_teacher")
    if cls.name in OBJECTIVES:
        raise ValueError(f"objective {cls.name!r} is registered already ({OBJECTIVES[cls.name].__qualname__})")
    OBJECTIVES[cls.name] = cls
    return cls


@register_objective
class Distill(Objective):
    """The student's output (``target: output``), or every block's features plus ``output_weight`` times the
    output (``target: features``), against the teacher's."""

    name = "distill"
    needs_teacher = True

    @property
    def latents(self) -> str:
        return self.cfg.latents

    @property
    def latents_setting(self) -> str:
        return f"objective.latents {self.cfg.latents!r}"

    @property
    def label(self) -> str:
        return f"{self.name}/{self.cfg.target}"

    def check(self, data_source: str) -> None:
        if data_source == "corpus" and self.cfg.latents == "teacher":
            # the corpus's clips are the clean latents of every objective; teacher samples would be ignored
            raise ValueError("objective.latents 'teacher' does not apply to data.source 'corpus' (its clips are "
                             "the clean latents); use 'dataset' or 'noise', or a precomputed data.path")

    def distill(self, gaps: dict) -> torch.Tensor:
        if self.cfg.target == "features":
            return gaps["gap_features"] + self.cfg.output_weight * gaps["gap"]
        return gaps["gap"]

    def terms(self, velocity, batch, gaps):
        d = self.distill(gaps)
        return {"distill": d, "loss": d}


@register_objective
class Flow(Objective):
    """Flow matching: the student's velocity against noise - x0 of the data's latents. No teacher."""

    name = "flow"
    needs_teacher = False

    def terms(self, velocity, batch, gaps):
        f = flow_loss(velocity, batch)
        return {"flow": f, "loss": f}


@register_objective
class Mix(Distill):
    """Distillation plus ``flow_weight`` times flow matching, from one student forward on the data's latents."""

    name = "mix"

    @property
    def latents(self) -> str:
        return "dataset"

    @property
    def latents_setting(self) -> str:
        return f"objective.type {self.name!r}"

    def terms(self, velocity, batch, gaps):
        d, f = self.distill(gaps), flow_loss(velocity, batch)
        return {"distill": d, "flow": f, "loss": d + self.cfg.flow_weight * f}
