"""Training checkpoints that load without unpickling, prove their integrity, and survive a kill.

A checkpoint folder (``OUTPUT/checkpoints/step-NNNNNNN/``, and ``OUTPUT/final/`` without ``state/``)::

    transformer.safetensors     the exported weights (checkpoint.save_dtype), what `generate` loads; a LoRA run
                                writes the LoRA file pytorch_lora_weights.safetensors instead; neither in a step
                                checkpoint under checkpoint.export: false
    config.yaml                 the run's config
    trainer_state.json          {"step", "position"}
    state/model.safetensors     fp32 master weights (full state dict; a LoRA run's: the adapter's alone)
    state/optimizer.safetensors the optimizer's state tensors (t0, t1, ...), a full state dict flattened
    state/optimizer.json        everything else of it: param groups, which tensor is which, and the
                                train.optimizer that wrote it ("optimizer": adamw, adamw8bit)
    state/scheduler.json        the LR scheduler's state_dict
    state/scaler.json           fp16 loss scaler (only under fp16 mixed precision)
    state/rng-R.safetensors     process R's torch (CPU, CUDA) RNG states; Python's and NumPy's in its metadata
    manifest.json               written last: the size and sha256 of every other file

With ``checkpoint.format: sharded`` (:func:`layout_for`; the manifest says ``"layout": "sharded"``) the two
full-state files are replaced by ``state/shards/``: one safetensors file per process, each written by its own
process through ``torch.distributed.checkpoint`` (the safetensors files of DCP's ``HuggingFaceStorageWriter``,
streamed a piece at a time by :mod:`attnqat.train.shard_writer`: the tensors and, in the header's metadata, where
each piece sits in its whole tensor; no ``.metadata`` pickle), holding that process's
part of the fp32 master weights (``model/FQN``) and of the optimizer state (``optimizer/FQN/KEY``); the rest of
the optimizer state stays in ``state/optimizer.json``. Nothing is gathered to one process, and DCP reshards on
load, so a run may resume on another number of processes.

Only safetensors and JSON are ever read back (``safetensors.torch.load_file``, ``json.loads``): a checkpoint
from someone else cannot run code. Folders written by accelerate's ``save_state`` (older attnqat: pickles
in ``state/``) are refused by name. Files the manifest does not list are never opened.

Every folder is written as ``NAME.tmp/`` (files fsynced, manifest last), then committed by renames:
``NAME -> NAME.old``, ``NAME.tmp -> NAME``, delete ``NAME.old``. :func:`recover` finishes or undoes an
interrupted commit from whatever a kill left, and never deletes the only complete copy.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import random
import re
import shutil
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from attnqat.errors import OutputWriteError
from attnqat.outputs import save_safetensors
from attnqat.pipelines.loading import CHECKPOINTS_DIR, FINAL_DIR, MANIFEST, STEP_DIR
from attnqat.train.shard_writer import StreamingShardWriter

FORMAT = "attnqat-checkpoint"
VERSION = 1
LAYOUTS = ("full", "sharded")  # a manifest without "layout" is full (written before sharded checkpoints existed)
SHARDS = "state/shards"
MAX_MANIFEST_BYTES = 16 << 20
KNOWN_SIDE = (".tmp", ".old")  # an interrupted write (.tmp) or commit (.old)
CORRUPT = ".corrupt"  # a checkpoint that failed verification, moved aside by --resume auto


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: incomplete, corrupt, a legacy pickle checkpoint, or another model's."""


class NonFiniteTrainingError(ValueError):
    """Training produced NaN or inf (loss, gradient norm, learning rate or weights); nothing non-finite is
    written. A ValueError: the CLI prints it as one line (exit 2); the usual fix is a lower train.lr."""


# ---------------------------------------------------------------------------------------------------------------
# Durable, atomic files


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``path`` as a whole or not at all: a temporary name, fsync, one rename."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_json(path: Path, data) -> None:
    """JSON, durably. NaN/Infinity are allowed (Python reads them back): a faithful snapshot even if the
    scheduler's next lr is not finite (the loop refuses to step with it; tensors are checked before saving)."""
    with open(path, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())


