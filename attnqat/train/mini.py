"""Train the ``mini`` text-to-video model from scratch (the model :mod:`attnqat.mini.model` ships).

    attnqat build-mini --out runs/mini                      # every stage, on the GPU
    attnqat build-mini --out runs/mini --stage transformer  # continue one stage (resumable)

(``python -m attnqat.train.mini ...`` is the same command, for scripts that start a module.)

Stages, each skipped when its output exists (so a killed or time-limited run just continues):

1. ``init``: write ``OUT/model``, a diffusers folder of untrained mini components (the frozen, seeded
   text encoder; an untrained VAE and transformer).
2. ``vae``: train the ``AutoencoderKLWan`` for reconstruction on corpus clips for ``--vae-minutes``
   (L1 + a small KL term), then measure the latents' per-channel mean and std on fresh clips and store
   them in its config (``latents_mean`` / ``latents_std``, which ``WanPipeline`` uses to decode).
3. ``transformer``: ``attnqat train`` with ``configs/mini.yaml`` (flow matching on the corpus,
   encoded on the fly by the stage-2 VAE; bf16 attention; EMA weights) for ``--minutes`` of this call;
   rerun to continue from its last checkpoint.
4. ``export``: the EMA weights of the last checkpoint into ``OUT/mini``, the folder that ships
   (bf16 transformer, fp16 VAE; <= 24 MB, no file over 15 MiB), with ``attnqat_mini.json`` (what was
   trained, for how long, on what). ``--ship`` then copies it to ``attnqat/models/mini``.

Wall-clock time of each stage is appended to ``OUT/timings.json``.

A warm start (``--from FOLDER``, at ``init``): continue training from an earlier build's exported folder
(its ``attnqat_mini.json`` names it) when the full checkpoint cannot travel, e.g. across GPU sessions whose
transfers are capped: the exported (EMA, bf16) transformer becomes the starting weights of a new run, with
a fresh optimizer and EMA (the warm-up of ``configs/mini.yaml`` applies again); the VAE is ``--vae`` if
given (the fp32 one the earlier build encoded with), else the folder's. The earlier build's timings and
steps are carried over, so the next export's card counts the whole chain.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

import torch

from attnqat.mini.corpus import Corpus
from attnqat.mini.evaluation import PSNR_CAP_DB, vae_round_trip
from attnqat.outputs import replace_dir_atomically, write_file_atomically
from attnqat.pipelines.loading import load_qat_checkpoint
from attnqat.mini.model import (MAX_FOLDER_BYTES, MAX_LARGER_FOLDER_BYTES, MINI_DIR, TRANSFORMER_SIZE_KEYS,
                                build_mini_pipeline, build_mini_transformer, check_folder_size,
                                mini_transformer_config, save_pipeline_folder)
from attnqat.mini.quality import detect, score

from .checkpoint import RUN_CONFIG
from .config import load_config, validate
from .loop import latest_checkpoint, train

STAGES = ("init", "vae", "transformer", "export")
CONTINUED = "continued_from.json"  # in OUT after a warm start: the card of the build it started from
CONFIG = Path(__file__).resolve().parents[2] / "configs" / "mini.yaml"


def _record(out: Path, stage: str, seconds: float, **facts) -> None:
    path = out / "timings.json"
    rows = json.loads(path.read_text()) if path.is_file() else []
    rows.append({"stage": stage, "seconds": round(seconds, 1), "device": _device_name(), **facts})
    write_file_atomically(path, lambda tmp: tmp.write_text(json.dumps(rows, indent=1)))


def _device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


# ---------------------------------------------------------------------------------------------------------------
# Stage 2: the VAE


FOREGROUND_WEIGHT = 20.0


def foreground_weights(video: torch.Tensor) -> torch.Tensor:
    """Per-pixel loss weights (n, 1, F, H, W): FOREGROUND_WEIGHT where the pixel is saturated (HSV
    saturation > 0.4: the corpus's objects), 1 elsewhere."""
    rgb = (video + 1) / 2
    hi, lo = rgb.amax(1, keepdim=True), rgb.amin(1, keepdim=True)
    saturation = (hi - lo) / hi.clamp_min(1e-3)
    return 1 + (FOREGROUND_WEIGHT - 1) * (saturation > 0.4).to(video.dtype)


# The clip sizes the VAE trains on, cycled. Wan's VAE is causal: the round trip of a clip's first N frames is
# exactly that of an N-frame clip (tests/test_mini_train.py checks it), so clips of the longest length used
# and one latent frame beyond (57 frames) train every shorter length too, each frame position equally. A
# cycle of lengths 9..57 weighted frame t by the share of clips longer than t, and the VAE trained on it
# declined along the clip (H100: 26 dB at frame 7 to 23.6 dB at frame 32 on a static background). Single
# frames too: the first frame is encoded and decoded alone, by a path no later frame takes, and was the
# worst of every length (the object's hue shifted, red read as orange on 4 of 16 clips), so it gets a third
# of the steps. Lengths a VAE never saw break it: one trained on 17 frames fell to 6-8 dB after frame 17.
VAE_SIZES = ((57, 128, 128), (57, 256, 256), (1, 128, 128), (57, 128, 128), (57, 256, 256), (1, 256, 256))
VAE_REFERENCE_VOXELS = 17 * 128 * 128  # ``batch`` clips of this many pixels a step; larger clips come fewer


def vae_batch(size, batch: float, reference: int = VAE_REFERENCE_VOXELS) -> int:
    """Clips a step at ``size`` (frames, height, width): about ``batch`` clips of ``reference`` pixels' worth, at
    least one (a ``batch`` below 1 makes small steps for smoke runs and tests: 0.02 is one 5x32x32 clip)."""
    f, h, w = size
    return max(1, round(batch * reference / (f * h * w)))


def with_new_decoder(vae, decoder_base_dim: int, seed: int = 0):
    """A copy of ``vae`` whose decoder is new and ``decoder_base_dim`` wide (untrained, seeded), the encoder side
    (``encoder``, ``quant_conv``) and ``post_quant_conv`` copied: the same latents, decoded by a decoder of another
    capacity (train it with ``decoder_only``)."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    config = {k: v for k, v in vae.config.items() if k != "_use_default_values"}  # which lists decoder_base_dim
    new = AutoencoderKLWan.from_config({**config, "decoder_base_dim": decoder_base_dim})
    kept = {k: v for k, v in vae.state_dict().items() if not k.startswith("decoder.")}
    missing, unexpected = new.load_state_dict(kept, strict=False)
    assert not unexpected and all(k.startswith("decoder.") for k in missing), (missing, unexpected)
    return new


def train_vae(vae, *, seconds: float, steps: int | None = None, batch: float = 8, sizes=VAE_SIZES, lr: float = 5e-4,
              kl_weight: float = 1e-4, seed: int = 0, device="cuda", log=print,
              reference_voxels: int = VAE_REFERENCE_VOXELS, decoder_only: bool = False) -> dict:
    """Train ``vae`` for reconstruction on corpus clips until ``seconds`` pass (or ``steps`` are done).

    Steps cycle through ``sizes`` ((frames, height, width) each), with :func:`vae_batch` clips of each so that
    every step sees about the pixels of ``batch`` clips of ``reference_voxels``. The learning rate follows a
    cosine over the time budget (to 10%). Returns the last losses.

    ``decoder_only`` freezes the encoder (and ``quant_conv``): the latents stay exactly what they were, so a
    transformer trained on them carries over while the decoder improves.
    """
    corpus = Corpus(seed, "train")
    vae.to(device).train()
    if decoder_only:
        for module in (vae.encoder, vae.quant_conv):
            module.requires_grad_(False).eval()
    opt = torch.optim.AdamW([p for p in vae.parameters() if p.requires_grad], lr=lr, weight_decay=0.0,
                            betas=(0.9, 0.99))
    t0, step, clip, l1 = time.perf_counter(), 0, 0, float("nan")
    use_amp = torch.device(device).type == "cuda"
    while True:
        frac = (time.perf_counter() - t0) / seconds
        if frac >= 1 or (steps is not None and step >= steps):
            break
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 100) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        frames, height, width = size = sizes[step % len(sizes)]
        n = vae_batch(size, batch, reference_voxels)
        specs = [corpus.spec(clip + i) for i in range(n)]
        clip += n
        video = corpus.render(specs, frames=frames, height=height, width=width, device=device)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=use_amp):
            with torch.set_grad_enabled(not decoder_only):
                posterior = vae.encode(video).latent_dist
            recon = vae.decode(posterior.sample()).sample
        # Objects cover ~5% of the pixels: an unweighted L1 lets the VAE drop them (measured: a 3-minute run
        # reconstructed backgrounds at 16.6 dB and no object at all). Saturated pixels (the objects; the
        # corpus's backgrounds are unsaturated) weigh FOREGROUND_WEIGHT times more.
        rec = ((recon.float() - video).abs() * foreground_weights(video)).mean()
        mu, logvar = posterior.mean.float(), posterior.logvar.float()
        kl = 0.5 * (mu.pow(2) + logvar.exp() - 1 - logvar).mean()  # per latent element
        loss = rec + kl_weight * kl if not decoder_only else rec
        if not torch.isfinite(loss):
            raise FloatingPointError(f"VAE training diverged at step {step} (loss {loss.item()})")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in vae.parameters() if p.requires_grad], 1.0)
        opt.step()
        step += 1
        l1 = rec.item() if step % 50 == 0 or step < 3 else l1
        if step % 200 == 0:
            log(f"vae step {step}: L1 {l1:.4f} ({time.perf_counter() - t0:.0f} s)")
    vae.eval()
    return {"steps": step, "clips": clip, "l1": l1}


@torch.no_grad()
def latent_statistics(vae, *, clips: int = 64, size=(33, 128, 128), seed: int = 0, device="cuda"):
    """Per-channel mean and std of ``vae``'s latents (posterior means) over ``clips`` corpus clips."""
    corpus = Corpus(seed, "train")
    frames, height, width = size
    zs = []
    for i in range(0, clips, 8):
        specs = [corpus.spec(10 ** 7 + j) for j in range(i, min(clips, i + 8))]  # clips past any VAE step's
        video = corpus.render(specs, frames=frames, height=height, width=width, device=device)
        zs.append(vae.encode(video).latent_dist.mode().float().transpose(0, 1).flatten(1))
    z = torch.cat(zs, 1)
    return z.mean(1).tolist(), z.std(1).tolist()


@torch.no_grad()
def reconstruction_per_frame(vae, *, clips: int = 16, size=(33, 256, 256), seed: int = 0, device="cuda") -> dict:
    """VAE round trips of held-out corpus clips measured frame by frame
    (:func:`attnqat.mini.evaluation.vae_round_trip`).

    Returns, per frame: ``frame_db`` (PSNR in dB, RGB in [-1, 1] as 0..255, the mean over clips), ``worst_db``
    (the worst clip), ``object_db`` (over the object's pixels), ``colour`` and ``shape`` (the fraction of clips
    whose round-trip frame the detector reads as the clip's colour, shape); and ``mean_db`` over clips and
    frames. PSNR is capped at ``PSNR_CAP_DB`` (100 dB: an exact frame), as ``attnqat quality`` caps it. A mean alone hides a VAE that breaks late in a clip: one
    trained on 17 frames averaged 18 dB at 33 frames while its frames 18-33 fell from 20 to 6 dB.
    """
    corpus = Corpus(seed, "held_out")
    frames, height, width = size
    specs = [corpus.spec(j) for j in range(clips)]
    video = corpus.render(specs, frames=frames, height=height, width=width, device=device)
    trip = vae_round_trip(vae, video, [s.attributes for s in specs])
    db = torch.tensor(trip["psnr"], dtype=torch.float64).clamp(max=PSNR_CAP_DB)  # (clips, frames)
    r = lambda values: [None if v is None else round(min(v, PSNR_CAP_DB), 2) for v in values]  # noqa: E731
    return {"frame_db": r(db.mean(0).tolist()), "worst_db": r(db.amin(0).tolist()),
            "object_db": r(trip["per_frame"]["psnr_object"]), "colour": r(trip["per_frame"]["colour_ok"]),
            "shape": r(trip["per_frame"]["shape_ok"]), "mean_db": round(db.mean().item(), 2)}


@torch.no_grad()
def reconstruction_detection(vae, *, clips: int = 16, size=(33, 256, 256), seed: int = 0, device="cuda") -> dict:
    """How well the detector (:func:`attnqat.mini.quality.detect`) reads colour, shape and motion off VAE
    round trips of held-out clips: a VAE that drops the objects scores ~0 here whatever its PSNR, and no transformer trained on its latents can show an object."""
    corpus = Corpus(seed, "held_out")
    frames, height, width = size
    detections, truths = [], []
    for i in range(0, clips, 4):
        specs = [corpus.spec(j) for j in range(i, min(clips, i + 4))]
        video = corpus.render(specs, frames=frames, height=height, width=width, device=device)
        recon = vae.decode(vae.encode(video).latent_dist.mode()).sample.float().clamp(-1, 1)
        detections += [detect(r) for r in recon]
        truths += [{"colour": s.colour, "shape": s.shape, "motion": s.motion} for s in specs]
    acc = score(detections, truths)
    return {k: acc[k] for k in ("colour", "shape", "motion", "all")}


# ---------------------------------------------------------------------------------------------------------------
# The stages


def stage_init(out: Path, vae_folder: str | None = None, from_folder: str | None = None,
               transformer_size: dict | None = None) -> None:
    from diffusers import AutoencoderKLWan, WanPipeline

    vae = None if vae_folder is None else AutoencoderKLWan.from_pretrained(vae_folder, torch_dtype=torch.float32)
    if from_folder is None:
        transformer = build_mini_transformer(size=transformer_size) if transformer_size else None
        save_pipeline_folder(build_mini_pipeline(transformer=transformer, vae=vae), out / "model",
                             vae_dtype=torch.float32, check_size=False)
        return
    card = read_card(Path(from_folder))
    if vae is None:
        vae = AutoencoderKLWan.from_pretrained(from_folder, subfolder="vae", torch_dtype=torch.float32)
    pipe = WanPipeline.from_pretrained(from_folder, vae=vae, torch_dtype=torch.float32)
    # the transformer as it was exported (bf16 values, held exactly in fp32); the text encoder stays in the
    # bf16 it was stored in by every build, so the prompt embeddings are the ones the weights learned from
    save_pipeline_folder(pipe, out / "model", transformer_dtype=torch.float32, vae_dtype=torch.float32,
                         check_size=False)
    write_file_atomically(out / CONTINUED, lambda tmp: tmp.write_text(json.dumps(card, indent=1)))
    if not (out / "timings.json").is_file():
        write_file_atomically(out / "timings.json", lambda tmp: tmp.write_text(json.dumps(card["timings"], indent=1)))
    print(f"init: warm start from {from_folder} ({card['transformer_steps']} transformer steps so far)")


def read_card(folder: Path) -> dict:
    """The ``attnqat_mini.json`` of an exported build (ValueError when there is none or it is not one)."""
    path = folder / "attnqat_mini.json"
    if not path.is_file():
        raise ValueError(f"--from {folder}: no attnqat_mini.json there; give a folder the export stage wrote")
    try:
        card = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"--from {folder}: attnqat_mini.json is not JSON ({e})") from None
    if not (isinstance(card, dict) and isinstance(card.get("transformer_steps"), int)
            and isinstance(card.get("timings"), list)):
        raise ValueError(f"--from {folder}: attnqat_mini.json lacks transformer_steps / timings")
    return card


