"""One attention entry point for every mode, and the registry that says what each mode is.

    attention(q, k, v, mode="attn_qat")   # (batch, heads, seqlen, head_dim), like SDPA
    mode_of("attn_qat").trainable         # True: every fact about a mode is a field of its Mode record

Each mode is one :class:`Mode` record: its Triton path (CUDA tensors, or CPU tensors under
``TRITON_INTERPRET=1``), its PyTorch-reference path (plain CPU tensors: slow but exact, and differentiable for
trainable modes, so the tiny model trains and generates on a laptop), and the facts the rest of the package
asks about it (trainable, a log-sum-exp for ring attention, a forward shared with another mode, ...). No other
module keeps a list of mode names: they ask :func:`mode_of` or :func:`available_modes`.

Names are checked once per edge: :func:`attention` (and :func:`attention_with_lse`) here, the processors in
``attnqat.pipelines``, each command's flags; :func:`mode_of` is that check, with one message. Past the edge the
paths take valid input: :func:`attention` checks q, k, v and the options once and calls the mode's path.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
import triton

from . import attn_qat, hopper_gluon, reference, sage3, sagebwd
from ._common import (KERNEL_DTYPES, P_BWD_CHOICES, SUPPORTED_HEAD_DIMS, check_qkv, default_scale, interpreting,
                      needs_grad)
from .formats import LOG2E, P_SCALE, SAGEBWD_PRECISIONS
from .rotation import QK_ROTATIONS, rotate_qk


@dataclass(frozen=True)
class Mode:
    """An attention mode: how it runs, and every fact the package asks about it.

    How it runs: ``kernel`` on CUDA (or the interpreter), ``reference`` on plain CPU tensors, both called as
    ``fn(q, k, v, sm_scale=..., causal=..., **options)`` on (B, H, L, D) tensors that :func:`attention` has
    checked. ``trainable`` modes have a backward; the others refuse to run with grad enabled. ``dtypes`` and
    ``head_dims`` (None: any) are what :func:`attention` accepts on every path (fp32 is also accepted on CPU,
    where the reference runs); ``options`` lists each option's name and its allowed values.

    What it is, for the rest of the package:

    - ``with_lse``: the forward that also returns the row log-sum-exp, called as
      ``fn(q, k, v, sm_scale=..., causal=..., use_kernel=..., **options) -> (out, lse)``
      (:func:`attention_with_lse`; context-parallel ring attention merges key chunks with it). None: ring
      attention cannot run the mode.
    - ``same_forward_as``: the mode whose forward (all that inference runs) this one runs; they differ only in
      the backward, so with the same weights it gives that mode's outputs exactly (``attnqat quality`` leaves
      it out of its default rows).
    - ``naive_fp4_forward``: its forward is naive NVFP4 attention (phi on Q, K, V and P in blocks of 16): an
      "FP4 without QAT" reference row may run it, and ring attention's key shares must be whole blocks to
      give the one-process result to the bit.
    - ``uses_qat_weights``: QAT fine-tunes are trained for it: a run in this mode loads the QAT weights
      shipped with the model unless told otherwise (``--qat-checkpoint``), and the demo's column says so.
    - ``high_precision``: a precision schedule may run it on its high-precision steps and blocks.
    - ``demo_column``: its column's place on the demo page, left to right (None: the page offers it only when
      the app's ``--modes`` names it); ``demo_ticked``: the column is ticked when the page opens; ``demo_label``:
      the column's title, one line in a quarter of the page (about 25 characters, so the columns stay aligned;
      None: the mode's name).
    """
    name: str
    description: str
    trainable: bool
    kernel: Callable[..., torch.Tensor]
    reference: Callable[..., torch.Tensor]
    dtypes: tuple = KERNEL_DTYPES
    head_dims: tuple | None = SUPPORTED_HEAD_DIMS
    options: tuple = ()  # ((name, (allowed values...)), ...)
    with_lse: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    same_forward_as: str | None = None
    naive_fp4_forward: bool = False
    uses_qat_weights: bool = False
    high_precision: bool = False
    demo_column: int | None = None
    demo_ticked: bool = True
    demo_label: str | None = None

    def check_options(self, options: dict) -> None:
        """Refuse options this mode does not take, and values outside their allowed set, by name (``ValueError``).
        :func:`attention` runs it on every call; the processors and the training config before a model runs."""
        allowed = dict(self.options)
        unknown = sorted(map(str, set(options) - set(allowed)))
        if unknown:
            if not allowed:
                raise ValueError(f"attention mode {self.name!r} takes no options, got {unknown}")
            raise ValueError(f"attention mode {self.name!r} takes options {', '.join(allowed)}; got {unknown}")
        for key, value in options.items():
            choices = allowed[key]
            if not any(type(value) is type(c) and value == c for c in choices):
                raise ValueError(f"attention mode {self.name!r}: {key} {value!r} not in {choices}")


#: The high-precision reference: unquantized attention (torch SDPA). Comparison tables put it first and measure
#: the other modes against it, the QAT teacher runs it, and a precision schedule runs it unless told otherwise.
REFERENCE_MODE = "bf16"

_MODES: dict[str, Mode] = {}


def register_mode(mode: Mode) -> None:
    """Add (or replace) a mode in the registry."""
    _MODES[mode.name] = mode


def available_modes(where: Callable[[Mode], bool] | None = None) -> list[str]:
    """Names of the registered modes, in registration order; with ``where``, those whose record it accepts
    (``available_modes(lambda m: m.trainable)``)."""
    return [name for name, mode in _MODES.items() if where is None or where(mode)]


def mode_of(name: str, what: str = "attention mode") -> Mode:
    """The record of the registered mode ``name``; anything else is a ``ValueError`` naming the registered modes,
    ``"unknown <what> 'name'; available: ..."`` (``what``: the flag or key at a command's edge, e.g. ``"--mode"``).
    The one check of a mode name, run once at each edge."""
    mode = _MODES.get(name) if isinstance(name, str) else None
    if mode is None:
        shown = repr(name) if len(repr(name)) <= 60 else f"{repr(name)[:28]}...{repr(name)[-28:]}"
        raise ValueError(f"unknown {what} {shown}; available: {', '.join(_MODES)}")
    return mode


def reference_first(modes: Iterable[str]) -> list[str]:
    """:data:`REFERENCE_MODE`, then ``modes`` in their order, each once: the rows of a comparison, whose first row
    the others are measured against."""
    return [REFERENCE_MODE] + [m for m in dict.fromkeys(modes) if m != REFERENCE_MODE]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mode: str = REFERENCE_MODE, *,
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
    m = _checked(q, k, v, mode, "attention", sm_scale, causal, options)
    if not m.trainable and needs_grad(q, k, v):
        raise ValueError(f"attention mode {mode!r} is inference-only (it has no backward); "
                         f"run it under torch.no_grad() or use a trainable mode: "
                         f"{', '.join(available_modes(lambda x: x.trainable))}")
    fn = m.kernel if _use_kernel(q) else m.reference
    q, k, options = _transformed(q, k, options)
    return fn(q, k, v, sm_scale=sm_scale, causal=causal, **options)


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mode: str = REFERENCE_MODE, *,
                       sm_scale: float | None = None, causal: bool = False,
                       **options) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention`'s output and the row log-sum-exp of the scaled logits, log(sum_j e^(s_ij)), as a
    (batch, heads, seqlen_q) float32 tensor (natural log, as FlashAttention's). Inference only (no backward);
    for the modes :func:`lse_modes` lists.

    For the FP4 modes it is computed from the kernel's integer running max m and the unquantized row sum l,
    so merging the outputs of key chunks with it (ring attention) gives the one-pass result up to fp32
    rounding: the integer max makes every chunk's P~ a power-of-two rescaling of the one-pass P~, which
    NVFP4 quantization commutes with (SPEC §2). ``q_smoothing`` keeps that: q̄ is a mean over this call's queries
    (per 128-row block from its first row) and ΔS = q̄ K^T is per key, so a chunk of keys gets the one-pass logits.
    A ring rank's query shard starts its own blocks: the one-process result to the bit needs shards of whole
    128-row blocks (otherwise another, equally exact, smoothing)."""
    m = mode_of(mode)
    if m.with_lse is None:
        raise ValueError(f"attention mode {mode!r} does not return its log-sum-exp (needed by ring attention); "
                         f"modes that do: {', '.join(lse_modes())}")
    _checked(q, k, v, mode, "attention_with_lse", sm_scale, causal, options)
    if needs_grad(q, k, v):
        raise ValueError(f"attention_with_lse(mode={mode!r}) is inference-only (no backward); run it under "
                         f"torch.no_grad()")
    if options.get("k_smoothing"):
        raise ValueError(f"attention_with_lse(mode={mode!r}): k_smoothing subtracts the mean of all keys, which a "
                         f"chunk of them does not have, so ring attention's chunks would not merge into the one-pass "
                         f"result; use Ulysses sequence parallelism, or k_smoothing=False")
    q, k, options = _transformed(q, k, options)
    return m.with_lse(q, k, v, sm_scale=sm_scale, causal=causal, use_kernel=_use_kernel(q), **options)


def lse_modes() -> list[str]:
    """Modes :func:`attention_with_lse` runs (the ones context-parallel ring attention can merge)."""
    return available_modes(lambda m: m.with_lse is not None)


def _checked(q, k, v, mode: str, caller: str, sm_scale, causal, options: dict) -> Mode:
    """The edge check of :func:`attention` and :func:`attention_with_lse`: the mode, q, k, v, sm_scale, causal
    and the options, once; what passes on to a mode's path is valid."""
    m = mode_of(mode)
    check_qkv(q, k, v, name=f"{caller}(mode={mode!r})", sm_scale=sm_scale, causal=causal, dtypes=m.dtypes,
              cpu_dtypes=(torch.float32,), head_dims=m.head_dims, kernel=False)
    m.check_options(options)
    return m


def _transformed(q, k, options: dict):
    """Apply the checked ``qk_rotation`` and ``k_smoothing`` options (the FP4 modes': attnqat.kernels.rotation) to
    q and k; the mode's path gets the other options."""
    if "qk_rotation" not in options and "k_smoothing" not in options:
        return q, k, options
    options = dict(options)
    q, k = rotate_qk(q, k, options.pop("qk_rotation", "none"), smooth_k=options.pop("k_smoothing", False))
    return q, k, options


def _use_kernel(q: torch.Tensor) -> bool:
    """CPU tensors take the Triton interpreter only when asked for (TRITON_INTERPRET=1) and in a dtype the
    kernels take; otherwise the PyTorch reference (fp32 welcome), so a CPU user never hits a refusal."""
    return q.is_cuda or (interpreting() and q.dtype in KERNEL_DTYPES)


def backend_info(device: torch.device | str | None = None) -> dict:
    """Which path each mode takes on ``device`` (default: CUDA if available, else CPU)."""
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    info = {"device": str(dev), "torch": torch.__version__, "triton": triton.__version__,
            "interpreter": interpreting()}
    if dev.type == "cuda":
        cap = torch.cuda.get_device_capability(dev)
        info["gpu"] = torch.cuda.get_device_name(dev)
        info["compute_capability"] = f"{cap[0]}.{cap[1]}"
        info["fp4_path"] = "bf16 tensor cores over exactly dequantized NVFP4 operands (SPEC §1)"
        info["path"] = "triton"
        form = attn_qat.native_fp4(dev)
        info["fp4_qk"] = ("native block-scaled FP4 MMA (tl.dot_scaled over NVFP4 storage)" if form else
                          "bf16 emulation (exactly dequantized NVFP4 operands)")
        info["fp4_pv"] = "bf16 tensor cores over exact phi(P) and V^F"
        gluon, why = hopper_gluon.gluon_sm90(dev)
        train_dims = ", ".join(map(str, hopper_gluon.TRAINING_HEAD_DIMS))
        info["attn_qat_training"] = (f"Gluon sm_90 kernels ({hopper_gluon.TRAINING_FWD_VARIANT} forward, "
                                     f"{hopper_gluon.TRAINING_BWD_VARIANT} backward) at head_dim {train_dims}, "
                                     "triton at the others" if gluon else f"triton ({why})")
        dims = ", ".join(map(str, hopper_gluon.INFERENCE_HEAD_DIMS))
        info["fp4_inference"] = (f"Gluon sm_90 forward ({hopper_gluon.INFERENCE_FWD_VARIANT}) at head_dim {dims}, "
                                 "triton at the others" if gluon else f"triton ({why})")
        # the defaults' answer (pv="int8", bwd="int8", K-major copies, no smooth_q) at head_dim 128
        fwd, why_fwd = sagebwd.gluon_forward(dev, 128, "int8", sagebwd.kmajor(), False)
        bwd, why_bwd = sagebwd.gluon_backward(dev, 128, "int8", sagebwd.kmajor(), False)
        info["sagebwd"] = ("Gluon sm_90 forward and backward (the defaults: pv and bwd int8, no smooth_q, head_dim 64 "
                           "or 128), triton otherwise" if fwd and bwd else
                           f"triton (forward: {why_fwd if not fwd else 'Gluon'}; backward: "
                           f"{why_bwd if not bwd else 'Gluon'})")
    else:
        info["path"] = "triton-interpreter" if interpreting() else "pytorch-reference"
        info["fp4_path"] = "fp32 arithmetic over dequantized NVFP4 operands"
        info["fp4_qk"] = info["fp4_pv"] = "fp32 emulation (exactly dequantized NVFP4 operands)"
    info["modes"] = available_modes()
    return info


# ---------------------------------------------------------------------------------------------------
# The modes
# ---------------------------------------------------------------------------------------------------


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
    if needs_grad(q, k, v):
        zero = sum(torch.nan_to_num(x, 0.0, 0.0, 0.0).sum(dims, keepdim=True)
                   for x, dims in ((q, (-1,)), (k, (-2, -1)), (v, (-2, -1)))) * 0
        marker = marker * zero.to(out.dtype) + marker
    return out + marker


def _sdpa(q, k, v, *, sm_scale=None, causal=False):
    # SPEC §1: an inf input never gives a silent finite value
    return mark_nonfinite(F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=sm_scale), q, k, v, causal)


