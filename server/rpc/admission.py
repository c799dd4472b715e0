"""Which call gets a handler thread (docs/design.md §6.2): a caller that waits never starves one
that works.

The gRPC server runs every call on a thread of one pool, and a call that waits (a pull for a
future version, a slot read, a step before every push) holds its thread while it waits:
unbounded, eight ``read``-token pulls for a far version starved a trainer's PushGrad on an
8-thread pool. So (``CallLimits``):

- A call of a waiting method (``WAITING_METHODS``) that may have to wait (``may_wait``: a
  pull for a version the buffer has reached does not) is admitted only while at least
  ``reserved`` of the ``workers`` threads stay free, a ``read`` token's only while fewer
  than ``max_waiting_read`` of them are in, and another token's (unary calls and sessions
  together) only while it holds fewer than ``caller_bound``, half the threads waiting calls
  may take: one caller's waiting calls never hold the threads another caller's
  collective needs. Beyond any of them a unary call fails at once with RESOURCE_EXHAUSTED
  "retry later", a message saying which bound, and nothing changed; a session's call waits in
  line for its turn, holding no thread (server/transport/waiting_line.py); a Join
  (``ANSWERS_AT_ONCE``) runs at once with no time to wait, so every rank is heard. Every other
  call (pushes to initialised buffers, steps whose pushes are in, SetParams, registration,
  Status, ...) is never refused here, and finds a reserved thread however many callers wait.
- Streams of the open services (reflection, health Watch) run on ``max_streams`` threads of
  their own, beside the workers; one stream more is refused with RESOURCE_EXHAUSTED. They stay
  open to callers without a token (``grpcurl`` and probes keep working), bounded instead.
- Client sessions (server/transport/sessions.py) run on ``max_sessions`` threads of their
  own; their calls pass the same bounds (a call that leaves calls ``on_left``).
- How long a call may wait is bounded by the servicer's ``max_wait_s``.
- Bytes that do not parse get INVALID_ARGUMENT, not grpcio's INTERNAL "Exception deserializing
  request!": the Shard service's own parsers never raise (server/servicer.py), the health and
  reflection services' protobuf parsers do, and the gate rebuilds every handler anyway.

A caller's role is its token's (server/rpc/auth.py); without tokens every caller may do everything
and counts as ``train``.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from paramshard.protos.batches import TENSOR_REPLIES
from paramshard.server.rpc.auth import SERVICE_NAME, caller_id
from paramshard.server.rpc.call_limits import CallLimits, default_reserved
from paramshard.server.rpc.unsent_replies import UnsentReplies

__all__ = ["ANSWERS_AT_ONCE", "CallGate", "CallLimits", "WAITING_METHODS", "default_reserved"]

ANSWERS_AT_ONCE = frozenset({"Join"})
"""Waiting methods whose call, past a bound of waiting calls, runs with no time to wait (unary
or in a session): a Join announces its rank and answers "ask again after a pause", so an
elastic job of more ranks than waiting threads is heard whole within its round's window."""

WAITING_METHODS = frozenset(
    {"PullParams", "ReadSlot", "GradNorm", "Snapshot", "PushGrad", "Step", "Join"}
)
"""Shard methods that may wait for other callers: a pull for a future version, a slot read, a
push before the buffer's initial values, a step before every rank's push, a Join until its
step's membership is decided. Whether a call of them may wait is the servicer's ``may_wait``
(a push to an initialised buffer does not, nor a step whose pushes are all in: those are never
refused). A ContributeRead is not one: its contribution goes in whatever the bounds, as a
Contribute does (other ranks' calls wait for it), and only its wait for the result passes the
bounds (``CallGate.wait_in``)."""


