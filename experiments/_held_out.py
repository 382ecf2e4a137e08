"""What the CPU experiments on mini's held-out clips share: their arguments and the model, QAT weights and clips.

    p = held_out_arguments(__doc__, clips=16, size="17x128x128")  # + --device
    args = p.parse_args(argv)
    pipe, qat, data = load_held_out(args)   # fp32 on the CPU (the reference kernels), the QAT state dict, the clips
"""
from __future__ import annotations

import argparse

import torch

from attnqat.mini.evaluation import held_out_clips
from attnqat.mini.quality_cli import parse_size
from attnqat.pipelines.loading import load_pipeline, read_qat_checkpoint


def held_out_arguments(doc: str, *, clips: int, size: str) -> argparse.ArgumentParser:
    """A parser with --model, --qat, --clips and --size (defaults: the shipped model and QAT file, ``clips``, ``size``);
    the description is ``doc``'s first paragraph."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--model", default="attnqat/models/mini")
    p.add_argument("--qat", default="attnqat/models/mini/attn_qat.safetensors")
    p.add_argument("--clips", type=int, default=clips)
    p.add_argument("--size", default=size)
    p.add_argument("--device", default="cpu", help="where the fp32 reference runs (default: cpu)")
    return p


def load_held_out(args: argparse.Namespace):
    """(pipeline in fp32 on ``args.device`` (CPU by default), the QAT weights as a full state dict, the held-out
    clips of ``args``)."""
    pipe = load_pipeline(args.model, dtype=torch.float32, device=args.device)  # the reference path: fp32
    pipe.text_encoder.to(torch.float32)
    qat = read_qat_checkpoint(pipe.transformer, args.qat)
    return pipe, qat, held_out_clips(pipe, args.clips, size=parse_size(args.size))
