"""One client's Session stream on this server (server/transport/sessions.py holds the Session
method, its pool and its bounds over every stream): the reader thread that takes the calls of
the client's batches within the bounds, the calls run or waiting in line, and the replies sent
back in batches."""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc

from paramshard.protos import shard_pb2 as pb
from paramshard.protos.batches import TooManyCalls, take_ready
from paramshard.server.rpc import scopes
from paramshard.server.rpc.admission import ANSWERS_AT_ONCE, WAITING_METHODS
from paramshard.server.rpc.parsers import Malformed
from paramshard.server.runtime.thread_names import name_this_thread
from paramshard.server.transport.session_bounds import (
    BATCH_BYTES,
    INLINE_BYTES,
    MAX_CALLS,
    MAX_HELD_BYTES,
    MAX_UNSENT,
    MAX_UNSENT_BYTES,
    MAX_WAITING,
    SESSIONS_BYTES,
)
from paramshard.server.transport.session_calls import (
    SessionJob,
    body_size,
    call_refusal,
    payload_bytes,
    run_call,
    status_reply,
)
from paramshard.server.transport.waiting_line import InLine

__all__ = ["SessionStream", "END", "BUDGET_POLL_S"]

log = logging.getLogger(__name__)

BUDGET_POLL_S = 0.05
"""How often a session held back by ``SESSIONS_BYTES`` (others' bytes too) looks again."""
END = object()
"""What ends the replies' queue of a stream."""


