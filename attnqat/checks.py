"""Argument checks shared by the command-line tools (``attnqat generate``, ``attnqat precompute``,
``app.py``) and the demo page: the limits and their reasons in one place, the rules for video
sizes, and the checks of every path a tool will write, all run before anything heavy loads.

Each check raises ``ValueError`` (``FileNotFoundError`` or ``PermissionError`` where those fit)
whose message names the flag and the value; the console script prints it as one line and exits
with status 2. Nothing here imports torch at import time (``attnqat --help`` stays fast).
"""
from __future__ import annotations

import math
import os
import stat
import tempfile
from pathlib import Path

__all__ = ["LIMITS", "SIZE_MULTIPLE", "TIME_STRIDE", "VAE_SPATIAL_STRIDE", "show", "check_int", "check_float", "check_text",
           "check_video_size", "check_path_text", "check_output_file", "check_output_dir", "check_input_file",
           "check_not_input", "model_inputs", "check_device", "check_precompute"]

# Upper limits of the command-line tools. They are typo guards, far above what Wan 2.1 is made for,
# each with the reason printed when it is hit. The demo page has tighter limits (attnqat.demo).
LIMITS: dict[str, tuple[int, str]] = {
    "side": (4096, "Wan 2.1 is trained at up to 1280 pixels; at 4096x4096 one latent frame is already "
                   "65,536 tokens"),
    "frames": (1025, "Wan 2.1 is trained on 81 frames; 1025 frames are 64 s at 16 fps (257 latent frames)"),
    "steps": (1000, "the flow scheduler has 1000 training timesteps; more steps would only repeat them"),
    "fps": (240, "the highest common display rate; Wan 2.1 makes 16 frames per second"),
    "text_tokens": (4096, "8x the 512 text tokens Wan 2.1's text encoder is used with"),
    "seed": (2 ** 63 - 1, "seeds are 64-bit signed integers"),
}
VAE_SPATIAL_STRIDE = 8  # Wan 2.1's VAE downsamples height and width by 8
SIZE_MULTIPLE = 2 * VAE_SPATIAL_STRIDE  # the VAE downsamples by 8, then the transformer patches 2x2
TIME_STRIDE = 4  # the VAE keeps the first frame, then compresses time by 4: frames = 4k + 1
NAME_MAX, PATH_MAX = 255, 4095  # bytes of one file name, of a whole path (Linux)


def show(value, limit: int = 100) -> str:
    """``repr(value)``, its middle cut out beyond ``limit`` characters (a message stays one readable
    line, and a path keeps its start and its file name)."""
    r = repr(value)
    if len(r) <= limit:
        return r
    half = (limit - 3) // 2
    return r[:half] + "..." + r[-half:]


def check_int(flag: str, value, lo: int, hi: int | None = None, why: str = "") -> int:
    """``value`` must be a whole number in ``[lo, hi]``; ``why`` is said when it is above ``hi``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{flag} must be a whole number, got {show(value)}")
    if value < lo:
        raise ValueError(f"{flag} {value} must be at least {lo}")
    if hi is not None and value > hi:
        raise ValueError(f"{flag} {value} is above the limit of {hi}" + (f" ({why})" if why else ""))
    return value


def check_limited(flag: str, value, kind: str, lo: int = 1) -> int:
    """:func:`check_int` against ``LIMITS[kind]``."""
    hi, why = LIMITS[kind]
    return check_int(flag, value, lo, hi, why)


def check_float(flag: str, value, *, lo: float, lo_open: bool = False, hi: float | None = None) -> float:
    """``value`` must be a finite number, ``>= lo`` (``> lo`` with ``lo_open``) and ``<= hi``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{flag} must be a number, got {show(value)}")
    if not math.isfinite(value):
        raise ValueError(f"{flag} {value} is not a finite number")
    if value < lo or (lo_open and value == lo):
        raise ValueError(f"{flag} {value} must be {'greater than' if lo_open else 'at least'} {lo:g}")
    if hi is not None and value > hi:
        raise ValueError(f"{flag} {value} is above the limit of {hi:g}")
    return float(value)


