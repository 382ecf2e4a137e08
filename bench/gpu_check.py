"""Compiled-kernel correctness check on the GPU (vs the PyTorch reference), printed as a table.
Used by the device runs before benchmarking; the pytest GPU suite asserts the same things."""
import sys, pathlib, time
import torch
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from attnqat.kernels.attn_qat import attn_qat_attention
from attnqat.kernels import reference as R


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def main():
    torch.manual_seed(0)
    for (B, H, LQ, LK, D, causal) in [(1, 2, 1000, 1000, 128, False), (2, 2, 777, 1500, 64, False),
                                      (1, 2, 1024, 1024, 128, True), (1, 1, 4096, 4096, 128, False)]:
        q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for L in (LQ, LK, LK))
        t = time.time()
        o = attn_qat_attention(q, k, v, causal=causal)
        do = torch.randn_like(o)
        o.backward(do)
        torch.cuda.synchronize()
        ro, roa, rm, rl = R.attn_qat_forward_ref(q.detach(), k.detach(), v.detach(), causal=causal)
        rdq, rdk, rdv = R.attn_qat_backward_ref(q.detach(), k.detach(), v.detach(), roa, do, rm, rl, causal=causal)
        bf = rel(ro.bfloat16(), ro)
        print(f"B{B} H{H} Lq{LQ} Lk{LK} D{D} causal={causal} ({time.time() - t:.1f}s): bf16-rounding {bf:.2e} "
              f"O {rel(o, ro):.2e} dQ {rel(q.grad, rdq):.2e} dK {rel(k.grad, rdk):.2e} dV {rel(v.grad, rdv):.2e}",
              flush=True)


if __name__ == "__main__":
    main()
