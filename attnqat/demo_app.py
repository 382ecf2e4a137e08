"""Side-by-side demo: one prompt and seed through Wan 2.1 with BF16, SageAttention3 (emulated),
Attn-QAT and (optionally) naive NVFP4 attention; each video with its time and fidelity to BF16.

    pip install -e ".[app]"
    attnqat demo                                    # the shipped mini model
    attnqat demo --model tiny                       # RANDOM weights: the mechanics in a second per mode
    attnqat demo --model ./Wan2.1-T2V-1.3B-Diffusers --qat-checkpoint qat.safetensors --port 7860

(``python app.py ...`` in a source checkout is the same command.) The pipeline is loaded once; each mode only
swaps attention processors (and, with a QAT checkpoint, the transformer's weights for Attn-QAT: see
:mod:`attnqat.demo`; on mini the default is the QAT fine-tune shipped with it, where installed). Requests generate
one at a time, so one GPU is never oversubscribed, and the line of waiting ones is bounded, in all and per
client (:class:`attnqat.demo.RequestLine`); each column shows its own mode's denoising progress and
appears as soon as its mode is done, and Cancel stops a request at its next denoising step. Every
argument is checked (port free, paths writable, ...) before the model loads: a mistake is one line
on stderr and exit status 2. The logic lives in :mod:`attnqat.demo`; this module is the Gradio page and the
``attnqat demo`` command (gradio, torch and the loaders are imported inside functions, so that ``--help`` and the
argument checks load none of them).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import inspect
import ipaddress
import math
import os
import re
import socket
import sys
import tempfile
import threading
from pathlib import Path

from attnqat.checks import check_device, check_int, check_output_dir, check_text, show
from attnqat.errors import GenerationCancelled, one_line
from attnqat.mini.model import DEFAULT_MODEL, FALLBACK_MODEL, MINI_MISSING_NOTE, MINI_NOTICE, default_model

HELP = "serve the side-by-side demo page: one prompt and seed in every attention mode (needs gradio)"
PROG = "attnqat demo"  # the prefix of the server's log lines on stderr
TITLE = "attnqat: BF16 vs SageAttention3 vs Attn-QAT (Wan 2.1)"
PROGRESS_CELLS = 10  # a denoising progress bar in a column's text: ten cells fit a quarter of the page
DEFAULT_PROMPT = "a corgi surfing a wave at sunset, cinematic"
MINI_PROMPT = "a blue square moves up over a checkered background"  # mini knows the corpus's words only
_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                       r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help=f"'{DEFAULT_MODEL}' (the default: attnqat's own small model, shipped in the "
                   f"package, offline, runs on CPU; without its weights installed '{FALLBACK_MODEL}', with a note), "
                   "'tiny' (offline, RANDOM weights) or a local diffusers-format Wan 2.1 T2V folder / hub id")
    p.add_argument("--qat-checkpoint", metavar="PATH", help="transformer weights from Attn-QAT fine-tuning, used by "
                   "the Attn-QAT column (default: for mini, the QAT fine-tune shipped with it where installed; "
                   "'none', or another model without it: that column is plain FP4 attention, labelled so)")
    p.add_argument("--modes", help="comma-separated attention modes to offer (default: bf16,sage3,attn_qat,nvfp4, "
                   "those registered)")
    p.add_argument("--port", type=int, default=7860, help="port, 1 to 65535, free (default: 7860)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--share", action="store_true", help="also open a public gradio.live link")
    p.add_argument("--device", help="cuda, cuda:1, cpu ... (default: cuda if available, else cpu)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="transformer dtype (default: bf16 on GPU, "
                   "fp32 on CPU)")
    p.add_argument("--out-dir", help="where videos are written, in OUT_DIR/attnqat-demo-requests/ (default: a "
                   "temporary folder); only the app's own request folders there are ever pruned")


def parse_args(argv: list[str]) -> argparse.Namespace:
    """``attnqat demo``'s arguments as the command reads them, --model's default resolved."""
    p = argparse.ArgumentParser(prog=PROG)
    add_arguments(p)
    return resolve_model_default(p.parse_args(argv))


def resolve_model_default(args: argparse.Namespace) -> argparse.Namespace:
    """--model left out: :func:`attnqat.mini.model.default_model` ("mini"; "tiny" only on an installation
    without mini's weights, and then ``args.model_note`` says so)."""
    args.model_note = None
    if args.model is None:
        args.model = default_model()
        if args.model != DEFAULT_MODEL:
            args.model_note = MINI_MISSING_NOTE
    return args


def check_listen(host: str, port: int) -> None:
    """``host`` is an IP address or host name that resolves, and ``port`` is free there."""
    check_text("--host", host)
    check_int("--port", port, 1, 65535, "TCP ports end at 65535")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if not _HOSTNAME.match(host) or re.fullmatch(r"[0-9.]+", host):  # 256.1.1.1 is no name either
            raise ValueError(f"--host {show(host)} is not an IP address or host name") from None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"--host {show(host)} does not resolve ({getattr(e, 'strerror', None) or e})") from None
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server itself binds
        try:
            s.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ValueError(f"--port {port} is in use on {host}; stop what listens there or pick another "
                                 f"port (e.g. --port {port + 1 if port < 65535 else 7860})") from None
            raise ValueError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None


