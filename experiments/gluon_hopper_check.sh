#!/usr/bin/env bash
# One device call on an H100/H200 (under 10 minutes: the step timeouts sum to 555 s): the Gluon sm_90 kernels' compile
# and GPU tests, first the forward's bf16 and FP4 inference variants', then the Attn-QAT training variant's (every
# output against the Triton training forward and the reference; the Triton backward on its saved tensors), then the
# Gluon backward's with both dK/dV kernels, "default" and "ws" (dQ, dK, dV against the Triton backward and the
# reference; the Gluon pair against the all-Triton path), then the timings beside cuDNN, flash SDPA and attn_qat's
# Triton kernels (training also backward alone and forward+backward, beside cuDNN's and the all-Triton path's). Every
# step has a timeout (a pipeline deadlock hangs the GPU, not the script); pytest runs verbose, so a step cut short
# names the test it was in. The warp-specialised backward (variant="ws", not yet run on a GPU) gets a short smoke
# test first (it also compiles its kernels for the later steps): if that fails or hangs, the later steps leave it out.
# Logs to $OUT (default /tmp/gluon_hopper_out). Usage, from the repo root: bash experiments/gluon_hopper_check.sh
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/gluon_hopper_out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/env.log"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/env.log"
TRAINING="gpu_training or (gluon_forward_then and triton_bwd)"
BACKWARD="gpu_backward or (gluon_forward_then and gluon_bwd)"
timeout ${T_TEST:-115} python3 -m pytest -v -rs -p no:cacheprovider --durations=5 -m "gpu or not gpu" \
  -k "not ($TRAINING or $BACKWARD)" tests/test_hopper_gluon.py 2>&1 | tee "$OUT/pytest.log" | tail -25
timeout ${T_TRAIN:-95} python3 -m pytest -v -rs -p no:cacheprovider --durations=5 -m "gpu or not gpu" \
  -k "$TRAINING" tests/test_hopper_gluon.py 2>&1 | tee "$OUT/pytest_training.log" | tail -25
NO_WS=""
timeout ${T_WS:-45} python3 -m pytest -x -v -rs -p no:cacheprovider -m "gpu or not gpu" \
  -k "gpu_backward_matches and ws and (97 or 1025-128-True)" tests/test_hopper_gluon.py > "$OUT/pytest_ws_smoke.log" 2>&1
WS_RC=$?; tail -5 "$OUT/pytest_ws_smoke.log"
if [ $WS_RC -ne 0 ]; then
  echo "ws smoke test failed (rc $WS_RC; 124: timed out, a hang): the ws variant is left out below"
  BACKWARD="($BACKWARD) and not ws"; NO_WS="--no-ws"
fi
timeout ${T_BWD:-130} python3 -m pytest -v -rs -p no:cacheprovider --durations=5 -m "gpu or not gpu" \
  -k "$BACKWARD" tests/test_hopper_gluon.py 2>&1 | tee "$OUT/pytest_backward.log" | tail -25
timeout ${T_BENCH:-120} python3 bench/gluon_hopper.py $NO_WS 2>&1 | tee "$OUT/bench.log"
timeout ${T_CAUSAL:-50} python3 bench/gluon_hopper.py --shapes 1,40,8192,128 2,24,4096,64 --causal $NO_WS 2>&1 \
  | tee "$OUT/bench_causal.log"
