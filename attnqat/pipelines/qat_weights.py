"""QAT weights that ship beside a model: only the tensors a QAT fine-tune changed, applied over the base.

The whole mini transformer is ~18 MB in bf16, more than the package ships in one file (12 MB); an
attention-only fine-tune (``train.trainable: attention``) changes only the self-attention tensors (~4 MB).
So a *QAT weights* file holds a SUBSET of a transformer's state dict, and names the base weights it applies
to. The shipped one is ``attnqat/models/mini/attn_qat.safetensors``
(:data:`attnqat.pipelines.mini.MINI_QAT_WEIGHTS`).

Format: a safetensors file (nothing in it is ever unpickled); tensors in bf16 under their state-dict
names; the header's metadata (strings) says what it is:

==========  ===========================================================================================
``format``  ``attnqat-qat-weights``: the only way a file is recognised as QAT weights (a file without it
            is a full state dict, loaded with the strict rules of
            :func:`~attnqat.pipelines.loading.read_qat_checkpoint`)
``tensors`` ``subset``
``base``    :func:`weights_fingerprint` of the base transformer's weights; loading refuses other weights
``dtype``   ``bfloat16``
``trained`` one line on how the weights were trained
==========  ===========================================================================================

``attnqat export-qat`` (:func:`export_qat_weights`) writes one from a fine-tune and its base model;
:func:`~attnqat.pipelines.loading.load_qat_checkpoint` loads it like any QAT checkpoint.
"""
from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from attnqat.errors import one_line

from .loading import CheckpointMismatchError
from .mini import MAX_QAT_WEIGHTS_BYTES

__all__ = ["FORMAT", "MAX_BYTES", "QatWeights", "weights_fingerprint", "is_qat_weights", "read_qat_weights",
           "changed_tensors", "export_qat_weights"]

FORMAT = "attnqat-qat-weights"
#: The size limit of a QAT weights file: what the package ships beside a model (MB = 10^6 bytes).
MAX_BYTES = MAX_QAT_WEIGHTS_BYTES
DTYPE = torch.bfloat16  # the dtype the models ship in, and the one "changed" is judged in
# Values under fp16's smallest normal number count as 0 in the fingerprint: every bf16 value from 2^-14 up is
# exact in fp16 (and fp32), smaller ones may round to fp16's subnormals. So the base's fingerprint is the same
# whether the model runs in fp32, bf16 or fp16 (--dtype fp16), and any other model's differs all the same.
TINY = 2.0 ** -14


@dataclass
class QatWeights:
    """A read QAT weights file: its tensors (CPU, bf16) and metadata."""

    path: Path
    tensors: dict[str, torch.Tensor]
    base: str
    trained: str


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
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return f.metadata() or {}
    except Exception as e:  # safetensors raises its own error types for corrupt/non-safetensors files
        raise CheckpointMismatchError(f"{str(path)!r} is not a readable safetensors file: {e}") from e


def is_qat_weights(path: str | os.PathLike) -> bool:
    """Whether the safetensors file ``path`` is a QAT weights file (its metadata's ``format``; the header only
    is read)."""
    return _metadata(path).get("format") == FORMAT


def read_qat_weights(path: str | os.PathLike) -> QatWeights:
    """The tensors and metadata of the QAT weights file ``path``; :class:`CheckpointMismatchError` when its
    metadata is not this format's (module docstring)."""
    from safetensors.torch import load_file

    meta = _metadata(path)
    want = {"format": FORMAT, "tensors": "subset"}
    wrong = {k: meta.get(k) for k, v in want.items() if meta.get(k) != v}
    if wrong or not meta.get("base"):
        raise CheckpointMismatchError(f"{str(path)!r} is not a QAT weights file of this attnqat version: its "
                                      f"metadata has {wrong or {'base': None}}, expected {want} and a base")
    return QatWeights(Path(path), load_file(str(path)), meta["base"], meta.get("trained", ""))


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


def _serialize(tensors: dict[str, torch.Tensor], base: str, trained: str) -> bytes:
    from safetensors.torch import save

    return save(tensors, metadata={"format": FORMAT, "tensors": "subset", "base": base, "dtype": "bfloat16",
                                   "trained": trained})


def export_qat_weights(finetune: str | os.PathLike, model: str, out: str | os.PathLike, *,
                       trained: str | None = None) -> QatWeights:
    """Write the QAT weights file ``out``: the tensors of the fine-tune ``finetune`` (a safetensors file, a
    folder of shards, an ``attnqat train`` run or checkpoint folder) that differ from the transformer of
    ``model`` (the base it was fine-tuned from: ``mini``, ``tiny`` or a diffusers folder), in bf16.

    Refused (ValueError, nothing written): a fine-tune whose keys or shapes differ from the base's
    (:class:`CheckpointMismatchError`), one equal to the base, a file over :data:`MAX_BYTES`. The file is
    written under a temporary name and renamed into place once it reads back.
    Return: the written file, as :func:`read_qat_weights` reads it.
    """
    from attnqat.outputs import write_file_atomically

    from .loading import checkpoint_weights_path, load_transformer, read_qat_checkpoint

    base = load_transformer(model, dtype=DTYPE)
    base_state = base.state_dict()
    changed = changed_tensors(read_qat_checkpoint(base, finetune), base_state)
    source = checkpoint_weights_path(finetune)
    if not changed:
        raise ValueError(f"the fine-tune {source!r} equals the base model {model!r} in bf16: no tensor changed, "
                         f"nothing to write (was it fine-tuned from another model?)")
    if trained is None:  # the paths as given (a run folder's name says more than its final/transformer.safetensors)
        trained = one_line(f"attnqat QAT fine-tune {finetune} of {model}")
    data = _serialize(changed, weights_fingerprint(base_state), trained)
    if len(data) > MAX_BYTES:
        raise ValueError(f"QAT weights of {source!r} would be {len(data) / 1e6:.1f} MB "
                         f"({_describe(changed, base_state)}), over the {MAX_BYTES / 1e6:g} MB limit of a shipped "
                         f"file; fine-tune the attention only (--set train.trainable=attention), or load the "
                         f"fine-tune itself with --qat-checkpoint")

    def verify(tmp: Path) -> None:
        back = read_qat_weights(tmp)
        if set(back.tensors) != set(changed):
            raise OSError(f"{tmp} does not read back: {len(back.tensors)} tensors instead of {len(changed)}")

    write_file_atomically(out, lambda tmp: tmp.write_bytes(data), verify)
    return read_qat_weights(out)


def _describe(changed: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor]) -> str:
    """``"N of M tensors changed, e.g. a, b, c"``, for messages."""
    names = sorted(changed)
    return f"{len(names)} of {len(base)} tensors changed, e.g. {', '.join(names[:3])}"
