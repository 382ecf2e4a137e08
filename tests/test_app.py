"""The side-by-side demo: its metrics (PSNR, SSIM, difference strips), request validation, weight
swapping with a QAT checkpoint, the app served on localhost and driven through gradio_client, and a
real headless-Chromium check (skipped when Chromium or playwright is missing)."""
import importlib.util
import math
from pathlib import Path

import imageio.v2 as imageio
import numpy as np
import pytest
import torch

from attnqat.demo import (DEMO_MODES, NO_CHECKPOINT_LABEL, DemoEngine, demo_modes, difference_strip, heat_colors,
                          heat_scale, psnr, ssim, validate_request)
from attnqat.kernels import available_modes

ROOT = Path(__file__).resolve().parent.parent
gradio_client = pytest.importorskip("gradio_client", reason="the demo needs gradio: pip install -e '.[app]'")
pytest.importorskip("gradio", reason="the demo needs gradio: pip install -e '.[app]'")

# Tiny sizes: every FP4 mode runs its Triton kernel in the interpreter on a CPU-only machine.
H, W, FRAMES, STEPS = 32, 48, 5, 2
OPTIONAL = [m for m in demo_modes() if m != "bf16"]  # sage3 included once it is registered


def _spec(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


browser_check = _spec("browser_check", ROOT / "scripts" / "browser_check.py")


def _read_mp4(path):
    reader = imageio.get_reader(str(path))
    try:
        return np.stack([f for f in reader])
    finally:
        reader.close()


# ------------------------------------------------------------------------------------------- metrics
def _video(seed, shape=(3, 24, 20, 3)):
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


def test_psnr_identical_is_inf_and_uniform_error_matches_formula():
    a = _video(0)
    assert psnr(a, a)[0] == math.inf
    b = a.astype(np.int16)
    b = np.where(b < 128, b + 4, b - 4).astype(np.uint8)  # |error| 4 everywhere
    mean, per_frame = psnr(a, b)
    assert mean == pytest.approx(10 * math.log10(255 ** 2 / 16))
    assert len(per_frame) == 3


def test_ssim_identical_is_one_and_uniform_images_match_closed_form():
    a = _video(1)
    assert ssim(a, a)[0] == pytest.approx(1.0)
    # constant images: variances and covariance vanish, SSIM = (2 mu_a mu_b + C1) / (mu_a^2 + mu_b^2 + C1)
    x, y = np.full((2, 16, 16, 3), 100, np.uint8), np.full((2, 16, 16, 3), 140, np.uint8)
    c1 = (0.01 * 255) ** 2
    assert ssim(x, y)[0] == pytest.approx((2 * 100 * 140 + c1) / (100 ** 2 + 140 ** 2 + c1))


def test_ssim_falls_with_noise_and_handles_frames_smaller_than_the_window():
    a = _video(2).astype(np.float64)
    rng = np.random.default_rng(3)
    scores = [ssim(a.astype(np.uint8), np.clip(a + rng.normal(0, s, a.shape), 0, 255).astype(np.uint8))[0]
              for s in (2, 10, 40)]
    assert 1 > scores[0] > scores[1] > scores[2]
    small = _video(4, (2, 6, 8, 3))
    assert ssim(small, small)[0] == pytest.approx(1.0)


def test_metrics_refuse_mismatched_videos():
    with pytest.raises(ValueError, match="videos must both be"):
        psnr(_video(0), _video(0, (3, 24, 22, 3)))


def test_difference_strip_layout_and_shared_heat_scale():
    ref = np.zeros((5, 8, 10, 3), np.uint8)
    x = ref.copy()
    x[2] = 30
    vmax = heat_scale([(ref, x)])
    assert vmax == 32.0
    strip = difference_strip(ref, x, vmax=vmax, gap=2)
    assert strip.shape == (2 * 8 + 2, 5 * 10 + 4 * 2, 3)
    assert (strip[8:10] == 255).all()  # the white gap between frames and heat map
    heat = strip[10:, 2 * 12:2 * 12 + 10]
    assert (heat == heat_colors(np.array(30.0), vmax)).all() and (strip[10:, :10] == heat_colors(np.array(0.0))).all()
    assert difference_strip(None, x).shape == (8, 58, 3)
    assert heat_scale([(ref, ref)]) == 1.0
    assert (heat_colors(np.array([0.0, 1e9])) == [[0, 0, 4], [252, 255, 164]]).all()


# ---------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize("change, message", [
    (dict(height=70), "height 70 is not a positive multiple of 16.*nearest valid: 64 or 80"),
    (dict(frames=6), "frames 6 is not of the form 4k\\+1.*nearest valid: 5"),
    (dict(steps=0), "steps 0 must be at least 1"),
    (dict(prompt="  "), "prompt is empty"),
    (dict(width=512), "width 512 is above this demo's limit of 256 for the tiny CPU model"),
    (dict(modes=["bf16", "nope"]), "unknown mode 'nope'"),
    (dict(height=32.5), "height must be a whole number"),
])
def test_validate_request_messages(change, message):
    req = dict(model="tiny", prompt="p", height=32, width=48, frames=5, steps=2, seed=0, modes=["bf16"], **{})
    req.update(change)
    with pytest.raises(ValueError, match=message):
        validate_request(**req)


