"""Replicas being received, chunk by chunk (docs/design.md §5.2, §6.2): bounded, checked, expiring.

A replica arrives as chunks ``[offset, offset + len(data))`` of a blob of ``total`` bytes. Nothing
is allocated for ``total`` up front: the chunks are kept as they come, so memory follows the bytes
actually received, and the caller bounds ``total`` before any chunk is kept (``replica_bound``:
the registered size of the job). A replica is complete when its chunks cover every byte exactly
once; a chunk overlapping one already received is refused (INVALID_ARGUMENT), as is one whose
``total`` disagrees with the first chunk's. An incomplete replica that gets no chunk for
``ttl_s`` seconds is dropped, and each source keeps at most ``MAX_PENDING`` incomplete versions
(a newer one pushes the oldest out: its sender has moved on). Every byte kept is paid for from
the server's ``MemoryBudget`` (kind ``replicas``) before it is kept; a complete replica's bytes
stay reserved for its blob, which the caller keeps (or releases).
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from paramshard.protos import shard_pb2 as pb
from paramshard.protos import slicing
from paramshard.server.runtime.errors import ShardError, reason
from paramshard.server.runtime.limits import MemoryBudget
from paramshard.server.snapshots.shards import Parts

__all__ = ["Inbox", "replica_bound", "memory_bound", "check_header", "MAX_PENDING"]

MAX_PENDING = 2  # incomplete versions kept per (kind, job, source)
_SLACK = 64 * 2**10  # the safetensors header's fixed part and its JSON metadata
_PER_ARRAY = 1024  # one tensor's entry in the header
_PER_BUFFER = 2048  # one buffer's layout in the metadata, besides its spec


def replica_bound(slices: list[Any], source_index: int) -> int:
    """The most bytes a replica of server ``source_index``'s slices of this job can take: what
    its params and every optimizer-state array its optimizer may have come to, in the master
    dtype, as one safetensors blob with its header. ``slices``: the job's buffers here (the same
    buffers, specs and optimizers on every server; only the slice bounds differ)."""
    total = _SLACK
    for b in slices:
        spec = b.spec
        start, stop = slicing.slice_bounds(spec.numel, spec.num_servers, source_index)
        arrays = 1 + len(b.optimizer.state_names)
        total += (stop - start) * b.dtype.itemsize * arrays + arrays * _PER_ARRAY
        total += 2 * spec.ByteSize() + 4 * len(b.name) + _PER_BUFFER  # base64 spec, in JSON
    return total


def memory_bound() -> int:
    """This host's memory: no replica is larger, whatever else is known."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError):
        return 2**40


def check_header(blob: bytes | Parts, chunk: pb.ReplicaChunk, what: str) -> None:
    """The replica's own metadata names the job, source and version its chunks claimed."""
    try:
        size = int.from_bytes(blob[:8], "little")
        header = json.loads(blob[8 : 8 + size])
        meta = json.loads(header["__metadata__"]["paramshard"])
        said = (meta["job"], meta["server_index"], meta["version"])
    except (ValueError, KeyError, TypeError, RecursionError) as exc:  # nested past the limit
        raise ShardError.invalid(f"{what}: not a paramshard replica ({reason(exc)})") from None
    if said != (chunk.job, chunk.source_index, chunk.version):
        raise ShardError.invalid(
            f"{what}: the replica itself holds job '{said[0]}' from server {said[1]} at v{said[2]}"
        )


@dataclass
class _Incoming:
    total: int
    chunks: slicing.Coverage = field(default_factory=slicing.Coverage)
    data: dict[int, bytes] = field(default_factory=dict)
    touched: float = field(default_factory=time.monotonic)

    def check(self, offset: int, size: int, what: str) -> None:
        clash = self.chunks.clash(offset, size)
        if clash is not None:
            raise ShardError.invalid(
                f"{what}: chunk [{offset:,}, {offset + size:,}) overlaps the chunk"
                f" [{clash[0]:,}, {clash[1]:,}) received already; each byte is sent once"
            )

    def add(self, offset: int, data: bytes, what: str) -> None:
        self.check(offset, len(data), what)
        self.chunks.add(offset, len(data))
        self.data[offset] = data
        self.touched = time.monotonic()

    @property
    def covered(self) -> int:
        return self.chunks.covered

    def blob(self) -> Parts:
        return Parts([self.data[s] for s in self.chunks.starts])


