"""Load Wan 2.1 text-to-video pipelines (the offline ``tiny`` one, a local folder, or a hub id) and
QAT checkpoints, with errors that say what to do instead of a traceback.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import warnings
from pathlib import Path

import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file

from attnqat.checks import check_path_text, check_text
from attnqat.errors import CheckpointMismatchError
from attnqat.kernels import mode_of

from attnqat.mini.model import is_mini, is_shipped_mini, mini_folder, shipped_qat_weights
from attnqat.trained_options import TRAINED_OPTIONS
from .lora import LORA_FILE, fuse_lora_file, fused, is_lora_file
from .model_folder import ModelConfigError, check_model_folder, check_regular_file
from .qat_weights import is_qat_weights, read_qat_weights, recorded_attention_options, weights_fingerprint
from .tiny import TINY_TRANSFORMER_CONFIG, build_tiny_pipeline, build_tiny_transformer

__all__ = ["ModelNotFoundError", "CheckpointMismatchError", "load_pipeline", "load_transformer",
           "load_qat_checkpoint", "read_qat_checkpoint", "checkpoint_weights_path", "is_tiny",
           "resolve_model", "model_inputs", "check_model", "model_num_blocks", "config_num_blocks",
           "model_transformer_config", "check_qat_checkpoint",
           "choose_qat_checkpoint", "NO_QAT_CHECKPOINT", "trained_attention_options", "trained_mode_options"]

# DIFFUSERS_LATE: diffusers (seconds to import) is imported where a model loads, so that the checks of a command's
# arguments (check_model, check_qat_checkpoint, model_inputs) answer before it.

# The folders of an `attnqat train` output, as attnqat.train.checkpoint writes them and load_qat_checkpoint reads
# them: OUTPUT/final/ and OUTPUT/checkpoints/step-NNNNNNN/ (7 digits, so names sort by step), each holding the
# exported weights and a manifest written last (a folder without it is an unfinished write). The exported weights
# are WEIGHTS_FILE, or for a LoRA run (train.trainable: lora) the LoRA file diffusers loads, LORA_FILE.
CHECKPOINTS_DIR, FINAL_DIR = "checkpoints", "final"
STEP_DIR = re.compile(r"step-(\d{7})")
WEIGHTS_FILE, MANIFEST = "transformer.safetensors", "manifest.json"
EXPORTED_FILES = (WEIGHTS_FILE, LORA_FILE)


def step_dir_name(step: int) -> str:
    """The folder name of the checkpoint of ``step``, which :data:`STEP_DIR` matches."""
    return f"step-{step:07d}"


#: The real model this project targets; also the example in error messages.
DEFAULT_REAL_MODEL = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
#: Text encoders with fewer parameters (mini's: 0.36M) run in fp32 (Wan 2.1's UMT5-XXL has 5.7B).
SMALL_TEXT_ENCODER = 10 ** 8


class ModelNotFoundError(FileNotFoundError):
    """A model folder is missing / incomplete, or a hub id is neither cached nor downloadable."""


def is_tiny(model: str) -> bool:
    return model.strip().lower() == "tiny"


def resolve_model(model: str) -> str:
    """``mini`` -> the shipped folder (a clear error when it is missing); any other name unchanged."""
    if is_mini(model):
        try:
            return str(mini_folder())
        except FileNotFoundError as e:
            raise ModelNotFoundError(str(e)) from None
    return model


def model_inputs(flag: str, model: str) -> list[tuple[str, str]]:
    """What a local model folder is loaded from, as ``(flag, path)`` pairs for
    :func:`~attnqat.checks.check_not_input`: its model_index.json and the component folders it names (transformer/,
    vae/, ...). Other files beside them (e.g. the QAT weights ``attnqat export-qat`` writes there) are not the
    model's. None for tiny and hub ids."""
    if is_tiny(model):
        return []
    folder = Path(resolve_model(model)).expanduser()
    index = folder / "model_index.json"
    try:
        names = [] if index.stat().st_size > 1 << 20 else [k for k in json.loads(index.read_text()) if k[:1] != "_"]
    except (OSError, ValueError, TypeError, UnicodeDecodeError):  # not a model folder: nothing it loads
        return []
    return [(flag, str(index))] + [(flag, str(folder / n)) for n in names if (folder / n).is_dir()]


