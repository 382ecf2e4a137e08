"""The side-by-side demo's logic (``app.py`` is its Gradio page): one Wan 2.1 pipeline, one prompt and
seed, several attention modes, and each video's fidelity to the BF16 one.

    engine = DemoEngine.load("tiny")                       # or a diffusers-format Wan 2.1 folder
    runs = engine.run("a corgi surfing a wave", modes=["bf16", "sage3", "attn_qat"], height=64, width=64,
                      frames=5, steps=4, seed=0, out_dir="out/")
    runs[1].psnr, runs[1].ssim, runs[1].video, runs[1].strip

Metrics, over the frames of a mode's video against the BF16 video of the same seed (uint8 RGB):

- PSNR: ``10 log10(255^2 / MSE)`` of each frame, averaged over frames (``inf`` for identical frames);
- SSIM: Wang et al. 2004's SSIM with an 11x11 Gaussian window (sigma 1.5), K1 = 0.01, K2 = 0.03,
  on the luma (BT.601) of each frame, averaged over frames;
- a difference strip: the mode's frames on top, ``|frame - bf16 frame|`` (mean over RGB) as a heat
  map below, every frame side by side. All strips of one request share one colour scale, 0 to the
  smallest power of two (at least 1, at most 256) above every mode's 99.9th-percentile difference,
  so strips of different modes compare and small differences stay visible.

Weights: the pipeline is loaded once; switching modes only swaps attention processors
(:func:`~attnqat.pipelines.patch_attention`). With a QAT checkpoint, Attn-QAT runs on the QAT weights
and every other mode on the base weights: both weight sets are kept as CPU state dicts and copied
into the one transformer with ``load_state_dict`` when the mode needs the other set. The trade-off:
two extra copies of the transformer's weights in host memory (1.3B in bf16: 2 x 2.6 GiB; 14B: 2 x 28 GiB)
and one host-to-device copy per swap, instead of a second transformer in GPU memory.
"""
from __future__ import annotations

import math
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["DEMO_MODES", "MODE_LABELS", "HEAT_MAX", "ModeRun", "DemoEngine", "psnr", "ssim", "difference_strip",
           "heat_colors", "heat_scale", "demo_modes", "mode_label", "validate_request"]

#: The modes the demo compares, in page order; only those registered in attnqat.kernels appear.
DEMO_MODES = ("bf16", "sage3", "attn_qat", "nvfp4")
MODE_LABELS = {
    "bf16": "BF16 (reference)",
    "sage3": "SageAttention3 (emulated)",
    "attn_qat": "Attn-QAT",
    "nvfp4": "naive NVFP4",
    "attn_qat_dropin": "Attn-QAT drop-in (ablation)",
    "sagebwd": "SageBwd (INT8)",
}
NO_CHECKPOINT_LABEL = "Attn-QAT: plain FP4 attention (no QAT checkpoint)"
HEAT_MAX = 64.0  # default top of the heat map's colour scale (|difference| on the 0-255 scale)

# Per-request limits, so one visitor cannot ask the CPU-only tiny demo for minutes of work.
TINY_LIMITS = dict(height=256, width=256, frames=33, steps=50)
REAL_LIMITS = dict(height=1280, width=1280, frames=81, steps=100)
KEEP_REQUESTS = 8  # output folders of the last 8 requests are kept on disk (the page may still show them)


def demo_modes(modes=None) -> list[str]:
    """The demo's modes that are registered (``modes`` defaults to :data:`DEMO_MODES`); bf16 first."""
    from attnqat.kernels import available_modes

    registered = available_modes()
    wanted = list(DEMO_MODES if modes is None else modes)
    unknown = [m for m in wanted if m not in registered]
    if modes is not None and unknown:
        raise ValueError(f"unknown attention modes {unknown}; available: {', '.join(registered)}")
    out = [m for m in wanted if m in registered]
    return ["bf16"] + [m for m in out if m != "bf16"]


def mode_label(mode: str, qat_checkpoint: str | None = None) -> str:
    if mode == "attn_qat":
        return f"Attn-QAT (QAT checkpoint {Path(qat_checkpoint).name})" if qat_checkpoint else NO_CHECKPOINT_LABEL
    return MODE_LABELS.get(mode, mode)