def write_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    save_safetensors(path, {k: v.detach().contiguous() for k, v in tensors.items()}, metadata=metadata)
    fsync_file(path)


# ---------------------------------------------------------------------------------------------------------------
# Manifest


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def _hash_all(paths: list[Path]) -> list[str]:
    # hashlib releases the GIL: files hash in parallel (a 14B checkpoint holds ~150 GB)
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(paths)))) as pool:
        return list(pool.map(_sha256, paths))


def write_manifest(folder: Path, *, kind: str, step: int, layout: str = "full") -> None:
    """List every file of ``folder`` with its size and sha256 in ``folder/manifest.json``; written last and
    atomically, so a folder with a manifest is complete. ``layout``: how the training state is stored (LAYOUTS)."""
    folder = Path(folder)
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    digests = _hash_all(files)
    manifest = {"format": FORMAT, "version": VERSION, "kind": kind, "step": int(step), "layout": layout,
                "files": {p.relative_to(folder).as_posix(): {"size": p.stat().st_size, "sha256": d}
                          for p, d in zip(files, digests)}}
    atomic_write_text(folder / MANIFEST, json.dumps(manifest, indent=1))


def is_legacy(folder: Path) -> bool:
    """A checkpoint written by accelerate's save_state (pickles in state/): never loaded."""
    state = Path(folder) / "state"
    return state.is_dir() and any(p.suffix in (".pkl", ".bin", ".pt", ".pth") for p in state.iterdir())


