"""A/B two versions of ``attnqat/kernels/hopper_gluon.py`` in one process: are the forwards' outputs identical, and
how fast is each, alternating, beside cuDNN.

    git show HEAD~1:attnqat/kernels/hopper_gluon.py > /tmp/hg_old.py
    python experiments/gluon_ab.py /tmp/hg_old.py                # the four forwards at Wan 14B's shape
    python experiments/gluon_ab.py /tmp/hg_old.py --time 1,40,8192,128 --rounds 3

Machines differ by a few percent and cuDNN's own time moves between runs, so a change worth a few percent is only
measurable with both versions timed in the same process, alternating. The other version is loaded from its file as a
sibling module of ``hopper_gluon`` (its relative imports resolve against the installed attnqat). For each forward
kind (bf16 ``pingpong``, FP4 inference ``pingpong`` and ``ws``, the Attn-QAT training forward ``ws``): first whether
every output (O; and O', m, l, phi(Q), phi(K), phi(V) for training) is equal bit for bit, NaN where NaN, at a few
ragged, causal and NaN-carrying shapes and at the timing shape; then median ms (``triton.testing.do_bench``) of each
version per round, and the ratio to cuDNN's forward of that round.
"""
from __future__ import annotations

import argparse
import importlib.util
import pathlib
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from bench._report import bench_ms, bhld_shape, env_line, environment  # noqa: E402
from attnqat.kernels import hopper_gluon  # noqa: E402

CHECK_SHAPES = ((2, 4, 1000, 64, False), (1, 6, 4097, 128, True), (1, 4, 3000, 128, False))  # + a NaN in the last


def load_other(path: pathlib.Path):
    """The other version as module ``attnqat.kernels._hopper_gluon_other``."""
    name = f"{hopper_gluon.__package__}._hopper_gluon_other"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def forwards(mod, q, k, v, causal):
    """The forward kinds of one version, as zero-argument callables."""
    return {
        "bf16 pingpong": lambda: mod.hopper_attention(q, k, v, causal=causal, variant="pingpong"),
        "fp4 pingpong": lambda: mod.hopper_fp4_attention(q, k, v, causal=causal, variant="pingpong"),
        "fp4 ws": lambda: mod.hopper_fp4_attention(q, k, v, causal=causal, variant="ws"),
        "training ws": lambda: mod.hopper_attn_qat_forward(q, k, v, causal=causal, variant="ws"),
    }


def identical(a, b) -> bool:
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(identical(x, y) for x, y in zip(a, b))
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def inputs(shape):
    return tuple(torch.randn(*shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("other", type=pathlib.Path, help="the other version of hopper_gluon.py (e.g. from git show)")
    p.add_argument("--time", type=bhld_shape, default=(1, 40, 32760, 128), help="B,H,L,D timed (non-causal)")
    p.add_argument("--rounds", type=int, default=2, help="timing rounds, each version once per round (default 2)")
    args = p.parse_args(argv)
    if not args.other.is_file():
        p.error(f"{args.other} is not a file")
    ok, why = hopper_gluon.available()
    if not ok:
        p.error(f"the Gluon sm_90 kernels cannot run here: {why}")
    other = load_other(args.other)
    print(env_line(environment()))
    torch.manual_seed(0)

    for *shape, causal in CHECK_SHAPES + (tuple(args.time) + (False,),):
        q, k, v = inputs(shape)
        if shape == list(CHECK_SHAPES[-1][:4]):
            q[0, 0, 5, 3] = float("nan")  # NaN in: NaN out, in the same rows
        this, that = forwards(hopper_gluon, q, k, v, causal), forwards(other, q, k, v, causal)
        same = {kind: identical(this[kind](), that[kind]()) for kind in this}
        print(f"identical {tuple(shape)} causal={causal}: {same}", flush=True)

    q, k, v = inputs(args.time)
    this, that = forwards(hopper_gluon, q, k, v, False), forwards(other, q, k, v, False)
    for r in range(args.rounds):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            ref = bench_ms(lambda: F.scaled_dot_product_attention(q, k, v), warmup=50, rep=300)
        cells = [f"cuDNN {ref:.2f} ms"]
        for kind in this:
            mine, theirs = (bench_ms(fn[kind], warmup=50, rep=300) for fn in (this, that))
            cells.append(f"{kind}: this {mine:.2f} ({mine / ref:.3f}x), other {theirs:.2f} ({theirs / ref:.3f}x)")
        print(f"round {r} {tuple(args.time)}: " + " | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