def stage_vae(out: Path, args) -> None:
    from diffusers import AutoencoderKLWan

    folder = out / "model" / "vae"
    timings = out / "timings.json"
    if not args.vae_again and timings.is_file() and any(r["stage"] == "vae" for r in json.loads(timings.read_text())):
        print("vae: already trained, skipped (--vae-again trains it further)")
        return
    vae = AutoencoderKLWan.from_pretrained(folder, torch_dtype=torch.float32)
    t0 = time.perf_counter()
    decoder_only = args.vae_train == "decoder"
    if decoder_only and vae.config.latents_mean is None:
        raise ValueError(f"--vae-train decoder: {folder} has no latent statistics; train the whole VAE first")
    if args.vae_decoder_dim is not None:
        vae = with_new_decoder(vae, args.vae_decoder_dim)
    facts = train_vae(vae, seconds=args.vae_minutes * 60, steps=args.vae_steps, batch=args.vae_batch,
                      sizes=args.vae_sizes, lr=args.vae_lr, device=args.device, decoder_only=decoder_only)
    # CPU runs (tests, smoke runs) measure at a small size: the GPU's 64 clips of 33x128x128 take a minute there
    on_cpu = args.device == "cpu"
    if decoder_only:  # the encoder is unchanged: its statistics (and the latents a transformer learned) stay
        mean, std = vae.config.latents_mean, vae.config.latents_std
    else:
        mean, std = latent_statistics(vae, device=args.device, **({"clips": 8, "size": (9, 64, 64)} if on_cpu else {}))
    sizes = [(9, 64, 64)] if on_cpu else [(33, 128, 128), (49, 128, 128), (33, 256, 256), (49, 256, 256)]
    key = "{}x{}x{}".format
    per_frame = {key(*size): reconstruction_per_frame(vae, device=args.device, clips=args.eval_clips, size=size)
                 for size in sizes}
    seen = {key(*size): reconstruction_detection(vae, device=args.device, clips=args.eval_clips, size=size)
            for size in sizes}
    vae.register_to_config(latents_mean=mean, latents_std=std)
    replace_dir_atomically(folder, lambda tmp: vae.to("cpu").save_pretrained(tmp))
    print(f"vae: {facts['steps']} steps, L1 {facts['l1']:.4f}")
    for name, pf in per_frame.items():
        print(f"vae: {name} round trips: mean {pf['mean_db']:.2f} dB, worst frame {min(pf['frame_db']):.2f} dB "
              f"(frame {pf['frame_db'].index(min(pf['frame_db']))}), last frame {pf['frame_db'][-1]:.2f} dB, "
              f"objects worst {min(v for v in pf['object_db'] if v is not None):.2f} dB, colour read on "
              f"{min(pf['colour']):.0%}-{max(pf['colour']):.0%} of clips a frame")
    for name, acc in seen.items():
        print(f"vae: detector on {name} round trips: " + ", ".join(f"{k} {v:.0%}" for k, v in acc.items() if v is not None))
    _record(out, "vae", time.perf_counter() - t0, trained=args.vae_train,
            decoder_base_dim=vae.config.decoder_base_dim or vae.config.base_dim, steps=facts["steps"], clips=facts["clips"], l1=facts["l1"],
            psnr_db=per_frame[key(*sizes[0])]["mean_db"], per_frame=per_frame, detector=seen)


