"""The ``attnqat`` console script: ``attnqat <command> [options]``.

Each command is a module exposing ``HELP`` (one line), ``add_arguments(parser)`` and
``main(args) -> int``. Adding a command is one line in :data:`COMMANDS`.

Errors a user can fix (bad arguments, missing model folder, mismatched checkpoint) are the
exceptions in :data:`USER_ERRORS`: they print as one line on stderr and exit with status 2, without
a traceback (set ``ATTNQAT_TRACEBACK=1`` to see it anyway).
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

COMMANDS: dict[str, str] = {
    "generate": "attnqat.pipelines.generate",
    "train": "attnqat.train.cli",
    "precompute": "attnqat.train.precompute",
}

# ValueError covers argument validation and attnqat's own refusals; FileNotFoundError covers
# ModelNotFoundError and missing checkpoints; ImportError a missing optional dependency (the message says
# what to install). Anything else is a bug and keeps its traceback.
USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, PermissionError, ImportError)


def _selected_command(argv: list[str]) -> str | None:
    """The command named on the command line (the first non-option word), if it is one of ours."""
    for a in argv:
        if not a.startswith("-"):
            return a if a in COMMANDS else None
    return None


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser; with ``only``, just that command's module is imported (so one command's missing
    optional dependency never breaks another); without, every importable command is listed."""
    from attnqat import __version__

    parser = argparse.ArgumentParser(prog="attnqat", description="4-bit (NVFP4) attention for Wan 2.1 video diffusion.")
    parser.add_argument("--version", action="version", version=f"attnqat {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module_name in COMMANDS.items():
        if only is not None and name != only:
            sub.add_parser(name)
            continue
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            if only == name:
                raise
            sub.add_parser(name, help=f"(unavailable: {e})")
            continue
        p = sub.add_parser(name, help=module.HELP, description=(module.__doc__ or module.HELP).strip(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(_module=module, _parser=p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(_selected_command(argv)).parse_args(argv)
    try:
        return int(args._module.main(args) or 0)
    except USER_ERRORS as e:
        if os.environ.get("ATTNQAT_TRACEBACK"):
            raise
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"attnqat {args.command}: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"attnqat {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
