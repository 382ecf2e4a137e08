"""The attention-consistency term (``objective.attention_consistency``): each FP4 self-attention layer's own FP4
error, penalised where it arises.

For every self-attention layer the student runs in an FP4 training mode (``attn_qat``, ``attn_qat_dropin``), the
training forward also runs the exact attention (:data:`attnqat.kernels.REFERENCE_MODE`, SDPA, as the teacher's
layers do) on the same q, k, v, and records

    c_layer = ||o_fp4 - o_ref||^2 / ||o_ref||^2        (fp32 sums over the micro-batch, as ``objectives.nmse``)

the term is the mean of c_layer over those layers, and the loss becomes ``loss + weight * term``. Why: of nvfp4
attention's error in mini's velocity, quantizing Q and K is 85% (docs/quality.md, "Where the error comes
from"); output distillation reaches each layer's error only through the whole network, and a per-layer term
gives the optimizer a local signal to make Q, K and V FP4-robust. Whether it helps is measured on the GPU
(``bench/gpu_qat.sh``, runs ``distill_cons*``).

o_ref is not detached: the gradient flows through both branches, so it is that of the layer's FP4 error itself
(as Attn-QAT's straight-through backward sees it: (J_fp4 - J_ref) times the error), not a pull of o_fp4 toward an
o_ref that moves with it. Measured on the tiny model (experiments/consistency_detach.py): the detached gradient is
4x larger and nearly orthogonal to this one (cosine 0.18), and 12 steps with weight 1 lowered the held-out term
25-28% this way, 7-10% detached, against -1.4% to +1.5% with weight 0 (config seeds 0-4). Its cost: the exact
attention's backward too, and what its backward keeps (SDPA's output and log-sum-exp a layer).

How it is recorded, so that it works under CUDA graphs, gradient checkpointing and ``train.compile``
(``fullgraph=True``): the student's training processors (:class:`~.student_teacher.AutocastAttnProcessor`) hold a
reference to one :class:`AttentionConsistency`; while grad is enabled each of them computes its two fp32 sums with
tensor ops only and, inside :meth:`AttentionConsistency.recording` (the training forward), stores them in the
recorder's dict (a side effect Dynamo replays, as :class:`~.student_teacher.FeatureCapture` stores features);
:meth:`AttentionConsistency.term` combines them after the forward. No host sync, no branch on a tensor's value.
The branch also runs in gradient checkpointing's recompute (grad on), which must save what the forward saved; its
sums are not kept there (:meth:`AttentionConsistency.record` says why and the one exception). Under
``torch.no_grad`` (held-out evaluation, inference, the teacher's sampler) nothing runs: they never pay for it.
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch
from diffusers.models.transformers.transformer_wan import WanAttention

from .student_teacher import AutocastAttnProcessor


class AttentionConsistency:
    """The recorder of the attention-consistency term of one student.

    Arguments:
        transformer: the student (or the module accelerate wrapped around it); its self-attention layers patched
            with :class:`~.student_teacher.AutocastAttnProcessor` (``make_student_teacher``) record the term.
    """

    def __init__(self, transformer: torch.nn.Module):
        self.sums: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.on = False  # inside recording(): the forward, not checkpointing's recompute
        self._recomputed = None
        self.processors = [m.get_processor() for m in transformer.modules()
                           if isinstance(m, WanAttention) and not m.is_cross_attention
                           and isinstance(m.get_processor(), AutocastAttnProcessor)]
        if not self.processors:
            raise TypeError(f"no self-attention layer of {type(transformer).__name__} is patched for training "
                            f"(make_student_teacher)")
        for i, processor in enumerate(self.processors):
            processor.consistency, processor.consistency_layer = self, i

    def record(self, layer: int, out: torch.Tensor, ref: torch.Tensor) -> None:
        """Layer ``layer``'s ||out - ref||^2 and ||ref||^2, fp32 sums over this process's tensors, stored in
        :attr:`sums` inside :meth:`recording`."""
        o, r = out.float(), ref.float()
        sums = ((o - r).pow(2).sum(), r.pow(2).sum())
        if self.on:
            self.sums[layer] = sums
        elif torch.compiler.is_compiling():
            # Checkpointing's recompute (grad on, outside recording()) runs the branch again, since it must save what
            # the forward saved. Eager, its sums are dropped here, and their graph with them: kept, they would hold
            # every layer's recomputed activations until the next step. Compiled, an unused branch is dead code that
            # Dynamo removes, the recompute then saves fewer tensors than the forward and the checkpoint fails
            # (CheckpointError): kept here, in one slot (one layer's at a time), freed by the next recording().
            self._recomputed = sums

    @contextmanager
    def recording(self):
        """Inside, a forward with grad records every layer's sums afresh (a layer that did not run leaves none)."""
        self.sums = {}
        self._recomputed = None
        self.on = True
        try:
            yield self
        finally:
            self.on = False

    def term(self, total: Callable[[torch.Tensor], torch.Tensor] | None = None,
             eps: float = 1e-12) -> torch.Tensor:
        """The mean over the recorded layers of ||o_fp4 - o_ref||^2 / ||o_ref||^2, a 0-d fp32 tensor. ``total``: sums
        a per-process sum over the processes holding parts of the sequence (as in ``objectives.nmse``)."""
        if not self.sums:
            raise RuntimeError("no attention-consistency sums recorded: run the student's forward with grad inside "
                               "recording()")
        ratios = []
        for err, ref in self.sums.values():
            if total is not None:
                err, ref = total(err), total(ref)
            ratios.append(err / ref.clamp_min(eps))
        return torch.stack(ratios).mean()

    def held_out_mean(self, trainer) -> float:
        """The term's mean over ``trainer``'s held-out batches (a :class:`~.loop.Trainer` whose student this records):
        each forward run with grad, as in training, so that it records; read, then dropped."""
        values = []
        for batch in trainer.held_out():
            with torch.enable_grad(), self.recording():
                trainer._forward(trainer.student, batch)
            values.append(self.term().item())
        return sum(values) / len(values)

    def remove(self) -> None:
        """Detach from the processors: they run as without the term again."""
        for processor in self.processors:
            processor.consistency = None
        self.processors = []
        self.sums = {}
