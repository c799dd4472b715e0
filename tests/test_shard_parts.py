"""``Parts``: a replica kept and sent as it was made or received, never joined on the way
(server/snapshots/shards.py). Reads must equal the joined bytes' at every offset."""

from __future__ import annotations

import random

import numpy as np
import pytest

from paramshard.server.snapshots.shards import Captured, Parts, decode_shard, encode_shard


def test_reads_equal_the_joined_bytes() -> None:
    parts = [b"head", np.arange(7, dtype=np.uint8), b"", np.arange(3, dtype=np.float32), b"z"]
    blob = Parts(parts)
    joined = b"".join(memoryview(p).cast("B") for p in parts)
    assert len(blob) == len(joined) and blob.joined() == joined
    rng = random.Random(0)
    for _ in range(2000):
        start, stop = rng.randint(0, len(joined) + 3), rng.randint(0, len(joined) + 3)
        assert bytes(blob.view(start, stop)) == joined[start:stop], (start, stop)
        assert blob[start:stop] == joined[start:stop]
        assert blob[-stop:] == joined[-stop:]
    with pytest.raises(TypeError):
        blob[3]  # noqa: B018 - indexing is refused: a replica is read by ranges


def test_a_read_inside_one_part_is_a_view_of_it() -> None:
    array = np.arange(1000, dtype=np.float32)
    blob = Parts([b"12345678", array])
    inside = blob.view(8 + 40, 8 + 400)
    assert isinstance(inside, memoryview)
    array[10] = -1.0  # the view is of the array itself: no copy was made
    assert np.frombuffer(inside, np.float32)[0] == -1.0
    assert isinstance(blob.view(4, 12), bytes)  # across two parts: joined


def test_a_replica_decodes_alike_joined_or_not() -> None:
    captured = [Captured("w", 0, np.linspace(0, 1, 11), {"exp_avg": np.ones(11)}, 3)]
    data = encode_shard("j", "replica", 0, 2, 5, captured, {"w": b"spec"})
    chunks = [data[i : i + 7] for i in range(0, len(data), 7)]  # as chunks arrive
    meta, tensors = decode_shard(Parts(chunks))
    assert meta["version"] == 5 and meta["buffers"]["w"]["step_count"] == 3
    np.testing.assert_array_equal(tensors["w::params"], captured[0].params)
    np.testing.assert_array_equal(tensors["w::state.exp_avg"], np.ones(11))
