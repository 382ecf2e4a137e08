"""The procedural captioned-video corpus the ``mini`` model is trained on.

Every clip is one coloured shape that moves (or grows, or shrinks) at constant speed over a static
background, rendered in pure torch from a :class:`ClipSpec`, with an English caption built from the
clip's attributes::

    corpus = Corpus(seed=0, split="train")
    video, captions, specs = corpus.batch(0, 16, frames=33, height=256, width=256, device="cuda")
    video.shape           # (16, 3, 33, 256, 256), float in [-1, 1]
    captions[0]           # e.g. "a red ball slides to the left over a checkered background"

Attributes (the four a caption names and :func:`parse_prompt` reads back):

- ``colour``: one of :data:`COLOURS`, eight strongly saturated colours (HSV saturation >= 0.7,
  value >= 0.61 after shading);
- ``shape``: one of :data:`SHAPES`;
- ``motion``: one of :data:`MOTIONS`, eight directions plus ``grow`` / ``shrink``;
- ``background``: one of :data:`BACKGROUNDS`, built from the low-saturation tones of
  :data:`BACKGROUND_TONES` (HSV saturation <= 0.25: greys, beige, cream, slate, taupe, ...).

The saturation gap is deliberate: backgrounds are never saturated and objects always are, so the
detector of :mod:`attnqat.mini.quality` finds the object from the pixels' chroma alone, whatever the
background. Each background tone also differs from the object in luma by at least
:data:`MIN_OBJECT_CONTRAST`: video codecs keep chroma at half resolution, and an object exactly as
bright as its background would keep only that blurred outline.

Geometry (resolution-free: a spec renders the same clip at any size):

- lengths are in units of the frame's short side; the start centre is in frame fractions;
- the object's size (its bounding-box width) starts in [0.18, 0.32];
- a directional motion travels 0.30 to 0.55 at constant speed (diagonals: that length along the
  diagonal); ``grow`` / ``shrink`` scale the object by 1.7x to 1.9x (or its inverse) geometrically
  about a fixed centre (the shape's centroid); the start centre is drawn so that the whole object
  stays inside the frame, with a margin, for the whole clip;
- edges are anti-aliased: coverage falls linearly over one pixel across the shape's boundary,
  computed from an exact signed distance.

Held-out combinations (:data:`HELD_OUT_PAIRS`): the ``train`` split never contains them and the
``held_out`` split contains only them, so a model trained on ``train`` can be asked for a pair it
has never seen (``"a blue square moves up over a checkered background"``).
"""
from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass, replace

import torch

__all__ = ["SHAPES", "COLOURS", "MOTIONS", "BACKGROUNDS", "BACKGROUND_TONES", "HELD_OUT_COLOUR_SHAPE",
           "HELD_OUT_SHAPE_MOTION", "HELD_OUT_PAIRS", "ClipSpec", "Corpus", "caption", "parse_prompt",
           "is_held_out", "make_spec", "render", "shape_sdf", "MOTION_DIRECTIONS", "caption_words", "WORD_SYNONYMS",
           "OPPOSITE_MOTION", "changed_captions"]

# ------------------------------------------------------------------------------------------ attributes
#: Eight shapes: 8 x 8 colours make 64 (colour, shape) pairs, so holding out one pair per colour
#: (8 pairs, 1/8 of the grid) also holds out every shape exactly once.
SHAPES = ("circle", "square", "triangle", "diamond", "ring", "cross", "star", "heart")

#: Object colours, RGB in [0, 1]. Hues (degrees): red 0, orange 30, yellow 55, green 130, cyan 185,
#: blue 229, purple 275, pink 327; HSV saturation >= 0.7 and value >= 0.72 (a clip multiplies the
#: colour by a shade in [0.85, 1], which keeps hue and saturation).
COLOURS = {
    "red": (0.90, 0.10, 0.10),
    "orange": (1.00, 0.50, 0.00),
    "yellow": (0.95, 0.88, 0.05),
    "green": (0.10, 0.72, 0.20),
    "cyan": (0.00, 0.78, 0.85),
    "blue": (0.10, 0.25, 0.92),
    "purple": (0.58, 0.15, 0.88),
    "pink": (1.00, 0.30, 0.68),
}

#: Unit vectors of the directional motions, x to the right, y downward (image convention).
_D = 1 / math.sqrt(2)
MOTION_DIRECTIONS = {
    "left": (-1.0, 0.0), "right": (1.0, 0.0), "up": (0.0, -1.0), "down": (0.0, 1.0),
    "up-left": (-_D, -_D), "up-right": (_D, -_D), "down-left": (-_D, _D), "down-right": (_D, _D),
}
MOTIONS = tuple(MOTION_DIRECTIONS) + ("grow", "shrink")

BACKGROUNDS = ("plain", "gradient", "stripes", "checker", "noise")

#: Background tones, RGB in [0, 1], HSV saturation <= 0.25 (most are pure greys).
BACKGROUND_TONES = {
    "white": (0.93, 0.93, 0.92),
    "light grey": (0.76, 0.76, 0.76),
    "grey": (0.52, 0.52, 0.52),
    "dark grey": (0.30, 0.30, 0.30),
    "charcoal": (0.14, 0.14, 0.15),
    "cream": (0.95, 0.92, 0.80),
    "beige": (0.85, 0.80, 0.68),
    "sand": (0.74, 0.68, 0.57),
    "taupe": (0.52, 0.47, 0.42),
    "slate": (0.40, 0.46, 0.52),
}

