"""The Attn-QAT training loop on accelerate: distillation (output / features), flow matching, or a mix.

    from attnqat.train import load_config, train
    result = train(load_config("configs/tiny.yaml"))
    result.gap_before, result.gap_after        # held-out student-teacher gap (normalized MSE)

One optimizer step = ``gradient_accumulation_steps`` micro-batches of ``data.batch_size`` samples per
process. Every random draw of a micro-batch (noise, sigma, data-free latents and embeddings) comes from
a generator seeded by (seed, step, micro-batch, rank), and dataset rows from the global sample position,
so a run resumed from a checkpoint repeats the uninterrupted run's batches exactly.
"""
from __future__ import annotations

import csv
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .config import TrainConfig, model_config, save_config, validate
from .data import ShardDataset, sample_indices
from .objectives import FeatureCapture, make_student_teacher, nmse, noised, sample_sigmas, teacher_samples

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
CSV_FIELDS = ["step", "loss", "loss_distill", "loss_flow", "gap", "grad_norm", "lr", "tokens_per_s", "step_s",
              "eval_gap_output", "eval_gap_features", "eval_flow"]


@dataclass
class TrainResult:
    steps: int
    losses: list[float]                 # one per optimizer step run by this call, averaged over processes
    gap_before: dict | None             # held-out gap at this call's start: {"output": ..., "features": ...}
    gap_after: dict | None
    output_dir: str
    final_checkpoint: str | None
    log_rows: list[dict] = field(default_factory=list)


class TrainerState:
    """Step and data position, saved with accelerate's state (``register_for_checkpointing``)."""

    def __init__(self):
        self.step = 0
        self.position = 0  # global samples consumed (for dataset sampling)

    def state_dict(self):
        return {"step": self.step, "position": self.position}

    def load_state_dict(self, d):
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


