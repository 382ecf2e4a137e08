"""Generate a video with Wan 2.1 text-to-video, its self-attention in an attnqat mode.

  attnqat generate --prompt "a blue square moves up over a checkered background" --out square.mp4
  attnqat generate --prompt "a red ball slides left over a striped background" --mode attn_qat --out ball.mp4
  attnqat generate --prompt "a corgi surfing a wave" --mode attn_qat --high-precision-steps first:2,last:1 \\
      --model ./Wan2.1-T2V-1.3B-Diffusers

The default --model mini is attnqat's own small Wan 2.1-architecture model, shipped in the package
(attnqat/models/mini) and loaded with WanPipeline.from_pretrained like real Wan weights; it was trained
on the procedural corpus, so it draws coloured shapes moving over simple backgrounds, offline, on a CPU
(33 frames of 128x128 in 20 steps). An installation without mini's weights (a checkout from before they
were committed) runs --model tiny instead and says so in one line. tiny is built in code with RANDOM
weights (its video is noise-like): it checks the whole pipeline in seconds, for tests. With --mode
attn_qat, mini runs on the QAT fine-tune shipped beside it (attnqat/models/mini/attn_qat.safetensors, where
installed; --qat-checkpoint none for the base weights), and the summary's 'weights' line says which. For Wan 2.1
itself pass a diffusers-format Wan 2.1 T2V folder, e.g. one made by
  huggingface-cli download Wan-AI/Wan2.1-T2V-1.3B-Diffusers --local-dir ./Wan2.1-T2V-1.3B-Diffusers

Sizes: height and width must be multiples of 16 and --frames of the form 4k+1 (1, 5, ..., 81);
other values are refused with the nearest valid ones (nothing is rounded silently). Upper limits
(typo guards, each with its reason in the message): height and width 4096, frames 1025, steps 1000,
fps 240. Every argument and both output paths are checked before any model loads.

Several processes (GPUs) share one video with --parallel ulysses|ring under a distributed launch:
  torchrun --nproc-per-node 2 -m attnqat generate --parallel ulysses --prompt "a corgi surfing a wave" ...
Every process runs the pipeline with the same seed; its transformer works on its share of the video's
tokens (diffusers' context parallelism); rank 0 alone decodes with the VAE, writes the outputs and
prints the summary.

Outputs are never left half-written: the video goes to a temporary file beside --out and replaces
it only once it reads back with every frame; --frames-dir is filled under a temporary name and
renamed into place. NaN or inf in the latents stops the run at that step, and nothing is written.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from attnqat.checks import (TIME_STRIDE, VAE_SPATIAL_STRIDE, LIMITS, check_device, check_float, check_int,
                            check_limited, check_not_input, check_output_dir, check_output_file, check_text, check_video_size,
                            show)
from attnqat.errors import NonFiniteOutputError, OutputWriteError
from attnqat.outputs import write_dir_atomically, write_file_atomically
from attnqat.trained_options import SWITCHED, flag

from .launch import LAUNCH_HINT, launch_from_env, process_group, rank_device, shared_check
# DEFAULT_MODEL ("mini") and default_model(): the switch of the --model default, in one place (attnqat/mini/model.py).
from attnqat.mini.model import (DEFAULT_MODEL, FALLBACK_MODEL, MINI_MISSING_NOTE, MINI_QAT_WEIGHTS, default_model,
                                is_mini, vocabulary_note)

# torch and diffusers are imported where they are used, so `attnqat generate --help` stays fast.

HELP = "generate a video with Wan 2.1 text-to-video (attention in an attnqat mode)"

# Per-model defaults for options left unset: the tiny model's are small so the CPU run takes seconds;
# mini's are its two training sizes (33x128x128 on a CPU: well under a minute on 2 cores; 33x256x256 on a
# GPU), its flow shift the one in its scheduler config (None: the model's own); the real model's are Wan
# 2.1's 480p settings (flow shift 3.0 at 480p, 5.0 at 720p). Guidance 5.0 is WanPipeline's own default.
TINY_DEFAULTS = dict(height=64, width=64, frames=9, steps=8, guidance=5.0, flow_shift=3.0)
MINI_DEFAULTS = {"cpu": dict(height=128, width=128, frames=33, steps=20, guidance=5.0, flow_shift=None),
                 "cuda": dict(height=256, width=256, frames=33, steps=25, guidance=5.0, flow_shift=None)}
REAL_DEFAULTS = dict(height=480, width=832, frames=81, steps=50, guidance=5.0, flow_shift=3.0)
FPS = 16  # Wan 2.1 generates 16 frames per second
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # --dtype -> torch attribute
MP4_SUFFIXES = (".mp4", ".m4v", ".mov", ".mkv")  # containers ffmpeg writes H.264 into
DEFAULT_OUT = "video.mp4"
#: the FP4 attention options switched auto / on / off, each its flag and option name (auto: as the weights were trained)
SWITCHED_OPTIONS = tuple((flag(option), option) for option in SWITCHED)
PARALLEL_LAYOUTS = ("ulysses", "ring")  # --parallel: diffusers' ContextParallelConfig ulysses_degree / ring_degree


def is_mini_model(model: str) -> bool:
    """``mini``, or a folder of a mini build (``attnqat_mini.json``, the build's record, beside its
    model_index.json: e.g. ``runs/mini/mini`` or ``attnqat/models/mini`` given as a path)."""
    if is_mini(model):
        return True
    try:
        return (Path(model).expanduser() / "attnqat_mini.json").is_file()
    except (OSError, ValueError):  # a name no path can have
        return False


def model_defaults(model: str, device=None) -> dict:
    """The defaults of ``model`` for the generation settings left unset (height, width, frames,
    steps, guidance, flow_shift; flow_shift None: the model's own scheduler setting): the one place
    that maps a model to them (generate and the demo). mini's depend on ``device`` (a torch device or
    its name; None: cuda if available, else cpu)."""
    from .loading import is_tiny

    if is_tiny(model):
        return dict(TINY_DEFAULTS)
    if is_mini_model(model):
        if device is None:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        return dict(MINI_DEFAULTS["cuda" if str(device).startswith("cuda") else "cpu"])
    return dict(REAL_DEFAULTS)


def torch_dtype(name: str):
    """``"bf16"`` / ``"fp16"`` / ``"fp32"`` -> the torch dtype."""
    import torch

    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype {show(name)} not in {sorted(DTYPE_NAMES)}")
    return getattr(torch, DTYPE_NAMES[name])


def add_arguments(p: argparse.ArgumentParser) -> None:
    side, frames, steps, fps = (LIMITS[k][0] for k in ("side", "frames", "steps", "fps"))
    g = p.add_argument_group("what to generate")
    g.add_argument("--prompt", required=True, help="text prompt")
    g.add_argument("--negative-prompt", default="", help="negative prompt for classifier-free guidance (default: empty)")
    g.add_argument("--height", type=int, help=f"video height in pixels, a multiple of 16 up to {side} "
                   "(default: mini 128 on CPU, 256 on GPU; tiny 64; a Wan 2.1 folder 480)")
    g.add_argument("--width", type=int, help=f"video width in pixels, a multiple of 16 up to {side} "
                   "(default: mini 128 on CPU, 256 on GPU; tiny 64; a Wan 2.1 folder 832)")
    g.add_argument("--frames", type=int, help=f"number of frames, 4k+1 up to {frames} (default: mini 33; tiny 9; "
                   "a Wan 2.1 folder 81); other values are refused with the nearest valid ones")
    g.add_argument("--steps", type=int, help=f"denoising steps, 1 to {steps} (default: mini 20 on CPU, 25 on GPU; "
                   "tiny 8; a Wan 2.1 folder 50)")
    g.add_argument("--guidance", type=float, help="classifier-free guidance scale, >= 0 (default: 5.0; <= 1 "
                   "disables the unconditional pass)")
    g.add_argument("--flow-shift", type=float, help="UniPC flow-matching shift, > 0 (default: mini's own, 3.0, "
                   "from its scheduler config; 3.0 otherwise, Wan 2.1's 480p value; 5.0 for 720p)")
    g.add_argument("--seed", type=int, default=0, help="random seed of the initial noise, 0 to 2^63-1 (default: 0)")

    g = p.add_argument_group("model and attention")
    g.add_argument("--model", help=f"'{DEFAULT_MODEL}' (the default: attnqat's own small Wan 2.1-architecture "
                   "model, shipped in the package, offline; it draws coloured shapes moving over simple backgrounds; "
                   f"an installation without its weights uses '{FALLBACK_MODEL}' instead, with a note), 'tiny' "
                   "(offline, RANDOM weights, for tests), a local diffusers-format Wan 2.1 T2V folder, or a hub id "
                   "such as Wan-AI/Wan2.1-T2V-1.3B-Diffusers (used from the cache, downloaded only if the network "
                   "allows)")
    g.add_argument("--mode", default="bf16", help="attention mode for the patched layers (default: bf16); "
                   "one of attnqat.available_modes(), e.g. attn_qat, nvfp4, sage3")
    g.add_argument("--qk-rotation", default="auto", metavar="{auto,none,hadamard}", help="rotate Q and K by a "
                   "Hadamard matrix before FP4 attention (modes nvfp4, attn_qat, attn_qat_dropin): exact in high "
                   "precision, it lowers FP4's error by about a third on mini with no training (docs/quality.md); "
                   "auto (default): as the loaded QAT weights were trained (what their file or training config "
                   "records), else none")
    g.add_argument("--k-smoothing", default="auto", metavar="{auto,on,off}", help="subtract K's mean over the "
                   "sequence before FP4 attention (the same modes): exact in high precision, it lowers FP4's error by "
                   "about a quarter on mini with no training, and adds about ten points to the rotation's "
                   "(docs/quality.md); auto (default): as the loaded QAT weights were trained, else off")
    g.add_argument("--q-smoothing", default="auto", metavar="{auto,on,off}", help="quantize Q minus its mean over "
                   "each block of 128 queries and add the mean's logits back unquantized, inside the kernels (the "
                   "same modes): exact in high precision (docs/kernels.md); auto (default): as the loaded QAT "
                   "weights were trained, else off")
    g.add_argument("--four-over-six", default="auto", metavar="{auto,on,off}", help="scale each block of 16 of "
                   "Q, K and V so that its largest magnitude maps to FP4's 6 or to 4, whichever quantizes it better "
                   "(Four Over Six; the same modes): 5 to 10 more points of FP4's loss gap closed on mini with no "
                   "training (docs/kernels.md); auto (default): as the loaded QAT weights' file or training config "
                   "records, else off")
    g.add_argument("--layers", default="self", help="which attention layers use --mode: 'self' (default: attn1 "
                   "of every block, the paper's setting), 'all' (attn1 and cross-attention attn2), or comma-"
                   "separated block indices (their attn1)")
    g.add_argument("--high-precision-steps", metavar="SPEC", help="denoising steps whose patched attention runs "
                   "in --high-precision-mode instead of --mode: comma-separated first:K (the first K steps), "
                   "last:K (the last K) or step indices (0-based; negative from the end), e.g. first:2,last:1 "
                   "or 0,1,-1; a list that starts with a negative index needs '=': --high-precision-steps=-1,0 "
                   "(default: none)")
    g.add_argument("--high-precision-blocks", metavar="LIST", help="transformer blocks whose patched attention "
                   "runs in --high-precision-mode at every step: comma-separated indices (negative from the end), "
                   "e.g. 0,-1 (--high-precision-blocks=-1,0 with '='); they must be among --layers (default: none)")
    g.add_argument("--high-precision-mode", metavar="MODE", help="the mode of those steps and blocks: bf16 "
                   "(default) or sagebwd; needs --high-precision-steps or --high-precision-blocks")
    g.add_argument("--qat-checkpoint", metavar="PATH", help="transformer weights to load (a .safetensors file or "
                   "a folder of them, e.g. from attnqat's QAT fine-tuning, QAT weights from `attnqat export-qat`, or a "
                   "LoRA file, fused into the weights); "
                   "must match --model's architecture. Default: with --mode attn_qat on mini, the QAT fine-tune "
                   f"shipped with it ({MINI_QAT_WEIGHTS}, where installed), else the base weights; 'none': the base "
                   "weights. The summary's 'weights' line says which ran")

    g = p.add_argument_group("output (checked before anything loads; written to a temporary name, then renamed)")
    g.add_argument("--out", help="output video path ending in .mp4 (or .m4v, .mov, .mkv); an existing file is "
                   "replaced only once the new video is written and reads back (default: video.mp4, unless "
                   "--frames-dir alone is given)")
    g.add_argument("--frames-dir", metavar="DIR", help="write every frame as DIR/frame_0000.png ...; DIR must be new "
                   "or empty (nothing in it is overwritten). Without --out, the frames are the only output (no video: "
                   "imageio-ffmpeg is not needed)")
    g.add_argument("--fps", type=int, default=FPS, help=f"frames per second of the video, 1 to {fps} (default: {FPS})")

    g = p.add_argument_group("runtime")
    g.add_argument("--device", help="cuda, cuda:1, cpu ... (default: cuda if available, else cpu)")
    g.add_argument("--dtype", choices=sorted(DTYPE_NAMES), help="transformer and text-encoder dtype (default: bf16 "
                   "on GPU, fp32 on CPU; the VAE always runs in fp32)")
    g.add_argument("--offload", action="store_true", help="model CPU offload (diffusers' enable_model_cpu_offload): "
                   "each model moves to the GPU only while it runs, for GPUs with little memory")
    g.add_argument("--parallel", choices=PARALLEL_LAYOUTS, help="split the video's tokens over the processes of a "
                   "distributed launch (torchrun --nproc-per-node N -m attnqat generate ...; on GPUs also accelerate "
                   "launch): 'ulysses' (every mode; N must divide the head count) or 'ring' (modes with a "
                   "log-sum-exp: bf16, nvfp4, attn_qat, attn_qat_dropin); each process uses cuda:LOCAL_RANK (the CPU "
                   "with gloo on a CPU-only torch), rank 0 decodes and writes (default: one process)")
    g.add_argument("--compile", action="store_true", help="torch.compile the transformer's blocks with "
                   "fullgraph=True (diffusers' compile_repeated_blocks; the first step is slower; attention time is "
                   "then not measured)")


def parse_layers(text: str, n_blocks: int | None = None):
    """``"self"``, ``"all"`` or ``"0,3,5"`` → what :func:`patch_attention` takes; indices are checked
    against ``n_blocks`` when it is known."""
    text = check_text("--layers", text).strip()
    if text in ("self", "all"):
        return text
    try:
        indices = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--layers {show(text)}: expected 'self', 'all' or comma-separated block indices") from None
    bad = sorted({i for i in indices if i < 0 or (n_blocks is not None and i >= n_blocks)})
    if bad:
        where = f"the transformer has {n_blocks} blocks (0..{n_blocks - 1})" if n_blocks else "indices start at 0"
        raise ValueError(f"--layers: block indices {show(bad)} out of range: {where}")
    return indices


def parse_schedule(args: argparse.Namespace):
    """The :class:`~attnqat.pipelines.schedule.PrecisionSchedule` of ``--high-precision-steps``,
    ``--high-precision-blocks`` and ``--high-precision-mode`` (None when neither of the first two is
    given), its steps resolved here, once, for ``--steps`` (the callback and the summary read them as they are);
    its blocks are resolved by :func:`check_model_settings`."""
    from attnqat.kernels import REFERENCE_MODE

    from .schedule import PrecisionSchedule

    steps, blocks = getattr(args, "high_precision_steps", None), getattr(args, "high_precision_blocks", None)
    mode = getattr(args, "high_precision_mode", None)
    if steps is None and blocks is None:
        if mode is not None:
            raise ValueError("--high-precision-mode needs --high-precision-steps or --high-precision-blocks")
        return None
    for flag, text in (("--high-precision-steps", steps), ("--high-precision-blocks", blocks),
                       ("--high-precision-mode", mode)):
        if text is not None:
            check_text(flag, text)
    schedule = PrecisionSchedule.parse(steps, blocks, REFERENCE_MODE if mode is None else mode,
                                       flags=("--high-precision-steps", "--high-precision-blocks",
                                              "--high-precision-mode"))
    return schedule.for_steps(args.steps, "--high-precision-steps")


def check_model_settings(args: argparse.Namespace, config: dict, n_blocks: int | None) -> None:
    """The settings that depend on the transformer (its ``config``: heads, patch size; ``n_blocks``), checked
    once a run: by :func:`resolve_settings` where the model folder's config reads before loading, else by
    ``_generate`` once the model has loaded (a hub id). ``args.schedule``'s blocks are resolved here, against
    ``n_blocks`` (None: an unreadable block count, then :func:`patch_attention` resolves them), and must be
    among ``--layers``; ``--parallel``'s layout is checked (:func:`check_parallel_layout`)."""
    schedule = args.schedule
    if schedule is not None and n_blocks is not None:
        args.schedule = schedule = schedule.for_blocks(n_blocks, "--high-precision-blocks")
        layers = getattr(args, "layers", "self")
        if not isinstance(layers, str):
            outside = sorted(set(schedule.blocks) - set(layers))
            if outside:
                raise ValueError(f"--high-precision-blocks: blocks {outside} are not among --layers "
                                 f"{','.join(map(str, layers))}")
    check_parallel_layout(args, config)