def check_text(flag: str, value, *, empty_ok: bool = False, max_chars: int | None = None) -> str:
    """Text that encodes as UTF-8 (no unpaired surrogates, which is what undecodable bytes on a
    command line become) and holds no NUL; non-blank unless ``empty_ok``."""
    if not isinstance(value, str):
        raise ValueError(f"{flag} must be text, got {show(value)}")
    if not empty_ok and not value.strip():
        raise ValueError(f"{flag} is empty")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{flag} is not valid text: it holds {show(value[e.start:e.end])} (not UTF-8)") from None
    if "\x00" in value:
        raise ValueError(f"{flag} holds a NUL character")
    if max_chars is not None and len(value) > max_chars:
        raise ValueError(f"{flag} is {len(value)} characters long; the limit is {max_chars}")
    return value


# ---------------------------------------------------------------------------------------- video sizes
def _nearest_frames(n: int) -> str:
    lo = max(1, (n - 1) // TIME_STRIDE * TIME_STRIDE + 1)
    hi = lo + TIME_STRIDE
    if n < 1:
        return "1"
    if n - lo == hi - n:
        return f"{lo} or {hi}"
    return str(lo if n - lo < hi - n else hi)


def _nearest_multiple(n: int, m: int) -> str:
    lo, hi = n // m * m, (n // m + 1) * m
    if lo < m:
        return str(m)
    return f"{lo} or {hi}"


def check_video_size(height, width, frames, steps=None, *, prefix: str = "--") -> None:
    """Wan 2.1's size rules: height and width positive multiples of 16, frames 4k+1, each within
    :data:`LIMITS`; other values are refused with the nearest valid ones (nothing is rounded
    silently). ``prefix`` is put before the names in messages (``--height`` on the command line)."""
    for name, v in (("height", height), ("width", width)):
        check_int(f"{prefix}{name}", v, -2 ** 62, *LIMITS["side"])  # a type check and the upper limit first
        if v <= 0 or v % SIZE_MULTIPLE:
            raise ValueError(f"{prefix}{name} {v} is not a positive multiple of {SIZE_MULTIPLE} (Wan's VAE downsamples "
                             f"by 8 and its transformer patches by 2); nearest valid: {_nearest_multiple(v, SIZE_MULTIPLE)}")
    check_int(f"{prefix}frames", frames, -2 ** 62, *LIMITS["frames"])
    if frames < 1 or (frames - 1) % TIME_STRIDE:
        raise ValueError(f"{prefix}frames {frames} is not of the form 4k+1 (Wan's VAE keeps the first frame and "
                         f"compresses the rest by 4); nearest valid: {_nearest_frames(frames)}")
    if steps is not None:
        check_limited(f"{prefix}steps", steps, "steps")


# ---------------------------------------------------------------------------------------------- paths
def check_path_text(flag: str, value) -> Path:
    """A path the operating system can take: not blank, no NUL, encodable, names of at most 255
    bytes. ``~`` is expanded. Nothing is created."""
    if value is None or not isinstance(value, (str, os.PathLike)) or not str(value).strip():
        raise ValueError(f"{flag} is empty")
    text = str(value)
    if "\x00" in text:
        raise ValueError(f"{flag} {show(text)} holds a NUL character")
    try:
        encoded = os.fsencode(text)
    except UnicodeEncodeError:
        raise ValueError(f"{flag} {show(text)} is not a valid file name on this system") from None
    try:
        p = Path(text).expanduser()
    except RuntimeError as e:  # ~user of an unknown user
        raise ValueError(f"{flag} {show(text)}: {e}") from None
    if len(encoded) > PATH_MAX or any(len(os.fsencode(part)) > NAME_MAX for part in p.parts):
        raise ValueError(f"{flag} {show(text)} is too long (names of at most {NAME_MAX} bytes, paths of "
                         f"{PATH_MAX})")
    return p


def _stat(flag: str, text: str, p: Path) -> os.stat_result | None:
    """``os.stat(p)``, None when nothing is there; a file in place of a parent folder is refused."""
    try:
        return os.stat(p)
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        raise ValueError(f"{flag} {show(text)}: a parent of it is a file, not a folder") from None
    except OSError as e:
        raise ValueError(f"{flag} {show(text)}: {e.strerror or e}") from None


def _existing_parent(flag: str, text: str, p: Path) -> Path:
    """The folder ``p`` is (or will be created) in, which must exist: a mistyped path is refused rather than
    created as a new tree of folders."""
    parent = p.absolute().parent
    st = _stat(flag, text, parent)
    if st is None:
        raise ValueError(f"{flag} {show(text)}: its folder {str(parent)!r} does not exist; create it first "
                         f"(or check the path)")
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{flag} {show(text)}: {str(parent)!r} is a file, not a folder")
    return parent


def _check_can_create_in(flag: str, text: str, folder: Path) -> None:
    """Create and remove a probe file in ``folder``: the one check that also holds for root and for
    read-only mounts, where permission bits say nothing."""
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".attnqat-write-test-")
    except OSError as e:
        raise PermissionError(f"{flag} {show(text)}: cannot write in {str(folder)!r} ({e.strerror or e})") from None
    os.close(fd)
    os.unlink(probe)


