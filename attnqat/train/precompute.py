"""Encode prompts (and optionally videos) once into safetensors shards for `attnqat train`.

  attnqat precompute --prompts prompts.txt --model tiny --out data/tiny
  attnqat precompute --prompts videos.jsonl --videos --model ./Wan2.1-T2V-1.3B-Diffusers --out data/wan13b

--prompts is a text file (one prompt per line; blank lines and lines starting with # skipped) or a
JSONL file ({"prompt": "...", "video": "clip.mp4"} per line). With --videos every record needs a
"video" (a path, relative to the JSONL file's folder or absolute); it is read with imageio, resized
to --height x --width, cut to --frames (4k+1) and encoded by the Wan VAE into normalized latents
((z - mean) / std, as WanPipeline decodes them). Training then needs neither the text encoder nor the
VAE in memory. Output: DIR/index.json and DIR/shard-NNNNN.safetensors (see attnqat.train.data).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import imageio.v3 as iio
import numpy as np
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKLWan
from transformers import AutoTokenizer, UMT5EncoderModel

from attnqat.checks import (check_can_create_in, check_device, check_input_file, check_int, check_limited,
                            check_not_input, check_output_dir, check_video_size, show)
from attnqat.errors import ComputeError, one_line
from attnqat.locking import output_lock
from attnqat.outputs import remove_stale_temps, replace_dir_atomically, write_dir_atomically
from attnqat.pipelines import build_tiny_text_encoder, build_tiny_tokenizer, build_tiny_vae, is_tiny
from attnqat.pipelines.loading import _from_pretrained, check_model, model_inputs, resolve_model

from .data import INDEX, SHARD_NAME, is_precompute_output, write_index, write_shard

HELP = "encode prompts (and videos) into safetensors shards for `attnqat train`"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", required=True, help="a .txt file (one prompt per line) or .jsonl ({\"prompt\", \"video\"})")
    p.add_argument("--model", default="tiny", help="'tiny' or a diffusers-format Wan 2.1 folder / hub id (default: tiny)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--videos", action="store_true", help="also encode each JSONL record's \"video\" through the VAE")
    p.add_argument("--max-length", type=int, default=512, help="text tokens per prompt, zero-padded (Wan: 512)")
    p.add_argument("--height", type=int, default=480, help="video height in pixels, multiple of 16 (default 480)")
    p.add_argument("--width", type=int, default=832, help="video width in pixels, multiple of 16 (default 832)")
    p.add_argument("--frames", type=int, default=81, help="frames per video, 4k+1 (default 81)")
    p.add_argument("--shard-size", type=int, default=256, help="samples per shard (default 256)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts per text-encoder call (default 8)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")


def check_arguments(args) -> None:
    """Every argument of ``attnqat precompute``, before its encoders load (the command's own module
    re-checks what it needs; this adds the limits, the paths and the device).

    ``--out`` must be new, empty, or an earlier precompute output (its index.json and shards, nothing else:
    it is then replaced, once the new output is complete): a folder holding anything else is refused, so no
    user file is overwritten. The new output is written beside it first, so its parent must be writable.
    """
    prompts = check_input_file("--prompts", args.prompts)
    check_model(args.model)
    out = check_output_dir("--out", args.out, must_be_empty=True, reusable=is_precompute_output)
    if out.exists():
        check_can_create_in("--out", str(args.out), out.parent)
    check_limited("--max-length", args.max_length, "text_tokens")
    check_int("--shard-size", args.shard_size, 1)
    check_int("--batch-size", args.batch_size, 1)
    if args.videos:
        check_video_size(args.height, args.width, args.frames)
    else:  # unused without --videos, still refused when absurd
        check_limited("--height", args.height, "side")
        check_limited("--width", args.width, "side")
        check_limited("--frames", args.frames, "frames")
    check_device("--device", args.device)
    try:
        read_records(prompts, args.videos)
    except UnicodeDecodeError:
        raise ValueError(f"--prompts {show(str(args.prompts))} is not UTF-8 text") from None


def read_records(path: str | Path, need_videos: bool) -> list[dict]:
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"--prompts {str(p)!r} does not exist")
    records = []
    if p.suffix == ".jsonl":
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{n}: not valid JSON ({e.msg})") from None
            if not isinstance(r, dict) or not isinstance(r.get("prompt"), str):
                raise ValueError(f"{p}:{n}: each line must be an object with a \"prompt\" string")
            if need_videos:
                if not r.get("video"):
                    raise ValueError(f"{p}:{n}: --videos needs a \"video\" path in every record")
                v = Path(r["video"]).expanduser()
                r["video"] = str(v if v.is_absolute() else p.parent / v)
                if not Path(r["video"]).is_file():
                    raise FileNotFoundError(f"{p}:{n}: video {r['video']!r} does not exist")
            records.append(r)
    else:
        if need_videos:
            raise ValueError("--videos needs a .jsonl --prompts file ({\"prompt\": ..., \"video\": ...} per line)")
        records = [{"prompt": line.strip()} for line in p.read_text().splitlines()
                   if line.strip() and not line.lstrip().startswith("#")]
    if not records:
        raise ValueError(f"--prompts {str(p)!r} holds no prompt")
    return records


def load_encoders(model: str, device, need_vae: bool):
    """(tokenizer, text_encoder, vae or None) of ``model``, text encoder in bf16 on GPU / fp32 on CPU."""
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if is_tiny(model):
        tok, enc = build_tiny_tokenizer(), build_tiny_text_encoder(dtype)
        vae = build_tiny_vae() if need_vae else None
    else:
        model = resolve_model(model)  # "mini": the shipped folder
        tok = _from_pretrained(AutoTokenizer, model, subfolder="tokenizer")
        enc = _from_pretrained(UMT5EncoderModel, model, subfolder="text_encoder", torch_dtype=dtype)
        vae = _from_pretrained(AutoencoderKLWan, model, subfolder="vae", torch_dtype=torch.float32) if need_vae else None
    enc = enc.to(device).eval()
    if vae is not None:
        vae = vae.to(device).eval()
    return tok, enc, vae


@torch.no_grad()
def encode_prompts(tok, enc, prompts: list[str], max_length: int, device) -> torch.Tensor:
    """Wan's prompt embeddings: UMT5 hidden states, zero past each prompt's length, (N, max_length, D)."""
    inputs = tok(prompts, padding="max_length", max_length=max_length, truncation=True, add_special_tokens=True,
                 return_attention_mask=True, return_tensors="pt")
    ids, mask = inputs.input_ids.to(device), inputs.attention_mask.to(device)
    h = enc(ids, mask).last_hidden_state
    return (h * mask.unsqueeze(-1).to(h.dtype)).to(torch.bfloat16).cpu()


def read_video(path: str, frames: int, height: int, width: int) -> torch.Tensor:
    """(3, frames, height, width) in [-1, 1]: the first ``frames`` frames, resized (bilinear)."""
    try:
        arr = np.stack([f for _, f in zip(range(frames), iio.imiter(path))])
    except (OSError, RuntimeError, ValueError) as e:  # a ValueError: not an output write failure
        raise ValueError(f"video {path!r}: cannot read it as a video ({one_line(str(e))})") from None
    if len(arr) < frames:
        raise ValueError(f"video {path!r} has {len(arr)} frames; --frames {frames} needs at least that many")
    x = torch.from_numpy(arr[..., :3]).float().permute(0, 3, 1, 2) / 127.5 - 1  # (T, 3, H, W)
    x = F.interpolate(x, size=(height, width), mode="bilinear", align_corners=False)
    return x.permute(1, 0, 2, 3)


@torch.no_grad()
def encode_video(vae, video: torch.Tensor, device) -> torch.Tensor:
    """Normalized latents (C, F, H, W) as the transformer sees them: (z - mean) / std."""
    z = vae.encode(video.unsqueeze(0).to(device, torch.float32)).latent_dist.mode()
    mean = torch.tensor(vae.config.latents_mean, device=z.device).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std, device=z.device).view(1, -1, 1, 1, 1)
    return ((z - mean) / std)[0].float().cpu()


def precompute(prompts_file: str, out: str, *, model: str = "tiny", videos: bool = False, max_length: int = 512,
               height: int = 480, width: int = 832, frames: int = 81, shard_size: int = 256, batch_size: int = 8,
               device: str | None = None, log=print) -> dict:
    """Write the shards and index.json; return the index.

    ``out`` is written as a whole: into a temporary folder beside it, renamed into place when complete, so
    a failed or interrupted run never leaves a half-written dataset there. An earlier precompute output at
    ``out`` (its index.json and shards, nothing else) is replaced only then; any other non-empty folder is
    refused. One run writes ``out`` at a time (:mod:`attnqat.locking`); the temporary folders a killed run
    left beside ``out`` are removed first."""
    if videos:
        if height % 16 or width % 16:
            raise ValueError(f"--height {height} and --width {width} must be multiples of 16")
        if frames % 4 != 1:
            raise ValueError(f"--frames {frames} must be 4k+1 (e.g. {frames - frames % 4 + 1})")
    if max_length < 1 or shard_size < 1 or batch_size < 1:
        raise ValueError("--max-length, --shard-size and --batch-size must be >= 1")
    folder = Path(out).expanduser()
    with output_lock(folder, "attnqat precompute", log=log):
        remove_stale_temps(folder, is_partial_output, log=lambda msg: log(f"attnqat precompute: {msg}"))
        records = read_records(prompts_file, videos)
        inputs = [("--prompts", prompts_file)] + [("a video of --prompts", r.get("video")) for r in records]
        check_not_input("--out", out, inputs + model_inputs("--model", model), holds_inputs_too=True)
        return _precompute(records, folder, out, model=model, videos=videos, max_length=max_length, height=height,
                           width=width, frames=frames, shard_size=shard_size, batch_size=batch_size, device=device,
                           log=log)


def is_partial_output(folder: Path) -> bool:
    """``folder`` holds nothing but what precompute writes (index.json, shards, their .tmp names): a temporary
    folder of precompute's, or an old output it moved aside."""
    return all(e.is_file() and not e.is_symlink() and (e.name.removesuffix(".tmp") == INDEX
                                                        or SHARD_NAME.fullmatch(e.name.removesuffix(".tmp")))
               for e in folder.iterdir())


