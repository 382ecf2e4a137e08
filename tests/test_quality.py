"""The prompt-following detector and the fidelity metrics (attnqat/mini/quality.py).

The accuracy tests use corpus seeds 7001-7004, which the detector was never tuned on (tuning used
seeds 1-5 and 100-400).
"""
import math
import multiprocessing
import types
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest
import torch

from attnqat import demo
from attnqat.mini.corpus import BACKGROUNDS, Corpus, make_spec, parse_prompt
from attnqat.mini.quality import (LAST_FRAMES, MIN_AREA_PIXELS, curve_summary, degrade, detect, detect_frames,
                                  object_mask, presence, psnr, score, ssim, to_uint8_frames)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def _batch_detections(seed: int, split: str, start: int, n: int, size: int, degraded: bool):
    """The detections, true attributes and backgrounds of clips ``start .. start + n - 1`` of a split."""
    video, _, specs = Corpus(seed, split).batch(start, n, frames=17, height=size, width=size)
    if degraded:
        video = degrade(video, seed=start)
    return [detect(v) for v in video], [s.attributes for s in specs], {s.background for s in specs}


def _accuracy(seed: int, clips: int, size: int, degraded: bool) -> dict:
    """Detector accuracy over ``clips`` clips of 17 x size x size, half from each split. The batches of 16 run in
    two forked processes: one thread's work each (one_thread), and the suite has two cores."""
    batches = [(seed, split, start, min(16, clips // 2 - start), size, degraded)
               for split in ("train", "held_out") for start in range(0, clips // 2, 16)]
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("fork")) as pool:
        done = list(pool.map(_batch_detections, *zip(*batches)))
    detections = [d for found, _, _ in done for d in found]
    truths = [t for _, true, _ in done for t in true]
    backgrounds = set().union(*(seen for _, _, seen in done))
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


# -------------------------------------------------------------------------------------------- per frame
def _collapse_second_half(video: torch.Tensor, start: int) -> torch.Tensor:
    """A clip (3, F, H, W) whose frames from ``start`` on lose their object's colour (its hue turned by a
    channel rotation), as mini's broken VAE turned a green star cyan late in a clip."""
    out = video.clone()
    out[:, start:] = video[[2, 0, 1], start:]
    return out


def test_detect_frames_reads_every_frame_of_clean_clips():
    video, _, specs = Corpus(7005, "held_out").batch(0, 8, frames=17, height=64, width=64)
    shapes_right = shapes_read = 0
    for v, spec in zip(video, specs):
        r = detect_frames(v)
        assert set(r) == {"found", "colour", "shape", "area"} and len(r["found"]) == 17
        assert all(r["found"]) and r["colour"] == [spec.colour] * 17, (spec, r["colour"])
        shapes_right += sum(s == spec.shape for s in r["shape"])
        shapes_read += 17
        assert min(r["area"]) >= MIN_AREA_PIXELS
    assert shapes_right >= 0.95 * shapes_read  # one frame alone: small shrunk objects are the misses
    blank = ((video[0] + 1) / 2).mean(0, keepdim=True).expand(3, -1, -1, -1) * 2 - 1  # no colour at all
    assert detect_frames(blank)["found"] == [False] * 17 and detect_frames(blank)["colour"] == [None] * 17


def test_presence_shows_a_late_collapse_that_the_whole_clip_reading_hides():
    frames, start = 33, 33 - LAST_FRAMES  # the last 8 frames collapse
    video, _, specs = Corpus(7006, "held_out").batch(0, 6, frames=frames, height=64, width=64)
    truths = [s.attributes for s in specs]
    broken = [_collapse_second_half(v, start) for v in video]
    # the whole-clip detector still reads every asked colour: the majority of frames is right
    assert score(broken, truths)["colour"] == 1.0
    p = presence(broken, truths)
    # independent count: frames before `start` right, every later frame wrong
    assert p["per_frame"] == [1.0] * start + [0.0] * (frames - start)
    assert p["frames"] == pytest.approx(start / frames) and p["last"] == 0.0 and p["present"] == 0.0
    assert p["worst_frame"] == start and p["videos_every_frame"] == 0.0 and p["last_frames"] == LAST_FRAMES
    assert p["videos"] == [pytest.approx(start / frames)] * 6 and p["n"] == 6 and p["frames_per_video"] == frames
    clean = presence(list(video), truths)
    assert clean["present"] == clean["frames"] == clean["last"] == 1.0 and clean["videos_every_frame"] == 1.0
    # readings are taken as they are; a truth without a colour asks only for the object
    readings = [detect_frames(v) for v in broken]
    assert presence(readings, truths) == p
    assert presence(readings, [{"colour": None}] * 6)["present"] == 1.0
    with pytest.raises(ValueError, match="same number of frames"):
        presence([readings[0], detect_frames(video[0, :, :9])], truths[:2])
    with pytest.raises(ValueError, match="2 videos or readings but 1 truths"):
        presence(readings[:2], truths[:1])


def test_per_frame_psnr_and_its_summary_show_a_corrupted_second_half_the_mean_hides():
    rng = np.random.default_rng(2)
    video, _, _ = Corpus(15).batch(0, 1, frames=33, height=32, width=32)
    a = to_uint8_frames(video[0])
    noise = np.where(np.arange(33)[:, None, None, None] < 17, 1, 60) * rng.standard_normal(a.shape)
    b = np.clip(a + noise, 0, 255).round().astype(np.uint8)
    mean, per_frame = psnr(a, b)
    mse = ((a.astype(np.float64) - b) ** 2).reshape(33, -1).mean(1)
    expected = 10 * np.log10(255 ** 2 / mse)  # independent per-frame PSNR
    assert per_frame == pytest.approx(list(expected), rel=1e-9)
    c = curve_summary(per_frame)
    assert mean > 28  # the mean looks like a sound video ...
    assert c["worst"] == pytest.approx(expected.min()) and c["worst_frame"] == int(expected.argmin()) >= 17
    assert c["last_mean"] == pytest.approx(expected[-8:].mean()) and c["last_mean"] < 16  # ... its end is not
    assert c["first"] == expected[0] and c["middle"] == expected[16] and c["last"] == expected[-1]
    loss = curve_summary([0.1, 0.3, 0.2], higher_is_better=False)
    assert loss["worst"] == 0.3 and loss["worst_frame"] == 1 and loss["mean"] == pytest.approx(0.2)
    assert math.isnan(curve_summary([20.0, float("nan"), 30.0])["worst"])  # NaN in, NaN out
    with pytest.raises(ValueError, match="non-empty"):
        curve_summary([])


class _ExactAutoencoder(torch.nn.Module):
    """An autoencoder that reproduces its input exactly, except that the decoder rotates the colour channels
    of frames ``start`` onwards: a known corruption for vae_round_trip (the interface of AutoencoderKLWan)."""

    def __init__(self, start: int):
        super().__init__()
        self.gain = torch.nn.Parameter(torch.ones(()))  # gives the module a device and dtype
        self.start = start

    def encode(self, x):
        return types.SimpleNamespace(latent_dist=types.SimpleNamespace(mode=lambda: x))

    def decode(self, z):
        out = z * self.gain
        out[:, :, self.start:] = z[:, [2, 0, 1], self.start:]
        return types.SimpleNamespace(sample=out)


def test_vae_round_trip_reports_each_frame_and_catches_a_late_collapse():
    from attnqat.mini.evaluation import vae_round_trip

    video, _, specs = Corpus(7007, "held_out").batch(0, 3, frames=17, height=64, width=64)
    truths = [s.attributes for s in specs]
    r = vae_round_trip(_ExactAutoencoder(start=9), video, truths, batch=2)
    for clip, psnrs, obj in zip(video, r["psnr"], r["psnr_object"]):
        assert psnrs[:9] == [math.inf] * 9 and obj[:9] == [math.inf] * 9  # exact frames
        back = _collapse_second_half(clip, 9).double()
        err = ((back - clip.double()) / 2) ** 2
        region = (object_mask(clip) >= 0.5).double()
        for f in range(9, 17):  # independent PSNR of each corrupted frame, whole and object region
            assert psnrs[f] == pytest.approx(10 * math.log10(1 / err[:, f].mean().item()), rel=1e-9)
            obj_mse = (err[:, f] * region[f]).sum().item() / (3 * region[f].sum().item())
            assert obj[f] == pytest.approx(10 * math.log10(1 / obj_mse), rel=1e-9)
            assert obj[f] < psnrs[f]  # the object is where the colours changed
    assert r["colour_ok"] == [[True] * 9 + [False] * 8] * 3
    assert r["per_frame"]["colour_ok"] == [1.0] * 9 + [0.0] * 8 and r["min"]["colour_ok"] == 0.0
    assert r["per_frame"]["psnr"][:9] == [math.inf] * 9
    assert r["min"]["psnr"] == pytest.approx(min(min(p) for p in r["psnr"])) and r["max"]["psnr"] == math.inf
    assert sum(r["shape_ok"][0][:9]) >= 8  # the exact frames read as the asked shape
    # without truths, the clip's own reading is the truth
    assert vae_round_trip(_ExactAutoencoder(start=9), video[:1])["colour_ok"] == r["colour_ok"][:1]


def test_vae_round_trip_of_a_real_vae_matches_an_independent_round_trip():
    from attnqat.mini.evaluation import vae_round_trip
    from attnqat.pipelines.tiny import build_tiny_vae

    vae = build_tiny_vae()
    video, _, specs = Corpus(7008).batch(0, 2, frames=5, height=32, width=32)
    r = vae_round_trip(vae, video, [s.attributes for s in specs])
    with torch.no_grad():
        back = vae.decode(vae.encode(video).latent_dist.mode()).sample.clamp(-1, 1).double().numpy()
    err = ((back - video.double().numpy()) / 2) ** 2  # (2, 3, 5, 32, 32)
    expected = 10 * np.log10(1 / err.mean(axis=(1, 3, 4)))
    assert np.allclose(r["psnr"], expected, rtol=1e-6)
    assert r["per_frame"]["psnr"] == pytest.approx(list(expected.mean(0)), rel=1e-6)
    assert len(r["colour_ok"]) == 2 and all(len(x) == 5 for x in r["colour_ok"] + r["shape_ok"])
    nan_clip = video[:1].clone()
    nan_clip[0, :, 0, 0, 0] = float("nan")
    assert math.isnan(vae_round_trip(vae, nan_clip)["min"]["psnr"])  # NaN in, NaN out
    with pytest.raises(ValueError, match="clips must be"):
        vae_round_trip(vae, video[0])
