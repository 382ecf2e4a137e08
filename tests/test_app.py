"""The side-by-side demo: its metrics (PSNR, SSIM, difference strips), request validation, weight
swapping with a QAT checkpoint, the app served on localhost and driven through gradio_client, and a
real headless-Chromium check (skipped when Chromium or playwright is missing)."""
import importlib.util
import math
import re
from pathlib import Path
from types import SimpleNamespace

import imageio.v2 as imageio
import numpy as np
import pytest
import torch

from attnqat.demo import (DEMO_MODES, NO_CHECKPOINT_LABEL, DemoEngine, demo_modes, difference_strip, heat_colors,
                          heat_scale, validate_request)
from attnqat.kernels import available_modes
from attnqat.mini.quality import psnr, ssim
from conftest import load_script

ROOT = Path(__file__).resolve().parent.parent
gradio_client = pytest.importorskip("gradio_client", reason="the demo needs gradio: pip install -e '.[app]'")
pytest.importorskip("gradio", reason="the demo needs gradio: pip install -e '.[app]'")

# Tiny sizes: every FP4 mode runs its Triton kernel in the interpreter on a CPU-only machine.
H, W, FRAMES, STEPS = 32, 48, 5, 2
OPTIONAL = [m for m in demo_modes() if m != "bf16"]  # sage3 included once it is registered


browser_check = load_script(ROOT / "scripts" / "browser_check.py", "browser_check")


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


def test_per_frame_psnr_line_names_the_worst_and_last_frame_and_draws_every_frame():
    from attnqat.demo import psnr_frames_line

    a = _video(5, (9, 16, 16, 3))
    b = a.copy()
    b[6:] = 255 - b[6:]  # the last three frames ruined, the first six untouched (infinite PSNR)
    b[3, 0, 0, 0] ^= 1  # one frame off by one level in one value
    per_frame = psnr(a, b)[1]
    mse = ((a.astype(np.float64) - b) ** 2).reshape(9, -1).mean(1)
    worst = int(np.argmax(mse))
    line = psnr_frames_line(per_frame)
    assert line.startswith(f"per frame: worst {10 * np.log10(255 ** 2 / mse[worst]):.1f} dB (frame {worst}), "
                           f"last {10 * np.log10(255 ** 2 / mse[-1]):.1f} dB ")
    bars = line.rsplit(" ", 1)[1]
    assert len(bars) == 9 and bars[:3] == "███" and bars[3] == "█" and set(bars[6:]) <= set("▁▂")
    assert psnr_frames_line([30.0, float("nan"), 20.0]).endswith(" █?▁")  # NaN in, NaN shown


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
    (dict(modes=["bf16", "nope"]), "unknown attention mode 'nope'; available: bf16"),
    (dict(height=32.5), "height must be a whole number"),
])
def test_validate_request_messages(change, message):
    req = dict(model="tiny", prompt="p", height=32, width=48, frames=5, steps=2, seed=0, modes=["bf16"], **{})
    req.update(change)
    with pytest.raises(ValueError, match=message):
        validate_request(**req)


def test_demo_modes_follow_the_registry():
    assert DEMO_MODES == ("bf16", "sage3", "attn_qat", "nvfp4")  # the page's columns, left to right
    assert demo_modes() == list(DEMO_MODES) and set(DEMO_MODES) <= set(available_modes())
    assert demo_modes(["sage3", "bf16", "sage3"]) == ["bf16", "sage3"]
    with pytest.raises(ValueError, match="unknown attention mode 'nope'; available: bf16"):
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
    assert (engine.label("attn_qat"), engine.weights("attn_qat")) == ("Attn-QAT", "QAT checkpoint qat.safetensors")
    assert engine.weights("nvfp4") is None
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
    assert plain.label("attn_qat") == NO_CHECKPOINT_LABEL == "Attn-QAT (base weights)"
    assert plain.weights("attn_qat") == "no QAT checkpoint: plain FP4 attention"


