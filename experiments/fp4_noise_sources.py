"""Where does FP4 attention's error in mini come from, and what did QAT change? (docs/quality.md, "What the QAT
file changed")

    python experiments/fp4_noise_sources.py [--model attnqat/models/mini] \
        [--qat attnqat/models/mini/attn_qat.safetensors] [--clips 4] [--size 33x128x128] \
        [--qk-rotation hadamard] [--k-smoothing] [--q-smoothing sequence|block|option] \
        [--four-over-six qk v p] [--four-over-six-tops 6,5.5,5,4.5,4] [--base-nvfp4]

For the base weights and for the QAT weights, each in its own bf16 as the reference: the velocity distance
``|v_fp4 - v_bf16|^2 / |v_bf16|^2`` of nvfp4 attention with only some of its quantizers on (Q and K; V; P; Q, K
and V; all four, which is nvfp4), on the first ``--clips`` held-out clips at the quality table's noise levels. The
velocity distance of the QAT weights in FP4 to the *base* weights in bf16 (the quality table's) splits into the QAT
weights' own FP4 error and how far their bf16 function moved from the base's, also printed. The quantizers are
switched in the PyTorch reference (attnqat.kernels.reference), which runs on the CPU (~10 minutes) or, with
``--device cuda``, on a GPU (the reference there too, not the kernels).
``--qk-rotation`` / ``--k-smoothing``: the FP4 rows with those options (Q and K transformed before the
quantizers, as the shipped QAT file runs: its weights were trained with the rotation). ``--q-smoothing``: a probe
of SageAttention2's Q smoothing (:func:`quantizers`); ``option`` smooths as the ``q_smoothing`` option does (blocks of
128 queries, the last partial). ``--four-over-six``: those quantizers choose each block's scale as "Four Over Six"
does (the ``four_over_six`` option's rule, ``reference.four_over_six_scale``; here also on P, which the option
leaves alone); ``--four-over-six-tops`` widens the rule's search from the maxima 6 and 4 to others (the reference's
rule only: the kernels try 6 and 4). ``--base-nvfp4``: also the base weights in plain nvfp4 to their bf16 (the
quality table's FP4 reference), so the last line reads as a share of the gap closed.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import pathlib
import sys

import torch

from attnqat.kernels import QK_ROTATIONS, api, describe_qk_options, reference
from attnqat.mini.evaluation import Variant, flow_metrics

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from experiments._held_out import held_out_arguments, load_held_out  # noqa: E402

#: how the header names --q-smoothing
SMOOTHED = {"sequence": ", Q smoothed over the sequence", "block": ", Q smoothed over each block of 64",
            "option": ", Q smoothed as the q_smoothing option (blocks of 128)"}
#: which of nvfp4's four quantizers are on, per row
SOURCES = {"Q,K": ("qk",), "V": ("v",), "P": ("p",), "Q,K,V": ("qk", "v"), "all (nvfp4)": ("qk", "v", "p")}


@contextlib.contextmanager
def quantizers(on: tuple[str, ...], q_smoothing: str = "none", four_over_six: tuple[str, ...] = ()):
    """The reference FP4 forward with only the quantizers in ``on`` (the others pass fp32 values through).
    ``q_smoothing`` (a probe; no option builds it): Q minus its mean over the sequence ("sequence") or over each
    block of 64 queries ("block", as SageAttention2 smooths each tile) is quantized, and the mean's logits
    q_mean . K are added back in float32, so exact attention does not change."""
    fq = reference.fake_quant_nvfp4_ref
    forward = reference.attn_qat_forward_ref
    four = functools.partial(fq, four_over_six=True)  # the four_over_six option's scales
    rule = {name: (four if name in four_over_six else fq) for name in ("qk", "v", "p")}

    def partial(q, k, v, *, sm_scale=None, causal=False, block_n=64, training=True, **option):
        if option.get("q_smoothing"):  # the mode's own option: this probe smooths Q itself (--q-smoothing option)
            raise SystemExit("the probe smooths Q itself: pass --q-smoothing option, not the mode's q_smoothing")
        scale = reference._scale(q, sm_scale)
        q, k = q.float(), k.float()
        q_mean = torch.zeros_like(q[..., :1, :])
        if q_smoothing == "sequence":
            q_mean = q.mean(dim=-2, keepdim=True)
        elif q_smoothing == "block":
            blocks = q.unflatten(-2, (-1, 64)) if q.shape[-2] % 64 == 0 else None
            if blocks is None:
                raise SystemExit(f"--q-smoothing block needs a multiple of 64 tokens, not {q.shape[-2]}")
            q_mean = blocks.mean(dim=-2, keepdim=True).expand_as(blocks).flatten(-3, -2)
        elif q_smoothing == "option":  # the q_smoothing option's own means: per 128-row block, the last partial
            q_mean = reference.q_block_means_ref(q)[2]
        qf, kf = ((rule["qk"](t) if "qk" in on else t) for t in (q - q_mean, k))
        vf = rule["v"](v.float()) if "v" in on else v.float()
        reference.fake_quant_nvfp4_ref = rule["p"] if "p" in on else (lambda x, dim=-1, pre_scale=1.0: x)
        try:
            s = reference._logits_log2(qf, kf, scale, causal)
            if q_smoothing != "none":  # the mean's share of every logit, unquantized
                s = s + (q_mean @ k.transpose(-1, -2)) * (scale * reference.LOG2E)
            return reference._fp4_online_softmax(s, vf, block_n=block_n, training=training)
        finally:
            reference.fake_quant_nvfp4_ref = fq

    use_kernel, check_qkv = api._use_kernel, api.check_qkv
    reference.attn_qat_forward_ref = partial
    # on a GPU too: the reference, whose quantizers this switches, in fp32 as on the CPU
    api._use_kernel = lambda q: False
    api.check_qkv = lambda *a, dtypes, **kw: check_qkv(*a, dtypes=(*dtypes, torch.float32), **kw)
    try:
        yield
    finally:
        reference.attn_qat_forward_ref = forward
        api._use_kernel, api.check_qkv = use_kernel, check_qkv


def main(argv=None) -> None:
    parser = held_out_arguments(__doc__, clips=4, size="33x128x128")
    parser.add_argument("--qk-rotation", choices=QK_ROTATIONS, default="none")
    parser.add_argument("--k-smoothing", action="store_true")
    parser.add_argument("--sources", nargs="+", choices=list(SOURCES), default=list(SOURCES),
                        help="the rows (default: all of them)")
    parser.add_argument("--q-smoothing", choices=("none", "sequence", "block", "option"), default="none",
                        help="probe: Q minus its mean quantized, the mean's logits added back exactly (quantizers())")
    parser.add_argument("--four-over-six", nargs="*", choices=("qk", "v", "p"), default=[],
                        help="probe: these quantizers pick each block's scale as Four Over Six does")
    parser.add_argument("--four-over-six-tops", type=tops_argument, default=(6.0, 4.0), metavar="T,T,...",
                        help="the maxima --four-over-six tries per block (default 6,4: the option's; e.g. "
                             "6,5.5,5,4.5,4,3.5,3: a wider search, which the kernels do not offer)")
    parser.add_argument("--base-nvfp4", action="store_true",
                        help="also the base weights in plain nvfp4 (the gap's FP4 end) on the same clips")
    args = parser.parse_args(argv)
    fos = tuple(args.four_over_six)
    sources = {name: SOURCES[name] for name in args.sources}
    options = {**({"qk_rotation": args.qk_rotation} if args.qk_rotation != "none" else {}),
               **({"k_smoothing": True} if args.k_smoothing else {})}
    with four_over_six_tops(args.four_over_six_tops):
        report(args, fos, sources, options)


def tops_argument(text: str) -> tuple[float, ...]:
    """--four-over-six-tops: comma-separated maxima in (0, 6], the SPEC's 6 first."""
    try:
        tops = tuple(float(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not comma-separated numbers: {text!r}") from None
    if not tops or tops[0] != 6.0 or not all(0.0 < t <= 6.0 for t in tops):
        raise argparse.ArgumentTypeError(f"maxima in (0, 6], 6 first: {text!r}")
    return tops


@contextlib.contextmanager
def four_over_six_tops(tops: tuple[float, ...]):
    """Four Over Six's rule trying ``tops`` while the context lasts: in the PyTorch reference (what this probe
    runs) always, in the kernels' pre-pass too where they have that search (nvfp4.FOUR_OVER_SIX_SEARCHES)."""
    from attnqat.kernels import nvfp4

    rule, kernel_tops = reference.four_over_six_scale, nvfp4.four_over_six_tops
    reference.four_over_six_scale = functools.partial(rule, tops=tops)
    if tuple(tops) in nvfp4.FOUR_OVER_SIX_SEARCHES:
        nvfp4.four_over_six_tops = tuple(tops)
    try:
        yield
    finally:
        reference.four_over_six_scale, nvfp4.four_over_six_tops = rule, kernel_tops


def report(args, fos, sources, options) -> None:
    """Score the rows and print them (main's body, under its --four-over-six-tops)."""
    pipe, qat, data = load_held_out(args)
    base = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    run = lambda variants: flow_metrics(pipe.transformer, variants, data["x0"], data["embeds"], batch=4)  # noqa: E731
    # the weights in the transformer: their own bf16 first
    pair = [Variant("bf16", "bf16"), Variant("fp4", "nvfp4", options=options)]
    own = {}
    for label, weights in (("base", base), ("QAT", qat)):
        pipe.transformer.load_state_dict(weights)
        for name, on in sources.items():
            with quantizers(on, args.q_smoothing, fos):
                own[label, name] = run(pair)["fp4"]["velocity_distance"]
    print(f"{args.clips} held-out clips at {args.size}; velocity distance of FP4"
          f"{' (' + '; '.join(describe_qk_options(options)) + ')' if options else ''}"
          f"{SMOOTHED.get(args.q_smoothing, '')}{', Four Over Six on ' + ' '.join(fos) if fos else ''}"
          f"{' trying maxima ' + ','.join(f'{t:g}' for t in args.four_over_six_tops) if fos else ''}"
          " to the same weights in bf16\n")
    print("| quantizers on | base weights | QAT weights | QAT / base |")
    print("|---|---|---|---|")
    for name in sources:
        b, q = own["base", name], own["QAT", name]
        print(f"| {name} | {b:.5f} | {q:.5f} | {q / b:.2f} |")
    pipe.transformer.load_state_dict(base)
    with quantizers(SOURCES["all (nvfp4)"], args.q_smoothing, fos):
        r = run([Variant("bf16", "bf16"), Variant("qat_bf16", "bf16", qat), Variant("qat_fp4", "nvfp4", qat, options)])
    print(f"\nto the base weights in bf16: the QAT weights in bf16 {r['qat_bf16']['velocity_distance']:.5f}, "
          f"in FP4 {r['qat_fp4']['velocity_distance']:.5f}")
    if args.base_nvfp4:
        with quantizers(SOURCES["all (nvfp4)"]):  # plain: no option, no probe
            plain = run([Variant("bf16", "bf16"), Variant("nvfp4", "nvfp4")])["nvfp4"]["velocity_distance"]
        print(f"the base weights in plain nvfp4: {plain:.5f}; the QAT weights in FP4 close "
              f"{1 - r['qat_fp4']['velocity_distance'] / plain:.1%} of that velocity distance")

if __name__ == "__main__":
    main()
