"""Training data drawn from the procedural corpus (:mod:`attnqat.mini.corpus`), encoded on the fly.

Clips are rendered on the training device, encoded by the model's own (frozen) VAE and text encoder
exactly as ``WanPipeline`` encodes a prompt and decodes latents, so what the transformer learns is what
the pipeline later asks of it:

    x0     = (vae.encode(video).mode() - latents_mean) / latents_std       (WanPipeline inverts this)
    embeds = text_encoder(tokens)[:len], zero-padded to text_len            (WanPipeline._get_t5_prompt_embeds)

Encoding a 33-frame clip costs about as much as a training step of the small transformer, so clips sit
in a **pool** per video size that is partly refreshed every step (``pool`` clips, ``refresh`` new ones
a step): each clip is seen about ``batch_size / refresh`` times on average instead of once. With
``refresh_every: K`` the new clips come ``refresh * K`` at a time every K-th step of a size: a 33-frame
VAE encode costs about the same for 4 clips as for 16 (H100: 87 ms; launch-bound), so fewer, larger
refreshes cost less per clip. What a pool holds is a function of (seed, step) alone, so a resumed run
rebuilds the very pool the uninterrupted run had, and batches stay identical. ``pool: 0`` encodes every sample fresh.
On a GPU each pool's next refresh is encoded ahead, on a worker thread and a CUDA stream of its own, while the
steps before it train (a refresh is mostly the host launching the VAE's kernels): the same clips, in time.

Video sizes: ``sizes`` lists (frames, height, width); the step's size cycles through a pattern built
from the integer ``size_weights`` (weights [2, 1] give sizes 0, 0, 1, 0, 0, 1, ...).
"""
from __future__ import annotations

import contextlib
import threading

import torch
from diffusers import AutoencoderKLWan
from diffusers.pipelines.wan.pipeline_wan import prompt_clean
from transformers import AutoTokenizer, UMT5EncoderModel

from attnqat.mini.corpus import Corpus
from attnqat.pipelines.loading import resolve_model

