"""``all_reduce(x, in_place=True)``: the sum lands in ``x``'s own memory, equal to the sum an
ordinary all-reduce returns, on every path payloads take (``transport``), with tensors of
several chunks on several servers (so the reads of early chunks overwrite ``x`` while later
chunks are still being contributed), and with NumPy arrays and CPU tensors alike."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import run_ranks

CHUNK_BYTES = 4096  # 1,024 float32 elements a message: the tensors below are many chunks
N = 10_001


def values(rank: int) -> np.ndarray:
    rng = np.random.default_rng(rank)
    return (rng.integers(-2000, 2001, N) * 0.25).astype(np.float32)  # sums are exact


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("world", [2, 3])
def test_in_place_all_reduce(transport: str, transport_servers, kind: str, world: int) -> None:
    want = sum(values(r) for r in range(world)) / world

    def rank(client):
        x = values(client.rank)
        x = torch.from_numpy(x) if kind == "torch" else x
        out = client.all_reduce(x, "mean", in_place=True)
        copied = client.all_reduce(values(client.rank), "mean")  # a second buffer
        return x, out, copied

    for x, out, copied in run_ranks(
        rank, world, transport_servers[:world], chunk_bytes=CHUNK_BYTES
    ):
        held = x.numpy() if kind == "torch" else x
        np.testing.assert_array_equal(held, want)  # x itself holds the mean
        np.testing.assert_array_equal(np.asarray(out), want)
        np.testing.assert_array_equal(copied, want)
        assert np.shares_memory(np.asarray(out), held)