def _sdpa_with_lse(q, k, v, *, sm_scale, causal, use_kernel):
    if q.is_cuda:  # FlashAttention returns its log-sum-exp (B, H, Lq) float32 (not exercised on CPU)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False,
                                                                       scale=sm_scale)[:2]
        return out, lse
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    s = reference._logits_log2(q.float(), k.float(), scale, causal) / LOG2E
    return _sdpa(q, k, v, sm_scale=sm_scale, causal=causal), torch.logsumexp(s, dim=-1)


def _paths(kernel_module: str, kernel_name: str, reference_name: str):
    """(kernel, reference): ``<kernel_module>.<kernel_name>`` and ``reference.<reference_name>``, each called with
    the checked inputs and options."""
    def kernel(q, k, v, *, sm_scale=None, causal=False, **options):
        module = {"attn_qat": attn_qat, "sage3": sage3, "sagebwd": sagebwd}[kernel_module]
        return getattr(module, kernel_name)(q, k, v, sm_scale=sm_scale, causal=causal, **options)

    def ref(q, k, v, *, sm_scale=None, causal=False, **options):
        return getattr(reference, reference_name)(q, k, v, sm_scale=sm_scale, causal=causal, **options)

    return kernel, ref


def _gluon_sm90(q, head_dims: tuple, q_smoothing: bool) -> bool:
    """Whether the Gluon sm_90 kernels run q: a CUDA tensor on an H100 / H200 whose Triton has Gluon
    (hopper_gluon.gluon_sm90), at ``head_dims`` (the Triton kernels are faster at the others). Never with
    ``q_smoothing``: the Gluon kernels have no ΔS input, so the Triton kernels run it (docs/kernels.md, "Q
    smoothing"); the one place that decides it, for the inference forward and for training alike. (``four_over_six``
    is the shared pre-pass's, so both paths take it.)"""
    return not q_smoothing and q.is_cuda and q.shape[-1] in head_dims and hopper_gluon.gluon_sm90(q.device)[0]