# ---------------------------------------------------------------------------------------------- metrics
from attnqat.quality import _check_videos, psnr, ssim  # noqa: E402  (defined once, with the detector)


# A perceptual dark-to-bright colour scale (anchors of matplotlib's "inferno"), interpolated in numpy
# so the demo needs no plotting library.
_HEAT_ANCHORS = np.array([[0, 0, 4], [40, 11, 84], [101, 21, 110], [159, 42, 99], [212, 72, 66],
                          [245, 125, 21], [250, 193, 39], [252, 255, 164]], dtype=np.float64)


def heat_colors(values: np.ndarray, vmax: float = HEAT_MAX) -> np.ndarray:
    """Map values in [0, vmax] (clipped) to uint8 RGB on the inferno-like scale; shape (..., 3)."""
    t = np.clip(np.asarray(values, dtype=np.float64) / vmax, 0.0, 1.0) * (len(_HEAT_ANCHORS) - 1)
    lo = np.floor(t).astype(int)
    hi = np.minimum(lo + 1, len(_HEAT_ANCHORS) - 1)
    frac = (t - lo)[..., None]
    return np.round(_HEAT_ANCHORS[lo] * (1 - frac) + _HEAT_ANCHORS[hi] * frac).astype(np.uint8)


def _abs_diff(ref: np.ndarray, x: np.ndarray) -> np.ndarray:
    return np.abs(x.astype(np.float64) - ref.astype(np.float64)).mean(axis=-1)  # (frames, H, W)


def heat_scale(refs_and_videos, percentile: float = 99.9) -> float:
    """A common top of the colour scale for several ``(ref, x)`` pairs: the smallest power of two
    (1 ... 256) at or above every pair's ``percentile`` of ``|x - ref|``."""
    top = max([float(np.percentile(_abs_diff(r, x), percentile)) for r, x in refs_and_videos] or [0.0])
    return float(2 ** min(8, max(0, math.ceil(math.log2(max(top, 1.0))))))


def difference_strip(ref: np.ndarray | None, x: np.ndarray, *, vmax: float = HEAT_MAX, gap: int = 2,
                     max_frames: int = 9) -> np.ndarray:
    """One image: ``x``'s frames on top, the heat map of ``|x - ref|`` (mean over RGB) below
    (frames only when ``ref`` is None).

    At most ``max_frames`` frames, evenly spaced, side by side with ``gap`` white pixels between.
    Return: (2 H + gap, n W + (n - 1) gap, 3) uint8 (H rows without ``ref``).
    """
    if ref is not None:
        _check_videos(ref, x)
    n = len(x)
    idx = np.unique(np.linspace(0, n - 1, min(n, max_frames)).round().astype(int))
    h, w = x.shape[1:3]
    rows = h if ref is None else 2 * h + gap
    out = np.full((rows, len(idx) * w + (len(idx) - 1) * gap, 3), 255, dtype=np.uint8)
    diff = None if ref is None else _abs_diff(ref, x)
    for j, i in enumerate(idx):
        c = j * (w + gap)
        out[:h, c:c + w] = x[i]
        if diff is not None:
            out[h + gap:, c:c + w] = heat_colors(diff[i], vmax)
    return out


