"""What a diffusers-format Wan 2.1 folder must hold before any of it loads: files (not FIFOs, devices or
sockets), component configs whose sizes are whole numbers within bounds, and safetensors weights that hold
the blocks the configs name.

A folder is data from anywhere: its ``config.json`` sizes the models that diffusers and transformers build
(an ``attention_head_dim`` of 10^6 with 10,000 layers allocates tens of GB before a weight is read), a FIFO
blocks the first read forever, and a pickle can run code when loaded. :func:`check_model_folder` reads only
the small JSON files and the safetensors headers, and raises :class:`ModelConfigError` (a ``ValueError``: the
command-line tools print it as one line and exit with status 2) naming the file, the value and the bound's
reason. The bounds are typo guards at ten times the largest Wan 2.1 (14B), far above anything it is made for.
"""
from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

__all__ = ["ModelConfigError", "CONFIG_BOUNDS", "check_model_folder", "check_regular_file"]


class ModelConfigError(ValueError):
    """Model files that cannot be loaded safely: a special file (in a model folder, or as a QAT checkpoint), a
    config value of the wrong type or beyond its bound, pickled weights, weights without the blocks the config
    names."""


def _tenfold(value: int, fact: str) -> tuple[int, str]:
    """A bound at ten times ``value`` and its reason, ``fact`` (which states ``value``)."""
    return 10 * value, f"{fact}; the limit is 10x that"


# component folder -> config key -> (lowest, highest, reason of the highest). Keys absent from a config take
# the model class's default; present ones must be whole numbers (not text, not true/false) within bounds.
CONFIG_BOUNDS: dict[str, dict[str, tuple[int, int, str]]] = {
    "transformer": {
        "num_layers": (1, *_tenfold(40, "Wan 2.1 14B has 40 blocks")),
        "num_attention_heads": (1, *_tenfold(40, "Wan 2.1 14B has 40 heads")),
        "attention_head_dim": (1, *_tenfold(128, "Wan 2.1's heads are 128 wide")),
        "ffn_dim": (1, *_tenfold(13824, "Wan 2.1 14B's FFN is 13,824 wide")),
        "in_channels": (1, *_tenfold(16, "Wan 2.1's latents have 16 channels")),
        "out_channels": (1, *_tenfold(16, "Wan 2.1's latents have 16 channels")),
        "text_dim": (1, *_tenfold(4096, "UMT5-XXL's text features are 4,096 wide")),
        "freq_dim": (1, *_tenfold(256, "Wan 2.1's is 256")),
        "rope_max_seq_len": (1, *_tenfold(1024, "Wan 2.1's is 1,024")),
    },
    "vae": {
        "base_dim": (1, *_tenfold(96, "Wan 2.1's VAE has 96")),
        "z_dim": (1, *_tenfold(16, "Wan 2.1's latents have 16 channels")),
        "num_res_blocks": (1, *_tenfold(2, "Wan 2.1's VAE has 2")),
        "in_channels": (1, *_tenfold(3, "video is RGB, 3 channels")),
        "out_channels": (1, *_tenfold(3, "video is RGB, 3 channels")),
    },
    "text_encoder": {
        "num_layers": (1, *_tenfold(24, "UMT5-XXL has 24 layers")),
        "num_heads": (1, *_tenfold(64, "UMT5-XXL has 64 heads")),
        "d_model": (1, *_tenfold(4096, "UMT5-XXL's is 4,096")),
        "d_kv": (1, *_tenfold(64, "UMT5-XXL's is 64")),
        "d_ff": (1, *_tenfold(10240, "UMT5-XXL's is 10,240")),
        "vocab_size": (1, *_tenfold(256384, "UMT5 has 256,384 tokens")),
    },
}
# The product the attention projections are sized by: heads x head dim.
HIDDEN_BOUND = _tenfold(5120, "Wan 2.1 14B has 40 heads of 128, 5,120")
# Lists of whole numbers in a config: key -> (length range, value range, reason).
LIST_BOUNDS = {
    "transformer": {"patch_size": ((3, 3), (1, 16), "Wan 2.1 patches (frames, height, width) by (1, 2, 2)")},
    "vae": {"dim_mult": ((1, 8), (1, 16), "Wan 2.1's VAE uses [1, 2, 4, 4]")},
}
# Weights named by their blocks: component -> (weights file stem, config key of the block count, key pattern).
BLOCK_KEYS = {
    "transformer": ("diffusion_pytorch_model", "num_layers", re.compile(r"blocks\.(\d+)\.")),
    "vae": ("diffusion_pytorch_model", None, None),
    "text_encoder": ("model", "num_layers", re.compile(r"encoder\.block\.(\d+)\.")),
}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
MAX_JSON_BYTES = 64 * 2 ** 20  # a 14B model's weight index is ~100 KB; its configs are ~2 KB