def read_manifest(folder: Path) -> dict:
    """The manifest of ``folder``, checked for form (not against the files); raises CheckpointError."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        if is_legacy(folder):
            raise CheckpointError(f"{folder} was written by an older attnqat (accelerate pickles in state/), which "
                                  f"--resume does not load: unpickling a file can run code. Start a new run")
        raise CheckpointError(f"{folder} has no {MANIFEST}: an incomplete write, or not an attnqat checkpoint")
    if path.stat().st_size > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"{path} is larger than {MAX_MANIFEST_BYTES >> 20} MB: not an attnqat manifest")
    try:
        m = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e})") from None
    ok = (isinstance(m, dict) and m.get("format") == FORMAT and m.get("version") == VERSION
          and isinstance(m.get("step"), int) and m.get("kind") in ("checkpoint", "final")
          and m.get("layout", "full") in LAYOUTS and isinstance(m.get("files"), dict))
    if not ok:
        raise CheckpointError(f"{path} is not an attnqat {FORMAT} v{VERSION} manifest")
    for rel, info in m["files"].items():
        parts = Path(rel).parts
        if (not isinstance(info, dict) or not isinstance(info.get("size"), int)
                or not re.fullmatch(r"[0-9a-f]{64}", str(info.get("sha256")))
                or Path(rel).is_absolute() or not parts or ".." in parts or "\\" in rel):
            raise CheckpointError(f"{path}: bad entry {rel[:80]!r}")
    return m


def verify(folder: Path, *, full: bool = True) -> dict:
    """Check ``folder`` against its manifest: every listed file is a regular file inside the folder of the
    listed size and (``full``) sha256. Returns the manifest; raises CheckpointError naming what is wrong."""
    folder = Path(folder)
    m = read_manifest(folder)
    root = folder.resolve()
    paths = []
    for rel, info in m["files"].items():
        p = folder / rel
        if p.is_symlink() or not p.is_file() or not p.resolve().is_relative_to(root):
            raise CheckpointError(f"{folder}: {rel} is missing (listed in {MANIFEST})")
        if p.stat().st_size != info["size"]:
            raise CheckpointError(f"{folder}: {rel} has {p.stat().st_size} bytes, the manifest says {info['size']}")
        paths.append((p, rel, info["sha256"]))
    if full:
        for (p, rel, want), got in zip(paths, _hash_all([p for p, _, _ in paths])):
            if got != want:
                raise CheckpointError(f"{folder}: {rel} is corrupt (sha256 differs from {MANIFEST})")
    return m


def is_complete(folder: Path) -> bool:
    """Cheap check (manifest and file sizes, no hashing): a write that finished."""
    try:
        verify(folder, full=False)
        return True
    except (CheckpointError, OSError):
        return False


def listed(folder: Path, manifest: dict, rel: str) -> Path:
    """``folder/rel``, refusing a file the manifest does not list (it is never opened)."""
    if rel not in manifest["files"]:
        raise CheckpointError(f"{folder}: {rel} is not listed in its {MANIFEST}")
    return Path(folder) / rel


# ---------------------------------------------------------------------------------------------------------------
# Committing a folder, and recovering from a kill


def commit(tmp: Path, target: Path) -> None:
    """Replace ``target`` by the complete folder ``tmp`` (two renames; :func:`recover` handles a kill between)."""
    old = target.with_name(target.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if target.exists():
        os.replace(target, old)
    os.replace(tmp, target)
    fsync_dir(target.parent)
    if old.exists():
        shutil.rmtree(old)


def recover(target: Path, log=print) -> None:
    """Finish or undo an interrupted write of ``target`` from ``target.tmp`` / ``target.old``.

    A complete ``.tmp`` is the newest copy (it is written after ``target`` was last committed): commit it. Else
    a complete ``target`` stays, and the partial ``.tmp`` and stale ``.old`` go. Else a complete ``.old`` (a kill
    between the two renames of a commit) is put back. A copy is deleted only when a complete one remains."""
    target = Path(target)
    tmp, old = target.with_name(target.name + ".tmp"), target.with_name(target.name + ".old")
    if not (tmp.exists() or old.exists()):
        return
    if tmp.is_dir() and is_complete(tmp):
        if target.exists() and not is_complete(target):
            _move_aside(target, log)
        commit(tmp, target)
        log(f"attnqat train: finished the interrupted write of {target}")
    elif target.is_dir() and is_complete(target):
        for p in (tmp, old):
            if p.exists():
                shutil.rmtree(p) if p.is_dir() else p.unlink()
    elif old.is_dir() and is_complete(old):
        if target.exists():
            _move_aside(target, log)
        os.replace(old, target)
        fsync_dir(target.parent)
        if tmp.exists():
            shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()
        log(f"attnqat train: restored {target} from {old.name} (a write was interrupted)")
    elif tmp.exists():  # nothing complete anywhere: the partial .tmp is no copy of anything
        shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()


def _move_aside(folder: Path, log) -> Path:
    dest = folder.with_name(folder.name + CORRUPT)
    n = 1
    while dest.exists():
        n += 1
        dest = folder.with_name(f"{folder.name}{CORRUPT}{n}")
    os.replace(folder, dest)
    fsync_dir(folder.parent)
    log(f"attnqat train: moved the incomplete or corrupt {folder.name} aside to {dest.name}")
    return dest


def move_aside(folder: Path, log=print) -> Path:
    """Rename a checkpoint that failed verification to ``NAME.corrupt`` (kept for inspection, never loaded)."""
    return _move_aside(Path(folder), log)


def recover_run(output_dir: Path, log=print) -> None:
    """:func:`recover` ``final/`` and every checkpoint of a run folder."""
    output_dir = Path(output_dir)
    recover(output_dir / FINAL_DIR, log)
    ckpts = output_dir / CHECKPOINTS_DIR
    if ckpts.is_dir():
        names = {p.name.removesuffix(s) for p in ckpts.iterdir() for s in KNOWN_SIDE if p.name.endswith(s)}
        for name in sorted(n for n in names if STEP_DIR.fullmatch(n)):
            recover(ckpts / name, log)


def step_dirs(output_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of ``OUTPUT/checkpoints/step-NNNNNNN``, oldest first (committed names only)."""
    ckpts = Path(output_dir) / CHECKPOINTS_DIR
    if not ckpts.is_dir():
        return []
    out = [(int(m.group(1)), p) for p in ckpts.iterdir() if (m := STEP_DIR.fullmatch(p.name)) and p.is_dir()]
    return sorted(out)