class Inbox:
    """Incomplete replicas by (kind, job, source index, version); thread-safe."""

    def __init__(self, ttl_s: float = 300.0, budget: MemoryBudget | None = None) -> None:
        self.ttl_s = ttl_s
        self.budget = budget or MemoryBudget()
        self._lock = threading.Lock()
        self._incoming: dict[tuple[str, str, int, int], _Incoming] = {}

    def add(
        self,
        kind: str,
        chunk: pb.ReplicaChunk,
        data: bytes,
        bound: int,
        what: str,
        quota: int = 0,
    ) -> Parts | None:
        """Keeps ``data``, the bytes of ``chunk`` (which carries their place: the server
        takes them out of the message or the caller's segment once, and they are kept as
        they are); the whole replica once every byte is in, else None. A chunk that
        is here already, the same bytes at the same offset, changes nothing (before, it was
        refused as an overlap: a recovery whose rank died after its first LoadReplica could
        not be done again until the partial replica expired). ``bound``: the most bytes this
        replica may have; ``quota`` (0: none): the most bytes all incomplete replicas of its
        kind and job may claim together; ``what`` names it in errors. The returned blob's
        bytes are still reserved in the budget: the caller keeps them or releases them."""
        total, offset, size = chunk.total, chunk.offset, len(data)
        if total > bound:
            raise ShardError.exhausted(
                f"{what} claims {total:,} bytes; at most {bound:,} are accepted for it here"
            )
        if size == 0:
            raise ShardError.invalid(f"{what}: a chunk at offset {offset:,} carries no bytes")
        if offset + size > total:
            raise ShardError.invalid(
                f"{what}: chunk [{offset:,}, {offset + size:,}) is past its {total:,} bytes"
            )
        key = (kind, chunk.job, chunk.source_index, chunk.version)
        self.sweep()
        with self._lock:
            entry = self._incoming.get(key)
            if entry is not None and entry.total != total:
                raise ShardError.invalid(
                    f"{what}: this chunk says the replica has {total:,} bytes, its first chunk"
                    f" said {entry.total:,}"
                )
            if entry is not None and entry.data.get(offset) == data:
                entry.touched = time.monotonic()  # sent again (a retry, a recovery asked
                return None  # again after its caller died): already here
            if entry is not None:
                entry.check(offset, size, what)
            elif quota:
                self._check_quota(key, total, quota, what)
            self.budget.reserve(size, "replicas", what)
            if entry is None:
                entry = _Incoming(total)
                self._make_room(key)
                self._incoming[key] = entry
            entry.add(offset, data, what)
            if entry.covered < total:
                return None
            del self._incoming[key]
        return entry.blob()  # its chunks as they came, not joined (a copy of the whole)

    def _check_quota(
        self, key: tuple[str, str, int, int], total: int, quota: int, what: str
    ) -> None:
        """Under the lock: a new replica of ``total`` bytes fits ``quota`` beside the other
        incomplete ones of its kind and job (those it would push out of its source's last
        ``MAX_PENDING`` not counted). Before, a job not on this server took up to
        ``MAX_PENDING`` incomplete loads from every source index, each up to its quota."""
        gone = set(self._pushed_out(key))
        claimed = sum(
            e.total for k, e in self._incoming.items() if k[:2] == key[:2] and k not in gone
        )
        if claimed + total > quota:
            raise ShardError.exhausted(
                f"{what}: the incomplete replicas of job '{key[1]}' being loaded here claim"
                f" {claimed:,} bytes; with this one's {total:,} they would pass the job's quota"
                f" of {quota:,} (--max-job-gb)"
            )

    def _pushed_out(self, key: tuple[str, str, int, int]) -> list[tuple[str, str, int, int]]:
        """Under the lock: the incomplete versions of ``key``'s source that a new one pushes
        out, the oldest past its last ``MAX_PENDING``."""
        same = sorted((k for k in self._incoming if k[:3] == key[:3]), key=self._touched)
        return same[: max(0, len(same) - MAX_PENDING + 1)]

    def _touched(self, key: tuple[str, str, int, int]) -> float:
        return self._incoming[key].touched

    def _make_room(self, key: tuple[str, str, int, int]) -> None:
        """Under the lock: drops the oldest incomplete versions of ``key``'s source."""
        for k in self._pushed_out(key):
            self._discard(k)

    def _discard(self, key: tuple[str, str, int, int]) -> None:
        """Under the lock: forgets an incomplete replica and gives back its bytes."""
        self.budget.release(self._incoming.pop(key).covered, "replicas")

    def sweep(self) -> None:
        """Drops incomplete replicas that got no chunk for ``ttl_s`` seconds."""
        limit = time.monotonic() - self.ttl_s
        with self._lock:
            for k in [k for k, e in self._incoming.items() if e.touched < limit]:
                self._discard(k)

    def drop(self, job: str) -> bool:
        """Discards ``job``'s incomplete replicas; whether there were any."""
        with self._lock:
            keys = [k for k in self._incoming if k[1] == job]
            for k in keys:
                self._discard(k)
        return bool(keys)

    def pending(self) -> dict[tuple[str, str, int, int], tuple[int, int]]:
        """(bytes received, total) of every incomplete replica."""
        with self._lock:
            return {k: (e.covered, e.total) for k, e in self._incoming.items()}
