"""The processes of benchmarks/collectives.py's transport section: a raw TCP sender and receiver,
and a push/pull client, ours or one on the generated protobuf classes (PlainClient)."""

from __future__ import annotations

import argparse
import json
import socket
import struct
import sys
import time
from typing import Any

from benchmarks._collective_ranks import GRPC_BIG, MiB
from benchmarks._processes import emit, malloc_env_state

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
    ls.bind((a.bind, 0))
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
    sock = socket.create_connection((a.to, a.port), timeout=120)
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


class PlainClient:
    """The generated protobuf classes (ShardStub, ``bytes`` fields), same chunking and windowing."""

    def __init__(self, addrs: list[str], chunk_bytes: int | None, max_in_flight: int) -> None:
        import grpc

        from paramshard.client import ClusterSpec
        from paramshard.client.chunk_size import default_chunk_bytes
        from paramshard.protos import shard_pb2_grpc

        self.chans = [grpc.insecure_channel(x, options=GRPC_BIG) for x in addrs]
        self.stubs = [shard_pb2_grpc.ShardStub(ch) for ch in self.chans]
        default = default_chunk_bytes(ClusterSpec(addrs).servers_per_host)  # as ShardClient's
        self.chunk = (chunk_bytes or default) // 4
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
        from paramshard.protos import slicing

        out = []
        for p in slicing.pieces(numel, len(self.stubs), 0, numel):
            for o, n in slicing.chunk_ranges(p.numel, self.chunk):
                out.append((p.server, p.local_offset + o, p.global_offset + o, n))
        return out

    def register(self, job: str, buf: str, numel: int) -> None:
        from paramshard.protos import shard_pb2 as pb

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
        from paramshard.protos import shard_pb2 as pb

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
        from paramshard.protos import shard_pb2 as pb

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

        from paramshard.protos import shard_pb2 as pb

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

    from paramshard.client import ClusterSpec, ShardClient, StepArgs

    fast_addrs, plain_addrs = json.loads(sys.stdin.readline())
    n = int(a.mib * MiB) // 4
    params = np.random.default_rng(1).standard_normal(n, dtype=np.float32)
    grads = np.random.default_rng(2).standard_normal(n, dtype=np.float32)
    job, buf = "bench", "flat"

    def client(shared_memory: bool, job: str) -> ShardClient:
        c = ShardClient(
            ClusterSpec(fast_addrs),
            rank=0,
            world_size=1,
            run_id=f"pushpull-{job}",
            chunk_bytes=a.chunk_bytes,
            max_in_flight=a.in_flight,
            shared_memory=shared_memory,
        )
        c.register_buffer(job, buf, n, optimizer="sgd", hyper={"lr": 0.0})
        c.set_params(job, buf, params)
        return c

    # the same servers: through shared segments, and in-band (job "inband")
    opened: list[Any] = []
    try:
        ours, inband = client(True, job), client(False, "inband")
        opened += [ours, inband]
        plain = PlainClient(plain_addrs, a.chunk_bytes, a.in_flight)
        opened.append(plain)
        plain.register(job, buf, n)
        plain.set_params(job, buf, params, 0)
        step_args = StepArgs({"lr": 0.0})
        res: dict[str, Any] = {"malloc_env": malloc_env_state()}
        for k in ("ours", "ours_inband", "plain"):
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
                    "ours_inband",
                    lambda s: inband.push_grads("inband", buf, grads, s, step_args=step_args),
                    lambda v: inband.pull_params("inband", buf, n, v),
                    lambda v: inband.set_params("inband", buf, params, version=v),
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
    finally:  # on every way out (benchmarks/_training.close_rank says why)
        for opened_client in opened:
            opened_client.close()
