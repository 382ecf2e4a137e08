"""The procedural corpus (attnqat/mini/corpus.py): determinism, splits, geometry, captions, parse_prompt."""
import colorsys
import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from attnqat.mini.corpus import (BACKGROUND_TONES, BACKGROUNDS, COLOURS, HELD_OUT_COLOUR_SHAPE, HELD_OUT_PAIRS,
                            HELD_OUT_SHAPE_MOTION, MOTION_DIRECTIONS, MOTIONS, OPPOSITE_MOTION, SHAPES, ClipSpec,
                            Corpus, caption, changed_captions, is_held_out, make_spec, parse_prompt, render)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def _luma(rgb) -> float:
    return 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2]


def _object_mask(video: torch.Tensor) -> torch.Tensor:
    """(..., F, H, W) bool: pixels of a clean clip (..., 3, F, H, W) that are mostly object (chroma)."""
    rgb = (video + 1) / 2
    return (rgb.amax(-4) - rgb.amin(-4)) > 0.3


# ------------------------------------------------------------------------------------------ attributes
def test_attribute_sets_are_the_documented_ones():
    assert {"circle", "square", "triangle", "diamond"} <= set(SHAPES)
    assert len(COLOURS) >= 8 and {"red", "orange", "yellow", "green", "cyan", "blue", "purple", "pink"} <= set(COLOURS)
    assert set(MOTIONS) == set(MOTION_DIRECTIONS) | {"grow", "shrink"} and len(MOTION_DIRECTIONS) == 8
    assert BACKGROUNDS == ("plain", "gradient", "stripes", "checker", "noise")
    names = list(COLOURS) + list(SHAPES) + list(MOTIONS)
    assert len(names) == len(set(names))  # a held-out pair's names say its kind


def test_objects_are_saturated_and_backgrounds_are_not():
    for name, rgb in COLOURS.items():
        _, s, v = colorsys.rgb_to_hsv(*rgb)
        assert s >= 0.6 and v * 0.85 >= 0.55, name  # 0.85: the darkest shade a clip uses
    for name, rgb in BACKGROUND_TONES.items():
        assert colorsys.rgb_to_hsv(*rgb)[1] <= 0.25, name
    # every background tone differs from the object in luma (codecs blur chroma, not luma)
    for spec in (Corpus(3).spec(i) for i in range(2000)):
        obj = _luma([c * spec.shade for c in COLOURS[spec.colour]])
        assert min(abs(_luma(t) - obj) for t in spec.bg_colours) >= 0.12, spec
    # and in rendered pixels: every background pixel is below every object colour in chroma
    video, _, specs = Corpus(3).batch(0, 24, frames=3, height=64, width=64)
    rgb = (video + 1) / 2
    chroma = rgb.amax(1) - rgb.amin(1)
    bg_only = ~F.max_pool3d(_object_mask(video).float()[:, None], (1, 5, 5), 1, (0, 2, 2))[:, 0].bool()
    assert chroma[bg_only].max() <= 0.25
    assert min(max(c) - min(c) for c in COLOURS.values()) * 0.85 >= 0.45


# ------------------------------------------------------------------------------------------- held out
def test_held_out_pairs_cover_every_colour_and_shape_once():
    assert len(HELD_OUT_COLOUR_SHAPE) * 8 == len(COLOURS) * len(SHAPES)  # 1/8 of the grid
    assert sorted(c for c, _ in HELD_OUT_COLOUR_SHAPE) == sorted(COLOURS)
    assert sorted(s for _, s in HELD_OUT_COLOUR_SHAPE) == sorted(SHAPES)
    assert ("blue", "square") in HELD_OUT_COLOUR_SHAPE
    assert ("square", "up") not in HELD_OUT_SHAPE_MOTION  # the README example differs from training in colour only
    assert 2 <= len(HELD_OUT_SHAPE_MOTION) <= 6
    assert set(HELD_OUT_PAIRS) == set(HELD_OUT_COLOUR_SHAPE) | set(HELD_OUT_SHAPE_MOTION)
    assert is_held_out({"colour": "blue", "shape": "square", "motion": "up", "background": "checker"})
    assert not is_held_out({"colour": "red", "shape": "square", "motion": "up"})


