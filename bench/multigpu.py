"""Context-parallel scaling: one denoising step of the Wan 2.1 14B transformer on 1 and on N GPUs.

    torchrun --nproc-per-node 2 bench/multigpu.py                      # 480p and 720p, bf16 / attn_qat / sage3
    torchrun --nproc-per-node 4 bench/multigpu.py --layers 10          # a partial model (said in the table)
    python -m torch.distributed.run --nproc-per-node 2 bench/multigpu.py --tiny   # the code path on CPU (gloo)

One run measures both ends: first each (resolution, mode) step on one GPU, the cases shared out over the N GPUs
(each GPU times its own, alone on it, at the same time as the others), then every rank
enables diffusers' context parallelism (``--parallel``: Ulysses by default, ring for the modes with a
log-sum-exp) on the same model and the step is timed again on all N. Same weights, same inputs, same
process: the ratios are same-run ratios. The step, its inputs and its clock are bench/e2e.py's (cond +
uncond, batch 1 each, random bf16 weights from the published config, CUDA events).

Columns per resolution and mode: the 1-GPU and N-GPU step time, speedup (1-GPU / N-GPU), scaling efficiency
(speedup / N), the mode's ratio to bf16 on 1 GPU and on N GPUs, and how far the N-GPU output is from the
1-GPU output (max abs difference over max abs value). Rank 0 writes the `## Multi-GPU: Wan 2.1 14B step, LAYOUT
on N GPUs` section of docs/benchmarks.md (only that section: one per layout and GPU count) and
bench/results/multigpu/LAYOUT_NGPU.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from attnqat.kernels import REFERENCE_MODE, available_modes  # noqa: E402
from attnqat.pipelines import TINY_TRANSFORMER_CONFIG  # noqa: E402
from attnqat.pipelines.context_parallel import check_degrees, enable_context_parallel  # noqa: E402
from attnqat.pipelines.launch import launch_from_env, process_group, rank_device  # noqa: E402
from attnqat.pipelines.wan_configs import WAN21_14B_TRANSFORMER_CONFIG  # noqa: E402
import e2e  # noqa: E402 - bench/e2e.py: the timed step
from _report import update_section  # noqa: E402


SECTION = "## Multi-GPU: Wan 2.1 14B step, {parallel} on {world} GPUs"  # one section per layout and GPU count
# Latents (channels, frames, height / 8, width / 8) of 81-frame videos: 480x832 -> 32,760 tokens,
# 720x1280 -> 75,600 tokens (patch 1x2x2).
LATENTS = {"480p": e2e.LATENT_480P, "720p": (16, 21, 90, 160)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--resolutions", default="480p,720p", help="comma-separated: 480p, 720p (default both)")
    p.add_argument("--modes", default="bf16,attn_qat,sage3", help="comma-separated modes; bf16 always runs first")
    p.add_argument("--parallel", choices=("ulysses", "ring"), default="ulysses",
                   help="context-parallel layout (default ulysses: every mode; ring: modes with a log-sum-exp)")
    p.add_argument("--layers", type=int, help="build only this many of the 40 blocks (said in the table)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up steps per mode and layout (default 1)")
    p.add_argument("--repeats", type=int, default=2, help="timed steps per mode and layout (default 2)")
    p.add_argument("--sdpa", choices=["default", "cudnn", "flash", "efficient", "math"],
                   help="torch SDPA backend for bf16 and the unpatched cross-attention (default cudnn; torch's "
                   "choice with --tiny)")
    p.add_argument("--tiny", action="store_true", help="the tiny model and latents: the code path on CPU")
    p.add_argument("--docs", help="markdown file whose section (one per layout and GPU count) to write (default "
                                  "docs/benchmarks.md; none with --tiny)")
    p.add_argument("--json", help="JSON results (default bench/results/multigpu/LAYOUT_NGPU.json; none with --tiny)")
    return p.parse_args(argv)


def _relative_gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x.float() - y.float()).abs().max() / y.float().abs().max().clamp_min(1e-12))
               for x, y in zip(a, b))


def _time(model, mode, inputs, args, device) -> tuple[dict, list[torch.Tensor]]:
    """bench/e2e.py's timed step, and the last step's outputs (for the 1-GPU vs N-GPU comparison)."""
    r = e2e.run_mode(model, mode, inputs, warmup=args.warmup, repeats=args.repeats, device=device, sdpa=args.sdpa,
                     keep_outputs=True)
    return r, r.pop("outputs")


def markdown(rows: list[dict], meta: dict) -> str:
    n = meta["world"]
    lines = [SECTION.format(parallel=meta["parallel"], world=n), "",
             f"{meta['model']}: one denoising step (cond + uncond, batch 1 each) on 1 GPU and on {n} GPUs with "
             f"diffusers' context parallelism ({meta['parallel']}: "
             + ("all-to-all over heads" if meta["parallel"] == "ulysses" else "key/value chunks merged by log-sum-exp")
             + f"), same model, inputs and process (the 1-GPU steps shared out over the {n} GPUs, each alone on its "
             f"GPU); self-attention in the mode, cross-attention in SDPA. "
             f"{meta['warmup']} warm-up step(s), mean of {meta['repeats']}; {meta['clock']}.", "",
             f"Device: {n} × {meta['device']}; torch {meta['torch']}, diffusers {meta['diffusers']}, triton "
             f"{meta['triton']}; SDPA backend {meta['sdpa']}; {meta['date']}.", ""]
    if meta["partial"]:
        lines += [f"**Partial model: {meta['layers']} of 40 blocks** (`--layers {meta['layers']}`).", ""]
    lines += [f"| resolution | tokens | mode | 1 GPU (s) | {n} GPUs (s) | speedup | efficiency | × bf16, 1 GPU | "
              f"× bf16, {n} GPUs | {n}-GPU output vs 1-GPU |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['resolution']} | {r['tokens']:,} | {r['mode']} | {r['one_s']:.3f} | {r['many_s']:.3f} | "
                     f"{r['speedup']:.2f}× | {100 * r['efficiency']:.0f}% | {r['ratio_one']:.2f} | "
                     f"{r['ratio_many']:.2f} | {r['gap']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    args.sdpa = args.sdpa or ("default" if args.tiny else "cudnn")
    launch = launch_from_env()
    if launch is None:
        print("bench/multigpu.py: error: run it under torchrun --nproc-per-node N (N >= 2)", file=sys.stderr)
        return 2
    modes = [REFERENCE_MODE] + [m for m in args.modes.split(",") if m != REFERENCE_MODE]
    unknown = [m for m in modes if m not in available_modes()]
    resolutions = args.resolutions.split(",")
    bad = [r for r in resolutions if r not in LATENTS]
    if unknown or bad:
        print(f"bench/multigpu.py: error: unknown modes {unknown} / resolutions {bad}", file=sys.stderr)
        return 2
    config = TINY_TRANSFORMER_CONFIG if args.tiny else WAN21_14B_TRANSFORMER_CONFIG
    ring, ulysses = (launch.world_size, 1) if args.parallel == "ring" else (1, launch.world_size)
    for mode in modes:
        check_degrees(ring, ulysses, heads=config["num_attention_heads"], mode=mode, needs_grad=False)
    device = rank_device(launch, "cpu" if args.tiny else "cuda")
    with process_group(device, timeout_minutes=60):  # ranks wait for each other between the two phases
        return _run(args, launch, device, config, modes, resolutions)


def _run(args, launch, device, config, modes, resolutions) -> int:
    import diffusers
    import triton

    dist = torch.distributed
    dtype = torch.float32 if args.tiny else torch.bfloat16
    layers = args.layers or config["num_layers"]
    model = e2e.build_transformer(config, device, dtype, layers)
    shapes = {"tiny": e2e.TINY_LATENT} if args.tiny else {r: LATENTS[r] for r in resolutions}
    text = 32 if args.tiny else e2e.TEXT_TOKENS
    g = torch.Generator(device="cpu").manual_seed(0)
    inputs = {name: {"latents": torch.randn(1, *lat, generator=g).to(device, dtype),
                     "cond": torch.randn(1, text, config["text_dim"], generator=g).to(device, dtype),
                     "uncond": torch.randn(1, text, config["text_dim"], generator=g).to(device, dtype),
                     "timestep": torch.tensor([999.0], device=device)} for name, lat in shapes.items()}
    # The 1-GPU steps, shared out: rank r times cases r, r + N, ... on its own GPU, with no communication while it
    # does, so the phase takes about 1/N of one GPU timing them all (on 8 GPUs the other 7 would wait minutes); the
    # results, outputs included (on the CPU), then go to every rank.
    cases = [(name, mode) for name in shapes for mode in modes]
    mine = {}
    for name, mode in cases[launch.rank::launch.world_size]:
        mine[name, mode] = _time(model, mode, inputs[name], args, device)
        print(f"1 GPU   {name} {mode:>10}: {mine[name, mode][0]['step_s']:.3f} s (rank {launch.rank})", file=sys.stderr)
    shared: list = [None] * launch.world_size
    dist.all_gather_object(shared, mine)
    one = {case: result for part in shared for case, result in part.items()}
    enable_context_parallel(model, args.parallel, launch.world_size)
    rows = []
    for name, lat in shapes.items():
        for mode in modes:
            many, outs = _time(model, mode, inputs[name], args, device)
            if launch.rank == 0:
                print(f"{launch.world_size} GPUs {name} {mode:>10}: {many['step_s']:.3f} s", file=sys.stderr)
                single, ref = one[name, mode]
                rows.append({"resolution": name, "tokens": lat[1] * (lat[2] // 2) * (lat[3] // 2), "mode": mode,
                             "one_s": single["step_s"], "many_s": many["step_s"],
                             "speedup": single["step_s"] / many["step_s"],
                             "efficiency": single["step_s"] / many["step_s"] / launch.world_size,
                             "one_peak_gib": single["peak_gib"], "many_peak_gib": many["peak_gib"],
                             "gap": _relative_gap(outs, ref), "finite": single["finite"] and many["finite"]})
    if launch.rank != 0:
        return 0
    for r in rows:
        base = next(b for b in rows if b["resolution"] == r["resolution"] and b["mode"] == REFERENCE_MODE)
        r["ratio_one"], r["ratio_many"] = r["one_s"] / base["one_s"], r["many_s"] / base["many_s"]
    meta = {"model": ("Tiny Wan 2.1-architecture transformer" if args.tiny else "Wan 2.1 T2V 14B transformer")
            + (f" ({layers} of {config['num_layers']} blocks)" if layers != config["num_layers"] else ""),
            "layers": layers, "partial": layers != config["num_layers"] and not args.tiny, "world": launch.world_size,
            "parallel": args.parallel, "warmup": args.warmup, "repeats": args.repeats, "sdpa": args.sdpa,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else
            f"CPU ({platform.processor() or platform.machine()})",
            "clock": "CUDA events" if device.type == "cuda" else "perf_counter",
            "torch": torch.__version__, "diffusers": diffusers.__version__, "triton": triton.__version__,
            "date": datetime.date.today().isoformat()}
    table = markdown(rows, meta)
    print(table)
    docs = args.docs or (None if args.tiny else str(ROOT / "docs" / "benchmarks.md"))
    if docs:
        update_section(f"multigpu_{meta['parallel']}_{launch.world_size}", table, Path(docs))
    js = args.json or (None if args.tiny else
                       str(ROOT / "bench" / "results" / "multigpu" / f"{args.parallel}_{launch.world_size}gpu.json"))
    if js:
        Path(js).parent.mkdir(parents=True, exist_ok=True)
        Path(js).write_text(json.dumps({"meta": meta, "results": rows}, indent=2))
    return 0 if all(r["finite"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
