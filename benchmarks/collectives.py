"""Collectives and flat-buffer transport through the shard servers, against torch gloo and raw TCP.

    python -m benchmarks.collectives [--quick] [--sizes 1,16,64] [--world-sizes 2,4]

Measured in one run, on 127.0.0.1 (DESIGN section 7 has the transport facts these compare to):

- **collectives**: all_reduce, all_gather, reduce_scatter for each world size W and tensor size S,
  (a) ours with each rank process hosting its own ShardServer (server threads in-process),
  (b) ours with the W servers as separate processes, (c) torch.distributed on gloo.
  Every rank is its own process, started with subprocess so that ``server.MALLOC_ENV`` is in its
  environment before the interpreter starts; gloo ranks get the same settings (``--gloo-env
  default`` runs them in the plain environment, as torch users usually do). Each repetition:
  barrier, then time the op on every rank; a repetition's time is the max over ranks; we quote
  the median over the repetitions of all rounds, after warm-up. CPU seconds per op and rank are
  reported too: on 2 cores both sides are CPU-bound, and CPU is steadier than wall time.
- **tcp**: one raw TCP stream on loopback moving S=64 MiB from a sender process to a receiver
  process (recv_into a preallocated buffer, 1-byte ack): the ceiling for one connection.
- **push_pull**: one client process pushing a 64 MiB flat gradient buffer to W server processes
  (``push_grads`` with SGD lr=0 step arguments, so each push also completes a step) and pulling
  the parameters back (``pull_params``).
- **codec**: the same push/pull with servers started with ``fast_codec=False`` and a client that
  uses the generated protobuf classes (``ShardStub``, ``PushGradRequest(data=arr.tobytes())``)
  with the same chunking and calls in flight, against ours.

Size convention (as nccl-tests and the torch anchors): S is the all_reduce tensor, the all_gather
OUTPUT (each rank contributes S/W) and the reduce_scatter INPUT (each rank keeps S/W).
GB/s = S bytes / median seconds / 1e9 (algorithm bandwidth, payload bytes only).

Options: ``--parts transport,collectives``, ``--rounds N``, ``--reps N``, ``--no-separate``,
``--no-gloo``, ``--wait-quiet SECONDS`` (wait for other load to stop before each phase).

Prints one JSON document to stdout; progress goes to stderr. Every child process is started by
this script, has a lifetime watchdog and exits when this process dies; all are stopped by PID.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import queue
import resource
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

MiB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPS = ("all_reduce", "all_gather", "reduce_scatter")
CHUNK_BYTES = 4 << 20  # ShardClient's defaults; --chunk-mib / --in-flight change them
MAX_IN_FLIGHT = 8
GRPC_BIG = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
MALLOC_KEYS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_ARENA_MAX")


def log(msg: str) -> None:
    print(f"[collectives {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def median_ms(seconds: list[float]) -> float:
    return round(statistics.median(seconds) * 1e3, 3)


def gbps(nbytes: int, ms: float | None) -> float | None:
    return None if not ms else round(nbytes / (ms / 1e3) / 1e9, 3)


# =============================================================================== child processes
class ChildError(RuntimeError):
    pass


class ChildTimeout(ChildError):
    pass


class Child:
    """A child process running one mode of this module; talks line by line over stdin/stdout."""

    registry: list[Child] = []

    def __init__(self, name: str, argv: list[str], env: dict[str, str], lifetime: float) -> None:
        self.name = name
        cmd = [sys.executable, "-m", "benchmarks.collectives", *argv, "--lifetime", str(lifetime)]
        self.proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        Child.registry.append(self)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def expect(self, tag: str, timeout: float) -> str:
        """The payload of the next ``TAG payload`` line (other lines are passed to stderr)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ChildTimeout(f"{self.name}: no {tag} within {timeout:.0f} s")
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                rc = self.proc.wait(timeout=10)
                raise ChildError(f"{self.name} exited (rc={rc}) before sending {tag}")
            if line.startswith(tag + " "):
                return line[len(tag) + 1 :]
            print(f"  [{self.name}] {line}", file=sys.stderr, flush=True)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError) as exc:
            raise ChildError(f"{self.name}: cannot write to it ({exc})") from None

    def stop(self, timeout: float = 15.0) -> None:
        stop_all([self], timeout)


def stop_all(children: list[Child] | None = None, timeout: float = 15.0) -> None:
    """Stops the given children (default: all still registered), all at once: close their stdin
    (their cue to exit), wait up to ``timeout`` s, then SIGTERM, then SIGKILL, each by PID."""
    kids = list(Child.registry if children is None else children)
    for c in kids:
        try:
            if c.proc.poll() is None and c.proc.stdin is not None:
                c.proc.stdin.close()
        except OSError:
            pass
    for grace, action in ((timeout, "terminate"), (5.0, "kill"), (5.0, None)):
        deadline = time.monotonic() + grace
        for c in kids:
            try:
                c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        alive = [c for c in kids if c.proc.poll() is None]
        if not alive:
            break
        if action is None:
            log(f"could not stop {[c.name for c in alive]}")
            break
        for c in alive:
            getattr(c.proc, action)()
    for c in kids:
        if c in Child.registry and c.proc.poll() is not None:
            Child.registry.remove(c)


def expect_all(kids: list[Child], tag: str, timeout: float, watch: list[Child] = ()) -> list[str]:
    """Every kid's next ``tag`` payload; fails as soon as any kid or watched child exits."""
    deadline = time.monotonic() + timeout
    got: dict[int, str] = {}
    while len(got) < len(kids):
        for i, k in enumerate(kids):
            if i in got:
                continue
            try:
                got[i] = k.expect(tag, 0.1)
            except ChildTimeout:
                pass
        for w in watch:
            # a kid's own exit surfaces through its expect() once its output is drained
            if w not in kids and w.proc.poll() is not None:
                raise ChildError(
                    f"{w.name} exited (rc={w.proc.returncode}) while waiting for {tag}"
                )
        if time.monotonic() > deadline and len(got) < len(kids):
            missing = [k.name for i, k in enumerate(kids) if i not in got]
            raise ChildError(f"no {tag} from {missing} within {timeout:.0f} s")
    return [got[i] for i in range(len(kids))]


