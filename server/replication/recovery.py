"""How a server gets its state back from replicas (server/replication/replicator.py keeps and sends
them).

A live server rolls back to a version it kept of its own (``rollback``); a restarted one reads
its replica back from its neighbour (``fetch`` there, ``load_chunk`` here) and loads it once the
chunks cover it. ``client.tools.recover_from_replicas`` picks the version and drives the calls.
"""

from __future__ import annotations

import base64
import threading
from collections import OrderedDict
from typing import Any

from google.protobuf.message import DecodeError

from paramshard.protos import shard_pb2 as pb
from paramshard.protos import slicing
from paramshard.server.buffers.slice_state import slice_bytes
from paramshard.server.buffers.spec_checks import check_spec
from paramshard.server.replication.inbox import Inbox, check_header, memory_bound, replica_bound
from paramshard.server.runtime.errors import ShardError, reason
from paramshard.server.runtime.request_bounds import count_of
from paramshard.server.snapshots.shards import Parts, decode_shard

__all__ = ["CHUNK", "ReplicaRecovery"]

CHUNK = 4 * 2**20  # bytes per replica chunk, sent or fetched


class ReplicaRecovery:
    """Replicator's recovery side: its replicas, kept and held, read back into the store."""

    store: Any  # BufferStore
    _lock: threading.Lock
    configs: dict[str, pb.ReplicationConfig]
    own: dict[str, OrderedDict[int, Parts]]
    held: dict[tuple[str, int], OrderedDict[int, Parts]]
    inbox: Inbox
    budget: Any

    def fetch(self, req: pb.FetchReplicaRequest) -> pb.ReplicaChunk:
        with self._lock:
            cfg = self.configs.get(req.job)
            if cfg is not None and cfg.server_index == req.source_index:
                blob = self.own.get(req.job, {}).get(req.version)
            else:
                blob = self.held.get((req.job, req.source_index), {}).get(req.version)
        if blob is None:
            raise ShardError.not_found(
                f"no replica of job '{req.job}' from server {req.source_index} at version"
                f" {req.version} here"
            )
        size = min(req.max_bytes or CHUNK, CHUNK)  # before: any size, the whole replica in
        # one reply, copied three times outside the account (docs/security.md 133)
        return pb.ReplicaChunk(
            job=req.job,
            source_index=req.source_index,
            version=req.version,
            offset=req.offset,
            total=len(blob),
            data=blob[req.offset : req.offset + size],
        )

    def load_chunk(self, chunk: pb.ReplicaChunk, data: bytes) -> bool:
        """A restarted server gets its own replica back, ``data`` the bytes of ``chunk``;
        loaded once whole."""
        what = f"replica of job '{chunk.job}' from server {chunk.source_index} v{chunk.version}"
        if chunk.total == 0:
            raise ShardError.invalid(f"{what}: a replica is not empty (total is 0)")
        slices = self.store.jobs().get(chunk.job)
        if slices:
            num = slices[0].spec.num_servers
            if chunk.source_index >= num:
                raise ShardError.invalid(
                    f"{what}: job '{chunk.job}' is on {num} server(s) here, slices 0..{num - 1}"
                )
            bound = replica_bound(slices, chunk.source_index)
        else:  # not here (the server restarted): this job's quota, else the host's memory
            bound = self.store.max_job_bytes or memory_bound()
        quota = self.store.max_job_bytes
        blob = self.inbox.add("load", chunk, data, bound, what, quota)
        if blob is None:
            return False
        try:  # once loaded, the slices hold what they need: the blob goes
            check_header(blob, chunk, what)
            self._restore(chunk.job, blob, "LoadReplica")
        finally:
            self.budget.release(len(blob), "replicas")  # reserved by the inbox
        return True

    def rollback(self, job: str, version: int) -> int:
        with self._lock:
            blob = self.own.get(job, {}).get(version)
        if blob is None:
            raise ShardError.not_found(f"this server has no copy of job '{job}' at v{version}")
        return self._restore(job, blob, "RollbackToReplica")

    def _restore(self, job: str, blob: Parts, method: str) -> int:
        """Swaps in job ``job`` as replica ``blob`` holds it, paying first for decoding it:
        the replica joined (safetensors checks it whole) and safetensors' copy of its
        tensors, each its size, until the slices are built. Before, those two copies were
        outside the memory account (712 MB each for a server of GPT-2 124M)."""
        decoding = 2 * len(blob)
        what = f"{method}: replica of job '{job}', decoded to be loaded"
        self.budget.reserve(decoding, "replicas", what)
        try:
            return self._load(job, blob, method)
        finally:
            self.budget.release(decoding, "replicas")

    def _load(self, job: str, blob: Parts, method: str) -> int:
        """``_restore``'s work, paid for. A replica that ``LoadReplica``
        brings may be any caller's file: its version and each buffer's spec pass the checks a
        registration does, its arrays must be the slice's size, and the slices are paid for
        before any is built."""
        from paramshard.server.buffers.store import (
            BufferSlice,  # store imports snapshots; avoid a cycle
        )

        meta, tensors = decode_shard(blob)  # joined for a moment: safetensors checks it whole
        if meta.get("job") != job:
            raise ShardError.invalid(f"replica holds job '{meta.get('job')}', not '{job}'")
        try:
            version = count_of(meta["version"], "version")
            rows = [
                (_spec(job, name, info, method), tensors[f"{name}::params"], info)
                for name, info in meta["buffers"].items()
            ]
            for spec, params, info in rows:
                state = [tensors[f"{spec.ref.buffer}::state.{k}"] for k in info["state"]]
                _check_sizes(spec, params, state)
                count_of(info["step_count"], f"buffer '{spec.ref.buffer}': step_count")
        except (KeyError, TypeError, ValueError, AttributeError, DecodeError) as exc:
            why = reason(exc)
            raise ShardError.invalid(f"replica of job '{job}' is malformed ({why})") from None
        specs = [spec for spec, _, _ in rows]
        _check_placement(job, meta, specs, method)
        self.store.check_room(job, specs, f"{method}: replica of job '{job}'")
        need = sum(map(slice_bytes, specs))
        self.budget.reserve(need, "replicas", f"{method}: replica of job '{job}'")
        slices = []
        try:
            for spec, params, info in rows:
                name = spec.ref.buffer
                state = {k: tensors[f"{name}::state.{k}"] for k in info["state"]}
                b = BufferSlice.restored(spec, version, params, state, info["step_count"])
                b.replicator = self if job in self.configs else None
                slices.append(b)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            why = reason(exc)
            raise ShardError.invalid(f"replica of job '{job}' is malformed ({why})") from None
        except MemoryError as exc:  # paid for above: the host has less than the budget says
            raise ShardError.exhausted(f"{method}: replica of job '{job}': {exc!r}") from None
        finally:
            self.budget.release(need, "replicas")
        self.store.replace_job(job, slices, "replica")
        return int(version)


