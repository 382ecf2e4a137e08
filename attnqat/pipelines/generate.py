"""Generate a video with Wan 2.1 text-to-video, its self-attention in an attnqat mode.

  attnqat generate --prompt "a corgi surfing a wave" --mode attn_qat --out corgi.mp4

The default --model tiny is built in code with RANDOM weights (offline; its video is noise-like):
it checks the whole pipeline in seconds on a CPU. For real videos pass a diffusers-format
Wan 2.1 T2V folder, e.g. one made by
  huggingface-cli download Wan-AI/Wan2.1-T2V-1.3B-Diffusers --local-dir ./Wan2.1-T2V-1.3B-Diffusers

Sizes: height and width must be multiples of 16 and --frames of the form 4k+1 (1, 5, ..., 81);
other values are refused with the nearest valid ones (nothing is rounded silently).
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

HELP = "generate a video with Wan 2.1 text-to-video (attention in an attnqat mode)"

# Per-model defaults for options left unset: the tiny model's are small so the CPU run takes seconds;
# the real model's are Wan 2.1's 480p settings (flow shift 3.0 at 480p, 5.0 at 720p).
TINY_DEFAULTS = dict(height=64, width=64, frames=9, steps=8, guidance=5.0, flow_shift=3.0)
REAL_DEFAULTS = dict(height=480, width=832, frames=81, steps=50, guidance=5.0, flow_shift=3.0)
FPS = 16  # Wan 2.1 generates 16 frames per second
SIZE_MULTIPLE = 16  # the VAE downsamples by 8, then the transformer patches 2x2
TIME_STRIDE = 4  # the VAE keeps the first frame, then compresses time by 4: frames = 4k + 1
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("what to generate")
    g.add_argument("--prompt", required=True, help="text prompt")
    g.add_argument("--negative-prompt", default="", help="negative prompt for classifier-free guidance (default: empty)")
    g.add_argument("--height", type=int, help="video height in pixels, a multiple of 16 "
                   "(default: 64 for tiny, 480 otherwise)")
    g.add_argument("--width", type=int, help="video width in pixels, a multiple of 16 (default: 64 for tiny, 832 otherwise)")
    g.add_argument("--frames", type=int, help="number of frames, 4k+1 (default: 9 for tiny, 81 otherwise); "
                   "other values are refused with the nearest valid ones")
    g.add_argument("--steps", type=int, help="denoising steps (default: 8 for tiny, 50 otherwise)")
    g.add_argument("--guidance", type=float, help="classifier-free guidance scale (default: 5.0; <= 1 disables "
                   "the unconditional pass)")
    g.add_argument("--flow-shift", type=float, help="UniPC flow-matching shift (default: 3.0, Wan 2.1's 480p "
                   "value; 5.0 for 720p)")
    g.add_argument("--seed", type=int, default=0, help="random seed of the initial noise (default: 0)")

    g = p.add_argument_group("model and attention")
    g.add_argument("--model", default="tiny", help="'tiny' (default: offline, RANDOM weights), a local "
                   "diffusers-format Wan 2.1 T2V folder, or a hub id such as Wan-AI/Wan2.1-T2V-1.3B-Diffusers "
                   "(used from the cache, downloaded only if the network allows)")
    g.add_argument("--mode", default="bf16", help="attention mode for the patched layers (default: bf16); "
                   "one of attnqat.available_modes(), e.g. attn_qat, nvfp4, sage3")
    g.add_argument("--layers", default="self", help="which attention layers use --mode: 'self' (default: attn1 "
                   "of every block, the paper's setting), 'all' (attn1 and cross-attention attn2), or comma-"
                   "separated block indices (their attn1)")
    g.add_argument("--qat-checkpoint", metavar="PATH", help="transformer weights to load (a .safetensors file or "
                   "a folder of them, e.g. from attnqat's QAT fine-tuning); must match --model's architecture")

    g = p.add_argument_group("output")
    g.add_argument("--out", default="video.mp4", help="output mp4 path (default: video.mp4)")
    g.add_argument("--frames-dir", metavar="DIR", help="also write every frame as DIR/frame_0000.png ...")
    g.add_argument("--fps", type=int, default=FPS, help=f"frames per second of the mp4 (default: {FPS})")

    g = p.add_argument_group("runtime")
    g.add_argument("--device", help="cuda, cuda:1, cpu ... (default: cuda if available, else cpu)")
    g.add_argument("--dtype", choices=sorted(DTYPES), help="transformer and text-encoder dtype (default: bf16 on "
                   "GPU, fp32 on CPU; the VAE always runs in fp32)")
    g.add_argument("--offload", action="store_true", help="model CPU offload (diffusers' enable_model_cpu_offload): "
                   "each model moves to the GPU only while it runs, for GPUs with little memory")
    g.add_argument("--compile", action="store_true", help="torch.compile the transformer (the first step is "
                   "slower; attention time is then not measured)")


def _nearest_frames(n: int) -> str:
    lo = max(1, (n - 1) // TIME_STRIDE * TIME_STRIDE + 1)
    hi = lo + TIME_STRIDE
    if n < 1:
        return "1"
    if n - lo == hi - n:
        return f"{lo} or {hi}"
    return str(lo if n - lo < hi - n else hi)


def _nearest_multiple(n: int, m: int) -> str:
    lo, hi = n // m * m, (n // m + 1) * m
    if lo < m:
        return str(m)
    return f"{lo} or {hi}"


def parse_layers(text: str):
    """``"self"``, ``"all"`` or ``"0,3,5"`` → what :func:`patch_attention` takes."""
    text = text.strip()
    if text in ("self", "all"):
        return text
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--layers {text!r}: expected 'self', 'all' or comma-separated block indices") from None


def resolve_settings(args: argparse.Namespace) -> argparse.Namespace:
    """Fill model-dependent defaults and validate every setting, before anything heavy loads."""
    from attnqat.kernels import available_modes

    from .loading import is_tiny

    defaults = TINY_DEFAULTS if is_tiny(args.model) else REAL_DEFAULTS
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if not args.prompt.strip():
        raise ValueError("--prompt is empty")
    for name in ("height", "width"):
        v = getattr(args, name)
        if v <= 0 or v % SIZE_MULTIPLE:
            raise ValueError(f"--{name} {v} is not a positive multiple of {SIZE_MULTIPLE} (Wan's VAE downsamples "
                             f"by 8 and its transformer patches by 2); nearest valid: {_nearest_multiple(v, SIZE_MULTIPLE)}")
    if args.frames < 1 or (args.frames - 1) % TIME_STRIDE:
        raise ValueError(f"--frames {args.frames} is not of the form 4k+1 (Wan's VAE keeps the first frame and "
                         f"compresses the rest by 4); nearest valid: {_nearest_frames(args.frames)}")
    if args.steps < 1:
        raise ValueError(f"--steps {args.steps} must be at least 1")
    if args.fps < 1:
        raise ValueError(f"--fps {args.fps} must be at least 1")
    if args.mode not in available_modes():
        raise ValueError(f"unknown --mode {args.mode!r}; available: {', '.join(available_modes())}")
    args.layers = parse_layers(args.layers) if isinstance(args.layers, str) else args.layers

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise ValueError(f"--device {args.device!r} is not a torch device (e.g. cuda, cuda:0, cpu)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda requested but no CUDA GPU is available; use --device cpu")
    if args.offload and device.type != "cuda":
        raise ValueError("--offload needs a CUDA device (it moves models between CPU and GPU)")
    if args.dtype is None:
        args.dtype = "bf16" if device.type == "cuda" else "fp32"
    if args.qat_checkpoint and not Path(args.qat_checkpoint).expanduser().exists():
        raise FileNotFoundError(f"--qat-checkpoint {args.qat_checkpoint!r} does not exist")
    return args


@dataclass
class GenerationResult:
    """What :func:`generate_video` returns: the frames and the measurements of the run."""
    frames: np.ndarray                  # (frames, height, width, 3) uint8
    step_seconds: list[float] = field(default_factory=list)   # wall time of each denoising step
    attention_seconds: float | None = None  # time inside patched attention calls, all steps (None: not timed)
    attention_calls: int = 0
    peak_memory_bytes: int | None = None  # peak GPU memory allocated (None on CPU)
    seconds: float = 0.0                # the whole pipeline call (text encoding, denoising, VAE decoding)


class _StepClock:
    """Times denoising steps: a step starts at its first transformer call (a forward pre-hook) and
    ends at the pipeline's step-end callback. Synchronises CUDA at both points."""

    def __init__(self, device: torch.device):
        self.device = device
        self.starts: list[float] = []
        self.ends: list[float] = []

    def _now(self) -> float:
        if self.device.type == "cuda":
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
                   steps: int, guidance: float, seed: int = 0, timer=None, device: torch.device | str | None = None,
                   max_sequence_length: int = 512) -> GenerationResult:
    """Run a ``WanPipeline`` once and measure it (step times, attention time via ``timer``, peak memory).

    ``timer`` is the :class:`~attnqat.pipelines.AttentionTimer` given to :func:`patch_attention`
    (reset here). The progress bar is diffusers' (tqdm).
    """
    device = torch.device(device) if device is not None else pipe._execution_device
    clock = _StepClock(device)
    hook = pipe.transformer.register_forward_pre_hook(clock.pre_hook)
    if timer is not None:
        timer.reset()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    try:
        out = pipe(prompt=prompt, negative_prompt=negative_prompt, height=height, width=width, num_frames=frames,
                   num_inference_steps=steps, guidance_scale=guidance, output_type="np",
                   generator=torch.Generator("cpu").manual_seed(seed), callback_on_step_end=clock.on_step_end,
                   max_sequence_length=max_sequence_length)
    finally:
        hook.remove()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    video = np.asarray(out.frames[0])
    video = (np.clip(video, 0.0, 1.0) * 255.0).round().astype(np.uint8)
    timed = timer is not None and timer.enabled
    return GenerationResult(
        frames=video, step_seconds=clock.seconds(), seconds=seconds,
        attention_seconds=timer.total_seconds() if timed else None, attention_calls=timer.calls if timed else 0,
        peak_memory_bytes=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None)


