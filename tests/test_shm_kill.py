"""Shared segments when a side is SIGKILLed (server/transport/shm.py, protos/shm.py).

Segments are memfds handed over an abstract socket: no file in ``/dev/shm`` or anywhere else,
so nothing outlives the processes that map them. A server killed in the middle of a stream of
payloads leaves the client with an error and, once the client closes, not one mapping of a
segment. A client killed while it holds segments leaves them with the server only until they
go idle (the pending-work TTL), then they are dropped and their memory budget is back.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest
from conftest import worker_env

from paramshard.client import ClusterSpec, ShardClient, ShardClientError
from paramshard.local_servers import start_local_servers
from paramshard.server import ShardServer

N = 1_000_000  # 4 MB of float32: 16 chunks of 256 KiB, each through a segment
CHUNK_BYTES = 256 * 2**10
SEGMENT = "memfd:paramshard-segment"


def mapped_segments() -> set[str]:
    """The inodes of this process's mappings of segments."""
    with open("/proc/self/maps") as f:
        return {line.split()[4] for line in f if SEGMENT in line}


def shm_files() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def test_a_server_killed_mid_transfer_leaves_no_segment() -> None:
    children, (address,) = start_local_servers(1, "cpu", worker_env(), timeout=60)
    (child,) = children
    mapped, files = mapped_segments(), shm_files()
    c = ShardClient(ClusterSpec([address]), timeout_s=10, retries=0, chunk_bytes=CHUNK_BYTES)
    failures: list[BaseException] = []
    sent = threading.Semaphore(0)

    def stream() -> None:
        values = np.arange(N, dtype=np.float32)
        deadline = time.monotonic() + 60
        try:
            while time.monotonic() < deadline:
                c.set_params("j", "w", values, version=0)
                sent.release()
        except ShardClientError as exc:
            failures.append(exc)

    try:
        c.register_buffer("j", "w", N)
        writer = threading.Thread(target=stream, daemon=True)
        writer.start()
        for _ in range(3):  # a few whole tensors went through segments: kill during the next
            assert sent.acquire(timeout=30), "no payload reached the server"
        assert c.shm.opened >= 1 and mapped_segments() - mapped
        child.proc.send_signal(signal.SIGKILL)
        writer.join(timeout=60)
        assert not writer.is_alive()
        (failure,) = failures
        assert failure.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), failure
    finally:
        c.close()
        child.proc.kill()
        child.proc.wait(timeout=30)
    assert mapped_segments() - mapped == set()
    assert shm_files() == files  # nothing was ever in /dev/shm


CLIENT = """
import sys, time
import numpy as np
from paramshard.client import ClusterSpec, ShardClient
c = ShardClient(ClusterSpec([sys.argv[1]]), timeout_s=10, chunk_bytes={chunk})
c.register_buffer("j", "w", {n})
c.set_params("j", "w", np.ones({n}, np.float32))
print(c.shm.opened, flush=True)
time.sleep(120)
"""


def test_a_killed_clients_segments_are_dropped_when_idle() -> None:
    server = ShardServer(local_calls=False).start()
    files, mapped = shm_files(), mapped_segments()  # other tests' servers may hold some
    proc = subprocess.Popen(
        [sys.executable, "-c", CLIENT.format(chunk=CHUNK_BYTES, n=N), server.address],
        env=worker_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        opened = int(proc.stdout.readline() or 0)
        assert opened >= 1
        registry = server.servicer.segments
        count, nbytes = registry.usage()
        assert count == opened and server.servicer.budget.usage()["shm"] == nbytes
        held = mapped_segments() - mapped  # this server's mappings (it runs in this process)
        assert len(held) >= count
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert registry.usage() == (count, nbytes)  # kept: the TTL has not passed yet
        registry.idle_s = 0.0
        assert registry.expire() == count
        assert registry.usage() == (0, 0)
        assert server.servicer.budget.usage()["shm"] == 0
        assert not mapped_segments() & held  # the server unmapped them
        assert shm_files() == files
    finally:
        proc.kill()
        proc.wait(timeout=30)
        server.stop(0)


@pytest.fixture(autouse=True)
def _shared_memory_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PARAMSHARD_SHM", raising=False)
