"""A private network of "hosts" (network namespaces) on one bridge: the multi-host tests' lab
(tests/multihost/conftest.py) and the benchmarks' cross-host variants.

``Namespaces(hosts)`` builds, with a random suffix S and a random X:

- a switch namespace ``ps-S-sw`` holding the bridge ``br-psS`` (the bridge lives in a namespace
  of its own, so the host's bridge netfilter/iptables rules never see the traffic and the root
  namespace gets no new interface);
- one namespace ``ps-S-NAME`` per host, with ``eth0`` = 10.231.X.k/24, a veth whose other end
  ``vpsS-NAME`` is a bridge port.

Only addresses inside these namespaces are ever used. ``teardown`` (safe after a failure
halfway through ``build``) kills whatever still runs inside the namespaces and deletes them,
which removes the veths and the bridge. Needs Linux, root and iproute2 (``unavailable`` says
why not).

**Links of real speed** (``shape``): every host's cable runs at a given rate in both directions:
a token bucket (``tc`` tbf) on the host's ``eth0`` (what it sends) and on its bridge port (what
it receives), so a host's traffic to all others shares one link of that rate, as a host's NIC.
The bucket holds 200 us of traffic (at least 128 KiB: whole 64 KiB GSO packets pass unsplit).
A data-centre hop also delays each packet (``DELAY_US`` one way, split over the two queues), but
only ``netem`` can add delay: where the kernel lacks it (``sch_netem``; the 6.x Firecracker
guest this was written on has neither netem nor fq) the links are shaped in rate only and
``shape`` says so.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

__all__ = ["DELAY_US", "Namespaces", "counters_between", "ip", "tc", "unavailable"]

CMD_TIMEOUT_S = 15.0
DELAY_US = 25.0
"""One way across a data-centre hop (NIC, switch, NIC; kernel TCP adds its own): 25 us, so
a round trip between two hosts is 50 us, the lower end of what same-rack TCP measures."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(
        ["ip", *args], check=False, capture_output=True, text=True, timeout=CMD_TIMEOUT_S
    )
    if check and done.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done


