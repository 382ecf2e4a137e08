"""How much an attention mode (and a set of weights) costs a model, measured on held-out data.

One *variant* is an attention mode plus the transformer weights it runs with (the base weights, or a
fine-tune such as a QAT checkpoint), optionally with a precision schedule (some denoising steps in bf16).
For a list of variants, on the held-out attribute combinations of the procedural corpus
(:mod:`attnqat.mini.corpus`), with fixed noise and seeds shared by every variant:

- **flow loss**: the flow-matching loss ``|v - (noise - x0)|^2`` on held-out clips at fixed noise levels
  (:data:`EVAL_SIGMAS`; the cleanest single number for "how much worse is FP4");
- **velocity distance**: ``|v - v_bf16|^2 / |v_bf16|^2`` to the base model with bf16 attention at the
  same inputs (how far the variant's prediction moved);
- **prompt following**: colour / shape / motion read off the generated videos by
  :func:`attnqat.mini.quality.detect` against the prompt's attributes (``acc_all``: every attribute right);
- **PSNR / SSIM** of each video to the bf16 video of the same prompt and seed (the reference row has none);
- **gap closed** ``(FP4 - X) / (FP4 - bf16)`` on the flow loss and on ``acc_all``, against an FP4 reference
  row (by default the base weights in nvfp4) and a bf16 reference row (by default the first row);
- **per frame**, so that a video that falls apart late cannot hide in a mean: the flow loss, velocity distance
  and gap closed per latent frame, PSNR / SSIM per video frame, and the asked object's presence in its asked
  colour per frame (:func:`attnqat.mini.quality.presence`).

:func:`vae_round_trip` measures a VAE the same way: every frame of round trips of clips, PSNR over the whole
frame and the object, and the detector's colour and shape reading.

``attnqat quality`` (:mod:`attnqat.mini.quality_cli`) and ``bench/quality.py`` print and save the table.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from attnqat.mini.corpus import Corpus, changed_captions
from attnqat.kernels import REFERENCE_MODE, available_modes, mode_of, reference_first
from attnqat.pipelines import patch_attention, unpatch_attention
from attnqat.pipelines.schedule import PrecisionSchedule
from attnqat.mini.quality import detect, detect_frames, object_mask, presence, psnr, score, ssim
from attnqat.train.config import CorpusConfig
from attnqat.train.corpus_source import CorpusSource

#: Noise levels of the flow-loss evaluation (each clip at each level, same noise for every variant).
EVAL_SIGMAS = (0.1, 0.3, 0.5, 0.7, 0.9)
#: PSNR of a frame identical to the reference is infinite; per-frame values are capped here before averaging.
PSNR_CAP_DB = 100.0


@dataclass
class Variant:
    """An attention mode with the transformer weights it runs with (``None``: the base weights)."""
    label: str
    mode: str = REFERENCE_MODE
    weights: dict | None = None         # a full transformer state dict (e.g. a QAT checkpoint)
    options: dict = field(default_factory=dict)
    high_precision_steps: tuple[int, ...] | PrecisionSchedule = ()
    source: str | None = None           # where ``weights`` came from (for the table); None: the base weights

    @property
    def schedule(self) -> PrecisionSchedule | None:
        """The variant's precision schedule (None when it has none)."""
        s = self.high_precision_steps
        s = s if isinstance(s, PrecisionSchedule) else PrecisionSchedule(steps=s)
        return None if s.empty else s


def base_variants(modes: list[str] | None = None) -> list[Variant]:
    """The base weights in every mode of ``modes`` (default: every registered mode whose forward is not another's:
    ``Mode.same_forward_as``; with the base weights such a mode gives that mode's numbers exactly), bf16 first
    (the reference)."""
    if modes is None:
        modes = available_modes(lambda m: m.same_forward_as is None)
    return [Variant(m, m) for m in reference_first(modes)]


def held_out_prompts(n: int, seed: int = 0) -> list[tuple[str, dict]]:
    """The first ``n`` captions of the corpus's held-out split, with their attributes."""
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
    unpatch_attention(transformer)
    if variant.mode != REFERENCE_MODE or variant.schedule is not None:
        patch_attention(transformer, variant.mode, "self", schedule=variant.schedule, **variant.options)