# ------------------------------------------------------------------------------------ the served app
@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``python app.py`` (tiny model, CPU) on 127.0.0.1 and a free port, for the whole module:
    its URL, log file and --out-dir."""
    log_path = tmp_path_factory.mktemp("app") / "app.log"
    out_dir = tmp_path_factory.mktemp("videos")
    port = browser_check.free_port()
    url = f"http://127.0.0.1:{port}/"
    with open(log_path, "w") as log:
        proc = browser_check.start_app(port, "--model", "tiny", "--out-dir", str(out_dir), log=log)
        try:
            browser_check.wait_for_server(url, proc, timeout=180)
        except (RuntimeError, TimeoutError) as e:
            proc.kill()
            pytest.fail(f"{e}; app log:\n{log_path.read_text()[-3000:]}")
        yield SimpleNamespace(url=url, log=log_path, out_dir=out_dir)
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def served_app(served):
    return served.url


def _predict(client, modes, **overrides):
    args = dict(prompt="a corgi surfing a wave", seed=7, steps=STEPS, height=H, width=W, frames=FRAMES,
                selected=modes)
    args.update(overrides)
    return client.predict(*args.values(), api_name="/generate")


def test_app_generates_every_mode_with_metrics(served_app):
    client = gradio_client.Client(served_app, verbose=False)
    out = _predict(client, OPTIONAL)
    modes = demo_modes()
    assert len(out) == 4 * len(modes) + 1  # per mode: video, metrics, strip, lossless frames; then the JSON
    summary = out[-1]
    assert set(summary["modes"]) == set(modes)
    for i, mode in enumerate(modes):
        video, text, strip = out[4 * i: 4 * i + 3]
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
            assert "PSNR (RGB) vs BF16" in text and "SSIM (luma)" in text and "per frame: worst" in text
    if "attn_qat" in summary["modes"]:  # the served app has no QAT checkpoint
        assert summary["modes"]["attn_qat"]["label"] == NO_CHECKPOINT_LABEL
        assert summary["modes"]["attn_qat"]["weights"] == "no QAT checkpoint: plain FP4 attention"


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
    model, device, dtype, qat_checkpoint, qat_shipped = "tiny", torch.device("cpu"), torch.float32, None, False
    qat_options: dict = {}

    def __init__(self):
        self.calls = 0

    def label(self, mode):
        return DemoEngine.label(self, mode)

    def weights(self, mode):
        return DemoEngine.weights(self, mode)

    def vocabulary_note(self, prompt):
        return DemoEngine.vocabulary_note(self, prompt)

    def run(self, prompt, *, modes, height, width, frames, steps, seed, out_dir, progress=None, on_run=None,
            cancel=None, high_precision_steps=0):
        self.calls += 1
        if self.calls == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB")
        return _gray_bf16_run(frames, height, width, out_dir)


def _gray_bf16_run(frames, height, width, out_dir):
    """What a stand-in engine's ``run`` returns: a gray bf16 video, written where the real one writes it."""
    from attnqat.demo import ModeRun
    from attnqat.pipelines.generate import write_mp4

    video = np.full((frames, height, width, 3), 128, np.uint8)
    strip = Path(out_dir) / "bf16_strip.png"
    imageio.imwrite(strip, difference_strip(None, video))
    return [ModeRun(mode="bf16", label="BF16 (reference)", video=write_mp4(video, Path(out_dir) / "bf16.mp4"),
                    strip=strip, frames=video, seconds=0.1, denoise_seconds=0.1, attention_seconds=None,
                    psnr=None, ssim=None)]


def test_app_reports_out_of_memory_and_keeps_serving(tmp_path):
    from attnqat import demo_app as app
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


class _SlowEngine(_FlakyEngine):
    """Stands in for :class:`DemoEngine`: every request generates until the test releases it."""

    def __init__(self):
        import threading

        super().__init__()
        self.started, self.release = threading.Semaphore(0), threading.Event()

    def run(self, prompt, *, modes, height, width, frames, steps, seed, out_dir, **kwargs):
        self.calls += 1
        self.started.release()
        assert self.release.wait(120)
        return _gray_bf16_run(frames, height, width, out_dir)


