"""The side-by-side demo's logic (``app.py`` is its Gradio page): one Wan 2.1 pipeline, one prompt and
seed, several attention modes, and each video's fidelity to the BF16 one.

    engine = DemoEngine.load("tiny")        # or "mini" (the default), or a diffusers-format Wan 2.1 folder
    runs = engine.run("a corgi surfing a wave", modes=["bf16", "sage3", "attn_qat"], height=64, width=64,
                      frames=5, steps=4, seed=0, out_dir="out/")
    runs[1].psnr, runs[1].ssim, runs[1].video, runs[1].strip

Metrics, over the frames of a mode's video against the BF16 video of the same seed. They measure
the generated uint8 RGB frames *before* mp4 encoding: exactly the lossless PNG frames the demo
offers for download (``{mode}_frames.zip``), not the lossy H.264 videos it plays.

- PSNR on RGB: ``10 log10(255^2 / MSE)`` of each frame, the MSE taken over every pixel and all three
  channels R, G, B (0-255), averaged over frames (``inf`` for identical frames);
- SSIM on luma: Wang et al. 2004's SSIM with an 11x11 Gaussian window (sigma 1.5), K1 = 0.01,
  K2 = 0.03, L = 255, on each frame's BT.601 luma Y = 0.299 R + 0.587 G + 0.114 B, averaged over
  frames;
- a difference strip: the mode's frames on top, ``|frame - bf16 frame|`` (mean over RGB) as a heat
  map below, every frame side by side. All strips of one request share one colour scale, 0 to the
  smallest power of two (at least 1, at most 256) above every mode's 99.9th-percentile difference,
  so strips of different modes compare and small differences stay visible. (While a request runs,
  each finished mode's strip uses the scale of the modes finished so far; the last step redraws the
  strips whose scale changed.)

Precision schedule: ``run(high_precision_steps=k)`` runs the first and the last ``k`` denoising
steps of every mode but bf16 in bf16 attention (a
:class:`~attnqat.pipelines.PrecisionSchedule`; SageAttention3's authors recommend it), the other
steps in the column's own mode. 0 (the default) is the plain mode at every step.

Limits of one request (:func:`validate_request`): each size within the page's sliders, and the
work ``height x width x frames x steps x modes`` within :data:`WORK_LIMITS`, named by a request of
that much work. Cancelling a request stops it at its next denoising step (``run(cancel=...)``).

Files: each request gets its own folder, made by :func:`new_request_dir` in
``OUT_DIR/attnqat-demo-requests/`` and marked as the app's (a marker file that lists every file the
app writes there, recorded before it is written). Only the newest :data:`KEEP_REQUESTS` are kept,
and pruning deletes only what a marker lists, in folders the app named and marked: a folder of the
user's, or a file someone added, is never deleted.

Weights: the pipeline is loaded once; switching modes only swaps attention processors
(:func:`~attnqat.pipelines.patch_attention`). With a QAT checkpoint (by default, for mini, the QAT
fine-tune shipped with it), Attn-QAT runs on the QAT weights and every other mode on the base weights:
both weight sets are kept as CPU state dicts and copied into the one transformer with
``load_state_dict`` when the mode needs the other set. The trade-off:
two extra copies of the transformer's weights in host memory (1.3B in bf16: 2 x 2.6 GiB; 14B: 2 x 28 GiB)
and one host-to-device copy per swap, instead of a second transformer in GPU memory.
"""
from __future__ import annotations

import io
import json
import math
import os
import re
import secrets
import threading
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from attnqat.checks import check_device, check_text, check_video_size
from attnqat.errors import GenerationCancelled
from attnqat.kernels import (REFERENCE_MODE, available_modes, backend_info, describe_qk_options, mode_of,
                             reference_first)
from attnqat.outputs import write_file_atomically
from attnqat.pipelines import (AttentionTimer, PrecisionSchedule, is_tiny, load_pipeline, load_qat_checkpoint,
                               patch_attention)
from attnqat.pipelines.generate import (DTYPE_NAMES, FPS, generate_video, is_mini_model, model_defaults, torch_dtype,
                                        write_mp4)
from attnqat.pipelines.loading import choose_qat_checkpoint, cpu_state_dict, trained_mode_options
from attnqat.mini.model import default_model, vocabulary_note
from attnqat.mini.quality import _check_videos, curve_summary, psnr, ssim  # the metrics, defined with the detector

