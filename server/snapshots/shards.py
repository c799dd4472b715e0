"""A shard file: one server's slices of a job at one version, as safetensors bytes
(``<buffer>::params`` and ``<buffer>::state.<name>`` tensors, the layout in the ``paramshard``
metadata). Snapshots (``files``) write and read them on disk, checking first that a folder's
shards are those a manifest names (``check_shards_here``, ``check_held``); neighbour replicas
(server/replication/) send them over the wire."""

from __future__ import annotations

import base64
import bisect
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import load as st_load

from paramshard.protos import slicing
from paramshard.server.runtime.errors import ShardError, reason
from paramshard.server.runtime.request_bounds import count_of
from paramshard.server.snapshots.folders import Folder

__all__ = [
    "Captured",
    "Parts",
    "check_held",
    "check_shards_here",
    "decode_shard",
    "array_bytes",
    "encode_shard",
    "shard_files",
    "shard_meta",
    "shard_parts",
    "shard_version",
    "st_dtype",
    "tensor_key",
]


@dataclass
class Captured:
    """One buffer slice as it was at the snapshot's version (host copies)."""

    buffer: str
    slice_start: int
    params: np.ndarray
    state: dict[str, np.ndarray]
    step_count: int


def tensor_key(buffer: str, kind: str) -> str:
    return f"{buffer}::{kind}"


def shard_meta(folder: Folder, name: str) -> dict[str, Any]:
    """The ``paramshard`` metadata of shard file ``name`` of ``folder``."""
    try:
        with folder.path_of(name) as path, safe_open(path, framework="numpy") as f:
            meta = json.loads(f.metadata()["paramshard"])
        if not isinstance(meta, dict):
            raise ValueError("its metadata is not an object")
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, SafetensorError) as exc:
        raise ShardError.precondition(  # SafetensorError is no ValueError: a lying header
            f"{folder.name(name)}: not a paramshard shard ({reason(exc)})"  # ended INTERNAL
        ) from None
    return meta


_ST_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "int64": "I64", "int32": "I32"}


def st_dtype(dtype: np.dtype) -> str:
    """How safetensors names ``dtype`` in a shard's header."""
    return _ST_DTYPES[np.dtype(dtype).name]


def shard_parts(
    job: str,
    tag: str,
    index: int,
    num: int,
    version: int,
    captured: list[Captured],
    specs: dict[str, bytes] | None = None,
) -> tuple[bytes, list[np.ndarray]]:
    """A shard file as (its safetensors head: length and header, its arrays in file order):
    ``<buffer>::params`` and ``<buffer>::state.<name>`` tensors, layout in the ``paramshard``
    metadata. ``specs`` (buffer -> serialised RegisterBufferRequest) makes the shard loadable
    on its own, as a neighbour replica is (a snapshot's manifest holds that instead).

    The caller writes the head, then each array's bytes as they are: nothing is copied here.
    (safetensors' own ``save`` took three copies of a shard's bytes at once, tobytes, its
    buffer and the returned bytes: GPT-2 124M's 712 MB shard held 2.1 GB more while a
    snapshot was written, docs/security.md's sixteenth round.)"""
    tensors: dict[str, np.ndarray] = {}
    layout = {}
    for c in captured:
        tensors[tensor_key(c.buffer, "params")] = c.params
        for name, arr in c.state.items():
            tensors[tensor_key(c.buffer, f"state.{name}")] = arr
        layout[c.buffer] = {
            "slice_start": c.slice_start,
            "slice_numel": int(c.params.size),
            "step_count": c.step_count,
            "state": sorted(c.state),
        }
        if specs is not None:
            layout[c.buffer]["spec"] = base64.b64encode(specs[c.buffer]).decode()
    meta = {
        "job": job,
        "tag": tag,
        "version": version,
        "server_index": index,
        "num_servers": num,
        "buffers": layout,
    }
    header: dict[str, Any] = {"__metadata__": {"paramshard": json.dumps(meta)}}
    # widest elements first, as safetensors orders them: every array starts aligned
    names = sorted(tensors, key=lambda k: (-tensors[k].dtype.itemsize, k))
    arrays, offset = [], 0
    for name in names:
        arr = np.ascontiguousarray(tensors[name])
        header[name] = {
            "dtype": _ST_DTYPES[arr.dtype.name],
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + arr.nbytes],
        }
        offset += arr.nbytes
        arrays.append(arr)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    return len(head).to_bytes(8, "little") + head, arrays


def array_bytes(arr: np.ndarray) -> memoryview:
    """``arr``'s bytes without a copy (it is contiguous: ``shard_parts``)."""
    return memoryview(arr).cast("B") if arr.size else memoryview(b"")


def encode_shard(
    job: str,
    tag: str,
    index: int,
    num: int,
    version: int,
    captured: list[Captured],
    specs: dict[str, bytes] | None = None,
) -> bytes:
    """One server's slices as safetensors bytes (``shard_parts``), in one copy."""
    head, arrays = shard_parts(job, tag, index, num, version, captured, specs)
    return b"".join([head, *map(array_bytes, arrays)])


_MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own bound on a header


