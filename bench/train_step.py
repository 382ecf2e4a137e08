"""Training step of the Wan 2.1 1.3B-sized transformer: bf16 attention vs attn_qat (step time, peak memory).

    python bench/train_step.py                           # GPU: 30 blocks, 480x832x81 -> latents (16, 21, 60, 104)
    python bench/train_step.py --layers 10 --frames 41   # cheaper: 10 blocks, 41 frames (said in the table)
    python bench/train_step.py --tiny                    # the code path on CPU with the tiny model (seconds)
    python bench/train_step.py --save-attention          # checkpointing that keeps the attention outputs

The transformer is built in code from Wan2.1-T2V-1.3B-Diffusers' transformer/config.json (12 heads x
128 = hidden 1536, ffn 8960, 30 blocks, text_dim 4096; checked against diffusers' conversion script)
with random weights, as `attnqat train` trains it: fp32 master weights under bf16 autocast, diffusers'
gradient checkpointing on every block (`--save-attention`: keeping the attention outputs, as
train.save_attention does), AdamW. One step of the default objective (distill/features):
frozen bf16 teacher forward (bf16 attention) + student forward and backward (the mode under test, attn1
of every block) + normalized-MSE loss over every block's hidden states and the output + clip + AdamW step.
`--objective flow` drops the teacher (flow-matching loss on random latents).

Per mode: median step time (CUDA-synchronised wall time, after warm-up steps), tokens/s, peak GPU memory
(torch.cuda.max_memory_allocated over the timed steps), ratios to bf16 from the same run. Writes the
`## Training step: Wan 2.1 1.3B-sized transformer` section of docs/benchmarks.md (not with --tiny unless
--write) and prints the table.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from _report import timed_steps  # noqa: E402

from attnqat.kernels import REFERENCE_MODE  # noqa: E402
from attnqat.pipelines.wan_configs import WAN21_1_3B_TRANSFORMER_CONFIG  # noqa: E402

SECTION = "## Training step: Wan 2.1 1.3B-sized transformer"

TEXT_TOKENS = 512


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", default="bf16,attn_qat", help="comma-separated student attention modes (default bf16,attn_qat)")
    p.add_argument("--layers", type=int, default=None, help="transformer blocks (default: all 30)")
    p.add_argument("--height", type=int, default=480, help="video height in pixels (default 480)")
    p.add_argument("--width", type=int, default=832, help="video width in pixels (default 832)")
    p.add_argument("--frames", type=int, default=81, help="video frames, 4k+1 (default 81)")
    p.add_argument("--batch", type=int, default=1, help="samples per step (default 1)")
    p.add_argument("--objective", choices=("distill", "flow"), default="distill")
    p.add_argument("--target", choices=("output", "features"), default="features")
    p.add_argument("--steps", type=int, default=5, help="timed steps (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2; compiles the kernels)")
    p.add_argument("--no-checkpointing", action="store_true", help="disable gradient checkpointing")
    p.add_argument("--save-attention", action="store_true",
                   help="keep the attention outputs through gradient checkpointing (train.save_attention): the "
                        "backward does not recompute the attention")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny model, 32 tokens, fp32")
    p.add_argument("--write", action="store_true", help="write docs/benchmarks.md even with --tiny")
    p.add_argument("--no-write", action="store_true", help="do not write docs/benchmarks.md")
    args = p.parse_args(argv)
    if args.save_attention and args.no_checkpointing:
        p.error("--save-attention keeps attention outputs through gradient checkpointing: drop --no-checkpointing")
    return args


def checkpointing(args) -> str:
    """The gradient checkpointing a run uses, in words (the table's section says it)."""
    if args.no_checkpointing:
        return "off"
    if args.save_attention:
        return "on every block, keeping the attention outputs (no attention recompute in the backward)"
    return "on every block (the backward recomputes the attention)"


def build(config: dict, device: torch.device, num_layers: int | None):
    from diffusers import WanTransformer3DModel

    cfg = dict(config, num_layers=num_layers or config["num_layers"])
    with torch.device(device):
        torch.manual_seed(0)
        model = WanTransformer3DModel(**cfg)  # fp32 master weights
    return model, cfg


def run_mode(mode: str, args, config: dict, shape, device, autocast_dtype):
    from attnqat.train.objectives import nmse
    from attnqat.train.student_teacher import FeatureCapture, block_checkpoint, make_student_teacher

    transformer, cfg = build(config, device, args.layers)
    teacher_dtype = torch.bfloat16 if autocast_dtype is not None else torch.float32
    student, teacher = make_student_teacher(transformer, mode, "self", teacher_dtype=teacher_dtype)
    if args.objective == "flow":
        del teacher
        teacher = None
    if not args.no_checkpointing:
        student.enable_gradient_checkpointing(block_checkpoint(args.save_attention))
    opt = torch.optim.AdamW(student.parameters(), lr=1e-6, weight_decay=0.01)
    s_cap = FeatureCapture(student)
    t_cap = FeatureCapture(teacher) if teacher is not None else None
    g = torch.Generator().manual_seed(0)
    b = args.batch
    x = torch.randn(b, *shape, generator=g).to(device)
    target = torch.randn(b, *shape, generator=g).to(device)
    emb = torch.randn(b, TEXT_TOKENS if not args.tiny else 8, cfg["text_dim"], generator=g).to(device)
    ts = torch.rand(b, generator=g).to(device) * 1000
    amp = (torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None
           else torch.autocast(device.type, enabled=False))

    def step():
        with amp:
            if teacher is not None:
                with torch.no_grad(), t_cap.capturing() as tf:
                    t_out = teacher(hidden_states=x.to(teacher_dtype), timestep=ts,
                                    encoder_hidden_states=emb.to(teacher_dtype), return_dict=False)[0]
                    tf = dict(tf)
            with s_cap.capturing() as sf:
                s_out = student(hidden_states=x, timestep=ts, encoder_hidden_states=emb, return_dict=False)[0]
                sf = dict(sf)
        if teacher is None:
            loss = (s_out.float() - target).pow(2).mean()
        elif args.target == "features":
            loss = torch.stack([nmse(sf[i], tf[i]) for i in sorted(tf)]).mean() + nmse(s_out, t_out)
        else:
            loss = nmse(s_out, t_out)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    times, losses = timed_steps(step, warmup=args.warmup, steps=args.steps, device=device)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    s_cap.remove()
    if t_cap:
        t_cap.remove()
    del student, teacher, opt
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"mode": mode, "step_s": statistics.median(times), "peak_gib": peak, "loss": losses[-1],
            "finite": all(l == l and abs(l) != float("inf") for l in losses)}


