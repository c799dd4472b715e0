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
import sys
import time
from typing import Any

from benchmarks._cpu import proc_cpu_s
from benchmarks._processes import emit, malloc_env_state, wait_parent_eof

MiB = 1 << 20
OPS = ("all_reduce", "all_gather", "reduce_scatter")
GRPC_BIG = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


def reps_for(mib: float, a: argparse.Namespace) -> int:
    if a.reps:
        return a.reps
    if a.quick:
        return 5
    return 200 if mib < 0.01 else 30 if mib <= 1 else 15 if mib <= 16 else 10


def numel(mib: float, world: int) -> int:
    """float32 elements of a tensor of ``mib`` MiB, a multiple of ``world`` and at least one
    per rank (so "4B", one element, becomes ``world`` elements for all_gather's sake)."""
    n = int(mib * MiB) // 4
    return max(world, n - n % world)


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
def status_rtt_ms(address: str, reps: int = 200) -> float:
    """Median ms of one gRPC unary round trip from this process to the server at ``address``
    (the next rank's: across the lab's link), a ``Status`` call on a channel of its own: the
    floor under every call of ours, beside which the 4-byte ops are read."""
    import grpc

    from paramshard.protos import shard_pb2 as pb
    from paramshard.protos.service import method_path

    with grpc.insecure_channel(address) as chan:
        call = chan.unary_unary(
            method_path("Status"),
            request_serializer=pb.StatusRequest.SerializeToString,
            response_deserializer=pb.StatusReply.FromString,
        )
        times = []
        for i in range(reps + 20):  # the first 20 warm the channel up
            t0 = time.perf_counter()
            call(pb.StatusRequest(), timeout=30)
            if i >= 20:
                times.append(time.perf_counter() - t0)
    times.sort()
    return round(times[len(times) // 2] * 1e3, 3)


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

    from paramshard.client import ClusterSpec, ShardClient

    server, clients = None, [None]
    try:
        if a.host_server:
            from paramshard.server import ShardServer

            server = ShardServer(port=0).start()
            emit("ADDR", server.address)
        addrs, server_pids = json.loads(sys.stdin.readline())
        world, rank = a.world, a.rank

        def clock() -> float:  # own CPU + an even share of the separate servers' CPU
            return time.process_time() + sum(proc_cpu_s(p) for p in server_pids) / world

        c = clients[0] = ShardClient(
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
            "status_rtt_ms": status_rtt_ms(addrs[(rank + 1) % len(addrs)]),
        }
        c.barrier()
        for mib in a.sizes:
            n = numel(mib, world)
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
        c.close()  # before the servers stop (closing twice does nothing)
        if line.strip() == "CLOSE":
            emit("CLOSED", "")
            wait_parent_eof()
    finally:  # on every way out, a failed rank's too: see benchmarks/_training.close_rank
        if clients[0] is not None:
            clients[0].close()
        if server is not None:
            server.stop(grace=None)


def server_main(a: argparse.Namespace) -> None:
    from paramshard.server import ShardServer

    # --bind: an address inside the benchmark's own namespaces, reachable from nowhere else
    # (gloo there has no credentials either)
    server = ShardServer(a.bind, 0, fast_codec=not a.plain, insecure=True).start()
    try:
        emit("ADDR", server.address)
        wait_parent_eof()
    finally:
        server.stop(grace=None)


# -------------------------------------------------------------------------- gloo: rank process
def gloo_main(a: argparse.Namespace) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # one intra-op thread a rank, as gloo's ranks
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
    n = numel(mib, world)
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
# ----------------------------------------------------------------------------------- push/pull
