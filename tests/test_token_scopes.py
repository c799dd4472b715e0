"""Issue 27, finding 9: tokens scoped to jobs and runs (server/rpc/scopes.py).

One in-process server, called over gRPC only (``local_calls=False``), holds team B's job
``team-b-job`` (trained a step, a committed snapshot), its run ``team-b-run`` (two ranks'
leases, an all-reduce slot waiting for its second contribution) and a shared segment of team
B's token. Team A's read, train and admin tokens are scoped to ``team-a-*``. Every method of
the Shard service, taken from its descriptor (a new method fails here until it has a scope
rule and a request below), is called by each of them naming team B's job or run, unary and
carried by a session: each is refused with PERMISSION_DENIED before its request is parsed (the
servicer's parsers count what they parse), and team B's job is bitwise what it was
(parameters, optimizer state, versions, pending work, snapshot files, memory, segments), its
run not aborted.
"""

from __future__ import annotations

import collections
import hashlib
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from chaos_target import job_state
from test_sessions import RawSession, code_of

from paramshard.client import ClusterSpec, ShardClient, ShardClientError, StepArgs, tools
from paramshard.protos import codec
from paramshard.protos import shard_pb2 as pb
from paramshard.server import ShardServer, servicer
from paramshard.server.rpc import auth, scopes
from paramshard.server.rpc.tokens import grant_of
from paramshard.server.servicer import ShardServicer
from paramshard.server.transport import shm

pytestmark = pytest.mark.timeout(120)

SHARD = "/paramshard.v1.Shard/"
METHODS = [m.name for m in pb.DESCRIPTOR.services_by_name["Shard"].methods]
TOKENS = {
    "root": "admin",
    "b-train": "train jobs=team-b-*",
    "a-read": "read jobs=team-a-*",
    "a-train": "train jobs=team-a-*",
    "a-admin": "admin jobs=team-a-*",
    "peer-1": "peer",
}
TEAM_A = ("a-read", "a-train", "a-admin")
B_JOB, B_RUN, N = "team-b-job", "team-b-run", 64
B_SLOT = f"{B_RUN}:ar0/0"
PARSED: collections.Counter[str] = collections.Counter()
"""Requests the servicer's parsers parsed, by request type."""


def _counting(make: Any) -> Any:
    """``parsers.plain`` / ``parsers.tensor`` whose parsers count what they parse."""

    def made(cls: Any, *rest: Any) -> Any:
        parse = make(cls, *rest)
        # tensor(header, request, fast) names its request; plain(cls, most) its class
        name = (rest[0] if rest and hasattr(rest[0], "DESCRIPTOR") else cls).DESCRIPTOR.name

        def counted(raw: Any) -> Any:
            PARSED[name] += 1
            return parse(raw)

        return counted

    return made


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ShardServer]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(servicer, "plain", _counting(servicer.plain))
        mp.setattr(servicer, "tensor", _counting(servicer.tensor))
        mp.setattr(shm, "plain", _counting(shm.plain))
        s = ShardServer(
            tokens=TOKENS,
            snapshot_dir=str(tmp_path_factory.mktemp("snapshots")),
            max_wait_s=0.5,
            local_calls=False,
        ).start()
    b = client(s, "b-train", B_RUN)
    b.register_buffer(B_JOB, "w", N, optimizer="adam", hyper={"lr": 0.01})
    b.set_params(B_JOB, "w", np.linspace(-1, 1, N, dtype=np.float32))
    b.push_grads(B_JOB, "w", np.cos(np.arange(N, dtype=np.float32)), 0)
    b.step(B_JOB, 0, {"w": StepArgs({"lr": 0.01})})
    b.close()
    root = client(s, "root")
    tools.snapshot(root, B_JOB, "base")
    root.close()
    for rank in (0, 1):
        assert call(s, "Lease", lease(rank, 60_000), "b-train")[0] == grpc.StatusCode.OK
    half = contribution(B_SLOT, contributor=0)
    assert call(s, "Contribute", half, "b-train")[0] == grpc.StatusCode.OK
    offer = pb.OfferSegmentRequest(nbytes=4096).SerializeToString()
    code, _, reply = call(s, "OfferSegment", offer, "b-train")
    assert code == grpc.StatusCode.OK
    s.b_segment = pb.OfferSegmentReply.FromString(reply).segment
    yield s
    s.stop(0)


def client(s: ShardServer, token: str, run: str = "team-a-run") -> ShardClient:
    return ShardClient(ClusterSpec([s.address], token=token), run_id=run, timeout_s=10, retries=0)