def _gluon_fp4_inference(q, q_smoothing: bool = False) -> bool:
    """Whether the FP4 inference forward of q runs the Gluon sm_90 kernel (:func:`_gluon_sm90` at
    hopper_gluon.INFERENCE_HEAD_DIMS); elsewhere attn_qat's Triton forward. The same numbers either way
    (docs/kernels.md)."""
    return _gluon_sm90(q, hopper_gluon.INFERENCE_HEAD_DIMS, q_smoothing)


def _fp4_inference(q, k, v, *, sm_scale=None, causal=False, q_smoothing=False, four_over_six=False):
    """The FP4 inference forward (nvfp4's; attn_qat's and attn_qat_dropin's without grad)."""
    if _gluon_fp4_inference(q, q_smoothing):
        return hopper_gluon.fp4_fwd_sm90(q, k, v, default_scale(q.shape[-1], sm_scale), causal, four_over_six)
    return attn_qat.nvfp4_unchecked(q, k, v, sm_scale=sm_scale, causal=causal, q_smoothing=q_smoothing,
                                    four_over_six=four_over_six)


def _attn_qat_kernel(q, k, v, *, sm_scale=None, causal=False, p_bwd="final_max", q_smoothing=False,
                     four_over_six=False):
    """attn_qat's kernel path. Without grad, :func:`_fp4_inference`. Training where :func:`_gluon_sm90` says so,
    at hopper_gluon.TRAINING_HEAD_DIMS: the Gluon sm_90 training forward and backward, the same numbers
    (docs/kernels.md); everywhere else, for p_bwd="normalized" (an ablation the Gluon backward does not implement)
    and for q_smoothing, the Triton path."""
    if not needs_grad(q, k, v):
        return _fp4_inference(q, k, v, sm_scale=sm_scale, causal=causal, q_smoothing=q_smoothing,
                              four_over_six=four_over_six)
    if p_bwd == "final_max" and _gluon_sm90(q, hopper_gluon.TRAINING_HEAD_DIMS, q_smoothing):
        return hopper_gluon.HopperAttnQATFunction.apply(q, k, v, default_scale(q.shape[-1], sm_scale), causal,
                                                        four_over_six)
    return attn_qat.attn_qat_unchecked(q, k, v, sm_scale=sm_scale, causal=causal, p_bwd=p_bwd,
                                       q_smoothing=q_smoothing, four_over_six=four_over_six)


