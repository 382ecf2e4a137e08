"""The prompt-following detector and the fidelity metrics (attnqat/quality.py).

The accuracy tests use corpus seeds 7001-7004, which the detector was never tuned on (tuning used
seeds 1-5 and 100-400).
"""
import math

import numpy as np
import pytest
import torch

from attnqat import demo
from attnqat.corpus import BACKGROUNDS, Corpus, make_spec, parse_prompt
from attnqat.quality import degrade, detect, psnr, score, ssim, to_uint8_frames


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def _accuracy(seed: int, clips: int, size: int, degraded: bool) -> dict:
    """Detector accuracy over ``clips`` clips of 17 x size x size, half from each split."""
    detections, truths, backgrounds = [], [], set()
    for split in ("train", "held_out"):
        corpus = Corpus(seed, split)
        for start in range(0, clips // 2, 16):
            video, _, specs = corpus.batch(start, min(16, clips // 2 - start), frames=17, height=size, width=size)
            if degraded:
                video = degrade(video, seed=start)
            detections += [detect(v) for v in video]
            truths += [s.attributes for s in specs]
            backgrounds |= {s.background for s in specs}
    assert backgrounds == set(BACKGROUNDS)
    assert all(d["found"] for d in detections)
    return score(detections, truths)


# ---------------------------------------------------------------------------------- detector accuracy
# The project's bar: >= 99% on colour, shape and motion of clean corpus clips at 64x64 and 128x128.
@pytest.mark.parametrize("seed, clips, size", [(7001, 320, 64), (7002, 160, 128)])
def test_detector_reads_clean_clips(seed, clips, size):
    acc = _accuracy(seed, clips, size, degraded=False)
    assert acc["n"] == clips
    for key in ("colour", "shape", "motion"):
        assert acc[key] >= 0.99, acc


# Degraded: blur sigma 1 px, noise 0.03, JPEG-like q60 with 4:2:0 chroma. At 64x64 a 12-pixel object
# keeps one chroma block of detail, so shape is the weak attribute there (docs/corpus.md: ~97-98%).
@pytest.mark.parametrize("seed, clips, size, shape_bar", [(7003, 160, 64, 0.95), (7004, 64, 128, 0.98)])
def test_detector_survives_blur_noise_and_compression(seed, clips, size, shape_bar):
    acc = _accuracy(seed, clips, size, degraded=True)
    assert acc["colour"] >= 0.99 and acc["motion"] >= 0.99, acc
    assert acc["shape"] >= shape_bar, acc


# ----------------------------------------------------------------------------------- detector contract
def test_detect_takes_corpus_and_uint8_layouts_alike():
    video, _, specs = Corpus(11).batch(0, 4, frames=9, height=64, width=64)
    for v, spec in zip(video, specs):
        a, b = detect(v), detect(to_uint8_frames(v))
        assert a["colour"] == b["colour"] == spec.colour
        assert a["shape"] == b["shape"] == spec.shape and a["motion"] == b["motion"] == spec.motion
        assert set(a) == {"colour", "shape", "motion", "found", "area_ratio", "displacement"}
        assert torch.from_numpy(to_uint8_frames(v)).shape == (9, 64, 64, 3)
    det = detect(video[0].numpy())  # numpy in the corpus layout too
    assert det["shape"] == specs[0].shape


@pytest.mark.parametrize("bad", [
    torch.zeros(9, 3, 32, 32),                      # frames first, float
    torch.zeros(3, 9, 32, 32, dtype=torch.uint8),   # corpus layout but uint8
    torch.zeros(9, 32, 32, 3),                      # frames last but float
    torch.zeros(3, 32, 32),                         # one frame
])
def test_detect_refuses_other_layouts(bad):
    with pytest.raises(ValueError, match="video must be"):
        detect(bad)


def test_detect_reports_nothing_without_an_object():
    spec = make_spec("red", "circle", "left", "checker", seed=0)
    video = Corpus.render([spec], frames=9, height=64, width=64)[0]
    blank = video.clone()
    rgb = (blank + 1) / 2
    grey = rgb.mean(0, keepdim=True).expand_as(rgb)
    det = detect(grey * 2 - 1)  # the same clip without colour: no saturated object
    assert det["found"] is False and det["colour"] is None and det["shape"] is None and det["motion"] is None


def test_detect_measures_displacement_and_area_ratio():
    right = make_spec("green", "square", "right", "plain", seed=1)
    det = detect(Corpus.render([right], frames=17, height=128, width=128)[0])
    assert det["displacement"][0] == pytest.approx(right.travel, abs=0.01)
    assert det["displacement"][1] == pytest.approx(0, abs=0.01)
    assert det["area_ratio"] == pytest.approx(1, abs=0.05)
    grow = make_spec("green", "square", "grow", "plain", seed=1)
    det = detect(Corpus.render([grow], frames=17, height=128, width=128)[0])
    assert det["area_ratio"] == pytest.approx(grow.end_scale ** 2, rel=0.05)
    assert math.hypot(*det["displacement"]) < 0.01


def test_score_counts_only_the_attributes_a_prompt_names():
    dets = [dict(colour="red", shape="circle", motion="left"), dict(colour="red", shape="square", motion="up"),
            dict(colour="blue", shape="star", motion=None)]
    truths = [parse_prompt("a red ball moves left"), parse_prompt("a red square"), dict(colour="blue", shape="heart")]
    out = score(dets, truths)
    assert out["colour"] == 1.0 and out["shape"] == pytest.approx(2 / 3) and out["motion"] == 1.0
    assert out["all"] == pytest.approx(2 / 3) and out["n"] == 3
    assert out["counted"] == {"colour": 3, "shape": 3, "motion": 1, "direction": 1}
    # direction: the motion accuracy over the eight directions only (grow / shrink are motions, not directions)
    dets = [dict(motion="left"), dict(motion="up"), dict(motion="shrink"), dict(motion="up")]
    truths = [dict(motion="left"), dict(motion="up-left"), dict(motion="shrink"), dict(motion="grow")]
    out = score(dets, truths)
    assert out["motion"] == 0.5 and out["direction"] == 0.5 and out["counted"]["direction"] == 2
    assert score(dets[2:], truths[2:])["direction"] is None  # no directional prompt: never scored
    video, captions, _ = Corpus(12).batch(0, 2, frames=9, height=64, width=64)
    assert score(list(video), [parse_prompt(c) for c in captions])["all"] == 1.0  # videos are detected
    with pytest.raises(ValueError, match="2 videos or detections but 1 truths"):
        score(list(video), [{}])


def test_degrade_is_deterministic_and_keeps_layout():
    video, _, _ = Corpus(13).batch(0, 2, frames=5, height=48, width=40)
    a, b = degrade(video, seed=3), degrade(video, seed=3)
    assert torch.equal(a, b) and a.shape == video.shape and a.dtype == video.dtype
    assert not torch.equal(a, degrade(video, seed=4))
    assert 0.01 < (a - video).abs().mean() < 0.1
    one = degrade(video[0], seed=3)  # a single clip too; 40 is not a multiple of 16 (padding inside)
    assert one.shape == video[0].shape
    plain = degrade(video, blur_sigma=0, noise_std=0, jpeg_quality=None)
    assert (plain - video).abs().max() <= 1 / 255 + 1e-6  # only the rounding to uint8 levels
    with pytest.raises(ValueError, match="jpeg_quality 0"):
        degrade(video, jpeg_quality=0)


# -------------------------------------------------------------------------------------------- PSNR/SSIM
def _ssim_numpy(a: np.ndarray, b: np.ndarray) -> float:
    """Independent SSIM: BT.601 luma, 11x11 Gaussian (sigma 1.5) by sliding windows, valid region."""
    x = np.arange(11) - 5.0
    g = np.exp(-x ** 2 / (2 * 1.5 ** 2))
    w = np.outer(g, g) / np.outer(g, g).sum()
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    scores = []
    for fa, fb in zip(a.astype(np.float64), b.astype(np.float64)):
        la, lb = fa @ [0.299, 0.587, 0.114], fb @ [0.299, 0.587, 0.114]
        wa = np.lib.stride_tricks.sliding_window_view(la, (11, 11))
        wb = np.lib.stride_tricks.sliding_window_view(lb, (11, 11))
        mu_a, mu_b = (wa * w).sum((-1, -2)), (wb * w).sum((-1, -2))
        var_a = (wa ** 2 * w).sum((-1, -2)) - mu_a ** 2
        var_b = (wb ** 2 * w).sum((-1, -2)) - mu_b ** 2
        cov = (wa * wb * w).sum((-1, -2)) - mu_a * mu_b
        s = (2 * mu_a * mu_b + c1) * (2 * cov + c2) / ((mu_a ** 2 + mu_b ** 2 + c1) * (var_a + var_b + c2))
        scores.append(s.mean())
    return float(np.mean(scores))


def test_psnr_and_ssim_of_identical_videos():
    a = np.random.default_rng(0).integers(0, 256, (3, 24, 20, 3), dtype=np.uint8)
    assert psnr(a, a)[0] == math.inf and ssim(a, a)[0] == pytest.approx(1.0)


def test_psnr_and_ssim_match_independent_computations():
    rng = np.random.default_rng(1)
    video, _, _ = Corpus(14).batch(0, 1, frames=4, height=48, width=64)
    a = to_uint8_frames(video[0])
    b = np.clip(a.astype(np.int16) + rng.integers(-20, 21, a.shape), 0, 255).astype(np.uint8)
    mse = ((a.astype(np.float64) - b) ** 2).reshape(4, -1).mean(1)
    assert psnr(a, b)[0] == pytest.approx(np.mean(10 * np.log10(255 ** 2 / mse)), rel=1e-9)
    assert psnr(a, b)[1] == pytest.approx(list(10 * np.log10(255 ** 2 / mse)), rel=1e-9)
    assert ssim(a, b)[0] == pytest.approx(_ssim_numpy(a, b), abs=1e-9)
    # floats in [0, 1] are the same videos
    assert psnr(a / 255.0, b / 255.0)[0] == pytest.approx(psnr(a, b)[0], rel=1e-9)
    assert ssim(a.astype(np.float32) / 255, b / 255.0)[0] == pytest.approx(ssim(a, b)[0], abs=1e-6)


def test_demo_uses_these_metrics():
    assert demo.psnr is psnr and demo.ssim is ssim
    with pytest.raises(ValueError, match="videos must both be"):
        psnr(np.zeros((2, 8, 8, 3), np.uint8), np.zeros((2, 8, 9, 3), np.uint8))
