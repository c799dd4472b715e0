"""A step's contributions under an elastic membership (server/buffers/membership.py), on real
servers: only the step's members push, each weighted by its rows of the global batch, summed in
rank order whatever order they arrive in; a newer generation replaces an older one's sums, and
an older one is refused, its GradNorm and Step too. Every request that breaks a rule is refused
with a message that names it, and changes nothing."""

from __future__ import annotations

import itertools

import grpc
import numpy as np
import pytest

from paramshard.client import ClusterSpec, ShardClient, ShardClientError, StepArgs
from paramshard.protos import shard_pb2 as pb
from paramshard.server.buffers.membership import Weights

NUMEL, WORLD, LR = 101, 4, 1.0


@pytest.fixture
def cluster(servers):
    """Two servers and a client per rank of a world of 4, a float64 SGD buffer (lr 1: the
    update is minus the reduced gradient) holding zeros."""
    started = servers(2)
    for s in started:  # one thread pushes every rank's turn: an early push waiting for its
        s.servicer.buffers.turns.limit = 0  # turn would wait out its bound (rank_order.py)
    addresses = [s.address for s in started]
    clients = [
        ShardClient(ClusterSpec(addresses), rank=r, world_size=WORLD, timeout_s=10.0)
        for r in range(WORLD)
    ]
    c = clients[0]
    c.register_buffer("j", "b", NUMEL, optimizer="sgd", hyper={"lr": LR}, master_dtype="float64")
    c.set_params("j", "b", np.zeros(NUMEL), version=0)
    yield clients
    for client in clients:
        client.close()


def grad(rank: int, micro: int = 0) -> np.ndarray:
    return np.random.default_rng([rank, micro]).standard_normal(NUMEL)


def push(c: ShardClient, members, generation=0, batch=0, micro=0, num_micro=1, step=0) -> None:
    membership = pb.StepMembership(generation=generation, members=members, global_batch=batch)
    c.push_grads(
        "j", "b", grad(c.rank, micro), step, micro=micro, num_micro=num_micro, dtype="float64",
        membership=membership,
    )  # fmt: skip


def applied(c: ShardClient, step: int = 0, generation: int | None = None) -> np.ndarray:
    """Applies ``step`` and returns the reduced gradient it applied (lr 1, from zeros)."""
    c.step("j", step, {"b": StepArgs({"lr": LR})}, generation=generation)
    return -c.pull_params("j", "b", NUMEL, step + 1, dtype="float64")


def test_weights_are_each_micro_batchs_rows_over_the_global_batch() -> None:
    assert list(Weights(3, 1, 10)) == [4 / 10, 3 / 10, 3 / 10]
    assert list(Weights(2, 2, 7)) == [2 / 7, 2 / 7, 2 / 7, 1 / 7]  # parts of 4 and 3, cut in two
    assert list(Weights(3, 2, 0)) == [1 / 3] * 6  # no global batch: plain average over members
    assert sum(Weights(5, 3, 97)) == pytest.approx(1.0, abs=1e-15)


def test_members_are_weighted_by_their_rows_in_rank_order_whatever_the_arrival(cluster) -> None:
    members, batch = [0, 2, 3], 10  # rank 1 is not a member of this step
    w = Weights(3, 1, batch)
    want = sum(np.float64(w[i]) * grad(r) for i, r in enumerate(members))
    results = []
    for order in itertools.permutations(members):
        job_reset(cluster[0])
        for r in order:
            push(cluster[r], members, batch=batch)
        results.append(applied(cluster[0]))
    np.testing.assert_allclose(results[0], want, rtol=1e-14, atol=0)
    for other in results[1:]:  # rank-order sums: the same bits in every arrival order
        assert np.array_equal(other, results[0])


def job_reset(c: ShardClient) -> None:
    """Back to version 0, zeros (SetParams of a new version restores)."""
    c.set_params("j", "b", np.zeros(NUMEL), version=1)
    c.set_params("j", "b", np.zeros(NUMEL), version=0)


def test_micro_batches_are_weighted_by_their_own_rows(cluster) -> None:
    members, batch = [1, 3], 7
    w = Weights(2, 2, batch)
    for r in members:
        for m in range(2):
            push(cluster[r], members, batch=batch, micro=m, num_micro=2)
    want = sum(
        np.float64(w[2 * i + m]) * grad(r, m) for i, r in enumerate(members) for m in range(2)
    )
    np.testing.assert_allclose(applied(cluster[1]), want, rtol=1e-14, atol=0)


