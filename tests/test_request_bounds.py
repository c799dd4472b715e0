"""What a request may ask a server to keep besides its arrays (server/runtime/request_bounds.py):
names, parameter records, placements and versions, each refused past its bound with
INVALID_ARGUMENT before anything changes, and what a slice keeps of its registration paid
for from the memory account.

An outside probe of a server shared by two teams (tokens scoped to ``team-a-*`` and
``team-b-*``) found, with team A's train token alone: a SetParams at version 2**64 - 1, a push
and a Step wrapped the version, and from then on every token's Status failed with INTERNAL
(team B's too, whose tokens cannot see team A's job) until team A dropped it; and buffers of
100 elements whose one parameter carried 200,000 aliases of 1,000 characters grew the server
by gigabytes its ``--max-memory`` account never saw, while team B's Status took 10-16 s.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import numpy as np
import pytest

from paramshard.client import ClusterSpec, ShardClient, ShardClientError
from paramshard.protos import shard_pb2 as pb
from paramshard.server import ShardServer
from paramshard.server.buffers.slice_state import SLICE_RECORD_BYTES
from paramshard.server.runtime.request_bounds import (
    MAX_ALIASES,
    MAX_KEY,
    MAX_NAME,
    MAX_PARAM_NAME,
    MAX_SERVERS,
    MAX_VERSION,
)

pytestmark = pytest.mark.timeout(120)

TOKENS = {"a-train": "train jobs=team-a-*", "a-admin": "admin jobs=team-a-*", "b-read": "read"}
N = 16


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ShardServer]:
    snapshots = tmp_path_factory.mktemp("snapshots")
    with ShardServer("127.0.0.1", 0, tokens=TOKENS, snapshot_dir=str(snapshots)) as s:
        yield s


def client(s: ShardServer, token: str) -> ShardClient:
    spec = ClusterSpec([s.address], token=token)
    return ShardClient(spec, run_id="team-a-run", timeout_s=10, retries=0)


def refused(c: ShardClient, method: str, request: pb.Message) -> str:
    with pytest.raises(ShardClientError) as err:
        c.call(0, method, request)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, err.value
    return err.value.details


def register(job: str = "team-a-job", buffer: str = "w", **kw: object) -> pb.Message:
    base = {
        "numel": N,
        "num_servers": 1,
        "contributors": 1,
        "optimizer": pb.OptimizerSpec(name="sgd"),
    }
    return pb.RegisterBufferRequest(ref=pb.BufferRef(job=job, buffer=buffer), **{**base, **kw})


def entry(name: str = "w", aliases: tuple[str, ...] = ()) -> pb.ParamEntry:
    return pb.ParamEntry(name=name, shape=[N], dtype="float32", numel=N, aliases=aliases)


def test_a_version_near_uint64s_end_is_refused_and_status_stays(server: ShardServer) -> None:
    a, b = client(server, "a-train"), client(server, "b-read")
    try:
        a.register_buffer("team-a-version", "w", N, optimizer="sgd", hyper={"lr": 0.5})
        for version, steps in ((2**64 - 1, 0), (MAX_VERSION + 1, 0), (0, 2**64 - 1)):
            with pytest.raises(ShardClientError) as err:
                zeros = np.zeros(N, np.float32)
                if steps:
                    a.set_params("team-a-version", "w", zeros, state="momentum_buffer",
                                 optimizer_steps=steps)  # fmt: skip
                else:
                    a.set_params("team-a-version", "w", zeros, version=version)
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, err.value
            assert f"{MAX_VERSION:,} (2**53)" in err.value.details
        a.set_params("team-a-version", "w", np.zeros(N, np.float32), version=MAX_VERSION)
        (row,) = [j for j in b.status()[0]["jobs"] if j["job"] == "team-a-version"]
        assert int(row["buffers"][0]["version"]) == MAX_VERSION  # every token's Status works
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize(
    ("request_", "words"),
    [
        (register(job="team-a-" + "j" * MAX_NAME), "a job name has 1..256 characters"),
        (register(buffer="b" * (MAX_NAME + 1)), "a buffer name has 1..256 characters"),
        (register(run="team-a-" + "r" * MAX_KEY), "a run name has 0..1,024 characters"),
        (register(num_servers=MAX_SERVERS + 1), "a placement of 1..65,536 servers"),
        (register(num_servers=2**32 - 1, server_index=1), "a placement of 1..65,536 servers"),
        (register(params=[entry("p" * (MAX_PARAM_NAME + 1))]), "at most 64 aliases of 1,024"),
        (register(params=[entry(aliases=("x",) * (MAX_ALIASES + 1))]), "has 65 aliases"),
        (register(params=[entry(aliases=("x" * (MAX_PARAM_NAME + 1),))]), "characters; at most"),
    ],
    ids=["job", "buffer", "run", "servers", "servers-u32", "param-name", "aliases", "alias"],
)
def test_registrations_past_a_bound_are_refused(
    server: ShardServer, request_: pb.Message, words: str
) -> None:
    a = client(server, "a-train")
    try:
        before = server.servicer.budget.used
        assert words in refused(a, "RegisterBuffer", request_)
        assert server.servicer.budget.used == before
        assert not any(job.startswith("team-a-j") for job in server.servicer.buffers.jobs())
    finally:
        a.close()


def test_a_slices_parameter_records_are_paid_for(server: ShardServer) -> None:
    """Bytes the memory account pays at registration: the arrays plus what the slice keeps of
    the request (its parameters' records) and its own record, so many long names cannot grow a
    server unseen."""
    a = client(server, "a-train")
    names = tuple(f"layer.{i}.tied." + "n" * 900 for i in range(MAX_ALIASES))
    try:
        before = server.servicer.budget.used
        a.call(0, "RegisterBuffer", register("team-a-records", params=[entry(aliases=names)]))
        paid = server.servicer.budget.used - before
        arrays = N * 4 * 3  # params, the gradient accumulator, SGD's momentum buffer
        assert paid == arrays + entry(aliases=names).ByteSize() + SLICE_RECORD_BYTES
    finally:
        a.close()


def test_a_restore_or_snapshot_onto_an_absurd_placement_is_refused(server: ShardServer) -> None:
    a, admin = client(server, "a-train"), client(server, "a-admin")
    try:
        a.register_buffer("team-a-restore", "w", N)
        a.set_params("team-a-restore", "w", np.arange(N, dtype=np.float32))
        admin.call(0, "Snapshot", pb.SnapshotRequest(job="team-a-restore", tag="t1", num_servers=1))
        for n in (2**32 - 1, MAX_SERVERS + 1):
            for method, req in (
                ("Restore", pb.RestoreRequest(job="team-a-restore", tag="t1", num_servers=n)),
                ("Snapshot", pb.SnapshotRequest(job="team-a-restore", tag="t2", num_servers=n)),
            ):
                assert "a placement of 1..65,536 servers" in refused(admin, method, req)
        np.testing.assert_array_equal(
            a.pull_params("team-a-restore", "w", N), np.arange(N, dtype=np.float32)
        )
    finally:
        a.close()
        admin.close()


def test_a_slot_key_past_its_bound_is_refused(server: ShardServer) -> None:
    a = client(server, "a-train")
    key = "team-a-run:" + "k" * MAX_KEY
    try:
        details = refused(a, "ReadSlot", pb.ReadSlotRequest(key=key))
        assert f"a slot key has 1..{MAX_KEY:,} characters" in details
    finally:
        a.close()


@pytest.mark.parametrize(
    "shape, total",
    [([1] * 2_000_000, 1), ([2, 3], 4), ([-2, -2], 4), ([0, -5], 0), ([2**62] * 65, 0)],
    ids=["long", "wrong-numel", "negative", "zero-and-negative", "dims"],
)
def test_a_contributions_shape_past_its_bound_is_refused(
    server: ShardServer, shape: list[int], total: int
) -> None:
    """A slot keeps its first contribution's shape for its readers. Before, any list was
    kept: eight contributions whose shape listed 20,000,000 ones held 1.8 GB of the server
    until the slots expired, while its memory account showed 40 KB."""
    a = client(server, "a-train")
    header = pb.SlotHeader(
        key="team-a-run:shape",
        op=pb.SUM,
        expected=2,
        readers=1,
        total_numel=total,
        chunk_numel=max(total, 1),
        shape=shape,
        chunk=pb.Chunk(offset=0, numel=total, dtype=pb.FLOAT32),
    )
    try:
        before = server.servicer.budget.used
        request_ = pb.ContributeRequest(header=header, data=b"\0" * 4 * total)
        assert f"({len(shape):,} dims) is not a shape of {total:,} elements" in refused(
            a, "Contribute", request_
        )
        assert server.servicer.budget.used == before and not server.servicer.slots.open_slots()
    finally:
        a.close()