# ---------------------------------------------------------------------------------------------------------------
# What a run folder holds (the refusal to mix runs, and --overwrite)

RUN_CONFIG = "run_config.yaml"
LOG = "log.csv"


LEGACY_ENTRIES = {"state", "transformer.safetensors", "config.yaml", "trainer_state.json"}


def is_ours(folder: Path) -> bool:
    """A checkpoint-shaped folder attnqat wrote: a manifest of ours, or the older layout (transformer.safetensors
    beside at most state/, config.yaml, trainer_state.json)."""
    folder = Path(folder)
    if not folder.is_dir():
        return False
    if (folder / MANIFEST).is_file():
        try:
            read_manifest(folder)
            return True
        except (CheckpointError, OSError):
            return False
    names = {p.name for p in folder.iterdir()}
    return "transformer.safetensors" in names and names <= LEGACY_ENTRIES


def our_log(path: Path) -> bool:
    """A log.csv attnqat wrote (its header starts with step,loss,)."""
    try:
        with open(path, newline="") as f:
            return f.readline().startswith("step,loss,")
    except (OSError, UnicodeDecodeError):
        return False


def run_artifacts(output_dir: Path) -> list[Path]:
    """What an earlier attnqat run left in ``output_dir``: its log, config, final/ and checkpoints (and their
    interrupted .tmp / .old / .corrupt copies). Anything else in the folder is the user's and never touched."""
    out_dir = Path(output_dir)
    if not out_dir.is_dir():
        return []
    found = []
    for name in (LOG, LOG + ".tmp"):
        if (out_dir / name).is_file() and (our_log(out_dir / name) or name.endswith(".tmp")):
            found.append(out_dir / name)
    for name in (RUN_CONFIG, RUN_CONFIG + ".tmp"):
        if (out_dir / name).is_file():
            found.append(out_dir / name)
    for p in sorted(out_dir.glob("final*")):
        if p.is_dir() and (p.name == "final" and is_ours(p) or re.fullmatch(r"final(\.tmp|\.old|\.corrupt\d*)", p.name)):
            found.append(p)
    for name in ("tensorboard", TRACKERS):  # tensorboard/: older attnqat's SummaryWriter
        if _only_tensorboard_files(out_dir / name):
            found.append(out_dir / name)
    ckpts = out_dir / "checkpoints"
    if ckpts.is_dir():
        for p in sorted(ckpts.iterdir()):
            if not p.is_dir():
                continue
            if STEP_DIR.fullmatch(p.name) and is_ours(p):
                found.append(p)
            elif re.fullmatch(STEP_DIR.pattern + r"(\.tmp|\.old|\.corrupt\d*)", p.name):
                found.append(p)
    return found


TRACKERS = "trackers"  # accelerate's logging_dir for log.trackers (TensorBoard's events in trackers/PROJECT/)


def _only_tensorboard_files(folder: Path) -> bool:
    """``folder`` holds nothing but what TensorBoard writes there through accelerate: event files, and the
    hparams.yml of its init_trackers (in a folder named by the time), at any depth."""
    if not folder.is_dir() or folder.is_symlink():
        return False
    for p in folder.rglob("*"):
        if p.is_symlink() or (p.is_file() and not (p.name.startswith("events.out.tfevents.") or p.name == "hparams.yml")):
            return False
    return True


def remove_run(output_dir: Path, log=print) -> list[Path]:
    """``--overwrite``: delete what :func:`run_artifacts` lists (and checkpoints/ if that empties it)."""
    removed = run_artifacts(output_dir)
    for p in removed:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    ckpts = Path(output_dir) / "checkpoints"
    if ckpts.is_dir() and not any(ckpts.iterdir()):
        ckpts.rmdir()
    if removed:
        fsync_dir(Path(output_dir))
        log(f"attnqat train: --overwrite removed the earlier run in {output_dir} ({len(removed)} entries)")
    return removed


# ---------------------------------------------------------------------------------------------------------------
# Optimizer and RNG state as tensors + JSON


