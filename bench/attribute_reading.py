"""Which words of the prompt does a model read? The flow loss at fixed noise of corpus clips under their own
caption and under the same caption with ONE attribute changed (docs/mini.md, "Why motion is not learned yet").

    python bench/attribute_reading.py --model attnqat/models/mini [--weights RUN_OR_CHECKPOINT] [--size 33x128x128]

Conditions, each worded by the same caption template and synonyms (``caption(spec, variant)`` with one
variant per clip, so only the attribute's words differ):

- ``right``: the clip's own attributes;
- ``motion``: the opposite motion (left <-> right, up <-> down, up-left <-> down-right, grow <-> shrink);
- ``colour``: the next colour of ``COLOURS`` (red -> orange, ...);
- ``shape``: the next shape of ``SHAPES``;
- ``empty``: the empty prompt.

For each split and sigma it prints the mean loss of each condition, its ratio to ``right`` and the share
of clips whose own caption has the lower loss (``pick``: 50% = the model cannot tell). A model that reads
an attribute's words pays more loss for the wrong one (ratio > 1, pick -> 100%). ``--json`` writes the numbers.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]

OPPOSITE = {"left": "right", "right": "left", "up": "down", "down": "up", "up-left": "down-right",
            "down-right": "up-left", "up-right": "down-left", "down-left": "up-right", "grow": "shrink",
            "shrink": "grow"}
CONDITIONS = ("right", "motion", "colour", "shape", "empty")


def changed_specs(spec):
    """The clip's spec with each single attribute changed (only the caption is built from them)."""
    from attnqat.corpus import COLOURS, SHAPES

    colours = list(COLOURS)
    return {
        "right": spec,
        "motion": dataclasses.replace(spec, motion=OPPOSITE[spec.motion]),
        "colour": dataclasses.replace(spec, colour=colours[(colours.index(spec.colour) + 1) % len(colours)]),
        "shape": dataclasses.replace(spec, shape=SHAPES[(SHAPES.index(spec.shape) + 1) % len(SHAPES)]),
    }


def captions_for(spec, variant: int) -> dict[str, str]:
    from attnqat.corpus import caption

    out = {name: caption(s, variant) for name, s in changed_specs(spec).items()}
    out["empty"] = ""
    return out


@torch.no_grad()
def measure(transformer, src, split: str, indices: list[int], sigmas: list[float], seed: int = 0,
            chunk: int = 8) -> dict:
    """Per-clip losses {sigma: {condition: tensor(n)}} of ``indices`` of ``split``, plus the clips' motions."""
    corpus = src.corpora[split]
    specs = [corpus.spec(i) for i in indices]
    x0, _ = src.encode_clips(split, indices, 0)
    caps = [captions_for(s, i) for s, i in zip(specs, indices)]
    emb = {c: src.embed([cp[c] for cp in caps]) for c in CONDITIONS}
    g = torch.Generator().manual_seed(seed)
    out = {}
    for sigma in sigmas:
        noise = torch.randn(x0.shape, generator=g)
        xt = (1 - sigma) * x0 + sigma * noise
        target = noise - x0
        per = {}
        for c in CONDITIONS:
            losses = []
            for i in range(0, len(x0), chunk):
                sl = slice(i, i + chunk)
                t = torch.full((xt[sl].shape[0],), sigma * 1000.0)
                v = transformer(hidden_states=xt[sl], timestep=t, encoder_hidden_states=emb[c][sl],
                                return_dict=False)[0]
                losses.append((v.float() - target[sl]).pow(2).mean(dim=(1, 2, 3, 4)))
            per[c] = torch.cat(losses)
        out[sigma] = per
    return {"losses": out, "motions": [s.motion for s in specs], "captions": [c["right"] for c in caps]}


def summarise(res: dict, subset=None) -> dict:
    rows = {}
    for sigma, per in res["losses"].items():
        keep = torch.ones(len(per["right"]), dtype=torch.bool) if subset is None else subset
        right = per["right"][keep]
        row = {"right": right.mean().item()}
        for c in CONDITIONS[1:]:
            wrong = per[c][keep]
            row[c] = wrong.mean().item()
            row[c + "/right"] = wrong.mean().item() / right.mean().item()
            row[c + " pick"] = (right < wrong).float().mean().item()
        rows[sigma] = row
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="attnqat/models/mini", help="a diffusers Wan folder (default: the shipped mini)")
    p.add_argument("--weights", help="transformer weights to load (an attnqat train run or checkpoint)")
    p.add_argument("--size", default="33x128x128", help="FRAMESxHEIGHTxWIDTH of the clips (default 33x128x128)")
    p.add_argument("--text-len", type=int, default=512, help="prompt length the model trained with (default 512)")
    p.add_argument("--clips", type=int, default=32)
    p.add_argument("--sigmas", default="0.3,0.6,0.9")
    p.add_argument("--splits", default="train,held_out")
    p.add_argument("--json", help="write the per-split summaries here")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from bench.prompt_reading import load_model_and_corpus

    transformer, src = load_model_and_corpus(args.model, args.weights, args.size, args.text_len)
    sigmas = [float(s) for s in args.sigmas.split(",")]
    report = {}
    print(f"{args.model} {args.weights or ''} {args.size}, {args.clips} clips a split; ratio = loss / own caption's; "
          "pick = share of clips whose own caption has the lower loss")
    print(f"{'split':9s} {'clips':10s} sigma  right   " + "  ".join(f"{c:>14s}" for c in CONDITIONS[1:]))
    for split in args.splits.split(","):
        first = 10 ** 6 if split == "train" else 0
        res = measure(transformer, src, split, list(range(first, first + args.clips)), sigmas)
        directional = torch.tensor([m not in ("grow", "shrink") for m in res["motions"]])
        report[split] = {"all": summarise(res), "directions": summarise(res, directional)}
        for group, rows in report[split].items():
            for sigma, row in rows.items():
                cells = "  ".join(f"{row[c + '/right']:.3f} ({row[c + ' pick']:4.0%})" for c in CONDITIONS[1:])
                print(f"{split:9s} {group:10s} {sigma:5.2f}  {row['right']:.4f}  {cells}")
    if args.json:
        from attnqat.outputs import write_file_atomically
        doc = {"model": args.model, "weights": args.weights, "size": args.size, "clips": args.clips,
               "report": {s: {g: {str(k): v for k, v in r.items()} for g, r in d.items()} for s, d in report.items()}}
        write_file_atomically(args.json, lambda tmp: tmp.write_text(json.dumps(doc, indent=1)))


if __name__ == "__main__":
    main()