# Ranges of the continuous parameters (lengths in units of the frame's short side).
SIZE_RANGE = (0.18, 0.32)        # bounding-box width of the object at the first frame
TRAVEL_RANGE = (0.30, 0.55)      # displacement of a directional motion over the clip
GROWTH_RANGE = (1.7, 1.9)        # end/start scale of "grow" (its inverse for "shrink")
SHADE_RANGE = (0.85, 1.0)        # multiplies the object colour: some variety, same hue and saturation
TONE_JITTER = (0.92, 1.04)       # multiplies a background tone (clipped to 1)
MIN_OBJECT_CONTRAST = 0.12       # luma difference between the object and each background tone
MIN_TONE_CONTRAST = 0.2          # luma difference of a two-tone background's tones, so patterns show
STRIPE_FREQUENCY = (2.0, 5.0)    # stripe periods per short side
CHECKER_CELL = (0.08, 0.2)       # checker cell side
MARGIN = 0.03                    # the object keeps this far from the frame's edges

# ------------------------------------------------------------------------------------- held-out pairs
#: (colour, shape) pairs never in the train split: 8 of the 64 (1/8), every colour and every shape
#: exactly once (a permutation, so each colour is still seen with 7 shapes and each shape with 7
#: colours). ("blue", "square") is the README's example of compositional generalisation.
HELD_OUT_COLOUR_SHAPE = (
    ("red", "triangle"), ("orange", "ring"), ("yellow", "heart"), ("green", "diamond"),
    ("cyan", "cross"), ("blue", "square"), ("purple", "circle"), ("pink", "star"),
)
#: (shape, motion) pairs never in the train split: 4 of the 80; each of these shapes still makes the
#: other 9 motions and each motion is still made by the other 7 shapes. (square, up) stays in train so
#: that the README's held-out example is new only in the pairing of its colour and shape.
HELD_OUT_SHAPE_MOTION = (("circle", "up-right"), ("triangle", "shrink"), ("diamond", "left"), ("cross", "grow"))
#: All held-out pairs; names of colours, shapes and motions never collide, so a pair says its own kind.
HELD_OUT_PAIRS = HELD_OUT_COLOUR_SHAPE + HELD_OUT_SHAPE_MOTION


@dataclass(frozen=True)
class ClipSpec:
    """Everything that defines one clip; :func:`render` turns it into pixels at any size.

    Lengths are in units of the frame's short side, positions in frame fractions (x right, y down).
    """
    colour: str
    shape: str
    motion: str
    background: str
    centre: tuple[float, float]      # object's centroid at the first frame, frame fractions
    size: float                      # bounding-box width at the first frame
    travel: float                    # displacement over the clip (0 for grow / shrink)
    end_scale: float                 # size at the last frame / size at the first (1 for directions)
    shade: float                     # the object's RGB is COLOURS[colour] * shade
    bg_tones: tuple[str, str]        # tone names; the second equals the first for "plain"
    bg_colours: tuple[tuple[float, float, float], tuple[float, float, float]]  # jittered tones, RGB
    bg_angle: float                  # direction of gradient and stripes, radians
    bg_frequency: float              # stripe periods per short side
    bg_cell: float                   # checker cell side
    bg_phase: float                  # offset of stripes / checker, in periods (cells)
    noise_seed: int                  # seeds the noise texture's sinusoids

    @property
    def attributes(self) -> dict[str, str]:
        """The four named attributes, as :func:`parse_prompt` returns them."""
        return {"colour": self.colour, "shape": self.shape, "motion": self.motion, "background": self.background}


def is_held_out(spec) -> bool:
    """Whether a spec (a :class:`ClipSpec` or a dict with the attribute names) is a held-out combination."""
    a = spec.attributes if isinstance(spec, ClipSpec) else spec
    return ((a.get("colour"), a.get("shape")) in HELD_OUT_COLOUR_SHAPE
            or (a.get("shape"), a.get("motion")) in HELD_OUT_SHAPE_MOTION)


