"""A job whose ranks were all killed, run again at once under its run id on the same servers
(server/collectives/lease_requests.py, ``abandoned``).

``paramshard launch`` (and torchrun) stop the other ranks when one dies: SIGTERM, then SIGKILL.
Nothing is released, and no rank lives on to witness the first one's lapse, so the servers
kept the run, and the same job started again under the same run id met the old run's keys:
its first all-reduce failed with "NOT_FOUND: slot 'fixedk:ar1/1' was read by all its readers
and freed" (seen with two `paramshard serve` and `paramshard launch --run-id fixedk`), for as
long as the servers kept the run (up to twice ``--pending-ttl``). A process new to the run that
finds no live process behind any of its leases now starts a new run, once the servers have
heard from none of its ranks for ``SETTLE_S`` (the new job's clients ask again meanwhile).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import grpc
import pytest
from conftest import unique_id, worker_env
from lease_fakes import Stream, contribute, new_table

from paramshard.protos import shard_pb2 as pb
from paramshard.server.collectives.lease_records import SETTLE_S
from paramshard.server.runtime.errors import ShardError

_RANK = textwrap.dedent(
    """
    import os, sys
    import numpy as np
    from paramshard.client import ShardClient

    c = ShardClient.from_env()
    for i in range(int(os.environ["STEPS"])):
        total = float(c.all_reduce(np.full(8, c.rank + 1.0))[0])
        assert total == 3.0, total
        print("step", i, flush=True)
    c.close()
    print("done", flush=True)
    """
)


def _ranks(addresses: str, run: str, steps: int) -> list[subprocess.Popen]:
    env = {**worker_env(), "PARAMSHARD_SERVERS": addresses, "PARAMSHARD_RUN": run}
    env = {**env, "WORLD_SIZE": "2", "STEPS": str(steps), "GRPC_VERBOSITY": "ERROR"}
    return [
        subprocess.Popen(
            [sys.executable, "-c", _RANK],
            env={**env, "RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]


def test_a_killed_job_run_again_at_once_under_its_run_id_trains(servers) -> None:
    addresses = ",".join(n.address for n in servers(2))
    run = unique_id("killed")
    old = _ranks(addresses, run, steps=100_000)
    try:
        for p in old:  # both in their loop of all-reduces
            assert p.stdout is not None
            while "step 3" not in p.stdout.readline():
                assert p.poll() is None, p.stdout.read()
        old[1].kill()  # a rank dies; the launcher stops the other (SIGTERM)
        old[0].terminate()
        for p in old:
            p.wait(30)
        new = _ranks(addresses, run, steps=20)  # at once, as a retry loop would
        outs = [p.communicate(timeout=120)[0] for p in new]
        assert [p.returncode for p in new] == [0, 0], outs
        assert all(out.rstrip().endswith("done") for out in outs), outs
    finally:
        for p in old:
            if p.poll() is None:
                p.kill()
                p.wait()


def _req(rank: int, holder: str, **kw) -> pb.LeaseRequest:
    return pb.LeaseRequest(
        run="k", rank=rank, world_size=2, ttl_ms=30_000, holder=holder, client=1, **kw
    )


@pytest.mark.parametrize(
    "case",
    ["killed", "one-streams", "one-renews", "awaited", "same-process", "blip", "running"],
)
def test_a_new_process_starts_a_new_run_only_where_no_process_lives_behind_it(case) -> None:
    """Both ranks held their leases by streams, an all-reduce is half in and an earlier one
    freed. Then a client being made (``fresh``) in a process new to the run leases rank 0: a
    new run (the open slot dropped, the freed key forgotten) only if no lease has a live
    process behind it. Before the server has heard from none of the ranks for ``SETTLE_S`` it
    is told to ask again, and nothing changes: a blip that reset every stream at once looks the
    same until the ranks come back. A running client ("running": made long ago, leasing this
    server for the first time, as one that found it full at first) never ends the run."""
    leases, clock = new_table()
    rejoin = {"rejoin_ms": 60_000} if case == "awaited" else {}
    streams = [Stream(run="k", rank=r) for r in (0, 1)]
    for r in (0, 1):
        leases.open_hold(_req(r, f"old{r}", **rejoin), streams[r])
    contribute(leases.slots, "k:ar1/0", 0, expected=1, readers=1)
    leases.slots.read(pb.ReadSlotRequest(key="k:ar1/0", offset=0, reader=0), timeout=1.0)
    contribute(leases.slots, "k:ar2/0", 0)  # rank 0's half of all-reduce #2
    ended = streams if case != "one-streams" else streams[:1]
    for stream in ended:  # killed (their kernels closed the connections), or a blip
        leases.end_hold(stream)
    clock.now += 2.0
    if case == "one-renews":
        leases.renew(_req(1, "old1"))  # alive: its stream broke, it renews
    asker = "old0" if case == "same-process" else "new0"
    ask = _req(0, asker, fresh=case != "running")
    if case in ("killed", "blip"):  # too soon: the ranks may be reconnecting
        with pytest.raises(ShardError) as refused:
            leases.open_hold(ask, Stream(run="k", rank=0))
        assert refused.value.code == grpc.StatusCode.ALREADY_EXISTS
        assert "heard from one 2.0 s ago" in refused.value.message, refused.value.message
        assert [x.key for x in leases.slots.open_slots()] == ["k:ar2/0"]
    if case == "blip":  # the ranks' clients reconnect: new streams
        for r in (0, 1):
            leases.open_hold(_req(r, f"old{r}"), Stream(run="k", rank=r))
    clock.now += SETTLE_S
    if case == "blip":  # rank 0 holds its stream again: another process is refused
        with pytest.raises(ShardError) as refused:
            leases.open_hold(ask, Stream(run="k", rank=0))
        assert refused.value.code == grpc.StatusCode.ALREADY_EXISTS
        assert "held by another process (old0)" in refused.value.message
    else:
        leases.open_hold(ask, Stream(run="k", rank=0))
    open_keys = [x.key for x in leases.slots.open_slots()]
    if case == "killed":
        assert open_keys == []
        assert contribute(leases.slots, "k:ar1/0", 0, expected=1) is False  # a new slot
    else:
        assert open_keys == ["k:ar2/0"]
        assert contribute(leases.slots, "k:ar1/0", 0, expected=1) is True  # a late retry


class _Walked(dict):
    """A run's leases that count the walks over them (``values()``)."""

    walks = 0

    def values(self):  # noqa: ANN201 - dict's own
        self.walks += 1
        return super().values()