def transformer_config(out: Path, overrides: list[str]):
    # a warm start trains the weights in OUT/model instead of a seeded random initialisation
    warm = ["train.from_scratch=false"] if (out / CONTINUED).is_file() else []
    return load_config(CONFIG, [f"model={out / 'model'}", f"output_dir={out / 'run'}", *warm, *overrides])


def run_config(out: Path, overrides: list[str]):
    """The config the transformer stage trained with: the run's own record (it holds the --set overrides of
    the training call), else configs/mini.yaml with ``overrides``."""
    recorded = out / "run" / RUN_CONFIG
    return load_config(recorded) if recorded.is_file() else transformer_config(out, overrides)


def stage_transformer(out: Path, args) -> None:
    cfg = transformer_config(out, args.set)
    t0 = time.perf_counter()
    result = train(cfg, resume="auto", time_limit=args.minutes * 60)
    _record(out, "transformer", time.perf_counter() - t0, steps=result.steps,
            last_loss=result.losses[-1] if result.losses else None,
            held_out=result.gap_after)


def stage_export(out: Path, args) -> Path:
    from diffusers import AutoencoderKLWan, WanPipeline

    ckpt = latest_checkpoint(out / "run")
    if ckpt is None:
        raise FileNotFoundError(f"no transformer checkpoint in {out / 'run'}; run the transformer stage first")
    vae = AutoencoderKLWan.from_pretrained(out / "model", subfolder="vae", torch_dtype=torch.float32)
    pipe = WanPipeline.from_pretrained(out / "model", vae=vae, torch_dtype=torch.float32)
    load_qat_checkpoint(pipe.transformer, ckpt / "transformer.safetensors")
    limit = round(args.max_folder_mb * 1e6)
    target = save_pipeline_folder(pipe, out / "mini", max_folder_bytes=limit)
    state = json.loads((ckpt / "trainer_state.json").read_text())
    timings = json.loads((out / "timings.json").read_text()) if (out / "timings.json").is_file() else []
    before = json.loads((out / CONTINUED).read_text()) if (out / CONTINUED).is_file() else None
    # each run of the chain: its steps and checkpoint (a card from before warm starts lists none)
    runs = ((before.get("runs") or [{"steps": before["transformer_steps"], "checkpoint": before.get("checkpoint")}])
            if before else []) + [{"steps": state["step"], "checkpoint": ckpt.name, "warm_start": before is not None}]
    card = {"model": "attnqat mini (Wan 2.1 architecture)", "transformer_steps": sum(r["steps"] for r in runs),
            "runs": runs, "checkpoint": ckpt.name, "config": run_config(out, args.set).to_dict(),
            "gpu_seconds": {s: sum(r["seconds"] for r in timings if r["stage"] == s) for s in ("vae", "transformer")},
            "device": sorted({r["device"] for r in timings}), "timings": timings}
    (target / "attnqat_mini.json").write_text(json.dumps(card, indent=1))
    size = check_folder_size(target, limit)
    print(f"export: {target} ({size / 1e6:.1f} MB) from {ckpt} (step {state['step']}; "
          f"{card['transformer_steps']} transformer steps in all)")
    if args.ship:
        if MINI_DIR.exists() and not (MINI_DIR / "model_index.json").is_file():
            raise FileExistsError(f"{MINI_DIR} exists and is not a model folder; not replacing it")
        replace_dir_atomically(MINI_DIR, lambda tmp: shutil.copytree(target, tmp, dirs_exist_ok=True))
        print(f"shipped to {MINI_DIR}")
    return target


