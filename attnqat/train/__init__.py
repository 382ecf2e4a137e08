"""Attn-QAT fine-tuning of Wan 2.1 transformers (``attnqat train``, ``attnqat precompute``).

    from attnqat.train import load_config, train
    result = train(load_config("configs/tiny.yaml", overrides=["train.max_steps=20"]))

The student runs a trainable FP4 attention mode (``attn_qat``); a frozen copy of the same initial
weights with bf16 attention is the teacher. Objectives (:mod:`.objectives`, a registry of small classes):
``distill`` (data-free or on precomputed prompts; target ``output`` or ``features``), ``flow`` (flow matching
on precomputed video latents), ``mix``. Runs on accelerate (CPU, one GPU, DDP, FSDP), optionally with Ulysses
sequence parallelism (``train.sequence_parallel``). See docs/training.md.
"""
from .config import (DISTILL_TARGETS, CheckedConfig, TrainConfig, config_from_dict, load_config, model_config,
                     save_config, validate)
from .checkpoint import CheckpointError, NonFiniteTrainingError
from .loop import TrainResult, Trainer, latest_checkpoint, train
from .objectives import OBJECTIVES, Objective, register_objective

__all__ = ["TrainConfig", "CheckedConfig", "load_config", "config_from_dict", "save_config", "validate", "model_config",
           "train", "Trainer", "TrainResult", "latest_checkpoint", "OBJECTIVES", "Objective", "register_objective",
           "DISTILL_TARGETS", "CheckpointError", "NonFiniteTrainingError"]