def tokens_per_sample(shape, tc) -> int:
    _, f, h, w = shape
    pt, ph, pw = tc.get("patch_size", (1, 2, 2))
    return (f // pt) * (h // ph) * (w // pw)


class Batcher:
    """Builds micro-batches (x0, noise, sigma, prompt embeddings) deterministically."""

    def __init__(self, cfg: TrainConfig, tc: dict, shape: list[int], dataset: ShardDataset | None):
        self.cfg, self.tc, self.shape, self.dataset = cfg, tc, shape, dataset

    def make(self, g: torch.Generator, n: int, indices: list[int] | None) -> dict[str, torch.Tensor]:
        cfg = self.cfg
        rows = self.dataset.batch(indices) if self.dataset is not None else None
        embeds = rows["prompt_embeds"].float() if rows is not None else \
            torch.randn(n, cfg.data.text_len, self.tc["text_dim"], generator=g)
        noise = torch.randn(n, *self.shape, generator=g)
        t = cfg.timesteps
        sigma = sample_sigmas(n, g, t.sampling, t.shift, t.min_sigma, t.max_sigma)
        if cfg.objective.type != "distill" or cfg.objective.latents == "dataset":
            x0 = rows["latents"].float()
        else:
            x0 = torch.randn(n, *self.shape, generator=g)  # "noise"; "teacher" replaces it by teacher samples
        return {"x0": x0, "noise": noise, "sigma": sigma, "embeds": embeds}


def _generator(seed: int, *parts: int) -> torch.Generator:
    s = seed
    for p in parts:
        s = (s * 1_000_003 + p + 1) % (2 ** 62)
    return torch.Generator().manual_seed(s)


class Trainer:
    """Holds the accelerator, student, teacher, optimizer and schedule of one run."""

    def __init__(self, cfg: TrainConfig, accelerator=None):
        from accelerate import Accelerator
        from accelerate.utils import set_seed

        self.cfg = cfg
        tr = cfg.train
        mp = tr.mixed_precision
        # cpu=True without a GPU: then torchrun / `accelerate launch --cpu` processes join one gloo group.
        self.accelerator = accelerator or Accelerator(mixed_precision=mp, cpu=not torch.cuda.is_available())
        acc = self.accelerator
        self.tc = model_config(cfg.model)
        self.index = validate(cfg, transformer_config=self.tc, device_type=acc.device.type)
        self.shape = self.index["latent_shape"]
        self.dataset = ShardDataset(cfg.data.path) if cfg.data.path else None
        set_seed(cfg.seed)

        from attnqat.pipelines import load_transformer

        if tr.from_scratch:  # the model's architecture at a seeded random initialisation
            from diffusers import WanTransformer3DModel

            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(cfg.seed)
                transformer = WanTransformer3DModel.from_config(self.tc)
        else:
            transformer = load_transformer(cfg.model, dtype=torch.float32)  # fp32 master weights
        tdt = tr.teacher_dtype or ("bf16" if mp == "bf16" else "fp32")
        self.teacher_dtype = DTYPES[tdt]
        student, teacher = make_student_teacher(transformer, cfg.attention.mode, cfg.attention.layers,
                                                cfg.attention.options, teacher_dtype=self.teacher_dtype,
                                                trainable=tr.trainable)
        if tr.gradient_checkpointing:
            student.enable_gradient_checkpointing()
        self.needs_teacher = cfg.objective.type in ("distill", "mix")
        self.features = cfg.objective.target == "features" and self.needs_teacher
        optimizer = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=tr.lr, betas=tuple(float(b) for b in tr.betas),
                                      eps=tr.eps, weight_decay=tr.weight_decay)
        self.student, self.optimizer = acc.prepare(student, optimizer)
        self.teacher = teacher.to(acc.device)
        # Not prepared: accelerate would step it once per process per step; it is registered instead.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg))
        self.state = TrainerState()
        acc.register_for_checkpointing(self.scheduler, self.state)
        self.s_cap = FeatureCapture(self.student)
        self.t_cap = FeatureCapture(self.teacher)
        self.batcher = Batcher(cfg, self.tc, self.shape, self.dataset)
        self.tokens = tokens_per_sample(self.shape, self.tc)
        self.corpus = None
        if cfg.data.source == "corpus":
            from .corpus_source import CorpusSource

            self.corpus = CorpusSource(cfg.model, cfg.data.corpus, text_len=cfg.data.text_len, device=acc.device,
                                       rank=acc.process_index, world=acc.num_processes)
        # EMA of the trainable weights (fp32, on the device), exported instead of the raw weights.
        self.ema = None
        if tr.ema_decay:
            if acc.distributed_type.value == "FSDP":
                raise ValueError("train.ema_decay is not supported with FSDP (the weights are sharded); set it to 0")
            self.ema = {n: p.detach().float().clone() for n, p in self._trainable()}

    def tokens_at(self, step: int) -> int:
        """Self-attention tokens of one sample at ``step`` (corpus runs cycle through video sizes)."""
        if self.corpus is None:
            return self.tokens
        return tokens_per_sample(self.index["latent_shapes"][self.corpus.size_of_step(step)], self.tc)

    def _trainable(self):
        return [(n, p) for n, p in self.accelerator.unwrap_model(self.student).named_parameters() if p.requires_grad]

    @torch.no_grad()
    def update_ema(self, step: int) -> None:
        """ema <- d ema + (1 - d) w, with d warmed up as min(decay, (1 + step) / (10 + step))."""
        if self.ema is None:
            return
        d = min(self.cfg.train.ema_decay, (1 + step) / (10 + step))
        named = dict(self._trainable())
        torch._foreach_lerp_(list(self.ema.values()), [named[n].detach().float() for n in self.ema], 1.0 - d)

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
        """Loss terms of one micro-batch (the student forward runs with grad if ``grad``)."""
        cfg, acc = self.cfg, self.accelerator
        out: dict[str, torch.Tensor] = {}
        t_out = t_feat = None
        if self.needs_teacher or not grad:
            with torch.no_grad(), acc.autocast(), self.t_cap.capturing() as feats:
                t_out = self._forward(self.teacher, batch, self.teacher_dtype)
                t_feat = dict(feats)
        with torch.set_grad_enabled(grad), acc.autocast(), self.s_cap.capturing() as feats:
            s_out = self._forward(self.student, batch)
            s_feat = dict(feats)
        if t_out is not None:
            out["gap"] = nmse(s_out, t_out)
            out["gap_features"] = torch.stack([nmse(s_feat[i], t_feat[i]) for i in sorted(t_feat)]).mean()
        if self.needs_teacher:
            if self.features:
                out["distill"] = out["gap_features"] + cfg.objective.output_weight * out["gap"]
            else:
                out["distill"] = out["gap"]
        if cfg.objective.type in ("flow", "mix") or (not grad and self.corpus is not None):
            target = batch["noise"] - batch["x0"]
            out["flow"] = (s_out.float() - target.float()).pow(2).mean()
        if cfg.objective.type == "distill":
            out["loss"] = out["distill"]
        elif cfg.objective.type == "flow":
            out["loss"] = out["flow"]
        else:
            out["loss"] = out["distill"] + cfg.objective.flow_weight * out["flow"]
        return out

    def micro_batch(self, step: int, micro: int) -> dict[str, torch.Tensor]:
        cfg, acc = self.cfg, self.accelerator
        b = cfg.data.batch_size
        g = _generator(cfg.seed, step, micro, acc.process_index)
        indices = None
        if self.dataset is not None:
            pos = (step * cfg.train.gradient_accumulation_steps + micro) * b * acc.num_processes + acc.process_index * b
            indices = sample_indices(len(self.dataset), cfg.seed, pos, b)
        if self.corpus is not None:
            pos = (step * cfg.train.gradient_accumulation_steps + micro) * b
            data = self.corpus.batch(step, micro, b, g, pos)
            return self._noise(data, g)
        batch = self._to_device(self.batcher.make(g, b, indices))
        if self.needs_teacher and cfg.objective.type == "distill" and cfg.objective.latents == "teacher":
            with acc.autocast():
                batch["x0"] = teacher_samples(self.teacher, torch.randn(batch["x0"].shape, generator=g).to(acc.device),
                                              batch["embeds"], cfg.objective.teacher_steps, cfg.timesteps.shift)
        return batch

    def _noise(self, data: dict[str, torch.Tensor], g: torch.Generator) -> dict[str, torch.Tensor]:
        """Add the noise and sigma draws (from ``g``, on the CPU) to a corpus micro-batch."""
        t = self.cfg.timesteps
        x0 = data["x0"]
        n = x0.shape[0]
        noise = torch.randn(x0.shape, generator=g).to(x0.device)
        sigma = sample_sigmas(n, g, t.sampling, t.shift, t.min_sigma, t.max_sigma).to(x0.device)
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
        gaps, feats, flows = [], [], []
        for batch in self.held_out():
            o = self.losses(batch, grad=False)
            gaps.append(o["gap"].item() * len(batch["sigma"]))
            feats.append(o["gap_features"].item() * len(batch["sigma"]))
            if "flow" in o:
                flows.append(o["flow"].item() * len(batch["sigma"]))
        n = self.cfg.data.held_out
        out = {"output": sum(gaps) / n, "features": sum(feats) / n}
        if flows:
            out["flow"] = sum(flows) / n
        return out

    # -- checkpoints ----------------------------------------------------------------------------------------
    def checkpoint_dir(self, step: int) -> Path:
        return Path(self.cfg.output_dir) / "checkpoints" / f"step-{step:07d}"

    def save(self, target: Path, *, with_state: bool = True) -> None:
        """Write ``target`` atomically: everything goes to ``target.tmp``, then one rename."""
        acc = self.accelerator
        tmp = target.with_name(target.name + ".tmp")
        if acc.is_main_process and tmp.exists():
            shutil.rmtree(tmp)
        acc.wait_for_everyone()
        tmp.mkdir(parents=True, exist_ok=True)
        if with_state:
            acc.save_state(str(tmp / "state"))
        state_dict = acc.get_state_dict(self.student)  # FSDP: gathered to the main process
        if acc.is_main_process:
            from safetensors.torch import save_file

            dt = DTYPES[self.cfg.checkpoint.save_dtype]
            if self.ema is not None:  # export the EMA weights; keep the exact fp32 EMA for a resume
                save_file({k: v.cpu().contiguous() for k, v in self.ema.items()}, str(tmp / "ema.safetensors"))
                state_dict = {**state_dict, **self.ema}
            sd = {k: v.detach().to("cpu", dt if v.is_floating_point() else v.dtype).contiguous()
                  for k, v in state_dict.items()}
            save_file(sd, str(tmp / "transformer.safetensors"),
                      metadata={"format": "pt", "attnqat": "qat", "weights": "ema" if self.ema is not None else "raw"})
            save_config(self.cfg, tmp / "config.yaml")
            import json
            (tmp / "trainer_state.json").write_text(json.dumps(self.state.state_dict()))
            if target.exists():
                old = target.with_name(target.name + ".old")
                os.replace(target, old)
                os.replace(tmp, target)
                shutil.rmtree(old)
            else:
                os.replace(tmp, target)
        acc.wait_for_everyone()

    def prune(self) -> None:
        if not self.accelerator.is_main_process:
            return
        ckpts = sorted(p for p in (Path(self.cfg.output_dir) / "checkpoints").glob("step-*") if not p.name.endswith((".tmp", ".old")))
        for p in ckpts[:-self.cfg.checkpoint.keep]:
            shutil.rmtree(p, ignore_errors=True)

    def load(self, path: Path) -> None:
        if not (path / "state").is_dir():
            raise FileNotFoundError(f"--resume {str(path)!r} is not a training checkpoint (no state/ folder)")
        self.accelerator.load_state(str(path / "state"))
        if self.ema is not None:
            from safetensors.torch import load_file

            f = path / "ema.safetensors"
            if not f.is_file():
                raise FileNotFoundError(f"--resume {str(path)!r} has no ema.safetensors, but train.ema_decay is set")
            saved = load_file(str(f), device=str(self.accelerator.device))
            if set(saved) != set(self.ema):
                raise ValueError(f"--resume {str(path)!r}: its EMA weights do not match this model's trainable weights")
            for k, v in saved.items():
                self.ema[k].copy_(v)


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    ckpts = sorted(p for p in (Path(output_dir) / "checkpoints").glob("step-*")
                   if p.is_dir() and not p.name.endswith((".tmp", ".old")) and (p / "state").is_dir())
    return ckpts[-1] if ckpts else None