__all__ = ["DEMO_MODES", "HEAT_MAX", "ModeRun", "DemoEngine", "psnr_frames_line",
           "difference_strip",
           "heat_colors", "heat_scale", "demo_modes", "mode_label", "mode_weights", "validate_request", "request_work",
           "page_defaults", "new_request_dir", "prune_requests", "register_output", "WORK_LIMITS", "SIZE_LIMITS",
           "model_kind",
           "REQUESTS_FOLDER", "KEEP_REQUESTS", "MAX_PROMPT_CHARS", "RequestLine", "LINE_WAITING", "PER_CLIENT"]

#: The modes the demo compares, in page order: those whose record has a ``demo_column``.
DEMO_MODES = tuple(sorted(available_modes(lambda m: m.demo_column is not None),
                          key=lambda name: mode_of(name).demo_column))
NO_CHECKPOINT_LABEL = "Attn-QAT (base weights)"
HEAT_MAX = 64.0  # default top of the heat map's colour scale (|difference| on the 0-255 scale)

# Per-request limits, so one visitor cannot ask the CPU-only tiny demo for minutes of work: each
# size (the page's sliders), and the work of the whole request (below). Per kind of model
# (:func:`model_kind`): tiny, mini (its largest training size, 33x256x256, and up to 50 steps), real.
TINY_LIMITS = dict(height=256, width=256, frames=33, steps=50)
MINI_LIMITS = dict(height=256, width=256, frames=33, steps=50)
REAL_LIMITS = dict(height=1280, width=1280, frames=81, steps=100)
SIZE_LIMITS = {"tiny": TINY_LIMITS, "mini": MINI_LIMITS, "real": REAL_LIMITS}
# The work of a request: height x width x frames x steps x modes ("pixel-frame-steps"); a step's cost
# grows at least linearly in each factor. Each limit is the work of the request named beside it.
WORK_LIMITS = {
    "tiny": (dict(height=128, width=128, frames=17, steps=20, modes=4),
             "about a minute for the tiny model on a 2-core CPU"),
    "mini": (dict(height=256, width=256, frames=33, steps=25, modes=4),
             "mini's GPU defaults, its larger training size, in all four modes"),
    "real": (dict(height=720, width=1280, frames=81, steps=50, modes=4),
             "Wan 2.1's largest trained size, 81 frames, 50 steps, in all four modes"),
}
MAX_PROMPT_CHARS = 2000  # the text encoder reads 512 tokens (about 2000 characters); the rest is cut anyway
MAX_UPLOAD = "1mb"  # the page takes no files; Gradio's upload route refuses anything larger
# The line of requests (:class:`RequestLine`): one generates, at most LINE_WAITING wait behind it (at the largest
# tiny request, 43 s each on a 2-core CPU, about six minutes of work), at most PER_CLIENT of them from one client.
LINE_WAITING = 8
PER_CLIENT = 2
KEEP_REQUESTS = 8  # output folders of the last 8 requests are kept on disk (the page may still show them)
REQUESTS_FOLDER = "attnqat-demo-requests"  # made by the app inside --out-dir; all it writes goes there
REQUEST_MARKER = ".attnqat-demo-request.json"  # in each request folder: proof the app made it, its files
_MARKER_KIND = "attnqat demo request folder"
_REQUEST_NAME = re.compile(r"^request-\d{8}-\d{6}-[0-9a-f]{8}$")  # new_request_dir's names only


def demo_modes(modes=None) -> list[str]:
    """``modes`` (default :data:`DEMO_MODES`), each a registered mode, bf16 first."""
    wanted = DEMO_MODES if modes is None else modes
    for m in wanted:
        mode_of(m)
    return reference_first(wanted)


def mode_label(mode: str, qat_checkpoint: str | None = None) -> str:
    """A column's title (its mode's ``demo_label``); the Attn-QAT column without QAT weights is
    :data:`NO_CHECKPOINT_LABEL`. Which weights a column runs on is :func:`mode_weights`."""
    record = mode_of(mode)
    if record.uses_qat_weights and not qat_checkpoint:
        return NO_CHECKPOINT_LABEL
    return record.demo_label or mode


