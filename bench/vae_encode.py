"""The training corpus's VAE encode, per variant: its time and how far its latents move from today's encode.

    python bench/vae_encode.py [--model mini] [--size 33x256x256] [--clips 16] [--variants all] [--json FILE]

Why: on an H200, mini's compiled, graphed training loop is bound by the GPU, and a third of the GPU's time at
33x256x256 is the latent pool's refresh (``attnqat/train/corpus_source.py``), encoded on a side stream while the
steps train: in the profiler's six steps (docs/benchmarks.md, run 4), 175 ms of VAE work beside 223 ms of training,
of it ~60 ms convolutions (15 ms of them cuDNN's NCHW <-> NHWC transposes around each conv), ~35 ms float32 copies
(the causal convolutions' padding and frame caches) and ~60 ms other elementwise kernels (RMS norm, SiLU).

Variants (each on the same rendered clips, ``CorpusSource.encode_video``'s autocast and normalisation):

- ``default``: what the loop runs (``corpus_source.set_up_for_encoding``: channels-last convolutions, and on a GPU
  bf16 weights).
- ``plain``: float32 weights and NCDHW tensors (the encode before 2026-11-29).
- ``channels_last``: float32 weights, channels-last convolutions and clips.
- ``bf16_weights``: bf16 weights, NCDHW (autocast casts float32 ones at every conv call otherwise); CUDA only.
- ``compiled_norms``: ``default`` with each RMS norm of the encoder compiled (``torch.compile``, dynamic shapes:
  the encode's time chunks and levels differ): one fused kernel where eager runs the normalisation's reduction,
  clamp, division, scale and gamma one kernel each (the ~60 ms of "other elementwise" above is mostly these).
- ``benchmark``: ``default`` with ``torch.backends.cudnn.benchmark`` (cuDNN times its algorithms once per shape; its
  pick may change from process to process, and with it the latents' last bits: a resumed run would then not
  rebuild its pool to the bit).

Per variant: the median wall time of ``--repeats`` encodes (synchronised; the first ``--warmup`` untimed) and the
latents' largest difference from ``default``'s, relative to their spread (RMS); then ``default`` once more, whose
difference from its first run is the device's own run-to-run spread (on an H200 the first run of a process differed
from all later ones by 0.14 RMS at some latent). Nothing is written but ``--json``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from attnqat.train.config import CorpusConfig  # noqa: E402
from attnqat.train.corpus_source import CorpusSource, set_up_for_encoding  # noqa: E402

VARIANTS = ("default", "plain", "channels_last", "bf16_weights", "compiled_norms", "benchmark")


@contextlib.contextmanager
def _variant(src, name: str):
    """``src`` (a CorpusSource of its own VAE) set up for variant ``name`` inside; as the library sets it up after."""
    if name not in VARIANTS:
        raise ValueError(f"unknown variant {name!r}: one of {', '.join(VARIANTS)}")
    vae, bench = src.vae, torch.backends.cudnn.benchmark
    try:
        if name in ("plain", "channels_last", "bf16_weights"):
            _plain(vae)
            src.channels_last = name == "channels_last"
            if name == "channels_last":
                _conv_weights(vae, {5: torch.channels_last_3d, 4: torch.channels_last})
            elif name == "bf16_weights":
                vae.to(torch.bfloat16)
        elif name == "benchmark":
            torch.backends.cudnn.benchmark = True
        elif name == "compiled_norms":
            for m in _rms_norms(vae.encoder):
                m.compile(dynamic=True)
        yield
    finally:
        for m in _rms_norms(vae.encoder):
            m._compiled_call_impl = None  # what nn.Module.compile set: the module calls its own forward again
        _plain(vae)
        set_up_for_encoding(vae)
        src.channels_last = True
        torch.backends.cudnn.benchmark = bench


def _rms_norms(module: torch.nn.Module) -> list[torch.nn.Module]:
    """Wan's VAE RMS norms in ``module`` (diffusers' ``WanRMS_norm``)."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanRMS_norm

    return [m for m in module.modules() if isinstance(m, WanRMS_norm)]


def _plain(vae: torch.nn.Module) -> None:
    vae.to(dtype=torch.float32)
    _conv_weights(vae, {5: torch.contiguous_format, 4: torch.contiguous_format})


def _conv_weights(module: torch.nn.Module, formats: dict) -> None:
    """Every convolution weight of ``module`` in ``formats[its rank]`` (Wan's VAE has 3-D and 2-D convolutions)."""
    for m in module.modules():
        if isinstance(m, (torch.nn.Conv3d, torch.nn.Conv2d)):
            m.weight.data = m.weight.data.contiguous(memory_format=formats[m.weight.dim()])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="mini", help="a model folder with vae/ (default: the shipped mini)")
    p.add_argument("--size", default="33x256x256", help="FRAMESxHEIGHTxWIDTH of the clips (default 33x256x256)")
    p.add_argument("--clips", type=int, default=16, help="clips per encode (the corpus's encode_batch: 16)")
    p.add_argument("--variants", default="all", help=f"comma-separated, from {', '.join(VARIANTS)} (default: all)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    variants = list(VARIANTS) if args.variants == "all" else args.variants.split(",")
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        p.error(f"--variants: unknown {', '.join(bad)}; choose from {', '.join(VARIANTS)}")
    try:
        frames, height, width = (int(x) for x in args.size.lower().split("x"))
    except ValueError:
        p.error(f"--size {args.size!r}: FRAMESxHEIGHTxWIDTH, e.g. 33x256x256")
    if args.device == "cpu" and "bf16_weights" in variants:  # encode_video autocasts on CUDA only: bf16 weights need it
        if args.variants != "all":
            p.error("--variants bf16_weights needs a CUDA device (the encode autocasts to bf16 there only)")
        variants.remove("bf16_weights")
    variants = ["default"] + [v for v in variants if v != "default"]  # the reference the others are compared with
    variants.append("default")  # once more: the device's own run-to-run spread

    device = torch.device(args.device)
    src = CorpusSource(args.model, CorpusConfig(sizes=[[frames, height, width]]), text_len=16, device=device,
                       prefetch=False)
    corpus = src.corpora["train"]
    video = corpus.render([corpus.spec(j) for j in range(args.clips)], frames=frames, height=height, width=width,
                          device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "size": [frames, height, width], "clips": args.clips, "variants": {}}
    reference = None
    for n, name in enumerate(variants):
        with _variant(src, name):
            times = []
            for i in range(args.warmup + args.repeats):
                sync()
                t0 = time.perf_counter()
                z = src.encode_video(video)
                sync()
                if i >= args.warmup:
                    times.append(time.perf_counter() - t0)
        if reference is None:
            reference = z
        spread = reference.float().pow(2).mean().sqrt()
        row = {"median_ms": 1e3 * statistics.median(times),
               "max_diff_over_rms": float((z.float() - reference.float()).abs().max() / spread)}
        name = "default_again" if n and name == "default" else name
        result["variants"][name] = row
        print(f"{name:14s} {row['median_ms']:8.1f} ms   latents: max |diff| / rms {row['max_diff_over_rms']:.2e}",
              flush=True)
    if args.json:
        from attnqat.outputs import write_file_atomically

        write_file_atomically(args.json, lambda tmp: tmp.write_text(json.dumps(result, indent=1)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