def _sizes(text: str) -> tuple:
    """``--vae-sizes`` "9x64x64,17x64x64" as ((9, 64, 64), (17, 64, 64)): 4k+1 frames (Wan's VAE), sides
    multiples of 16 (the transformer's 2x2 patches of 8x8-pixel latents), at least 32 (the corpus's smallest)."""
    try:
        sizes = tuple(tuple(int(v) for v in part.split("x")) for part in text.split(","))
        if any(len(size) != 3 for size in sizes):
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected FxHxW[,FxHxW...], e.g. 33x128x128") from None
    for size in sizes:
        if size[0] < 1 or (size[0] - 1) % 4 or any(v < 32 or v % 16 for v in size[1:]):
            raise argparse.ArgumentTypeError(f"{'x'.join(map(str, size))}: frames must be 4k+1 and sides multiples "
                                             f"of 16, at least 32")
    return sizes


def _transformer_size(text: str) -> dict:
    """``--transformer-size`` "heads=6,layers=10,ffn=1536" as {"heads": 6, "layers": 10, "ffn": 1536}."""
    size = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        if key.strip() not in TRANSFORMER_SIZE_KEYS or not value.strip().isdigit() or int(value) < 1:
            raise argparse.ArgumentTypeError(f"{part!r}: expected KEY=N with KEY one of "
                                             f"{', '.join(TRANSFORMER_SIZE_KEYS)} and N >= 1, e.g. heads=6,layers=10")
        size[key.strip()] = int(value)
    return size