def check_output_file(flag: str, value, suffixes: tuple[str, ...]) -> Path:
    """A file path to write: its name ends in one of ``suffixes``; it is not a folder or a special
    file (an existing regular file will be replaced, atomically); its folder exists, and files can be
    created there. Return: the expanded path."""
    p = check_path_text(flag, value)
    text = str(value)
    st = _stat(flag, text, p)
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{flag} {show(text)} is a folder; give a file name in it, e.g. "
                         f"{show(str(p / ('video' + suffixes[0])))}")
    if p.suffix.lower() not in suffixes:
        raise ValueError(f"{flag} {show(text)} must end in {suffixes[0]}"
                         + (f" (or {', '.join(suffixes[1:])})" if len(suffixes) > 1 else ""))
    if st is not None:
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{flag} {show(text)} exists and is not a regular file")
        if not os.access(p, os.W_OK):
            raise PermissionError(f"{flag} {show(text)} exists and is read-only; it is not replaced")
    _check_can_create_in(flag, text, _existing_parent(flag, text, p))
    return p


def check_output_dir(flag: str, value, *, must_be_empty: bool, reusable=None) -> Path:
    """A folder to write into: a folder, or nothing there yet (then its parent must exist and allow creating it).
    With ``must_be_empty`` an existing folder must be empty, unless ``reusable(path)`` says it holds
    an earlier output of the same tool. Return: the expanded path."""
    p = check_path_text(flag, value)
    text = str(value)
    st = _stat(flag, text, p)
    if st is None:
        _check_can_create_in(flag, text, _existing_parent(flag, text, p))
        return p
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{flag} {show(text)} is a file, not a folder")
    if must_be_empty:
        try:
            empty = next(os.scandir(p), None) is None
        except OSError as e:
            raise PermissionError(f"{flag} {show(text)}: cannot list it ({e.strerror or e})") from None
        if not empty and not (reusable is not None and reusable(p)):
            raise ValueError(f"{flag} {show(text)} already exists and is not empty; give a new or empty folder "
                             f"(nothing in it is overwritten)")
    _check_can_create_in(flag, text, p)
    return p


def check_input_file(flag: str, value) -> Path:
    """An existing, readable regular file. Return: the expanded path."""
    p = check_path_text(flag, value)
    text = str(value)
    st = _stat(flag, text, p)
    if st is None:
        raise FileNotFoundError(f"{flag} {show(text)} does not exist")
    if stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{flag} {show(text)} is a folder, not a file")
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{flag} {show(text)} is not a regular file")
    try:
        with open(p, "rb"):
            pass
    except OSError as e:
        raise PermissionError(f"{flag} {show(text)} cannot be read ({e.strerror or e})") from None
    return p


def _same_or_inside(path: Path, folder: Path) -> bool:
    """``path`` is ``folder`` or inside it: symlinks resolved, and a hard link or bind mount recognised by its
    device and inode."""
    for a in (path, *path.parents):
        if a == folder:
            return True
        try:
            if os.path.samefile(a, folder):
                return True
        except OSError:  # one of them does not exist (yet)
            pass
    return False


