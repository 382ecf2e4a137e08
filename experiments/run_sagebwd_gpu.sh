#!/usr/bin/env bash
# One device call: GPU tests, benchmark (+ config sweep, K-major on/off), GPU training demo. Logs to $OUT.
# Usage, from the repo root: OUT=/some/dir bash experiments/run_sagebwd_gpu.sh (the paths below are the repo root's).
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/sagebwd_out}; mkdir -p "$OUT"
(nvidia-smi --query-gpu=name,driver_version --format=csv
 python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
 timeout ${T_TEST:-90} python -m pytest -m gpu -q -s -p no:cacheprovider tests/test_sagebwd.py 2>&1) | tee "$OUT/pytest_gpu.log" | tail -40
ATTNQAT_SAGEBWD_KMAJOR=0 timeout ${T_ROW:-50} python bench/sagebwd.py --no-accuracy --variants int8 --out /tmp/rowmajor 2>&1 | grep "^|" | tee "$OUT/bench_rowmajor.log"
timeout ${T_BENCH:-270} python bench/sagebwd.py ${BENCH_ARGS:---sweep} --out "$OUT" 2>&1 | tee "$OUT/bench.log" | grep -v "^accuracy"
timeout ${T_TRAIN:-70} python experiments/train_sagebwd_lm.py --device cuda --steps 600 --batch 32 --seq 512 --layers 4 \
  --d-model 256 --lr 2e-3 --out "$OUT" --name sagebwd_training_gpu 2>&1 | tee "$OUT/train.log" | grep "=="