class _Logger:
    def __init__(self, cfg: TrainConfig, acc, start_step: int):
        self.rows: list[dict] = []
        self.main = acc.is_main_process
        self.csv_path = Path(cfg.output_dir) / "log.csv"
        self.tb = None
        if not self.main:
            return
        Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
        if cfg.log.csv:
            kept = []
            if self.csv_path.exists() and start_step > 0:  # resume: keep rows up to the checkpoint
                with self.csv_path.open() as f:
                    kept = [r for r in csv.DictReader(f) if r.get("step") and int(r["step"]) <= start_step]
            with self.csv_path.open("w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
                w.writeheader()
                w.writerows(kept)
        if cfg.log.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ValueError("log.tensorboard is true but TensorBoard is not installed: pip install tensorboard "
                                 "(or set log.tensorboard: false; the CSV log is always written)") from e
            self.tb = SummaryWriter(str(Path(cfg.output_dir) / "tensorboard"))
        self.cfg = cfg

    def log(self, row: dict):
        self.rows.append(row)
        if not self.main:
            return
        if self.cfg.log.csv:
            with self.csv_path.open("a", newline="") as f:
                csv.DictWriter(f, fieldnames=CSV_FIELDS).writerow({k: row.get(k, "") for k in CSV_FIELDS})
        if self.tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, row["step"])

    def close(self):
        if self.tb is not None:
            self.tb.close()


