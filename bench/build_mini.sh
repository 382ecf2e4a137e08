#!/usr/bin/env bash
# The shipped mini from nothing, in one command (docs/mini.md, "Building it"): the VAE in five trainings, then the
# transformer in four runs, each a warm start of the one before. The settings are the shipped build's, as its cards
# and logs recorded them; where one was not recorded, its comment says so and what stands in for it.
# At most about 105 GPU minutes on an H100 (the VAE's trainings 39 minutes, the transformer's runs up to 62). The
# VAE's trainings and the last transformer run end on their minutes, so a rebuild matches the shipped build in
# recipe, not bit for bit.
#
#   bash bench/build_mini.sh OUT [--ship]     # OUT/t4/mini is the build; --ship then copies it into
#                                             # attnqat/models/mini (that removes the QAT file there: make a new
#                                             # one for the new base, docs/mini.md)
#
# OUT/vae17 holds the 17-frame VAE the chain starts from, OUT/vae the shipped VAE (its four trainings), OUT/t1..t4
# the transformer runs. A training whose result is recorded is skipped, so the same command continues a killed
# build: a killed VAE training runs its minutes again from the VAE as last saved; a killed transformer run resumes
# its last checkpoint and trains up to its minutes again. Environment:
#   EXTRA  more arguments for every `python -m attnqat.train.mini` call, after the recipe's own (the tests: --device
#          cpu, small sizes, step caps; the ceiling, bench/gpu_ceiling.sh: FP4 attention in the loop)
#   VAE    an exported build (a folder with attnqat_mini.json, e.g. attnqat/models/mini): no VAE is trained, the
#          transformer runs encode with its vae/ and the cards count its VAE trainings
#   UNTIL  t1, t2 or t3: stop after that transformer run's export (a device session too short for the chain; the
#          same command continues it, given OUT/tN/mini back)
set -euo pipefail
usage="usage: bash bench/build_mini.sh OUT [--ship]"
{ [ $# -ge 1 ] && [ $# -le 2 ] && { [ $# -eq 1 ] || [ "$2" = --ship ]; }; } || { echo "$usage" >&2; exit 2; }
out=$1; ship=${2:-}
if [ -e "$out" ] && [ ! -d "$out" ]; then echo "OUT $out exists and is not a folder" >&2; exit 2; fi
case "${UNTIL:-t4}" in t1|t2|t3|t4) ;; *) echo "UNTIL must be t1, t2, t3 or t4, not '$UNTIL'" >&2; exit 2 ;; esac
if [ -n "${VAE:-}" ] && { [ ! -f "$VAE/attnqat_mini.json" ] || [ ! -f "$VAE/vae/config.json" ]; }; then
  echo "VAE=$VAE is not an exported build (no attnqat_mini.json and vae/ there)" >&2; exit 2
fi
read -r -a extra <<< "${EXTRA:-}"
mini() { python3 -m attnqat.train.mini "$@" ${extra[@]+"${extra[@]}"}; }

vae_trainings() {  # FOLDER: how many VAE trainings its timings.json records
  [ -f "$1/timings.json" ] || { echo 0; return; }
  python3 -c 'import json, sys; print(sum(r["stage"] == "vae" for r in json.load(open(sys.argv[1]))))' "$1/timings.json"
}
vae() {  # FOLDER N [build-mini arguments]: FOLDER's Nth VAE training (batch 16 throughout), unless recorded there
  local folder=$1 n=$2 trained; shift 2
  trained=$(vae_trainings "$folder")
  [ "$trained" -ge "$n" ] && { echo "$(basename "$folder"): VAE training $n done already, skipped"; return; }
  local again=(); [ "$n" -gt 1 ] && again=(--vae-again)
  mini --out "$folder" --stage vae ${again[@]+"${again[@]}"} --vae-batch 16 "$@"
}
sizes() {  # FRAMES...: those clip lengths at 128x128, then at 256x256 (the order the recorded trainings cycled)
  local s f list=()
  for s in 128 256; do for f in "$@"; do list+=("${f}x${s}x${s}"); done; done
  local IFS=,; echo "${list[*]}"
}

vae_model=$out/vae/model/vae; vae_timings=$out/vae/timings.json
if [ -n "${VAE:-}" ]; then  # a trained VAE: its build's VAE trainings stand for steps 0-4
  vae_model=$VAE/vae; vae_timings=$out/vae_timings.json
  mkdir -p "$out"
  python3 -c 'import json, sys; json.dump([r for r in json.load(open(sys.argv[1]))["timings"] if r["stage"] == "vae"],
                                          open(sys.argv[2], "w"), indent=1)' "$VAE/attnqat_mini.json" "$vae_timings"
