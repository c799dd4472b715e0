"""Neighbour replication (DESIGN section 5): a dead server is rebuilt from its neighbour.

Every ``every`` versions, right after a step, each buffer slice of a configured job copies its
params and optimizer state (a memcpy, under the slice's lock). When all buffers of the job on
this server have been copied at that version, a background thread encodes them as one shard
(the snapshot format, plus each buffer's registration), keeps it, and sends it in chunks to
server (index + 1) mod N, which keeps it for us. Both sides keep the last ``KEEP`` versions.

Recovery (client.tools.recover_from_replicas) picks the newest version every server can get
back: a live server from its own copy (rollback), a restarted one from its neighbour's.
Encoding and sending happen off the training path; only the copy is on it.
"""

from __future__ import annotations

import base64
import logging
import queue
import threading
from collections import OrderedDict
from typing import Any

import grpc

from protos import shard_pb2 as pb
from server.errors import ShardError
from server.snapshots import Captured, decode_shard, encode_shard

__all__ = ["Replicator"]

log = logging.getLogger("paramshard.replication")
KEEP = 2  # versions kept of each replica
CHUNK = 4 * 2**20
_CHANNEL_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


class Replicator:
    def __init__(self, store: Any) -> None:
        self.store = store  # BufferStore
        self._lock = threading.Lock()
        self.configs: dict[str, pb.ReplicationConfig] = {}
        self._collecting: dict[tuple[str, int], dict[str, tuple[Captured, bytes]]] = {}
        self.own: dict[str, OrderedDict[int, bytes]] = {}
        self.held: dict[tuple[str, int], OrderedDict[int, bytes]] = {}
        self._incoming: dict[tuple, tuple[bytearray, set[int]]] = {}
        self._queue: queue.Queue = queue.Queue()
        self._channels: dict[str, grpc.Channel] = {}
        threading.Thread(target=self._send_loop, name="replicate", daemon=True).start()

    # -- configuration and capture (the training path) --------------------------------------
    def configure(self, cfg: pb.ReplicationConfig) -> None:
        slices = self.store.jobs().get(cfg.job)
        if not slices:
            raise ShardError.not_found(f"job '{cfg.job}' is not on this server")
        if cfg.every and (":" not in cfg.neighbour or cfg.server_index >= cfg.num_servers):
            raise ShardError.invalid(
                f"replication of '{cfg.job}': neighbour {cfg.neighbour!r} must be host:port and"
                f" server_index {cfg.server_index} inside 0..{cfg.num_servers - 1}"
            )
        with self._lock:
            self.configs[cfg.job] = cfg
        for b in slices:  # a first copy now, so a failure before step `every` is covered too
            b.replicator = self if cfg.every else None
            if cfg.every:
                with b.cond:
                    self.on_version(b, force=True)

    def on_version(self, b: Any, force: bool = False) -> None:
        """Called with ``b.cond`` held after ``b`` reached a new version."""
        cfg = self.configs.get(b.job)
        if cfg is None or not cfg.every or (b.version % cfg.every and not force):
            return
        captured = b.copy_state()
        key = (b.job, b.version)
        total = len(self.store.jobs().get(b.job, ()))
        with self._lock:
            bucket = self._collecting.setdefault(key, {})
            bucket[b.name] = (captured, b.spec.SerializeToString())
            if len(bucket) < total:
                return
            del self._collecting[key]
        self._queue.put((cfg, b.version, bucket))

    # -- encoding and sending (background) ----------------------------------------------------
    def _send_loop(self) -> None:
        while True:
            cfg, version, bucket = self._queue.get()
            try:
                captured = [c for c, _ in bucket.values()]
                specs = {name: spec for name, (_, spec) in bucket.items()}
                blob = encode_shard(
                    cfg.job, "replica", cfg.server_index, cfg.num_servers, version, captured, specs
                )
                with self._lock:
                    _keep(self.own.setdefault(cfg.job, OrderedDict()), version, blob)
                self._send(cfg, version, blob)
            except Exception:  # the neighbour may be down: the next version tries again
                log.warning(
                    "replica of %s v%d to %s failed", cfg.job, version, cfg.neighbour, exc_info=True
                )

    def _send(self, cfg: pb.ReplicationConfig, version: int, blob: bytes) -> None:
        chan = self._channels.get(cfg.neighbour)
        if chan is None:
            chan = self._channels[cfg.neighbour] = grpc.insecure_channel(
                cfg.neighbour, options=_CHANNEL_OPTIONS
            )
        store = chan.unary_unary(
            "/paramshard.v1.Shard/StoreReplica",
            request_serializer=pb.ReplicaChunk.SerializeToString,
            response_deserializer=pb.ReplicaAck.FromString,
        )
        metadata = (("authorization", f"Bearer {cfg.token}"),) if cfg.token else ()
        for offset in range(0, max(len(blob), 1), CHUNK):
            store(
                pb.ReplicaChunk(
                    job=cfg.job,
                    source_index=cfg.server_index,
                    version=version,
                    offset=offset,
                    total=len(blob),
                    data=blob[offset : offset + CHUNK],
                ),
                timeout=60,
                metadata=metadata,
            )

    # -- the neighbour's side and recovery ---------------------------------------------------
    def _assemble(self, kind: str, chunk: pb.ReplicaChunk) -> bytes | None:
        """Collects the chunks of one replica; its bytes once every chunk is in."""
        if chunk.offset + len(chunk.data) > chunk.total:
            raise ShardError.invalid(
                f"replica chunk [{chunk.offset:,}, +{len(chunk.data):,}) is past its"
                f" {chunk.total:,} bytes"
            )
        key = (kind, chunk.job, chunk.source_index, chunk.version, chunk.total)
        with self._lock:
            buf, seen = self._incoming.setdefault(key, (bytearray(chunk.total), set()))
            buf[chunk.offset : chunk.offset + len(chunk.data)] = chunk.data
            seen.add(chunk.offset)
            if sum(min(CHUNK, chunk.total - o) for o in seen) < chunk.total:
                return None
            del self._incoming[key]
        return bytes(buf)

    def store_chunk(self, chunk: pb.ReplicaChunk) -> bool:
        blob = self._assemble("held", chunk)
        if blob is None:
            return False
        with self._lock:
            _keep(
                self.held.setdefault((chunk.job, chunk.source_index), OrderedDict()),
                chunk.version,
                blob,
            )
        return True

    def list(self, job: str) -> list[pb.ReplicaInfo]:
        with self._lock:
            cfg = self.configs.get(job)
            rows = [
                pb.ReplicaInfo(
                    source_index=cfg.server_index if cfg else 0, version=v, bytes=len(b), own=True
                )
                for v, b in self.own.get(job, {}).items()
            ]
            rows += [
                pb.ReplicaInfo(source_index=src, version=v, bytes=len(b), own=False)
                for (j, src), kept in self.held.items()
                if j == job
                for v, b in kept.items()
            ]
        return rows

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
        size = req.max_bytes or CHUNK
        return pb.ReplicaChunk(
            job=req.job,
            source_index=req.source_index,
            version=req.version,
            offset=req.offset,
            total=len(blob),
            data=blob[req.offset : req.offset + size],
        )

    def load_chunk(self, chunk: pb.ReplicaChunk) -> bool:
        """A restarted server gets its own replica back; loaded once whole."""
        blob = self._assemble("load", chunk)
        if blob is None:
            return False
        self._restore(chunk.job, blob)
        return True

    def rollback(self, job: str, version: int) -> int:
        with self._lock:
            blob = self.own.get(job, {}).get(version)
        if blob is None:
            raise ShardError.not_found(f"this server has no copy of job '{job}' at v{version}")
        return self._restore(job, blob)

    def _restore(self, job: str, blob: bytes) -> int:
        from server.store import BufferSlice  # store imports snapshots; avoid a cycle

        meta, tensors = decode_shard(blob)
        if meta.get("job") != job:
            raise ShardError.invalid(f"replica holds job '{meta.get('job')}', not '{job}'")
        slices = []
        for name, info in meta["buffers"].items():
            spec = pb.RegisterBufferRequest.FromString(base64.b64decode(info["spec"]))
            state = {k: tensors[f"{name}::state.{k}"] for k in info["state"]}
            b = BufferSlice.restored(
                spec, meta["version"], tensors[f"{name}::params"], state, info["step_count"]
            )
            b.replicator = self if job in self.configs else None
            slices.append(b)
        self.store.replace_job(job, slices)
        return int(meta["version"])


def _keep(kept: OrderedDict[int, bytes], version: int, blob: bytes) -> None:
    kept[version] = blob
    kept.move_to_end(version)
    while len(kept) > KEEP:
        kept.popitem(last=False)
