"""A job's parameters into one safetensors file under the model's own names: ``export``
from live servers, and the streaming writer offline export shares (``write_safetensors``).

Export streams: the safetensors header is computed from the manifest first, then each
parameter is pulled and written in turn, so memory stays about one parameter.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from paramshard.client.jobs import live_params
from paramshard.client.shard_client import ShardClient
from paramshard.client.tensor_parts import WholeParam
from paramshard.protos import codec
from paramshard.protos.atomic import atomic_write

__all__ = ["export", "export_dtype", "whole_items", "write_safetensors"]

_ST_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64"}


def write_safetensors(
    path: str | os.PathLike,
    items: Iterable[tuple[str, str, tuple[int, ...], Callable[[], np.ndarray]]],
    metadata: dict[str, str] | None = None,
) -> None:
    """Streams tensors into a safetensors file: (name, dtype, shape, produce float values).

    The header (names, dtypes, shapes, offsets) is written first from the shapes alone, then
    each tensor's bytes as it is produced: memory stays about one tensor.
    """
    items = list(items)
    header: dict[str, Any] = {"__metadata__": metadata or {}}
    offset = 0
    for name, dtype, shape, _ in items:
        size = math.prod(shape) * (
            2 if dtype in ("float16", "bfloat16") else 8 if dtype == "float64" else 4
        )
        header[name] = {
            "dtype": _ST_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with atomic_write(path) as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for name, dtype, shape, produce in items:
            values = produce()
            if values.size != math.prod(shape):  # the header promised that many
                raise RuntimeError(f"'{name}': got {values.size} values for shape {list(shape)}")
            if dtype == "bfloat16":
                raw = codec.f32_to_bf16_bits(values)
            else:
                raw = values.astype(codec.numpy_dtype(codec.wire_dtype(dtype)))
            f.write(raw.tobytes())
            del values, raw


def export_dtype(dtype: str) -> str:
    """The dtype a parameter is exported in: its own, or float32 where safetensors has none."""
    return dtype if dtype in _ST_DTYPES else "float32"


def whole_items(
    params: Iterable[WholeParam], aliases: bool = True
) -> list[tuple[str, str, tuple, Callable[[], np.ndarray]]]:
    """``write_safetensors`` items of whole parameters: each once per name it has (tied
    weights under every name; with ``aliases`` False, under its first name only)."""
    return [
        (each, export_dtype(w.dtype), w.shape, w.produce)
        for w in params
        for each in ((w.name, *w.aliases) if aliases else (w.name,))
    ]


def export(client: ShardClient, job: str, out: str | os.PathLike) -> int:
    """The job's full state dict from live servers into one safetensors file, under the
    model's own names; returns the number of tensors. Consistent when training is paused;
    while it runs, snapshot first and export the snapshot.

    Of a 3D job's base name: the whole model, each tensor joined from its parts (tensor
    rank 0's copy of a replicated one), every stage; one whole tensor in memory at a time."""
    params, jobs = live_params(client, job)
    items = whole_items(params)
    meta = {"job": job, "version": str(max((p.version for p in params), default=0))}
    if jobs != [job]:
        meta["parts"] = ",".join(jobs)
    write_safetensors(out, items, meta)
    return len(items)