def check_mp4_writer() -> None:
    """Raise ImportError (with what to install) when imageio's ffmpeg plugin is missing: without it
    imageio silently picks another writer for '.mp4' and fails late with an unrelated error."""
    try:
        import imageio_ffmpeg  # noqa: F401
    except ImportError:
        raise ImportError("writing mp4 needs imageio's ffmpeg plugin: pip install imageio-ffmpeg") from None


def write_mp4(frames: np.ndarray, path: str | Path, fps: int = FPS) -> Path:
    """Write (frames, H, W, 3) uint8 as an H.264 mp4 (imageio + its bundled ffmpeg)."""
    import imageio.v2 as imageio

    check_mp4_writer()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with imageio.get_writer(str(path), format="FFMPEG", fps=fps, codec="libx264", quality=8, pixelformat="yuv420p",
                            macro_block_size=1, ffmpeg_log_level="error") as w:
        for frame in frames:
            w.append_data(frame)
    return path


def write_pngs(frames: np.ndarray, folder: str | Path) -> list[Path]:
    """Write each frame as ``folder/frame_0000.png`` ..."""
    import imageio.v2 as imageio

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"frame_{i:04d}.png" for i in range(len(frames))]
    for p, frame in zip(paths, frames):
        imageio.imwrite(p, frame)
    return paths


