#!/usr/bin/env bash
# Device runs that build the mini model (docs/mini.md). Usage on the GPU machine, from the repo root:
#   bash bench/gpu_mini.sh vae MINUTES [again]     # init + train the VAE (again: train it further); environment:
#                                                  # VAE_FROM (a trained VAE folder to start from), VAE_TRAIN
#                                                  # (all|decoder), VAE_DECODER_DIM (a new decoder this wide),
#                                                  # VAE_LR, VAE_BATCH; W (working folder)
#   bash bench/gpu_mini.sh train MINUTES SLEEP [--set K=V ...|auto]
#                                                  # (init from a carried runs/mini_vae if there is no model yet,
#                                                  # warm-started from a carried runs/mini_from: an exported build;
#                                                  # --set: configs/mini.yaml overrides; auto: profile eager and
#                                                  # compiled blocks first and train with the faster)
#                                                  # start the transformer in the background if the VAE
#                                                  # passes its detector check, then sleep SLEEP seconds
#   bash bench/gpu_mini.sh build VAE_MINUTES MINUTES SLEEP [--set K=V ...|auto]
#                                                  # the whole build in one background job: init, the VAE for
#                                                  # VAE_MINUTES, its detector gate, then the transformer as
#                                                  # `train` does; sleep SLEEP seconds (a session's first call:
#                                                  # nothing carried; VAE_BATCH in the environment, default 16)
#   bash bench/gpu_mini.sh wait SECONDS [tests]    # let it train; copy logs to $OUT (tests: meanwhile run
#                                                  # `pytest -m gpu` beside it: correctness only, it shares the GPU)
#   bash bench/gpu_mini.sh profile [--set K=V ...] # where a training step's time goes (before train)
#   bash bench/gpu_mini.sh export                  # export runs/mini/mini and pack it into $OUT (2 parts; MAX_FOLDER_MB
#                                                  # for a larger build, TRANSFORMER_SIZE at `train`'s init)
set -uo pipefail
export PYTHONUNBUFFERED=1
if [ -d .whl ] && [ ! -d /tmp/site/diffusers ]; then  # once a machine: a second install would rewrite modules
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
W=${W:-runs/mini}
# Logs live in runs/logs (a background job outlives the call whose $OUT it started in); each call returns them
# as one $OUT/logs.tar (a call brings back at most 8 files; $OUT/NAME.tar for LOGS=runs/NAME).
LOGS=${LOGS:-runs/logs}; mkdir -p $LOGS  # LOGS (environment): a second build beside the first keeps its own
# A VAE trained by an earlier build (carried as runs/mini_vae: its model/vae and timings.json) is reused; an
# exported build carried as runs/mini_from (its OUT/mini) is continued: a warm start (docs/mini.md).
init_model() {
  [ -f $W/model/model_index.json ] && return
  if [ -z "${TRANSFORMER_SIZE:-}" ] && [ -f runs/mini_from/attnqat_mini.json ]; then  # a new size starts afresh
    python3 -m attnqat.train.mini --out $W --stage init --from runs/mini_from --vae runs/mini_vae/model/vae 2>&1 \
      | grep -v Writing
  elif [ -d runs/mini_vae/model/vae ]; then  # TRANSFORMER_SIZE (environment): a capacity sweep's new transformer
    python3 -m attnqat.train.mini --out $W --stage init --vae runs/mini_vae/model/vae \
      ${TRANSFORMER_SIZE:+--transformer-size "$TRANSFORMER_SIZE"} 2>&1 | grep -v Writing
    cp runs/mini_vae/timings.json $W/timings.json
  fi
}
# The transformer stage behind its gate (the detector must read the colour of most held-out VAE round trips
# at the CPU size), in the foreground of the calling process: MINUTES [--set K=V ...|auto].
train_transformer() {
  if ! python3 - "$W/timings.json" <<'PY'
import json, sys
rows = [r for r in json.load(open(sys.argv[1])) if r["stage"] == "vae"]
acc = rows[-1].get("detector", {}).get("33x128x128", {})
print("vae gate:", acc)
sys.exit(0 if (acc.get("colour") or 0) >= 0.8 else 1)
PY
  then echo "VAE below the gate: not training the transformer"; return 1; fi
  local minutes=$1; shift; local extra=("$@")
  if [ "${extra[0]:-}" = auto ]; then  # auto [--set K=V ...]: the overrides apply to the profile too
    extra=("${extra[@]:1}")
    local sets=(); for x in "${extra[@]}"; do [ "$x" != --set ] && sets+=(--set "$x"); done
    for c in false true; do
      python3 bench/profile_mini_step.py --out $W --steps 12 --warmup 4 --json "$LOGS/profile_compile_$c.json" \
        "${sets[@]}" --set data.corpus.pool=64 --set train.compile=$c 2>&1 | grep -E "^[0-9]+x" || echo "profile compile=$c failed"
    done
    extra+=(--set "train.compile=$(python3 - "$LOGS" <<'PY'
import json, sys
from pathlib import Path
def step(c):  # seconds per step over the size cycle (equal weights)
    try:
        per = json.loads((Path(sys.argv[1]) / f"profile_compile_{c}.json").read_text())["per_step_s"]
    except (OSError, ValueError, KeyError):
        return float("inf")
    return sum(sum(v.values()) for v in per.values()) / max(len(per), 1)
print("true" if step("true") < 0.9 * step("false") else "false")
PY
)")
    echo "training with ${extra[*]}"
  fi
  python3 -m attnqat.train.mini --out $W --stage transformer --minutes "$minutes" "${extra[@]}"
}
case "$1" in
  vae)
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    python3 -c "import torch, triton, diffusers; print('torch', torch.__version__, 'triton', triton.__version__, 'diffusers', diffusers.__version__)"
    python3 -m attnqat.train.mini --out $W --stage init ${VAE_FROM:+--vae "$VAE_FROM"} 2>&1 | grep -v Writing
    again=""; [ "${3:-}" = again ] && again=--vae-again
    python3 -m attnqat.train.mini --out $W --stage vae --vae-minutes "$2" $again --vae-batch "${VAE_BATCH:-16}" \
      --vae-lr "${VAE_LR:-1e-3}" --vae-train "${VAE_TRAIN:-all}" \
      ${VAE_DECODER_DIM:+--vae-decoder-dim "$VAE_DECODER_DIM"} 2>&1 | tee -a "$W/vae.log" | grep --line-buffered -v Warn
    ;;
  train)
    init_model
    minutes=$2; pause=${3:-120}; shift $(( $# < 3 ? $# : 3 ))
    setsid nohup bash "$0" _transformer "$minutes" "$@" > $W/train.log 2>&1 < /dev/null &
    sleep "$pause"
    ;;
  _transformer)
    shift; train_transformer "$@"
    exit 0
    ;;
  build)
    mkdir -p $W
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    python3 -c "import torch, triton, diffusers; print('torch', torch.__version__, 'triton', triton.__version__, 'diffusers', diffusers.__version__)"
    vae_minutes=$2; minutes=$3; pause=${4:-120}; shift $(( $# < 4 ? $# : 4 ))
    setsid nohup bash "$0" _build "$vae_minutes" "$minutes" "$@" > $W/train.log 2>&1 < /dev/null &
    sleep "$pause"
    ;;
  _build)
    # VAE_FROM (environment): a trained VAE folder to start the VAE from (a warm start) instead of an untrained one
    python3 -m attnqat.train.mini --out $W --stage init ${VAE_FROM:+--vae "$VAE_FROM"} 2>&1 | grep --line-buffered -v Writing
    python3 -m attnqat.train.mini --out $W --stage vae --vae-minutes "$2" --vae-batch "${VAE_BATCH:-16}" \
      --vae-lr "${VAE_LR:-1e-3}" 2>&1 | grep --line-buffered -v Warn
    shift 2; train_transformer "$@"
    exit 0
    ;;
  profile)
    init_model
    shift; python3 bench/profile_mini_step.py --out $W --json "$LOGS/profile_$(date +%s).json" "$@" 2>&1 | grep -v Warn | tail -4
    exit 0
    ;;
  wait)
    start=$SECONDS
    if [ "${3:-}" = tests ]; then
      timeout $(( $2 - 30 )) python3 -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | tee "$LOGS/gpu_tests.log" | tail -15
    fi
    left=$(( $2 - (SECONDS - start) )); [ $left -gt 0 ] && sleep $left
    ;;
  export)
    while pgrep -f "attnqat.train.mini" > /dev/null; do sleep 5; done
    python3 -m attnqat.train.mini --out $W --stage export ${MAX_FOLDER_MB:+--max-folder-mb "$MAX_FOLDER_MB"} 2>&1 | tail -3
    # named after W (runs/mini: mini.tar.part-*, mini_vae.tar), so two builds' exports come back side by side
    name=$(basename $W)
    tar -C $W -cf /tmp/$name.tar mini && split -b 15M /tmp/$name.tar "$OUT/$name.tar.part-"
    # the fp32 VAE the transformer was trained with (a warm start's --vae: the export holds it in fp16)
    tar -C $W -cf "$OUT/${name}_vae.tar" model/vae timings.json
    ;;
esac
tr '\r' '\n' < $W/train.log 2>/dev/null | grep -v "it/s\]$" | tail -n 12
cp $W/train.log $W/run/log.csv $W/timings.json $LOGS/ 2>/dev/null
tar -cf "$OUT/$(basename $LOGS).tar" $LOGS
tail -n 3 $W/run/log.csv 2>/dev/null
# the held-out rows: flow loss and wrong/right caption loss (about 1.00 = the prompt is ignored)
python3 - $W/run/log.csv <<'PY' 2>/dev/null
import csv, sys
rows = [r for r in csv.DictReader(open(sys.argv[1])) if r.get("eval_flow")]
for r in rows[-4:]:
    print(f"step {r['step']}: held-out flow {float(r['eval_flow']):.4f}, wrong/right caption {r.get('eval_prompt_ratio') or '-'}")
PY
exit 0
