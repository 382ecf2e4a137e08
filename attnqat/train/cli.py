"""Fine-tune a Wan 2.1 transformer for FP4 attention (Attn-QAT), on accelerate.

  attnqat train --config configs/tiny.yaml
  attnqat train --config configs/tiny.yaml --set train.lr=1e-4 --set train.max_steps=50
  attnqat train --config configs/tiny.yaml --resume auto         # continue from the latest intact checkpoint
  attnqat train --config configs/tiny.yaml --overwrite           # delete the run in output_dir, start over
  accelerate launch --config_file configs/fsdp_wan14b.yaml -m attnqat.train --config configs/wan2.1-14b.yaml
  accelerate launch --config_file configs/fsdp_wan14b.yaml -m attnqat.train --config configs/wan2.1-14b-sp.yaml

The student trains `attention.mode` (attn_qat) attention; a frozen copy with bf16 attention is the
teacher (with --set train.trainable=lora: a LoRA adapter trains over frozen weights, and the teacher is the same
module with the adapter off). Checkpoints go to OUTPUT_DIR/checkpoints/step-N/ (atomic, sha256 manifest, no
pickles), the last weights to OUTPUT_DIR/final/transformer.safetensors (a LoRA run: the LoRA file
pytorch_lora_weights.safetensors; load either with `attnqat generate --qat-checkpoint`), the log to
OUTPUT_DIR/log.csv. A folder that already holds a run needs --resume or --overwrite. Config keys:
docs/training.md.
"""
from __future__ import annotations

import argparse
import sys

from .config import load_config, objective_of, validate
from .loop import check_request, train

HELP = "QAT fine-tuning of a Wan 2.1 transformer for FP4 attention (distillation / flow matching)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="YAML config (see configs/ and docs/training.md)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set train.lr=1e-5 (repeatable; values parsed as YAML)")
    p.add_argument("--output-dir", help="override output_dir")
    p.add_argument("--max-steps", metavar="N", help="override train.max_steps")
    p.add_argument("--resume", metavar="auto|PATH", help="continue from a checkpoint folder, or 'auto' for the "
                   "newest intact one in output_dir")
    p.add_argument("--overwrite", action="store_true", help="output_dir holds an earlier run: delete it (its "
                   "checkpoints, final/, log.csv, run_config.yaml; nothing else) and start over")
    p.add_argument("--stop-after", metavar="STEP", help="stop after this step as if interrupted "
                   "(resume later with --resume auto)")
    p.add_argument("--check", action="store_true", help="validate the config and data, print the plan, exit")

    def error(message: str):  # argparse's own errors as one line too (its default adds the usage)
        print(f"attnqat train: error: {message}", file=sys.stderr)
        sys.exit(2)

    p.error = error


def _step_number(flag: str, text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f"{flag} must be a whole number, got {text[:80]!r}") from None


def main(args) -> int:
    if args.output_dir is not None and not args.output_dir.strip():
        raise ValueError("--output-dir is empty")
    max_steps = _step_number("--max-steps", args.max_steps)
    stop_after = _step_number("--stop-after", args.stop_after)
    cfg = load_config(args.config, args.overrides)
    if args.output_dir is not None:  # set as given (a --set value would be parsed as YAML)
        cfg.output_dir = args.output_dir
    if max_steps is not None:
        cfg.train.max_steps = max_steps

    # for the device and process count the run gets, before check_request looks at output_dir: a bad config is
    # reported first
    checked = validate(cfg)
    if args.check:
        check_request(cfg, args.resume, stop_after, args.overwrite, refuse_existing=False)
        print(f"config OK: model {cfg.model}, objective {objective_of(cfg.objective).label}, "
              f"mode {cfg.attention.mode}, latents {checked.index['latent_shape']}, {cfg.train.max_steps} steps "
              f"at lr {cfg.train.lr:g}")
        return 0
    train(checked, resume=args.resume, stop_after=stop_after, overwrite=args.overwrite)
    return 0
