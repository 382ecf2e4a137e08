"""attnqat.train.shard_writer: DCP's safetensors shard, written a piece at a time. The file must read back as the
one torch's own HuggingFaceStorageWriter writes (safetensors and DCP's HuggingFaceStorageReader), and the writer
must never hold more than the piece it is writing (torch's held the whole part, three times: a 14B save on two
H200s ran the host out of memory)."""
from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from attnqat.train import shard_writer
from attnqat.train.shard_writer import StreamingShardWriter


def state(strided: bool = True) -> dict[str, torch.Tensor]:
    """Every dtype a training state holds, NaN, a 0-dim and an empty tensor, and (``strided``) a transposed view,
    which torch's writer refuses (safetensors saves contiguous tensors only) and ours copies."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 5, generator=g)
    w[2, 3] = float("nan")
    return {
        "model/w": w,
        "model/half": torch.randn(3, 7, generator=g).bfloat16(),
        "model/transposed": torch.randn(4, 9, generator=g).t() if strided else torch.randn(9, 4, generator=g),
        "optimizer/w/codes": torch.randint(0, 256, (6, 5), generator=g, dtype=torch.uint8),
        "optimizer/w/step": torch.tensor(7.0),  # 0-dim
        "optimizer/w/count": torch.tensor([3, -2], dtype=torch.int64),
        "optimizer/w/none": torch.empty(0, 4),
    }


def save(folder, writer, strided=True, **kw):
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.save(state(strided), storage_writer=writer, **kw)
    files = sorted(folder.glob("*.safetensors"))
    assert len(files) == 1, files
    with safe_open(str(files[0]), framework="pt") as f:
        meta = f.metadata()
        return files[0].name, {k: f.get_tensor(k) for k in f.keys()}, meta


def test_the_file_is_what_torchs_writer_writes_and_loads_back(tmp_path):
    ours_name, ours, ours_meta = save(tmp_path / "ours", StreamingShardWriter(tmp_path / "ours"))
    theirs_name, theirs, theirs_meta = save(tmp_path / "theirs", dcp.HuggingFaceStorageWriter(
        str(tmp_path / "theirs"), save_distributed=True), strided=False)
    assert ours_name == theirs_name
    assert ours.keys() == theirs.keys() == state().keys()
    for key, want in state().items():
        assert ours[key].dtype == want.dtype and ours[key].shape == want.shape
        assert torch.equal(ours[key].nan_to_num(), want.nan_to_num()) and torch.equal(ours[key].isnan(), want.isnan())
        if key != "model/transposed":
            assert torch.equal(ours[key].nan_to_num(), theirs[key].nan_to_num())
    assert ours_meta.keys() == theirs_meta.keys()
    for key in ours_meta:
        parse = json.loads if key == shard_writer.CUSTOM_METADATA_KEY else str
        assert parse(ours_meta[key]) == parse(theirs_meta[key]), key

    back = {k: torch.full_like(v, 123) for k, v in state().items()}  # poisoned
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        dcp.load(back, storage_reader=dcp.HuggingFaceStorageReader(str(tmp_path / "ours")))
    for key, want in state().items():
        assert torch.equal(back[key].nan_to_num(), want.nan_to_num()) and torch.equal(back[key].isnan(), want.isnan())


def test_each_piece_is_written_before_the_next_is_fetched(tmp_path, monkeypatch):
    events = []

    class Planner(DefaultSavePlanner):
        def resolve_data(self, item):
            events.append("fetch")
            return super().resolve_data(item)

    real = shard_writer.write_piece
    monkeypatch.setattr(shard_writer, "write_piece", lambda *a: (events.append("write"), real(*a)))
    save(tmp_path, StreamingShardWriter(tmp_path), planner=Planner())
    assert events == ["fetch", "write"] * len(state())


def test_a_dtype_the_reader_cannot_map_is_refused_by_name(tmp_path):
    with pytest.raises(CheckpointException) as caught:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
            dcp.save({"model/flags": torch.ones(3, dtype=torch.bool)}, storage_writer=StreamingShardWriter(tmp_path))
    (error, _), = caught.value.failures.values()
    assert isinstance(error, TypeError) and str(error).startswith("model/flags: torch.bool is not a dtype")
    assert not list(tmp_path.glob("*.safetensors"))
