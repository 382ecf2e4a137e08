#!/usr/bin/env bash
# The recoverable ceiling (docs/quality.md): mini's transformer trained from scratch twice with configs/mini.yaml's
# recipe, the same seed and batches, once in bf16 attention and once in attn_qat (FP4 in the loop from step 0);
# then attnqat quality at the newest step both runs kept a checkpoint of (an equal-step comparison), the
# bf16-trained run in bf16 and in FP4 beside the FP4-trained run in FP4. WIDTH > 1 first writes a folder with
# WIDTH times the heads and FFN (a random transformer of that config; the VAE and text encoder linked).
#   bash bench/gpu_ceiling.sh start MINUTES      # both runs side by side in the background (GPU $CUDA_VISIBLE_DEVICES)
#   bash bench/gpu_ceiling.sh report [ARGS...]   # wait for them; the quality table at the common step -> $W/quality
#   bash bench/gpu_ceiling.sh full [tN]          # at full length: the shipped base's four transformer runs
#                                                # (bench/build_mini.sh, 23,808 steps) on its VAE, FP4 in the loop,
#                                                # in the background; UNTIL tN (t1-t3) for a short session
#   bash bench/gpu_ceiling.sh fullreport [ARGS...]  # wait; the built model in FP4 beside MODEL, the bf16 base that
#                                                # recipe built, in bf16 and FP4 -> $W/quality_full
# Knobs (environment): W (runs/ceiling), WIDTH (1), MODEL (attnqat/models/mini), EXTRA (more --set values),
# ROT=1: the FP4 run trains with Q and K rotated (qk_rotation=hadamard) and is scored with it, beside the bf16-trained
# run with the rotation alone (the ceiling with the rotation in the loop, against plain nvfp4's gap).
set -uo pipefail
export PYTHONUNBUFFERED=1
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:$PWD
W=${W:-runs/ceiling}; WIDTH=${WIDTH:-1}; MODEL=${MODEL:-attnqat/models/mini}
[ "$WIDTH" != 1 ] && BASE=$W/mini_x$WIDTH || BASE=$MODEL

train_one() {  # NAME MINUTES MODE: resumes its checkpoint, stops on the time limit
  set -f
  python3 - "$BASE" "$W/$1" "$2" ${EXTRA:-} "attention.mode=$3" <<'PY'
import sys
from attnqat.train import load_config, train
model, out, minutes, *sets = sys.argv[1:]
cfg = load_config("configs/mini.yaml", [f"model={model}", f"output_dir={out}", "train.compile=true",
                                        "checkpoint.keep=8", *sets])  # keep 8: a step both runs reached
result = train(cfg, resume="auto", time_limit=float(minutes) * 60)
print(f"{out}: step {result.steps}")
PY
  local rc=$?; set +f; return $rc
}

common_step() {  # the newest checkpoint step both runs have
  for d in $(ls -d $W/bf16/checkpoints/step-* 2>/dev/null | sort -r); do
    [ -f "$W/fp4/checkpoints/$(basename $d)/manifest.json" ] && { basename $d; return; }
  done
}

case "${1:-}" in
  start)
    mkdir -p $W
    if [ "$WIDTH" != 1 ] && [ ! -f $BASE/transformer/config.json ]; then
      python3 experiments/wide_mini.py --model $MODEL --width $WIDTH --out $BASE || exit 1
    fi
    for m in bf16 attn_qat; do n=$([ $m = bf16 ] && echo bf16 || echo fp4)
      extra="${EXTRA:-}"; [ $m = attn_qat ] && [ "${ROT:-0}" = 1 ] && extra="$extra attention.options.qk_rotation=hadamard"
      setsid nohup bash -c "$(declare -f train_one); BASE=$BASE W=$W EXTRA='$extra' train_one $n ${2:?minutes} $m" \
        > $W/$n.out 2>&1 < /dev/null & echo $! > $W/$n.pid
      sleep 5
    done ;;
  report)
    for n in bf16 fp4; do while [ -f $W/$n.pid ] && kill -0 $(cat $W/$n.pid) 2>/dev/null; do sleep 5; done; done
    s=$(common_step); [ -n "$s" ] || { echo "no checkpoint step both runs have"; exit 1; }
    echo "common step: $s"
    shift
    # ROT=1: the FP4-trained row as its run trained, the bf16-trained one also with the rotation alone; the gap stays
    # plain nvfp4's on the bf16-trained run (the shipped file's measure)
    fp4=nvfp4; rot=(); [ "${ROT:-0}" = 1 ] && fp4="nvfp4,qk_rotation=hadamard" \
      && rot=(--variant "s_bf16_fp4_rot=$fp4:$W/bf16/checkpoints/$s")
    python3 -m attnqat quality --model $BASE --base-modes bf16 --variant s_bf16=bf16:$W/bf16/checkpoints/$s \
      --variant s_bf16_fp4=nvfp4:$W/bf16/checkpoints/$s "${rot[@]}" --variant s_fp4=$fp4:$W/fp4/checkpoints/$s \
      --fp4-reference s_bf16_fp4 --bf16-reference s_bf16 --out $W/quality --overwrite "$@" ;;
  full)
    mkdir -p $W
    sets="--set attention.mode=attn_qat"; [ "${ROT:-0}" = 1 ] && sets="$sets --set attention.options.qk_rotation=hadamard"
    for kv in ${EXTRA:-}; do sets="$sets --set $kv"; done
    setsid nohup env VAE=$MODEL UNTIL=${2:-t4} EXTRA="$sets" bash bench/build_mini.sh $W/full > $W/full.out 2>&1 \
      < /dev/null & echo $! > $W/full.pid ;;
  fullreport)
    while [ -f $W/full.pid ] && kill -0 $(cat $W/full.pid) 2>/dev/null; do sleep 5; done
    [ -f $W/full/t4/mini/attnqat_mini.json ] || { echo "no $W/full/t4/mini: the chain has not finished"; exit 1; }
    shift
    fp4=nvfp4; rot=(); [ "${ROT:-0}" = 1 ] && fp4="nvfp4,qk_rotation=hadamard" && rot=(--variant "base_rot=$fp4")
    python3 -m attnqat quality --model $MODEL --base-modes bf16,nvfp4 "${rot[@]}" \
      --variant "ceiling=$fp4:$W/full/t4/mini/transformer" --out $W/quality_full --overwrite "$@" ;;
  *) sed -n 2,13p "$0"; exit 2 ;;
esac
