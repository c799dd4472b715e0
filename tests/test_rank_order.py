"""Rank-order sums kept per element (server/buffers/rank_order.py): the same bits as a sum in
(contributor, micro-batch) order whatever the chunks and their arrival, and an early chunk
waits in staging only while an earlier contribution's chunk over its own elements is missing.

Ordered per slice, a chunk of contribution k waited until contributions 0..k-1 had covered the
*whole* slice: a ZeRO-2 slice spans the whole model, so each server kept up to W - 1 slices of
copies until the slowest rank's last chunk (GPT-2 124M at W = 4: 372 MB a server).
"""

from __future__ import annotations

import itertools
import random
import threading
import time

import numpy as np
import pytest
from test_server_float64 import NUMEL, contributions, register

from paramshard.protos import shard_pb2 as pb
from paramshard.server.buffers.rank_order import RankOrder
from paramshard.server.buffers.slice_state import STAGED_RECORD_BYTES
from paramshard.server.buffers.store import BufferStore
from paramshard.server.collectives.slot import slot_charge
from paramshard.server.collectives.slots import SlotStore
from paramshard.server.runtime import backend
from paramshard.server.runtime.errors import ShardError
from paramshard.server.runtime.turns import TurnWaits
from paramshard.server.transport.session_bounds import INLINE_BYTES


@pytest.fixture(autouse=True)
def numpy_backend() -> None:
    backend.use_device("cpu")


def cuts(rng: random.Random, numel: int, pieces: int) -> list[tuple[int, int]]:
    """At most ``pieces`` chunks (offset, numel) covering [0, numel), at random boundaries."""
    inner = sorted(rng.sample(range(1, numel), min(pieces, numel) - 1))
    bounds = [0, *inner, numel]
    return [(a, b - a) for a, b in itertools.pairwise(bounds)]


def test_rank_order_matches_a_count_per_element() -> None:
    rng = random.Random(5)
    for _ in range(200):
        numel, ranks = rng.randint(2, 40), rng.randint(1, 5)
        chunks = [(k, o, n) for k in range(ranks) for o, n in cuts(rng, numel, rng.randint(1, 6))]
        rng.shuffle(chunks)
        order, taken, waiting = RankOrder(), np.zeros(numel, int), list(chunks)
        while waiting:  # add whatever is ready, as the server does, until nothing is left
            for k, o, n in list(waiting):
                want = bool((taken[o : o + n] == k).all())
                assert order.ready(o, n, k) == want, (k, o, n, taken)
                if want:
                    order.advance(o, n)
                    taken[o : o + n] += 1
                    waiting.remove((k, o, n))
        assert (taken == ranks).all()
        assert order.starts == [0, numel] and order.taken == [ranks, 0]  # runs stay maximal


def test_advancing_a_range_that_is_not_one_run_is_refused() -> None:
    order = RankOrder()
    order.advance(0, 4)
    with pytest.raises(ValueError, match="not one run"):
        order.advance(2, 4)  # [2, 4) took one, [4, 6) none
    assert order.starts == [0, 4] and order.taken == [1, 0]


def push(b: object, c: int, m: int, micro: int, o: int, n: int, values: np.ndarray) -> None:
    wire = pb.FLOAT64 if values.dtype == np.float64 else pb.FLOAT32
    header = pb.PushGradHeader(
        ref=pb.BufferRef(job="j", buffer="b"),
        chunk=pb.Chunk(offset=o, numel=n, dtype=wire),
        step=0,
        contributor=c,
        micro=m,
        num_micro=micro,
    )
    b.push_grad(header, memoryview(values[o : o + n].tobytes()), timeout=1.0)


@pytest.mark.parametrize("master", [pb.FLOAT32, pb.FLOAT64], ids=["float32", "float64"])
def test_any_chunking_and_interleaving_sums_in_rank_order(master: int) -> None:
    contributors, micro = 4, 2
    dtype = np.float64 if master == pb.FLOAT64 else np.float32
    values = contributions(contributors, micro, dtype)
    want = np.zeros(NUMEL, dtype)
    for key in sorted(values):
        want += values[key]
    want /= dtype(contributors)
    rng = random.Random(17)
    for trial in range(30):
        b = register(BufferStore(), contributors, master=master)
        chunks = [(c, m, o, n) for (c, m) in values for o, n in cuts(rng, NUMEL, rng.randint(1, 7))]
        rng.shuffle(chunks)
        for c, m, o, n in chunks:
            push(b, c, m, micro, o, n, values[c, m])
        assert b.pending.reduced and not b.pending.staged and b.pending.staged_bytes == 0
        np.testing.assert_array_equal(b.grad, want, err_msg=f"trial {trial}")


