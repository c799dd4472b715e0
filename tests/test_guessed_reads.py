"""Reads of whole slots by a reader that guesses their size (client/slot_reads.py): an
all-gather of tensors of one shape and dtype reads every chunk of every part in one round
trip, and any other shape or dtype is still read right, in a second round; a read at an
offset the slot cannot hold is refused, or with ``guess`` answered with no elements, as soon
as the slot's first contribution shows it, not at the read's deadline."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import run_ranks
from test_bad_input import make_client, rpc_error
from test_bad_slots import payload_for, slot

from paramshard.client import ShardClient
from paramshard.protos import shard_pb2 as pb

CHUNK = 4096  # bytes: 1,024 float32 elements a chunk
WAIT_S = 20.0  # the clients' deadline: a read that waited for it would take this long


def read_rounds(c: ShardClient) -> list[int]:
    """Counts, batch by batch, the ReadSlot calls ``c`` sends (by wrapping its ``run``)."""
    rounds: list[int] = []
    run = c.run

    def counting(calls: Any) -> list[Any]:
        calls = list(calls)
        reads = sum(call.method == "ReadSlot" for call in calls)
        if reads:
            rounds.append(reads)
        return run(calls)

    c.run = counting  # type: ignore[method-assign]
    return rounds


@pytest.mark.parametrize("world", [2, 3])
def test_all_gather_of_one_shape_reads_in_one_round(transport_servers, world: int) -> None:
    n = 5 * 1024 + 7  # 6 chunks, the last one short

    def work(c: ShardClient) -> tuple[list[np.ndarray], list[int]]:
        rounds = read_rounds(c)
        x = np.arange(n, dtype=np.float32) + 1000 * c.rank
        return c.all_gather(x), rounds

    for rank, (got, rounds) in enumerate(
        run_ranks(work, world, transport_servers[:world], chunk_bytes=CHUNK, timeout_s=WAIT_S)
    ):
        for j, part in enumerate(got):
            np.testing.assert_array_equal(part, np.arange(n, dtype=np.float32) + 1000 * j)
        assert rounds == [6 * (world - 1)], f"rank {rank}: ReadSlot calls per batch {rounds}"


def test_all_gather_of_other_shapes_and_dtypes(transport_servers) -> None:
    """Rank 1's tensor is longer than rank 0's and float64; rank 2's shorter and one chunk:
    every guess misses, and every part still arrives whole in its own dtype and shape. Rank 1
    cuts its float64 guess every 512 elements, which is every chunk start of the others (1,024
    float32 a chunk): it has all in one round. Ranks 0 and 2 miss chunks of rank 1's part (and
    rank 2 of rank 0's): a second round reads them."""
    shapes = {0: (3000,), 1: (5, 900), 2: (100,)}
    dtypes = {0: np.float32, 1: np.float64, 2: np.float32}

    def values(r: int) -> np.ndarray:
        return (np.arange(np.prod(shapes[r])) * (r + 1)).astype(dtypes[r]).reshape(shapes[r])

    def work(c: ShardClient) -> tuple[list[np.ndarray], list[int]]:
        rounds = read_rounds(c)
        return c.all_gather(values(c.rank)), rounds

    results = run_ranks(work, 3, transport_servers[:3], chunk_bytes=CHUNK, timeout_s=WAIT_S)
    for rank, (got, rounds) in enumerate(results):
        for j, part in enumerate(got):
            assert part.dtype == dtypes[j] and part.shape == shapes[j], (rank, j)
            np.testing.assert_array_equal(part, values(j))
        assert len(rounds) == (1 if rank == 1 else 2), f"rank {rank}: ReadSlot rounds {rounds}"