_BF16 = Variant(REFERENCE_MODE)


def bf16_sigma_indices(variant: Variant, scheduler, steps: int, sigmas=EVAL_SIGMAS) -> set[int]:
    """Indices of ``sigmas`` that a ``steps``-step run of ``scheduler`` denoises in one of the variant's bf16
    steps: step i takes the latents from ``s[i]`` to ``s[i+1]`` (the scheduler's shifted sigmas), so it covers
    noise levels in ``(s[i+1], s[i]]``. The flow loss of a precision-schedule row uses bf16 attention there."""
    if variant.schedule is None:
        return set()
    bf16_steps = variant.schedule.resolve_steps(steps)
    sched = copy.deepcopy(scheduler)
    sched.set_timesteps(steps)
    s = [float(x) for x in sched.sigmas]
    out = set()
    for j, sigma in enumerate(sigmas):
        for i in range(steps):
            if s[i + 1] < sigma <= s[i] and i in bf16_steps:
                out.add(j)
    return out


@torch.no_grad()
def flow_metrics(transformer, variants: list[Variant], x0: torch.Tensor, embeds: torch.Tensor, *,
                 sigmas=EVAL_SIGMAS, seed: int = 0, batch: int = 8, bf16_sigmas: dict | None = None,
                 weights: _Weights | None = None, progress=None) -> dict[str, dict]:
    """Flow loss and velocity distance to bf16 of each variant on clips ``x0`` (n, C, F, H, W) with prompt
    embeddings ``embeds``, over all latent positions and per latent frame (``flow_loss_frames``,
    ``velocity_distance_frames``: F values each); the first variant is taken as the bf16 reference when its
    mode is bf16 on the base weights. ``bf16_sigmas``: label -> indices of ``sigmas`` evaluated with bf16 attention (precision-schedule
    rows, :func:`bf16_sigma_indices`). ``progress``: a tqdm-like object, ``update(1)`` after each variant."""
    weights = weights or _Weights(transformer)
    # the dtype of the input projection: diffusers keeps some modules (norms, the time embedding) in fp32
    dtype = transformer.patch_embedding.weight.dtype if hasattr(transformer, "patch_embedding") else transformer.dtype
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn((len(sigmas),) + tuple(x0.shape), generator=g).to(x0.device)
    ref, out = None, {}
    for variant in variants:
        weights.use(variant.weights)
        in_bf16 = (bf16_sigmas or {}).get(variant.label, set())
        loss_sum, count, vels = 0.0, 0, []
        loss_frames = torch.zeros(x0.shape[2], dtype=torch.float64)  # per latent frame, summed over clips
        for si, sigma in enumerate(sigmas):
            _use_mode(transformer, Variant(variant.label, variant.schedule.mode) if si in in_bf16 else variant)
            for i in range(0, len(x0), batch):
                x, e, n = x0[i:i + batch], embeds[i:i + batch], noise[si, i:i + batch]
                xt = (1 - sigma) * x + sigma * n
                t = torch.full((len(x),), sigma * 1000.0, device=x.device)
                v = transformer(hidden_states=xt.to(dtype), timestep=t, encoder_hidden_states=e.to(dtype),
                                return_dict=False)[0].float()
                err = (v - (n - x)).pow(2)
                loss_sum += err.flatten(1).mean(1).sum().item()
                loss_frames += err.mean((1, 3, 4)).sum(0).double().cpu()
                count += len(x)
                vels.append(v.cpu())
        v_all = torch.cat(vels)
        row = {"flow_loss": loss_sum / count, "flow_loss_frames": (loss_frames / count).tolist()}
        if ref is None and variant.mode == REFERENCE_MODE and variant.weights is None and not in_bf16:
            ref = v_all
        if ref is not None:
            row["velocity_distance"] = ((v_all - ref).pow(2).sum() / ref.pow(2).sum()).item()
            per_frame = (0, 1, 3, 4)  # all but the latent frame
            row["velocity_distance_frames"] = ((v_all - ref).pow(2).sum(per_frame) / ref.pow(2).sum(per_frame)).tolist()
        out[variant.label] = row
        if progress is not None:
            progress.update(1)
    weights.use(None)
    _use_mode(transformer, _BF16)
    return out


