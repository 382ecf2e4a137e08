"""torch.library custom ops over the FP4 kernel launches, with fake (shape-only) implementations,
so ``torch.compile`` traces models that use them without graph breaks.

    attnqat::attn_qat_fwd  (q, k, v, sm_scale, causal, training) -> (o, o_aux, m, l, q^F, k^F, v^F)
    attnqat::attn_qat_bwd  (do, q, k, q^F, k^F, v^F, o_aux, m, l, sm_scale, causal, p_bwd) -> (dq, dk, dv)
    attnqat::sage3_fwd     (q, k, v, sm_scale, causal) -> o

The autograd Functions in ``attn_qat.py`` call these ops; Dynamo traces the Functions themselves.
"""
from __future__ import annotations

import torch

from . import attn_qat


def _work_dtype(q: torch.Tensor) -> torch.dtype:
    return attn_qat._work_dtype(q.dtype)


@torch.library.custom_op("attnqat::attn_qat_fwd", mutates_args=(), device_types=("cuda", "cpu"))
def attn_qat_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, causal: bool,
                 training: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                          torch.Tensor, torch.Tensor]:
    o, o_aux, m, l, (qf, kf, vf) = attn_qat.attn_qat_forward(q, k, v, sm_scale=sm_scale, causal=causal,
                                                             training=training)
    if o_aux is None:  # inference: an empty placeholder (custom ops return tensors, not None)
        o_aux = o.new_empty(0)
    return o.to(q.dtype), o_aux, m, l, qf, kf, vf


@attn_qat_fwd.register_fake
def _(q, k, v, sm_scale, causal, training):
    b, h, lq, d = q.shape
    wdt = _work_dtype(q)
    aux = q.new_empty((b, h, lq, d), dtype=wdt) if training else q.new_empty(0, dtype=wdt)
    return (torch.empty_like(q), aux, q.new_empty((b, h, lq), dtype=torch.float32),
            q.new_empty((b, h, lq), dtype=torch.float32), q.new_empty(q.shape, dtype=wdt),
            k.new_empty(k.shape, dtype=wdt), v.new_empty(v.shape, dtype=wdt))


@torch.library.custom_op("attnqat::attn_qat_bwd", mutates_args=(), device_types=("cuda", "cpu"))
def attn_qat_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, qf: torch.Tensor, kf: torch.Tensor,
                 vf: torch.Tensor, o_aux: torch.Tensor, m: torch.Tensor, l: torch.Tensor, sm_scale: float,
                 causal: bool, p_bwd: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return attn_qat.attn_qat_backward(do, q, k, qf, kf, vf, o_aux, m, l, sm_scale=sm_scale, causal=causal,
                                      p_bwd=p_bwd)


@attn_qat_bwd.register_fake
def _(do, q, k, qf, kf, vf, o_aux, m, l, sm_scale, causal, p_bwd):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(k)


@torch.library.custom_op("attnqat::sage3_fwd", mutates_args=(), device_types=("cuda", "cpu"))
def sage3_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, causal: bool) -> torch.Tensor:
    from .sage3 import sage3_forward

    return sage3_forward(q, k, v, sm_scale=sm_scale, causal=causal)


@sage3_fwd.register_fake
def _(q, k, v, sm_scale, causal):
    return torch.empty_like(q)