def check_args(args: argparse.Namespace) -> tuple[list[str], Path | None]:
    """Every argument, before the model loads. Return: (the modes to offer, --out-dir as a path)."""
    from attnqat.demo import demo_modes
    from attnqat.pipelines.loading import check_model, check_qat_checkpoint, choose_qat_checkpoint

    check_model(args.model)
    qat_checkpoint, _ = choose_qat_checkpoint(args.model, args.qat_checkpoint, "attn_qat")
    if qat_checkpoint is not None:
        check_qat_checkpoint(qat_checkpoint)
    names = None
    if args.modes is not None:
        names = [m.strip() for m in check_text("--modes", args.modes).split(",")]
        if not all(names):
            raise ValueError(f"--modes {show(args.modes)}: an empty name between commas")
    modes = demo_modes(names)
    check_device("--device", args.device)
    out_dir = None if args.out_dir is None else check_output_dir("--out-dir", args.out_dir, must_be_empty=False)
    check_listen(args.host, args.port)
    return modes, out_dir


def page_theme():
    """Gradio's default theme with whole fonts. The default declares Source Sans Pro (and IBM Plex
    Mono) at weights 400 and 600, and the 600 files Gradio ships are subsets of a few glyphs
    (SourceSansPro-SemiBold: A, B and some Cyrillic), so bold text mixed two fonts ("ʙF16").
    Declaring 400 and 700, whose files are complete, makes bold text one font."""
    import gradio as gr

    return gr.themes.Default(
        font=[gr.themes.LocalFont("Source Sans Pro", weights=(400, 700)), "ui-sans-serif", "system-ui", "sans-serif"],
        font_mono=[gr.themes.LocalFont("IBM Plex Mono", weights=(400, 700)), "ui-monospace", "Consolas", "monospace"])


def _title(label: str, weights: str | None) -> list[str]:
    """A column's first lines: its title (one line: the mode's ``demo_label``) and the weights it runs on
    where they are not the model's own."""
    return [f"**{label}**"] + ([weights] if weights else [])


def _fmt_progress(label: str, weights: str | None, state: str | tuple[int, int]) -> str:
    """A column's text before its video: ``state`` "waiting", "not selected" or its denoising (step, steps)."""
    if isinstance(state, tuple):
        done, total = state
        filled = round(PROGRESS_CELLS * done / total) if total else 0
        state = (f"denoising {'▰' * filled}{'▱' * (PROGRESS_CELLS - filled)} step {done} of {total}" if done
                 else "starting")
    return "  \n".join([*_title(label, weights), state])


