"""A training step's forward and backward replayed as one CUDA graph per batch shape.

A small transformer's step is bound by the host, not the GPU: mini (9M parameters) at 33x128x128 and batch 32
is ~1 TFLOP, a few ms of an H200, but its eager step launches ~2,000 kernels one Python call at a time, and
every ``.item()`` or CPU-to-GPU copy in the loop makes the GPU wait for the host to catch up
(``bench/profile_mini_step.py``, docs/benchmarks.md). :class:`StepGraphs` captures the student's forward, the
objective's loss and the backward once per batch shape (``torch.cuda.CUDAGraph``) and replays it: one launch
a micro-batch.

What stays outside the graph, eager: building the batch (copied into the graph's input buffers), the gradient
clip, the optimizer (one fused kernel) and the EMA, and the copy of the loss terms and the gradient norm to the
host, which :func:`~.loop._train` reads one step later (:mod:`.lagged`): a non-finite loss still stops training
before the weights change, its update skipped on the device.

Same numerics: the graph replays the kernels the eager step launches, on the same inputs. Gradients live at
fixed addresses (allocated once, zeroed by :meth:`StepGraphs.zero_grad` after each optimizer step instead of
being freed): the backward computes each into a fresh tensor, as the eager one does, and one multi-tensor addition
adds them all to the fixed ones (a backward accumulating into ``.grad`` itself launches one addition per
parameter: 232 kernels a step in mini's, ~0.5 ms of an H200 at 33x256x256). On a CPU
(``capture=False``) :meth:`StepGraphs.forward_backward` runs the same body without a graph: the equality test
(tests/test_graphed.py) compares it step for step with the eager loop, and a GPU test the replayed graph.

The graph cannot hold what needs the host mid-step; :func:`unsupported` names what rules it out (``train.
cuda_graphs: auto`` then runs eagerly, ``on`` refuses the config).
"""
from __future__ import annotations

import contextlib
import gc

import torch

#: The loss terms the loop logs, in the order of :meth:`StepGraphs.forward_backward`'s result.
TERMS = ("loss", "distill", "flow", "gap", "consistency")
#: Distinct batch shapes (video sizes) a run may capture: each graph keeps its activations' memory.
MAX_GRAPHS = 16
#: Eager forward-backward passes before a capture: the first compiles Triton kernels (and torch.compile's
#: graphs), the second runs with everything warm, as the capture will.
WARMUP = 2


def unsupported(cfg, device_type: str, world_size: int) -> str | None:
    """Why a run of ``cfg`` (a TrainConfig) on ``world_size`` processes of ``device_type`` cannot replay its step
    as a CUDA graph, or None when it can. The one place that decides it."""
    tr = cfg.train
    if device_type != "cuda":
        return "it needs a CUDA device"
    if world_size != 1:
        return "several processes all-reduce their gradients inside the backward"
    if tr.gradient_checkpointing:
        return "gradient checkpointing saves and restores the RNG state inside the backward"
    if tr.mixed_precision == "fp16":
        return "fp16's gradient scaler checks for inf on the host"
    return None


def use_graphs(cfg, device_type: str, world_size: int) -> bool:
    """Whether the run replays graphs: ``train.cuda_graphs`` ``on`` (ValueError if :func:`unsupported`), ``off``,
    or ``auto`` (where supported)."""
    why = unsupported(cfg, device_type, world_size)
    if cfg.train.cuda_graphs == "on" and why:
        raise ValueError(f"train.cuda_graphs 'on' cannot be used here: {why} (use 'auto' or 'off')")
    return cfg.train.cuda_graphs != "off" and why is None


