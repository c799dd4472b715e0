"""``paramshard launch`` stops the whole process group of a rank that failed, promptly, also
when the rank is restarted (``--max-restarts``) and the job goes on.

Each rank starts a background ``sleep`` (as a data loader worker or a shell pipeline would) and
writes its pid to a file; rank 0 then exits with code 4. The launcher must report the failure
at once, although the ``sleep`` keeps the rank's stdout and stderr pipes open, and stop every
rank's group: the dead rank's ``sleep`` (its group leader is gone) as well as the living ones.

Measured on the development machine, from rank 0's exit to the launcher's exit: before the fix
about 20.5 s with ``--nproc 1`` (the exit was reported only after the pipes were waited on for
2 x 5 s, and again 2 x 5 s while stopping) and 20.3 s with ``--nproc 2``, the dead rank's
``sleep`` left running in both; after it, 0.4 s and 0.5 s, nothing left. ``EXIT_LAG_S`` sits
between the two, with room for a busy machine.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from launching import launch_env, wait_gone  # noqa: E402

from paramshard.processes import spawn, stop, watch  # noqa: E402
from paramshard.restarts import RankRestarts, ServerRestarts, supervise  # noqa: E402

pytestmark = pytest.mark.timeout(180)

RUN_S = 90.0  # one launcher run, servers included, on a busy machine
EXIT_LAG_S = 6.0  # rank 0's exit to the launcher's: ~0.5 s now, ~20 s before the fix

LEAVES_A_CHILD = r"""
import os, subprocess, sys, time
from pathlib import Path

rank, world, folder = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), Path(sys.argv[1])
child = subprocess.Popen(["sleep", "40"])  # inherits the rank's stdout and stderr
(folder / f"child.{rank}").write_text(str(child.pid))
if rank != 0:
    time.sleep(60)  # until the launcher stops it
deadline = time.monotonic() + 30
while len(list(folder.glob("child.*"))) < world and time.monotonic() < deadline:
    time.sleep(0.05)
print("failing now", flush=True)
(folder / "failed_at").write_text(repr(time.time()))
sys.exit(4)
"""


def run_launch(*args: str, **env: str) -> tuple[int, str, str, float]:
    """``paramshard launch ARGS``: its exit code, stdout, stderr, and when it ended."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "paramshard", "launch", *args],
        cwd=ROOT,
        env=launch_env(**env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the test can clean up whatever the launcher leaves
    )
    try:
        out, err = proc.communicate(timeout=RUN_S)
        return proc.returncode, out, err, time.time()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait(timeout=10)


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_failed_ranks_background_child_is_stopped_promptly(tmp_path: Path, nproc: int) -> None:
    script = tmp_path / "leaves_a_child.py"
    script.write_text(LEAVES_A_CHILD)
    folder = tmp_path / "pids"
    folder.mkdir()
    code, out, err, ended_at = run_launch("--nproc", str(nproc), str(script), str(folder))
    children = [int(p.read_text()) for p in sorted(folder.glob("child.*"))]
    try:
        assert code == 4, out + err
        assert "[rank 0] failing now" in out
        assert "rank 0 failed with exit code 4" in err
        lag = ended_at - float((folder / "failed_at").read_text())
        assert lag < EXIT_LAG_S, f"the launcher exited {lag:.1f} s after rank 0 failed\n{err}"
        assert len(children) == nproc
        assert wait_gone(children, timeout=2.0) == [], f"left running: {children}\n{err}"
    finally:
        for pid in children:  # never leave a sleep behind, whatever failed
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass


RESTARTED = r"""
import os, subprocess, sys, time
from pathlib import Path
import torch
from paramshard.client import restarts
from paramshard.strategies import ShardingConfiguration, ZeRO2Model

folder = Path(sys.argv[1])
config = ShardingConfiguration.from_env(job="orphans-" + os.environ["PARAMSHARD_RUN"])
model = ZeRO2Model(torch.nn.Linear(4, 2), config)  # declares its state is on the servers
if restarts.restart_count() == 0:
    child = subprocess.Popen(["sleep", "40"])
    (folder / "child").write_text(str(child.pid))
    (folder / "first").write_text(str(os.getpid()))
    print("failing now", flush=True)
    sys.exit(3)
first, child = int((folder / "first").read_text()), int((folder / "child").read_text())
deadline = time.monotonic() + 10
while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in (first, child)):
    time.sleep(0.05)  # a zombie still has its /proc entry: the first process must be reaped
left = [p for p in (first, child) if os.path.exists(f"/proc/{p}")]
print("left at restart:", left, flush=True)
"""


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="reads /proc")
def test_a_restarted_ranks_leftovers_are_stopped_before_it_runs_again(tmp_path: Path) -> None:
    """Before the fix the failed process's ``sleep`` ran beside its successor until the job
    ended, and the failed process stayed a zombie as long: "left at restart: [FIRST, SLEEP]"."""
    script = tmp_path / "restarted.py"
    script.write_text(RESTARTED)
    folder = tmp_path / "pids"
    folder.mkdir()
    args = ["--nproc", "1", "--max-restarts", "1", str(script), str(folder)]
    code, out, err, _ = run_launch(*args, OMP_NUM_THREADS="1")
    child = int((folder / "child").read_text()) if (folder / "child").exists() else None
    try:
        assert code == 0, out + err
        assert "restarting it (its restart 1" in err
        assert "[rank 0] left at restart: []" in out, out + err
    finally:
        if child is not None:
            try:
                os.kill(child, 9)
            except ProcessLookupError:
                pass


def test_a_local_server_started_again_leaves_no_zombie_or_orphan(tmp_path: Path) -> None:
    """``--max-server-restarts``: the server that exited is reaped and what it left in its
    group is stopped before its successor starts (before the fix both stayed until the job
    ended). Real processes under ``supervise``; a shell stands in for the server."""
    left = tmp_path / "left"
    old = spawn("server 0", ["sh", "-c", f"sleep 40 & echo $! > {left}; exit 5"], ENV)
    done = tmp_path / "done"
    rank = spawn("rank 0", [sys.executable, "-c", WAITS_FOR, str(done)], ENV)
    servers, events, received = [old], queue.SimpleQueue(), []
    watch(old, events)
    watch(rank, events)
    restarts = ServerRestarts(1, lambda index: spawn(f"server {index}", ["sleep", "40"], ENV))
    result: list[int] = []
    runner = threading.Thread(
        target=lambda: result.append(
            supervise(
                [rank],
                servers,
                events,
                received,
                grace=5.0,
                restarts=RankRestarts(0),
                start_rank=None,
                server_restarts=restarts,
            )
        )
    )
    runner.start()
    try:
        deadline = time.monotonic() + 30
        while (servers[0] is old or not left.exists()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert servers[0] is not old and restarts.used == 1
        assert wait_gone([int(left.read_text())], timeout=5.0) == []
        reaped_by = time.monotonic() + 5  # a zombie keeps its /proc entry until reaped
        while os.path.exists(f"/proc/{old.proc.pid}") and time.monotonic() < reaped_by:
            time.sleep(0.05)
        assert not os.path.exists(f"/proc/{old.proc.pid}"), "the old server is still a zombie"
    finally:
        done.write_text("")
        runner.join(30)
        stop(servers + [rank], signal.SIGKILL, 5.0, received)
    assert result == [0]


ENV = dict(os.environ)
WAITS_FOR = """
import os, sys, time
deadline = time.monotonic() + 60
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.05)
"""