def child_env(tuned: bool) -> dict[str, str]:
    from server import MALLOC_ENV

    env = {k: v for k, v in os.environ.items() if k not in MALLOC_KEYS}
    if tuned:
        env.update(MALLOC_ENV)
    env.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
    env.setdefault("GRPC_VERBOSITY", "ERROR")
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


# ------------------------------------------------------------------------ child-side helpers
def emit(tag: str, payload: Any) -> None:
    text = payload if isinstance(payload, str) else json.dumps(payload)
    sys.stdout.write(f"{tag} {text}\n")
    sys.stdout.flush()


def child_guard(lifetime: float) -> None:
    """Exit on our own if the parent dies or the lifetime runs out (no orphans)."""
    parent = os.getppid()

    def watch() -> None:
        end = time.monotonic() + lifetime
        while time.monotonic() < end:
            if os.getppid() != parent:
                os._exit(5)
            time.sleep(0.5)
        print(f"child {os.getpid()}: lifetime {lifetime:.0f} s exceeded", file=sys.stderr)
        os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def wait_parent_eof() -> None:
    """Blocks until the parent closes our stdin (or writes EXIT)."""
    for line in sys.stdin:
        if line.strip() == "EXIT":
            return


def malloc_env_state() -> dict[str, str]:
    return {k: os.environ[k] for k in MALLOC_KEYS if k in os.environ}


def reps_for(mib: float, a: argparse.Namespace) -> int:
    if a.reps:
        return a.reps
    if a.quick:
        return 5
    return 30 if mib <= 1 else 15 if mib <= 16 else 10


def barrier_cpu_s(barrier: Any, clock: Any = time.process_time, n: int = 20) -> float:
    """CPU seconds (by ``clock``) per barrier, subtracted from the per-op CPU."""
    barrier()
    c0 = clock()
    for _ in range(n):
        barrier()
    return (clock() - c0) / n


def time_reps(
    fn: Any,
    barrier: Any,
    reps: int,
    warmup: int,
    barrier_cpu: float,
    clock: Any = time.process_time,
) -> dict[str, Any]:
    """``warmup - 1`` untimed calls (the caller made one to check the result), then ``reps`` of
    barrier + timed call. CPU: ``clock`` (this process's user+sys seconds, all threads; plus a
    share of separate servers) over the loop, less the barriers' share, per call; so a rank's
    server threads still serving others after its own call returned count too."""
    for _ in range(warmup - 1):
        fn()
    times = []
    cpu0 = clock()
    for _ in range(reps):
        barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    barrier()
    cpu = (clock() - cpu0) / reps - barrier_cpu * (reps + 1) / reps
    return {"t": times, "cpu_s": max(0.0, cpu)}


# -------------------------------------------------------------------------- ours: rank process
def expected_sum(world: int) -> float:
    return world * (world + 1) / 2.0  # rank r contributes r + 1


def check_result(op: str, res: Any, world: int, rank: int, n: int) -> bool:
    import numpy as np

    s = expected_sum(world)
    if op == "all_reduce":
        return res.size == n and bool(np.all(np.asarray(res) == s))
    if op == "reduce_scatter":
        return res.size == n // world and bool(np.all(np.asarray(res) == s))
    return len(res) == world and all(
        np.asarray(r).size == n // world and bool(np.all(np.asarray(r) == j + 1))
        for j, r in enumerate(res)
    )


def rank_main(a: argparse.Namespace) -> None:
    """One rank of ours: optionally hosts a ShardServer, then times the collectives."""
    import numpy as np

    from client import ClusterSpec, ShardClient

    server = None
    if a.host_server:
        from server import ShardServer

        server = ShardServer(port=0).start()
        emit("ADDR", server.address)
    addrs, server_pids = json.loads(sys.stdin.readline())
    world, rank = a.world, a.rank

    def clock() -> float:  # own CPU + an even share of the separate servers' CPU
        return time.process_time() + sum(proc_cpu_s(p) for p in server_pids) / world

    c = ShardClient(
        ClusterSpec(addrs),
        rank=rank,
        world_size=world,
        run_id=a.run_id,
        chunk_bytes=a.chunk_bytes,
        max_in_flight=a.in_flight,
    )
    bcpu = barrier_cpu_s(c.barrier, clock)
    out: dict[str, Any] = {
        "malloc_env": malloc_env_state(),
        "pid": os.getpid(),
        "barrier_cpu_ms": round(bcpu * 1e3, 3),
    }
    for mib in a.sizes:
        n = int(mib * MiB) // 4
        n -= n % world
        full = np.full(n, rank + 1, np.float32)
        part = np.full(n // world, rank + 1, np.float32)
        fns = {
            "all_reduce": lambda full=full: c.all_reduce(full),
            "all_gather": lambda part=part: c.all_gather(part),
            "reduce_scatter": lambda full=full: c.reduce_scatter(full),
        }
        for op in OPS:
            fn = fns[op]
            c.barrier()
            ok = check_result(op, fn(), world, rank, n)
            out[f"{op}/{mib:g}"] = {
                **time_reps(fn, c.barrier, reps_for(mib, a), a.warmup, bcpu, clock),
                "ok": ok,
            }
    emit("RESULT", out)
    # Two-phase exit: every rank closes its channels first (CLOSE), and the servers stop only
    # when the parent closes stdin, so no rank sees another's server go away mid-call.
    line = sys.stdin.readline()
    c.close()
    if line.strip() == "CLOSE":
        emit("CLOSED", "")
        wait_parent_eof()
    if server is not None:
        server.stop(grace=None)


def server_main(a: argparse.Namespace) -> None:
    from server import ShardServer

    server = ShardServer(port=0, fast_codec=not a.plain).start()
    emit("ADDR", server.address)
    wait_parent_eof()
    server.stop(grace=None)


# -------------------------------------------------------------------------- gloo: rank process
def gloo_main(a: argparse.Namespace) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # as the anchors (torch_gloo_collectives.py)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{a.init_file}",
        rank=a.rank,
        world_size=a.world,
        timeout=datetime.timedelta(seconds=180),
    )
    out: dict[str, Any] = {
        "malloc_env": malloc_env_state(),
        "torch": torch.__version__,
        "reduce_scatter_impl": "reduce_scatter_tensor",
    }
    bcpu = barrier_cpu_s(dist.barrier)
    out["barrier_cpu_ms"] = round(bcpu * 1e3, 3)
    for mib in a.sizes:
        _gloo_size(a, mib, out, bcpu)
    emit("RESULT", out)
    dist.barrier()
    dist.destroy_process_group()


