"""`attnqat quality` with the Four Over Six rule trying other maxima than 6 and 4 (docs/quality.md, "Four Over
Six"): what a wider search of each block's scale gives the shipped file.

    python experiments/scale_search_quality.py --tops 6,5.5,5,4.5,4,3.5,3 -- --device cpu --size 33x128x128 \
        --clips 16 --prompts 1 --steps 10 --base-modes bf16,nvfp4 \
        --variant shipped=attn_qat:attnqat/models/mini/attn_qat.safetensors --out runs/search

Everything after ``--`` is `attnqat quality`'s. The kernels' pre-pass has two searches (6 and 4, the option's; 6 down
to 3 in steps of 0.5: nvfp4.FOUR_OVER_SIX_SEARCHES): with one of those, the kernels run it, and the rows compare
with the kernels' own tables. With other maxima, or ``--reference``, the rule is swapped in the PyTorch reference
and every attention call runs the reference while the script lasts, CUDA tensors too: compare such a run with one of
``--tops 6,4 --reference``, not with the kernels' rows (on an H200 at 33x128x128 the reference's nvfp4 row scored
0.08417 where the kernels' scored 0.08400; not explained: SPEC §1 lets the kernels round P's ties otherwise). Rows
with ``four_over_six`` on (the shipped file records it) use the search; the others are unchanged.
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
    parser.add_argument("--reference", action="store_true",
                        help="every attention call through the PyTorch reference, also for a search the kernels "
                             "have (the control of a run whose maxima only the reference tries)")
    parser.add_argument("quality", nargs=argparse.REMAINDER, help="-- then attnqat quality's arguments")
    args = parser.parse_args(argv)
    rest = args.quality[1:] if args.quality[:1] == ["--"] else args.quality
    from attnqat.cli import main as attnqat_main
    from attnqat.kernels import api, nvfp4

    use_kernel = api._use_kernel
    if args.reference or args.tops not in nvfp4.FOUR_OVER_SIX_SEARCHES:
        api._use_kernel = lambda q: False  # the reference for every call: only the reference has this rule
    try:
        with four_over_six_tops(args.tops):
            return attnqat_main(["quality", *rest])
    finally:
        api._use_kernel = use_kernel


if __name__ == "__main__":
    sys.exit(main())
