"""The neighbour's side of replication (server/replication/replicator.py sends): a
predecessor's replica kept here chunk by chunk, the replicas listed, and the last ``KEEP``
versions of each kept."""

from __future__ import annotations

from collections import OrderedDict

import grpc

from paramshard.protos import shard_pb2 as pb
from paramshard.server.replication.inbox import check_header, replica_bound
from paramshard.server.replication.recovery import ReplicaRecovery
from paramshard.server.runtime.errors import ShardError
from paramshard.server.snapshots.shards import Parts

__all__ = ["KEEP", "HeldReplicas"]

KEEP = 2  # versions kept of each replica


class HeldReplicas(ReplicaRecovery):
    """Replicator's receiving side: what its predecessor sends, kept; what it holds, listed
    (its state: ``ReplicaRecovery``'s)."""

    def store_chunk(self, chunk: pb.ReplicaChunk, data: bytes) -> bool:
        """A chunk of our predecessor's replica, its bytes ``data`` (an empty one, total 0:
        may it send?)."""
        what = f"replica of job '{chunk.job}' from server {chunk.source_index} v{chunk.version}"
        slices = self.store.jobs().get(chunk.job)
        if not slices:
            raise ShardError.not_found(f"{what}: job '{chunk.job}' is not on this server")
        index, num = slices[0].spec.server_index, slices[0].spec.num_servers
        if chunk.source_index != (index - 1) % num:
            raise ShardError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{what}: this server holds slice {index} of {num} and takes replicas only from"
                f" server {(index - 1) % num}, its predecessor",
            )
        if chunk.total == 0 and not data:
            return False  # the sender's probe
        blob = self.inbox.add("held", chunk, data, replica_bound(slices, chunk.source_index), what)
        if blob is None:
            return False
        try:
            check_header(blob, chunk, what)
        except BaseException:  # whatever it raised, the bytes are not kept
            self.budget.release(len(blob), "replicas")  # reserved by the inbox
            raise
        with self._lock:
            if any(b.dropped for b in slices):  # DropJob or Restore meanwhile: its drop()
                self.budget.release(len(blob), "replicas")  # came first and freed the rest
                raise ShardError.not_found(
                    f"{what}: job '{chunk.job}' was dropped or restored while it arrived"
                )
            self._keep(
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

    def _keep(self, kept: OrderedDict[int, Parts], version: int, blob: Parts) -> None:
        """Under the lock: keeps ``blob`` (its bytes reserved) and the newest ``KEEP``."""
        gone = kept.pop(version, None)
        freed = 0 if gone is None else len(gone)
        kept[version] = blob
        while len(kept) > KEEP:
            freed += len(kept.popitem(last=False)[1])
        self.budget.release(freed, "replicas")