def train(cfg: TrainConfig, *, resume: str | None = None, stop_after: int | None = None,
          time_limit: float | None = None, accelerator=None) -> TrainResult:
    """Run (or continue) training as ``cfg`` says.

    Arguments:
        resume: a checkpoint folder (``OUTPUT/checkpoints/step-N``), or ``"auto"`` for the latest one in
            ``cfg.output_dir`` (starts fresh if there is none).
        stop_after: stop after this optimizer step, as if interrupted (no final checkpoint unless it is
            a checkpoint step). For tests and time-limited jobs.
        time_limit: seconds; once a step ends past them, save a checkpoint and stop (resume later with
            ``resume="auto"``). For jobs that must fit a time slot.
    Return:
        a :class:`TrainResult` with this call's losses and the held-out gap before and after.
    """
    from tqdm.auto import tqdm

    trainer = Trainer(cfg, accelerator)
    acc, tr = trainer.accelerator, cfg.train
    if resume:
        path = latest_checkpoint(cfg.output_dir) if resume == "auto" else Path(resume).expanduser()
        if path is None:
            acc.print(f"attnqat train: no checkpoint in {cfg.output_dir}/checkpoints; starting from step 0")
        else:
            if not path.exists():
                raise FileNotFoundError(f"--resume {str(path)!r} does not exist")
            trainer.load(path)
            acc.print(f"attnqat train: resumed from {path} at step {trainer.state.step}")
    start = trainer.state.step
    acc.print(f"attnqat train: {cfg.model}, {acc.num_processes} process(es) on {acc.device.type} "
              f"({acc.distributed_type.value}), objective {cfg.objective.type}"
              f"{'/' + cfg.objective.target if trainer.needs_teacher else ''}, student {cfg.attention.mode}, "
              f"{trainer.tokens_at(start)} tokens/sample, steps {start}..{tr.max_steps}")
    logger = _Logger(cfg, acc, start)
    gap_before = trainer.evaluate()
    if gap_before and acc.is_main_process:
        acc.print(f"held-out student-teacher gap at step {start}: output {gap_before['output']:.6f}, "
                  f"features {gap_before['features']:.6f}"
                  + (f"; held-out flow loss {gap_before['flow']:.6f}" if "flow" in gap_before else ""))
    accum = tr.gradient_accumulation_steps
    losses: list[float] = []
    final = None
    gap_after = None
    end = tr.max_steps if stop_after is None else min(tr.max_steps, stop_after)
    bar = tqdm(total=tr.max_steps, initial=start, disable=not (acc.is_main_process and cfg.log.progress),
               desc="attnqat train", dynamic_ncols=True)
    max_norm = tr.grad_clip if tr.grad_clip > 0 else float("inf")
    t_start = time.perf_counter()
    for step in range(start, end):
        t0 = time.perf_counter()
        trainer.student.train()
        sums: dict[str, float] = {}
        for micro in range(accum):
            batch = trainer.micro_batch(step, micro)
            ctx = acc.no_sync(trainer.student) if micro < accum - 1 else _null()
            with ctx:
                out = trainer.losses(batch)
                acc.backward(out["loss"] / accum)
            for k in ("loss", "distill", "flow", "gap"):
                if k in out:
                    sums[k] = sums.get(k, 0.0) + out[k].detach().float() / accum
        grad_norm = acc.clip_grad_norm_([p for p in trainer.student.parameters() if p.requires_grad], max_norm)
        lr = trainer.scheduler.get_last_lr()[0]
        trainer.optimizer.step()
        trainer.scheduler.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        trainer.update_ema(step)
        trainer.state.step = step + 1
        trainer.state.position = (step + 1) * accum * cfg.data.batch_size * acc.num_processes
        reduced = {k: acc.reduce(v.reshape(1).to(acc.device), "mean").item() for k, v in sums.items()}
        if acc.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        losses.append(reduced["loss"])
        row = {"step": step + 1, "loss": reduced["loss"], "loss_distill": reduced.get("distill", ""),
               "loss_flow": reduced.get("flow", ""), "gap": reduced.get("gap", ""),
               "grad_norm": float(grad_norm) if grad_norm is not None else "", "lr": lr,
               "tokens_per_s": trainer.tokens_at(step) * cfg.data.batch_size * accum * acc.num_processes / dt, "step_s": dt}
        if cfg.log.eval_every and (step + 1) % cfg.log.eval_every == 0 and step + 1 < tr.max_steps:
            ev = trainer.evaluate()
            if ev:
                row["eval_gap_output"], row["eval_gap_features"] = ev["output"], ev["features"]
                row["eval_flow"] = ev.get("flow", "")
        last = step + 1 == tr.max_steps
        if last:
            gap_after = trainer.evaluate()
        if last and gap_after:
            row["eval_gap_output"], row["eval_gap_features"] = gap_after["output"], gap_after["features"]
            row["eval_flow"] = gap_after.get("flow", "")
        if (step + 1) % cfg.log.every == 0 or last or "eval_gap_output" in row:
            logger.log(row)
        bar.update(1)
        bar.set_postfix(loss=f"{row['loss']:.4g}", lr=f"{lr:.2e}", gn=f"{row['grad_norm']:.3g}",
                        tok_s=f"{row['tokens_per_s']:.3g}")
        out_of_time = time_limit is not None and time.perf_counter() - t_start > time_limit
        if (step + 1) % cfg.checkpoint.every == 0 or last or out_of_time:
            trainer.save(trainer.checkpoint_dir(step + 1))
            trainer.prune()
        if last:
            final = Path(cfg.output_dir) / "final"
            trainer.save(final, with_state=False)
        if out_of_time and not last:
            acc.print(f"attnqat train: time limit of {time_limit:.0f} s reached after step {step + 1}; "
                      f"checkpoint saved (continue with --resume auto)")
            break
    bar.close()
    logger.close()
    if gap_after is None and trainer.state.step > start:
        gap_after = trainer.evaluate()
    if gap_after and gap_before and acc.is_main_process:
        acc.print(f"held-out student-teacher gap at step {trainer.state.step}: output {gap_after['output']:.6f} "
                  f"(from {gap_before['output']:.6f}), features {gap_after['features']:.6f} "
                  f"(from {gap_before['features']:.6f})"
                  + (f"; held-out flow loss {gap_after['flow']:.6f} (from {gap_before['flow']:.6f})"
                     if "flow" in gap_after and "flow" in gap_before else ""))
    if final is not None:
        acc.print(f"final checkpoint: {final}  (attnqat generate --qat-checkpoint {final} --model {cfg.model} "
                  f"--mode {cfg.attention.mode})")
    trainer.s_cap.remove()
    trainer.t_cap.remove()
    acc.end_training()
    return TrainResult(steps=trainer.state.step, losses=losses, gap_before=gap_before, gap_after=gap_after,
                       output_dir=cfg.output_dir, final_checkpoint=str(final) if final else None, log_rows=logger.rows)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False
