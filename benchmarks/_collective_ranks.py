"""The child processes of ``benchmarks.collectives``: one rank of ours (optionally hosting its
``ShardServer``), a server, one gloo rank, the two ends of a raw TCP stream, and the push/pull
client (ours and plain protobuf). Each is started by the parent as ``python -m
benchmarks.collectives _mode ...`` and answers with ``TAG payload`` lines on stdout; see that
module's docstring for what is measured and how.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import sys
import time
from typing import Any

from benchmarks._processes import emit, malloc_env_state, proc_cpu_s, wait_parent_eof

MiB = 1 << 20
OPS = ("all_reduce", "all_gather", "reduce_scatter")
CHUNK_BYTES = 4 << 20  # ShardClient's defaults; --chunk-mib / --in-flight change them
MAX_IN_FLIGHT = 8
GRPC_BIG = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


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
