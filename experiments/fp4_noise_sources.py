"""Where does FP4 attention's error in mini come from, and what did QAT change? (docs/quality.md, "What the QAT
file changed")

    python experiments/fp4_noise_sources.py [--model attnqat/models/mini] \
        [--qat attnqat/models/mini/attn_qat.safetensors] [--clips 4] [--size 33x128x128] \
        [--qk-rotation hadamard] [--k-smoothing]

For the base weights and for the QAT weights, each in its own bf16 as the reference: the velocity distance
``|v_fp4 - v_bf16|^2 / |v_bf16|^2`` of nvfp4 attention with only some of its quantizers on (Q and K; V; P; Q, K
and V; all four, which is nvfp4), on the first ``--clips`` held-out clips at the quality table's noise levels. The
velocity distance of the QAT weights in FP4 to the *base* weights in bf16 (the quality table's) splits into the QAT
weights' own FP4 error and how far their bf16 function moved from the base's, also printed. The quantizers are
switched in the PyTorch reference (attnqat.kernels.reference), so this runs where that runs (CPU: ~10 minutes).
``--qk-rotation`` / ``--k-smoothing``: the FP4 rows with those options (Q and K transformed before the
quantizers, as the shipped QAT file runs: its weights were trained with the rotation).
"""
from __future__ import annotations

import contextlib
import pathlib
import sys

from attnqat.kernels import QK_ROTATIONS, describe_qk_options, reference
from attnqat.mini.evaluation import Variant, flow_metrics

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from experiments._held_out import held_out_arguments, load_held_out  # noqa: E402

#: which of nvfp4's four quantizers are on, per row
SOURCES = {"Q,K": ("qk",), "V": ("v",), "P": ("p",), "Q,K,V": ("qk", "v"), "all (nvfp4)": ("qk", "v", "p")}


@contextlib.contextmanager
def quantizers(on: tuple[str, ...]):
    """The reference FP4 forward with only the quantizers in ``on`` (the others pass fp32 values through)."""
    fq = reference.fake_quant_nvfp4_ref
    forward = reference.attn_qat_forward_ref

    def partial(q, k, v, *, sm_scale=None, causal=False, block_n=64, training=True):
        scale = reference._scale(q, sm_scale)
        qf, kf = ((fq(t.float()) if "qk" in on else t.float()) for t in (q, k))
        vf = fq(v.float()) if "v" in on else v.float()
        reference.fake_quant_nvfp4_ref = fq if "p" in on else (lambda x, dim=-1, pre_scale=1.0: x)
        try:
            return reference._fp4_online_softmax(reference._logits_log2(qf, kf, scale, causal), vf, block_n=block_n,
                                                 training=training)
        finally:
            reference.fake_quant_nvfp4_ref = fq

    reference.attn_qat_forward_ref = partial
    try:
        yield
    finally:
        reference.attn_qat_forward_ref = forward


def main(argv=None) -> None:
    parser = held_out_arguments(__doc__, clips=4, size="33x128x128")
    parser.add_argument("--qk-rotation", choices=QK_ROTATIONS, default="none")
    parser.add_argument("--k-smoothing", action="store_true")
    args = parser.parse_args(argv)
    options = {**({"qk_rotation": args.qk_rotation} if args.qk_rotation != "none" else {}),
               **({"k_smoothing": True} if args.k_smoothing else {})}
    pipe, qat, data = load_held_out(args)
    base = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    run = lambda variants: flow_metrics(pipe.transformer, variants, data["x0"], data["embeds"], batch=4)  # noqa: E731
    # the weights in the transformer: their own bf16 first
    pair = [Variant("bf16", "bf16"), Variant("fp4", "nvfp4", options=options)]
    own = {}
    for label, weights in (("base", base), ("QAT", qat)):
        pipe.transformer.load_state_dict(weights)
        for name, on in SOURCES.items():
            with quantizers(on):
                own[label, name] = run(pair)["fp4"]["velocity_distance"]
    print(f"{args.clips} held-out clips at {args.size}; velocity distance of FP4"
          f"{' (' + '; '.join(describe_qk_options(options)) + ')' if options else ''} to the same weights in bf16\n")
    print("| quantizers on | base weights | QAT weights | QAT / base |")
    print("|---|---|---|---|")
    for name in SOURCES:
        b, q = own["base", name], own["QAT", name]
        print(f"| {name} | {b:.5f} | {q:.5f} | {q / b:.2f} |")
    pipe.transformer.load_state_dict(base)
    r = run([Variant("bf16", "bf16"), Variant("qat_bf16", "bf16", qat), Variant("qat_fp4", "nvfp4", qat, options)])
    print(f"\nto the base weights in bf16: the QAT weights in bf16 {r['qat_bf16']['velocity_distance']:.5f}, "
          f"in FP4 {r['qat_fp4']['velocity_distance']:.5f}")

if __name__ == "__main__":
    main()
