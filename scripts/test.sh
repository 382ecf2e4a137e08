#!/usr/bin/env bash
# The README's test command: installs the project (pinned torch) and runs the CPU suite; Triton
# kernels run under Triton's interpreter (tests/conftest.py sets it).
# The pin does not pick the build: from PyPI on Linux torch==2.13.0 is the multi-GB CUDA build. On
# this project's CI machine a local CPU wheel already satisfies it (no index is reachable there, so
# none is named here); elsewhere install the CPU wheel first, as the README says:
#   pip install "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q "torch==2.13.0" -e ".[test]"
# Two workers (pytest-xdist; one on a one-core machine): much of a test's time is a Triton-interpreter
# thread or a forked process waiting, so two cores run the suite in ~0.6x the time of one worker.
python -m pytest -q -n auto --maxprocesses 2 "$@"
