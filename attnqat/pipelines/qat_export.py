"""Export a QAT fine-tune as QAT weights (:mod:`.qat_weights`): the tensors it changed, read against the base
model it was fine-tuned from, in the smallest storage that fits a shipped file (``attnqat export-qat``)."""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch

from attnqat.errors import one_line
from attnqat.kernels import QK_ROTATIONS
from attnqat.outputs import write_file_atomically
from attnqat.trained_options import DEFAULTS, SWITCHED, TRAINED_OPTIONS

from .loading import checkpoint_weights_path, load_transformer, read_qat_checkpoint, trained_attention_options
from .qat_weights import (MAX_BYTES, STORAGES, QatWeights, changed_tensors, fp8_changes, read_qat_weights, serialize,
                          weights_fingerprint)

__all__ = ["export_qat_weights"]


def export_qat_weights(finetune: str | os.PathLike, model: str, out: str | os.PathLike, *,
                       trained: str | None = None, storage: str = "auto",
                       options: Mapping | None = None) -> QatWeights:
    """Write the QAT weights file ``out``: the tensors of the fine-tune ``finetune`` (a safetensors file, a
    folder of shards, an ``attnqat train`` run or checkpoint folder, or a LoRA file: fused into the base by
    :func:`~.loading.read_qat_checkpoint`) that differ from the transformer of
    ``model`` (the base it was fine-tuned from: ``mini``, ``tiny`` or a diffusers folder) in bf16.
    ``storage``: ``subset`` (their values in bf16), ``fp8-delta`` (their changes in FP8, module docstring) or
    ``auto`` (``subset`` where it fits in :data:`MAX_BYTES`, else ``fp8-delta``). ``options``: the attention options
    the fine-tune was trained under (:data:`~attnqat.trained_options.TRAINED_OPTIONS`), recorded in the file; one
    left out or None: what the fine-tune's training config says (:func:`~.loading.trained_attention_options`), else
    its default ("none", False).

    Refused (ValueError, nothing written): a fine-tune whose keys or shapes differ from the base's
    (:class:`CheckpointMismatchError`), one equal to the base, a file over :data:`MAX_BYTES`. The file is
    written under a temporary name and renamed into place once it reads back.
    Return: the written file, as :func:`read_qat_weights` reads it.
    """
    unknown = set(options or {}) - set(TRAINED_OPTIONS)
    if unknown:
        raise ValueError(f"unknown attention options {sorted(unknown)}: the recorded ones are {TRAINED_OPTIONS}")
    trained_options = trained_attention_options(finetune) or {}
    options = {name: (options or {}).get(name) for name in TRAINED_OPTIONS}
    options = {name: trained_options.get(name, DEFAULTS[name]) if value is None else value
               for name, value in options.items()}
    if options["qk_rotation"] not in QK_ROTATIONS:
        raise ValueError(f"qk_rotation must be one of {QK_ROTATIONS}, got {options['qk_rotation']!r}")
    for name in SWITCHED:
        if type(options[name]) is not bool:
            raise ValueError(f"{name} must be True or False, got {options[name]!r}")
    if storage not in ("auto", *STORAGES):
        raise ValueError(f"storage must be 'auto' or one of {STORAGES}, got {storage!r}")
    # fp32: an fp8-delta is the change from the base as the model holds it (a bf16 folder's values, exactly)
    base = load_transformer(model, dtype=torch.float32)
    base_state = base.state_dict()
    tuned = read_qat_checkpoint(base, finetune)
    changed = changed_tensors(tuned, base_state)
    source = checkpoint_weights_path(finetune)
    if not changed:
        raise ValueError(f"the fine-tune {source!r} equals the base model {model!r} in bf16: no tensor changed, "
                         f"nothing to write (was it fine-tuned from another model?)")
    if trained is None:  # the paths as given (a run folder's name says more than its final/transformer.safetensors)
        trained = one_line(f"attnqat QAT fine-tune {finetune} of {model}")
    fingerprint = weights_fingerprint(base_state)
    for storage in STORAGES if storage == "auto" else (storage,):  # auto: the first that fits
        tensors = changed if storage == "subset" else fp8_changes({k: tuned[k] for k in changed}, base_state)
        data = serialize(tensors, fingerprint, trained, storage, options)
        if len(data) <= MAX_BYTES:
            break
    else:
        raise ValueError(f"QAT weights of {source!r} would be {len(data) / 1e6:.1f} MB as {storage} "
                         f"({_describe(changed, base_state)}), over the {MAX_BYTES / 1e6:g} MB limit of a shipped "
                         f"file; fine-tune fewer weights (e.g. --set train.trainable=attention), store them as "
                         f"fp8-delta, or load the fine-tune itself with --qat-checkpoint")

    def verify(tmp: Path) -> None:
        back = read_qat_weights(tmp)
        if (set(back.tensors), back.storage, back.options) != (set(changed), storage, options):
            raise OSError(f"{tmp} does not read back: {len(back.tensors)} tensors ({back.storage}, {back.options}) "
                          f"instead of {len(changed)} ({storage}, {options})")

    write_file_atomically(out, lambda tmp: tmp.write_bytes(data), verify)
    return read_qat_weights(out)


def _describe(changed: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor]) -> str:
    """``"N of M tensors changed, e.g. a, b, c"``, for messages."""
    names = sorted(changed)
    return f"{len(names)} of {len(base)} tensors changed, e.g. {', '.join(names[:3])}"
