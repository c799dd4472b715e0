"""A wait on other ranks that times out says what the server's leases know of the ranks it
waited for: one that released its lease (its process ended, or closed its client) is named as
such, not only as "missing". Seen in the field: a rank restarted by ``--max-restarts`` whose
loop started again at step 0 outlived its peers and waited 120 s, then named the peer that had
finished as missing.

Real servers on 127.0.0.1 reached through gRPC (``local_calls=False``), real clients.
"""

from __future__ import annotations

import re
import threading
from typing import Any

import numpy as np
import pytest
from conftest import unique_id as unique

from paramshard.client import ClusterSpec, ShardClient, ShardClientError
from paramshard.server.collectives import lease_records as records
from paramshard.server.collectives import lease_words

TIMEOUT_S = 3.0


@pytest.fixture
def address(servers: Any) -> str:
    """One real server, reached through gRPC."""
    return servers(1, local_calls=False)[0].address


def client(address: str, rank: int, run: str, **kw: Any) -> ShardClient:
    return ShardClient(
        ClusterSpec([address]), rank=rank, world_size=2, run_id=run, timeout_s=TIMEOUT_S, **kw
    )


RELEASED = re.compile(
    r"missing rank\(s\) 1 \(arrived: 0\); rank 1 released its lease here (\d+\.\d) s ago"
    r" \(its process ended or closed its client\)"
)


def test_a_collective_names_the_rank_that_left(address: str) -> None:
    """Both ranks meet at a barrier; rank 1 closes its client (what its process does at its
    end); rank 0's next barrier names rank 1 as gone, with how long ago."""
    run = unique("left")
    first, second = client(address, 0, run), client(address, 1, run)
    try:
        done: list[None] = []
        t = threading.Thread(target=lambda: done.append(second.barrier()))
        t.start()
        first.barrier()
        t.join(TIMEOUT_S * 2)
        assert done, "the barrier of both ranks did not complete"
        second.close()
        with pytest.raises(ShardClientError) as info:
            first.barrier()
    finally:
        first.close()
        second.close()
    err = info.value
    assert err.code.name == "DEADLINE_EXCEEDED", err
    found = RELEASED.search(err.details)
    assert found is not None, err.details
    assert TIMEOUT_S * 0.5 < float(found[1]) < TIMEOUT_S * 4, err.details


def test_a_step_names_the_rank_that_left(address: str) -> None:
    """A pull of the next version waits for rank 1's gradient; rank 1 registered the buffer
    with rank 0 and closed its client: the error says it released its lease."""
    job, n, run = unique("pull"), 16, unique("run")
    first, second = client(address, 0, run), client(address, 1, run)
    try:
        for c in (first, second):
            c.register_buffer(job, "w", n, contributors=2)
        first.set_params(job, "w", np.zeros(n, np.float32))
        second.close()
        first.push_grads(job, "w", np.ones(n, np.float32), 0)
        with pytest.raises(ShardClientError) as info:
            first.pull_params(job, "w", n, min_version=1)
    finally:
        first.close()
        second.close()
    assert f"buffer '{job}/w' (run '{run}') is at version 0" in info.value.details, info.value
    assert RELEASED.search(info.value.details) is not None, info.value.details


def test_a_rank_still_holding_its_lease_is_named_alive(address: str) -> None:
    """A peer that holds its lease (alive, only late) is named missing and alive: it did not
    die, it has not come (stopped, slow, or at another collective)."""
    run = unique("late")
    first, second = client(address, 0, run), client(address, 1, run)
    try:
        with pytest.raises(ShardClientError) as info:
            first.barrier()
    finally:
        first.close()
        second.close()
    assert (
        "missing rank(s) 1 (arrived: 0); rank 1 is alive (its connection here is open)"
        " but has not come: stopped, slow, or at another collective" in info.value.details
    )


def test_words_for_a_lapsed_lease_awaited_and_for_groups() -> None:
    """A lapsed lease the run waits for (a restart) is said so, with the wait, and a rank of a
    run others lease in that holds no lease here; a group's ranks are its members' indices,
    not the run's ranks, so a group's run gets no words; an epoch's run is its run's."""
    run = records.RunRecord(world_size=3)
    run.leases[2] = records.LeaseRecord(
        expires=10.0, epoch=0, ttl_s=5.0, rejoin_s=60.0, since=0.0, heard=5.0, lapsed_at=10.0
    )
    run.released_at[1] = 4.0
    runs = {"r": run}
    words = lease_words.whereabouts(runs, "r.e2", [0, 1, 2], now=12.5)
    assert words == (
        "; rank 0 holds no lease here: not started, or cut off"
        "; rank 1 released its lease here 8.5 s ago (its process ended or closed its client)"
        "; rank 2's lease lapsed 2.5 s ago; the run waits 60 s from then for it to come back"
    )
    assert lease_words.whereabouts(runs, "r/s1g0", [1, 2], now=12.5) == ""
    assert lease_words.whereabouts(runs, "other", [1], now=12.5) == ""


