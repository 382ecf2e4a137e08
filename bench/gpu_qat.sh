#!/usr/bin/env bash
# Device runs of the QAT fine-tunes of mini and their quality table (configs/mini_qat.yaml, docs/quality.md).
# On the GPU machine, from the repo root, once bench/gpu_mini.sh has built runs/mini/mini (MODEL=... for another):
#   bash bench/gpu_qat.sh start MINUTES   # the five fine-tunes, one after another in the background, MINUTES each
#   bash bench/gpu_qat.sh wait SECONDS    # let them run; progress to stdout, logs to $OUT
#   bash bench/gpu_qat.sh report          # wait for the last one; attnqat quality on every row -> docs/quality.*, $OUT
#   bash bench/gpu_qat.sh ship            # SHIP's runs exported as shipped files, scored beside the base rows
#   bash bench/gpu_qat.sh stop            # end the background runs (their checkpoints stay)
# A run that reaches its minutes saves a checkpoint and stops (no final/: attnqat quality takes the newest
# checkpoint); `start` again continues each run from there for MINUTES more.
# Knobs (environment): MODEL (runs/mini/mini), EXTRA (more --set values for every run, space-separated; a run's own
# switches override them), DROPIN_STEPS (a step cap for the drop-in ablation), SHIP (the runs packed), DEVICE
# (cuda), QUALITY_ARGS (more attnqat quality options), DOCS (docs: where bench/quality.py writes). A CPU smoke run:
#   MODEL=/tmp/m DEVICE=cpu DOCS=/tmp/d EXTRA="data.corpus.sizes=[[5,32,32]] data.corpus.size_weights=null ..." \
#     QUALITY_ARGS="--size 5x32x32 --steps 2 --prompts 2 --clips 2" bash bench/gpu_qat.sh start 0.1
set -uo pipefail
export PYTHONUNBUFFERED=1
# the wheels once a machine: installing again while a run imports from /tmp/site breaks that run
if [ -d .whl ] && [ ! -d /tmp/site/diffusers ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
MODEL=${MODEL:-runs/mini/mini}
DEVICE=${DEVICE:-cuda}
DOCS=${DOCS:-docs}
W=${W:-runs/mini_qat}  # where the runs go
# RUNS (environment) picks and orders them; PARALLEL=1 runs them side by side (a 9M-parameter model's step is
# launch-bound: one GPU holds several), else one after another.
RUNS=${RUNS:-"flow distill_output pbwd_normalized dropin bf16_control"}

ROT="attention.options.qk_rotation=hadamard"
LORA="train.trainable=lora train.lora.rank=32 train.lora.alpha=32 train.lr=1e-3"
cosine() { echo "train.lr_schedule=cosine train.max_steps=${COS_STEPS:-1500}"; }

overrides() {  # the --set switches of each run (configs/mini_qat.yaml's header); they come after EXTRA's
  case $1 in
    flow) ;;
    flow_lr2e-5) echo "train.lr=2e-5" ;;
    flow_lr1e-4) echo "train.lr=1e-4" ;;
    flow_attention) echo "train.trainable=attention" ;;
    distill_output) echo "objective.type=distill objective.target=output" ;;
    pbwd_normalized) echo "attention.options.p_bwd=normalized" ;;
    # DROPIN_STEPS: the drop-in ablation diverges (docs/quality.md); a cap leaves the GPU to the others
    dropin) echo "attention.mode=attn_qat_dropin ${DROPIN_STEPS:+train.max_steps=$DROPIN_STEPS}" ;;
    bf16_control) echo "attention.mode=bf16" ;;
    # the two backward ablations under the recipe that ships (distillation), not the paper's flow objective
    distill_pbwd_normalized) echo "$(overrides distill_output) attention.options.p_bwd=normalized" ;;
    distill_dropin) echo "$(overrides distill_output) $(overrides dropin)" ;;
    # the cosine round: the learning rate decays to 0 at COS_STEPS (distillation flattens at a constant rate)
    distill_cos) echo "objective.type=distill objective.target=output $(cosine)" ;;
    distill_cos_1e-4) echo "objective.type=distill objective.target=output train.lr=1e-4 $(cosine)" ;;
    distill_cos_2e-4) echo "objective.type=distill objective.target=output train.lr=2e-4 $(cosine)" ;;  # ships
    features_cos) echo "objective.type=distill objective.target=features $(cosine)" ;;
    # past the ~46% plateau? the same with an EMA of the student's weights (exported), or only attention trained
    features_cos_ema) echo "$(overrides features_cos) train.ema_decay=0.999" ;;
    features_attention) echo "$(overrides features_cos) train.trainable=attention train.lr=6e-4" ;;
    mix_cos) echo "objective.type=mix objective.target=output objective.flow_weight=0.1 $(cosine)" ;;
    # distillation plus each FP4 self-attention layer's own error (objective.attention_consistency, docs/training.md):
    # does a local term get past distillation's plateau? Against distill_output, the same run without it
    distill_cons) echo "$(overrides distill_output) objective.attention_consistency=1.0" ;;
    distill_cons_0.1) echo "$(overrides distill_output) objective.attention_consistency=0.1" ;;
    bf16_control_cos) echo "attention.mode=bf16 $(cosine)" ;;
    distill_cons_cos) echo "$(overrides distill_cos_2e-4) objective.attention_consistency=1.0" ;;
    # Q and K rotated by a Hadamard matrix before FP4 attention (attention.options.qk_rotation, attnqat.kernels.rotation)
    rot_distill) echo "$(overrides distill_cos_2e-4) $ROT" ;;
    rot_distill_1e-4) echo "$(overrides distill_cos_1e-4) $ROT" ;;
    rot_features) echo "$(overrides features_cos) train.lr=2e-4 $ROT" ;;
    rot_cons) echo "$(overrides rot_distill) objective.attention_consistency=1.0" ;;
    rot_distill_5e-5) echo "objective.type=distill objective.target=output train.lr=5e-5 $(cosine) $ROT" ;;
    # LoRA adapters instead of every weight (train.trainable=lora; the 14B recipe on one GPU, docs/multigpu.md)
    lora_distill) echo "$(overrides distill_cos_2e-4) $LORA" ;;
    rot_lora_distill) echo "$(overrides lora_distill) $ROT" ;;
    rot_lora_5e-4) echo "$(overrides rot_lora_distill) train.lr=5e-4" ;;
    # K's mean subtracted before FP4 attention as well (attention.options.k_smoothing): the shipped recipe with it
    rot_ks_distill_5e-5) echo "$(overrides rot_distill_5e-5) attention.options.k_smoothing=true" ;;
    rot_ks_distill_1e-4) echo "$(overrides rot_distill_1e-4) attention.options.k_smoothing=true" ;;
    # Q minus its 128-row block means quantized, their logits added back unquantized (attention.options.q_smoothing)
    rot_qs_distill_5e-5) echo "$(overrides rot_distill_5e-5) attention.options.q_smoothing=true" ;;
    rot_qs_distill_2e-4) echo "$(overrides rot_distill) attention.options.q_smoothing=true" ;;
    rot_qs_ks_distill_5e-5) echo "$(overrides rot_qs_distill_5e-5) attention.options.k_smoothing=true" ;;
    # Four Over Six on Q, K and V's block scales (docs/kernels.md) in the loop as well
    rot_qs_fos_distill_5e-5) echo "$(overrides rot_qs_distill_5e-5) attention.options.four_over_six=true" ;;
    # the shipped recipe aimed at 33x128x128, its weakest size (69.5% of the loss gap with Four Over Six at run
    # time): the 128x128 sizes drawn twice as often, or twice the steps (the cosine over 7,200)
    rot_qs_distill_5e-5_w128) echo "$(overrides rot_qs_distill_5e-5) data.corpus.size_weights=[2,4,1,2,1,2]" ;;
    rot_qs_distill_5e-5_long) echo "$(overrides rot_qs_distill_5e-5) train.max_steps=7200" ;;
  esac
}