def mode_weights(mode: str, qat_checkpoint: str | None = None, shipped: bool = False) -> str | None:
    """The weights a column runs on, where they are not the model's own: the Attn-QAT column's (``shipped``:
    ``qat_checkpoint`` is the QAT fine-tune installed with the model); None for the other columns."""
    if not mode_of(mode).uses_qat_weights:
        return None
    if not qat_checkpoint:
        return "no QAT checkpoint: plain FP4 attention"
    return f"{'the QAT fine-tune shipped with the model' if shipped else 'QAT checkpoint'} {Path(qat_checkpoint).name}"


# ---------------------------------------------------------------------------------------------- metrics
_SPARK = "▁▂▃▄▅▆▇█"  # a per-frame curve in one line of text, lowest to highest


def psnr_frames_line(per_frame: list[float]) -> str:
    """One line on a video's PSNR per frame: the worst frame, the last frame and the curve as a sparkline
    (lowest to highest of this video), e.g. ``per frame: worst 18.3 dB (frame 31), last 19.0 dB ▇▇▆▃▁``.
    Identical frames (``inf``) show as ∞ and the top of the sparkline; a NaN frame as ``?``."""
    v = np.asarray(per_frame, dtype=np.float64)
    c = curve_summary(v)
    finite = v[np.isfinite(v)]
    lo, hi = (finite.min(), finite.max()) if len(finite) else (0.0, 0.0)

    def bar(x: float) -> str:
        if np.isnan(x):
            return "?"
        if np.isinf(x) or hi == lo:
            return _SPARK[-1]
        return _SPARK[int(round((x - lo) / (hi - lo) * (len(_SPARK) - 1)))]

    def db(x: float) -> str:
        return "∞" if np.isinf(x) else f"{x:.1f} dB"

    return (f"per frame: worst {db(c['worst'])} (frame {c['worst_frame']}), last {db(c['last'])} "
            + "".join(bar(x) for x in v))


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
def model_kind(model: str) -> str:
    """Which limits and page settings a model gets: "tiny", "mini" (also a mini build's folder) or "real"."""
    return "tiny" if is_tiny(model) else "mini" if is_mini_model(model) else "real"


def page_defaults(model: str, device=None) -> dict:
    """The page's initial settings: the model's generation defaults on ``device``
    (:func:`attnqat.pipelines.generate.model_defaults`), with fewer frames and steps for the tiny
    model so that a click answers in about a second."""
    d = model_defaults(model, device)
    if model_kind(model) == "tiny":
        d.update(frames=5, steps=4)
    return d


def request_work(height: int, width: int, frames: int, steps: int, modes: int) -> int:
    """The work of a request in pixel-frame-steps: ``height x width x frames x steps x modes``."""
    return int(height) * int(width) * int(frames) * int(steps) * int(modes)


