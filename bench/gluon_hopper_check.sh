#!/usr/bin/env bash
# One device call on an H100/H200 (under 10 minutes: the step timeouts sum to 550 s): the Gluon sm_90 forward's
# compile and GPU tests (bf16, FP4 inference and Attn-QAT training variants; the Triton backward on the training
# forward's saved tensors), then their timings beside cuDNN, flash SDPA and attn_qat's Triton forwards (and, for
# training, forward+backward beside cuDNN's and the all-Triton path's). Every step has a timeout (a pipeline
# deadlock hangs the GPU, not the script). Logs to $OUT (default /tmp/gluon_hopper_out).
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gluon_hopper_out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/env.log"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/env.log"
timeout ${T_TEST:-270} python3 -m pytest -q -rs -p no:cacheprovider --durations=8 -m "gpu or not gpu" \
  tests/test_hopper_gluon.py 2>&1 | tee "$OUT/pytest.log" | tail -40
timeout ${T_BENCH:-170} python3 bench/gluon_hopper.py 2>&1 | tee "$OUT/bench.log"
timeout ${T_CAUSAL:-110} python3 bench/gluon_hopper.py --shapes 1,40,8192,128 2,24,4096,64 --causal 2>&1 \
  | tee "$OUT/bench_causal.log"
