"""How far do objects move, in the corpus and in a model's samples? (docs/mini.md, "Why motion is not learned yet")

    python experiments/motion_diagnosis.py scale                       # the corpus's motion in pixels, latent cells, tokens
    python experiments/motion_diagnosis.py samples [--model attnqat/models/mini] [--prompts 8] [--swaps 2] [--steps 20]

``scale`` draws 4,000 train specs and reports, per motion kind, the displacement over a clip and the
object's size in pixels, in VAE latent cells (8x8 pixels; 33 frames -> 9 latent frames) and in transformer
tokens (the patch is 1x2x2 latent cells: 16x16 pixels), at 128x128 and 256x256; then reads 64 rendered
clips with the detector as a check.

``samples`` generates held-out prompts (seed i for prompt i, the default sampler, guidance 5) and, for
the same seeds, one prompt with its motion word set to left / right / up / down; it reads each video with
the detector (:func:`attnqat.mini.quality.detect`): the fitted displacement, the area ratio, and the path
length (sum of frame-to-frame centroid steps: a blob that jitters in place has a long path and a
small displacement), against the ground-truth clip of the same prompt.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics as st

import torch

LATENT_FRAMES = {33: 9, 17: 5, 9: 3}


def _q(xs, qs=(0.1, 0.5, 0.9)):
    xs = sorted(xs)
    return [xs[min(len(xs) - 1, int(q * len(xs)))] for q in qs]


def scale(args) -> dict:
    from attnqat.mini.corpus import Corpus, MOTION_DIRECTIONS
    from attnqat.mini.quality import detect

    corpus = Corpus(0, "train")
    specs = [corpus.spec(10 ** 6 + i) for i in range(4000)]
    out = {}
    print("per motion kind, median [10%, 90%] over 4,000 train specs; size = bounding-box width at frame 0")
    for px in (128, 256):
        rows = {}
        for kind, keep in (("directions", lambda s: s.motion in MOTION_DIRECTIONS),
                           ("grow/shrink", lambda s: s.motion not in MOTION_DIRECTIONS)):
            sel = [s for s in specs if keep(s)]
            travel = [s.travel * px for s in sel]
            size = [s.size * px for s in sel]
            size_change = [abs(s.size * (s.end_scale - 1)) * px for s in sel]  # width change over the clip
            ratio = [s.travel / s.size for s in sel]
            rows[kind] = dict(travel_px=_q(travel), size_px=_q(size), size_change_px=_q(size_change),
                              travel_over_size=_q(ratio))
            t, z, c = rows[kind]["travel_px"], rows[kind]["size_px"], rows[kind]["size_change_px"]
            f = LATENT_FRAMES[33]
            print(f"{px}x{px} {kind:11s}: travel {t[1]:5.1f} px [{t[0]:.1f}, {t[2]:.1f}] = {t[1] / 8:4.1f} latent cells "
                  f"= {t[1] / 16:4.1f} tokens ({t[1] / 8 / (f - 1):.2f} cells per latent frame); object {z[1]:5.1f} px "
                  f"= {z[1] / 8:4.1f} cells = {z[1] / 16:4.1f} tokens; width change {c[1]:5.1f} px = {c[1] / 8:.1f} cells; "
                  f"travel / size {rows[kind]['travel_over_size'][1]:.2f}")
        out[f"{px}"] = rows
    # the detector on rendered clips (a check of the numbers above, and the scale samples are compared with)
    video, _, sp = corpus.batch(10 ** 6, 64, frames=33, height=128, width=128)
    det = [detect(v) for v in video]
    disp = [math.hypot(*d["displacement"]) for d, s in zip(det, sp) if s.motion in MOTION_DIRECTIONS]
    acc = sum(d["motion"] == s.motion for d, s in zip(det, sp)) / len(sp)
    print(f"detector on 64 rendered train clips (33x128x128): motion {acc:.0%}; directional displacement median "
          f"{st.median(disp):.3f} short sides ({st.median(disp) * 128:.1f} px)")
    out["detector_rendered"] = dict(motion=acc, displacement_median=st.median(disp))
    return out


def _centroids(video) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-frame centroids (pixels) and areas of the detector's object mask."""
    from attnqat.mini.quality import _frames_of, _object_mask, _refine_mask

    frames = _frames_of(video)
    _, _, h, w = frames.shape
    chroma, _ = _object_mask(frames)
    mask = _refine_mask(frames, chroma)
    area = mask.sum((1, 2))
    ys = torch.arange(h, dtype=torch.float32).view(1, -1, 1)
    xs = torch.arange(w, dtype=torch.float32).view(1, 1, -1)
    cx = (mask * xs).sum((1, 2)) / area.clamp(min=1e-6)
    cy = (mask * ys).sum((1, 2)) / area.clamp(min=1e-6)
    return torch.stack([cx, cy], 1), area


