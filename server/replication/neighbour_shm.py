"""Replica chunks through shared memory when the neighbour runs on this host (docs/design.md §7.2).

A server sending its replica to its neighbour is a client of that neighbour, and goes the way a
trainer's payloads go (protos/shm.py): the first chunk asks the neighbour for a segment over the
authenticated channel, with the credential derived from the server's ``peer`` token
(server/rpc/peer_credentials.py; the segment calls accept it besides ``read``,
server/rpc/auth.py), and the neighbour's abstract Unix socket hands it over only within one
network namespace. A neighbour on another host, or in another container network, keeps getting
its chunks in-band. A neighbour that forgot our segments (it restarted) gets the chunk in-band
at once, and new segments later.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import grpc

from paramshard.protos import shard_pb2 as pb
from paramshard.protos.shm import SHM_MIN_BYTES, SharedMemory, is_stale
from paramshard.server.rpc.auth import SERVICE_NAME

__all__ = ["NeighbourSegments"]

_REPLIES = {
    "OfferSegment": pb.OfferSegmentReply,
    "ConfirmSegment": pb.ConfirmSegmentReply,
    "ReleaseSegments": pb.ReleaseSegmentsReply,
}


class _Caller:
    """What ``SharedMemory`` needs of a caller: the neighbour's address and one plain call."""

    def __init__(self, address: str, channel: grpc.Channel, metadata: Any) -> None:
        self.spec = SimpleNamespace(addresses=[address])
        self._channel, self._metadata = channel, metadata

    def plain_call(self, index: int, method: str, request: Any, timeout: float) -> Any:
        call = self._channel.unary_unary(
            f"/{SERVICE_NAME}/{method}",
            request_serializer=type(request).SerializeToString,
            response_deserializer=_REPLIES[method].FromString,
        )
        return call(request, timeout=timeout, metadata=self._metadata)


class NeighbourSegments:
    """The segments this server holds with its neighbours, two per neighbour (the sender
    sends one chunk at a time), each one replica chunk large."""

    def __init__(self, chunk_bytes: int) -> None:
        self.shm = SharedMemory(chunk_bytes, max_in_flight=1)
        self._callers: dict[str, _Caller] = {}

    def store(
        self,
        neighbour: str,
        channel: grpc.Channel,
        store: Any,
        metadata: Any,
        chunk: pb.ReplicaChunk,
        data: memoryview | bytes,
        timeout: float,
    ) -> None:
        """``store`` (the StoreReplica stub on ``channel``) of ``chunk`` with payload ``data``
        on ``neighbour``: in a segment when it shares memory with this server, else in-band.
        Raises grpc.RpcError."""
        caller = self._callers.get(neighbour)
        if caller is None or caller._channel is not channel:  # noqa: SLF001 - our own class
            caller = self._callers[neighbour] = _Caller(neighbour, channel, metadata)
        caller._metadata = metadata  # noqa: SLF001 - a credential made for this call
        placed = self.shm.put(caller, 0, data) if len(data) >= SHM_MIN_BYTES else None
        if placed is not None:
            ref, seg = placed
            chunk.shm.CopyFrom(ref)
            try:
                store(chunk, timeout=timeout, metadata=metadata)
            except grpc.RpcError as exc:
                self.shm.retire(seg)
                if not is_stale(exc.code(), exc.details()):
                    raise
                self.shm.reset(neighbour)  # it restarted: this chunk in-band, new segments later
                chunk.ClearField("shm")
            else:
                self.shm.settle(seg, None, consumed=True)
                return
        chunk.data = bytes(data)
        store(chunk, timeout=timeout, metadata=metadata)

    def forget(self, neighbour: str) -> None:
        """Replication to ``neighbour`` stopped: unmap its free segments (it drops them idle)."""
        self._callers.pop(neighbour, None)
        self.shm.reset(neighbour)

    def close(self) -> None:
        """Releases every segment (before the channels close)."""
        self.shm.close()
