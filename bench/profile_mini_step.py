"""Where a step of the mini model's training goes, and what the training loop takes a step.

    python bench/profile_mini_step.py --out runs/mini [--steps 30] [--set KEY=VALUE ...] [--json FILE]
    python bench/profile_mini_step.py --config configs/mini_qat.yaml --model attnqat/models/mini [--set ...]
    python bench/profile_mini_step.py --config configs/mini_qat.yaml --model attnqat/models/mini \
        --loop eager,graphs,graphs+compile --loop-steps 60      # the loop itself, variants side by side

OUT is a `python -m attnqat.train.mini` working folder (its model/ is used; nothing is written there:
the run goes to a temporary folder). With --config, that training config (e.g. the QAT fine-tune's) on
--model instead.

Parts (default): the corpus pool refresh (render, VAE encode, caption embedding), the transformer's forward +
backward, and the optimizer + EMA, each timed with the device synchronised around it, at each training size:
medians over --steps steps after a warm-up, eager.

--loop: ``attnqat train`` itself (the loop of attnqat/train/loop.py, no held-out evaluation, no checkpoint) for
--loop-warmup + --loop-steps steps per variant, in one process one after another: ``eager`` (train.cuda_graphs
off), ``graphs`` (on), ``+compile`` (train.compile). Per size: the median step (log.csv's step_s; with graphs
the time from the previous step's values reaching the host to this step's, docs/training.md) and the mean over every timed step, pool
refreshes included: the mean is the rate a build trains at; the clock (log.csv's elapsed_s over the timed steps),
which also counts what lies between steps; and how long the loop waited for each pool refresh's clips (the
prefetch not done yet, or an inline encode).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch


def _timed(fn, sync):
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="a mini build folder (holds model/)")
    p.add_argument("--config", help="a training config to profile instead of configs/mini.yaml (needs --model)")
    p.add_argument("--model", help="with --config: the model folder it trains")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override configs/mini.yaml")
    p.add_argument("--json", help="also write the numbers here")
    p.add_argument("--loop", metavar="VARIANTS",
                   help="time the training loop instead, per comma-separated variant: eager, graphs, graphs+compile, "
                        "eager+compile")
    p.add_argument("--loop-steps", type=int, default=60)
    p.add_argument("--loop-warmup", type=int, default=12, help="untimed steps (each size's first step captures)")
    p.add_argument("--trace", metavar="DIR",
                   help="--loop: also record the torch profiler over each variant's last --trace-steps steps: "
                        "DIR/VARIANT.json.gz (a Chrome trace) and, printed and in --json, where the GPU sat idle")
    p.add_argument("--trace-steps", type=int, default=6)
    p.add_argument("--vae-variant", default="default",
                   help="--loop: the pool refresh's VAE encode as bench/vae_encode.py's variant of this name, e.g. "
                        "plain (default: the library's own)")
    args = p.parse_args(argv)
    if (args.config is None) == (args.out is None) or (args.config is not None) != (args.model is not None):
        p.error("give --out, or --config with --model")
    variants = args.loop.split(",") if args.loop else []
    if args.vae_variant != "default" and not variants:
        p.error("--vae-variant times the loop: give --loop too")
    for v in variants:
        if v.split("+")[0] not in ("eager", "graphs") or v.split("+")[1:] not in ([], ["compile"]):
            p.error(f"--loop variant {v!r}: eager or graphs, optionally +compile")
    from attnqat.train.config import load_config
    from attnqat.train.mini import transformer_config

    def config(tmp, extra):
        run = [f"output_dir={tmp}/run", "data.held_out=0", *args.set, *extra]
        return (load_config(args.config, [f"model={args.model}", *run]) if args.config
                else transformer_config(Path(args.out), run))

    if variants:
        return _loop(args, variants, config)
    return _parts(args, config)


def _loop(args, variants, config) -> int:
    """The loop's own step times per variant (module docstring)."""
    from attnqat.train.corpus_source import CorpusSource
    from attnqat.train.loop import train

    # the time the loop spends getting each refresh's clips: waiting for the prefetch (or encoding inline)
    waits: list[float] = []
    refresh_clips = CorpusSource._refresh_clips

    def timed_refresh(self, *a, **k):
        t = time.perf_counter()
        try:
            return refresh_clips(self, *a, **k)
        finally:
            waits.append(time.perf_counter() - t)

    CorpusSource._refresh_clips = timed_refresh
    try:
        with _vae_variant(args.vae_variant):
            return _loop_variants(args, variants, config, train, waits)
    finally:
        CorpusSource._refresh_clips = refresh_clips


