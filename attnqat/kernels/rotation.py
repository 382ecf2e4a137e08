"""Q and K transformed before FP4 attention in ways exact attention ignores: the ``qk_rotation`` and ``k_smoothing``
options of the FP4 modes.

    attention(q, k, v, "attn_qat", qk_rotation="hadamard")   # = attention(q @ H, k @ H, v, "attn_qat")
    attention(q, k, v, "attn_qat", k_smoothing=True)         # = attention(q, k - mean(k), v, "attn_qat")

**The rotation.** For an orthogonal H, (Q H)(K H)ᵀ = Q Kᵀ: in exact arithmetic the logits, and so the attention,
are unchanged. NVFP4 (SPEC §1) scales each block of 16 values along head_dim by its largest one, so a few large
channels (RoPE'd, RMS-normed Q and K have them) push the rest of their block towards zero. The normalized
Walsh-Hadamard matrix spreads every channel over all of head_dim, which flattens the blocks: on mini's base weights
it takes FP4 attention's velocity error from 0.00557 to 0.00363 with no training (docs/quality.md, "Rotating Q and
K").

**K-smoothing** (SageAttention's): the mean key over the sequence (per batch and head) subtracted from every key.
Each logit of query row i moves by the same q_i . mean(K), with or without the causal mask, so softmax, and the
attention, are unchanged in exact arithmetic; what goes is the offset all keys share, which otherwise sets the scale
of their NVFP4 blocks. On mini it closes about a quarter of FP4's gap alone and adds about ten points to the
rotation's (docs/quality.md, "Smoothing K"). The mean spans every key, so a chunk of keys is smoothed otherwise than
the whole: ring attention's chunks would not merge into the one-pass result, and ``attention_with_lse`` refuses it
(Ulysses keeps each head's whole sequence on one GPU and gives the one-GPU result). A non-finite key makes every
key of its head non-finite.

The kernels see the transformed Q and K and run the SPEC's numerics unchanged; the backward is autograd's through
the transform (the kernels' straight-through gradients are those of the transformed Q and K). Both are computed in
float32 and rounded to the input's dtype once: for bf16 inputs that adds one bf16 rounding to Q and K, far below
FP4's error.
"""
from __future__ import annotations

import torch

#: the ``qk_rotation`` option's values: "none" (the SPEC's attention as it is) or "hadamard"
QK_ROTATIONS = ("none", "hadamard")

_MATRICES: dict[tuple[int, torch.device], torch.Tensor] = {}


def describe_qk_options(options: dict) -> list[str]:
    """The Q/K options among a mode's ``options`` in words, one phrase each (``["Q, K rotated: hadamard",
    "K smoothed", "Q smoothed per 128-row block", "Q, K, V block scales: Four Over Six"]``), for every command that
    says how attention runs; [] when none is on. (``q_smoothing`` and ``four_over_six`` are the kernels' own, not
    transforms here: docs/kernels.md, "Q smoothing", "Four Over Six".)"""
    rotation = options.get("qk_rotation", "none")
    return ([f"Q, K rotated: {rotation}"] if rotation != "none" else []) \
        + (["K smoothed"] if options.get("k_smoothing") else []) \
        + (["Q smoothed per 128-row block"] if options.get("q_smoothing") else []) \
        + (["Q, K, V block scales: Four Over Six"] if options.get("four_over_six") else [])


def hadamard_matrix(d: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The (d, d) Walsh-Hadamard matrix divided by sqrt(d) (orthogonal, symmetric) in float32, d a power of two
    (Sylvester's construction, so the same matrix as ``scipy.linalg.hadamard(d) / d ** 0.5``)."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two head_dim, got {d}")
    key = (d, torch.device(device))
    if key not in _MATRICES:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < d:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        _MATRICES[key] = (h / d ** 0.5).to(torch.float32).to(key[1])
    return _MATRICES[key]


def rotate_qk(q: torch.Tensor, k: torch.Tensor, rotation: str, *, smooth_k: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) rotated along their last dim by ``rotation`` (one of :data:`QK_ROTATIONS`, checked at the edge),
    k first smoothed (its mean over the sequence, dim -2, subtracted) when ``smooth_k``; in their own dtypes."""
    if rotation == "none" and not smooth_k:
        return q, k
    kf = k.float()
    if smooth_k:
        kf = kf - kf.mean(dim=-2, keepdim=True)
    if rotation == "none":
        return q, kf.to(k.dtype)
    h = hadamard_matrix(q.shape[-1], q.device)
    return (q.float() @ h).to(q.dtype), (kf @ h).to(k.dtype)
