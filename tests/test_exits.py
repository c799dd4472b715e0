"""Every process exits: the shapes that hung, repeated, each failing if a process is still
alive a few seconds after its work.

- The four rank processes of a 3D cell (``benchmarks.hybrid``'s ranks, each hosting a server):
  after their work, and when one of them is killed mid-run (the others fail, and used to sit
  in the interpreter's exit draining a gRPC server's queue for ever: protos/closing.py).
- ``paramshard launch --nproc 2`` with one rank interrupted: the launcher, its other rank and
  its servers are gone within seconds (its servers used to print "stopped" and live on,
  their handler threads blocked in a wait, until SIGKILLed 15 s later).
- ``paramshard serve`` with a call waiting in it: gone within its grace after SIGTERM; with
  a client's session open and idle: gone at once.
- A process whose code raised with a server and a client open.
- ``LocalCluster`` after a failed run: none of the server's or the clients' threads is left.
"""

from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from conftest import worker_env

ROOT = Path(__file__).resolve().parents[1]
EXIT_S = 5.0
"""A process that finished its work is gone within this long (on two busy cores)."""
ROUNDS = 2  # each shape runs this many times


def _threads(pid: int) -> dict[str, str]:
    """Each running thread of process ``pid``: its name -> its state (R, S, D...); a zombie's
    are left out (dead, not reaped by its parent yet)."""
    out = {}
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            state = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        except OSError:
            continue
        if state != "Z":
            out[f"{name}/{tid}"] = state
    return out


def alive(pid: int) -> bool:
    """Whether any thread of process ``pid`` still runs."""
    return bool(_threads(pid))