@torch.no_grad()
def generate_videos(pipe, variant: Variant, prompts: list[str], *, height: int, width: int, frames: int, steps: int,
                    guidance: float, seed: int = 0, batch: int = 8, progress=None) -> tuple[np.ndarray, np.ndarray]:
    """Videos of ``prompts`` in the variant's mode (prompt i with seed ``seed + i``, whatever the batching:
    each prompt's noise comes from its own generator), with the weights the transformer holds now.

    Return: ((n, frames, height, width, 3) uint8 videos, (n,) bool: the video was finite). A video with NaN
    or inf pixels is kept (as 0 there) and marked, so that one broken variant does not end a long run.
    ``progress``: a tqdm-like object, ``update(1)`` after each batch.
    """
    videos, finite = [], []
    _use_mode(pipe.transformer, variant)
    schedule = variant.schedule
    switch = schedule.callback(pipe.transformer, steps) if schedule is not None else None
    try:
        for i in range(0, len(prompts), batch):
            part = prompts[i:i + batch]
            gens = [torch.Generator("cpu").manual_seed(seed + i + j) for j in range(len(part))]
            if switch is not None:
                switch.start()
            out = pipe(prompt=part, negative_prompt=[""] * len(part), height=height, width=width, num_frames=frames,
                       num_inference_steps=steps, guidance_scale=guidance, output_type="np", generator=gens,
                       callback_on_step_end=switch, max_sequence_length=512)
            v = np.asarray(out.frames, dtype=np.float32)
            ok = np.isfinite(v).reshape(len(v), -1).all(1)
            v = np.nan_to_num(v, nan=0.0, posinf=1.0, neginf=0.0)
            videos.append((np.clip(v, 0, 1) * 255).round().astype(np.uint8))
            finite.append(ok)
            if progress is not None:
                progress.update(1)
    finally:
        _use_mode(pipe.transformer, _BF16)
    return np.concatenate(videos), np.concatenate(finite)


def work_units(variants: int, prompts: int, batch: int) -> int:
    """How many ``progress.update(1)`` calls :func:`evaluate` makes: one per variant for the flow metrics, one
    per variant and batch of generated videos."""
    return variants * (1 + math.ceil(prompts / batch))


def video_psnr_frames(ref: np.ndarray, x: np.ndarray) -> list[float]:
    """PSNR (dB) of each frame of a video to a reference, capped at :data:`PSNR_CAP_DB` (an identical frame's
    is infinite)."""
    return [min(v, PSNR_CAP_DB) for v in psnr(ref, x)[1]]


def video_psnr(ref: np.ndarray, x: np.ndarray) -> float:
    """PSNR (dB) of a video to a reference: the mean over frames of :func:`video_psnr_frames`."""
    return float(np.mean(video_psnr_frames(ref, x)))


def default_fp4_reference(variants: list[Variant]) -> str | None:
    """The label of the first variant that is FP4 attention without QAT: a mode whose forward is naive NVFP4
    (``Mode.naive_fp4_forward``) on the base weights, without bf16 steps or options (None when there is none)."""
    for v in variants:
        if mode_of(v.mode).naive_fp4_forward and v.weights is None and v.schedule is None and not v.options:
            return v.label
    return None


