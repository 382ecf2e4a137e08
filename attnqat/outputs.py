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
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path

from .errors import OutputWriteError

__all__ = ["temp_beside", "make_parents", "remove_created", "write_file_atomically", "write_dir_atomically",
           "replace_dir_atomically"]

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
    is written and verified under a temporary name first, then the old one is moved aside (to another
    temporary name), the new one renamed into place, and the old one removed. The caller decides that
    ``path`` is its own to replace (e.g. a model folder an earlier run wrote). Return: ``path``."""
    path = Path(path)
    if not path.exists():
        return write_dir_atomically(path, write, verify)
    staged = write_dir_atomically(temp_beside(path, suffix=""), write, verify)
    old = temp_beside(path, suffix="")
    os.rename(path, old)
    os.rename(staged, path)
    shutil.rmtree(old)
    return path
