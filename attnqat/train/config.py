"""Training configuration: nested dataclasses, loaded from YAML, validated before anything is built.

    cfg = load_config("configs/tiny.yaml", overrides=["train.lr=1e-4", "train.max_steps=20"])

Every key is checked: an unknown key, an unknown objective / attention mode / schedule, a missing
data folder, or latents that do not fit the transformer (channels, patch divisibility, text width)
raise ``ValueError`` naming the offending value, before any model is loaded or step is taken.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

import yaml

OBJECTIVES = ("distill", "flow", "mix")
DISTILL_TARGETS = ("output", "features")
LATENT_SOURCES = ("noise", "dataset", "teacher")
TIMESTEP_SAMPLING = ("uniform", "shifted")
LR_SCHEDULES = ("constant", "cosine")
MIXED_PRECISION = ("no", "bf16", "fp16")
SAVE_DTYPES = ("bf16", "fp32")
TRAINABLE = ("all", "attention")
DATA_SOURCES = ("precomputed", "corpus")


@dataclass
class AttentionConfig:
    mode: str = "attn_qat"          # the student's attention (trainable mode); the teacher runs bf16
    layers: Any = "self"            # "self" (attn1 of every block, the paper's setting), "all", or [block indices]
    options: dict = field(default_factory=dict)  # mode options, e.g. {p_bwd: normalized}


@dataclass
class ObjectiveConfig:
    type: str = "distill"           # distill | flow | mix (= distill + flow_weight * flow)
    target: str = "features"        # distill target: output (velocity) | features (every block + output)
    output_weight: float = 1.0      # features: weight of the output term beside the mean block term
    flow_weight: float = 1.0        # mix: weight of the flow-matching term
    latents: str = "noise"          # distill's clean latents x0: noise | dataset | teacher (teacher samples)
    teacher_steps: int = 8          # latents=teacher: Euler steps of the teacher's sampler


@dataclass
class TimestepConfig:
    sampling: str = "shifted"       # uniform sigma, or Wan's shift: s' = shift*s / (1 + (shift-1)*s)
    shift: float = 3.0              # Wan 2.1: 3.0 at 480p, 5.0 at 720p
    min_sigma: float = 0.001
    max_sigma: float = 1.0


@dataclass
class CorpusConfig:
    """``data.source: corpus``: clips of :mod:`attnqat.corpus`, encoded on the fly by the model's VAE."""
    seed: int = 0                   # corpus seed (clip attributes and captions)
    sizes: list = field(default_factory=lambda: [[33, 256, 256]])  # video sizes (frames, height, width)
    size_weights: list | None = None  # integer weight of each size in the cycle of step sizes (default: 1 each)
    pool: int = 1024                # encoded clips kept per size (0: encode every sample fresh)
    refresh: int = 8                # pool clips replaced by new ones per step of that size
    encode_batch: int = 16          # clips rendered and encoded at once
    caption_dropout: float = 0.1    # share of samples whose prompt is replaced by the empty one (for guidance)


@dataclass
class DataConfig:
    source: str = "precomputed"     # precomputed (data.path, or data-free) | corpus (the procedural corpus)
    path: str | None = None         # folder written by `attnqat precompute` (prompt embeddings, optional latents)
    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    latent_shape: list = field(default_factory=lambda: [16, 21, 60, 104])  # (C, F, H, W) for noise latents
    text_len: int = 512             # tokens of random prompt embeddings when path is null (data-free)
    batch_size: int = 1             # per process, per micro-batch
    held_out: int = 4               # samples in the fixed held-out set for the student-teacher gap
    held_out_seed: int = 12345


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
    trainable: str = "all"          # all | attention (only the patched attention modules' weights)
    teacher_dtype: str | None = None  # bf16 | fp32; default bf16 under bf16 mixed precision, else fp32
    from_scratch: bool = False      # start from a seeded random initialisation of the model's architecture
    ema_decay: float = 0.0          # > 0: keep an exponential moving average of the weights and export it


