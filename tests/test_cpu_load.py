"""benchmarks/_cpu.py's load measures: ``Load`` splits the machine's CPU that was not ours
into other processes' and the hypervisor's steal, read from /proc/stat (here a fake one with
known counters); ``wake_steal`` hands a byte to a child and back for its time and ends the
child; ``wait_quiet`` gives up at its deadline with a share."""

from __future__ import annotations

import io
import os
import time
from types import SimpleNamespace

import pytest

from benchmarks import _cpu

TICK = os.sysconf("SC_CLK_TCK")


def stat_line(user: int, system: int, idle: int, steal: int) -> str:
    # user nice system idle iowait irq softirq steal guest guest_nice, in ticks
    return f"cpu  {user} 0 {system} {idle} 0 0 0 {steal} 0 0\n"


def test_load_tells_steal_from_other_processes(monkeypatch) -> None:
    lines = iter([stat_line(100, 50, 1000, 10), stat_line(100 + 4 * TICK, 50, 1000, 10 + TICK)])
    monkeypatch.setattr(_cpu, "open", lambda *_: io.StringIO(next(lines)), raising=False)
    own = iter([5.0, 6.0])  # this process used 1 s of the 4 s of user time
    monkeypatch.setattr(_cpu, "own_cpu_s", lambda: next(own))
    clock = iter([0.0, 2.0])  # 2 s on os.cpu_count() CPUs
    monkeypatch.setattr(_cpu, "time", SimpleNamespace(monotonic=lambda: next(clock)))
    cpus = os.cpu_count() or 1
    load = _cpu.Load().start()
    foreign = load.stop()
    # busy grew 4 s of user and 1 s of steal: 5 s, of which 1 s was ours
    assert foreign == load.foreign == pytest.approx(round(4.0 / (2.0 * cpus), 3))
    assert load.steal == pytest.approx(round(1.0 / (2.0 * cpus), 3))


def test_wake_steal_hands_bytes_for_its_time_and_ends_its_child() -> None:
    began = time.monotonic()
    stolen = _cpu.wake_steal(0.3)
    assert time.monotonic() - began >= 0.3
    assert 0.0 <= stolen <= 1.0


def test_wait_quiet_gives_up_at_its_deadline_with_a_share() -> None:
    began = time.monotonic()
    # nothing is that quiet: it measures once (2 s idle, 1 s of hand-offs) and gives up
    said: list[float] = []
    share = _cpu.wait_quiet(0.0, threshold=1.1, steal=-1.0, busy=said.append)
    assert 0.0 <= share <= 1.0 and said == [share]  # told: the machine was not quiet
    assert 2.0 <= time.monotonic() - began < 30.0


def test_wait_quiet_says_nothing_once_the_machine_is_quiet_enough() -> None:
    said: list[float] = []
    share = _cpu.wait_quiet(60.0, threshold=1.1, steal=1.1, busy=said.append)  # any machine
    assert 0.0 <= share <= 1.0 and said == []
