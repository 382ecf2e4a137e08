"""How much an attention mode (and a set of weights) costs a model, measured on held-out data.

One *variant* is an attention mode plus the transformer weights it runs with (the base weights, or a
fine-tune such as a QAT checkpoint). For a list of variants, on the held-out attribute combinations of
the procedural corpus (:mod:`attnqat.corpus`), with fixed noise and seeds shared by every variant:

- **flow loss**: the flow-matching loss ``|v - (noise - x0)|^2`` on held-out clips at fixed noise levels
  (the cleanest single number for "how much worse is FP4");
- **velocity distance**: ``|v - v_bf16|^2 / |v_bf16|^2`` to the base model with bf16 attention at the
  same inputs (how far the variant's prediction moved);
- **prompt following**: colour / shape / motion read off the generated videos by
  :func:`attnqat.quality.detect` against the prompt's attributes;
- **PSNR / SSIM** of each video to the bf16 video of the same prompt and seed.

``attnqat quality`` (:mod:`attnqat.quality_cli`) and ``bench/quality.py`` print and save the table.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from attnqat.pipelines.schedule import PrecisionSchedule

#: Noise levels of the flow-loss evaluation (each clip at each level, same noise for every variant).
EVAL_SIGMAS = (0.1, 0.3, 0.5, 0.7, 0.9)


@dataclass
class Variant:
    """An attention mode with the transformer weights it runs with (``None``: the base weights).

    ``high_precision_steps``: denoising steps (0-based; negative from the end) whose attention runs in
    bf16 when generating videos, or a whole :class:`~attnqat.pipelines.PrecisionSchedule` (steps,
    blocks, high-precision mode). The flow metrics (one transformer call per noise level, no
    denoising steps) use only its blocks.
    """
    label: str
    mode: str = "bf16"
    weights: dict | None = None         # a full transformer state dict (e.g. a QAT checkpoint)
    options: dict = field(default_factory=dict)
    high_precision_steps: tuple[int, ...] | PrecisionSchedule = ()

    @property
    def schedule(self) -> PrecisionSchedule | None:
        """The variant's precision schedule (None when it has none)."""
        s = self.high_precision_steps
        s = s if isinstance(s, PrecisionSchedule) else PrecisionSchedule(steps=s)
        return None if s.empty else s


def held_out_prompts(n: int, seed: int = 0) -> list[tuple[str, dict]]:
    """The first ``n`` captions of the corpus's held-out split, with their attributes."""
    from attnqat.corpus import Corpus

    corpus = Corpus(seed, "held_out")
    out = []
    for i in range(n):
        spec = corpus.spec(i)
        out.append((corpus.caption_of(i), {"colour": spec.colour, "shape": spec.shape, "motion": spec.motion,
                                           "background": spec.background}))
    return out


class _Weights:
    """Swap transformer weights in and out (the base weights are kept on the CPU)."""

    def __init__(self, transformer):
        self.transformer = transformer
        self.base = {k: v.detach().to("cpu", copy=True) for k, v in transformer.state_dict().items()}
        self.current = None

    def use(self, weights: dict | None):
        if weights is self.current:
            return
        self.transformer.load_state_dict(weights if weights is not None else self.base, strict=True)
        self.current = weights


def _use_mode(transformer, variant: Variant) -> None:
    """Patch ``variant``'s mode and schedule (bf16 without a schedule: diffusers' own processors)."""
    from attnqat.pipelines import patch_attention, unpatch_attention

    unpatch_attention(transformer)
    if variant.mode != "bf16" or variant.schedule is not None:
        patch_attention(transformer, variant.mode, "self", schedule=variant.schedule, **variant.options)


@torch.no_grad()
def flow_metrics(transformer, variants: list[Variant], x0: torch.Tensor, embeds: torch.Tensor, *,
                 sigmas=EVAL_SIGMAS, seed: int = 0, batch: int = 8) -> dict[str, dict]:
    """Flow loss and velocity distance to bf16 of each variant on clips ``x0`` (n, C, F, H, W) with prompt
    embeddings ``embeds``; the first variant is taken as the bf16 reference when its mode is bf16."""
    weights = _Weights(transformer)
    dtype = next(transformer.parameters()).dtype
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn((len(sigmas),) + tuple(x0.shape), generator=g).to(x0.device)
    ref, out = None, {}
    for variant in variants:
        weights.use(variant.weights)
        _use_mode(transformer, variant)
        loss_sum, dist_sum, count, vels = 0.0, 0.0, 0, []
        for si, sigma in enumerate(sigmas):
            for i in range(0, len(x0), batch):
                x, e, n = x0[i:i + batch], embeds[i:i + batch], noise[si, i:i + batch]
                xt = (1 - sigma) * x + sigma * n
                t = torch.full((len(x),), sigma * 1000.0, device=x.device)
                v = transformer(hidden_states=xt.to(dtype), timestep=t, encoder_hidden_states=e.to(dtype),
                                return_dict=False)[0].float()
                loss_sum += (v - (n - x)).pow(2).flatten(1).mean(1).sum().item()
                count += len(x)
                vels.append(v.cpu())
        v_all = torch.cat(vels)
        row = {"flow_loss": loss_sum / count}
        if ref is None and variant.mode == "bf16" and variant.weights is None:
            ref = v_all
        if ref is not None:
            row["velocity_distance"] = ((v_all - ref).pow(2).sum() / ref.pow(2).sum()).item()
        out[variant.label] = row
    weights.use(None)
    _use_mode(transformer, Variant("bf16"))
    return out