def _fmt_metrics(run) -> str:
    from attnqat.demo import psnr_frames_line

    lines = [*_title(run.label, run.weights), f"time **{run.seconds:.2f} s** (denoising {run.denoise_seconds:.2f} s)"]
    if run.precision:
        lines.append(f"precision: {run.precision}")
    if run.psnr is None:
        lines.append("reference for the metrics (strip: its frames)")
    else:
        p = "∞ (identical)" if math.isinf(run.psnr) else f"{run.psnr:.2f} dB"
        lines.append(f"PSNR (RGB) vs BF16 **{p}** · SSIM (luma) **{run.ssim:.4f}**")
        if len(run.psnr_frames) > 1:
            lines.append(psnr_frames_line(run.psnr_frames))
        lines.append(f"heat map: |difference| 0 to {min(run.heat_max, 255):.0f} (of 255)")
    return "  \n".join(lines)


METRICS_NOTE = ("The numbers measure the generated frames before video compression: PSNR over the R, G, B "
                "values (0-255) of every pixel, SSIM (Gaussian 11x11 window, sigma 1.5) on the luma "
                "Y = 0.299 R + 0.587 G + 0.114 B, both per frame and averaged over frames; under the averages, the "
                "worst and the last frame's PSNR and every frame's as a sparkline (low to high within the video), "
                "so a video that falls apart late shows it. The videos you see "
                "are H.264 mp4s (lossy); download *lossless frames* under a column for the exact PNG frames "
                "the numbers were computed on.")


def _client(request) -> str:
    """Who sent a request: the peer's address (through a proxy or --share's tunnel every visitor is that one
    client, so the per-client cap then holds for all together)."""
    client = getattr(request, "client", None)
    return str(getattr(client, "host", None) or "unknown")


def refusal(message: str, title: str, client: str | None = None):
    """A ``gr.Error`` for the page, logged as one line on the server's stderr instead of a traceback
    (``ATTNQAT_TRACEBACK=1`` keeps Gradio's traceback). A client sending bad requests adds one line each."""
    import gradio as gr

    source = f" from {client}" if client else ""
    print(f"{PROG}: {title.lower()}{source}: {one_line(message)[:500]}", file=sys.stderr, flush=True)
    quiet = {} if os.environ.get("ATTNQAT_TRACEBACK") or "print_exception" not in inspect.signature(gr.Error).parameters \
        else {"print_exception": False}
    return gr.Error(message, title=title, **quiet)


def check_selected(selected, modes: list[str]) -> list[str]:
    """The page's mode checkboxes as sent (a list of offered mode names; nothing selected: empty or None)."""
    if selected is None:
        return []
    if not isinstance(selected, list) or not all(isinstance(m, str) for m in selected):
        raise ValueError(f"the modes must be a list of mode names, got {show(selected)}")
    unknown = [m for m in selected if m not in modes]
    if unknown:
        raise ValueError(f"mode {show(unknown[0])} is not offered here; offered: {', '.join(modes)}")
    return selected


