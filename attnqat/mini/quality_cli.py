"""Measure what each attention mode (and each fine-tune) costs a model: one table, one command.

  attnqat quality --out quality/                                  # the shipped mini, every mode, base weights
  attnqat quality --model ./my-wan-folder --variant qat=attn_qat:runs/qat --out q/
  attnqat quality --variant qat=attn_qat:runs/qat/final --variant qat_hp=attn_qat:runs/qat/final \\
                  --bf16-steps qat_hp=0,-1 --out q/                # a precision-schedule row

Rows ("variants"): the base weights in every inference mode (--base-modes; attn_qat and attn_qat_dropin
are left out: without grad their forward is nvfp4's), then each --variant LABEL=MODE[,KEY=VALUE...][:CHECKPOINT]
(KEY=VALUE: the mode's options, e.g. qat=attn_qat,qk_rotation=hadamard:runs/qat; weights trained with a Q/K
rotation run with it in an FP4 mode unless the row says qk_rotation=none). A CHECKPOINT is
transformer weights: a .safetensors state dict, a folder of shards, a diffusers model folder, or what
`attnqat train` writes: a run folder (OUTPUT: its final/, else its newest complete checkpoint), a checkpoint
folder (OUTPUT/checkpoints/step-N) or OUTPUT/final. Nothing is unpickled.

Columns, on the held-out attribute combinations of the procedural corpus (attnqat.mini.corpus) with fixed seeds
(docs/quality.md): the flow-matching loss on --clips held-out clips at fixed noise levels; the velocity
distance |v - v_bf16|^2 / |v_bf16|^2 to the base model in bf16; prompt following (colour, shape, motion,
direction: motion over the prompts naming one of the 8 directions, all three) read by attnqat.mini.quality.detect from --prompts generated videos; PSNR and SSIM of each video to
the bf16 video of the same seed (the bf16 row is the reference: "ref"); and the gap closed
(FP4 - X) / (FP4 - bf16) on the loss and on the accuracy, between --fp4-reference (default: the base weights
in nvfp4) and --bf16-reference (default: bf16).

Per frame too, so that a video that falls apart late cannot hide in a mean: the flow loss per latent frame,
PSNR / SSIM per frame, and the share of videos showing the asked object in the asked colour at each frame
(the presence statistic: the lower of that share over all frames and over the last 8).

Output: OUT/table.json (every number and per-frame curve, the prompts, the detections), OUT/table.md (the
table and the per-frame table, also printed),
OUT/grid.png (first, middle and last frame of a few prompts, one row per variant). Each file is written to
a temporary name and renamed. OUT must be new, empty, or an earlier `attnqat quality` output; --overwrite
writes the three files into any other folder (nothing else in it is touched). Every argument, checkpoint
header and the output folder are checked before the model loads.

Defaults depend on the device: on a GPU 32 prompts, 32 clips, 33x256x256, 25 steps; on a CPU 8 prompts,
8 clips, 33x128x128, 25 steps (the mini model's two training sizes).
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

from attnqat.checks import (LIMITS, check_device, check_float, check_int, check_limited, check_not_input,
                            check_output_dir, check_text, check_video_size, show)
from attnqat.locking import output_lock
from attnqat.outputs import write_dir_atomically, write_files_atomically
from attnqat.pipelines.generate import check_mode_runs
# DEFAULT_MODEL ("mini") is generate's default too; unlike generate, no fallback to tiny where mini's weights
# are not installed (a table of random weights would mean nothing): `quality` then stops with mini_folder()'s
# one-line error, which says how to build mini.
from attnqat.mini.model import DEFAULT_MODEL

# torch, diffusers and PIL are imported where they are used, so `attnqat quality --help` stays fast.

HELP = "measure each attention mode's (and fine-tune's) flow loss, prompt following and PSNR/SSIM to bf16"

GPU_DEFAULTS = dict(prompts=32, clips=32, size="33x256x256", steps=25)
CPU_DEFAULTS = dict(prompts=8, clips=8, size="33x128x128", steps=25)
MAX_PROMPTS = 4096  # the held-out split holds far more; beyond this a run takes days even on a GPU
MAX_BATCH = 256
LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,39}")
FORMAT = "attnqat-quality"
FILES = ("table.json", "table.md", "grid.png")


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("what to compare")
    g.add_argument("--model", default=DEFAULT_MODEL, help=f"'mini' (default: the shipped model), 'tiny' (RANDOM "
                   f"weights, for smoke runs) or a diffusers-format Wan 2.1 folder; its weights are the base weights")
    g.add_argument("--variant", action="append", default=[], metavar="LABEL=MODE[,KEY=VALUE...][:CHECKPOINT]",
                   help="a row: attention MODE with the weights of CHECKPOINT (default: the base weights); "
                        "repeatable; added after the --base-modes rows")
    g.add_argument("--base-modes", metavar="LIST", help="comma-separated modes run with the base weights, one row "
                   "each, labelled by the mode (default: every inference mode: bf16, nvfp4, sage3, sagebwd); "
                   "bf16 is always the first row (the reference)")
    g.add_argument("--bf16-steps", action="append", default=[], metavar="LABEL=STEPS",
                   help="a precision schedule: the row LABEL runs these denoising steps in bf16 attention (as "
                        "generate's --high-precision-steps: first:K, last:K and step indices, 0-based, negative from "
                        "the end, e.g. first:1,-1); its flow loss uses bf16 at the noise "
                        "levels those steps cover")
    g.add_argument("--fp4-reference", metavar="LABEL", help="the FP4 end of the gap closed (default: the first row "
                   "in nvfp4 / attn_qat / attn_qat_dropin on the base weights)")
    g.add_argument("--bf16-reference", metavar="LABEL", help="the bf16 end of the gap closed (default: bf16)")

    g = p.add_argument_group("evaluation set (held-out attribute combinations of the corpus)")
    g.add_argument("--prompts", type=int, help="generated videos per row (default: 32 on GPU, 8 on CPU)")
    g.add_argument("--clips", type=int, help="held-out clips of the flow loss (default: 32 on GPU, 8 on CPU)")
    g.add_argument("--size", metavar="FxHxW", help="frames x height x width of clips and videos (default: 33x256x256 "
                   "on GPU, 33x128x128 on CPU)")
    g.add_argument("--steps", type=int, help="denoising steps (default: 25)")
    g.add_argument("--guidance", type=float, default=5.0, help="classifier-free guidance scale (default: 5.0)")
    g.add_argument("--flow-shift", type=float, help="the sampler's (UniPC) flow-matching shift, > 0 (default: the "
                   "model's own scheduler setting; mini's is 3.0)")
    g.add_argument("--seed", type=int, default=0, help="seed of the flow-loss noise; video i uses seed + i "
                   "(default: 0)")
    g.add_argument("--corpus-seed", type=int, help="the corpus seed the model was trained on (default: the one in "
                   "the model's attnqat_mini.json, else 0)")
    g.add_argument("--batch", type=int, default=8, help="videos / clips per forward pass (default: 8)")

    g = p.add_argument_group("output and runtime")
    g.add_argument("--out", default="quality", help="output folder (default: ./quality): new, empty, or an earlier "
                   "`attnqat quality` output")
    g.add_argument("--overwrite", action="store_true", help="write table.json, table.md and grid.png into an --out "
                   "folder holding other things too (only those three names are replaced)")
    g.add_argument("--grid-prompts", type=int, default=4, help="prompts (columns) in grid.png (default: 4)")
    g.add_argument("--device", help="cuda, cuda:1, cpu (default: cuda if available, else cpu)")


# ------------------------------------------------------------------------------------------- arguments
def parse_size(text) -> tuple[int, int, int]:
    """``"33x256x256"`` -> (33, 256, 256), checked against Wan's size rules."""
    text = check_text("--size", text).strip().lower()
    m = re.fullmatch(r"(\d{1,6})x(\d{1,6})x(\d{1,6})", text)
    if not m:
        raise ValueError(f"--size {show(text)} must look like FRAMESxHEIGHTxWIDTH, e.g. 33x256x256")
    f, h, w = (int(x) for x in m.groups())
    check_video_size(h, w, f, prefix="--size ")
    return f, h, w


