"""A client's sessions: one persistent stream per server carrying its data-plane calls
(server/transport/sessions.py, docs/design.md §7.3).

Unary calls cost grpcio a call's setup on both sides, and the first future after an idle spell
makes grpcio start a polling thread for the channel; a session opens once and stays open, and
each batch it sends holds every call that was ready (a reduce-scatter's contributions and the
read of its own slice travel together). A session opens on the first data-plane call to a
server: the client waits for the server's empty first batch, and a server that refuses (an older
server, one with ``--max-sessions 0`` or at its bound, a token it does not take) gets that
client's calls one by one, as before; it is asked again after ``RETRY_OPEN_S``, or after
``RETRY_UNREACHABLE_S`` when no server answered (UNAVAILABLE: one that is still starting, or
restarting, is not a server that refused, and its calls should not go one by one for half a
minute once it is up). A session that breaks fails its calls in flight with UNAVAILABLE (every
call is idempotent: ``RpcCore.run`` sends them again) and the next call opens a new one.
``PARAMSHARD_SESSIONS=0`` turns sessions off.

Only calls whose message is at most ``MAX_BODY`` bytes travel in sessions: a tensor whose
payload is in a shared segment, or a small one. A large in-band payload goes as its own call,
whose setup costs little beside its bytes, and which a session would copy once more.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from paramshard.client.local_calls import LocalRpcError
from paramshard.protos import closing
from paramshard.protos import shard_pb2 as pb
from paramshard.protos.batches import MAX_BATCH, decode_batch, encode_batch, take_ready
from paramshard.protos.service import method_path
from paramshard.protos.words import details_of, said

__all__ = ["Sessions", "MAX_BODY", "enabled"]

log = logging.getLogger(__name__)

MAX_BODY = 256 * 2**10
OPEN_TIMEOUT_S = 5.0
RETRY_OPEN_S = 30.0
RETRY_UNREACHABLE_S = 1.0
_REPLY_GRACE_S = 2.0  # past its deadline, a call without a reply fails here
_SERVICE = method_path("Session")


def enabled() -> bool:
    """Whether clients of this process open sessions (``PARAMSHARD_SESSIONS`` is not 0)."""
    return os.environ.get("PARAMSHARD_SESSIONS", "1").strip() not in ("0", "false", "off", "no")


class SessionFuture:
    """One call of a session, as ``RpcCore.run`` uses a grpc.Future."""

    def __init__(self, deserialize: Callable[[bytes], Any], timeout: float) -> None:
        self._deserialize = deserialize
        self._deadline = time.monotonic() + timeout
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[Any], None]] = []
        self._reply: Any = None
        self._error: grpc.RpcError | None = None
        self._cancelled = False

    def _finish(self, reply: Any = None, error: grpc.RpcError | None = None, cancel=False) -> bool:
        with self._lock:
            if self._done.is_set():
                return False
            self._reply, self._error, self._cancelled = reply, error, cancel
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn(self)
        return True

    def resolve(self, reply: pb.SessionCall, body: memoryview) -> None:
        if reply.code:
            code = _CODES.get(reply.code, grpc.StatusCode.UNKNOWN)
            self._finish(error=LocalRpcError(code, said(reply.details)))  # a status's are bounded
            return
        try:
            parsed = self._deserialize(body)
        except Exception as exc:  # noqa: BLE001 - the server's reply is not what it should be
            self._finish(error=LocalRpcError(grpc.StatusCode.INTERNAL, f"bad reply: {exc}"))
            return
        self._finish(parsed)

    def fail(self, code: grpc.StatusCode, details: str) -> None:
        self._finish(error=LocalRpcError(code, details))

    def cancel(self) -> bool:
        return self._finish(cancel=True)

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    def result(self, timeout: float | None = None) -> Any:
        wait = self._deadline + _REPLY_GRACE_S - time.monotonic()
        if not self._done.wait(max(0.0, wait if timeout is None else min(wait, timeout))):
            self.fail(grpc.StatusCode.DEADLINE_EXCEEDED, "no reply in the session by the deadline")
        if self._cancelled:
            raise grpc.FutureCancelledError()
        if self._error is not None:
            raise self._error
        return self._reply


_CODES = {code.value[0]: code for code in grpc.StatusCode}


class _Session:
    """One open stream to one server."""

    def __init__(self, channel: grpc.Channel, metadata: Any, address: str) -> None:
        self.address = address
        self._out: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._pending: dict[int, SessionFuture] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._opened = threading.Event()
        self.broken: str | None = None  # why it ended
        # how it ended: UNAVAILABLE, no server answered (yet); RESOURCE_EXHAUSTED, the
        # server's sessions are at a bound
        self.code: grpc.StatusCode | None = None
        stub = channel.stream_stream(
            _SERVICE, request_serializer=encode_batch, response_deserializer=self._decode
        )
        self._call = stub(self._batches(), metadata=metadata)
        self._receiver = threading.Thread(
            target=self._receive, args=(self._call,), name="session-receiver", daemon=True
        )
        self._receiver.start()

    @staticmethod
    def _decode(raw: bytes) -> list[tuple[pb.SessionCall, memoryview]]:
        """A batch of replies: at most ``MAX_BATCH`` (a server sends no more than the calls in
        flight), refused before the rest is parsed: a lying server's batch of a million empty
        replies took 810 MB and 3.3 s of the receiver, and ended the session's calls."""
        return decode_batch(raw, limit=MAX_BATCH)

    def wait_open(self, timeout: float) -> bool:
        """Whether the server opened it within ``timeout``; if not, it is closed, and never
        used: its close waits for the receiver only ``closing.step_s()``, and on a loaded
        machine the receiver may not have marked it broken by then."""
        if not self._opened.wait(timeout):
            self.close()
            return False
        return self.broken is None

    def submit(
        self, method: str, body: bytes, deserialize: Callable[[bytes], Any], timeout: float
    ) -> SessionFuture | None:
        """Sends one call; None when the session has ended (send it some other way)."""
        fut = SessionFuture(deserialize, timeout)
        with self._lock:
            if self.broken is not None:
                return None
            call_id = next(self._ids)
            self._pending[call_id] = fut
        fut.add_done_callback(lambda _: self._forget(call_id))
        self._out.put((pb.SessionCall(id=call_id, method=method, timeout_s=timeout), body))
        return fut

    def _forget(self, call_id: int) -> None:
        with self._lock:
            self._pending.pop(call_id, None)

    def _batches(self) -> Any:
        """The request stream: each batch holds every call queued by the time it is sent."""
        while True:
            calls, ended = take_ready(self._out, None)
            if calls:
                yield calls
            if ended:
                return

    def _receive(self, call: Any) -> None:
        why = "the server ended it"
        try:
            for batch in call:
                self._opened.set()
                for reply, body in batch:
                    with self._lock:
                        fut = self._pending.get(reply.id)
                    if fut is not None:
                        fut.resolve(reply, body)
        except grpc.RpcError as exc:
            why = f"{exc.code().name}: {details_of(exc)}"
            self.code = exc.code()
            closing.unlink(exc)
        except Exception as exc:  # noqa: BLE001 - whatever it was, the session is over
            why = f"{type(exc).__name__}: {exc}"
        with self._lock:
            self.broken = why
            pending, self._pending = list(self._pending.values()), {}
        self._opened.set()
        for fut in pending:  # what the server did with them is unknown: retried (idempotent)
            fut.fail(grpc.StatusCode.UNAVAILABLE, f"the session to {self.address} ended ({why})")

    def close(self) -> None:
        """Ends the stream; its calls in flight fail (UNAVAILABLE) and its thread ends, waited
        for (``closing.STEP_S`` at most)."""
        self._out.put(None)
        # bounded: an interrupt inside gRPC may have left the call's lock taken (protos/closing.py)
        closing.bounded(closing.let_go(self, "_call"), "cancelling a session")
        if self._receiver is not threading.current_thread():
            self._receiver.join(closing.step_s())