def check_mode_runs(mode: str, head_dim: int, device: torch.device, dtype: torch.dtype) -> None:
    """Run ``mode`` once on small inputs of the model's head_dim, device and dtype, so that an
    unsupported combination (e.g. an FP4 kernel given fp32, or head_dim 96) fails before the model runs."""
    from attnqat.kernels import attention

    q = torch.randn(1, 1, 32, head_dim, device=device).to(dtype)
    try:
        with torch.no_grad():
            attention(q, q, q, mode)
    except (ValueError, TypeError, NotImplementedError) as e:
        hint = "; try --dtype bf16" if dtype == torch.float32 and "dtype" in str(e) else ""
        raise ValueError(f"--mode {mode} cannot run this model ({dtype}, head_dim {head_dim}, {device}): "
                         f"{str(e).splitlines()[0]}{hint}") from e


def _describe_layers(layers, n_blocks: int) -> str:
    if layers == "self":
        return f"self-attention (attn1) of all {n_blocks} blocks"
    if layers == "all":
        return f"self- and cross-attention (attn1, attn2) of all {n_blocks} blocks"
    return f"self-attention (attn1) of blocks {', '.join(map(str, layers))} of {n_blocks}"


def main(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    from .loading import is_tiny, load_pipeline, load_qat_checkpoint
    from .processor import AttentionTimer, patch_attention
    from .tiny import TINY_NOTICE

    args = resolve_settings(args)
    check_mp4_writer()  # before minutes of generation, not after
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731 - the video path goes to stdout
    tiny = is_tiny(args.model)
    if tiny:
        log(f"NOTE: {TINY_NOTICE}.")
    device, dtype = torch.device(args.device), DTYPES[args.dtype]

    pipe = load_pipeline(args.model, dtype=dtype, device=None if args.offload else device,
                         flow_shift=args.flow_shift)
    if args.qat_checkpoint:
        load_qat_checkpoint(pipe.transformer, args.qat_checkpoint)
    check_mode_runs(args.mode, pipe.transformer.config.attention_head_dim, device, dtype)
    timer = AttentionTimer(enabled=not args.compile)
    patch_attention(pipe.transformer, args.mode, args.layers, timer=timer)
    if args.offload:
        pipe.enable_model_cpu_offload(device=device)
    if args.compile:
        pipe.transformer.compile()
    pipe.set_progress_bar_config(desc=f"denoising ({args.mode})", file=sys.stderr)
    t_loaded = time.perf_counter()

    result = generate_video(pipe, args.prompt, negative_prompt=args.negative_prompt, height=args.height,
                            width=args.width, frames=args.frames, steps=args.steps, guidance=args.guidance,
                            seed=args.seed, timer=timer, device=device)
    out = write_mp4(result.frames, args.out, fps=args.fps)
    pngs = write_pngs(result.frames, args.frames_dir) if args.frames_dir else []
    total = time.perf_counter() - t_start

    steps = result.step_seconds
    denoise = sum(steps)
    per_step = denoise / max(len(steps), 1)
    passes = "cond + uncond" if args.guidance > 1.0 else "cond only"
    lines = [
        "",
        f"model        {args.model}" + ("  (RANDOM weights: not a real video model)" if tiny else "")
        + (f" + {args.qat_checkpoint}" if args.qat_checkpoint else ""),
        f"attention    {args.mode} on {_describe_layers(args.layers, len(pipe.transformer.blocks))}",
        f"video        {args.frames} frames {args.height}x{args.width}, {args.steps} steps, guidance "
        f"{args.guidance}, seed {args.seed}, {args.dtype} on {device}" + (" (CPU offload)" if args.offload else ""),
        f"total time   {total:.2f} s (loading {t_loaded - t_start:.2f} s, pipeline {result.seconds:.2f} s, "
        f"denoising {denoise:.2f} s)",
        f"per step     {per_step:.3f} s ({passes})" + (f"; first {steps[0]:.3f} s, rest {sum(steps[1:]) / (len(steps) - 1):.3f} s"
                                                     if len(steps) > 1 else ""),
    ]
    if result.attention_seconds is not None and denoise > 0:
        lines.append(f"attention    {100 * result.attention_seconds / denoise:.1f}% of the step "
                     f"({result.attention_seconds / max(len(steps), 1):.3f} s per step in {args.mode} layers)")
    else:
        lines.append("attention    share not measured (--compile)")
    lines.append(f"peak memory  {result.peak_memory_bytes / 2**30:.2f} GiB (GPU, allocated)"
                 if result.peak_memory_bytes is not None else "peak memory  n/a (CPU run)")
    lines.append(f"wrote        {out} ({len(result.frames)} frames, {args.height}x{args.width}, {args.fps} fps)"
                 + (f" and {len(pngs)} PNGs in {args.frames_dir}" if pngs else ""))
    log("\n".join(lines))
    print(out)
    return 0