def _wait_until(condition, what, timeout=60):
    import time

    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_requests_line_is_bounded_in_all_and_per_client(tmp_path, capfd):
    """300 requests at the largest allowed work were all queued (hours of CPU): the line now lets one request
    generate, at most `waiting` wait, at most `per_client` from one client; the rest are refused at once with a
    reason, logged as one line each (no traceback), and the admitted ones still finish."""
    from attnqat.demo import RequestLine

    from attnqat import demo_app as app
    engine, line = _SlowEngine(), RequestLine(waiting=1, per_client=5)
    demo = app.build_demo(engine, ["bf16", *OPTIONAL], str(tmp_path), line=line)
    port = browser_check.free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, allowed_paths=[str(tmp_path)],
                quiet=True)
    args = ["p", 1, STEPS, H, W, FRAMES, []]
    try:
        client = gradio_client.Client(f"http://127.0.0.1:{port}/", verbose=False)
        running = client.submit(*args, api_name="/generate")
        assert engine.started.acquire(timeout=60)
        waiting = client.submit(*args, api_name="/generate")
        _wait_until(lambda: len(line) == 2, "the second request in line")
        with pytest.raises(Exception, match="the demo is busy: 2 requests are in line"):
            client.predict(*args, api_name="/generate")
        line.waiting, line.per_client = 5, 2  # room in line, but this client has 2 requests there
        with pytest.raises(Exception, match="you have 2 requests in line already \\(at most 2 per client\\)"):
            client.predict(*args, api_name="/generate")
        assert engine.calls == 1 and len(line) == 2  # the refused ones never ran nor stayed in line
        engine.release.set()
        for job in (running, waiting):
            assert list(job.result(timeout=120)[-1]["modes"]) == ["bf16"]
        assert engine.calls == 2
        _wait_until(lambda: len(line) == 0, "the line to empty")
    finally:
        engine.release.set()
        demo.close()
    log = capfd.readouterr().err
    assert "Traceback" not in log
    refused = [x for x in log.splitlines() if x.startswith("attnqat demo: busy from 127.0.0.1: ")]
    assert len(refused) == 2, log[-2000:]


@pytest.mark.parametrize("change, message", [
    (dict(seed=1.5), "seed must be a whole number, got 1.5"),
    (dict(seed=None), "seed must be a whole number, got None"),
    (dict(prompt=["a"]), "the prompt must be text, got \\['a'\\]"),
    (dict(steps=True), "steps must be a whole number, got True"),
    (dict(height="32"), "height must be a whole number, got '32'"),
    (dict(selected="nvfp4"), "the modes must be a list of mode names, got 'nvfp4'"),
    (dict(selected=["nope"]), "mode 'nope' is not offered here"),
    (dict(selected=[1]), "the modes must be a list of mode names, got \\[1\\]"),
])
def test_app_api_refuses_wrong_types_instead_of_coercing(served, change, message):
    """The API took seed 1.5 as 2 and the prompt ["a"] as the text "['a']": the values now reach the handler as
    sent, and a wrong type is refused with one line to the client and one line in the server's log."""
    client = gradio_client.Client(served.url, verbose=False)
    with pytest.raises(Exception, match=message):
        _predict(client, [], **change)
    lines = [x for x in served.log.read_text().splitlines() if x.startswith("attnqat demo: invalid input from 127.0.0.1: ")]
    assert re.search(message, lines[-1]), lines[-3:]
    assert "Traceback" not in served.log.read_text()


# ---------------------------------------------------------------------------- nothing lost, nothing silent
def _tree(root):
    return sorted(str(p.relative_to(root)) + ("/" if p.is_dir() else f" {p.read_bytes()!r}")
                  for p in Path(root).rglob("*"))


def test_request_folders_prune_only_what_the_app_made(tmp_path):
    """`--out-dir .` in a clone once deleted tracked files: pruning now touches only request folders
    the app named and marked, and in them only the files it recorded."""
    from attnqat.demo import KEEP_REQUESTS, REQUEST_MARKER, REQUESTS_FOLDER, new_request_dir, register_output

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "model.py").write_text("mine")
    (tmp_path / "README.md").write_text("mine")
    box = tmp_path / REQUESTS_FOLDER
    (box / "my-notes").mkdir(parents=True)
    (box / "my-notes" / "n.txt").write_text("mine")
    lookalike = box / "request-20200101-000000-deadbeef"  # the app's name pattern, but no marker
    lookalike.mkdir()
    (lookalike / "bf16.mp4").write_text("mine")
    forged = box / "request-20200101-000001-deadbeef"
    forged.mkdir()
    (forged / REQUEST_MARKER).write_text('{"kind": "something else", "created": 0, "files": ["x.txt"]}')
    (forged / "x.txt").write_text("mine")
    user_owned = before = None
    made = []
    for i in range(KEEP_REQUESTS + 3):
        d = new_request_dir(tmp_path)
        register_output(d, "bf16.mp4")
        (d / "bf16.mp4").write_bytes(b"video")
        (d / "unrecorded.txt").write_text("mine") if i == 0 else None  # a user's file in the app's folder
        made.append(d)
        if i == 0:
            user_owned = d
            before = _tree(tmp_path)
    apps = [d for d in made if d.exists()]
    assert apps[-KEEP_REQUESTS:] == made[-KEEP_REQUESTS:] and len(apps) == KEEP_REQUESTS + 1
    assert sorted(p.name for p in user_owned.iterdir()) == [REQUEST_MARKER, "unrecorded.txt"]  # bf16.mp4 went
    after = _tree(tmp_path)
    for entry in before:  # everything the user made is still there, byte for byte
        if not entry.startswith(f"{REQUESTS_FOLDER}/{user_owned.name}"):
            assert entry in after, entry


