"""One writer per output: an advisory lock held while a command writes a run folder or output file.

``attnqat train``, ``precompute``, ``export-qat`` and ``quality`` hold :func:`output_lock` on their output for
as long as they write it. The lock is ``flock(2)`` on a hidden file beside the output,
``.NAME.attnqat-lock``, which records the holder (pid, host, command, start time) so that a second process
can say who has it. The kernel releases a ``flock`` when its process dies, however it dies: the file alone
is not the lock, so a file left by a killed process is stale and simply taken over (saying so). A holder
removes the file on release while it still holds the lock; a process that locked a file which was removed
meanwhile tries again on the new one, so two processes never both hold "the" lock.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import OutputLockedError
from .outputs import make_parents, remove_created

__all__ = ["output_lock", "lock_path"]


def lock_path(target: str | os.PathLike) -> Path:
    """The lock file of ``target`` (a run folder or an output file): ``.NAME.attnqat-lock`` beside it, its
    folder's symlinks resolved, so every spelling of one output names one lock."""
    target = Path(os.path.realpath(Path(target).expanduser()))
    return target.parent / f".{target.name[:200]}.attnqat-lock"


def _holder(fd: int) -> str:
    """The holder recorded in the lock file, as words (``"pid 12 on host, attnqat train, started ..."``)."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        info = json.loads(os.read(fd, 4096).decode())
        return (f"pid {int(info['pid'])} on {str(info['host'])[:64]}, {str(info['command'])[:64]}, "
                f"started {str(info['started'])[:32]}")
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError):
        return "another process (its lock file names no holder)"


@contextmanager
def output_lock(target: str | os.PathLike, command: str, log=None) -> Iterator[Path]:
    """Hold the lock of ``target`` for the ``with`` block; refuse at once (:class:`OutputLockedError`, naming
    the holder) if another process holds it. Missing parent folders of ``target`` are created for the lock
    file and removed again, if still empty, on release. Yield: the lock file's path."""
    log = log or (lambda msg: print(msg, file=sys.stderr))
    path = lock_path(target)
    created = make_parents(path.parent)
    try:
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = _holder(fd)
                os.close(fd)
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
                raise OutputLockedError(f"{str(target)!r} is being written by {holder}; wait for it to finish "
                                        f"(or stop it), or choose another output") from None
            try:  # the file locked must still be the one at the path (a releasing holder removes it)
                same = os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False))
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
    except BaseException:
        remove_created(created)
        raise
    try:
        if os.fstat(fd).st_size:
            log(f"{command}: taking over the lock {str(path)!r} of {_holder(fd)}: that process is no longer running")
        info = {"pid": os.getpid(), "host": socket.gethostname(), "command": command,
                "started": time.strftime("%Y-%m-%d %H:%M:%S %z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        yield path
    finally:
        try:
            os.unlink(path)  # while still holding it: a waiter that opened this file retries on a new one
        except OSError:
            pass
        os.close(fd)
        remove_created(created)
