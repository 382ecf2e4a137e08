"""`attnqat quality` on the CPU with the Four Over Six rule trying other maxima than 6 and 4 (docs/quality.md,
"Four Over Six"): what a wider search of each block's scale would give the shipped file, before any kernel has it.

    python experiments/scale_search_quality.py --tops 6,5.5,5,4.5,4,3.5,3 -- --device cpu --size 33x128x128 \
        --clips 16 --prompts 1 --steps 10 --base-modes bf16,nvfp4 \
        --variant shipped=attn_qat:attnqat/models/mini/attn_qat.safetensors --out runs/search

Everything after ``--`` is `attnqat quality`'s. The rule is swapped in the PyTorch reference, which is what plain
CPU tensors run; on a GPU the kernels would run their own rule (6 and 4), so ``--device cuda`` is refused. Rows with
``four_over_six`` on (the shipped file records it) use the wider search; the others are unchanged.
"""
from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from experiments.fp4_noise_sources import four_over_six_tops, tops_argument  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tops", type=tops_argument, required=True, metavar="T,T,...",
                        help="the maxima the Four Over Six rule tries, 6 first")
    parser.add_argument("quality", nargs=argparse.REMAINDER, help="-- then attnqat quality's arguments")
    args = parser.parse_args(argv)
    rest = args.quality[1:] if args.quality[:1] == ["--"] else args.quality
    import torch

    on_cpu = any(a in ("--device=cpu",) for a in rest) or any(
        a == "--device" and b == "cpu" for a, b in zip(rest, rest[1:]))
    if not on_cpu and (torch.cuda.is_available() or any("cuda" in a for a in rest)):
        parser.error("CPU only (give --device cpu): on a GPU the kernels run the option's own rule (6 and 4), "
                     "not the reference's")
    from attnqat.cli import main as attnqat_main

    with four_over_six_tops(args.tops):
        return attnqat_main(["quality", *rest])


if __name__ == "__main__":
    sys.exit(main())
