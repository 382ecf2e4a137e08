#!/usr/bin/env bash
# `attnqat train` end to end on Wan 2.1 14B-sized random weights (docs/multigpu.md): the folder, the prompt
# embeddings, full-parameter QAT on NPROC GPUs (FSDP2, AdamW8bit, the teacher sharded, Ulysses over all of them),
# an exact-resume check (a run whose rank 1 is killed mid-step after a checkpoint, resumed, against one that ran
# through), and LoRA-QAT on one GPU. Step time and memory are in each run's log.csv; each run also says the host's
# peak memory (free -g every 2 s) and its setup times.
#   bash bench/gpu_wan14b_train.sh folder            # bench/random_wan_folder.py -> $WAN (once a machine; ~29 GB)
#   bash bench/gpu_wan14b_train.sh data              # attnqat precompute of 8 prompts -> $WAN_DATA
#   bash bench/gpu_wan14b_train.sh full STEPS        # the full-parameter run, STEPS steps, in $W/full
#   bash bench/gpu_wan14b_train.sh through STEPS     # $W/through: STEPS uninterrupted steps, writing no checkpoint
#   bash bench/gpu_wan14b_train.sh repeat STEPS      # $W/through twice ($W/again): do two runs give the same losses?
#   bash bench/gpu_wan14b_train.sh kill STEPS EVERY  # $W/killed: a checkpoint at step EVERY, rank 1 killed in the step
#                                                    # after it, --resume auto to STEPS, the losses against $W/through
#   bash bench/gpu_wan14b_train.sh lora STEPS        # LoRA-QAT on one GPU (configs/wan2.1-14b-lora.yaml), in $W/lora
#   bash bench/gpu_wan14b_train.sh compare A B       # the loss columns of two runs' log.csv, step by step
# Knobs (environment): CONFIG (configs/wan2.1-14b-sp.yaml; lora: configs/wan2.1-14b-lora.yaml),
# WAN (/tmp/wan14b), WAN_DATA (/tmp/wan14b_data), W (runs/wan14b), SIZE (14b | 1.3b),
# LAYERS (all), NPROC (2), LATENT (the config's 16x21x60x104), SET (more --set values, space-separated).
# Disk: the folder 29 GB; a full-parameter checkpoint 86 GB (fp32 master weights, 8-bit moments) with
# checkpoint.export=false (set here), 115 GB with the bf16 export. The runs stop before a second checkpoint (the last
# step writes one, so each runs STEPS of STEPS + 1 steps): one checkpoint on disk at a time. through and kill run
# with train.deterministic (DET=false: without): on GPUs two runs are not bit for bit alike otherwise.
# A CPU dry run of the same commands: SIZE=1.3b LAYERS=1 NPROC=1 LATENT=16,2,8,8 WAN=/tmp/w WAN_DATA=/tmp/wd \
#   W=/tmp/wr SET="train.mixed_precision=no" bash bench/gpu_wan14b_train.sh kill 3 2
set -uo pipefail
export PYTHONUNBUFFERED=1
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:$PWD
CONFIG=${CONFIG:-configs/wan2.1-14b-sp.yaml}
WAN=${WAN:-/tmp/wan14b}; WAN_DATA=${WAN_DATA:-/tmp/wan14b_data}; W=${W:-runs/wan14b}; NPROC=${NPROC:-2}

sets() {  # --set arguments of a run: the folder, its data, checkpoints every $EVERY steps (keep 1), the knobs
  local s="model=$WAN data.path=$WAN_DATA output_dir=$1 train.max_steps=$2 train.warmup_steps=1
           checkpoint.every=${EVERY:-2} checkpoint.keep=1 checkpoint.export=false log.eval_every=1000 data.held_out=1
           train.sequence_parallel=$NPROC ${SET:-}"
  [ "$NPROC" -gt 1 ] && s="$s train.optimizer=adamw8bit"
  [ -n "${LATENT:-}" ] && s="$s data.latent_shape=[${LATENT}]"
  for x in $s; do printf -- "--set %s " "$x"; done
}

train() {  # OUTPUT STEPS [attnqat train options...]: NPROC processes (FSDP2) or one; says the host's peak memory
  local out=$1 steps=$2 rc watch; shift 2
  mkdir -p "$(dirname "$out")"
  # the host's used memory every 2 s while the run lasts (loading the 14B is where it peaks: docs/multigpu.md)
  ( while sleep 2; do free -g | awk '/^Mem:/ {print $3}'; done ) > "$out.hostmem" & watch=$!
  if [ "$NPROC" -gt 1 ]; then
    accelerate launch --config_file configs/fsdp2_wan14b.yaml --num_processes "$NPROC" -m attnqat.train \
      --config "$CONFIG" $(sets "$out" "$steps") "$@"
  else
    python3 -m attnqat.train --config "$CONFIG" $(sets "$out" "$steps") "$@"
  fi
  rc=$?
  kill "$watch" 2> /dev/null
  echo "host memory used at the peak: $(sort -n "$out.hostmem" | tail -n 1) GiB (free -g, every 2 s; $out.hostmem)"
  return $rc
}

