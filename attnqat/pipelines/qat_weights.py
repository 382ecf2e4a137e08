"""QAT weights that ship beside a model: only the tensors a QAT fine-tune changed, applied over the base.

The whole mini transformer is ~18 MB in bf16, more than the package ships in one file (12 MB); an
attention-only fine-tune (``train.trainable: attention``) changes only the self-attention tensors (~4 MB).
So a *QAT weights* file holds a SUBSET of a transformer's state dict, and names the base weights it applies
to. The shipped one is ``attnqat/models/mini/attn_qat.safetensors``
(:data:`attnqat.mini.model.MINI_QAT_WEIGHTS`).

A fine-tune of every weight does not fit in bf16 (18 MB); its *changes* do in FP8: a fine-tune moves each
weight by a few percent of its size, so the change stored in float8 e4m3 with one scale per row
(``fp8-delta``, ~9 MB for mini) carries an error of ~1% of the change, a tenth of what bf16 rounding of the
weights themselves costs. Loading adds the decoded change to the base weights (in fp32).

Format: a safetensors file (nothing in it is ever unpickled); tensors under their state-dict names; the
header's metadata (strings) says what it is:

==========  ===========================================================================================
``format``  ``attnqat-qat-weights``: the only way a file is recognised as QAT weights (a file without it
            is a full state dict, loaded with the strict rules of
            :func:`~attnqat.pipelines.loading.read_qat_checkpoint`)
``tensors`` ``subset``: the changed tensors' new values, in bf16; or ``fp8-delta``: their changes
            (new - base), in float8_e4m3fn for tensors of 2 or more dimensions, each with its per-row scale
            (float32, one per index of the first dimension) stored as ``scale:NAME``, and in bf16 for the
            others (biases, norms)
``base``    :func:`weights_fingerprint` of the base transformer's weights; loading refuses other weights
``dtype``   ``bfloat16`` (``subset``) or ``float8_e4m3fn`` (``fp8-delta``)
``trained`` one line on how the weights were trained
optional:   ``qk_rotation`` (``hadamard``), and ``k_smoothing``, ``q_smoothing``, ``four_over_six`` (``true``): the
            FP4 attention options the weights were trained under (:mod:`attnqat.trained_options`), which every
            command runs them with unless told otherwise; absent: trained without them
==========  ===========================================================================================

``attnqat export-qat`` (:func:`attnqat.pipelines.qat_export.export_qat_weights`) writes one from a fine-tune
and its base model;
:func:`~attnqat.pipelines.loading.load_qat_checkpoint` loads it like any QAT checkpoint.
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save

from attnqat.errors import CheckpointMismatchError

from attnqat.mini.model import MAX_QAT_WEIGHTS_BYTES
from attnqat.trained_options import DEFAULTS, SWITCHED

__all__ = ["FORMAT", "MAX_BYTES", "STORAGES", "QatWeights", "weights_fingerprint", "is_qat_weights",
           "read_qat_weights", "changed_tensors", "fp8_changes", "serialize"]

FORMAT = "attnqat-qat-weights"
#: How a file stores the changed tensors (its metadata's ``tensors``): their values in bf16, or their changes in FP8.
STORAGES = ("subset", "fp8-delta")
_STORAGE_DTYPE = {"subset": "bfloat16", "fp8-delta": "float8_e4m3fn"}
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
SCALE_PREFIX = "scale:"  # fp8-delta: the per-row scale of tensor NAME is stored as scale:NAME
#: The size limit of a QAT weights file: what the package ships beside a model (MB = 10^6 bytes).
MAX_BYTES = MAX_QAT_WEIGHTS_BYTES
DTYPE = torch.bfloat16  # the dtype the models ship in, and the one "changed" is judged in
# Values under fp16's smallest normal number count as 0 in the fingerprint: every bf16 value from 2^-14 up is
# exact in fp16 (and fp32), smaller ones may round to fp16's subnormals. So the base's fingerprint is the same
# whether the model runs in fp32, bf16 or fp16 (--dtype fp16), and any other model's differs all the same.
TINY = 2.0 ** -14


@dataclass
class QatWeights:
    """A read QAT weights file: its tensors as stored (CPU; ``subset``: the new values in bf16; ``fp8-delta``:
    the changes, FP8 or bf16, with ``scales``) under their state-dict names, and its metadata."""

    path: Path
    tensors: dict[str, torch.Tensor]
    base: str
    trained: str
    storage: str = "subset"
    scales: dict[str, torch.Tensor] | None = None
    #: the attention options the weights were trained under, every one of attnqat.trained_options.TRAINED_OPTIONS
    options: dict = field(default_factory=lambda: dict(DEFAULTS))

    def values(self, base: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The new values of the file's tensors, given the ``base`` state dict they apply over (only its keys
        that the file holds are read): ``subset``: the stored values; ``fp8-delta``: base + decoded change, fp32."""
        if self.storage == "subset":
            return dict(self.tensors)
        out = {}
        for name, change in self.tensors.items():
            delta = change.float()
            if name in self.scales:  # one scale per row (index of the first dimension)
                delta = delta * self.scales[name].view(-1, *([1] * (delta.ndim - 1)))
            out[name] = base[name].detach().to("cpu", torch.float32) + delta
        return out