class Lines:
    """A child's stdout, line by line, from a thread; ``seen`` keeps them with their time."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.q: queue.Queue = queue.Queue()
        self.seen: list[tuple[float, str]] = []

        def pump() -> None:
            for line in proc.stdout:
                self.seen.append((time.monotonic(), line.rstrip("\n")))
                self.q.put(self.seen[-1][1])
            self.q.put(None)

        threading.Thread(target=pump, daemon=True).start()

    def since(self, t0: float) -> str:
        return "\n".join(f"{t - t0:+7.2f} {line}" for t, line in self.seen if t >= t0 - 1)

    def expect(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            line = self.q.get(timeout=max(0.01, deadline - time.monotonic()))
            if line is None:
                raise AssertionError(f"the process ended before {prefix!r}")
            if line.startswith(prefix):
                return line[len(prefix) :].strip()


def gone_within(procs: list[subprocess.Popen], seconds: float) -> list[float]:
    """How long each process took to exit; fails naming those still alive after ``seconds``."""
    began, took = time.monotonic(), {}
    while len(took) < len(procs) and time.monotonic() - began < seconds:
        for i, p in enumerate(procs):
            if i not in took and p.poll() is not None:
                took[i] = time.monotonic() - began
        time.sleep(0.05)
    stuck = [p.pid for i, p in enumerate(procs) if i not in took]
    stacks = "".join(_stack(pid) for pid in stuck)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(10)
    assert not stuck, f"processes {stuck} still alive {seconds} s after their work\n{stacks}"
    return [round(took[i], 2) for i in range(len(procs))]


def _stack(pid: int) -> str:
    """Where process ``pid`` is (``py-spy dump --native``, when py-spy is installed)."""
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=os.path.dirname(sys.executable))
    if spy is None:
        return f"(pid {pid}: install py-spy to see its stack)\n"
    dump = [spy, "dump", "--native", "--pid", str(pid)]
    return subprocess.run(dump, capture_output=True, text=True, timeout=60, check=False).stdout


# ------------------------------------------------------------------------------ a 3D cell
def start_cell() -> tuple[list[subprocess.Popen], list[Lines]]:
    """The four ranks of the GPT 3D cell (pp 2, tp 2, dp 1), addresses exchanged."""
    argv = ["--model", "tiny", "--world", "4", "--steps", "2", "--cell", "3d", "--family", "gpt"]
    argv += ["--pp", "2", "--tp", "2", "--dp", "1", "--schedule", "gpipe", "--micro-batches", "2"]
    argv += ["--run", f"x{uuid.uuid4().hex[:10]}", "--lifetime", "600"]
    env = {**worker_env(), "GRPC_VERBOSITY": "ERROR"}  # worker_env: this checkout first
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "benchmarks.hybrid", "_ours", *argv, "--rank", str(r)],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(4)
    ]
    lines = [Lines(p) for p in procs]
    addresses = [ln.expect("ADDR ", 300) for ln in lines]
    for p in procs:
        p.stdin.write("SERVERS " + ",".join(addresses) + "\n")
        p.stdin.flush()
    return procs, lines


@pytest.mark.slow
@pytest.mark.parametrize("round_", range(ROUNDS))
def test_a_3d_cells_ranks_exit_after_their_work(round_):
    procs, lines = start_cell()
    try:
        for ln in lines:
            ln.expect("RESULT ", 600)
        for p in procs:
            p.stdin.write("EXIT\n")
            p.stdin.flush()
        took = gone_within(procs, EXIT_S)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0, 0, 0]
    print(f"exited {took} s after EXIT")


@pytest.mark.slow
@pytest.mark.parametrize("round_", range(ROUNDS))
def test_a_3d_cells_ranks_exit_when_one_is_killed(round_):
    """Rank 3 (a trainer and a server) is SIGKILLed while the cell trains: the other three
    fail (a lost rank, a lost server) and exit."""
    procs, _ = start_cell()
    try:
        time.sleep(0.5)  # into their setup: building and registering the model
        procs[3].kill()
        for p in procs[:3]:  # had one finished already, its EXIT would come with the others'
            p.stdin.write("EXIT\n")
            p.stdin.flush()
        took = gone_within(procs[:3], 60.0)  # their calls' retries, then their exit
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode != 0 for p in procs[:3])
    print(f"the others exited {took} s after the kill")


# ---------------------------------------------------------------------------------- launch
TRAIN_LOOP = textwrap.dedent(
    """
    import time
    import numpy as np
    from paramshard.client import ShardClient
    c = ShardClient.from_env(timeout_s=60)
    try:
        c.all_reduce(np.ones(4, dtype=np.float32))
        print("ready", flush=True)
        while True:
            c.all_reduce(np.ones(1000, dtype=np.float32))
            time.sleep(0.01)
    finally:
        c.close()
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("round_", range(3))
def test_launch_exits_soon_after_one_rank_is_interrupted(tmp_path, round_):
    script = tmp_path / "loop.py"
    script.write_text(TRAIN_LOOP)
    launch = subprocess.Popen(
        [sys.executable, "-m", "paramshard", "launch", "--nproc", "2", str(script)],
        env=worker_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    out = Lines(launch)
    try:
        pids = {}  # "rank 0", "server 1", ... -> pid
        deadline = time.monotonic() + 120
        while sum(1 for k in pids if k.startswith("rank")) < 2 or len(pids) < 4:
            line = out.q.get(timeout=max(0.01, deadline - time.monotonic()))
            assert line is not None, "launch ended early"
            if m := re.search(r"\[(server \d)\] paramshard serve: listening.* pid (\d+)", line):
                pids[m.group(1)] = int(m.group(2))
            if m := re.match(r"\[(rank \d)\] ready", line):
                pids[m.group(1)] = _child_pid(launch.pid, m.group(1))
        interrupted = time.monotonic()
        os.kill(pids["rank 1"], signal.SIGINT)
        try:
            launch.wait(EXIT_S)
        except subprocess.TimeoutExpired:  # where it and its children are, what it said when
            stacks = "".join(
                f"{n}: {_threads(pid)}\n{_stack(pid)}" for n, pid in pids.items() if alive(pid)
            )
            raise AssertionError(
                f"launch still alive {EXIT_S} s after rank 1's SIGINT\n{_stack(launch.pid)}"
                f"\n{stacks}\n{out.since(interrupted)}"
            ) from None
    finally:
        if launch.poll() is None:
            launch.kill()
    left = [name for name, pid in pids.items() if alive(pid)]
    assert not left, f"{left} outlived the launcher"


def _child_pid(parent: int, rank: str) -> int:
    """The pid of launch's child running rank ``rank`` ("rank 1": RANK=1 in its environment)."""
    want = f"RANK={rank.split()[1]}".encode()
    for task in Path(f"/proc/{parent}/task").iterdir():
        for pid in (task / "children").read_text().split():
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if want in environ and b"PARAMSHARD_RUN" in b"".join(environ):
                return int(pid)
    raise AssertionError(f"no process of {rank} under {parent}")


# ----------------------------------------------------------------------------------- serve
@pytest.mark.slow
@pytest.mark.parametrize("calls", ["a call waiting", "a session idle"])
def test_serve_exits_within_its_grace(calls):
    """A call still waiting gets the grace; an open session with nothing in flight does not
    hold the stop (it used to: every SIGTERM of a server with a client took the whole grace,
    5 s by default; ``docker stop`` gives 10 s in all)."""
    from paramshard.client import ClusterSpec, ShardClient, ShardClientError

    waits = calls == "a call waiting"
    grace = 2.0 if waits else 60.0
    serve = subprocess.Popen(
        [sys.executable, "-m", "paramshard", "serve", "--port", "0", "--grace", str(grace)],
        env=worker_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    out = Lines(serve)
    client = None
    try:
        address = re.match(r"listening on (\S+)", out.expect("paramshard serve: ", 60)).group(1)
        client = ShardClient(ClusterSpec([address]), rank=0, world_size=1 + waits, run_id="w")
        failed: list[BaseException] = []

        def wait_for_rank_1() -> None:  # a slot read that never completes
            try:
                client.all_reduce(np.ones(3, dtype=np.float32))
            except ShardClientError as exc:
                failed.append(exc)

        if waits:
            waiting = threading.Thread(target=wait_for_rank_1, daemon=True)
            waiting.start()
            time.sleep(1.0)
        else:  # its session opens, and stays open
            assert client.all_reduce(np.ones(3, dtype=np.float32)).tolist() == [1.0] * 3
        serve.send_signal(signal.SIGTERM)
        took = gone_within([serve], (grace if waits else 0.0) + EXIT_S)
        if waits:
            waiting.join(30)
        assert serve.returncode == 0 and (failed or not waits), (serve.returncode, failed)
        print(f"serve exited {took[0]} s after SIGTERM (grace {grace:g} s, {calls})")
    finally:
        if client is not None:
            client.close()
        if serve.poll() is None:
            serve.kill()


# ---------------------------------------------------------------------- a raising program
def test_a_program_that_raises_with_a_server_and_a_client_open_exits(servers):
    """Nothing closed: the program raised before its ``finally``, with another process still
    calling its server. The exit hook closes both (protos/closing.py); the process is gone
    within seconds instead of hanging in the interpreter's exit."""
    (peer_server,) = servers(1)
    code = textwrap.dedent(
        f"""
        import time
        import numpy as np
        from paramshard.client import ClusterSpec, ShardClient
        from paramshard.server import ShardServer
        srv = ShardServer().start()
        c = ShardClient(ClusterSpec([srv.address, "{peer_server.address}"]), rank=0,
                        world_size=2, run_id="raising")
        print(srv.address, flush=True)
        time.sleep(2)
        raise RuntimeError("the training failed")
        """
    )
    from paramshard.client import ClusterSpec, ShardClient

    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        env=worker_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    other = None
    try:
        address = proc.stdout.readline().strip()
        # the other rank keeps calling its server, as the ranks of a job do
        other = ShardClient(
            ClusterSpec([address, peer_server.address]), rank=1, world_size=2, run_id="raising"
        )
        proc.wait(60)
        gone_within([proc], EXIT_S)
    finally:
        if other is not None:
            other.close()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1


# ------------------------------------------------------------------------------ LocalCluster
OUR_THREADS = ("lease", "session-receiver", "shard", "session", "shard-expiry", "shm-handover")


def _ours(thread: threading.Thread) -> bool:
    return any(thread.name.startswith(p) for p in OUR_THREADS)


def _fails_while_the_other_waits(config):
    if config.client.rank == 1:
        time.sleep(0.5)
        raise RuntimeError("rank 1 fails")
    config.client.all_reduce(np.ones(3, dtype=np.float32))  # waits for rank 1 for ever


def test_local_cluster_leaves_no_thread_after_a_failed_run():
    from paramshard import LocalCluster
    from paramshard.local_ranks import RankFailed

    before = {t for t in threading.enumerate() if _ours(t)}
    with LocalCluster(world_size=2) as cluster:
        with pytest.raises(RankFailed, match="rank 1 fails"):
            cluster.run(_fails_while_the_other_waits, timeout_s=60)
    deadline = time.monotonic() + EXIT_S
    while time.monotonic() < deadline:
        left = [t.name for t in threading.enumerate() if _ours(t) and t not in before]
        if not left:
            break
        time.sleep(0.1)
    assert not left, f"threads left: {left}"
