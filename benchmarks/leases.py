"""What a run's ranks cost a server, by the run's size: their leases (ours against a heartbeat
through torch's ``TCPStore``) and an elastic step's membership.

    python -m benchmarks.leases [--quick] [--worlds 1024,8192,32768] [--served 1024,8192]
                                [--members 1024,4096] [--crowd 150,400] [--reads 150]
                                [--wait-quiet S]

Every rank of a run renews its lease on every server once a second (client/leases.py), so a
server of a run of W ranks handles W renewals a second, at 1,024 hosts of 8 GPUs 8,192; and
each rank of an elastic job Joins the job's coordinator at every step. Three parts, every size
in one run:

- **table**: the lease table alone (``server/collectives/leases.py``, in this process, on a
  clock that moves 1/W s a renewal, as W ranks renewing once a second move it): the wall time
  of registering W ranks, of one second of their renewals (``renewal_us``: per renewal;
  ``core_share``: the share of one core those W renewals a second take) and of the lapse
  check of a server that heard from no rank for a TTL (every lease silent at once,
  ``cut_off_sweep_s``).
- **served**: a real ``paramshard serve`` process; this process sends it W ranks' renewals one
  after another (``Lease``, the RPC the ranks send): W to register them, then at least
  ``MIN_CALLS`` more, over which it reads the server's CPU seconds from /proc
  (``server_cpu_us`` a renewal; ``client_cpu_us``: this process's). The reference, in the same
  run: torch's ``TCPStore`` (its master in a process of its own; the store torchelastic's c10d
  rendezvous keeps its heartbeats in) takes the same calls as ``set``s of a small value; its
  master's CPU a call. ``ratio``: ours ÷ the store's, server CPU a call. A heartbeat in the
  store records that a node is alive; a renewal also checks the run's other leases for lapses
  and brings back the run's notice. ``server_core_share``: the share of a server's core the
  run's renewals take a second, as every rank renewing every second (``unpaced``) and at the
  ranks' pace (``renewals_a_second``: where they hold a stream, and where they renew alone).

- **membership**: an elastic step of W ranks on its coordinator alone
  (``server/collectives/membership.py``, in this process, every rank holding a live lease in
  the coordinator's lease table): W Joins that announce the ranks (the last one decides the
  round; the first sent again with its known members, as the coordinator asks a new job's),
  then W that get the step's members; the wall time of each half (``announce_s``,
  ``decided_s``) and the replies' bytes. Then what a step's membership costs a server's
  pushes (``server/buffers/membership.py``): every member pushes each bucket to every server
  with the step's W members; the check of a server's first push of the step
  (``first_push_us``) and of each push after it (``push_us``).
- **crowd**: an elastic step's Joins through a real in-process server with the default bounds,
  more ranks than it has threads for waiting calls (benchmarks/_membership_crowd.py): the
  members of the step, and how long the last rank waited.
- **reads**: all-reduces of more ranks than a server has threads for waiting calls, through a
  server in a process of its own, ranks in six more, with the default bounds, with a session
  for every rank (its reads wait in the server's line) and with a thread for every read
  (benchmarks/_read_crowd.py).

JSON to stdout, progress to stderr; every child is started here and stopped by PID.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

import grpc

from benchmarks._cpu import Load, cpu_self_s, proc_cpu_s, wait_quiet
from benchmarks._membership_crowd import crowd_row
from benchmarks._processes import (
    Child,
    child_env,
    child_guard,
    emit,
    free_port,
    install_cleanup,
    logger,
    run_child,
    serve_processes,
    stop_all,
    wait_parent_eof,
)
from benchmarks._read_crowd import ranks_child, reads_row, server_child
from paramshard.client.lease_keeper import RENEW_S, renewal_pace
from paramshard.client.leases import DEFAULT_TTL_S
from paramshard.protos import shard_pb2 as pb
from paramshard.protos import shard_pb2_grpc
from paramshard.server.buffers.membership import check_membership, elastic_pending
from paramshard.server.collectives.leases import LeaseTable
from paramshard.server.collectives.membership import MembershipTable
from paramshard.server.collectives.slots import SlotStore

say = logger("leases")
TTL_MS = 30_000


def _renewal(rank: int, world: int) -> pb.LeaseRequest:
    return pb.LeaseRequest(run="bench", rank=rank, world_size=world, ttl_ms=TTL_MS)


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def table_row(world: int) -> dict[str, Any]:
    """The lease table alone: registering ``world`` ranks, a second of their renewals, and the
    check of a server cut off from all of them."""
    clock = _Clock()
    table = LeaseTable(SlotStore(), max_leases=1 << 21, clock=clock)
    began = time.perf_counter()
    for rank in range(world):
        clock.now += 1.0 / world
        table.renew(_renewal(rank, world))
    registered = time.perf_counter() - began
    began = time.perf_counter()
    for rank in range(world):
        clock.now += 1.0 / world
        table.renew(_renewal(rank, world))
    renewed = time.perf_counter() - began
    clock.now += TTL_MS / 1000 + 1  # nobody heard for a TTL: every lease silent at once
    began = time.perf_counter()
    table.sweep()
    swept = time.perf_counter() - began
    aborted = table.renew(_renewal(0, world)).aborted  # a server cut off decides nothing
    return {
        "world": world,
        "register_s": round(registered, 4),
        "renewal_us": round(renewed / world * 1e6, 2),
        "core_share": round(renewed, 4),
        "cut_off_sweep_s": round(swept, 4),
        "cut_off_aborted": bool(aborted),
    }


MIN_CALLS = 20_000
"""Calls a measurement takes at least (ranks again from the first past W): /proc counts CPU in
ticks of 10 ms, and a store's call takes microseconds."""