def check_not_input(out_flag: str, out, inputs, *, holds_inputs_too: bool = False) -> None:
    """Refuse an output that is one of ``inputs`` (``(flag, path)`` pairs; ``None`` paths skipped) or lies
    inside one, however it is spelled (``..``, symlinks, hard links): a run never writes over what it reads.
    ``holds_inputs_too``: the output is a folder replaced as a whole, so an input inside it is refused too."""
    o = Path(os.path.realpath(Path(str(out)).expanduser()))
    for flag, value in inputs:
        if value is None:
            continue
        i = Path(os.path.realpath(Path(str(value)).expanduser()))
        if _same_or_inside(o, i):
            where = "is" if _same_or_inside(i, o) else "is inside"
            raise ValueError(f"{out_flag} {show(str(out))} {where} {flag} {show(str(value))}: an output never "
                             f"replaces what the run reads; choose another {out_flag}")
        if holds_inputs_too and _same_or_inside(i, o):
            raise ValueError(f"{flag} {show(str(value))} is inside {out_flag} {show(str(out))}, which is replaced "
                             f"as a whole; choose another {out_flag}")


def model_inputs(flag: str, model: str) -> list[tuple[str, str]]:
    """What a local model folder is loaded from, as ``(flag, path)`` pairs for :func:`check_not_input`: its
    model_index.json and the component folders it names (transformer/, vae/, ...). Other files beside them
    (e.g. the QAT weights ``attnqat export-qat`` writes there) are not the model's. None for tiny and hub ids."""
    import json

    from attnqat.pipelines.loading import is_tiny, resolve_model

    if is_tiny(model):
        return []
    folder = Path(resolve_model(model)).expanduser()
    index = folder / "model_index.json"
    try:
        names = [] if index.stat().st_size > 1 << 20 else [k for k in json.loads(index.read_text()) if k[:1] != "_"]
    except (OSError, ValueError, TypeError, UnicodeDecodeError):  # not a model folder: nothing it loads
        return []
    return [(flag, str(index))] + [(flag, str(folder / n)) for n in names if (folder / n).is_dir()]


# --------------------------------------------------------------------------------------------- device
def check_device(flag: str, value):
    """The torch device named by ``value`` (None: cuda if available, else cpu); only cpu and
    available CUDA GPUs are accepted."""
    import torch

    if value is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{flag} is empty; use cuda, cuda:0, cpu ...")
    try:
        device = torch.device(value)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"{flag} {show(value)} is not a torch device (e.g. cuda, cuda:0, cpu)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{flag} {value} requested but no CUDA GPU is available; use {flag} cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"{flag} {value}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    elif device.type != "cpu" or device.index not in (None, 0):
        raise ValueError(f"{flag} {show(value)}: only cpu and cuda devices are supported")
    return device


# ------------------------------------------------------------------------------------ attnqat precompute
def check_precompute(args) -> None:
    """Every argument of ``attnqat precompute``, before its encoders load (the command's own module
    re-checks what it needs; this adds the limits, the paths and the device).

    ``--out`` must be new, empty, or an earlier precompute output (its index.json and shards, nothing else:
    it is then replaced, once the new output is complete): a folder holding anything else is refused, so no
    user file is overwritten. The new output is written beside it first, so its parent must be writable.
    """
    from attnqat.pipelines.loading import check_model
    from attnqat.train.data import is_precompute_output

    prompts = check_input_file("--prompts", args.prompts)
    check_model(args.model)
    out = check_output_dir("--out", args.out, must_be_empty=True, reusable=is_precompute_output)
    if out.exists():
        _check_can_create_in("--out", str(args.out), out.parent)
    check_limited("--max-length", args.max_length, "text_tokens")
    check_int("--shard-size", args.shard_size, 1)
    check_int("--batch-size", args.batch_size, 1)
    if args.videos:
        check_video_size(args.height, args.width, args.frames)
    else:  # unused without --videos, still refused when absurd
        check_limited("--height", args.height, "side")
        check_limited("--width", args.width, "side")
        check_limited("--frames", args.frames, "frames")
    check_device("--device", args.device)
    from attnqat.train.precompute import read_records

    try:
        read_records(prompts, args.videos)
    except UnicodeDecodeError:
        raise ValueError(f"--prompts {show(str(args.prompts))} is not UTF-8 text") from None