def _whole(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or float(v) != int(v):
        raise ValueError(f"{name} must be a whole number, got {v!r}")
    return int(v)


def validate_request(*, model: str, prompt: str, height: int, width: int, frames: int, steps: int, seed: int,
                     modes: list[str], high_precision_steps: int = 0) -> None:
    """Raise ``ValueError`` with a message for the page if the request is not valid.

    Size and frame rules (and their messages with the nearest valid values) are the ``generate``
    command's own (:func:`attnqat.checks.check_video_size`); the demo adds its upper limits per size
    (the sliders) and on the work of the whole request (:data:`WORK_LIMITS`).
    """
    values = {k: _whole(k, v) for k, v in dict(height=height, width=width, frames=frames, steps=steps,
                                                 seed=seed).items()}
    high_k = _whole("bf16 steps (first/last k)", high_precision_steps)
    check_text("the prompt", prompt if prompt is not None else "", max_chars=MAX_PROMPT_CHARS)
    if not isinstance(modes, (list, tuple)) or not all(isinstance(m, str) for m in modes):
        raise ValueError(f"modes must be a list of mode names, got {modes!r}"[:200])
    if not modes:
        raise ValueError("no attention mode selected")
    for mode in modes:
        mode_of(mode)
    check_video_size(values["height"], values["width"], values["frames"], values["steps"], prefix="")
    kind = model_kind(model)
    for k, top in SIZE_LIMITS[kind].items():
        if values[k] > top:
            raise ValueError(f"{k} {values[k]} is above this demo's limit of {top}"
                             + {"tiny": " for the tiny CPU model", "mini": " for the mini model"}.get(kind, ""))
    if not 0 <= values["seed"] < 2 ** 63:
        raise ValueError(f"seed {values['seed']} must be in [0, 2^63)")
    if not 0 <= high_k <= values["steps"]:
        raise ValueError(f"bf16 steps (first/last k) {high_k} must be between 0 and the {values['steps']} steps")
    work = request_work(values["height"], values["width"], values["frames"], values["steps"], len(modes))
    ref, why = WORK_LIMITS[kind]
    limit = request_work(**ref)
    if work > limit:
        raise ValueError(
            f"this request is {work / limit:.1f}x the work one request may ask for: height x width x frames x "
            f"steps x modes = {values['height']}x{values['width']}x{values['frames']}x{values['steps']}x{len(modes)}"
            f" = {work:,} pixel-frame-steps; the limit, {limit:,}, is the work of {ref['height']}x{ref['width']}, "
            f"{ref['frames']} frames, {ref['steps']} steps in {ref['modes']} modes ({why}). Use fewer steps, "
            f"frames or modes, or a smaller size")


class RequestLine:
    """The demo's requests, first come first served: one generates at a time, at most ``waiting`` wait behind it
    and at most ``per_client`` of all those come from one client, so one visitor cannot queue hours of work or
    crowd out the others. A request beyond either bound is refused at once (:meth:`join` raises ``ValueError``).

        line.join(client)           # or ValueError
        try:
            async with line.turn():     # waits for the requests ahead
                ...
        finally:
            line.leave(client)
    """

    def __init__(self, waiting: int = LINE_WAITING, per_client: int = PER_CLIENT):
        self.waiting, self.per_client = waiting, per_client
        self.clients: dict[str, int] = {}
        self._turn = None  # an asyncio.Lock, made in the server's event loop on first use (it wakes waiters in order)

    def __len__(self) -> int:
        return sum(self.clients.values())

    def join(self, client: str) -> int:
        """Admit a request of ``client``. Return: the number of requests ahead of it."""
        ahead = len(self)
        if ahead > self.waiting:
            raise ValueError(f"the demo is busy: {ahead} requests are in line (one generates, at most {self.waiting} "
                             f"wait); try again in a few minutes")
        if self.clients.get(client, 0) >= self.per_client:
            raise ValueError(f"you have {self.clients[client]} requests in line already (at most {self.per_client} "
                             f"per client); wait for one to finish, or cancel it")
        self.clients[client] = self.clients.get(client, 0) + 1
        return ahead

    def leave(self, client: str) -> None:
        """A request of ``client`` finished, failed or was cancelled (waiting or generating)."""
        left = self.clients.get(client, 0) - 1
        if left > 0:
            self.clients[client] = left
        else:
            self.clients.pop(client, None)

    def turn(self):
        """An async context manager held while a request generates."""
        import asyncio

        if self._turn is None:
            self._turn = asyncio.Lock()
        return self._turn


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
    frames_zip: Path | None = None       # the lossless frames the metrics measure, PNG in a zip
    precision: str | None = None         # the precision schedule, e.g. "bf16 on steps 0, 3 of 4 (...)"
    weights: str | None = None           # :func:`mode_weights` (None: the model's own)

    def summary(self) -> dict:
        """JSON-friendly metrics (``inf`` PSNR as the string "inf")."""
        def num(v):
            return None if v is None else ("inf" if np.isinf(v) else round(v, 4))
        return {"label": self.label, "seconds": round(self.seconds, 3), "denoise_seconds": round(self.denoise_seconds, 3),
                "attention_seconds": None if self.attention_seconds is None else round(self.attention_seconds, 3),
                "psnr_db": num(self.psnr), "ssim": num(self.ssim),
                "psnr_db_per_frame": [num(v) for v in self.psnr_frames],
                "ssim_per_frame": [num(v) for v in self.ssim_frames],
                "heat_max": self.heat_max, "precision": self.precision, "weights": self.weights,
                "frames": int(self.frames.shape[0]),
                "height": int(self.frames.shape[1]),
                "width": int(self.frames.shape[2])}


class DemoEngine:
    """A loaded Wan 2.1 pipeline that generates one prompt and seed in several attention modes.

    Not for concurrent use from several threads at once (the pipeline is shared); :meth:`run`
    takes a lock, and the Gradio app also queues requests one at a time.
    """

    def __init__(self, pipe, *, model: str, device: torch.device, dtype: torch.dtype,
                 qat_checkpoint: str | None = None, qat_shipped: bool = False, guidance: float = 5.0):
        self.pipe, self.model, self.device, self.dtype = pipe, model, device, dtype
        self.qat_checkpoint, self.qat_shipped, self.guidance = qat_checkpoint, qat_shipped, guidance
        self._lock = threading.Lock()
        self._weights = {"base": self._snapshot()}
        self._live = "base"
        # the Attn-QAT column runs its weights with the options their file records (rotation, smoothings, Four Over Six)
        self.qat_options: dict = {}
        if qat_checkpoint:
            load_qat_checkpoint(pipe.transformer, qat_checkpoint)  # validates keys and shapes
            self._weights["qat"] = self._snapshot()
            self._live = "qat"
            self.qat_options = trained_mode_options("attn_qat", qat_checkpoint)
        self.timer = AttentionTimer()

    @classmethod
    def load(cls, model: str | None = None, *, qat_checkpoint: str | None = None, device: str | None = None,
             dtype: str | None = None) -> "DemoEngine":
        """Load the pipeline once. ``model`` defaults to
        :func:`~attnqat.mini.model.default_model` ("mini"; "tiny" where its weights are not
        installed); ``device`` to cuda if available; ``dtype`` ("bf16", "fp16", "fp32") to bf16 on GPU
        and under the Triton interpreter (the FP4 kernels take 16-bit inputs), else fp32 (CPU runs each
        mode's PyTorch reference). ``qat_checkpoint``: the Attn-QAT column's weights, as
        :func:`~attnqat.pipelines.loading.choose_qat_checkpoint` picks them for attn_qat (None: the QAT
        fine-tune shipped with mini where installed, else the base weights; "none": the base weights)."""
        if model is None:
            model = default_model()
        chosen, _ = choose_qat_checkpoint(model, qat_checkpoint, "attn_qat")
        dev = check_device("--device", device)
        if dtype is None:
            dtype = "bf16" if dev.type == "cuda" or backend_info(dev)["interpreter"] else "fp32"
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"--dtype {dtype!r} not in {sorted(DTYPE_NAMES)}")
        defaults = model_defaults(model, dev)
        pipe = load_pipeline(model, dtype=torch_dtype(dtype), device=dev, flow_shift=defaults["flow_shift"])
        pipe.set_progress_bar_config(disable=True)
        return cls(pipe, model=model, device=dev, dtype=torch_dtype(dtype), qat_checkpoint=chosen,
                   qat_shipped=qat_checkpoint is None and chosen is not None, guidance=defaults["guidance"])

    def _snapshot(self) -> dict[str, torch.Tensor]:
        return cpu_state_dict(self.pipe.transformer)

    def _use_weights(self, name: str) -> None:
        if self._live != name:
            self.pipe.transformer.load_state_dict(self._weights[name], strict=True)
            self._live = name

    def label(self, mode: str) -> str:
        return mode_label(mode, self.qat_checkpoint)

    def weights(self, mode: str) -> str | None:
        said = mode_weights(mode, self.qat_checkpoint, self.qat_shipped)
        if said and self.qat_options and mode_of(mode).uses_qat_weights:
            said += f" ({'; '.join(describe_qk_options(self.qat_options))}, as its file records)"
        return said

    def vocabulary_note(self, prompt: str) -> str | None:
        """For mini, the line naming the prompt's words it does not know
        (:func:`~attnqat.mini.model.vocabulary_note`); None for other models or a prompt it knows."""
        if model_kind(self.model) != "mini":
            return None
        return vocabulary_note(self.pipe.tokenizer, prompt)

    def run(self, prompt: str, *, modes: list[str], height: int, width: int, frames: int, steps: int,
            seed: int, out_dir: str | Path, progress=None, on_run=None, cancel: threading.Event | None = None,
            high_precision_steps: int = 0) -> list[ModeRun]:
        """Generate ``prompt`` with ``seed`` in bf16 and every other mode of ``modes``; bf16 comes first
        (the reference of the metrics).

        Per mode it writes ``{mode}.mp4`` (H.264, lossy: for playing), ``{mode}_frames.zip`` (the
        lossless PNG frames the metrics are computed on) and ``{mode}_strip.png`` into ``out_dir``.

        Arguments:
            progress: ``progress(i, n, mode, step, steps)``: step 0 before mode ``i`` of ``n``
                starts, then after each of its denoising steps.
            on_run: ``on_run(run)`` as soon as a mode's files are written (the page shows its column).
            cancel: when this event is set, the run stops at the next denoising step (or before the
                next mode) with :class:`~attnqat.errors.GenerationCancelled`.
            high_precision_steps: ``k``: every mode but bf16 runs its first and last ``k`` steps in bf16
                attention (``PrecisionSchedule(first=k, last=k)``); 0: none.
        Return: the :class:`ModeRun` of every mode, bf16 first.
        """
        modes = reference_first(modes)
        validate_request(model=self.model, prompt=prompt, height=height, width=width, frames=frames, steps=steps,
                         seed=seed, modes=modes, high_precision_steps=high_precision_steps)
        k = int(high_precision_steps)
        schedule = PrecisionSchedule(first=k, last=k).for_steps(int(steps)) if k else None  # resolved once, every column
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        runs: list[ModeRun] = []

        def check_cancel():
            if cancel is not None and cancel.is_set():
                raise GenerationCancelled("the request was cancelled")

        with self._lock:
            for i, mode in enumerate(modes):
                check_cancel()
                if progress is not None:
                    progress(i, len(modes), mode, 0, int(steps))

                def on_step(done, total, i=i, mode=mode):
                    check_cancel()
                    if progress is not None:
                        progress(i, len(modes), mode, done, total)

                qat = mode_of(mode).uses_qat_weights and "qat" in self._weights
                self._use_weights("qat" if qat else "base")
                scheduled = schedule if mode != REFERENCE_MODE else None
                patch_attention(self.pipe.transformer, mode, timer=self.timer, schedule=scheduled,
                                **(self.qat_options if qat else {}))
                result = generate_video(self.pipe, prompt, height=int(height), width=int(width), frames=int(frames),
                                        steps=int(steps), guidance=self.guidance, seed=int(seed), timer=self.timer,
                                        device=self.device, on_step=on_step, schedule=scheduled)
                register_output(out_dir, f"{mode}.mp4")
                video = write_mp4(result.frames, out_dir / f"{mode}.mp4", fps=FPS)
                run = ModeRun(mode=mode, label=self.label(mode), video=video, strip=out_dir / f"{mode}_strip.png",
                              frames=result.frames, seconds=result.seconds, denoise_seconds=sum(result.step_seconds),
                              attention_seconds=result.attention_seconds, psnr=None, ssim=None,
                              frames_zip=write_frames_zip(result.frames, out_dir / f"{mode}_frames.zip"),
                              precision=None if scheduled is None else scheduled.describe(
                                  int(steps), len(self.pipe.transformer.blocks)), weights=self.weights(mode))
                if runs:
                    run.psnr, run.psnr_frames = psnr(runs[0].frames, result.frames)
                    run.ssim, run.ssim_frames = ssim(runs[0].frames, result.frames)
                runs.append(run)
                self._write_strips(runs, only=run)
                if on_run is not None:
                    on_run(run)
        self._write_strips(runs)
        return runs

    @staticmethod
    def _write_strips(runs: list[ModeRun], only: ModeRun | None = None) -> None:
        """Draw the strips of ``runs`` on their common colour scale: only ``only``'s, or every strip
        whose scale is not the common one yet."""
        ref = runs[0].frames
        vmax = heat_scale([(ref, r.frames) for r in runs[1:]])
        for r in [only] if only is not None else runs:
            scale = None if r is runs[0] else vmax  # bf16's strip shows frames only
            if only is None and r.heat_max == scale and r.strip.exists():
                continue  # already drawn on the common scale
            r.heat_max = scale
            image = difference_strip(None if r is runs[0] else ref, r.frames, vmax=vmax)
            register_output(r.strip.parent, r.strip.name)
            write_file_atomically(r.strip, lambda tmp, image=image: _write_png(tmp, image))