def _attn_qat_dropin_kernel(q, k, v, *, sm_scale=None, causal=False, q_smoothing=False, four_over_six=False):
    """attn_qat_dropin's kernel path: without grad :func:`_fp4_inference`, else its Triton autograd Function."""
    if not needs_grad(q, k, v):
        return _fp4_inference(q, k, v, sm_scale=sm_scale, causal=causal, q_smoothing=q_smoothing,
                              four_over_six=four_over_six)
    return attn_qat.attn_qat_dropin_unchecked(q, k, v, sm_scale=sm_scale, causal=causal, q_smoothing=q_smoothing,
                                              four_over_six=four_over_six)


def _marked(fn):
    """``fn`` with :func:`mark_nonfinite` on its output (the drop-in ablation's backward needs it)."""
    def run(q, k, v, *, sm_scale=None, causal=False, **options):
        return mark_nonfinite(fn(q, k, v, sm_scale=sm_scale, causal=causal, **options), q, k, v, causal)

    return run


def _fp4_lse(m: torch.Tensor, l: torch.Tensor) -> torch.Tensor:
    """Natural-log log-sum-exp of the scaled logits from the FP4 forwards' integer max m (log2 units) and
    l = sum of P~ = 2688 * 2^(S - m): log(sum e^(s)) = ln2 * (m + log2(l / 2688))."""
    return (m.float() + torch.log2(l.float()) - math.log2(P_SCALE)) * math.log(2.0)


