"""Does a model read its prompt? The flow loss at fixed noise with each clip's own caption, with
another clip's caption (the batch rolled by one) and with the empty prompt (docs/mini.md).

    python bench/prompt_reading.py --model runs/mini/mini [--weights RUN_OR_CHECKPOINT] [--size 9x64x64]

A model that ignores the caption has wrong/right ~1.00; one that reads it, clearly above 1. Clips are
corpus clips (train split from index 10^6, past what a short run sees; and the held-out split),
encoded by the model's own VAE and text encoder.
"""
from __future__ import annotations

import argparse

import torch


def load_model_and_corpus(model: str, weights: str | None, size: str, text_len: int):
    """(transformer in eval mode, CorpusSource of clips of ``size`` "FxHxW") on the CPU in fp32, from a diffusers Wan
    folder, with ``weights`` (an attnqat train run or checkpoint) loaded over its transformer if given; clips are
    encoded by the model's own VAE and text encoder (bench/attribute_reading.py shares this)."""
    from diffusers import AutoencoderKLWan, WanPipeline

    from attnqat.pipelines.loading import load_qat_checkpoint
    from attnqat.train.config import CorpusConfig
    from attnqat.train.corpus_source import CorpusSource

    f, h, w = (int(x) for x in size.split("x"))
    vae = AutoencoderKLWan.from_pretrained(model, subfolder="vae", torch_dtype=torch.float32)
    pipe = WanPipeline.from_pretrained(model, vae=vae, torch_dtype=torch.float32)
    if weights:
        load_qat_checkpoint(pipe.transformer, weights)
    src = CorpusSource.from_components(pipe.tokenizer, pipe.text_encoder, pipe.vae, CorpusConfig(sizes=[[f, h, w]]),
                                      text_len=text_len, device="cpu")
    return pipe.transformer.eval(), src


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a diffusers Wan folder (e.g. runs/mini/mini)")
    p.add_argument("--weights", help="transformer weights to load (an attnqat train run or checkpoint)")
    p.add_argument("--size", default="9x64x64", help="FRAMESxHEIGHTxWIDTH of the clips (default 9x64x64)")
    p.add_argument("--text-len", type=int, default=512, help="prompt length the model trained with (default 512)")
    p.add_argument("--clips", type=int, default=32)
    p.add_argument("--sigmas", default="0.6,0.9")
    args = p.parse_args()
    transformer, src = load_model_and_corpus(args.model, args.weights, args.size, args.text_len)
    print("split     sigma  right   wrong   empty   wrong/right")
    for split in ("train", "held_out"):
        first = 10 ** 6 if split == "train" else 0
        x0, emb = src.encode_clips(split, list(range(first, first + args.clips)), 0)
        empty = src.empty_embedding().expand_as(emb)
        g = torch.Generator().manual_seed(0)
        for sigma in (float(s) for s in args.sigmas.split(",")):
            noise = torch.randn(x0.shape, generator=g)
            xt, t = (1 - sigma) * x0 + sigma * noise, torch.full((len(x0),), sigma * 1000.0)
            loss = {}
            with torch.no_grad():
                for name, e in (("right", emb), ("wrong", emb.roll(1, 0)), ("empty", empty)):
                    v = transformer(hidden_states=xt, timestep=t, encoder_hidden_states=e, return_dict=False)[0]
                    loss[name] = (v - (noise - x0)).pow(2).mean().item()
            print(f"{split:9s} {sigma:5.2f}  {loss['right']:.4f}  {loss['wrong']:.4f}  {loss['empty']:.4f}  "
                  f"{loss['wrong'] / loss['right']:.3f}")


if __name__ == "__main__":
    main()