def make_handler(engine, modes: list[str], out_root: str | Path, line=None):
    """The page's generate function: an async generator that yields the outputs (per mode: video,
    metrics, strip, lossless frames; then the JSON summary) each time a mode is done.

    Its inputs arrive as the client sent them (the event does not preprocess them), so a wrong type (a
    seed of 1.5, a list as the prompt, true as a number of steps) is refused, never rounded or turned
    into text. A valid request then joins ``line`` (:class:`~attnqat.demo.RequestLine`, one generation at a
    time, bounded in all and per client) or is refused at once.

    The generation runs in a worker thread. Each column's text says where its mode is (waiting, its denoising
    step, then its metrics; "not selected" for a mode left out), updated after every step; the request's
    overall progress goes through ``gr.Progress`` (the page shows it in one place, not over every column). If
    the request is cancelled (the Cancel button, or the page closed), Gradio
    cancels this coroutine at its ``await``; the ``finally`` sets the engine's cancel event, and the
    worker stops at its next denoising step."""
    import gradio as gr
    import torch

    from attnqat.demo import RequestLine, new_request_dir, validate_request
    from attnqat.kernels import REFERENCE_MODE

    line = RequestLine() if line is None else line

    async def generate(prompt, seed, steps, height, width, frames, selected, high_precision_steps=0,
                       request: gr.Request = None, progress=gr.Progress()):
        client = _client(request)
        high_precision_steps = 0 if high_precision_steps is None else high_precision_steps  # an emptied box
        try:
            selected = check_selected(selected, modes)
            validate_request(model=engine.model, prompt=prompt, height=height, width=width, frames=frames,
                             steps=steps, seed=seed, modes=[REFERENCE_MODE, *selected],
                             high_precision_steps=high_precision_steps)
        except ValueError as e:
            raise refusal(str(e), "Invalid input", client) from None
        try:
            ahead = line.join(client)
        except ValueError as e:
            raise refusal(str(e), "Busy", client) from None
        try:
            if ahead:
                progress(0, desc=f"waiting in line: {ahead} request{'s' if ahead > 1 else ''} ahead")
            async with line.turn(), contextlib.aclosing(_generate(
                    prompt, seed, steps, height, width, frames, selected, high_precision_steps, client,
                    progress)) as outputs:  # closed (its worker told to stop) with this one
                async for out in outputs:
                    yield out
        finally:
            line.leave(client)

    # Gradio passes the request to a parameter annotated gr.Request; this module's annotations are strings
    # (``from __future__ import annotations``) naming a local import, which Gradio cannot resolve.
    generate.__annotations__["request"] = gr.Request

    async def _generate(prompt, seed, steps, height, width, frames, selected, high_precision_steps, client, progress):
        try:
            out_dir = new_request_dir(out_root)
        except OSError as e:
            raise refusal(f"could not create a folder for this request in {str(out_root)!r}: "
                          f"{e.strerror or e}", "Generation failed", client) from None
        run_modes = [REFERENCE_MODE, *[m for m in modes if m in selected]]
        note = engine.vocabulary_note(prompt)  # mini: the prompt's words it does not know; it goes on
        if note:
            gr.Warning(note)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()

        def emit(kind, payload=None):
            try:
                loop.call_soon_threadsafe(events.put_nowait, (kind, payload))
            except RuntimeError:  # the event loop is gone (server shutting down): nobody to tell
                pass

        def work():
            try:
                emit("done", engine.run(prompt, modes=selected, height=int(height), width=int(width),
                                        frames=int(frames), steps=int(steps), seed=int(seed), out_dir=out_dir,
                                        progress=lambda *a: emit("step", a), on_run=lambda r: emit("run", r),
                                        cancel=cancel, high_precision_steps=int(high_precision_steps)))
            except BaseException as e:  # handed to the coroutine, which shows it in the page
                emit("error", e)

        denoising: dict[str, tuple[int, int]] = {}  # mode -> (step, steps) once it has started
        summary = {"prompt": prompt, "seed": int(seed), "steps": int(steps), "height": int(height),
                   "width": int(width), "frames": int(frames), "high_precision_steps": int(high_precision_steps),
                   "model": engine.model,
                   "qat_checkpoint": engine.qat_checkpoint, "vocabulary_note": note, "modes": {}}
        shown: dict[str, object] = {}

        def outputs(texts_only: bool = False):
            """Every output; ``texts_only``: the columns' texts, the rest left as the page shows it (no video,
            strip or zip is sent again after each step)."""
            out = []
            for m in modes:
                r = shown.get(m)
                if r is not None:
                    text = _fmt_metrics(r) + (f"  \n⚠ {note}" if note and m == REFERENCE_MODE else "")
                    files = [str(r.video), str(r.strip), None if r.frames_zip is None else str(r.frames_zip)]
                else:
                    state = denoising.get(m, "waiting") if m in run_modes else "not selected"
                    text, files = _fmt_progress(engine.label(m), engine.weights(m), state), [None, None, None]
                if texts_only:
                    files = [gr.skip()] * 3
                out += [files[0], text, *files[1:]]
            return [*out, gr.skip() if texts_only else summary]

        yield outputs()  # the previous request's videos go: no column shows a video its text is not about
        worker = threading.Thread(target=work, name="attnqat-demo-request", daemon=True)
        worker.start()
        try:
            while True:
                kind, payload = await events.get()
                if kind == "step":
                    i, n, mode, step, total = payload
                    progress((step, total), desc=f"{engine.label(mode)} (mode {i + 1} of {n}): denoising steps",
                             unit="steps")
                    denoising[mode] = (step, total)
                    yield outputs(texts_only=True)
                elif kind == "run":
                    shown[payload.mode] = payload
                    summary["modes"][payload.mode] = payload.summary()
                    yield outputs()
                elif kind == "done":
                    for r in payload:  # strips redrawn on the request's common colour scale
                        shown[r.mode] = r
                        summary["modes"][r.mode] = r.summary()
                    yield outputs()
                    return
                else:
                    raise payload
        except GenerationCancelled:
            return
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            raise refusal(f"Out of GPU memory at {int(height)}x{int(width)}, {int(frames)} frames: try a smaller "
                          f"size or fewer frames.", "Out of memory", client) from None
        except ValueError as e:
            raise refusal(str(e), "Invalid input", client) from None
        except gr.Error:
            raise
        except Exception as e:  # shown in the page; the server keeps serving the next request
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            raise refusal(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", "Generation failed",
                          client) from None
        finally:
            cancel.set()  # a cancelled or abandoned request stops at its next denoising step

    return generate