train_one() {  # NAME MINUTES: train(..., time_limit) as python -m attnqat.train.mini does (resumes its checkpoint)
  set -f  # EXTRA's [[5,32,32]] is a value, not a file pattern
  python3 - "$MODEL" "$W/$1" "$2" ${EXTRA:-} $(overrides "$1") <<'PY'
import sys
from attnqat.train import load_config, train
model, out, minutes, *sets = sys.argv[1:]
cfg = load_config("configs/mini_qat.yaml", [f"model={model}", f"output_dir={out}", *sets])
result = train(cfg, resume="auto", time_limit=float(minutes) * 60)
print(f"{out}: step {result.steps}, held-out {result.gap_after}")
PY
  local rc=$?
  set +f
  return $rc
}

has_weights() {  # a run folder attnqat quality can read
  [ -f "$W/$1/final/transformer.safetensors" ] || ls "$W/$1"/checkpoints/step-*/manifest.json >/dev/null 2>&1
}

running() { [ -f $W/pid ] && kill -0 "$(cat $W/pid)" 2>/dev/null; }

score() {  # attnqat quality (bench/quality.py) on the base rows and the --variant rows given; table, picture, log -> $OUT
  python3 bench/quality.py --device "$DEVICE" --model "$MODEL" --docs "$DOCS" --out $W/quality "$@" ${QUALITY_ARGS:-} 2>&1 \
    | stdbuf -oL tr '\r' '\n' | grep --line-buffered -v "it/s\]$\|s/it\]$\|^ *$" | tee "$OUT/quality.log" | tail -n 40
  tar -cf "$OUT/quality.tar" $W/quality "$DOCS"/quality.md "$DOCS"/quality.png "$DOCS"/quality.json 2>/dev/null
}

