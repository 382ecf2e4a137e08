"""Prompt following and fidelity of generated videos: a detector for the corpus's clips, accuracy
against the prompt's attributes, and PSNR / SSIM between two videos.

    det = detect(video)                    # {"colour": "red", "shape": "circle", "motion": "left", ...}
    score([det, ...], [parse_prompt(p), ...])["all"]

The detector reads only pixels, never a spec. It relies on the corpus's one design rule
(:mod:`attnqat.mini.corpus`): the object is strongly saturated, the background is not. Per video:

1. **Mask.** Chroma ``max(R,G,B) - min(R,G,B)`` of every pixel; the object's chroma level is the
   90th percentile over frames of each frame's highest 3x3-averaged chroma, the background's each
   frame's median chroma (the object covers less than half a frame). The chroma mask rises from 0
   to 1 across the midpoint of the two levels (over a quarter of their gap), so it is 0.5 on the
   object's boundary. Then the mask is refined in full RGB: each pixel's position between its
   background (the temporal mean of the frames where the object is well away: backgrounds are
   static) and the object's colour. A codec keeps luma sharp and blurs chroma (4:2:0); the RGB
   projection recovers the sharp edge. No frame with at least :data:`MIN_AREA_PIXELS` of mask, or
   an object chroma below :data:`MIN_CHROMA`: ``found`` is False and every attribute None.
2. **Colour.** The hue of every pixel well inside the chroma mask (>= :data:`CORE_MASK`) votes for
   the :data:`~attnqat.mini.corpus.COLOURS` entry of the nearest hue; the majority wins.
3. **Shape.** Scale-free template matching by simulation. For up to 6 frames where the object is
   whole and large, every shape of :data:`~attnqat.mini.corpus.SHAPES` is drawn at the observed centroid
   and area on the frame's pixel grid, blurred by each of a few Gaussian widths, and turned into a
   mask the way the video was; observed and hypothesised masks are resampled about their own
   centroids, scaled by their own areas, averaged over the frames, and compared (sum of squared
   differences). The best (shape, blur) wins. Simulating the blur is what keeps a blurred triangle
   from looking like a circle; scaling by the area is what makes the match independent of size.
4. **Motion.** Least-squares lines through the centroid and the log-area over time. A centroid that
   moves less than :data:`GROW_MAX_TRAVEL` short sides while the area changes by more than
   :data:`GROW_MIN_RATIO` is ``grow`` / ``shrink``; otherwise a displacement of at least
   :data:`MIN_TRAVEL` falls in one of 8 direction sectors of 45 degrees, else the motion is None.

Measured accuracy: docs/corpus.md (``python bench/detector.py`` measures it); tests/test_quality.py
asserts the bars.

Per frame: :func:`detect_frames` reads the object's presence, colour and shape off each frame on its own
(the same masks; a frame's own colour vote and shape match), :func:`presence` turns the readings of a set
of videos into how often the asked object is there in the asked colour, frame by frame and over the last
:data:`LAST_FRAMES` frames, and :func:`curve_summary` puts a per-frame curve in a few numbers.

PSNR and SSIM (as the demo reports them), over the frames of two videos of one shape
(frames, H, W, 3), uint8 or float in [0, 1]:

- PSNR: ``10 log10(255^2 / MSE)`` of each frame on RGB, averaged over frames (``inf`` where equal);
- SSIM: Wang et al. 2004's SSIM with an 11x11 Gaussian window (sigma 1.5), K1 = 0.01, K2 = 0.03,
  on the luma (BT.601) of each frame, averaged over frames.
"""
from __future__ import annotations

import functools
import math

import numpy as np
import torch
import torch.nn.functional as F

from attnqat.mini.corpus import COLOURS, MOTION_DIRECTIONS, SHAPES, shape_sdf

__all__ = ["detect", "score", "detect_frames", "presence", "curve_summary", "object_mask", "psnr", "ssim", "degrade",
           "to_uint8_frames", "MIN_AREA_PIXELS", "MIN_TRAVEL", "GROW_MAX_TRAVEL", "GROW_MIN_RATIO", "MAX_AREA_FRACTION",
           "LAST_FRAMES"]

MIN_AREA_PIXELS = 4       # a frame with less mask than this has no object
MIN_CHROMA = 0.3          # an object's chroma level below this is no object (corpus objects: >= 0.6)
MIN_TRAVEL = 0.1          # a centroid that moves less (short sides) has no direction
GROW_MAX_TRAVEL = 0.12    # grow / shrink: the centroid moves less than this (short sides) ...
GROW_MIN_RATIO = 1.4      # ... and the area changes by more than this factor (corpus: 1.7^2 or more)
CORE_MASK = 0.75          # pixels at least this deep in the mask vote for the colour
MAX_AREA_FRACTION = 0.5   # per frame: a mask over more of the frame is a flooded background (corpus objects: < 0.4)
LAST_FRAMES = 8           # presence(): the final frames also read on their own
_CANONICAL = 33           # canonical frame of the shape match: 33 x 33 samples ...
_CANONICAL_SPAN = 1.1     # ... over +-1.1 sqrt(area); the farthest point of a unit-area corpus shape is 0.9
_SECTORS = ("right", "up-right", "up", "up-left", "left", "down-left", "down", "down-right")