def test_a_read_off_the_slot_ends_when_the_slot_shows_it(servers) -> None:
    """Reads sent before any contribution, at an offset past the slot's end and at one off its
    chunk grid: once the first contribution arrives, a plain read is refused and a guessed
    one answered with the slot's header and no elements, well before the deadline."""
    (s,) = servers(1)
    c = make_client([s.address], timeout_s=WAIT_S)
    h = slot("g1", op=pb.SET, expected=1, readers=1, total=6, chunk_numel=4, shape=(6,))
    reads = {
        "past the end": pb.ReadSlotRequest(key="g1", offset=8, reader=1),
        "off the grid": pb.ReadSlotRequest(key="g1", offset=2, reader=1),
        "guessed past the end": pb.ReadSlotRequest(key="g1", offset=8, reader=1, guess=True),
    }
    try:
        with ThreadPoolExecutor(len(reads)) as pool:
            began = time.monotonic()
            waits = {name: pool.submit(_outcome, c, req) for name, req in reads.items()}
            time.sleep(0.3)  # the reads wait: nobody knows the slot's size yet
            assert not any(w.done() for w in waits.values()), "a read did not wait"
            c.call(0, "Contribute", (h, payload_for(h)))
            got = {name: w.result(timeout=WAIT_S) for name, w in waits.items()}
            took = time.monotonic() - began
        assert took < WAIT_S / 2, f"the reads ended after {took:.1f} s: at their deadline"
        for name in ("past the end", "off the grid"):
            code, details = got[name]
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (name, code, details)
            assert "slot 'g1'" in details, (name, details)
        assert "past its 6 elements" in got["past the end"][1]
        assert "does not start a chunk of 4" in got["off the grid"][1]
        header, data = got["guessed past the end"]
        assert (header.total_numel, header.chunk.numel, len(data)) == (6, 0, 0)
        assert header.chunk.offset == 8 and list(header.shape) == [6]
        # the real chunks were not read by any of that: their reader still finds them
        first, data0 = c.call(0, "ReadSlot", pb.ReadSlotRequest(key="g1", offset=0, reader=1))
        assert first.chunk.numel == 4
        np.testing.assert_array_equal(data0, np.ones(4, np.float32))
        h2 = slot("g1", op=pb.SET, expected=1, readers=1, total=6, chunk_numel=4, shape=(6,))
        h2.chunk.offset, h2.chunk.numel = 4, 2
        c.call(0, "Contribute", (h2, payload_for(h2)))
        second, _ = c.call(0, "ReadSlot", pb.ReadSlotRequest(key="g1", offset=4, reader=1))
        assert second.chunk.numel == 2
        err = rpc_error(c.call, 0, "ReadSlot", pb.ReadSlotRequest(key="g1", offset=0, reader=1))
        assert err.code == grpc.StatusCode.NOT_FOUND, "read by its one reader: freed"
    finally:
        c.close()


def test_a_guessed_read_after_the_slot_was_freed(servers) -> None:
    """Another reader may take a slot's last chunk (and free the slot) before a guessed read
    of an offset it never had arrives: that read is answered with no elements, as while the
    slot was open; a read of a chunk it had is still NOT_FOUND (a read again: its reply was
    lost, client/retries.py)."""
    (s,) = servers(1)
    c = make_client([s.address], timeout_s=WAIT_S)
    h = slot("g2", op=pb.SET, expected=1, readers=1, total=3, chunk_numel=4, shape=(3,))
    try:
        c.call(0, "Contribute", (h, payload_for(h)))
        c.call(0, "ReadSlot", pb.ReadSlotRequest(key="g2", offset=0, reader=1))
        header, data = c.call(0, "ReadSlot", pb.ReadSlotRequest(key="g2", offset=4, guess=True))
        assert (header.chunk.offset, header.chunk.numel, header.total_numel) == (4, 0, 3)
        assert len(data) == 0
        for req in (
            pb.ReadSlotRequest(key="g2", offset=4),
            pb.ReadSlotRequest(key="g2", offset=0, guess=True),
        ):
            err = rpc_error(c.call, 0, "ReadSlot", req)
            assert err.code == grpc.StatusCode.NOT_FOUND and "freed" in err.details, (req, err)
    finally:
        c.close()


def _outcome(c: ShardClient, req: pb.ReadSlotRequest) -> Any:
    """The reply of ``req``, or (status code, details) of its error."""
    try:
        return c.call(0, "ReadSlot", req)
    except Exception as exc:  # noqa: BLE001 - the error is the outcome
        return getattr(exc, "code", None), getattr(exc, "details", str(exc))