def _precompute(records, folder: Path, out, *, model, videos, max_length, height, width, frames, shard_size,
                batch_size, device, log) -> dict:
    reuse = folder.is_dir() and (folder / INDEX).is_file()
    if folder.exists() and not (folder.is_dir() and (reuse or not any(folder.iterdir()))):
        raise ValueError(f"--out {str(out)!r} exists and is neither empty nor an earlier precompute output")
    if reuse and not is_precompute_output(folder):
        raise ValueError(f"--out {str(out)!r} holds an index.json beside files precompute did not write; "
                         f"give a new or empty folder (nothing in it is replaced)")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    tok, enc, vae = load_encoders(model, device, videos)
    index: dict = {}

    def write(tmp: Path) -> None:
        shards, latent_shape = [], None
        for s in range(0, len(records), shard_size):
            chunk = records[s:s + shard_size]
            name = f"shard-{len(shards):05d}.safetensors"
            try:  # a RuntimeError here is the encoders' (e.g. out of memory), not the folder's being written
                embeds = torch.cat([encode_prompts(tok, enc, [r["prompt"] for r in chunk[i:i + batch_size]],
                                                   max_length, device) for i in range(0, len(chunk), batch_size)])
                tensors = {"prompt_embeds": embeds}
                if videos:
                    lat = torch.stack([encode_video(vae, read_video(r["video"], frames, height, width), device)
                                       for r in chunk])
                    tensors["latents"] = lat
                    latent_shape = list(lat.shape[1:])
            except RuntimeError as e:
                raise ComputeError(f"encoding {name} failed ({one_line(str(e))}); "
                                   f"nothing was written to {str(out)!r}") from e
            write_shard(tmp / name, tensors, metadata={"prompts": json.dumps([r["prompt"] for r in chunk])})
            shards.append({"file": name, "num": len(chunk)})
            log(f"attnqat precompute: {name}: {len(chunk)} samples")
        index.update({"num_samples": len(records), "shards": shards, "text_dim": int(embeds.shape[-1]),
                      "text_len": max_length, "has_latents": bool(videos), "latent_shape": latent_shape,
                      "model": model})
        write_index(tmp, index)

    (replace_dir_atomically if reuse else write_dir_atomically)(folder, write)
    log(f"attnqat precompute: wrote {len(records)} samples to {folder} (set data.path: {folder})")
    return index


def main(args) -> int:
    precompute(args.prompts, args.out, model=args.model, videos=args.videos, max_length=args.max_length,
               height=args.height, width=args.width, frames=args.frames, shard_size=args.shard_size,
               batch_size=args.batch_size, device=args.device)
    return 0