def encode(value):
    """JSON form of an optimizer's non-tensor values (tuples tagged, so they come back as tuples)."""
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v) for v in value]}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        return {str(k): encode(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"optimizer state value of type {type(value).__name__} cannot be stored as JSON")


def decode(value):
    if isinstance(value, dict):
        if set(value) == {"__tuple__"}:
            return tuple(decode(v) for v in value["__tuple__"])
        return {k: decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode(v) for v in value]
    return value


def flatten_optimizer(osd: dict, name=None) -> tuple[dict[str, torch.Tensor], dict]:
    """A (FQN-keyed) optimizer state dict -> (its tensors, JSON-able structure naming them). The tensors are named
    t0, t1, ... and copied to the CPU (a full state dict), or ``name(fqn, key)`` and left as they are (a sharded
    one: DTensor / ShardedTensor on the device, which DCP writes piece by piece)."""
    tensors: dict[str, torch.Tensor] = {}
    state = {}
    for fqn, entries in osd.get("state", {}).items():
        state[str(fqn)] = {}
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                ref = f"t{len(tensors)}" if name is None else name(fqn, key)
                tensors[ref] = value.detach().cpu() if name is None else value
                state[str(fqn)][key] = {"tensor": ref}
            else:
                state[str(fqn)][key] = {"value": encode(value)}
    return tensors, {"state": state, "param_groups": encode(osd.get("param_groups", []))}


def unflatten_optimizer(tensors: dict[str, torch.Tensor], structure: dict) -> dict:
    if not isinstance(structure, dict) or not isinstance(structure.get("state"), dict):
        raise CheckpointError("optimizer.json is not an attnqat optimizer structure")
    state = {}
    for fqn, entries in structure["state"].items():
        state[fqn] = {}
        for key, ref in entries.items():
            if isinstance(ref, dict) and "tensor" in ref:
                if ref["tensor"] not in tensors:
                    raise CheckpointError(f"optimizer.json names tensor {ref['tensor']!r}, absent from the safetensors")
                state[fqn][key] = tensors[ref["tensor"]]
            elif isinstance(ref, dict) and "value" in ref:
                state[fqn][key] = decode(ref["value"])
            else:
                raise CheckpointError(f"optimizer.json: bad entry for {fqn}/{key}")
    return {"state": state, "param_groups": decode(structure.get("param_groups", []))}


def saved_optimizer(structure) -> str | None:
    """The ``train.optimizer`` whose state optimizer.json's ``structure`` holds: recorded as its ``"optimizer"``;
    in a checkpoint written before that was recorded, told from the state itself: 8-bit moment codes, or param
    groups without torch AdamW's ``maximize`` (torchao's AdamW8bit has none), are ``adamw8bit``'s, param groups
    with it ``adamw``'s. None where it cannot tell (no param groups)."""
    if not isinstance(structure, dict):
        return None
    if isinstance(structure.get("optimizer"), str):
        return structure["optimizer"]
    state, groups = structure.get("state"), structure.get("param_groups")
    if isinstance(state, dict) and any(isinstance(e, dict) and any(str(k).endswith("_codes") for k in e)
                                       for e in state.values()):
        return "adamw8bit"
    if not isinstance(groups, list) or not groups or not all(isinstance(g, dict) for g in groups):
        return None
    return "adamw" if all("maximize" in g for g in groups) else "adamw8bit"


def check_optimizer(folder: Path, structure, name: str) -> None:
    """Refuse (CheckpointError, one line) to resume checkpoint ``folder``, whose optimizer.json is ``structure``,
    into a run whose ``train.optimizer`` is ``name`` when another optimizer wrote it: their states do not convert
    (torch AdamW's fp32 moments against AdamW8bit's 8-bit codes and block scales, and other param groups)."""
    saved = saved_optimizer(structure)
    if saved is not None and saved != name:
        raise CheckpointError(f"checkpoint {str(folder)!r} holds train.optimizer {saved!r}'s state, which does not "
                              f"load into this run's {name!r}: resume with train.optimizer={saved}, or start a new "
                              f"run in another output_dir")


def rng_state() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """This process's RNG states: torch CPU/CUDA as uint8 tensors, Python's and NumPy's as JSON metadata."""
    import numpy as np

    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = s
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    meta = {"python": json.dumps([version, list(internal), gauss]),
            "numpy": json.dumps([name, [int(x) for x in keys], int(pos), int(has_gauss), float(cached)])}
    return tensors, meta


def set_rng_state(tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    import numpy as np

    try:
        torch.set_rng_state(tensors["torch_cpu"])
        cuda = sorted((int(k.rsplit("_", 1)[1]), v) for k, v in tensors.items() if k.startswith("torch_cuda_"))
        if cuda and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([v for _, v in cuda][:torch.cuda.device_count()])
        version, internal, gauss = json.loads(meta["python"])
        random.setstate((int(version), tuple(int(x) for x in internal), None if gauss is None else float(gauss)))
        name, keys, pos, has_gauss, cached = json.loads(meta["numpy"])
        np.random.set_state((str(name), np.array(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached)))
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"RNG state does not load ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None


# ---------------------------------------------------------------------------------------------------------------
# Sharded training state (checkpoint.format: sharded): torch.distributed.checkpoint, through safetensors
#
# DCP's default FileSystemWriter stores its index (which piece of which tensor is where) as a pickle,
# ``.metadata``, which its FileSystemReader unpickles: loading someone else's checkpoint could run code. Its
# HuggingFaceStorageWriter with ``save_distributed`` (streamed: shard_writer.py) writes each process's pieces as
# one safetensors file and the index in that file's header (JSON: each piece's offsets in its whole tensor), and
# HuggingFaceStorageReader rebuilds the index from the headers: nothing is pickled either way. It stores tensors
# only, so the optimizer's other values (param groups, hyperparameters) go to optimizer.json as in a full
# checkpoint.


def layout_for(fmt: str, distributed_type: str) -> str:
    """The layout of the training state a run writes: ``checkpoint.format`` (full, sharded, or auto: sharded under
    FSDP, where a full state dict gathers the whole model and optimizer state on one process, else full)."""
    if fmt == "auto":
        return "sharded" if distributed_type == "FSDP" else "full"
    return fmt


def sharded_state(model, optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """This process's part of the model's and the optimizer's state (DTensor / ShardedTensor under FSDP, whole
    tensors otherwise), flat, keyed ``model/FQN`` and ``optimizer/FQN/KEY``; and optimizer.json's structure (which
    names the tensors and holds every other value). An optimizer that has not stepped yet gets its state at zero
    (torch steps it once at lr 0), a template to load into."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    tensors = {f"model/{k}": v for k, v in get_model_state_dict(model).items()}
    opt_tensors, structure = flatten_optimizer(get_optimizer_state_dict(model, optimizer),
                                               name=lambda fqn, key: f"optimizer/{fqn}/{key}")
    return {**tensors, **opt_tensors}, structure


@contextlib.contextmanager
def _single_process_is_meant():
    """DCP warns on every call without a process group that it assumes one process: a one-process run is one."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def local_parts(tensors: dict):
    """(name, tensor) of the pieces of ``tensors`` this process holds (a DTensor's or ShardedTensor's local part)."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    for name, t in tensors.items():
        if isinstance(t, DTensor):
            yield name, t.to_local()
        elif isinstance(t, ShardedTensor):
            for shard in t.local_shards():
                yield name, shard.tensor
        else:
            yield name, t


def save_sharded(folder: Path, tensors: dict) -> None:
    """Every process writes its part of ``tensors`` to ``folder/shard-0000R-model-00001-of-00001.safetensors``
    (R = its rank + 1; a tensor all processes hold whole is written once), fsynced. Collective: every process
    calls it. A process that fails (a full disk) fails it on all, as an OutputWriteError naming the process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with _single_process_is_meant():
            dcp.save(tensors, storage_writer=StreamingShardWriter(folder))
    except CheckpointException as e:  # a BaseException carrying every process's failure
        rank, (exc, _) = sorted(e.failures.items(), key=lambda kv: kv[0])[0]
        if isinstance(exc, OSError):
            raise OutputWriteError(exc.errno, f"process {rank} could not write its shard of the training state "
                                              f"({exc.strerror or exc})", exc.filename) from None
        raise  # not the disk: a bug, with every process's traceback
    fsync_dir(Path(folder))


def _shard_files(folder: Path, manifest: dict) -> Path:
    """``folder/state/shards``, after checking that the safetensors files in it are exactly those its manifest
    lists: DCP's reader opens every one there."""
    shards = Path(folder) / SHARDS
    listed_here = {rel.rsplit("/", 1)[1] for rel in manifest["files"]
                   if rel.startswith(SHARDS + "/") and rel.endswith(".safetensors") and rel.count("/") == 2}
    present = {p.name for p in shards.iterdir() if p.name.endswith(".safetensors")} if shards.is_dir() else set()
    if not listed_here or present != listed_here:
        extra = sorted(present - listed_here) or sorted(listed_here - present) or ["none listed"]
        raise CheckpointError(f"{folder}: {SHARDS}/ does not hold exactly the shard files its {MANIFEST} lists "
                              f"({extra[0]})")
    return shards


def sharded_shapes(folder: Path, manifest: dict) -> dict[str, tuple[int, ...]]:
    """The whole shape of every tensor of a sharded checkpoint (``model/FQN``, ``optimizer/FQN/KEY``), read from
    the shards' headers (no tensor is loaded); CheckpointError if the pieces do not cover each tensor once (a
    shard missing, or pieces that overlap)."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    shards = _shard_files(folder, manifest)
    try:
        md = HuggingFaceStorageReader(str(shards)).read_metadata()
    except (ValueError, KeyError, TypeError, RuntimeError, OSError) as e:
        raise CheckpointError(f"{folder}: the headers of {SHARDS}/ do not read as DCP shards "
                              f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})") from None
    shapes = {}
    for key, meta in md.state_dict_metadata.items():
        size = tuple(int(x) for x in meta.size)
        covered = 0
        for chunk in meta.chunks:
            if any(o < 0 or o + n > s for o, n, s in zip(chunk.offsets, chunk.sizes, size)):
                raise CheckpointError(f"{folder}: a piece of {key} lies outside the tensor")
            covered += math.prod(chunk.sizes)
        if covered != math.prod(size):
            raise CheckpointError(f"{folder}: the pieces of {key} in {SHARDS}/ cover {covered} of its "
                                  f"{math.prod(size)} elements (a shard missing or repeated)")
        shapes[key] = size
    return shapes


def load_sharded(folder: Path, manifest: dict, model, optimizer, structure: dict) -> None:
    """Load a sharded checkpoint's model and optimizer state into ``model`` and ``optimizer`` (prepared, on any
    number of processes: DCP reads the pieces each process's own part needs). Collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    shards = _shard_files(folder, manifest)
    tensors, _ = sharded_state(model, optimizer)  # this run's layout: DCP fills it in place
    saved = sharded_shapes(folder, manifest)
    want = {k: tuple(v.shape) for k, v in tensors.items()}  # whole shapes (a DTensor's and ShardedTensor's too)
    if saved != want:  # DCP would load the overlap of a tensor of another shape and leave the rest as it was
        diff = sorted(set(saved) ^ set(want)) or sorted(k for k in want if saved[k] != want[k])
        raise CheckpointError(f"{folder}: {SHARDS}/ holds another model's or optimizer's state ({len(diff)} tensors "
                              f"differ, e.g. {diff[0]})")
    try:
        with _single_process_is_meant():
            dcp.load(tensors, storage_reader=dcp.HuggingFaceStorageReader(str(shards)))
    except CheckpointException as e:
        _, (exc, _) = sorted(e.failures.items(), key=lambda kv: kv[0])[0]
        raise CheckpointError(f"{folder}: {SHARDS}/ does not load into this run ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0][:200] if str(exc) else ''})") from None
    set_model_state_dict(model, {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")})
    opt = {k: v for k, v in tensors.items() if k.startswith("optimizer/")}
    set_optimizer_state_dict(model, optimizer, unflatten_optimizer(opt, structure))
