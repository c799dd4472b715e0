"""Whether the caller of the call a handler thread runs is still there, and who it is.

A call that waits (a slot's read, a pull of a version not reached yet, a step waiting for its
gradients, a snapshot's version, a contribution's turn) holds a handler thread while it waits.
Its caller may go away meanwhile: a trainer killed, a channel closed, a session cancelled.
The servicer's guard runs every handler inside ``serving(context)``; the waits ask
``check()`` at each poll and end CANCELLED once the caller went away, so the thread is free
at once and not at the call's deadline (up to the server's bound, 120 s by default).

gRPC's context says so itself (``is_active``: False once the call was cancelled or its
connection lost); a session's call asks its stream's (server/transport/session_calls.py). A
call made in the trainer's own process (client/local_calls.py) has no such context and is
never taken for gone.

``who()`` names the caller (its token: server/rpc/auth.py ``caller_of``) for what counts
against its share (server/collectives/slot.py ``SlotMemory``); None without a token."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from paramshard.server.runtime.errors import ShardError

__all__ = ["check", "serving", "who"]

_ALIVE: ContextVar[Callable[[], bool] | None] = ContextVar("paramshard_caller", default=None)
_WHO: ContextVar[str | None] = ContextVar("paramshard_caller_id", default=None)


@contextmanager
def serving(context: Any, caller: str | None = None) -> Iterator[None]:
    """Runs the block as the handler of a call of ``context`` (grpc's, or a session call's):
    ``check`` asks its ``is_active``; ``who`` says ``caller`` (server/rpc/auth.py
    ``caller_of``: its token), for what its caller's share counts."""
    alive, who_token = _ALIVE.set(getattr(context, "is_active", None)), _WHO.set(caller)
    try:
        yield
    finally:
        _WHO.reset(who_token)
        _ALIVE.reset(alive)


def who() -> str | None:
    """The caller of the call this thread serves (None: no token, or not serving a call)."""
    return _WHO.get()


def check(waiting_for: str) -> None:
    """Raises CANCELLED when the call this thread serves lost its caller (``waiting_for``:
    what it waited for, for the server's log and the metrics; no caller reads it)."""
    alive = _ALIVE.get()
    if alive is not None and not alive():
        raise ShardError.cancelled(f"the caller went away while this call waited for {waiting_for}")
