"""Neighbour replication (docs/design.md §5.2, §6.1): a dead server is rebuilt from its neighbour.

Every ``every`` versions, right after a step, each buffer slice of a configured job copies its
params and optimizer state (a memcpy, under the slice's lock). When all buffers of the job on
this server have been copied at that version, a background thread encodes them as one shard
(the snapshot format, plus each buffer's registration), keeps it, and sends it in chunks to
server (index + 1) mod N, which keeps it for us: through shared memory when that server runs
on this host (``replica_shm.py``), else in-band. Both sides keep the last ``KEEP`` versions.

Who may do what (docs/design.md §6.1): ``ConfigureReplication`` is an admin call, and its target
must be the job's next server: before accepting it, this server asks the target to take a
replica of the job from our slice index (an empty ``StoreReplica``, total 0), which the target
accepts only if it holds the job and we are its predecessor ((its index - 1) mod N, from the
placement the job was registered with). Replicas travel with this server's own ``peer`` token
(server/rpc/auth.py), over TLS when this server serves TLS. A received replica is bounded by the
registered size of the job (``replica_inbox.replica_bound``), complete when its chunks cover
every byte once, and dropped when it stays incomplete (``replica_inbox.Inbox``). The send queue
is bounded (the oldest waiting replica gives way); a neighbour's channel is closed when
replication stops, moves elsewhere, or the job is dropped.

Recovery (client.tools.recover_from_replicas) picks the newest version every server can get
back: a live server from its own copy (rollback), a restarted one from its neighbour's.
Encoding and sending happen off the training path; only the copy is on it.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from typing import Any

import grpc

from paramshard.protos import shard_pb2 as pb
from paramshard.protos.words import details_of
from paramshard.server.replication.channels import NeighbourChannels, store_stub
from paramshard.server.replication.held import KEEP, HeldReplicas
from paramshard.server.replication.inbox import Inbox
from paramshard.server.replication.neighbour_shm import NeighbourSegments
from paramshard.server.replication.recovery import CHUNK
from paramshard.server.runtime.errors import ShardError
from paramshard.server.snapshots.shards import Captured, Parts, array_bytes, shard_parts

__all__ = ["Replicator"]

log = logging.getLogger("paramshard.replication")
QUEUE = 2  # versions captured and waiting to be encoded and sent (each a copy of the job here)
_Bucket = dict[str, tuple[Captured, bytes, int]]  # buffer -> (copy, its spec, bytes reserved)


def _reserved(bucket: _Bucket) -> int:
    return sum(n for _, _, n in bucket.values())


class Replicator(NeighbourChannels, HeldReplicas):
    def __init__(self, store: Any, *, ttl_s: float = 300.0, queue_size: int = QUEUE) -> None:
        self.store = store  # BufferStore
        self._lock = threading.Lock()
        self.configs: dict[str, pb.ReplicationConfig] = {}
        self._collecting: dict[tuple[str, int], _Bucket] = {}
        self.own: dict[str, OrderedDict[int, Parts]] = {}
        self.held: dict[tuple[str, int], OrderedDict[int, Parts]] = {}
        self.budget = store.budget  # replicas kept here are paid for from the server's memory
        self.inbox = Inbox(ttl_s, self.budget)
        self.queue_size = queue_size
        self._queue: deque[tuple[pb.ReplicationConfig, int, _Bucket]] = deque()
        self.failures: dict[str, str] = {}  # job -> why its last replica was not made
        self._wake = threading.Condition(self._lock)
        self._channels: dict[str, grpc.Channel] = {}
        self.segments = NeighbourSegments(CHUNK)  # chunks to a neighbour on this host
        self._closed = False
        # set by ShardServer: how replicas reach the neighbour
        self.peer_token: str | None = None
        self.tokens_required = False
        self.credentials: grpc.ChannelCredentials | None = None
        threading.Thread(target=self._send_loop, name="replicate", daemon=True).start()

    def set_transport(
        self,
        *,
        peer_token: str | None,
        tokens_required: bool,
        credentials: grpc.ChannelCredentials | None,
    ) -> None:
        """``peer_token``: sent on every replica call; ``tokens_required``: this server takes
        tokens, so its peers do too and a missing peer token is a configuration error;
        ``credentials``: TLS for replica channels (None: plaintext, for plaintext servers)."""
        self.peer_token, self.tokens_required = peer_token, tokens_required
        self.credentials = credentials

    def set_ttl(self, ttl_s: float) -> None:
        """Incomplete replicas are dropped after ``ttl_s`` seconds without a chunk."""
        with self._lock:
            self.inbox.ttl_s = ttl_s
            self._wake.notify_all()  # the sweep's period follows

    # -- configuration and capture (the training path) --------------------------------------
    def configure(self, cfg: pb.ReplicationConfig) -> None:
        slices = self.store.jobs().get(cfg.job)
        if not slices:
            raise ShardError.not_found(f"job '{cfg.job}' is not on this server")
        if not cfg.every:
            self._stop(cfg.job)
            return
        held = (slices[0].spec.server_index, slices[0].spec.num_servers)
        if (cfg.server_index, cfg.num_servers) != held:
            raise ShardError.invalid(
                f"replication of '{cfg.job}': this server holds slice {held[0]} of {held[1]},"
                f" the configuration says {cfg.server_index} of {cfg.num_servers}"
            )
        if ":" not in cfg.neighbour:
            raise ShardError.invalid(
                f"replication of '{cfg.job}': neighbour {cfg.neighbour!r} must be host:port"
            )
        if self.tokens_required and not self.peer_token:
            raise ShardError.precondition(
                f"replication of '{cfg.job}': this server has tokens but no peer token to send"
                " replicas with; add a 'peer TOKEN' line (the same on every server) to its"
                " --token-file"
            )
        self._probe(cfg)
        with self._lock:
            if any(b.dropped for b in slices):  # a DropJob or Restore while the probe ran:
                self._close_unused(cfg.neighbour)  # its drop() came first, nothing to undo
                raise ShardError.not_found(
                    f"replication of '{cfg.job}': the job was dropped or restored while its"
                    " neighbour was asked; configure it again if it is still here"
                )
            old = self.configs.get(cfg.job)
            self.configs[cfg.job] = cfg
            if old is not None and old.neighbour != cfg.neighbour:
                self._close_unused(old.neighbour)
            slices = self.store.jobs().get(cfg.job, [])  # with any registered since: ``adopt``
            for b in slices:
                b.replicator = self
        for b in slices:  # a first copy now, so a failure before step `every` is covered too
            with b.cond:
                self.on_version(b, force=True)

    def adopt(self, job: str, slices: list[Any], how: str) -> None:
        """``slices`` joined ``job`` here (``BufferStore.added``: "registered", or all of them
        restored, from a "snapshot" or a "replica"). If the job replicates, they do too, as
        its others (before, a restored job or a buffer registered later made no more replicas
        while its configuration still said it replicated). A restored job is copied at once.
        Its replicas of other versions are of the history it left and go; after a snapshot's
        Restore, all of them do (its versions are another history's numbers: a server lost
        then was rebuilt from a replica of the history before, at the same version), with
        what is being sent. After a replica's, those of its version stay: the recovery that
        chose it for every server may still load another server's from here."""
        version = slices[0].version if slices else 0
        gone: list[bytes] = []
        with self._lock:
            if how != "registered":
                kept = [self.own.get(job)] + [v for k, v in self.held.items() if k[0] == job]
                for versions in kept:
                    for other in [v for v in versions or () if how == "snapshot" or v != version]:
                        gone.append(versions.pop(other))
            cfg = self.configs.get(job)
            copies = 0
            if cfg is not None and how == "snapshot":  # what is encoded or sent of the history
                copies = self._forget_copies(job)  # before stops there
                self.configs[job] = cfg = pb.ReplicationConfig.FromString(cfg.SerializeToString())
            for b in slices if cfg is not None else ():
                b.replicator = self
        self.budget.release(sum(map(len, gone)) + copies, "replicas")
        if how == "snapshot":
            self.inbox.drop(job)
        if cfg is not None and how != "registered":
            for b in slices:
                with b.cond:
                    self.on_version(b, force=True)

    def _stop(self, job: str) -> bool:
        """Stops replicating ``job``; whether it was replicated."""
        for b in self.store.jobs().get(job, ()):
            b.replicator = None
        with self._lock:
            old = self.configs.pop(job, None)
            self.failures.pop(job, None)
            copies = self._forget_copies(job)
            if old is not None:
                self._close_unused(old.neighbour)
        self.budget.release(copies, "replicas")
        return old is not None

    def _forget_copies(self, job: str) -> int:
        """Under the lock: drops ``job``'s copies not yet encoded; the bytes they reserved."""
        buckets = [self._collecting.pop(k) for k in [k for k in self._collecting if k[0] == job]]
        buckets += [bucket for cfg, _, bucket in self._queue if cfg.job == job]
        self._queue = deque(item for item in self._queue if item[0].job != job)
        return sum(map(_reserved, buckets))

    def _failed(self, job: str, version: int, why: str) -> None:
        """Replica ``version`` of ``job`` was not made or not sent: kept for ListReplicas (its
        ``failure``, which a recovery names), and logged: as a warning the first time after a
        replica that was made (a limit too small refuses every step's copy: one line, not one
        a step), then at debug level."""
        with self._lock:
            first = job not in self.failures
            if job in self.configs:
                self.failures[job] = f"v{version}: {why}"
        (log.warning if first else log.debug)("replica of %s v%d: %s", job, version, why)

    def drop(self, job: str) -> bool:
        """The job left this server: stop replicating it, forget its replicas, close channels.
        Whether it held any of that. Called after the job's slices were retired, so a call that
        checks them under the lock after this (``configure``, ``store_chunk``) sees them gone."""
        had = self._stop(job)
        with self._lock:
            gone = list(self.own.pop(job, {}).values())
            for key in [k for k in self.held if k[0] == job]:
                gone += self.held.pop(key).values()
        self.budget.release(sum(map(len, gone)), "replicas")
        return self.inbox.drop(job) or had or bool(gone)

    def on_version(self, b: Any, force: bool = False) -> None:
        """Called with ``b.cond`` held after ``b`` reached a new version."""
        cfg = self.configs.get(b.job)
        if cfg is None or not cfg.every or (b.version % cfg.every and not force):
            return
        # the copy is paid for before it is made: before, copies waiting to be sent took a
        # GPT-2 124M server to 8.4 GB past any --max-memory (docs/security.md, sixteenth round)
        nbytes = b.capture_bytes()
        try:
            self.budget.reserve(nbytes, "replicas", f"a copy of {b.label} for its replica")
        except ShardError as exc:
            self._failed(b.job, b.version, exc.message)
            return
        captured = b.copy_state()
        key = (b.job, b.version)
        total = len(self.store.jobs().get(b.job, ()))
        freed = nbytes
        with self._lock:
            if self.configs.get(b.job) is cfg:  # else stopped or dropped meanwhile
                freed = 0
                bucket = self._collecting.setdefault(key, {})
                replaced = bucket.get(b.name)  # an earlier copy of this version (forced)
                freed += 0 if replaced is None else replaced[2]
                bucket[b.name] = (captured, b.spec.SerializeToString(), nbytes)
                older = sorted(k for k in self._collecting if k[0] == b.job)
                for stale in older[: max(0, len(older) - KEEP)]:  # a buffer never got there
                    freed += _reserved(self._collecting.pop(stale))
                if len(bucket) == total:
                    self._collecting.pop(key, None)
                    if len(self._queue) >= self.queue_size:
                        late, version, dropped = self._queue.popleft()
                        freed += _reserved(dropped)
                        self.failures[late.job] = f"v{version}: dropped, the neighbour is slow"
                        log.warning(
                            "replica of %s v%d dropped: %d replicas wait to be sent to slow"
                            " neighbours",
                            late.job,
                            version,
                            self.queue_size,
                        )
                    self._queue.append((cfg, b.version, bucket))
                    self._wake.notify()
        self.budget.release(freed, "replicas")

    # -- encoding and sending (background) ----------------------------------------------------
    def _send_loop(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._wake.wait(timeout=min(60.0, self.inbox.ttl_s / 2))
                    self.inbox.sweep()
                if self._closed:
                    return
                cfg, version, bucket = self._queue.popleft()
            try:
                blob = self._encode(cfg, version, bucket)
                del bucket  # the copies go: the blob holds them now
                if blob is None:
                    continue
                self._send(cfg, version, blob)
                with self._lock:
                    self.failures.pop(cfg.job, None)
            except grpc.RpcError as exc:  # the neighbour is down or restarting: an expected
                # failure, said in one line; the next version tries again
                why = f"sending it to {cfg.neighbour} failed: {exc.code().name}: {details_of(exc)}"
                self._failed(cfg.job, version, why)
            except Exception as exc:  # anything else is a bug to see in full; the next tries
                self._failed(cfg.job, version, f"sending it to {cfg.neighbour} failed: {exc!r}")
                log.warning("replica of %s v%d", cfg.job, version, exc_info=True)

    def _encode(self, cfg: pb.ReplicationConfig, version: int, bucket: _Bucket) -> Parts | None:
        """The replica of ``bucket``'s copies, kept as this server's own: the copies' arrays
        as they are (joining them took one more copy of the job here), their reservation
        now the replica's, with its head; None if it cannot be."""
        try:
            captured = [c for c, _, _ in bucket.values()]
            specs = {name: spec for name, (_, spec, _) in bucket.items()}
            head, arrays = shard_parts(
                cfg.job, "replica", cfg.server_index, cfg.num_servers, version, captured, specs
            )
            blob = Parts([head, *map(array_bytes, arrays)])
            extra = len(blob) - _reserved(bucket)  # the head (and what the estimate missed)
            if extra > 0:
                self.budget.reserve(extra, "replicas", f"own replica of '{cfg.job}'")
            else:
                self.budget.release(-extra, "replicas")
        except ShardError as exc:
            self.budget.release(_reserved(bucket), "replicas")
            self._failed(cfg.job, version, exc.message)
            return None
        except BaseException:
            self.budget.release(_reserved(bucket), "replicas")
            raise
        with self._lock:
            if self.configs.get(cfg.job) is not cfg:  # reconfigured or stopped meanwhile
                self.budget.release(len(blob), "replicas")
                return None
            self._keep(self.own.setdefault(cfg.job, OrderedDict()), version, blob)
        return blob

    def close(self) -> None:
        """Stops the sender and closes every channel (the server stops)."""
        with self._lock:
            self._closed = True
            copies = sum(_reserved(bucket) for _, _, bucket in self._queue)
            copies += sum(map(_reserved, self._collecting.values()))
            self._queue.clear()
            self._collecting.clear()
            channels, self._channels = list(self._channels.values()), {}
            self._wake.notify_all()
        self.budget.release(copies, "replicas")
        self.segments.close()
        for chan in channels:
            chan.close()

    def _send(self, cfg: pb.ReplicationConfig, version: int, blob: Parts) -> None:
        """The replica in chunks, through shared memory when the neighbour is on this host;
        a chunk inside one array is sent from the array."""
        channel = self._channel(cfg.neighbour, cfg)
        store = store_stub(channel)
        for offset in range(0, len(blob), CHUNK):
            if self.configs.get(cfg.job) is not cfg:  # restored or stopped: not this replica
                return
            chunk = pb.ReplicaChunk(
                job=cfg.job,
                source_index=cfg.server_index,
                version=version,
                offset=offset,
                total=len(blob),
            )
            data = blob.view(offset, offset + CHUNK)
            metadata = self._metadata(cfg.job)
            self.segments.store(cfg.neighbour, channel, store, metadata, chunk, data, 60)