def check_regular_file(path: Path, what: str) -> None:
    """``path`` (followed through symbolic links) is a regular file: a FIFO would block the first read for
    ever, a device would stream without end. Missing is left to the caller."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as e:  # a loop of symbolic links, a file as a parent folder ...
        raise ModelConfigError(f"{what} {str(path)!r}: {e.strerror or e}") from None
    if not stat.S_ISREG(mode):
        kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a folder" if stat.S_ISDIR(mode)
                else "not a regular file")
        raise ModelConfigError(f"{what} {str(path)!r} is {kind}; only regular files are read")


def _read_json(path: Path, what: str):
    check_regular_file(path, what)
    if path.stat().st_size > MAX_JSON_BYTES:
        raise ModelConfigError(f"{what} {str(path)!r} is {path.stat().st_size:,} bytes; the limit is "
                               f"{MAX_JSON_BYTES:,}")
    try:
        return json.loads(path.read_bytes())
    except (OSError, ValueError) as e:
        raise ModelConfigError(f"{what} {str(path)!r} is not readable JSON: {str(e).splitlines()[0]}") from None


def _show(value) -> str:
    r = repr(value)
    return r if len(r) <= 60 else r[:57] + "..."


def _whole(where: str, key: str, value, lo: int, hi: int, why: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelConfigError(f"{where}: {key} must be a whole number, got {_show(value)}")
    if value < lo:
        raise ModelConfigError(f"{where}: {key} {value} must be at least {lo}")
    if value > hi:
        raise ModelConfigError(f"{where}: {key} {value:,} is above the limit of {hi:,} ({why})")
    return value


def check_config(component: str, config, where: str) -> None:
    """A component's ``config.json`` (already parsed): every bounded key that it holds, and heads x head dim."""
    if not isinstance(config, dict):
        raise ModelConfigError(f"{where} must hold a JSON object, got {type(config).__name__}")
    for key, (lo, hi, why) in CONFIG_BOUNDS.get(component, {}).items():
        if key in config:
            _whole(where, key, config[key], lo, hi, why)
    for key, ((n_lo, n_hi), (lo, hi), why) in LIST_BOUNDS.get(component, {}).items():
        if key not in config:
            continue
        value = config[key]
        if not isinstance(value, list) or not n_lo <= len(value) <= n_hi:
            size = str(n_lo) if n_lo == n_hi else f"{n_lo} to {n_hi}"
            raise ModelConfigError(f"{where}: {key} must be a list of {size} whole numbers, got {_show(value)} ({why})")
        for v in value:
            _whole(where, f"{key} entry", v, lo, hi, why)
    if component == "transformer" and {"num_attention_heads", "attention_head_dim"} <= set(config):
        width = config["num_attention_heads"] * config["attention_head_dim"]
        _whole(where, "num_attention_heads x attention_head_dim", width, 1, *HIDDEN_BOUND)


def _weight_keys(folder: Path, component: str, stem: str) -> list[str] | None:
    """The tensor names of a component's safetensors weights (its index, or its one file's header); None when
    it has none (diffusers and transformers then say what is missing). Pickled weights are refused."""
    from safetensors import safe_open

    index = folder / f"{stem}.safetensors.index.json"
    single = folder / f"{stem}.safetensors"
    if index.exists():
        data = _read_json(index, "weight index")
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise ModelConfigError(f"weight index {str(index)!r} has no weight_map of tensor names to files")
        for name in sorted(set(weight_map.values())):
            shard = folder / name
            if Path(name).name != name:
                raise ModelConfigError(f"weight index {str(index)!r} names {name!r}, outside its folder")
            check_regular_file(shard, "weights file")
        return list(weight_map)
    if single.exists():
        check_regular_file(single, "weights file")
        try:
            with safe_open(str(single), framework="pt") as f:
                return list(f.keys())
        except Exception as e:  # safetensors raises its own error types for a corrupt header
            raise ModelConfigError(f"weights file {str(single)!r} is not readable safetensors: "
                                   f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    pickles = sorted(p.name for p in folder.iterdir() if p.name.endswith(PICKLE_SUFFIXES)) if folder.is_dir() else []
    if pickles:
        raise ModelConfigError(f"{component}/{pickles[0]} in {str(folder.parent)!r} holds pickled weights: attnqat "
                               f"loads only .safetensors weights (loading a pickle can run code); convert it to "
                               f"{stem}.safetensors")
    return None


def _check_blocks(folder: Path, component: str, config: dict, where: str) -> None:
    stem, count_key, pattern = BLOCK_KEYS[component]
    keys = _weight_keys(folder, component, stem)
    if keys is None or count_key is None or count_key not in config:
        return
    held = sorted({int(m.group(1)) for k in keys if (m := pattern.match(k))})
    want = config[count_key]
    if held != list(range(want)):
        has = (f"{len(held)} blocks (0 to {held[-1]})" if held == list(range(len(held))) and held
               else f"blocks {held[:6]}{'...' if len(held) > 6 else ''}" if held else "no blocks")
        raise ModelConfigError(f"{where}: {count_key} is {want}, but the weights beside it hold {has}: the config "
                               f"does not describe these weights")


def _check_entries(folder: Path) -> None:
    """Every entry of the folder and of its component folders is a regular file or a folder."""
    for top in [folder, *(p for p in sorted(folder.iterdir()) if p.is_dir())]:
        for p in top.iterdir():
            if p.is_dir():
                continue
            check_regular_file(p, "model file")


def check_model_folder(folder: str | os.PathLike, components: tuple[str, ...] | None = None) -> None:
    """Refuse a diffusers-format model folder whose files cannot be loaded safely (:class:`ModelConfigError`):
    special files anywhere in it or its component folders; ``components``' (default: transformer, vae,
    text_encoder, those present) configs with values of the wrong type or beyond :data:`CONFIG_BOUNDS`; pickled
    weights; weights that do not hold the blocks the config names. Reads JSON and safetensors headers only."""
    folder = Path(folder)
    try:
        _check_entries(folder)
    except OSError as e:
        raise ModelConfigError(f"model folder {str(folder)!r}: {e.strerror or e}") from None
    for component in components or tuple(BLOCK_KEYS):
        sub = folder / component
        config_path = sub / "config.json"
        if component not in BLOCK_KEYS or not config_path.exists():
            continue
        where = f"{component}/config.json in {str(folder)!r}"
        config = _read_json(config_path, "model config")
        check_config(component, config, where)
        _check_blocks(sub, component, config, where)