def main(argv=None) -> int:
    args = parse_args(argv)
    from attnqat.pipelines import TINY_TRANSFORMER_CONFIG

    if args.tiny:
        device = torch.device("cpu")
        config, shape, autocast_dtype = dict(TINY_TRANSFORMER_CONFIG), (16, 2, 8, 8), None
        if args.steps == 5:
            args.steps, args.warmup = 2, 1
    else:
        if not torch.cuda.is_available():
            print("bench/train_step.py: no CUDA GPU; use --tiny for the CPU code path", file=sys.stderr)
            return 2
        if args.height % 16 or args.width % 16 or args.frames % 4 != 1:
            print(f"bench/train_step.py: need height, width multiples of 16 and frames 4k+1, got "
                  f"{args.height}x{args.width}x{args.frames}", file=sys.stderr)
            return 2
        device = torch.device("cuda")
        config, autocast_dtype = WAN21_1_3B_TRANSFORMER_CONFIG, torch.bfloat16
        shape = (16, (args.frames - 1) // 4 + 1, args.height // 8, args.width // 8)
    tokens = shape[1] * (shape[2] // 2) * (shape[3] // 2)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    results = []
    for mode in modes:
        r = run_mode(mode, args, config, shape, device, autocast_dtype)
        r["tokens_per_s"] = tokens * args.batch / r["step_s"]
        results.append(r)
        print(f"{mode:>10}: step {r['step_s'] * 1e3:9.1f} ms  peak {r['peak_gib']:6.2f} GiB  "
              f"{r['tokens_per_s']:9.0f} tokens/s  loss {r['loss']:.4g}", flush=True)
    base = next((r for r in results if r["mode"] == REFERENCE_MODE), None)
    layers = args.layers or config["num_layers"]
    lines = ["| student attention | step time | vs bf16 | tokens/s | peak memory | vs bf16 |", "|---|---|---|---|---|---|"]
    for r in results:
        rt = f"{r['step_s'] / base['step_s']:.2f}x" if base else "-"
        rm = f"{r['peak_gib'] / base['peak_gib']:.2f}x" if base and base["peak_gib"] == base["peak_gib"] else "-"
        lines.append(f"| `{r['mode']}` | {r['step_s'] * 1e3:.0f} ms | {rt} | {r['tokens_per_s']:.0f} | "
                     f"{r['peak_gib']:.1f} GiB | {rm} |")
    table = "\n".join(lines)
    print(f"gradient checkpointing {checkpointing(args)}\n{table}")
    if args.no_write or (args.tiny and not args.write):
        return 0 if all(r["finite"] for r in results) else 1
    from _report import env_line, environment, update_section

    what = (f"{'tiny model (CPU code path)' if args.tiny else f'Wan 2.1 1.3B-sized transformer, {layers} of 30 blocks'}"
            f", random weights; latents {tuple(shape)} (B={args.batch}) -> {tokens:,} self-attention tokens, "
            f"{TEXT_TOKENS if not args.tiny else 8} text tokens")
    section, key = (f"{SECTION}, attention outputs kept", "train_step_saved") if args.save_attention \
        else (SECTION, "train_step")  # one section each: the docs show both checkpointings
    md = (f"{section}\n\n`python bench/train_step.py {' '.join(sys.argv[1:] if argv is None else argv)}`. {what}. "
          f"One step = {'frozen bf16 teacher forward + ' if args.objective == 'distill' else ''}student forward + "
          f"backward ({args.objective}{'/' + args.target if args.objective == 'distill' else ''} loss) + grad clip + "
          f"AdamW; fp32 master weights under bf16 autocast; gradient checkpointing {checkpointing(args)}; only the "
          f"student's attn1 changes mode. Median of "
          f"{args.steps} steps after {args.warmup} warm-up; peak = torch.cuda.max_memory_allocated.\n\n"
          f"{table}\n\n{env_line(environment())}\n")
    update_section(key, md)
    return 0 if all(r["finite"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