# ---------------------------------------------------------------------------------------------- engine
def validate_request(*, model: str, prompt: str, height: int, width: int, frames: int, steps: int, seed: int,
                     modes: list[str]) -> None:
    """Raise ``ValueError`` with a message for the page if the request is not valid.

    Size and frame rules (and their messages with the nearest valid values) are the ``generate``
    command's own (:func:`attnqat.pipelines.generate.resolve_settings`); the demo adds upper limits.
    """
    import argparse

    from attnqat.pipelines import is_tiny
    from attnqat.pipelines.generate import resolve_settings

    values = dict(height=height, width=width, frames=frames, steps=steps, seed=seed)
    for k, v in values.items():
        if v is None or float(v) != int(v):
            raise ValueError(f"{k} must be a whole number, got {v!r}")
    if not (prompt or "").strip():
        raise ValueError("the prompt is empty")
    if not modes:
        raise ValueError("no attention mode selected")
    for mode in modes:
        ns = argparse.Namespace(prompt=prompt, height=int(height), width=int(width), frames=int(frames),
                                steps=int(steps), guidance=None, flow_shift=None, fps=16, mode=mode,
                                layers="self", model=model, device="cpu", dtype="fp32", offload=False,
                                qat_checkpoint=None)
        try:
            resolve_settings(ns)
        except ValueError as e:  # its messages name CLI flags (--height 70 ...); the page has fields
            raise ValueError(str(e).replace("--", "")) from None
    limits = TINY_LIMITS if is_tiny(model) else REAL_LIMITS
    for k, top in limits.items():
        if int(values[k]) > top:
            raise ValueError(f"{k} {int(values[k])} is above this demo's limit of {top}"
                             + (" for the tiny CPU model" if is_tiny(model) else ""))
    if not 0 <= int(seed) < 2 ** 63:
        raise ValueError(f"seed {int(seed)} must be in [0, 2^63)")


@dataclass
class ModeRun:
    """One mode's video and its measurements."""
    mode: str
    label: str
    video: Path                          # mp4
    strip: Path                          # PNG: frames over |difference| vs bf16 (bf16 itself: frames only)
    frames: np.ndarray = field(repr=False)
    seconds: float                       # the pipeline call (text encoding, denoising, VAE decoding)
    denoise_seconds: float
    attention_seconds: float | None
    psnr: float | None                   # against bf16; None for bf16 itself
    ssim: float | None
    psnr_frames: list[float] = field(default_factory=list)
    ssim_frames: list[float] = field(default_factory=list)
    heat_max: float | None = None        # top of the strip's colour scale (None for bf16)

    def summary(self) -> dict:
        """JSON-friendly metrics (``inf`` PSNR as the string "inf")."""
        def num(v):
            return None if v is None else ("inf" if np.isinf(v) else round(v, 4))
        return {"label": self.label, "seconds": round(self.seconds, 3), "denoise_seconds": round(self.denoise_seconds, 3),
                "attention_seconds": None if self.attention_seconds is None else round(self.attention_seconds, 3),
                "psnr_db": num(self.psnr), "ssim": num(self.ssim),
                "psnr_db_per_frame": [num(v) for v in self.psnr_frames],
                "ssim_per_frame": [num(v) for v in self.ssim_frames],
                "heat_max": self.heat_max, "frames": int(self.frames.shape[0]), "height": int(self.frames.shape[1]),
                "width": int(self.frames.shape[2])}