def test_words_name_the_process_that_held_the_missing_ranks_lease() -> None:
    """A field test's wait named the missing rank only, where its lease's holder says which
    process it is (client/lease_holds.py: host, pid and a random part, which is left out)."""
    run = records.RunRecord(world_size=3)
    alive = dict(expires=20.0, epoch=0, ttl_s=5.0, rejoin_s=60.0, since=0.0, heard=5.0)
    run.leases[0] = records.LeaseRecord(**alive, holder="node-7 pid 4242 0a1b2c3d")
    run.leases[2] = records.LeaseRecord(**{**alive, "expires": 10.0}, lapsed_at=10.0,
                                        holder="node-9 pid 77 feedbeef")  # fmt: skip
    run.released_at[1], run.released_by[1] = 4.0, ("node-8 pid 5 00ff00ff", 1)
    words = lease_words.whereabouts({"r": run}, "r", [0, 1, 2], now=12.5)
    assert words == (
        "; rank 0 is alive (it renews its lease) but has not come: stopped, slow, or at another"
        " collective (host node-7 pid 4242)"
        "; rank 1 released its lease here 8.5 s ago (its process ended or closed its client)"
        " (host node-8 pid 5)"
        "; rank 2's lease lapsed 2.5 s ago; the run waits 60 s from then for it to come back"
        " (host node-9 pid 77)"
    )


def test_ended_words_only_when_every_missing_rank_ended_for_good() -> None:
    """``ended`` (the fail-at-once check, tests/test_ended_ranks.py) speaks only when every
    rank waited for released its lease with ``ends`` and holds none: not for a rank that only
    released, one that leases again, a group's ranks, or a list cut at its bound."""
    run = records.RunRecord(world_size=4)
    run.ended_at.update({0: 2.0, 1: 3.0})
    run.released_at.update({0: 2.0, 1: 3.0, 2: 3.0})
    runs = {"r": run}
    assert lease_words.ended(runs, "r.e1", [0, 1], now=5.0).startswith(
        "missing rank(s) 0, 1 ended: their process exited with no uncaught exception (its"
        " script's end, or sys.exit; the last 2.0 s ago)"
    )
    assert lease_words.ended(runs, "r", [0, 2], now=5.0) == ""  # rank 2 released, may come back
    assert lease_words.ended(runs, "r/s1g0", [0, 1], now=5.0) == ""
    assert lease_words.ended(runs, "r", list(range(1024)), now=5.0) == ""
    run.leases[1] = records.LeaseRecord(
        expires=9.0, epoch=0, ttl_s=5.0, rejoin_s=0.0, since=4.0, heard=4.0
    )
    assert lease_words.ended(runs, "r", [0, 1], now=5.0) == ""  # rank 1 leases again


def test_a_steps_pending_row_names_a_rank_that_never_leased(address: str) -> None:
    """Rank 1 failed before it made its client (a missing data file): it never leased. The
    hang doctor's row of the step that waits for its gradient says so; before, a step's row
    said nothing of its missing ranks (a field check: "missing rank(s) 1 (arrived: 0), open
    for 120.0 s" and no more, where a collective's row names them)."""
    from paramshard.protos import shard_pb2 as pb

    job, n = unique("early"), 16
    first = client(address, 0, unique("run"))
    try:
        first.register_buffer(job, "w", n, contributors=2)
        first.set_params(job, "w", np.zeros(n, np.float32))
        first.push_grads(job, "w", np.ones(n, np.float32), 0)
        reply = first.call(0, "Status", pb.StatusRequest(pending=True))
    finally:
        first.close()
    (row,) = [r for r in reply.pending if r.kind == "push_grad"]
    assert list(row.missing) == [1], row
    assert row.whereabouts == "; rank 1 holds no lease here: not started, or cut off", row


def test_a_pull_of_initial_values_names_rank_0(address: str) -> None:
    """Rank 0 writes a job's initial values (the strategies' rule) and failed before it made
    its client; rank 1's pull of them says who writes them and that rank 0 never leased.
    Before, it said "its initial values are not all written (SetParams covered 0 of 16
    elements)" and no more (a field check under torchrun)."""
    job, n = unique("initial"), 16
    second = client(address, 1, unique("run"))
    try:
        second.register_buffer(job, "w", n, contributors=2)
        with pytest.raises(ShardClientError) as info:
            second.pull_params(job, "w", n, min_version=0)
    finally:
        second.close()
    assert (
        "its initial values are not all written (SetParams covered 0 of 16 elements;"
        " paramshard's strategies write them from rank 0; rank 0 holds no lease here: not"
        " started, or cut off)" in info.value.details
    ), info.value.details