def weights_fingerprint(state: Mapping[str, torch.Tensor]) -> str:
    """sha256 (hex) of a transformer's weights: every key in sorted order with its shape and its values in
    bf16 (those under :data:`TINY` as 0), so the same weights held in fp32, bf16 or fp16 give the same text."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach()
        h.update(f"{name} {tuple(t.shape)}\n".encode())
        if t.is_floating_point():
            t = t.to(DTYPE)
            t = torch.where(t.abs() < TINY, torch.zeros_like(t), t).reshape(-1).view(torch.int16)
        h.update(t.cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _metadata(path: str | os.PathLike) -> dict[str, str]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}
    except Exception as e:  # safetensors raises its own error types for corrupt/non-safetensors files
        raise CheckpointMismatchError(f"{str(path)!r} is not a readable safetensors file: {e}") from e


def is_qat_weights(path: str | os.PathLike) -> bool:
    """Whether the safetensors file ``path`` is a QAT weights file (its metadata's ``format``; the header only
    is read)."""
    return _metadata(path).get("format") == FORMAT


def recorded_attention_options(path: str | os.PathLike) -> dict:
    """The attention options (:data:`~attnqat.trained_options.TRAINED_OPTIONS`) a QAT weights file records (its
    header only is read): "none" and False where it records none."""
    return _attention_options(_metadata(path))


def _attention_options(meta: dict) -> dict:
    return {"qk_rotation": meta.get("qk_rotation", "none"), **{name: meta.get(name) == "true" for name in SWITCHED}}


def read_qat_weights(path: str | os.PathLike) -> QatWeights:
    """The tensors and metadata of the QAT weights file ``path``; :class:`CheckpointMismatchError` when its
    metadata is not this format's (module docstring)."""
    meta = _metadata(path)
    storage = meta.get("tensors")
    if meta.get("format") != FORMAT or storage not in STORAGES or not meta.get("base"):
        raise CheckpointMismatchError(f"{str(path)!r} is not a QAT weights file of this attnqat version: its "
                                      f"metadata has format {meta.get('format')!r}, tensors {storage!r}, base "
                                      f"{meta.get('base')!r}; expected {FORMAT!r}, one of {STORAGES} and a base")
    stored = load_file(str(path))
    scales = {k[len(SCALE_PREFIX):]: v for k, v in stored.items() if k.startswith(SCALE_PREFIX)}
    tensors = {k: v for k, v in stored.items() if not k.startswith(SCALE_PREFIX)}
    _check_stored(path, storage, tensors, scales)
    return QatWeights(Path(path), tensors, meta["base"], meta.get("trained", ""), storage,
                      scales if storage == "fp8-delta" else None, _attention_options(meta))