def build_demo(engine, modes: list[str], out_root: str | Path, line=None):
    """The page. ``line``: the :class:`~attnqat.demo.RequestLine` its requests join (default: a new one with
    :data:`~attnqat.demo.LINE_WAITING` waiting, :data:`~attnqat.demo.PER_CLIENT` per client)."""
    import gradio as gr

    from attnqat.demo import (LINE_WAITING, MAX_PROMPT_CHARS, MAX_UPLOAD, PER_CLIENT, SIZE_LIMITS, WORK_LIMITS,
                              model_kind, page_defaults, request_work)
    from attnqat.kernels import REFERENCE_MODE, mode_of
    from attnqat.pipelines.tiny import TINY_NOTICE

    kind = model_kind(engine.model)
    d = page_defaults(engine.model, engine.device)
    top = SIZE_LIMITS[kind]
    on_cpu = engine.device.type == "cpu"
    optional = [m for m in modes if m != REFERENCE_MODE]
    default_on = [m for m in optional if mode_of(m).demo_ticked] or optional
    qat_column = any(mode_of(m).uses_qat_weights for m in modes)
    ref, why = WORK_LIMITS[kind]

    # Gradio 6 takes the theme in launch() (launch_options); Gradio 5 in Blocks().
    theme = {} if _theme_in_launch() else {"theme": page_theme()}
    with gr.Blocks(title=TITLE, delete_cache=(3600, 3600), **theme) as demo:
        gr.Markdown(f"# {TITLE}\nThe same prompt and seed, with the transformer's self-attention in each mode; "
                    "each column's fidelity to the BF16 video under it.")
        with gr.Accordion("About this demo: the metrics, the model, the limits", open=False):
            gr.Markdown("Each video shows its generation time and its fidelity to the BF16 video: PSNR and SSIM, and "
                        "a strip of its frames over a heat map of |difference| (one colour scale for all modes of a "
                        "request, dark = equal). Columns appear as their mode finishes. *BF16 on the first/last k "
                        "steps* runs those denoising steps of every other column in BF16 attention (a precision "
                        f"schedule, as SageAttention3's authors recommend).\n\n{METRICS_NOTE}")
            notes = [f"model `{engine.model}` on `{engine.device}` ({str(engine.dtype).replace('torch.', '')})"]
            if kind == "tiny":
                notes.append(f"**Note:** {TINY_NOTICE}. It shows the mechanics (the same seed, modes swapped, metrics), "
                             "not video quality; start the app with `--model mini` (attnqat's own small model, when "
                             "installed) or `--model <Wan 2.1 folder>` for real videos.")
            elif kind == "mini":
                notes.append(f"**Note:** {MINI_NOTICE}.")
            if qat_column and not engine.qat_checkpoint:
                notes.append("No `--qat-checkpoint` given: the Attn-QAT column is plain FP4 attention "
                             "(no QAT checkpoint).")
            elif qat_column and engine.qat_shipped:
                notes.append(f"The Attn-QAT column runs the QAT fine-tune shipped with the model "
                             f"(`{Path(engine.qat_checkpoint).name}`); start the app with `--qat-checkpoint none` for "
                             f"plain FP4 attention on the base weights.")
            if on_cpu:
                notes.append("Running on CPU: keep sizes small.")
            notes.append(f"Limits of one request: height × width × frames × steps × modes at most "
                         f"{request_work(**ref):,} pixel-frame-steps (as much as {ref['height']}×{ref['width']}, "
                         f"{ref['frames']} frames, {ref['steps']} steps in {ref['modes']} modes: {why}); prompts of "
                         f"up to {MAX_PROMPT_CHARS} characters; uploads up to {MAX_UPLOAD.upper()} (the page takes "
                         f"none). One request generates at a time; at most {LINE_WAITING} wait, {PER_CLIENT} per visitor. "
                         "Cancel stops a request at its next denoising step.")
            gr.Markdown("  \n".join(notes))
        with gr.Row():
            with gr.Column(scale=3):
                prompt = gr.Textbox(label="Prompt", value=MINI_PROMPT if kind == "mini" else DEFAULT_PROMPT, lines=2,
                                    max_length=MAX_PROMPT_CHARS)
                selected = gr.CheckboxGroup(choices=[(engine.label(m), m) for m in optional], value=default_on,
                                            label="Modes (BF16 always runs: it is the reference)")
            with gr.Column(scale=2):
                with gr.Row():
                    seed = gr.Number(label="Seed", value=0, precision=0, minimum=0)
                    steps = gr.Slider(1, top["steps"], value=d["steps"], step=1, label="Steps")
                    high_steps = gr.Number(label="BF16 on the first/last k steps (FP4 columns)", value=0,
                                           precision=0, minimum=0, elem_id="high-precision-steps")
                with gr.Row():
                    height = gr.Slider(16, top["height"], value=d["height"], step=16, label="Height")
                    width = gr.Slider(16, top["width"], value=d["width"], step=16, label="Width")
                    frames = gr.Slider(1, top["frames"], value=d["frames"], step=4, label="Frames (4k+1)")
        with gr.Row():
            button = gr.Button("Generate", variant="primary", elem_id="generate", scale=4)
            stop = gr.Button("Cancel", variant="stop", elem_id="cancel", scale=1)
        # The request's overall progress shows here only: Gradio otherwise draws it over every output, and every
        # column, unticked ones too, would show the running mode's bar. Each column's text has its own.
        status = gr.Markdown("Each column shows its mode's progress while a request runs.",
                             elem_id="request-progress")
        outputs = []
        with gr.Row(equal_height=False):
            for m in modes:
                label = engine.label(m)
                with gr.Column(min_width=160):
                    # video and strip first, each of a fixed height, and the texts (of any length) under them:
                    # the columns' pictures stay level whatever their texts. The outputs keep the API's order:
                    # video, metrics, strip, lossless frames.
                    video = gr.Video(label=f"{label}: video (mp4, lossy)", format="mp4", autoplay=True,
                                     loop=True, elem_id=f"video-{m}", height=256)
                    strip = gr.Image(label=f"{label}: frames / |difference| vs BF16", type="filepath",
                                     elem_id=f"strip-{m}", show_label=True, height=120)
                    metrics = gr.Markdown("  \n".join(_title(label, engine.weights(m))), label=f"{label}: metrics",
                                          elem_id=f"metrics-{m}")
                    frames_zip = gr.File(label=f"{label}: lossless frames (PNG, zip)", elem_id=f"frames-{m}")
                    outputs += [video, metrics, strip, frames_zip]
        with gr.Accordion("All metrics (JSON)", open=False):
            summary = gr.JSON(label="metrics (JSON)")
        # Every request reaches the handler at once (concurrency_limit None): its RequestLine lets one generate at a
        # time, so one GPU is never oversubscribed, and refuses what is beyond its bounds with a reason. Gradio's
        # own queue (max_size) only holds what arrives faster than the handler can refuse it.
        event = button.click(make_handler(engine, modes, out_root, line), [prompt, seed, steps, height, width,
                                                                           frames, selected, high_steps],
                             [*outputs, summary], api_name="generate", preprocess=False, concurrency_limit=None,
                             show_progress_on=[status])
        stop.click(None, None, None, cancels=[event], api_name=False, queue=False)
    demo.queue(max_size=LINE_WAITING)
    return demo