case "${1:-}" in
  start)
    [ -f "$MODEL/model_index.json" ] || { echo "no trained mini at $MODEL (bash bench/gpu_mini.sh first)"; exit 1; }
    running && { echo "already running (pid $(cat $W/pid))"; exit 1; }
    mkdir -p $W
    [ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
    setsid nohup bash "$0" _all "${2:?minutes per run}" > $W/train.log 2>&1 < /dev/null &
    echo $! > $W/pid
    sleep "${3:-60}"
    ;;
  _all)
    for name in $RUNS; do
      echo "=== $name ($(date +%T))"
      if [ "${PARALLEL:-0}" = 1 ]; then
        mkdir -p $W/$name; (train_one "$name" "$2" > $W/$name.out 2>&1 || echo "=== $name failed") &
        sleep 5  # stagger the starts: each compiles and fills its pool
      else
        train_one "$name" "$2" || echo "=== $name failed"
      fi
    done
    wait
    echo "=== done ($(date +%T))"
    ;;
  wait)
    sleep "${2:-60}"
    ;;
  stop)
    running && kill -- -"$(cat $W/pid)"
    ;;
  report)
    while running; do sleep 10; done
    args=()
    add() { has_weights "$2" && args+=(--variant "$1=$3:$W/$2") || echo "no weights in $W/$2: row $1 left out"; }
    add qat flow attn_qat
    add qat_distill distill_output attn_qat
    add qat_pbwd_norm pbwd_normalized attn_qat
    add qat_dropin dropin attn_qat
    add qat_distill_pbwd_norm distill_pbwd_normalized attn_qat
    add qat_distill_dropin distill_dropin attn_qat
    add ctrl_fp4 bf16_control attn_qat
    add qat_lr2e-5 flow_lr2e-5 attn_qat
    add qat_lr1e-4 flow_lr1e-4 attn_qat
    add qat_attention flow_attention attn_qat
    add ctrl_bf16 bf16_control bf16
    add qat_distill_cos distill_cos attn_qat
    add qat_distill_cos_1e-4 distill_cos_1e-4 attn_qat
    add qat_distill_cos_2e-4 distill_cos_2e-4 attn_qat
    add qat_features_cos features_cos attn_qat
    add qat_features_cos_ema features_cos_ema attn_qat
    add qat_features_attention features_attention attn_qat
    add qat_mix_cos mix_cos attn_qat
    add qat_distill_cons distill_cons attn_qat
    add qat_distill_cons_0.1 distill_cons_0.1 attn_qat
    add ctrl_cos_fp4 bf16_control_cos attn_qat
    add ctrl_cos_bf16 bf16_control_cos bf16
    # the QAT weights that ship with mini, as a user loads them (FP8 changes over the base)
    [ -f "$MODEL/attn_qat.safetensors" ] && args+=(--variant "shipped=attn_qat:$MODEL/attn_qat.safetensors")
    args+=(--variant nvfp4_first2=nvfp4 --bf16-steps nvfp4_first2=0,1)
    has_weights flow && args+=(--variant "qat_first2=attn_qat:$W/flow" --bf16-steps qat_first2=0,1)
    score "${args[@]}"
    # the fine-tuned transformers of SHIP (environment), bf16, in 15 MB parts (a file back is at most 16 MiB)
    rm -rf /tmp/qat_weights /tmp/qat_weights.tar; mkdir -p /tmp/qat_weights  # this report's runs only
    for name in ${SHIP:-flow flow_attention distill_output}; do
      python3 - "$W/$name" "/tmp/qat_weights/$name.safetensors" <<'PY' || echo "no weights of $name packed"
