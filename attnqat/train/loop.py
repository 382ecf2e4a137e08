"""The Attn-QAT training loop on accelerate, for the objective the config names (:mod:`.objectives`).

    from attnqat.train import load_config, train
    result = train(load_config("configs/tiny.yaml"))
    result.gap_before, result.gap_after        # held-out student-teacher gap (normalized MSE)

One optimizer step = ``gradient_accumulation_steps`` micro-batches of ``data.batch_size`` samples per
process (per group of ``train.sequence_parallel`` processes, which share each sample: :mod:`.sequence_parallel`).
Every random draw of a micro-batch (noise, sigma, data-free latents and embeddings) comes from a generator
seeded by (seed, step, micro-batch, data-parallel rank), and dataset rows from the global sample position,
so a run resumed from a checkpoint repeats the uninterrupted run's batches exactly.

Checkpoints hold safetensors and JSON only, with a sha256 manifest written last (:mod:`.checkpoint`); a run
refuses to start in a folder that holds another run (``resume`` or ``overwrite`` says what to do with it),
stops on a non-finite loss, gradient norm or learning rate before it updates the weights, and never writes
non-finite weights.
"""
from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import shlex
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from attnqat.checks import check_not_input
from attnqat.locking import output_lock
from attnqat.pipelines.loading import (CHECKPOINTS_DIR, load_transformer, load_transformer_cast_on, model_inputs,
                                      step_dir_name)
from attnqat.pipelines.lora import save_lora
from attnqat.trained_options import SWITCHED, flag as option_flag

from . import checkpoint as ck
from . import compact_text, optimizers, sequence_parallel
from .checkpoint import CheckpointError, NonFiniteTrainingError
from .consistency import AttentionConsistency
from .config import CheckedConfig, TrainConfig, objective_of, save_config, tokens_per_sample, trackers_of, validate
from .corpus_source import CorpusSource, to_device
from .graphed import TERMS, StepGraphs, use_graphs
from .data import ShardDataset, sample_indices
from .lagged import LaggedReads, Sent
from .objectives import Objective, flow_loss, noised, sample_sigmas, teacher_gaps, teacher_samples
from .student_teacher import (AdapterOffTeacher, FeatureCapture, block_checkpoint, cast_all, make_student_teacher,
                              make_teacher, shard_teacher, teacher_is_sharded)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
CSV_FIELDS = ["step", "loss", "loss_distill", "loss_flow", "loss_consistency", "gap", "grad_norm", "lr",
              "tokens_per_s", "step_s", "elapsed_s", "peak_gib", "peak_reserved_gib", "eval_gap_output",
              "eval_gap_features", "eval_flow", "eval_prompt_ratio"]


@dataclass
class TrainResult:
    steps: int
    losses: list[float]                 # one per optimizer step run by this call, averaged over processes
    gap_before: dict | None             # held-out gap at this call's start: {"output": ..., "features": ...}
    gap_after: dict | None
    output_dir: str
    final_checkpoint: str | None
    log_rows: list[dict] = field(default_factory=list)


def _allow_block_graphs(blocks: int, shapes: int, passes: int = 2) -> None:
    """Raise Dynamo's recompile limits to the graphs compiled blocks can need, which fullgraph=True turns from a
    warning into a hard failure: static shapes make one graph per video shape and kind of pass (``passes``: training
    and held-out evaluation, and the teacher's forward: its own compiled blocks, or a LoRA run's student's), and on
    some torch versions (2.11 on the H200s) each block instance compiles its own, so a 16-block transformer on 6
    sizes failed at the old fixed limit of 64 after 8 steps (8 blocks fitted)."""
    graphs = blocks * shapes * passes + 8  # + 8: autocast and other one-off guards
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, graphs)
    cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, graphs + 256)


def _compile_blocks(transformer: torch.nn.Module, sequence_parallel_degree: int) -> None:
    """``train.compile``: each block compiled in place with static shapes. The patched attention traces inside
    (one graph a block), except under sequence parallelism, where its templated Ulysses function with gradients
    runs between two graphs of the block (context_parallel._templated_outside_compile)."""
    for block in transformer.blocks:
        block.compile(dynamic=False, fullgraph=sequence_parallel_degree == 1)


class TrainerState:
    """Step and data position, saved as trainer_state.json in every checkpoint."""

    def __init__(self):
        self.step = 0
        self.position = 0  # global samples consumed (for dataset sampling)

    def state_dict(self):
        return {"step": self.step, "position": self.position}

    def load_state_dict(self, d):
        if not (isinstance(d, dict) and all(isinstance(d.get(k), int) and d[k] >= 0 for k in ("step", "position"))):
            raise CheckpointError(f"trainer_state.json must hold non-negative integers step and position, got {d!r:.200}")
        self.step, self.position = int(d["step"]), int(d["position"])