def _png_bytes(image: np.ndarray) -> bytes:
    import imageio.v3 as iio

    return iio.imwrite("<bytes>", image, extension=".png")


def _write_png(path: Path, image: np.ndarray) -> None:
    path.write_bytes(_png_bytes(image))


def write_frames_zip(frames: np.ndarray, path: str | Path) -> Path:
    """The frames, lossless, as ``frame_0000.png`` ... in a zip (written atomically). Return: ``path``."""
    path = Path(path)

    def write(tmp: Path) -> None:
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED) as z:  # PNG is compressed already
            for i, frame in enumerate(frames):
                z.writestr(f"frame_{i:04d}.png", _png_bytes(frame))

    register_output(path.parent, path.name)
    return write_file_atomically(path, write)


def read_frames_zip(path: str | Path) -> np.ndarray:
    """The frames of :func:`write_frames_zip`'s zip, (frames, H, W, 3) uint8."""
    import imageio.v3 as iio

    with zipfile.ZipFile(path) as z:
        names = sorted(n for n in z.namelist() if n.endswith(".png"))
        return np.stack([iio.imread(io.BytesIO(z.read(n)), extension=".png") for n in names])


# --------------------------------------------------------------------------------------- request folders
def _write_marker(folder: Path, data: dict) -> None:
    payload = json.dumps(data, indent=1).encode()
    write_file_atomically(folder / REQUEST_MARKER, lambda tmp: tmp.write_bytes(payload))