def _download_hint(model: str) -> str:
    repo = model if _looks_like_hub_id(model) else DEFAULT_REAL_MODEL
    return (f"download it once with `huggingface-cli download {repo} --local-dir ./{repo.split('/')[-1]}` "
            f"(or `hf download ...`) and pass that folder: --model ./{repo.split('/')[-1]}; "
            f"or use --model tiny for the offline random-weight model")


def _looks_like_hub_id(model: str) -> bool:
    """``org/name`` with exactly one slash and no path markers (``./``, ``/``, ``~``, backslashes)."""
    return (model.count("/") == 1 and not model.startswith((".", "/", "~")) and "\\" not in model
            and all(model.split("/")))


def _resolve(model: str, subfolder: str | None = None) -> str:
    """The folder or hub id to pass to ``from_pretrained``; raises :class:`ModelNotFoundError` early."""
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelNotFoundError(f"--model {model!r} is a file; expected a diffusers-format Wan 2.1 folder "
                                     f"(with model_index.json, transformer/, vae/, ...)")
        # a component's config; a tokenizer's is tokenizer_config.json (Wan's hub folders and mini's have no other)
        wanted = (path / subfolder / ("tokenizer_config.json" if subfolder == "tokenizer" else "config.json")
                  if subfolder else path / "model_index.json")
        if not wanted.exists():
            raise ModelNotFoundError(f"{str(path)!r} is not a diffusers-format Wan 2.1 folder: "
                                     f"{wanted.relative_to(path)} is missing; {_download_hint(DEFAULT_REAL_MODEL)}")
        check_model_folder(path, (subfolder,) if subfolder else None)  # before any model is built from it
        return str(path)
    if _looks_like_hub_id(model):
        return model
    raise ModelNotFoundError(f"model folder {model!r} does not exist; {_download_hint(DEFAULT_REAL_MODEL)}")


def check_model(model: str, flag: str = "--model") -> None:
    """Refuse a ``model`` value that cannot load, without loading anything: blank text, a missing
    folder, a folder without model_index.json, a file, a folder :func:`check_model_folder` refuses (special
    files, pickled weights, configs beyond bounds or unlike their weights). A hub id is checked when it loads."""
    check_text(flag, model)
    model = resolve_model(model)
    if not is_tiny(model):
        check_path_text(flag, model)
        _resolve(model)


def model_transformer_config(model: str) -> dict | None:
    """The transformer's config (``num_layers``, ``num_attention_heads``, ``patch_size`` ...), read without
    loading weights (None for a hub id or an unreadable config: then it is known once the model loads)."""
    model = resolve_model(model)
    if is_tiny(model):
        return dict(TINY_TRANSFORMER_CONFIG)
    config = Path(model).expanduser() / "transformer" / "config.json"
    try:
        values = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    return values if isinstance(values, dict) else None


def model_num_blocks(model: str) -> int | None:
    """The transformer's number of blocks, read from its config without loading weights (None for a
    hub id or an unreadable config: then it is known once the model loads)."""
    return config_num_blocks(model_transformer_config(model))


def config_num_blocks(config: dict | None) -> int | None:
    """The number of blocks a transformer config (:func:`model_transformer_config`'s) names, None if it names
    none."""
    n = (config or {}).get("num_layers")
    return n if isinstance(n, int) else None


def _from_pretrained(cls, model: str, **kwargs):
    """``cls.from_pretrained`` with network/cache failures turned into :class:`ModelNotFoundError`."""
    target = _resolve(model, kwargs.get("subfolder"))
    try:
        with warnings.catch_warnings():
            # newer diffusers renamed torch_dtype to dtype and warn on the old name, which older ones (>= 0.33,
            # as pyproject allows) need: keep it, without the warning.
            warnings.filterwarnings("ignore", message=r"`torch_dtype` is deprecated", category=FutureWarning)
            return cls.from_pretrained(target, use_safetensors=True, **kwargs)  # never a pickle
    except (OSError, ValueError, EnvironmentError) as e:  # hub: not cached and offline/unreachable/unknown id
        if Path(target).exists():
            raise ModelNotFoundError(f"could not load {cls.__name__} from folder {target!r}: {e}".splitlines()[0]) from e
        raise ModelNotFoundError(f"model {model!r} is not in the local Hugging Face cache and could not be "
                                 f"downloaded ({type(e).__name__}); {_download_hint(model)}") from e


