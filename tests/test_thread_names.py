"""server/runtime/thread_names.py: a server's pools and session readers carry their Python
names in the kernel, where what reads threads from outside the process sees them (the scale
benchmark's servers' CPU by kind of thread, ``top -H``). A real server on 127.0.0.1, called
through gRPC and a session."""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest

from paramshard.client import ClusterSpec, ShardClient
from paramshard.server import ShardServer
from paramshard.server.runtime.thread_names import name_this_thread

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc, prctl")


def kernel_name(native_id: int) -> str:
    with open(f"/proc/self/task/{native_id}/comm") as f:
        return f.read().strip()


def test_a_servers_busy_threads_carry_their_python_names_in_the_kernel() -> None:
    server = ShardServer("127.0.0.1", 0, local_calls=False).start()
    client = ShardClient(ClusterSpec([server.address]), rank=0, world_size=1, run_id="names")
    try:
        got = client.all_reduce(np.arange(4.0))
        np.testing.assert_array_equal(got, np.arange(4.0))
        assert server.sessions.calls > 0  # the all-reduce went through a session
        threads = {t.name: t.native_id for t in threading.enumerate()}
        mine = {
            name: kernel_name(tid)
            for name, tid in threads.items()
            if name.startswith(("session_", "shard_", "session-reader")) and tid is not None
        }
        kinds = {name.rstrip("0123456789") for name in mine}
        assert {"session_", "shard_", "session-reader"} <= kinds, mine
        for name, comm in mine.items():
            assert comm == name[:15], (name, comm)
    finally:
        client.close()
        server.stop(0)


def test_a_name_is_cut_to_the_kernels_fifteen_bytes_and_a_bad_one_never_raises() -> None:
    seen: list[str] = []

    def run() -> None:
        name_this_thread()
        seen.append(kernel_name(threading.get_native_id()))
        name_this_thread("naïve\x00name")  # C reads up to the NUL: no error
        seen.append(kernel_name(threading.get_native_id()))

    t = threading.Thread(target=run, name="a-name-longer-than-fifteen")
    t.start()
    t.join(10)
    assert seen[0] == "a-name-longer-t"
    assert seen[1] == "naïve"