def membership_row(world: int) -> dict[str, Any]:
    """An elastic step of ``world`` ranks on its coordinator alone (server/collectives/
    membership.py): every rank Joins, the last one decides the round, every rank asks again
    and gets the members; wall time of each half and the replies' bytes. Then the pushes'
    membership checks (``push_checks``)."""
    clock = _Clock()
    leases = LeaseTable(SlotStore(), max_leases=1 << 21, clock=clock)
    for rank in range(world):
        leases.renew(_renewal(rank, world))
    table = MembershipTable(leases, {"bench": 0}.get, clock=clock)

    def request(rank: int, known: bool = False) -> pb.JoinRequest:
        return pb.JoinRequest(
            run="bench", job="bench", rank=rank, world_size=world, step=0, min_members=1,
            window_ms=600_000, known_members=range(world) if known else (),
        )  # fmt: skip

    requests = [request(rank) for rank in range(world)]
    times, sizes = [], 0
    for _ in range(2):
        began = time.perf_counter()
        for req in requests:
            clock.now += 1e-4
            reply = table.join(req, 0.0)
            if reply.send_known:  # as the client does (client/membership.py)
                reply = table.join(request(req.rank, known=True), 0.0)
            sizes += len(reply.SerializeToString())
        times.append(time.perf_counter() - began)
    return {
        "world": world,
        "announce_s": round(times[0], 4),
        "decided_s": round(times[1], 4),
        "reply_mb": round(sizes / 1e6, 2),
        "decided": bool(reply.decided and len(reply.members) == world),
        **push_checks(world),
    }


def push_checks(world: int, pushes: int = 200) -> dict[str, float]:
    """A server's membership checks of a step's pushes (server/buffers/membership.py): its
    first push of the step, and the median of ``pushes`` pushes after it, microseconds."""
    h = pb.PushGradHeader(step=0, num_micro=1, contributor=world - 1)
    h.membership.members.extend(range(world))
    began = time.perf_counter()
    key = check_membership("bench", world, h)
    pending, _ = elastic_pending("bench", None, h, key)
    first = time.perf_counter() - began
    times = []
    for _ in range(pushes):
        began = time.perf_counter()
        key = check_membership("bench", world, h, pending)
        elastic_pending("bench", pending, h, key)
        times.append(time.perf_counter() - began)
    return {
        "first_push_us": round(first * 1e6, 1),
        "push_us": round(statistics.median(times) * 1e6, 1),
    }


def _timed_calls(pid: int, world: int, send) -> tuple[float, float]:
    """Sends calls for ranks 0..world-1 one after another, again from rank 0 until there were
    ``MIN_CALLS``; (the server's CPU, this process's) a call in microseconds."""
    calls = max(world, MIN_CALLS)
    server, own = proc_cpu_s(pid), cpu_self_s()
    for i in range(calls):
        send(i % world)
    return (
        (proc_cpu_s(pid) - server) / calls * 1e6,
        (cpu_self_s() - own) / calls * 1e6,
    )


def renewals_a_second(world: int) -> dict[str, float]:
    """Renewals a second a server gets from a run of ``world`` ranks at their pace
    (``client.lease_keeper.renewal_pace``, the default TTL): where they hold a stream there
    (``streamed``), and where their lease lives on renewals alone (``renewed``)."""
    return {
        how: round(world / max(RENEW_S, renewal_pace(world, DEFAULT_TTL_S, streamed)), 1)
        for how, streamed in (("streamed", True), ("renewed", False))
    }


def ours_served(world: int) -> dict[str, Any]:
    servers, addresses = serve_processes(1, 120)
    channel = grpc.insecure_channel(addresses[0])
    try:
        stub = shard_pb2_grpc.ShardStub(channel)
        pid = servers[0].proc.pid

        def renew(rank: int) -> None:
            stub.Lease(_renewal(rank, world), timeout=60)

        for rank in range(world):  # registers the ranks
            renew(rank)
        renewal = _timed_calls(pid, world, renew)
    finally:
        channel.close()
        stop_all(servers)
    return {
        "server_cpu_us": round(renewal[0], 1),
        "client_cpu_us": round(renewal[1], 1),
    }


