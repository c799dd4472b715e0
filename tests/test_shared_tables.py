"""Teams sharing a server keep a share of its tables (docs/security.md, finding 16): one caller
(its token) may make at most half of the leased runs (``LeaseTable.max_runs``) and half of the
elastic jobs (``MembershipTable.max_jobs``) a server holds, so one team cannot fill a table and
leave the next team's Lease or Join with RESOURCE_EXHAUSTED.

The tables' rules on their own, then through a real server with two teams' tokens, whose
callers the servicer names by token.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from lease_fakes import new_table

from paramshard.client import ClusterSpec, ShardClient, ShardClientError
from paramshard.protos import shard_pb2 as pb
from paramshard.server import ShardServer
from paramshard.server.collectives.membership import MembershipTable
from paramshard.server.runtime.errors import ShardError

pytestmark = pytest.mark.timeout(120)


def lease(run: str, rank: int = 0) -> pb.LeaseRequest:
    return pb.LeaseRequest(run=run, rank=rank, world_size=2, ttl_ms=30_000)


def join(job: str) -> pb.JoinRequest:
    return pb.JoinRequest(run=f"run-{job}", job=job, rank=0, world_size=2, window_ms=1000)


def refused(make, *args) -> str:
    with pytest.raises(ShardError) as caught:
        make(*args)
    assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, caught.value
    return str(caught.value)


def test_a_caller_makes_half_the_leased_runs_and_the_rest_stay_for_others():
    leases, clock = new_table()
    leases.max_runs = 8
    for i in range(4):
        leases.renew(lease(f"a{i}"), "team-a")
    words = refused(leases.renew, lease("a4"), "team-a")
    assert "its share (half of the server's 8)" in words and "'a4'" in words, words
    leases.renew(lease("a0", rank=1), "team-a")  # its runs' other ranks still renew
    for i in range(4):
        leases.renew(lease(f"b{i}"), "team-b")
    assert "its limit" in refused(leases.renew, lease("c0"), "team-c")  # the server's bound
    assert leases.drop("a1")
    leases.renew(lease("a4"), "team-a")  # a run it dropped makes room in its share
    for rank in (0, 1):
        leases.renew(_release("a0", rank), "team-a")
    clock.now += 601  # a run whose leases all went is forgotten after forget_s
    leases.sweep()
    leases.renew(lease("a5"), "team-a")


def _release(run: str, rank: int) -> pb.LeaseRequest:
    req = lease(run, rank)
    req.release = True
    return req


def test_without_tokens_the_leased_runs_have_no_share():
    leases, _ = new_table()
    leases.max_runs = 4
    for i in range(4):
        leases.renew(lease(f"r{i}"))
    assert "its limit" in refused(leases.renew, lease("r4"))


def test_a_caller_makes_half_the_elastic_jobs():
    table = MembershipTable(new_table()[0], {}.get, max_jobs=4)
    for i in range(2):
        table.join(join(f"a{i}"), 0.0, "team-a")
    words = refused(table.join, join("a2"), 0.0, "team-a")
    assert "its share (half of the server's 4)" in words and "'a2'" in words, words
    for i in range(2):
        table.join(join(f"b{i}"), 0.0, "team-b")
    assert table.drop("a0")
    table.join(join("a2"), 0.0, "team-a")


@pytest.fixture
def server() -> Iterator[ShardServer]:
    tokens = {"a": "train jobs=team-a-*", "b": "train jobs=team-b-*"}
    s = ShardServer(tokens=tokens, local_calls=False).start()
    s.servicer.leases.max_runs = 4
    s.servicer.membership.max_jobs = 4
    yield s
    s.stop(0)


def call(s: ShardServer, method: str, request, token: str) -> tuple[grpc.StatusCode, str]:
    with grpc.insecure_channel(s.address) as chan:
        stub = chan.unary_unary(
            f"/paramshard.v1.Shard/{method}",
            request_serializer=type(request).SerializeToString,
            response_deserializer=None,
        )
        try:
            stub(request, timeout=10, metadata=(("authorization", f"Bearer {token}"),))
            return grpc.StatusCode.OK, ""
        except grpc.RpcError as exc:
            return exc.code(), exc.details()


def test_through_a_server_each_team_keeps_its_share_of_runs_and_elastic_jobs(server):
    for i in range(2):
        assert call(server, "Lease", lease(f"team-a-run{i}"), "a")[0] == grpc.StatusCode.OK
    code, details = call(server, "Lease", lease("team-a-run2"), "a")
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "share" in details, details
    for i in range(2):  # team B's place was kept
        assert call(server, "Lease", lease(f"team-b-run{i}"), "b")[0] == grpc.StatusCode.OK

    for i in range(2):
        req = pb.JoinRequest(
            run=f"team-a-run{i}", job=f"team-a-job{i}", rank=0, world_size=2, window_ms=1000
        )
        assert call(server, "Join", req, "a")[0] == grpc.StatusCode.OK
    req = pb.JoinRequest(run="team-a-run0", job="team-a-job2", rank=0, world_size=2)
    code, details = call(server, "Join", req, "a")
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "share" in details, details
    req = pb.JoinRequest(run="team-b-run0", job="team-b-job0", rank=0, world_size=2)
    assert call(server, "Join", req, "b")[0] == grpc.StatusCode.OK


def test_unread_mailboxes_fill_only_their_tokens_share_of_slot_memory():
    """Slot memory has a share per token too (docs/security.md, item 67): a team that fills
    mailboxes nobody reads is refused at half of ``--max-slot-mb``, and another team's sends
    and all-reduces still fit. Before, the first team took all of it (review round 10: 63
    unread 4 MiB messages, then the other team's calls got RESOURCE_EXHAUSTED)."""
    tokens = {"a": "train jobs=team-a-*", "b": "train jobs=team-b-*"}
    s = ShardServer(tokens=tokens, local_calls=False, max_slot_bytes=4 * 2**20).start()
    message = np.ones(2**16, np.float32)  # 256 KiB
    clients: list[ShardClient] = []

    def client(token: str, rank: int) -> ShardClient:
        spec = ClusterSpec([s.address], token=token)
        clients.append(ShardClient(spec, rank, 2, run_id=f"team-{token}-run", timeout_s=20))
        return clients[-1]

    try:
        a = client("a", 0)
        sent = 0
        with pytest.raises(ShardClientError) as caught:
            while sent < 64:  # 16 messages would fill the whole bound
                a.send(message, 1, tag="unread")
                sent += 1
        assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, caught.value
        assert "this caller's share of slot memory" in caught.value.details, caught.value
        assert 4 <= sent < 8, sent  # half of 4 MiB, less the slots' records
        b0, b1 = client("b", 0), client("b", 1)
        with ThreadPoolExecutor(2) as pool:  # the other team's collectives still run
            sums = list(pool.map(lambda c: c.all_reduce(message), (b0, b1)))
        assert all(float(x[0]) == 2.0 for x in sums), sums
        for _ in range(sent):  # and its unread messages fit as many as the first team's
            b0.send(message, 1, tag="unread")
        a1 = client("a", 1)
        got = [a1.recv(0, like=message, tag="unread") for _ in range(sent)]
        assert all(np.array_equal(x, message) for x in got)  # read: team A's share is free
        a.send(message, 1, tag="again")
        assert s.servicer.slots.memory.held > 0
    finally:
        for c in clients:
            c.close()
        s.stop(0)