def _theme_in_launch() -> bool:
    import gradio as gr

    return "theme" in inspect.signature(gr.Blocks.launch).parameters


def launch_options(args: argparse.Namespace, out_root: Path) -> dict:
    """``demo.launch`` keywords: only the app's request folder is served; uploads capped; Gradio's
    start-up lines (and its share hint) only with --share (the app prints its own URL line)."""
    from attnqat.demo import MAX_UPLOAD, REQUESTS_FOLDER

    options = dict(server_name=args.host, server_port=args.port, share=args.share, show_error=True,
                   allowed_paths=[str(Path(out_root) / REQUESTS_FOLDER)], max_file_size=MAX_UPLOAD,
                   quiet=not args.share, prevent_thread_lock=True)
    if _theme_in_launch():
        options["theme"] = page_theme()
    return options


def main(args: argparse.Namespace) -> int:
    """Check every argument, load the pipeline, serve the page until Ctrl-C. A mistake is raised (the
    console script makes it one line and exit status 2: a ValueError, or an ImportError without gradio)."""
    args = resolve_model_default(args)
    modes, out_dir = check_args(args)
    if args.model_note:  # after the checks: a mistake stays one line
        print(f"{PROG}: note: {args.model_note}", file=sys.stderr, flush=True)
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # read when gradio is imported
    try:
        import gradio  # noqa: F401
    except ImportError:
        raise ImportError("the demo needs gradio: pip install -e '.[app]'") from None
    from attnqat.demo import REQUESTS_FOLDER, DemoEngine

    engine = DemoEngine.load(args.model, qat_checkpoint=args.qat_checkpoint, device=args.device, dtype=args.dtype)
    out_root = out_dir if out_dir is not None else Path(tempfile.mkdtemp(prefix="attnqat-demo-"))
    (out_root / REQUESTS_FOLDER).mkdir(parents=True, exist_ok=True)
    demo = build_demo(engine, modes, out_root)
    try:
        demo.launch(**launch_options(args, out_root))
    except OSError as e:  # the port was taken after it was checked
        raise ValueError(f"cannot serve on {args.host}:{args.port}: {e}") from None
    print(f"{PROG}: serving modes {', '.join(modes)} of model {args.model!r} on {engine.device} at "
          f"http://{args.host}:{args.port}/ (files in {out_root / REQUESTS_FOLDER})", file=sys.stderr, flush=True)
    try:
        demo.block_thread()
    except KeyboardInterrupt:
        pass
    return 0
