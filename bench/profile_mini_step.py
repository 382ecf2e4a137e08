"""Where a step of the mini model's training goes: the corpus pool refresh (render, VAE encode, caption
embedding), the transformer's forward + backward, and the optimizer + EMA, each timed with the device
synchronised around it, at each training size of configs/mini.yaml.

    python bench/profile_mini_step.py --out runs/mini [--steps 30] [--set KEY=VALUE ...] [--json FILE]
    python bench/profile_mini_step.py --config configs/mini_qat.yaml --model attnqat/models/mini [--set ...]

OUT is a `python -m attnqat.train.mini` working folder (its model/ is used; nothing is written there:
the run goes to a temporary folder). With --config, that training config (e.g. the QAT fine-tune's) on
--model instead. The numbers are per step, medians over --steps steps after a warm-up.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch


def _timed(fn, sync):
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="a mini build folder (holds model/)")
    p.add_argument("--config", help="a training config to profile instead of configs/mini.yaml (needs --model)")
    p.add_argument("--model", help="with --config: the model folder it trains")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override configs/mini.yaml")
    p.add_argument("--json", help="also write the numbers here")
    args = p.parse_args(argv)
    if (args.config is None) == (args.out is None) or (args.config is not None) != (args.model is not None):
        p.error("give --out, or --config with --model")
    from attnqat.train.config import load_config
    from attnqat.train.loop import Trainer
    from attnqat.train.mini import transformer_config

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    with tempfile.TemporaryDirectory() as tmp:
        run = [f"output_dir={tmp}/run", "data.held_out=0", *args.set]
        cfg = (load_config(args.config, [f"model={args.model}", *run]) if args.config
               else transformer_config(Path(args.out), run))
        trainer = Trainer(cfg)
        acc, src = trainer.accelerator, trainer.corpus
        params = [p for p in trainer.student.parameters() if p.requires_grad]
        rows: dict[str, dict[str, list[float]]] = {}
        for step in range(args.warmup + args.steps):
            size = src.size_of_step(step)
            key = "x".join(str(v) for v in cfg.data.corpus.sizes[size])
            batch, t_batch = _timed(lambda: trainer.micro_batch(step, 0), sync)

            def fwd_bwd():
                out = trainer.losses(batch)
                acc.backward(out["loss"])
                return out["loss"].item()

            _, t_fb = _timed(fwd_bwd, sync)

            def update():
                acc.clip_grad_norm_(params, 1.0)
                trainer.optimizer.step()
                trainer.scheduler.step()
                trainer.optimizer.zero_grad(set_to_none=True)
                trainer.update_ema(step)

            _, t_up = _timed(update, sync)
            if step < args.warmup:
                continue
            r = rows.setdefault(key, {"batch": [], "forward_backward": [], "optimizer_ema": []})
            r["batch"].append(t_batch)
            r["forward_backward"].append(t_fb)
            r["optimizer_ema"].append(t_up)
        # the refresh's parts, on as many clips as one refresh encodes
        corpus = src.corpora["train"]
        parts = {}
        for size, (f, h, w) in enumerate(cfg.data.corpus.sizes):
            key = f"{f}x{h}x{w}"
            specs = [corpus.spec(j) for j in range(cfg.data.corpus.refresh)]
            caps = [corpus.caption_of(j) for j in range(cfg.data.corpus.refresh)]
            times = {"render": [], "vae_encode": [], "embed": []}
            for _ in range(5):
                video, t = _timed(lambda: corpus.render(specs, frames=f, height=h, width=w, device=src.device), sync)
                times["render"].append(t)
                times["vae_encode"].append(_timed(lambda: src.encode_video(video), sync)[1])
                times["embed"].append(_timed(lambda: src.embed(caps), sync)[1])
            parts[key] = {k: statistics.median(v[1:]) for k, v in times.items()}
    result = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "batch_size": cfg.data.batch_size, "refresh": cfg.data.corpus.refresh,
              "per_step_s": {k: {n: statistics.median(v) for n, v in r.items()} for k, r in rows.items()},
              "refresh_parts_s": parts, "config": args.config or "configs/mini.yaml", "overrides": args.set}
    for key, r in result["per_step_s"].items():
        total = sum(r.values())
        print(f"{key}: step {total * 1e3:.1f} ms = " + ", ".join(f"{n} {v * 1e3:.1f}" for n, v in r.items())
              + "; refresh parts " + ", ".join(f"{n} {v * 1e3:.1f}" for n, v in parts[key].items()))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
