"""What one caller's leases may take of a server (server/collectives/lease_books.py): the
server's bound of leases and of marks of released ranks, and each token's share of half of
each, so that one team on a shared server cannot refuse another its leases; and a refusal
leaves nothing behind.

Found by a hostile review: one token held every lease of a server (the other team's ranks got
RESOURCE_EXHAUSTED); a lease refused at the bound left an empty run record that nothing ever
removed, so four refusals used up a team's share of runs for good; the marks of released ranks
grew with every rank of a run that released (577 bytes each) up to the bound of leases per run,
not per server; and a client that met a full server once never asked it again.
"""

from __future__ import annotations

import time

import grpc
import pytest
from conftest import unique_id
from lease_fakes import new_table

from paramshard.client import ClusterSpec, ShardClient
from paramshard.protos import shard_pb2 as pb
from paramshard.server.runtime.errors import ShardError


def _req(run: str, rank: int, world: int = 64, **kw) -> pb.LeaseRequest:
    return pb.LeaseRequest(
        run=run, rank=rank, world_size=world, ttl_ms=30_000, holder=f"p{rank}", client=1, **kw
    )


def _refused(call) -> str:
    with pytest.raises(ShardError) as refused:
        call()
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
    return refused.value.message


def test_one_token_takes_at_most_half_of_the_leases():
    leases, _ = new_table()
    leases.max_leases = 8
    for rank in range(4):
        leases.renew(_req("b-run", rank), owner="team-b")
    words = _refused(lambda: leases.renew(_req("b-run", 4), owner="team-b"))
    assert "this caller's token holds 4 leases on this server, its share" in words, words
    assert "(half of the server's 8)" in words and "rank 4 of run 'b-run'" in words, words
    for rank in range(4):  # the other team still gets the rest
        leases.renew(_req("a-run", rank), owner="team-a")
    words = _refused(lambda: leases.renew(_req("c-run", 0), owner="team-c"))
    assert "this server holds 8 leases, its limit" in words, words
    leases.renew(_req("b-run", 0, release=True), owner="team-b")  # one of team-b's goes
    leases.renew(_req("b-run", 5), owner="team-b")  # and team-b has room for one again


@pytest.mark.parametrize("call", ["renew", "open_hold"])
def test_a_lease_refused_at_the_bound_leaves_no_run_behind(call):
    leases, clock = new_table()
    leases.max_leases, leases.max_runs = 2, 4  # a token's share: 1 lease, 2 runs
    leases.renew(_req("a", 0), owner="team-a")
    leases.renew(_req("b", 0), owner="team-b")
    before = set(leases._runs)
    for n in range(6):  # more than the share of runs: each refusal left a run before
        run = f"a{n}"
        if call == "renew":
            _refused(lambda run=run: leases.renew(_req(run, 0), owner="team-a"))
        else:
            _refused(lambda run=run: leases.open_hold(_req(run, 0), _Stream(run), owner="team-a"))
    assert set(leases._runs) == before
    leases.renew(_req("a", 0, release=True), owner="team-a")
    clock.now += 1
    leases.renew(_req("a9", 0), owner="team-a")  # room again, and the team's share of runs


class _Stream:
    def __init__(self, run: str) -> None:
        self.run, self.rank = run, 0

    def push(self, reply: pb.LeaseReply) -> None:
        pass

    def stop(self) -> None:
        pass


def test_marks_of_released_ranks_are_bounded_by_the_server_and_the_token():
    """While rank 0 holds its lease, each other rank of a wide run leases and releases in
    turn: two leases at a time, but a mark a rank. Past the token's share no more are kept,
    and a release still drops its lease."""
    leases, _ = new_table()
    leases.max_leases = 8
    leases.renew(_req("wide", 0), owner="team-b")
    for rank in range(1, 11):
        leases.renew(_req("wide", rank), owner="team-b")
        leases.renew(_req("wide", rank, release=True), owner="team-b")
    run = leases._runs["wide"]
    assert list(run.leases) == [0]  # every release dropped its lease
    assert run.released == {1, 2, 3, 4} and set(run.released_by) == {1, 2, 3, 4}
    assert leases._books.marks.total == 4 and leases._books.leases.total == 1
    leases.renew(_req("other", 0, world=2), owner="team-a")  # the other team marks its own
    leases.renew(_req("other", 0, world=2, release=True), owner="team-a")
    assert leases._runs["other"].released == {0}
    leases.drop("wide")
    leases.drop("other")
    assert leases._books.marks.total == 0 and not leases._books.marks.by_owner


def test_a_client_that_met_a_full_server_leases_there_once_it_has_room(servers):
    (srv,) = servers(1)
    table = srv.servicer.leases
    table.max_leases = 2
    for rank in range(2):  # another job holds every lease of the server
        table.renew(_req("full", rank, world=2))
    run = unique_id("late")
    client = ShardClient(ClusterSpec([srv.address]), rank=0, world_size=2, run_id=run)
    try:
        time.sleep(1.5)  # a renewal or more was refused: the server is full
        assert run not in table._runs
        for rank in range(2):
            table.renew(_req("full", rank, world=2, release=True))
        deadline = time.monotonic() + 10.0
        while run not in table._runs and time.monotonic() < deadline:
            time.sleep(0.1)
        assert run in table._runs and 0 in table._runs[run].leases  # asked again: leased
    finally:
        client.close()
