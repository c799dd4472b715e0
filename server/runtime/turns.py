"""Early contributions wait for their turn instead of being copied (docs/design.md §3.4).

Gradient pushes (server/buffers/contributions.py) and slot contributions
(server/collectives/slots.py) are summed in rank order. One that comes before its turn used to
be copied into staging memory until its turn came: memory (up to W - 1 copies of what is being
reduced) and a copy's CPU on a server that shares the host's cores with the trainers. Now it
first waits for its turn, holding its own request (a shared segment or the message, which exist
anyway), and is added from it.

Contribution k waits only for contributions below k, and contribution 0 never waits, so no
contribution waits on one that waits on it; a client queues every contribution of a collective
before any of its reads (client/collectives.py), so a window of waiting reads never holds back
a contribution others wait for. The bounds make a wait harmless even where that is not so:

- each waiting call holds a handler thread, so at most ``TurnWaits.limit`` wait at once, server
  wide (the server sets it to a quarter of the threads waiting calls may take: server/app.py);
- a wait lasts ``TURN_WAIT_S`` at most, and half its call's time at most, and ends CANCELLED
  once its caller went away (server/runtime/callers.py);
- a contribution of ``WAITS_FROM_BYTES`` or less never waits (a session runs contributions of
  up to ``INLINE_BYTES``, 256 KiB, on its reader thread, which must never wait: its other calls
  would wait behind it; small copies cost less than the wait's bookkeeping anyway).

Past any of them the contribution is staged as a copy, as before.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from paramshard.server.runtime.run_names import wait_asking

__all__ = ["TurnWaits", "TURN_WAIT_S", "WAITS_FROM_BYTES"]

TURN_WAIT_S = 30.0
"""How long an early contribution waits for its turn at most."""
WAITS_FROM_BYTES = 2**20
"""Contributions of this many bytes or fewer are staged at once, never wait."""


class TurnWaits:
    """The server's contributions waiting for their turn, at most ``limit`` at once (0: none
    waits; a store outside a server keeps that)."""

    def __init__(self, limit: int = 0) -> None:
        self.limit, self.waiting = limit, 0
        self.min_bytes = WAITS_FROM_BYTES  # contributions of no more bytes never wait
        self._lock = threading.Lock()

    def wait(self, cond: Any, done: Callable[[], bool], nbytes: int, until: float, of: Any) -> bool:
        """Waits on ``cond`` (held by the caller) until ``done()`` or ``until``, for a
        contribution of ``nbytes``; False, at once, when it may not wait (too small, too late,
        or ``limit`` others wait). ``of`` (a slice or a slot) counts its waiters in
        ``turn_waiters``: whoever changes what they wait for notifies ``cond`` while any do."""
        if nbytes <= self.min_bytes or time.monotonic() >= until:
            return False
        with self._lock:
            if self.waiting >= self.limit:
                return False
            self.waiting += 1
        of.turn_waiters += 1
        try:
            wait_asking(cond, done, max(0.0, until - time.monotonic()), str, "its turn")
        finally:
            of.turn_waiters -= 1
            with self._lock:
                self.waiting -= 1
        return True

    @staticmethod
    def until(timeout: float) -> float:
        """When a wait that starts now ends at the latest, for a call with ``timeout`` left."""
        return time.monotonic() + min(TURN_WAIT_S, timeout / 2)