class SessionStream:
    """One open Session stream: its reader thread takes the client's calls within the
    bounds (server/transport/session_bounds.py), runs or queues them, and its replies go
    back in batches."""

    def __init__(
        self,
        sessions: Any,
        context: grpc.ServicerContext,
        role: str | None,
        caller: str | None,
        scope: scopes.Scope | None = None,
    ) -> None:
        self.s, self.context, self.role, self.scope = sessions, context, role, scope
        self.caller = caller  # the token: the gate bounds one caller's waiting calls
        self.out: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.in_flight = 0  # calls taken and not yet replied to
        self.waiting = 0  # of them, calls that may wait (for other callers)
        self.unsent = 0  # replies in ``out``
        self.unsent_bytes = 0  # and their bytes
        self.promised = 0  # reply bytes of the calls taken whose replies are not made yet
        self.held = 0  # request bytes of the calls taken and not yet run to their end
        self.drained = threading.Condition(self.lock)  # unsent or held went down, or we stopped
        self.stopped = False  # the stream's side is gone: nobody drains ``out`` any more
        self.ended: tuple[grpc.StatusCode, str] | None = None  # why the session was ended

    # -- the reader thread ---------------------------------------------------------------
    def read(self, batches: Iterator[Any]) -> None:
        """Takes the calls of ``batches`` until the client ends them or goes away; the
        replies' stream then ends (``END``) whatever stopped the reading: before, a reader
        held back by the bounds (``room``) whose client went away left the stream waiting
        for replies, its calls and bytes held, until one of its calls ended."""
        name_this_thread()
        try:
            for batch in batches:
                if isinstance(batch, Malformed):
                    if isinstance(batch.error, TooManyCalls):
                        self.end(grpc.StatusCode.RESOURCE_EXHAUSTED, str(batch.error))
                    else:
                        why = f"a batch does not parse: {batch.error}"
                        self.end(grpc.StatusCode.INVALID_ARGUMENT, why)
                    return
                for call, body in batch:
                    if not self.room():
                        return
                    self.start(call, body)
            self._replied()  # the client sent its last call and reads on: answer them all
        except grpc.RpcError:
            pass  # the client went away (cancelled, connection lost)
        except Exception as exc:  # a bug, not bad input: say so, keep serving the others
            log.exception("session reader failed")
            self.end(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        finally:
            self.out.put(END)  # a second one after ``end``'s is never read

    def _replied(self) -> None:
        """Waits until every call taken has its reply handed to gRPC, while the stream lives
        (a client that half-closes its side still reads the replies)."""
        with self.drained:
            while self.in_flight and not self.stopped and self.context.is_active():
                self.drained.wait(1.0)  # ``replies`` notifies as it hands them over

    def room(self) -> bool:
        """Waits while the replies not yet sent, or the requests not yet run, are past their
        bounds, this session's or the server's; False once the stream is gone (nothing will
        drain them)."""
        with self.drained:
            while not self.stopped:
                if (
                    self.unsent >= MAX_UNSENT
                    or self.unsent_bytes >= MAX_UNSENT_BYTES
                    or self.held >= MAX_HELD_BYTES
                ):
                    self.drained.wait(1.0)  # this session's replies or calls end: notified
                elif self._over_share():
                    self.drained.wait(BUDGET_POLL_S)  # other sessions' bytes: not notified
                else:
                    return True
                if not self.context.is_active():
                    return False
            return False

    def _over_share(self) -> bool:
        """Whether the server's sessions hold ``SESSIONS_BYTES`` or more, this one at least
        its share of them (a session holding none is always read)."""
        own = self.held + self.unsent_bytes
        return (
            own > 0
            and self.s.held_bytes >= SESSIONS_BYTES
            and own * max(1, self.s.gate.sessions) >= SESSIONS_BYTES
        )

    def _add(
        self, held: int = 0, replies: int = 0, reply_bytes: int = 0, promised: int = 0
    ) -> None:
        """Adds to the request bytes held, the replies unsent (and their bytes) and the reply
        bytes promised, under ``lock``; the bytes held and unsent go to the server's total
        too. Once the session stopped, its unsent replies left the total (nobody sends
        them), while its calls still running hold their requests until they end."""
        self.held += held
        self.unsent += replies
        self.unsent_bytes += reply_bytes
        self.promised += promised
        with self.s.count_lock:
            self.s.held_bytes += held + (0 if self.stopped else reply_bytes)

    def put(
        self, counted: int, reply: tuple[pb.SessionCall, Any], size: int = 0, promised: int = 0
    ) -> None:
        """Queues a reply of ``size`` payload bytes, in place of the ``promised`` ones;
        ``counted``: whether it ends a call counted in flight."""
        size += reply[0].ByteSize()
        with self.lock:
            self._add(replies=1, reply_bytes=size, promised=-promised)
        self.out.put((counted, size, reply))

    def end(self, code: grpc.StatusCode, details: str) -> None:
        self.ended = (code, f"Session: {details}")
        self.out.put(END)

    def drain(self, why: str) -> None:
        """The server is stopping (``Sessions.stopping``, set before this runs): the
        session ends now if no call is in flight, else once the last has replied."""
        with self.lock:
            idle = self.in_flight == 0
        if idle:
            self.end(grpc.StatusCode.UNAVAILABLE, why)

    def refuse(self, reply: tuple[pb.SessionCall, bytes]) -> None:
        """A reply to a call refused before it counted as in flight."""
        self.put(0, reply)

    def start(self, call: pb.SessionCall, body: memoryview) -> None:
        """Checks ``call`` and runs it, here or on the pool; its reply goes to ``out``."""
        method = call.method
        refused = call_refusal(self.s.handlers, method, body, self.role, self.scope)
        if refused:
            return self.refuse(status_reply(call.id, *refused))
        finite = math.isfinite(call.timeout_s) and call.timeout_s > 0
        deadline = time.monotonic() + call.timeout_s if finite else None  # from its arrival
        fn, parse, serialize = self.s.handlers[method]
        request = parse(body)
        refused = self.scope and scopes.mismatch(self.scope, method, request)
        if refused:
            return self.refuse(status_reply(call.id, *refused))
        waits = None
        if method in WAITING_METHODS and self.s.may_wait(method, request):
            waits = self.role or "train"
        promised = self.s.reply_bytes(method, request) if self.s.reply_bytes else 0
        with self.lock:
            stopping = self.s.stopping  # under the lock ``drain`` takes: counted, or refused
            crowded = self._full(waits is not None, promised)
            if crowded is not None and waits is not None and method in ANSWERS_AT_ONCE:
                waits, deadline = None, time.monotonic()  # it answers at once, not waiting
                crowded = self._full(False, promised)
            if crowded is None and stopping is None:
                self.in_flight += 1
                self.waiting += waits is not None
                self._add(promised=promised)
        if stopping is not None:  # the server is stopping: the client sends it again
            return self.refuse(status_reply(call.id, grpc.StatusCode.UNAVAILABLE, stopping))
        if crowded is not None:
            return self.refuse(
                status_reply(call.id, grpc.StatusCode.RESOURCE_EXHAUSTED, f"{method}: {crowded}")
            )
        job = SessionJob(
            call.id, method, fn, serialize, request, deadline, waits, len(body), promised
        )
        with self.lock:
            self._add(held=job.received)
        if waits is not None and method not in ANSWERS_AT_ONCE:
            if self.s.line.enter(InLine(self, job)):  # else it waits in line for the gate
                self.s.pool.submit(self.run, job)
            return None
        _, admitted = self.s.gate.admit(method, waits, self.caller)  # never refused here
        if admitted != waits:  # past the gate's bounds: it answers at once (ANSWERS_AT_ONCE)
            self.call_ended(waits)
            job = job._replace(waits=None, deadline=time.monotonic())
        if method == "Contribute" and payload_bytes(request) <= INLINE_BYTES:
            self.run(job)
        else:
            self.s.pool.submit(self.run, job)
        return None

    def _full(self, waits: bool, promised: int) -> str | None:
        """Why a call that may wait (``waits``) and whose reply may carry ``promised`` bytes
        cannot be taken now ("retry later"), None when it can; under ``lock``."""
        if self.in_flight >= MAX_CALLS:
            return f"{MAX_CALLS} calls of this session are in flight, its bound; retry later"
        if waits and self.waiting >= MAX_WAITING:
            return f"{MAX_WAITING} calls of this session are waiting, its bound; retry later"
        coming = self.unsent_bytes + self.promised
        if promised and coming and coming + promised > MAX_UNSENT_BYTES:
            return (
                f"the replies of this session's calls, unsent or to come, hold {coming:,}"
                f" bytes; with this one's {promised:,} they would pass the bound of"
                f" {MAX_UNSENT_BYTES:,}; retry later"
            )
        return None

    def call_ended(self, waits: str | None, received: int = 0) -> None:
        """A call taken with ``waits`` and ``received`` request bytes has ended."""
        with self.drained:
            self.waiting -= waits is not None
            if received:
                self._add(held=-received)
                self.drained.notify_all()

    def run(self, job: SessionJob) -> None:
        """Runs a call taken (on the pool, or on the reader for a small contribution) and
        queues its reply."""
        began = time.perf_counter()
        try:
            reply, code = run_call(job, self.context)
        finally:
            self.s.gate.leave(job.waits, self.caller)
            self.call_ended(job.waits, job.received)
        with self.s.count_lock:
            self.s.calls += 1
        size = body_size(reply[1])
        if self.s.observe is not None:
            self.s.observe(job.method, code, time.perf_counter() - began, job.received, size)
        self.put(1, reply, size, job.promised)

    # -- the stream's thread ---------------------------------------------------------------
    def replies(self) -> Iterator[list[tuple[pb.SessionCall, Any]]]:
        """Batches of the replies ready, until the client ends the session."""
        while True:
            items, ended = take_ready(self.out, END, BATCH_BYTES, lambda item: item[1])
            if items:
                yield [reply for _, _, reply in items]
                with self.drained:  # handed to gRPC, which asks for the next batch
                    self.in_flight -= sum(counted for counted, _, _ in items)
                    sent = sum(size for _, size, _ in items)
                    self._add(replies=-len(items), reply_bytes=-sent)
                    self.drained.notify_all()
                    stopping = self.s.stopping if self.in_flight == 0 else None
                if stopping is not None and not ended:
                    self.end(grpc.StatusCode.UNAVAILABLE, stopping)
            if ended:
                return

    def close(self) -> None:
        """The stream's side is gone: its unsent replies leave the server's total, its calls
        in line leave the line (before, they stayed until the sweep, their requests held
        and no longer counted), its running calls' replies go nowhere, and the server
        forgets it."""
        with self.drained:
            with self.s.count_lock:
                self.s.held_bytes -= self.unsent_bytes
            self.stopped = True
            self.drained.notify_all()
        self.s.line.drop(self)
        with self.s.count_lock:
            self.s.live.discard(self)