import sys
import torch
from safetensors.torch import save_file
from attnqat.pipelines.loading import _read_state_dict, checkpoint_weights_path  # the lookup attnqat quality uses
state = _read_state_dict(sys.argv[1])
save_file({k: v.to(torch.bfloat16).contiguous() for k, v in state.items()}, sys.argv[2])
print(f"packed {sys.argv[1]} from {checkpoint_weights_path(sys.argv[1])}")
PY
    done
    tar -C /tmp -cf /tmp/qat_weights.tar qat_weights && split -b 15M /tmp/qat_weights.tar "$OUT/qat_weights.tar.part-"
    ;;
  ship)
    # SHIP's runs as the files that would ship (attnqat export-qat: fp8-delta where bf16 is over 12 MB), scored
    # as a user loads them beside the base rows; the files come back in $OUT (a new base needs new QAT weights)
    while running; do sleep 10; done
    mkdir -p $W/ship; args=()
    trained_max=$(python3 -c "from attnqat.export_qat_cli import MAX_TRAINED_CHARS as m; print(m)") || exit 1
    for name in ${SHIP:?the runs to export, e.g. SHIP=distill_output}; do
      # export-qat refuses a --trained longer than its limit (EXTRA's six training sizes alone are ~90 characters)
      trained="attn_qat fine-tune '$name' (configs/mini_qat.yaml, bench/gpu_qat.sh: $(overrides "$name")${EXTRA:+ $EXTRA})"
      python3 -m attnqat export-qat --model "$MODEL" --from "$W/$name" --out "$W/ship/$name.safetensors" \
        --trained "${trained:0:$trained_max}" \
        2>&1 | tail -n 2 \
        && [ -f "$W/ship/$name.safetensors" ] && args+=(--variant "ship_$name=attn_qat:$W/ship/$name.safetensors")
    done
    score "${args[@]}"
    cp $W/ship/*.safetensors "$OUT/" 2>/dev/null
    ;;
  *)
    echo "usage: bash bench/gpu_qat.sh start MINUTES | wait SECONDS | report | ship | stop"; exit 2
    ;;
esac
[ "${1:-}" = _all ] && exit 0
tr '\r' '\n' < $W/train.log 2>/dev/null | grep -v "it/s\]$\|s/it\]$\|^ *$" | tail -n 8
for name in $RUNS; do
  [ -f $W/$name/log.csv ] && echo "$name: $(tail -n 1 $W/$name/log.csv)"
done
# one file back (a call brings back at most 8): every run's log.csv and output, the driver's log
tar -cf "$OUT/qat_logs.tar" $W/train.log $W/*.out $W/*/log.csv 2>/dev/null
exit 0