def _read(video, short: int) -> dict:
    from attnqat.mini.quality import detect

    d = detect(video)
    c, area = _centroids(video)
    ok = area >= 4
    steps = (c[1:] - c[:-1]).norm(dim=1)[ok[1:] & ok[:-1]]
    return dict(motion=d["motion"], colour=d["colour"], found=d["found"],
                displacement=math.hypot(*d["displacement"]), dxdy=[round(v, 3) for v in d["displacement"]],
                area_ratio=d["area_ratio"], path=steps.sum().item() / short,
                area_cv=(area[ok].std() / area[ok].mean()).item() if ok.sum() > 1 else None)


def samples(args) -> dict:
    import numpy as np

    from attnqat.mini.corpus import Corpus, render
    from attnqat.mini.evaluation import held_out_prompts
    from attnqat.pipelines.loading import load_pipeline

    torch.set_num_threads(2)
    f, h, w = (int(x) for x in args.size.split("x"))
    pipe = load_pipeline(args.model, dtype=torch.float32, device="cpu")
    corpus = Corpus(0, "held_out")

    def gen(prompt: str, seed: int):
        g = torch.Generator("cpu").manual_seed(seed)
        out = pipe(prompt=prompt, negative_prompt="", height=h, width=w, num_frames=f, num_inference_steps=args.steps,
                   guidance_scale=args.guidance, output_type="np", generator=g, max_sequence_length=512)
        v = np.clip(np.asarray(out.frames[0], dtype=np.float32), 0, 1)
        return torch.from_numpy((v * 255).round().astype(np.uint8))

    rows = []
    print(f"{'prompt':78s} asked    read     disp  path  area-ratio | truth disp")
    for i, (prompt, attrs) in enumerate(held_out_prompts(args.prompts)):
        r = _read(gen(prompt, i), min(h, w))
        truth = _read(render(corpus.spec(i), frames=f, height=h, width=w)[0], min(h, w))
        rows.append(dict(prompt=prompt, asked=attrs["motion"], sample=r, truth=truth))
        print(f"{prompt[:78]:78s} {attrs['motion']:8s} {str(r['motion']):8s} {r['displacement']:.3f} {r['path']:.3f} "
              f"{r['area_ratio']:5.2f}      | {truth['displacement']:.3f} ({truth['motion']})", flush=True)
    swaps = []
    base = "a {c} {s} moves {m} over a plain grey background"
    for seed, (c, s) in enumerate((("red", "circle"), ("yellow", "square"), ("blue", "heart"))[:args.swaps]):
        for m in ("left", "right", "up", "down"):
            prompt = base.format(c=c, s=s, m=m)
            r = _read(gen(prompt, 100 + seed), min(h, w))
            swaps.append(dict(prompt=prompt, seed=100 + seed, asked=m, sample=r))
            print(f"{prompt[:78]:78s} {m:8s} {str(r['motion']):8s} {r['displacement']:.3f} {r['path']:.3f} "
                  f"{r['area_ratio']:5.2f}  dxdy {r['dxdy']}", flush=True)

    def med(xs):
        xs = list(xs)
        return st.median(xs) if xs else None

    directional = [x for x in rows if x["asked"] not in ("grow", "shrink")]
    summary = dict(
        held_out_motion=sum(x["sample"]["motion"] == x["asked"] for x in rows) / max(1, len(rows)),
        sample_displacement_median=med(x["sample"]["displacement"] for x in directional),
        truth_displacement_median=med(x["truth"]["displacement"] for x in directional),
        sample_path_median=med(x["sample"]["path"] for x in rows),
        truth_path_median=med(x["truth"]["path"] for x in rows),
        swap_motion=sum(x["sample"]["motion"] == x["asked"] for x in swaps) / max(1, len(swaps)),
    )
    print(json.dumps(summary, indent=1))
    return dict(rows=rows, swaps=swaps, summary=summary)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("scale", "samples"))
    p.add_argument("--model", default="mini")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--swaps", type=int, default=2, help="objects asked to move left/right/up/down (default 2)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--guidance", type=float, default=5.0)
    p.add_argument("--size", default="33x128x128")
    p.add_argument("--json", help="write every number here")
    args = p.parse_args()
    res = scale(args) if args.what == "scale" else samples(args)
    if args.json:
        from attnqat.outputs import write_file_atomically
        write_file_atomically(args.json, lambda tmp: tmp.write_text(json.dumps(res, indent=1, default=str)))


if __name__ == "__main__":
    main()
