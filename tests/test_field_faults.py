"""Faults met in a field test (GPT-2 124M, 2 ranks, 2 `paramshard serve` processes, on a busy
2-core machine), reproduced small.

A rank that is only stopped (SIGSTOP, a debugger, swapped out) must never be taken for dead
(docs/inspection-and-recovery.md, "Fast failure: leases and abort notices": "a rank that is
stopped ... keeps its sockets open and its kernel acknowledges what the server sends, so its
lease holds however long that lasts"; README "Known limits": only gRPC's two-hourly keepalive
probe may take a stall over 30 s for death). In the field a rank stopped mid-step (FSDP,
GPT-2 124M) for 150 s was declared "rank 1 lost (its lease stream to this server closed: its
process ended or its host is unreachable)" about 61 s after SIGSTOP, and the job ended; a stop
of 40 s passed. The stopped process's gRPC later logged `Got goaway ... ping_timeout`: the
server's HTTP/2 ping went unanswered by the stopped process for the 30 s keepalive timeout.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from conftest import unique_id, worker_env

ROUNDS = 30
STOP_S = 75.0  # past the ~61 s at which the stopped rank was declared lost


def _rank_1(addresses: list[str], run: str, elements: int) -> subprocess.Popen:
    code = (
        "import numpy as np\n"
        "from paramshard.client import ClusterSpec, ShardClient\n"
        f"c = ShardClient(ClusterSpec({addresses!r}), rank=1, world_size=2, run_id={run!r},"
        " timeout_s=300)\n"
        f"x = np.ones({elements}, dtype=np.float32)\n"
        f"for i in range({ROUNDS}):\n"
        "    c.all_reduce(x)\n"
        "    print('round', i, flush=True)\n"
        "c.close()\n"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code],
        env=worker_env(),
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


@pytest.mark.slow
def test_a_rank_stopped_in_the_middle_of_collectives_is_not_taken_for_dead(servers):
    """Rank 1 (a process) all-reduces 4 MiB in a loop with rank 0 (this process) over two
    servers; SIGSTOP rank 1 for 75 s mid-loop, then SIGCONT. Rank 0 must wait (its deadline is
    300 s), hear of no lost rank, and both must finish every round after SIGCONT. Now rank 0's
    all-reduce fails about 61 s into the stop with "ABORTED ... rank 1 lost (its lease stream
    to this server closed ...)"."""
    from paramshard.client import ClusterSpec, ShardClient

    addresses = [s.address for s in servers(2)]
    run, elements = unique_id(), 2**20
    proc = _rank_1(addresses, run, elements)
    client = ShardClient(ClusterSpec(addresses), rank=0, world_size=2, run_id=run, timeout_s=300)
    errors: list[tuple[float, BaseException]] = []

    def loop() -> None:
        x = np.ones(elements, dtype=np.float32)
        try:
            for _ in range(ROUNDS):
                client.all_reduce(x)
        except BaseException as exc:  # noqa: BLE001 - what the test checks
            errors.append((time.monotonic(), exc))

    worker = threading.Thread(target=loop, daemon=True)
    worker.start()
    stopped = None
    try:
        for _ in range(3):  # a few rounds in, so the stop lands between and inside calls
            assert proc.stdout.readline().startswith("round")
        stopped = time.monotonic()
        os.kill(proc.pid, signal.SIGSTOP)
        while not errors and time.monotonic() - stopped < STOP_S:
            time.sleep(0.2)
        notice = client.run_state.current()
        assert not errors and notice is None, (
            f"rank 0 took the stopped rank 1 for lost "
            f"{(errors[0][0] - stopped) if errors else time.monotonic() - stopped:.1f} s into a"
            f" {STOP_S:.0f} s SIGSTOP: {errors[0][1] if errors else notice.reason}"
        )
        os.kill(proc.pid, signal.SIGCONT)
        out, _ = proc.communicate(timeout=120)
        worker.join(120)
        assert proc.returncode == 0, out[-2000:]
        assert not errors, errors
        assert not worker.is_alive()
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.wait(10)
        client.close()