def resolve_settings(args: argparse.Namespace) -> argparse.Namespace:
    """Fill model-dependent defaults and validate every generation setting, before anything heavy
    loads. The limits and their reasons are :data:`attnqat.checks.LIMITS`."""
    from attnqat.kernels import QK_ROTATIONS, available_modes, mode_of

    from .loading import (check_model, check_qat_checkpoint, choose_qat_checkpoint, config_num_blocks,
                          model_transformer_config, trained_mode_options)

    args.model_note = None
    if args.model is None:
        args.model = default_model()
        if args.model != DEFAULT_MODEL:  # only on an installation without mini's weights
            args.model_note = MINI_MISSING_NOTE
    check_model(args.model)
    device = check_device("--device", args.device)
    args.launch = resolve_launch(args)
    if args.launch is not None:
        device = rank_device(args.launch, args.device)
    args.device = str(device)
    for k, v in model_defaults(args.model, device).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    check_text("--prompt", args.prompt)
    check_text("--negative-prompt", args.negative_prompt, empty_ok=True)
    check_video_size(args.height, args.width, args.frames, args.steps)
    check_float("--guidance", args.guidance, lo=0.0)
    if args.flow_shift is not None:  # None: the model's own (mini's scheduler config)
        check_float("--flow-shift", args.flow_shift, lo=0.0, lo_open=True)
    check_limited("--fps", args.fps, "fps")
    check_int("--seed", args.seed, 0, *LIMITS["seed"])
    check_text("--mode", args.mode)
    mode_of(args.mode, "--mode")
    check_text("--qk-rotation", args.qk_rotation)
    if args.qk_rotation not in ("auto", *QK_ROTATIONS):
        raise ValueError(f"--qk-rotation {args.qk_rotation!r}: choose one of auto, {', '.join(QK_ROTATIONS)}")
    for switch, option in SWITCHED_OPTIONS:
        check_text(switch, getattr(args, option))
        if getattr(args, option) not in ("auto", "on", "off"):
            raise ValueError(f"{switch} {getattr(args, option)!r}: choose one of auto, on, off")
    for switch, option, asked in (("--qk-rotation", "qk_rotation", args.qk_rotation not in ("auto", "none")),
                                  *((s, option, getattr(args, option) == "on") for s, option in SWITCHED_OPTIONS)):
        if asked and option not in dict(mode_of(args.mode).options):
            fp4 = ", ".join(available_modes(lambda m: option in dict(m.options)))
            raise ValueError(f"{switch} {getattr(args, option)} needs an FP4 --mode ({fp4}), not {args.mode}")
    args.qat_checkpoint, args.weights_note = choose_qat_checkpoint(args.model, args.qat_checkpoint, args.mode)
    if args.qat_checkpoint is not None:
        check_qat_checkpoint(args.qat_checkpoint)
    trained = trained_mode_options(args.mode, args.qat_checkpoint)  # the base weights were trained without them
    if args.qk_rotation == "auto":  # as the weights were trained
        args.qk_rotation = trained.get("qk_rotation", "none")
    for _, option in SWITCHED_OPTIONS:
        if getattr(args, option) == "auto":
            setattr(args, option, "on" if trained.get(option) else "off")
    args.mode_options = {**({} if args.qk_rotation == "none" else {"qk_rotation": args.qk_rotation}),
                         **{option: True for _, option in SWITCHED_OPTIONS if getattr(args, option) == "on"}}
    # None for a hub id: what depends on its transformer is checked once it has loaded (_generate)
    args.transformer_config = model_transformer_config(args.model)
    n_blocks = config_num_blocks(args.transformer_config)  # the config read once
    if isinstance(args.layers, str):
        args.layers = parse_layers(args.layers, n_blocks)
    args.schedule = parse_schedule(args)
    if args.transformer_config is not None:
        check_model_settings(args, args.transformer_config, n_blocks)

    if args.offload and device.type != "cuda":
        raise ValueError("--offload needs a CUDA device (it moves models between CPU and GPU)")
    if args.dtype is None:
        args.dtype = "bf16" if device.type == "cuda" else "fp32"
    return args


