"""The ``attnqat`` console script: ``attnqat <command> [options]``.

Each command is a module exposing ``HELP`` (one line), ``add_arguments(parser)`` and
``main(args) -> int``. Adding a command is one entry in :data:`COMMANDS`. ``attnqat --help`` imports
no command module (their one-line help is repeated in :data:`COMMANDS`, and a test keeps the two
equal); ``attnqat CMD ...`` imports only CMD's module. So help is fast, and one command's missing
optional dependency never breaks another.

Exit status and stderr:
- 2, one line ``attnqat CMD: error: ...``: a mistake the user can fix in the arguments (argparse's
  own errors, and the exceptions in :data:`USER_ERRORS`: bad values, missing model folder,
  unwritable output path, mismatched checkpoint, missing optional dependency).
- 1, one line ``attnqat CMD: failed: ...``: the run failed for a reason to read, not a bug
  (:data:`RUN_ERRORS`: an output that could not be written, e.g. a full disk; NaN/inf output; and an
  ``OSError`` of the disk itself, :data:`DISK_ERRNOS`, wherever it was raised).
- 75, one line ``attnqat CMD: busy: ...``: another process is writing the same output (its lock,
  :mod:`attnqat.locking`, names it); nothing was done: try again when it has finished.
- 130, one line ``attnqat CMD: interrupted``, on Ctrl-C at any moment, also while the command's modules
  (torch) are still being imported. Anything else is a bug and keeps its traceback.
Set ``ATTNQAT_TRACEBACK=1`` to see the traceback of the one-line errors too.

Before a command runs, torch's CPU thread count is capped to the CPUs the process may use unless
``OMP_NUM_THREADS`` is set (:mod:`attnqat.threads`).
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import os
import signal
import sys
import threading

from . import __version__, threads
from .errors import ComputeError, NonFiniteOutputError, OutputLockedError, OutputWriteError, one_line

# name -> (module, one-line help, argument check run before the module's main or None: precompute's,
# attnqat.train.precompute.check_arguments, refuses bad paths, limits and devices before the encoders load).
COMMANDS: dict[str, tuple[str, str, str | None]] = {
    "generate": ("attnqat.pipelines.generate",
                 "generate a video with Wan 2.1 text-to-video (attention in an attnqat mode)", None),
    "train": ("attnqat.train.cli",
              "QAT fine-tuning of a Wan 2.1 transformer for FP4 attention (distillation / flow matching)", None),
    "precompute": ("attnqat.train.precompute",
                   "encode prompts (and videos) into safetensors shards for `attnqat train`",
                   "attnqat.train.precompute:check_arguments"),
    "quality": ("attnqat.mini.quality_cli",
                "measure each attention mode's (and fine-tune's) flow loss, prompt following and PSNR/SSIM to bf16",
                None),
    "export-qat": ("attnqat.export_qat_cli",
                   "write the tensors a QAT fine-tune changed (bf16, or their changes in FP8; at most 12 MB) as QAT "
                   "weights that ship beside its base", None),
    "build-mini": ("attnqat.mini.build_cli",
                   "train the mini text-to-video model from scratch (stages: init, vae, transformer, export; "
                   "resumable)", None),
    "demo": ("attnqat.demo_app",
             "serve the side-by-side demo page: one prompt and seed in every attention mode (needs gradio)", None),
}

# ValueError covers argument validation and attnqat's own refusals; FileNotFoundError covers
# ModelNotFoundError and missing checkpoints; ImportError a missing optional dependency (the message says
# what to install).
USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, PermissionError, ImportError)
RUN_ERRORS = (OutputWriteError, NonFiniteOutputError, ComputeError)
# A disk that fails a write (full, over quota, read-only, broken): a reason to read, not a bug.
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG)
BUSY = 75  # sysexits.h's EX_TEMPFAIL: a temporary failure, the same command may succeed later
INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process ended by Ctrl-C


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line on stderr (exit status 2), naming
    ``--help`` instead of printing the usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


def _selected_command(argv: list[str]) -> str | None:
    """The command named on the command line (the first non-option word), if it is one of ours."""
    for a in argv:
        if not a.startswith("-"):
            return a if a in COMMANDS else None
    return None


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser. Only ``only``'s module is imported (and its arguments added); the other commands
    are listed with their one-line help."""
    parser = OneLineParser(prog="attnqat", description="4-bit (NVFP4) attention for Wan 2.1 video diffusion.")
    parser.add_argument("--version", action="version", version=f"attnqat {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_line, _) in COMMANDS.items():
        if name != only:
            sub.add_parser(name, help=help_line)
            continue
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=module.HELP, description=(module.__doc__ or module.HELP).strip(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(_module=module, _parser=p)
    return parser


def _report(command: str, kind: str, e: BaseException) -> None:
    msg = one_line(str(e).splitlines()[0]) if str(e).strip() else type(e).__name__
    print(f"attnqat {command}: {kind}: {msg}", file=sys.stderr)


def _check(spec: str | None, args: argparse.Namespace) -> None:
    if spec is not None:
        module_name, func = spec.split(":")
        getattr(importlib.import_module(module_name), func)(args)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    threads.prefer_passive_waits()  # before any command imports torch
    command = _selected_command(argv)
    try:  # Ctrl-C is one line from the first moment: importing a command's module (torch) takes seconds
        return _run(argv, command)
    except KeyboardInterrupt:
        if os.environ.get("ATTNQAT_TRACEBACK"):
            raise
        print(f"attnqat{' ' + command if command else ''}: interrupted", file=sys.stderr)
        return INTERRUPTED


@contextlib.contextmanager
def _imports_uninterrupted():
    """Hold a Ctrl-C that comes while the command's modules import (torch: seconds) until they have, then
    raise it: an import cut part way leaves a module half-initialised (numpy then refuses to load again, and the
    run ends in a misleading error), and some libraries' imports swallow the interrupt. Where SIGINT is not
    Python's default handler (ignored in a background job, or the caller's own), it is left alone."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    pending = []
    signal.signal(signal.SIGINT, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if pending:
        raise KeyboardInterrupt


def _run(argv: list[str], command: str | None) -> int:
    try:
        with _imports_uninterrupted():
            parser = build_parser(command)
    except ImportError as e:  # the selected command's optional dependency is missing
        if os.environ.get("ATTNQAT_TRACEBACK"):
            raise
        _report(command or "", "error", e)
        return 2
    args, extra = parser.parse_known_args(argv)
    if extra:  # reported by the command's own parser, so the message names the command
        getattr(args, "_parser", parser).error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        with _imports_uninterrupted():
            _check(COMMANDS[args.command][2], args)
            threads.limit_torch_threads()
        return int(args._module.main(args) or 0)
    except OutputLockedError as e:
        if os.environ.get("ATTNQAT_TRACEBACK"):
            raise
        _report(args.command, "busy", e)
        return BUSY
    except RUN_ERRORS as e:
        if os.environ.get("ATTNQAT_TRACEBACK"):
            raise
        _report(args.command, "failed", e)
        return 1
    except USER_ERRORS as e:
        if os.environ.get("ATTNQAT_TRACEBACK"):
            raise
        _report(args.command, "error", e)
        return 2
    except OSError as e:
        if e.errno not in DISK_ERRNOS or os.environ.get("ATTNQAT_TRACEBACK"):
            raise
        where = f" ({one_line(str(e.filename))})" if e.filename else ""
        print(f"attnqat {args.command}: failed: {one_line(e.strerror or str(e))}{where}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
