"""Training configuration: nested dataclasses, loaded from YAML, validated before anything is built.

    cfg = load_config("configs/tiny.yaml", overrides=["train.lr=1e-4", "train.max_steps=20"])

Every key is checked: an unknown key, a value of the wrong type (a null where a value is needed, a
non-finite number), a value outside its range (see :data:`LIMITS` for the upper bounds and their reasons),
an unknown objective / attention mode / option / schedule, a missing data folder, latents that do not
fit the transformer (channels, patch divisibility, text width), or a ``train.sequence_parallel`` degree that
does not divide the process count, the heads or the tokens raise ``ValueError`` naming the offending value,
before any model is loaded or step is taken.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import numbers
import os
import re
import reprlib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

import torch
import yaml
from accelerate.utils import parse_flag_from_env
from diffusers import WanTransformer3DModel

from attnqat.checks import latent_shape
from attnqat.kernels import available_modes, mode_of
from attnqat.pipelines.loading import ModelNotFoundError, is_tiny, resolve_model
from attnqat.pipelines.lora import DEFAULT_TARGETS, require_peft, target_layers
from attnqat.pipelines.model_folder import check_model_folder
from attnqat.pipelines.tiny import TINY_TRANSFORMER_CONFIG

from .data import read_index
from .graphed import use_graphs
from .objectives import OBJECTIVES, Objective
from .optimizers import OPTIMIZERS, require_torchao
from .student_teacher import SHARD_TEACHER

DISTILL_TARGETS = ("output", "features")
LATENT_SOURCES = ("noise", "dataset", "teacher")
TIMESTEP_SAMPLING = ("uniform", "shifted")
LR_SCHEDULES = ("constant", "cosine")
MIXED_PRECISION = ("no", "bf16", "fp16")
SAVE_DTYPES = ("bf16", "fp32")
TRAINABLE = ("all", "attention", "lora")
CUDA_GRAPHS = ("auto", "on", "off")
DATA_SOURCES = ("precomputed", "corpus")
CHECKPOINT_FORMATS = ("auto", "full", "sharded")
# accelerate's trackers (LoggerType), each named as its package is; "all" (whatever happens to be installed) is not
# taken: the config names what a run logs to
TRACKERS = ("tensorboard", "wandb", "comet_ml", "aim", "mlflow", "clearml", "dvclive", "swanlab", "trackio")

# Upper bounds, each with its reason (the lower bounds are in validate()).
LIMITS = {
    "train.max_steps": (9_999_999, "checkpoint folders are named step-NNNNNNN (7 digits) and sorted by name"),
    "seed": (2 ** 32 - 1, "accelerate seeds NumPy, whose seeds are 32-bit"),
    "data.held_out_seed": (2 ** 63 - 1, "a 64-bit seed"),
    "objective.teacher_steps": (1000, "Euler steps of the teacher's sampler (Wan samples in 50)"),
    "train.lr": (1.0, "AdamW moves every weight by about lr per step; the recipe uses 1e-6 to 1e-5"),
    "train.eps": (1.0, "AdamW's denominator guard; larger values stop learning"),
    "timesteps.shift": (1000.0, "Wan uses 3 (480p) to 5 (720p); at 1000 half the sampled sigmas are above 0.999"),
    "train.gradient_accumulation_steps": (4096, "forward/backward passes per optimizer step and process; raise "
                                                "data.batch_size or the process count instead"),
    "objective.output_weight": (1000.0, "a loss term's weight against the other; beyond 1000 the other is noise"),
    "objective.flow_weight": (1000.0, "a loss term's weight against the other; beyond 1000 the other is noise"),
    "objective.attention_consistency": (1000.0, "a loss term's weight against the other; beyond 1000 the other is "
                                                "noise"),
}
MAX_ELEMENTS = 2 ** 31  # one tensor of a micro-batch or of the held-out set: int32 indexing, 8 GiB in fp32


@dataclass
class AttentionConfig:
    mode: str = "attn_qat"          # the student's attention (trainable mode); the teacher runs bf16
    layers: Any = "self"            # "self" (attn1 of every block, the paper's setting), "all", or [block indices]
    options: dict = field(default_factory=dict)  # mode options, e.g. {p_bwd: normalized}


@dataclass
class ObjectiveConfig:
    type: str = "distill"           # objectives.OBJECTIVES: distill | flow | mix (= distill + flow_weight * flow)
    target: str = "features"        # distill target: output (velocity) | features (every block + output)
    output_weight: float = 1.0      # features: weight of the output term beside the mean block term
    flow_weight: float = 1.0        # mix: weight of the flow-matching term
    latents: str = "noise"          # distill's clean latents x0: noise | dataset | teacher (teacher samples)
    teacher_steps: int = 8          # latents=teacher: Euler steps of the teacher's sampler
    attention_consistency: float = 0.0  # > 0: + this x each FP4 self-attention layer's own nmse(FP4 output, exact
                                        # output), mean over layers (consistency.py); any objective.type


@dataclass
class TimestepConfig:
    sampling: str = "shifted"       # uniform sigma, or Wan's shift: s' = shift*s / (1 + (shift-1)*s)
    shift: float = 3.0              # Wan 2.1: 3.0 at 480p, 5.0 at 720p
    min_sigma: float = 0.001
    max_sigma: float = 1.0


@dataclass
class CorpusConfig:
    """``data.source: corpus``: clips of :mod:`attnqat.mini.corpus`, encoded on the fly by the model's VAE."""
    seed: int = 0                   # corpus seed (clip attributes and captions)
    sizes: list = field(default_factory=lambda: [[33, 256, 256]])  # video sizes (frames, height, width)
    size_weights: list | None = None  # integer weight of each size in the cycle of step sizes (default: 1 each)
    pool: int = 1024                # encoded clips kept per size (0: encode every sample fresh)
    refresh: int = 8                # pool clips replaced by new ones per step of that size (on average)
    refresh_every: int = 1          # ... replaced refresh * refresh_every at a time, every refresh_every-th step of
                                    # that size: the VAE's cost is mostly per call, so batching refreshes saves time
    encode_batch: int = 16          # clips rendered and encoded at once
    caption_dropout: float = 0.1    # share of samples whose prompt is replaced by the empty one (for guidance)
    compact_text: int = 0           # > 0: keep this many rows of the prompt embeddings, the last standing for all the
                                    # padding (exact; cross-attention over them, not data.text_len: compact_text.py)


