"""A client's shared-memory segments with its host's servers (server/transport/shm.py,
docs/design.md §7.2).

It lives in protos/, below both sides: trainers use it, and so does a server sending replica
chunks to its neighbour (server/replication/neighbour_shm.py), which never imports client code.

For each server, the first large payload opens a segment: ``OfferSegment`` (an authenticated
call), the memfd received over the server's abstract Unix socket for the one-time ticket,
mapped (once its seals say its size can never change: ``is_sealed``), and ``ConfirmSegment``
with the bytes the server wrote at its start. A server on another host, or in another network
namespace, cannot be reached on that socket: its calls keep their payloads in-band, and
nothing is tried again with it. Whether memory is shared is found this way, never by
comparing addresses. ``PARAMSHARD_SHM=0`` turns the path off.

Segments are pooled per server, each the size of one message (``chunk_bytes``), at most
``2 x max_in_flight`` of them; a pool grows to the most calls in flight to its server at
once, which ``RpcCore.run`` keeps near ``IN_FLIGHT_PER_SERVER`` (client/call_order.py). A
payload of a push, a parameter set or a slot contribution is copied into a free segment (one
memcpy) and the message carries its reference; a pull or a slot read names a segment for the
reply, which the server writes into, and the reply's values are read from it in place. A
segment goes back to the pool when its call succeeded and its reply was used; after any
failure it is retired (unmapped here, released at the server), since the server may still be
reading it. A server that no longer knows a segment (it restarted, or the segment sat idle
past its TTL) answers FAILED_PRECONDITION: that server's pool is emptied and the call is sent
again (``RpcCore.run``).
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import re
import secrets
import socket
import threading
from typing import Any

import grpc

from paramshard.protos import codec
from paramshard.protos import shard_pb2 as pb
from paramshard.protos.words import details_of

__all__ = [
    "SharedMemory",
    "enabled",
    "is_stale",
    "is_sealed",
    "seal",
    "SHM_MIN_BYTES",
    "IN_FLIGHT_PER_SERVER",
    "PROOF_BYTES",
    "SEALS",
    "MFD_ALLOW_SEALING",
    "TICKET_BYTES",
    "handover_name",
]

log = logging.getLogger(__name__)

IN_FLIGHT_PER_SERVER = 2
"""Calls with segments a client keeps in flight to one server beyond each batch's first
(``has_room``): a server's pool of a client's segments grows to the most that were in flight
at once, and stays. Two keep the copies on both sides going (the client fills one segment
while the server reads the other); a whole window of 8 to one server held 8 x 16 MiB per
trainer and server (docs/benchmarks.md)."""
SHM_MIN_BYTES = 64 * 2**10
"""Smaller payloads stay in-band: their copy costs less than the bookkeeping."""
_SEND = ("PushGrad", "SetParams", "Contribute", "ContributeRead")
_RECEIVE = ("PullParams", "ReadSlot")
_BOTH = ("ContributeRead",)  # its reply comes back into the segment its payload went in
_HANDSHAKE_TIMEOUT_S = 5.0
TICKET_BYTES = 32
"""A segment's one-time ticket, sent on the server's handover socket to claim its memfd."""
_HANDOVER = re.compile(r"@paramshard-shm-[0-9]{1,10}-[0-9a-f]{16}")
"""The only sockets a client connects to for a memfd: a server's (``handover_name``). The name
and the ticket come from the server, so a server on another host could otherwise make its
clients write bytes of its choosing to any abstract socket of theirs (a local bus, a container
runtime's shim)."""
PROOF_BYTES = 32
"""Random bytes a server writes at a new segment's start; the client proves its mapping with
them."""
_STALE = "shared segment"  # in the server's message for a segment it does not know
MFD_ALLOW_SEALING = getattr(os, "MFD_ALLOW_SEALING", 2)  # the Linux values where Python lacks them
_F_ADD_SEALS = getattr(fcntl, "F_ADD_SEALS", 1033)
_F_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1034)
SEALS = (
    getattr(fcntl, "F_SEAL_SHRINK", 2)
    | getattr(fcntl, "F_SEAL_GROW", 4)
    | getattr(fcntl, "F_SEAL_SEAL", 1)
)
"""A segment's size is fixed for good before anyone else holds it: a caller that shrank its
segment under the server's mapping would make the server's next read or write there die of
SIGBUS (the whole process), and one that grew it would hold memory past its budget. No seal
can be added after these (``F_SEAL_SEAL``)."""


