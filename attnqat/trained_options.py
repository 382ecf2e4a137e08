"""The FP4 attention options that weights are trained under and then run with: what a QAT weights file's metadata
(:mod:`attnqat.pipelines.qat_weights`) or an ``attnqat train`` run's ``config.yaml`` records, what ``attnqat
export-qat`` writes and ``attnqat generate`` switches (``auto``: as the weights were trained). The one list of them,
kept free of torch so that the commands' ``--help`` stays fast; the kernels define what each does
(:mod:`attnqat.kernels.api`, docs/kernels.md).
"""
from __future__ import annotations

#: the on / off options, each with the words its ``auto | on | off`` flag's help says about it
SWITCHED = {
    "k_smoothing": "K-smoothing (K's mean over the sequence subtracted before FP4 attention)",
    "q_smoothing": "Q-smoothing (Q minus its mean over each block of 128 queries quantized, the mean's logits "
                   "added back unquantized)",
    "four_over_six": "Four Over Six (each block of 16 of Q, K and V scaled so that its largest magnitude maps to "
                     "6 or to 4, whichever quantizes the block better)",
}
#: every recorded option: the Q/K rotation (a name), then the switched ones
TRAINED_OPTIONS = ("qk_rotation", *SWITCHED)
#: their values when nothing records them: weights trained without them
DEFAULTS = {"qk_rotation": "none", **{name: False for name in SWITCHED}}


def flag(option: str) -> str:
    """The command-line flag of ``option``: ``four_over_six`` -> ``--four-over-six``."""
    return "--" + option.replace("_", "-")