class CallGate(grpc.ServerInterceptor):
    """Admits calls to handler threads by ``limits``; ``role_of(metadata)`` names the caller's
    role (None: no tokens, or none presented); ``may_wait(method, request)`` tells whether a
    call of a waiting method may wait (default: it may)."""

    def __init__(
        self,
        limits: CallLimits,
        role_of: Callable[[Any], str | None] | None = None,
        may_wait: Callable[[str, Any], bool] | None = None,
        reply_bytes: Callable[[str, Any], int] | None = None,
    ) -> None:
        self.limits = limits
        self.role_of = role_of
        self.reply_bytes = reply_bytes  # the servicer's: what a call's reply may carry
        self.unsent = UnsentReplies()
        self.may_wait = may_wait
        self._lock = threading.Lock()
        self.busy = 0  # calls in a handler (streams not included)
        self.waiting: Counter[str] = Counter()  # calls of waiting methods in a handler, by role
        self._callers: Counter[str] = Counter()  # and by caller (token), where there are tokens
        self.streams = 0
        self.sessions = 0
        self.read_sessions = 0  # of them, sessions of read tokens
        self.on_left: Callable[[], None] | None = None  # a call left (the sessions' line)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if handler is None:
            return None
        service, _, method = details.method.lstrip("/").rpartition("/")
        if handler.request_streaming or handler.response_streaming:
            session = service == SERVICE_NAME
            role = self.role_of(details.invocation_metadata) if session and self.role_of else None
            return self._stream(handler, method, session=session, reader=role == "read")
        role = caller = None
        ours = service == SERVICE_NAME
        if ours and (method in WAITING_METHODS or method in TENSOR_REPLIES):
            # the caller is named for a reply it may leave unread too (a ContributeRead)
            caller = caller_id(details.invocation_metadata) if self.role_of else None
        if ours and method in WAITING_METHODS:
            found = self.role_of(details.invocation_metadata) if self.role_of else None
            role = found or "train"
        return self._unary(handler, method, role, caller)

    # -- unary calls -------------------------------------------------------------------------
    @property
    def caller_bound(self) -> int:
        """Waiting calls one token (train or above) may have in at once: half of what waiting
        calls may take (read tokens, all together, have ``max_waiting_read``)."""
        return max(1, (self.limits.workers - self.limits.reserved) // 2)

    def waiting_of(self, caller: str) -> int:
        """The waiting calls of ``caller`` (a token) in now."""
        with self._lock:
            return self._callers[caller]

    def enter(self, role: str | None, caller: str | None = None, busy: bool = True) -> str | None:
        """Counts a call in; why a waiting one (``role`` set; ``caller``: its token) is refused.
        ``busy=False``: a call counted in already, which starts to wait (``wait_in``)."""
        lim = self.limits
        if role == "read":
            caller = None  # read tokens have a bound of their own, all together
        with self._lock:
            if role is not None:
                others = self.busy - (not busy)  # a call counted in already: not itself
                if others >= lim.workers - lim.reserved:
                    return (
                        f"{others} calls are running on this server's {lim.workers} worker"
                        f" threads and {lim.reserved} are kept for calls that do not wait"
                        " (pushes, steps, Status); retry later (paramshard serve --workers)"
                    )
                if role == "read" and self.waiting["read"] >= lim.max_waiting_read:
                    return (
                        f"{self.waiting['read']} calls of read tokens already wait on this"
                        f" server, its bound (paramshard serve --max-waiting-read); retry later"
                    )
                if caller is not None and self._callers[caller] >= self.caller_bound:
                    return (
                        f"{self._callers[caller]} calls of this token already wait on this"
                        f" server, half of what waiting calls may take (paramshard serve"
                        " --workers, --reserved-workers); retry later"
                    )
                self.waiting[role] += 1
                if caller is not None:
                    self._callers[caller] += 1
            self.busy += busy
        return None

    def admit(
        self, method: str, role: str | None, caller: str | None = None
    ) -> tuple[str | None, str | None]:
        """``enter`` for a call of ``method``: (why it is refused, the role it waits as): past
        the bounds, one of ``ANSWERS_AT_ONCE`` comes in as a call that does not wait."""
        refusal = self.enter(role, caller)
        if refusal is None or role is None or method not in ANSWERS_AT_ONCE:
            return refusal, role
        return self.enter(None, caller), None

    def wait_in(self, metadata: Any) -> tuple[str | None, Callable[[], None]]:
        """A call counted in as one that works (a ContributeRead, its contribution added)
        starts to wait for other callers: it counts as a waiting call of its caller's role and
        token (``metadata``: its call's or its session's), within the bounds of the waiting
        methods' calls. Returns (why it is refused, how its wait ends)."""
        role = (self.role_of(metadata) if self.role_of else None) or "train"
        caller = caller_id(metadata) if self.role_of else None
        refusal = self.enter(role, caller, busy=False)
        if refusal is not None:
            return refusal, lambda: None
        return None, lambda: self.leave(role, caller, busy=False)

    def leave(self, role: str | None, caller: str | None = None, busy: bool = True) -> None:
        if role == "read":
            caller = None
        with self._lock:
            self.busy -= busy
            if role is not None:
                self.waiting[role] -= 1
                if caller is not None:
                    self._callers[caller] -= 1
                    if not self._callers[caller]:
                        del self._callers[caller]
        if self.on_left is not None:  # any call: ``busy`` counts the ones that do not wait too
            self.on_left()

    def _unary(
        self, handler: grpc.RpcMethodHandler, method: str, role: str | None, caller: str | None
    ) -> grpc.RpcMethodHandler:
        behavior = handler.unary_unary

        def gated(request: Any, context: grpc.ServicerContext) -> Any:
            _check_parsed(request, context, method)
            self._hold_reply(method, request, caller, context)
            waits = role if role and (not self.may_wait or self.may_wait(method, request)) else None
            refusal, admitted = self.admit(method, waits, caller)
            if refusal is not None:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{method}: {refusal}")
            try:
                return behavior(request, context if admitted == waits else _AtOnce(context))
            finally:
                self.leave(admitted, caller)

        return grpc.unary_unary_rpc_method_handler(
            gated,
            request_deserializer=_never_raising(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )

    def _hold_reply(
        self, method: str, request: Any, caller: str | None, context: grpc.ServicerContext
    ) -> None:
        """Counts the bytes the call's reply may carry until gRPC ends the call, which it
        does once the caller read the reply (server/rpc/unsent_replies.py); aborts "retry
        later" past the bounds."""
        nbytes = self.reply_bytes(method, request) if self.reply_bytes else 0
        if not nbytes:
            return
        refusal = self.unsent.take(caller, nbytes)
        if refusal is not None:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{method}: {refusal}")
        given = threading.Lock()

        def give() -> None:  # once: the call ended (sent, failed or cancelled)
            if given.acquire(blocking=False):
                self.unsent.give(caller, nbytes)

        if not context.add_callback(give):
            give()  # the call already ended

    # -- streams -------------------------------------------------------------------------------
    @property
    def read_bound(self) -> int:
        """Sessions of read tokens open at once: a quarter of ``max_sessions``, at least 1."""
        return max(1, self.limits.max_sessions // 4)

    def _stream(
        self,
        handler: grpc.RpcMethodHandler,
        method: str,
        session: bool = False,
        reader: bool = False,
    ) -> grpc.RpcMethodHandler:
        """An open service's stream (reflection, health Watch), or a Shard ``session``:
        each kind counted against its own bound. A ``reader``'s session (a read token's) also
        counts against a quarter of the sessions' bound, so read tokens never take the places
        of trainers."""
        behavior, make = _streaming(handler)
        if not session:
            counts = [("streams", self.limits.max_streams)]
            refusal = (
                f"{self.limits.max_streams} streams (reflection, health Watch) are open on this"
                " server, its bound (paramshard serve --max-streams); retry later"
            )
        elif reader:
            counts = [("sessions", self.limits.max_sessions), ("read_sessions", self.read_bound)]
            refusal = (
                f"{self.read_bound} sessions of read tokens (a quarter of --max-sessions) or"
                f" {self.limits.max_sessions} in all are open on this server, the bounds; calls"
                " go one by one meanwhile"
            )
        else:
            counts = [("sessions", self.limits.max_sessions)]
            refusal = (
                f"{self.limits.max_sessions} sessions are open on this server, its bound"
                " (paramshard serve --max-sessions); calls go one by one meanwhile"
            )

        def gated(request: Any, context: grpc.ServicerContext) -> Any:
            if handler.request_streaming:
                request = _parsed(request, context, method)
            else:
                _check_parsed(request, context, method)
            with self._lock:
                admitted = all(getattr(self, kind) < bound for kind, bound in counts)
                for kind, _ in counts:
                    setattr(self, kind, getattr(self, kind) + admitted)
            if not admitted:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{method}: {refusal}")
            left = threading.Lock()

            def leave() -> None:  # once, whichever comes first: the end or the cancellation
                if left.acquire(blocking=False):
                    with self._lock:
                        for kind, _ in counts:
                            setattr(self, kind, getattr(self, kind) - 1)

            context.add_callback(leave)
            try:
                result = behavior(request, context)
            except BaseException:
                leave()
                raise
            if not handler.response_streaming:
                leave()
                return result
            return _closing(result, leave)

        return make(
            gated,
            request_deserializer=_never_raising(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )


class _Unparsed:
    """Stands in for a request whose bytes did not parse."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _never_raising(parse: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if parse is None:
        return None

    def parse_or_flag(raw: bytes) -> Any:
        try:
            return parse(raw)
        except Exception as exc:  # noqa: BLE001 - whatever the parser says, the bytes are bad
            return _Unparsed(exc)

    return parse_or_flag


class _AtOnce:
    """A unary call's context with no time left to wait (``ANSWERS_AT_ONCE``)."""

    def __init__(self, context: grpc.ServicerContext) -> None:
        self._context, self.time_remaining = context, lambda: 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


def _check_parsed(request: Any, context: grpc.ServicerContext, method: str) -> None:
    if isinstance(request, _Unparsed):
        context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{method}: request does not parse: {type(request.error).__name__}: {request.error}",
        )


def _parsed(requests: Iterator[Any], context: grpc.ServicerContext, method: str) -> Iterator[Any]:
    for request in requests:
        _check_parsed(request, context, method)
        yield request


def _closing(responses: Iterator[Any], leave: Callable[[], None]) -> Iterator[Any]:
    try:
        yield from responses
    finally:
        leave()


def _streaming(handler: grpc.RpcMethodHandler) -> tuple[Any, Callable[..., Any]]:
    """The behaviour of a streaming handler and the constructor of its kind."""
    if handler.request_streaming and handler.response_streaming:
        return handler.stream_stream, grpc.stream_stream_rpc_method_handler
    if handler.request_streaming:
        return handler.stream_unary, grpc.stream_unary_rpc_method_handler
    return handler.unary_stream, grpc.unary_stream_rpc_method_handler
