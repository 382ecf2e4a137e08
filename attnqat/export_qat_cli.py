"""Write the tensors a QAT fine-tune changed as a small QAT weights file that ships beside its base model.

  attnqat export-qat --from runs/mini_qat/distill_output --out attnqat/models/mini/attn_qat.safetensors
  attnqat export-qat --model ./my-wan-folder --from runs/qat --out my_qat.safetensors

--from is the fine-tune as `attnqat train` wrote it (a run folder: its final/, else its newest complete
checkpoint; a checkpoint folder; a .safetensors file or a folder of shards; a LoRA run's or any Wan LoRA file,
fused into the base first); --model is the base it was
fine-tuned from (default: mini). The file holds only the tensors whose bf16 values differ from the base's,
with the base's fingerprint in its metadata (attnqat.pipelines.qat_weights), so it loads only over that base.
--storage auto (the default) stores their values in bf16 where that fits in 12 MB, else their changes from
the base in FP8 with a scale per row (fp8-delta: ~9 MB for a fine-tune of all of mini's weights, whose
changes are a few percent of the weights: the FP8 error is ~1% of the change). It loads with `attnqat generate --mode attn_qat --qat-checkpoint FILE`, `app.py --qat-checkpoint FILE`,
`attnqat quality --variant qat=attn_qat:FILE`. Written to mini's folder (the first example), it is what
`attnqat generate --mode attn_qat` and the demo's Attn-QAT column run on mini by default.

Refused, with nothing written: a fine-tune whose keys or shapes are not the base's, one equal to the base in
bf16, and a file over 12 MB (the limit of a shipped file: mini's 18 MB in bf16 ship as fp8-delta; a fine-tune
of the attention only, `--set train.trainable=attention`, changes ~4 MB in bf16). The file is written under a temporary
name and renamed into place once it reads back.
"""
from __future__ import annotations

import argparse

from attnqat.checks import check_not_input, check_output_file, check_text
from attnqat.errors import one_line
from attnqat.locking import output_lock
from attnqat.mini.model import DEFAULT_MODEL
from attnqat.trained_options import SWITCHED, flag

# torch and diffusers are imported where they are used, so `attnqat export-qat --help` stays fast.

HELP = ("write the tensors a QAT fine-tune changed (bf16, or their changes in FP8; at most 12 MB) as QAT weights "
        "that ship beside its base")
MAX_TRAINED_CHARS = 200  # the metadata's one line on how the weights were trained


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--from", dest="finetune", required=True, metavar="PATH",
                   help="the QAT fine-tune: an `attnqat train` run or checkpoint folder, a .safetensors file or a "
                        "folder of shards, or a LoRA file (fused into the base)")
    p.add_argument("--model", default=DEFAULT_MODEL, help=f"the base model it was fine-tuned from (default: "
                   f"{DEFAULT_MODEL}): mini, tiny or a diffusers-format Wan 2.1 folder")
    p.add_argument("--out", required=True, metavar="FILE", help="the QAT weights file to write, ending in "
                   ".safetensors (the one mini ships: attnqat/models/mini/attn_qat.safetensors); an existing file is "
                   "replaced only once the new one reads back")
    p.add_argument("--storage", choices=("auto", "subset", "fp8-delta"), default="auto",
                   help="subset: the changed tensors' values in bf16; fp8-delta: their changes from the base in FP8 "
                        "with a scale per row (about half the size); auto (default): subset where it fits in 12 MB")
    p.add_argument("--qk-rotation", choices=("auto", "none", "hadamard"), default="auto",
                   help="the attention option the weights were trained under, recorded in the file so that "
                        "`attnqat generate` runs them with it; auto (default): what --from's training config says "
                        "(an `attnqat train` run or checkpoint), else none")
    for option, words in SWITCHED.items():
        p.add_argument(flag(option), choices=("auto", "on", "off"), default="auto",
                       help=f"likewise for {words}; auto (default): what --from's training config says, else off")
    p.add_argument("--trained", metavar="TEXT", help="one line on how the weights were trained, stored in the "
                   f"file's metadata (at most {MAX_TRAINED_CHARS} characters; default: the --from and --model "
                   "given)")


def check_arguments(args: argparse.Namespace) -> None:
    """Every argument, before any model loads (the fine-tune's files: their headers only)."""
    from attnqat.pipelines.loading import check_model, check_qat_checkpoint, model_inputs

    check_qat_checkpoint(args.finetune, flag="--from")
    check_model(args.model)
    check_output_file("--out", args.out, (".safetensors",))
    check_not_input("--out", args.out, [("--from", args.finetune)] + model_inputs("--model", args.model))
    if args.trained is not None:
        args.trained = one_line(check_text("--trained", args.trained, max_chars=MAX_TRAINED_CHARS))


def main(args: argparse.Namespace) -> int:
    from attnqat.kernels import describe_qk_options
    from attnqat.pipelines.qat_export import export_qat_weights

    check_arguments(args)
    with output_lock(args.out, "attnqat export-qat"):
        options = {"qk_rotation": None if args.qk_rotation == "auto" else args.qk_rotation,
                   **{name: None if getattr(args, name) == "auto" else getattr(args, name) == "on" for name in SWITCHED}}
        written = export_qat_weights(args.finetune, args.model, args.out, trained=args.trained, storage=args.storage,
                                     options=options)
    size = written.path.stat().st_size
    print(f"wrote {written.path}: {len(written.tensors)} tensors that differ from {args.model}'s in bf16, as "
          f"{written.storage} ({size / 1e6:.2f} MB); base fingerprint {written.base[:12]}; trained: {written.trained}"
          + "".join(f"; {said}" for said in describe_qk_options(written.options)))
    return 0