@pytest.mark.parametrize("change, message", [
    (dict(height=256, width=256, frames=33, steps=50, modes=["bf16", "sage3"]),
     "the work one request may ask for: height x width x frames x steps x modes = 256x256x33x50x2"),
    (dict(height=128, width=128, frames=17, steps=21, modes=["bf16", "sage3", "attn_qat", "nvfp4"]),
     "1.1x the work .* the work of 128x128, 17 frames, 20 steps in 4 modes"),
    (dict(height=float("inf")), "height must be a whole number, got inf"),
    (dict(steps=float("nan")), "steps must be a whole number, got nan"),
    (dict(prompt="x" * 2001), "prompt is 2001 characters long; the limit is 2000"),
    (dict(prompt="\udcff"), "prompt is not valid text"),
])
def test_validate_request_caps_the_work_of_a_request(change, message):
    req = dict(model="tiny", prompt="p", height=32, width=48, frames=5, steps=2, seed=0, modes=["bf16"])
    req.update(change)
    with pytest.raises(ValueError, match=message):
        validate_request(**req)
    validate_request(model="tiny", prompt="p", height=128, width=128, frames=17, steps=20, seed=0,
                     modes=["bf16", "sage3", "attn_qat", "nvfp4"])  # exactly the limit passes


@pytest.fixture(scope="module")
def app_module():
    from attnqat import demo_app

    return demo_app


@pytest.fixture(scope="module")
def tiny_engine():
    return DemoEngine.load("tiny", device="cpu")


class _Progress:
    """Records what the page's handler reports through gr.Progress."""

    def __init__(self):
        self.calls = []

    def __call__(self, progress=None, desc=None, total=None, unit="steps"):
        self.calls.append((progress, desc, unit))


def test_handler_gives_each_column_its_own_progress(tmp_path, app_module, tiny_engine):
    """Each column's text follows its own mode: the running one its denoising steps, the later ones "waiting", a
    finished one its metrics, an unticked one "not selected" throughout. After a step only the texts are sent (the
    videos, strips and zips stay as the page shows them); the first update clears every video, a column's video
    comes when its mode is done, then all again at the end (the common heat scale); the request's overall progress
    goes to gr.Progress."""
    import asyncio

    import gradio as gr

    modes = demo_modes()
    handler = app_module.make_handler(tiny_engine, modes, tmp_path)
    progress = _Progress()
    selected = [m for m in modes if m != "bf16"][:2]
    run_order = ["bf16", *[m for m in modes if m in selected]]
    unticked = [m for m in modes if m not in run_order]
    steps = 3

    async def drive():
        return [o async for o in handler("p", 1, steps, H, W, FRAMES, selected, progress=progress)]

    yields = asyncio.run(drive())
    skip = gr.skip()
    seen, full = [], []
    for out in yields:
        assert len(out) == 4 * len(modes) + 1
        text = {m: out[4 * i + 1] for i, m in enumerate(modes)}
        assert all(text[m].startswith(f"**{tiny_engine.label(m)}**") for m in modes)
        assert all(text[m].endswith("not selected") for m in unticked)
        if out[-1] != skip:
            full.append(out)
            continue
        assert all(out[4 * i + k] == skip for i in range(len(modes)) for k in (0, 2, 3))
        running = [m for m in run_order if text[m].endswith(f"of {steps}") or text[m].endswith("starting")]
        assert len(running) == 1, text
        at = run_order.index(running[0])
        assert all("time **" in text[m] for m in run_order[:at]), text  # done: its metrics
        assert all(text[m].endswith("waiting") for m in run_order[at + 1:]), text
        seen.append((running[0], text[running[0]].split("  \n")[-1]))
    bar = {k: "▰" * round(10 * k / steps) + "▱" * (10 - round(10 * k / steps)) for k in range(1, steps + 1)}
    assert seen == [(m, "starting" if k == 0 else f"denoising {bar[k]} step {k} of {steps}")
                    for m in run_order for k in range(steps + 1)]
    assert len(full) == len(selected) + 3  # the start, one per finished mode, then the final (common heat scale)
    start, first = full[0], full[1]
    assert all(start[4 * i + k] is None for i in range(len(modes)) for k in (0, 2, 3))
    assert all(start[4 * i + 1].endswith("waiting") for i, m in enumerate(modes) if m in run_order)
    assert first[0] and first[1].count("time") == 1  # bf16's column is shown ...
    assert all(first[4 * i + 1].endswith("waiting") for i, m in enumerate(modes) if m in selected)  # ... the rest wait
    assert all(full[-1][4 * modes.index(m)] and "time **" in full[-1][4 * modes.index(m) + 1] for m in run_order)
    for mode in run_order:
        label = tiny_engine.label(mode)
        steps_seen = [p for p, desc, unit in progress.calls if desc and desc.startswith(label + " (mode")]
        assert steps_seen == [(k, steps) for k in range(steps + 1)], (mode, progress.calls)
        assert all("denoising steps" in desc and unit == "steps" for _, desc, unit in progress.calls)
    final = full[-1]
    assert set(final[-1]["modes"]) == {"bf16", *selected}
    # only mini names the words it does not know; tiny reads bytes
    assert final[-1]["vocabulary_note"] is None and tiny_engine.vocabulary_note("a cat playing piano") is None