def enabled() -> bool:
    """Whether clients of this process may use shared memory (``PARAMSHARD_SHM`` is not 0)."""
    return os.environ.get("PARAMSHARD_SHM", "1").strip() not in ("0", "false", "off", "no")


def is_stale(code: grpc.StatusCode, details: str) -> bool:
    """Whether a failure says the server does not know a segment this client holds."""
    return code == grpc.StatusCode.FAILED_PRECONDITION and _STALE in details


class Segment:
    def __init__(self, server: str, segment_id: int, mapped: mmap.mmap) -> None:
        self.server, self.id, self.map = server, segment_id, mapped  # server: its address
        self.nbytes = len(mapped)

    def ref(self, nbytes: int) -> pb.ShmRef:
        return pb.ShmRef(segment=self.id, offset=0, nbytes=nbytes)


class SharedMemory:
    """The segments of one client (``RpcCore``) and its views on some of its servers
    (``ShardClient.on_servers``, groups), per server address: a view numbers the servers its
    own way, so every method takes the calling view and the server's index in it."""

    def __init__(self, chunk_bytes: int, max_in_flight: int, on: bool | None = None) -> None:
        self.chunk_bytes = chunk_bytes
        self.on = on  # None: as PARAMSHARD_SHM says (``enabled``)
        self.segment_bytes = max(SHM_MIN_BYTES, chunk_bytes + 4096)
        self.limit = 2 * max_in_flight
        self._lock = threading.Lock()
        self._free: dict[str, list[Segment]] = {}
        self._count: dict[str, int] = {}  # segments open per server (free or in use)
        self._off: set[str] = set()  # servers this client shares no memory with
        self._cap: dict[str, int] = {}  # servers that refused more segments: what it holds
        self._released: dict[str, list[int]] = {}  # retired ids the server still holds
        self._via: dict[str, tuple[Any, int]] = {}  # address -> (a view, its index there)
        self.opened = 0  # segments opened (a test reads it)

    # -- what RpcCore calls --------------------------------------------------------------------
    def has_room(self, server: str) -> bool:
        """Whether one more call to ``server`` (an address) may take a segment now: this
        client's segments in use there (by all its batches) are fewer than
        ``IN_FLIGHT_PER_SERVER``, or it shares no memory with that server, or shared memory
        is off."""
        if not self._on():
            return True
        with self._lock:
            if server in self._off:
                return True
            taken = self._count.get(server, 0) - len(self._free.get(server, ()))
        return taken < IN_FLIGHT_PER_SERVER

    def attach(
        self, core: Any, server: int, method: str, request: Any
    ) -> tuple[Any, Segment | None]:
        """``request`` (to server ``server`` of view ``core``) with its payload (or its reply)
        in a segment, and that segment; else ``request`` unchanged and None."""
        if method in _SEND and isinstance(request, tuple):
            header, payload = request
            placed = self.put(core, server, payload)
            if placed is None:
                return request, None
            ref, seg = placed
            moved = type(header)()
            moved.CopyFrom(header)
            moved.shm.CopyFrom(ref)
            if method in _BOTH:  # the server reads the payload before it writes the reply
                moved.reply_shm.CopyFrom(seg.ref(seg.nbytes))
            return (moved, b""), seg
        if method in _RECEIVE and not isinstance(request, tuple):
            if method == "PullParams":
                itemsize = codec.numpy_dtype(request.chunk.dtype).itemsize
                size = request.chunk.numel * itemsize
            else:  # a slot chunk: at most one message
                size = self.chunk_bytes
            seg = self._take(core, server, size) if size >= SHM_MIN_BYTES else None
            if seg is None:
                return request, None
            asked = type(request)()
            asked.CopyFrom(request)
            asked.reply_shm.CopyFrom(seg.ref(seg.nbytes))
            return asked, seg
        return request, None

    def put(self, core: Any, server: int, payload: Any) -> tuple[pb.ShmRef, Segment] | None:
        """``payload`` copied into a free segment for server ``server`` of ``core``: its
        reference and the segment (``settle`` or ``retire`` it after the call), or None when
        the payload stays in-band (small, or no segment for that server)."""
        data = codec.byte_view(payload)
        seg = self._take(core, server, data.nbytes) if data.nbytes >= SHM_MIN_BYTES else None
        if seg is None:
            return None
        codec.copy_into(seg.map, data)
        return seg.ref(data.nbytes), seg

    def settle(self, seg: Segment, reply: Any, consumed: bool) -> Any:
        """After a call succeeded: the pool gets ``seg`` back. A reply still in the segment
        that nobody consumed is copied out first."""
        if not consumed and isinstance(reply, tuple) and reply[0].HasField("shm"):
            reply = (reply[0], bytes(reply[1]))
        self._give(seg)
        return reply

    @staticmethod
    def reply_payload(seg: Segment, reply: Any) -> Any:
        """A reply whose values the server wrote into ``seg``: the payload read in place."""
        if isinstance(reply, tuple) and reply[0].HasField("shm"):
            ref = reply[0].shm
            if ref.segment != seg.id or ref.offset + ref.nbytes > seg.nbytes:
                raise codec.BadReply(
                    f"the reply was put outside the caller's segment {seg.id} of"
                    f" {seg.nbytes:,} bytes (segment {ref.segment}, bytes {ref.offset:,}"
                    f" to {ref.offset + ref.nbytes:,})"
                )
            return reply[0], memoryview(seg.map)[ref.offset : ref.offset + ref.nbytes]
        return reply

    def retire(self, seg: Segment) -> None:
        """After a failure: the server may still read ``seg``; it is never used again."""
        with self._lock:
            self._count[seg.server] = self._count.get(seg.server, 1) - 1
            self._released.setdefault(seg.server, []).append(seg.id)
        _unmap(seg)

    def reset(self, server: str) -> None:
        """Server ``server`` (an address) forgot our segments (it restarted): drop them, open
        new ones later."""
        with self._lock:
            free = self._free.pop(server, [])
            self._count[server] = self._count.get(server, 0) - len(free)
        for seg in free:
            _unmap(seg)

    def close(self) -> None:
        with self._lock:
            free, self._free = self._free, {}
            released, self._released = self._released, {}
        for seg in (s for segs in free.values() for s in segs):
            released.setdefault(seg.server, []).append(seg.id)
            _unmap(seg)
        for server, ids in released.items():
            self._release(server, ids, timeout=0.5)

    # -- the pool ------------------------------------------------------------------------------
    def _on(self) -> bool:
        """Whether this client uses shared memory (``on``, or ``PARAMSHARD_SHM``)."""
        return enabled() if self.on is None else self.on

    def _take(self, core: Any, index: int, nbytes: int) -> Segment | None:
        if nbytes > self.segment_bytes or not self._on():
            return None
        server = core.spec.addresses[index]
        with self._lock:
            self._via[server] = (core, index)
            if server in self._off:
                return None
            if self._free.get(server):
                return self._free[server].pop()
            if self._count.get(server, 0) >= self._cap.get(server, self.limit):
                return None  # all in use: this one goes in-band
            self._count[server] = self._count.get(server, 0) + 1
            released = self._released.pop(server, [])
        if released:
            self._release(server, released, timeout=_HANDSHAKE_TIMEOUT_S)
        seg = self._open(core, index, server)
        if seg is None:
            with self._lock:
                self._count[server] -= 1
        return seg

    def _give(self, seg: Segment) -> None:
        with self._lock:
            self._free.setdefault(seg.server, []).append(seg)

    def _open(self, core: Any, index: int, server: str) -> Segment | None:
        """The handshake (module docstring); None when this server shares no memory with us."""
        try:
            offer = core.plain_call(
                index, "OfferSegment", pb.OfferSegmentRequest(nbytes=self.segment_bytes),
                _HANDSHAKE_TIMEOUT_S,
            )  # fmt: skip
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # its bounds: no more of them
                with self._lock:
                    self._cap[server] = self._count.get(server, 1) - 1
            elif exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                self._turn_off(server, f"{exc.code().name}: {details_of(exc)}")
            return None  # a server down now may share memory once it is back
        try:
            fd = _receive_fd(offer.socket, offer.ticket)
        except OSError as exc:
            self._turn_off(server, f"its socket {offer.socket}: {exc}")
            return None
        try:
            if offer.nbytes != self.segment_bytes:  # our payloads and replies fill what we asked
                raise OSError(f"a segment of {offer.nbytes:,} bytes, not {self.segment_bytes:,}")
            if not is_sealed(fd, offer.nbytes):  # its size could change under our mapping
                raise OSError(f"the segment is not sealed at {offer.nbytes:,} bytes")
            mapped = mmap.mmap(fd, offer.nbytes)
        except (OSError, ValueError) as exc:
            self._turn_off(server, f"mapping the segment: {exc}")
            return None
        finally:
            os.close(fd)
        seg = Segment(server, offer.segment, mapped)
        try:
            core.plain_call(
                index, "ConfirmSegment",
                pb.ConfirmSegmentRequest(segment=offer.segment, proof=bytes(mapped[:PROOF_BYTES])),
                _HANDSHAKE_TIMEOUT_S,
            )  # fmt: skip
        except grpc.RpcError as exc:
            _unmap(seg)
            if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                self._turn_off(server, f"{exc.code().name}: {details_of(exc)}")
            return None
        self.opened += 1
        return seg

    def _turn_off(self, server: str, why: str) -> None:
        log.debug("server %s: payloads stay in-band (%s)", server, why)
        with self._lock:
            self._off.add(server)

    def _release(self, server: str, ids: list[int], timeout: float) -> None:
        core, index = self._via[server]
        try:
            core.plain_call(
                index, "ReleaseSegments", pb.ReleaseSegmentsRequest(segments=ids), timeout
            )
        except (grpc.RpcError, ValueError):  # ValueError: the spec's channels were closed
            pass  # the server drops idle segments itself