def call(s: ShardServer, method: str, payload: bytes, token: str) -> tuple[Any, str, bytes]:
    """One unary call of raw bytes: (code, details, reply bytes or b"")."""
    with grpc.insecure_channel(s.address) as chan:
        stub = chan.unary_unary(SHARD + method, request_serializer=None, response_deserializer=None)
        try:
            reply = stub(payload, timeout=10, metadata=(("authorization", f"Bearer {token}"),))
            return grpc.StatusCode.OK, "", reply
        except grpc.RpcError as exc:
            return exc.code(), exc.details(), b""


def lease(rank: int, ttl_ms: int, run: str = B_RUN, abort: str = "") -> bytes:
    req = pb.LeaseRequest(run=run, rank=rank, world_size=2, ttl_ms=ttl_ms, abort=abort)
    return req.SerializeToString()


def contribution(key: str, contributor: int) -> bytes:
    header = pb.SlotHeader(
        key=key,
        op=pb.SUM,
        expected=2,
        readers=2,
        total_numel=4,
        chunk=pb.Chunk(numel=4, dtype=pb.FLOAT32),
        chunk_numel=4,
        contributor=contributor,
    )
    return codec.encode(header, np.ones(4, np.float32))


def _chunk(job: str) -> pb.ReplicaChunk:
    return pb.ReplicaChunk(job=job, version=1, total=8, data=b"\0" * 8)


ref = pb.BufferRef(job=B_JOB, buffer="w")
whole = pb.Chunk(offset=0, numel=N, dtype=pb.FLOAT32)
FOREIGN: dict[str, Any] = {
    "RegisterBuffer": pb.RegisterBufferRequest(
        ref=pb.BufferRef(job=B_JOB, buffer="more"), numel=2**20, num_servers=1, contributors=1
    ),
    "SetParams": codec.encode(pb.SetParamsHeader(ref=ref, chunk=whole, version=1), np.zeros(N)),
    "PushGrad": codec.encode(
        pb.PushGradHeader(ref=ref, chunk=whole, step=1, num_micro=1), np.ones(N, np.float32)
    ),  # fmt: skip
    "PullParams": pb.PullParamsRequest(ref=ref, chunk=whole, min_version=5),
    "GradNorm": pb.GradNormRequest(job=B_JOB, buffers=["w"], step=1),
    "Step": pb.StepRequest(job=B_JOB, step=1, skip=True),
    "Contribute": contribution(B_SLOT, contributor=1),
    "ReadSlot": pb.ReadSlotRequest(key=B_SLOT),
    "ContributeRead": contribution(B_SLOT, contributor=1),
    "DropJob": pb.DropJobRequest(job=B_JOB),
    "Lease": lease(1, 100),  # lapses in 100 ms: the run would be aborted, "rank 1 lost"
    "HoldLease": lease(1, 100),  # a stream, refused before it opens (its end would lose rank 1)
    "Snapshot": pb.SnapshotRequest(job=B_JOB, tag="evil", version=1, num_servers=1),
    "CommitSnapshot": pb.CommitSnapshotRequest(job=B_JOB, tag="evil", manifest_json="{}"),
    "Restore": pb.RestoreRequest(job=B_JOB, tag="base", num_servers=1),
    "ListSnapshots": pb.ListSnapshotsRequest(job=B_JOB),
    "DeleteSnapshot": pb.DeleteSnapshotRequest(job=B_JOB, tag="base"),
    "ConfigureReplication": pb.ReplicationConfig(job=B_JOB, every=1, num_servers=1),
    "StoreReplica": _chunk(B_JOB),
    "ListReplicas": pb.ListReplicasRequest(job=B_JOB),
    "FetchReplica": pb.FetchReplicaRequest(job=B_JOB, version=1, max_bytes=4096),
    "LoadReplica": _chunk(B_JOB),
    "RollbackToReplica": pb.RollbackRequest(job=B_JOB, version=1),
    "Join": pb.JoinRequest(run=B_RUN, job=B_JOB, rank=1, world_size=2, step=1, leave=True),
}
"""A request of each method that names a job or run, naming team B's."""
EXTRA = [  # more ways to touch team B's run and job
    ("Lease", lease(0, 600_000, abort="stop them")),
    ("Lease", pb.LeaseRequest(run=B_RUN, rank=1, world_size=2, release=True)),
    ("Lease", lease(1, 600_000, run=f"{B_RUN}.e1")),
    ("ReadSlot", pb.ReadSlotRequest(key=f"{B_RUN}/grp:ar0/0")),
    ("DropJob", pb.DropJobRequest(job=B_RUN)),
    # its own job, team B's run: a wait's words, a restore's refusal would tell of its ranks
    (
        "RegisterBuffer",
        pb.RegisterBufferRequest(
            ref=pb.BufferRef(job="team-a-spy", buffer="w"),
            numel=N,
            num_servers=1,
            contributors=2,
            run=B_RUN,
        ),
    ),  # fmt: skip
    # a restore naming team B's run as its own: the guard's refusal would tell of its ranks
    ("Restore", pb.RestoreRequest(job="team-a-job", tag="t1", num_servers=1, run=B_RUN)),
    # its own snapshot loaded as a job of team B's: B's name, or a new one in B's names
    ("Restore", pb.RestoreRequest(job="team-a-job", tag="t1", num_servers=1, into=B_JOB)),
    ("Restore", pb.RestoreRequest(job="team-a-job", tag="t1", num_servers=1, into="team-b-x")),
    # its own job, team B's run: the decision would tell whose leases in that run are alive
    (
        "Join",
        pb.JoinRequest(
            run=B_RUN,
            job="team-a-probe",
            rank=0,
            world_size=2,
            step=1,
            min_members=1,
            window_ms=60_000,
            known_members=[0, 1],
        ),
    ),  # fmt: skip
    # the job of the last occurrence counts, as protobuf reads it: team B's
    (
        "PullParams",
        pb.PullParamsRequest(ref=pb.BufferRef(job="team-a-x")).SerializeToString()
        + pb.PullParamsRequest(ref=ref).SerializeToString(),
    ),  # fmt: skip
]


