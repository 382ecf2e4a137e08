"""DCP's safetensors shard writer, streamed: each process writes its part of the training state one piece at a time.

torch's ``HuggingFaceStorageWriter`` (2.11 to 2.13) copies every tensor of a process's part to host memory, then has
safetensors build the whole file as one bytes object and writes that: about three copies of the part in host memory
at once. The whole Wan 14B's training state on two H200s is 43 GB a process; during its save the host's used
memory rose from 33 to 251 GiB and the kernel killed a rank (a 256 GiB host). Here the file's header is made from
the write plan first (DCP's plan knows every piece's dtype, shape and place in its whole tensor before any byte
moves), then each piece is copied to the host and written in turn: one piece in host memory at a time (Wan 14B's
largest, an FFN weight in fp32, 283 MB).

The file is the one torch's writer makes, as DCP's ``HuggingFaceStorageReader`` reads it: a safetensors file
``shard-0000R-model-00001-of-00001.safetensors`` whose metadata holds each piece's offsets in its whole tensor
(``DCP_SHARDING_INFO``), DCP's version and the format; the tensors' order in it may differ, which safetensors
does not care about. The checkpoint's old-or-new guarantee is the caller's: it writes into a ``.tmp`` folder.
"""
from __future__ import annotations

import json
import math
import os
import struct

import torch
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint._hf_utils import (CUSTOM_METADATA_KEY, DCP_VERSION_KEY, DTYPE_MAP, FORMAT_KEY,
                                                     FORMAT_VALUE, HF_DCP_VERSION, SAVED_OFFSETS_KEY, _gen_file_name)
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

# the dtypes DCP's reader maps back (its own table), by safetensors' names
SAFETENSORS_DTYPES = {dtype: name for name, dtype in DTYPE_MAP.items()}


class StreamingShardWriter(HuggingFaceStorageWriter):
    """``HuggingFaceStorageWriter(path, save_distributed=True)`` whose :meth:`write_data` streams: the header from
    the plan, then each piece resolved, copied to the host and written before the next is resolved."""

    def __init__(self, path: str | os.PathLike) -> None:
        super().__init__(str(path), save_distributed=True)

    def write_data(self, plan, planner) -> Future:
        items = plan.items
        done: Future = Future()
        if not items:
            done.set_result([])
            return done
        name = _gen_file_name(1, 1, plan.storage_data["shard_index"])
        header, places = shard_header(items)
        results = []
        with open(os.path.join(str(self.path), name), "wb") as f:
            f.write(struct.pack("<Q", len(header)))
            f.write(header)
            for item in items:
                begin, length = places[item.index.fqn]
                write_piece(f, planner.resolve_data(item), item)
                results.append(WriteResult(index=item.index, size_in_bytes=length,
                                           storage_data=_StorageInfo(name, 8 + len(header) + begin, length)))
            f.flush()
            os.fsync(f.fileno())
        done.set_result(results)
        return done


def shard_header(items) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """The safetensors header of a shard holding ``items`` (DCP write items of tensors) laid out in their order,
    padded to 8 bytes; and each piece's (start, length) in the data that follows."""
    tensors, offsets, places, begin = {}, {}, {}, 0
    for item in items:
        if item.type == WriteItemType.BYTE_IO:  # DCP's bytes entries: a training state holds only tensors
            raise TypeError(f"{item.index.fqn}: not a tensor; a sharded training state holds tensors only")
        dtype, chunk = item.tensor_data.properties.dtype, item.tensor_data.chunk
        if dtype not in SAFETENSORS_DTYPES:
            raise TypeError(f"{item.index.fqn}: {dtype} is not a dtype DCP's safetensors reader reads "
                            f"({', '.join(map(str, SAFETENSORS_DTYPES))})")
        length = math.prod(chunk.sizes) * dtype.itemsize
        fqn = item.index.fqn
        tensors[fqn] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(chunk.sizes),
                        "data_offsets": [begin, begin + length]}
        offsets[fqn] = {SAVED_OFFSETS_KEY: list(chunk.offsets)}
        places[fqn] = (begin, length)
        begin += length
    metadata = {CUSTOM_METADATA_KEY: json.dumps(offsets), DCP_VERSION_KEY: str(HF_DCP_VERSION),
                FORMAT_KEY: FORMAT_VALUE}
    header = json.dumps({"__metadata__": metadata, **tensors}, separators=(",", ":")).encode()
    return header + b" " * (-len(header) % 8), places


def write_piece(f, tensor: torch.Tensor, item) -> None:
    """``tensor``'s bytes (the piece ``item`` planned: its dtype and shape checked) to ``f``, through one host
    copy of it at most."""
    chunk = item.tensor_data.chunk
    if tensor.dtype != item.tensor_data.properties.dtype or tuple(tensor.shape) != tuple(chunk.sizes):
        raise ValueError(f"{item.index.fqn}: the planned piece is {item.tensor_data.properties.dtype} "
                         f"{tuple(chunk.sizes)}, the state holds {tensor.dtype} {tuple(tensor.shape)}")
    host = tensor.detach().contiguous().cpu()
    f.write(host.reshape(-1).view(torch.uint8).numpy().data)
