"""Wan 2.1 (diffusers) with attnqat attention: processor patching, the offline ``tiny`` model,
model/checkpoint loading, and the ``attnqat generate`` command (:mod:`attnqat.pipelines.generate`).

    from attnqat.pipelines import PrecisionSchedule, load_pipeline, patch_attention
    pipe = load_pipeline("tiny")                       # or a local Wan2.1-T2V-*-Diffusers folder
    patch_attention(pipe.transformer, "attn_qat")      # self-attention (attn1) in FP4
    schedule = PrecisionSchedule(first=2, last=1)      # ... but bf16 on the first 2 and the last step
    patch_attention(pipe.transformer, "attn_qat", schedule=schedule)
    pipe(..., num_inference_steps=50, callback_on_step_end=schedule.callback(pipe.transformer, 50))

The names below load their submodule (torch, diffusers) on first use, so that importing
:mod:`attnqat.pipelines.generate` for ``attnqat generate --help`` stays fast.
"""
import importlib

_EXPORTS = {
    "loading": ("CheckpointMismatchError", "ModelNotFoundError", "is_tiny", "load_pipeline", "load_qat_checkpoint",
                "load_transformer"),
    "model_folder": ("ModelConfigError",),
    "processor": ("AttentionTimer", "AttnQATProcessor", "attention_modes", "patch_attention", "patched_attention",
                  "unpatch_attention"),
    "schedule": ("PrecisionSchedule", "PrecisionSwitch"),
    "tiny": ("TINY_NOTICE", "TINY_TRANSFORMER_CONFIG", "build_tiny_pipeline", "build_tiny_text_encoder",
             "build_tiny_tokenizer", "build_tiny_transformer", "build_tiny_vae"),
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = [
    "patch_attention", "unpatch_attention", "patched_attention", "attention_modes", "AttnQATProcessor",
    "AttentionTimer", "PrecisionSchedule", "PrecisionSwitch",
    "load_pipeline", "load_transformer", "load_qat_checkpoint", "is_tiny", "ModelNotFoundError", "ModelConfigError",
    "CheckpointMismatchError",
    "build_tiny_pipeline", "build_tiny_transformer", "build_tiny_text_encoder", "build_tiny_tokenizer",
    "build_tiny_vae", "TINY_NOTICE", "TINY_TRANSFORMER_CONFIG",
]


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'attnqat.pipelines' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