def add_gap_closed(rows: dict[str, dict], fp4: str, bf16: str) -> None:
    """Add ``gap_closed_loss`` (on ``flow_loss``), ``gap_closed_velocity`` (on ``velocity_distance``: the bf16
    end is 0 there, so it is 1 - distance / FP4's distance) and ``gap_closed_acc`` (on ``acc_all``) to every
    row: :func:`gap_closed` with the rows ``fp4`` and ``bf16`` as the two ends (None where undefined); and per
    latent frame ``gap_closed_loss_frames`` and ``gap_closed_velocity_frames`` from the rows' per-frame lists."""
    for key, metric in (("gap_closed_loss", "flow_loss"), ("gap_closed_velocity", "velocity_distance"),
                        ("gap_closed_acc", "acc_all")):
        lo, hi = rows[fp4].get(metric), rows[bf16].get(metric)
        for row in rows.values():
            x = row.get(metric)
            g = gap_closed(lo, x, hi) if None not in (lo, hi, x) else float("nan")
            row[key] = g if math.isfinite(g) else None
    for key, metric in (("gap_closed_loss_frames", "flow_loss_frames"),
                        ("gap_closed_velocity_frames", "velocity_distance_frames")):
        lo, hi = rows[fp4].get(metric), rows[bf16].get(metric)
        for row in rows.values():
            x = row.get(metric)
            gaps = [] if None in (lo, hi, x) else [gap_closed(a, b, c) for a, b, c in zip(lo, x, hi)]
            row[key] = [g if math.isfinite(g) else None for g in gaps] or None


def check_variants(variants: list[Variant]) -> None:
    """The first variant must be bf16 on the base weights (the reference); labels are unique."""
    first = variants[0] if variants else None
    if first is None or first.mode != REFERENCE_MODE or first.weights is not None or first.schedule is not None:
        raise ValueError("the first variant must be bf16 attention on the base weights (the reference)")
    labels = [v.label for v in variants]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise ValueError(f"variant labels must be unique; repeated: {', '.join(dup)}")


def corpus_source(pipe, *, size, corpus_seed: int = 0, batch: int = 8, text_len: int = 512):
    """A :class:`~attnqat.train.corpus_source.CorpusSource` of corpus clips at ``size`` (frames, height, width),
    encoded by ``pipe``'s VAE and text encoder on ``pipe``'s device as ``attnqat train`` (``data.source:
    corpus``) encodes training clips, prompts padded to ``text_len`` tokens (``WanPipeline``'s 512)."""
    return CorpusSource.from_components(pipe.tokenizer, pipe.text_encoder, pipe.vae,
                                        CorpusConfig(seed=corpus_seed, sizes=[list(size)], pool=0,
                                                     encode_batch=batch),
                                        text_len=text_len, device=pipe._execution_device)


def held_out_clips(pipe, clips: int, *, size, corpus_seed: int = 0, batch: int = 8) -> dict[str, torch.Tensor]:
    """The first ``clips`` clips of the corpus's held-out split at ``size`` (frames, height, width), encoded as
    :func:`corpus_source` encodes them: ``{"x0": latents, "embeds": prompt embeddings}`` on ``pipe``'s device."""
    return corpus_source(pipe, size=size, corpus_seed=corpus_seed, batch=batch).held_out(clips)


#: The captions :func:`caption_losses` scores each clip under (:func:`attnqat.mini.corpus.changed_captions`, and
#: ``other``: the next clip's own caption).
CAPTION_CONDITIONS = ("right", "motion", "colour", "shape", "empty", "other")


