"""End-to-end: one denoising step of the Wan 2.1 14B transformer in each attention mode.

    python bench/e2e.py                          # GPU: 14B from its published config, random bf16 weights
    python bench/e2e.py --layers 10              # a cheaper partial model (10 of 40 blocks), said in the table
    python bench/e2e.py --tiny                   # the code path on CPU with the tiny model (seconds)
    python bench/e2e.py --layers 10 --modes diffusers,bf16,attn_qat --compile
                                                 # diffusers' own processor beside the patched modes, each
                                                 # also under torch.compile(fullgraph=True)

The transformer is built in code from Wan 2.1 T2V 14B's published config (no download) with random
weights created directly on the GPU in bf16. One step = the two transformer calls of classifier-free
guidance (cond, then uncond; batch 1 each, as diffusers' WanPipeline runs them) on 480x832x81-frame
latents (1, 16, 21, 60, 104) -> 32,760 self-attention tokens, with 512 text tokens.

Per mode (self-attention attn1 patched, as in the paper; cross-attention stays diffusers' SDPA):
step time (CUDA events, after warm-up), attention time (CUDA events around every patched attention
call, via the processors' AttentionTimer) and its share of the step, peak GPU memory, ratios to bf16
measured in the same run. ``diffusers`` in ``--modes`` is the unpatched transformer (diffusers' own
processor and SDPA); when it runs, ratios are to it instead of bf16. ``--compile`` also times each mode under
``torch.compile(model, fullgraph=True)`` (Inductor; the warm-up step compiles, and its time is reported) and
reports the compiled output's relative error to the eager one (attention time is not measured there: a
compiled graph has no per-call timing points). Writes the `## End-to-end: Wan 2.1 14B transformer step` section of
docs/benchmarks.md (only that section; with ``--compile`` the `## End-to-end, compiled: ...` one) and a JSON file, and prints the table.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from attnqat.kernels import REFERENCE_MODE, available_modes, mode_of  # noqa: E402
from attnqat.pipelines import AttentionTimer, TINY_TRANSFORMER_CONFIG, patch_attention, unpatch_attention  # noqa: E402
from attnqat.pipelines.wan_configs import WAN21_14B_TRANSFORMER_CONFIG  # noqa: E402
from bench._report import update_section  # noqa: E402

SECTION = "## End-to-end: Wan 2.1 14B transformer step"
COMPILED_SECTION = "## End-to-end, compiled: Wan 2.1 14B transformer step"  # --compile: its own table, beside eager's
MARKERS = {SECTION: "e2e", COMPILED_SECTION: "e2e_compiled"}  # each table's section of the docs page (update_section)

# 480x832 pixels, 81 frames -> latents (16, 21, 60, 104): VAE 4x in time (+1 frame), 8x in space.
LATENT_480P = (16, 21, 60, 104)
TINY_LATENT = (16, 2, 8, 8)  # --tiny: 32 tokens (splits over 2 and 4 processes)
TEXT_TOKENS = 512
# Modes whose inference forward is another mode's (their record's same_forward_as): timing them again adds nothing.
SAME_FORWARD = available_modes(lambda m: m.same_forward_as is not None)
UNPATCHED = "diffusers"  # the --modes name of the unpatched transformer (diffusers' own attention processor)


def build_transformer(config: dict, device: torch.device, dtype: torch.dtype, num_layers: int | None):
    """WanTransformer3DModel with random weights created directly on ``device`` in ``dtype`` (no
    fp32 copy on the CPU: 14B parameters would be 56 GB), then diffusers' fp32 modules cast back."""
    from diffusers import WanTransformer3DModel

    cfg = dict(config, num_layers=num_layers or config["num_layers"])
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            torch.manual_seed(0)
            model = WanTransformer3DModel(**cfg)
    finally:
        torch.set_default_dtype(previous)
    keep = model._keep_in_fp32_modules or []
    for name, p in model.named_parameters():
        if any(part in keep for part in name.split(".")):
            p.data = p.data.float()
    return model.eval().requires_grad_(False)


