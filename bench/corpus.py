"""The procedural corpus and its detector: render time, detector accuracy, a contact sheet.

    python bench/corpus.py [--device cpu|cuda] [--clips 640] [--seed 9000] [--no-write]

- render time of ``attnqat.mini.corpus.render`` for a few batch shapes (on CUDA with synchronisation);
- accuracy of ``attnqat.mini.quality.detect`` on corpus clips (half train, half held-out) at 17x64x64 and
  17x128x128, clean and degraded (``attnqat.mini.quality.degrade``: the tests' setting and a harsher one),
  per attribute, with the shape confusions;
- docs/corpus.png: first, middle and last frame of 8 clips (one per shape; the last row is the
  README's held-out example) with their captions, and 10 example captions.

Writes the sections of docs/corpus.md between BEGIN/END markers and docs/corpus.json. The seeds
(9000 on) are neither the tests' (7001-7004) nor those the detector was tuned on (1-5, 100-400).
"""
from __future__ import annotations

import argparse
import collections
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from attnqat.mini.corpus import SHAPES, Corpus, caption, make_spec  # noqa: E402
from attnqat.mini.quality import degrade, detect  # noqa: E402
from bench._report import ROOT, env_line, environment, update_section, write_json  # noqa: E402

DOC = ROOT / "docs" / "corpus.md"
RENDER_SHAPES = ((8, 17, 128), (4, 33, 256), (16, 33, 256))  # (clips, frames, side)
CONDITIONS = {
    "clean": None,
    "degraded": dict(blur_sigma=1.0, noise_std=0.03, jpeg_quality=60),   # tests/test_quality.py's setting
    "harsh": dict(blur_sigma=1.5, noise_std=0.05, jpeg_quality=40),
}
KEYS = ("colour", "shape", "motion")


def render_times(device: torch.device) -> list[dict]:
    rows = []
    corpus = Corpus(0)
    for n, frames, side in RENDER_SHAPES:
        specs = [corpus.spec(i) for i in range(n)]
        times = []
        for _ in range(4):  # the first is a warm-up
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            Corpus.render(specs, frames=frames, height=side, width=side, device=device)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        rows.append(dict(clips=n, frames=frames, side=side, seconds=sorted(times[1:])[1]))
    return rows


def accuracy(seed: int, clips: int, side: int, condition: str) -> dict:
    right, confusions, n = collections.Counter(), collections.Counter(), 0
    for k, split in enumerate(("train", "held_out")):
        corpus = Corpus(seed + k, split)
        for start in range(0, clips // 2, 16):
            video, _, specs = corpus.batch(start, min(16, clips // 2 - start), frames=17, height=side, width=side)
            if CONDITIONS[condition] is not None:
                video = degrade(video, seed=start, **CONDITIONS[condition])
            for v, spec in zip(video, specs):
                det = detect(v)
                n += 1
                ok = True
                for key in KEYS:
                    hit = det[key] == getattr(spec, key)
                    right[key] += hit
                    ok &= hit
                    if not hit:
                        confusions[f"{key}: {getattr(spec, key)} -> {det[key]}"] += 1
                right["all"] += ok
    return dict(side=side, condition=condition, clips=n, **{k: right[k] / n for k in KEYS + ("all",)},
                confusions=dict(confusions.most_common()))


def contact_sheet(path: pathlib.Path) -> list[str]:
    """docs/corpus.png; returns the captions shown."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    corpus, specs, captions = Corpus(0), [], []
    for i in range(200):  # the first train clip of every shape but the square
        s = corpus.spec(i)
        if s.shape != "square" and s.shape not in {x.shape for x in specs}:
            specs.append(s)
            captions.append(corpus.caption_of(i))
    specs.append(make_spec("blue", "square", "up", "checker", seed=0))
    captions.append("a blue square moves up over a checkered background (held out)")
    frames = 33
    video = Corpus.render(specs, frames=frames, height=128, width=128)
    fig, axes = plt.subplots(len(specs), 3, figsize=(6.3, 2.35 * len(specs)))
    for row, (clip, text) in enumerate(zip(video, captions)):
        for col, f in enumerate((0, frames // 2, frames - 1)):
            ax = axes[row, col]
            ax.imshow(((clip[:, f].permute(1, 2, 0) + 1) / 2).clamp(0, 1).numpy())
            ax.set_xticks([]), ax.set_yticks([])
            if row == 0:
                ax.set_xlabel(f"frame {f}", fontsize=8)
                ax.xaxis.set_label_position("top")
        axes[row, 0].set_title(text, fontsize=7.5, loc="left", x=0.0)
    fig.tight_layout(h_pad=1.2)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return captions


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--clips", type=int, default=640, help="clips per (size, condition); 128x128 gets half")
    p.add_argument("--seed", type=int, default=9000)
    p.add_argument("--threads", type=int, default=1, help="CPU threads (1 is fastest on a busy small CPU)")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    env = environment()

    times = render_times(device)
    lines = [f"Render time, {device.type.upper()} ({'1 thread' if device.type == 'cpu' and args.threads == 1 else env['device']}):",
             "", "| clips x frames x H x W | seconds |", "|---|---|"]
    lines += [f"| {r['clips']} x {r['frames']} x {r['side']} x {r['side']} | {r['seconds']:.3f} |" for r in times]
    print("\n".join(lines))
    render_md = "\n".join(lines) + "\n\n" + env_line(env)

    results = []
    for side, clips in ((64, args.clips), (128, args.clips // 2)):
        for condition in CONDITIONS:
            r = accuracy(args.seed, clips, side, condition)
            results.append(r)
            print(f"{side}x{side} {condition:9s} n={r['clips']} colour {r['colour']:.4f} shape {r['shape']:.4f} "
                  f"motion {r['motion']:.4f} all {r['all']:.4f} {r['confusions']}")
    table = ["| size | condition | clips | colour | shape | motion | all | errors |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        errors = ", ".join(f"{k} ({v})" for k, v in list(r["confusions"].items())[:4]) or "none"
        table.append(f"| {r['side']}x{r['side']} | {r['condition']} | {r['clips']} | {r['colour']:.1%} | "
                     f"{r['shape']:.1%} | {r['motion']:.1%} | {r['all']:.1%} | {errors} |")
    settings = "; ".join(f"{k}: {v}" for k, v in CONDITIONS.items() if v)
    accuracy_md = ("\n".join(table) + f"\n\n17 frames, seeds {args.seed} (train) and {args.seed + 1} (held out), "
                   f"half the clips each. Degradations ({settings}): Gaussian blur (pixels), Gaussian noise "
                   "(on [0, 1]), JPEG-like quality with 4:2:0 chroma.")

    if not args.no_write:
        captions = contact_sheet(ROOT / "docs" / "corpus.png")
        corpus = Corpus(0)
        examples = "\n".join(f"- `{corpus.caption_of(i)}`" for i in range(10))
        update_section("corpus-captions", "Captions of clips 0-9 of `Corpus(seed=0)`:\n\n" + examples, DOC)
        update_section("corpus-render-time", render_md, DOC)
        update_section("corpus-detector", accuracy_md, DOC)
        write_json(ROOT / "docs" / "corpus.json", dict(environment=env, render=times, detector=results,
                                                       sheet_captions=captions))
        print(f"wrote {DOC}, docs/corpus.png, docs/corpus.json")


if __name__ == "__main__":
    main()