def resolve_launch(args: argparse.Namespace):
    """The :class:`~attnqat.pipelines.launch.Launch` ``--parallel`` runs under (None: one process). Refused:
    ``--parallel`` in one process, several launched processes without ``--parallel`` (each would generate
    and write the same --out), ``--parallel`` with ``--offload``."""
    if getattr(args, "parallel", None) is None:
        try:
            launch = launch_from_env()
        except ValueError:  # stray variables no launcher set: not a launch to refuse a one-process run for
            return None
        if launch is not None:
            raise ValueError(f"{launch.world_size} processes were launched (WORLD_SIZE={launch.world_size}) without "
                             f"--parallel: each would generate and write the same video; add --parallel ulysses "
                             f"or --parallel ring")
        return None
    launch = launch_from_env()
    if launch is None:
        raise ValueError(f"--parallel {args.parallel} needs several processes and this is one (WORLD_SIZE is "
                         f"{os.environ.get('WORLD_SIZE') or 'unset'}); {LAUNCH_HINT}")
    if args.offload:
        raise ValueError("--offload with --parallel is not supported: each process keeps its whole pipeline on "
                         "its GPU")
    return launch


def video_tokens(args: argparse.Namespace, config) -> int:
    """The transformer's sequence length for --height x --width x --frames: latent frames x rows x columns of
    patches (the patch size from the transformer's ``config``)."""
    height, width, frames = args.height, args.width, args.frames
    pt, ph, pw = tuple(config.get("patch_size") or (1, 2, 2))
    latent_frames = (frames - 1) // TIME_STRIDE + 1
    return (latent_frames // pt) * (height // VAE_SPATIAL_STRIDE // ph) * (width // VAE_SPATIAL_STRIDE // pw)


def check_parallel_layout(args: argparse.Namespace, config: dict) -> None:
    """``--parallel``'s layout against the transformer's ``config`` (heads, patch size) and the video's size,
    the same on every rank and before any communication, so that a refusal stops every rank at once (called by
    :func:`check_model_settings`)."""
    from .context_parallel import check_degrees

    if getattr(args, "launch", None) is None:
        return
    world = args.launch.world_size
    where = f"--parallel {args.parallel} over {world} processes"
    ring, ulysses = (world, 1) if args.parallel == "ring" else (1, world)
    # the mode with its options (K-smoothing), and the schedule's high-precision mode, which runs without them
    modes = [(args.mode, getattr(args, "mode_options", None) or {})]
    if args.schedule is not None:
        modes.append((args.schedule.mode, {}))
    for mode, options in modes:
        try:
            check_degrees(ring, ulysses, heads=int(config["num_attention_heads"]), mode=mode, needs_grad=False,
                          options=options)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    tokens = video_tokens(args, config)
    if tokens % world:
        raise ValueError(f"{where}: the video's {tokens} tokens do not split into {world} equal shares (diffusers "
                         f"shards the sequence evenly); pick --height, --width, --frames or a process count so that "
                         f"they do")


def parallel_note(args: argparse.Namespace, config) -> str | None:
    """Why a video made on several processes will not be the one-process video to the bit, where it will not:
    - ring with an FP4 mode when a rank's share of the tokens is not whole NVFP4 blocks: P and V are quantized in
      blocks of 16 keys, and a share boundary inside a block gives other blocks (other scales) than one process has,
      so the video differs like another FP4 rounding would;
    - ``--compile``: each process's compiled blocks see its share of the tokens, and the compiler picks a
      reduction's launch configuration by the number of rows, so the norms may sum in another order than one
      process's compiled blocks do (measured on two H200s: docs/multigpu.md)."""
    from attnqat.kernels import mode_of
    from attnqat.kernels.formats import NVFP4_BLOCK

    if getattr(args, "launch", None) is None:
        return None
    notes = []
    share = video_tokens(args, config) // args.launch.world_size
    if args.parallel == "ring" and mode_of(args.mode).naive_fp4_forward and share % NVFP4_BLOCK:
        notes.append(f"each rank holds {share} of the video's tokens, not a multiple of {NVFP4_BLOCK} (NVFP4's "
                     f"block along the keys): ring's {args.mode} quantizes other key blocks than one process does, "
                     f"so this video is not the one-process video to the bit (it differs as another FP4 rounding "
                     f"would)")
    if getattr(args, "compile", False):
        notes.append("--compile with --parallel: each process's compiled blocks see its share of the tokens, and "
                     "the compiler may sum the norms in another order than for the whole, so this video is not the "
                     "one-process --compile video to the bit (without --compile, Ulysses gives it exactly)")
    return "; ".join(notes) or None


def check_outputs(args: argparse.Namespace) -> argparse.Namespace:
    """Check --out and --frames-dir before anything loads (a read-only folder, a folder given as
    --out, a non-empty --frames-dir are refused here, not after minutes of generation), and the mp4 writer where a
    video is asked for. Nothing is created yet. --out defaults to video.mp4 unless --frames-dir alone is given."""
    from .loading import model_inputs

    if args.out is None and args.frames_dir is None:
        args.out = DEFAULT_OUT
    if args.out is not None:
        args.out = check_output_file("--out", args.out, MP4_SUFFIXES)
    if args.frames_dir is not None:
        args.frames_dir = check_output_dir("--frames-dir", args.frames_dir, must_be_empty=True)
        if args.out is not None and args.frames_dir.absolute() == args.out.absolute():
            raise ValueError("--frames-dir and --out are the same path")
    inputs = [("--qat-checkpoint", args.qat_checkpoint)] + model_inputs("--model", args.model)
    for flag, out in (("--out", args.out), ("--frames-dir", args.frames_dir)):
        if out is not None:
            check_not_input(flag, out, inputs)
    if args.out is not None:
        check_mp4_writer()  # before minutes of generation, not after
    return args


@dataclass
class GenerationResult:
    """What :func:`generate_video` returns: the frames and the measurements of the run."""
    frames: np.ndarray | None           # (frames, height, width, 3) uint8; None when not decoded (decode=False)
    step_seconds: list[float] = field(default_factory=list)   # wall time of each denoising step
    attention_seconds: float | None = None  # time inside patched attention calls, all steps (None: not timed)
    attention_calls: int = 0
    peak_memory_bytes: int | None = None  # peak GPU memory allocated (None on CPU)
    seconds: float = 0.0                # the whole pipeline call (text encoding, denoising, VAE decoding)
    latents: Any = None                 # the final latents (torch.Tensor, what the VAE decodes)


class _StepClock:
    """Times denoising steps: a step starts at its first transformer call (a forward pre-hook) and
    ends at the pipeline's step-end callback. Synchronises CUDA at both points."""

    def __init__(self, device):
        self.device = device
        self.starts: list[float] = []
        self.ends: list[float] = []

    def _now(self) -> float:
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def pre_hook(self, module, args):
        if len(self.starts) == len(self.ends):
            self.starts.append(self._now())

    def on_step_end(self, pipe, step, timestep, callback_kwargs):
        self.ends.append(self._now())
        return {}

    def seconds(self) -> list[float]:
        return [e - s for s, e in zip(self.starts, self.ends)]


def generate_video(pipe, prompt: str, *, negative_prompt: str = "", height: int, width: int, frames: int,
                   steps: int, guidance: float, seed: int = 0, timer=None, device=None,
                   max_sequence_length: int = 512, on_step=None, schedule=None,
                   decode: bool = True) -> GenerationResult:
    """Run a ``WanPipeline`` once and measure it (step times, attention time via ``timer``, peak memory).

    ``timer`` is the :class:`~attnqat.pipelines.AttentionTimer` given to :func:`patch_attention`
    (reset here). The progress bar is diffusers' (tqdm). ``on_step(done, steps)`` is called after
    each denoising step; an exception it raises stops the generation there (the demo's cancel).
    ``schedule``: the :class:`~attnqat.pipelines.PrecisionSchedule` the transformer was patched with;
    its steps run in high precision (its callback runs after each step; the processors are back in
    their own mode afterwards, also when the run fails).

    After every step the latents are checked: NaN or inf stops the run with
    :class:`~attnqat.errors.NonFiniteOutputError` (no later step, no decoding); so do non-finite
    decoded frames. A video is never made from them.

    ``decode`` False skips the VAE (frames None): the ranks other than 0 of ``--parallel``, whose final
    latents equal rank 0's.
    """
    import torch

    device = torch.device(device) if device is not None else pipe._execution_device
    clock = _StepClock(device)
    switch = schedule.callback(pipe.transformer, steps) if schedule is not None else None

    final = {}

    def step_end(pipe_, step, timestep, callback_kwargs):
        clock.on_step_end(pipe_, step, timestep, callback_kwargs)
        latents = final["latents"] = callback_kwargs.get("latents")
        if latents is not None and not bool(torch.isfinite(latents).all()):
            raise NonFiniteOutputError(f"denoising step {step + 1} of {steps} produced NaN or infinite latents; "
                                       f"no video is made from them")
        if switch is not None:
            switch(pipe_, step, timestep, callback_kwargs)
        if on_step is not None:
            on_step(step + 1, steps)
        return {}

    hook = pipe.transformer.register_forward_pre_hook(clock.pre_hook)
    if timer is not None:
        timer.reset()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    try:
        out = pipe(prompt=prompt, negative_prompt=negative_prompt, height=height, width=width, num_frames=frames,
                   num_inference_steps=steps, guidance_scale=guidance, output_type="np" if decode else "latent",
                   generator=torch.Generator("cpu").manual_seed(seed), callback_on_step_end=step_end,
                   callback_on_step_end_tensor_inputs=["latents"], max_sequence_length=max_sequence_length)
    finally:
        hook.remove()
        if switch is not None:
            switch.finish()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    video = _to_uint8(out.frames[0]) if decode else None
    timed = timer is not None and timer.enabled
    return GenerationResult(
        frames=video, step_seconds=clock.seconds(), seconds=seconds, latents=final.get("latents"),
        attention_seconds=timer.total_seconds() if timed else None, attention_calls=timer.calls if timed else 0,
        peak_memory_bytes=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None)


def _to_uint8(frames) -> np.ndarray:
    """The pipeline's float frames in [0, 1] as uint8; non-finite frames are refused."""
    video = np.asarray(frames)
    if not np.isfinite(video).all():
        raise NonFiniteOutputError("the decoded frames hold NaN or infinite values; no video is made from them")
    return (np.clip(video, 0.0, 1.0) * 255.0).round().astype(np.uint8)


def check_mp4_writer() -> None:
    """Raise ImportError (with what to install) when imageio's ffmpeg plugin is missing: without it
    imageio silently picks another writer for '.mp4' and fails late with an unrelated error."""
    try:
        import imageio_ffmpeg  # noqa: F401
    except ImportError:
        raise ImportError("writing mp4 needs imageio's ffmpeg plugin: pip install imageio-ffmpeg") from None


def _check_frames(frames) -> np.ndarray:
    frames = np.asarray(frames)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or len(frames) == 0:
        raise ValueError(f"frames must be a non-empty (frames, height, width, 3) uint8 array, got "
                         f"{frames.dtype} {frames.shape}")
    return frames


def read_video(path: str | Path) -> np.ndarray:
    """All frames of a video file as (frames, H, W, 3) uint8 (imageio + ffmpeg)."""
    import imageio.v2 as imageio

    reader = imageio.get_reader(str(path), format="FFMPEG")
    try:
        return np.stack([f for f in reader])
    finally:
        reader.close()


def write_mp4(frames: np.ndarray, path: str | Path, fps: int = FPS) -> Path:
    """Write (frames, H, W, 3) uint8 as an H.264 video (imageio + its bundled ffmpeg), safely.

    The video goes to a temporary file beside ``path``; it replaces ``path`` only after the writer
    finished and the file reads back with the same number and size of frames. Any failure (disk full,
    ffmpeg error) leaves an existing ``path`` untouched, removes the temporary file and raises
    :class:`~attnqat.errors.OutputWriteError`. Return: ``path``.
    """
    import imageio.v2 as imageio

    check_mp4_writer()
    frames = _check_frames(frames)
    path = Path(path)

    def write(tmp: Path) -> None:
        with imageio.get_writer(str(tmp), format="FFMPEG", fps=fps, codec="libx264", quality=8,
                                pixelformat="yuv420p", macro_block_size=1, ffmpeg_log_level="error") as w:
            for frame in frames:
                w.append_data(frame)

    def verify(tmp: Path) -> None:
        if tmp.stat().st_size == 0:
            raise OutputWriteError(f"the video written for {str(path)!r} is empty")
        try:
            back = read_video(tmp)
        except Exception as e:  # imageio / ffmpeg raise several types for an unreadable file
            raise OutputWriteError(f"the video written for {str(path)!r} does not read back "
                                   f"({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__})") from e
        if back.shape != frames.shape:
            raise OutputWriteError(f"the video written for {str(path)!r} reads back as {back.shape[0]} frames of "
                                   f"{back.shape[1]}x{back.shape[2]}, not {frames.shape[0]} of "
                                   f"{frames.shape[1]}x{frames.shape[2]}")

    return write_file_atomically(path, write, verify)


def write_pngs(frames: np.ndarray, folder: str | Path) -> list[Path]:
    """Write each frame as ``folder/frame_0000.png`` ... (lossless).

    The frames go to a temporary folder beside ``folder``, which is then renamed to ``folder``;
    ``folder`` must not exist or be empty: a folder with anything in it is never written into
    (:class:`~attnqat.errors.OutputWriteError`; the temporary folder is removed)."""
    import imageio.v2 as imageio

    frames = _check_frames(frames)
    folder = Path(folder)
    names = [f"frame_{i:04d}.png" for i in range(len(frames))]

    def write(tmp: Path) -> None:
        for name, frame in zip(names, frames):
            imageio.imwrite(tmp / name, frame)

    def verify(tmp: Path) -> None:
        short = [n for n in names if (tmp / n).stat().st_size == 0]
        if short:
            raise OutputWriteError(f"{len(short)} PNG files written for {str(folder)!r} are empty")

    write_dir_atomically(folder, write, verify)
    return [folder / n for n in names]


def check_mode_runs(mode: str, head_dim: int, device, dtype, flag: str = "--mode") -> None:
    """Run ``mode`` once on small inputs of the model's head_dim, device and dtype, so that an
    unsupported combination (e.g. an FP4 kernel given fp32, or head_dim 96) fails before the model runs."""
    import torch

    from attnqat.kernels import attention

    q = torch.randn(1, 1, 32, head_dim, device=device).to(dtype)
    try:
        with torch.no_grad():
            attention(q, q, q, mode)
    except (ValueError, TypeError, NotImplementedError) as e:
        hint = "; try --dtype bf16" if dtype == torch.float32 and "dtype" in str(e) else ""
        raise ValueError(f"{flag} {mode} cannot run this model ({dtype}, head_dim {head_dim}, {device}): "
                         f"{str(e).splitlines()[0]}{hint}") from e


def _describe_layers(layers, n_blocks: int) -> str:
    if layers == "self":
        return f"self-attention (attn1) of all {n_blocks} blocks"
    if layers == "all":
        return f"self- and cross-attention (attn1, attn2) of all {n_blocks} blocks"
    return f"self-attention (attn1) of blocks {', '.join(map(str, layers))} of {n_blocks}"


def main(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    args = resolve_settings(args)
    if args.launch is None:
        check_outputs(args)
        return _generate(args, t_start)
    import torch

    with process_group(torch.device(args.device)):
        # Only rank 0 writes, so only rank 0 checks the paths; its refusal stops every rank.
        shared_check(args.launch, lambda: check_outputs(args))
        return _generate(args, t_start)


def _generate(args: argparse.Namespace, t_start: float) -> int:
    """Load, patch (under --parallel: enable context parallelism), generate; the one process, or rank 0 of
    --parallel, writes the outputs and the summary."""
    import torch

    from .loading import is_tiny, load_pipeline, load_qat_checkpoint
    from .processor import AttentionTimer, patch_attention
    from .tiny import TINY_NOTICE

    writes = args.launch is None or args.launch.rank == 0
    # The video path goes to stdout; the other ranks stay quiet (they would repeat rank 0's lines).
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if writes else (lambda msg: None)  # noqa: E731
    if getattr(args, "model_note", None):
        log(f"NOTE: {args.model_note}.")
    if is_tiny(args.model):
        log(f"NOTE: {TINY_NOTICE}.")
    device, dtype = torch.device(args.device), torch_dtype(args.dtype)

    pipe = load_pipeline(args.model, dtype=dtype, device=None if args.offload else device,
                         flow_shift=args.flow_shift)
    if is_mini_model(args.model):  # mini reads its corpus's words only; any other word is <unk> to it
        note = vocabulary_note(pipe.tokenizer, args.prompt)
        if note:
            log(f"NOTE: {note}.")
    if args.qat_checkpoint:
        load_qat_checkpoint(pipe.transformer, args.qat_checkpoint)
    check_mode_runs(args.mode, pipe.transformer.config.attention_head_dim, device, dtype)
    schedule = args.schedule
    if schedule is not None:
        check_mode_runs(schedule.mode, pipe.transformer.config.attention_head_dim, device, dtype,
                        flag="--high-precision-mode")
    if args.transformer_config is None:  # a hub id's transformer is known only now
        check_model_settings(args, dict(pipe.transformer.config), len(pipe.transformer.blocks))
        schedule = args.schedule
    timer = AttentionTimer(enabled=not args.compile)
    patch_attention(pipe.transformer, args.mode, args.layers, timer=timer, schedule=schedule,
                    **getattr(args, "mode_options", {}))
    if args.launch is not None:
        from .context_parallel import enable_context_parallel

        config = dict(pipe.transformer.config)
        enable_context_parallel(pipe.transformer, args.parallel, args.launch.world_size)
        note = parallel_note(args, config)
        if note:
            log(f"NOTE: {note}.")
    if args.offload:
        pipe.enable_model_cpu_offload(device=device)
    if args.compile:
        # diffusers' regional compile: each block with fullgraph=True (the patched attention traces inside it); the
        # step clock's hook on the transformer stays outside the compiled code
        pipe.transformer.compile_repeated_blocks(fullgraph=True)
    pipe.set_progress_bar_config(desc=f"denoising ({args.mode})", file=sys.stderr, disable=not writes)
    t_loaded = time.perf_counter()

    try:
        result = generate_video(pipe, args.prompt, negative_prompt=args.negative_prompt, height=args.height,
                                width=args.width, frames=args.frames, steps=args.steps, guidance=args.guidance,
                                seed=args.seed, timer=timer, device=device, schedule=schedule, decode=writes)
    except NonFiniteOutputError as e:
        raise NonFiniteOutputError(f"{e} (--mode {args.mode}, --dtype {args.dtype}, seed {args.seed}); nothing "
                                   f"was written") from e
    if not writes:
        return 0
    out = write_mp4(result.frames, args.out, fps=args.fps) if args.out is not None else None
    pngs = []
    if args.frames_dir is not None:
        try:
            pngs = write_pngs(result.frames, args.frames_dir)
        except OutputWriteError as e:
            raise OutputWriteError(f"{e}" + (f" (the video {str(out)!r} was written)" if out else "")) from e
    log("\n".join(_summary(args, pipe, result, time.perf_counter() - t_start, t_loaded - t_start, out, pngs)))
    print(out if out is not None else args.frames_dir)
    return 0


def _summary(args: argparse.Namespace, pipe, result: GenerationResult, total: float, loading: float, out: Path | None,
             pngs: list) -> list[str]:
    """The lines printed after a run: what ran, its times, what was written."""
    from attnqat.kernels import describe_qk_options

    from .loading import is_tiny

    tiny = is_tiny(args.model)
    schedule = args.schedule
    device = args.device
    steps = result.step_seconds
    denoise = sum(steps)
    per_step = denoise / max(len(steps), 1)
    passes = "cond + uncond" if args.guidance > 1.0 else "cond only"
    qk = describe_qk_options(getattr(args, "mode_options", None) or {})
    lines = [
        "",
        f"model        {args.model}" + ("  (RANDOM weights: not a real video model)" if tiny else "")
        + ("  (attnqat's small model, trained on its procedural corpus: coloured shapes over simple backgrounds)"
           if is_mini_model(args.model) else ""),
        f"attention    {args.mode}" + (f" ({'; '.join(qk)})" if qk else "") +
        f" on {_describe_layers(args.layers, len(pipe.transformer.blocks))}",
    ]
    if getattr(args, "weights_note", None):
        lines.append(f"weights      {args.weights_note}")
    if schedule is not None:
        lines.append(f"precision    {schedule.describe(args.steps, len(pipe.transformer.blocks))}"
                     + ("" if schedule.empty else f"; {args.mode} elsewhere"))
    lines += [
        f"video        {args.frames} frames {args.height}x{args.width}, {args.steps} step{'s' if args.steps != 1 else ''}, guidance "
        f"{args.guidance}, seed {args.seed}, {args.dtype} on {device}" + (" (CPU offload)" if args.offload else ""),
    ]
    if args.launch is not None:
        lines.append(f"parallel     {args.parallel} over {args.launch.world_size} processes (context parallelism); "
                     f"times and memory are rank 0's, which decoded and wrote")
    lines += [
        f"total time   {total:.2f} s (loading {loading:.2f} s, pipeline {result.seconds:.2f} s, "
        f"denoising {denoise:.2f} s)",
        f"per step     {per_step:.3f} s ({passes})" + (f"; first {steps[0]:.3f} s, rest {sum(steps[1:]) / (len(steps) - 1):.3f} s"
                                                     if len(steps) > 1 else ""),
    ]
    if result.attention_seconds is not None and denoise > 0:
        lines.append(f"attention    {100 * result.attention_seconds / denoise:.1f}% of the step "
                     f"({result.attention_seconds / max(len(steps), 1):.3f} s per step in "
                     + (f"{args.mode} layers)" if schedule is None else "the patched layers)"))
    else:
        lines.append("attention    share not measured (--compile)")
    lines.append(f"peak memory  {result.peak_memory_bytes / 2**30:.2f} GiB (GPU, allocated)"
                 if result.peak_memory_bytes is not None else "peak memory  n/a (CPU run)")
    if out is not None:
        lines.append(f"wrote        {out} ({len(result.frames)} frames, {args.height}x{args.width}, {args.fps} fps)"
                     + (f" and {len(pngs)} PNGs in {args.frames_dir}" if pngs else ""))
    else:
        lines.append(f"wrote        {len(pngs)} PNGs in {args.frames_dir} ({args.height}x{args.width}; no video: "
                     f"no --out)")
    return lines