@contextlib.contextmanager
def _vae_variant(name: str):
    """Every CorpusSource made inside encodes as bench/vae_encode.py's variant ``name``; the class as it was after."""
    if name == "default":
        yield
        return
    import importlib.util

    from attnqat.train.corpus_source import CorpusSource

    spec = importlib.util.spec_from_file_location("bench_vae_encode", Path(__file__).with_name("vae_encode.py"))
    vae_encode = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vae_encode)
    if name not in vae_encode.VARIANTS:
        raise SystemExit(f"--vae-variant {name!r}: one of {', '.join(vae_encode.VARIANTS)}")
    init = CorpusSource.__init__
    held = contextlib.ExitStack()

    def variant_init(self, *a, **k):
        init(self, *a, **k)
        held.enter_context(vae_encode._variant(self, name))

    CorpusSource.__init__ = variant_init
    try:
        with held:
            yield
    finally:
        CorpusSource.__init__ = init


def _loop_variants(args, variants, config, train, waits: list[float]) -> int:
    result = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__, "config": args.config or "configs/mini.yaml", "overrides": args.set,
              "vae_variant": args.vae_variant,
              "warmup": args.loop_warmup, "steps": args.loop_steps, "variants": {}}
    for variant in variants:
        graphs, compiled = variant.startswith("graphs"), variant.endswith("+compile")
        extra = [f"train.cuda_graphs={'on' if graphs else 'off'}", f"train.compile={str(compiled).lower()}",
                 "log.every=1", "log.eval_every=0", "log.progress=false", "checkpoint.every=9999999"]
        with tempfile.TemporaryDirectory() as tmp:
            cfg = config(tmp, extra)
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            waits.clear()
            with _traced(args, variant) as trace:
                rows = train(cfg, stop_after=args.loop_warmup + args.loop_steps).log_rows
            wall = time.perf_counter() - t0
        sizes = ["x".join(map(str, s)) for s in cfg.data.corpus.sizes]
        pattern = [i for i, w in enumerate(cfg.data.corpus.size_weights or [1] * len(sizes)) for _ in range(int(w))]
        timed_rows = [(int(r["step"]), sizes[pattern[(int(r["step"]) - 1) % len(pattern)]], float(r["step_s"]))
                      for r in rows[args.loop_warmup:]]  # (step, its size, its time)
        per: dict[str, list[float]] = {}
        for _, size, t in timed_rows:
            per.setdefault(size, []).append(t)
        timed = [float(r["step_s"]) for r in rows[args.loop_warmup:]]
        result["variants"][variant] = {
            "per_size": {k: {"median_ms": 1e3 * statistics.median(v), "mean_ms": 1e3 * statistics.fmean(v),
                             "max_ms": 1e3 * max(v), "steps": len(v)} for k, v in per.items()},
            "mean_ms": 1e3 * statistics.fmean(timed), "wall_s": wall,
            # the run's clock over the timed steps: every step and whatever lies between them
            "clock_mean_ms": 1e3 * (float(rows[-1]["elapsed_s"]) - float(rows[args.loop_warmup - 1]["elapsed_s"]))
            / (len(rows) - args.loop_warmup) if args.loop_warmup else None,
            "refresh_waits_ms": [round(1e3 * w, 1) for w in waits],
            # steps over 3x their size's median (step number, size, ms): where a mean's outliers come from
            "slow_steps": [(step, size, round(1e3 * t, 1)) for step, size, t in timed_rows
                           if t > 3 * statistics.median(per[size])],
            "loss_first_last": [rows[0]["loss"], rows[-1]["loss"]],
            "peak_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if torch.cuda.is_available() else None}
        r = result["variants"][variant]
        if trace:
            r["trace"] = trace
            print(f"{variant} trace: " + json.dumps(trace)[:1500], flush=True)
        print(f"{variant}: " + "; ".join(f"{k} median {v['median_ms']:.1f} ms mean {v['mean_ms']:.1f} (max "
                                         f"{v['max_ms']:.0f})" for k, v in r["per_size"].items())
              + f"; all sizes mean {r['mean_ms']:.1f} ms/step (clock {r['clock_mean_ms'] or 0:.1f}); refreshes waited "
              f"{sum(r['refresh_waits_ms']):.0f} ms in all ({len(r['refresh_waits_ms'])}); wall {wall:.0f} s; slow steps "
              f"{r['slow_steps']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


@contextlib.contextmanager
def _traced(args, variant: str):
    """Record the profiler over the last ``--trace-steps`` steps of the run (stepped where the loop advances a step);
    yields a dict, filled on exit with :func:`_idle`'s summary of the trace."""
    summary: dict = {}
    if not args.trace or not torch.cuda.is_available():
        yield summary
        return
    from torch.profiler import ProfilerActivity, profile, schedule

    from attnqat.train.loop import Trainer

    out = Path(args.trace)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{variant.replace('+', '_')}.json.gz"
    wait = max(0, args.loop_warmup + args.loop_steps - args.trace_steps - 1)
    exported: list = []
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                   schedule=schedule(wait=wait, warmup=1, active=args.trace_steps, repeat=1),
                   on_trace_ready=lambda p: exported.append(p.export_chrome_trace(str(path))))
    advance = Trainer.advance_to

    def stepped(self, steps):
        advance(self, steps)
        prof.step()

    Trainer.advance_to = stepped
    try:
        with prof:
            yield summary
    finally:
        Trainer.advance_to = advance
    if exported:  # this run's trace, not one an earlier run left in DIR
        summary.update(_idle(path))


def _idle(path: Path, top: int = 12) -> dict:
    """Where the GPU sat idle in a Chrome trace: its kernels' busy share of the span from the first GPU event to the
    last, the longest gaps with the host calls (CPU ops and CUDA runtime calls) under way when each began, and the
    kernels that took the most time."""
    import gzip

    events = json.loads(gzip.open(path, "rt").read())["traceEvents"]
    gpu = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in events
                 if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "ts" in e)
    host = [(e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in events
            if e.get("cat") in ("cpu_op", "cuda_runtime", "python_function", "user_annotation") and "ts" in e]
    if not gpu:
        return {"error": "no GPU events in the trace"}
    busy, gaps, end = 0.0, [], gpu[0][0]
    for s, e, _ in gpu:
        if s > end:
            gaps.append((s - end, end))
        busy += max(0.0, e - max(s, end))
        end = max(end, e)
    span = end - gpu[0][0]
    gaps.sort(reverse=True)
    longest = []
    for length, at in gaps[:top]:
        under_way = sorted({n for s, e, n in host if s <= at <= e and not n.startswith("ProfilerStep")})
        longest.append({"ms": round(length / 1e3, 3), "host": under_way[:8]})
    kernels: dict[str, float] = {}
    for s, e, n in gpu:
        kernels[n] = kernels.get(n, 0.0) + (e - s)
    # per CUDA stream: the training loop's and the pool refresh's (its own stream) run at the same time
    streams: dict[str, dict[str, float]] = {}
    for e in events:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "ts" in e:
            per = streams.setdefault(str(e.get("tid")), {})
            per[e["name"]] = per.get(e["name"], 0.0) + e.get("dur", 0)
    return {"span_ms": round(span / 1e3, 2), "gpu_busy_ms": round(busy / 1e3, 2),
            "idle_ms": round((span - busy) / 1e3, 2), "gaps_over_50us": sum(1 for g, _ in gaps if g > 50),
            "longest_gaps": longest,
            "top_kernels_ms": {n[:90]: round(t / 1e3, 2) for n, t in sorted(kernels.items(), key=lambda kv: -kv[1])[:top]},
            "streams_ms": {tid: {"total": round(sum(per.values()) / 1e3, 2),
                                 "top": {n[:90]: round(t / 1e3, 2)
                                         for n, t in sorted(per.items(), key=lambda kv: -kv[1])[:5]}}
                           for tid, per in streams.items()}}


def _parts(args, config) -> int:
    """The parts of an eager step (module docstring)."""
    from attnqat.train.loop import Trainer

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = config(tmp, [])
        trainer = Trainer(cfg)
        acc, src = trainer.accelerator, trainer.corpus
        params = [p for p in trainer.student.parameters() if p.requires_grad]
        rows: dict[str, dict[str, list[float]]] = {}
        for step in range(args.warmup + args.steps):
            size = src.size_of_step(step)
            key = "x".join(str(v) for v in cfg.data.corpus.sizes[size])
            batch, t_batch = _timed(lambda: trainer.micro_batch(step, 0), sync)

            def fwd_bwd(batch=batch):
                out = trainer.losses(batch)
                acc.backward(out["loss"])
                return out["loss"].item()

            _, t_fb = _timed(fwd_bwd, sync)

            def update():
                acc.clip_grad_norm_(params, 1.0)
                trainer.optimizer.step()
                trainer.scheduler.step()
                trainer.optimizer.zero_grad(set_to_none=True)
                trainer.update_ema(step)

            _, t_up = _timed(update, sync)
            if step < args.warmup:
                continue
            r = rows.setdefault(key, {"batch": [], "forward_backward": [], "optimizer_ema": []})
            r["batch"].append(t_batch)
            r["forward_backward"].append(t_fb)
            r["optimizer_ema"].append(t_up)
        # the refresh's parts, on as many clips as one refresh encodes
        corpus = src.corpora["train"]
        parts = {}
        for size, (f, h, w) in enumerate(cfg.data.corpus.sizes):
            key = f"{f}x{h}x{w}"
            specs = [corpus.spec(j) for j in range(cfg.data.corpus.refresh)]
            caps = [corpus.caption_of(j) for j in range(cfg.data.corpus.refresh)]
            times = {"render": [], "vae_encode": [], "embed": []}
            for _ in range(5):
                video, t = _timed(lambda: corpus.render(specs, frames=f, height=h, width=w, device=src.device), sync)
                times["render"].append(t)
                times["vae_encode"].append(_timed(lambda: src.encode_video(video), sync)[1])
                times["embed"].append(_timed(lambda: src.embed(caps), sync)[1])
            parts[key] = {k: statistics.median(v[1:]) for k, v in times.items()}
    result = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "batch_size": cfg.data.batch_size, "refresh": cfg.data.corpus.refresh,
              "per_step_s": {k: {n: statistics.median(v) for n, v in r.items()} for k, r in rows.items()},
              "refresh_parts_s": parts, "config": args.config or "configs/mini.yaml", "overrides": args.set}
    for key, r in result["per_step_s"].items():
        total = sum(r.values())
        print(f"{key}: step {total * 1e3:.1f} ms = " + ", ".join(f"{n} {v * 1e3:.1f}" for n, v in r.items())
              + "; refresh parts " + ", ".join(f"{n} {v * 1e3:.1f}" for n, v in parts[key].items()))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
