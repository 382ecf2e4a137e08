"""One attention entry point for every mode.

    attention(q, k, v, mode="attn_qat")   # (batch, heads, seqlen, head_dim), like SDPA

Each mode is a small :class:`Mode` record in a registry: its Triton path (CUDA tensors, or CPU tensors
under ``TRITON_INTERPRET=1``) and its PyTorch-reference path (plain CPU tensors: slow but exact, and
differentiable for trainable modes, so the tiny model trains and generates on a laptop).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ._common import KERNEL_DTYPES, P_BWD_CHOICES, SUPPORTED_HEAD_DIMS, check_qkv, interpreting
from .formats import SAGEBWD_PRECISIONS


@dataclass(frozen=True)
class Mode:
    """An attention mode: ``kernel`` runs on CUDA (or the interpreter), ``reference`` on plain CPU.

    Both are called as ``fn(q, k, v, sm_scale=..., causal=..., **options)`` on (B, H, L, D) tensors.
    ``trainable`` modes have a backward; the others refuse to run with grad enabled.
    ``dtypes`` and ``head_dims`` (None: any) are what :func:`attention` accepts on every path (fp32 is
    also accepted on CPU, where the reference runs); ``options`` lists each option's name and its
    allowed values.
    """
    name: str
    description: str
    trainable: bool
    kernel: Callable[..., torch.Tensor]
    reference: Callable[..., torch.Tensor]
    dtypes: tuple = KERNEL_DTYPES
    head_dims: tuple | None = SUPPORTED_HEAD_DIMS
    options: tuple = ()  # ((name, (allowed values...)), ...)


_MODES: dict[str, Mode] = {}


def register_mode(mode: Mode) -> None:
    """Add (or replace) a mode in the registry."""
    _MODES[mode.name] = mode


def available_modes() -> list[str]:
    """Names of every registered mode, in registration order."""
    return list(_MODES)


def get_mode(name: str) -> Mode:
    if not isinstance(name, str) or name not in _MODES:
        raise ValueError(f"unknown attention mode {name!r}; available: {', '.join(_MODES)}")
    return _MODES[name]


def check_options(mode: str, options: dict) -> None:
    """Refuse options ``mode`` does not take, and values outside their allowed set, by name (``ValueError``).
    :func:`attention` runs it on every call; the training config runs it before building a model."""
    m = get_mode(mode)
    allowed = dict(m.options)
    unknown = sorted(map(str, set(options) - set(allowed)))
    if unknown:
        if not allowed:
            raise ValueError(f"attention mode {mode!r} takes no options, got {unknown}")
        raise ValueError(f"attention mode {mode!r} takes options {', '.join(allowed)}; got {unknown}")
    for key, value in options.items():
        choices = allowed[key]
        if not any(type(value) is type(c) and value == c for c in choices):
            raise ValueError(f"attention mode {mode!r}: {key} {value!r} not in {choices}")


def _needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mode: str = "bf16", *,
              sm_scale: float | None = None, causal: bool = False, **options) -> torch.Tensor:
    """Scaled dot-product attention in the given mode.

    Arguments:
        q: (batch, heads, seqlen_q, head_dim); k, v: (batch, heads, seqlen_k, head_dim), same batch and
            heads (no broadcasting), same dtype and device. Any strides whose last dim is contiguous, so
            diffusers' (B, L, H, D) tensors pass as ``.transpose(1, 2)``. bf16 or fp16 (the ``bf16`` mode
            also fp32; CPU tensors also fp32, which runs the reference); head_dim 64 or 128 (any for ``bf16``).
        mode: one of :func:`available_modes`.
        sm_scale: softmax scale, a finite number > 0; default 1/sqrt(head_dim).
        causal: top-left aligned causal mask (as SDPA's ``is_causal``), True or False.
        options: mode-specific keywords (e.g. ``p_bwd`` for ``attn_qat``); unknown ones are refused.
    Return:
        (batch, heads, seqlen_q, head_dim) in q's dtype. A NaN or inf in q's row i, or in a k or v row that
        query i attends to, leaves a non-finite value in output row i, in every mode (docs/kernels.md, "Inputs
        and non-finite values"); anything else the contract above excludes is a ``ValueError`` naming the value,
        the same on the Triton and the reference path.
    """
    m = get_mode(mode)
    check_qkv(q, k, v, name=f"attention(mode={mode!r})", sm_scale=sm_scale, causal=causal, dtypes=m.dtypes,
              cpu_dtypes=(torch.float32,), head_dims=m.head_dims, kernel=False)
    check_options(mode, options)
    if not m.trainable and _needs_grad(q, k, v):
        raise ValueError(f"attention mode {mode!r} is inference-only (it has no backward); "
                         f"run it under torch.no_grad() or use a trainable mode: "
                         f"{', '.join(n for n, x in _MODES.items() if x.trainable)}")
    # CPU tensors take the Triton interpreter only when asked for (TRITON_INTERPRET=1) and in a dtype the
    # kernels take; otherwise the PyTorch reference (fp32 welcome), so a CPU user never hits a refusal.
    use_kernel = q.is_cuda or (interpreting() and q.dtype in (torch.bfloat16, torch.float16))
    fn = m.kernel if use_kernel else m.reference
    return fn(q, k, v, sm_scale=sm_scale, causal=causal, **options)


def backend_info(device: torch.device | str | None = None) -> dict:
    """Which path each mode takes on ``device`` (default: CUDA if available, else CPU)."""
    import triton

    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    info = {"device": str(dev), "torch": torch.__version__, "triton": triton.__version__,
            "interpreter": interpreting()}
    if dev.type == "cuda":
        cap = torch.cuda.get_device_capability(dev)
        info["gpu"] = torch.cuda.get_device_name(dev)
        info["compute_capability"] = f"{cap[0]}.{cap[1]}"
        info["fp4_path"] = "bf16 tensor cores over exactly dequantized NVFP4 operands (SPEC §1)"
        info["path"] = "triton"
        from .attn_qat import native_fp4

        form = native_fp4(dev)
        info["fp4_qk"] = ("native block-scaled FP4 MMA (tl.dot_scaled over NVFP4 storage)" if form else
                          "bf16 emulation (exactly dequantized NVFP4 operands)")
        info["fp4_pv"] = "bf16 tensor cores over exact phi(P) and V^F"
    else:
        info["path"] = "triton-interpreter" if interpreting() else "pytorch-reference"
        info["fp4_path"] = "fp32 arithmetic over dequantized NVFP4 operands"
        info["fp4_qk"] = info["fp4_pv"] = "fp32 emulation (exactly dequantized NVFP4 operands)"
    info["modes"] = available_modes()
    return info


def _no_options(mode: str, options: dict) -> None:
    if options:
        raise ValueError(f"attention mode {mode!r} takes no options, got {sorted(options)}")


def nonfinite_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """(B, H, Lq, 1) float32: NaN for each query row whose q row, or a k or v row it attends to (every key, or
    keys 0..i when ``causal``), holds a NaN or inf; 0 elsewhere. Adding it to an output changes no finite row."""
    bad = ~torch.isfinite(q).all(-1)  # (B, H, Lq)
    bad_kv = ~(torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1))  # (B, H, Lk)
    if causal:  # top-left aligned: row i sees keys 0..min(i, Lk - 1)
        seen = bad_kv.cumsum(-1) > 0
        bad = bad | seen[..., torch.arange(q.shape[-2], device=q.device).clamp(max=k.shape[-2] - 1)]
    else:
        bad = bad | bad_kv.any(-1, keepdim=True)
    return torch.where(bad, float("nan"), 0.0)[..., None]


def mark_nonfinite(out: torch.Tensor, q, k, v, causal: bool) -> torch.Tensor:
    """``out`` with NaN added to the rows that saw a NaN or inf (:func:`nonfinite_rows`), also in the gradients:
    the marker is multiplied into a zero that depends on q, k and v, so a marked row sends NaN into dq, dk and dv
    (0 * NaN is NaN). An addition, so finite rows and their gradients are unchanged. For the paths whose own
    arithmetic can turn an inf into a finite value: SDPA (a -inf logit is just a zero weight; PyTorch's CPU kernel
    also zeroes +inf rows) and the drop-in backward (its P, from unquantized Q and K, is finite where the FP4
    forward was not)."""
    marker = nonfinite_rows(q, k, v, causal).to(out.dtype)
    if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
        zero = sum(torch.nan_to_num(x, 0.0, 0.0, 0.0).sum(dims, keepdim=True)
                   for x, dims in ((q, (-1,)), (k, (-2, -1)), (v, (-2, -1)))) * 0
        marker = marker * zero.to(out.dtype) + marker
    return out + marker


def _sdpa(q, k, v, *, sm_scale=None, causal=False, **options):
    _no_options("bf16", options)
    # SPEC §1: an inf input never gives a silent finite value
    return mark_nonfinite(F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=sm_scale), q, k, v, causal)


register_mode(Mode("bf16", "high-precision attention (torch SDPA: cuDNN / FlashAttention on GPU)", True, _sdpa, _sdpa,
                   dtypes=(torch.bfloat16, torch.float16, torch.float32), head_dims=None))



# Attn-QAT family (SPEC §2): one FP4 forward; the modes differ in their backward.
def _attn_qat_kernel(q, k, v, *, sm_scale=None, causal=False, p_bwd="final_max", **options):
    from .attn_qat import attn_qat_attention

    _no_options("attn_qat (besides p_bwd)", options)
    return attn_qat_attention(q, k, v, sm_scale=sm_scale, causal=causal, p_bwd=p_bwd)


def _attn_qat_reference(q, k, v, *, sm_scale=None, causal=False, p_bwd="final_max", **options):
    from .reference import attn_qat_attention_ref

    _no_options("attn_qat (besides p_bwd)", options)
    if p_bwd not in P_BWD_CHOICES:
        raise ValueError(f"p_bwd {p_bwd!r} not in {P_BWD_CHOICES}")
    return attn_qat_attention_ref(q, k, v, sm_scale=sm_scale, causal=causal, p_bwd=p_bwd)


def _plain(mode: str, kernel_module: str, kernel_name: str, reference_name: str):
    """A mode taking no options, calling ``<kernel_module>.<kernel_name>`` / ``reference.<reference_name>``
    (imported on first call: the Triton modules load only when a mode runs)."""
    def kernel(q, k, v, *, sm_scale=None, causal=False, **options):
        from . import attn_qat, sage3  # a plain import: torch.compile traces it (importlib it cannot)

        _no_options(mode, options)
        module = {"attn_qat": attn_qat, "sage3": sage3}[kernel_module]
        return getattr(module, kernel_name)(q, k, v, sm_scale=sm_scale, causal=causal)

    def ref(q, k, v, *, sm_scale=None, causal=False, **options):
        from . import reference

        _no_options(mode, options)
        return getattr(reference, reference_name)(q, k, v, sm_scale=sm_scale, causal=causal)

    return kernel, ref


register_mode(Mode("nvfp4", "naive NVFP4 attention: phi on Q, K, V and on P (inference only)", False,
                   *_plain("nvfp4", "attn_qat", "nvfp4_attention", "nvfp4_attention_ref")))
register_mode(Mode("attn_qat", "Attn-QAT: NVFP4 forward with the matching FP4 backward (trainable; without "
                   "grad it is the nvfp4 forward)", True, _attn_qat_kernel, _attn_qat_reference,
                   options=(("p_bwd", P_BWD_CHOICES),)))
def _marked(fn):
    """``fn`` with :func:`mark_nonfinite` on its output (the drop-in ablation's backward needs it)."""
    def run(q, k, v, *, sm_scale=None, causal=False, **options):
        return mark_nonfinite(fn(q, k, v, sm_scale=sm_scale, causal=causal, **options), q, k, v, causal)

    return run


register_mode(Mode("attn_qat_dropin", "ablation: NVFP4 forward, high-precision FlashAttention backward "
                   "(unstable in training)", True,
                   *map(_marked, _plain("attn_qat_dropin", "attn_qat", "attn_qat_dropin_attention",
                                        "attn_qat_dropin_attention_ref"))))
register_mode(Mode("sage3", "SageAttention3 emulated: NVFP4 with Q/K smoothing and two-level P (inference only)",
                   False, *_plain("sage3", "sage3", "sage3_attention", "sage3_attention_ref")))

# SageBwd (SPEC §4): INT8 forward and backward; options smooth_k (default True), smooth_q, pv, bwd.
def _sagebwd_options(options: dict) -> None:
    if options:
        raise ValueError(f"attention mode 'sagebwd' takes options smooth_k, smooth_q, pv, bwd; got {sorted(options)}")


def _sagebwd_kernel(q, k, v, *, sm_scale=None, causal=False, smooth_k=True, smooth_q=False, pv="int8", bwd="int8",
                    **options):
    from .sagebwd import sagebwd_attention

    _sagebwd_options(options)
    return sagebwd_attention(q, k, v, sm_scale=sm_scale, causal=causal, smooth_k=smooth_k, smooth_q=smooth_q, pv=pv,
                             bwd=bwd)


def _sagebwd_reference(q, k, v, *, sm_scale=None, causal=False, smooth_k=True, smooth_q=False, pv="int8", bwd="int8",
                       **options):
    from .reference import sagebwd_attention_ref

    _sagebwd_options(options)
    return sagebwd_attention_ref(q, k, v, sm_scale=sm_scale, causal=causal, smooth_k=smooth_k, smooth_q=smooth_q,
                                 pv=pv, bwd=bwd)


register_mode(Mode("sagebwd", "trainable INT8 attention: six of seven matmuls in INT8, dP in 16-bit (SageBwd)",
                   True, _sagebwd_kernel, _sagebwd_reference,
                   options=(("smooth_k", (True, False)), ("smooth_q", (True, False)), ("pv", SAGEBWD_PRECISIONS),
                            ("bwd", SAGEBWD_PRECISIONS))))


# ---------------------------------------------------------------------------------------------------
# Output and log-sum-exp (context-parallel ring attention merges per-chunk outputs with it)
# ---------------------------------------------------------------------------------------------------


def _fp4_lse(m: torch.Tensor, l: torch.Tensor) -> torch.Tensor:
    """Natural-log log-sum-exp of the scaled logits from the FP4 forwards' integer max m (log2 units) and
    l = sum of P~ = 2688 * 2^(S - m): log(sum e^(s)) = ln2 * (m + log2(l / 2688))."""
    from .formats import P_SCALE

    return (m.float() + torch.log2(l.float()) - math.log2(P_SCALE)) * math.log(2.0)


def _bf16_lse(q, k, v, *, sm_scale, causal, use_kernel, **options):
    _no_options("bf16", options)
    if q.is_cuda:  # FlashAttention returns its log-sum-exp (B, H, Lq) float32 (not exercised on CPU)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False,
                                                                       scale=sm_scale)[:2]
        return out, lse
    from .reference import _logits_log2

    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    s = _logits_log2(q.float(), k.float(), scale, causal) / LOG2E_F
    return _sdpa(q, k, v, sm_scale=sm_scale, causal=causal), torch.logsumexp(s, dim=-1)


def _nvfp4_lse(q, k, v, *, sm_scale, causal, use_kernel, p_bwd=None, **options):
    """The FP4 forward shared by nvfp4, attn_qat and attn_qat_dropin (their forwards are one and the same)."""
    _no_options("nvfp4", options)
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    if use_kernel:
        from .attn_qat import attn_qat_fwd

        o, _, m, l = attn_qat_fwd(q, k, v, scale, causal, False)[:4]
    else:
        from .reference import attn_qat_forward_ref

        o, _, m, l = attn_qat_forward_ref(q, k, v, sm_scale=scale, causal=causal, training=False)
    return o.to(q.dtype), _fp4_lse(m, l)


LOG2E_F = 1.4426950408889634
# Modes whose forward can also return its log-sum-exp (inference only: no backward through these). Not sage3:
# its K smoothing subtracts the mean of all keys, so a chunk of keys gives other logits than the whole (its
# per-chunk outputs do not merge into the one-pass result); not sagebwd (its lse is not exposed here yet).
_LSE: dict[str, Callable] = {"bf16": _bf16_lse, "nvfp4": _nvfp4_lse, "attn_qat": _nvfp4_lse,
                             "attn_qat_dropin": _nvfp4_lse}


def lse_modes() -> list[str]:
    """Modes :func:`attention_with_lse` runs (the ones context-parallel ring attention can merge)."""
    return [m for m in _MODES if m in _LSE]


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mode: str = "bf16", *,
                       sm_scale: float | None = None, causal: bool = False,
                       **options) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention`'s output and the row log-sum-exp of the scaled logits, log(sum_j e^(s_ij)), as a
    (batch, heads, seqlen_q) float32 tensor (natural log, as FlashAttention's). Inference only (no backward).

    For the FP4 modes it is computed from the kernel's integer running max m and the unquantized row sum l,
    so merging the outputs of key chunks with it (ring attention) gives the one-pass result up to fp32
    rounding: the integer max makes every chunk's P~ a power-of-two rescaling of the one-pass P~, which
    NVFP4 quantization commutes with (SPEC §2)."""
    m = get_mode(mode)
    if mode not in _LSE:
        raise ValueError(f"attention mode {mode!r} does not return its log-sum-exp (needed by ring attention); "
                         f"modes that do: {', '.join(lse_modes())}")
    check_qkv(q, k, v, name=f"attention_with_lse(mode={mode!r})", sm_scale=sm_scale, causal=causal,
              dtypes=m.dtypes, cpu_dtypes=(torch.float32,), head_dims=m.head_dims, kernel=False)
    check_options(mode, options)
    if _needs_grad(q, k, v):
        raise ValueError(f"attention_with_lse(mode={mode!r}) is inference-only (no backward); run it under "
                         f"torch.no_grad()")
    use_kernel = q.is_cuda or (interpreting() and q.dtype in (torch.bfloat16, torch.float16))
    return _LSE[mode](q, k, v, sm_scale=sm_scale, causal=causal, use_kernel=use_kernel, **options)
