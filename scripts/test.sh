#!/usr/bin/env bash
# The README's test command. Installs the CPU build of torch (never the CUDA one) and the project,
# then runs the CPU suite: Triton kernels run under Triton's interpreter (tests/conftest.py sets it).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q "torch==2.13.0" -e ".[test]"
python -m pytest -q "$@"
