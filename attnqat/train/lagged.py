"""A graphed step's loss terms and gradient norm, read by the host one step later; the non-finite stop decided on
the device.

Why: with each micro-batch's forward and backward replayed as a CUDA graph (:mod:`.graphed`), the loop's one read
of the loss terms and the gradient norm a step (``.tolist()``) made the GPU wait while the host did everything after
it: the optimizer and EMA launches, the log row, the progress bar and the next step's batch. mini's compiled QAT step
on an H200 was 43 ms of GPU work in 51 ms of wall time at 33x256x256 (~12.5 in 16.8 ms at 33x128x128). Copied to
the host without waiting (pinned memory, an event after the copy) and read one step later, after the next step is
queued, step N's values are already there when the host asks, and the GPU goes on with step N+1 meanwhile.

What keeps a non-finite step from moving the weights without the host looking: :attr:`LaggedReads.bad`, a 0-d
flag on the device, set by the first step whose terms or gradient norm hold a NaN or inf and never cleared. The
fused AdamW reads it as its ``found_inf`` (what ``GradScaler`` hands it: ``Adam.step`` passes
``getattr(self, "found_inf", None)`` to ``_fused_adam``, whose kernel skips the update where it is 1.0 and which
then takes the flag back off every step count), and :meth:`~.loop.Trainer.update_ema` scales its lerp weight by
``1 - bad``. So when the host reads the bad step's values, one step later, the weights, the EMA and the optimizer's
state are still those after the step before it (the next step's update was skipped too: the flag stays set), and
the loop stops there with the synchronous check's log row and error (:func:`~.loop._check_finite`).

Nothing here is saved: the flag starts at 0 in every run, and the optimizer is the same fused AdamW with the same
hyperparameters, so checkpoints written with and without the lag resume each other.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Sent:
    """One step's values on their way to the host: ``host`` (float32, pinned on CUDA) and the event recorded after
    the copy into it (None off CUDA, where the copy is done when :meth:`LaggedReads.send` returns)."""
    host: torch.Tensor
    event: "torch.cuda.Event | None"


class LaggedReads:
    """The device's non-finite flag, and each step's values copied to the host without a sync.

    Arguments:
        optimizer: the run's ``torch.optim.AdamW(fused=True)`` (the :class:`~.loop.Trainer` builds it fused whenever
            the step is graphed): its ``found_inf`` becomes :attr:`bad` (a fresh one each run). Not one a ``GradScaler``
            steps (fp16 is never graphed): that sets and deletes ``found_inf`` itself around each step.
        device: the parameters' device. On CUDA the values go to pinned memory with an event; on a CPU (tests) the same
            calls copy synchronously.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, device):
        if not all(g.get("fused") for g in optimizer.param_groups):
            raise ValueError("reading a step's values one step later needs the fused AdamW, which skips its update on "
                             "the device (found_inf); this optimizer is not fused")
        self.device = torch.device(device)
        # float32 and exactly 0.0 or 1.0: the fused kernel reads a float and skips on == 1, and _fused_adam subtracts
        # the flag from each step count after adding 1 (a 2.0 would update the weights and count the step back twice)
        self.bad = torch.zeros((), dtype=torch.float32, device=self.device)
        optimizer.found_inf = self.bad
        self._free: list[Sent] = []  # received buffers, reused: a pinned allocation is a slow call to the driver

    def send(self, terms: list[torch.Tensor], grad_norm: torch.Tensor) -> Sent:
        """Fold the step's ``terms`` (0-d float32 device tensors) and ``grad_norm`` into :attr:`bad` and queue their
        copy to the host; :meth:`receive` reads it. Launches only: nothing waits for the device."""
        values = torch.stack([*terms, grad_norm.float()])
        self.bad.logical_or_(torch.isfinite(values).all().logical_not())  # 1.0 from here on, once one is NaN or inf
        sent = self._free.pop() if self._free and self._free[-1].host.numel() == len(values) else self._new(len(values))
        cuda = self.device.type == "cuda"
        sent.host.copy_(values, non_blocking=cuda)
        if cuda:
            sent.event.record(torch.cuda.current_stream(self.device))
        return sent

    def receive(self, sent: Sent) -> list[float]:
        """The values :meth:`send` queued, as Python floats (the terms, then the gradient norm), once their copy is done
        (waiting for the device only up to that copy)."""
        if sent.event is not None:
            sent.event.synchronize()
        values = sent.host.tolist()
        self._free.append(sent)
        return values

    def _new(self, n: int) -> Sent:
        if self.device.type != "cuda":
            return Sent(torch.empty(n, dtype=torch.float32), None)
        return Sent(torch.empty(n, dtype=torch.float32, pin_memory=True), torch.cuda.Event())