HELP = "train the mini text-to-video model from scratch (stages: init, vae, transformer, export; resumable)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="working folder (model/, run/, mini/, timings.json)")
    p.add_argument("--stage", choices=("all",) + STAGES, default="all")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--vae-minutes", type=float, default=4.0, help="VAE training time (default 4)")
    p.add_argument("--vae", metavar="FOLDER", help="init: start from this trained AutoencoderKLWan folder (an earlier "
                   "build's OUT/model/vae) instead of an untrained one; copy that build's timings.json into --out "
                   "too so that the vae stage is skipped and its time counted")
    p.add_argument("--from", dest="from_folder", metavar="FOLDER",
                   help="init: warm start from an earlier build's exported folder (OUT/mini, with its "
                        "attnqat_mini.json): its transformer is the starting point, its steps and timings carry over")
    p.add_argument("--transformer-size", type=_transformer_size, metavar="heads=H,layers=L,ffn=F",
                   help="init: a transformer of other dimensions than mini's (4 heads of 64, 8 layers, ffn 1024), "
                        "e.g. heads=6,layers=10,ffn=1536 for a capacity sweep; its export may need --max-folder-mb")
    p.add_argument("--max-folder-mb", type=float, default=MAX_FOLDER_BYTES / 1e6,
                   help=f"export: the exported folder's size limit in MB (default {MAX_FOLDER_BYTES / 1e6:g}, the "
                        f"shipped model's; at most {MAX_LARGER_FOLDER_BYTES / 1e6:g} for a larger build)")
    p.add_argument("--vae-steps", type=int, help="stop VAE training after this many steps (tests)")
    p.add_argument("--vae-batch", type=float, default=8, help="clips of 17x128x128 a VAE step; larger clips come "
                   "fewer, so every step sees about as many pixels (default 8; a fraction makes smaller steps for "
                   "smoke runs, at least one clip: 0.02 is one 5x32x32 clip)")
    p.add_argument("--vae-sizes", type=_sizes, default=VAE_SIZES, metavar="FxHxW,...",
                   help="the clip sizes the VAE trains on, cycled (default: 57-frame clips, which train every shorter "
                        "length of the causal VAE too, and single frames, at 128x128 and 256x256)")
    p.add_argument("--vae-lr", type=float, default=1e-3, help="VAE peak learning rate (default 1e-3)")
    p.add_argument("--vae-train", choices=("all", "decoder"), default="all",
                   help="what the VAE stage trains: all of it, or the decoder only (the latents, and a transformer "
                        "trained on them, stay valid; needs a trained VAE, e.g. with --vae) (default all)")
    p.add_argument("--vae-decoder-dim", type=int, metavar="N",
                   help="with --vae-train decoder: replace the decoder by a new, untrained one N channels wide "
                        "(the VAE's base_dim is 24) and train it on the unchanged latents")
    p.add_argument("--vae-again", action="store_true", help="train the VAE further even if already trained")
    p.add_argument("--eval-clips", type=int, default=16, help="held-out clips for the VAE's PSNR")
    p.add_argument("--minutes", type=float, default=9.0, help="transformer training time of this call (default 9)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override configs/mini.yaml (e.g. --set train.max_steps=100)")
    p.add_argument("--ship", action="store_true", help="export: copy the folder into attnqat/models/mini")