def test_train_split_never_holds_out_and_held_out_split_always_does():
    train = [Corpus(1, "train").spec(i) for i in range(3000)]
    assert not any(is_held_out(s) for s in train)
    held = [Corpus(1, "held_out").spec(i) for i in range(600)]
    assert all(is_held_out(s) for s in held)
    reached = {(s.colour, s.shape) for s in held} | {(s.shape, s.motion) for s in held}
    assert set(HELD_OUT_PAIRS) <= reached
    # every colour is still trained with most shapes, every shape with most colours
    pairs = {(s.colour, s.shape) for s in train}
    assert len(pairs) == len(COLOURS) * len(SHAPES) - len(HELD_OUT_COLOUR_SHAPE)


def test_attribute_coverage_and_parameter_ranges():
    specs = [Corpus(2).spec(i) for i in range(2000)]
    for attr, values in (("colour", COLOURS), ("shape", SHAPES), ("motion", MOTIONS), ("background", BACKGROUNDS)):
        assert {getattr(s, attr) for s in specs} == set(values), attr
    assert all(0.18 <= s.size <= 0.32 for s in specs)
    for s in specs:
        if s.motion in ("grow", "shrink"):
            assert s.travel == 0 and 1.7 <= max(s.end_scale, 1 / s.end_scale) <= 1.9
            assert (s.end_scale > 1) == (s.motion == "grow")
        else:
            assert 0.3 <= s.travel <= 0.55 and s.end_scale == 1


# ------------------------------------------------------------------------------------------ rendering
def test_same_index_same_clip_and_caption_different_index_differs():
    a, b = Corpus(5), Corpus(5)
    va, ca, sa = a.batch(10, 4, frames=5, height=32, width=48)
    vb, cb, sb = b.batch(10, 4, frames=5, height=32, width=48)
    assert torch.equal(va, vb) and ca == cb and sa == sb
    assert torch.equal(render(sa, frames=5, height=32, width=48), va)  # a repeated render is identical
    assert sa[0] == a.spec(10) and ca[1] == a.caption_of(11)
    assert Corpus(6).spec(10) != sa[0] and Corpus(5, "held_out").spec(10) != sa[0]
    assert not torch.equal(va[0], va[1]) and len(set(sa)) == 4


def test_corpus_does_not_touch_the_global_rng():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    Corpus(0).batch(0, 2, frames=3, height=32, width=32)
    Corpus(0).spec(7)
    caption(Corpus(0).spec(1), 4)
    assert torch.equal(torch.rand(3), expected)


def test_render_layout_range_and_dtype():
    video, captions, specs = Corpus(0).batch(0, 3, frames=9, height=40, width=64, dtype=torch.bfloat16)
    assert video.shape == (3, 3, 9, 40, 64) and video.dtype == torch.bfloat16
    assert len(captions) == len(specs) == 3
    v = render(specs, frames=9, height=40, width=64)
    assert v.dtype == torch.float32 and v.min() >= -1 and v.max() <= 1
    assert (v.float() - video.float()).abs().max() < 0.02  # bf16 rounding only
    one = render(specs[0], frames=1, height=32, width=32)
    assert one.shape == (1, 3, 1, 32, 32)
    assert torch.equal(one[0, :, 0], render(specs[0], frames=7, height=32, width=32)[0, :, 0])  # frame 0 = start


@pytest.mark.parametrize("kwargs, match", [
    (dict(frames=0, height=32, width=32), "frames 0"),
    (dict(frames=3, height=36, width=32), "height 36"),
    (dict(frames=3, height=32, width=24), "width 24"),
])
def test_render_refuses_bad_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        render([Corpus(0).spec(0)], **kwargs)


def test_bad_arguments_are_refused_by_value():
    with pytest.raises(ValueError, match="split 'test'"):
        Corpus(0, "test")
    with pytest.raises(ValueError, match="clip index -1"):
        Corpus(0).spec(-1)
    with pytest.raises(ValueError, match="shape 'hexagon'"):
        make_spec("red", "hexagon", "up", "plain")
    with pytest.raises(ValueError, match="rng_or_variant"):
        caption(Corpus(0).spec(0), "a")