def tc(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(
        ["tc", *args], check=False, capture_output=True, text=True, timeout=CMD_TIMEOUT_S
    )
    if check and done.returncode != 0:
        raise RuntimeError(f"`tc {' '.join(args)}` failed: {done.stderr.strip()}")
    return done


def counters_between(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """``Namespaces.counters`` taken after something, less those taken before it. A qdisc
    replaced in between (``shape``) starts its counts again: a negative difference is not
    a count, and says so as -1."""
    return {k: after[k] - before[k] if after[k] >= before[k] else -1 for k in before}


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns, bridges, veths)"
    if shutil.which("ip") is None:
        return "network namespaces need iproute2's `ip`"
    probe = f"ps-probe-{secrets.token_hex(3)}"
    try:
        done = ip("netns", "add", probe, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`ip netns add` failed: {exc}"
    if done.returncode != 0:
        return f"`ip netns add` failed: {done.stderr.strip()}"
    ip("netns", "del", probe, check=False)
    return None


class Namespaces:
    """The namespaces of ``hosts``, their addresses, and the prefix that runs a command in one."""

    def __init__(self, hosts: Sequence[str]) -> None:
        self.suffix = secrets.token_hex(2)
        self.subnet = secrets.randbelow(254) + 1  # 10.231.X.0/24, X in 1..254
        self.switch = f"ps-{self.suffix}-sw"
        self.bridge = f"br-ps{self.suffix}"
        self.hosts = list(hosts)
        self.ns = {h: f"ps-{self.suffix}-{h}" for h in hosts}
        self.veth = {h: f"vps{self.suffix}-{h}" for h in hosts}  # the bridge-side ends
        self.ip = {h: f"10.231.{self.subnet}.{i + 1}" for i, h in enumerate(hosts)}
        self._made: list[str] = []

    def build(self) -> None:
        ip("netns", "add", self.switch)
        self._made.append(self.switch)
        sw = ("-n", self.switch)
        ip(*sw, "link", "set", "lo", "up")
        ip(*sw, "link", "add", self.bridge, "type", "bridge")
        ip(*sw, "link", "set", self.bridge, "up")
        for h in self.hosts:
            ns, veth = self.ns[h], self.veth[h]
            ip("netns", "add", ns)
            self._made.append(ns)
            ip(*sw, "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            ip(*sw, "link", "set", veth, "master", self.bridge)
            ip(*sw, "link", "set", veth, "up")
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "addr", "add", f"{self.ip[h]}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")

    def exec_prefix(self, host: str) -> list[str]:
        """Runs a command inside ``host``'s namespace (``ip netns exec`` execs it: same pid)."""
        return ["ip", "netns", "exec", self.ns[host]]

    def set_link(self, host: str, up: bool) -> None:
        """Cuts (or restores) ``host``'s cable: its bridge-side veth end goes down (up)."""
        ip("-n", self.switch, "link", "set", self.veth[host], "up" if up else "down")

    def _links(self) -> list[tuple[str, str]]:
        """(namespace, device) of both ends of every host's cable."""
        return [(self.ns[h], "eth0") for h in self.hosts] + [
            (self.switch, self.veth[h]) for h in self.hosts
        ]

    def shape(self, gbit: float | None, delay_us: float = DELAY_US) -> dict[str, object]:
        """Every host's link at ``gbit`` Gbit/s each way (None: unlimited, the queues removed),
        with ``delay_us`` one way where netem exists; returns what was applied."""
        for ns, dev in self._links():
            tc("-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
        if gbit is None:
            return {"rate_gbit": None, "delay_us": 0.0, "qdisc": "none"}
        rate = f"{gbit:g}gbit"
        half = f"{delay_us / 2:g}us"
        burst = max(128 * 1024, int(gbit * 1e9 / 8 * 200e-6))
        applied: dict[str, object] = {"rate_gbit": gbit, "burst_bytes": burst}
        for i, (ns, dev) in enumerate(self._links()):
            if delay_us > 0 and applied.get("qdisc") != "tbf":
                done = tc("-n", ns, "qdisc", "replace", "dev", dev, "root", "netem",
                          "delay", half, "rate", rate, "limit", "100000", check=False)  # fmt: skip
                if done.returncode == 0:
                    applied.update(qdisc="netem", delay_us=delay_us)
                    continue
                if i > 0:  # netem worked on the first link: it must on all
                    raise RuntimeError(f"netem on {ns}/{dev}: {done.stderr.strip()}")
                applied.update(qdisc="tbf", delay_us=0.0)
                applied["delay_unavailable"] = f"netem refused: {done.stderr.strip()}"
            tc("-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf",
               "rate", rate, "burst", str(burst), "latency", "10ms")  # fmt: skip
            applied.setdefault("qdisc", "tbf")
            applied.setdefault("delay_us", 0.0)
        return applied

    def counters(self) -> dict[str, int]:
        """What the lab's links dropped and what its TCP sent again, so far: the queues'
        drops on both ends of every cable (``tc -s``; a token bucket drops what would wait
        past its latency) and, summed over the hosts, TCP's retransmitted segments and
        retransmission timeouts (each stalls its connection for at least 200 ms). Take two
        and subtract (``counters_between``)."""
        got = {"qdisc_drops": 0, "tcp_retrans_segs": 0, "tcp_timeouts": 0}
        for ns, dev in self._links():
            done = tc("-s", "-j", "-n", ns, "qdisc", "show", "dev", dev, check=False)
            for q in json.loads(done.stdout or "[]") if done.returncode == 0 else []:
                got["qdisc_drops"] += int(q.get("drops", 0))
        for h in self.hosts:
            done = subprocess.run(
                [*self.exec_prefix(h), "nstat", "-asz", "--json"],
                check=False, capture_output=True, text=True, timeout=CMD_TIMEOUT_S,
            )  # fmt: skip
            if done.returncode == 0:
                kernel = json.loads(done.stdout).get("kernel", {})
                got["tcp_retrans_segs"] += int(kernel.get("TcpRetransSegs", 0))
                got["tcp_timeouts"] += int(kernel.get("TcpExtTCPTimeouts", 0))
        return got

    def teardown(self) -> None:
        """Kills what still runs in the namespaces (started for them) and deletes them."""
        for ns in reversed(self._made):
            for pid in ip("netns", "pids", ns, check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            deadline = time.monotonic() + 5
            while ip("netns", "pids", ns, check=False).stdout.split():
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            ip("netns", "del", ns, check=False)
        self._made.clear()

    def __enter__(self) -> Namespaces:
        try:
            self.build()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()