def handover_name() -> str:
    """A new name for a server's handover socket, unique on its host: without the ``@`` that
    marks it abstract in an offer."""
    return f"paramshard-shm-{os.getpid()}-{secrets.token_hex(8)}"


def _receive_fd(name: str, ticket: bytes) -> int:
    """The memfd the server hands over on its abstract socket ``@name`` for ``ticket``; nothing
    is sent to a socket that is not a server's handover socket, nor a ticket of another size."""
    if not _HANDOVER.fullmatch(name) or not hasattr(socket, "recv_fds"):
        raise OSError(f"not a paramshard server's handover socket: {name[:80]!r}")
    if len(ticket) != TICKET_BYTES:
        raise OSError(f"a ticket of {len(ticket):,} bytes, not {TICKET_BYTES}")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(_HANDSHAKE_TIMEOUT_S)
        sock.connect("\0" + name[1:])
        sock.sendall(ticket)
        msg, fds, _, _ = socket.recv_fds(sock, 16, 1)
    if msg != b"ok" or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise OSError(f"the server refused the ticket ({msg!r})")
    return fds[0]


def seal(fd: int) -> None:
    """Seals memfd ``fd`` (made with ``MFD_ALLOW_SEALING``) at its size: ``SEALS``."""
    fcntl.fcntl(fd, _F_ADD_SEALS, SEALS)


def is_sealed(fd: int, nbytes: int) -> bool:
    """Whether ``fd`` has ``nbytes`` bytes and cannot shrink or grow (``SEALS``)."""
    try:
        return fcntl.fcntl(fd, _F_GET_SEALS) & SEALS == SEALS and os.fstat(fd).st_size == nbytes
    except OSError:
        return False


def _unmap(seg: Segment) -> None:
    try:
        seg.map.close()
    except BufferError:  # a reply view still reads it: unmapped with the last view
        pass
