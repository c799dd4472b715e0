"""The order a batch of calls goes out in (client/call_order.py): each server's calls in turn.

Unit checks of ``in_turn`` on plain records, then real servers: a pull that spans four
servers opens two shared segments per server instead of a whole window's eight, and the
collectives that depend on the order (contributions before reads) still complete and agree.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import pytest
from conftest import run_ranks

from paramshard.client import ClusterSpec, ShardClient
from paramshard.client.call_order import Batch, in_turn
from paramshard.server import ShardServer


@dataclass
class Rec:
    server: int
    method: str


def order(calls: list[Rec]) -> list[tuple[int, str, int]]:
    """(server, method, original index) in the order ``in_turn`` sends them."""
    return [(c.server, c.method, i) for i, c in in_turn(enumerate(calls))]


def test_one_call_of_each_server_in_turn() -> None:
    calls = [Rec(s, "PullParams") for s in (0, 0, 0, 1, 1, 1, 2, 2)]
    assert [(s, i) for s, _, i in order(calls)] == [
        (0, 0), (1, 3), (2, 6), (0, 1), (1, 4), (2, 7), (0, 2), (1, 5),
    ]  # fmt: skip


def test_a_run_of_one_method_never_mixes_with_the_next() -> None:
    """An all-reduce's contributions all go before its reads, whatever the servers."""
    calls = [Rec(s, "Contribute") for s in (0, 0, 1, 1)] + [Rec(s, "ReadSlot") for s in (0, 0, 1)]
    methods = [m for _, m, _ in order(calls)]
    assert methods == ["Contribute"] * 4 + ["ReadSlot"] * 3


def test_every_call_once_and_each_servers_in_its_order() -> None:
    rng = random.Random(7)
    for _ in range(200):
        calls = [
            Rec(rng.randrange(5), rng.choice(["PushGrad", "PullParams"]))
            for _ in range(rng.randrange(0, 40))
        ]
        sent = order(calls)
        assert sorted(i for *_, i in sent) == list(range(len(calls)))
        # each run of one method keeps its place: the call sent p-th is of the run of call p
        run_of = [0] * len(calls)
        for i in range(1, len(calls)):
            run_of[i] = run_of[i - 1] + (calls[i].method != calls[i - 1].method)
        assert [run_of[i] for *_, i in sent] == run_of
        for s in range(5):
            mine = [i for server, _, i in sent if server == s]
            assert mine == sorted(mine)


def test_a_server_at_its_bound_lets_its_runs_other_servers_go_first() -> None:
    calls = [Rec(0, "PushGrad")] * 3 + [Rec(1, "PushGrad"), Rec(2, "ReadSlot")]
    batch = Batch(calls, room=lambda server: server != 0)
    first, second = batch.take(), batch.take()
    assert (first[0], second[0]) == (0, 3)  # server 0's second call waits; server 1's goes
    assert batch.take() is None  # nothing of the next run (ReadSlot) before this one is done
    batch.done(calls[0])
    assert batch.take()[0] == 1
    assert batch.take() is None
    batch.done(calls[0])
    assert batch.take()[0] == 2
    batch.done(calls[0])
    assert batch.take()[0] == 4 and not batch


def test_calls_that_wait_for_each_other_go_strictly_in_order() -> None:
    """An all-reduce's ContributeRead calls: a server at its bound holds back the calls after
    it, so every rank's calls sent are the first ones of the same list."""
    calls = [Rec(s, "ContributeRead") for s in (0, 0, 1, 1)]
    batch = Batch(calls, room=lambda server: server != 0)
    assert batch.take()[0] == 0  # server 0's first call (its first to a server always goes)
    assert batch.take()[0] == 2  # in turn: server 1's first
    assert batch.take() is None  # server 0's second waits for room, and server 1's behind it
    batch.done(calls[0])
    assert batch.take()[0] == 1
    assert batch.take()[0] == 3 and not batch


@pytest.fixture
def four() -> list[ShardServer]:
    servers = [ShardServer(local_calls=False).start() for _ in range(4)]
    yield servers
    for s in servers:
        s.stop(0)


def test_a_pull_across_servers_spreads_its_window_and_its_segments(four) -> None:
    """8 chunks per server, 8 calls in flight: sent server by server, each server's pool of
    segments grew to 8 (32 in all); in turn, 2 each are in flight at once."""
    chunk = 256 * 2**10
    n = 4 * 8 * chunk // 4  # float32: 8 chunks on each of the 4 servers
    c = ShardClient(
        ClusterSpec([s.address for s in four]), timeout_s=30, chunk_bytes=chunk, max_in_flight=8
    )
    try:
        values = np.arange(n, dtype=np.float32)
        c.register_buffer("j", "w", n)
        c.set_params("j", "w", values)
        for _ in range(3):
            np.testing.assert_array_equal(c.pull_params("j", "w", n), values)
        per_server = [s.servicer.segments.usage()[0] for s in four]
    finally:
        c.close()
    assert sum(per_server) == c.shm.opened
    assert max(per_server) <= 2, per_server  # 8 when a whole window went to one server


def test_a_pull_from_one_server_keeps_two_segments_in_flight(four) -> None:
    chunk = 256 * 2**10
    n = 4 * 8 * chunk // 4  # 8 chunks on each server
    c = ShardClient(ClusterSpec([four[0].address]), timeout_s=30, chunk_bytes=chunk)
    try:
        values = np.arange(n // 4, dtype=np.float32)
        c.register_buffer("j", "w", n // 4)
        c.set_params("j", "w", values)
        for _ in range(3):
            np.testing.assert_array_equal(c.pull_params("j", "w", n // 4), values)
    finally:
        c.close()
    assert c.shm.opened <= 2  # IN_FLIGHT_PER_SERVER: the set's, reused by the pulls


def test_collectives_over_several_servers_complete_in_turn(four) -> None:
    """Each rank's all-reduce spans all four servers (contributions then reads, each run in
    turn); a window full of waiting reads must never hold back what another rank waits for."""
    n = 600_000

    def rank(c: ShardClient) -> tuple[np.ndarray, list[np.ndarray]]:
        x = np.full(n, c.rank + 1.0, np.float32)
        return c.all_reduce(x), c.all_gather(x[: n // 3])

    results = run_ranks(
        rank, 3, [s.address for s in four], chunk_bytes=128 * 2**10, max_in_flight=4
    )
    for reduced, gathered in results:
        np.testing.assert_array_equal(reduced, np.full(n, 6.0, np.float32))
        for r, part in enumerate(gathered):
            np.testing.assert_array_equal(part, np.full(n // 3, r + 1.0, np.float32))
