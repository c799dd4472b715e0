"""The channels a server sends its replicas to its neighbour on (server/replication/
replicator.py): one a neighbour, renewed when it stalls in gRPC's reconnect backoff, and the
probe that asks the neighbour whether it takes a job's replicas from us."""

from __future__ import annotations

import threading
from typing import Any

import grpc

from paramshard.protos import shard_pb2 as pb
from paramshard.protos.service import method_path
from paramshard.protos.words import details_of
from paramshard.server.replication.neighbour_shm import NeighbourSegments
from paramshard.server.rpc import peer_credentials
from paramshard.server.runtime.errors import ShardError

__all__ = ["NeighbourChannels", "store_stub"]

PROBE_TIMEOUT_S = 10.0
_CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    ("grpc.max_reconnect_backoff_ms", 1000),  # a neighbour back is reached within a second
    ("grpc.use_local_subchannel_pool", 1),  # a new channel connects anew (``_renew_channel``)
]
_STORE = method_path("StoreReplica")


class NeighbourChannels:
    """Replicator's channels to its neighbours (its state: ``Replicator``'s)."""

    _lock: threading.Lock
    _closed: bool
    _channels: dict[str, grpc.Channel]
    configs: dict[str, pb.ReplicationConfig]
    segments: NeighbourSegments
    peer_token: str | None
    credentials: grpc.ChannelCredentials | None

    def _close_unused(self, neighbour: str) -> None:
        """Under the lock: closes the channel to ``neighbour`` unless a job still sends there."""
        if any(c.neighbour == neighbour for c in self.configs.values()):
            return
        chan = self._channels.pop(neighbour, None)
        if chan is not None:
            self.segments.forget(neighbour)
            chan.close()

    def _stub(self, neighbour: str) -> Any:
        """A StoreReplica stub to ``neighbour``."""
        return store_stub(self._channel(neighbour))

    def _channel(self, neighbour: str, cfg: pb.ReplicationConfig | None = None) -> grpc.Channel:
        """The channel to ``neighbour``; with ``cfg``, only while it is the job's."""
        with self._lock:
            if self._closed:
                raise ShardError.precondition("this server is stopping")
            if cfg is not None and self.configs.get(cfg.job) is not cfg:
                raise ShardError.precondition(f"replication of '{cfg.job}' was reconfigured")
            chan = self._channels.get(neighbour)
            if chan is None:
                if self.credentials is not None:
                    chan = grpc.secure_channel(neighbour, self.credentials, _CHANNEL_OPTIONS)
                else:
                    chan = grpc.insecure_channel(neighbour, options=_CHANNEL_OPTIONS)
                self._channels[neighbour] = chan
        return chan

    def _renew_channel(self, neighbour: str) -> None:
        """The next call to ``neighbour`` gets a new channel (the old one is closed: its calls
        in flight fail, and the next version's replica goes on the new one)."""
        with self._lock:
            old = self._channels.pop(neighbour, None)
            if old is not None:
                self.segments.forget(neighbour)
        if old is not None:
            old.close()

    def _metadata(self, job: str) -> tuple[tuple[str, str], ...]:
        """The credential of a call about ``job``'s replicas: derived from the peer token for
        that job (server/rpc/peer_credentials.py); the token itself never leaves this server,
        since the neighbour is whatever address the caller of ConfigureReplication named."""
        if not self.peer_token:
            return ()
        return (("authorization", f"Bearer {peer_credentials.derive(self.peer_token, job)}"),)

    def _probe(self, cfg: pb.ReplicationConfig) -> None:
        """Asks the neighbour whether it takes this job's replicas from our slice index. A
        probe the cached channel refuses at once (UNAVAILABLE: it waits out gRPC's reconnect
        backoff after the neighbour was down, up to seconds after it is back) is asked again
        on a new channel: before, a recovery's ConfigureReplication failed for 5.9 s after a
        neighbour's 15 s outage, and each failure cost the recovery one of its rounds."""
        hello = pb.ReplicaChunk(job=cfg.job, source_index=cfg.server_index)
        try:
            try:
                self._stub(cfg.neighbour)(
                    hello, timeout=PROBE_TIMEOUT_S, metadata=self._metadata(cfg.job)
                )
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                self._renew_channel(cfg.neighbour)
                self._stub(cfg.neighbour)(
                    hello, timeout=PROBE_TIMEOUT_S, metadata=self._metadata(cfg.job)
                )
        except grpc.RpcError as exc:
            code, details = exc.code(), details_of(exc)
            where = f"replication of '{cfg.job}' to {cfg.neighbour}"
            with self._lock:
                self._close_unused(cfg.neighbour)
            if code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED):
                raise ShardError(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"{where} refused: the target is not slice {cfg.server_index + 1} of"
                    f" {cfg.num_servers} of the job's placement ({details})",
                ) from None
            if code == grpc.StatusCode.UNAUTHENTICATED:
                raise ShardError.precondition(
                    f"{where}: the target refused this server's peer token (every server needs"
                    f" the same 'peer TOKEN' line): {details}"
                ) from None
            raise ShardError.precondition(
                f"{where}: the target did not answer ({code.name}: {details})"
            ) from None


def store_stub(channel: grpc.Channel) -> Any:
    return channel.unary_unary(
        _STORE,
        request_serializer=pb.ReplicaChunk.SerializeToString,
        response_deserializer=pb.ReplicaAck.FromString,
    )