@pytest.mark.parametrize("height, width", [(64, 64), (64, 128), (96, 48)])
def test_object_stays_inside_the_frame(height, width):
    video, _, _ = Corpus(4).batch(0, 64, frames=9, height=height, width=width)
    mask = _object_mask(video)  # (n, F, H, W)
    assert mask.flatten(2).any(-1).all()  # the object is in every frame
    border = mask[..., 0, :].any(-1) | mask[..., -1, :].any(-1) | mask[..., :, 0].any(-1) | mask[..., :, -1].any(-1)
    assert not border.any()


def test_geometry_is_resolution_free():
    """The same clip at 64 and 128: the 128 render averaged down 2x matches the 64 render."""
    specs = [Corpus(8).spec(i) for i in range(6)]
    small = render(specs, frames=5, height=64, width=64)
    large = render(specs, frames=5, height=128, width=128)
    down = F.avg_pool3d(large, (1, 2, 2))
    assert (down - small).abs().mean() < 0.02


@pytest.mark.parametrize("motion", ["left", "up-right", "down", "grow", "shrink"])
def test_motion_moves_the_centroid_and_scales_the_area_as_specified(motion):
    size = 128
    spec = make_spec("red", "square", motion, "plain", seed=3)
    mask = _object_mask(render(spec, frames=9, height=size, width=size))[0].float()  # (F, H, W)
    area = mask.sum((1, 2))
    ys, xs = torch.meshgrid(torch.arange(size) + 0.5, torch.arange(size) + 0.5, indexing="ij")
    cx, cy = (mask * xs).sum((1, 2)) / area, (mask * ys).sum((1, 2)) / area
    assert cx[0] / size == pytest.approx(spec.centre[0], abs=0.01)
    assert cy[0] / size == pytest.approx(spec.centre[1], abs=0.01)
    assert area[0] == pytest.approx((spec.size * size) ** 2, rel=0.05)
    dx, dy = MOTION_DIRECTIONS.get(motion, (0, 0))
    assert (cx[-1] - cx[0]) / size == pytest.approx(spec.travel * dx, abs=0.01)
    assert (cy[-1] - cy[0]) / size == pytest.approx(spec.travel * dy, abs=0.01)
    assert (area[-1] / area[0]).item() == pytest.approx(spec.end_scale ** 2, rel=0.05)
    steps = (cx[1:] - cx[:-1]) if dx else (area[1:].sqrt() - area[:-1].sqrt()) if not dy else (cy[1:] - cy[:-1])
    if motion in ("left", "up-right", "down"):
        assert steps.std() < 0.05 * steps.abs().mean()  # constant speed


