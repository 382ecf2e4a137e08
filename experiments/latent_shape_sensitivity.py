"""How much does a VAE's latent space say about an object's shape? (docs/mini.md, "What does not bring the shapes
back")

    python experiments/latent_shape_sensitivity.py [--vae attnqat/models/mini/vae] [--vae OTHER_VAE_FOLDER] \
        [--clips 8] [--size 33x128x128]

Renders training-split corpus clips three times: as drawn, with the next shape of ``SHAPES``, and with the next
colour of ``COLOURS`` (everything else the same: position, size, motion, background); encodes them with each VAE
into the normalised latents the transformer trains on (``(mode - latents_mean) / latents_std``) and prints the RMS
latent distance a shape change and a colour change make, against the latents' own RMS, overall and per latent
frame. A VAE whose latents move less with the shape gives the transformer less to learn a shape from, at every
noise level. An earlier VAE folder can be read out of the git history (``git show REV:attnqat/models/mini/vae/...``).
"""
from __future__ import annotations

import argparse
import dataclasses

import torch
from diffusers import AutoencoderKLWan

from attnqat.mini.corpus import COLOURS, SHAPES, Corpus, render
from attnqat.mini.quality_cli import parse_size


def variants(spec):
    """The clip, the clip with the next shape, the clip with the next colour."""
    shape = SHAPES[(SHAPES.index(spec.shape) + 1) % len(SHAPES)]
    colours = list(COLOURS)
    colour = colours[(colours.index(spec.colour) + 1) % len(colours)]
    return [spec, dataclasses.replace(spec, shape=shape), dataclasses.replace(spec, colour=colour)]


@torch.no_grad()
def latent_distances(vae_folder: str, video: torch.Tensor, n: int, batch: int = 6) -> dict:
    vae = AutoencoderKLWan.from_pretrained(vae_folder, torch_dtype=torch.float32).eval()
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    z = torch.cat([(vae.encode(video[i:i + batch]).latent_dist.mode() - mean) / std
                   for i in range(0, len(video), batch)])
    z = z.view(n, 3, *z.shape[1:])  # (clips, [as drawn, shape changed, colour changed], C, F, H, W)
    rms = lambda t, dims=None: t.pow(2).mean(dims).sqrt() if dims else t.pow(2).mean().sqrt()  # noqa: E731
    per_frame = (0, 1, 3, 4)
    return {"rms": rms(z[:, 0]).item(), "shape": rms(z[:, 1] - z[:, 0]).item(), "colour": rms(z[:, 2] - z[:, 0]).item(),
            "shape_frames": rms(z[:, 1] - z[:, 0], per_frame).tolist(),
            "colour_frames": rms(z[:, 2] - z[:, 0], per_frame).tolist()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vae", action="append", help="a VAE folder (repeat to compare; default the shipped mini's)")
    p.add_argument("--clips", type=int, default=8)
    p.add_argument("--size", default="33x128x128")
    args = p.parse_args(argv)
    frames, height, width = parse_size(args.size)
    corpus = Corpus(seed=0, split="train")
    specs = [v for i in range(args.clips) for v in variants(corpus.spec(i))]
    video = render(specs, frames=frames, height=height, width=width)
    for folder in args.vae or ["attnqat/models/mini/vae"]:
        d = latent_distances(folder, video, args.clips)
        print(f"{folder}: latent RMS {d['rms']:.3f}; shape change {d['shape']:.4f} ({d['shape'] / d['rms']:.3f} of "
              f"the RMS), colour change {d['colour']:.4f}; shape / colour {d['shape'] / d['colour']:.2f}")
        print("  per latent frame, shape: " + " ".join(f"{x:.3f}" for x in d["shape_frames"]))
        print("  per latent frame, colour: " + " ".join(f"{x:.3f}" for x in d["colour_frames"]))


if __name__ == "__main__":
    main()
