#!/usr/bin/env bash
# One device call: GPU test suite, kernel benchmark, fidelity on the kernels. Logs and docs -> $OUT.
# Usage (on the GPU machine, repo root): OUT=/some/dir bash bench/gpu_run.sh [stage...]
# stages: tests kernels fidelity e2e e2e_compile train (default: tests kernels fidelity)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
stages=${*:-tests kernels fidelity}
for st in $stages; do
  echo "=== $st"
  case $st in
    tests) timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -25 ;;
    kernels) timeout 300 python3 bench/kernels.py 2>&1 | tee "$OUT/kernels.log" | tail -30 ;;
    fidelity) timeout 120 python3 bench/fidelity.py --device cuda 2>&1 | tee "$OUT/fidelity.log" | tail -12 ;;
    e2e) timeout 400 python3 bench/e2e.py --sdpa cudnn --layers "${E2E_LAYERS:-10}" --warmup 1 --repeats 1 2>&1 | tee "$OUT/e2e.log" | tail -20 ;;
    e2e_compile) timeout 580 python3 bench/e2e.py --sdpa cudnn --layers "${E2E_LAYERS:-10}" --modes diffusers,bf16,attn_qat \
      --compile --warmup 1 --repeats 2 --docs "$OUT/e2e_compile.md" --json "$OUT/e2e_compile.json" 2>&1 | tee "$OUT/e2e_compile.log" | tail -20 ;;
    train) timeout 300 python3 bench/train_step.py 2>&1 | tee "$OUT/train.log" | tail -20 ;;
  esac
done
for f in docs/benchmarks.md docs/bench_kernels.json docs/bench_fidelity.json; do [ -f $f ] && cp $f "$OUT"/; done
ls bench/results/*.json >/dev/null 2>&1 && cp bench/results/*.json "$OUT"/
true