def test_a_new_jobs_clients_asking_again_do_not_each_walk_the_run() -> None:
    """Every rank of the new job asks again about four times a second until the run settles:
    the first refusal's verdict is kept, so a run of many ranks is walked by the first
    refusal only, not at each."""
    leases, clock = new_table()
    streams = [Stream(run="k", rank=r) for r in (0, 1)]
    for r in (0, 1):
        leases.open_hold(_req(r, f"old{r}"), streams[r])
        leases.end_hold(streams[r])
    run = leases._runs["k"]
    run.leases = walked = _Walked(run.leases)
    for n in range(8):
        clock.now += 0.5
        with pytest.raises(ShardError) as refused:
            leases.open_hold(_req(n % 2, f"new{n % 2}", fresh=True), Stream(run="k", rank=n % 2))
        assert refused.value.code == grpc.StatusCode.ALREADY_EXISTS
        if n == 0:
            first = walked.walks  # the first refusal's walks
    assert f"heard from one {clock.now - 1000.0:.1f} s ago" in refused.value.message
    assert first > 0 and walked.walks == first
    clock.now += SETTLE_S
    leases.open_hold(_req(0, "new0", fresh=True), Stream(run="k", rank=0))  # settled: a new run
    assert leases._runs["k"].leases[0].holder == "new0" and 1 not in leases._runs["k"].leases
