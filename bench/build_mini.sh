#!/usr/bin/env bash
# The shipped mini from nothing, in one command (docs/mini.md, "The shipped build, from nothing"): the VAE and a
# first transformer, then two warm starts at flow shift 8, the second with its learning rate decaying to 10%.
# About 69 GPU minutes on an H100/H200; step counts in a time budget depend on the GPU, so a rebuild matches
# the shipped build in recipe, not bit for bit.
#
#   bash bench/build_mini.sh OUT [--ship]     # OUT/mini6/mini is the build; --ship then copies it into
#                                             # attnqat/models/mini (that removes the QAT file there: make a new
#                                             # one for the new base, docs/mini.md)
#
# A stage whose export exists is skipped, so the same command continues a killed build (the killed stage
# resumes its last checkpoint and trains its full minutes again). EXTRA (environment): more arguments for every
# `python -m attnqat.train.mini` call, after the recipe's own (the tests: --device cpu, small sizes, step caps).
set -euo pipefail
usage="usage: bash bench/build_mini.sh OUT [--ship]"
{ [ $# -ge 1 ] && [ $# -le 2 ] && { [ $# -eq 1 ] || [ "$2" = --ship ]; }; } || { echo "$usage" >&2; exit 2; }
out=$1; ship=${2:-}
if [ -e "$out" ] && [ ! -d "$out" ]; then echo "OUT $out exists and is not a folder" >&2; exit 2; fi
read -r -a extra <<< "${EXTRA:-}"
mini() { python3 -m attnqat.train.mini "$@" ${extra[@]+"${extra[@]}"}; }
both=(--set "data.corpus.size_weights=[1,1]" --set train.compile=true)
done_() { [ -f "$1/mini/attnqat_mini.json" ]; }

# 1. the VAE (10 minutes, batch 16) and the transformer at flow shift 3 (14 minutes)
done_ "$out/mini4" || mini --out "$out/mini4" --vae-minutes 10 --vae-batch 16 --minutes 14 "${both[@]}"

warm() {  # NAME FROM MINUTES [--set ...]: a warm start of FROM's export, trained MINUTES more, exported
  # One call runs the stages in order: init from FROM's export (its card's timings hold the VAE's, so the VAE stage
  # is skipped), the transformer, the export. A killed run continues in its own folder (no --from there).
  local name=$1 from=$2 minutes=$3; shift 3
  done_ "$out/$name" && { echo "$name: exported already, skipped"; return; }
  local start=(--from "$out/$from/mini" --vae "$out/mini4/model/vae")
  [ -f "$out/$name/model/model_index.json" ] && start=()
  mini --out "$out/$name" ${start[@]+"${start[@]}"} --minutes "$minutes" "${both[@]}" --set timesteps.shift=8.0 "$@"
}
# 2. 22 more minutes at flow shift 8 (9,782 steps on an H200)
warm mini5 mini4 22
# 3. 22 more minutes, the learning rate a cosine to 10% over 9,000 steps (8,654 done on an H200)
warm mini6 mini5 22 --set train.lr_schedule=cosine --set train.max_steps=9000 --set train.min_lr_ratio=0.1
if [ -n "$ship" ]; then mini --out "$out/mini6" --stage export --ship; fi
echo "built: $out/mini6/mini"
