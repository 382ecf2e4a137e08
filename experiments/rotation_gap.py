"""How much of FP4 attention's gap the Q/K rotation closes on mini, with and without the shipped QAT weights (docs/
quality.md, "Rotating Q and K before FP4 attention"): the flow metrics of `attnqat quality` only (no videos), so it
runs on a CPU.

    python experiments/rotation_gap.py [--model attnqat/models/mini] \
        [--qat attnqat/models/mini/attn_qat.safetensors] [--clips 16] [--size 17x128x128] [--json out.json] \
        [--row LABEL=CHECKPOINT ...]

Rows: bf16, nvfp4, nvfp4 with qk_rotation=hadamard (base weights), attn_qat with the QAT weights, and the same
with the rotation, then each --row: attn_qat with the rotation on those weights (QAT weights, a run folder, a LoRA
file: what attnqat quality takes); for each the held-out flow loss, the velocity distance to bf16 and the share of nvfp4's gap
closed on both (about 2 minutes at 17x128x128 with 16 clips on 2 cores, 14 at 49x128x128).
"""
from __future__ import annotations

import json
import pathlib
import sys

from attnqat.mini.evaluation import Variant, flow_metrics
from attnqat.pipelines.loading import read_qat_checkpoint

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from experiments._held_out import held_out_arguments, load_held_out  # noqa: E402


def main(argv=None) -> None:
    p = held_out_arguments(__doc__, clips=16, size="17x128x128")
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--row", action="append", default=[], metavar="LABEL=CHECKPOINT",
                   help="a fine-tune trained with the rotation, run in attn_qat with it (repeatable)")
    args = p.parse_args(argv)
    pipe, qat, data = load_held_out(args)
    rot = {"qk_rotation": "hadamard"}
    variants = [Variant("bf16", "bf16"), Variant("nvfp4", "nvfp4"), Variant("rot", "nvfp4", options=rot),
                Variant("qat", "attn_qat", qat), Variant("qat_rot", "attn_qat", qat, options=rot)]
    for text in args.row:
        label, _, checkpoint = text.partition("=")
        if not label or not checkpoint:
            p.error(f"--row {text!r}: expected LABEL=CHECKPOINT")
        variants.append(Variant(label, "attn_qat", read_qat_checkpoint(pipe.transformer, checkpoint), options=rot))
    r = flow_metrics(pipe.transformer, variants, data["x0"], data["embeds"], batch=4)
    bf16, fp4 = r["bf16"], r["nvfp4"]
    rows = {}
    print(f"{args.clips} held-out clips at {args.size}\n\n| row | flow loss | velocity dist. | gap closed: loss / velocity |")
    print("|---|---|---|---|")
    for v in variants:
        x = r[v.label]
        loss = (fp4["flow_loss"] - x["flow_loss"]) / (fp4["flow_loss"] - bf16["flow_loss"])
        vel = (fp4["velocity_distance"] - x["velocity_distance"]) / fp4["velocity_distance"]
        rows[v.label] = {"flow_loss": x["flow_loss"], "velocity_distance": x["velocity_distance"],
                         "gap_closed_loss": loss, "gap_closed_velocity": vel}
        print(f"| {v.label} | {x['flow_loss']:.5f} | {x['velocity_distance']:.5f} | {loss:.0%} / {vel:.0%} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size": args.size, "clips": args.clips, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