class _Events:
    """Wall time of a region: CUDA events on GPU, perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    @contextlib.contextmanager
    def time(self, out: list):
        if self.cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            yield
            e.record()
            torch.cuda.synchronize()
            out.append(s.elapsed_time(e) / 1e3)
        else:
            t0 = time.perf_counter()
            yield
            out.append(time.perf_counter() - t0)


def sdpa_context(backend: str):
    if backend == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel({"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                        "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[backend])


@torch.no_grad()
def run_mode(model, mode: str, inputs: dict, *, warmup: int, repeats: int, device: torch.device,
             sdpa: str, keep_outputs: bool = False, compile: str | None = None) -> dict:
    """Warm up, then time ``repeats`` steps (cond + uncond) of ``model`` with attn1 in ``mode`` (``"diffusers"``:
    unpatched); with ``compile`` (a torch.compile backend) the same again under
    ``torch.compile(model, fullgraph=True, backend=compile)``.
    ``keep_outputs``: the last step's two outputs (on the CPU) under "outputs" (not JSON)."""
    timer = AttentionTimer()
    if mode != UNPATCHED:
        patch_attention(model, mode, "self", timer=timer)
    clock = _Events(device)

    def step(fn):
        outs = []
        for ctx in (inputs["cond"], inputs["uncond"]):
            outs.append(fn(hidden_states=inputs["latents"], timestep=inputs["timestep"],
                           encoder_hidden_states=ctx, return_dict=False)[0])
        return outs

    def timed(fn):
        first: list[float] = []
        for i in range(warmup):
            with clock.time(first) if i == 0 else contextlib.nullcontext():
                step(fn)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        timer.reset()
        times: list[float] = []
        for _ in range(repeats):
            with clock.time(times):
                outs = step(fn)
        return times, outs, (first[0] if first else None)

    compiled = {}
    try:
        with sdpa_context(sdpa):
            times, outs, _ = timed(model)
            attn_s, calls = timer.total_seconds() / repeats, timer.calls // repeats
            peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
            if compile:
                timer.enabled = False  # a compiled graph has no per-call timing points
                torch._dynamo.reset()
                c_times, c_outs, first_s = timed(torch.compile(model, fullgraph=True, backend=compile))
                err = max(((c.float() - e.float()).norm() / e.float().norm()).item() for c, e in zip(c_outs, outs))
                compiled = {"compiled_step_s": sum(c_times) / len(c_times), "compiled_step_s_all": c_times,
                            "compile_warmup_s": first_s, "compiled_rel_err": err}
    finally:
        unpatch_attention(model)
        torch._dynamo.reset()
    step_s = sum(times) / len(times)
    return {
        "mode": mode, "step_s": step_s, "step_s_all": times, "attention_s": attn_s,
        "attention_share": attn_s / step_s, "attention_calls_per_step": calls, "peak_gib": peak,
        "finite": bool(all(torch.isfinite(o).all() for o in outs)),
    } | compiled | ({"outputs": [o.cpu() for o in outs]} if keep_outputs else {})


