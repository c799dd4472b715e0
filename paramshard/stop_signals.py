"""The stop signals of ``paramshard serve``: SIGINT and SIGTERM mark a stop that its main
thread waits for, and once one came a second one ends the process at once."""

from __future__ import annotations

import signal
import time
from typing import Any

STOP_POLL_S = 0.2  # how soon the main thread sees a stop signal's mark


class StopSignals:
    """SIGINT and SIGTERM mark a stop that ``serve``'s main thread waits for; once one came, a
    second one ends the process at once (the default action)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous: dict[int, Any] = {}

    def __call__(self, signum: int, _frame: Any) -> None:
        # Takes no lock: a signal can interrupt this handler itself (a SIGKILLed launcher's
        # servers got their parent-death SIGTERM in a burst), and a nested call waiting on a
        # lock its interrupted caller held would wait for ever (such a server lived on, with
        # no parent, stuck in threading.Event.set).
        signal.signal(signum, signal.SIG_DFL)
        self.received.append(signum)

    def install(self) -> None:
        self._previous = {s: signal.signal(s, self) for s in self.SIGNALS}

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def wait(self, timeout: float | None = None) -> bool:
        """Whether a stop signal came, waiting up to ``timeout`` s (None: for ever); a signal
        cuts the sleep short and runs the handler."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.received:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(STOP_POLL_S)
        return True
