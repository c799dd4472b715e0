"""Lapse checks that come due: when a rank's last stream ends, its lease lapses
``STREAM_GRACE_S`` later unless the rank comes back, and someone must look then
(server/collectives/leases.py). One thread does it for every run, while any check is due.

A stream's own handler thread once waited out the grace itself. The server's handler threads
are few, and a stream's place in the session bound is given back the moment it ends, so a
caller that opened and dropped streams in a loop held a thread a stream for a second each,
past the bound, until other callers' renewals waited behind them and missed their deadlines.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable

__all__ = ["DueChecks"]

log = logging.getLogger("paramshard.server")

COALESCE_S = 0.05
"""A run's check due within this long after one already waiting is folded into it: that one
runs at its own time and, if a check folded into it is not due yet then, once more at the
latest due time it took in. A run's checks run at most about twice every this long, whatever
the rate its streams end at, and none runs before it is due."""


class DueChecks:
    """Calls ``check(run)`` once ``delay`` has passed for each ``at(run, delay)``, never
    before, from one thread that lives while any check waits."""

    def __init__(self, check: Callable[[str], None]) -> None:
        self._check = check
        self._cond = threading.Condition()
        self._due: list[list] = []  # heap of [due, order, run, latest due folded in]
        self._waiting: dict[str, list] = {}  # run -> its newest entry in the heap
        self._order = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def at(self, run: str, delay: float) -> None:
        due = time.monotonic() + delay
        with self._cond:
            if self._stopped:
                return
            entry = self._waiting.get(run)
            if entry is not None and due - entry[0] <= COALESCE_S:
                entry[3] = max(entry[3], due)
                return
            entry = [due, next(self._order), run, due]
            self._waiting[run] = entry
            heapq.heappush(self._due, entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="lease-checks", daemon=True)
                self._thread.start()
            self._cond.notify()

    def stop(self) -> None:
        """Nothing more is checked; waits a moment for a check that runs now."""
        with self._cond:
            self._stopped, self._due, self._waiting = True, [], {}
            thread = self._thread
            self._cond.notify()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._due and not self._stopped:
                    wait = self._due[0][0] - time.monotonic()
                    if wait <= 0:
                        break
                    self._cond.wait(wait)
                if not self._due or self._stopped:
                    self._thread = None  # the next ``at`` starts another
                    return
                entry = heapq.heappop(self._due)
                run, latest = entry[2], entry[3]
                newest = self._waiting.get(run) is entry
                if newest:
                    del self._waiting[run]
                if latest > entry[0]:  # a check folded in is due later: once more then
                    again = [latest, next(self._order), run, latest]
                    heapq.heappush(self._due, again)
                    if newest:
                        self._waiting[run] = again
            try:
                self._check(run)
            except Exception:  # a bug in one check must not stop the others
                log.exception("checking run %r for lapses failed", run)
