"""The lab's links of a given speed (benchmarks/_netns.py ``Namespaces.shape``): a raw TCP stream
between two hosts moves no faster than the rate set, and as fast as before once the limit is
lifted. Upper bounds only: on a busy machine the CPU, not the link, may be slower still."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from benchmarks._netns import Namespaces, counters_between, tc, unavailable

PAYLOAD = 24 * 2**20
RATE_GBIT = 0.5  # below what veths move on any machine, so the limit is what decides
PORT = 5201

RECEIVER = f"""
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], {PORT})); s.listen(1); s.settimeout(30)
c, _ = s.accept(); c.settimeout(30)
buf = bytearray({PAYLOAD}); view = memoryview(buf); got = 0; t0 = None
while got < {PAYLOAD}:
    k = c.recv_into(view[got:], {PAYLOAD} - got)
    if not k: break
    t0 = t0 or time.perf_counter()
    got += k
print(got, time.perf_counter() - t0, flush=True)
c.sendall(b"k"); c.close(); s.close()
"""
SENDER = f"""
import socket, sys
c = socket.create_connection((sys.argv[1], {PORT}), timeout=30)
c.sendall(bytes({PAYLOAD})); c.recv(1); c.close()
"""


def gbit_per_s(lab: Namespaces) -> float:
    """One stream of PAYLOAD bytes from host a to host b: the rate the receiver saw."""
    rx = subprocess.Popen(
        [*lab.exec_prefix("b"), sys.executable, "-c", RECEIVER, lab.ip["b"]],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(0.5)  # the receiver listens
        subprocess.run(
            [*lab.exec_prefix("a"), sys.executable, "-c", SENDER, lab.ip["b"]],
            check=True,
            timeout=60,
        )
        out, _ = rx.communicate(timeout=60)
    finally:
        if rx.poll() is None:
            rx.kill()
            rx.wait(10)
    got, seconds = out.split()
    assert int(got) == PAYLOAD
    return PAYLOAD * 8 / float(seconds) / 1e9


def test_shaped_link_is_no_faster_than_its_rate() -> None:
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    with Namespaces(["a", "b"]) as lab:
        applied = lab.shape(RATE_GBIT)
        assert applied["rate_gbit"] == RATE_GBIT
        shown = tc("-n", lab.ns["a"], "qdisc", "show", "dev", "eth0").stdout
        assert applied["qdisc"] in shown, shown
        shaped = gbit_per_s(lab)
        assert shaped <= 1.15 * RATE_GBIT, shaped  # the bucket's burst lets a little through
        assert lab.shape(None)["qdisc"] == "none"
        assert applied["qdisc"] not in tc("-n", lab.ns["a"], "qdisc", "show", "dev", "eth0").stdout
        assert gbit_per_s(lab) > 1.5 * RATE_GBIT  # unlimited again


def test_counters_see_a_queue_that_drops() -> None:
    """``Namespaces.counters``: a queue too short for a stream drops packets and TCP sends them
    again, and both show between two readings (what the collectives benchmark records for each
    variant's run on shaped links)."""
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    with Namespaces(["a", "b"]) as lab:
        before = lab.counters()
        assert set(before) == {"qdisc_drops", "tcp_retrans_segs", "tcp_timeouts"}
        # 1 ms of queue at 0.2 Gbit/s holds 25 KB: TCP's window outgrows it within the stream.
        # The queue is on b's bridge port, so what it drops was sent and is lost on the way:
        # the sender must send it again. (On the sender's own eth0 the drops are local ones,
        # which TCP sends again without always counting a retransmission: one CI run saw 60
        # drops there and no retransmitted segment.)
        tc("-n", lab.switch, "qdisc", "replace", "dev", lab.veth["b"], "root", "tbf",
           "rate", "0.2gbit", "burst", str(128 * 1024), "latency", "1ms")  # fmt: skip
        gbit_per_s(lab)
        got = counters_between(before, lab.counters())
        assert got["qdisc_drops"] > 0, got
        assert got["tcp_retrans_segs"] > 0, got
        assert counters_between({"qdisc_drops": 5}, {"qdisc_drops": 2}) == {"qdisc_drops": -1}