else
# 0. The VAE the shipped one was warm-started from: the earlier mini's, 10 minutes on 17x128x128 clips, lr 1e-3.
vae "$out/vae17" 1 --vae-minutes 10 --vae-sizes 17x128x128 --vae-lr 1e-3
# 1. The whole VAE, 8 minutes at lr 5e-4 on every length 9..57 at both sizes (879 steps on an H100). Its encoder
#    and latent statistics are final from here on: the trainings after it change the decoder alone.
vae "$out/vae" 1 --vae "$out/vae17/model/vae" --vae-minutes 8 --vae-lr 5e-4 --vae-sizes "$(sizes 9 17 25 33 41 49 57)"
# 2.-4. The decoder: 6 minutes on single frames and every length (552 steps, sharing its H100), then 10 and 5 minutes
#    on 57-frame clips and single frames (build-mini's default --vae-sizes; 1,549 and 713 steps on an H100).
#    Their learning rate was not recorded: build-mini's default (1e-3), what bench/gpu_mini.sh passed unless told.
vae "$out/vae" 2 --vae-train decoder --vae-minutes 6 --vae-sizes "$(sizes 1 9 17 25 33 41 49 57)"
vae "$out/vae" 3 --vae-train decoder --vae-minutes 10
vae "$out/vae" 4 --vae-train decoder --vae-minutes 5
fi

done_() { [ -f "$1/mini/attnqat_mini.json" ]; }
run() {  # NAME FROM MINUTES [--set ...]: a transformer run on OUT/vae's VAE, exported; FROM: the run it continues
  # One call runs the stages in order: init (a warm start from FROM's export, or an untrained transformer with
  # OUT/vae's timings, so the card counts the VAE), the VAE stage skipped as trained, the transformer, the export.
  # A killed run continues in its own folder (no second init there).
  local name=$1 from=$2 minutes=$3; shift 3
  done_ "$out/$name" && { echo "$name: exported already, skipped"; return; }
  local start=()
  if [ ! -f "$out/$name/model/model_index.json" ]; then
    start=(--vae "$vae_model")
    if [ -n "$from" ]; then start+=(--from "$out/$from/mini")
    else mkdir -p "$out/$name" && cp "$vae_timings" "$out/$name/timings.json"; fi
  fi
  mini --out "$out/$name" ${start[@]+"${start[@]}"} --minutes "$minutes" "$@"
}
until_() { [ "${UNTIL:-t4}" = "$1" ] && { echo "stopped after $1 (UNTIL): $out/$1/mini"; exit 0; }; return 0; }
# Every run: clips of 17, 33 and 49 frames at both sizes, flow shift 8, compiled, batch 32, EMA 0.999 (the rest is
# configs/mini.yaml). Runs 1-3 stop at their recorded step counts, their MINUTES a bound above the recorded time;
# run 4 stops on its minutes, as recorded, part way through its 12,000-step cosine.
six=(--set "data.corpus.sizes=[[33,256,256],[33,128,128],[17,256,256],[17,128,128],[49,256,256],[49,128,128]]"
     --set timesteps.shift=8.0 --set train.compile=true)
early=("${six[@]}" --set "data.corpus.size_weights=[2,2,1,1,1,1]" --set data.corpus.pool=1024)
# 1. From scratch, lr 3e-4 constant after 300 warm-up steps: 4,500 steps (13 minutes on an H100).
run t1 "" 15 "${early[@]}" --set train.max_steps=4500
until_ t1
# 2. The same settings, 2,859 steps (13 minutes on an H100 it shared with two VAE trainings).
run t2 t1 13 "${early[@]}" --set train.max_steps=2859
until_ t2
# 3. The learning rate a cosine from 3e-4 to 0 over 6,800 steps (12.8 minutes on an H100).
run t3 t2 15 "${early[@]}" --set train.lr_schedule=cosine --set train.max_steps=6800
until_ t3
# 4. 33 frames first (4:4:1:1:1:1), lr 1e-4 after 200 warm-up steps, a cosine to 0 over 12,000 steps: 19 minutes
#    (9,649 steps on an H200).
run t4 t3 19 "${six[@]}" --set "data.corpus.size_weights=[4,4,1,1,1,1]" --set train.lr=1e-4 \
  --set train.warmup_steps=200 --set train.lr_schedule=cosine --set train.max_steps=12000 --set train.min_lr_ratio=0
if [ -n "$ship" ]; then mini --out "$out/t4" --stage export --ship; fi
echo "built: $out/t4/mini"