@dataclass
class CheckpointConfig:
    every: int = 500                # steps; the last step is always saved
    keep: int = 2                   # how many step checkpoints to keep (final/ is extra)
    save_dtype: str = "bf16"        # dtype of the exported transformer.safetensors


@dataclass
class LogConfig:
    every: int = 10                 # steps between log rows
    eval_every: int = 0             # steps between held-out gap evaluations (0: only at start and end)
    csv: bool = True
    tensorboard: bool = False
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
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"unknown config key {where + '.' if where else ''}{unknown[0]}; "
                         f"{where or 'top level'} takes: {', '.join(sorted(names))}")
    kwargs = {}
    for name, value in values.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value or {}, f"{where}.{name}" if where else name)
        else:
            kwargs[name] = _coerce(value, hint, f"{where}.{name}" if where else name)
    return cls(**kwargs)


def _coerce(value, hint, key):
    """YAML gives ``1e-6`` as a string and ints where floats are meant; fix those, refuse the rest."""
    if value is None:
        return None
    if hint is float or hint == "float":
        if isinstance(value, bool):
            raise ValueError(f"config key {key} must be a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(f"config key {key} must be a number, got {value!r}") from None
    if hint is int:
        if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, float) and value.is_integer())):
            raise ValueError(f"config key {key} must be an integer, got {value!r}")
        return int(value)
    if hint is bool:
        if not isinstance(value, bool):
            raise ValueError(f"config key {key} must be true or false, got {value!r}")
        return value
    return value


def _set_dotted(d: dict, key: str, value) -> None:
    parts = key.split(".")
    for p in parts[:-1]:
        d = d.setdefault(p, {})
        if not isinstance(d, dict):
            raise ValueError(f"override {key!r}: {p!r} is not a section")
    d[parts[-1]] = value


def config_from_dict(values: dict, overrides: list[str] | None = None) -> TrainConfig:
    values = json.loads(json.dumps(values or {}))  # deep copy
    for item in overrides or []:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like section.key=value (e.g. train.lr=1e-5)")
        key, raw = item.split("=", 1)
        _set_dotted(values, key.strip(), yaml.safe_load(raw))
    return _build(TrainConfig, values, "")