def _gloo_size(a: argparse.Namespace, mib: float, out: dict[str, Any], bcpu: float) -> None:
    import torch
    import torch.distributed as dist

    world, rank = a.world, a.rank
    n = int(mib * MiB) // 4
    n -= n % world
    s = expected_sum(world)
    full = torch.full((n,), float(rank + 1))
    ar = full.clone()  # all_reduce is in place: its values grow xW a call (no overflow in reps)
    part = torch.full((n // world,), float(rank + 1))
    gathered = torch.empty(n)
    rs_out = torch.empty(n // world)

    def rs_native() -> None:
        dist.reduce_scatter_tensor(rs_out, full)

    def rs_emulated() -> None:  # what torch users do without reduce_scatter: all_reduce + slice
        tmp = full.clone()
        dist.all_reduce(tmp)
        rs_out.copy_(tmp.chunk(world)[rank])

    fns = {
        "all_reduce": lambda: dist.all_reduce(ar),
        "all_gather": lambda: dist.all_gather_into_tensor(gathered, part),
        "reduce_scatter": rs_native,
    }
    checks = {
        "all_reduce": lambda: bool(torch.all(ar == s)),
        "all_gather": lambda: all(
            bool(torch.all(ch == j + 1)) for j, ch in enumerate(gathered.chunk(world))
        ),
        "reduce_scatter": lambda: bool(torch.all(rs_out == s)),
    }
    for op in OPS:
        fn = fns[op]
        dist.barrier()
        ar.copy_(full)
        try:
            fn()
        except (RuntimeError, NotImplementedError) as exc:
            if op != "reduce_scatter":
                raise
            out["reduce_scatter_impl"] = f"emulated: all_reduce + slice ({str(exc)[:120]})"
            fn = rs_emulated
            dist.barrier()
            fn()
        ok = checks[op]()
        timing = time_reps(fn, dist.barrier, reps_for(mib, a), a.warmup, bcpu)
        out[f"{op}/{mib:g}"] = {**timing, "ok": ok}


# ------------------------------------------------------------------------------------ raw TCP
_HDR = struct.Struct("<q")


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("peer closed")
        got += k


def tcp_recv_main(a: argparse.Namespace) -> None:
    import numpy as np

    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(1)
    emit("PORT", str(ls.getsockname()[1]))
    conn, _ = ls.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = np.empty(0, np.uint8)
    hdr = bytearray(_HDR.size)
    while True:
        _recv_exact(conn, memoryview(hdr))
        (n,) = _HDR.unpack(hdr)
        if n <= 0:
            break
        if buf.size < n:
            buf = np.empty(n, np.uint8)
            buf.fill(0)  # fault the pages in once, outside the timed transfers
        _recv_exact(conn, memoryview(buf)[:n])
        conn.sendall(b"k")
    conn.close()


def tcp_send_main(a: argparse.Namespace) -> None:
    import numpy as np

    n = int(a.mib * MiB)
    src = np.random.default_rng(0).standard_normal(n // 4, dtype=np.float32)
    view = memoryview(src).cast("B")
    sock = socket.create_connection(("127.0.0.1", a.port), timeout=120)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ack = bytearray(1)
    times = []
    for i in range(a.warmup + a.reps):
        t0 = time.perf_counter()
        sock.sendall(_HDR.pack(n))
        sock.sendall(view)
        _recv_exact(sock, memoryview(ack))
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
    sock.sendall(_HDR.pack(0))
    sock.close()
    emit("RESULT", {"t": times})


# ----------------------------------------------------------------------------------- push/pull
class PlainClient:
    """The generated protobuf classes (ShardStub, ``bytes`` fields), same chunking and windowing."""

    def __init__(self, addrs: list[str], chunk_bytes: int, max_in_flight: int) -> None:
        import grpc

        from protos import shard_pb2_grpc

        self.chans = [grpc.insecure_channel(x, options=GRPC_BIG) for x in addrs]
        self.stubs = [shard_pb2_grpc.ShardStub(ch) for ch in self.chans]
        self.chunk = chunk_bytes // 4
        self.window = max_in_flight

    def _run(self, calls: list[Any]) -> None:
        """calls: (send() -> future, on_result(reply)); at most ``window`` in flight."""
        pending: list[Any] = []
        it = iter(calls)
        for send, done in it:
            pending.append((send(), done))
            if len(pending) >= self.window:
                fut, cb = pending.pop(0)
                cb(fut.result())
        for fut, cb in pending:
            cb(fut.result())

    def _chunks(self, numel: int) -> list[tuple[int, int, int, int]]:
        from protos import slicing

        out = []
        for p in slicing.pieces(numel, len(self.stubs), 0, numel):
            for o, n in slicing.chunk_ranges(p.numel, self.chunk):
                out.append((p.server, p.local_offset + o, p.global_offset + o, n))
        return out

    def register(self, job: str, buf: str, numel: int) -> None:
        from protos import shard_pb2 as pb

        for i, stub in enumerate(self.stubs):
            stub.RegisterBuffer(
                pb.RegisterBufferRequest(
                    ref=pb.BufferRef(job=job, buffer=buf),
                    numel=numel,
                    num_servers=len(self.stubs),
                    server_index=i,
                    contributors=1,
                    optimizer=pb.OptimizerSpec(name="sgd", hyper={"lr": 0.0}),
                ),
                timeout=60,
            )

    def set_params(self, job: str, buf: str, flat: Any, version: int) -> None:
        from protos import shard_pb2 as pb

        ref = pb.BufferRef(job=job, buffer=buf)
        calls = []
        for s, local, g, n in self._chunks(flat.size):

            def send(s=s, local=local, g=g, n=n):
                req = pb.SetParamsRequest(
                    header=pb.SetParamsHeader(
                        ref=ref,
                        version=version,
                        chunk=pb.Chunk(offset=local, numel=n, dtype=pb.FLOAT32),
                    ),
                    data=flat[g : g + n].tobytes(),
                )
                return self.stubs[s].SetParams.future(req, timeout=120)

            calls.append((send, lambda r: None))
        self._run(calls)

    def push(self, job: str, buf: str, flat: Any, step: int) -> None:
        from protos import shard_pb2 as pb

        ref = pb.BufferRef(job=job, buffer=buf)
        args = pb.StepArgs(hyper={"lr": 0.0}, clip_coef=1.0)
        calls = []
        for s, local, g, n in self._chunks(flat.size):

            def send(s=s, local=local, g=g, n=n):
                req = pb.PushGradRequest(
                    header=pb.PushGradHeader(
                        ref=ref,
                        step=step,
                        contributor=0,
                        micro=0,
                        num_micro=1,
                        step_args=args,
                        chunk=pb.Chunk(offset=local, numel=n, dtype=pb.FLOAT32),
                    ),
                    data=flat[g : g + n].tobytes(),
                )
                return self.stubs[s].PushGrad.future(req, timeout=120)

            calls.append((send, lambda r: None))
        self._run(calls)

    def pull(self, job: str, buf: str, numel: int, min_version: int) -> Any:
        import numpy as np

        from protos import shard_pb2 as pb

        ref = pb.BufferRef(job=job, buffer=buf)
        out = np.empty(numel, np.float32)
        calls = []
        for s, local, g, n in self._chunks(numel):

            def send(s=s, local=local, n=n):
                req = pb.PullParamsRequest(
                    ref=ref,
                    min_version=min_version,
                    chunk=pb.Chunk(offset=local, numel=n, dtype=pb.FLOAT32),
                )
                return self.stubs[s].PullParams.future(req, timeout=120)

            def done(reply, g=g, n=n):
                out[g : g + n] = np.frombuffer(reply.data, np.float32)

            calls.append((send, done))
        self._run(calls)
        return out

    def close(self) -> None:
        for ch in self.chans:
            ch.close()


def pushpull_main(a: argparse.Namespace) -> None:
    """One client: push a flat buffer to W servers and pull it back; ours vs plain protobuf."""
    import numpy as np

    from client import ClusterSpec, ShardClient, StepArgs

    fast_addrs, plain_addrs = json.loads(sys.stdin.readline())
    n = int(a.mib * MiB) // 4
    params = np.random.default_rng(1).standard_normal(n, dtype=np.float32)
    grads = np.random.default_rng(2).standard_normal(n, dtype=np.float32)
    job, buf = "bench", "flat"

    ours = ShardClient(
        ClusterSpec(fast_addrs),
        rank=0,
        world_size=1,
        run_id="pushpull",
        chunk_bytes=a.chunk_bytes,
        max_in_flight=a.in_flight,
    )
    ours.register_buffer(job, buf, n, optimizer="sgd", hyper={"lr": 0.0})
    ours.set_params(job, buf, params)
    plain = PlainClient(plain_addrs, a.chunk_bytes, a.in_flight)
    plain.register(job, buf, n)
    plain.set_params(job, buf, params, 0)
    step_args = StepArgs({"lr": 0.0})
    res: dict[str, Any] = {"malloc_env": malloc_env_state()}
    for k in ("ours", "plain"):
        res[k] = {"push": [], "pull": [], "set": [], "push_cpu": [], "pull_cpu": [], "ok": True}
    for i in range(a.warmup + a.reps):
        keep = i >= a.warmup
        # interleaved, so drift on a noisy machine hits both alike
        for name, push, pull, setp in (
            (
                "ours",
                lambda s: ours.push_grads(job, buf, grads, s, step_args=step_args),
                lambda v: ours.pull_params(job, buf, n, v),
                lambda v: ours.set_params(job, buf, params, version=v),
            ),
            (
                "plain",
                lambda s: plain.push(job, buf, grads, s),
                lambda v: plain.pull(job, buf, n, v),
                lambda v: plain.set_params(job, buf, params, v),
            ),
        ):
            r = res[name]
            # step i: version i -> i + 1 (SGD with lr=0 leaves the values as they were)
            c0, t0 = time.process_time(), time.perf_counter()
            push(2 * i)
            c1, t1 = time.process_time(), time.perf_counter()
            got = pull(2 * i + 1)
            c2, t2 = time.process_time(), time.perf_counter()
            setp(2 * i + 2)  # transport-only push: SetParams with the next version
            t3 = time.perf_counter()
            if i == 0 or not keep:
                r["ok"] = r["ok"] and bool(np.array_equal(got, params))
            if keep:
                r["push"].append(t1 - t0)
                r["pull"].append(t2 - t1)
                r["set"].append(t3 - t2)
                r["push_cpu"].append(c1 - c0)
                r["pull_cpu"].append(c2 - c1)
    emit("RESULT", res)
    ours.close()
    plain.close()


# =============================================================================== parent: phases
def cpu_busy_s() -> float:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return (sum(v[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    s = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime + s.ru_utime + s.ru_stime


class Load:
    """Fraction of the machine's CPU used by processes other than ours during a phase."""

    def __enter__(self) -> Load:
        self.t, self.busy, self.own = time.monotonic(), cpu_busy_s(), children_cpu_s()
        return self

    def __exit__(self, *exc: object) -> None:
        dt = max(1e-9, time.monotonic() - self.t)
        foreign = (cpu_busy_s() - self.busy) - (children_cpu_s() - self.own)
        self.foreign = round(max(0.0, foreign) / (dt * (os.cpu_count() or 1)), 3)


def start_servers(
    w: int, plain: bool, a: argparse.Namespace, tag: str
) -> tuple[list[Child], list[str]]:
    env = child_env(True)
    kids = [
        Child(f"{tag}server{i}", ["_server"] + (["--plain"] if plain else []), env, a.lifetime)
        for i in range(w)
    ]
    return kids, expect_all(kids, "ADDR", 60, watch=kids)


def rank_argv(a: argparse.Namespace) -> list[str]:
    argv = ["--sizes", ",".join(f"{s:g}" for s in a.sizes), "--warmup", str(a.warmup)]
    argv += ["--chunk-mib", f"{a.chunk_mib:g}", "--in-flight", str(a.in_flight)]
    if a.reps:
        argv += ["--reps", str(a.reps)]
    if a.quick:
        argv.append("--quick")
    return argv


def result_timeout(a: argparse.Namespace, w: int) -> float:
    return 120.0 + 6.0 * w * sum(reps_for(s, a) * max(1.0, s / 8) for s in a.sizes)


def run_ours(w: int, a: argparse.Namespace, separate: bool) -> list[dict[str, Any]]:
    kids: list[Child] = []
    try:
        if separate:
            servers, addrs = start_servers(w, False, a, "sep")
            kids += servers
        env = child_env(True)
        run_id = f"bench{os.getpid()}w{w}{'s' if separate else 'i'}"
        ranks = [
            Child(
                f"{'sep' if separate else 'ours'}rank{r}",
                ["_rank", "--rank", str(r), "--world", str(w), "--run-id", run_id]
                + ([] if separate else ["--host-server"])
                + rank_argv(a),
                env,
                a.lifetime,
            )
            for r in range(w)
        ]
        kids += ranks
        if not separate:
            addrs = expect_all(ranks, "ADDR", 60, watch=ranks)
        server_pids = [k.proc.pid for k in servers] if separate else []
        for k in ranks:
            k.send(json.dumps([addrs, server_pids]))
        timeout = result_timeout(a, w)
        results = [json.loads(x) for x in expect_all(ranks, "RESULT", timeout, watch=kids)]
        for k in ranks:
            k.send("CLOSE")
        expect_all(ranks, "CLOSED", 30, watch=kids)
        return results
    finally:
        stop_all(kids)


def run_gloo(w: int, a: argparse.Namespace) -> list[dict[str, Any]]:
    fd, init_file = tempfile.mkstemp(prefix="collectives_gloo_")
    os.close(fd)
    os.unlink(init_file)  # the FileStore creates it
    env = child_env(a.gloo_env == "tuned")
    kids = [
        Child(
            f"gloorank{r}",
            ["_gloo", "--rank", str(r), "--world", str(w), "--init-file", init_file] + rank_argv(a),
            env,
            a.lifetime,
        )
        for r in range(w)
    ]
    try:
        return [json.loads(x) for x in expect_all(kids, "RESULT", result_timeout(a, w), kids)]
    finally:
        stop_all(kids, timeout=30)
        if os.path.exists(init_file):
            os.unlink(init_file)


def summarise(rounds: list[list[dict[str, Any]]], op: str, mib: float) -> dict[str, Any]:
    """Pools the repetitions of every round: a repetition's time is the max over its ranks."""
    worst: list[float] = []
    cpu: list[float] = []
    ok = True
    for results in rounds:
        per_rank = [r[f"{op}/{mib:g}"] for r in results]
        reps = min(len(p["t"]) for p in per_rank)
        worst += [max(p["t"][i] for p in per_rank) for i in range(reps)]
        cpu += [p["cpu_s"] for p in per_rank]
        ok = ok and all(p["ok"] for p in per_rank)
    return {
        "ms": median_ms(worst),
        "ms_min_max": [round(min(worst) * 1e3, 3), round(max(worst) * 1e3, 3)],
        "reps": len(worst),
        "cpu_ms_per_rank": round(statistics.mean(cpu) * 1e3, 2),
        "ok": ok,
    }


def wait_quiet(max_wait: float, threshold: float = 0.2) -> float:
    """Waits (up to max_wait s) until other processes use < threshold of the CPUs."""
    end = time.monotonic() + max_wait
    while True:
        b0, t0 = cpu_busy_s(), time.monotonic()
        time.sleep(2.0)
        frac = (cpu_busy_s() - b0) / ((time.monotonic() - t0) * (os.cpu_count() or 1))
        if frac < threshold or time.monotonic() >= end:
            return round(frac, 3)
        time.sleep(3.0)


def phase_tcp(a: argparse.Namespace) -> list[float]:
    """Seconds per transfer of one raw TCP stream (sender and receiver processes)."""
    env = child_env(True)
    recv = Child("tcprecv", ["_tcp_recv"], env, a.lifetime)
    kids = [recv]
    try:
        port = recv.expect("PORT", 60)
        reps = 5 if a.quick else 20
        send = Child(
            "tcpsend",
            [
                "_tcp_send",
                "--port",
                port,
                "--mib",
                str(a.tcp_mib),
                "--reps",
                str(reps),
                "--warmup",
                "2",
            ],
            env,
            a.lifetime,
        )
        kids.append(send)
        t = json.loads(send.expect("RESULT", 120))["t"]
    finally:
        stop_all(kids)
    return t


def proc_cpu_s(pid: int) -> float:
    """user + system CPU seconds of a process (all its threads) so far."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def phase_pushpull(w: int, a: argparse.Namespace) -> dict[str, Any]:
    kids: list[Child] = []
    try:
        fast, fast_addrs = start_servers(w, False, a, "pp")
        plain, plain_addrs = start_servers(w, True, a, "pplain")
        kids += fast + plain
        reps = 3 if a.quick else 15
        cpu0 = {c.name: proc_cpu_s(c.proc.pid) for c in fast + plain}
        cl = Child(
            "pushpull",
            ["_pushpull", "--mib", str(a.tcp_mib), "--reps", str(reps), "--warmup", "2"]
            + ["--chunk-mib", f"{a.chunk_mib:g}", "--in-flight", str(a.in_flight)],
            child_env(True),
            a.lifetime,
        )
        kids.append(cl)
        cl.send(json.dumps([fast_addrs, plain_addrs]))
        res = json.loads(expect_all([cl], "RESULT", 300, watch=kids)[0])
        iters = reps + 2
        server_cpu = {
            k: sum(proc_cpu_s(c.proc.pid) - cpu0[c.name] for c in group) / iters
            for k, group in (("ours", fast), ("plain", plain))
        }
    finally:
        stop_all(kids)
    nbytes = int(a.tcp_mib * MiB)
    out: dict[str, Any] = {"world_size": w, "servers": w, "mib": a.tcp_mib}
    for k in ("ours", "plain"):
        r = res[k]
        push, pull, setp = median_ms(r["push"]), median_ms(r["pull"]), median_ms(r["set"])
        both = [x + y for x, y in zip(r["push"], r["pull"], strict=True)]
        out[k] = {
            "push_ms": push,
            "pull_ms": pull,
            "push_pull_ms": median_ms(both),
            "set_params_ms": setp,
            "push_gbps": gbps(nbytes, push),
            "pull_gbps": gbps(nbytes, pull),
            "set_params_gbps": gbps(nbytes, setp),
            "push_pull_gbps": gbps(2 * nbytes, median_ms(both)),
            "client_cpu_push_ms": median_ms(r["push_cpu"]),
            "client_cpu_pull_ms": median_ms(r["pull_cpu"]),
            "servers_cpu_ms_per_iteration": round(server_cpu[k] * 1e3, 1),
            "verified": r["ok"],
            "reps": len(r["push"]),
        }
    out["client_malloc_env"] = bool(res["malloc_env"])
    return out


# ======================================================================================== main
def parse_list(text: str, kind: type) -> list[Any]:
    return [kind(x) for x in text.replace(" ", "").split(",") if x]


def machine() -> dict[str, Any]:
    import grpc
    import numpy

    info: dict[str, Any] = {
        "cores": os.cpu_count(),
        "affinity_cores": (
            len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        ),
        "loadavg_at_start": list(os.getloadavg()),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "grpcio": grpc.__version__,
        "numpy": numpy.__version__,
    }
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        info["cpu"] = names[0] if names else None
    except OSError:
        pass
    try:
        from importlib.metadata import version

        info["torch"] = version("torch")
    except Exception:  # noqa: BLE001
        info["torch"] = None
    return info


def bench_main(a: argparse.Namespace) -> int:
    from server import MALLOC_ENV

    t_start = time.monotonic()
    doc: dict[str, Any] = {"machine": machine()}
    doc["conventions"] = {
        "size": "S = all_reduce tensor = all_gather OUTPUT (each rank sends S/W) = reduce_scatter"
        " INPUT (each rank keeps S/W); mib = S / 2**20, float32",
        "time": "per repetition: barrier, then the op on every rank; the repetition's time is the"
        " max over ranks; *_ms = median over repetitions after warm-up",
        "gbps": "payload bytes of the tensor S / median time / 1e9 (algorithm bandwidth)",
        "ratio_vs_gloo": "ours_ms / gloo_ms (lower is better; 1.0 = as fast as gloo)",
        "cpu": "*_cpu_ms_per_rank: CPU seconds (user+sys, all threads, incl. a hosted server) of"
        " one rank process per op (over the timed loop, less the barriers' CPU measured"
        " alone), mean over ranks; cpu_ratio_vs_gloo = ours / gloo. On a"
        " 2-core machine both sides are CPU-bound, and CPU is less disturbed by other load"
        " than wall time",
        "rounds": "each world size runs every variant --rounds times in alternating order; the"
        " repetitions of all rounds are pooled before the median",
        "ours": f"each rank process hosts its ShardServer (in-process server threads); chunk"
        f" {a.chunk_bytes / MiB:g} MiB, {a.in_flight} calls in flight per rank",
        "ours_sep": "same ranks, servers as W separate processes (ours_sep_cpu_ms_per_rank ="
        " a rank's own CPU + 1/W of all servers' CPU)",
        "malloc_env": MALLOC_ENV,
        "gloo_env": "allocator-tuned (MALLOC_ENV), as ours"
        if a.gloo_env == "tuned"
        else "default environment (as torch users usually run it)",
    }
    log(f"sizes {a.sizes} MiB, world sizes {a.world_sizes}, quick={a.quick}, parts {a.parts}")
    if a.wait_quiet > 0:
        log(f"waiting up to {a.wait_quiet:.0f} s for a quiet machine")
        doc["machine"]["busy_before_start"] = wait_quiet(a.wait_quiet)
    if "transport" in a.parts:
        section_transport(doc, a)
    if "collectives" in a.parts:
        section_collectives(doc, a)
    doc["machine"]["loadavg_at_end"] = list(os.getloadavg())
    doc["seconds"] = round(time.monotonic() - t_start, 1)
    json.dump(doc, sys.stdout, indent=1)
    sys.stdout.write("\n")
    sys.stdout.flush()
    log(f"done in {doc['seconds']} s")
    return 0


def section_transport(doc: dict[str, Any], a: argparse.Namespace) -> None:
    """Raw TCP ceiling, push/pull of a flat buffer, and the codec comparison."""
    log(f"raw TCP, one stream, {a.tcp_mib:g} MiB (measured before and after push/pull)")
    with Load() as load:
        tcp_times = phase_tcp(a)
    tcp_ms = median_ms(tcp_times)
    doc["tcp_gbps"] = gbps(int(a.tcp_mib * MiB), tcp_ms)  # provisional, until the second run
    log(f"  tcp {doc['tcp_gbps']} GB/s")
    tcp_foreign = [load.foreign]

    pp_rows = []
    for w in a.world_sizes:
        log(f"push/pull {a.tcp_mib:g} MiB to {w} servers (ours and plain protobuf)")
        with Load() as load:
            row = phase_pushpull(w, a)
        row["foreign_cpu_frac"] = load.foreign
        pp_rows.append(row)
        log(
            f"  ours push {row['ours']['push_gbps']} pull {row['ours']['pull_gbps']} GB/s,"
            f" plain push {row['plain']['push_gbps']} pull {row['plain']['pull_gbps']} GB/s"
        )
    with Load() as load:
        tcp_times += phase_tcp(a)
    tcp_foreign.append(load.foreign)
    nbytes = int(a.tcp_mib * MiB)
    doc["tcp"] = {
        "mib": a.tcp_mib,
        "ms": median_ms(tcp_times),
        "gbps": gbps(nbytes, median_ms(tcp_times)),
        "best_gbps": gbps(nbytes, min(tcp_times) * 1e3),
        "reps": len(tcp_times),
        "foreign_cpu_frac": tcp_foreign,
        "note": "sendall of a numpy buffer / recv_into a preallocated one, 1-byte ack per"
        " transfer; half the repetitions before push/pull, half after",
    }
    doc["tcp_gbps"] = doc["tcp"]["gbps"]
    log(f"  tcp {doc['tcp_gbps']} GB/s (best {doc['tcp']['best_gbps']})")
    for row in pp_rows:
        row["ratio_vs_tcp"] = round(row["ours"]["push_pull_gbps"] / doc["tcp_gbps"], 3)
        row["push_ratio_vs_tcp"] = round(row["ours"]["push_gbps"] / doc["tcp_gbps"], 3)
        row["pull_ratio_vs_tcp"] = round(row["ours"]["pull_gbps"] / doc["tcp_gbps"], 3)
    head = max(pp_rows, key=lambda r: r["world_size"])
    doc["push_pull"] = {
        "mib": a.tcp_mib,
        "servers": head["servers"],
        "push_gbps": head["ours"]["push_gbps"],
        "pull_gbps": head["ours"]["pull_gbps"],
        "push_pull_gbps": head["ours"]["push_pull_gbps"],
        "tcp_gbps": doc["tcp_gbps"],
        "ratio_vs_tcp": head["ratio_vs_tcp"],
        "goal": ">= 0.7",
        "cpu": "client_cpu_*_ms: the client process's CPU per call (median);"
        " servers_cpu_ms_per_iteration: all W servers' CPU per iteration of push + pull +"
        " set_params (warm-up included)",
        "note": "one client process, servers as separate processes; push = push_grads with SGD"
        " lr=0 step arguments (each push completes a step on the servers); pull ="
        " pull_params; push_pull_gbps = 2 * S / median(push + pull); ratio_vs_tcp ="
        " push_pull_gbps / one raw TCP stream's GB/s (the client uses one connection per"
        " server, so W streams)",
        "by_world_size": pp_rows,
    }
    doc["codec"] = {
        "what": "push + pull of the same buffer: fast_codec servers + ShardClient (hand-encoded"
        " wire format) vs fast_codec=False servers + ShardStub with PushGradRequest("
        "data=arr.tobytes()) / PullParamsReply.data (protobuf bytes fields); same"
        " chunks and calls in flight",
        "mib": a.tcp_mib,
        "servers": head["servers"],
        "fast_ms": head["ours"]["push_pull_ms"],
        "protobuf_ms": head["plain"]["push_pull_ms"],
        "speedup": round(head["plain"]["push_pull_ms"] / head["ours"]["push_pull_ms"], 3),
        "fast_push_ms": head["ours"]["push_ms"],
        "protobuf_push_ms": head["plain"]["push_ms"],
        "fast_pull_ms": head["ours"]["pull_ms"],
        "protobuf_pull_ms": head["plain"]["pull_ms"],
        "by_world_size": [
            {
                "servers": r["servers"],
                "fast_ms": r["ours"]["push_pull_ms"],
                "protobuf_ms": r["plain"]["push_pull_ms"],
                "speedup": round(r["plain"]["push_pull_ms"] / r["ours"]["push_pull_ms"], 3),
            }
            for r in pp_rows
        ],
    }


def section_collectives(doc: dict[str, Any], a: argparse.Namespace) -> None:
    """ours (in-process servers), ours_sep (server processes) and gloo, every op and size."""
    rows: list[dict[str, Any]] = []
    phases: list[dict[str, Any]] = []
    for w in a.world_sizes:
        got: dict[str, list[list[dict[str, Any]]]] = {}
        variants = (
            ["ours"] + ([] if a.no_separate else ["ours_sep"]) + ([] if a.no_gloo else ["gloo"])
        )
        for rnd in range(a.rounds):
            # alternate the order, so drift on a busy machine does not favour one variant
            for v in variants if rnd % 2 == 0 else variants[::-1]:
                busy_before = wait_quiet(a.wait_quiet) if a.wait_quiet > 0 else None
                log(f"W={w}: {v} (round {rnd + 1}/{a.rounds})")
                t0 = time.monotonic()
                with Load() as load:
                    if v == "gloo":
                        res = run_gloo(w, a)
                    else:
                        res = run_ours(w, a, separate=(v == "ours_sep"))
                got.setdefault(v, []).append(res)
                phases.append(
                    {
                        "world_size": w,
                        "variant": v,
                        "round": rnd,
                        "seconds": round(time.monotonic() - t0, 1),
                        "foreign_cpu_frac": load.foreign,
                        "busy_before": busy_before,
                    }
                )
        if "gloo" in got:
            doc.setdefault("gloo_reduce_scatter_impl", got["gloo"][0][0]["reduce_scatter_impl"])
        for op in OPS:
            for mib in a.sizes:
                nbytes = int(mib * MiB)
                row: dict[str, Any] = {"op": op, "world_size": w, "mib": mib}
                s = {v: summarise(got[v], op, mib) for v in got}
                row["ours_ms"] = s["ours"]["ms"]
                row["gloo_ms"] = s["gloo"]["ms"] if "gloo" in s else None
                row["ratio_vs_gloo"] = (
                    round(row["ours_ms"] / row["gloo_ms"], 3) if row["gloo_ms"] else None
                )
                row["ours_gbps"] = gbps(nbytes, row["ours_ms"])
                row["gloo_gbps"] = gbps(nbytes, row["gloo_ms"])
                if "ours_sep" in s:
                    row["ours_sep_ms"] = s["ours_sep"]["ms"]
                    row["ours_sep_gbps"] = gbps(nbytes, row["ours_sep_ms"])
                    row["sep_ratio_vs_gloo"] = (
                        round(row["ours_sep_ms"] / row["gloo_ms"], 3) if row["gloo_ms"] else None
                    )
                    row["faster_placement"] = (
                        "in-process" if row["ours_ms"] <= row["ours_sep_ms"] else "separate"
                    )
                if "gloo" in s:
                    row["cpu_ratio_vs_gloo"] = round(
                        s["ours"]["cpu_ms_per_rank"] / max(1e-9, s["gloo"]["cpu_ms_per_rank"]), 3
                    )
                for v, sv in s.items():
                    row[f"{v}_ms_min_max"] = sv["ms_min_max"]
                    row[f"{v}_cpu_ms_per_rank"] = sv["cpu_ms_per_rank"]
                    row[f"{v}_verified"] = sv["ok"]
                row["reps"] = s["ours"]["reps"]
                rows.append(row)
                log(
                    f"  {op:<14} W={w} {mib:>4g} MiB  ours {row['ours_ms']:9.2f} ms"
                    + (f"  sep {row['ours_sep_ms']:9.2f} ms" if "ours_sep_ms" in row else "")
                    + (
                        f"  gloo {row['gloo_ms']:9.2f} ms  x{row['ratio_vs_gloo']}"
                        if row["gloo_ms"]
                        else ""
                    )
                )
    doc["results"] = rows
    doc["phases"] = phases


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "mode",
        nargs="?",
        default="bench",
        choices=["bench", "_rank", "_server", "_gloo", "_tcp_recv", "_tcp_send", "_pushpull"],
        help=argparse.SUPPRESS,
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="one size (16 MiB), 5 repetitions, no separate-server variant (< 2 min)",
    )
    ap.add_argument("--sizes", default=None, help="tensor sizes in MiB (default 1,16,64)")
    ap.add_argument("--world-sizes", default="2,4")
    ap.add_argument("--reps", type=int, default=0, help="repetitions per cell (default by size)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--tcp-mib",
        type=float,
        default=64.0,
        help="payload of the raw TCP and push/pull measurements",
    )
    ap.add_argument(
        "--gloo-env",
        choices=["default", "tuned"],
        default="tuned",
        help="tuned (default): gloo ranks get MALLOC_ENV too, like ours; default: the plain"
        " environment (gloo then page-faults on its per-call buffers: slower all_gather and"
        " reduce_scatter)",
    )
    ap.add_argument("--no-separate", action="store_true", help="skip the separate-servers variant")
    ap.add_argument("--no-gloo", action="store_true")
    ap.add_argument(
        "--chunk-mib", type=float, default=CHUNK_BYTES / MiB, help="ShardClient chunk_bytes, MiB"
    )
    ap.add_argument(
        "--in-flight", type=int, default=MAX_IN_FLIGHT, help="ShardClient max_in_flight"
    )
    ap.add_argument(
        "--parts",
        default="transport,collectives",
        help="what to run: transport (raw TCP, push/pull, codec) and/or collectives",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=0,
        help="times each variant runs per world size, alternating order (default 2, --quick 1)",
    )
    ap.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        help="before each phase wait up to this many seconds for other processes to"
        " use < 20%% of the CPUs (default: do not wait)",
    )
    ap.add_argument(
        "--max-seconds", type=float, default=0, help="global watchdog (default 1200, --quick 300)"
    )
    # child options
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--run-id", default="bench", help=argparse.SUPPRESS)
    ap.add_argument("--host-server", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--init-file", default="", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--mib", type=float, default=64.0, help=argparse.SUPPRESS)
    ap.add_argument("--lifetime", type=float, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.sizes = parse_list(a.sizes, float) if a.sizes else ([16.0] if a.quick else [1.0, 16.0, 64.0])
    a.world_sizes = parse_list(a.world_sizes, int)
    a.parts = parse_list(a.parts, str)
    a.chunk_bytes = max(4096, int(a.chunk_mib * MiB))
    if not a.parts or set(a.parts) - {"transport", "collectives"}:
        ap.error("--parts takes transport and/or collectives")
    if a.quick:
        a.no_separate = True
    a.rounds = a.rounds or (1 if a.quick else 2)
    waits = (1 + len(a.world_sizes) * a.rounds * 3) * max(0.0, a.wait_quiet)
    a.max_seconds = a.max_seconds or (300.0 if a.quick else 1200.0) + waits

    if a.mode != "bench":
        child_guard(a.lifetime or 1800.0)
        {
            "_rank": rank_main,
            "_server": server_main,
            "_gloo": gloo_main,
            "_tcp_recv": tcp_recv_main,
            "_tcp_send": tcp_send_main,
            "_pushpull": pushpull_main,
        }[a.mode](a)
        return 0

    if any(w < 1 for w in a.world_sizes) or any(s <= 0 for s in a.sizes):
        ap.error("sizes and world sizes must be positive")
    a.lifetime = a.max_seconds + 60  # children outlive no parent: they also watch getppid()

    def on_signal(signum: int, _frame: Any) -> None:
        stop_all(timeout=3)
        os._exit(128 + signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    atexit.register(stop_all, None, 3)

    def on_timeout() -> None:
        log(f"global watchdog: {a.max_seconds:.0f} s exceeded; stopping children")
        stop_all(timeout=3)
        os._exit(4)

    wd = threading.Timer(a.max_seconds, on_timeout)
    wd.daemon = True
    wd.start()
    try:
        return bench_main(a)
    except ChildError as exc:
        log(f"FAILED: {exc}")
        return 1
    finally:
        wd.cancel()
        stop_all(timeout=5)


if __name__ == "__main__":
    sys.exit(main())
