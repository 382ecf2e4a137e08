"""A wider mini: the shipped folder's VAE, text encoder, tokenizer and scheduler (linked), and a transformer with
--width times the attention heads and FFN (head_dim stays 64), randomly initialised. bench/gpu_ceiling.sh trains it
from scratch (the ceiling at twice the width, docs/quality.md); its weights are only there so that the folder loads.

  python experiments/wide_mini.py --model attnqat/models/mini --width 2 --out runs/ceiling_x2/mini_x2
"""
import argparse
import json
import os
import shutil
from pathlib import Path

import torch
from diffusers import WanTransformer3DModel

from attnqat.pipelines.loading import resolve_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="mini", help="the folder widened ('mini': the shipped one)")
    ap.add_argument("--width", type=int, default=2, help="heads and FFN multiplied by this")
    ap.add_argument("--out", required=True, help="a new folder")
    args = ap.parse_args()
    src, out = Path(resolve_model(args.model)), Path(args.out)
    if args.width < 1:
        ap.error("--width must be >= 1")
    if out.exists() and any(out.iterdir()):
        ap.error(f"--out {out} exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)
    for entry in src.iterdir():
        if entry.name in ("transformer", "attn_qat.safetensors"):  # QAT weights of the narrow model do not apply
            continue
        if entry.is_dir():
            os.symlink(entry.resolve(), out / entry.name)
        else:
            shutil.copy(entry, out / entry.name)
    config = {k: v for k, v in json.loads((src / "transformer" / "config.json").read_text()).items()
              if not k.startswith("_")}
    config["num_attention_heads"] *= args.width
    config["ffn_dim"] *= args.width
    torch.manual_seed(0)
    transformer = WanTransformer3DModel.from_config(config)
    transformer.save_pretrained(out / "transformer")
    print(f"{out}: {sum(p.numel() for p in transformer.parameters()) / 1e6:.1f}M parameters "
          f"({config['num_attention_heads']} heads, FFN {config['ffn_dim']})")


if __name__ == "__main__":
    main()