def _check_stored(path, storage: str, tensors: dict, scales: dict) -> None:
    """:class:`CheckpointMismatchError` unless the stored tensors are what ``storage`` says: bf16 values; or
    FP8 changes of 2+ dimensions each with a float32 scale per row, and bf16 changes of the others."""
    bad = []
    for name, t in tensors.items():
        if storage == "subset" or t.ndim < 2:
            if t.dtype != DTYPE:
                bad.append(f"{name} is {t.dtype}, not bfloat16")
        elif t.dtype != FP8:
            bad.append(f"{name} is {t.dtype}, not float8_e4m3fn")
        else:
            s = scales.get(name)
            if s is None or s.dtype != torch.float32 or tuple(s.shape) != (t.shape[0],):
                bad.append(f"{name}'s scale is {'missing' if s is None else f'{s.dtype} {tuple(s.shape)}'}, not "
                           f"float32 ({t.shape[0]},)")
    orphans = sorted(set(scales) - {k for k, t in tensors.items() if t.dtype == FP8})
    if (storage == "subset" and scales) or orphans:
        bad.append(f"scales without an FP8 tensor: {', '.join(SCALE_PREFIX + k for k in sorted(orphans or scales))}")
    if bad:
        raise CheckpointMismatchError(f"QAT weights {str(path)!r} ({storage}) are malformed: " + "; ".join(bad[:3])
                                      + (f" ({len(bad)} problems in all)" if len(bad) > 3 else ""))


def changed_tensors(tuned: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors of ``tuned`` whose bf16 values differ from ``base``'s in any bit, in bf16 on the CPU
    (a change below bf16's precision is no change: the shipped model runs on bf16 values)."""
    out = {}
    for name, value in tuned.items():
        new = value.detach().to("cpu", DTYPE).contiguous()
        old = base[name].detach().to("cpu", DTYPE)
        if not torch.equal(new.view(torch.int16), old.contiguous().view(torch.int16)):
            out[name] = new
    return out


def fp8_changes(tuned: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The ``fp8-delta`` tensors of the fine-tuned values ``tuned`` (some keys of ``base``): each change
    (tuned - base, in fp32) of 2+ dimensions as float8_e4m3fn with a float32 scale per row (the row's largest
    change maps to 448; stored as ``scale:NAME``), the others' changes in bf16."""
    out = {}
    for name, value in tuned.items():
        delta = value.detach().to("cpu", torch.float32) - base[name].detach().to("cpu", torch.float32)
        if delta.ndim < 2:
            out[name] = delta.to(DTYPE)
            continue
        rows = delta.reshape(delta.shape[0], -1)
        # an all-zero row keeps a positive scale (its changes stay 0, never 0/0)
        scale = (rows.abs().amax(dim=1) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
        scaled = (rows / scale[:, None]).clamp(-FP8_MAX, FP8_MAX)  # rounding of x/s may exceed 448 by an ulp
        out[name] = scaled.to(FP8).reshape(delta.shape).contiguous()
        out[SCALE_PREFIX + name] = scale.contiguous()
    return out


def serialize(tensors: dict[str, torch.Tensor], base: str, trained: str, storage: str = "subset",
              options: Mapping | None = None) -> bytes:
    """The file's bytes; ``options``: the attention options trained under (those left out: their defaults)."""
    meta = {"format": FORMAT, "tensors": storage, "base": base, "dtype": _STORAGE_DTYPE[storage], "trained": trained}
    options = {**DEFAULTS, **(options or {})}
    if options["qk_rotation"] != "none":  # files of weights trained without them read as before
        meta["qk_rotation"] = options["qk_rotation"]
    meta.update({name: "true" for name in SWITCHED if options[name]})
    return save(tensors, metadata=meta)