@torch.no_grad()
def caption_losses(transformer, source, split: str, indices: list[int], sigmas, *,
                   conditions=CAPTION_CONDITIONS, seed: int = 0, chunk: int = 8) -> dict:
    """Which words of the prompt does a model read? The flow loss ``|v - (noise - x0)|^2`` of corpus clips at
    fixed noise under their own caption and under captions that differ from it (:data:`CAPTION_CONDITIONS`).

    A model that reads an attribute's words pays more loss for the changed caption than for the own one; one
    that ignores them pays the same (a ratio of 1.00, the own caption lower on half of the clips).

    Arguments:
        transformer: a Wan transformer (eval mode).
        source: the :class:`~attnqat.train.corpus_source.CorpusSource` that renders and encodes the clips
            (:func:`corpus_source`); the first of its sizes is used.
        split, indices: the clips, ``source.corpora[split].spec(i)`` for ``i`` in ``indices`` (at least 2).
        sigmas: noise levels in (0, 1]; each gets its own noise, shared by every condition.
        conditions: which of :data:`CAPTION_CONDITIONS` to score.
        seed: the noise's seed.
    Return: ``{"losses": {sigma: {condition: (n,) per-clip losses}}, "motions": [each clip's motion],
    "captions": [each clip's own caption]}``.
    """
    unknown = [c for c in conditions if c not in CAPTION_CONDITIONS]
    if unknown:
        raise ValueError(f"unknown caption conditions {unknown}; known: {', '.join(CAPTION_CONDITIONS)}")
    if len(indices) < 2:
        raise ValueError(f"caption_losses needs at least 2 clips (one's caption is another's 'other'), "
                         f"got {len(indices)}")
    specs = [source.corpora[split].spec(i) for i in indices]
    x0, _ = source.encode_clips(split, list(indices), 0)
    caps = [changed_captions(s, i) for s, i in zip(specs, indices)]
    for i, c in enumerate(caps):
        c["other"] = caps[(i + 1) % len(caps)]["right"]
    emb = {c: source.embed([cp[c] for cp in caps]) for c in conditions}
    g = torch.Generator().manual_seed(seed)
    out = {}
    for sigma in sigmas:
        noise = torch.randn(x0.shape, generator=g).to(x0.device)
        xt, target = (1 - sigma) * x0 + sigma * noise, noise - x0
        per = {}
        for c in conditions:
            losses = []
            for i in range(0, len(x0), chunk):
                part = slice(i, i + chunk)
                t = torch.full((xt[part].shape[0],), sigma * 1000.0, device=x0.device)
                v = transformer(hidden_states=xt[part].to(transformer.dtype), timestep=t,
                                encoder_hidden_states=emb[c][part].to(transformer.dtype), return_dict=False)[0]
                losses.append((v.float() - target[part]).pow(2).mean(dim=(1, 2, 3, 4)).cpu())
            per[c] = torch.cat(losses)
        out[sigma] = per
    return {"losses": out, "motions": [s.motion for s in specs], "captions": [c["right"] for c in caps]}