def _read_marker(folder: Path) -> dict | None:
    """The marker of a request folder the app made, or None (no marker, not a regular file, not ours)."""
    m = folder / REQUEST_MARKER
    try:
        if m.is_symlink() or not m.is_file():
            return None
        data = json.loads(m.read_text())
    except (OSError, ValueError):
        return None
    files = data.get("files") if isinstance(data, dict) else None
    if (data.get("kind") != _MARKER_KIND or not isinstance(data.get("created"), (int, float))
            or not isinstance(files, list)
            or not all(isinstance(f, str) and f not in ("", ".", "..", REQUEST_MARKER) and "/" not in f
                       and os.sep not in f for f in files)):
        return None
    return data


def register_output(folder: str | Path, name: str) -> None:
    """Record in ``folder``'s marker that the app writes ``name`` there (before writing it), so that
    pruning may delete it later. A folder without the app's marker is left alone (nothing recorded)."""
    folder = Path(folder)
    data = _read_marker(folder)
    if data is not None and name not in data["files"]:
        data["files"].append(name)
        _write_marker(folder, data)


def prune_requests(container: str | Path, keep: int = KEEP_REQUESTS) -> list[Path]:
    """Delete the app's request folders in ``container`` beyond the newest ``keep``.

    Only folders named as :func:`new_request_dir` names them and holding its marker count; in them
    only the files the marker lists are deleted, then the marker and the folder if nothing else is
    left. Anything else (other folders, files someone added, symbolic links) stays.
    Return: the folders removed."""
    container = Path(container)
    ours = []
    for p in container.iterdir():
        if p.is_symlink() or not p.is_dir() or not _REQUEST_NAME.match(p.name):
            continue
        data = _read_marker(p)
        if data is not None:
            ours.append((data["created"], p.name, p, data))
    ours.sort()
    removed = []
    for _, _, p, data in ours[:max(0, len(ours) - keep)]:
        try:
            for name in data["files"]:
                f = p / name
                if not f.is_symlink() and f.is_file():
                    f.unlink()
            if [q.name for q in p.iterdir()] == [REQUEST_MARKER]:
                (p / REQUEST_MARKER).unlink()
                p.rmdir()
                removed.append(p)
        except OSError:  # changed meanwhile or not ours to touch: left as it is, tried again next time
            continue
    return removed


def new_request_dir(root: str | Path) -> Path:
    """A fresh folder for one request's files, ``root/attnqat-demo-requests/request-<time>-<random>/``,
    marked as the app's; older request folders beyond the newest :data:`KEEP_REQUESTS` are pruned
    (:func:`prune_requests`: only the app's own folders and files)."""
    container = Path(root) / REQUESTS_FOLDER
    container.mkdir(parents=True, exist_ok=True)
    prune_requests(container, keep=KEEP_REQUESTS - 1)
    while True:
        d = container / f"request-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(4)}"
        try:
            d.mkdir()
            break
        except FileExistsError:
            continue
    _write_marker(d, {"kind": _MARKER_KIND, "created": time.time(), "files": []})
    return d
