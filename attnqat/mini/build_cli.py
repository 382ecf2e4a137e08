"""``attnqat build-mini``: the console script's entry for :mod:`attnqat.train.mini` (the stages, their arguments
and checks live there; ``python -m attnqat.train.mini`` runs the same)."""
from __future__ import annotations

import argparse

from attnqat.train import mini
from attnqat.train.mini import HELP, add_arguments  # noqa: F401 (the command's protocol: HELP, add_arguments, main)

__doc__ = mini.__doc__  # (--help prints a command module's docstring: the stages' description)


def main(args: argparse.Namespace) -> int:
    mini.check_arguments(args)
    return mini.build(args)