@contextlib.contextmanager
def _gc_disabled():
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class StepGraphs:
    """The micro-batch's forward + loss + backward of ``trainer``, captured per batch shape.

    Arguments:
        trainer: the :class:`~.loop.Trainer` (its ``losses``, student and ``sp`` scale).
        accum: micro-batches per optimizer step (each backward adds 1/accum of its loss's gradient).
        capture: replay CUDA graphs; False runs the same body eagerly (CPU, tests).
        fallback: when a capture fails, say so in one line and run the body eagerly from then on (``train.
            cuda_graphs: auto``); False raises (``on``).
    """

    def __init__(self, trainer, accum: int, *, capture: bool = True, fallback: bool = True):
        self.trainer, self.capture, self.fallback = trainer, capture, fallback
        self.scale = trainer.sp.degree / accum  # as the eager loop scales (1 without sequence parallelism)
        self.accum = accum
        self.params = [p for p in trainer.student.parameters() if p.requires_grad]
        with torch.no_grad():
            for p in self.params:  # gradients at fixed addresses: a captured backward accumulates into them
                p.grad = torch.zeros_like(p)
        self.grads = [p.grad for p in self.params]
        self.keys: list[str] = []  # the objective's terms among TERMS (known after the first forward)
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, dict, torch.Tensor]] = {}
        self.pool = None  # one memory pool for every graph: they never run at the same time

    def _body(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The captured work: the objective's terms and the backward; returns the terms of :data:`TERMS` that the
        objective has (``self.keys``), stacked, each divided by ``accum`` as the eager loop sums them."""
        for p in self.params:
            p.grad = None  # the backward allocates each gradient (in a capture: from the graph's pool) ...
        out = self.trainer.losses(batch)
        (out["loss"] * self.scale).backward()
        fresh = [(g, p.grad) for g, p in zip(self.grads, self.params) if p.grad is not None]
        if fresh:  # ... which one multi-tensor kernel adds to the fixed ones
            torch._foreach_add_([g for g, _ in fresh], [new for _, new in fresh])
        for p, g in zip(self.params, self.grads):
            p.grad = g
        self.keys = [k for k in TERMS if k in out]
        return torch.stack([out[k].detach().float() / self.accum for k in self.keys])

    def forward_backward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Add one micro-batch's gradient to the parameters' ``.grad``; returns its loss terms over ``accum`` (0-d
        device tensors; when captured, views of the graph's output buffer: use them before the next call)."""
        if not self.capture:
            terms = self._body(batch)
            return dict(zip(self.keys, terms))
        key = tuple((k, tuple(v.shape), v.dtype) for k, v in sorted(batch.items()))
        entry = self.graphs.get(key)
        if entry is None:
            try:
                entry = self._capture(key, batch)
            except RuntimeError as e:  # a CUDA call the capture forbids, in code we do not control
                if not self.fallback:
                    raise
                print(f"attnqat train: capturing the step as a CUDA graph failed ({str(e).splitlines()[0]}); "
                      f"training on eagerly (train.cuda_graphs: off skips the attempt)", flush=True)
                self.capture = False
                return self.forward_backward(batch)
        graph, inputs, terms = entry
        for k, v in batch.items():
            inputs[k].copy_(v)
        graph.replay()
        return dict(zip(self.keys, terms))

    def _capture(self, key: tuple, batch: dict[str, torch.Tensor]):
        if len(self.graphs) >= MAX_GRAPHS:
            raise ValueError(f"the run feeds more than {MAX_GRAPHS} batch shapes; each CUDA graph keeps its own "
                             f"activations: set train.cuda_graphs: off")
        inputs = {k: v.clone() for k, v in batch.items()}
        saved = [g.clone() for g in self.grads]
        try:
            graph, terms = self._record(inputs)
        finally:  # the warm-ups added to the gradients (the capture itself ran nothing), whether or not it worked
            with torch.no_grad():
                torch._foreach_copy_(self.grads, saved)
        self.graphs[key] = (graph, inputs, terms)
        return self.graphs[key]

    def _record(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up on ``inputs``, then capture the body reading them; returns the graph and its terms' buffer."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the default stream, as torch.cuda.graphs asks
            for _ in range(WARMUP):
                self._body(inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        corpus = self.trainer.corpus
        # No prefetch and no garbage collection during the capture: another thread's GPU work, or a tensor freed
        # with an event to record on another stream, is a CUDA call the capture refuses.
        with corpus.paused() if corpus is not None else contextlib.nullcontext(), _gc_disabled():
            with torch.cuda.graph(graph, pool=self.pool):
                terms = self._body(inputs)
        self.pool = graph.pool()
        return graph, terms

    @torch.no_grad()
    def zero_grad(self) -> None:
        """Zero the gradients in place (the graphs write into these tensors; ``set_to_none`` would orphan them)."""
        torch._foreach_zero_(self.grads)