@torch.no_grad()
def generate_videos(pipe, variant: Variant, prompts: list[str], *, height: int, width: int, frames: int, steps: int,
                    guidance: float, seed: int = 0, batch: int = 8) -> np.ndarray:
    """(n, frames, height, width, 3) uint8 videos of ``prompts`` (prompt i with seed ``seed + i``)."""
    videos = []
    _use_mode(pipe.transformer, variant)
    schedule = variant.schedule
    switch = schedule.callback(pipe.transformer, steps) if schedule is not None else None
    try:
        for i in range(0, len(prompts), batch):
            part = prompts[i:i + batch]
            gens = [torch.Generator("cpu").manual_seed(seed + i + j) for j in range(len(part))]
            if switch is not None:
                switch.start()
            out = pipe(prompt=part, negative_prompt=[""] * len(part), height=height, width=width,
                       num_frames=frames, num_inference_steps=steps, guidance_scale=guidance, output_type="np",
                       generator=gens, callback_on_step_end=switch, max_sequence_length=512)
            videos.append((np.clip(np.asarray(out.frames), 0, 1) * 255).round().astype(np.uint8))
    finally:
        _use_mode(pipe.transformer, Variant("bf16"))
    return np.concatenate(videos)


def evaluate(pipe, variants: list[Variant], *, prompts: int = 32, clips: int = 32, size=(33, 256, 256),
             steps: int = 25, guidance: float = 5.0, seed: int = 0, batch: int = 8, keep_videos: bool = False,
             log=print) -> dict:
    """The full table: flow metrics on ``clips`` held-out clips and video metrics on ``prompts`` held-out
    prompts, for every variant (the first must be bf16 on the base weights: the reference)."""
    from attnqat.quality import detect, psnr, score, ssim
    from attnqat.train.config import CorpusConfig
    from attnqat.train.corpus_source import CorpusSource

    if not variants or variants[0].mode != "bf16" or variants[0].weights is not None:
        raise ValueError("the first variant must be bf16 attention on the base weights (the reference)")
    frames, height, width = size
    device = pipe._execution_device
    source = CorpusSource(pipe.name_or_path if hasattr(pipe, "name_or_path") else pipe.config._name_or_path,
                          CorpusConfig(sizes=[list(size)], pool=0), text_len=512, device=device)
    data = source.held_out(clips)
    log(f"flow metrics on {clips} held-out clips at sigmas {EVAL_SIGMAS}")
    flow = flow_metrics(pipe.transformer, variants, data["x0"], data["embeds"], seed=seed, batch=batch)
    truth = held_out_prompts(prompts, seed=0)
    texts = [p for p, _ in truth]
    weights = _Weights(pipe.transformer)
    results, ref_videos, videos = {}, None, {}
    for variant in variants:
        log(f"generating {len(texts)} videos: {variant.label}")
        weights.use(variant.weights)
        vids = generate_videos(pipe, variant, texts, height=height, width=width, frames=frames, steps=steps,
                               guidance=guidance, seed=seed, batch=batch)
        dets = [detect(v) for v in vids]
        row = dict(flow[variant.label])
        row.update({f"acc_{k}": v for k, v in score(dets, [t for _, t in truth]).items()})
        if ref_videos is None:
            ref_videos = vids
        else:
            row["psnr"] = float(np.mean([_finite(psnr(a, b)) for a, b in zip(ref_videos, vids)]))
            row["ssim"] = float(np.mean([_finite(ssim(a, b)) for a, b in zip(ref_videos, vids)]))
        results[variant.label] = row
        if keep_videos:
            videos[variant.label] = vids
    weights.use(None)
    return {"rows": results, "prompts": texts, "truth": [t for _, t in truth], "size": list(size), "steps": steps,
            "guidance": guidance, "seed": seed, "clips": clips, "sigmas": list(EVAL_SIGMAS),
            "videos": videos if keep_videos else None}


def _finite(x) -> float:
    """The mean of a (mean, per-frame) metric pair, capped at 100 (PSNR of identical videos is infinite)."""
    x = float(x[0] if isinstance(x, tuple) else x)
    return min(x, 100.0)  # identical videos: PSNR is infinite; cap so that means stay finite


def gap_closed(fp4: float, qat: float, bf16: float) -> float:
    """(FP4 - QAT) / (FP4 - bf16): 1 when QAT reaches bf16, 0 when it does no better than FP4."""
    return (fp4 - qat) / (fp4 - bf16) if fp4 != bf16 else float("nan")
