"""The process's one renewing thread (client/leases.py): it renews every lease the process
holds, keeps their streams open, and ends with the last one."""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from typing import Any, Protocol

from paramshard.protos import closing

__all__ = ["RENEWALS_A_SECOND", "RENEW_S", "Keeper", "renewal_pace"]

log = logging.getLogger("paramshard.leases")

RENEW_S = 1.0
STUCK_S = 30.0
"""A renewing thread that has not come round for this long is taken for stuck (in a gRPC call
that never returns): the next lease added starts another, and the stuck one leaves when it
comes back. A rank whose renewals stop is taken for dead by the servers."""
RENEWALS_A_SECOND = 64
"""A rank of a run of more ranks renews a server every ``world_size / RENEWALS_A_SECOND`` s: a
renewal costs a server 0.3-0.45 ms of CPU (``python -m benchmarks.leases``). The server still
hears the run 64 times a second (witnesses of lapses), a stream holds the lease and brings
notices at once, and a failed renewal, a new epoch or a broken stream is renewed at once."""
PACED_MAX_S = 30.0  # the longest pace with a stream; without, a sixth of the TTL (5 may fail)


def renewal_pace(world_size: int, ttl_s: float, streamed: bool) -> float:
    """Seconds between a rank's renewals of a server where it holds a stream (or not)."""
    pace = max(RENEW_S, min(PACED_MAX_S, world_size / RENEWALS_A_SECOND))
    return pace if streamed else min(pace, ttl_s / 6)


class _Held(Protocol):
    """A rank's lease as the thread drives it (client/leases.py)."""

    released: bool

    def client(self) -> Any: ...

    def keep_holds(self) -> None: ...

    def close_holds(self) -> None: ...

    def send_due(self) -> None: ...

    def collect(self, until: float) -> None: ...


class Keeper:
    """The process's one renewing thread, running while any lease is held."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holdings: list[_Held] = []
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._round = 0.0  # when the thread last began a round

    def add(self, holding: _Held) -> None:
        with self._lock:
            self._holdings.append(holding)
            if self._thread is not None and not self._came_round():
                self._thread = None
            if self._thread is None:
                self._wake.clear()
                self._round = time.monotonic()
                self._thread = threading.Thread(target=self._run, name="lease", daemon=True)
                self._thread.start()

    def _came_round(self) -> bool:
        """Whether the thread is alive and began a round within ``STUCK_S``; if not, says where
        it is (caller holds ``_lock``)."""
        thread, late = self._thread, time.monotonic() - self._round
        if thread is not None and thread.is_alive() and late < STUCK_S:
            return True
        frame = sys._current_frames().get(thread.ident) if thread is not None else None
        where = "".join(traceback.format_stack(frame)) if frame is not None else "(ended)\n"
        log.warning(
            "the lease renewing thread has not come round for %.0f s; another one"
            " starts. It was at:\n%s",
            late,
            where,
        )
        return False

    def discard(self, holding: _Held) -> None:
        """``holding`` was released: the thread ends (and is waited for) with the last one."""
        with self._lock:
            if holding in self._holdings:
                self._holdings.remove(holding)
            thread = self._thread if not self._holdings else None
        if thread is not None and thread is not threading.current_thread():
            self._wake.set()
            thread.join(closing.STEP_S)  # it ends at the end of its round (RENEW_S)

    def _run(self) -> None:
        while True:
            began = time.monotonic()
            with self._lock:
                if self._thread is not threading.current_thread():
                    return  # taken for stuck meanwhile: another thread renews
                self._wake.clear()
                self._round = began
                live = [h for h in self._holdings if not h.released and h.client() is not None]
                # a client dropped without close(): its streams end here (a released one's
                # end in its release, on the thread that closes)
                dropped = [h for h in self._holdings if not h.released and h.client() is None]
                self._holdings = live
                if not live:
                    self._thread = None
            for holding in dropped:
                holding.close_holds()
            if not live:
                return
            try:  # every renewal in flight at once: a slow server delays no other lease
                for holding in live:
                    holding.keep_holds()
                for holding in live:
                    holding.send_due()
                for holding in live:  # answers that come within the round; the rest later
                    holding.collect(began + RENEW_S)
            except Exception:  # never let the thread die: the leases would lapse
                log.exception("renewing leases failed")
            self._wake.wait(max(0.0, RENEW_S - (time.monotonic() - began)))
