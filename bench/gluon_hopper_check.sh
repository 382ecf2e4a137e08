#!/usr/bin/env bash
# One device call on an H100/H200 (under 10 minutes: the step timeouts sum to 555 s): the Gluon sm_90 kernels' compile
# and GPU tests, first the forward's bf16 and FP4 inference variants', then the Attn-QAT training variant's (every
# output against the Triton training forward and the reference; the Triton backward on its saved tensors), then the
# Gluon backward's with both dK/dV kernels, "default" and "ws" (dQ, dK, dV against the Triton backward and the
# reference; the Gluon pair against the all-Triton path), then the timings beside cuDNN, flash SDPA and attn_qat's
# Triton kernels (training also backward alone and forward+backward, beside cuDNN's and the all-Triton path's). Every
# step has a timeout (a pipeline deadlock hangs the GPU, not the script); pytest runs verbose, so a step cut short
# names the test it was in. Logs to $OUT (default /tmp/gluon_hopper_out).
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gluon_hopper_out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/env.log"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/env.log"
TRAINING="gpu_training or (gluon_forward_then and triton_bwd)"
BACKWARD="gpu_backward or (gluon_forward_then and gluon_bwd)"
timeout ${T_TEST:-125} python3 -m pytest -v -rs -p no:cacheprovider --durations=5 -m "gpu or not gpu" \
  -k "not ($TRAINING or $BACKWARD)" tests/test_hopper_gluon.py 2>&1 | tee "$OUT/pytest.log" | tail -25
timeout ${T_TRAIN:-100} python3 -m pytest -v -rs -p no:cacheprovider --durations=5 -m "gpu or not gpu" \
  -k "$TRAINING" tests/test_hopper_gluon.py 2>&1 | tee "$OUT/pytest_training.log" | tail -25
timeout ${T_BWD:-150} python3 -m pytest -v -rs -p no:cacheprovider --durations=5 -m "gpu or not gpu" \
  -k "$BACKWARD" tests/test_hopper_gluon.py 2>&1 | tee "$OUT/pytest_backward.log" | tail -25
timeout ${T_BENCH:-130} python3 bench/gluon_hopper.py 2>&1 | tee "$OUT/bench.log"
timeout ${T_CAUSAL:-50} python3 bench/gluon_hopper.py --shapes 1,40,8192,128 2,24,4096,64 --causal 2>&1 \
  | tee "$OUT/bench_causal.log"