def test_a_newer_generation_replaces_the_older_and_the_older_is_refused(cluster) -> None:
    push(cluster[0], [0, 1, 2], generation=0, batch=9)
    push(cluster[1], [0, 1, 2], generation=0, batch=9)  # rank 2 is lost before it pushes
    push(cluster[0], [0, 1], generation=1, batch=9)  # the others redo the step without it
    with pytest.raises(ShardClientError, match="generation 1, not 0: its members changed") as e:
        push(cluster[1], [0, 1, 2], generation=0, batch=9)  # a late push of generation 0
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(ShardClientError, match="generation 1, not 0") as e:
        cluster[1].grad_check("j", ["b"], 0, generation=0)  # refused, not waited for
    push(cluster[1], [0, 1], generation=1, batch=9)
    w = Weights(2, 1, 9)
    want = np.float64(w[0]) * grad(0) + np.float64(w[1]) * grad(1)
    np.testing.assert_allclose(applied(cluster[0], generation=1), want, rtol=1e-14, atol=0)


def test_what_breaks_the_rules_is_refused_and_changes_nothing(cluster) -> None:
    push(cluster[0], [0, 1], batch=8)
    cases = [
        (cluster[2], {"members": [0, 1]}, "rank 2 is not a member of step 0"),
        # the step's own membership, byte for byte: checked against the step's, not rank by rank
        (cluster[2], {"members": [0, 1], "batch": 8}, "rank 2 is not a member of step 0"),
        (cluster[1], {"members": [0, 1], "batch": 8, "num_micro": 5}, "8 rows cannot give"),
        (cluster[0], {"members": [1, 0]}, "distinct ranks in ascending order"),
        (cluster[0], {"members": [0, 7]}, "member rank 7 is outside 0..3"),
        (cluster[0], {"members": [0, 1], "batch": 1}, "global batch of 1 rows cannot give"),
        (cluster[1], {"members": [0, 1], "batch": 6}, "this push says 0, 1 and 6"),
    ]
    for c, kw, message in cases:
        with pytest.raises(ShardClientError, match=message):
            push(c, **kw)
    with pytest.raises(ShardClientError, match="without one cannot join it") as e:
        cluster[1].push_grads("j", "b", grad(1), 0, dtype="float64")
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    push(cluster[1], [0, 1], batch=8)  # the step goes on as if nothing had been tried
    w = Weights(2, 1, 8)
    want = np.float64(w[0]) * grad(0) + np.float64(w[1]) * grad(1)
    np.testing.assert_allclose(applied(cluster[0]), want, rtol=1e-14, atol=0)


def test_the_hang_doctor_names_the_members_missing(cluster) -> None:
    push(cluster[3], [1, 3], batch=8)
    rows = [
        p
        for row in cluster[0].status(pending=True)
        for p in row.get("pending", [])
        if p["kind"] == "push_grad"
    ]
    assert rows and all(p["arrived"] == [3] and p["missing"] == [1] for p in rows), rows
    assert all(int(p["expected"]) == 2 for p in rows)


@pytest.mark.parametrize("batch", [0, 2**33])
def test_a_push_of_billions_of_micro_batches_builds_no_list_of_their_weights(
    cluster, batch: int
) -> None:
    """``num_micro`` is the push's own. Before, the step's weights were a list of ``members *
    num_micro``: 2**32 - 1 ended INTERNAL (MemoryError) with no global batch, and with one
    the list was built in a Python loop (2**23 took 3.1 s and 320 MB)."""
    push(cluster[0], [0, 2], batch=batch, num_micro=2**32 - 1)  # waits for the rest
    w = Weights(2, 2**32 - 1, batch)
    assert len(w) == 2 * (2**32 - 1) and w[len(w) - 1] == (0.5 if not batch else 1 / batch)
    # the step is open, as that push said: a push of one micro-batch to it is refused
    with pytest.raises(ShardClientError) as err:
        push(cluster[2], [0, 2], batch=batch)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION, err.value
    assert "accumulates 4294967295 micro-batches per contributor" in str(err.value)
