"""Errors that end a run for a reason the user should read, not a bug.

The ``attnqat`` console script prints each of these as one line on stderr, without a traceback,
and exits with status 1 (status 2 is for mistakes in the arguments, see :mod:`attnqat.cli`).
"""
from __future__ import annotations

__all__ = ["OutputWriteError", "OutputLockedError", "NonFiniteOutputError", "GenerationCancelled", "ComputeError",
           "CheckpointMismatchError", "one_line"]


class OutputWriteError(OSError):
    """An output file or folder could not be written (disk full, folder removed meanwhile, ...), or it
    was written but does not read back. The message says whether an earlier file was kept."""


class OutputLockedError(RuntimeError):
    """Another process is writing the same output (it holds its lock, :mod:`attnqat.locking`); nothing was
    done. The message names that process. The console script exits with status 75 (try again later)."""


class NonFiniteOutputError(RuntimeError):
    """Generation produced NaN or infinite latents or frames; no video is written from them."""


class GenerationCancelled(RuntimeError):
    """A generation was stopped between two denoising steps because its request was cancelled."""


class ComputeError(Exception):
    """A model computation failed part way (out of memory, a device error): not an output that could not be
    written, even when it happened while one was being written. The message says what ran."""


class CheckpointMismatchError(ValueError):
    """A QAT checkpoint whose keys or shapes do not match the transformer it is loaded into, or a file that is not
    the checkpoint it claims to be. A ``ValueError``: the console script treats it as a mistake in the arguments
    (status 2)."""


def one_line(text: str) -> str:
    """``text`` as one line (a value with a newline in it must not split an error message)."""
    return " ".join(text.split("\n")).strip()