_full_said: set[str] = set()  # servers whose bound on sessions this process has reported
_full_lock = threading.Lock()


def _say_full(address: str, why: str | None) -> None:
    """Warns, once a process for each server, that it refused a session at its bound: the
    operator sizes ``--max-sessions`` (debug logs say nothing to a user whose ranks past the
    bound quietly call one by one, their waiting calls refused and asked again)."""
    with _full_lock:
        if address in _full_said:
            return
        _full_said.add(address)
    log.warning(
        "server %s refused a session (%s); a client of this process calls it one by one, asking"
        " again every %.0f s. Its --max-sessions counts its ranks' sessions and lease streams:"
        " size it at 2 per rank (docs/scaling.md)",
        address,
        why,
        RETRY_OPEN_S,
    )


class Sessions:
    """A client's sessions, per server address (shared by its views, like its segments).
    ``on``: True/False, or None for ``PARAMSHARD_SESSIONS``."""

    def __init__(self, on: bool | None = None) -> None:
        self.on = on
        self._lock = threading.Lock()
        self._open: dict[str, _Session] = {}
        self._refused: dict[str, float] = {}  # address -> when it may be asked again
        self._closed = False

    def get(self, core: Any, index: int) -> _Session | None:
        """The open session to server ``index`` of view ``core``, opened now if need be; None:
        send the call on its own."""
        if not (enabled() if self.on is None else self.on):
            return None
        address = core.spec.addresses[index]
        with self._lock:
            session = self._open.get(address)
            if session is not None and session.broken is None:
                return session
            if self._closed or time.monotonic() < self._refused.get(address, 0.0):
                return None
            self._open.pop(address, None)
        session = _Session(core.spec.channel(index), core.spec.metadata(), address)
        if not session.wait_open(OPEN_TIMEOUT_S):
            log.debug("server %s: no session (%s); calls go one by one", address, session.broken)
            if session.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                _say_full(address, session.broken)
            unreachable = session.code == grpc.StatusCode.UNAVAILABLE
            wait = RETRY_UNREACHABLE_S if unreachable else RETRY_OPEN_S
            with self._lock:
                self._refused[address] = time.monotonic() + wait
            return None
        with self._lock:
            if self._closed or address in self._open:  # closed, or another thread won the race
                other = self._open.get(address)
                keep = other if other is not None and other.broken is None else None
            else:
                keep = None
            if keep is None and not self._closed:
                self._open[address] = session
                return session
        session.close()
        return keep

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sessions, self._open = list(self._open.values()), {}
        for session in sessions:
            session.close()
