"""Precomputed training data: safetensors shards of prompt embeddings (and optionally video latents).

Layout of a data folder (written by :mod:`attnqat.train.precompute`)::

    index.json                  {"num_samples", "shards": [{"file", "num"}], "text_dim", "text_len",
                                 "has_latents", "latent_shape", "model"}
    shard-00000.safetensors     prompt_embeds (N, text_len, text_dim) bf16, zero past each prompt's
                                length (as WanPipeline pads them); latents (N, C, F, H, W) fp32 if videos

Rows are read lazily (one ``safe_open`` handle per shard), so a dataset larger than memory works.

Sampling order is a function of (seed, epoch) only, and a batch is a function of the *global sample
position*: resuming at a position continues the exact sequence, on any number of processes.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from attnqat.outputs import save_safetensors

INDEX = "index.json"
SHARD_NAME = re.compile(r"shard-\d{5}\.safetensors")  # precompute's shard files


def is_precompute_output(folder: Path) -> bool:
    """Whether ``folder`` holds an earlier ``attnqat precompute`` output and nothing else: its index.json
    and shard files (the only folder precompute replaces; anything beside them is someone else's)."""
    folder = Path(folder)
    if not (folder / INDEX).is_file():
        return False
    return all(e.is_file() and (e.name == INDEX or SHARD_NAME.fullmatch(e.name)) for e in folder.iterdir())


def read_index(path: str | Path) -> dict:
    p = Path(path).expanduser()
    try:
        if not p.exists():
            raise FileNotFoundError(f"data.path {str(p)[:200]!r} does not exist; write it with `attnqat precompute`")
        if not (p / INDEX).is_file():
            raise FileNotFoundError(f"data.path {str(p)!r} has no {INDEX}; is it a folder written by `attnqat precompute`?")
        index = json.loads((p / INDEX).read_text())
    except OSError as e:
        if isinstance(e, (FileNotFoundError, PermissionError)):
            raise
        raise ValueError(f"data.path {str(p)[:200]!r} cannot be read ({e.strerror or e})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"data.path {str(p)!r}: {INDEX} is not valid JSON ({e})") from None
    if not isinstance(index, dict) or not isinstance(index.get("shards", []), list) or \
            not all(isinstance(s, dict) and isinstance(s.get("file"), str) for s in index.get("shards", [])):
        raise ValueError(f"data.path {str(p)!r}: {INDEX} is not an attnqat data index")
    missing = [s["file"] for s in index.get("shards", []) if not (p / s["file"]).is_file()]
    if missing:
        raise FileNotFoundError(f"data.path {str(p)!r}: shard {missing[0]!r} listed in {INDEX} is missing")
    if not index.get("num_samples"):
        raise ValueError(f"data.path {str(p)!r} holds no samples")
    return index


class ShardDataset:
    """Random access to the rows of a precomputed data folder."""

    def __init__(self, path: str | Path):
        from safetensors import safe_open

        self.path = Path(path).expanduser()
        self.index = read_index(self.path)
        self._handles = [safe_open(str(self.path / s["file"]), framework="pt") for s in self.index["shards"]]
        self._where: list[tuple[int, int]] = []
        for i, s in enumerate(self.index["shards"]):
            self._where += [(i, j) for j in range(s["num"])]
        self.has_latents = bool(self.index.get("has_latents"))

    def __len__(self) -> int:
        return len(self._where)

    def get(self, i: int) -> dict[str, torch.Tensor]:
        shard, row = self._where[i]
        h = self._handles[shard]
        out = {"prompt_embeds": h.get_slice("prompt_embeds")[row:row + 1][0]}
        if self.has_latents:
            out["latents"] = h.get_slice("latents")[row:row + 1][0]
        return out

    def batch(self, indices: list[int]) -> dict[str, torch.Tensor]:
        rows = [self.get(i) for i in indices]
        return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def sample_indices(n: int, seed: int, position: int, count: int) -> list[int]:
    """``count`` dataset indices starting at global sample ``position`` of the shuffled stream
    (a fresh permutation of ``range(n)`` per epoch, from ``(seed, epoch)``)."""
    out = []
    perms: dict[int, list[int]] = {}
    for p in range(position, position + count):
        epoch, k = divmod(p, n)
        if epoch not in perms:
            g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
            perms[epoch] = torch.randperm(n, generator=g).tolist()
        out.append(perms[epoch][k])
    return out


def write_shard(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """Write a safetensors file atomically (to a temporary name, then rename)."""
    import os

    tmp = path.with_name(path.name + ".tmp")
    save_safetensors(tmp, {k: v.contiguous() for k, v in tensors.items()}, metadata=metadata)
    os.replace(tmp, path)


def write_index(folder: Path, index: dict) -> None:
    import os

    tmp = folder / (INDEX + ".tmp")
    tmp.write_text(json.dumps(index, indent=2))
    os.replace(tmp, folder / INDEX)