def shard_version(folder: Folder, name: str) -> int | None:
    """The version shard file ``name`` holds (its header only), None when it cannot be read."""
    try:
        with os.fdopen(folder.open(name), "rb") as f:
            size = int.from_bytes(f.read(8), "little")  # safetensors: the header's length
            header = json.loads(f.read(min(size, _MAX_HEADER_BYTES)))
        version = json.loads(header["__metadata__"]["paramshard"])["version"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:  # JSON's true was taken for 1, and -1 or 2**64 made a listing's reply fail
        return count_of(version, "version")
    except ValueError:
        return None


class Parts:
    """Bytes made of parts, read without joining them: a replica kept as it was made (its
    head and the arrays of the copy, ``shard_parts``) or as it came (its chunks). Joining took
    one more copy of a server's whole state for every replica sent and every one received
    (GPT-2 124M: 712 MB each, a step, with ``replicate_every=1``)."""

    def __init__(self, parts: list[Any]) -> None:
        self._parts = [memoryview(p).cast("B") if len(p) else memoryview(b"") for p in parts]
        self._starts = [0]
        for part in self._parts:
            self._starts.append(self._starts[-1] + len(part))

    def __len__(self) -> int:
        return self._starts[-1]

    def view(self, start: int, stop: int) -> memoryview | bytes:
        """Bytes [start, stop) (clipped to the end): a view of the part holding them all,
        else joined from the parts they span."""
        start, stop = max(0, start), min(stop, len(self))
        if start >= stop:
            return b""
        first = bisect.bisect_right(self._starts, start) - 1
        last = bisect.bisect_left(self._starts, stop) - 1
        if first == last:
            lo = self._starts[first]
            return self._parts[first][start - lo : stop - lo]
        pieces = []
        for i in range(first, last + 1):
            lo = self._starts[i]
            pieces.append(self._parts[i][max(start, lo) - lo : min(stop, self._starts[i + 1]) - lo])
        return b"".join(pieces)

    def __getitem__(self, key: slice) -> bytes:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("Parts take a slice")
        start, stop, _ = key.indices(len(self))
        return bytes(self.view(start, stop))

    def joined(self) -> bytes:
        return b"".join(self._parts)


def decode_shard(data: bytes | Parts) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(metadata, tensors) of ``encode_shard`` bytes (``Parts`` are joined first: a replica
    is decoded only to be loaded, and safetensors checks the whole of it)."""
    if isinstance(data, Parts):
        data = data.joined()
    try:
        tensors = st_load(data)
        header_len = int.from_bytes(data[:8], "little")
        meta = json.loads(json.loads(data[8 : 8 + header_len])["__metadata__"]["paramshard"])
    except Exception as exc:  # safetensors raises its own error types
        raise ShardError.invalid(f"not a paramshard shard ({exc})") from None
    return meta, tensors


def check_held(shape: list[int], numel: int, num: int, index: int) -> None:
    """A shard's tensor is slice ``index`` of ``num`` of a buffer of ``numel`` elements, as
    the manifest (a caller's file: CommitSnapshot) says the buffer is."""
    lo, hi = slicing.slice_bounds(numel, num, index)
    if shape != [hi - lo]:
        raise ValueError(
            f"it holds a tensor of shape {shape[:4]}, the manifest's {numel:,} elements make"
            f" slice {index} of {num} {hi - lo:,} long"
        )


def shard_files(manifest: dict[str, Any]) -> list[str]:
    """The shard files a manifest names (their names in the snapshot's folder)."""
    return [Path(shard["file"]).name for shard in manifest["shards"]]


def check_shards_here(folder: Folder, manifest: dict[str, Any], where: str) -> None:
    """FAILED_PRECONDITION unless every shard ``manifest`` names is a file of its size and
    version in ``folder``. A restore reads every shard, so the servers of a job must share
    one snapshot folder; where their ``--snapshot-dir``s are separate folders each holds its
    own shard only, and a manifest committed there would name files no server can read whole.
    A shard of another version is one a second Snapshot under the same tag wrote over this
    one's (``reserve`` replaces a shard it takes for an abandoned attempt). Left open: that
    second Snapshot replacing the shard between this check and the manifest's write; the
    Restore's checksums then refuse the snapshot."""
    for shard in manifest["shards"]:
        name = Path(shard["file"]).name
        kind = folder.kind(name)
        if kind == "file" and folder.size(name) == shard["bytes"]:
            held = shard_version(folder, name)
            if held == manifest["version"]:
                continue
            raise ShardError.precondition(
                f"{where}: not committed: shard {name} holds version {held}, the manifest's is"
                f" {manifest['version']}: another Snapshot under this tag replaced it while"
                " this one was being committed; snapshot again under another tag"
            )
        if kind is None:
            found = "is missing"
        elif kind == "file":
            found = f"is {folder.size(name):,} bytes"
        else:
            found = f"is a {kind}"
        raise ShardError.precondition(
            f"{where}: not committed: shard {name} of server {shard['server']}"
            f" {found} in this server's snapshot folder {folder.shown!r}"
            f" ({shard['bytes']:,} bytes written); the servers of a job must share one"
            " --snapshot-dir (a restore reads every shard), see docs/deployment.md"
        )
