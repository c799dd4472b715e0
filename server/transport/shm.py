"""Shared-memory segments for clients on this host (docs/design.md §7.2).

A client calls ``OfferSegment``; the server creates an anonymous memory file (``memfd``: it is
never in a file system, so nothing outlives a SIGKILL of either side), seals it at its size
(``F_SEAL_SHRINK | F_SEAL_GROW``, protos/shm.py ``SEALS``: a caller that shrank the file under
the server's mapping would make the server die of SIGBUS at its next read or write there; the
seals are checked again at confirm), maps it, writes ``PROOF_BYTES`` random bytes at its
start, and answers with the segment's id, a one-time ticket and the name of its own abstract
Unix socket. The client connects there, sends the ticket, receives the file descriptor
(SCM_RIGHTS; server/transport/handover.py serves every connection at once, none able to
delay another), maps it and calls ``ConfirmSegment`` with the bytes it finds at the start:
that proves it shares this host's memory with the server (an abstract socket is reachable only
within one network namespace, and a client in another one, or on another host, fails here and
keeps sending its payloads in-band). Whether a client and a server share memory is found this
way, never by comparing addresses.

A tensor message then carries a ``ShmRef`` (segment, offset, bytes) instead of its payload, and
the server reads (or, for replies, writes) the bytes in place. The registry refuses any
reference to a segment that is unknown, unconfirmed, out of range, or offered to another caller
(segments belong to the caller's token: every container may run as the same uid, so file modes
would isolate nothing). Bounds: ``MAX_SEGMENTS`` segments and ``MAX_OWNER_BYTES`` bytes per
caller, each segment paid for from the server's memory budget, except a ``read`` token's: those
come from a pool of their own (server/transport/read_pool.py) and take replies only, so read
tokens never hold memory a trainer needs; a segment not confirmed within ``CONFIRM_S`` or idle
for ``idle_s`` is dropped (the sweeper), as are the ones a client releases.
``PARAMSHARD_SHM=0`` on the client turns the path off.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import grpc

from paramshard.protos import codec
from paramshard.protos import shard_pb2 as pb
from paramshard.protos.shm import PROOF_BYTES, TICKET_BYTES, is_sealed
from paramshard.server.rpc.auth import caller_of
from paramshard.server.rpc.parsers import plain
from paramshard.server.runtime.errors import ShardError
from paramshard.server.runtime.limits import MemoryBudget
from paramshard.server.transport import segment_files
from paramshard.server.transport.handover import Handover
from paramshard.server.transport.read_pool import ReadPool
from paramshard.server.transport.segment_files import Segment

__all__ = ["SegmentRegistry", "PROOF_BYTES", "MAX_SEGMENTS", "MAX_OWNER_BYTES"]

log = logging.getLogger(__name__)

MAX_SEGMENTS = 128  # per caller (token): 8 trainers sharing a token, 16 each
MAX_OWNER_BYTES = 4 * 2**30  # per caller (token)
MAX_SEGMENT_BYTES = 1 * 2**30
CONFIRM_S = 10.0  # an offered segment not confirmed by then is dropped


class SegmentRegistry:
    """The segments this server has offered, by id; their socket; their memory."""

    def __init__(self, budget: MemoryBudget, idle_s: float = 600.0) -> None:
        self.budget = budget
        self.idle_s = idle_s
        self.max_segment_bytes = MAX_SEGMENT_BYTES  # the server lowers it to its message limit
        self._lock = threading.Lock()
        self._segments: dict[int, Segment] = {}
        self._by_ticket: dict[bytes, int] = {}
        self._handover: Handover | None = None
        self._read_pool = ReadPool()  # read tokens' segments, under _lock
        self._offering: Counter[str] = Counter()  # offers checked, not yet in _segments
        self._lingering: list[Segment] = []  # dropped while a call still holds a view of it
        self.max_total = segment_files.segment_bound()
        self.role_of: Callable[[Any], str | None] | None = None  # metadata -> role (the app's)
        self._closed = False
        # payloads and replies that went through segments; request payloads that did not
        self.views = self.in_band = 0

    # -- the calls ---------------------------------------------------------------------------
    def offer(
        self, owner: str, req: pb.OfferSegmentRequest, role: str | None = None
    ) -> pb.OfferSegmentReply:
        """A new segment for ``owner``; a ``read`` token's comes from the read pool."""
        nbytes = int(req.nbytes)
        reader = role == "read"
        if not PROOF_BYTES <= nbytes <= MAX_SEGMENT_BYTES:
            raise ShardError.invalid(
                f"a segment has {PROOF_BYTES}..{MAX_SEGMENT_BYTES:,} bytes, not {nbytes:,}"
            )
        if nbytes > self.max_segment_bytes:  # no payload larger than a message may be
            raise ShardError.exhausted(
                f"a segment of {nbytes:,} bytes is larger than this server's largest request,"
                f" {self.max_segment_bytes:,} bytes (--max-receive-mb)"
            )
        if not hasattr(os, "memfd_create") or not hasattr(socket, "send_fds"):
            raise ShardError.precondition("this server cannot share memory (no memfd)")
        name = self._socket_name()
        with self._lock:
            mine = [s for s in self._segments.values() if s.owner == owner]
            held = len(mine) + self._offering[owner]  # offers in flight count: no race past
            if held >= MAX_SEGMENTS or sum(s.nbytes for s in mine) + nbytes > MAX_OWNER_BYTES:
                raise ShardError.exhausted(
                    f"this caller holds {held} segments of {sum(s.nbytes for s in mine):,}"
                    f" bytes; at most {MAX_SEGMENTS} of {MAX_OWNER_BYTES:,} bytes in all"
                    " (ReleaseSegments gives them back)"
                )
            if len(self._segments) + sum(self._offering.values()) >= self.max_total:
                raise ShardError.exhausted(
                    f"this server holds {len(self._segments)} shared segments, the most its"
                    f" file descriptor limit leaves room for (two each); payloads go in-band"
                    " meanwhile (raise the server's ulimit -n)"
                )
            if reader:
                self._read_pool.pay(owner, held, nbytes)
            else:
                self.budget.reserve(nbytes, "shm", f"a shared segment of {nbytes:,} bytes")
            self._offering[owner] += 1
        return self._make(owner, nbytes, reader, name)

    def _offered(self, owner: str) -> None:
        """Ends an offer's count in flight (caller holds the lock): it is listed, or failed."""
        self._offering[owner] -= 1
        if not self._offering[owner]:
            del self._offering[owner]

    def _make(self, owner: str, nbytes: int, reader: bool, name: str) -> pb.OfferSegmentReply:
        """The segment an offer paid for: made, mapped, sealed and listed (refunded if not);
        ``name``: the handover socket's. It moves from the offers in flight to the listed
        segments in one step, so it is never counted twice against its caller's bound."""
        try:
            fd, mapped = segment_files.create(nbytes)
        except BaseException:
            self._refund(owner, nbytes, reader)
            with self._lock:
                self._offered(owner)
            raise
        proof = secrets.token_bytes(PROOF_BYTES)
        mapped[:PROOF_BYTES] = proof
        seg = Segment(owner, nbytes, fd, mapped, secrets.token_bytes(TICKET_BYTES), proof,
                       time.monotonic(), reader)  # fmt: skip
        with self._lock:
            closed = self._closed  # ``close`` ran while this offer made it: never listed
            segment_id = secrets.randbits(63) or 1
            while segment_id in self._segments:
                segment_id = secrets.randbits(63) or 1
            if not closed:
                self._segments[segment_id] = seg
                self._by_ticket[seg.ticket] = segment_id
            self._offered(owner)
        if closed:
            os.close(fd)
            self._unmap(seg)
            raise ShardError.precondition("the server is stopping")
        return pb.OfferSegmentReply(
            segment=segment_id, socket="@" + name, ticket=seg.ticket, nbytes=nbytes
        )

    def confirm(self, owner: str, req: pb.ConfirmSegmentRequest) -> pb.ConfirmSegmentReply:
        with self._lock:
            seg = self._segments.get(req.segment)
            if seg is None or seg.owner != owner:
                raise ShardError.not_found(f"no segment {req.segment} was offered to this caller")
            if not seg.handed or not hmac.compare_digest(req.proof, seg.proof):
                raise ShardError.precondition(
                    f"segment {req.segment}: the proof does not match what the server wrote;"
                    " the caller does not share this server's memory"
                )
            if not is_sealed(seg.fd, seg.nbytes):
                raise ShardError.precondition(
                    f"segment {req.segment} is not sealed against shrinking and growing at"
                    f" {seg.nbytes:,} bytes; the server does not use it"
                )
            seg.confirmed = True
            seg.last_used = time.monotonic()
        return pb.ConfirmSegmentReply()

    def release(self, owner: str, req: pb.ReleaseSegmentsRequest) -> pb.ReleaseSegmentsReply:
        if len(req.segments) > MAX_SEGMENTS:  # refused before a set of them is built
            raise ShardError.invalid(
                f"{len(req.segments):,} segments named; a caller holds at most {MAX_SEGMENTS}"
            )
        with self._lock:
            gone = [
                self._segments.pop(i)
                for i in set(req.segments)
                if i in self._segments and self._segments[i].owner == owner
            ]
        for seg in gone:
            self._drop(seg)
        return pb.ReleaseSegmentsReply(released=len(gone))

    def view(self, owner: str, ref: pb.ShmRef, reply: bool = False) -> memoryview:
        """The ``ref.nbytes`` bytes at ``ref.offset`` of a confirmed segment of ``owner``
        (``reply``: for a reply; a read token's segment takes nothing else)."""
        with self._lock:
            seg = self._segments.get(ref.segment)
            if seg is None or seg.owner != owner or not seg.confirmed:
                raise ShardError.precondition(
                    f"shared segment {ref.segment} is unknown here (released, expired, or"
                    " the server restarted); send the payload in-band"
                )
            if seg.reader and not reply:
                raise ShardError(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"shared segment {ref.segment} is a read token's: it takes replies only",
                )
            if ref.offset + ref.nbytes > seg.nbytes:
                raise ShardError.invalid(
                    f"shared segment {ref.segment}: bytes {ref.offset:,} to"
                    f" {ref.offset + ref.nbytes:,} are outside its {seg.nbytes:,}"
                )
            seg.last_used = time.monotonic()
            self.views += 1
            return memoryview(seg.map)[ref.offset : ref.offset + ref.nbytes]

    # -- the servicer's side ------------------------------------------------------------------
    def handlers(self) -> dict[str, tuple[Callable, Callable, Callable]]:
        """The segment methods for the servicer's table: name -> (handler, parser, serializer)."""
        table: dict[str, tuple[Callable, Callable, Callable]] = {
            name: (
                lambda req, context, fn=fn: fn(caller(context), req),
                plain(request_cls),
                codec.serialize,
            )
            for name, fn, request_cls in (
                ("ConfirmSegment", self.confirm, pb.ConfirmSegmentRequest),
                ("ReleaseSegments", self.release, pb.ReleaseSegmentsRequest),
            )
        }
        table["OfferSegment"] = (
            lambda req, context: self.offer(caller(context), req, self._role(context)),
            plain(pb.OfferSegmentRequest),
            codec.serialize,
        )
        return table

    def _role(self, context: Any) -> str | None:
        """The caller's role (None without tokens, or in this process)."""
        metadata = getattr(context, "invocation_metadata", None)
        if self.role_of is None or metadata is None:
            return None
        return self.role_of(metadata())

    def payload(self, msg: tuple[Any, memoryview], context: Any) -> tuple[Any, memoryview]:
        """A tensor request's (header, payload), the payload read from its segment when the
        header references one."""
        header, data = msg
        if not header.HasField("shm"):
            self.in_band += len(data) > 0
            return header, data
        if len(data):
            raise ShardError.invalid("a payload both in-band and in a shared segment")
        return header, self.view(caller(context), header.shm)

    def chunk_bytes(self, chunk: pb.ReplicaChunk, context: Any) -> bytes:
        """A replica chunk's bytes in one copy: out of the caller's segment when it references
        one (server/replication/neighbour_shm.py), else out of the message. Put back into the
        message and read out again, they took two copies more: 0.33 s of a server's CPU a
        replica of GPT-2 124M's 712 MB, measured."""
        data = chunk.data
        if chunk.HasField("shm"):
            _, view = self.payload((chunk, memoryview(data)), context)
            return bytes(view)
        return data

    def reply_view(self, req: Any, context: Any) -> memoryview | None:
        """The caller's ``reply_shm``, checked before the call does anything: a slot read
        frees what it read, so a segment refused after it would lose the values."""
        if not req.HasField("reply_shm"):
            return None
        return self.view(caller(context), req.reply_shm, reply=True)

    @staticmethod
    def reply(req: Any, view: memoryview | None, header: Any, payload: Any) -> Any:
        """A tensor reply for ``req``: its payload written into ``view`` (``reply_view``; the
        header then says where) when there is one and the payload fits, else (header,
        payload) as usual."""
        if view is None:
            return header, payload
        data = codec.byte_view(payload)
        if data.nbytes > view.nbytes:
            return header, payload
        codec.copy_into(view, data)
        ref = req.reply_shm
        header.shm.CopyFrom(pb.ShmRef(segment=ref.segment, offset=ref.offset, nbytes=data.nbytes))
        return header, b""

    def reply_encoder(self, req: Any, context: Any, encode: Callable | None) -> Callable | None:
        """PullParams' ``encode`` (run under the slice's lock): into the caller's segment
        when it asked for that (checked now, before the pull waits)."""
        view = self.reply_view(req, context)
        if view is None:
            return encode

        def into_segment(header: Any, payload: Any) -> Any:
            return codec.encode(*self.reply(req, view, header, payload))

        return into_segment

    # -- upkeep ------------------------------------------------------------------------------
    def expire(self) -> int:
        """Drops segments offered but not confirmed within CONFIRM_S, or idle for idle_s, and
        unmaps (and refunds) dropped segments whose last view has gone."""
        now = time.monotonic()
        with self._lock:
            lingering, self._lingering = self._lingering, []
        for seg in lingering:
            self._unmap(seg)
        with self._lock:
            old = [
                i
                for i, s in self._segments.items()
                if (not s.confirmed and now - s.created > CONFIRM_S)
                or now - s.last_used > self.idle_s
            ]
            gone = [self._segments.pop(i) for i in old]
        for seg in gone:
            self._drop(seg)
        return len(gone)

    def usage(self) -> tuple[int, int]:
        with self._lock:
            return len(self._segments), sum(s.nbytes for s in self._segments.values())

    def close(self) -> None:
        with self._lock:
            self._closed = True
            gone = list(self._segments.values())
            self._segments.clear()
            handover, self._handover = self._handover, None
        for seg in gone:
            self._drop(seg)
        if handover is not None:
            handover.close()

    def _drop(self, seg: Segment) -> None:
        with self._lock:
            self._by_ticket.pop(seg.ticket, None)
        os.close(seg.fd)
        self._unmap(seg)

    def _unmap(self, seg: Segment) -> None:
        """Unmaps ``seg`` and refunds its memory, or, while a call still holds a view of it (a
        pull waiting to write its reply there), keeps it mapped and paid for until ``expire``
        finds the view gone: its pages live as long as the mapping."""
        try:
            seg.map.close()
        except BufferError:
            with self._lock:
                self._lingering.append(seg)
            return
        self._refund(seg.owner, seg.nbytes, seg.reader)

    def _refund(self, owner: str, nbytes: int, reader: bool) -> None:
        if reader:
            with self._lock:
                self._read_pool.refund(owner, nbytes)
        else:
            self.budget.release(nbytes, "shm")

    # -- the socket the descriptors travel through --------------------------------------------
    def _socket_name(self) -> str:
        with self._lock:
            if self._closed:
                raise ShardError.precondition("the server is stopping")
            if self._handover is None:
                self._handover = Handover(self._claim)
            return self._handover.name

    def _claim(self, ticket: bytes) -> int | None:
        """For the handover: a copy of the descriptor of the segment offered with ``ticket``
        (once: one ticket, one descriptor), None for a ticket nobody holds."""
        with self._lock:
            segment_id = self._by_ticket.pop(ticket, None)
            seg = self._segments.get(segment_id) if segment_id is not None else None
            if seg is None:
                return None
            seg.handed = True
            return os.dup(seg.fd)  # a release meanwhile closes seg.fd, never this one


def caller(context: Any) -> str:
    """Who owns a segment: the caller's token ("" without one, or for a call in this process;
    every server's derived peer credential is one owner, auth.caller_id)."""
    return caller_of(context) or ""
