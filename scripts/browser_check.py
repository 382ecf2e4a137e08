"""Real-browser check of the demo: headless Chromium loads the page, clicks Generate, waits until
every column shows a playable video, and saves a screenshot.

    python scripts/browser_check.py                          # starts `python app.py` itself (default model, CPU)
    python scripts/browser_check.py -- --model tiny          # the same with the random-weight tiny model
    python scripts/browser_check.py --url http://127.0.0.1:7860 --out docs/demo.png

Needs Debian's Chromium (`apt-get install -y chromium`) and playwright-python (`pip install playwright`);
playwright drives the system browser (`executable_path`), so `playwright install` is never needed.
Exit status 0 when every video loaded (its <video> element has decoded data of the requested size),
1 otherwise. tests/test_app.py runs :func:`check` when both are available.
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM_CANDIDATES = ("chromium", "chromium-browser", "google-chrome")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--autoplay-policy=no-user-gesture-required"]


def find_chromium() -> str | None:
    for name in CHROMIUM_CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_server(url: str, proc: subprocess.Popen | None = None, timeout: float = 180.0) -> None:
    """Poll ``url`` until it answers; raise if ``proc`` exits first or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the app exited with status {proc.returncode} before serving")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f} s")


def start_app(port: int, *extra: str, log=None, env=None) -> subprocess.Popen:
    """``python app.py --port PORT ...`` in a subprocess (stdout/stderr to ``log``)."""
    return subprocess.Popen([sys.executable, str(ROOT / "app.py"), "--port", str(port), *extra], cwd=ROOT,
                            stdout=log or subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            env={**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", **(env or {})})


def check(url: str, out: str | Path, *, chromium: str | None = None, timeout: float = 240.0,
          width: int = 1400, height: int = 1100, all_modes: bool = True) -> dict:
    """Open ``url``, tick every mode (``all_modes``; naive NVFP4 is off by default), click Generate,
    wait for the videos, screenshot to ``out``.

    Return: ``{"videos": [{"id", "width", "height", "duration", "ready"}...], "screenshot": out}``.
    Raises RuntimeError if the page shows an error or no video loads within ``timeout`` seconds.
    """
    from playwright.sync_api import sync_playwright

    chromium = chromium or find_chromium()
    if chromium is None:
        raise RuntimeError("no Chromium found; install Debian's: apt-get install -y chromium")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="attnqat-chromium-") as profile, sync_playwright() as p:
        context = p.chromium.launch_persistent_context(profile, executable_path=chromium, headless=True,
                                                       args=CHROMIUM_ARGS,
                                                       viewport={"width": width, "height": height})
        try:
            page = context.new_page()
            page.goto(url, wait_until="networkidle", timeout=timeout * 1000)
            if all_modes:
                boxes = page.locator("input[type=checkbox]:not(:checked)")
                for _ in range(boxes.count()):
                    boxes.first.check()
            # bf16 always runs; every ticked mode adds a column that must show its video before the check is done
            expected = 1 + page.locator("input[type=checkbox]:checked").count()
            page.locator("#generate").click()
            # Gradio renders a <video> in a column once its file is served; wait until every shown
            # column's video element has decoded enough to paint a frame (readyState >= 2).
            deadline = time.monotonic() + timeout
            videos = []
            while time.monotonic() < deadline:
                errors = page.locator(".toast-body.error, .toast-wrap .error")
                if errors.count():
                    raise RuntimeError(f"the page shows an error: {errors.first.inner_text()}")
                videos = page.evaluate("""() => [...document.querySelectorAll('[id^="video-"]')].map(el => {
                    const v = el.querySelector('video');
                    return {id: el.id, ready: v ? v.readyState : -1, width: v ? v.videoWidth : 0,
                            height: v ? v.videoHeight : 0, duration: v ? v.duration : 0};
                })""")
                # columns fill one after another: a column with no <video> yet (ready -1) is still running
                ready = [v for v in videos if v["ready"] >= 2]
                if len(ready) >= expected and not page.locator(".progress-text").count():
                    break
                time.sleep(0.5)
            else:
                raise RuntimeError(f"{expected} videos did not load within {timeout:.0f} s: {videos}")
            page.evaluate("""() => document.querySelectorAll('video').forEach(v => { v.pause(); v.currentTime = 0.1; })""")
            time.sleep(1.0)
            page.screenshot(path=str(out), full_page=True)
        finally:
            context.close()
    return {"videos": videos, "screenshot": str(out)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running app (default: start `python app.py` on a free port and stop it after)")
    p.add_argument("--out", default=str(ROOT / "docs" / "demo.png"), help="screenshot path (default: docs/demo.png)")
    p.add_argument("--chromium", help="browser binary (default: chromium on PATH)")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds to wait for the videos (default: 240)")
    p.add_argument("--default-modes", action="store_true", help="leave the mode checkboxes as the page sets them "
                   "(default: tick every mode)")
    p.add_argument("app_args", nargs="*", help="extra arguments for app.py when it is started here (after --)")
    args = p.parse_args(argv)
    proc = None
    url = args.url
    try:
        if url is None:
            port = free_port()
            url = f"http://127.0.0.1:{port}/"
            proc = start_app(port, *args.app_args, log=sys.stderr)
            wait_for_server(url, proc)
        result = check(url, args.out, chromium=args.chromium, timeout=args.timeout,
                       all_modes=not args.default_modes)
    except RuntimeError as e:
        print(f"browser check FAILED: {e}", file=sys.stderr)
        return 1
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    for v in result["videos"]:
        print(f"{v['id']}: {v['width']}x{v['height']}, {v['duration']:.2f} s, readyState {v['ready']}")
    print(f"screenshot: {result['screenshot']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