def _label(flag: str, text: str) -> str:
    if not LABEL.fullmatch(text):
        raise ValueError(f"{flag}: label {show(text)} must be 1-40 letters, digits or _.+- (starting with a letter "
                         f"or digit)")
    return text


def parse_variant(text) -> tuple[str, str, str | None, dict]:
    """``"LABEL=MODE[,KEY=VALUE...][:CHECKPOINT]"`` -> (label, mode, checkpoint or None, {KEY: VALUE}); the mode
    and its options are checked (VALUE true / false is a bool, anything else a string), the checkpoint's files
    (headers only) too."""
    from attnqat.kernels import mode_of
    from attnqat.pipelines.loading import check_qat_checkpoint

    text = check_text("--variant", text)
    if "=" not in text:
        raise ValueError(f"--variant {show(text)} must look like LABEL=MODE or LABEL=MODE:CHECKPOINT, e.g. "
                         f"qat=attn_qat:runs/qat")
    label, rest = text.split("=", 1)
    label = _label("--variant", label.strip())
    mode, colon, checkpoint = rest.partition(":")
    mode, *pairs = (x.strip() for x in mode.split(","))
    record = mode_of(mode, f"--variant {label}'s mode")
    options = {}
    for pair in pairs:
        key, eq, value = (x.strip() for x in pair.partition("="))
        if not eq or not key or not value or key in options:
            raise ValueError(f"--variant {label}: option {show(pair)} must be KEY=VALUE, each key once, e.g. "
                             f"qat=attn_qat,qk_rotation=hadamard:runs/qat")
        options[key] = {"true": True, "false": False}.get(value.lower(), value)
    try:
        record.check_options(options)
    except ValueError as e:
        raise ValueError(f"--variant {label}: {e}") from None
    if colon and not checkpoint.strip():
        raise ValueError(f"--variant {label}: empty CHECKPOINT after ':' (leave out ':' for the base weights)")
    if checkpoint:
        check_qat_checkpoint(checkpoint, flag=f"--variant {label}")
    return label, mode, checkpoint or None, options