losses() { python3 -c "
import csv, sys
for r in csv.DictReader(open(sys.argv[1])):
    print(r['step'], r['loss'], r.get('step_s', ''), r.get('peak_gib', ''), r.get('peak_reserved_gib', ''))" "$1/log.csv"; }

case "${1:-}" in
  folder)
    [ -f "$WAN/model_index.json" ] && { echo "$WAN is there"; exit 0; }
    python3 bench/random_wan_folder.py --size "${SIZE:-14b}" ${LAYERS:+--layers $LAYERS} --out "$WAN" ;;
  data)
    p=$(mktemp); for i in 1 2 3 4 5 6 7 8; do echo "a test prompt number $i, a red ball rolls left" >> "$p"; done
    python3 -m attnqat precompute --prompts "$p" --model "$WAN" --out "$WAN_DATA"; rm -f "$p" ;;
  full)
    train "$W/full" "${2:?steps}" --overwrite 2>&1 | tr '\r' '\n' | grep -v "it/s\]\|s/it\]" | tail -5
    losses "$W/full" ;;
  through)
    steps=${2:?steps}
    EVERY=1000 SET="train.deterministic=${DET:-true} ${SET:-}" train "$W/through" $((steps + 1)) --overwrite --stop-after "$steps" > "$W.through.log" 2>&1 \
      || { tail -20 "$W.through.log"; exit 1; }
    grep -h "host memory" "$W.through.log"
    losses "$W/through" ;;
  repeat)
    bash "$0" through "${2:?steps}" > /dev/null || exit 1
    mv "$W.through.log" "$W.first.log"; rm -rf "$W/again"; mv "$W/through" "$W/again"
    bash "$0" through "$2" > /dev/null || exit 1
    bash "$0" compare "$W/through" "$W/again" ;;
  kill)
    steps=${2:?steps}; export EVERY=${3:?every}; ck=$W/killed/checkpoints/step-$(printf %07d "$EVERY")
    [ "$steps" -gt "$EVERY" ] && [ "$steps" -lt $((2 * EVERY)) ] || { echo "need EVERY < STEPS < 2 x EVERY"; exit 2; }
    export SET="train.deterministic=${DET:-true} ${SET:-}"  # as through's: GPU runs repeat bit for bit only so
    train "$W/killed" $((steps + 1)) --overwrite > "$W.killed.log" 2>&1 &
    run=$!
    alive() {  # the run ended on its own before its checkpoint was committed (an error, or the kernel's OOM killer)
      kill -0 "$run" 2> /dev/null && return
      wait "$run"; local rc=$?; tail -20 "$W.killed.log"
      echo "the run ended (exit $rc) before $ck was committed; this script killed nothing (host memory at the peak:" \
           "$(sort -n "$W/killed.hostmem" 2> /dev/null | tail -n 1) GiB)"; exit 1; }
    until [ -d "$ck.tmp" ] || [ -f "$ck/manifest.json" ]; do alive; sleep 1; done; t0=$(date +%s)
    until [ -f "$ck/manifest.json" ]; do alive; sleep 1; done  # committed: the rename follows the manifest
    echo "checkpoint $ck: written in $(($(date +%s) - t0)) s, $(du -sh "$ck" | cut -f1)"
    sleep "${KILL_AFTER:-6}"  # into the next step
    for pid in $(pgrep -f "attnqat.train --config"); do  # rank 1 (its LOCAL_RANK), or the one process
      if [ "$NPROC" = 1 ] || tr '\0' '\n' < /proc/$pid/environ 2>/dev/null | grep -qx "LOCAL_RANK=1"; then
        kill -9 "$pid" && echo "killed pid $pid"
      fi
    done
    wait
    echo "killed ($(grep -c . "$W/killed/log.csv") log lines); resuming"
    t0=$(date +%s)
    train "$W/killed" $((steps + 1)) --resume auto --stop-after "$steps" >> "$W.killed.log" 2>&1 \
      || { tail -20 "$W.killed.log"; exit 1; }
    echo "resumed to step $steps in $(($(date +%s) - t0)) s"
    grep -h "host memory\|set up in\|resumed from" "$W.killed.log" | sed 's/^.*attnqat train: /attnqat train: /'
    bash "$0" compare "$W/through" "$W/killed" ;;
  lora)
    NPROC=1 CONFIG=configs/wan2.1-14b-lora.yaml train "$W/lora" "${2:?steps}" --overwrite 2>&1 | tr '\r' '\n' \
      | grep -v "it/s\]\|s/it\]" | tail -5
    losses "$W/lora" ;;
  compare)
    python3 - "$2/log.csv" "$3/log.csv" <<'PY'
import csv, sys
a, b = ({r["step"]: r["loss"] for r in csv.DictReader(open(p))} for p in sys.argv[1:])
for step in a:
    print(step, a[step], b.get(step, "-"))
print("losses equal at every step" if a and a == b else "LOSSES DIFFER")
PY
    ;;
  *) sed -n 2,17p "$0"; exit 2 ;;
esac
