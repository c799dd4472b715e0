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
import logging
import threading
import time
from collections.abc import Callable

__all__ = ["DueChecks"]

log = logging.getLogger("paramshard.server")

COALESCE_S = 0.05
"""A run's check due within this long after one already waiting is folded into that one (it
runs that much later): a run's checks waiting at once are bounded by the grace over this."""


class DueChecks:
    """Calls ``check(run)`` once ``delay`` has passed for each ``at(run, delay)``, in order of
    their due times, from one thread that lives while any check waits."""

    def __init__(self, check: Callable[[str], None]) -> None:
        self._check = check
        self._cond = threading.Condition()
        self._due: list[tuple[float, str]] = []  # heap: (due, run)
        self._latest: dict[str, float] = {}  # run -> its latest waiting check's due time
        self._thread: threading.Thread | None = None
        self._stopped = False

    def at(self, run: str, delay: float) -> None:
        due = time.monotonic() + delay
        with self._cond:
            if self._stopped or self._latest.get(run, -1.0) >= due - COALESCE_S:
                return
            self._latest[run] = due
            heapq.heappush(self._due, (due, run))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="lease-checks", daemon=True)
                self._thread.start()
            self._cond.notify()

    def stop(self) -> None:
        """Nothing more is checked; waits a moment for a check that runs now."""
        with self._cond:
            self._stopped, self._due, self._latest = True, [], {}
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
                due, run = heapq.heappop(self._due)
                if self._latest.get(run) == due:
                    del self._latest[run]
            try:
                self._check(run)
            except Exception:  # a bug in one check must not stop the others
                log.exception("checking run %r for lapses failed", run)
