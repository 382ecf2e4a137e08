"""LoRA adapters on a Wan transformer, through peft and diffusers' adapter API: added for training
(``train.trainable: lora``), saved as a LoRA file in diffusers' Wan format, and fused into a transformer's
weights by every command that takes ``--qat-checkpoint``.

    names = add_lora(transformer, rank=64, alpha=64, target_modules=DEFAULT_TARGETS)   # adapters on, base frozen
    save_lora(folder, transformer)                       # folder/pytorch_lora_weights.safetensors
    pipe.load_lora_weights(folder)                       # diffusers reads it as any Wan LoRA
    fuse_lora_file(pipe.transformer, folder / LORA_FILE) # what attnqat's commands do: checked, fused, unloaded

The file is what ``WanPipeline.save_lora_weights`` writes (keys ``transformer.<module>.lora_A.weight`` /
``lora_B.weight``, the adapter's peft config in the header, so its alpha comes back); it is read through
``WanPipeline.lora_state_dict``, which also converts the other Wan LoRA layouts diffusers knows (the original
``diffusion_model.*`` one, musubi's). Nothing is unpickled: safetensors only.

peft is an optional dependency as far as the rest of the package goes: it is imported where a LoRA is made or
read, and :func:`require_peft` says what to install.
"""
from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open

from attnqat.errors import CheckpointMismatchError

__all__ = ["LORA_FILE", "DEFAULT_TARGETS", "ADAPTER", "require_peft", "target_layers", "add_lora",
           "lora_state_dict", "save_lora", "is_lora_file", "read_lora", "fuse_lora_file", "fused"]

#: diffusers' default LoRA file name (``LORA_WEIGHT_NAME_SAFE``): ``pipe.load_lora_weights(folder)`` finds it.
LORA_FILE = "pytorch_lora_weights.safetensors"
#: Wan's attention projections (self- and cross-attention) and FFN linears; the probe that sized LoRA-QAT for Wan
#: 14B (rank 64: 307M trainable weights, one H200 at 57 GiB) adapted exactly these.
DEFAULT_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2")
#: The adapter's name while it is in a transformer (peft's default; not stored in the file).
ADAPTER = "default"
# A LoRA key's module: what precedes its lora_A / lora_B / lora_down / lora_up / lora_magnitude part.
_LORA_KEY = re.compile(r"(.+?)\.(lora_(?:A|B|down|up|magnitude_vector))(?:\.|$)")
_PREFIX = "transformer."  # diffusers' Wan pipelines file the transformer's adapters under it


def require_peft(what: str) -> None:
    """ImportError naming peft when it cannot be imported (``what`` needs it); the one check of the dependency."""
    try:
        import peft  # noqa: F401
    except ImportError:
        raise ImportError(f"{what} needs peft, which is not installed: pip install peft") from None