def test_demo_modes_follow_the_registry():
    modes = demo_modes()
    assert modes[0] == "bf16" and set(modes) <= set(DEMO_MODES) and set(modes) <= set(available_modes())
    assert ("sage3" in modes) == ("sage3" in available_modes())
    with pytest.raises(ValueError, match="unknown attention modes"):
        demo_modes(["bf16", "nope"])


# ------------------------------------------------------------------------------- engine, QAT weights
def test_engine_swaps_qat_weights_only_for_attn_qat(tmp_path):
    from safetensors.torch import save_file

    from attnqat.pipelines import build_tiny_transformer

    qat = build_tiny_transformer()
    with torch.no_grad():
        for p in qat.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ckpt = tmp_path / "qat.safetensors"
    save_file({k: v.contiguous() for k, v in qat.state_dict().items()}, str(ckpt))

    engine = DemoEngine.load("tiny", qat_checkpoint=str(ckpt), device="cpu")
    assert engine.label("attn_qat") == "Attn-QAT (QAT checkpoint qat.safetensors)"
    size = dict(height=H, width=W, frames=FRAMES, steps=STEPS, seed=3)
    runs = engine.run("p", modes=["attn_qat", "nvfp4"], out_dir=tmp_path, **size)
    bf16, attn_qat, nvfp4 = runs
    assert [r.mode for r in runs] == ["bf16", "attn_qat", "nvfp4"]
    # nvfp4 ran on the base weights again (swapped back after attn_qat), attn_qat on the QAT weights:
    # the QAT weights (here: base + noise) move attn_qat's video much further from bf16's
    assert attn_qat.psnr < nvfp4.psnr - 3
    base = build_tiny_transformer(dtype=engine.dtype).state_dict()
    assert all(torch.equal(v, base[k]) for k, v in engine.pipe.transformer.state_dict().items())

    plain = DemoEngine(engine.pipe, model="tiny", device=engine.device, dtype=engine.dtype)
    assert plain.label("attn_qat") == NO_CHECKPOINT_LABEL == "Attn-QAT: plain FP4 attention (no QAT checkpoint)"


# ------------------------------------------------------------------------------------ the served app
@pytest.fixture(scope="module")
def served_app(tmp_path_factory):
    """``python app.py`` (tiny model, CPU) on 127.0.0.1 and a free port, for the whole module."""
    log_path = tmp_path_factory.mktemp("app") / "app.log"
    port = browser_check.free_port()
    url = f"http://127.0.0.1:{port}/"
    with open(log_path, "w") as log:
        proc = browser_check.start_app(port, "--out-dir", str(tmp_path_factory.mktemp("videos")), log=log)
        try:
            browser_check.wait_for_server(url, proc, timeout=180)
        except (RuntimeError, TimeoutError) as e:
            proc.kill()
            pytest.fail(f"{e}; app log:\n{log_path.read_text()[-3000:]}")
        yield url
        proc.terminate()
        proc.wait(timeout=30)


def _predict(client, modes, **overrides):
    args = dict(prompt="a corgi surfing a wave", seed=7, steps=STEPS, height=H, width=W, frames=FRAMES,
                selected=modes)
    args.update(overrides)
    return client.predict(*args.values(), api_name="/generate")