@dataclass
class DataConfig:
    source: str = "precomputed"     # precomputed (data.path, or data-free) | corpus (the procedural corpus)
    path: str | None = None         # folder written by `attnqat precompute` (prompt embeddings, optional latents)
    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    latent_shape: list = field(default_factory=lambda: [16, 21, 60, 104])  # (C, F, H, W) for noise latents
    text_len: int = 512             # tokens of random prompt embeddings when path is null (data-free)
    batch_size: int = 1             # per process (per sequence-parallel group), per micro-batch
    held_out: int = 4               # samples in the fixed held-out set for the student-teacher gap
    held_out_seed: int = 12345


@dataclass
class LoraSection:
    """``train.lora``: the adapter of ``train.trainable: lora`` (peft's LoraConfig through diffusers' add_adapter)."""
    rank: int = 64                  # Wan 14B at rank 64 on these targets: 307M trainable weights
    alpha: float = 64.0             # the adapter's output is scaled by alpha / rank
    target_modules: list = field(default_factory=lambda: list(DEFAULT_TARGETS))  # peft's names: a module's name
                                    # or its ending (to_q: every block's attn1.to_q and attn2.to_q)
    dropout: float = 0.0            # dropout on the adapter's input (peft's lora_dropout)


@dataclass
class TrainSection:
    max_steps: int = 1000           # optimizer steps
    lr: float = 1e-6                # the published recipe's
    weight_decay: float = 0.01
    betas: list = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    grad_clip: float = 1.0          # 0 disables clipping (the norm is still logged)
    warmup_steps: int = 0
    lr_schedule: str = "constant"   # constant | cosine (to min_lr_ratio * lr at max_steps), after warmup
    min_lr_ratio: float = 0.0
    gradient_accumulation_steps: int = 1
    mixed_precision: str = "bf16"   # accelerate's: no | bf16 | fp16 (master weights stay fp32)
    gradient_checkpointing: bool = True
    save_attention: bool = False    # keep each block's attention outputs through gradient checkpointing: no
                                    # attention recompute in the backward, at the memory of those outputs per block
    compile: bool = False           # torch.compile the student's blocks (small models are launch-bound)
    cuda_graphs: str = "auto"       # auto | on | off: replay each micro-batch's forward + backward as a CUDA graph
                                    # (one GPU, no gradient checkpointing: graphed.py); auto where it can
    trainable: str = "all"          # all | attention (only the patched attention modules' weights) | lora (an
                                    # adapter over frozen weights; the teacher is the same module, adapter off)
    lora: LoraSection = field(default_factory=LoraSection)
    teacher_dtype: str | None = None  # bf16 | fp32; default bf16 under bf16 mixed precision, else fp32; with lora
                                      # also the frozen base weights' dtype (they are the teacher)
    from_scratch: bool = False      # start from a seeded random initialisation of the model's architecture
    ema_decay: float = 0.0          # > 0: keep an exponential moving average of the weights and export it
    sequence_parallel: int = 1      # Ulysses degree: N consecutive processes share each sample's sequence
    optimizer: str = "adamw"        # adamw (torch's) | adamw8bit (torchao's: m and v in 8 bits, ~2 bytes a weight
                                    # instead of 8; optimizers.py)
    shard_teacher: str = "auto"     # auto | on | off: under FSDP, shard the teacher copy as the student is (auto:
                                    # whenever the run is under FSDP); off keeps a whole replica on every process
    deterministic: bool = False     # torch's deterministic algorithms for the run (cuBLAS, cuDNN, SDPA's backward):
                                    # a GPU run repeats bit for bit; an op without one stops the run, named


