"""``paramshard serve``'s stop signals (paramshard/stop_signals.py): a second SIGTERM that
comes while the handler of the first one runs ends the process or is taken as the same stop;
it never leaves the process frozen.

A server whose launcher was SIGKILLed got a burst of SIGTERMs (its parent-death signal, more
than once; why the kernel sent it again was not found). One came while the handler of an earlier one
held the lock of a ``threading.Event``; the nested handler waited for that lock, and the
server lived on, frozen, with no parent (a field check: 1 of 11 killed launchers; 1 of 15
servers given 300 SIGTERMs at once). Here a child process raises SIGTERM once and again at the
n-th call or return the handler makes (a profile hook), for every n the handler reaches.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest
from conftest import worker_env

CHILD = textwrap.dedent(
    """
    import os, signal, sys
    from paramshard.stop_signals import StopSignals

    n = int(sys.argv[1])
    stops = StopSignals()
    stops.install()
    handler = signal.getsignal(signal.SIGTERM)
    events = 0

    def hook(frame, event, arg):  # within the handler: its calls and returns, C's too
        global events
        events += 1
        if events == n:
            os.kill(os.getpid(), signal.SIGTERM)  # the second signal, at that point

    def traced(signum, frame):
        sys.setprofile(hook)
        try:
            handler(signum, frame)
        finally:
            sys.setprofile(None)

    signal.signal(signal.SIGTERM, traced)
    os.kill(os.getpid(), signal.SIGTERM)
    print("stopped" if stops.wait(10) else "not stopped", events, flush=True)
    """
)
HANG_S = 20.0  # a child that makes no call of its own for this long is frozen


def run_child(n: int) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            [sys.executable, "-c", CHILD, str(n)],
            check=False,
            env=worker_env(),
            capture_output=True,
            text=True,
            timeout=HANG_S,
        )
    except subprocess.TimeoutExpired:  # run() killed it
        pytest.fail(f"a second SIGTERM at the handler's event {n} froze the process")


def test_a_second_stop_signal_inside_the_handler_never_freezes_the_process():
    first = run_child(0)  # no second signal: how many events the handler makes
    assert first.returncode == 0, first.stderr
    word, events = first.stdout.split()
    assert word == "stopped" and int(events) > 0, first.stdout
    for n in range(1, int(events) + 1):
        done = run_child(n)
        # stopped (the signal was taken as the same stop), or ended by the second signal
        assert done.returncode in (0, -signal.SIGTERM), (n, done.returncode, done.stderr)
        if done.returncode == 0:
            assert done.stdout.startswith("stopped"), (n, done.stdout)
