"""A MEAN chunk divided as its last contribution is added (``arrays.reduce_into``): one pass
over memory instead of two, and the same bits as adding, then dividing, each over the whole
chunk. Checked on chunks several blocks long with a ragged end, for every order the
contributions can arrive in, held (ContributeRead) or copied, and staged for rank order."""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import numpy as np
import pytest

from paramshard.protos import shard_pb2 as pb
from paramshard.server.collectives import slot as slot_module
from paramshard.server.collectives.contribute_read import contribute_read
from paramshard.server.collectives.slots import SlotStore
from paramshard.server.runtime import arrays, backend

N = 3 * (1 << 16) + 12_345  # several of reduce_into's blocks, and a ragged end


@pytest.fixture(autouse=True)
def numpy_backend() -> None:
    backend.use_device("cpu")


def header(key: str, c: int, expected: int, dtype: int) -> pb.SlotHeader:
    return pb.SlotHeader(
        key=key,
        op=pb.MEAN,
        expected=expected,
        readers=expected,
        total_numel=N,
        chunk_numel=N,
        contributor=c,
        chunk=pb.Chunk(offset=0, numel=N, dtype=dtype),
    )


def operands(expected: int, np_dtype: Any) -> list[np.ndarray]:
    rng = np.random.default_rng(expected)
    return [(rng.standard_normal(N) * 10.0 ** (k - 1)).astype(np_dtype) for k in range(expected)]


def two_passes(values: list[np.ndarray]) -> np.ndarray:
    """The reference: contributions added in rank order, then the whole sum divided."""
    acc = values[0].copy()
    for v in values[1:]:
        np.add(acc, v, out=acc)
    return acc / acc.dtype.type(len(values))


@pytest.mark.parametrize("np_dtype", [np.float32, np.float64])
def test_reduce_into_divides_in_the_same_pass_with_the_same_bits(np_dtype: Any) -> None:
    a, b = operands(2, np_dtype)
    want = two_passes([a, b])
    out = np.empty_like(a)
    assert arrays.reduce_into(np.add, a, b, out, 2) is out
    assert out.tobytes() == want.tobytes()
    acc = a.copy()  # in place, as a chunk's own accumulator is
    arrays.reduce_into(np.add, acc, b, acc, 2)
    assert acc.tobytes() == want.tobytes()
    arrays.reduce_into(np.maximum, a, b, out)  # no divisor: the reduction alone
    assert out.tobytes() == np.maximum(a, b).tobytes()


class Divisions:
    """Records the divisors ``Chunk.add`` passes to ``reduce_into``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.divisors: list[int] = []
        real = arrays.reduce_into

        def spy(fn: Any, acc: Any, values: Any, out: Any, divisor: int = 0) -> Any:
            self.divisors.append(divisor)
            return real(fn, acc, values, out, divisor)

        monkeypatch.setattr(slot_module.arrays, "reduce_into", spy)


def run_in_threads(calls: list[Any]) -> list[Any]:
    out: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        out[i] = calls[i]()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(calls))]
    for t in threads:
        t.start()
        time.sleep(0.02)  # in the order given, mostly: any order must give the same bits
    for t in threads:
        t.join(30)
    return out


@pytest.mark.parametrize("expected", [2, 3, 4])
@pytest.mark.parametrize("held", [False, True])
def test_every_arrival_order_gives_the_two_pass_bits_and_divides_once(
    expected: int, held: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    values = operands(expected, np.float32)
    want = two_passes(values).tobytes()
    divisions = Divisions(monkeypatch)
    for n, order in enumerate(itertools.permutations(range(expected))):
        store, key = SlotStore(), f"m{n}"
        divisions.divisors.clear()
        if held:
            replies = run_in_threads(
                [
                    lambda c=c, store=store, key=key: contribute_read(
                        store,
                        header(key, c, expected, pb.FLOAT32),
                        memoryview(values[c]).cast("B"),
                        20.0,
                    )
                    for c in order
                ]
            )
            payloads = [bytes(p) for _, p in replies]
        else:
            for c in order:  # no wait for a turn: early ones are staged as copies at once
                h = header(key, c, expected, pb.FLOAT32)
                store.contribute(
                    h, memoryview(values[c]).cast("B"), 5.0, turn_until=time.monotonic()
                )
            payloads = [
                bytes(store.read(pb.ReadSlotRequest(key=key, offset=0, reader=r), 5.0)[1])
                for r in range(expected)
            ]
        assert all(p == want for p in payloads), order
        assert divisions.divisors.count(expected) == 1, (order, divisions.divisors)
        assert divisions.divisors.count(0) == expected - 2, (order, divisions.divisors)
        assert store.usage() == (0, 0)