@dataclass
class CheckpointConfig:
    every: int = 500                # steps; the last step is always saved
    keep: int = 2                   # how many step checkpoints to keep (final/ is extra)
    save_dtype: str = "bf16"        # dtype of the exported transformer.safetensors
    format: str = "auto"            # training state: full, sharded (each process its own shard), auto (FSDP: sharded)
    export: bool = True             # step checkpoints hold transformer.safetensors too (final/ always does)


@dataclass
class LogConfig:
    every: int = 10                 # steps between log rows
    eval_every: int = 0             # steps between held-out gap evaluations (0: only at start and end)
    csv: bool = True
    trackers: list = field(default_factory=list)  # accelerate's log_with: tensorboard, wandb, ... (TRACKERS)
    tensorboard: bool = False       # the same as "tensorboard" in trackers
    project: str = "attnqat"        # the trackers' project name (TensorBoard: trackers/PROJECT/ in output_dir)
    progress: bool = True


@dataclass
class TrainConfig:
    model: str = "tiny"             # "tiny", a diffusers-format Wan 2.1 folder, or a hub id
    output_dir: str = "runs/attnqat"
    seed: int = 0
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    timesteps: TimestepConfig = field(default_factory=TimestepConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainSection = field(default_factory=TrainSection)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------------------------
# Loading


def _build(cls, values: dict, where: str):
    if not isinstance(values, dict):
        raise ValueError(f"config section {where or 'top level'!r} must be a mapping, got {values!r}")
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(map(str, set(values) - names))
    if unknown:
        raise ValueError(f"unknown config key {where + '.' if where else ''}{_show(unknown[0]).strip(chr(39))}; "
                         f"{where or 'top level'} takes: {', '.join(sorted(names))}")
    kwargs = {}
    for name, value in values.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value or {}, f"{where}.{name}" if where else name)
        else:
            kwargs[name] = _coerce(value, hint, f"{where}.{name}" if where else name)
    return cls(**kwargs)


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60
_REPR.maxlist = _REPR.maxdict = _REPR.maxtuple = 4
_REPR.maxlevel = 2


def _show(value) -> str:
    """A short repr of a value a user gave (bounded however large or nested: an error message stays one short
    line, and YAML aliases cannot make it explode)."""
    return _REPR.repr(value).replace("\n", "\\n")


def _coerce(value, hint, key):
    """YAML gives ``1e-6`` as a string and ints where floats are meant; fix those, refuse the rest (a null
    only where the key allows one; numbers must be finite)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None and len(args) < len(typing.get_args(hint)):
            return None
        hint = args[0] if len(args) == 1 else Any
    if value is None and hint is not Any:
        raise ValueError(f"config key {key} must not be null")
    if hint is float or hint == "float":
        if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
            raise ValueError(f"config key {key} must be a number, got {_show(value)}")
        try:
            x = float(value)
        except (TypeError, ValueError, OverflowError):
            raise ValueError(f"config key {key} must be a number, got {_show(value)}") from None
        if not math.isfinite(x):
            raise ValueError(f"config key {key} must be a finite number, got {_show(value)}")
        return x
    if hint is int:
        if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, float) and value.is_integer())):
            raise ValueError(f"config key {key} must be an integer, got {_show(value)}")
        return int(value)
    if hint is bool:
        if not isinstance(value, bool):
            raise ValueError(f"config key {key} must be true or false, got {_show(value)}")
        return value
    for kind, name in ((str, "a string"), (list, "a list"), (dict, "a mapping")):
        if hint is kind and not isinstance(value, kind):
            raise ValueError(f"config key {key} must be {name}, got {_show(value)}")
    return value


class ConfigLoader(yaml.SafeLoader):
    """YAML for configs: safe types only; no aliases (``*name``: a 1.6 KB file of nested aliases expands to
    gigabytes when copied, and a config needs none); YAML 1.2's booleans, ``true`` and ``false`` only, so
    ``no`` is the string "no" (``train.mixed_precision: no``), not false as in YAML 1.1."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            raise yaml.composer.ComposerError(None, None, "aliases (*name) are not allowed in a config",
                                              self.peek_event().start_mark)
        return super().compose_node(parent, index)


ConfigLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                   list("tTfF"))


def _load_yaml(text: str):
    return yaml.load(text, Loader=ConfigLoader)  # noqa: S506 - a SafeLoader


def _set_dotted(d: dict, key: str, value) -> None:
    parts = key.split(".")
    for p in parts[:-1]:
        d = d.setdefault(p, {})
        if not isinstance(d, dict):
            raise ValueError(f"override {key!r}: {p!r} is not a section")
    d[parts[-1]] = value


def config_from_dict(values: dict, overrides: list[str] | None = None) -> TrainConfig:
    try:
        values = json.loads(json.dumps(values or {}))  # deep copy
    except (TypeError, ValueError, RecursionError):
        raise ValueError("the config holds values YAML allows but a config cannot (non-string keys, dates, "
                         "recursive aliases)") from None
    for item in overrides or []:
        if "=" not in item:
            raise ValueError(f"override {_show(item)} must look like section.key=value (e.g. train.lr=1e-5)")
        key, raw = item.split("=", 1)
        try:
            value = _load_yaml(raw)
        except yaml.YAMLError as e:
            raise ValueError(f"override {_show(item)}: the value is not valid YAML "
                             f"({str(e).splitlines()[0]})") from None
        if not key.strip() or any(not p for p in key.strip().split(".")):
            raise ValueError(f"override {_show(item)}: empty key (use section.key=value)")
        _set_dotted(values, key.strip(), value)
    return _build(TrainConfig, values, "")


