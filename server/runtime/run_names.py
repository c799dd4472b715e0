"""Run names as clients make them, and ``RankNews``, through which a wait on other ranks learns
what this server's leases know of the ranks it waits for: words for its deadline's error
(``whereabouts``), and whether they all ended for good, so it fails at once (``ended``,
asked every ``ENDED_POLL_S``).

A client's run id is ``<run>``; after ``restart_collectives`` its collectives run under
``<run>.e<epoch>``, and a group's under ``<run>/<group>`` (client/collectives.py,
client/shard_client.py). A group's ranks are its members' indices, not the run's ranks.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from paramshard.server.runtime import callers

__all__ = ["ENDED_POLL_S", "NOTHING_KNOWN", "RankNews", "grouped", "run_root", "wait_asking"]

ENDED_POLL_S = 0.5
"""How often a wait on other ranks asks whether they ended for good (a peer whose script ran
out of batches first: its release said so, ``LeaseRequest.ends``)."""


class RankNews(Protocol):
    """What the server's leases know of a run's ranks (``LeaseTable``,
    server/collectives/leases.py); both answer "" when they know nothing to say."""

    def whereabouts(self, run: str, ranks: Sequence[int]) -> str:
        """Words on each of ``ranks`` that released its lease or whose lease lapsed, each as
        ``; ...``."""
        ...

    def ended(self, run: str, ranks: Sequence[int]) -> str:
        """Words when all of ``ranks`` ended for good (their process exited normally)."""
        ...


class _NothingKnown:
    """The ``RankNews`` of a store not wired to the server's leases (tests, tools)."""

    def whereabouts(self, run: str, ranks: Sequence[int]) -> str:
        return ""

    def ended(self, run: str, ranks: Sequence[int]) -> str:
        return ""


NOTHING_KNOWN: RankNews = _NothingKnown()


def run_root(run: str) -> str:
    """The run id ``run`` stands for: without a group's ``/<group>`` or a restart's
    ``.e<epoch>`` suffix."""
    return re.sub(r"\.e\d+$", "", run.split("/", 1)[0])


def grouped(run: str) -> bool:
    """Whether ``run`` is a group's: its ranks are the group's member indices."""
    return "/" in run


def wait_asking(
    cond: threading.Condition,
    ready: Callable[[], bool],
    timeout: float,
    ask: Callable[[], str],
    waiting_for: str,
) -> tuple[bool, str]:
    """``cond.wait_for(ready, timeout)`` (caller holds ``cond``) that calls ``ask()`` every
    ``ENDED_POLL_S`` and ends early when it has words (the missing ranks ended for good);
    ``ask`` may raise to end it otherwise. It ends CANCELLED once the call it serves lost its
    caller (``callers.check``; ``waiting_for`` says what it waited for). Returns (ready,
    words)."""
    end = time.monotonic() + timeout
    while True:
        left = end - time.monotonic()
        if cond.wait_for(ready, min(left, ENDED_POLL_S)):
            return True, ""
        if left <= ENDED_POLL_S:
            return False, ""
        callers.check(waiting_for)
        if words := ask():
            return False, words
