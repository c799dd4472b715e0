"""One call of a session as its handler sees it (server/transport/sessions.py): the part of
a gRPC context the data-plane handlers use, with the call's own deadline, and the sizes the
session's bounds count."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import grpc

from paramshard.protos import codec
from paramshard.protos import shard_pb2 as pb
from paramshard.server.rpc import auth, scopes

__all__ = [
    "CallAbort",
    "CallContext",
    "SessionJob",
    "body_size",
    "call_refusal",
    "payload_bytes",
    "run_call",
    "status_reply",
]

log = logging.getLogger(__name__)


class SessionJob(NamedTuple):
    """A call a session has taken, as its pool thread runs it (``run_call``)."""

    call_id: int
    method: str
    fn: Callable[[Any, Any], Any]
    serialize: Callable[[Any], bytes]
    request: Any
    deadline: float | None
    """``time.monotonic`` when the call's time is up (None: no deadline)."""
    waits: str | None
    """The role the gate counts it as waiting for, None for a call that does not wait."""
    received: int
    """Its request bytes, held until it ends."""
    promised: int
    """The bytes its reply may carry, counted from the moment it was taken."""


class CallAbort(Exception):
    """A handler's ``context.abort`` inside a session: the call ends with this status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class CallContext:
    """The part of grpc.ServicerContext the data-plane handlers use, for one call of a
    session: its own deadline (``time.monotonic``, from the call's arrival: a call that waited
    for a thread has waited that long already), the stream's caller."""

    def __init__(self, stream: grpc.ServicerContext, deadline: float | None) -> None:
        self._stream = stream
        self._deadline = deadline

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def is_active(self) -> bool:
        """False once the session's stream ended (its client cancelled it, or went away): the
        call's waits end then (server/runtime/callers.py)."""
        return self._stream.is_active()

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise CallAbort(code, details)

    def invocation_metadata(self) -> Any:
        return self._stream.invocation_metadata()

    def auth_context(self) -> Any:
        return self._stream.auth_context()


def run_call(
    job: SessionJob, stream: grpc.ServicerContext
) -> tuple[tuple[Any, Any], grpc.StatusCode]:
    """Runs ``job``'s handler for the session ``stream``: its reply (the call's id and body)
    and status. A handler's abort is the call's status; a bug in a handler is INTERNAL in the
    reply, logged, and the session goes on."""
    try:
        body = job.serialize(job.fn(job.request, CallContext(stream, job.deadline)))
        return (pb.SessionCall(id=job.call_id), body), grpc.StatusCode.OK
    except CallAbort as exc:
        return status_reply(job.call_id, exc.code, exc.details), exc.code
    except Exception as exc:  # the guard reports handler bugs; this is one in the reply
        log.exception("session call %s failed", job.method)
        details = f"{job.method}: {type(exc).__name__}: {exc}"
        return status_reply(
            job.call_id, grpc.StatusCode.INTERNAL, details
        ), grpc.StatusCode.INTERNAL


def status_reply(call_id: int, code: grpc.StatusCode, details: str) -> tuple[pb.SessionCall, bytes]:
    """A call's reply that carries only its status."""
    return pb.SessionCall(id=call_id, code=code.value[0], details=details), b""


def body_size(body: Any) -> int:
    """The bytes a reply body takes on the wire (a tensor reply's header and payload)."""
    return codec.encode_parts(*body)[1] if isinstance(body, tuple) else len(body)


def payload_bytes(request: Any) -> int:
    """The payload size of a tensor request (in-band or in a segment); 0 for anything else."""
    if not isinstance(request, tuple):
        return 0
    header, data = request
    return header.shm.nbytes if header.HasField("shm") else len(data)


def call_refusal(
    handlers: dict[str, Any], method: str, body: memoryview, role: str | None, scope: Any
) -> tuple[grpc.StatusCode, str] | None:
    """Why a session's call of ``method`` is refused before its body is parsed (a method
    sessions do not carry, a role below the method's, a body outside the token's ``scope``),
    or None; ``handlers``: the methods sessions carry."""
    if method not in handlers:
        shown = method[:64] + ("..." if len(method) > 64 else "")
        return (
            grpc.StatusCode.UNIMPLEMENTED,
            f"{shown!r} is not a method sessions carry; they carry {', '.join(sorted(handlers))}",
        )
    need = auth.METHOD_ROLES[method]
    if role is not None and not auth.role_allows(role, need, method):
        return (
            grpc.StatusCode.PERMISSION_DENIED,
            f"{method} needs role '{need}'; this session's token has role '{role}'",
        )
    return scopes.refusal(scope, method, body) if scope else None