def lr_lambda(cfg: TrainConfig):
    tr = cfg.train

    def f(step: int) -> float:  # step = optimizer steps taken so far
        if tr.warmup_steps and step < tr.warmup_steps:
            return (step + 1) / tr.warmup_steps
        if tr.lr_schedule == "constant":
            return 1.0
        span = max(1, tr.max_steps - tr.warmup_steps)
        progress = min(1.0, (step - tr.warmup_steps) / span)
        return tr.min_lr_ratio + (1 - tr.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


class Batcher:
    """Builds micro-batches (x0, noise, sigma, prompt embeddings) deterministically."""

    def __init__(self, cfg: TrainConfig, tc: dict, shape: list[int], dataset: ShardDataset | None,
                 objective: Objective):
        self.cfg, self.tc, self.shape, self.dataset, self.objective = cfg, tc, shape, dataset, objective

    def make(self, g: torch.Generator, n: int, indices: list[int] | None) -> dict[str, torch.Tensor]:
        cfg = self.cfg
        rows = self.dataset.batch(indices) if self.dataset is not None else None
        embeds = rows["prompt_embeds"].float() if rows is not None else \
            torch.randn(n, cfg.data.text_len, self.tc["text_dim"], generator=g)
        noise = torch.randn(n, *self.shape, generator=g)
        t = cfg.timesteps
        sigma = sample_sigmas(n, g, t.sampling, t.shift, t.min_sigma, t.max_sigma)
        if self.objective.latents == "dataset":
            x0 = rows["latents"].float()
        else:
            x0 = torch.randn(n, *self.shape, generator=g)  # "noise"; "teacher" replaces it by teacher samples
        return {"x0": x0, "noise": noise, "sigma": sigma, "embeds": embeds}


def _generator(seed: int, *parts: int) -> torch.Generator:
    s = seed
    for p in parts:
        s = (s * 1_000_003 + p + 1) % (2 ** 62)
    return torch.Generator().manual_seed(s)


def checked_for(cfg: TrainConfig | CheckedConfig, accelerator=None) -> CheckedConfig:
    """``cfg`` as it is if already checked, else validated for ``accelerator`` (without one: for the device type
    and process count of the accelerator :class:`Trainer` builds, :func:`.config.run_device_type` and
    ``WORLD_SIZE``)."""
    if isinstance(cfg, CheckedConfig):
        return cfg
    if accelerator is None:
        return validate(cfg)
    return validate(cfg, device_type=accelerator.device.type, world_size=accelerator.num_processes)


class Trainer:
    """Holds the accelerator, objective, student, teacher, optimizer and schedule of one run.

    The teacher is built when the objective needs it (its loss, or its clean latents) or the held-out gap is
    measured (``data.held_out`` > 0); else ``teacher`` is None.

    ``cfg``: a :class:`.config.CheckedConfig` (checked for this accelerator's device type and process count), or a
    ``TrainConfig``, validated here for the accelerator.
    """

    def __init__(self, cfg: TrainConfig | CheckedConfig, accelerator=None):
        from accelerate import Accelerator
        from accelerate.utils import set_seed

        checked = checked_for(cfg, accelerator)
        if accelerator is None:  # for the device type it was checked for; on the CPU (no GPU, or `accelerate
            # launch --cpu`) torchrun / accelerate processes join one gloo group
            accelerator = Accelerator(mixed_precision=checked.config.train.mixed_precision,
                                      cpu=checked.device_type == "cpu", **tracking(checked.config))
        check_trackers(accelerator, checked.config)
        self.accelerator = acc = accelerator
        if (checked.device_type, checked.world_size) != (acc.device.type, acc.num_processes):
            raise ValueError(f"the config was checked for {checked.world_size} process(es) on {checked.device_type}, "
                             f"but the run has {acc.num_processes} on {acc.device.type}: validate it for this "
                             f"accelerator, or pass the TrainConfig itself")
        self.cfg = cfg = checked.config
        tr = cfg.train
        mp = tr.mixed_precision
        self.tc = checked.transformer_config
        self.index = checked.index
        self.sp = sequence_parallel.setup(tr.sequence_parallel, acc.process_index, acc.num_processes,
                                          acc.device.type)
        self.objective = objective_of(cfg.objective)
        self.shape = self.index["latent_shape"]
        self.dataset = ShardDataset(cfg.data.path) if cfg.data.path else None
        set_seed(cfg.seed)

        tdt = tr.teacher_dtype or ("bf16" if mp == "bf16" else "fp32")
        self.teacher_dtype = DTYPES[tdt]
        self.lora = tr.trainable == "lora"
        # fp32 master weights where they train; a LoRA run's frozen weights are its teacher's, in the teacher's dtype
        # (Wan 14B: 28 GB in bf16 instead of 57 GB), and only the adapter is fp32. Not under FSDP1: it flattens each
        # block's weights, the adapter's with them, into one tensor of one dtype (a bf16 base is refused at the wrap);
        # sharded, fp32 frozen weights cost 1/N a process, and FSDP's mixed precision computes in bf16 all the same
        fsdp = (2 if acc.is_fsdp2 else 1) if acc.distributed_type.value == "FSDP" else None
        optimizers.check_sharding(tr.optimizer, fsdp)  # before a model is built: one line
        shard = teacher_is_sharded(tr.shard_teacher, fsdp)
        dtype = self.teacher_dtype if self.lora and fsdp != 1 else torch.float32
        # the held-out gap is measured against the teacher too, whatever the objective
        with_teacher = self.objective.needs_teacher or self.objective.latents == "teacher" or cfg.data.held_out > 0
        # A teacher to shard is read from the model again once the student is sharded, not copied from it now: a
        # process then never holds both whole (Wan 14B: the fp32 student's 57 GB and the bf16 teacher's 29 GB, 8 x 86
        # GB of host memory on a node of 8 GPUs). Loaded in the teacher's dtype (diffusers keeps a few modules in fp32:
        # cast too), the copy's very values (tests/test_sharded_checkpoint.py; a bf16 folder loads without a copy).
        later = with_teacher and shard and not self.lora and not tr.from_scratch
        # The student is loaded onto this process's device (a bf16 folder cast to fp32 there: loading.
        # load_transformer_cast_on), unless FSDP is to shard it beside a whole teacher copied from it, which stays
        # on the CPU until then (both whole on one GPU would not fit where the sharded run does).
        where = "cpu" if fsdp and with_teacher and not later and not self.lora else acc.device
        t0 = time.perf_counter()  # the model's setup, timed in parts (said when the run starts: Wan 14B's takes minutes)
        if tr.from_scratch:  # the model's architecture at a seeded random initialisation
            from diffusers import WanTransformer3DModel

            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(cfg.seed)
                transformer = WanTransformer3DModel.from_config(self.tc).to(dtype)
        else:
            transformer = load_transformer_cast_on(cfg.model, dtype, where)
        student, teacher = make_student_teacher(transformer, cfg.attention.mode, cfg.attention.layers,
                                                cfg.attention.options, teacher_dtype=self.teacher_dtype,
                                                trainable=tr.trainable, with_teacher=with_teacher and not later,
                                                lora=asdict(tr.lora))
        # a LoRA run's teacher is the student's module (student_teacher.AdapterOffTeacher), else a copy of its own
        shared = isinstance(teacher, AdapterOffTeacher)
        compact = cfg.data.source == "corpus" and cfg.data.corpus.compact_text  # prompt embeddings cut to their rows
        if compact:
            compact_text.install(student, cfg.data.text_len)
        if tr.gradient_checkpointing:
            student.enable_gradient_checkpointing(block_checkpoint(tr.save_attention))
        if tr.compile:  # each block in place: parameter names, hooks and checkpoints stay as they are
            # passes: training and held-out evaluation, and the teacher's forward (its own blocks, or a LoRA run's
            # student's with the adapter off)
            _allow_block_graphs(len(student.blocks), len(self.index.get("latent_shapes") or [self.shape]),
                                passes=3 if with_teacher else 2)
            _compile_blocks(student, self.sp.degree)
        if self.sp.degree > 1:
            sequence_parallel.enable(student, self.sp)
        # With CUDA graphs the optimizer is what is left of the host's work in a step: the multi-tensor AdamW's Python
        # kept mini's H200 idle 4-9 ms a step (profiler trace); the fused one is one kernel launch per dtype.
        self.graphs = use_graphs(cfg, acc.device.type, acc.num_processes)
        optimizer = optimizers.build(tr.optimizer, [p for p in student.parameters() if p.requires_grad], lr=tr.lr,
                                     betas=tr.betas, eps=tr.eps, weight_decay=tr.weight_decay,
                                     fused=self.graphs or None)
        self.trainable_names = sorted(n for n, p in student.named_parameters() if p.requires_grad)
        # what state/model.safetensors holds: every weight, or a LoRA run's adapter alone (the frozen weights are
        # the model's, loaded again on resume)
        self.saved_names = set(self.trainable_names) if self.lora else None
        self.model_shapes = {k: tuple(v.shape) for k, v in student.state_dict().items()  # checks a resume
                             if self.saved_names is None or k in self.saved_names}
        t1 = time.perf_counter()
        self.student, self.optimizer = acc.prepare(student, optimizer)
        t2 = time.perf_counter()
        if later:
            teacher = make_teacher(cast_all(load_transformer(cfg.model, dtype=self.teacher_dtype), self.teacher_dtype),
                                   cfg.attention.layers)
        if shared:
            teacher.forward_module = self.student  # through accelerate's wrapper, as the student's forward goes
        if teacher is not None and not shared:  # a teacher of its own, copied or read again
            if compact:  # the student's prompt rows
                compact_text.install(teacher, cfg.data.text_len)
            if tr.compile:  # its forward runs every step of a distillation: eager, its norms and RoPE cost mini's
                _compile_blocks(teacher, self.sp.degree)  # QAT step GPU time the student's compiled blocks do not
            if self.sp.degree > 1:
                # the student's sequence shards: its block features must be the same shards as the student's, and a
                # whole-sequence teacher forward would cost every process N times its share
                sequence_parallel.enable(teacher, self.sp)
            # sharded as the student is (train.shard_teacher), or whole here
            teacher = shard_teacher(teacher, self.student, acc.device) if shard else teacher.to(acc.device)
        self.teacher = teacher
        self.setup_s = {"model": t1 - t0, "prepare": t2 - t1, "teacher": time.perf_counter() - t2}
        # Not prepared: accelerate would step it once per process per step; the checkpoint saves it.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        self.state = TrainerState()
        self.s_cap = FeatureCapture(self.student)
        # the attention-consistency term's recorder, in the student's FP4 self-attention layers (consistency.py)
        self.consistency = AttentionConsistency(self.student) if cfg.objective.attention_consistency > 0 else None
        self.t_cap = None if teacher is None else FeatureCapture(teacher.transformer if shared else self.teacher)
        self.batcher = Batcher(cfg, self.tc, self.shape, self.dataset, self.objective)
        self.tokens = tokens_per_sample(self.shape, self.tc)
        self.corpus = None
        if cfg.data.source == "corpus":
            self.corpus = CorpusSource(cfg.model, cfg.data.corpus, text_len=cfg.data.text_len, device=acc.device,
                                       rank=self.sp.dp_rank, world=self.sp.dp_size)
        # EMA of the trainable weights (fp32, on the device), exported instead of the raw weights.
        self.ema = None
        if tr.ema_decay:
            if acc.distributed_type.value == "FSDP":
                raise ValueError("train.ema_decay is not supported with FSDP (the weights are sharded); set it to 0")
            trainable = self._trainable()
            self.ema = {n: p.detach().float().clone() for n, p in trainable}
            self._ema_weights = [p for _, p in trainable]  # in self.ema's order; looked up once, not every step

    def step_graphs(self) -> StepGraphs | None:
        """The CUDA graphs that replay this run's forward + backward (:mod:`.graphed`), or None where the run
        steps eagerly (``train.cuda_graphs``; :func:`.graphed.unsupported` says why not)."""
        if not self.graphs:
            return None
        return StepGraphs(self, self.cfg.train.gradient_accumulation_steps,
                          fallback=self.cfg.train.cuda_graphs == "auto")

    def tokens_at(self, step: int) -> int:
        """Self-attention tokens of one sample at ``step`` (corpus runs cycle through video sizes)."""
        if self.corpus is None:
            return self.tokens
        return tokens_per_sample(self.index["latent_shapes"][self.corpus.size_of_step(step)], self.tc)

    def _trainable(self):
        return [(n, p) for n, p in self.accelerator.unwrap_model(self.student).named_parameters() if p.requires_grad]

    @torch.no_grad()
    def update_ema(self, step: int, skip: torch.Tensor | None = None) -> None:
        """ema <- d ema + (1 - d) w, with d warmed up as min(decay, (1 + step) / (10 + step)); not where ``skip`` (a 0-d
        float32 device tensor, 0.0 or 1.0: :attr:`.lagged.LaggedReads.bad`) is 1, decided on the device."""
        if self.ema is None:
            return
        d = min(self.cfg.train.ema_decay, (1 + step) / (10 + step))
        ema, weights = list(self.ema.values()), [w.detach().float() for w in self._ema_weights]
        if skip is None:
            torch._foreach_lerp_(ema, weights, 1.0 - d)
            return
        # The same lerp with a 0-d tensor weight, (1 - skip) * (1 - d): float32(1 - d) exactly, or 0, which leaves each
        # EMA value as it is. No foreach lerp takes one tensor weight for every tensor, so this list of them takes
        # torch's per-tensor path (one lerp_ launch per tensor, from C++); bit for bit the scalar lerp on CPU.
        weight = (1 - skip) * (1.0 - d)
        torch._foreach_lerp_(ema, weights, [weight] * len(ema))

    def advance_to(self, steps: int) -> None:
        """The state after ``steps`` optimizer steps: the step count and the global samples consumed."""
        cfg = self.cfg
        self.state.step = steps
        self.state.position = steps * cfg.train.gradient_accumulation_steps * cfg.data.batch_size * self.sp.dp_size

    # -- one micro-batch ------------------------------------------------------------------------------------
    def _forward(self, model, batch, dtype=None):
        x = noised(batch["x0"], batch["noise"], batch["sigma"])
        t = batch["sigma"] * 1000.0
        e = batch["embeds"]
        if dtype is not None:
            x, e = x.to(dtype), e.to(dtype)
        return model(hidden_states=x, timestep=t, encoder_hidden_states=e, return_dict=False)[0]

    def _to_device(self, batch):
        return {k: v.to(self.accelerator.device) for k, v in batch.items()}

    def losses(self, batch, *, grad: bool = True) -> dict[str, torch.Tensor]:
        """The objective's terms of one micro-batch (the student forward runs with grad if ``grad``); held out
        (``grad`` false), also the student-teacher gap, and on the corpus the flow loss."""
        acc = self.accelerator
        gaps: dict[str, torch.Tensor] = {}
        run_teacher = self.objective.needs_teacher or not grad
        if run_teacher:
            with torch.no_grad(), acc.autocast(), self.t_cap.capturing() as feats:
                t_out = self._forward(self.teacher, batch, self.teacher_dtype)
                t_feat = dict(feats)
        # the attention-consistency term trains only: held out, the forward has no grad and records nothing
        consistency = self.consistency if grad else None
        with torch.set_grad_enabled(grad), acc.autocast(), self.s_cap.capturing() as feats, \
                consistency.recording() if consistency is not None else contextlib.nullcontext():
            s_out = self._forward(self.student, batch)
            s_feat = dict(feats)
        # features and the layers' attention outputs are sequence shards under SP: their sums are totalled over the
        # group
        total = lambda x: sequence_parallel.sum_over_group(x, self.sp)  # noqa: E731
        if run_teacher:
            gaps = teacher_gaps(s_out, s_feat, t_out, t_feat, total=total)
        term = consistency.term(total) if consistency is not None else None
        out = {**gaps, **self.objective.loss_terms(s_out, batch, gaps, term)}
        if not grad and self.corpus is not None and "flow" not in out:
            out["flow"] = flow_loss(s_out, batch)
        return out

    def micro_batch(self, step: int, micro: int) -> dict[str, torch.Tensor]:
        cfg, acc = self.cfg, self.accelerator
        b = cfg.data.batch_size
        # a function of the data-parallel rank: the processes of a sequence group train on the same samples
        dp_rank, dp_size = self.sp.dp_rank, self.sp.dp_size
        g = _generator(cfg.seed, step, micro, dp_rank)
        indices = None
        if self.dataset is not None:
            pos = (step * cfg.train.gradient_accumulation_steps + micro) * b * dp_size + dp_rank * b
            indices = sample_indices(len(self.dataset), cfg.seed, pos, b)
        if self.corpus is not None:
            pos = (step * cfg.train.gradient_accumulation_steps + micro) * b
            data = sequence_parallel.share_batch(self.corpus.batch(step, micro, b, g, pos), self.sp)
            return self._noise(data, g)
        batch = self._to_device(self.batcher.make(g, b, indices))
        if self.objective.latents == "teacher":
            with acc.autocast():
                batch["x0"] = teacher_samples(self.teacher, torch.randn(batch["x0"].shape, generator=g).to(acc.device),
                                              batch["embeds"], cfg.objective.teacher_steps, cfg.timesteps.shift,
                                              self.teacher_dtype)
        return batch

    def _noise(self, data: dict[str, torch.Tensor], g: torch.Generator) -> dict[str, torch.Tensor]:
        """Add the noise and sigma draws (from ``g``, on the CPU) to a corpus micro-batch."""
        t = self.cfg.timesteps
        x0 = data["x0"]
        n = x0.shape[0]
        # drawn on the device from a seed out of g: the latents are on the device, and a (32, 16, 9, 32, 32)
        # draw on the CPU plus its copy cost ~25 ms a step there (bench/profile_mini_step.py)
        seed = int(torch.randint(2 ** 62, (1,), generator=g))
        noise = torch.randn(x0.shape, generator=torch.Generator(x0.device).manual_seed(seed), device=x0.device)
        sigma = to_device(sample_sigmas(n, g, t.sampling, t.shift, t.min_sigma, t.max_sigma), x0.device)
        return {"x0": x0, "noise": noise, "sigma": sigma, "embeds": data["embeds"]}

    # -- held-out gap ---------------------------------------------------------------------------------------
    def held_out(self) -> list[dict[str, torch.Tensor]]:
        """The fixed held-out micro-batches (own seed: never a training batch)."""
        cfg = self.cfg
        n = cfg.data.held_out
        if not hasattr(self, "_held_out") and self.corpus is not None:
            g = _generator(cfg.data.held_out_seed, 0)
            b = cfg.data.batch_size
            full = self._noise(self.corpus.held_out(n), g)
            self._held_out = [{k: v[i:i + b] for k, v in full.items()} for i in range(0, n, b)]
        if not hasattr(self, "_held_out"):
            g = _generator(cfg.data.held_out_seed, 0)
            indices = None
            if self.dataset is not None:
                perm = torch.randperm(len(self.dataset), generator=g).tolist()
                indices = [perm[i % len(perm)] for i in range(n)]
            full = self.batcher.make(g, n, indices)
            b = cfg.data.batch_size
            self._held_out = [self._to_device({k: v[i:i + b] for k, v in full.items()}) for i in range(0, n, b)]
        return self._held_out

    @torch.no_grad()
    def evaluate(self) -> dict[str, float] | None:
        """Held-out student-teacher gap: normalized MSE of the output and mean over blocks' hidden states."""
        if not self.cfg.data.held_out:
            return None
        gaps, feats, flows, wrong = [], [], [], []
        for batch in self.held_out():
            o = self.losses(batch, grad=False)
            gaps.append(o["gap"].item() * len(batch["sigma"]))
            feats.append(o["gap_features"].item() * len(batch["sigma"]))
            if "flow" in o:
                flows.append(o["flow"].item() * len(batch["sigma"]))
                if self.corpus is not None and len(batch["sigma"]) > 1:
                    wrong.append((self._wrong_caption_flow(batch) * len(batch["sigma"]), flows[-1]))
        for module in (self.student, self.teacher):
            _reshard_root(module)
        n = self.cfg.data.held_out
        out = {"output": sum(gaps) / n, "features": sum(feats) / n}
        if flows:
            out["flow"] = sum(flows) / n
        if wrong:
            out["prompt_ratio"] = sum(w for w, _ in wrong) / sum(r for _, r in wrong)
        return out

    def _wrong_caption_flow(self, batch) -> float:
        """The student's flow loss on ``batch`` with each clip given the next clip's caption. Its ratio to the
        loss with the right captions (``prompt_ratio``, logged as eval_prompt_ratio) says whether the model reads
        the prompt at all: about 1.00 means it ignores it (mini's byte-tokenizer build stayed at 1.001-1.011)."""
        batch = dict(batch, embeds=batch["embeds"].roll(1, dims=0))
        with self.accelerator.autocast():
            return flow_loss(self._forward(self.student, batch), batch).item()

    # -- checkpoints ----------------------------------------------------------------------------------------
    def checkpoint_dir(self, step: int) -> Path:
        return Path(self.cfg.output_dir) / CHECKPOINTS_DIR / step_dir_name(step)

    def _raw_optimizer(self) -> torch.optim.Optimizer:
        return getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate's AcceleratedOptimizer wraps it

    def _on_main(self, value: int) -> int:
        """``value`` as the main process has it, on every process (a broadcast; no pickling)."""
        acc = self.accelerator
        if acc.num_processes == 1:
            return int(value)
        from accelerate.utils import broadcast

        return int(broadcast(torch.tensor([int(value)], dtype=torch.int64, device=acc.device), from_process=0).item())

    def _anywhere(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any process (on every process; a sum of tensors, no pickling)."""
        acc = self.accelerator
        if acc.num_processes == 1:
            return bool(flag)
        return acc.reduce(torch.tensor([int(flag)], device=acc.device), "sum").item() > 0

    def save(self, target: Path, *, with_state: bool = True) -> None:
        """Write ``target`` atomically and verifiably: everything goes to ``target.tmp`` (fsynced, manifest.json
        with every file's sha256 last, by the main process once every process has written its files), then two
        renames (:func:`.checkpoint.commit`). Refuses, writing nothing, if a weight or optimizer value is not finite
        (NonFiniteTrainingError). The training state's layout is ``checkpoint.format``'s (:func:`.checkpoint.layout_for`)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        acc = self.accelerator
        target = Path(target)
        layout = ck.layout_for(self.cfg.checkpoint.format, acc.distributed_type.value) if with_state else "full"
        export = not with_state or self.cfg.checkpoint.export
        # the export (and a full layout's state/model.safetensors): FSDP gathers the weights to the main process. A
        # sharded step checkpoint without the export gathers nothing (Wan 14B: 57 GB of fp32 on one host, and 29 GB
        # of bf16 on disk, a quarter of its checkpoint)
        state_dict = acc.get_state_dict(self.student) if export or layout == "full" else {}
        if self.saved_names is not None:
            state_dict = {k: v for k, v in state_dict.items() if k in self.saved_names}
        osd = sharded = None
        if layout == "sharded":  # each process its own part of the model and optimizer state: nothing gathered
            sharded = ck.sharded_state(self.student, self._raw_optimizer())
        elif with_state:  # FQN-keyed full state dict (FSDP: gathered to the main process, offloaded to CPU)
            osd = get_optimizer_state_dict(self.student, self._raw_optimizer(),
                                           options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        bad = None
        if acc.is_main_process:
            bad = _first_nonfinite(state_dict.items(), "weight")
            if bad is None and osd is not None:
                bad = _first_nonfinite(((f"{fqn}/{k}", v) for fqn, d in osd["state"].items() for k, v in d.items()),
                                       "optimizer state")
        if bad is None and sharded is not None:
            bad = _first_nonfinite(ck.local_parts(sharded[0]), "training state")
        if self._anywhere(bad is not None):
            raise NonFiniteTrainingError(f"step {self.state.step}: {bad or 'a value on another process'} is not "
                                         f"finite; {target} was not written (the last good checkpoint stays)")
        tmp = target.with_name(target.name + ".tmp")
        try:
            self._write(tmp, state_dict, osd, with_state, sharded, export)
            if acc.is_main_process:
                ck.write_manifest(tmp, kind="checkpoint" if with_state else "final", step=self.state.step,
                                  layout=layout)
        except BaseException:  # a full disk, a kill: the partial copy is no checkpoint; the last good one stays
            if acc.is_main_process:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        if acc.is_main_process:
            ck.commit(tmp, target)
        acc.wait_for_everyone()

    def _write(self, tmp: Path, state_dict: dict, osd: dict | None, with_state: bool,
               sharded: tuple[dict, dict] | None = None, export: bool = True) -> None:
        """Every file of a checkpoint (the manifest aside) into ``tmp``: the training state as a full state dict
        (``osd``, the main process writes it) or, ``sharded`` (tensors, optimizer.json's structure), each process its
        own shard; ``export``: the exported weights too."""
        acc = self.accelerator
        if acc.is_main_process:
            if tmp.exists():
                shutil.rmtree(tmp)
            (tmp / "state" if with_state else tmp).mkdir(parents=True)
        acc.wait_for_everyone()
        if with_state:
            tensors, meta = ck.rng_state()
            ck.write_tensors(tmp / "state" / f"rng-{acc.process_index}.safetensors", tensors, meta)
        if sharded is not None:
            ck.save_sharded(tmp / ck.SHARDS, sharded[0])  # collective: a failure on one process fails it on all
        if acc.is_main_process:
            dt = DTYPES[self.cfg.checkpoint.save_dtype]
            exported = state_dict
            if self.ema is not None:  # export the EMA weights; keep the exact fp32 EMA for a resume
                ck.write_tensors(tmp / "ema.safetensors", {k: v.to("cpu") for k, v in self.ema.items()})
                exported = {**state_dict, **self.ema}
            if export and self.lora:  # the LoRA file diffusers' load_lora_weights loads (pipelines/lora.py)
                ck.fsync_file(save_lora(tmp, acc.unwrap_model(self.student), exported, dt))
            elif export:
                ck.write_tensors(tmp / "transformer.safetensors",
                                 {k: v.to("cpu", dt if v.is_floating_point() else v.dtype) for k, v in exported.items()},
                                 metadata={"format": "pt", "attnqat": "qat",
                                           "weights": "ema" if self.ema is not None else "raw"})
            save_config(self.cfg, tmp / "config.yaml")
            ck.fsync_file(tmp / "config.yaml")
            ck.write_json(tmp / "trainer_state.json", self.state.state_dict())
            if with_state:
                if sharded is not None:
                    structure = sharded[1]
                else:
                    ck.write_tensors(tmp / "state" / "model.safetensors",
                                     {k: v.to("cpu") for k, v in state_dict.items()}, metadata={"format": "pt"})
                    tensors, structure = ck.flatten_optimizer(osd)
                    ck.write_tensors(tmp / "state" / "optimizer.safetensors", tensors)
                ck.write_json(tmp / "state" / "optimizer.json", {**structure, "optimizer": self.cfg.train.optimizer})
                ck.write_json(tmp / "state" / "scheduler.json", ck.encode(self.scheduler.state_dict()))
                if acc.scaler is not None:
                    ck.write_json(tmp / "state" / "scaler.json", ck.encode(acc.scaler.state_dict()))
        acc.wait_for_everyone()  # every process's RNG file is written

    def prune(self) -> None:
        """Keep the newest ``checkpoint.keep`` complete checkpoints; delete the older ones."""
        if not self.accelerator.is_main_process:
            return
        steps = ck.step_dirs(self.cfg.output_dir)
        complete = [s for s, p in steps if ck.is_complete(p)]
        if len(complete) <= self.cfg.checkpoint.keep:
            return
        oldest_kept = complete[-self.cfg.checkpoint.keep]
        for s, p in steps:
            if s < oldest_kept:
                shutil.rmtree(p, ignore_errors=True)

    def load(self, path: Path, manifest: dict | None = None) -> None:
        """Restore a checkpoint written by :meth:`save` (safetensors and JSON only: nothing is unpickled).
        ``manifest``: the one the main process verified (sha256); else it is read here."""
        from safetensors import safe_open
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        acc = self.accelerator
        path = Path(path)
        manifest = manifest or ck.read_manifest(path)
        if manifest["kind"] != "checkpoint":
            raise CheckpointError(f"--resume {str(path)!r} is an exported {manifest['kind']}/ folder (weights only), "
                                  f"not a training checkpoint; resume from OUTPUT/checkpoints/step-N")
        sharded = manifest.get("layout", "full") == "sharded"
        if sharded:  # the shards' headers: the same answer on every process
            shapes = {k.removeprefix("model/"): v for k, v in ck.sharded_shapes(path, manifest).items()
                      if k.startswith("model/")}
            if self.saved_names is not None:  # a LoRA run's shards hold the frozen weights too; its adapter is checked
                shapes = {k: v for k, v in shapes.items() if k in self.saved_names}
        else:
            model_file = ck.listed(path, manifest, "state/model.safetensors")
            with safe_open(str(model_file), framework="pt") as f:  # header only: the same answer on every process
                shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        if shapes != self.model_shapes:
            diff = sorted(set(shapes) ^ set(self.model_shapes)) or \
                sorted(k for k in shapes if shapes[k] != self.model_shapes[k])
            raise CheckpointError(f"checkpoint {str(path)!r} does not fit model {self.cfg.model!r} "
                                  f"({len(diff)} keys differ, e.g. {diff[0]}): was it trained on another model?")

        def json_file(rel):
            try:
                return json.loads(ck.listed(path, manifest, rel).read_text())
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise CheckpointError(f"{path}: {rel} is not valid JSON ({e})") from None

        structure = json_file("state/optimizer.json")
        ck.check_optimizer(path, structure, self.cfg.train.optimizer)  # before anything loads
        saved = sorted(n for g in (structure.get("param_groups") or [{}]) for n in g.get("params", [])) \
            if isinstance(structure, dict) else None
        if saved != self.trainable_names:
            raise CheckpointError(f"checkpoint {str(path)!r} trained another set of weights (its optimizer state covers "
                                  f"{len(saved or [])} tensors, this run's train.trainable {self.cfg.train.trainable!r} "
                                  f"{len(self.trainable_names)})")
        multi = acc.num_processes > 1
        if sharded:  # every process reads the pieces of its own part (DCP reshards to this run's processes)
            ck.load_sharded(path, manifest, self.student, self._raw_optimizer(), structure)
        else:  # several processes: the main one reads, then broadcasts
            reads = acc.is_main_process or not multi
            # a LoRA run's checkpoint holds the adapter's weights alone (strict=False: the frozen others stay)
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=multi,
                                       strict=self.saved_names is None)
            set_model_state_dict(self.student, load_file(str(model_file)) if reads else {}, options=options)
            osd = {}
            if reads:
                osd = ck.unflatten_optimizer(load_file(str(ck.listed(path, manifest, "state/optimizer.safetensors"))),
                                             structure)
            set_optimizer_state_dict(self.student, self._raw_optimizer(), osd, options=options)
        sched = ck.decode(json_file("state/scheduler.json"))  # load_state_dict sets every key as an attribute:
        if not isinstance(sched, dict) or "last_epoch" not in sched or set(sched) - set(self.scheduler.state_dict()):
            raise CheckpointError(f"{path}: state/scheduler.json does not hold this run's LR scheduler state")
        self.scheduler.load_state_dict(sched)
        if acc.scaler is not None and "state/scaler.json" in manifest["files"]:
            acc.scaler.load_state_dict(ck.decode(json_file("state/scaler.json")))
        self.state.load_state_dict(json_file("trainer_state.json"))
        rel = f"state/rng-{acc.process_index}.safetensors"
        if rel in manifest["files"]:
            with safe_open(str(ck.listed(path, manifest, rel)), framework="pt") as f:
                ck.set_rng_state({k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {})
        else:
            print(f"attnqat train: {path} holds no RNG state for process {acc.process_index} (saved with fewer "
                  f"processes); its random draws start from the seed")
        if self.ema is not None:
            if "ema.safetensors" not in manifest["files"]:
                raise CheckpointError(f"--resume {str(path)!r} has no ema.safetensors, but train.ema_decay is set")
            saved = load_file(str(ck.listed(path, manifest, "ema.safetensors")), device=str(acc.device))
            if set(saved) != set(self.ema):
                raise CheckpointError(f"--resume {str(path)!r}: its EMA weights do not match this model's trainable "
                                      f"weights")
            for k, v in saved.items():
                self.ema[k].copy_(v)

    def resume_from(self, resume: str) -> Path | None:
        """Verify (sha256, on the main process) and load the checkpoint ``resume`` names: a folder, or ``"auto"``:
        the newest intact one in output_dir; a corrupt one is moved aside as step-N.corrupt, saying so, and the
        next older one is tried. Returns the folder, or None (auto, no checkpoint yet)."""
        acc = self.accelerator
        out_dir = Path(self.cfg.output_dir)
        chosen, error = None, None
        t0 = time.perf_counter()
        if acc.is_main_process:
            try:
                if resume == "auto":
                    chosen = select_checkpoint(out_dir, log=acc.print)
                else:
                    chosen = (Path(resume).expanduser(), ck.verify(Path(resume).expanduser()))
            except CheckpointError as e:
                error = e
        code = self._on_main(-2 if error else (-1 if chosen is None else chosen[1]["step"]))
        if error is not None:
            raise error
        if code == -2:
            raise CheckpointError("the checkpoint to resume from failed verification on the main process")
        if code == -1:
            acc.print(f"attnqat train: no checkpoint in {out_dir}/checkpoints; starting from step 0")
            return None
        if chosen is None:  # other processes: the folder the main process verified
            path = Path(resume).expanduser() if resume != "auto" else self.checkpoint_dir(code)
            chosen = (path, ck.read_manifest(path))
        self.load(*chosen)
        acc.print(f"attnqat train: resumed from {chosen[0]} at step {self.state.step} (sha256 verified) in "
                  f"{time.perf_counter() - t0:.1f} s")
        return chosen[0]


def _first_nonfinite(items, what: str) -> str | None:
    """"<what> <name>" of the first floating tensor in ``items`` holding NaN or inf, else None."""
    for name, v in items:
        if isinstance(v, torch.Tensor) and v.is_floating_point() and not torch.isfinite(v).all():
            return f"{what} {name}"
    return None


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint folder (manifest present, sizes match; not hashed), or None."""
    for _, p in reversed(ck.step_dirs(output_dir)):
        if ck.is_complete(p):
            return p
    return None


def select_checkpoint(output_dir: str | Path, log=print) -> tuple[Path, dict] | None:
    """The newest checkpoint that passes full verification (sha256 of every file) and its manifest. The corrupt
    ones newer than it are then moved aside to step-N.corrupt (kept for inspection, out of the way of pruning and
    of the next resume), saying so; older-format (pickle) ones are skipped, saying so. None if there is no
    checkpoint at all; CheckpointError (and nothing moved) if there are some and none is usable."""
    steps = ck.step_dirs(output_dir)
    problems = []
    for _, p in reversed(steps):
        try:
            manifest = ck.verify(p)
        except CheckpointError as e:
            problems.append((p, e))
            continue
        for bad, e in problems:
            if ck.is_legacy(bad) and not (bad / ck.MANIFEST).exists():
                log(f"attnqat train: skipping {bad.name}: {e}")
            else:
                dest = ck.move_aside(bad, log=lambda *_: None)
                log(f"attnqat train: {e}; moved it aside to {dest.name}, falling back to {p.name}")
        return p, manifest
    if problems:
        raise CheckpointError(f"no intact checkpoint in {Path(output_dir) / 'checkpoints'}: "
                              + " | ".join(str(e) for _, e in problems))
    return None


def _eval_columns(ev: dict) -> dict:
    """log.csv's held-out columns from :meth:`Trainer.evaluate`'s result."""
    return {"eval_gap_output": ev["output"], "eval_gap_features": ev["features"], "eval_flow": ev.get("flow", ""),
            "eval_prompt_ratio": ev.get("prompt_ratio", "")}


def tracking(cfg: TrainConfig) -> dict:
    """The ``Accelerator`` arguments for the trackers :func:`.config.trackers_of` names: ``log_with``, and
    ``OUTPUT/trackers`` as the logging folder of those that write files here (TensorBoard: trackers/PROJECT/)."""
    from accelerate.utils import ProjectConfiguration

    names = trackers_of(cfg.log)
    if not names:
        return {}
    return {"log_with": names, "project_config": ProjectConfiguration(
        project_dir=cfg.output_dir, logging_dir=str(Path(cfg.output_dir) / ck.TRACKERS))}


def check_trackers(acc, cfg: TrainConfig) -> None:
    """An accelerator handed to the Trainer logs to the trackers the config names, no other (its ``log_with`` is
    fixed when it is built: build it with :func:`tracking`'s arguments)."""
    want = set(trackers_of(cfg.log))
    have = {str(getattr(t, "value", t)) for t in (acc.log_with or [])}
    if have != want:
        raise ValueError(f"the accelerator logs to {sorted(have) or 'no tracker'}, the config's log.trackers to "
                         f"{sorted(want) or 'none'}: build it with Accelerator(**attnqat.train.loop.tracking(cfg), ...)")


def _hyperparameters(d: dict, prefix: str = "") -> dict:
    """The config as flat key: number / string / bool pairs, as trackers take hyperparameters (TensorBoard's
    add_hparams refuses lists and None)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_hyperparameters(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v if isinstance(v, (bool, int, float, str)) else json.dumps(v)
    return out


class _Logger:
    """log.csv, appended one complete line per row. On resume, the rows after the checkpoint's step (the part of
    the history the resumed run redoes) are dropped by writing a new file and renaming it over the old one, so a
    kill at any moment leaves the old log or the new one, never an empty or half-written one. The same rows go to
    accelerate's trackers (``log.trackers``), as scalars at their step."""

    def __init__(self, cfg: TrainConfig, acc, start_step: int, resuming: bool):
        self.rows: list[dict] = []
        self.main = acc.is_main_process
        self.csv_path = Path(cfg.output_dir) / ck.LOG
        self.acc = acc
        self.trackers = trackers_of(cfg.log)
        self.cfg = cfg
        if not self.main:
            return
        Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
        if cfg.log.csv:
            kept = read_log(self.csv_path, upto=start_step) if resuming and self.csv_path.exists() else []
            out = io.StringIO(newline="")
            w = csv.DictWriter(out, fieldnames=CSV_FIELDS, restval="", extrasaction="ignore", lineterminator="\n")
            w.writeheader()
            w.writerows(kept)
            ck.atomic_write_text(self.csv_path, out.getvalue())
        if self.trackers:
            acc.init_trackers(cfg.log.project, config=_hyperparameters(cfg.to_dict()))

    def log(self, row: dict):
        self.rows.append(row)
        if not self.main:
            return
        if self.cfg.log.csv:
            out = io.StringIO(newline="")
            csv.DictWriter(out, fieldnames=CSV_FIELDS, lineterminator="\n").writerow(
                {k: row.get(k, "") for k in CSV_FIELDS})
            with self.csv_path.open("a", newline="") as f:
                f.write(out.getvalue())  # one write of one complete line
        if self.trackers:
            self.acc.log({k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}, step=row["step"])

    def close(self):
        """End the trackers, so their files are complete when training returns (log.csv is closed after each row).
        Not accelerator.end_training(): that also destroys the process group, which the held-out evaluation after
        the last step still uses (train() calls it last)."""
        if self.main and self.trackers:
            for tracker in self.acc.trackers:
                tracker.finish()
            self.acc.trackers.clear()  # finished: end_training() in train() must not finish them again


def read_log(path: str | Path, upto: int | None = None) -> list[dict]:
    """The rows of a log.csv: complete lines only (a line cut by a kill has no newline yet), one row per step
    (the last written, should a step appear twice), in step order, steps <= ``upto`` if given."""
    with open(path, newline="") as f:
        text = f.read()
    if not text.endswith("\n"):
        text = text[:text.rfind("\n") + 1]
    rows: dict[int, dict] = {}
    for r in csv.DictReader(io.StringIO(text, newline="")):
        try:
            step = int(r.get("step") or "")
        except ValueError:
            continue
        if upto is None or step <= upto:
            rows[step] = {k: v for k, v in r.items() if k is not None}
    return [rows[k] for k in sorted(rows)]


def check_request(cfg: TrainConfig, resume: str | None = None, stop_after: int | None = None,
                  overwrite: bool = False, *, refuse_existing: bool = True) -> None:
    """What :func:`train` checks before building anything (read-only, the same answer on every process): the
    arguments, the output folder (a folder, or creatable), that it holds no other run unless ``resume`` or
    ``overwrite`` says what to do with it (``refuse_existing=False``: ``--check`` only looks), and that the checkpoint
    to resume is of this run's ``train.optimizer``."""
    if resume is not None and (not isinstance(resume, str) or not resume.strip()):
        raise ValueError(f"--resume must be 'auto' or a checkpoint folder, got {resume!r}")
    if resume and overwrite:
        raise ValueError("--resume and --overwrite exclude each other: continue the run, or delete it and start over")
    if stop_after is not None and (isinstance(stop_after, bool) or not isinstance(stop_after, int) or stop_after < 1):
        raise ValueError(f"--stop-after must be a step >= 1, got {stop_after!r}")
    out_dir = Path(cfg.output_dir)
    check_output_dir(out_dir)
    named_checkpoint = resume if resume != "auto" else None
    check_not_input("output_dir", out_dir, [("data.path", cfg.data.path), ("--resume", named_checkpoint)]
                    + model_inputs("model", cfg.model))
    found = ck.run_artifacts(out_dir)
    if found and not resume and not overwrite and refuse_existing:
        names = ", ".join(sorted({p.relative_to(out_dir).parts[0] + ("/" if p.is_dir() else "") for p in found}))
        raise ValueError(f"output_dir {str(out_dir)!r} already holds a training run ({names}); continue it with "
                         f"--resume auto, or delete that run and start over with --overwrite")
    if resume and resume != "auto":
        path = Path(resume).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"--resume {resume!r} does not exist")
        if not path.is_dir():
            raise ValueError(f"--resume {resume!r} is not a folder; give OUTPUT/checkpoints/step-N or 'auto'")
        ck.read_manifest(path)  # refuses incomplete and older pickle checkpoints by name (verified later)
    if resume:
        check_resume_optimizer(cfg, resume)


def check_resume_optimizer(cfg: TrainConfig, resume: str) -> None:
    """Refuse, before a model is built, to resume a checkpoint of another ``train.optimizer`` (the named one, or
    for ``auto`` the newest complete one in output_dir). A first look, unverified: a checkpoint whose optimizer.json
    does not read is left to :meth:`Trainer.load`, which checks the verified one again."""
    path = latest_checkpoint(cfg.output_dir) if resume == "auto" else Path(resume).expanduser()
    if path is None:
        return
    try:
        manifest = ck.read_manifest(path)
        structure = json.loads(ck.listed(path, manifest, "state/optimizer.json").read_text())
    except (CheckpointError, OSError, UnicodeDecodeError, json.JSONDecodeError):
        return
    ck.check_optimizer(path, structure, cfg.train.optimizer)


def check_output_dir(out_dir: Path) -> None:
    """output_dir is a folder (or can become one), and any log.csv / final/ in it are attnqat's own."""
    out_dir = Path(out_dir)
    try:
        if out_dir.exists() and not out_dir.is_dir():
            raise ValueError(f"output_dir {str(out_dir)!r} exists and is not a folder")
        parent = out_dir
        while not parent.exists():
            parent = parent.parent
        if not parent.is_dir():
            raise ValueError(f"output_dir {str(out_dir)!r} cannot be created: {str(parent)!r} is a file")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise PermissionError(f"output_dir {str(out_dir)!r}: {str(parent)!r} is not writable")
        for name in ("checkpoints", "final"):
            if (out_dir / name).exists() and not (out_dir / name).is_dir():
                raise ValueError(f"output_dir {str(out_dir)!r}: {name} exists and is not a folder")
        if (out_dir / "final").is_dir() and not ck.is_ours(out_dir / "final") and any((out_dir / "final").iterdir()):
            raise ValueError(f"{str(out_dir / 'final')!r} was not written by attnqat; move it out of output_dir")
        if (out_dir / ck.LOG).exists() and not ck.our_log(out_dir / ck.LOG):
            raise ValueError(f"{str(out_dir / ck.LOG)!r} is not an attnqat log; move it out of output_dir")
    except (OSError, ValueError) as e:  # a name too long, a NUL byte
        if isinstance(e, PermissionError) or (isinstance(e, ValueError) and "output_dir" in str(e)):
            raise
        raise ValueError(f"output_dir {str(out_dir)[:200]!r} is not usable: {getattr(e, 'strerror', None) or e}") from None


def _held_out_line(step: int, now: dict, before: dict | None = None, *, with_gap: bool = True) -> str:
    """The held-out measures at ``step`` (and where they started). A run from scratch leaves out the
    student-teacher gap: its teacher is the random initialisation, and the distance to it means nothing."""
    names = [("output", "student-teacher gap: output", 4), ("features", "features", 4)] if with_gap else []
    names += [("flow", "flow loss", 4), ("prompt_ratio", "wrong/right caption loss", 4)]
    # significant digits, not decimals: a tiny model's gaps of ~2e-5 must show their change
    parts = [f"{label} {now[k]:.{digits}g}" + (f" (from {before[k]:.{digits}g})" if before and k in before else "")
             for k, label, digits in names if k in now]
    return f"held-out at step {step}: " + "; ".join(parts)


def train(cfg: TrainConfig | CheckedConfig, *, resume: str | None = None, stop_after: int | None = None,
          time_limit: float | None = None, accelerator=None, overwrite: bool = False) -> TrainResult:
    """Run (or continue) training as ``cfg`` says.

    Arguments:
        cfg: a :class:`.config.CheckedConfig` from :func:`.config.validate`, or a ``TrainConfig``, validated here
            (for ``accelerator``'s device type and process count, else the ones this machine's run gets).
        resume: a checkpoint folder (``OUTPUT/checkpoints/step-N``), or ``"auto"`` for the newest intact one in
            ``cfg.output_dir`` (starts fresh if there is none). Resuming a finished run (checkpoint at
            ``train.max_steps``) only (re)writes a missing or stale ``final/``.
        stop_after: stop after this optimizer step, as if interrupted (no final checkpoint unless it is
            a checkpoint step). For tests and time-limited jobs.
        time_limit: seconds; once a step ends past them, save a checkpoint and stop (resume later with
            ``resume="auto"``). For jobs that must fit a time slot.
        overwrite: delete the run already in ``cfg.output_dir`` (its checkpoints, final/, log and config; nothing
            else) and start over. Without it (or ``resume``), a folder holding a run is refused.
    Return:
        a :class:`TrainResult` with this call's losses and the held-out gap before and after.
    Raises:
        ValueError for what a user can fix: a refused folder or checkpoint (``CheckpointError``), and
        ``NonFiniteTrainingError`` (a NaN/inf loss, gradient norm, learning rate or weight: training stops
        before the optimizer step, and nothing non-finite is written).
    """
    checked = checked_for(cfg, accelerator)  # a bad config is reported before output_dir is looked at
    cfg = checked.config
    check_request(cfg, resume, stop_after, overwrite)  # before any model is built
    # One run writes output_dir at a time. The main process (global rank 0) holds the lock; if it refuses, a
    # launcher (torchrun, accelerate launch) stops the other processes.
    main_process = int(os.environ.get("RANK", "0")) == 0
    with (output_lock(cfg.output_dir, "attnqat train") if main_process else contextlib.nullcontext(),
          deterministic_algorithms(cfg.train.deterministic)):
        check_request(cfg, resume, stop_after, overwrite)  # again: another run may have finished meanwhile
        trainer = Trainer(checked, accelerator)
        try:
            return _train(trainer, cfg, resume, stop_after, overwrite, time_limit)
        finally:
            trainer.s_cap.remove()
            if trainer.t_cap is not None:
                trainer.t_cap.remove()
            trainer.accelerator.end_training()


@contextlib.contextmanager
def deterministic_algorithms(on: bool):
    """``train.deterministic``: torch's deterministic algorithms while the run lasts, the caller's setting after.
    On GPUs a run is otherwise not repeatable bit for bit: two uninterrupted runs of a 2-block Wan 1.3B on two
    H200s parted at step 3 by 3e-5 of the loss (docs/multigpu.md). This package's attention kernels add nothing
    atomically (their default backward); torch's may (the bf16 cross-attention's SDPA backward is the suspect, not
    yet isolated), so an exact-resume check on GPUs needs this. cuBLAS needs its workspace setting before its first
    call: set here unless the environment has one, and left set (cuBLAS reads it when a handle is made)."""
    if not on:
        yield
        return
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.benchmark)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    try:
        yield
    except RuntimeError as e:  # torch's refusal names the op: one line for the CLI, not a traceback
        if "does not have a deterministic implementation" not in str(e):
            raise
        raise ValueError(f"train.deterministic: {str(e).splitlines()[0]} (turn train.deterministic off to run "
                         f"with it)") from e
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.benchmark = before[2]


def _reshard_root(module) -> None:
    """Free the weights FSDP2 gathered for a forward without backward at ``module``'s root (fully_shard keeps the root
    unsharded after its forward, for the backward it expects): left so, the root's parameters are the gathered plain
    tensors until the next backward, so a list of the student's parameters taken then (the optimizer's, the clip's)
    would not be the sharded ones it steps."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(module, FSDPModule):
        module.reshard()


def _train(trainer: Trainer, cfg: TrainConfig, resume, stop_after, overwrite, time_limit=None) -> TrainResult:
    from tqdm.auto import tqdm

    acc, tr = trainer.accelerator, cfg.train
    out_dir = Path(cfg.output_dir)
    resumed = None
    if resume and resume != "auto":  # a named checkpoint: verified and loaded before output_dir is touched
        resumed = trainer.resume_from(resume)
    if acc.is_main_process:
        if overwrite:
            ck.remove_run(out_dir, log=acc.print)
        ck.recover_run(out_dir, log=acc.print)  # finish or undo the writes a kill interrupted
    acc.wait_for_everyone()
    if resume == "auto":
        resumed = trainer.resume_from(resume)
    start = trainer.state.step
    if start > tr.max_steps:
        raise ValueError(f"the checkpoint is at step {start}, past train.max_steps {tr.max_steps}; raise "
                         f"train.max_steps or resume an earlier checkpoint")
    if acc.is_main_process:
        out_dir.mkdir(parents=True, exist_ok=True)
        ck.atomic_write_text(out_dir / ck.RUN_CONFIG, yaml_config(cfg))
    if resumed is not None and start == tr.max_steps:
        return _finish(trainer, out_dir / "final")
    groups = f", sequence parallel {trainer.sp.degree} x {trainer.sp.dp_size}" if trainer.sp.degree > 1 else ""
    acc.print(f"attnqat train: {cfg.model}, {acc.num_processes} process(es) on {acc.device.type} "
              f"({acc.distributed_type.value}{groups}), objective {trainer.objective.label}, "
              f"student {cfg.attention.mode}"
              f"{f' + LoRA rank {tr.lora.rank}' if trainer.lora else ''}, "
              f"{trainer.tokens_at(start)} tokens/sample, steps {start}..{tr.max_steps}; set up in "
              + ", ".join(f"{k} {v:.1f} s" for k, v in trainer.setup_s.items()))
    logger = _Logger(cfg, acc, start, resuming=bool(resume))
    gap_before = trainer.evaluate()
    if gap_before and acc.is_main_process:
        acc.print(_held_out_line(start, gap_before, with_gap=not tr.from_scratch))
    accum = tr.gradient_accumulation_steps
    losses: list[float] = []
    final = None
    gap_after = None
    end = tr.max_steps if stop_after is None else min(tr.max_steps, stop_after)
    bar = tqdm(total=tr.max_steps, initial=start, disable=not (acc.is_main_process and cfg.log.progress),
               desc="attnqat train", dynamic_ncols=True)
    max_norm = tr.grad_clip if tr.grad_clip > 0 else float("inf")
    trainable = [p for p in trainer.student.parameters() if p.requires_grad]
    graphs = trainer.step_graphs()  # None: the eager step
    reads = None
    if graphs is not None:
        reads = LaggedReads(trainer._raw_optimizer(), acc.device)
        acc.print("attnqat train: each micro-batch's forward and backward replays a CUDA graph "
                  "(train.cuda_graphs; the first step of each video size captures it); each step's loss and gradient "
                  "norm are read one step later")
    if acc.device.type == "cuda":  # log.csv's peak_gib is this run's, not an earlier one's in the same process
        torch.cuda.reset_peak_memory_stats(acc.device)
    t_start = time.perf_counter()
    t_read = t_start  # when the host last had a step's values: with graphs, where the next step's time ends

    def finish(step: int, reduced: dict, grad_norm, lr: float, dt: float, *, lagged: bool = False) -> bool:
        """What follows ``step``'s update (0-based; its values read and finite): its row, held-out evaluation, progress
        and checkpoints. ``lagged``: the next step is queued already, so this step is none that uses the weights
        (:func:`_uses_weights`) and the time limit is not looked at. Returns whether the time limit stops the run."""
        nonlocal final, gap_after
        losses.append(reduced["loss"])
        row = {"step": step + 1, "loss": reduced["loss"], "loss_distill": reduced.get("distill", ""),
               "loss_flow": reduced.get("flow", ""), "gap": reduced.get("gap", ""),
               "loss_consistency": reduced.get("consistency", ""),
               "grad_norm": float(grad_norm) if grad_norm is not None else "", "lr": lr,
               "tokens_per_s": trainer.tokens_at(step) * cfg.data.batch_size * accum * trainer.sp.dp_size / dt,
               "step_s": dt, "elapsed_s": time.perf_counter() - t_start,
               # the allocator's own count (no wait for the device): what a user sizes a GPU by
               "peak_gib": torch.cuda.max_memory_allocated(acc.device) / 2 ** 30 if acc.device.type == "cuda" else "",
               # what the allocator held for them (its cache included): nearer what nvidia-smi shows
               "peak_reserved_gib": (torch.cuda.max_memory_reserved(acc.device) / 2 ** 30
                                     if acc.device.type == "cuda" else "")}
        if _evaluates(cfg, step):
            ev = trainer.evaluate()
            if ev:
                row.update(_eval_columns(ev))
        last = step + 1 == tr.max_steps
        if last:
            gap_after = trainer.evaluate()
        if last and gap_after:
            row.update(_eval_columns(gap_after))
        if (step + 1) % cfg.log.every == 0 or last or "eval_gap_output" in row:
            logger.log(row)
        bar.set_postfix(loss=f"{row['loss']:.4g}", lr=f"{lr:.2e}", gn=f"{row['grad_norm']:.3g}",
                        tok_s=f"{row['tokens_per_s']:.3g}", refresh=False)  # drawn by update, at most 10 a second
        bar.update(1)
        out_of_time = not lagged and _out_of_time(time_limit, t_start)
        if _checkpoints(cfg, step) or last or out_of_time:
            trainer.save(trainer.checkpoint_dir(step + 1))
            trainer.prune()
        if last:
            final = Path(cfg.output_dir) / "final"
            trainer.save(final, with_state=False)
        if out_of_time and not last:
            acc.print(f"attnqat train: time limit of {time_limit:.0f} s reached after step {step + 1}; "
                      f"checkpoint saved (continue with --resume auto)")
        return out_of_time and not last

    def eager_step(step: int, t0: float) -> bool:
        sums: dict[str, torch.Tensor] = {}
        for micro in range(accum):
            batch = trainer.micro_batch(step, micro)
            ctx = acc.no_sync(trainer.student) if micro < accum - 1 else _null()
            with ctx:
                out = trainer.losses(batch)
                # x sequence_parallel: each process's gradient is its sequence shard's share of the sample's,
                # which the group must sum, but DDP / FSDP average over every process (sequence_parallel.py)
                acc.backward(out["loss"] * trainer.sp.degree / accum)
            terms = {k: out[k].detach().float() / accum for k in TERMS if k in out}
            for k, v in terms.items():
                sums[k] = sums.get(k, 0.0) + v
        grad_norm = acc.clip_grad_norm_(trainable, max_norm)
        lr = trainer.scheduler.get_last_lr()[0]
        # averaged over processes before the optimizer step, so that every process stops at the same step
        reduced = {k: acc.reduce(v.reshape(1).to(acc.device), "mean").item() for k, v in sums.items()}
        _check_finite(trainer, logger, bar, step + 1, reduced, grad_norm, lr)
        trainer.optimizer.step()
        trainer.scheduler.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        trainer.update_ema(step)
        trainer.advance_to(step + 1)
        if acc.device.type == "cuda":
            torch.cuda.synchronize()
        return finish(step, reduced, grad_norm, lr, time.perf_counter() - t0)

    def read(launched: _Launched, *, lagged: bool = False) -> bool:
        """Wait for a graphed step's values (the copy :meth:`.lagged.LaggedReads.send` queued), stop if any is not
        finite (the row and the error of the synchronous check), then :func:`finish` the step."""
        nonlocal t_read
        *values, grad_norm = reads.receive(launched.sent)
        now = time.perf_counter()
        # the step's time: from its start, or from the values of the step before if those came later (the GPU ran it
        # behind that step), to its own values
        dt, t_read = now - max(launched.t0, t_read), now
        reduced = dict(zip(launched.keys, values))
        try:
            _check_finite(trainer, logger, bar, launched.step + 1, reduced, grad_norm, launched.lr)
        except NonFiniteTrainingError:
            trainer.advance_to(launched.step)  # its update, and any after it, were skipped on the device
            raise
        return finish(launched.step, reduced, grad_norm, launched.lr, dt, lagged=lagged)

    pending: _Launched | None = None  # a graphed step whose values the host has not read yet
    prepared: dict[str, torch.Tensor] | None = None  # the next step's first micro-batch, built ahead

    def graphed_step(step: int, t0: float) -> bool:
        """One optimizer step of the graphed path, with no wait for the GPU unless :func:`_uses_weights` or the time
        limit needs this step's weights now: its values are read while the next step runs (why: :mod:`.lagged`, the
        GPU idle 8 of mini's 51 ms a step at 33x256x256 while the host finished the step after its read)."""
        nonlocal pending, prepared
        sums: dict[str, torch.Tensor] = {}
        for micro in range(accum):
            batch = prepared if micro == 0 and prepared is not None else trainer.micro_batch(step, micro)
            for k, v in graphs.forward_backward(batch).items():  # the same terms, over accum
                sums[k] = sums.get(k, 0.0) + v
        prepared = None
        grad_norm = acc.clip_grad_norm_(trainable, max_norm)
        lr = trainer.scheduler.get_last_lr()[0]
        launched = _Launched(step, list(sums), reads.send(list(sums.values()), grad_norm), lr, t0)
        if not math.isfinite(lr):  # the host knows it now: stop before this update, as the synchronous check does
            earlier, pending = pending, None
            if earlier is not None:
                read(earlier, lagged=True)
            read(launched)  # raises
        trainer.optimizer.step()  # fused: skipped on the device once a step's terms or norm were not finite
        trainer.scheduler.step()
        graphs.zero_grad()
        trainer.update_ema(step, skip=reads.bad)
        trainer.advance_to(step + 1)
        now = step + 1 == end or _uses_weights(cfg, step) or _out_of_time(time_limit, t_start)
        if not now:  # queued on the stream behind this step (its copy into the graph's inputs too): safe to build now
            prepared = trainer.micro_batch(step + 1, 0)
        earlier, pending = pending, (None if now else launched)
        if earlier is not None:
            read(earlier, lagged=True)  # the wait, if any, has this step queued behind it on the GPU
        return read(launched) if now else False

    for step in range(start, end):
        t0 = time.perf_counter()
        trainer.student.train()
        if (eager_step if graphs is None else graphed_step)(step, t0):
            break
    bar.close()
    logger.close()
    if gap_after is None and trainer.state.step > start:
        gap_after = trainer.evaluate()
    if gap_after and gap_before and acc.is_main_process:
        acc.print(_held_out_line(trainer.state.step, gap_after, gap_before, with_gap=not tr.from_scratch))
    if final is not None:
        rotation = cfg.attention.options.get("qk_rotation", "none")
        acc.print(f"final checkpoint: {final}\n  try it: attnqat generate --model {shlex.quote(str(cfg.model))} "
                  f"--qat-checkpoint {shlex.quote(str(final))} --mode {cfg.attention.mode} "
                  + (f"--qk-rotation {rotation} " if rotation != "none" else "")
                  + "".join(f"{option_flag(name)} on " for name in SWITCHED if cfg.attention.options.get(name))
                  + "--prompt 'a red ball slides left over a striped background'")
    return TrainResult(steps=trainer.state.step, losses=losses, gap_before=gap_before, gap_after=gap_after,
                       output_dir=cfg.output_dir, final_checkpoint=str(final) if final else None, log_rows=logger.rows)


class _Launched(NamedTuple):
    """A graphed step queued on the device whose values the host reads later (:func:`_train`)."""
    step: int           # 0-based
    keys: list[str]     # the loss terms, in the order of the values sent
    sent: Sent
    lr: float
    t0: float           # when the host began it


def _evaluates(cfg: TrainConfig, step: int) -> bool:
    """Whether the held-out evaluation runs after 0-based ``step`` (mid-run: the last step's is ``gap_after``)."""
    return bool(cfg.log.eval_every) and (step + 1) % cfg.log.eval_every == 0 and step + 1 < cfg.train.max_steps


def _checkpoints(cfg: TrainConfig, step: int) -> bool:
    """Whether 0-based ``step`` is a ``checkpoint.every`` step (the last one and the time limit also write one)."""
    return (step + 1) % cfg.checkpoint.every == 0


def _uses_weights(cfg: TrainConfig, step: int) -> bool:
    """Whether what follows 0-based ``step`` reads the weights it left (a held-out evaluation, a checkpoint, final/):
    the graphed loop then reads the step's values before it queues the next step."""
    return (_evaluates(cfg, step) and cfg.data.held_out > 0) or _checkpoints(cfg, step) \
        or step + 1 == cfg.train.max_steps


def _out_of_time(time_limit: float | None, t_start: float) -> bool:
    return time_limit is not None and time.perf_counter() - t_start > time_limit


def _check_finite(trainer: Trainer, logger: _Logger, bar, step: int, reduced: dict, grad_norm, lr: float) -> None:
    """Stop (NonFiniteTrainingError) before the optimizer step of ``step`` if the loss terms, the gradient norm or
    the learning rate are NaN or inf; the row is logged first, so the log shows where it happened."""
    gn = float(grad_norm) if grad_norm is not None else None
    bad = [f"{k} {v}" for k, v in (*reduced.items(), ("grad_norm", gn), ("lr", lr))
           if v is not None and not math.isfinite(v)]
    if not bad:
        return
    logger.log({"step": step, "loss": reduced.get("loss", ""), "loss_distill": reduced.get("distill", ""),
                "loss_flow": reduced.get("flow", ""), "gap": reduced.get("gap", ""),
                "loss_consistency": reduced.get("consistency", ""),
                "grad_norm": gn if gn is not None else "", "lr": lr})
    bar.close()
    logger.close()
    last_good = latest_checkpoint(trainer.cfg.output_dir)
    raise NonFiniteTrainingError(f"step {step}: non-finite {', '.join(bad)}; stopped before the optimizer step, "
                                 f"nothing written; the last good checkpoint is {last_good or 'none'} (lower "
                                 f"train.lr or check the data, then --resume auto)")


def _finish(trainer: Trainer, final: Path) -> TrainResult:
    """A resumed run already at train.max_steps: (re)write final/ unless an intact one of this step is there."""
    acc, step = trainer.accelerator, trainer.state.step
    done = False
    if acc.is_main_process:
        try:
            done = ck.verify(final)["step"] == step
        except (CheckpointError, OSError):
            done = False
    trainer.prune()  # a kill may have come between the last checkpoint and its pruning
    if trainer._on_main(done):
        acc.print(f"attnqat train: the run is complete (step {step}); {final} is intact")
    else:
        trainer.save(final, with_state=False)
        acc.print(f"attnqat train: the run is complete (step {step}); wrote {final}")
    return TrainResult(steps=step, losses=[], gap_before=None, gap_after=None,
                       output_dir=trainer.cfg.output_dir, final_checkpoint=str(final))


def yaml_config(cfg: TrainConfig) -> str:
    import yaml

    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False