class DemoEngine:
    """A loaded Wan 2.1 pipeline that generates one prompt and seed in several attention modes.

    Not for concurrent use from several threads at once (the pipeline is shared); :meth:`run`
    takes a lock, and the Gradio app also queues requests one at a time.
    """

    def __init__(self, pipe, *, model: str, device: torch.device, dtype: torch.dtype,
                 qat_checkpoint: str | None = None, guidance: float = 5.0):
        self.pipe, self.model, self.device, self.dtype = pipe, model, device, dtype
        self.qat_checkpoint, self.guidance = qat_checkpoint, guidance
        self._lock = threading.Lock()
        self._weights = {"base": self._snapshot()}
        self._live = "base"
        if qat_checkpoint:
            from attnqat.pipelines import load_qat_checkpoint

            load_qat_checkpoint(pipe.transformer, qat_checkpoint)  # validates keys and shapes
            self._weights["qat"] = self._snapshot()
            self._live = "qat"
        from attnqat.pipelines import AttentionTimer

        self.timer = AttentionTimer()

    @classmethod
    def load(cls, model: str = "tiny", *, qat_checkpoint: str | None = None, device: str | None = None,
             dtype: str | None = None) -> "DemoEngine":
        """Load the pipeline once. ``device`` defaults to cuda if available; ``dtype`` ("bf16", "fp16",
        "fp32") to bf16 on GPU and under the Triton interpreter (the FP4 kernels take 16-bit inputs),
        else fp32 (CPU runs each mode's PyTorch reference)."""
        from attnqat.kernels import backend_info
        from attnqat.pipelines import is_tiny, load_pipeline
        from attnqat.pipelines.generate import DTYPES, REAL_DEFAULTS, TINY_DEFAULTS

        dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda requested but no CUDA GPU is available; use --device cpu")
        if dtype is None:
            dtype = "bf16" if dev.type == "cuda" or backend_info(dev)["interpreter"] else "fp32"
        if dtype not in DTYPES:
            raise ValueError(f"--dtype {dtype!r} not in {sorted(DTYPES)}")
        defaults = TINY_DEFAULTS if is_tiny(model) else REAL_DEFAULTS
        pipe = load_pipeline(model, dtype=DTYPES[dtype], device=dev, flow_shift=defaults["flow_shift"])
        pipe.set_progress_bar_config(disable=True)
        return cls(pipe, model=model, device=dev, dtype=DTYPES[dtype], qat_checkpoint=qat_checkpoint,
                   guidance=defaults["guidance"])

    def _snapshot(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().to("cpu", copy=True) for k, v in self.pipe.transformer.state_dict().items()}

    def _use_weights(self, name: str) -> None:
        if self._live != name:
            self.pipe.transformer.load_state_dict(self._weights[name], strict=True)
            self._live = name

    def label(self, mode: str) -> str:
        return mode_label(mode, self.qat_checkpoint)

    def run(self, prompt: str, *, modes: list[str], height: int, width: int, frames: int, steps: int,
            seed: int, out_dir: str | Path, progress=None) -> list[ModeRun]:
        """Generate ``prompt`` with ``seed`` in bf16 and every other mode of ``modes``; bf16 comes first
        (the reference of the metrics). ``progress(i, n, mode)`` is called before each mode."""
        from attnqat.pipelines import patch_attention
        from attnqat.pipelines.generate import FPS, generate_video, write_mp4

        modes = ["bf16"] + [m for m in dict.fromkeys(modes) if m != "bf16"]
        validate_request(model=self.model, prompt=prompt, height=height, width=width, frames=frames, steps=steps,
                         seed=seed, modes=modes)
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        runs: list[ModeRun] = []
        with self._lock:
            for i, mode in enumerate(modes):
                if progress is not None:
                    progress(i, len(modes), mode)
                self._use_weights("qat" if mode == "attn_qat" and "qat" in self._weights else "base")
                patch_attention(self.pipe.transformer, mode, timer=self.timer)
                result = generate_video(self.pipe, prompt, height=int(height), width=int(width), frames=int(frames),
                                        steps=int(steps), guidance=self.guidance, seed=int(seed), timer=self.timer,
                                        device=self.device)
                video = write_mp4(result.frames, out_dir / f"{mode}.mp4", fps=FPS)
                run = ModeRun(mode=mode, label=self.label(mode), video=video, strip=out_dir / f"{mode}_strip.png",
                              frames=result.frames, seconds=result.seconds, denoise_seconds=sum(result.step_seconds),
                              attention_seconds=result.attention_seconds, psnr=None, ssim=None)
                if runs:
                    run.psnr, run.psnr_frames = psnr(runs[0].frames, result.frames)
                    run.ssim, run.ssim_frames = ssim(runs[0].frames, result.frames)
                runs.append(run)
        self._write_strips(runs)
        return runs

    @staticmethod
    def _write_strips(runs: list[ModeRun]) -> None:
        import imageio.v2 as imageio

        ref = runs[0].frames
        vmax = heat_scale([(ref, r.frames) for r in runs[1:]])
        imageio.imwrite(runs[0].strip, difference_strip(None, ref))
        for r in runs[1:]:
            r.heat_max = vmax
            imageio.imwrite(r.strip, difference_strip(ref, r.frames, vmax=vmax))


def new_request_dir(root: str | Path) -> Path:
    """A fresh folder under ``root`` for one request's files; removes all but the newest
    :data:`KEEP_REQUESTS` earlier ones."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    old = sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
    for p in old[:max(0, len(old) - KEEP_REQUESTS + 1)]:
        shutil.rmtree(p, ignore_errors=True)
    d = root / f"request-{time.strftime('%Y%m%d-%H%M%S')}-{time.perf_counter_ns() % 10**6:06d}"
    d.mkdir()
    return d