# ------------------------------------------------------------------------------------------- sampling
def _seed_of(*parts) -> int:
    """A 63-bit seed from any parts, stable across runs and platforms (unlike ``hash``)."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class _Draws:
    """Uniform numbers from a CPU torch.Generator, drawn 32 at a time (one torch call per batch)."""

    def __init__(self, generator: torch.Generator):
        self.g, self.buf = generator, []

    def uniform(self, lo: float = 0.0, hi: float = 1.0) -> float:
        if not self.buf:
            self.buf = torch.rand(32, generator=self.g, dtype=torch.float64).tolist()
        return lo + (hi - lo) * self.buf.pop()

    def choice(self, seq):
        return seq[min(int(self.uniform() * len(seq)), len(seq) - 1)]


def _luma(rgb) -> float:
    return 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2]


def _check_name(kind: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{kind} {value!r} not in {tuple(allowed)}")


def _draw_spec(d: _Draws, colour: str, shape: str, motion: str, background: str) -> ClipSpec:
    """The continuous parameters of a clip with the given attributes, from the draws ``d``."""
    size = d.uniform(*SIZE_RANGE)
    if motion in ("grow", "shrink"):
        growth = d.uniform(*GROWTH_RANGE)
        end_scale, travel = (growth if motion == "grow" else 1 / growth), 0.0
    else:
        end_scale, travel = 1.0, d.uniform(*TRAVEL_RANGE)
    # The start centre: the object (at its largest) stays inside the unit square, margin included, at
    # both ends of its path. Valid at any aspect ratio too: a wider frame only widens the room.
    left, right, up, down = (e * size * max(1.0, end_scale) for e in _SHAPE_EXTENTS[shape])
    dx, dy = (travel * v for v in MOTION_DIRECTIONS.get(motion, (0.0, 0.0)))
    centre = []
    for lo_ext, hi_ext, disp in ((left, right, dx), (up, down, dy)):
        lo = MARGIN + lo_ext - min(0.0, disp)
        hi = 1 - MARGIN - hi_ext - max(0.0, disp)
        if hi < lo:  # cannot happen with the ranges above; guards an edit of them
            raise RuntimeError(f"no room for a {shape} of size {size:.3f} travelling {travel:.3f}")
        centre.append(d.uniform(lo, hi))
    shade = d.uniform(*SHADE_RANGE)

    # Background tones whose brightness differs from the object's: an object as bright as its
    # background is told apart by chroma alone, which video codecs keep at half resolution.
    object_luma = _luma(COLOURS[colour]) * shade
    jitter = (d.uniform(*TONE_JITTER), d.uniform(*TONE_JITTER))

    def tone(name: str, k: int) -> tuple[float, float, float]:
        return tuple(min(1.0, c * jitter[k]) for c in BACKGROUND_TONES[name])

    def usable(name: str, k: int) -> bool:
        return abs(_luma(tone(name, k)) - object_luma) >= MIN_OBJECT_CONTRAST

    tone1 = d.choice([t for t in BACKGROUND_TONES if usable(t, 0)])
    seconds = [t for t in BACKGROUND_TONES if usable(t, 1)]
    contrast = {t: abs(_luma(tone(t, 1)) - _luma(tone(tone1, 0))) for t in seconds}
    # rarely (a bright object, a dark first tone) no second tone is that far: take the farthest
    tone2 = d.choice([t for t in seconds if contrast[t] >= MIN_TONE_CONTRAST] or [max(seconds, key=contrast.get)])
    if background == "plain":
        tone2 = tone1
    bg_colours = (tone(tone1, 0), tone(tone1, 0) if background == "plain" else tone(tone2, 1))
    return ClipSpec(
        colour=colour, shape=shape, motion=motion, background=background,
        centre=(centre[0], centre[1]), size=size, travel=travel, end_scale=end_scale, shade=shade,
        bg_tones=(tone1, tone2), bg_colours=bg_colours,
        bg_angle=d.uniform(0.0, math.pi), bg_frequency=d.uniform(*STRIPE_FREQUENCY),
        bg_cell=d.uniform(*CHECKER_CELL), bg_phase=d.uniform(), noise_seed=int(d.uniform() * 2 ** 31),
    )


def make_spec(colour: str, shape: str, motion: str, background: str, *, seed: int = 0) -> ClipSpec:
    """A clip with the given attributes; its continuous parameters are drawn from ``seed``.

    For rendering the ground truth of a prompt (``make_spec(**parse_prompt(text))`` when the prompt
    names all four attributes). Held-out combinations are allowed.
    """
    for kind, value, allowed in (("colour", colour, COLOURS), ("shape", shape, SHAPES),
                                 ("motion", motion, MOTIONS), ("background", background, BACKGROUNDS)):
        _check_name(kind, value, allowed)
    g = torch.Generator().manual_seed(_seed_of("make_spec", seed, colour, shape, motion, background))
    return _draw_spec(_Draws(g), colour, shape, motion, background)


class Corpus:
    """An endless, deterministic sequence of clips: clip ``index`` is a function of (seed, split, index).

    Arguments:
        seed: selects the sequence.
        split: ``"train"`` (never a held-out combination) or ``"held_out"`` (always one, each of
            :data:`HELD_OUT_PAIRS` equally often, the other attributes uniform).
    """
    SPLITS = ("train", "held_out")

    def __init__(self, seed: int = 0, split: str = "train"):
        _check_name("split", split, self.SPLITS)
        self.seed, self.split = int(seed), split

    def __repr__(self) -> str:
        return f"Corpus(seed={self.seed}, split={self.split!r})"

    def _generator(self, index: int, purpose: str) -> torch.Generator:
        if not isinstance(index, int) or index < 0:
            raise ValueError(f"clip index {index!r} must be an int >= 0")
        return torch.Generator().manual_seed(_seed_of("corpus", purpose, self.seed, self.split, index))

    def spec(self, index: int) -> ClipSpec:
        """The spec of clip ``index``."""
        d = _Draws(self._generator(index, "spec"))
        if self.split == "train":
            while True:  # rejection: uniform over the combinations that are not held out
                attrs = dict(colour=d.choice(tuple(COLOURS)), shape=d.choice(SHAPES),
                             motion=d.choice(MOTIONS), background=d.choice(BACKGROUNDS))
                if not is_held_out(attrs):
                    break
        else:
            pair = d.choice(HELD_OUT_PAIRS)
            attrs = dict(colour=d.choice(tuple(COLOURS)), shape=None, motion=d.choice(MOTIONS),
                         background=d.choice(BACKGROUNDS))
            if pair in HELD_OUT_COLOUR_SHAPE:
                attrs["colour"], attrs["shape"] = pair
            else:
                attrs["shape"], attrs["motion"] = pair
        return _draw_spec(d, **attrs)

    def caption_of(self, index: int) -> str:
        """The caption of clip ``index`` (its wording, too, is fixed by (seed, split, index))."""
        return caption(self.spec(index), self._generator(index, "caption"))

    def batch(self, start: int, n: int, *, frames: int, height: int, width: int, device="cpu",
              dtype: torch.dtype = torch.float32):
        """Clips ``start .. start + n - 1``.

        Return: (video, captions, specs): video (n, 3, frames, height, width) in [-1, 1] on ``device``;
        captions and specs, lists of n.
        """
        if n < 1:
            raise ValueError(f"batch size n {n!r} must be >= 1")
        specs = [self.spec(i) for i in range(start, start + n)]
        captions = [self.caption_of(i) for i in range(start, start + n)]
        return render(specs, frames=frames, height=height, width=width, device=device, dtype=dtype), captions, specs

    @staticmethod
    def render(specs, *, frames: int, height: int, width: int, device="cpu", dtype: torch.dtype = torch.float32):
        """Same as the module's :func:`render`."""
        return render(specs, frames=frames, height=height, width=width, device=device, dtype=dtype)


