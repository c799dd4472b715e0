"""protos/closing.py's bound on one step of a close: a step left past it shortens the steps
after it only while it still runs.

A step that waits on a gRPC lock left taken never ends, and every later step would wait its
full bound on the same lock. But on a loaded machine a cancel can also just be slow (a 300-rank
process on two cores took over a second for one): once it ends, the closes after it must get
their full bound again, not be cut short for the rest of the process.
"""

from __future__ import annotations

import threading
import time

from paramshard.protos import closing


def test_a_slow_step_shortens_later_steps_only_while_it_runs(monkeypatch) -> None:
    monkeypatch.setattr(closing, "STEP_S", 0.2)
    release = threading.Event()
    assert closing.step_s() == 0.2

    assert closing.bounded(lambda: release.wait(30), "a slow step") is False
    assert closing.step_s() == closing.WEDGED_STEP_S  # it may be a lock left taken
    # a later step that ends in time is waited for, and does not clear the mark
    assert closing.bounded(lambda: None, "a quick step") is True
    assert closing.step_s() == closing.WEDGED_STEP_S

    release.set()  # it was only slow: it ends
    deadline = time.monotonic() + 10
    while closing.step_s() != 0.2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert closing.step_s() == 0.2


def test_a_step_that_ends_in_time_is_waited_for(monkeypatch) -> None:
    monkeypatch.setattr(closing, "STEP_S", 5.0)
    ran = []
    assert closing.bounded(lambda: (time.sleep(0.05), ran.append(1)), "a step") is True
    assert ran == [1] and closing.step_s() == 5.0