def test_page_shows_the_request_progress_in_one_place_and_keeps_the_columns_level(tmp_path, app_module, tiny_engine):
    """The overall progress bar is drawn on one element of the page, not over every column (Gradio's default);
    every column is its video and its strip (fixed heights), then its texts, so the pictures stay level
    whatever a column's text; the API's outputs keep their order; every column title is one short line."""
    modes = demo_modes()
    config = app_module.build_demo(tiny_engine, modes, tmp_path).config
    elem = {c["id"]: c["props"].get("elem_id") for c in config["components"]}
    dep = next(d for d in config["dependencies"] if d.get("api_name") == "generate")
    assert [elem[i] for i in dep["show_progress_on"]] == ["request-progress"]
    assert [elem[i] for i in dep["outputs"]][:-1] == [f"{kind}-{m}" for m in modes
                                                      for kind in ("video", "metrics", "strip", "frames")]

    def columns(node):
        kids = [elem.get(c["id"]) for c in node.get("children", [])]
        if any(k and k.startswith("video-") for k in kids):
            yield kids
        for c in node.get("children", []):
            yield from columns(c)

    assert list(columns(config["layout"])) == [[f"{kind}-{m}" for kind in ("video", "strip", "metrics", "frames")]
                                               for m in modes]
    assert all(len(tiny_engine.label(m)) <= 25 for m in modes)  # about a quarter of the page in bold


def test_handler_runs_fp4_columns_with_bf16_first_and_last_steps(tmp_path, app_module, tiny_engine):
    import asyncio

    handler = app_module.make_handler(tiny_engine, ["bf16", "nvfp4"], tmp_path)

    async def drive(k):
        return [o async for o in handler("p", 1, STEPS, H, W, FRAMES, ["nvfp4"], k, progress=_Progress())][-1]

    every = asyncio.run(drive(STEPS))  # k = steps: every step of the nvfp4 column in bf16
    summary = every[-1]
    assert summary["high_precision_steps"] == STEPS
    assert summary["modes"]["nvfp4"]["psnr_db"] == "inf" and summary["modes"]["bf16"]["precision"] is None
    assert (summary["modes"]["nvfp4"]["precision"]
            == f"bf16 on steps 0-{STEPS - 1} of {STEPS} (first:{STEPS},last:{STEPS})")
    assert "precision: bf16 on steps" in every[5]
    plain = asyncio.run(drive(None))[-1]  # an emptied number box is 0
    assert plain["high_precision_steps"] == 0 and plain["modes"]["nvfp4"]["psnr_db"] != "inf"
    with pytest.raises(Exception, match=f"bf16 steps \\(first/last k\\) {STEPS + 1} must be between 0 and the"):
        asyncio.run(drive(STEPS + 1))