# -------------------------------------------------------------------------------------------- shapes
# Every shape is defined in "unit" coordinates: bounding-box width 2 (x in [-1, 1]), y downward, the
# origin at the shape's centroid (so grow/shrink about it leaves the centroid fixed). A clip scales
# the unit shape by size / 2.
_TRIANGLE = ((0.0, -1.2), (1.0, 0.6), (-1.0, 0.6))   # apex up, height 1.8; centroid 1/3 up from the base
_STAR_OUTER = 1 / math.sin(math.radians(72))         # outer radius that makes the width 2
_STAR = tuple((r * math.cos(math.radians(-90 + 36 * k)), r * math.sin(math.radians(-90 + 36 * k)))
              for k in range(10) for r in [_STAR_OUTER * (1.0 if k % 2 == 0 else 0.5)])  # inner radius 1/2
_RING_INNER = 0.5                                    # hole radius / outer radius
_CROSS_ARM = 0.3                                     # half-width of the cross's arms (wider ones blur into a diamond)
# The heart is Inigo Quilez's (a square on its tip, two half-discs on its upper sides): in its own
# coordinates (y up, tip at the origin) it spans x in +-(1/4 + sqrt(2)/4), y in [0, 3/4 + sqrt(2)/4]
# and its centroid is at y = (1/4 + pi/8 * (3/4 + sqrt(2)/(3 pi))) / (1/2 + pi/8).
_HEART_HALF_WIDTH = 0.25 + math.sqrt(2) / 4
_HEART_TOP = 0.75 + math.sqrt(2) / 4
_HEART_CENTROID = (0.25 + math.pi / 8 * (0.75 + math.sqrt(2) / (3 * math.pi))) / (0.5 + math.pi / 8)
_HEART_SCALE = 1 / _HEART_HALF_WIDTH                 # heart units -> unit coordinates

#: Extent of each shape from its centroid, in units of its size: (left, right, up, down).
_SHAPE_EXTENTS = {
    "circle": (0.5, 0.5, 0.5, 0.5), "square": (0.5, 0.5, 0.5, 0.5), "diamond": (0.5, 0.5, 0.5, 0.5),
    "ring": (0.5, 0.5, 0.5, 0.5), "cross": (0.5, 0.5, 0.5, 0.5),
    "triangle": (0.5, 0.5, 0.6, 0.3),
    "star": (0.5, 0.5, _STAR_OUTER / 2, _STAR_OUTER * math.cos(math.radians(36)) / 2),
    "heart": (0.5, 0.5, (_HEART_TOP - _HEART_CENTROID) * _HEART_SCALE / 2, _HEART_CENTROID * _HEART_SCALE / 2),
}


def _box_sdf(x, y, half_w: float, half_h: float):
    qx, qy = x.abs() - half_w, y.abs() - half_h
    outside = torch.sqrt(qx.clamp(min=0) ** 2 + qy.clamp(min=0) ** 2)
    return outside + torch.maximum(qx, qy).clamp(max=0)


def _polygon_sdf(x, y, vertices):
    """Exact signed distance to a simple polygon (Inigo Quilez's sdPolygon); negative inside."""
    v0x, v0y = vertices[0]
    dist2 = (x - v0x) ** 2 + (y - v0y) ** 2
    sign = torch.ones_like(x)
    for i in range(len(vertices)):
        (vix, viy), (vjx, vjy) = vertices[i], vertices[i - 1]
        ex, ey = vjx - vix, vjy - viy
        wx, wy = x - vix, y - viy
        h = ((wx * ex + wy * ey) / (ex * ex + ey * ey)).clamp(0, 1)
        dist2 = torch.minimum(dist2, (wx - ex * h) ** 2 + (wy - ey * h) ** 2)
        c1, c2, c3 = y >= viy, y < vjy, ex * wy > ey * wx  # crossing test of a ray along +x
        sign = torch.where((c1 & c2 & c3) | (~c1 & ~c2 & ~c3), -sign, sign)
    return sign * torch.sqrt(dist2)


def _heart_sdf(x, y):
    """Exact signed distance to Inigo Quilez's heart (sdHeart), in unit coordinates."""
    px = x.abs() / _HEART_SCALE
    py = _HEART_CENTROID - y / _HEART_SCALE  # to the heart's own frame: y up, tip at the origin
    lobe = torch.sqrt((px - 0.25) ** 2 + (py - 0.75) ** 2) - math.sqrt(2) / 4
    m = 0.5 * (px + py).clamp(min=0)
    body = torch.sqrt(torch.minimum(px ** 2 + (py - 1) ** 2, (px - m) ** 2 + (py - m) ** 2)) * torch.sign(px - py)
    return torch.where(px + py > 1, lobe, body) * _HEART_SCALE


