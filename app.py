"""``python app.py [options]`` is ``attnqat demo [options]`` (the side-by-side demo page, :mod:`attnqat.demo_app`),
for a source checkout. The page's functions are reachable here too (``app.check_args``, ``app.build_demo``, ...)."""
from __future__ import annotations

import argparse
import sys

from attnqat.cli import build_parser
from attnqat.cli import main as cli_main
from attnqat.demo_app import *  # noqa: F401,F403
from attnqat.demo_app import resolve_model_default


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """``attnqat demo``'s arguments, --model's default resolved (:func:`attnqat.demo_app.resolve_model_default`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    return resolve_model_default(build_parser("demo").parse_args(["demo", *argv]))


def main(argv: list[str] | None = None) -> int:
    return cli_main(["demo", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
