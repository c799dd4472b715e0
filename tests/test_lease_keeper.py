"""The renewing thread (client/lease_keeper.py) must not stop: a rank whose renewals stop is
taken for dead by the servers. One stuck in a call that never returns is replaced when the next
lease is added, says where it was, and leaves once it comes back."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from paramshard.client import lease_keeper
from paramshard.client.lease_keeper import Keeper


class _Holding:
    """A lease as the thread drives it: counts its renewal rounds; ``stuck`` blocks them."""

    def __init__(self, stuck: threading.Event | None = None) -> None:
        self.released, self.rounds, self.stuck = False, 0, stuck
        self.client = lambda: self  # a live client

    def keep_holds(self) -> None:
        if self.stuck is not None:
            self.stuck.wait(60)

    def close_holds(self) -> None:
        pass

    def send_due(self) -> None:
        self.rounds += 1

    def collect(self, until: float) -> None:
        pass


def _wait_for(what, seconds: float = 10.0) -> bool:
    end = time.monotonic() + seconds
    while not what() and time.monotonic() < end:
        time.sleep(0.02)
    return what()


def test_a_stuck_renewing_thread_is_replaced_and_leaves_when_it_comes_back(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(lease_keeper, "STUCK_S", 0.5)
    keeper, stuck = Keeper(), threading.Event()
    blocked = _Holding(stuck)
    keeper.add(blocked)
    first = keeper._thread
    time.sleep(0.7)  # the thread sits in blocked.keep_holds
    late = _Holding()
    with caplog.at_level(logging.WARNING, logger="paramshard.leases"):
        keeper.add(late)
    assert keeper._thread is not first and keeper._thread.is_alive()
    assert "has not come round" in caplog.text and "keep_holds" in caplog.text, caplog.text
    blocked.released = True  # the new thread must not stick on it too
    assert _wait_for(lambda: late.rounds >= 2), "the new thread renews"
    stuck.set()
    first.join(5)
    assert not first.is_alive(), "the old thread left once it came back"
    late.released = True
    keeper.discard(late)
    keeper.discard(blocked)
    assert _wait_for(lambda: keeper._thread is None)
