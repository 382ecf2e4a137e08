"""Writing outputs without losing what was there.

A file is written under a temporary name beside its target, checked, and only then renamed over
the target (``os.replace``: atomic on one file system), so a failure (disk full, a writer that
crashes, a file that does not read back) leaves an earlier file as it was. A folder of outputs is
filled under a temporary name and renamed into place; it may only replace an empty folder.
After a failure only what the write itself created is removed: its temporary file or folder, and
parent folders it made that are still empty. Failures are :class:`~attnqat.errors.OutputWriteError`.
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path

from .errors import OutputWriteError

__all__ = ["temp_beside", "make_parents", "remove_created", "write_file_atomically", "write_dir_atomically",
           "replace_dir_atomically", "write_files_atomically", "remove_stale_temps", "save_safetensors"]

# Errors a writer raises when the file system fails it (imageio-ffmpeg raises RuntimeError when ffmpeg
# exits early, e.g. on a full disk). Anything else is a bug and keeps its own type.
WRITE_FAILURES = (OSError, RuntimeError)


def temp_beside(path: Path, suffix: str | None = None) -> Path:
    """An unused hidden name in ``path``'s folder, ``.{stem}.{random}.tmp{suffix}`` (the target's
    suffix by default, so writers that pick a format from it pick the same one)."""
    suffix = path.suffix if suffix is None else suffix
    stem = path.stem[:100]  # keep the name under the 255-byte limit
    for _ in range(100):
        tmp = path.with_name(f".{stem}.{secrets.token_hex(6)}.tmp{suffix}")
        if not os.path.lexists(tmp):
            return tmp
    raise OutputWriteError(f"could not find a free temporary name beside {str(path)!r}")


def make_parents(folder: Path) -> list[Path]:
    """Create ``folder`` and its missing parents. Return: the folders created, outermost first."""
    missing = []
    a = Path(folder).absolute()
    while not a.exists():
        missing.append(a)
        a = a.parent
    created = []
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:
            continue
        except OSError as e:
            remove_created(created)
            raise OutputWriteError(f"could not create folder {str(d)!r}: {e.strerror or e}") from e
        created.append(d)
    return created


def remove_created(folders: list[Path]) -> None:
    """Remove folders that :func:`make_parents` created, innermost first, where they are still empty."""
    for d in reversed(folders):
        try:
            d.rmdir()
        except OSError:
            return  # not empty (something else wrote there) or gone: leave it and its parents


def _reason(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def write_file_atomically(path: str | os.PathLike, write: Callable[[Path], None],
                          verify: Callable[[Path], None] | None = None) -> Path:
    """``write(tmp)`` a file under a temporary name beside ``path``, ``verify(tmp)`` it (raise to
    reject), then rename it to ``path``, replacing an earlier file only now. Return: ``path``."""
    path = Path(path)
    existed = path.exists()
    created = make_parents(path.parent)
    tmp = temp_beside(path)
    try:
        write(tmp)
        if verify is not None:
            verify(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        remove_created(created)
        kept = "the existing file was left unchanged" if existed else "nothing was written"
        if isinstance(e, OutputWriteError):
            raise OutputWriteError(f"{e}; {kept}") from e
        if isinstance(e, WRITE_FAILURES):
            raise OutputWriteError(f"could not write {str(path)!r}: {_reason(e)}; {kept}") from e
        raise
    return path


def write_dir_atomically(path: str | os.PathLike, write: Callable[[Path], None],
                         verify: Callable[[Path], None] | None = None) -> Path:
    """``write(tmp)`` into a new temporary folder beside ``path``, ``verify(tmp)``, then rename it to
    ``path``. ``path`` must not exist or be an empty folder: a folder with anything in it is never
    replaced (the rename fails, and the temporary folder is removed). Return: ``path``."""
    path = Path(path)
    created = make_parents(path.parent)
    tmp = temp_beside(path, suffix="")
    made_tmp = False
    try:
        tmp.mkdir()
        made_tmp = True
        write(tmp)
        if verify is not None:
            verify(tmp)
        os.rename(tmp, path)  # replaces an empty folder only (rename(2))
    except BaseException as e:
        if made_tmp:
            shutil.rmtree(tmp, ignore_errors=True)  # the temporary folder and what this call wrote in it
        remove_created(created)
        if isinstance(e, OutputWriteError):
            raise
        if isinstance(e, WRITE_FAILURES):
            raise OutputWriteError(f"could not write folder {str(path)!r}: {_reason(e)}; "
                                   f"{'it was left as it was' if path.exists() else 'nothing was written'}") from e
        raise
    return path


def replace_dir_atomically(path: str | os.PathLike, write: Callable[[Path], None],
                           verify: Callable[[Path], None] | None = None) -> Path:
    """:func:`write_dir_atomically`, except that an existing folder at ``path`` is replaced: the new folder
    is written and verified under a temporary name first (``.NAME.xxxx.tmp``), then the old one is moved aside
    (``.NAME.xxxx.old``), the new one renamed into place, and the old one removed; if that rename fails the old
    one is moved back. The caller decides that ``path`` is its own to replace (e.g. a model folder an earlier
    run wrote). Return: ``path``."""
    path = Path(path)
    if not path.exists():
        return write_dir_atomically(path, write, verify)
    staged = write_dir_atomically(temp_beside(path, suffix=""), write, verify)
    old = staged.with_name(staged.name[:-len(".tmp")] + ".old")
    try:
        os.rename(path, old)
        try:
            os.rename(staged, path)
        except BaseException:
            os.rename(old, path)
            raise
    except BaseException as e:
        shutil.rmtree(staged, ignore_errors=True)
        if isinstance(e, OSError):
            raise OutputWriteError(f"could not replace folder {str(path)!r}: {_reason(e)}; "
                                   f"it was left as it was") from e
        raise
    shutil.rmtree(old)
    return path


def write_files_atomically(folder: str | os.PathLike, writers: dict[str, Callable[[Path], None]]) -> list[Path]:
    """Write a set of files into ``folder`` as one unit: ``writers[name](tmp)`` writes each under a temporary
    folder in ``folder`` (``.output.xxxx.tmp``); only when every one is written are the old files of those names
    moved aside and the new ones renamed into place (if a rename fails, the ones moved are moved back). So a
    failure (a full disk) leaves the old set whole; other files in ``folder`` are never touched. Return: the
    paths written."""
    folder = Path(folder)
    created = make_parents(folder)
    stage = temp_beside(folder / "output", suffix="")
    existed = any(os.path.lexists(folder / name) for name in writers)
    try:
        (stage / "new").mkdir(parents=True)
        (stage / "old").mkdir()
        for name, write in writers.items():
            write(stage / "new" / name)
        moved, placed = [], []
        try:
            for name in writers:
                if os.path.lexists(folder / name):
                    os.rename(folder / name, stage / "old" / name)
                    moved.append(name)
                os.rename(stage / "new" / name, folder / name)
                placed.append(name)
        except BaseException:
            for name in placed:
                os.rename(folder / name, stage / "new" / name)
            for name in moved:
                os.rename(stage / "old" / name, folder / name)
            raise
    except BaseException as e:
        shutil.rmtree(stage, ignore_errors=True)
        remove_created(created)
        kept = "the existing files were left unchanged" if existed else "nothing was written"
        if isinstance(e, OutputWriteError):
            raise OutputWriteError(f"{e}; {kept}") from e
        if isinstance(e, WRITE_FAILURES):
            raise OutputWriteError(f"could not write {', '.join(writers)} in {str(folder)!r}: {_reason(e)}; "
                                   f"{kept}") from e
        raise
    shutil.rmtree(stage, ignore_errors=True)
    return [folder / name for name in writers]


def remove_stale_temps(path: str | os.PathLike, is_ours: Callable[[Path], bool], log=None) -> None:
    """Clean up after a write of folder ``path`` that a kill interrupted (call it holding ``path``'s lock,
    :mod:`attnqat.locking`, so no other process is writing them): remove the temporary folders
    :func:`write_dir_atomically` and :func:`replace_dir_atomically` leave beside it (``.NAME.xxxx.tmp`` /
    ``.old``, a random 12-digit hex ``xxxx``) that ``is_ours`` recognises by their content, except that an old
    copy is renamed back to ``path`` when ``path`` is missing (a kill between the two renames)."""
    path = Path(path)
    pattern = re.compile(rf"\.{re.escape(path.stem[:100])}\.[0-9a-f]{{12}}\.(tmp|old)")
    try:
        entries = sorted(path.parent.iterdir(), key=lambda p: p.name)
    except OSError:
        return
    for entry in entries:
        if not (pattern.fullmatch(entry.name) and entry.is_dir() and not entry.is_symlink() and is_ours(entry)):
            continue
        if entry.name.endswith(".old") and not os.path.lexists(path):
            os.rename(entry, path)
            what = f"restored {str(path)!r} from {entry.name} (a kill had interrupted its replacement)"
        else:
            shutil.rmtree(entry)
            what = f"removed {str(entry)!r}, left by an interrupted run"
        if log is not None:
            log(what)


def save_safetensors(path: str | os.PathLike, tensors: dict, metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file``, with its failures (a full disk: a ``SafetensorError`` naming the OS
    error inside) as :class:`~attnqat.errors.OutputWriteError`: one line, no traceback."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata=metadata)
    except (SafetensorError, OSError) as e:
        m = re.search(r"\(os error (\d+)\)", str(e))  # "... I/O error: No space left on device (os error 28)"
        reason = os.strerror(int(m.group(1))) if m else _reason(e)
        raise OutputWriteError(f"could not write {str(path)!r}: {reason}") from e
