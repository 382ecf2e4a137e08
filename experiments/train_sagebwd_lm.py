"""Does SageBwd train? A tiny byte-level causal LM on Python's own standard-library source.

Three runs from the same initialisation and the same batches: high-precision attention (mode
``bf16``: torch SDPA), ``sagebwd`` with K-smoothing (default) and ``sagebwd`` without. Writes the loss
curves to ``docs/sagebwd_training.{png,json}``.

    python experiments/train_sagebwd_lm.py                       # CPU: sagebwd runs its PyTorch reference path
    python experiments/train_sagebwd_lm.py --device cuda --steps 600 --seq 512 --layers 4 --d-model 256

On CPU, :func:`attnqat.kernels.attention` runs the differentiable reference of SPEC §4 (bit-for-bit the
kernel's numerics up to float rounding, see tests/test_sagebwd.py); on CUDA it runs the Triton kernels.
The model uses only the public API of ``attnqat.kernels``.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from attnqat.kernels import attention  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUNS = (("bf16", "sdpa (high precision)", {}), ("sagebwd", "sagebwd, K-smoothing", {"smooth_k": True}),
        ("sagebwd", "sagebwd, no smoothing", {"smooth_k": False}))


def stdlib_bytes(limit: int = 4_000_000) -> torch.Tensor:
    """The standard library's top-level .py files, concatenated in sorted order, as byte ids."""
    root = pathlib.Path(os.__file__).parent
    chunks, total = [], 0
    for p in sorted(root.glob("*.py")):
        b = p.read_bytes()
        chunks.append(b)
        total += len(b)
        if total >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long()


class Block(nn.Module):
    def __init__(self, d_model, n_heads, mode, options, attn_dtype):
        super().__init__()
        self.n_heads, self.mode, self.options, self.attn_dtype = n_heads, mode, options, attn_dtype
        self.norm1, self.norm2 = nn.RMSNorm(d_model), nn.RMSNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.n_heads, c // self.n_heads).permute(2, 0, 3, 1, 4)
        q, k, v = (t.to(self.attn_dtype) for t in (q, k, v))
        o = attention(q, k, v, mode=self.mode, causal=True, **self.options)
        x = x + self.proj(o.to(x.dtype).transpose(1, 2).reshape(b, n, c))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, d_model, n_heads, n_layers, seq, mode, options, attn_dtype):
        super().__init__()
        self.emb = nn.Embedding(256, d_model)
        self.pos = nn.Parameter(torch.randn(seq, d_model) * 0.02)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, mode, options, attn_dtype) for _ in range(n_layers))
        self.norm = nn.RMSNorm(d_model)
        self.head = nn.Linear(d_model, 256, bias=False)

    def forward(self, ids):
        x = self.emb(ids) + self.pos[: ids.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def train(mode, options, data, args, device, attn_dtype):
    torch.manual_seed(args.seed)  # same init and batch order in every run
    model = TinyLM(args.d_model, args.d_model // 64, args.layers, args.seq, mode, options, attn_dtype).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    n_train = int(len(data) * 0.95)
    train_data, val_data = data[:n_train], data[n_train:]
    gen = torch.Generator().manual_seed(args.seed)
    losses, t0 = [], time.time()
    for step in range(args.steps):
        lr = args.lr * min(1.0, (step + 1) / 50)  # 50-step warmup, then constant
        for g in opt.param_groups:
            g["lr"] = lr
        idx = torch.randint(0, len(train_data) - args.seq - 1, (args.batch,), generator=gen)
        batch = torch.stack([train_data[i:i + args.seq + 1] for i in idx]).to(device)
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 256), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == args.steps - 1:
            print(f"{mode} {options} step {step} loss {loss.item():.4f} ({time.time() - t0:.0f}s)", flush=True)
    model.eval()
    with torch.no_grad():
        gv = torch.Generator().manual_seed(123)
        idx = torch.randint(0, len(val_data) - args.seq - 1, (args.val_batches * args.batch,), generator=gv)
        vl = []
        for chunk in idx.split(args.batch):
            batch = torch.stack([val_data[i:i + args.seq + 1] for i in chunk]).to(device)
            vl.append(F.cross_entropy(model(batch[:, :-1]).reshape(-1, 256), batch[:, 1:].reshape(-1)).item())
    return {"train_loss": losses, "val_loss": sum(vl) / len(vl), "seconds": time.time() - t0}


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    w = 20
    for run in result["runs"]:
        x = torch.tensor(run["train_loss"])
        sm = torch.nn.functional.avg_pool1d(x[None, None], w, 1).flatten()  # 20-step moving average
        ax.plot(range(w - 1, len(x)), sm, label=f"{run['label']} (val {run['val_loss']:.3f})")
    a = result["args"]
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (nats/byte, 20-step mean)")
    ax.set_title(f"byte-level LM on stdlib source: {a['layers']} layers, d={a['d_model']}, L={a['seq']}, "
                 f"{result['path']}", fontsize=9)
    ax.set_ylim(top=min(3.5, ax.get_ylim()[1]))
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--val-batches", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "docs"))
    ap.add_argument("--name", default="sagebwd_training")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    attn_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # kernels take bf16; reference any
    data = stdlib_bytes()
    path = "CUDA: Triton SageBwd kernels" if device.type == "cuda" else "CPU: SageBwd reference path"
    result = {"args": vars(args), "path": path, "data_bytes": len(data), "runs": []}
    if device.type == "cuda":
        result["device"] = torch.cuda.get_device_name()
    for mode, label, options in RUNS:
        r = train(mode, options, data, args, device, attn_dtype)
        r.update(mode=mode, label=label, options=options)
        result["runs"].append(r)
        print(f"== {label}: final train {sum(r['train_loss'][-20:]) / 20:.4f}, val {r['val_loss']:.4f}, "
              f"{r['seconds']:.0f}s", flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(result))
    try:
        plot(result, out / f"{args.name}.png")
    except ImportError:
        print("matplotlib not installed: pip install matplotlib (the 'plot' extra); JSON written", flush=True)


if __name__ == "__main__":
    main()