def test_a_chunk_waits_only_for_earlier_chunks_over_its_own_elements() -> None:
    store = BufferStore()
    b = register(store, 4, master=pb.FLOAT32)
    half, ones = NUMEL // 2, np.ones(NUMEL, np.float32)
    # the values staged, and what the budget holds for them (their records too)
    staged = lambda: (b.pending.staged_bytes, store.budget.usage()["staging"])  # noqa: E731
    each = (NUMEL - half) * 4
    for c in range(4):  # every rank's first half, in rank order: nothing waits
        push(b, c, 0, 1, 0, half, ones)
        assert staged() == (0, 0), c
    push(b, 3, 0, 1, half, NUMEL - half, ones)  # rank 3's second half: ranks 0-2 are missing
    push(b, 1, 0, 1, half, NUMEL - half, ones)  # rank 1's: rank 0 is missing
    assert staged() == (2 * each, 2 * (each + STAGED_RECORD_BYTES))
    push(b, 0, 0, 1, half, NUMEL - half, ones)  # rank 0's: rank 1's is added, rank 3's waits
    assert staged() == (each, each + STAGED_RECORD_BYTES) and not b.pending.reduced
    push(b, 2, 0, 1, half, NUMEL - half, ones)  # the last: rank 3's goes too
    assert staged() == (0, 0) and b.pending.reduced
    np.testing.assert_array_equal(b.grad, ones)  # 4 ones, averaged


# --- early chunks wait for their turn (server/runtime/turns.py) before any copy is made ---------
def pushing(b: object, c: int, values: np.ndarray, timeout: float = 10.0) -> threading.Thread:
    """Rank ``c``'s whole push in a thread of its own, as its server's handler runs it."""
    wire = pb.FLOAT32
    header = pb.PushGradHeader(
        ref=pb.BufferRef(job="j", buffer="b"),
        chunk=pb.Chunk(offset=0, numel=NUMEL, dtype=wire),
        step=0,
        contributor=c,
        num_micro=1,
    )
    t = threading.Thread(target=b.push_grad, args=(header, memoryview(values.tobytes()), timeout))
    t.start()
    return t


def settle(condition: object, what: str) -> None:
    deadline = time.monotonic() + 10.0
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_an_early_push_waits_for_its_turn_and_is_added_without_a_copy() -> None:
    store = BufferStore()
    store.turns.limit, store.turns.min_bytes = 4, 0  # NUMEL floats: 1 KiB
    b = register(store, 3, master=pb.FLOAT32)
    values = contributions(3, 1, np.float32)
    late = [pushing(b, c, values[c, 0]) for c in (2, 1)]  # both before rank 0
    settle(lambda: store.turns.waiting == 2, "ranks 2 and 1 to wait")
    assert store.budget.usage()["staging"] == 0 and b.pending is None  # nothing recorded yet
    pushing(b, 0, values[0, 0]).join(10.0)
    for t in late:
        t.join(10.0)
    assert b.pending.reduced and store.turns.waiting == 0 and b.turn_waiters == 0
    assert store.budget.usage()["staging"] == 0
    want = (values[0, 0] + values[1, 0]) + values[2, 0]
    np.testing.assert_array_equal(b.grad, want / np.float32(3))


def test_a_turn_that_does_not_come_is_waited_for_until_its_bound_then_staged() -> None:
    store = BufferStore()
    store.turns.limit, store.turns.min_bytes = 4, 0  # NUMEL floats: 1 KiB
    b = register(store, 3, master=pb.FLOAT32)
    pushing(b, 2, np.ones(NUMEL, np.float32), timeout=0.4).join(10.0)  # waits 0.2 s at most
    assert store.turns.waiting == 0 and b.pending.staged_bytes == NUMEL * 4
    assert store.budget.usage()["staging"] == NUMEL * 4 + STAGED_RECORD_BYTES


def test_pushes_past_the_bound_on_waits_are_staged_at_once() -> None:
    store = BufferStore()
    store.turns.limit, store.turns.min_bytes = 1, 0
    b = register(store, 3, master=pb.FLOAT32)
    waiting = pushing(b, 2, np.ones(NUMEL, np.float32))
    settle(lambda: store.turns.waiting == 1, "rank 2 to wait")
    pushing(b, 1, np.ones(NUMEL, np.float32)).join(10.0)  # no room to wait: a copy at once
    assert store.turns.waiting == 1 and b.pending.staged_bytes == NUMEL * 4
    pushing(b, 0, np.ones(NUMEL, np.float32)).join(10.0)
    waiting.join(10.0)
    assert b.pending.reduced and b.pending.staged_bytes == 0
    np.testing.assert_array_equal(b.grad, np.ones(NUMEL, np.float32))


def test_small_contributions_never_wait_for_their_turn() -> None:
    """A session runs contributions up to INLINE_BYTES on its reader thread, which must never
    wait (its other calls would wait behind it): those are staged at once."""
    assert INLINE_BYTES < TurnWaits().min_bytes
    store = BufferStore()
    store.turns.limit = 4
    b = register(store, 3, master=pb.FLOAT32)  # 1 KiB chunks
    pushing(b, 2, np.ones(NUMEL, np.float32)).join(10.0)
    assert store.turns.waiting == 0 and b.pending.staged_bytes == NUMEL * 4