def _spec(job: str, name: str, info: dict[str, Any], method: str) -> pb.RegisterBufferRequest:
    """Buffer ``name``'s spec as the replica recorded it, checked as a registration is."""
    spec = pb.RegisterBufferRequest.FromString(base64.b64decode(info["spec"]))
    if (spec.ref.job, spec.ref.buffer) != (job, name):
        raise ShardError.invalid(
            f"replica of job '{job}': buffer {name[:128]!r} holds the spec of"
            f" '{spec.ref.job[:128]}/{spec.ref.buffer[:128]}'"
        )
    check_spec(spec, method)
    return spec


def _check_placement(
    job: str, meta: dict[str, Any], specs: list[pb.RegisterBufferRequest], method: str
) -> None:
    """The replica holds buffers, each placed where its own metadata says it is (slice
    ``server_index`` of ``num_servers``). Before, a replica with none emptied the job, and
    its specs could move the server to another slice or mix placements in one job."""
    what = f"{method}: replica of job '{job}'"
    if not specs:
        raise ShardError.invalid(f"{what} holds no buffers")
    said = (meta.get("server_index"), meta.get("num_servers"))
    placed = sorted({(s.server_index, s.num_servers) for s in specs})
    if placed != [said]:
        where = ", ".join(f"slice {i} of {n}" for i, n in placed[:4])
        raise ShardError.invalid(
            f"{what} says it is slice {said[0]!r:.24} of {said[1]!r:.24}; its buffers' specs"
            f" place them at {where}"
        )


def _check_sizes(spec: pb.RegisterBufferRequest, params: Any, state: list[Any]) -> None:
    """The replica's arrays are the size of the slice its spec places on this server."""
    start, stop = slicing.slice_bounds(spec.numel, spec.num_servers, spec.server_index)
    sizes = {int(params.size), *(int(a.size) for a in state)}
    if sizes != {stop - start}:
        raise ShardError.invalid(
            f"replica of job '{spec.ref.job}': buffer '{spec.ref.buffer}' holds arrays of"
            f" {sorted(sizes)} elements where its slice {spec.server_index} of"
            f" {spec.num_servers} has {stop - start:,}"
        )
