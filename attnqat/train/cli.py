"""Fine-tune a Wan 2.1 transformer for FP4 attention (Attn-QAT), on accelerate.

  attnqat train --config configs/tiny.yaml
  attnqat train --config configs/tiny.yaml --set train.lr=1e-4 --set train.max_steps=50
  attnqat train --config configs/tiny.yaml --resume auto         # continue from the latest checkpoint
  accelerate launch --config_file configs/fsdp_wan14b.yaml -m attnqat.train --config configs/wan2.1-14b.yaml

The student trains `attention.mode` (attn_qat) attention; a frozen copy with bf16 attention is the
teacher. Checkpoints go to OUTPUT_DIR/checkpoints/step-N/ (atomic), the last weights to
OUTPUT_DIR/final/transformer.safetensors (load it with `attnqat generate --qat-checkpoint`), the log
to OUTPUT_DIR/log.csv. Config keys: docs/training.md.
"""
from __future__ import annotations

import argparse

HELP = "QAT fine-tuning of a Wan 2.1 transformer for FP4 attention (distillation / flow matching)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="YAML config (see configs/ and docs/training.md)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set train.lr=1e-5 (repeatable; values parsed as YAML)")
    p.add_argument("--output-dir", help="override output_dir")
    p.add_argument("--max-steps", type=int, help="override train.max_steps")
    p.add_argument("--resume", metavar="auto|PATH", help="continue from a checkpoint folder, or 'auto' for the "
                   "latest one in output_dir")
    p.add_argument("--stop-after", type=int, metavar="STEP", help="stop after this step as if interrupted "
                   "(resume later with --resume auto)")
    p.add_argument("--check", action="store_true", help="validate the config and data, print the plan, exit")


def main(args) -> int:
    from .config import load_config, validate

    overrides = list(args.overrides)
    if args.output_dir:
        overrides.append(f"output_dir={args.output_dir}")
    if args.max_steps is not None:
        overrides.append(f"train.max_steps={args.max_steps}")
    cfg = load_config(args.config, overrides)
    if args.check:
        index = validate(cfg)
        print(f"config OK: model {cfg.model}, objective {cfg.objective.type}"
              f"{'/' + cfg.objective.target if cfg.objective.type != 'flow' else ''}, mode {cfg.attention.mode}, "
              f"latents {index['latent_shape']}, {cfg.train.max_steps} steps at lr {cfg.train.lr:g}")
        return 0
    from .loop import train

    train(cfg, resume=args.resume, stop_after=args.stop_after)
    return 0