def load_pipeline(model: str = "tiny", *, dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None,
                  flow_shift: float | None = None, vae_dtype: torch.dtype = torch.float32):
    """A Wan 2.1 text-to-video ``diffusers.WanPipeline``.

    Arguments:
        model: ``"mini"`` (attnqat's own small model, shipped in the package: its folder, loaded like
            any other), ``"tiny"`` (offline, RANDOM weights, built in code), a local diffusers-format folder
            (e.g. one made by ``huggingface-cli download Wan-AI/Wan2.1-T2V-1.3B-Diffusers --local-dir ...``),
            or a hub id (used from the local cache, else downloaded if the network allows).
        dtype: dtype of the transformer and text encoder (a folder's small text encoder, under
            :data:`SMALL_TEXT_ENCODER` parameters such as mini's, runs in fp32 whatever ``dtype``, as
            ``attnqat train`` encodes the captions; its weights may be stored in bf16).
        device: where to put the pipeline; None leaves it on the CPU (for ``enable_model_cpu_offload``).
        flow_shift: the UniPC scheduler's flow shift (Wan 2.1: 3.0 at 480p, 5.0 at 720p); None keeps
            the model's own.
        vae_dtype: the VAE's dtype (float32, as diffusers recommends for Wan's VAE).
    Return:
        the pipeline. Raises :class:`ModelNotFoundError` with download instructions when the model
        is missing locally and cannot be downloaded.
    """
    if is_tiny(model):
        kwargs = {} if flow_shift is None else {"flow_shift": flow_shift}
        pipe = build_tiny_pipeline(dtype=dtype, **kwargs)
        return pipe.to(device) if device is not None else pipe
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline  # see DIFFUSERS_LATE

    model = resolve_model(model)
    _resolve(model)  # a folder without model_index.json fails here, before any component loads
    vae = _from_pretrained(AutoencoderKLWan, model, subfolder="vae", torch_dtype=vae_dtype)
    pipe = _from_pretrained(WanPipeline, model, vae=vae, torch_dtype=dtype)
    if sum(p.numel() for p in pipe.text_encoder.parameters()) < SMALL_TEXT_ENCODER:
        pipe.text_encoder.to(torch.float32)  # the pipeline casts its embeddings to the transformer's dtype
    if flow_shift is not None:
        pipe.scheduler = UniPCMultistepScheduler.from_config(pipe.scheduler.config, flow_shift=flow_shift)
    return pipe.to(device) if device is not None else pipe


def load_transformer(model: str = "tiny", *, dtype: torch.dtype = torch.bfloat16,
                     device: torch.device | str | None = None):
    """Only the ``WanTransformer3DModel`` of :func:`load_pipeline`'s model (same ``model`` values)."""
    if is_tiny(model):
        return build_tiny_transformer(dtype=dtype, device=device)
    from diffusers import WanTransformer3DModel  # see DIFFUSERS_LATE
    model = resolve_model(model)
    transformer = _from_pretrained(WanTransformer3DModel, model, subfolder="transformer", torch_dtype=dtype)
    return transformer.to(device) if device is not None else transformer


_STORED = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def stored_dtype(model: str) -> torch.dtype | None:
    """The one dtype every tensor of a local model folder's transformer weights is stored in, read from the
    safetensors headers (nothing loaded), or None: the tiny model, a hub id, mixed or other dtypes."""
    if is_tiny(model):
        return None
    folder = Path(resolve_model(model)).expanduser() / "transformer"
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
    found = set()
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            found.update(h.get_slice(k).get_dtype() for k in h.keys())
    return _STORED.get(found.pop()) if len(found) == 1 else None


def load_transformer_cast_on(model: str, dtype: torch.dtype, device: torch.device | str):
    """:func:`load_transformer`'s model in ``dtype`` on ``device``, the same values: in fp32 from a folder stored in
    bf16 or fp16 (Wan's hub folders: bf16), loaded as stored and cast on ``device``, so the host never holds the
    fp32 copy (Wan 14B: 57 GB a process, cast by one CPU thread under a launcher); anything else is loaded in
    ``dtype`` and moved."""
    stored = stored_dtype(model)
    if dtype != torch.float32 or stored not in (torch.bfloat16, torch.float16):
        return load_transformer(model, dtype=dtype, device=device)
    # as stored (diffusers keeps a few modules in fp32, exact too), then fp32 on the device (float(): diffusers'
    # ModelMixin.to warns when given a dtype)
    return load_transformer(model, dtype=stored).to(device).float()


def _exported(folder: Path) -> Path | None:
    """The exported weights of an ``attnqat train`` checkpoint or final/ folder (:data:`EXPORTED_FILES`), or None."""
    return next((folder / name for name in EXPORTED_FILES if (folder / name).is_file()), None)


