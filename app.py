"""Side-by-side demo: one prompt and seed through Wan 2.1 with BF16, SageAttention3 (emulated),
Attn-QAT and (optionally) naive NVFP4 attention; each video with its time and fidelity to BF16.

    pip install -e ".[app]"
    python app.py                                   # offline tiny model (RANDOM weights), CPU is fine
    python app.py --model ./Wan2.1-T2V-1.3B-Diffusers --qat-checkpoint qat.safetensors --port 7860

The pipeline is loaded once; each mode only swaps attention processors (and, with a QAT
checkpoint, the transformer's weights for Attn-QAT: see :mod:`attnqat.demo`). Requests are queued
one at a time, so one GPU is never oversubscribed. The logic lives in :mod:`attnqat.demo`.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile

import torch

from attnqat.demo import DemoEngine, demo_modes, new_request_dir, validate_request

TITLE = "attnqat: BF16 vs SageAttention3 vs Attn-QAT (Wan 2.1)"
DEFAULT_PROMPT = "a corgi surfing a wave at sunset, cinematic"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="tiny", help="'tiny' (default: offline, RANDOM weights, runs on CPU) or a "
                   "local diffusers-format Wan 2.1 T2V folder / hub id")
    p.add_argument("--qat-checkpoint", metavar="PATH", help="transformer weights from Attn-QAT fine-tuning, used by "
                   "the Attn-QAT column (without it, that column is plain FP4 attention, labelled so)")
    p.add_argument("--modes", help="comma-separated attention modes to offer (default: bf16,sage3,attn_qat,nvfp4, "
                   "those registered)")
    p.add_argument("--port", type=int, default=7860, help="port (default: 7860)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1; 0.0.0.0 for all)")
    p.add_argument("--share", action="store_true", help="also open a public gradio.live link")
    p.add_argument("--device", help="cuda, cuda:1, cpu ... (default: cuda if available, else cpu)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="transformer dtype (default: bf16 on GPU, "
                   "fp32 on CPU)")
    p.add_argument("--out-dir", help="where videos are written (default: a temporary folder)")
    return p.parse_args(argv)


def _fmt_metrics(run) -> str:
    lines = [f"**{run.label}**", f"time **{run.seconds:.2f} s** (denoising {run.denoise_seconds:.2f} s)"]
    if run.psnr is None:
        lines.append("reference for the metrics (strip: its frames)")
    else:
        p = "∞ (identical)" if math.isinf(run.psnr) else f"{run.psnr:.2f} dB"
        lines.append(f"PSNR vs BF16 **{p}** · SSIM **{run.ssim:.4f}**")
        lines.append(f"heat map: |difference| 0 to {run.heat_max:.0f} (of 255)")
    return "  \n".join(lines)


def build_demo(engine: DemoEngine, modes: list[str], out_root: str):
    import gradio as gr

    from attnqat.pipelines import TINY_NOTICE, is_tiny
    from attnqat.pipelines.generate import REAL_DEFAULTS, TINY_DEFAULTS

    tiny = is_tiny(engine.model)
    d = dict(TINY_DEFAULTS, height=64, width=64, frames=5, steps=4) if tiny else REAL_DEFAULTS
    on_cpu = engine.device.type == "cpu"
    optional = [m for m in modes if m != "bf16"]
    default_on = [m for m in optional if m != "nvfp4"] or optional

    def generate(prompt, seed, steps, height, width, frames, selected, progress=gr.Progress()):
        selected = [m for m in (selected or []) if m in modes]
        try:
            validate_request(model=engine.model, prompt=prompt, height=height, width=width, frames=frames,
                             steps=steps, seed=seed, modes=["bf16", *selected])
        except ValueError as e:
            raise gr.Error(str(e), title="Invalid input") from None
        out_dir = new_request_dir(out_root)

        def report(i, n, mode):
            progress((i, n), desc=f"generating {engine.label(mode)} ({i + 1}/{n})")

        try:
            runs = engine.run(prompt, modes=selected, height=int(height), width=int(width), frames=int(frames),
                              steps=int(steps), seed=int(seed), out_dir=out_dir, progress=report)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            raise gr.Error(f"Out of GPU memory at {int(height)}x{int(width)}, {int(frames)} frames: try a smaller "
                           f"size or fewer frames.", title="Out of memory") from None
        except ValueError as e:
            raise gr.Error(str(e), title="Invalid input") from None
        except Exception as e:  # shown in the page; the server keeps serving the next request
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            raise gr.Error(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                           title="Generation failed") from None
        by_mode = {r.mode: r for r in runs}
        outputs, summary = [], {"prompt": prompt, "seed": int(seed), "steps": int(steps), "height": int(height),
                                "width": int(width), "frames": int(frames), "model": engine.model,
                                "qat_checkpoint": engine.qat_checkpoint, "modes": {}}
        for m in modes:
            r = by_mode.get(m)
            if r is None:
                outputs += [None, f"**{engine.label(m)}**  \nnot selected", None]
                continue
            outputs += [str(r.video), _fmt_metrics(r), str(r.strip)]
            summary["modes"][m] = r.summary()
        return [*outputs, summary]

    with gr.Blocks(title=TITLE, delete_cache=(3600, 3600)) as demo:
        gr.Markdown(f"# {TITLE}\nThe same prompt and seed, with the transformer's self-attention in each mode. "
                    "Each video shows its generation time and its fidelity to the BF16 video: PSNR and SSIM "
                    f"averaged over frames, and a strip of its frames over a heat map of |difference| (one colour "
                    "scale for all modes of a request, dark = equal).")
        notes = [f"model `{engine.model}` on `{engine.device}` ({str(engine.dtype).replace('torch.', '')})"]
        if tiny:
            notes.append(f"**Note:** {TINY_NOTICE}. It shows the mechanics (the same seed, modes swapped, metrics), "
                         "not video quality; start the app with `--model <Wan 2.1 folder>` for real videos.")
        if "attn_qat" in modes and not engine.qat_checkpoint:
            notes.append("No `--qat-checkpoint` given: the Attn-QAT column is plain FP4 attention "
                         "(no QAT checkpoint).")
        if "sage3" not in modes:
            notes.append("SageAttention3 (mode `sage3`) is not registered in this attnqat build.")
        if on_cpu:
            notes.append("Running on CPU: keep sizes small.")
        gr.Markdown("  \n".join(notes))
        with gr.Row():
            with gr.Column(scale=3):
                prompt = gr.Textbox(label="Prompt", value=DEFAULT_PROMPT, lines=2)
                selected = gr.CheckboxGroup(choices=[(engine.label(m), m) for m in optional], value=default_on,
                                            label="Modes (BF16 always runs: it is the reference)")
            with gr.Column(scale=2):
                with gr.Row():
                    seed = gr.Number(label="Seed", value=0, precision=0, minimum=0)
                    steps = gr.Slider(1, 50 if tiny else 100, value=d["steps"], step=1, label="Steps")
                with gr.Row():
                    height = gr.Slider(16, 256 if tiny else 1280, value=d["height"], step=16, label="Height")
                    width = gr.Slider(16, 256 if tiny else 1280, value=d["width"], step=16, label="Width")
                    frames = gr.Slider(1, 33 if tiny else 81, value=d["frames"], step=4, label="Frames (4k+1)")
        button = gr.Button("Generate", variant="primary", elem_id="generate")
        outputs = []
        with gr.Row(equal_height=False):
            for m in modes:
                with gr.Column(min_width=160):
                    outputs.append(gr.Video(label=engine.label(m), format="mp4", autoplay=True, loop=True,
                                            elem_id=f"video-{m}", height=256))
                    outputs.append(gr.Markdown(f"**{engine.label(m)}**", elem_id=f"metrics-{m}"))
                    outputs.append(gr.Image(label="frames / |difference| vs BF16", type="filepath",
                                            elem_id=f"strip-{m}", show_label=True, height=120))
        with gr.Accordion("All metrics (JSON)", open=False):
            summary = gr.JSON(label="metrics")
        button.click(generate, [prompt, seed, steps, height, width, frames, selected], [*outputs, summary],
                     api_name="generate")
    demo.queue(default_concurrency_limit=1)  # one generation at a time: one GPU is never oversubscribed
    return demo


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        modes = demo_modes(args.modes.split(",") if args.modes else None)
        engine = DemoEngine.load(args.model, qat_checkpoint=args.qat_checkpoint, device=args.device,
                                 dtype=args.dtype)
    except (ValueError, FileNotFoundError) as e:
        print(f"app.py: error: {e}", file=sys.stderr)
        return 2
    out_root = args.out_dir or tempfile.mkdtemp(prefix="attnqat-demo-")
    demo = build_demo(engine, modes, out_root)
    print(f"serving modes {', '.join(modes)} of model {args.model!r} on {engine.device}", file=sys.stderr,
          flush=True)
    demo.launch(server_name=args.host, server_port=args.port, share=args.share, allowed_paths=[out_root],
                show_error=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    sys.exit(main())
