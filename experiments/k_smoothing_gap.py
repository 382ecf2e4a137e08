"""Would subtracting the mean key before FP4 attention close more of its gap on mini, alone and with the Q/K rotation?

    python experiments/k_smoothing_gap.py [--clips 16] [--size 17x128x128] [--json out.json] [--v-smoothing]

K-smoothing (SageAttention's; the FP4 modes' ``k_smoothing`` option, attnqat.kernels.rotation): K minus its mean over
the keys, per batch and head. Every logit of a query row moves by the same q . mean(K), so softmax, and the
attention, are unchanged in exact arithmetic, while the keys' shared offset (a few channels large in every key) no
longer sets each NVFP4 block's scale (SPEC §1).

Rows (the flow metrics of `attnqat quality`, CPU, the reference kernels): bf16, nvfp4, nvfp4 with the rotation,
the shipped QAT file with its rotation, then the same FP4 rows with smoothed keys; the share of nvfp4's gap each
closes, on the loss and the velocity, overall and at its worst latent frame.

--v-smoothing adds two rows probing the same idea for V, which no option builds yet: V's mean over the sequence
subtracted before FP4 attention and added to its output (softmax's rows sum to 1, so exact attention does not
change), with the rotation and K-smoothing, on the base weights and the shipped file. The rows' processors call a
wrapped ``attention`` (the processor module's name for it) while they run.
"""
from __future__ import annotations

import contextlib
import json
import pathlib
import sys

from attnqat.kernels import REFERENCE_MODE, mode_of
from attnqat.mini.evaluation import Variant, flow_metrics
from attnqat.pipelines import processor

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from experiments._held_out import held_out_arguments, load_held_out  # noqa: E402


@contextlib.contextmanager
def smoothed_values():
    """Inside, the processors' FP4 attention runs on V minus its mean over the sequence and adds the mean back."""
    attention = processor.attention

    def v_smoothed(q, k, v, mode, **options):
        if mode_of(mode).high_precision:
            return attention(q, k, v, mode, **options)
        mean = v.float().mean(dim=-2, keepdim=True)
        return (attention(q, k, (v.float() - mean).to(v.dtype), mode, **options).float() + mean).to(v.dtype)

    processor.attention = v_smoothed
    try:
        yield
    finally:
        processor.attention = attention


def main(argv=None) -> None:
    p = held_out_arguments(__doc__, clips=16, size="17x128x128")
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--v-smoothing", action="store_true", help="also the two rows with V smoothed (the docstring)")
    args = p.parse_args(argv)
    pipe, qat, data = load_held_out(args)
    rot, smooth = {"qk_rotation": "hadamard"}, {"k_smoothing": True}
    rows = flow_metrics(pipe.transformer, [
        Variant("bf16", "bf16"), Variant("nvfp4", "nvfp4"), Variant("rot", "nvfp4", options=rot),
        Variant("qat_rot", "attn_qat", qat, options=rot), Variant("ksmooth", "nvfp4", options=smooth),
        Variant("ksmooth_rot", "nvfp4", options={**rot, **smooth}),
        Variant("qat_ksmooth_rot", "attn_qat", qat, options={**rot, **smooth})],
        data["x0"], data["embeds"], batch=4)
    if args.v_smoothing:
        with smoothed_values():
            v_rows = flow_metrics(pipe.transformer, [
                Variant(REFERENCE_MODE, REFERENCE_MODE),
                Variant("vsmooth_ksmooth_rot", "nvfp4", options={**rot, **smooth}),
                Variant("qat_vsmooth_ksmooth_rot", "attn_qat", qat, options={**rot, **smooth})],
                data["x0"], data["embeds"], batch=4)
        ref = v_rows.pop(REFERENCE_MODE)
        assert ref["flow_loss"] == rows[REFERENCE_MODE]["flow_loss"], "the bf16 rows of the two passes differ"
        rows.update(v_rows)
    bf16, fp4 = rows["bf16"], rows["nvfp4"]

    def closed(x, key):
        whole = (fp4[key] - x[key]) / (fp4[key] - (bf16[key] if key == "flow_loss" else 0.0))
        frames = [(f - xf) / (f - (b if key == "flow_loss" else 0.0)) for f, xf, b in
                  zip(fp4[f"{key}_frames"], x[f"{key}_frames"], bf16[f"{key}_frames"])]
        return whole, min(frames)

    table = {}
    print(f"{args.clips} held-out clips at {args.size}\n")
    print("| row | flow loss | velocity dist. | gap closed: loss / velocity | worst latent frame: loss / velocity |")
    print("|---|---|---|---|---|")
    for label, x in rows.items():
        (loss, loss_min), (vel, vel_min) = closed(x, "flow_loss"), closed(x, "velocity_distance")
        table[label] = {"flow_loss": x["flow_loss"], "velocity_distance": x["velocity_distance"],
                        "gap_closed_loss": loss, "gap_closed_velocity": vel,
                        "worst_frame_loss": loss_min, "worst_frame_velocity": vel_min}
        print(f"| {label} | {x['flow_loss']:.5f} | {x['velocity_distance']:.5f} | {loss:.0%} / {vel:.0%} | "
              f"{loss_min:.0%} / {vel_min:.0%} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size": args.size, "clips": args.clips, "rows": table}, f, indent=1)


if __name__ == "__main__":
    main()