# ---------------------------------------------------------------------------------------- conversions
def _frames_of(video) -> torch.Tensor:
    """(F, 3, H, W) float32 in [0, 1] from a corpus clip (3, F, H, W) float in [-1, 1] or
    (F, H, W, 3) uint8 frames."""
    v = torch.from_numpy(np.ascontiguousarray(video)) if isinstance(video, np.ndarray) else video
    if not isinstance(v, torch.Tensor):
        raise ValueError(f"video must be a torch.Tensor or numpy array, got {type(video).__name__}")
    v = v.detach().cpu()
    if v.dtype == torch.uint8 and v.ndim == 4 and v.shape[-1] == 3:
        return v.permute(0, 3, 1, 2).float() / 255
    if v.is_floating_point() and v.ndim == 4 and v.shape[0] == 3:
        return ((v.float() + 1) / 2).clamp(0, 1).permute(1, 0, 2, 3)
    raise ValueError(f"video must be (3, frames, H, W) float in [-1, 1] or (frames, H, W, 3) uint8, "
                     f"got {tuple(v.shape)} {v.dtype}")


def to_uint8_frames(video: torch.Tensor) -> np.ndarray:
    """A corpus clip (3, F, H, W) float in [-1, 1] as (F, H, W, 3) uint8, the layout diffusers and
    imageio use (rounded to the nearest level)."""
    if not (isinstance(video, torch.Tensor) and video.is_floating_point() and video.ndim == 4 and video.shape[0] == 3):
        raise ValueError(f"video must be a (3, frames, H, W) float tensor, got "
                         f"{getattr(video, 'shape', type(video).__name__)}")
    u8 = ((video.detach().float().cpu() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
    return u8.permute(1, 2, 3, 0).numpy()


def _hue_degrees(rgb: torch.Tensor) -> torch.Tensor:
    """Hue in [0, 360) of RGB values along dim -3 (any leading/trailing dims)."""
    r, g, b = rgb.unbind(-3)
    mx, mn = rgb.amax(-3), rgb.amin(-3)
    c = (mx - mn).clamp(min=1e-6)
    h = torch.where(mx == r, ((g - b) / c) % 6, torch.where(mx == g, (b - r) / c + 2, (r - g) / c + 4))
    return (h * 60) % 360


_COLOUR_NAMES = tuple(COLOURS)
_COLOUR_HUES = _hue_degrees(torch.tensor(list(COLOURS.values())).T.reshape(3, -1, 1))[:, 0]  # (colours,)


# ------------------------------------------------------------------------------------------ templates
@functools.lru_cache(maxsize=None)
def _unit_area_scale(shape: str) -> float:
    """Factor that turns the unit-coordinate shape (width 2) into one of area 1: 1 / sqrt(area)."""
    n = 1024
    c = (torch.arange(n, dtype=torch.float64) + 0.5) / n * 4 - 2  # [-2, 2]^2 holds every shape
    inside = shape_sdf(shape, c.view(1, n), c.view(n, 1)) < 0
    return 1 / math.sqrt(inside.double().mean().item() * 16)


# The blurs (Gaussian sigma, pixels) the shape match tries: a clean clip matches best at 0-0.6 (its
# one-pixel edge), the tests' degraded clips (blur 1 + 4:2:0 chroma) at 1-2. Wider blurs are left
# out: they leave too little of a 12-pixel shape (64x64) to tell one from another.
_TEMPLATE_BLURS = (0.0, 0.6, 1.0, 1.5, 2.0)
_MASK_GAIN = 4.0            # the mask rises over a quarter of the object's contrast: 0 below 3/8, 1 above 5/8
_LEVEL_QUANTILE = 0.9       # the object's contrast: this quantile over frames of each frame's peak
_MATCH_SIZE = 14            # objects larger than this (sqrt(area), pixels) are matched at a reduced resolution
_FILL_SIGMA = 3.0           # pixels: reach of the interpolation of unknown background
_SHAPE_FRAMES = 6           # frames the shape match uses at most (evenly spread over the usable ones) ...
_SHAPE_MIN_AREA = 0.5       # ... among those whose object area is at least this fraction of the largest


def _band(n: int, taps: torch.Tensor) -> torch.Tensor:
    """(n, n) matrix that convolves a length-n signal with the odd-length ``taps``, zero outside."""
    r = (len(taps) - 1) // 2
    offset = torch.arange(n).view(1, -1) - torch.arange(n).view(-1, 1) + r  # column - row + r
    inside = (offset >= 0) & (offset < len(taps))
    return torch.where(inside, taps[offset.clamp(0, len(taps) - 1)], torch.zeros(()))


def _separable(x: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
    """(N, H, W) convolved along both axes with ``taps`` (as two batched matrix products: far faster
    on a CPU than conv2d with one channel)."""
    return _band(x.shape[1], taps) @ x @ _band(x.shape[2], taps).T


def _blur(x: torch.Tensor, sigma: float) -> torch.Tensor:
    """Gaussian blur of (N, H, W) with standard deviation ``sigma`` pixels, zero outside."""
    if sigma <= 0:
        return x
    radius = max(1, math.ceil(3 * sigma))
    taps = torch.exp(-torch.arange(-radius, radius + 1, dtype=torch.float32) ** 2 / (2 * sigma ** 2))
    return _separable(x, taps / taps.sum())


def _peak(x: torch.Tensor) -> torch.Tensor:
    """(N,) highest 3x3 average of each of (N, H, W): a contrast level that one noisy pixel cannot set."""
    if max(x.shape[1:]) > 96:  # the band matrices' products cost O(side^3): pooling for whole frames
        averaged = F.avg_pool2d(x[:, None], 3, stride=1, padding=1, count_include_pad=True)[:, 0]
    else:
        averaged = _separable(x, torch.full((3,), 1 / 3))
    return averaged.flatten(1).amax(1).clamp(min=1e-6)


def _canonical(mask: torch.Tensor) -> torch.Tensor:
    """(N, S, S) masks (N, H, W) resampled about their own centroids, scaled by sqrt(their area)."""
    h, w = mask.shape[1:]
    xs = torch.arange(w, dtype=torch.float32).view(1, 1, -1)
    ys = torch.arange(h, dtype=torch.float32).view(1, -1, 1)
    area = mask.sum((1, 2)).clamp(min=1e-6)
    cx = (mask * xs).sum((1, 2)) / area
    cy = (mask * ys).sum((1, 2)) / area
    q = torch.linspace(-_CANONICAL_SPAN, _CANONICAL_SPAN, _CANONICAL)
    scale = area.sqrt().view(-1, 1, 1)
    px, py = torch.broadcast_tensors(cx.view(-1, 1, 1) + q.view(1, 1, -1) * scale,
                                     cy.view(-1, 1, 1) + q.view(1, -1, 1) * scale)  # rows y, columns x
    grid = torch.stack([(2 * px + 1) / w - 1, (2 * py + 1) / h - 1], dim=-1)
    return F.grid_sample(mask[:, None], grid, mode="bilinear", padding_mode="zeros", align_corners=False)[:, 0]


def _shape_distances(mask: torch.Tensor, cx: torch.Tensor, cy: torch.Tensor, area: torch.Tensor, *,
                     per_frame: bool = False) -> torch.Tensor:
    """(shapes, blurs) distance of the observed masks (N, H, W) of chosen frames (centroids cx, cy
    and areas (N,)) to every shape of :data:`~attnqat.mini.corpus.SHAPES` under every blur of
    :data:`_TEMPLATE_BLURS`; ``per_frame``: (shapes, blurs, N), each frame matched on its own.

    Each hypothesis goes through what the video went through: the shape is drawn on the frame's pixel
    grid at the observed centroid and area, with the corpus's one-pixel edge, blurred, normalised by
    its peak and turned into a mask by the detector's ramp (so a blurred corner is rounded, a thin
    point shortened, a small hole filled as in the video); then observed and hypothesised masks
    alike are resampled about their own centroids and scaled by their own areas, averaged over the
    frames, and compared by the sum of squared differences over the 33 x 33 canonical samples.
    """
    # Large objects are matched at a reduced resolution (cost grows with the window's pixels and the
    # blur's taps); the shapes' features stay many pixels wide.
    k = max(1, int(area.max().sqrt().item() / _MATCH_SIZE))
    if k > 1:
        mask = F.avg_pool2d(mask[:, None], k)[:, 0]
        cx, cy, area = (cx + 0.5) / k - 0.5, (cy + 0.5) / k - 0.5, area / (k * k)
    blurs = [sigma / k for sigma in _TEMPLATE_BLURS]
    n = mask.shape[0]
    # One window size for all frames (batched), around each frame's object, large enough for every
    # shape and the widest blur; the mask is zero-padded so a window may cross the frame's edge.
    reach = int(_CANONICAL_SPAN * area.max().sqrt().item() + 3 * max(blurs)) + 2
    padded = F.pad(mask, (reach, reach, reach, reach))
    x0, y0 = cx.round().long(), cy.round().long()  # window origins in padded coordinates
    side = 2 * reach + 1
    steps = torch.arange(side)
    rows = (y0.view(-1, 1) + steps.view(1, -1)).view(n, side, 1)
    cols = (x0.view(-1, 1) + steps.view(1, -1)).view(n, 1, side)
    crops = padded[torch.arange(n).view(-1, 1, 1), rows, cols]  # (n, side, side)
    observed = _canonical(crops) if per_frame else _canonical(crops).mean(0)

    # Local pixel coordinates of the window: the object's centroid sits at (reach + fraction).
    lx = (steps.view(1, 1, -1) - reach - (cx - x0).view(-1, 1, 1)).float()
    ly = (steps.view(1, -1, 1) - reach - (cy - y0).view(-1, 1, 1)).float()
    alphas = []
    for shape in SHAPES:
        half = (_unit_area_scale(shape) * area.sqrt()).view(-1, 1, 1)  # pixels per unit coordinate
        alphas.append((0.5 - shape_sdf(shape, lx / half, ly / half) * half).clamp(0, 1))
    alpha = torch.stack(alphas).view(len(SHAPES) * n, side, side)
    out = []
    for sigma in blurs:
        b = _blur(alpha, sigma)
        b = b / _peak(b).view(-1, 1, 1)  # a thin part loses contrast in the video too
        m = (0.5 + (b - 0.5) * _MASK_GAIN).clamp(0, 1)
        hypothesis = _canonical(m).view(len(SHAPES), n, _CANONICAL, _CANONICAL)
        out.append(hypothesis if per_frame else hypothesis.mean(1))
    hypotheses = torch.stack(out, 1)  # (shapes, blurs, S, S) or per frame (shapes, blurs, N, S, S)
    return ((hypotheses - observed) ** 2).sum((-2, -1))


def _object_mask(frames: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Soft object mask (F, H, W) in [0, 1] and the object's chroma level."""
    chroma = frames.amax(1) - frames.amin(1)  # (F, H, W)
    level = _peak(chroma).quantile(_LEVEL_QUANTILE).item()
    floor = chroma.flatten(1).median(1).values.view(-1, 1, 1)
    mid, width = (floor + level) / 2, (level - floor).clamp(min=1e-3) / 4
    return (0.5 + (chroma - mid) / width).clamp(0, 1), level


def _refine_mask(frames: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Coverage from full RGB: how far each pixel lies from the background towards the object's colour.

    JPEG-like codecs keep luma at full resolution but halve chroma; the chroma mask inherits that
    blur, a projection on (object - background) in RGB recovers the sharp luma edges. The background
    of a pixel is its temporal mean over the frames where the object is well away (backgrounds are
    static); pixels the object never leaves get one interpolated from nearby pixels (or, failing
    that, keep their chroma mask).
    """
    near = (mask > 0.02).float()[:, None]  # dilated by 2 pixels (two 1-D passes: cheaper than 5x5)
    near = F.max_pool2d(F.max_pool2d(near, (5, 1), stride=1, padding=(2, 0)), (1, 5), stride=1, padding=(0, 2))[:, 0] > 0
    away = (~near).float()[:, None]  # (F, 1, H, W)
    count = away.sum(0)
    background = (frames * away).sum(0) / count.clamp(min=1)  # (3, H, W): the mean of the frames away
    background = background.masked_fill(count == 0, float("nan"))
    # Pixels the object never leaves (where a shrinking object ends, where a growing one starts): their
    # background is interpolated from known pixels nearby (a normalised convolution), which is right
    # for smooth backgrounds and harmless deep inside the object.
    known = ~torch.isnan(background[0])
    if not known.all():
        weight = _blur(known.float()[None], _FILL_SIGMA)
        filled = _blur(background.nan_to_num(0) * known, _FILL_SIGMA) / weight.clamp(min=1e-6)
        background = torch.where(known | (weight < 1e-3), background, filled)
    core = mask >= 0.9
    if not core.any():
        return mask
    obj = frames.permute(1, 0, 2, 3)[:, core].median(dim=1).values.view(3, 1, 1)
    diff = obj - background
    alpha = ((frames - background) * diff).sum(1) / (diff * diff).sum(0).clamp(min=1e-4)
    alpha = alpha / _peak(alpha.nan_to_num(0)).quantile(_LEVEL_QUANTILE)
    refined = (0.5 + (alpha - 0.5) * _MASK_GAIN).clamp(0, 1)
    refined = torch.where(torch.isnan(background[0]), mask, refined)
    # A frame whose refined mask disagrees wildly with its chroma mask (a background that moved, say)
    # keeps the chroma mask.
    wild = refined.sum((1, 2)) > 1.5 * mask.sum((1, 2)) + 10
    return torch.where(wild.view(-1, 1, 1), mask, refined)


def _nearest_colours(rgb: torch.Tensor) -> torch.Tensor:
    """(P,) index into :data:`~attnqat.mini.corpus.COLOURS` of the nearest hue of each pixel of (3, P)."""
    hues = _hue_degrees(rgb.reshape(3, -1, 1))[:, 0]
    gap = (hues[:, None] - _COLOUR_HUES[None, :]).abs() % 360
    return torch.minimum(gap, 360 - gap).argmin(1)


def _centroids(mask: torch.Tensor, area: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) centroids, pixels, of the masks (F, H, W) of areas (F,)."""
    ys = torch.arange(mask.shape[1], dtype=torch.float32).view(1, -1, 1)
    xs = torch.arange(mask.shape[2], dtype=torch.float32).view(1, 1, -1)
    return (mask * xs).sum((1, 2)) / area.clamp(min=1e-6), (mask * ys).sum((1, 2)) / area.clamp(min=1e-6)


def _touches_border(mask: torch.Tensor) -> torch.Tensor:
    """(F,) bool: the solid part (>= 0.5) of each frame's mask reaches the frame's edge (the object is cut)."""
    solid = mask >= 0.5
    return solid[:, 0].any(1) | solid[:, -1].any(1) | solid[:, :, 0].any(1) | solid[:, :, -1].any(1)


def _fit_line(t: torch.Tensor, y: torch.Tensor) -> float:
    """Least-squares slope of y over t."""
    tc = t - t.mean()
    return ((tc * (y - y.mean())).sum() / (tc * tc).sum().clamp(min=1e-12)).item()


def detect(video) -> dict:
    """Colour, shape and motion of the one object of a video, from its pixels.

    Arguments:
        video: ONE video, either a corpus clip (3, frames, H, W) float in [-1, 1] (torch or numpy),
            or (frames, H, W, 3) uint8 as diffusers / imageio return. Anything else: ValueError.
    Return: {"colour": name | None, "shape": name | None, "motion": name | None, "found": bool,
    "area_ratio": float (last / first frame's object area, from a fit), "displacement": (dx, dy)
    (the centroid's motion over the clip in short sides, x right, y down)}. Names are those of
    :data:`~attnqat.mini.corpus.COLOURS`, :data:`~attnqat.mini.corpus.SHAPES`, :data:`~attnqat.mini.corpus.MOTIONS`.
    """
    frames = _frames_of(video)
    n, _, height, width = frames.shape
    short = min(height, width)
    chroma_mask, level = _object_mask(frames)
    mask = _refine_mask(frames, chroma_mask)
    area = mask.sum((1, 2))
    present = area >= MIN_AREA_PIXELS
    result = dict(colour=None, shape=None, motion=None, found=False, area_ratio=1.0, displacement=(0.0, 0.0))
    if level < MIN_CHROMA or not present.any():
        return result
    result["found"] = True

    # Colour: majority of the core pixels' nearest hues.
    rgb = frames.permute(1, 0, 2, 3)  # (3, F, H, W)
    core = chroma_mask >= CORE_MASK
    if not core.any():
        core = chroma_mask >= chroma_mask.max() * 0.9
    nearest = _nearest_colours(rgb[:, core])
    result["colour"] = _COLOUR_NAMES[torch.bincount(nearest, minlength=len(_COLOUR_NAMES)).argmax().item()]

    # Centroids and areas of the frames with an object.
    cx, cy = _centroids(mask, area)

    # Shape: from the frames where the object is whole (off the border) and large (at least half its
    # largest whole area), up to _SHAPE_FRAMES of them.
    whole = present & ~_touches_border(mask)
    if whole.any():
        idx = (whole & (area >= _SHAPE_MIN_AREA * area[whole].max())).nonzero()[:, 0]
        idx = idx[torch.linspace(0, len(idx) - 1, min(len(idx), _SHAPE_FRAMES)).round().long()]
        dist = _shape_distances(mask[idx], cx[idx], cy[idx], area[idx])
        result["shape"] = SHAPES[dist.amin(1).argmin().item()]

    # Motion from the centroid's and the log-area's lines over time.
    if present.sum() >= 2:
        t = torch.linspace(0, 1, n)[present]
        dx = _fit_line(t, cx[present]) / short
        dy = _fit_line(t, cy[present]) / short
        ratio = math.exp(_fit_line(t, area[present].log()))
        result["displacement"], result["area_ratio"] = (dx, dy), ratio
        travel = math.hypot(dx, dy)
        if travel < GROW_MAX_TRAVEL and (ratio > GROW_MIN_RATIO or ratio < 1 / GROW_MIN_RATIO):
            result["motion"] = "grow" if ratio > 1 else "shrink"
        elif travel >= MIN_TRAVEL:
            angle = math.degrees(math.atan2(-dy, dx))  # y up
            result["motion"] = _SECTORS[round(angle / 45) % 8]
    return result


def score(videos_or_detections, truths) -> dict:
    """Accuracy of detections against the attributes a prompt asked for.

    Arguments:
        videos_or_detections: a list of videos (anything :func:`detect` takes) or of its results.
        truths: a list of the same length of dicts like :func:`~attnqat.mini.corpus.parse_prompt`'s;
            attributes that are None (or missing) are not scored.
    Return: {"colour", "shape", "motion": accuracy in [0, 1] or None when never scored, "direction": the
    motion accuracy over the prompts that ask for one of the eight directions (not grow / shrink), "all":
    the fraction of videos with every scored attribute right, "n": number of videos, and "counted":
    {attribute: number scored}}.
    """
    items, truths = list(videos_or_detections), list(truths)
    if len(items) != len(truths):
        raise ValueError(f"{len(items)} videos or detections but {len(truths)} truths")
    if not items:
        raise ValueError("score needs at least one video, got none")
    keys = ("colour", "shape", "motion")
    right, counted, all_right = dict.fromkeys(keys + ("direction",), 0), dict.fromkeys(keys + ("direction",), 0), 0
    for item, truth in zip(items, truths):
        det = item if isinstance(item, dict) else detect(item)
        ok = True
        for k in keys:
            if truth.get(k) is None:
                continue
            counted[k] += 1
            hit = det.get(k) == truth[k]
            right[k] += hit
            ok &= hit
            if k == "motion" and truth[k] in MOTION_DIRECTIONS:  # the direction bar's own subset
                counted["direction"] += 1
                right["direction"] += hit
        all_right += ok
    out = {k: (right[k] / counted[k] if counted[k] else None) for k in right}
    out.update(all=all_right / len(items), n=len(items), counted=counted)
    return out


# ------------------------------------------------------------------------------------------ per frame
def object_mask(video) -> torch.Tensor:
    """The detector's soft object mask of a video, (frames, H, W) float in [0, 1] (0.5 on the object's
    boundary; step 1 of the module docstring), for a clip or frames as :func:`detect` takes them."""
    frames = _frames_of(video)
    return _refine_mask(frames, _object_mask(frames)[0])


def detect_frames(video) -> dict:
    """Colour and shape of the one object of a video, read off each frame on its own.

    The masks are :func:`detect`'s (the object's chroma level set over the whole video, so a frame whose
    object lost its saturation shows none). A frame holds the object when its chroma mask covers at
    least :data:`MIN_AREA_PIXELS` and at most :data:`MAX_AREA_FRACTION` of it (more is a background
    flooded with colour, not an object) and its own peak chroma reaches :data:`MIN_CHROMA`. Its colour
    is the majority of its core pixels' nearest hues (whatever the object's colour in the other frames);
    its shape is matched as :func:`detect` matches it, on the RGB-refined mask of that frame alone, where
    the object is whole (off the border), else None.

    Arguments:
        video: ONE video, as :func:`detect` takes it.
    Return: {"found": [bool], "colour": [name | None], "shape": [name | None], "area": [pixels of the
    chroma mask]}, one entry per frame.
    """
    frames = _frames_of(video)
    n, _, height, width = frames.shape
    chroma_mask, _ = _object_mask(frames)
    mask = _refine_mask(frames, chroma_mask)
    # Presence and colour from the chroma mask, which holds whatever the object's hue (the refined mask
    # looks for the video's one object colour, so an object that changed colour would vanish from it).
    chroma_area, area = chroma_mask.sum((1, 2)), mask.sum((1, 2))
    peak = _peak(frames.amax(1) - frames.amin(1))
    found = ((chroma_area >= MIN_AREA_PIXELS) & (chroma_area <= MAX_AREA_FRACTION * height * width)
             & (peak >= MIN_CHROMA))

    # Colour: each frame's core pixels vote (a frame without any: its most saturated ones).
    core = chroma_mask >= CORE_MASK
    faint = ~core.flatten(1).any(1)
    core[faint] = chroma_mask[faint] >= 0.9 * chroma_mask[faint].amax((1, 2), keepdim=True).clamp(min=1e-6)
    f_idx, ys, xs = core.nonzero(as_tuple=True)
    nearest = _nearest_colours(frames[f_idx, :, ys, xs].T)
    votes = torch.bincount(f_idx * len(_COLOUR_NAMES) + nearest, minlength=n * len(_COLOUR_NAMES))
    colour_idx = votes.view(n, len(_COLOUR_NAMES)).argmax(1)
    colours = [_COLOUR_NAMES[c] if ok else None for c, ok in zip(colour_idx.tolist(), found.tolist())]

    # Shape: each whole frame matched alone, in groups of one match resolution (the object may grow 2x).
    shapes: list[str | None] = [None] * n
    whole = (found & (area >= MIN_AREA_PIXELS) & ~_touches_border(mask)).nonzero()[:, 0]
    if len(whole):
        cx, cy = _centroids(mask[whole], area[whole])
        level = (area[whole].sqrt() / _MATCH_SIZE).long().clamp(min=1)
        for k in level.unique().tolist():
            pick = (level == k).nonzero()[:, 0]
            dist = _shape_distances(mask[whole[pick]], cx[pick], cy[pick], area[whole[pick]], per_frame=True)
            for i, s in zip(whole[pick].tolist(), dist.amin(1).argmin(0).tolist()):
                shapes[i] = SHAPES[s]
    return {"found": found.tolist(), "colour": colours, "shape": shapes, "area": chroma_area.tolist()}


def presence(videos_or_readings, truths, *, last: int = LAST_FRAMES) -> dict:
    """How often the asked object is there in the asked colour, frame by frame, over a set of videos.

    A frame counts when :func:`detect_frames` finds the object there in the colour the prompt asked for
    (any colour when the truth names none). The bar "the asked object present with the asked colour in
    >= X% of frames, the last 8 frames included" reads ``present``: the lower of the fraction over all
    frames and the fraction over the last ``last`` frames, so a collapse at the end cannot hide.

    Arguments:
        videos_or_readings: videos (anything :func:`detect_frames` takes) or its results, all with the
            same number of frames.
        truths: a list of the same length of dicts like :func:`~attnqat.mini.corpus.parse_prompt`'s ("colour",
            and "shape" for ``shape_per_frame``).
        last: how many final frames are also read on their own (all of them in a shorter video).
    Return: {"present", "frames": fraction of all frames of all videos, "last": the same over the last
    frames, "per_frame": [fraction of videos, at each frame], "worst_frame": index of the lowest,
    "videos_every_frame": fraction of videos right in every frame, "videos": [each video's fraction of
    frames], "shape_per_frame": [fraction of videos whose frame reads as the asked shape] (None without
    shape truths), "n", "frames_per_video", "last_frames"}.
    """
    items, truths = list(videos_or_readings), list(truths)
    if len(items) != len(truths):
        raise ValueError(f"{len(items)} videos or readings but {len(truths)} truths")
    if not items:
        raise ValueError("presence needs at least one video, got none")
    readings = [x if isinstance(x, dict) else detect_frames(x) for x in items]
    lengths = sorted({len(r["found"]) for r in readings})
    if len(lengths) != 1:
        raise ValueError(f"the videos must all have the same number of frames, got {lengths}")
    right = np.array([[f and (t.get("colour") is None or c == t["colour"]) for f, c in zip(r["found"], r["colour"])]
                      for r, t in zip(readings, truths)], dtype=np.float64)  # (videos, frames)
    n_frames, tail = lengths[0], min(max(int(last), 1), lengths[0])
    per_frame = right.mean(0)
    frames_ok, last_ok = float(right.mean()), float(right[:, -tail:].mean())
    shaped = [t.get("shape") is not None for t in truths]
    shape_per_frame = None
    if any(shaped):
        shape_right = np.array([[f and s == t["shape"] for f, s in zip(r["found"], r["shape"])]
                                for r, t, ok in zip(readings, truths, shaped) if ok], dtype=np.float64)
        shape_per_frame = shape_right.mean(0).tolist()
    return {"present": min(frames_ok, last_ok), "frames": frames_ok, "last": last_ok,
            "per_frame": per_frame.tolist(), "worst_frame": int(per_frame.argmin()),
            "videos_every_frame": float(right.all(1).mean()), "videos": right.mean(1).tolist(),
            "shape_per_frame": shape_per_frame, "n": len(readings), "frames_per_video": n_frames,
            "last_frames": tail}


def curve_summary(values, *, higher_is_better: bool = True, last: int = LAST_FRAMES) -> dict:
    """A per-frame curve in a few numbers: {"first", "middle", "last" (the final frame), "last_mean" (the
    mean of the final ``last`` frames), "mean", "worst", "worst_frame" (its index)}. The worst is the
    lowest value, or the highest when ``higher_is_better`` is False (a loss). NaN in, NaN out."""
    v = np.asarray(values, dtype=np.float64)
    if v.ndim != 1 or len(v) == 0:
        raise ValueError(f"a per-frame curve must be a non-empty list of numbers, got shape {v.shape}")
    worst = int(np.argmin(v) if higher_is_better else np.argmax(v))  # both return the first NaN, if any
    return {"first": float(v[0]), "middle": float(v[(len(v) - 1) // 2]), "last": float(v[-1]),
            "last_mean": float(v[-min(max(int(last), 1), len(v)):].mean()), "mean": float(v.mean()),
            "worst": float(v[worst]), "worst_frame": worst}


# ---------------------------------------------------------------------------------------- degradation
_JPEG_LUMA = torch.tensor([
    [16, 11, 10, 16, 24, 40, 51, 61], [12, 12, 14, 19, 26, 58, 60, 55], [14, 13, 16, 24, 40, 57, 69, 56],
    [14, 17, 22, 29, 51, 87, 80, 62], [18, 22, 37, 56, 68, 109, 103, 77], [24, 35, 55, 64, 81, 104, 113, 92],
    [49, 64, 78, 87, 103, 121, 120, 101], [72, 92, 95, 98, 112, 100, 103, 99]], dtype=torch.float32)
_JPEG_CHROMA = torch.full((8, 8), 99.0)
_JPEG_CHROMA[:4, :4] = torch.tensor([[17, 18, 24, 47], [18, 21, 26, 66], [24, 26, 56, 99], [47, 66, 99, 99]],
                                    dtype=torch.float32)


def _dct_matrix(n: int = 8) -> torch.Tensor:
    k, i = torch.arange(n, dtype=torch.float32).view(-1, 1), torch.arange(n, dtype=torch.float32).view(1, -1)
    m = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2 / n)
    m[0] /= math.sqrt(2)
    return m


def _jpeg_plane(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Quantise (N, H, W) values (0..255 scale, H and W multiples of 8) through 8x8 DCT blocks."""
    n, h, w = x.shape
    d = _dct_matrix()
    blocks = (x - 128).view(n, h // 8, 8, w // 8, 8).transpose(2, 3)  # (N, h/8, w/8, 8, 8)
    coef = d @ blocks @ d.T
    coef = torch.round(coef / table) * table
    return ((d.T @ coef @ d).transpose(2, 3).reshape(n, h, w) + 128)


def _jpeg(rgb: torch.Tensor, quality: int) -> torch.Tensor:
    """JPEG-like round trip of (N, 3, H, W) on the 0..255 scale: JFIF YCbCr, 4:2:0 chroma, 8x8 DCT
    with the IJG-scaled standard tables; no entropy coding (lossless anyway)."""
    scale = 5000 / quality if quality < 50 else 200 - 2 * quality
    luma_t = ((_JPEG_LUMA * scale + 50) // 100).clamp(1, 255)
    chroma_t = ((_JPEG_CHROMA * scale + 50) // 100).clamp(1, 255)
    n, _, h, w = rgb.shape
    ph, pw = -h % 16, -w % 16  # whole 16x16 macroblocks (4:2:0)
    x = F.pad(rgb, (0, pw, 0, ph), mode="replicate")
    r, g, b = x.unbind(1)
    y = 0.299 * r + 0.587 * g + 0.114 * b
    cb = 128 - 0.168736 * r - 0.331264 * g + 0.5 * b
    cr = 128 + 0.5 * r - 0.418688 * g - 0.081312 * b
    y = _jpeg_plane(y, luma_t)
    chroma = F.avg_pool2d(torch.stack([cb, cr], 1), 2)
    chroma = torch.stack([_jpeg_plane(chroma[:, c], chroma_t) for c in range(2)], 1)
    cb, cr = F.interpolate(chroma, scale_factor=2, mode="bilinear", align_corners=False).unbind(1)
    out = torch.stack([y + 1.402 * (cr - 128), y - 0.344136 * (cb - 128) - 0.714136 * (cr - 128),
                       y + 1.772 * (cb - 128)], 1)
    return out[:, :, :h, :w]


def _reflect_band(n: int, taps: torch.Tensor) -> torch.Tensor:
    """(n, n) matrix that convolves a length-n signal with ``taps``, reflecting at the ends (as
    ``F.pad(mode="reflect")``; n must exceed the taps' radius)."""
    r = (len(taps) - 1) // 2
    m = torch.zeros(n, n)
    rows = torch.arange(n)
    for k in range(-r, r + 1):
        cols = (rows + k).abs()
        cols = torch.where(cols > n - 1, 2 * (n - 1) - cols, cols)
        m.index_put_((rows, cols), taps[k + r].expand(n), accumulate=True)
    return m


def degrade(video: torch.Tensor, *, blur_sigma: float = 1.0, noise_std: float = 0.03, jpeg_quality: int | None = 60,
            seed: int = 0) -> torch.Tensor:
    """What a generative model and a video codec do to a clip, to test the detector's robustness:
    a Gaussian blur, Gaussian noise, then a JPEG-like compression of every frame, rounded to uint8 levels.

    Arguments:
        video: (3, F, H, W) or (N, 3, F, H, W) float in [-1, 1], the corpus layout.
        blur_sigma: standard deviation of the blur in pixels (0: none).
        noise_std: standard deviation of the noise on the [0, 1] scale (0.03 is 7.7 levels of 255).
        jpeg_quality: IJG quality 1..100, or None for no compression.
        seed: of the noise (a CPU torch.Generator).
    Return: the same shape and dtype, in [-1, 1].
    """
    if video.ndim not in (4, 5) or video.shape[-4] != 3:
        raise ValueError(f"video must be (3, F, H, W) or (N, 3, F, H, W), got {tuple(video.shape)}")
    if jpeg_quality is not None and not 1 <= jpeg_quality <= 100:
        raise ValueError(f"jpeg_quality {jpeg_quality!r} not in 1..100")
    shape, dtype, device = video.shape, video.dtype, video.device
    x = video.detach().float().cpu().reshape(-1, *shape[-4:])  # (N, 3, F, H, W)
    n, _, f, h, w = x.shape
    x = ((x + 1) * 127.5).permute(0, 2, 1, 3, 4).reshape(n * f, 3, h, w)  # (N*F, 3, H, W), 0..255
    if blur_sigma > 0:
        radius = max(1, math.ceil(3 * blur_sigma))
        taps = torch.exp(-torch.arange(-radius, radius + 1, dtype=torch.float32) ** 2 / (2 * blur_sigma ** 2))
        taps = taps / taps.sum()
        x = _reflect_band(h, taps) @ x @ _reflect_band(w, taps).T
    if noise_std > 0:
        g = torch.Generator().manual_seed(seed)
        x = x + torch.randn(x.shape, generator=g) * (noise_std * 255)
    x = x.round().clamp(0, 255)
    if jpeg_quality is not None:
        x = _jpeg(x, jpeg_quality).round().clamp(0, 255)
    x = x.view(n, f, 3, h, w).permute(0, 2, 1, 3, 4) / 127.5 - 1
    return x.reshape(shape).to(device=device, dtype=dtype)


# ------------------------------------------------------------------------------------------- PSNR/SSIM
def _check_videos(ref, x) -> None:
    if ref.shape != x.shape or ref.ndim != 4 or ref.shape[-1] != 3:
        raise ValueError(f"videos must both be (frames, height, width, 3), got {ref.shape} and {x.shape}")


def _on_255_scale(video) -> np.ndarray:
    """float64 on the 0..255 scale: uint8 as is, floats (taken to be in [0, 1]) times 255."""
    v = video.detach().cpu().numpy() if isinstance(video, torch.Tensor) else np.asarray(video)
    if v.dtype == np.uint8:
        return v.astype(np.float64)
    if np.issubdtype(v.dtype, np.floating):
        return v.astype(np.float64) * 255.0
    raise ValueError(f"videos must be uint8 or float in [0, 1], got {v.dtype}")


def psnr(ref, x) -> tuple[float, list[float]]:
    """PSNR in dB of two videos (frames, H, W, 3), uint8 or float in [0, 1], on RGB.

    Return: (mean over frames, per frame); ``inf`` for identical frames.
    """
    _check_videos(ref, x)
    a, b = _on_255_scale(ref), _on_255_scale(x)
    mse = ((a - b) ** 2).mean(axis=(1, 2, 3))
    with np.errstate(divide="ignore"):
        per_frame = np.where(mse == 0, np.inf, 10.0 * np.log10(255.0 ** 2 / np.maximum(mse, 1e-300)))
    return float(per_frame.mean()), [float(v) for v in per_frame]


def _gaussian_taps(size: int, sigma: float) -> torch.Tensor:
    """The 1-D Gaussian of the SSIM window (float64, sums to 1): the 2-D window is its outer product."""
    x = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    g = torch.exp(-x ** 2 / (2 * sigma ** 2))
    return g / g.sum()


def _luma(video: np.ndarray) -> torch.Tensor:
    v = torch.from_numpy(np.ascontiguousarray(video)).to(torch.float64)
    return 0.299 * v[..., 0] + 0.587 * v[..., 1] + 0.114 * v[..., 2]  # (frames, H, W), BT.601


def ssim(ref, x, *, window: int = 11, sigma: float = 1.5) -> tuple[float, list[float]]:
    """Gaussian-window SSIM (Wang et al. 2004) of two videos (frames, H, W, 3), uint8 or float in
    [0, 1], on luma (BT.601), with the dynamic range of 255 levels.

    Return: (mean over frames, per frame). The window shrinks (to the largest odd size that fits)
    for frames smaller than ``window`` pixels; statistics use only full windows ("valid").
    """
    _check_videos(ref, x)
    size = min(window, ref.shape[1], ref.shape[2])
    size -= 1 - size % 2
    taps, r = _gaussian_taps(size, sigma), (size - 1) // 2
    a, b = _luma(_on_255_scale(ref)), _luma(_on_255_scale(x))
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2  # K1, K2 of the paper, dynamic range L = 255
    h, w = a.shape[1], a.shape[2]

    def blur(t):  # the window's weighted mean where it fits whole ("valid"): the separable Gaussian as two
        # banded matrix products (float64 conv2d with an 11x11 kernel took ~6 s a 33x256x256 video on a CPU)
        return _separable(t, taps)[:, r:h - r, r:w - r]

    mu_a, mu_b = blur(a), blur(b)
    var_a = blur(a * a) - mu_a ** 2
    var_b = blur(b * b) - mu_b ** 2
    cov = blur(a * b) - mu_a * mu_b
    s = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a ** 2 + mu_b ** 2 + c1) * (var_a + var_b + c2))
    per_frame = s.mean(dim=(1, 2))
    return float(per_frame.mean()), [float(v) for v in per_frame]