def check_arguments(args: argparse.Namespace) -> None:
    """The checks no argument type makes, before anything is created (ValueError)."""
    for name in ("vae_minutes", "minutes"):
        v = getattr(args, name)
        if not (math.isfinite(v) and 0 < v <= 24 * 60):
            raise ValueError(f"--{name.replace('_', '-')} must be in (0, 1440], got {v}")
    if not (math.isfinite(args.vae_batch) and args.vae_batch > 0):
        raise ValueError(f"--vae-batch must be a number above 0, got {args.vae_batch}")
    if args.vae_decoder_dim is not None and not (args.vae_train == "decoder" and 8 <= args.vae_decoder_dim <= 256):
        raise ValueError("--vae-decoder-dim needs --vae-train decoder and a width from 8 to 256")
    if not (0 < args.max_folder_mb <= MAX_LARGER_FOLDER_BYTES / 1e6):
        raise ValueError(f"--max-folder-mb must be in (0, {MAX_LARGER_FOLDER_BYTES / 1e6:g}], got {args.max_folder_mb}")
    if args.transformer_size and args.from_folder is not None:
        raise ValueError("--transformer-size makes a new transformer; a warm start (--from) keeps its own")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file")
    if args.from_folder is not None:
        if (out / "model" / "model_index.json").is_file():
            raise ValueError(f"--from: {out / 'model'} exists already; a warm start begins in a new --out")
        read_card(Path(args.from_folder))
    if args.stage in ("all", "transformer"):  # a bad --set fails now, not after the VAE's minutes
        validate(transformer_config(out, args.set), transformer_config=_planned_transformer_config(out, args),
                 device_type=torch.device(args.device).type)