def contributing(slots: SlotStore, c: int, values: np.ndarray) -> threading.Thread:
    header = pb.SlotHeader(
        key="r:ar1", op=pb.SUM, expected=3, readers=1, total_numel=values.size,
        chunk_numel=values.size, chunk=pb.Chunk(offset=0, numel=values.size, dtype=pb.FLOAT32),
        contributor=c,
    )  # fmt: skip
    args = (header, memoryview(values.tobytes()), 10.0)
    t = threading.Thread(target=slots.contribute, args=args)
    t.start()
    return t


def test_an_early_slot_contribution_waits_for_its_turn_without_a_copy() -> None:
    turns = TurnWaits(4)
    turns.min_bytes = 0
    slots = SlotStore(turns=turns)
    values = contributions(3, 1, np.float32)
    late = [contributing(slots, c, values[c, 0]) for c in (2, 1)]
    settle(lambda: turns.waiting == 2, "contributors 2 and 1 to wait")
    assert slots.usage()[0] == slot_charge("r:ar1")  # its record: no accumulator, none staged
    contributing(slots, 0, values[0, 0]).join(10.0)
    for t in late:
        t.join(10.0)
    assert turns.waiting == 0
    _, total = slots.read(pb.ReadSlotRequest(key="r:ar1", offset=0, reader=0), 5.0)
    want = (values[0, 0] + values[1, 0]) + values[2, 0]
    np.testing.assert_array_equal(np.asarray(total), want)


def test_a_push_waiting_for_its_turn_when_its_job_is_dropped_fails_and_keeps_nothing() -> None:
    store = BufferStore()
    store.turns.limit, store.turns.min_bytes = 4, 0
    b = register(store, 3, master=pb.FLOAT32)
    failed: list[ShardError] = []
    header = pb.PushGradHeader(
        ref=pb.BufferRef(job="j", buffer="b"),
        chunk=pb.Chunk(offset=0, numel=NUMEL, dtype=pb.FLOAT32),
        step=0, contributor=2, num_micro=1,
    )  # fmt: skip

    def push() -> None:
        try:
            b.push_grad(header, memoryview(np.ones(NUMEL, np.float32).tobytes()), 10.0)
        except ShardError as exc:
            failed.append(exc)

    t = threading.Thread(target=push)
    t.start()
    settle(lambda: store.turns.waiting == 1, "rank 2 to wait")
    assert store.drop("j") == 1
    t.join(10.0)
    (err,) = failed
    assert "was dropped while waiting" in err.message, err.message
    assert store.turns.waiting == 0 and store.budget.usage()["staging"] == 0


@pytest.mark.parametrize(
    ("contributors", "micro", "arrival_order"), [(2, 1, False), (4, 2, True), (3, 1, True)]
)
def test_arrival_order_sums_copy_the_first_contribution_of_every_element(
    contributors: int, micro: int, arrival_order: bool
) -> None:
    """Without rank order (two contributions, or ``arrival_order``), each element takes its
    contributions as they come: the first is copied (no zeros under it, so a -0.0 stays -0.0
    as in gloo's sums), and the next step starts over from the copies, not from the last
    step's sums. The reference replays the same arrivals over whole arrays."""
    values = contributions(contributors, micro, np.float32)
    for key in values:
        values[key][:3] = -0.0  # the same sign of zero from every rank
    rng = random.Random(contributors)
    b = register(BufferStore(), contributors, master=pb.FLOAT32, arrival_order=arrival_order)
    for trial in range(3):
        chunks = [(c, m, o, n) for (c, m) in values for o, n in cuts(rng, NUMEL, rng.randint(1, 7))]
        rng.shuffle(chunks)
        want, taken = np.empty(NUMEL, np.float32), np.zeros(NUMEL, int)
        for c, m, o, n in chunks:
            header = pb.PushGradHeader(
                ref=pb.BufferRef(job="j", buffer="b"),
                chunk=pb.Chunk(offset=o, numel=n, dtype=pb.FLOAT32),
                step=trial,
                contributor=c,
                micro=m,
                num_micro=micro,
                step_args=pb.StepArgs(),
            )
            b.push_grad(header, memoryview(values[c, m][o : o + n].tobytes()), timeout=1.0)
            first = taken[o : o + n] == 0
            part = want[o : o + n]
            part[first] = values[c, m][o : o + n][first]
            part[~first] += values[c, m][o : o + n][~first]
            taken[o : o + n] += 1
        want /= np.float32(contributors)
        assert b.grad.tobytes() == want.tobytes(), f"trial {trial}"
        assert np.signbit(b.grad[:3]).all()
        assert b.version == trial + 1  # stepped: the next trial is a new step