def test_cancelled_request_stops_at_its_next_denoising_step(tmp_path, app_module, tiny_engine):
    """Gradio cancels the handler's coroutine (the Cancel button, a closed page); the worker thread
    must then stop between two denoising steps instead of finishing every mode."""
    import asyncio

    modes = demo_modes()
    handler = app_module.make_handler(tiny_engine, modes, tmp_path)
    calls = []
    hook = tiny_engine.pipe.transformer.register_forward_pre_hook(lambda m, a: calls.append(1))
    steps = 40
    try:
        async def cancel_after_first_column():
            async def read_every_update():  # as the page does, until Gradio cancels it
                async for _ in handler("p", 1, steps, H, W, FRAMES, [m for m in modes if m != "bf16"],
                                       progress=_Progress()):
                    pass

            reading = asyncio.ensure_future(read_every_update())
            while len(calls) < 2 * steps + 4:  # two steps into the second mode
                await asyncio.sleep(0.01)
            reading.cancel()
            with pytest.raises(asyncio.CancelledError):
                await reading

        asyncio.run(cancel_after_first_column())
        assert tiny_engine._lock.acquire(timeout=120)  # the worker let go of the engine ...
        tiny_engine._lock.release()
        stopped_at = len(calls)
        assert stopped_at <= 2 * steps + 8, stopped_at  # ... within a step of the cancel, not after 4 modes
    finally:
        hook.remove()
    request = next((tmp_path / "attnqat-demo-requests").iterdir())
    assert sorted(p.name for p in request.iterdir() if not p.name.startswith(".")) == [
        "bf16.mp4", "bf16_frames.zip", "bf16_strip.png"]


def test_page_names_every_input_and_output_and_shows_no_share_hint(served):
    client = gradio_client.Client(served.url, verbose=False)
    api = client.view_api(print_info=False, return_format="dict")
    assert list(api["named_endpoints"]) == ["/generate"] and not api["unnamed_endpoints"]
    ep = api["named_endpoints"]["/generate"]
    labels = [p["label"] for p in ep["parameters"] + ep["returns"]]
    assert all(label and not label.startswith("value_") for label in labels), labels
    log = served.log.read_text()
    assert "share=True" not in log and "attnqat demo: serving modes" in log


def test_page_fonts_have_every_letter(served):
    """Gradio's default theme declared a 600-weight font file of 55 glyphs, so bold headings mixed
    fonts ("ʙF16"). Every font file the page declares must hold every ASCII letter and digit."""
    import re
    import urllib.request

    ttlib = pytest.importorskip("fontTools.ttLib")
    import gradio

    css = urllib.request.urlopen(served.url + "theme.css", timeout=30).read().decode()
    files = re.findall(r"url\('(static/fonts/[^']+\.woff2)'\)", css)
    assert files
    static = Path(gradio.__file__).parent / "templates" / "frontend"
    for f in files:
        cmap = ttlib.TTFont(static / f).getBestCmap()
        missing = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789" if ord(c) not in cmap]
        assert not missing, (f, "".join(missing))


def test_uploads_are_capped(served):
    import urllib.error
    import urllib.request

    body = b"--x\r\nContent-Disposition: form-data; name=\"files\"; filename=\"a.bin\"\r\n\r\n" + b"0" * (2 << 20) \
        + b"\r\n--x--\r\n"
    req = urllib.request.Request(served.url + "gradio_api/upload", data=body, method="POST",
                                 headers={"Content-Type": "multipart/form-data; boundary=x"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == 413


def test_metrics_are_those_of_the_lossless_frames_offered(served):
    """The page plays lossy mp4s but its PSNR/SSIM are computed before encoding: it says so, and the
    lossless frames it offers give back exactly its numbers."""
    import json
    import urllib.request

    from attnqat.demo import read_frames_zip

    client = gradio_client.Client(served.url, verbose=False)
    out = _predict(client, ["nvfp4"])
    modes = demo_modes()
    zips = {m: out[4 * i + 3] for i, m in enumerate(modes) if out[4 * i + 3]}
    assert set(zips) == {"bf16", "nvfp4"}
    ref, x = (read_frames_zip(zips[m]) for m in ("bf16", "nvfp4"))
    assert ref.shape == (FRAMES, H, W, 3)
    m = out[-1]["modes"]["nvfp4"]
    assert m["psnr_db"] == round(psnr(ref, x)[0], 4) and m["ssim"] == round(ssim(ref, x)[0], 4)
    lossy = _read_mp4(out[4 * modes.index("nvfp4")]["video"] if isinstance(out[4 * modes.index("nvfp4")], dict)
                      else out[4 * modes.index("nvfp4")])
    assert not np.array_equal(lossy, x)  # the played video is not what was measured
    page = json.dumps(json.loads(urllib.request.urlopen(served.url + "config", timeout=30).read()))
    assert "before video compression" in page and "PSNR over the R, G, B" in page and "on the luma" in page