def _planned_transformer_config(out: Path, args: argparse.Namespace) -> dict:
    """The config of the transformer the transformer stage will train: the one in OUT/model, else the one init
    will write (a warm start's, or mini's with --transformer-size)."""
    for folder in [out / "model"] + ([Path(args.from_folder)] if args.from_folder else []):
        if (folder / "transformer" / "config.json").is_file():
            return json.loads((folder / "transformer" / "config.json").read_text())
    return mini_transformer_config(args.transformer_size)


def build(args: argparse.Namespace) -> int:
    """Run the stages ``args`` select (checked by :func:`check_arguments`)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stages = STAGES if args.stage == "all" else (args.stage,)
    if ("init" in stages or "vae" in stages) and not (out / "model" / "model_index.json").is_file():
        stage_init(out, args.vae, args.from_folder, args.transformer_size)
    if "vae" in stages:
        stage_vae(out, args)
    if "transformer" in stages:
        stage_transformer(out, args)
    if "export" in stages:
        stage_export(out, args)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m attnqat.train.mini``: ``attnqat build-mini`` (:mod:`attnqat.mini.build_cli`) for scripts that
    start a module; usage errors exit with status 2."""
    p = argparse.ArgumentParser(prog="python -m attnqat.train.mini", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        check_arguments(args)
    except (ValueError, FileNotFoundError) as e:
        p.error(str(e))
    return build(args)


if __name__ == "__main__":
    sys.exit(main())