def test_edges_are_antialiased():
    """Coverage ramps over about one pixel: a straight edge has one intermediate pixel per row."""
    spec = make_spec("blue", "square", "right", "plain", seed=0)
    frame = (render(spec, frames=1, height=128, width=128)[0, :, 0] + 1) / 2
    obj = torch.tensor(COLOURS["blue"]).view(3, 1, 1) * spec.shade
    bg = torch.tensor(spec.bg_colours[0]).view(3, 1, 1)
    coverage = ((frame - bg) * (obj - bg)).sum(0) / ((obj - bg) ** 2).sum()
    partial = (coverage > 0.02) & (coverage < 0.98)
    rows = partial.any(1).nonzero()[:, 0]
    middle = rows[len(rows) // 2]
    assert 1 <= partial[middle].sum() <= 3  # left and right edges: one or two partial pixels each


def test_make_spec_is_deterministic_and_takes_held_out_pairs():
    a = make_spec("blue", "square", "up", "checker", seed=1)
    assert a == make_spec("blue", "square", "up", "checker", seed=1) != make_spec("blue", "square", "up", "checker", seed=2)
    assert is_held_out(a) and isinstance(a, ClipSpec) and a.attributes["background"] == "checker"


# ------------------------------------------------------------------------------------------- captions
def test_captions_are_short_lowercase_and_varied():
    corpus = Corpus(9)
    captions = [corpus.caption_of(i) for i in range(600)]
    assert all(c == c.lower() and len(c) <= 100 for c in captions)
    assert len(set(captions)) >= 590
    spec = corpus.spec(0)
    wordings = {caption(spec, v) for v in range(60)}
    assert len(wordings) >= 30
    assert caption(spec, 3) == caption(spec, 3)
    g1, g2 = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    assert caption(spec, g1) == caption(spec, g2)
    joined = " ".join(captions)
    for word in ("moves", "slides", "drifts", "travels", "grows", "gets bigger", "expands", "shrinks", "gets smaller",
                 "ball", "disc", "box", "block", " on ", " over ", "against", "plain", "gradient", "striped",
                 "checkered", "noisy", "textured", "up and to the", "towards the top", "towards the bottom"):
        assert word in joined, word


def test_parse_prompt_recovers_the_attributes_of_every_caption():
    corpus = Corpus(10)
    missing_background = 0
    for i in range(2000):
        spec = corpus.spec(i)
        for variant in (i, i + 7919, i + 104729):
            text = caption(spec, variant)
            got = parse_prompt(text)
            for key in ("colour", "shape", "motion"):
                assert got[key] == getattr(spec, key), (text, got)
            assert got["background"] in (spec.background, None), (text, got)
            missing_background += got["background"] is None
    assert missing_background < 0.2 * 6000  # one template in eight leaves the background out


@pytest.mark.parametrize("text, expected", [
    ("a blue square moves up over a checkered background", ("blue", "square", "up", "checker")),
    ("a red ball moving left", ("red", "circle", "left", None)),
    ("Green triangle going to the upper right on a checkerboard", ("green", "triangle", "up-right", "checker")),
    ("a yellow heart drifting towards the bottom-left, noisy texture", ("yellow", "heart", "down-left", "noise")),
    ("an orange plus sign growing on a plain grey background", ("orange", "cross", "grow", "plain")),
    ("a violet star getting smaller against stripes", ("purple", "star", "shrink", "stripes")),
    ("a cyan ring heading south-east over a gradient", ("cyan", "ring", "down-right", "gradient")),
    ("a pink diamond falls", ("pink", "diamond", "down", None)),
    ("a cat", (None, None, None, None)),
])
def test_parse_prompt_reads_user_phrasings(text, expected):
    got = parse_prompt(text)
    assert (got["colour"], got["shape"], got["motion"], got["background"]) == expected


def test_every_combination_has_a_caption_that_parses_back():
    for k, (colour, shape, motion) in enumerate(itertools.product(COLOURS, SHAPES, MOTIONS)):
        spec = make_spec(colour, shape, motion, BACKGROUNDS[k % len(BACKGROUNDS)])
        got = parse_prompt(caption(spec, k))
        assert (got["colour"], got["shape"], got["motion"]) == (colour, shape, motion)


def test_changed_captions_name_one_other_attribute():
    """changed_captions: each changed caption reads back (parse_prompt) with that attribute changed and every other
    one the clip's own; the motion is the opposite one, and the opposite of the opposite is the motion again."""
    assert set(OPPOSITE_MOTION) == set(MOTIONS)
    seed, split = int(torch.randint(1000, ())), Corpus.SPLITS[int(torch.randint(len(Corpus.SPLITS), ()))]
    corpus = Corpus(seed, split)
    for index in torch.randint(100_000, (40,)).tolist():
        spec = corpus.spec(index)
        caps = changed_captions(spec, index)
        assert caps["empty"] == "" and caps["right"] == caption(spec, index)
        own = parse_prompt(caps["right"])
        assert (own["colour"], own["shape"], own["motion"]) == (spec.colour, spec.shape, spec.motion)
        for attr in ("motion", "colour", "shape"):
            read = parse_prompt(caps[attr])
            assert read[attr] != own[attr], (attr, caps[attr])
            for other in {"colour", "shape", "motion", "background"} - {attr}:
                assert read[other] == own[other], (attr, other, caps[attr], caps["right"])
        assert parse_prompt(caps["motion"])["motion"] == OPPOSITE_MOTION[spec.motion]
        assert OPPOSITE_MOTION[OPPOSITE_MOTION[spec.motion]] == spec.motion


@pytest.mark.gpu
def test_render_on_cuda_matches_cpu():
    specs = [Corpus(0).spec(i) for i in range(4)]
    cpu = render(specs, frames=5, height=64, width=64)
    gpu = render(specs, frames=5, height=64, width=64, device="cuda")
    assert gpu.is_cuda and (gpu.cpu() - cpu).abs().max() < 1e-4
    assert math.isfinite(gpu.sum().item())