def load_config(path: str | Path, overrides: list[str] | None = None) -> TrainConfig:
    """Read a YAML config, apply ``section.key=value`` overrides, and check every value's form."""
    p = Path(path).expanduser()
    try:
        if p.is_dir():
            raise ValueError(f"config file {_show(str(p))} is a folder; give a YAML file")
        if not p.is_file():
            raise FileNotFoundError(f"config file {_show(str(p))} does not exist")
        if p.stat().st_size > 1 << 20:
            raise ValueError(f"config file {_show(str(p))} is larger than 1 MB: not a training config")
        text = p.read_text()
    except OSError as e:
        if isinstance(e, (FileNotFoundError, PermissionError)):
            raise
        raise ValueError(f"config file {_show(str(p))} cannot be read: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ValueError(f"config file {_show(str(p))} is not UTF-8 text") from None
    try:
        values = _load_yaml(text) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"config file {str(p)!r} is not valid YAML: {e}".replace("\n", " ")) from e
    return config_from_dict(values, overrides)


def save_config(cfg: TrainConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


# ---------------------------------------------------------------------------------------------------------------
# Validation (everything a user can get wrong, checked before a model is built)


def _one_of(value, choices, key):
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{key} {_show(value)} is not one of {', '.join(map(str, choices))}")


def trackers_of(log: LogConfig) -> list[str]:
    """The trackers a run logs to through accelerate (``log_with``): ``log.trackers``, and tensorboard if
    ``log.tensorboard``; the one place that decides. Refuses an unknown name, and one whose package is not
    installed (accelerate would leave it out without a word)."""
    from accelerate.tracking import get_available_trackers

    if not (isinstance(log.trackers, list) and all(isinstance(t, str) for t in log.trackers)):
        raise ValueError(f"log.trackers must be a list of tracker names ({', '.join(TRACKERS)}), got "
                         f"{_show(log.trackers)}")
    names = list(dict.fromkeys(log.trackers + (["tensorboard"] if log.tensorboard else [])))
    for name in names:
        _one_of(name, TRACKERS, "log.trackers entry")
    available = {str(getattr(t, "value", t)) for t in get_available_trackers()}
    missing = [n for n in names if n not in available]
    if missing:
        raise ValueError(f"log.trackers names {missing[0]}, which is not installed: pip install {missing[0]} (or "
                         f"leave it out; log.csv is written either way)")
    if not (isinstance(log.project, str) and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}", log.project)):
        raise ValueError(f"log.project {_show(log.project)} must be a name of letters, digits, '.', '_', '-' (at most "
                         f"100, the first a letter or digit): it names a folder and the trackers' project")
    return names


def objective_of(o: ObjectiveConfig) -> Objective:
    """The objective ``objective.type`` names (:data:`.objectives.OBJECTIVES`), built from its section: the one
    place a name becomes an objective."""
    _one_of(o.type, tuple(OBJECTIVES), "objective.type")
    return OBJECTIVES[o.type](o)


def model_config(model: str) -> dict:
    """The ``WanTransformer3DModel`` config of ``model`` without loading any weight."""
    if not isinstance(model, str) or not model.strip():
        raise ValueError(f"model must be 'tiny', 'mini', a Wan 2.1 folder or a hub id, got {_show(model)}")
    model = resolve_model(model)
    if is_tiny(model):
        return dict(TINY_TRANSFORMER_CONFIG)
    path = Path(model).expanduser()
    try:
        is_dir = path.is_dir()
    except (OSError, ValueError) as e:  # a name too long for the file system, a NUL byte
        raise ValueError(f"model {_show(model)} is not a usable path ({getattr(e, 'strerror', None) or e})") from None
    if is_dir:
        check_model_folder(path, ("transformer",))  # bounds, types, its weights' blocks
        cfg = path / "transformer" / "config.json"
        if not cfg.is_file():
            cfg = path / "config.json"
        if not cfg.is_file():
            raise FileNotFoundError(f"model {model!r}: no transformer/config.json in that folder; expected a "
                                    f"diffusers-format Wan 2.1 folder")
        try:
            tc = json.loads(cfg.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"model {model!r}: {cfg.name} is not valid JSON ({e})") from None
        if not isinstance(tc, dict):
            raise ValueError(f"model {model!r}: {cfg.name} is not a transformer config")
        return tc
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", model):  # not even the shape of a hub id: no network lookup
        raise ModelNotFoundError(f"model {_show(model)} is neither 'tiny', a local folder, nor a hub id (org/name)")
    try:
        return dict(WanTransformer3DModel.load_config(model, subfolder="transformer"))
    except Exception as e:  # not cached / offline / unknown id
        raise ModelNotFoundError(f"model {_show(model)} is neither 'tiny', a local folder, nor a cached hub id "
                                 f"({type(e).__name__})") from e


def run_device_type() -> str:
    """The device type a run started here trains on (:class:`~.loop.Trainer` builds its accelerator for it):
    ``"cuda"`` where torch sees a GPU, unless the launcher asked for the CPU (``accelerate launch --cpu``)."""
    return "cuda" if torch.cuda.is_available() and not parse_flag_from_env("ACCELERATE_USE_CPU") else "cpu"


@dataclass(frozen=True)
class CheckedConfig:
    """A :class:`TrainConfig` that :func:`validate` accepted for one device type and process count, with what the
    check read: the data index and the transformer's config. :func:`~.loop.train` and :class:`~.loop.Trainer` take
    it as it is (a raw ``TrainConfig`` they validate themselves)."""
    config: TrainConfig         # a copy: changing the caller's config afterwards does not change the checked one
    index: dict                 # the data index (``{}`` data-free) with latent_shape and latent_shapes
    transformer_config: dict
    device_type: str            # "cpu" or "cuda"
    world_size: int             # processes


def validate(cfg: TrainConfig, *, transformer_config: dict | None = None, device_type: str | None = None,
             world_size: int | None = None) -> CheckedConfig:
    """Check ``cfg`` against itself, its data folder, the transformer's config (default: the model's), the device
    type (default: :func:`run_device_type`) and the process count ``world_size`` (default: the launcher's
    ``WORLD_SIZE``, 1 without one); return the :class:`CheckedConfig`. Raises ValueError / FileNotFoundError naming
    the offending value."""
    if device_type is None:
        device_type = run_device_type()
    if world_size is None:  # torchrun and accelerate launch set WORLD_SIZE: checked before a process group exists
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    a, o, t, d, tr, ck = cfg.attention, cfg.objective, cfg.timesteps, cfg.data, cfg.train, cfg.checkpoint
    objective = objective_of(o)
    _one_of(o.target, DISTILL_TARGETS, "objective.target")
    _one_of(o.latents, LATENT_SOURCES, "objective.latents")
    _one_of(t.sampling, TIMESTEP_SAMPLING, "timesteps.sampling")
    _one_of(tr.lr_schedule, LR_SCHEDULES, "train.lr_schedule")
    _one_of(tr.mixed_precision, MIXED_PRECISION, "train.mixed_precision")
    _one_of(tr.trainable, TRAINABLE, "train.trainable")
    _one_of(ck.save_dtype, SAVE_DTYPES, "checkpoint.save_dtype")
    _one_of(tr.cuda_graphs, CUDA_GRAPHS, "train.cuda_graphs")
    _one_of(ck.format, CHECKPOINT_FORMATS, "checkpoint.format")
    _one_of(tr.optimizer, OPTIMIZERS, "train.optimizer")
    _one_of(tr.shard_teacher, SHARD_TEACHER, "train.shard_teacher")
    if tr.optimizer == "adamw8bit":
        require_torchao()
    trackers_of(cfg.log)  # known names, installed packages
    if tr.teacher_dtype is not None:
        _one_of(tr.teacher_dtype, SAVE_DTYPES, "train.teacher_dtype")
    mode = mode_of(a.mode, "attention.mode")
    if not mode.trainable:
        raise ValueError(f"attention.mode {a.mode!r} is inference-only; train with a trainable mode "
                         f"({', '.join(available_modes(lambda m: m.trainable))})")
    if not (a.layers in ("self", "all") or (isinstance(a.layers, list) and a.layers
                                            and all(type(i) is int for i in a.layers))):
        raise ValueError(f"attention.layers {_show(a.layers)} must be 'self', 'all' or a list of block indices")
    if not isinstance(a.options, dict):
        raise ValueError(f"attention.options must be a mapping, got {_show(a.options)}")
    mode.check_options(a.options)  # unknown options and values, before a model is built
    if not isinstance(cfg.output_dir, str) or not cfg.output_dir.strip():
        raise ValueError(f"output_dir must be a folder name, got {_show(cfg.output_dir)}")
    if d.path is not None and not d.path.strip():
        raise ValueError("data.path is empty (null for data-free training)")
    for key, value, lo in (("train.max_steps", tr.max_steps, 1), ("data.batch_size", d.batch_size, 1),
                           ("train.gradient_accumulation_steps", tr.gradient_accumulation_steps, 1),
                           ("train.warmup_steps", tr.warmup_steps, 0), ("checkpoint.every", ck.every, 1),
                           ("checkpoint.keep", ck.keep, 1), ("log.every", cfg.log.every, 1),
                           ("log.eval_every", cfg.log.eval_every, 0), ("data.held_out", d.held_out, 0),
                           ("data.text_len", d.text_len, 1), ("objective.teacher_steps", o.teacher_steps, 1),
                           ("seed", cfg.seed, 0), ("data.held_out_seed", d.held_out_seed, 0),
                           ("train.sequence_parallel", tr.sequence_parallel, 1)):
        if value < lo:
            raise ValueError(f"{key} must be >= {lo}, got {value}")
    for key, value in (("train.max_steps", tr.max_steps), ("seed", cfg.seed), ("train.lr", tr.lr),
                       ("data.held_out_seed", d.held_out_seed), ("objective.teacher_steps", o.teacher_steps),
                       ("train.eps", tr.eps), ("timesteps.shift", t.shift),
                       ("train.gradient_accumulation_steps", tr.gradient_accumulation_steps),
                       ("objective.output_weight", o.output_weight), ("objective.flow_weight", o.flow_weight),
                       ("objective.attention_consistency", o.attention_consistency)):
        hi, why = LIMITS[key]
        if value > hi:
            raise ValueError(f"{key} must be <= {hi:g}, got {_show(value)}: {why}")
    if tr.warmup_steps > tr.max_steps:
        raise ValueError(f"train.warmup_steps {tr.warmup_steps} > train.max_steps {tr.max_steps}: the warmup would "
                         f"never end")
    if not tr.lr > 0 or not tr.eps > 0:
        raise ValueError(f"train.lr and train.eps must be > 0, got {tr.lr}, {tr.eps}")
    if tr.weight_decay < 0 or tr.grad_clip < 0:
        raise ValueError(f"train.weight_decay and train.grad_clip must be >= 0, got {tr.weight_decay}, {tr.grad_clip}")
    if tr.lr * tr.weight_decay >= 1:
        raise ValueError(f"train.lr * train.weight_decay = {tr.lr * tr.weight_decay:g} must be < 1: AdamW multiplies "
                         f"the weights by 1 - lr * weight_decay every step")
    if not 0 <= tr.min_lr_ratio <= 1:
        raise ValueError(f"train.min_lr_ratio must be in [0, 1], got {tr.min_lr_ratio}")
    if o.output_weight < 0 or o.flow_weight < 0:
        raise ValueError(f"objective.output_weight and flow_weight must be >= 0, got {o.output_weight}, {o.flow_weight}")
    _check_consistency(o.attention_consistency, a.mode)
    if not (isinstance(tr.betas, list) and len(tr.betas) == 2
            and all(isinstance(b, numbers.Real) and not isinstance(b, bool) and 0 <= b < 1 for b in tr.betas)):
        raise ValueError(f"train.betas must be two numbers in [0, 1), got {_show(tr.betas)}")
    if not 0 <= t.min_sigma < t.max_sigma <= 1:
        raise ValueError(f"timesteps: need 0 <= min_sigma < max_sigma <= 1, got {t.min_sigma}, {t.max_sigma}")
    if t.shift <= 0:
        raise ValueError(f"timesteps.shift must be > 0, got {t.shift}")
    _check_lora_form(tr.lora)  # whatever train.trainable is: no setting is silently ignored
    if tr.trainable == "lora" and tr.mixed_precision == "no" and tr.teacher_dtype == "bf16":
        raise ValueError("train.trainable 'lora' with train.teacher_dtype 'bf16' needs train.mixed_precision 'bf16': "
                         "the frozen base weights are the teacher's, in its dtype, and without autocast the fp32 "
                         "student cannot run on bf16 weights")
    if tr.save_attention and not tr.gradient_checkpointing:
        raise ValueError("train.save_attention needs train.gradient_checkpointing: it keeps the attention outputs "
                         "through the checkpointed blocks' recompute, and without checkpointing nothing is recomputed")

    # Data
    index: dict = {}
    _one_of(d.source, DATA_SOURCES, "data.source")
    needs_latents = objective.latents == "dataset"
    corpus_shapes = _corpus_shapes(d.corpus)  # checked whatever the source: no setting is silently ignored
    keep = d.corpus.compact_text
    if not (type(keep) is int and (keep == 0 or 2 <= keep < d.text_len)):
        raise ValueError(f"data.corpus.compact_text must be 0 (off) or an integer from 2 to data.text_len - 1 "
                         f"({d.text_len - 1}), got {_show(keep)}")
    if keep and d.source != "corpus":
        raise ValueError("data.corpus.compact_text cuts the corpus's prompt embeddings; data.source is "
                         f"{d.source!r}: set compact_text: 0 or data.source: corpus")
    if keep and a.layers == "all":
        raise ValueError("data.corpus.compact_text needs the cross-attention in diffusers' processor, but "
                         "attention.layers 'all' runs it in attention.mode; use layers 'self' or compact_text: 0")
    if d.source == "corpus":
        if d.path is not None:
            raise ValueError("data.path and data.source 'corpus' exclude each other; set data.path: null")
        shapes = corpus_shapes
        index["has_latents"] = True
    else:
        if d.path is not None:
            index = read_index(d.path)
        if needs_latents:
            why = objective.latents_setting
            if d.path is None:
                raise ValueError(f"{why} needs a dataset of video latents: set data.path to a folder written by "
                                 f"`attnqat precompute --videos ...`, or data.source: corpus")
            if not index.get("has_latents"):
                raise ValueError(f"{why} needs video latents, but data.path {d.path!r} holds prompt embeddings "
                                 f"only; run `attnqat precompute` with --videos")
        shapes = [list(index["latent_shape"]) if needs_latents else list(d.latent_shape)]
    objective.check(d.source)
    for shape in shapes:
        if len(shape) != 4 or not all(type(x) is int and x > 0 for x in shape):
            raise ValueError(f"data.latent_shape must be 4 positive integers (C, F, H, W), got {_show(shape)}")
    if not (isinstance(tr.ema_decay, float) and (tr.ema_decay == 0 or 0 < tr.ema_decay < 1)):
        raise ValueError(f"train.ema_decay must be 0 (off) or in (0, 1), got {_show(tr.ema_decay)}")

    # The batch against the transformer
    if transformer_config is None:
        transformer_config = model_config(cfg.model)
    tc = transformer_config
    pt, ph, pw = tc.get("patch_size", (1, 2, 2))
    for c, f, h, w in shapes:
        shape = [c, f, h, w]
        if c != tc["in_channels"]:
            raise ValueError(f"latent channels {c} (latent shape {shape}) != the transformer's in_channels "
                             f"{tc['in_channels']}")
        if f % pt or h % ph or w % pw:
            raise ValueError(f"latent shape {shape} (C, F, H, W) does not fit the transformer's patch size "
                             f"{tuple(tc.get('patch_size'))}: F, H, W must be divisible by it")
    text_dim = tc["text_dim"]
    per_sample = math.prod(shape)
    for what, n in (("data.batch_size x latent elements", d.batch_size * per_sample),
                    ("data.held_out x latent elements", d.held_out * per_sample),
                    ("data.batch_size x data.text_len x text_dim", d.batch_size * d.text_len * text_dim),
                    ("data.held_out x data.text_len x text_dim", d.held_out * d.text_len * text_dim)):
        if n > MAX_ELEMENTS:
            raise ValueError(f"{what} = {n} > 2^31: one tensor that large overflows int32 indexing (8 GiB in fp32); "
                             f"use gradient_accumulation_steps for larger batches")
    if index.get("text_dim") is not None and index["text_dim"] != text_dim:
        raise ValueError(f"prompt embeddings in {d.path!r} have width {index['text_dim']}, but the transformer's "
                         f"text_dim is {text_dim}: were they encoded with another model's text encoder?")
    head_dim = tc["attention_head_dim"]
    head_dims = mode.head_dims  # on the GPU; the CPU reference takes any
    if device_type == "cuda" and head_dims is not None and head_dim not in head_dims:
        raise ValueError(f"attention mode {a.mode!r} on GPU needs head_dim {' or '.join(map(str, head_dims))}; "
                         f"the model's is {head_dim}")
    if isinstance(a.layers, list):
        bad = [i for i in a.layers if not 0 <= i < tc["num_layers"]]
        if bad:
            raise ValueError(f"attention.layers {bad} out of range: the transformer has {tc['num_layers']} blocks")
    if device_type == "cpu" and tr.mixed_precision == "fp16":
        raise ValueError("train.mixed_precision 'fp16' needs a GPU; use 'no' on CPU")
    if tr.trainable == "lora":
        _check_lora_targets(tr.lora, tc)
    _check_sequence_parallel(tr.sequence_parallel, tc, shapes, world_size)
    use_graphs(cfg, device_type, world_size)  # train.cuda_graphs 'on' where graphs cannot run
    index["latent_shape"] = shapes[0]
    index["latent_shapes"] = shapes
    return CheckedConfig(copy.deepcopy(cfg), index, dict(tc), device_type, world_size)


def _check_consistency(weight, mode: str) -> None:
    """``objective.attention_consistency``: a finite weight >= 0; above 0 it needs a student whose attention has an
    FP4 forward and a backward (the term is that layer's FP4 error, trained through its backward)."""
    if not (isinstance(weight, numbers.Real) and not isinstance(weight, bool) and math.isfinite(weight)
            and weight >= 0):
        raise ValueError(f"objective.attention_consistency must be a finite number >= 0, got {_show(weight)}")
    fp4 = available_modes(lambda m: m.trainable and m.naive_fp4_forward)
    if weight > 0 and mode not in fp4:
        raise ValueError(f"objective.attention_consistency {weight:g} needs an FP4 trainable attention.mode "
                         f"({', '.join(fp4)}), got {mode!r}: the term is a layer's FP4 error against its exact output")


def _check_sequence_parallel(degree: int, tc: dict, shapes: list[list[int]], world: int) -> None:
    """``train.sequence_parallel`` N against the processes (groups of N), the heads (Ulysses hands each process
    heads / N of them) and the tokens (diffusers splits the sequence in N equal parts)."""
    if degree == 1:
        return
    if world % degree:
        raise ValueError(f"train.sequence_parallel {degree} must divide the process count {world}: each group of "
                         f"{degree} consecutive processes shares one sample's sequence")
    heads = tc["num_attention_heads"]
    if heads % degree:
        raise ValueError(f"train.sequence_parallel {degree} must divide the transformer's {heads} attention heads "
                         f"(Ulysses gives each process heads / {degree}; Wan 2.1 14B has 40, 1.3B has 12)")
    for shape in shapes:
        tokens = tokens_per_sample(shape, tc)
        if tokens % degree:
            raise ValueError(f"train.sequence_parallel {degree} must divide the {tokens} tokens of latent shape "
                             f"{list(shape)}: diffusers splits the sequence into equal parts")


def _check_lora_form(lora: LoraSection) -> None:
    """``train.lora``'s values on their own (their fit to the transformer: :func:`_check_lora_targets`)."""
    if lora.rank < 1:
        raise ValueError(f"train.lora.rank must be >= 1, got {lora.rank}")
    if not lora.alpha > 0:
        raise ValueError(f"train.lora.alpha must be > 0 (the adapter's output is scaled by alpha / rank), got "
                         f"{_show(lora.alpha)}")
    if not 0 <= lora.dropout < 1:
        raise ValueError(f"train.lora.dropout must be in [0, 1), got {_show(lora.dropout)}")
    t = lora.target_modules
    if not (t and all(isinstance(x, str) and x.strip() and x == x.strip() for x in t) and len(set(t)) == len(t)):
        raise ValueError(f"train.lora.target_modules must be a list of distinct module names (e.g. "
                         f"{list(DEFAULT_TARGETS)}), got {_show(t)}")


def _check_lora_targets(lora: LoraSection, tc: dict) -> None:
    """peft is there, each of ``train.lora.target_modules`` selects linear layers of the transformer (built on the
    meta device: names and shapes, no memory), and the rank fits the narrowest of them."""
    require_peft("train.trainable 'lora'")
    with torch.device("meta"):
        model = WanTransformer3DModel.from_config(tc)
    layers = [name for names in target_layers(model, lora.target_modules).values() for name in names]
    width, name = min((min(model.get_submodule(n).in_features, model.get_submodule(n).out_features), n)
                      for n in layers)
    if lora.rank > width:
        raise ValueError(f"train.lora.rank {lora.rank} > {width}, the width of the targeted layer {name}: a rank past a "
                         f"layer's width adds weights but nothing it can express")


def tokens_per_sample(shape, tc: dict) -> int:
    """Self-attention tokens of one latent of ``shape`` (C, F, H, W) under the transformer config ``tc``'s patch."""
    _, f, h, w = shape
    pt, ph, pw = tc.get("patch_size", (1, 2, 2))
    return (f // pt) * (h // ph) * (w // pw)


def _corpus_shapes(c: CorpusConfig) -> list[list[int]]:
    """Latent shapes of ``data.corpus.sizes``, after checking the section (types, ranges, limits)."""
    def whole(x, lo, hi):
        return type(x) is int and lo <= x <= hi

    if not whole(c.seed, 0, 2 ** 32 - 1):
        raise ValueError(f"data.corpus.seed must be an integer in [0, 2^32 - 1], got {_show(c.seed)}")
    if not (isinstance(c.sizes, list) and 0 < len(c.sizes) <= 16
            and all(isinstance(s, list) and len(s) == 3 for s in c.sizes)):
        raise ValueError(f"data.corpus.sizes must be a list of [frames, height, width] (at most 16), got {_show(c.sizes)}")
    for size in c.sizes:
        f, h, w = size
        # limits: 257 frames (16 s at 16 fps) and 2048 pixels keep one clip's render and latents a few GB at most
        if not (whole(f, 1, 257) and (f - 1) % 4 == 0 and whole(h, 32, 2048) and whole(w, 32, 2048)
                and h % 16 == 0 and w % 16 == 0):
            raise ValueError(f"data.corpus.sizes entry {_show(size)} must have frames 4k+1 (at most 257) and height, "
                             f"width multiples of 16 in [32, 2048]")
    if c.size_weights is not None and not (isinstance(c.size_weights, list) and len(c.size_weights) == len(c.sizes)
                                           and all(whole(x, 0, 1000) for x in c.size_weights)
                                           and sum(c.size_weights) > 0):
        raise ValueError(f"data.corpus.size_weights must be one integer in [0, 1000] per size (not all 0), "
                         f"got {_show(c.size_weights)}")
    # pool: at most 65536 clips (a 33x256x256 clip's latents and prompt take ~0.9 MB on the device)
    if not (whole(c.pool, 0, 65536) and whole(c.refresh, 1, 65536) and whole(c.refresh_every, 1, 65536)
            and whole(c.encode_batch, 1, 1024) and (c.pool == 0 or c.refresh * c.refresh_every <= c.pool)):
        raise ValueError(f"data.corpus: need pool in [0, 65536], refresh and refresh_every >= 1 with refresh * "
                         f"refresh_every <= pool, encode_batch in [1, 1024]; got pool {_show(c.pool)}, refresh "
                         f"{_show(c.refresh)}, refresh_every {_show(c.refresh_every)}, encode_batch {_show(c.encode_batch)}")
    if not (isinstance(c.caption_dropout, float) and 0 <= c.caption_dropout < 1):
        raise ValueError(f"data.corpus.caption_dropout must be in [0, 1), got {_show(c.caption_dropout)}")
    return [latent_shape(s) for s in c.sizes]