def parse_schedule(text, steps: int):
    """``LABEL=first:1,last:1`` / ``LABEL=0,1,-1``'s schedule (:class:`attnqat.pipelines.PrecisionSchedule`'s
    text form, as ``attnqat generate --high-precision-steps`` takes it), checked against ``steps``."""
    from attnqat.pipelines.schedule import PrecisionSchedule

    schedule = PrecisionSchedule.parse(text, flags=("--bf16-steps", "--bf16-steps", "--bf16-steps"))
    if schedule.empty:
        raise ValueError(f"--bf16-steps {show(text)} names no step")
    schedule = schedule.for_steps(steps, "--bf16-steps")  # resolved once: the evaluation reads it as it is
    if len(schedule.high_steps) == steps:
        raise ValueError(f"--bf16-steps {show(text)} names every one of the {steps} steps: that row is the bf16 row")
    return schedule


def resolve_settings(args: argparse.Namespace) -> argparse.Namespace:
    """Check every argument, the checkpoints' files and the output folder, before anything heavy loads;
    fill the device-dependent defaults. Sets ``args.rows`` to [(label, mode, checkpoint, bf16_steps, options)]."""
    from attnqat.kernels import mode_of
    from attnqat.pipelines.loading import check_model, model_inputs, trained_mode_options

    from .evaluation import base_variants

    check_model(args.model)
    device = check_device("--device", args.device)
    args.device = str(device)
    defaults = GPU_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.size = parse_size(args.size) if isinstance(args.size, str) else args.size
    check_int("--prompts", args.prompts, 1, MAX_PROMPTS, "a run that long is a typo")
    check_int("--clips", args.clips, 1, MAX_PROMPTS, "a run that long is a typo")
    check_limited("--steps", args.steps, "steps")
    check_float("--guidance", args.guidance, lo=0.0, hi=100.0)
    if args.flow_shift is not None:  # None: the model's own scheduler setting
        check_float("--flow-shift", args.flow_shift, lo=0.0, lo_open=True)
    check_int("--seed", args.seed, 0, *LIMITS["seed"])
    if args.corpus_seed is not None:
        check_int("--corpus-seed", args.corpus_seed, 0, 2 ** 32 - 1, "the corpus seed is 32-bit")
    check_int("--batch", args.batch, 1, MAX_BATCH, "memory")
    check_int("--grid-prompts", args.grid_prompts, 1, 16, "a wider picture is unreadable")

    base = None
    if args.base_modes is not None:
        base = [m.strip() for m in check_text("--base-modes", args.base_modes).split(",") if m.strip()]
        for m in base:
            mode_of(m, "--base-modes entry")
    rows = [(v.label, v.mode, None, {}) for v in base_variants(base)]
    for text in args.variant:
        label, mode, checkpoint, options = parse_variant(text)
        options = {**trained_mode_options(mode, checkpoint), **options}  # as trained, unless the row says otherwise
        if label in [r[0] for r in rows]:
            raise ValueError(f"--variant {label}: the label is taken (base rows are labelled by their mode; "
                             f"choose another label or leave that mode out of --base-modes)")
        rows.append((label, mode, checkpoint, options))
    labels = [r[0] for r in rows]
    schedules: dict = {}
    for text in args.bf16_steps:
        text = check_text("--bf16-steps", text)
        if "=" not in text:
            raise ValueError(f"--bf16-steps {show(text)} must look like LABEL=STEPS, e.g. qat=0,-1")
        label, steps = (x.strip() for x in text.split("=", 1))
        if label not in labels:
            raise ValueError(f"--bf16-steps: no row labelled {show(label)} (rows: {', '.join(labels)})")
        if label == labels[0]:
            raise ValueError("--bf16-steps: the bf16 reference row runs every step in bf16 already; give the "
                             "schedule to a --variant row")
        if label in schedules:
            raise ValueError(f"--bf16-steps: row {label} is given twice")
        schedules[label] = parse_schedule(steps, args.steps)
    args.rows = [(label, mode, ckpt, schedules.get(label, ()), options) for label, mode, ckpt, options in rows]
    for flag in ("fp4_reference", "bf16_reference"):
        value = getattr(args, flag)
        if value is not None and value not in labels:
            raise ValueError(f"--{flag.replace('_', '-')} {show(value)} is not a row label (rows: {', '.join(labels)})")
    args.out = check_output_dir("--out", args.out, must_be_empty=not args.overwrite, reusable=is_our_output)
    check_not_input("--out", args.out, [(f"--variant {label}", ckpt) for label, _, ckpt, _, _ in args.rows]
                    + model_inputs("--model", args.model))
    return args