def raw(request: Any) -> bytes:
    return request if isinstance(request, bytes) else request.SerializeToString()


def team_b(s: ShardServer) -> Any:
    """Everything of team B's: its job bitwise (tests/test_chaos_fuzz.py), its open slot, its
    snapshot files, and the server's memory and segments."""
    root = client(s, "root")
    try:
        state = job_state(root, B_JOB)
        status = root.call(0, "Status", pb.StatusRequest(pending=True))
    finally:
        root.close()
    slots = [(p.key, list(p.arrived), p.expected) for p in status.pending if p.run == B_RUN]
    folder = s.servicer.snapshots.root / B_JOB
    files = {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in folder.rglob("*")
        if p.is_file()
    }
    replicas = s.servicer.replicator.configs.get(B_JOB)
    return state, slots, files, s.servicer.budget.used, s.servicer.segments.usage(), replicas


def test_every_method_has_a_scope_rule_and_a_foreign_request() -> None:
    for method in METHODS:
        assert method in scopes.ROUTES, f"{method} has no scope rule (server/rpc/scopes.py)"
        if scopes.ROUTES[method].checked:
            assert method in FOREIGN, f"add a request of {method} naming team B's job or run"
    assert set(scopes.ROUTES) == set(METHODS)


def test_a_token_scoped_to_another_team_touches_nothing(server: ShardServer) -> None:
    before = team_b(server)
    parsed = PARSED.copy()
    sent = [(m, raw(r)) for m, r in FOREIGN.items()] + [(m, raw(r)) for m, r in EXTRA]
    for token in TEAM_A:
        role = grant_of(TOKENS[token]).role
        for method, payload in sent:
            code, details, _ = call(server, method, payload, token)
            assert code == grpc.StatusCode.PERMISSION_DENIED, (token, method, code, details)
            if auth.role_allows(role, auth.METHOD_ROLES[method], method):
                assert "outside this token's scope (jobs=team-a-*" in details, details
    session_methods = sorted(ShardServicer.SESSION_METHODS)
    for token in TEAM_A:
        s = RawSession(server.address, token)
        s.opened()
        carried = [(m, raw(r)) for m, r in sent if m in session_methods]
        s.send(*[pb.SessionCall(id=i, method=m, body=b) for i, (m, b) in enumerate(carried)])
        replies = s.replies(len(carried))
        s.close()
        for i, (method, _) in enumerate(carried):
            assert code_of(replies[i]) == grpc.StatusCode.PERMISSION_DENIED, (token, method)
    assert PARSED == parsed, f"parsed: {PARSED - parsed}"  # refused before the parse
    time.sleep(0.3)  # a lease renewed with a 100 ms TTL would have lapsed by now
    for rank in (0, 1):  # the run goes on: nothing aborted, no rank awaited
        code, details, reply = call(server, "Lease", lease(rank, 60_000), "b-train")
        assert code == grpc.StatusCode.OK, details
        notice = pb.LeaseReply.FromString(reply)
        assert (notice.aborted, list(notice.awaiting)) == ("", []), notice
    assert team_b(server) == before