def evaluate(pipe, variants: list[Variant], *, prompts: int = 32, clips: int = 32, size=(33, 256, 256),
             steps: int = 25, guidance: float = 5.0, seed: int = 0, batch: int = 8, corpus_seed: int = 0,
             fp4_reference: str | None = None, bf16_reference: str | None = None, keep_videos: bool = False,
             log=print, progress=None) -> dict:
    """The full table: flow metrics on ``clips`` held-out clips and video metrics on ``prompts`` held-out
    prompts, for every variant (the first must be bf16 on the base weights: the reference of the velocity
    distance and of PSNR / SSIM).

    Arguments:
        pipe: a ``WanPipeline`` on its device; its text encoder and VAE encode the held-out clips the way
            ``attnqat train`` (``data.source: corpus``) encodes training clips.
        size: (frames, height, width) of the clips and videos.
        corpus_seed: the corpus seed the model was trained with (its held-out split is the prompt set).
        fp4_reference, bf16_reference: labels of the gap-closed rows' two ends; default
            :func:`default_fp4_reference` and the first variant. No FP4 reference: no gap-closed columns.
        progress: a tqdm-like object, updated :func:`work_units` times.
    Return: ``{"rows": {label: {...}}, "order": [labels], "references": {...}, "prompts", "truth",
    "detections": {label: [...]}, settings...}``, plus ``"videos": {label: uint8 array}`` if ``keep_videos``.
    Each row holds the averages and the per-frame curves (``flow_loss_frames``, ``velocity_distance_frames``,
    ``gap_closed_*_frames`` per latent frame; ``psnr_frames``, ``ssim_frames`` and ``presence`` per video
    frame); each detection the whole video's reading and ``colour_frames``, the colour read in each frame.
    """
    check_variants(variants)
    labels = [v.label for v in variants]
    bf16_reference = bf16_reference or labels[0]
    fp4_reference = fp4_reference if fp4_reference is not None else default_fp4_reference(variants)
    for flag, label in (("fp4_reference", fp4_reference), ("bf16_reference", bf16_reference)):
        if label is not None and label not in labels:
            raise ValueError(f"{flag} {label!r} is not a variant label ({', '.join(labels)})")
    frames, height, width = size
    data = held_out_clips(pipe, clips, size=size, corpus_seed=corpus_seed, batch=batch)
    log(f"flow metrics on {clips} held-out clips at sigmas {EVAL_SIGMAS}")
    weights = _Weights(pipe.transformer)
    bf16_sigmas = {v.label: bf16_sigma_indices(v, pipe.scheduler, steps) for v in variants}
    flow = flow_metrics(pipe.transformer, variants, data["x0"], data["embeds"], seed=seed, batch=batch,
                        bf16_sigmas=bf16_sigmas, weights=weights, progress=progress)
    truth = held_out_prompts(prompts, seed=corpus_seed)
    texts = [p for p, _ in truth]
    results, detections, ref_videos, videos = {}, {}, None, {}
    for variant in variants:
        log(f"generating {len(texts)} videos: {variant.label}")
        weights.use(variant.weights)
        vids, finite = generate_videos(pipe, variant, texts, height=height, width=width, frames=frames, steps=steps,
                                       guidance=guidance, seed=seed, batch=batch, progress=progress)
        dets = [detect(v) for v in vids]
        readings = [detect_frames(v) for v in vids]
        acc = score(dets, [t for _, t in truth])
        row = dict(flow[variant.label])
        row.update({f"acc_{k}": acc[k] for k in ("colour", "shape", "motion", "direction", "all")})
        row["presence"] = presence(readings, [t for _, t in truth])
        row["nonfinite_videos"] = int((~finite).sum())
        if ref_videos is None:
            ref_videos = vids
            row["psnr"] = row["ssim"] = row["psnr_frames"] = row["ssim_frames"] = None  # the reference itself
        else:
            psnrs = np.array([video_psnr_frames(a, b) for a, b in zip(ref_videos, vids)])  # (videos, frames)
            ssims = np.array([ssim(a, b)[1] for a, b in zip(ref_videos, vids)])
            row["psnr"], row["ssim"] = float(psnrs.mean()), float(ssims.mean())
            row["psnr_frames"], row["ssim_frames"] = psnrs.mean(0).tolist(), ssims.mean(0).tolist()
        results[variant.label] = row
        detections[variant.label] = [{**{k: d.get(k) for k in ("colour", "shape", "motion")},
                                      "colour_frames": r["colour"]} for d, r in zip(dets, readings)]
        if keep_videos:
            videos[variant.label] = vids
    weights.use(None)
    if fp4_reference is not None:
        add_gap_closed(results, fp4_reference, bf16_reference)
    return {"rows": results, "order": labels,
            "variants": [{"label": v.label, "mode": v.mode, "weights": v.source, "options": dict(v.options),
                          "high_precision": None if v.schedule is None else
                          {"steps": v.schedule.steps_text(), "blocks": v.schedule.blocks_text(),
                           "mode": v.schedule.mode}} for v in variants],
            "references": {"bf16": bf16_reference, "fp4": fp4_reference, "video": labels[0]},
            "prompts": texts, "truth": [t for _, t in truth], "detections": detections, "size": list(size),
            "steps": steps, "guidance": guidance, "seed": seed, "corpus_seed": corpus_seed, "clips": clips,
            "sigmas": list(EVAL_SIGMAS), "psnr_cap_db": PSNR_CAP_DB, "videos": videos if keep_videos else None}


