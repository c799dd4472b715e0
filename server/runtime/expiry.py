"""One thread per server that ends abandoned work: expired slots, mailboxes and replicas.

Nothing waits per item: each store keeps the time of its items' last activity and a ``sweep``
that drops what is older than its TTL; this thread calls every sweep a few times per TTL.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

__all__ = ["Sweeper", "sweep_period"]

log = logging.getLogger("paramshard.server")


def sweep_period(ttl_s: float) -> float:
    """How often to sweep for a TTL: four times per TTL, between 50 ms and 10 s."""
    return min(10.0, max(0.05, ttl_s / 4))


class Sweeper:
    """Calls each of ``sweeps`` every ``period_s`` seconds until ``stop``."""

    def __init__(self, sweeps: Sequence[Callable[[], object]], period_s: float) -> None:
        self.sweeps = list(sweeps)
        self.period_s = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shard-expiry", daemon=True)

    def start(self) -> Sweeper:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            for sweep in self.sweeps:
                try:
                    sweep()
                except Exception:  # a bug in one sweep must not stop the others
                    log.exception("sweeping expired work failed")
