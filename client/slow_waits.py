"""A rank whose collective or step waits long on other ranks says so while it waits, and names
who is missing.

A wait on other ranks ends at the client's deadline (``timeout_s``, 120 s by default) with the
server's account of who never came (server/collectives/pending.py). Until then a stalled job
showed nothing: a rank stopped by a debugger or swapped out, stuck in its data loader, or a
stopped server all look, from the waiting ranks, like one long step. So every
``PARAMSHARD_WAIT_NOTICE_S`` seconds (30 by default; 0: never) of such a wait, the waiting rank
asks its server's hang doctor (``Status`` with ``pending``, as a timed-out wait does:
client/hang_report.py) and logs a warning with the collective or step, how long it has waited
of its deadline, and the ranks the server still waits for, or that the server itself did not
answer. The question is one small call per notice; a wait that ends sooner costs nothing
but the registration of a callback on its future.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from paramshard.client.env import env_seconds

__all__ = ["NOTICE_ENV", "DEFAULT_NOTICE_S", "notice_s", "wait"]

NOTICE_ENV = "PARAMSHARD_WAIT_NOTICE_S"
DEFAULT_NOTICE_S = 30.0
"""Long enough that a step of a large model, or a peer's checkpoint, does not raise one."""


def notice_s() -> float:
    """Seconds between a long wait's notices, from ``PARAMSHARD_WAIT_NOTICE_S`` (0: none)."""
    return env_seconds(NOTICE_ENV, DEFAULT_NOTICE_S, 0.0, 86400.0)


def wait(fut: Any, began: float, until: float, every: float, say: Callable[[float], None]) -> None:
    """Returns once ``fut`` is done, or at ``until`` (time.monotonic), whichever comes first;
    meanwhile calls ``say(seconds since began)`` at ``began + every``, ``began + 2 * every``,
    ... A future that cannot report its end (one that ended already) returns at once, and so
    does every future when ``every`` is 0. The caller then takes the future's result, which
    enforces its deadline as before."""
    add = getattr(fut, "add_done_callback", None)
    if every <= 0 or add is None:
        return
    done = threading.Event()
    add(lambda _: done.set())
    due = began + every
    while not done.wait(max(0.0, min(due, until) - time.monotonic())):
        now = time.monotonic()
        if now >= until:
            return
        if now >= due:
            say(now - began)
            due += every * (1 + int((now - due) // every))  # a late notice skips, never bursts
