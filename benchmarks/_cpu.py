"""What the benchmarks measure of CPU and memory: the machine's busy time, a process's CPU
seconds and peak resident memory, the share of the machine other processes and the
hypervisor use (``Load``, ``wake_steal``; ``wait_quiet``: a measurement waits for both to
drop first). Linux (/proc, getrusage).
"""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
import time
from collections.abc import Callable


def _proc_stat() -> tuple[float, float]:
    """(busy CPU seconds, steal included; steal seconds) of all cores, from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    steal = v[7] if len(v) > 7 else 0
    return (sum(v[:8]) - idle) / os.sysconf("SC_CLK_TCK"), steal / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds of this process and its reaped children."""
    a = resource.getrusage(resource.RUSAGE_SELF)
    b = resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def cpu_self_s() -> float:
    """CPU seconds used so far by this process (all its threads)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _stat(path: str) -> tuple[str, float]:
    """(the kernel's name, user + system CPU seconds) of a /proc ``stat`` file."""
    with open(path) as f:
        head, rest = f.read().rsplit(")", 1)
    fields = rest.split()
    return head.split("(", 1)[1], (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid: int) -> float:
    """CPU seconds used so far by process ``pid`` (all threads), from /proc."""
    try:
        return _stat(f"/proc/{pid}/stat")[1]
    except (OSError, IndexError, ValueError):
        return 0.0


def threads_cpu_s() -> dict[str, float]:
    """CPU seconds used so far by this process's threads, summed by kind: ``main`` (the
    thread that called this), Python threads by name less their numbering (``allreduce_0``
    and ``allreduce_1``: ``allreduce``; an unnamed one by its target), others (grpc's,
    torch's, gloo's) by the kernel's name for them less digits. A thread that ended has left
    its seconds to no kind."""
    import threading

    named = {t.native_id: t.name for t in threading.enumerate()}
    named[threading.get_native_id()] = "main"
    return _by_kind("self", named)


def process_threads_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds used so far by process ``pid``'s threads, summed by the kernel's name for
    them less digits (a server names its pools' and readers' threads there:
    server/runtime/thread_names.py); empty once it has exited."""
    try:
        return _by_kind(str(pid), {})
    except OSError:
        return {}


def _by_kind(pid: str, named: dict[int, str]) -> dict[str, float]:
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            comm, cpu = _stat(f"/proc/{pid}/task/{tid}/stat")
        except OSError:  # ended meanwhile
            continue
        kind = named.get(int(tid)) or comm
        kind = re.sub(r"^Thread-\d+ \((.*)\)$", r"\1", kind)  # unnamed: by its target
        kind = re.sub(r"[-_ ]*\d+([-_]\d+)*$", "", kind) or "thread"
        out[kind] = out.get(kind, 0.0) + cpu
    return out


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class Load:
    """``with Load() as load: ...`` (or ``load = Load().start(); ...; load.stop()``); then
    ``load.foreign`` is the share of the machine's CPU that processes other than ours (this
    one and its reaped children) used meanwhile, and ``load.steal`` the part of it that was
    steal: time a virtual machine's CPUs had work but the hypervisor ran something else.

    Steal is the hypervisor's, and not only other guests' work: a virtual CPU that sleeps and
    is woken (a process handing work to one on the other core, as every message between
    ranks does) costs it time the guest counts as steal, the more so the busier the physical
    host. On the 2-core Firecracker VM these benchmarks ran on, one day two processes passing
    a byte back and forth through pipes, nothing else running, saw 29-32% of the CPUs stolen
    and two busy loops 5-6%, where runs of the collectives on other days saw 0-10% foreign:
    a benchmark of messages can raise its own ``foreign`` share, which ``steal`` tells apart."""

    foreign = 0.0
    steal = 0.0

    def start(self) -> Load:
        self.t, self.own = time.monotonic(), own_cpu_s()
        self.busy, self.stolen = _proc_stat()
        return self

    def stop(self) -> float:
        dt = max(1e-9, time.monotonic() - self.t) * (os.cpu_count() or 1)
        busy, stolen = _proc_stat()
        foreign = (busy - self.busy) - (own_cpu_s() - self.own)
        # /proc/stat counts whole clock ticks: with every CPU busy the count may pass dt by
        # a tick (1.001 with two CPUs full of CPU hogs), and a share of the machine is at most 1
        self.foreign = round(min(1.0, max(0.0, foreign) / dt), 3)
        self.steal = round(min(self.foreign, max(0.0, stolen - self.stolen) / dt), 3)
        return self.foreign

    def __enter__(self) -> Load:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


_ECHO = "import os\nwhile os.read(0, 1) == b'x':\n    os.write(1, b'x')\n"


def wake_steal(seconds: float = 1.0) -> float:
    """The share of the CPUs the hypervisor stole while this process and a child handed a
    byte back and forth through pipes for ``seconds``, each hand-off waking the other's CPU:
    what a benchmark of messages would lose now, which an idle machine's steal does not show
    (``Load``). 0 on a machine that is not virtual."""
    child = subprocess.Popen(
        [sys.executable, "-c", _ECHO], stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0
    )
    assert child.stdin is not None and child.stdout is not None
    send, recv = child.stdin.fileno(), child.stdout.fileno()
    try:
        os.write(send, b"x")
        os.read(recv, 1)  # the child runs
        t0, (_, stolen) = time.monotonic(), _proc_stat()
        while time.monotonic() - t0 < seconds:
            for _ in range(64):
                os.write(send, b"x")
                os.read(recv, 1)
        dt = (time.monotonic() - t0) * (os.cpu_count() or 1)
        return round(min(1.0, max(0.0, _proc_stat()[1] - stolen) / dt), 3)
    finally:
        child.stdin.close()  # its read ends: it exits
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        child.stdout.close()


def wait_quiet(
    max_wait: float,
    threshold: float = 0.15,
    steal: float = 0.1,
    busy: Callable[[float], None] | None = None,
) -> float:
    """Waits (at most ``max_wait`` s) until other processes use < ``threshold`` of the CPUs
    and the hypervisor steals < ``steal`` of them from hand-offs between processes
    (``wake_steal``); returns the larger of the two last measured shares, which ``busy`` is
    given too where the wait ran out before the machine was quiet."""
    end = time.monotonic() + max_wait
    while True:
        with Load() as load:
            time.sleep(2.0)
        stolen = wake_steal() if load.foreign < threshold else None
        quiet = stolen is not None and stolen < steal
        if quiet or time.monotonic() >= end:
            share = max(load.foreign, stolen or 0.0)
            if not quiet and busy is not None:
                busy(share)
            return share
        time.sleep(3.0)
