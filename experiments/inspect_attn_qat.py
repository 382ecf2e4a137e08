"""Where the FP4 forward's time goes: compile the inference forward with and without phi(P) and print
registers, spills, TTGIR layout conversions / shared-memory traffic and a SASS opcode histogram,
then time both. GPU only.

    python experiments/inspect_attn_qat.py [--L 32760] [--config 64,64,4,3]
"""
import argparse
import collections
import pathlib
import re
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from attnqat.kernels._common import LaunchConfig  # noqa: E402
from attnqat.kernels.formats import LOG2E  # noqa: E402
from attnqat.kernels.attn_qat import _attn_fwd, attn_qat_forward  # noqa: E402
from attnqat.kernels.nvfp4 import quantize_heads  # noqa: E402
from bench._report import bench_ms  # noqa: E402

OPS = ["HGMMA", "MUFU", "SHFL", "LDS", "STS", "BAR", "FMNMX", "FSETP", "FADD", "FMUL", "FFMA", "F2FP", "SEL",
       "FSEL", "LOP3", "IADD3", "LDL", "STL", "LDG", "STG", "LDGSTS", "SYNCS", "UTMALDG"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--L", type=int, default=32760)
    ap.add_argument("--heads", type=int, default=40)
    ap.add_argument("--config", default="128,128,8,3")
    ap.add_argument("--smooth", action="store_true", help="the sage3 variant (SMOOTH_Q: adds ΔS to S)")
    ap.add_argument("--dump", default=None, help="folder to write the quantized kernel's TTGIR, PTX and SASS to")
    args = ap.parse_args()
    cfg = LaunchConfig.parse(args.config)
    q, k, v = (torch.randn(1, args.heads, args.L, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qf, kf, vf = (quantize_heads(t, torch.bfloat16) for t in (q, k, v))
    o = torch.empty_like(q)
    m = torch.empty((1, args.heads, args.L), device="cuda")
    nqb = triton_cdiv(args.L, 128)
    ds = (torch.zeros((1, args.heads, nqb, 3, triton_cdiv(args.L, cfg.block_n) * cfg.block_n), device="cuda",
                      dtype=torch.bfloat16) if args.smooth else m)
    l = torch.empty_like(m)
    for quant in (False, True):
        kern = _attn_fwd[(triton_cdiv(args.L, cfg.block_m), args.heads)](
            qf, kf, vf, qf, kf, o, o, m, l, ds, o.stride(0), o.stride(1), o.stride(2), args.heads, args.L, args.L,
            nqb if args.smooth else 0, ds.stride(3) if args.smooth else 0,
            128 ** -0.5 * LOG2E, HEAD_DIM=128, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CAUSAL=False,
            TRAINING=False, QUANT_P=quant, IEEE=False, SMOOTH_Q=args.smooth, FP16=False, FP8_CAST=True, PACKED_QK=0,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        ttgir = kern.asm["ttgir"]
        sass = kern.asm["sass"]
        ir = {op: len(re.findall(op, ttgir)) for op in ("ttg.convert_layout", "ttg.local_alloc", "ttg.local_load",
                                                         "ttg.local_store", "tt.reshape", "tt.reduce")}
        hist = collections.Counter()
        for line in sass.splitlines():  # Triton's SASS: "<control bits>\t[@pred] OPCODE.mods operands;"
            if "\t" not in line:
                continue
            tok = line.split("\t", 1)[1].split()
            if tok:
                hist[(tok[1] if tok[0].startswith("@") and len(tok) > 1 else tok[0]).split(".")[0]] += 1
        t = bench_ms(lambda: attn_qat_forward(q, k, v, sm_scale=128 ** -0.5, causal=False, training=False,
                                              quant_p=quant, config=cfg, operands=(qf, kf, vf),
                                              delta_s=ds if args.smooth else None))
        print(f"QUANT_P={quant}: {t:.2f} ms, regs {kern.n_regs}, spills {kern.n_spills}, TTGIR {ir}")
        print("   SASS:", {op: hist.get(op, 0) for op in OPS})
        if quant and args.dump:
            folder = pathlib.Path(args.dump)
            folder.mkdir(parents=True, exist_ok=True)
            for ext in ("ttgir", "ptx", "sass"):
                (folder / f"attn_fwd_quant.{ext}").write_text(kern.asm.get(ext, "") or "")


def triton_cdiv(a, b):
    return (a + b - 1) // b


if __name__ == "__main__":
    main()