def target_layers(transformer: torch.nn.Module, target_modules: Sequence[str]) -> dict[str, list[str]]:
    """For each name of ``target_modules``, the names of the ``transformer``'s modules it selects, by peft's own rule
    (a module's name equals it or ends with ``.name``). ValueError for a name that selects nothing or selects a module
    that is not a linear layer (attnqat adapts linear layers; Wan's attention and FFN are linear)."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    modules = dict(transformer.named_modules())
    out = {}
    for target in target_modules:
        config = LoraConfig(target_modules=[target])
        names = [n for n in modules if n and check_target_module_exists(config, n)]
        if not names:
            raise ValueError(f"train.lora.target_modules {target!r} names no layer of the transformer; Wan's linear "
                             f"layers are named e.g. {', '.join(DEFAULT_TARGETS)}, proj_out")
        other = [n for n in names if not isinstance(modules[n], torch.nn.Linear)]
        if other:
            raise ValueError(f"train.lora.target_modules {target!r} selects {other[0]} "
                             f"({type(modules[other[0]]).__name__}), not a linear layer: name linear layers, e.g. "
                             f"{', '.join(DEFAULT_TARGETS)}")
        out[target] = names
    return out


def add_lora(transformer: torch.nn.Module, *, rank: int, alpha: float, target_modules: Sequence[str],
             dropout: float = 0.0) -> list[str]:
    """Freeze ``transformer`` and add a trainable LoRA adapter (peft, through diffusers' ``add_adapter``) to the
    layers ``target_modules`` selects: B starts at zero, so the adapted model starts as the base. The adapter's
    weights are fp32 whatever the base's dtype (diffusers' ``cast_training_params``): AdamW's updates of ~lr x
    the weight vanish in bf16. Returns the names of the trainable parameters."""
    require_peft("a LoRA (train.trainable: lora)")
    from diffusers.training_utils import cast_training_params
    from peft import LoraConfig

    transformer.requires_grad_(False)
    transformer.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout,
                                       target_modules=list(target_modules), init_lora_weights=True), ADAPTER)
    cast_training_params(transformer, dtype=torch.float32)
    return [n for n, p in transformer.named_parameters() if p.requires_grad]


def lora_state_dict(transformer: torch.nn.Module, state_dict: dict[str, torch.Tensor] | None = None
                    ) -> dict[str, torch.Tensor]:
    """The adapter's tensors under the file's module names (peft's ``get_peft_model_state_dict``: ``...lora_A.weight``
    without the adapter's name), taken from ``state_dict`` (the transformer's names, e.g. an EMA of the adapter's
    weights) or else from the transformer."""
    from peft.utils import get_peft_model_state_dict

    return get_peft_model_state_dict(transformer, state_dict=state_dict, adapter_name=ADAPTER)


def save_lora(folder: str | os.PathLike, transformer: torch.nn.Module, tensors: dict[str, torch.Tensor] | None = None,
              dtype: torch.dtype | None = None) -> Path:
    """Write ``folder/``:data:`LORA_FILE` with diffusers' ``WanPipeline.save_lora_weights``: the adapter's tensors
    (:func:`lora_state_dict` of ``tensors``, in ``dtype``, on the CPU) and its peft config, so that diffusers' loaders
    rebuild it with its rank and alpha. Returns the file."""
    from diffusers import WanPipeline

    layers = {k: v.detach().to("cpu", dtype or v.dtype).contiguous()
              for k, v in lora_state_dict(transformer, tensors).items()}
    WanPipeline.save_lora_weights(folder, transformer_lora_layers=layers, weight_name=LORA_FILE,
                                  transformer_lora_adapter_metadata=transformer.peft_config[ADAPTER].to_dict())
    return Path(folder) / LORA_FILE


def is_lora_file(path: str | os.PathLike) -> bool:
    """Whether the safetensors file ``path`` holds LoRA weights (its keys, read from the header only)."""
    try:
        with safe_open(str(path), framework="pt") as f:
            keys = list(f.keys())
    except Exception as e:  # safetensors raises its own error types for corrupt/non-safetensors files
        raise CheckpointMismatchError(f"{str(path)!r} is not a readable safetensors file: {e}") from e
    return any(_LORA_KEY.match(k) for k in keys)


def read_lora(transformer: torch.nn.Module, path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict | None]:
    """The LoRA file ``path`` as diffusers' Wan loader reads it (``WanPipeline.lora_state_dict``: diffusers' keys,
    other Wan layouts converted) with its adapter metadata, checked against ``transformer``, which is not changed:
    :class:`CheckpointMismatchError` for a LoRA of another model (a module it adapts that the transformer lacks,
    or whose width differs). diffusers itself would skip such keys with a warning."""
    require_peft(f"the LoRA {str(path)!r}")
    from diffusers import WanPipeline

    try:
        state, metadata = WanPipeline.lora_state_dict(str(path), use_safetensors=True, return_lora_metadata=True)
    except Exception as e:  # safetensors' and diffusers' own error types
        raise CheckpointMismatchError(f"{str(path)!r} is not a LoRA file diffusers reads: {e}".splitlines()[0]) from e
    modules = dict(transformer.named_modules())
    problems = [] if any(k.startswith(_PREFIX) for k in state) else ["no tensor for the transformer"]
    for key, value in state.items():
        name, part = _module_of(key)
        module = modules.get(name) if key.startswith(_PREFIX) else None
        if module is None:
            problems.append(f"{key}: no such layer")
        elif key.endswith(".weight") and part in ("lora_A", "lora_B") and not (
                isinstance(module, torch.nn.Linear)
                and (value.shape[-1] == module.in_features if part == "lora_A" else value.shape[0] == module.out_features)):
            problems.append(f"{key}: {tuple(value.shape)} does not fit {module}")
    if problems:
        blocks = getattr(getattr(transformer, "config", None), "num_layers", None)
        raise CheckpointMismatchError(
            f"LoRA {str(path)!r} does not match this transformer{f' ({blocks} blocks)' if blocks else ''}: "
            f"{problems[0]}{f' ({len(problems)} problems in all)' if len(problems) > 1 else ''}. Was it trained on "
            f"another model? Pass the --model it was trained from.")
    return state, metadata


def fuse_lora_file(transformer: torch.nn.Module, path: str | os.PathLike) -> list[str]:
    """Fuse the LoRA file ``path`` into ``transformer``'s weights: read and checked (:func:`read_lora`), loaded as an
    adapter (diffusers' ``load_lora_adapter``), fused (``fuse_lora``) and the adapter layers removed
    (``unload_lora``), so the transformer has its own modules again (attention processors, a snapshot of its
    state dict and ``load_state_dict`` work as before) and runs at the base's speed. Returns the names of the
    modules whose weights changed."""
    return _fuse(transformer, *read_lora(transformer, path))


@contextmanager
def fused(transformer: torch.nn.Module, path: str | os.PathLike) -> Iterator[torch.nn.Module]:
    """``with fused(transformer, path): ...``: the LoRA file fused in (:func:`fuse_lora_file`); after the block,
    even when it raises, the adapted modules' own tensors back, bit for bit."""
    state, metadata = read_lora(transformer, path)  # checked before anything is kept or changed
    kept = {f"{name}.{k}": v.detach().clone() for name in _adapted(state)
            for k, v in transformer.get_submodule(name).state_dict().items()}
    try:
        _fuse(transformer, state, metadata)
        yield transformer
    finally:
        transformer.load_state_dict(kept, strict=False)


def _fuse(transformer: torch.nn.Module, state: dict[str, torch.Tensor], metadata: dict | None) -> list[str]:
    if getattr(transformer, "peft_config", None):  # unload_lora below would remove those too
        raise ValueError("the transformer already holds LoRA adapters; fuse a LoRA file into one without")
    try:
        transformer.load_lora_adapter(state, prefix=_PREFIX[:-1], adapter_name=ADAPTER, metadata=metadata)
        transformer.fuse_lora(adapter_names=[ADAPTER])
    finally:  # also after a failed load, which leaves peft's wrappers around the layers it reached
        transformer.unload_lora()
    return _adapted(state)


def _module_of(key: str) -> tuple[str, str | None]:
    """(module name, LoRA part: lora_A, lora_B, ... or None) of a diffusers-keyed LoRA tensor (``transformer.`` off)."""
    name = key.removeprefix(_PREFIX)
    match = _LORA_KEY.match(name)
    return (match.group(1), match.group(2)) if match else (name.rpartition(".")[0], None)


def _adapted(state: dict[str, torch.Tensor]) -> list[str]:
    """The names of the transformer's modules a (diffusers-keyed) LoRA state dict adapts, in order."""
    return list(dict.fromkeys(_module_of(k)[0] for k in state))