def load_config(path: str | Path, overrides: list[str] | None = None) -> TrainConfig:
    """Read a YAML config, apply ``section.key=value`` overrides, and check every value's form."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"config file {str(p)!r} does not exist")
    try:
        values = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"config file {str(p)!r} is not valid YAML: {e}".replace("\n", " ")) from e
    return config_from_dict(values, overrides)


def save_config(cfg: TrainConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


# ---------------------------------------------------------------------------------------------------------------
# Validation (everything a user can get wrong, checked before a model is built)


def _one_of(value, choices, key):
    if value not in choices:
        raise ValueError(f"{key} {value!r} is not one of {', '.join(map(str, choices))}")


def model_config(model: str) -> dict:
    """The ``WanTransformer3DModel`` config of ``model`` without loading any weight."""
    from attnqat.pipelines import TINY_TRANSFORMER_CONFIG, is_tiny
    from attnqat.pipelines.loading import resolve_model

    model = resolve_model(model)
    if is_tiny(model):
        return dict(TINY_TRANSFORMER_CONFIG)
    path = Path(model).expanduser()
    if path.is_dir():
        cfg = path / "transformer" / "config.json"
        if not cfg.is_file():
            cfg = path / "config.json"
        if not cfg.is_file():
            raise FileNotFoundError(f"model {model!r}: no transformer/config.json in that folder; expected a "
                                    f"diffusers-format Wan 2.1 folder")
        return json.loads(cfg.read_text())
    from attnqat.pipelines import ModelNotFoundError
    try:
        from diffusers import WanTransformer3DModel
        return dict(WanTransformer3DModel.load_config(model, subfolder="transformer"))
    except Exception as e:  # not cached / offline / unknown id
        raise ModelNotFoundError(f"model {model!r} is neither 'tiny', a local folder, nor a cached hub id "
                                 f"({type(e).__name__})") from e


def validate(cfg: TrainConfig, *, transformer_config: dict | None = None, device_type: str = "cpu") -> dict:
    """Check ``cfg`` against itself, its data folder and the transformer's config; return the data index
    (``{}`` when data-free). Raises ValueError / FileNotFoundError naming the offending value."""
    from attnqat.kernels import available_modes
    from attnqat.kernels.api import get_mode

    a, o, t, d, tr, ck = cfg.attention, cfg.objective, cfg.timesteps, cfg.data, cfg.train, cfg.checkpoint
    _one_of(o.type, OBJECTIVES, "objective.type")
    _one_of(o.target, DISTILL_TARGETS, "objective.target")
    _one_of(o.latents, LATENT_SOURCES, "objective.latents")
    _one_of(t.sampling, TIMESTEP_SAMPLING, "timesteps.sampling")
    _one_of(tr.lr_schedule, LR_SCHEDULES, "train.lr_schedule")
    _one_of(tr.mixed_precision, MIXED_PRECISION, "train.mixed_precision")
    _one_of(tr.trainable, TRAINABLE, "train.trainable")
    _one_of(ck.save_dtype, SAVE_DTYPES, "checkpoint.save_dtype")
    if tr.teacher_dtype is not None:
        _one_of(tr.teacher_dtype, SAVE_DTYPES, "train.teacher_dtype")
    if a.mode not in available_modes():
        raise ValueError(f"attention.mode {a.mode!r} is not one of {', '.join(available_modes())}")
    if not get_mode(a.mode).trainable:
        raise ValueError(f"attention.mode {a.mode!r} is inference-only; train with a trainable mode "
                         f"(attn_qat, attn_qat_dropin, sagebwd, bf16)")
    if not (a.layers in ("self", "all") or (isinstance(a.layers, list) and all(isinstance(i, int) for i in a.layers))):
        raise ValueError(f"attention.layers {a.layers!r} must be 'self', 'all' or a list of block indices")
    if not isinstance(a.options, dict):
        raise ValueError(f"attention.options must be a mapping, got {a.options!r}")
    for key, value, lo in (("train.max_steps", tr.max_steps, 1), ("data.batch_size", d.batch_size, 1),
                           ("train.gradient_accumulation_steps", tr.gradient_accumulation_steps, 1),
                           ("train.warmup_steps", tr.warmup_steps, 0), ("checkpoint.every", ck.every, 1),
                           ("checkpoint.keep", ck.keep, 1), ("log.every", cfg.log.every, 1),
                           ("log.eval_every", cfg.log.eval_every, 0), ("data.held_out", d.held_out, 0),
                           ("data.text_len", d.text_len, 1), ("objective.teacher_steps", o.teacher_steps, 1)):
        if value < lo:
            raise ValueError(f"{key} must be >= {lo}, got {value}")
    if not tr.lr > 0:
        raise ValueError(f"train.lr must be > 0, got {tr.lr}")
    if tr.weight_decay < 0 or tr.grad_clip < 0:
        raise ValueError(f"train.weight_decay and train.grad_clip must be >= 0, got {tr.weight_decay}, {tr.grad_clip}")
    if not (isinstance(tr.betas, list) and len(tr.betas) == 2 and all(0 <= float(b) < 1 for b in tr.betas)):
        raise ValueError(f"train.betas must be two numbers in [0, 1), got {tr.betas!r}")
    if not 0 <= t.min_sigma < t.max_sigma <= 1:
        raise ValueError(f"timesteps: need 0 <= min_sigma < max_sigma <= 1, got {t.min_sigma}, {t.max_sigma}")
    if t.shift <= 0:
        raise ValueError(f"timesteps.shift must be > 0, got {t.shift}")

    # Data
    index: dict = {}
    _one_of(d.source, DATA_SOURCES, "data.source")
    needs_latents = o.type in ("flow", "mix") or o.latents == "dataset"
    if d.source == "corpus":
        shapes = _corpus_shapes(d.corpus, d.path)
        index["has_latents"] = True
    else:
        if d.path is not None:
            from .data import read_index
            index = read_index(d.path)
        if needs_latents:
            why = f"objective.type {o.type!r}" if o.type != "distill" else "objective.latents 'dataset'"
            if d.path is None:
                raise ValueError(f"{why} needs a dataset of video latents: set data.path to a folder written by "
                                 f"`attnqat precompute --videos ...`, or data.source: corpus")
            if not index.get("has_latents"):
                raise ValueError(f"{why} needs video latents, but data.path {d.path!r} holds prompt embeddings "
                                 f"only; run `attnqat precompute` with --videos")
        shapes = [list(index["latent_shape"]) if needs_latents else list(d.latent_shape)]
    for shape in shapes:
        if len(shape) != 4 or not all(isinstance(x, int) and x > 0 for x in shape):
            raise ValueError(f"data.latent_shape must be 4 positive integers (C, F, H, W), got {shape!r}")
    if tr.ema_decay != 0 and not 0 < tr.ema_decay < 1:
        raise ValueError(f"train.ema_decay must be 0 (off) or in (0, 1), got {tr.ema_decay}")

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
    if index.get("text_dim") is not None and index["text_dim"] != text_dim:
        raise ValueError(f"prompt embeddings in {d.path!r} have width {index['text_dim']}, but the transformer's "
                         f"text_dim is {text_dim}: were they encoded with another model's text encoder?")
    head_dim = tc["attention_head_dim"]
    if device_type == "cuda" and a.mode != "bf16" and head_dim not in (64, 128):
        raise ValueError(f"attention mode {a.mode!r} on GPU needs head_dim 64 or 128; the model's is {head_dim}")
    if isinstance(a.layers, list):
        bad = [i for i in a.layers if not 0 <= i < tc["num_layers"]]
        if bad:
            raise ValueError(f"attention.layers {bad} out of range: the transformer has {tc['num_layers']} blocks")
    if device_type == "cpu" and tr.mixed_precision == "fp16":
        raise ValueError("train.mixed_precision 'fp16' needs a GPU; use 'no' on CPU")
    index["latent_shape"] = shapes[0]
    index["latent_shapes"] = shapes
    return index


def _corpus_shapes(c: CorpusConfig, path) -> list[list[int]]:
    """Latent shapes of ``data.corpus.sizes``, after checking the section."""
    if path is not None:
        raise ValueError("data.path and data.source 'corpus' exclude each other; set data.path: null")
    if not (isinstance(c.sizes, list) and c.sizes and all(isinstance(s, list) and len(s) == 3 for s in c.sizes)):
        raise ValueError(f"data.corpus.sizes must be a list of [frames, height, width], got {c.sizes!r}")
    for f, h, w in c.sizes:
        if not all(isinstance(x, int) for x in (f, h, w)) or f < 1 or (f - 1) % 4 or h < 32 or w < 32 or h % 16 or w % 16:
            raise ValueError(f"data.corpus.sizes entry {[f, h, w]} must have frames 4k+1 and height, width multiples "
                             f"of 16 (>= 32)")
    if c.size_weights is not None and not (isinstance(c.size_weights, list) and len(c.size_weights) == len(c.sizes)
                                           and all(isinstance(x, int) and x >= 0 for x in c.size_weights)
                                           and sum(c.size_weights) > 0):
        raise ValueError(f"data.corpus.size_weights must be one non-negative integer per size, got {c.size_weights!r}")
    if c.pool < 0 or c.refresh < 1 or c.encode_batch < 1 or (c.pool and c.refresh > c.pool):
        raise ValueError(f"data.corpus: need pool >= 0, 1 <= refresh <= pool, encode_batch >= 1; got pool {c.pool}, "
                         f"refresh {c.refresh}, encode_batch {c.encode_batch}")
    if not 0 <= c.caption_dropout < 1:
        raise ValueError(f"data.corpus.caption_dropout must be in [0, 1), got {c.caption_dropout}")
    from .corpus_source import latent_shape
    return [latent_shape(s) for s in c.sizes]
