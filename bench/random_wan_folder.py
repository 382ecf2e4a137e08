"""A diffusers-format Wan 2.1 folder with RANDOM weights at a published size, for running `attnqat train`,
`attnqat precompute` and `attnqat generate` end to end on GPUs without downloading a model (docs/multigpu.md).

    python bench/random_wan_folder.py --size 14b --out /tmp/wan14b                 # 14.3B transformer, bf16, ~29 GB
    python bench/random_wan_folder.py --size 1.3b --layers 2 --out /tmp/wan_small  # a CPU-sized stand-in

The transformer is the published config (attnqat.pipelines.wan_configs; --layers keeps the first N blocks) with
diffusers' initialisation, written in bf16 as the hub's folders are, in shards. The rest is what the transformer
needs to run, not Wan's own: the tiny model's byte-level tokenizer, a one-layer UMT5 text encoder of the real
width (d_model 4096: the transformer's text_dim), Wan's VAE at its published config (random: its latents have
the real shape, not the real statistics) and Wan's UniPC scheduler. Nothing it makes is a usable video model;
timings, memory and the code paths (loading, sharding, checkpoints, resume) are what it is for.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIZES = ("14b", "1.3b")


def build(size: str, out: Path, layers: int | None = None, seed: int = 0) -> Path:
    """Write the folder (a new or empty ``out``) and return it; every part is made from ``seed``."""
    from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    from attnqat.pipelines.tiny import build_tiny_scheduler, build_tiny_tokenizer
    from attnqat.pipelines.wan_configs import WAN21_1_3B_TRANSFORMER_CONFIG, WAN21_14B_TRANSFORMER_CONFIG

    config = dict(WAN21_14B_TRANSFORMER_CONFIG if size == "14b" else WAN21_1_3B_TRANSFORMER_CONFIG)
    if layers is not None:
        config["num_layers"] = layers
    tokenizer = build_tiny_tokenizer()
    torch.manual_seed(seed)
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=len(tokenizer), d_model=config["text_dim"], d_kv=64, d_ff=256, num_layers=1, num_heads=64,
        feed_forward_proj="gated-gelu", dropout_rate=0.0, pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0)).to(torch.bfloat16).eval()
    vae = AutoencoderKLWan().eval()  # Wan 2.1's VAE config (diffusers' defaults); fp32, as diffusers keeps it
    # bf16 from the start: a 14B fp32 copy (57 GB) would be made only to be cast
    torch.set_default_dtype(torch.bfloat16)
    try:
        transformer = WanTransformer3DModel(**config).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    pipe = WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
                       scheduler=build_tiny_scheduler())
    pipe.save_pretrained(out, safe_serialization=True, max_shard_size="5GB")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=SIZES, default="14b", help="the published transformer config (default 14b)")
    p.add_argument("--layers", type=int, help="keep only the first N transformer blocks (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True, help="a new or empty folder")
    args = p.parse_args(argv)
    if args.layers is not None and args.layers < 1:
        p.error("--layers must be >= 1")
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        p.error(f"--out {args.out} exists and is not an empty folder")
    start = time.perf_counter()
    build(args.size, args.out, args.layers, args.seed)
    gb = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file()) / 1e9
    print(f"wrote {args.out}: Wan 2.1 {args.size} config{f', {args.layers} blocks' if args.layers else ''}, RANDOM "
          f"weights, {gb:.1f} GB, {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
