"""An orthogonal rotation of Q and K along head_dim before FP4 attention (the ``qk_rotation`` option).

    attention(q, k, v, "attn_qat", qk_rotation="hadamard")   # = attention(q @ H, k @ H, v, "attn_qat")

For an orthogonal H, (Q H)(K H)ᵀ = Q Kᵀ: in exact arithmetic the logits, and so the attention, are unchanged.
NVFP4 (SPEC §1) scales each block of 16 values along head_dim by its largest one, so a few large channels
(RoPE'd, RMS-normed Q and K have them) push the rest of their block towards zero. The normalized Walsh-Hadamard
matrix spreads every channel over all of head_dim, which flattens the blocks: on mini's base weights it takes
FP4 attention's velocity error from 0.00557 to 0.00363 with no training (docs/quality.md, "Rotating Q and K").
The kernels see rotated Q and K and run the SPEC's numerics unchanged; the backward is autograd's through the
matmul (the kernels' straight-through gradients are those of the rotated Q and K).

The rotation is a matmul in float32, rounded to the input's dtype: for bf16 inputs it adds one bf16 rounding to
Q and K, far below FP4's error.
"""
from __future__ import annotations

import torch

#: the ``qk_rotation`` option's values: "none" (the SPEC's attention as it is) or "hadamard"
QK_ROTATIONS = ("none", "hadamard")

_MATRICES: dict[tuple[int, torch.device], torch.Tensor] = {}


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


def rotate_qk(q: torch.Tensor, k: torch.Tensor, rotation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) rotated along their last dim by ``rotation`` (one of :data:`QK_ROTATIONS`, checked at the edge),
    in their own dtypes."""
    if rotation == "none":
        return q, k
    h = hadamard_matrix(q.shape[-1], q.device)
    return (q.float() @ h).to(q.dtype), (k.float() @ h).to(k.dtype)