def markdown(results: list[dict], meta: dict) -> str:
    base = next((r for r in results if r["mode"] == UNPATCHED), None) or next(
        (r for r in results if r["mode"] == REFERENCE_MODE), None)
    bf16 = next((r for r in results if r["mode"] == REFERENCE_MODE), None)
    compiled = all("compiled_step_s" in r for r in results)
    lines = [COMPILED_SECTION if meta["compile"] else SECTION, "",
             f"{meta['model']}: one denoising step = transformer calls for cond + uncond (batch 1 each) at "
             f"{meta['resolution']} ({meta['tokens']:,} self-attention tokens, {meta['text_tokens']} text tokens); "
             f"self-attention (attn1) in the mode, cross-attention in diffusers' SDPA. Random {meta['dtype']} weights "
             f"built from the published config (no download); {meta['warmup']} warm-up step(s), mean of "
             f"{meta['repeats']}. Times from {meta['clock']}; attention time = the patched attn1 calls"
             + (f"; `{UNPATCHED}` = the unpatched transformer (diffusers' own attention processor)"
                if any(r["mode"] == UNPATCHED for r in results) else "")
             + (f"; compiled = `torch.compile(transformer, fullgraph=True)` ({meta['compile']}), its warm-up step compiles, and "
                "its error is ||compiled - eager|| / ||eager|| of the step's outputs" if compiled else "") + ".",
             "",
             f"Device: {meta['device']}; torch {meta['torch']}, diffusers {meta['diffusers']}, triton {meta['triton']}; "
             f"SDPA backend: {meta['sdpa']}; {meta['date']}.", ""]
    if meta["partial"]:
        lines += [f"**Partial model: {meta['layers']} of 40 blocks** (`--layers {meta['layers']}`); a full "
                  f"step takes about 40/{meta['layers']} times the block part.", ""]
    ratio = f"× {base['mode']}" if base else "× bf16"
    head = f"| mode | step (s) | {ratio} |"
    if compiled:
        head += f" compiled step (s) | compiled {ratio} | compiled warm-up (s) | compiled vs eager error |"
    head += " attention (s) | attention share | attention × bf16 | peak memory (GiB) | output finite |"
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        rs = f"{r['step_s'] / base['step_s']:.3f}" if base else "–"
        row = f"| {r['mode']} | {r['step_s']:.3f} | {rs} |"
        if compiled:
            rc = f"{r['compiled_step_s'] / base['compiled_step_s']:.3f}" if base else "–"
            row += (f" {r['compiled_step_s']:.3f} | {rc} | {r['compile_warmup_s'] or 0:.1f} | "
                    f"{r['compiled_rel_err']:.1e} |")
        timed = r["mode"] != UNPATCHED
        ra = (f"{r['attention_s'] / bf16['attention_s']:.2f}" if timed and bf16 and bf16["attention_s"] > 0
              else "–")
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "n/a"
        attn = f"{r['attention_s']:.3f} | {100 * r['attention_share']:.1f}%" if timed else "– | –"
        row += f" {attn} | {ra} | {peak} | {'yes' if r['finite'] else 'NO'} |"
        lines.append(row)
    for m in SAME_FORWARD:
        if m in meta["skipped"]:
            lines += ["", f"`{m}` is not timed: its inference forward is `{mode_of(m).same_forward_as}`'s."]
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--modes", help="comma-separated modes (default: every registered mode except "
                   f"{', '.join(SAME_FORWARD)}, whose forward is another mode's); {REFERENCE_MODE} always runs, first after "
                   f"{UNPATCHED!r} (the unpatched transformer, when listed)")
    p.add_argument("--compile", action="store_true", help="also time each mode under torch.compile(model, "
                   "fullgraph=True)")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend (default inductor; "
                   "aot_eager traces without generating code: the tests' quick check of the code path)")
    p.add_argument("--layers", type=int, help="build only this many of the 40 blocks (cheaper; said in the table)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up steps per mode (default 1)")
    p.add_argument("--repeats", type=int, default=2, help="timed steps per mode (default 2)")
    p.add_argument("--sdpa", default="default", choices=["default", "cudnn", "flash", "efficient", "math"],
                   help="torch SDPA backend for bf16 and the unpatched cross-attention (default: torch's choice)")
    p.add_argument("--tiny", action="store_true", help="the tiny CPU model and tiny latents: tests the code path")
    p.add_argument("--device", help="default: cuda (cpu with --tiny)")
    p.add_argument("--docs", help="markdown file whose section to write (default: docs/benchmarks.md; none with --tiny)")
    p.add_argument("--json", help="JSON results path (default: bench/results/e2e.json; none with --tiny)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import diffusers
    import triton

    device = torch.device(args.device or ("cpu" if args.tiny else "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench/e2e.py: error: no CUDA GPU; use --tiny to check the code path on CPU", file=sys.stderr)
        return 2
    registered = available_modes()
    wanted = args.modes.split(",") if args.modes else [m for m in registered if m not in SAME_FORWARD]
    unknown = [m for m in wanted if m not in registered + [UNPATCHED]]
    if unknown:
        print(f"bench/e2e.py: error: unknown modes {unknown}; available: {', '.join(registered)}, {UNPATCHED}",
              file=sys.stderr)
        return 2
    modes = [UNPATCHED] * (UNPATCHED in wanted) + [REFERENCE_MODE] + [m for m in wanted
                                                                        if m not in (REFERENCE_MODE, UNPATCHED)]
    skipped = [m for m in registered if m not in modes]

    if args.tiny:
        config, dtype = TINY_TRANSFORMER_CONFIG, torch.float32 if device.type == "cpu" else torch.bfloat16
        latent, text, name, resolution = TINY_LATENT, 32, "Tiny Wan 2.1-architecture transformer", "64×64×5 frames"
        text_dim = config["text_dim"]
    else:
        config, dtype = WAN21_14B_TRANSFORMER_CONFIG, torch.bfloat16
        latent, text, name, resolution = LATENT_480P, TEXT_TOKENS, "Wan 2.1 T2V 14B transformer", "480×832×81 frames"
        text_dim = config["text_dim"]
    layers = args.layers or config["num_layers"]
    t0 = time.perf_counter()
    model = build_transformer(config, device, dtype, layers)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"built {name} ({layers} blocks, {n_params / 1e9:.2f} B parameters) in {time.perf_counter() - t0:.1f} s",
          file=sys.stderr)
    g = torch.Generator(device="cpu").manual_seed(0)
    inputs = {
        "latents": torch.randn(1, *latent, generator=g).to(device, dtype),
        "cond": torch.randn(1, text, text_dim, generator=g).to(device, dtype),
        "uncond": torch.randn(1, text, text_dim, generator=g).to(device, dtype),
        "timestep": torch.tensor([999.0], device=device),
    }
    tokens = latent[1] * (latent[2] // 2) * (latent[3] // 2)
    results = []
    for mode in modes:
        r = run_mode(model, mode, inputs, warmup=args.warmup, repeats=args.repeats, device=device, sdpa=args.sdpa,
                     compile=args.compile_backend if args.compile else None)
        results.append(r)
        compiled = (f", compiled step {r['compiled_step_s']:.3f} s (warm-up {r['compile_warmup_s']:.1f} s, error "
                    f"{r['compiled_rel_err']:.1e})" if args.compile else "")
        print(f"{mode:>16}: step {r['step_s']:.3f} s, attention {r['attention_s']:.3f} s "
              f"({100 * r['attention_share']:.1f}%), peak {r['peak_gib'] if r['peak_gib'] is None else round(r['peak_gib'], 1)} GiB"
              + compiled, file=sys.stderr)

    meta = {"model": name + (f" ({layers} of {config['num_layers']} blocks)" if layers != config["num_layers"] else ""),
            "layers": layers, "partial": layers != config["num_layers"] and not args.tiny,
            "resolution": resolution, "tokens": tokens, "text_tokens": text, "warmup": args.warmup,
            "repeats": args.repeats, "sdpa": args.sdpa, "skipped": skipped, "compile": args.compile_backend if args.compile else None,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor() or platform.machine()})",
            "torch": torch.__version__, "diffusers": diffusers.__version__, "triton": triton.__version__,
            "date": datetime.date.today().isoformat(), "parameters": n_params,
            "dtype": str(dtype).replace("torch.", ""), "clock": "CUDA events" if device.type == "cuda" else "perf_counter"}
    table = markdown(results, meta)
    print(table)
    docs = args.docs or (None if args.tiny else str(ROOT / "docs" / "benchmarks.md"))
    if docs:
        section = MARKERS[table.split("\n", 1)[0]]  # markdown() chose it: the compiled run's own, or the eager one
        update_section(section, table, Path(docs))
        print(f"wrote section {section!r} of {docs}", file=sys.stderr)
    js = args.json or (None if args.tiny else str(ROOT / "bench" / "results" / "e2e.json"))
    if js:
        Path(js).parent.mkdir(parents=True, exist_ok=True)
        Path(js).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
        print(f"wrote {js}", file=sys.stderr)
    return 0 if all(math.isfinite(r["step_s"]) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