def test_app_generates_every_mode_with_metrics(served_app):
    client = gradio_client.Client(served_app, verbose=False)
    out = _predict(client, OPTIONAL)
    modes = demo_modes()
    assert len(out) == 3 * len(modes) + 1
    summary = out[-1]
    assert set(summary["modes"]) == set(modes)
    for i, mode in enumerate(modes):
        video, text, strip = out[3 * i: 3 * i + 3]
        video = video["video"] if isinstance(video, dict) else video
        frames = _read_mp4(video)
        assert frames.shape == (FRAMES, H, W, 3), mode
        assert frames.std() > 0, f"{mode}: blank video"
        assert imageio.imread(strip).shape[1] == FRAMES * W + (FRAMES - 1) * 2
        m = summary["modes"][mode]
        assert (m["frames"], m["height"], m["width"]) == (FRAMES, H, W)
        assert m["seconds"] > 0 and "time" in text
        if mode == "bf16":
            assert m["psnr_db"] is None and m["ssim"] is None  # the reference itself
        else:
            assert isinstance(m["psnr_db"], float) and 10 < m["psnr_db"] < 200, (mode, m)
            assert 0 < m["ssim"] <= 1 and len(m["ssim_per_frame"]) == FRAMES
            assert "PSNR vs BF16" in text and "SSIM" in text
    assert "plain FP4 attention (no QAT checkpoint)" in summary["modes"].get("attn_qat", {"label": "plain FP4 attention (no QAT checkpoint)"})["label"]


def test_app_reports_bad_input_and_keeps_serving(served_app):
    client = gradio_client.Client(served_app, verbose=False)
    with pytest.raises(Exception, match="nearest valid: 32 or 48"):
        _predict(client, [], height=40)
    with pytest.raises(Exception, match="not of the form 4k\\+1"):
        _predict(client, [], frames=4)
    out = _predict(client, [])  # bf16 only; the server still answers
    assert list(out[-1]["modes"]) == ["bf16"]
    assert _read_mp4(out[0]["video"] if isinstance(out[0], dict) else out[0]).shape == (FRAMES, H, W, 3)


def _browser_ready() -> str | None:
    if browser_check.find_chromium() is None:
        return "Chromium not installed (apt-get install -y chromium)"
    if importlib.util.find_spec("playwright") is None:
        return "playwright-python not installed (pip install playwright; no `playwright install` needed)"
    return None


@pytest.mark.skipif(_browser_ready() is not None, reason=_browser_ready() or "")
def test_browser_loads_page_clicks_generate_and_shows_videos(served_app, tmp_path):
    result = browser_check.check(served_app, tmp_path / "demo.png", timeout=180)
    shown = [v for v in result["videos"] if v["ready"] != -1]
    assert len(shown) == len(demo_modes())
    assert all(v["ready"] >= 2 and (v["width"], v["height"]) == (64, 64) for v in shown), result
    assert imageio.imread(tmp_path / "demo.png").shape[0] > 500


class _FlakyEngine:
    """Stands in for :class:`DemoEngine`: the first request runs out of GPU memory, the next succeeds."""
    model, device, dtype, qat_checkpoint = "tiny", torch.device("cpu"), torch.float32, None

    def __init__(self):
        self.calls = 0

    def label(self, mode):
        return DemoEngine.label(self, mode)

    def run(self, prompt, *, modes, height, width, frames, steps, seed, out_dir, progress=None):
        from attnqat.demo import ModeRun
        from attnqat.pipelines.generate import write_mp4

        self.calls += 1
        if self.calls == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")
        video = np.full((frames, height, width, 3), 128, np.uint8)
        strip = Path(out_dir) / "bf16_strip.png"
        imageio.imwrite(strip, difference_strip(None, video))
        return [ModeRun(mode="bf16", label="BF16 (reference)", video=write_mp4(video, Path(out_dir) / "bf16.mp4"),
                        strip=strip, frames=video, seconds=0.1, denoise_seconds=0.1, attention_seconds=None,
                        psnr=None, ssim=None)]


def test_app_reports_out_of_memory_and_keeps_serving(tmp_path):
    app = _spec("attnqat_app", ROOT / "app.py")
    demo = app.build_demo(_FlakyEngine(), ["bf16", *OPTIONAL], str(tmp_path))
    port = browser_check.free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, allowed_paths=[str(tmp_path)],
                quiet=True)
    try:
        client = gradio_client.Client(f"http://127.0.0.1:{port}/", verbose=False)
        with pytest.raises(Exception, match="Out of GPU memory at 32x48, 5 frames"):
            _predict(client, [])
        out = _predict(client, [])
        assert list(out[-1]["modes"]) == ["bf16"]
    finally:
        demo.close()
