"""Which words of the prompt does a model read? The flow loss at fixed noise of corpus clips under their own
caption and under captions that differ from it (docs/mini.md, "It reads the words of the prompt").

    python experiments/attribute_reading.py [--model mini] [--weights RUN_OR_CHECKPOINT] [--size 33x128x128]

Conditions (:func:`attnqat.mini.evaluation.caption_losses`; the changed captions are
:func:`attnqat.mini.corpus.changed_captions`: the same template and synonyms, so only the attribute's words differ):

- ``right``: the clip's own attributes;
- ``motion``: the opposite motion (left <-> right, up <-> down, up-left <-> down-right, grow <-> shrink);
- ``colour``: the next colour of ``COLOURS`` (red -> orange, ...);
- ``shape``: the next shape of ``SHAPES``;
- ``empty``: the empty prompt;
- ``other``: another clip's own caption (the ratio `attnqat train` logs as ``eval_prompt_ratio``).

For each split and sigma it prints the mean loss of each condition, its ratio to ``right`` and the share
of clips whose own caption has the lower loss (``pick``: 50% = the model cannot tell). A model that reads
an attribute's words pays more loss for the wrong one (ratio > 1, pick -> 100%). ``--json`` writes the numbers.
"""
from __future__ import annotations

import argparse
import json

import torch

from attnqat.mini.evaluation import CAPTION_CONDITIONS, caption_losses, corpus_source
from attnqat.outputs import write_file_atomically
from attnqat.pipelines import load_pipeline, load_qat_checkpoint
from attnqat.mini.quality_cli import parse_size


def summarise(res: dict, subset=None) -> dict:
    rows = {}
    for sigma, per in res["losses"].items():
        keep = torch.ones(len(per["right"]), dtype=torch.bool) if subset is None else subset
        right = per["right"][keep]
        row = {"right": right.mean().item()}
        for c in CAPTION_CONDITIONS[1:]:
            wrong = per[c][keep]
            row[c] = wrong.mean().item()
            row[c + "/right"] = wrong.mean().item() / right.mean().item()
            row[c + " pick"] = (right < wrong).float().mean().item()
        rows[sigma] = row
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="mini", help="mini (the default) or a diffusers Wan folder")
    p.add_argument("--weights", help="transformer weights to load (an attnqat train run or checkpoint)")
    p.add_argument("--size", default="33x128x128", help="FRAMESxHEIGHTxWIDTH of the clips (default 33x128x128)")
    p.add_argument("--text-len", type=int, default=512, help="prompt length the model trained with (default 512)")
    p.add_argument("--clips", type=int, default=32)
    p.add_argument("--sigmas", default="0.3,0.6,0.9")
    p.add_argument("--splits", default="train,held_out")
    p.add_argument("--json", help="write the per-split summaries here")
    args = p.parse_args()
    pipe = load_pipeline(args.model, dtype=torch.float32, device=torch.device("cpu"))
    if args.weights:
        load_qat_checkpoint(pipe.transformer, args.weights)
    source = corpus_source(pipe, size=parse_size(args.size), text_len=args.text_len)
    transformer = pipe.transformer.eval()
    sigmas = [float(s) for s in args.sigmas.split(",")]
    report = {}
    print(f"{args.model} {args.weights or ''} {args.size}, {args.clips} clips a split; ratio = loss / own caption's; "
          "pick = share of clips whose own caption has the lower loss")
    print(f"{'split':9s} {'clips':10s} sigma  right   " + "  ".join(f"{c:>14s}" for c in CAPTION_CONDITIONS[1:]))
    for split in args.splits.split(","):
        first = 10 ** 6 if split == "train" else 0  # train clips past what a training run has seen
        res = caption_losses(transformer, source, split, list(range(first, first + args.clips)), sigmas)
        directional = torch.tensor([m not in ("grow", "shrink") for m in res["motions"]])
        report[split] = {"all": summarise(res), "directions": summarise(res, directional)}
        for group, rows in report[split].items():
            for sigma, row in rows.items():
                cells = "  ".join(f"{row[c + '/right']:.3f} ({row[c + ' pick']:4.0%})" for c in CAPTION_CONDITIONS[1:])
                print(f"{split:9s} {group:10s} {sigma:5.2f}  {row['right']:.4f}  {cells}")
    if args.json:
        doc = {"model": args.model, "weights": args.weights, "size": args.size, "clips": args.clips,
               "report": {s: {g: {str(k): v for k, v in r.items()} for g, r in d.items()} for s, d in report.items()}}
        write_file_atomically(args.json, lambda tmp: tmp.write_text(json.dumps(doc, indent=1)))


if __name__ == "__main__":
    main()