def test_a_token_of_another_team_cannot_abort_a_run_through_its_lease(
    server: ShardServer,
) -> None:
    """The finding: a train token renewed rank 1 of another team's run with a 100 ms TTL,
    and that run was aborted, "rank 1 lost"; or renewed a dead rank's lease for ever."""
    code, details, _ = call(server, "Lease", lease(1, 100), "a-train")
    assert code == grpc.StatusCode.PERMISSION_DENIED, details
    assert f"run '{B_RUN}' is outside this token's scope" in details
    time.sleep(0.3)
    code, details, reply = call(server, "Lease", lease(0, 60_000), "b-train")
    assert code == grpc.StatusCode.OK, details
    assert pb.LeaseReply.FromString(reply).aborted == ""
    code, _, _ = call(server, "Lease", lease(0, 100, abort="stop"), "a-admin")
    assert code == grpc.StatusCode.PERMISSION_DENIED
    code, _, reply = call(server, "Lease", lease(1, 60_000), "b-train")
    assert pb.LeaseReply.FromString(reply).aborted == ""


def test_a_scoped_token_works_on_its_own_jobs(server: ShardServer) -> None:
    """The same server, team A's tokens on team A's job and run: through the ordinary client
    (sessions and shared memory as it chooses), whose token and calls do not change."""
    a = client(server, "a-train")
    a.register_buffer("team-a-job", "w", N, optimizer="sgd", hyper={"lr": 0.5})
    a.set_params("team-a-job", "w", np.zeros(N, np.float32))
    a.push_grads("team-a-job", "w", np.ones(N, np.float32), 0)
    a.step("team-a-job", 0, {"w": StepArgs({"lr": 0.5})})
    out = a.pull_params("team-a-job", "w", N, min_version=1)
    np.testing.assert_array_equal(out, np.full(N, -0.5, np.float32))
    np.testing.assert_array_equal(a.all_reduce(np.arange(4.0)), np.arange(4.0))
    a.close()
    assert call(server, "Lease", lease(0, 60_000, run="team-a-run"), "a-train")[0].name == "OK"
    with grpc.insecure_channel(server.address) as chan:  # the lease held by a stream, in scope
        hold = chan.unary_stream(
            SHARD + "HoldLease",
            request_serializer=None,
            response_deserializer=pb.LeaseReply.FromString,
        )
        stream = hold(
            lease(0, 60_000, run="team-a-run"), metadata=(("authorization", "Bearer a-train"),)
        )
        assert not next(stream).aborted  # the stream opened: its first reply
        bye = pb.LeaseRequest(run="team-a-run", rank=0, world_size=2, release=True)
        assert call(server, "Lease", bye.SerializeToString(), "a-train")[0].name == "OK"
        stream.cancel()
    admin = client(server, "a-admin")
    tools.snapshot(admin, "team-a-job", "t1")
    admin.close()
    for token in ("a-read", "root"):
        code, _, reply = call(server, "Status", b"", token)
        jobs = {j.job for j in pb.StatusReply.FromString(reply).jobs}
        assert jobs == ({"team-a-job"} if token == "a-read" else {"team-a-job", B_JOB})
        pending = pb.StatusReply.FromString(call(server, "Status", b"\x08\x01", token)[2]).pending
        assert (B_RUN in {p.run for p in pending}) == (token == "root")
        code, _, reply = call(server, "ListSnapshots", b"", token)
        listed = {(i.job, i.tag) for i in pb.ListSnapshotsReply.FromString(reply).snapshots}
        assert (B_JOB, "base") in listed if token == "root" else listed == {("team-a-job", "t1")}
    drop = pb.DropJobRequest(job="team-a-job").SerializeToString()
    assert call(server, "DropJob", drop, "a-admin")[0] == grpc.StatusCode.OK


def test_a_job_not_on_the_server_is_refused_without_naming_others(server: ShardServer) -> None:
    """A job of its own scope that the server does not hold: NOT_FOUND, and the message names
    no job of another team (Status lists only the jobs in scope; an error must not either)."""
    for token in TEAM_A:
        a = client(server, token)
        try:
            with pytest.raises(ShardClientError) as err:
                a.pull_params("team-a-missing", "w", N)
        finally:
            a.close()
        assert err.value.code == grpc.StatusCode.NOT_FOUND, err.value
        assert "job 'team-a-missing' is not on this server" in str(err.value)
        assert B_JOB not in str(err.value)


def test_segments_stay_their_tokens_own(server: ShardServer) -> None:
    """Segments name no job: they belong to the token, so team A cannot confirm or release
    team B's, and its own cannot carry a request for team B's job."""
    segment = server.servicer.segments.usage()
    confirm = pb.ConfirmSegmentRequest(segment=server.b_segment, proof=b"x" * 16)
    code, _, _ = call(server, "ConfirmSegment", confirm.SerializeToString(), "a-train")
    assert code == grpc.StatusCode.NOT_FOUND
    release = pb.ReleaseSegmentsRequest(segments=[server.b_segment]).SerializeToString()
    code, _, reply = call(server, "ReleaseSegments", release, "a-admin")
    assert pb.ReleaseSegmentsReply.FromString(reply).released == 0
    assert server.servicer.segments.usage() == segment
