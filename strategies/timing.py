"""Where a step's time goes: seconds the training thread spends blocked on the servers, and
seconds the strategies' background threads spend moving bytes, by kind.

Every data-parallel strategy keeps one ``CommTimes`` (``model.comm_times``). The training
thread's waits (``blocked``) are what communication adds to a step on top of compute; the
background threads' calls (``busy``) overlap with compute and show how long the transfers
themselves take. ``take()`` returns the seconds since the last ``take()`` and starts again, so
a caller reads one step's figures after each step. The cost is two ``perf_counter`` calls and a
lock per wait or call, nothing per byte.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["CommTimes"]


class CommTimes:
    """Seconds by kind: ``blocked/<kind>`` (training thread waiting) and ``busy/<kind>``
    (a background thread running calls)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds: dict[str, float] = {}

    def add(self, key: str, seconds: float) -> None:
        with self._lock:
            self._seconds[key] = self._seconds.get(key, 0.0) + seconds

    @contextmanager
    def blocked(self, kind: str) -> Iterator[None]:
        """Times a wait of the training thread on communication of ``kind``."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add("blocked/" + kind, time.perf_counter() - t0)

    @contextmanager
    def busy(self, kind: str) -> Iterator[None]:
        """Times a background thread's calls of ``kind``."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add("busy/" + kind, time.perf_counter() - t0)

    def take(self) -> dict[str, float]:
        """The seconds by key since the last ``take()``; the counters start again at zero."""
        with self._lock:
            out, self._seconds = self._seconds, {}
        return out