def shape_sdf(shape: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Signed distance (negative inside) to ``shape`` in unit coordinates (width 2, centroid at 0, y down)."""
    if shape == "circle":
        return torch.sqrt(x * x + y * y) - 1
    if shape == "square":
        return _box_sdf(x, y, 1.0, 1.0)
    if shape == "diamond":  # a square turned 45 degrees: exact as a box in rotated coordinates
        return _box_sdf((x + y) * _D, (y - x) * _D, _D, _D)
    if shape == "ring":
        mid, half = (1 + _RING_INNER) / 2, (1 - _RING_INNER) / 2
        return (torch.sqrt(x * x + y * y) - mid).abs() - half
    if shape == "cross":  # union of two bars; min() is exact near the boundary, where it matters
        return torch.minimum(_box_sdf(x, y, 1.0, _CROSS_ARM), _box_sdf(x, y, _CROSS_ARM, 1.0))
    if shape == "triangle":
        return _polygon_sdf(x, y, _TRIANGLE)
    if shape == "star":
        return _polygon_sdf(x, y, _STAR)
    if shape == "heart":
        return _heart_sdf(x, y)
    raise ValueError(f"shape {shape!r} not in {SHAPES}")


# --------------------------------------------------------------------------------------------- render
NOISE_WAVES = 6  # sinusoids summed into the noise texture


def _check_size(frames: int, height: int, width: int) -> None:
    if not isinstance(frames, int) or frames < 1:
        raise ValueError(f"frames {frames!r} must be an int >= 1")
    for name, v in (("height", height), ("width", width)):
        if not isinstance(v, int) or v < 32 or v % 8:
            raise ValueError(f"{name} {v!r} must be a multiple of 8 and >= 32")


def _aa_step(signed: torch.Tensor, slope_px: float | torch.Tensor) -> torch.Tensor:
    """0..1 step of a smooth periodic function at its zero crossings, one pixel wide:
    ``signed / slope_px`` approximates the signed distance in pixels near a crossing."""
    return (0.5 + 0.5 * (signed / slope_px).clamp(-1, 1))


def _backgrounds(specs, xs, ys, short: int, device) -> torch.Tensor:
    """(B, 3, H, W) background of each spec; xs (1, W), ys (H, 1) in short-side units."""
    H, W = ys.shape[0], xs.shape[1]
    out = torch.empty(len(specs), 3, H, W, device=device)
    for kind in BACKGROUNDS:
        idx = [i for i, s in enumerate(specs) if s.background == kind]
        if not idx:
            continue
        sub = [specs[i] for i in idx]
        n = len(sub)
        c0 = torch.tensor([s.bg_colours[0] for s in sub], device=device).view(n, 3, 1, 1)
        c1 = torch.tensor([s.bg_colours[1] for s in sub], device=device).view(n, 3, 1, 1)
        angle = torch.tensor([s.bg_angle for s in sub], device=device).view(n, 1, 1)
        phase = torch.tensor([s.bg_phase for s in sub], device=device).view(n, 1, 1)
        if kind == "plain":
            t = torch.zeros(n, H, W, device=device)
        elif kind == "gradient":
            # projection on the gradient's direction, spanning 0..1 over the frame's corners
            u = xs * torch.cos(angle) + ys * torch.sin(angle)
            lo, hi = u.amin(dim=(1, 2), keepdim=True), u.amax(dim=(1, 2), keepdim=True)
            t = (u - lo) / (hi - lo)
        elif kind == "stripes":
            freq = torch.tensor([s.bg_frequency for s in sub], device=device).view(n, 1, 1)
            u = xs * torch.cos(angle) + ys * torch.sin(angle)
            t = _aa_step(torch.sin(2 * math.pi * (freq * u + phase)), 2 * math.pi * freq / short)
        elif kind == "checker":
            cell = torch.tensor([s.bg_cell for s in sub], device=device).view(n, 1, 1)
            slope = math.pi / (cell * short)
            sx = _aa_step(torch.sin(math.pi * (xs / cell + phase)), slope) * 2 - 1
            sy = _aa_step(torch.sin(math.pi * (ys / cell + phase)), slope) * 2 - 1
            t = 0.5 + 0.5 * sx * sy
        else:  # noise: a smooth random texture, a sum of sinusoids of 1.5 to 4.5 periods per short side
            waves = []
            for s in sub:
                g = torch.Generator().manual_seed(s.noise_seed)
                waves.append(torch.rand(NOISE_WAVES, 3, generator=g, dtype=torch.float64))
            w = torch.stack(waves).to(device=device, dtype=torch.float32)  # (n, K, 3)
            freq = (1.5 + 3.0 * w[..., 0]).view(n, NOISE_WAVES, 1, 1)
            theta = (2 * math.pi * w[..., 1]).view(n, NOISE_WAVES, 1, 1)
            ph = (2 * math.pi * w[..., 2]).view(n, NOISE_WAVES, 1, 1)
            u = xs * torch.cos(theta) + ys * torch.sin(theta)
            total = torch.cos(2 * math.pi * freq * u + ph).sum(dim=1)  # std sqrt(K / 2)
            t = 0.5 + 0.5 * torch.tanh(total / math.sqrt(NOISE_WAVES / 2))
        out[idx] = c0 + (c1 - c0) * t[:, None]
    return out


def render(specs, *, frames: int, height: int, width: int, device="cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Render clips, vectorised over the batch and the frames (pure torch; runs where ``device`` says).

    Arguments:
        specs: a list of :class:`ClipSpec` (or one).
        frames: frames per clip, >= 1 (time runs 0..1 over them; one frame shows the start).
        height, width: multiples of 8, >= 32; lengths scale with min(height, width).
        device, dtype: of the result; computation is float32.
    Return: (len(specs), 3, frames, height, width) in [-1, 1].
    """
    if isinstance(specs, ClipSpec):
        specs = [specs]
    specs = list(specs)
    if not specs:
        raise ValueError("render needs at least one spec, got none")
    _check_size(frames, height, width)
    device = torch.device(device)
    B, short = len(specs), min(height, width)
    xs = ((torch.arange(width, device=device, dtype=torch.float32) + 0.5) / short).view(1, width)
    ys = ((torch.arange(height, device=device, dtype=torch.float32) + 0.5) / short).view(height, 1)
    t = torch.linspace(0, 1, frames, device=device)

    def per_spec(values):
        return torch.tensor(values, device=device, dtype=torch.float32).view(-1, 1)

    direction = per_spec([MOTION_DIRECTIONS.get(s.motion, (0.0, 0.0)) for s in specs]).view(B, 2)
    travel = per_spec([s.travel for s in specs])
    cx = per_spec([s.centre[0] * width / short for s in specs]) + travel * direction[:, :1] * t  # (B, F)
    cy = per_spec([s.centre[1] * height / short for s in specs]) + travel * direction[:, 1:] * t
    half = per_spec([s.size / 2 for s in specs]) * per_spec([s.end_scale for s in specs]) ** t  # (B, F)

    # Coverage: the shape's signed distance in pixels, a linear ramp one pixel wide across the edge.
    alpha = torch.empty(B, frames, height, width, device=device)
    for shape in SHAPES:
        idx = [i for i, s in enumerate(specs) if s.shape == shape]
        if not idx:
            continue
        h = half[idx][:, :, None, None]
        ux = (xs - cx[idx][:, :, None, None]) / h
        uy = (ys - cy[idx][:, :, None, None]) / h
        dist_px = shape_sdf(shape, ux, uy) * h * short
        alpha[idx] = (0.5 - dist_px).clamp(0, 1)

    colour = per_spec([[c * s.shade for c in COLOURS[s.colour]] for s in specs]).view(B, 3, 1, 1, 1)
    background = _backgrounds(specs, xs, ys, short, device)[:, :, None]  # (B, 3, 1, H, W)
    a = alpha[:, None]
    video = background + (colour - background) * a
    return (video * 2 - 1).to(dtype)


# -------------------------------------------------------------------------------------------- captions
_SHAPE_WORDS = {
    "circle": ("circle", "ball", "disc"), "square": ("square", "box", "block"), "triangle": ("triangle",),
    "diamond": ("diamond", "rhombus"), "ring": ("ring", "hoop", "donut"), "cross": ("cross", "plus sign"),
    "star": ("star",), "heart": ("heart",),
}
# Motion phrases, as (third person, gerund); "{h}" left/right, "{v}" up/down, "{vpos}" top/bottom,
# "{vadj}" upper/lower.
_STRAIGHT_H = (("moves to the {h}", "moving to the {h}"), ("slides {h}", "sliding {h}"),
               ("drifts to the {h}", "drifting to the {h}"), ("travels to the {h}", "travelling to the {h}"),
               ("moves {h}", "moving {h}"), ("glides to the {h}", "gliding to the {h}"))
_STRAIGHT_V = {
    "up": (("moves up", "moving up"), ("rises", "rising"), ("drifts upward", "drifting upward"),
           ("travels towards the top", "travelling towards the top"), ("floats up", "floating up"),
           ("slides up", "sliding up")),
    "down": (("moves down", "moving down"), ("sinks", "sinking"), ("drifts downward", "drifting downward"),
             ("travels towards the bottom", "travelling towards the bottom"), ("falls", "falling"),
             ("slides down", "sliding down")),
}
_DIAGONAL = (("moves {v} and to the {h}", "moving {v} and to the {h}"),
             ("drifts towards the {vpos} {h}", "drifting towards the {vpos} {h}"),
             ("travels to the {vadj} {h}", "travelling to the {vadj} {h}"),
             ("slides diagonally {v} and {h}", "sliding diagonally {v} and {h}"),
             ("moves {v}-{h}", "moving {v}-{h}"),
             ("glides {v} and to the {h}", "gliding {v} and to the {h}"))
_SIZE_CHANGE = {
    "grow": (("grows", "growing"), ("gets bigger", "getting bigger"), ("expands", "expanding"),
             ("grows larger", "growing larger"), ("becomes larger", "becoming larger")),
    "shrink": (("shrinks", "shrinking"), ("gets smaller", "getting smaller"), ("contracts", "contracting"),
               ("becomes smaller", "becoming smaller"), ("shrinks away", "shrinking away")),
}
# Background phrases: "{t}" one tone, "{t2}" "tone1 and tone2".
_BACKGROUND_WORDS = {
    "plain": ("a plain {t} background", "a plain background", "a solid {t} background", "a flat {t} background",
              "a uniform {t} background"),
    "gradient": ("a gradient background", "a {t} gradient background", "a {t2} gradient", "a smooth {t} gradient",
                 "a gradient backdrop"),
    "stripes": ("a striped background", "a {t} striped background", "{t2} stripes", "a background of {t2} stripes",
                "a striped backdrop"),
    "checker": ("a checkered background", "a {t} checkered background", "a {t2} checkerboard",
                "a checkerboard background", "a chequered backdrop"),
    "noise": ("a noisy background", "a textured background", "a mottled {t} background", "a noisy {t2} texture",
              "a textured {t} backdrop"),
}
_PREPOSITIONS = ("on", "over", "against", "in front of")
_TEMPLATES = (
    "{obj} {verb} {prep} {bg}",            # a red ball slides left over a striped background
    "{obj} on {bg}, {gerund}",             # a red ball on a striped background, sliding left
    "{bg} with {obj} that {verb}",         # a striped background with a red ball that slides left
    "{prep} {bg}, {obj} {verb}",           # over a striped background, a red ball slides left
    "{obj} {gerund} {prep} {bg}",          # a red ball sliding left over a striped background
    "{obj} {verb}",                        # a red ball slides left (the background is left open)
    "the {colour} {shape} {verb} {prep} {bg}",
    "{bg}; {obj} {verb}",
)
MAX_CAPTION = 100


def _article(phrase: str) -> str:
    return ("an " if phrase[0] in "aeiou" else "a ") + phrase


def _motion_phrase(motion: str, d: _Draws) -> tuple[str, str]:
    if motion in _SIZE_CHANGE:
        return d.choice(_SIZE_CHANGE[motion])
    if motion in _STRAIGHT_V:
        return d.choice(_STRAIGHT_V[motion])
    if motion in ("left", "right"):
        verb, gerund = d.choice(_STRAIGHT_H)
        return verb.format(h=motion), gerund.format(h=motion)
    v, h = motion.split("-")
    words = dict(v=v, h=h, vpos="top" if v == "up" else "bottom", vadj="upper" if v == "up" else "lower")
    verb, gerund = d.choice(_DIAGONAL)
    return verb.format(**words), gerund.format(**words)


def caption(spec: ClipSpec, rng_or_variant: int | torch.Generator = 0) -> str:
    """An English caption of a clip: lowercase, at most 100 characters, built from its attributes.

    Arguments:
        spec: the clip.
        rng_or_variant: an int (the same int picks the same template and synonyms) or a CPU
            ``torch.Generator`` to draw the wording from.
    Return: e.g. ``"a red ball slides to the left over a checkered background"``; one template in
    eight leaves the background out.
    """
    if isinstance(rng_or_variant, torch.Generator):
        d = _Draws(rng_or_variant)
    elif isinstance(rng_or_variant, int):
        d = _Draws(torch.Generator().manual_seed(_seed_of("caption", rng_or_variant)))
    else:
        raise ValueError(f"rng_or_variant {rng_or_variant!r} must be an int or a torch.Generator")
    template = d.choice(_TEMPLATES)
    shape = d.choice(_SHAPE_WORDS[spec.shape])
    verb, gerund = _motion_phrase(spec.motion, d)
    bg_template, prep = d.choice(_BACKGROUND_WORDS[spec.background]), d.choice(_PREPOSITIONS)
    t1, t2 = spec.bg_tones
    tones = dict(t=t1, t2=f"{t1} and {t2}" if t2 != t1 else t1)
    # Shorter wordings if the tones make it too long: one tone, then none.
    for bg_tones in (tones, dict(t=t1, t2=t1), dict(t="", t2="")):
        bg = re.sub(" +", " ", bg_template.format(**bg_tones)).replace("a  ", "a ").strip()
        if bg.startswith("a "):
            bg = _article(bg[2:])
        text = template.format(obj=_article(f"{spec.colour} {shape}"), colour=spec.colour, shape=shape,
                               verb=verb, gerund=gerund, prep=prep, bg=bg)
        if len(text) <= MAX_CAPTION:
            return text
    return text


#: Each motion's opposite: the reverse direction, grow <-> shrink.
OPPOSITE_MOTION = {"left": "right", "right": "left", "up": "down", "down": "up", "up-left": "down-right",
                   "down-right": "up-left", "up-right": "down-left", "down-left": "up-right", "grow": "shrink",
                   "shrink": "grow"}


def changed_captions(spec: ClipSpec, variant: int = 0) -> dict[str, str]:
    """A clip's caption and the same caption with ONE attribute changed, to ask which words a model reads.

    Every caption is ``caption(s, variant)`` of the spec ``s`` with that attribute replaced, so the template
    and the synonyms drawn are the same and only that attribute's words differ.
    Return: ``{"right": the clip's own, "motion": the opposite motion (:data:`OPPOSITE_MOTION`), "colour": the
    next colour of :data:`COLOURS`, "shape": the next shape of :data:`SHAPES`, "empty": ""}``.
    """
    colours = list(COLOURS)
    changed = {
        "right": spec,
        "motion": replace(spec, motion=OPPOSITE_MOTION[spec.motion]),
        "colour": replace(spec, colour=colours[(colours.index(spec.colour) + 1) % len(colours)]),
        "shape": replace(spec, shape=SHAPES[(SHAPES.index(spec.shape) + 1) % len(SHAPES)]),
    }
    return {**{name: caption(s, variant) for name, s in changed.items()}, "empty": ""}


def caption_words() -> list[str]:
    """Every word and punctuation mark a caption can contain, sorted (the ``mini`` model's tokenizer
    vocabulary: one token per word). Words are maximal runs of letters; "up-right" is "up", "-", "right"."""
    phrases = [*COLOURS, *BACKGROUND_TONES, *_PREPOSITIONS, "a", "an", "and"]
    phrases += [w for words in _SHAPE_WORDS.values() for w in words]
    fill = dict(h="left right", v="up down", vpos="top bottom", vadj="upper lower", t="", t2="")
    groups = [_STRAIGHT_H, *_STRAIGHT_V.values(), _DIAGONAL, *_SIZE_CHANGE.values()]
    phrases += [form.format(**fill) for group in groups for pair in group for form in pair]
    phrases += [bg.format(**fill) for bgs in _BACKGROUND_WORDS.values() for bg in bgs]
    phrases += [re.sub(r"\{\w+\}", " ", t) for t in _TEMPLATES]
    return sorted({w for phrase in phrases for w in re.findall(r"[a-z]+|[^a-z\s]", phrase)})


# ------------------------------------------------------------------------------------------- parsing
_COLOUR_SYNONYMS = {"violet": "purple", "magenta": "pink", "aqua": "cyan", "turquoise": "cyan",
                    "crimson": "red", "scarlet": "red"}
_SHAPE_SYNONYMS = {w: s for s, words in _SHAPE_WORDS.items() for w in words}
_SHAPE_SYNONYMS.update({"dot": "circle", "rectangle": "square", "rhomb": "diamond", "doughnut": "ring",
                        "plus": "cross", "pentagram": "star"})
#: Words a person may use that captions never do, and the caption word each means (the ``mini``
#: tokenizer reads them as that word, so "a violet dot" prompts like "a purple circle").
WORD_SYNONYMS = {**_COLOUR_SYNONYMS, "dot": "circle", "rectangle": "square", "rhomb": "diamond",
                 "doughnut": "donut", "pentagram": "star"}
_SHAPE_RE = re.compile(r"\b(" + "|".join(sorted(map(re.escape, _SHAPE_SYNONYMS), key=len, reverse=True))
                       + r")(?:e?s)?\b")
_COLOUR_RE = re.compile(r"\b(" + "|".join(list(COLOURS) + list(_COLOUR_SYNONYMS)) + r")\b")
_UP_RE = re.compile(r"\b(up|upward|upwards|upper|top|rises|rising|rise|ascends|ascending|climbs|climbing|higher"
                    r"|north\w*)\b")
_DOWN_RE = re.compile(r"\b(down|downward|downwards|lower|bottom|sinks|sinking|sink|falls|falling|fall|drops|dropping"
                      r"|descends|descending|south\w*)\b")
_LEFT_RE = re.compile(r"\b(left(ward|wards)?|(north|south)?west(ward|wards)?)\b")
_RIGHT_RE = re.compile(r"\b(right(ward|wards)?|(north|south)?east(ward|wards)?)\b")
_GROW_RE = re.compile(r"\b(grows?|growing|bigger|larger|expands?|expanding|enlarg\w*|swell\w*|scales? up)\b")
_SHRINK_RE = re.compile(r"\b(shrinks?|shrinking|smaller|contracts?|contracting|dwindl\w*|scales? down)\b")
_BACKGROUND_RES = (
    ("plain", re.compile(r"\b(plain|solid|uniform|flat|blank)\b")),
    ("gradient", re.compile(r"\bgradients?\b")),
    ("stripes", re.compile(r"\bstrip(e|es|ed|y)\b")),
    ("checker", re.compile(r"\b(checker\w*|chequer\w*|checked|checks)\b")),
    ("noise", re.compile(r"\b(nois(e|y)|textur(e|ed)|mottled|grainy|speckled)\b")),
)


def _last_match(regex: re.Pattern, text: str) -> int:
    """Position of the last match of ``regex`` in ``text``, -1 if none."""
    found = [m.start() for m in regex.finditer(text)]
    return found[-1] if found else -1


def parse_prompt(text: str) -> dict[str, str | None]:
    """The attributes a caption (or a user's prompt in similar words) names.

    Return: {"colour", "shape", "motion", "background"}, each a name from :data:`COLOURS`,
    :data:`SHAPES`, :data:`MOTIONS`, :data:`BACKGROUNDS`, or None when the text does not say.
    The shape is the first shape word; the colour is the colour word closest before it (else the
    first colour word); a direction combines a vertical and a horizontal word ("towards the top
    left", "up and to the right", "moving left", "upper-right").
    """
    s = " " + text.lower().replace("-", " ").replace("_", " ") + " "
    out: dict[str, str | None] = dict(colour=None, shape=None, motion=None, background=None)
    shape_match = _SHAPE_RE.search(s)
    shape_at = shape_match.start() if shape_match else len(s)
    if shape_match:
        out["shape"] = _SHAPE_SYNONYMS[shape_match.group(1)]
    colours = [(m.start(), m.group(1)) for m in _COLOUR_RE.finditer(s)]
    before = [c for c in colours if c[0] < shape_at]
    if before or colours:
        word = (before or colours)[-1 if before else 0][1]
        out["colour"] = _COLOUR_SYNONYMS.get(word, word)

    up, down = _last_match(_UP_RE, s), _last_match(_DOWN_RE, s)
    left, right = _last_match(_LEFT_RE, s), _last_match(_RIGHT_RE, s)
    vertical = None if up < 0 and down < 0 else ("up" if up > down else "down")
    horizontal = None if left < 0 and right < 0 else ("left" if left > right else "right")
    grow, shrink = _last_match(_GROW_RE, s), _last_match(_SHRINK_RE, s)
    if vertical and horizontal:
        out["motion"] = f"{vertical}-{horizontal}"
    elif vertical or horizontal:
        out["motion"] = vertical or horizontal
    if max(grow, shrink) >= 0 and out["motion"] is None:  # a direction, if named, wins over a size word
        out["motion"] = "grow" if grow > shrink else "shrink"

    for name, regex in _BACKGROUND_RES:
        if regex.search(s):
            out["background"] = name
            break
    return out
