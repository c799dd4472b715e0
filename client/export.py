"""A job's parameters into one safetensors file under the model's own names: ``export``
from live servers, and the streaming writer offline export shares (``write_safetensors``).

Export streams: the safetensors header is computed from the manifest first, then each
parameter is pulled and written in turn, so memory stays about one parameter.

A live export is of one version (docs/design.md §3.3) or not written at all
(``one_version``): the header, written first, records the version Status reports, and every
pull's reply says the version its values are of. A step that lands between two pulls (training
runs) makes a tensor of another version: the attempt is dropped (``atomic_write``: no file)
and made again, a few times, then refused with what to do instead.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any, TypeVar

import numpy as np

from paramshard.client.jobs import LiveParam, live_params
from paramshard.client.shard_client import ShardClient
from paramshard.client.tensor_parts import WholeParam
from paramshard.protos import codec
from paramshard.protos.atomic import atomic_write

__all__ = [
    "ATTEMPTS",
    "VersionChangedError",
    "export",
    "export_dtype",
    "one_version",
    "whole_items",
    "write_safetensors",
]

ATTEMPTS = 3
"""Live export attempts before a job whose version keeps moving is refused."""

T = TypeVar("T")

_ST_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64"}


def write_safetensors(
    path: str | os.PathLike,
    items: Iterable[tuple[str, str, tuple[int, ...], Callable[[], np.ndarray]]],
    metadata: dict[str, str] | None = None,
) -> None:
    """Streams tensors into a safetensors file: (name, dtype, shape, produce float values).

    The header (names, dtypes, shapes, offsets) is written first from the shapes alone, then
    each tensor's bytes as it is produced: memory stays about one tensor. A name given twice,
    or ``__metadata__``, would make a file safetensors cannot load: RuntimeError, nothing
    written.
    """
    items = list(items)
    seen: set[str] = set()
    for name, *_ in items:  # the names are a Status's or a manifest's: one entry each
        if name == "__metadata__" or name in seen:
            why = "the file's own key" if name == "__metadata__" else "named twice"
            raise RuntimeError(f"parameter {name[:256]!r} cannot be exported: {why}")
        seen.add(name)
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
            else:  # no copy where the dtype is already the file's (float32, float64)
                raw = values.astype(codec.numpy_dtype(codec.wire_dtype(dtype)), copy=False)
            del values  # a converted copy is all that is left: one tensor, not two
            # the array's own bytes, little-endian as safetensors stores them: no bytes copy
            raw = np.ascontiguousarray(raw, raw.dtype.newbyteorder("<")).reshape(-1)
            f.write(memoryview(raw).cast("B"))
            del raw


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


class VersionChangedError(RuntimeError):
    """A live export kept finding tensors of another version than the one it records:
    training stepped while it ran."""


class _Moved(Exception):
    """One attempt's tensor is of another version (caught by ``one_version``)."""


def _checked(p: LiveParam, seen: list[int], version: int) -> Callable[[], Any]:
    """``p.produce``, refusing values whose pulls (``seen``) were not all of ``version``."""

    def produce() -> Any:
        seen.clear()
        values = p.produce()
        other = sorted(set(seen) - {version})
        if other:
            got = " and ".join(map(str, sorted(set(seen))))
            raise _Moved(f"'{p.name}' came back at version {got}, the export's is {version}")
        return values

    return produce


def one_version(
    client: ShardClient,
    job: str,
    write: Callable[[list[LiveParam], list[str], dict[str, str]], T],
    attempts: int = ATTEMPTS,
) -> T:
    """``write(params, jobs, metadata)`` of ``job``'s live parameters (``live_params``) with
    metadata ``{"job", "version"[, "parts"]}``, where every tensor ``write`` produces is of
    that version. ``write`` must leave nothing when a producer raises (``atomic_write``).

    The version is the newest Status reports; a tensor whose pull came back at another one (a
    step applied between two pulls, or a step half applied when Status answered) drops the
    attempt and starts another, with a new Status. After ``attempts``, VersionChangedError:
    a running job is exported from a snapshot (the servers capture every buffer at one
    version without stopping training, docs/design.md §5.1)."""
    why = ""
    for _ in range(max(1, attempts)):
        seen: list[int] = []
        params, jobs = live_params(client, job, versions=seen)
        version = max((p.version for p in params), default=0)
        meta = {"job": job, "version": str(version)}
        if jobs != [job]:
            meta["parts"] = ",".join(jobs)
        try:
            return write(
                [replace(p, produce=_checked(p, seen, version)) for p in params], jobs, meta
            )
        except _Moved as exc:
            why = str(exc)
    raise VersionChangedError(
        f"job '{job}' changed version while it was exported, {attempts} times (last: {why}):"
        " training is running, and a live export is of one version or nothing. Nothing was"
        " written. Pause training and export again, or take a snapshot (paramshard snapshot"
        f" {job} --tag TAG) and export that (paramshard export --snapshot"
        f" <snapshot-dir>/{job}/TAG, with --out FILE or --hf-dir DIR)"
    )


def export(client: ShardClient, job: str, out: str | os.PathLike) -> int:
    """The job's full state dict from live servers into one safetensors file, under the
    model's own names; returns the number of tensors. Every tensor is of the version the
    metadata records (``one_version``): while training runs, VersionChangedError unless an
    attempt fits between two steps; snapshot first and export the snapshot instead.

    Of a 3D job's base name: the whole model, each tensor joined from its parts (tensor
    rank 0's copy of a replicated one), every stage; one whole tensor in memory at a time."""

    def write(params: list[LiveParam], jobs: list[str], meta: dict[str, str]) -> int:
        items = whole_items(params)
        write_safetensors(out, items, meta)
        return len(items)

    return one_version(client, job, write)