def _nvfp4_with_lse(q, k, v, *, sm_scale, causal, use_kernel, p_bwd=None, q_smoothing=False, four_over_six=False):
    """The FP4 forward shared by nvfp4, attn_qat and attn_qat_dropin (their forwards are one and the same;
    ``p_bwd``, attn_qat's option, is the backward's) with its row statistics: the kernel :func:`_fp4_inference`
    would run."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    if use_kernel and _gluon_fp4_inference(q, q_smoothing):
        o, m, l = hopper_gluon.fp4_fwd_stats_sm90(q, k, v, scale, causal, four_over_six)
    elif use_kernel:
        o, _, m, l = attn_qat.attn_qat_fwd(q, k, v, scale, causal, False, q_smoothing, four_over_six)[:4]
    else:
        o, _, m, l = reference.attn_qat_forward_ref(q, k, v, sm_scale=scale, causal=causal, training=False,
                                                    q_smoothing=q_smoothing, four_over_six=four_over_six)
    return o.to(q.dtype), _fp4_lse(m, l)


# The NVFP4 family's options: Q and K rotated along head_dim, K's mean over the sequence subtracted, before the
# kernel (attnqat.kernels.rotation); Q's mean over each 128-row block quantized apart, in the kernel (its logits
# q̄ K^T added back unquantized: docs/kernels.md, "Q smoothing"). All three leave exact attention as it is.
# Four Over Six: each Q, K and V block's scale, amax / 6 or amax / 4, whichever quantizes it better (docs/kernels.md).
QK_ROTATION = ("qk_rotation", QK_ROTATIONS)
K_SMOOTHING = ("k_smoothing", (False, True))
Q_SMOOTHING = ("q_smoothing", (False, True))
FOUR_OVER_SIX = ("four_over_six", (False, True))
FP4_OPTIONS = (QK_ROTATION, K_SMOOTHING, Q_SMOOTHING, FOUR_OVER_SIX)

# Registration order is the order of available_modes(). No log-sum-exp for sage3: its K smoothing subtracts the
# mean of all keys, so a chunk of keys gives other logits than the whole (its per-chunk outputs do not merge into
# the one-pass result); none for sagebwd yet (its kernel does not expose it).
register_mode(Mode(REFERENCE_MODE, "high-precision attention (torch SDPA: cuDNN / FlashAttention on GPU)", True,
                   _sdpa, _sdpa, dtypes=(torch.bfloat16, torch.float16, torch.float32), head_dims=None,
                   with_lse=_sdpa_with_lse, high_precision=True, demo_column=0, demo_label="BF16 (reference)"))
register_mode(Mode("nvfp4", "naive NVFP4 attention: phi on Q, K, V and on P (inference only)", False,
                   _fp4_inference, reference.nvfp4_attention_ref, options=FP4_OPTIONS,
                   with_lse=_nvfp4_with_lse, naive_fp4_forward=True, demo_column=3, demo_ticked=False,
                   demo_label="naive NVFP4"))
# Attn-QAT family (SPEC §2): one FP4 forward; the modes differ in their backward.
register_mode(Mode("attn_qat", "Attn-QAT: NVFP4 forward with the matching FP4 backward (trainable; without "
                   "grad it is the nvfp4 forward)", True,
                   _attn_qat_kernel, reference.attn_qat_attention_ref,
                   options=(("p_bwd", P_BWD_CHOICES), *FP4_OPTIONS),
                   with_lse=_nvfp4_with_lse,
                   same_forward_as="nvfp4", naive_fp4_forward=True, uses_qat_weights=True, demo_column=2,
                   demo_label="Attn-QAT"))
register_mode(Mode("attn_qat_dropin", "ablation: NVFP4 forward, high-precision FlashAttention backward "
                   "(unstable in training)", True,
                   _marked(_attn_qat_dropin_kernel), _marked(reference.attn_qat_dropin_attention_ref),
                   options=FP4_OPTIONS, with_lse=_nvfp4_with_lse, same_forward_as="nvfp4",
                   naive_fp4_forward=True, demo_label="Attn-QAT drop-in (ablation)"))
register_mode(Mode("sage3", "SageAttention3 emulated: NVFP4 with Q/K smoothing and two-level P (inference only)",
                   False, *_paths("sage3", "sage3_unchecked", "sage3_attention_ref"), demo_column=1,
                   demo_label="SageAttention3 (emulated)"))
# SageBwd (SPEC §4): INT8 forward and backward; options smooth_k (default True), smooth_q, pv, bwd.
register_mode(Mode("sagebwd", "trainable INT8 attention: six of seven matmuls in INT8, dP in 16-bit (SageBwd)",
                   True, *_paths("sagebwd", "sagebwd_unchecked", "sagebwd_attention_ref"),
                   options=(("smooth_k", (True, False)), ("smooth_q", (True, False)), ("pv", SAGEBWD_PRECISIONS),
                            ("bwd", SAGEBWD_PRECISIONS)), high_precision=True, demo_label="SageBwd (INT8)"))