def store_served(world: int) -> dict[str, Any]:
    from torch.distributed import TCPStore

    port = free_port()
    env = child_env(tuned=False)
    master = Child.module("store", "benchmarks.leases", ["_store", str(port)], env, 600)
    try:
        master.expect("READY", 60)
        client = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
        value = str(time.time()).encode()  # a heartbeat: when the node was last alive

        def beat(node: int) -> None:
            client.set(f"hb/{node}", value)

        for node in range(world):
            beat(node)
        again = _timed_calls(master.proc.pid, world, beat)
    finally:
        stop_all([master])
    return {
        "server_cpu_us": round(again[0], 1),
        "client_cpu_us": round(again[1], 1),
    }


def _store_child(port: int, lifetime: float) -> None:
    """The TCPStore master: serves until its stdin closes."""
    from torch.distributed import TCPStore

    child_guard(lifetime)
    store = TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    emit("READY", str(port))
    wait_parent_eof()
    del store


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(ln.split(":", 1)[1].strip() for ln in f if "model name" in ln)
    except (OSError, StopIteration):
        return "?"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_store"]:  # _store PORT --lifetime S
        run_child(lambda: _store_child(int(argv[1]), float(argv[3])))
    if argv[:1] == ["_reads_server"]:  # _reads_server BOUNDS --lifetime S
        run_child(lambda: server_child(argv[1], float(argv[3])))
    if argv[:1] == ["_reads_ranks"]:  # _reads_ranks ADDRESS WORLD INDEX PROCS --lifetime S
        w, i, n = (int(v) for v in argv[2:5])
        run_child(lambda: ranks_child(argv[1], w, i, n, float(argv[6])))
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.leases", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--quick", action="store_true", help="W = 256 only")
    ap.add_argument("--worlds", default="1024,8192,32768", help="run sizes, the table alone")
    ap.add_argument("--served", default="1024,8192", help="run sizes, through a real server")
    ap.add_argument("--members", default="1024,4096", help="run sizes, an elastic step's Joins")
    ap.add_argument("--crowd", default="150,400", help="run sizes, Joins through a server")
    ap.add_argument("--reads", default="150", help="run sizes, all-reduces through a server")
    ap.add_argument("--wait-quiet", type=float, default=0.0, help="wait for other load (s)")
    a = ap.parse_args(argv)
    worlds = [256] if a.quick else [int(w) for w in a.worlds.split(",") if w]
    served = [256] if a.quick else [int(w) for w in a.served.split(",") if w]
    members = [256] if a.quick else [int(w) for w in a.members.split(",") if w]
    install_cleanup()
    if a.wait_quiet:
        wait_quiet(a.wait_quiet)
    load, t0 = Load().start(), time.time()
    table = []
    for world in worlds:
        table.append(table_row(world))
        say(json.dumps(table[-1]))
    membership = []
    for world in members:
        membership.append(membership_row(world))
        say(json.dumps(membership[-1]))
    crowd = []
    for world in [64] if a.quick else [int(w) for w in a.crowd.split(",") if w]:
        crowd.append(crowd_row(world))
        say(json.dumps(crowd[-1]))
    reads = []
    for world in [72] if a.quick else [int(w) for w in a.reads.split(",") if w]:
        reads.append(reads_row(world, rounds=3 if a.quick else 6))
        say(json.dumps(reads[-1]))
    rows = []
    for world in served:
        row = {"world": world, "ours": ours_served(world), "tcpstore": store_served(world)}
        rate = row["renewals_a_second"] = renewals_a_second(world)
        cost = row["ours"]["server_cpu_us"] / 1e6
        row["server_core_share"] = {
            "unpaced": round(world * cost, 3),
            **{how: round(per_s * cost, 3) for how, per_s in rate.items()},
        }
        store_us = row["tcpstore"]["server_cpu_us"]
        row["ratio"] = round(row["ours"]["server_cpu_us"] / store_us, 2) if store_us else None
        rows.append(row)
        say(json.dumps(row))
    out = {
        "benchmark": "leases",
        "host": {"python": platform.python_version(), "cpu": _cpu_model()},
        "table": table,
        "membership": membership,
        "crowd": crowd,
        "reads": reads,
        "served": rows,
        "wall_s": round(time.time() - t0, 1),
        "foreign_cpu_frac": load.stop(),
    }
    print(json.dumps(out, indent=1))
    failed = any(r["cut_off_aborted"] for r in table) or not all(r["decided"] for r in membership)
    failed |= any(r["members_of_step_0"] < r["world"] for r in crowd)
    failed |= any(r[k]["errors"] for r in reads for k in ("default", "session_each", "thread_each"))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