@torch.no_grad()
def vae_round_trip(vae, clips: torch.Tensor, truths: list[dict] | None = None, *, batch: int = 4) -> dict:
    """Each frame of VAE round trips (encode, the posterior's mode, decode), measured against the clip.

    Arguments:
        vae: an ``AutoencoderKLWan`` on any device, in any dtype (the clips go to its device and dtype).
        clips: (n, 3, frames, H, W) float in [-1, 1], the corpus layout (``Corpus.batch``'s videos).
        truths: per clip the attributes the detector should read (``{"colour", "shape"}``, e.g. a corpus
            spec's ``attributes``); None: what :func:`attnqat.mini.quality.detect` reads off the clip itself.
        batch: clips per encode / decode.
    Return: per clip and frame (lists of lists, n x frames): ``"psnr"`` in dB over the whole frame (RGB,
    [-1, 1] taken as 0..255, the round trip clamped to it; ``inf`` where equal), ``"psnr_object"`` the same
    over the clip's object region (the pixels where :func:`attnqat.mini.quality.object_mask` of the clip is
    >= 0.5; None where a frame has none), ``"colour_ok"`` and ``"shape_ok"``
    (:func:`attnqat.mini.quality.detect_frames` of the round trip reads the truth's colour, shape: an object not
    found or cut by the border is wrong); ``"per_frame"``: each of the four averaged over the clips, frame
    by frame (PSNR as the mean dB; the checks as the fraction of clips right); ``"min"``: the lowest
    ``"psnr"`` and ``"psnr_object"`` of any frame of any clip and the lowest per-frame fraction of
    ``"colour_ok"`` and ``"shape_ok"``; ``"max"``: the highest ``"psnr"`` of any frame.
    """
    if not (isinstance(clips, torch.Tensor) and clips.ndim == 5 and clips.shape[1] == 3 and clips.is_floating_point()):
        raise ValueError(f"clips must be a (n, 3, frames, H, W) float tensor, got "
                         f"{getattr(clips, 'shape', type(clips).__name__)}")
    if truths is not None and len(truths) != len(clips):
        raise ValueError(f"{len(clips)} clips but {len(truths)} truths")
    param = next(vae.parameters())
    out = {k: [] for k in ("psnr", "psnr_object", "colour_ok", "shape_ok")}
    for i in range(0, len(clips), batch):
        x = clips[i:i + batch].to(param.device, param.dtype)
        recon = vae.decode(vae.encode(x).latent_dist.mode()).sample.float().clamp(-1, 1).cpu().double()
        for j, (clip, back) in enumerate(zip(clips[i:i + batch].detach().cpu().double(), recon)):
            err = ((back - clip) / 2).pow(2)  # (3, F, H, W) on the [0, 1] scale
            region = (object_mask(clip) >= 0.5).double()  # (F, H, W)
            out["psnr"].append(_db(err.mean((0, 2, 3))).tolist())
            covered = region.sum((1, 2))
            obj = _db((err * region).sum((0, 2, 3)) / (3 * covered).clamp(min=1))
            out["psnr_object"].append([v if c > 0 else None for v, c in zip(obj.tolist(), covered.tolist())])
            truth = truths[i + j] if truths is not None else detect(clip)
            reading = detect_frames(back)
            out["colour_ok"].append([f and c == truth.get("colour") for f, c in zip(reading["found"], reading["colour"])])
            out["shape_ok"].append([f and s == truth.get("shape") for f, s in zip(reading["found"], reading["shape"])])
    psnr = np.array(out["psnr"], dtype=np.float64)
    has = np.array([[v is not None for v in row] for row in out["psnr_object"]])  # (n, F): a region to measure
    obj = np.array([[0.0 if v is None else v for v in row] for row in out["psnr_object"]], dtype=np.float64)
    colour, shape = np.array(out["colour_ok"], dtype=np.float64), np.array(out["shape_ok"], dtype=np.float64)
    out["per_frame"] = {"psnr": psnr.mean(0).tolist(),
                        "psnr_object": [float(obj[h, f].mean()) if h.any() else None for f, h in enumerate(has.T)],
                        "colour_ok": colour.mean(0).tolist(), "shape_ok": shape.mean(0).tolist()}
    out["min"] = {"psnr": float(psnr.min()), "psnr_object": float(obj[has].min()) if has.any() else None,
                  "colour_ok": float(colour.mean(0).min()), "shape_ok": float(shape.mean(0).min())}
    out["max"] = {"psnr": float(psnr.max())}
    return out


def _db(mse: torch.Tensor) -> torch.Tensor:
    """PSNR in dB of mean squared errors on the [0, 1] scale (``inf`` for 0, NaN for NaN)."""
    return 10 * torch.log10(1 / mse)


def gap_closed(fp4: float, qat: float, bf16: float) -> float:
    """(FP4 - QAT) / (FP4 - bf16): 1 when QAT reaches bf16, 0 when it does no better than FP4."""
    return (fp4 - qat) / (fp4 - bf16) if fp4 != bf16 else float("nan")
