"""Where, by noise level, does FP4 attention cost a model flow loss, and how much of it does a QAT file win back
there? (docs/quality.md, "Where the gap sits")

    python experiments/fp4_gap_by_sigma.py [--model mini] [--qat attnqat/models/mini/attn_qat.safetensors] \
        [--clips 8] [--size 33x128x128] [--sigmas 0.05,0.1,0.2,0.3,0.5,0.7,0.9,0.97]

For each sigma: the held-out flow loss of bf16, nvfp4 and the QAT weights in attn_qat (whose forward is nvfp4's),
the gap closed ``(nvfp4 - qat) / (nvfp4 - bf16)``, and the velocity distances to bf16 with the share the QAT
weights remove (``1 - qat / nvfp4``). Measured with :func:`attnqat.mini.evaluation.flow_metrics` (what `attnqat
quality` averages over sigmas 0.1 .. 0.9), one sigma at a time, on the first ``--clips`` held-out clips. A QAT
recipe that trains on other noise levels than the ones where the gap is left would show it here as a gap closed
that falls off at those levels. CPU: about 10 minutes at the defaults.
"""
from __future__ import annotations

import argparse

import torch

from attnqat.mini.evaluation import Variant, flow_metrics, held_out_clips
from attnqat.mini.quality_cli import parse_size
from attnqat.pipelines.loading import load_pipeline, read_qat_checkpoint


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="attnqat/models/mini")
    p.add_argument("--qat", default="attnqat/models/mini/attn_qat.safetensors", help="QAT weights (any form "
                   "`attnqat quality --variant` takes)")
    p.add_argument("--clips", type=int, default=8)
    p.add_argument("--size", default="33x128x128")
    p.add_argument("--sigmas", default="0.05,0.1,0.2,0.3,0.5,0.7,0.9,0.97")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    sigmas = [float(s) for s in args.sigmas.split(",")]
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    pipe = load_pipeline(args.model, dtype=dtype, device=args.device)
    pipe.text_encoder.to(torch.float32)  # as `attnqat train` encodes the corpus's captions
    variants = [Variant("bf16", "bf16"), Variant("nvfp4", "nvfp4"),
                Variant("qat", "attn_qat", read_qat_checkpoint(pipe.transformer, args.qat))]
    data = held_out_clips(pipe, args.clips, size=parse_size(args.size))
    print("| sigma | bf16 | nvfp4 | QAT | gap closed (loss) | velocity dist. nvfp4 | QAT | gap closed (velocity) |")
    print("|---|---|---|---|---|---|---|---|")
    for s in sigmas:
        r = flow_metrics(pipe.transformer, variants, data["x0"], data["embeds"], sigmas=(s,), batch=4)
        b, f, q = (r[k]["flow_loss"] for k in ("bf16", "nvfp4", "qat"))
        vf, vq = r["nvfp4"]["velocity_distance"], r["qat"]["velocity_distance"]
        print(f"| {s:g} | {b:.4f} | {f:.4f} | {q:.4f} | {(f - q) / (f - b):.2f} | {vf:.4f} | {vq:.4f} | "
              f"{1 - vq / vf:.2f} |", flush=True)


if __name__ == "__main__":
    main()