def is_our_output(folder: Path) -> bool:
    """``folder`` holds an earlier `attnqat quality` output and nothing else (so it may be rewritten)."""
    try:
        names = {p.name for p in Path(folder).iterdir()}
        table = json.loads((Path(folder) / "table.json").read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(table, dict) and table.get("format") == FORMAT and names <= set(FILES)


def _corpus_seed(model: str) -> int:
    """The corpus seed in the model folder's attnqat_mini.json (the mini build's record), else 0."""
    from attnqat.pipelines.loading import is_tiny, resolve_model

    if is_tiny(model):
        return 0
    try:
        card = json.loads((Path(resolve_model(model)).expanduser() / "attnqat_mini.json").read_text())
        seed = card["config"]["data"]["corpus"]["seed"]
    except (OSError, ValueError, KeyError, TypeError):
        return 0
    return seed if isinstance(seed, int) and seed >= 0 else 0


# ---------------------------------------------------------------------------------------------- outputs
def _finite_or_none(x):
    """JSON-safe: non-finite floats and numpy scalars made plain (None for NaN / inf)."""
    if isinstance(x, dict):
        return {str(k): _finite_or_none(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite_or_none(v) for v in x]
    if hasattr(x, "item") and not isinstance(x, (str, bytes)):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def _fmt(x, spec: str, none: str = "—") -> str:
    if x is None:
        return none
    text = format(x, spec)
    return text[1:] if text.startswith("-") and float(text) == 0 else text  # no "-0.00"


def _short_path(text: str, parts: int = 3) -> str:
    """The last ``parts`` components of a path (a table cell stays narrow)."""
    p = Path(text)
    return str(Path(*p.parts[-parts:])) if len(p.parts) > parts else text


def format_table(result: dict) -> str:
    """The markdown table of an :func:`attnqat.mini.evaluation.evaluate` result (as table.json holds it)."""
    refs = result["references"]
    head = ("| row | attention | weights | flow loss | velocity dist. | colour | shape | motion | direction | all "
            "| PSNR (dB) | SSIM | gap closed (loss) | gap closed (velocity) | gap closed (acc.) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    by_label = {v["label"]: v for v in result["variants"]}
    for label in result["order"]:
        row, v = result["rows"][label], by_label[label]
        hp = v["high_precision"]
        attention = ", ".join([v["mode"]] + [f"{k}={o}" for k, o in (v.get("options") or {}).items()])
        attention += f" ({hp['mode']} steps {hp['steps']})" if hp else ""
        weights = "base" if v["weights"] is None else f"`{_short_path(v['weights'])}`"
        ref = label == refs["video"]
        marks = [m for m, key in (("bf16 ref.", "bf16"), ("FP4 ref.", "fp4")) if refs.get(key) == label]
        name = f"**{label}**" + (f" ({', '.join(marks)})" if marks else "")
        if row.get("nonfinite_videos"):
            name += f" ⚠ {row['nonfinite_videos']} non-finite videos"
        pct = lambda x: _fmt(None if x is None else 100 * x, ".0f") + ("%" if x is not None else "")  # noqa: E731
        lines.append("| " + " | ".join([
            name, attention, weights, _fmt(row.get("flow_loss"), ".4f"), _fmt(row.get("velocity_distance"), ".3g"),
            pct(row.get("acc_colour")), pct(row.get("acc_shape")), pct(row.get("acc_motion")),
            pct(row.get("acc_direction")), pct(row.get("acc_all")),
            "ref" if ref else _fmt(row.get("psnr"), ".1f"), "ref" if ref else _fmt(row.get("ssim"), ".3f"),
            _fmt(row.get("gap_closed_loss"), ".2f"), _fmt(row.get("gap_closed_velocity"), ".2f"),
            _fmt(row.get("gap_closed_acc"), ".2f")]) + " |")
    f, h, w = result["size"]
    notes = [f"Model `{result['model']}`; {len(result['prompts'])} held-out prompts and {result['clips']} held-out "
             f"clips at {f}x{h}x{w}; {result['steps']} steps, guidance {result['guidance']:g}"
             + (f", flow shift {result['flow_shift']:g}" if result.get("flow_shift") is not None else "")
             + f", seed {result['seed']}, "
             f"corpus seed {result['corpus_seed']}; {result['device']}.",
             f"Flow loss at sigmas {', '.join(f'{s:g}' for s in result['sigmas'])}; PSNR per frame capped at "
             f"{result['psnr_cap_db']:g} dB (identical frames)."]
    if refs.get("fp4") is None:
        notes.append("No FP4 reference row (nvfp4 on the base weights): no gap closed.")
    return "\n".join(lines) + "\n\n" + "\n".join(notes) + "\n\n" + format_frames(result)


def format_frames(result: dict) -> str:
    """The per-frame table of an :func:`attnqat.mini.evaluation.evaluate` result: each row's flow loss per latent
    frame, PSNR to the bf16 videos per frame and the asked object's presence per frame, as first / middle /
    end / worst, so that a collapse late in the clip shows even where the means above hide it."""
    from attnqat.mini.quality import LAST_FRAMES, curve_summary

    refs = result["references"]
    f = result["size"][0]
    last = min(LAST_FRAMES, f)
    head = (f"| row | flow loss per latent frame: first / middle / last | worst (latent frame) | PSNR (dB) per frame: "
            f"first / middle / last {last} | worst (frame) | asked object in its colour: all frames / last {last} "
            f"| worst (frame) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for label in result["order"]:
        row = result["rows"][label]
        cells = [f"**{label}**"]
        loss = row.get("flow_loss_frames")
        if loss:
            c = curve_summary(loss, higher_is_better=False)
            cells += [f"{c['first']:.4f} / {c['middle']:.4f} / {c['last']:.4f}", f"{c['worst']:.4f} ({c['worst_frame']})"]
        else:
            cells += ["—", "—"]
        if label == refs["video"]:
            cells += ["ref", "ref"]
        elif row.get("psnr_frames"):
            c = curve_summary(row["psnr_frames"], last=last)
            cells += [f"{c['first']:.1f} / {c['middle']:.1f} / {c['last_mean']:.1f}", f"{c['worst']:.1f} ({c['worst_frame']})"]
        else:
            cells += ["—", "—"]
        p = row.get("presence")
        if p:
            cells += [f"{100 * p['frames']:.0f}% / {100 * p['last']:.0f}%",
                      f"{100 * p['per_frame'][p['worst_frame']]:.0f}% ({p['worst_frame']})"]
        else:
            cells += ["—", "—"]
        lines.append("| " + " | ".join(cells) + " |")
    latent = len(result["rows"][result["order"][0]].get("flow_loss_frames") or ())
    note = (f"Frames counted from 0: {latent} latent frames (the VAE folds 4 video frames into one, the first "
            f"alone), {f} video frames. PSNR: the mean over the videos of each frame's PSNR to the bf16 video; "
            f"\"last {last}\": the mean of the last {last} frames. Asked object: the fraction of the videos in which "
            f"attnqat.mini.quality.detect_frames finds the object with the colour the prompt asked for, over all "
            f"frames and over the last {last}; the lower of the two is the presence statistic (table.json: "
            f"rows.*.presence.present).")
    return "\n".join(lines) + "\n\n" + note + "\n"


def frame_grid(result: dict, videos: dict, *, prompts: int = 4, frames: int = 3):
    """A PIL image: one row per variant, ``prompts`` columns of ``frames`` frames each (first, middle, last),
    the row labels on the left and the prompts on top."""
    import numpy as np
    from PIL import Image, ImageDraw, ImageFont

    order = result["order"]
    n_prompts = min(prompts, len(result["prompts"]))
    first = videos[order[0]]
    n_frames, h, w = first.shape[1:4]
    picks = sorted({round(i * (n_frames - 1) / max(frames - 1, 1)) for i in range(frames)})
    scale = max(1, math.ceil(96 / max(h, w)))
    ch, cw = h * scale, w * scale
    gap, label_w, head_h, pad, det_h = 2, 130, 44, 8, 14
    col_w = len(picks) * (cw + gap) + pad
    row_h = ch + det_h + gap
    img = Image.new("RGB", (label_w + n_prompts * col_w, head_h + len(order) * row_h), "white")
    draw = ImageDraw.Draw(img)
    font = ImageFont.load_default(size=11)
    for j in range(n_prompts):
        x0 = label_w + j * col_w
        words, lines, line = result["prompts"][j].split(), [], ""
        for word in words:  # wrap the caption to the column's width
            trial = (line + " " + word).strip()
            if draw.textlength(trial, font=font) > col_w - pad and line:
                lines.append(line)
                line = word
            else:
                line = trial
        lines.append(line)
        draw.multiline_text((x0, 2), "\n".join(lines[:3]), fill="black", font=font, spacing=1)
    for i, label in enumerate(order):
        y0 = head_h + i * row_h
        row = result["rows"][label]
        text = label + ("\n" + f"{row['acc_all'] * 100:.0f}% right" if row.get("acc_all") is not None else "")
        draw.multiline_text((4, y0 + 4), text, fill="black", font=font, spacing=2)
        for j in range(n_prompts):
            for k, f in enumerate(picks):
                frame = np.asarray(videos[label][j][f])
                tile = Image.fromarray(frame).resize((cw, ch), Image.NEAREST)
                img.paste(tile, (label_w + j * col_w + k * (cw + gap), y0))
            # What the detector read off this video: green where it matches the prompt, red where not.
            det, truth = result["detections"][label][j], result["truth"][j]
            x = label_w + j * col_w
            for key in ("colour", "shape", "motion"):
                word = str(det.get(key) or "?")
                colour = (0, 128, 0) if det.get(key) == truth.get(key) else (200, 0, 0)
                draw.text((x, y0 + ch + 1), word, fill=colour, font=font)
                x += draw.textlength(word + " ", font=font)
    return img


def write_outputs(out: Path, result: dict, videos: dict, grid_prompts: int) -> list[Path]:
    """table.json, table.md and grid.png into ``out`` as one set: a new folder is filled under a temporary name
    and renamed; in an existing folder the three are written under a temporary folder in it and renamed over
    the old three only once all are written (:func:`attnqat.outputs.write_files_atomically`)."""
    table = json.dumps(_finite_or_none(result), indent=1, allow_nan=False)
    markdown = format_table(result)
    grid = frame_grid(result, videos, prompts=grid_prompts)
    writers = {"table.json": lambda p: p.write_text(table), "table.md": lambda p: p.write_text(markdown),
               "grid.png": lambda p: grid.save(p, format="PNG")}
    fresh = not out.exists() or not any(out.iterdir())
    if fresh:
        def write_all(tmp: Path) -> None:
            for name, write in writers.items():
                write(tmp / name)
        write_dir_atomically(out, write_all)
    else:
        write_files_atomically(out, writers)
    return [out / name for name in FILES]


# ------------------------------------------------------------------------------------------------- main
def load_variants(rows, transformer) -> tuple[list, dict]:
    """:class:`attnqat.mini.evaluation.Variant` rows with their checkpoints read (and checked against the model;
    a checkpoint named twice is read once), and {label: the file or folder its weights were read from}."""
    from attnqat.pipelines.loading import checkpoint_weights_path, read_qat_checkpoint

    from .evaluation import Variant

    cache: dict[str, dict] = {}
    out, files = [], {}
    for label, mode, ckpt, schedule, options in rows:
        weights = None
        if ckpt is not None:
            files[label] = checkpoint_weights_path(ckpt)
            if files[label] not in cache:
                cache[files[label]] = read_qat_checkpoint(transformer, ckpt)
            weights = cache[files[label]]
        out.append(Variant(label, mode, weights, options=options, high_precision_steps=schedule, source=ckpt))
    return out, files


def main(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    args = resolve_settings(args)
    with output_lock(args.out, "attnqat quality"):  # one run writes OUT at a time
        return _measure(args, t_start)


def _measure(args: argparse.Namespace, t_start: float) -> int:
    import torch
    from tqdm.auto import tqdm

    from attnqat.pipelines.loading import is_tiny, load_pipeline

    from .evaluation import evaluate, work_units

    def log(msg: str) -> None:
        tqdm.write(msg, file=sys.stderr)

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the FP4 kernels take bf16 on a GPU
    corpus_seed = args.corpus_seed if args.corpus_seed is not None else _corpus_seed(args.model)
    if is_tiny(args.model):
        from attnqat.pipelines.tiny import TINY_NOTICE

        log(f"NOTE: {TINY_NOTICE}; its numbers only check the command.")
    pipe = load_pipeline(args.model, dtype=dtype, device=device, flow_shift=args.flow_shift)
    # The text encoder in fp32 (when it is small), as `attnqat train` encodes the corpus's captions; the
    # pipeline casts the embeddings to the transformer's dtype.
    if sum(p.numel() for p in pipe.text_encoder.parameters()) < 10 ** 9:
        pipe.text_encoder.to(torch.float32)
    pipe.set_progress_bar_config(disable=True)
    head_dim = pipe.transformer.config.attention_head_dim
    for mode in dict.fromkeys(r[1] for r in args.rows):
        check_mode_runs(mode, head_dim, device, dtype)
    variants, weight_files = load_variants(args.rows, pipe.transformer)

    with tqdm(total=work_units(len(variants), args.prompts, args.batch), desc="attnqat quality", file=sys.stderr,
              dynamic_ncols=True) as bar:
        result = evaluate(pipe, variants, prompts=args.prompts, clips=args.clips, size=args.size, steps=args.steps,
                          guidance=args.guidance, seed=args.seed, batch=args.batch, corpus_seed=corpus_seed,
                          fp4_reference=args.fp4_reference, bf16_reference=args.bf16_reference, keep_videos=True,
                          log=log, progress=bar)
    videos = result.pop("videos")
    result = {"format": FORMAT, "version": 1, "model": args.model, "device": _device_name(device),
              # the sampler's shift as it ran (None for a scheduler without one, e.g. a model's flow-matching Euler)
              "flow_shift": pipe.scheduler.config.get("flow_shift"),
              "seconds": round(time.perf_counter() - t_start, 1), "weight_files": weight_files, **result}
    files = write_outputs(args.out, result, videos, args.grid_prompts)
    print(format_table(result))
    log(f"wrote {', '.join(str(f) for f in files)}")
    return 0


def _device_name(device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "CPU"
