"""Sessions: a client's persistent stream to this server (docs/design.md §7.3, ``rpc Session``).

A unary call costs grpcio about 0.2 ms of CPU a side (0.15 ms more to start a polling thread
after an idle spell), and a small collective is a few such calls. A session is one stream per
client and server, open as long as the client: each direction carries batches of calls, each
holding every call its sender had ready, and it keeps grpcio's polling thread alive.

Each call of a session is what its unary twin is:

- only the data-plane methods (``ShardServicer.SESSION_METHODS``) travel in sessions, each parsed,
  guarded and run by the servicer's own handler; its status comes back in its reply and never
  ends the session;
- the stream's token is every call's token: each call needs its method's role (server/rpc/auth.py),
  a scoped token's call is checked against its scope before it is parsed, as a unary call is
  (server/rpc/scopes.py), and its segments are that token's (server/transport/shm.py);
- a call that may wait passes the admission gate (server/rpc/admission.py) with the unary calls,
  but past its bounds waits in line for a thread instead of being refused
  (server/transport/waiting_line.py);
- a call's deadline is its ``timeout_s`` from its arrival.

Its bounds, what each refuses and how they hold a greedy client back, and which calls run on
the reader thread: server/transport/session_bounds.py.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from paramshard.protos.batches import decode_batch, encode_batch
from paramshard.server.rpc import auth, scopes
from paramshard.server.rpc.admission import CallGate
from paramshard.server.rpc.parsers import Malformed
from paramshard.server.runtime.thread_names import name_this_thread
from paramshard.server.transport.session_bounds import (
    MAX_BATCH,
)
from paramshard.server.transport.session_stream import SessionStream
from paramshard.server.transport.waiting_line import WaitingLine

__all__ = ["Sessions"]  # its bounds: server/transport/session_bounds.py

log = logging.getLogger(__name__)


Handler = tuple[Callable[[Any, Any], Any], Callable[[bytes], Any], Callable[[Any], bytes]]
"""A method's guarded handler, request parser and reply serialiser (the servicer's own)."""


def _parse_batch(raw: bytes) -> Any:
    try:
        return decode_batch(raw, limit=MAX_BATCH)
    except Exception as exc:  # noqa: BLE001 - whatever the decoder says, the bytes are bad
        return Malformed(exc)


class Sessions:
    """The Session method of one server. ``handlers``: the data-plane methods' handlers;
    ``role_of(metadata)``: the caller's role (None without tokens); ``observe(method, code,
    seconds, request bytes, reply bytes)``: metrics of each call (server/metrics.py);
    ``scope_of(metadata)``: the caller's token's scope (None: unscoped, or no tokens);
    ``reply_bytes(method, request)``: the payload bytes a call's reply may carry, known before
    it runs (the servicer's)."""

    def __init__(
        self,
        handlers: dict[str, Handler],
        gate: CallGate,
        role_of: Callable[[Any], str | None] | None,
        may_wait: Callable[[str, Any], bool],
        workers: int,
        observe: Callable[[str, grpc.StatusCode, float, int, int], None] | None = None,
        reply_bytes: Callable[[str, Any], int] | None = None,
        scope_of: Callable[[Any], scopes.Scope | None] | None = None,
    ) -> None:
        self.handlers = handlers
        self.scope_of = scope_of
        self.gate, self.role_of, self.may_wait, self.observe = gate, role_of, may_wait, observe
        self.reply_bytes = reply_bytes
        self.pool = ThreadPoolExecutor(
            workers, thread_name_prefix="session", initializer=name_this_thread
        )
        # calls that may wait, past the gate's bounds (server/transport/waiting_line.py)
        self.line = WaitingLine(gate, lambda e: self.pool.submit(e.session.run, e.job))
        self.calls = 0  # calls run through sessions (tests read it)
        self.count_lock = threading.Lock()
        self.held_bytes = 0  # request bytes held and reply bytes unsent, over all sessions
        self.live: set[SessionStream] = set()  # under _count
        self.stopping: str | None = None  # why, once ``drain`` ran (under count_lock)

    @property
    def open(self) -> int:
        """The sessions being served now."""
        with self.count_lock:
            return len(self.live)

    def drain(self, why: str) -> None:
        """The server stops: every session takes no new call and ends (UNAVAILABLE: the
        client sends its calls again, elsewhere or later) once its calls in flight have
        replied, and a session opened now ends at once; so idle streams do not hold the
        server's grace to its end."""
        with self.count_lock:
            self.stopping = why
            live = list(self.live)
        self.line.stop(why)  # calls waiting for a thread never start now
        for session in live:
            session.drain(why)

    def generic_handler(self) -> grpc.GenericRpcHandler:
        handler = grpc.stream_stream_rpc_method_handler(
            self._serve, request_deserializer=_parse_batch, response_serializer=encode_batch
        )
        return grpc.method_handlers_generic_handler(auth.SERVICE_NAME, {"Session": handler})

    def close(self) -> None:
        self.line.close()
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _serve(self, batches: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        role = caller = scope = None
        if self.role_of:
            role = self.role_of(context.invocation_metadata())
            caller = auth.caller_id(context.invocation_metadata())
        if self.scope_of:
            scope = self.scope_of(context.invocation_metadata())
        session = SessionStream(self, context, role, caller, scope)
        with self.count_lock:
            stopping = self.stopping
            if stopping is None:
                self.live.add(session)
        if stopping is not None:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"Session: {stopping}")
        try:  # gRPC closes this generator at any yield, the first too (a call cancelled at once)
            reader = threading.Thread(
                target=session.read, args=(batches,), name="session-reader", daemon=True
            )
            reader.start()
            yield []  # an empty batch: open
            yield from session.replies()
        finally:
            session.close()
        if session.ended is not None:
            context.abort(*session.ended)
