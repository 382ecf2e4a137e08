"""Which tensors of a QAT fine-tune carry its recovery: the fine-tune's changes kept on a subset of the
transformer's tensors (the rest at the base weights), scored by the flow metrics of `attnqat quality`
(held-out flow loss and velocity distance to the bf16 model, both under FP4 attention), with each subset's
size in bf16. It answers what a size-capped file of QAT weights (`attnqat export-qat`, 12 MB for mini) can
keep of a full fine-tune.

    python experiments/qat_subsets.py --model runs/mini/mini --qat runs/mini_qat/flow [--clips 16] [--size 33x128x128]

Rows: bf16 and nvfp4 on the base weights (the two ends), the whole fine-tune, then each subset (regular
expressions over the state-dict names, --subset NAME=REGEX to add your own). Prints a markdown table; --json
writes the numbers.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: Subsets of Wan's transformer state dict (block k: ``blocks.k.``): self-attention, cross-attention, ...
SUBSETS = {
    "self-attention": r"^blocks\.\d+\.attn1\.",
    "all attention": r"^blocks\.\d+\.attn[12]\.",
    "self-attention + ffn": r"^blocks\.\d+\.(attn1|ffn)\.",
    "blocks": r"^blocks\.",
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="the base model folder the fine-tune started from")
    p.add_argument("--qat", required=True, help="the fine-tune: a run folder, checkpoint or safetensors file")
    p.add_argument("--mode", default="attn_qat", help="the FP4 mode the fine-tune is scored in (attn_qat)")
    p.add_argument("--clips", type=int, default=16)
    p.add_argument("--size", default="33x128x128")
    p.add_argument("--subset", action="append", default=[], metavar="NAME=REGEX")
    p.add_argument("--only", action="store_true", help="score only the --subset ones, not the built-in subsets")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json")
    args = p.parse_args(argv)
    from attnqat.mini.evaluation import Variant, _Weights, add_gap_closed, flow_metrics, held_out_clips
    from attnqat.pipelines import load_pipeline
    from attnqat.pipelines.loading import cpu_state_dict, read_qat_checkpoint
    from attnqat.pipelines.qat_weights import changed_tensors
    from attnqat.mini.quality_cli import parse_size

    subsets = {} if args.only else dict(SUBSETS)
    for item in args.subset:
        name, _, regex = item.partition("=")
        subsets[name] = regex
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    pipe = load_pipeline(args.model, dtype=dtype, device=device)
    data = held_out_clips(pipe, args.clips, size=parse_size(args.size))
    base = cpu_state_dict(pipe.transformer)
    tuned = read_qat_checkpoint(pipe.transformer, args.qat)
    changed = set(changed_tensors(tuned, base))
    variants = [Variant("bf16"), Variant("nvfp4", "nvfp4"), Variant("whole fine-tune", args.mode, tuned)]
    sizes = {"whole fine-tune": sum(base[k].numel() * 2 for k in changed)}
    for name, regex in subsets.items():
        keep = {k for k in changed if re.search(regex, k)}
        variants.append(Variant(name, args.mode, {k: (tuned[k] if k in keep else base[k]) for k in base}))
        sizes[name] = sum(base[k].numel() * 2 for k in keep)
    rows = flow_metrics(pipe.transformer, variants, data["x0"], data["embeds"], weights=_Weights(pipe.transformer))
    add_gap_closed(rows, "nvfp4", "bf16")
    print(f"{args.qat} over {args.model}: {len(changed)} of {len(base)} tensors changed; {args.clips} held-out "
          f"clips at {args.size}, scored in {args.mode}\n")
    print("| tensors kept | size (bf16) | flow loss | velocity dist. | gap closed (loss) | gap closed (velocity) |")
    print("|---|---|---|---|---|---|")
    for v in variants:
        r = rows[v.label]
        size_text = f"{sizes[v.label] / 1e6:.1f} MB" if v.label in sizes else "—"
        print(f"| {v.label} | {size_text} | {r['flow_loss']:.5f} | {r.get('velocity_distance', 0):.3g} | "
              f"{r.get('gap_closed_loss', float('nan')):.2f} | {r.get('gap_closed_velocity', float('nan')):.2f} |")
    if args.json:
        from attnqat.outputs import write_file_atomically

        text = json.dumps({"rows": rows, "sizes": sizes}, indent=1)
        write_file_atomically(Path(args.json), lambda tmp: tmp.write_text(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