from .config import CorpusConfig


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small CPU tensor on ``device`` without waiting for the device: a plain copy from pageable memory to a GPU
    synchronises the stream (the training loop's GPU then idles while the host catches up); from pinned memory it
    is queued like a kernel."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def size_pattern(cfg: CorpusConfig) -> list[int]:
    weights = cfg.size_weights or [1] * len(cfg.sizes)
    return [i for i, w in enumerate(weights) for _ in range(int(w))]


def uses_before(pattern: list[int], size: int, step: int) -> int:
    """How many steps before ``step`` used video size ``size``."""
    full, part = divmod(step, len(pattern))
    return full * pattern.count(size) + pattern[:part].count(size)


def pool_clips(pool: int, refresh: int, use: int) -> list[int]:
    """Clip numbers held by each pool slot after the ``use``-th refresh (0-based) of that pool.

    The pool starts with clips 0..pool-1; refresh number t (t = 0, 1, ...) puts clip ``pool + t`` into
    slot ``t % pool``, ``refresh`` of them per use.
    """
    done = (use + 1) * refresh
    out = []
    for j in range(pool):
        out.append(pool + j + pool * ((done - 1 - j) // pool) if done - 1 >= j else j)
    return out


def set_up_for_encoding(vae: torch.nn.Module) -> None:
    """Lay out a VAE that only encodes the corpus for speed (its clips then go in channels-last too).

    Its convolution weights go channels-last, so cuDNN (and the CPU's oneDNN) run their NHWC kernels without
    transposing to and from them around every convolution; on a GPU its weights go to bf16 as well, which the encode's
    bf16 autocast casts them to at every call otherwise. On an H200, 16 clips at 33x256x256: 207 -> 165 ms
    (bench/vae_encode.py, 2026-11-29); on a CPU channels-last alone 59 -> 36 ms at 5x32x32.
    """
    for m in vae.modules():
        if isinstance(m, (torch.nn.Conv3d, torch.nn.Conv2d)):
            fmt = torch.channels_last_3d if m.weight.dim() == 5 else torch.channels_last
            m.weight.data = m.weight.data.contiguous(memory_format=fmt)
    if next(vae.parameters()).device.type == "cuda":
        vae.to(torch.bfloat16)


class CorpusSource:
    """Micro-batches of (latents, prompt embeddings) from :class:`attnqat.mini.corpus.Corpus`.

    Arguments:
        model: the diffusers folder (or ``mini``) whose ``vae``, ``text_encoder`` and ``tokenizer`` encode.
        cfg: the ``data.corpus`` section.
        text_len: prompt embeddings are zero-padded to this many tokens (WanPipeline: 512).
        device: where clips are rendered and encoded.
        rank, world: this process among ``world``; processes draw disjoint clips.
    """

    def __init__(self, model: str, cfg: CorpusConfig, *, text_len: int, device, rank: int = 0, world: int = 1,
                 prefetch: bool | None = None):
        folder = resolve_model(model)
        tokenizer = AutoTokenizer.from_pretrained(folder, subfolder="tokenizer")
        text_encoder = UMT5EncoderModel.from_pretrained(folder, subfolder="text_encoder", dtype=torch.float32)
        vae = AutoencoderKLWan.from_pretrained(folder, subfolder="vae", torch_dtype=torch.float32)
        self._setup(tokenizer, text_encoder, vae, cfg, text_len, device, rank, world, prefetch)
        set_up_for_encoding(self.vae)  # its own copy: nothing else uses it
        self.channels_last = True

    @classmethod
    def from_components(cls, tokenizer, text_encoder, vae, cfg: CorpusConfig, *, text_len: int,
                        device) -> "CorpusSource":
        """A source encoding with components already loaded (a pipeline's: ``pipe.tokenizer``,
        ``pipe.text_encoder``, ``pipe.vae``, used as they are, in their dtype; they are moved to ``device``)."""
        self = cls.__new__(cls)
        self._setup(tokenizer, text_encoder, vae, cfg, text_len, device, 0, 1, False)
        return self

    def _setup(self, tokenizer, text_encoder, vae, cfg, text_len, device, rank, world, prefetch) -> None:
        self.cfg, self.text_len, self.device, self.rank, self.world = cfg, text_len, torch.device(device), rank, world
        self.channels_last = False  # a pipeline's VAE is used as it is (set_up_for_encoding would change it for it)
        # the next refresh of a pool encoded on a worker thread (a stream of its own) while steps train: a refresh of
        # 32 clips at 33x256x256 took ~0.5 s of an H200, mostly the host launching the VAE's kernels
        self.prefetch = bool(cfg.pool) and (self.device.type == "cuda" if prefetch is None else prefetch)
        self.tokenizer = tokenizer
        self.text_encoder = text_encoder.to(self.device).eval()
        self.vae = vae.to(self.device).eval()
        self.text_encoder.requires_grad_(False)
        self.vae.requires_grad_(False)
        z = self.vae.config.z_dim
        self.mean = torch.tensor(self.vae.config.latents_mean, device=self.device).view(1, z, 1, 1, 1)
        self.std = torch.tensor(self.vae.config.latents_std, device=self.device).view(1, z, 1, 1, 1)
        self.corpora = {split: Corpus(cfg.seed, split) for split in ("train", "held_out")}
        self.pattern = size_pattern(cfg)
        self._empty = None
        self._pools: dict[int, dict] = {}  # size -> {"use": int, "clips": list, "x0": T, "embeds": T}
        self._encoding = threading.RLock()
        self._ahead: dict[int, tuple] = {}  # size -> (use, clips, future of their encoding)
        self._executor = self._stream = None

    # -- encoding -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def embed(self, captions: list[str]) -> torch.Tensor:
        """(n, text_len, d_model) float32 prompt embeddings, as ``WanPipeline`` computes them; with
        ``cfg.compact_text`` = L > 0, their first L rows, the last of which is padding for every caption
        (:mod:`.compact_text`: it stands for all of it), and a caption with no padding within L is refused."""
        tokens = self.tokenizer([prompt_clean(c) for c in captions], padding="max_length", max_length=self.text_len,
                                truncation=True, add_special_tokens=True, return_attention_mask=True,
                                return_tensors="pt")
        keep = self.cfg.compact_text
        if keep:  # the tokenizer's lengths are on the host: no wait for the GPU
            longest = int(tokens.attention_mask.sum(1).max())
            if longest >= keep:
                raise ValueError(f"data.corpus.compact_text {keep}: a caption of {longest} tokens leaves none of the "
                                 f"first {keep} rows to stand for the padding; set it above {longest}")
        ids, mask = tokens.input_ids.to(self.device), tokens.attention_mask.to(self.device)
        out = self.text_encoder(ids, mask).last_hidden_state.float()
        out = out * mask.unsqueeze(-1).to(out.dtype)  # zero past each prompt's length, as the pipeline pads
        return out[:, :keep].contiguous() if keep else out

    @torch.no_grad()
    def encode_video(self, video: torch.Tensor) -> torch.Tensor:
        """Normalised latents (n, C, F', H', W') of videos (n, 3, F, H, W) in [-1, 1]."""
        video = video.float()
        if self.channels_last:
            video = video.contiguous(memory_format=torch.channels_last_3d)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            z = self.vae.encode(video).latent_dist.mode()
        return (z.float() - self.mean) / self.std

    def clip_number(self, size: int, clip: int) -> int:
        """The corpus index of pool clip ``clip`` of video size ``size`` on this process (disjoint for all)."""
        return (clip * len(self.cfg.sizes) + size) * self.world + self.rank

    @torch.no_grad()
    def encode_clips(self, split: str, indices: list[int], size: int) -> tuple[torch.Tensor, torch.Tensor]:
        with self._encoding:  # one caller at a time: Wan's VAE keeps its causal caches on the module
            return self._encode_clips(split, indices, size)

    def _encode_clips(self, split: str, indices: list[int], size: int) -> tuple[torch.Tensor, torch.Tensor]:
        corpus = self.corpora[split]
        frames, height, width = self.cfg.sizes[size]
        x0, embeds = [], []
        chunk = max(1, self.cfg.encode_batch)
        for i in range(0, len(indices), chunk):
            part = indices[i:i + chunk]
            specs = [corpus.spec(j) for j in part]
            video = corpus.render(specs, frames=frames, height=height, width=width, device=self.device)
            x0.append(self.encode_video(video))
            embeds.append(self.embed([corpus.caption_of(j) for j in part]))
        return torch.cat(x0), torch.cat(embeds)

    # -- batches ---------------------------------------------------------------------------------------------
    def size_of_step(self, step: int) -> int:
        return self.pattern[step % len(self.pattern)]

    def _pool(self, size: int, step: int) -> dict:
        cfg = self.cfg
        # the pool changes at every refresh_every-th use of this size, by refresh * refresh_every clips
        use = uses_before(self.pattern, size, step) // cfg.refresh_every
        want = pool_clips(cfg.pool, cfg.refresh * cfg.refresh_every, use)
        pool = self._pools.get(size)
        if pool is not None and pool["use"] == use:
            return pool
        if pool is not None and pool["use"] == use - 1:  # the usual case: refresh a few slots
            changed = [j for j in range(cfg.pool) if pool["clips"][j] != want[j]]
        else:  # first use, or a resumed run: rebuild the whole pool
            pool = {"x0": None, "embeds": None}
            changed = list(range(cfg.pool))
        x0, embeds = self._refresh_clips(size, use, [self.clip_number(size, want[j]) for j in changed])
        if pool["x0"] is None:
            pool["x0"], pool["embeds"] = x0, embeds
        else:
            idx = torch.tensor(changed, device=self.device)
            pool["x0"][idx], pool["embeds"][idx] = x0, embeds
        pool["use"], pool["clips"] = use, want
        self._pools[size] = pool
        if self.prefetch:  # the next refresh of this size, encoded while the coming steps train
            nxt = pool_clips(cfg.pool, cfg.refresh * cfg.refresh_every, use + 1)
            clips = [self.clip_number(size, nxt[j]) for j in range(cfg.pool) if nxt[j] != want[j]]
            # The worker's tensors were made on its stream and read here on this one. Rather than record_stream
            # (whose free records an event on this stream, which fails inside a CUDA graph capture when the garbage
            # collector frees them there), the worker waits for this event before it allocates again: only it
            # allocates on its stream, so their memory is not reused before this stream is done with them.
            consumed = None
            if self.device.type == "cuda":
                consumed = torch.cuda.Event()
                consumed.record(torch.cuda.current_stream(self.device))
            self._ahead[size] = (use + 1, clips, self._worker().submit(self._encode_ahead, clips, size, consumed))
        return pool

    def _refresh_clips(self, size: int, use: int, clips: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The encoded ``clips`` of refresh ``use`` of ``size``: the prefetched ones if they are these, else now."""
        ahead = self._ahead.pop(size, None)
        if ahead is not None and ahead[:2] == (use, clips):
            x0, embeds, done = ahead[2].result()
            if done is not None:  # encoded on the worker's stream: this stream waits for it
                torch.cuda.current_stream(self.device).wait_event(done)
            return x0, embeds
        if ahead is not None:
            ahead[2].result()  # a resumed or jumped run: let the stale encode finish (it holds the encoder)
        return self.encode_clips("train", clips, size)

    def _worker(self):
        if self._executor is None:
            from concurrent.futures import ThreadPoolExecutor

            self._executor = ThreadPoolExecutor(1, thread_name_prefix="attnqat-pool")
        return self._executor

    def _encode_ahead(self, clips: list[int], size: int, consumed=None):
        """On the worker thread: encode ``clips`` (on a stream of its own on a GPU), once the main stream has passed
        ``consumed`` (the last prefetch's tensors read); returns the tensors and the event that marks them done
        (None on a CPU)."""
        if self.device.type != "cuda":
            return (*self.encode_clips("train", clips, size), None)
        with self._encoding:  # all of its GPU work under the lock that paused() takes
            if consumed is not None:
                consumed.synchronize()
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device)
            with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
                x0, embeds = self.encode_clips("train", clips, size)
                done = torch.cuda.Event()
                done.record(self._stream)
            return x0, embeds, done

    @contextlib.contextmanager
    def paused(self):
        """No encoding while inside: a CUDA graph capture on the main thread fails if the worker's GPU work lands in
        it (seen on an H200: "operation would make the legacy stream depend on a capturing blocking stream")."""
        with self._encoding:
            yield

    def batch(self, step: int, micro: int, n: int, g: torch.Generator, position: int) -> dict[str, torch.Tensor]:
        """``x0`` and ``embeds`` of one micro-batch of ``n`` samples (``position``: global sample number,
        used when there is no pool); caption dropout replaces a prompt by the empty one (for guidance)."""
        size = self.size_of_step(step)
        if self.cfg.pool:
            pool = self._pool(size, step)
            pick = to_device(torch.randint(self.cfg.pool, (n,), generator=g), self.device)
            x0, embeds = pool["x0"][pick], pool["embeds"][pick]
        else:
            x0, embeds = self.encode_clips("train", [self.clip_number(size, position + k) for k in range(n)], size)
        drop = torch.rand(n, generator=g) < self.cfg.caption_dropout
        if drop.any():  # a select, not a masked assignment: that one waits for the GPU to count the mask
            embeds = torch.where(to_device(drop, self.device).view(n, 1, 1),
                                 self.empty_embedding().to(embeds.dtype), embeds)
        return {"x0": x0, "embeds": embeds}

    def empty_embedding(self) -> torch.Tensor:
        if self._empty is None:
            self._empty = self.embed([""])[0]
        return self._empty

    def held_out(self, n: int) -> dict[str, torch.Tensor]:
        """The first ``n`` clips of the held-out split at the first video size (never trained on)."""
        x0, embeds = self.encode_clips("held_out", list(range(n)), 0)
        return {"x0": x0, "embeds": embeds}