def _latest_step_weights(checkpoints: Path) -> Path | None:
    """The exported weights of the newest ``checkpoints/step-N`` folder that finished writing (its manifest.json is
    written last), or None."""
    steps = sorted((p for p in checkpoints.iterdir() if STEP_DIR.fullmatch(p.name) and p.is_dir()), reverse=True)
    for step in steps:
        if (step / MANIFEST).is_file() and _exported(step) is not None:
            return _exported(step)
    return None


def _checkpoint_files(path: str | os.PathLike) -> list[Path]:
    """The safetensors file(s) holding the transformer weights that ``path`` names: a file; an ``attnqat train``
    checkpoint or final/ folder (its transformer.safetensors: the exported, EMA where kept, weights; a LoRA run's
    LoRA file); an ``attnqat train`` run folder (its final/, else its newest complete checkpoint); a folder of
    shards; or a diffusers model folder (its transformer/)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"QAT checkpoint {str(p)!r} does not exist")
    if not p.is_dir():
        check_regular_file(p, "QAT checkpoint")  # a FIFO would block the read for ever
        return [p]
    if _exported(p) is not None:  # a checkpoint or final/ folder (beside ema.safetensors, state/)
        return [_exported(p)]
    step = STEP_DIR.fullmatch(p.name)
    if step and (p / MANIFEST).is_file():  # not its ema.safetensors: no weights file of ours
        raise FileNotFoundError(
            f"{str(p)!r} is a training checkpoint saved without its exported weights (checkpoint.export: false); "
            f"its training state has them: resumed into a new output_dir at its step (attnqat train --config CONFIG "
            f"--resume {shlex.quote(str(p))} --set output_dir=NEW --set train.max_steps={int(step.group(1))}), "
            f"the run writes them to NEW/final/")
    if _exported(p / FINAL_DIR) is not None:  # a finished run folder
        return [_exported(p / FINAL_DIR)]
    if (p / CHECKPOINTS_DIR).is_dir():  # a run folder without final/ (stopped early)
        latest = _latest_step_weights(p / CHECKPOINTS_DIR)
        if latest is not None:
            return [latest]
    # a diffusers model folder's weights are its transformer/'s, not QAT weights shipped beside them (mini's)
    files = [] if (p / "model_index.json").is_file() else sorted(p.glob("*.safetensors"))
    files = files or sorted(p.glob("transformer/*.safetensors"))
    for f in files:
        check_regular_file(f, "QAT checkpoint file")
    if not files:
        raise FileNotFoundError(f"QAT checkpoint folder {str(p)!r} holds no .safetensors file (nor an attnqat "
                                f"train run's final/ or checkpoints/step-N/)")
    return files


#: ``--qat-checkpoint none``: the base weights, even where a QAT fine-tune ships with the model.
NO_QAT_CHECKPOINT = "none"


def choose_qat_checkpoint(model: str, given: str | None, mode: str) -> tuple[str | None, str | None]:
    """The QAT checkpoint a run of attention ``mode`` on ``model`` loads (None: the base weights), and what to
    say about its weights (None: nothing to say). ``given``: --qat-checkpoint.

    - ``none``: the base weights;
    - another path: that checkpoint, in any mode;
    - nothing, in a mode whose record says ``uses_qat_weights`` (``attn_qat``): the QAT fine-tune shipped with
      ``model`` (mini's :data:`~attnqat.mini.model.MINI_QAT_WEIGHTS`) where one is installed, else the base
      weights;
    - nothing, in another mode: the base weights (QAT weights are for attn_qat attention).
    """
    if given is not None and given.strip().lower() == NO_QAT_CHECKPOINT:
        return None, f"base weights (--qat-checkpoint {NO_QAT_CHECKPOINT})"
    if given is not None:
        return given, f"QAT checkpoint {given}"
    if not mode_of(mode).uses_qat_weights:
        return None, None
    shipped = shipped_qat_weights(model)
    if shipped is not None:
        return str(shipped), f"shipped QAT fine-tune {shipped}"
    return None, f"base weights ({'no QAT fine-tune installed' if is_shipped_mini(model) else 'no --qat-checkpoint'})"


def checkpoint_weights_path(path: str | os.PathLike) -> str:
    """Where the weights of ``path`` are read from (one file, or a folder of shards): for messages."""
    files = _checkpoint_files(path)
    return str(files[0]) if len(files) == 1 else str(files[0].parent)




def trained_attention_options(path: str | os.PathLike) -> dict | None:
    """The :data:`~attnqat.trained_options.TRAINED_OPTIONS` the weights at ``path`` (as :func:`load_qat_checkpoint`
    takes it) were trained under: what a QAT weights file records, or those of ``attention.options`` in the
    ``config.yaml`` that an ``attnqat train`` checkpoint keeps beside its weights (unchecked values included: callers
    check them). None when nothing says (a plain file, a LoRA file)."""
    files = _checkpoint_files(path)
    if len(files) == 1 and is_qat_weights(files[0]):
        return recorded_attention_options(files[0])
    config = files[0].parent / "config.yaml"
    try:
        data = yaml.safe_load(config.read_text()) if config.is_file() else None
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    options = (data.get("attention") or {}).get("options") if isinstance(data, dict) else None
    return {k: options[k] for k in TRAINED_OPTIONS if k in options} if isinstance(options, dict) else None


def trained_mode_options(mode: str, path: str | os.PathLike | None) -> dict:
    """The attention options ``mode`` runs the weights at ``path`` with when the user says nothing: the Q/K rotation,
    K- and Q-smoothing they were trained under (:func:`trained_attention_options`), those ``mode`` takes (the FP4
    modes) with a value it allows, other than the default; else none (the base weights, None, were trained without
    them). ``attnqat generate --qk-rotation auto --k-smoothing auto``, quality rows, the demo."""
    if path is None:
        return {}
    takes = dict(mode_of(mode).options)
    recorded = trained_attention_options(path) or {}
    return {k: v for k, v in recorded.items() if k in takes and v not in ("none", False)
            and any(type(v) is type(c) and v == c for c in takes[k])}


def check_qat_checkpoint(path: str | os.PathLike, flag: str = "--qat-checkpoint") -> None:
    """Refuse a checkpoint path that cannot load, reading only the files' headers: missing, a folder
    without .safetensors files, a file that is not safetensors. Whether its keys and shapes fit the
    model is checked by :func:`load_qat_checkpoint`."""
    p = check_path_text(flag, path)
    if not p.exists():
        raise FileNotFoundError(f"{flag} {str(path)!r} does not exist")
    try:
        files = _checkpoint_files(p)
    except (FileNotFoundError, ModelConfigError) as e:
        raise type(e)(f"{flag}: {e}") from None
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as h:
                h.keys()
        except Exception as e:  # safetensors raises its own error types for corrupt/non-safetensors files
            raise CheckpointMismatchError(f"{str(f)!r} is not a readable safetensors file: {e}") from e


def _read_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    files = _checkpoint_files(path)
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except Exception as e:  # safetensors raises its own error types for corrupt/non-safetensors files
            raise CheckpointMismatchError(f"{str(f)!r} is not a readable safetensors file: {e}") from e
    return state


def _partial_file(path: str | os.PathLike) -> tuple[str, Path] | None:
    """``("subset", file)`` for the QAT weights file (:mod:`.qat_weights`: a subset of the weights, recognised by its
    metadata) that ``path`` names, ``("lora", file)`` for a LoRA file (:mod:`.lora`: adapters fused over the
    transformer's weights, recognised by its keys), or None when its files are a plain state dict."""
    files = _checkpoint_files(path)
    kinds = [(kind, f) for f in files if (kind := "subset" if is_qat_weights(f) else "lora" if is_lora_file(f) else None)]
    if kinds and len(files) > 1:
        what = "QAT weights" if kinds[0][0] == "subset" else "LoRA"
        raise CheckpointMismatchError(f"QAT checkpoint {str(path)!r} mixes a {what} file ({kinds[0][1].name}) "
                                      f"with {len(files) - 1} other safetensors files; pass the one file itself")
    return kinds[0] if kinds else None


def _check_keys(transformer: torch.nn.Module, path, state: dict, *, subset: bool = False) -> None:
    """:class:`CheckpointMismatchError` unless ``state``'s keys and shapes are ``transformer``'s (all of them;
    with ``subset``, some of them)."""
    own = transformer.state_dict()
    missing = [] if subset else sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    shapes = sorted(f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
                    for k in set(own) & set(state) if state[k].shape != own[k].shape)
    if missing or unexpected or shapes:
        def few(xs):
            return ", ".join(xs[:3]) + (f", ... ({len(xs)} in all)" if len(xs) > 3 else "")
        parts = [f"{len(missing)} missing keys ({few(missing)})" if missing else "",
                 f"{len(unexpected)} unexpected keys ({few(unexpected)})" if unexpected else "",
                 f"{len(shapes)} shape mismatches ({few(shapes)})" if shapes else ""]
        arch = getattr(getattr(transformer, "config", None), "num_layers", None)
        raise CheckpointMismatchError(
            f"{'QAT weights' if subset else 'QAT checkpoint'} {str(path)!r} "
            f"{'do' if subset else 'does'} not match this transformer"
            f"{f' ({arch} blocks)' if arch is not None else ''}: " + "; ".join(p for p in parts if p)
            + ". Was it trained on another model? Pass the --model it was trained from.")


def _read_subset(transformer: torch.nn.Module, file: Path) -> dict[str, torch.Tensor]:
    """The tensors of the QAT weights ``file``, checked against ``transformer``: known keys, equal shapes, and
    ``transformer``'s current weights are the base the file was made for (its fingerprint)."""
    weights = read_qat_weights(file)
    _check_keys(transformer, file, weights.tensors, subset=True)
    own = weights_fingerprint(transformer.state_dict())
    if own != weights.base:
        raise CheckpointMismatchError(
            f"QAT weights {str(file)!r} were made for other base weights (base fingerprint {weights.base[:12]}, "
            f"this transformer's {own[:12]}): they apply only over the model they were exported from; load that "
            f"--model, or pass --qat-checkpoint none to run the base weights")
    return weights.values(transformer.state_dict())


def cpu_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A CPU copy of ``module``'s state dict, detached: weights kept aside to load back later (the demo's
    columns, a QAT weights file applied over the base, experiments/qat_subsets.py's subsets)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}


def read_qat_checkpoint(transformer: torch.nn.Module, path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The state dict (CPU tensors, as stored) of a QAT checkpoint, checked against ``transformer`` (which
    is not changed): every key present, no extra key, every shape equal; otherwise
    :class:`CheckpointMismatchError` says what differs. ``path``: as :func:`load_qat_checkpoint` takes.

    A QAT weights file (:mod:`attnqat.pipelines.qat_weights`: only the tensors a fine-tune changed) gives
    ``transformer``'s current weights (CPU copies) with its tensors in their place, once its keys and shapes
    fit and ``transformer`` holds the base weights it was made for (otherwise
    :class:`CheckpointMismatchError`). A LoRA file (:mod:`attnqat.pipelines.lora`, e.g. an ``attnqat train`` run with
    ``train.trainable: lora``) gives ``transformer``'s current weights with the LoRA fused in."""
    partial = _partial_file(path)
    if partial is not None and partial[0] == "subset":
        return {**cpu_state_dict(transformer), **_read_subset(transformer, partial[1])}
    if partial is not None:
        with fused(transformer, partial[1]):
            return cpu_state_dict(transformer)
    state = _read_state_dict(path)
    _check_keys(transformer, path, state)
    return state


def load_qat_checkpoint(transformer: torch.nn.Module, path: str | os.PathLike) -> torch.nn.Module:
    """Load transformer weights (a QAT fine-tune) from a safetensors file, a folder of shards, an
    ``attnqat train`` checkpoint folder (``OUTPUT/checkpoints/step-N``, ``OUTPUT/final``) or run folder
    (``OUTPUT``: its final/, else its newest complete checkpoint), a diffusers model folder, a QAT
    weights file (:mod:`attnqat.pipelines.qat_weights`, e.g. the ``attn_qat.safetensors`` shipped with mini), or a
    LoRA file.

    A checkpoint must be a full state dict of this architecture: every key present, no extra key, every
    shape equal; otherwise :class:`CheckpointMismatchError` says what differs (and nothing is loaded). A QAT
    weights file holds some of the keys, with their shapes, and only loads over the base weights it was
    made for: its tensors replace those weights, the others stay. A LoRA file (what ``WanPipeline.load_lora_weights``
    loads; ``attnqat train`` writes one with ``train.trainable: lora``) is checked against the transformer's layers
    and fused into their weights (:func:`~attnqat.pipelines.lora.fuse_lora_file`), leaving no adapter behind. Values
    are cast to each parameter's dtype and device. Attention processors are kept.
    Return: ``transformer``.
    """
    partial = _partial_file(path)
    if partial is not None and partial[0] == "subset":
        transformer.load_state_dict(_read_subset(transformer, partial[1]), strict=False)  # the others are the base
        return transformer
    if partial is not None:
        fuse_lora_file(transformer, partial[1])
        return transformer
    transformer.load_state_dict(read_qat_checkpoint(transformer, path), strict=True)
    return transformer
