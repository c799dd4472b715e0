"""Collectives through the shard servers' reduction slots: what tests/test_collectives.py's
NumPy references do not show. Half-precision sums accumulate in fp32 and round once; many
chunks per server; a barrier waits for every rank; ranks in separate processes; no slot
memory is left behind; two worlds on the same servers; refusals fail fast and say why.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch
from conftest import collective_worker, unique_id

from paramshard.client import ShardClient, ShardClientError
from paramshard.protos.slicing import slice_bounds


def test_half_precision_sums_accumulate_in_fp32_and_round_once(
    transport_servers, run_ranks
) -> None:
    # fp16: 2048 + 1 + 1 == 2048 when accumulated in fp16 (each +1 is a tie to even), 2050 in fp32
    values = [2048.0, 1.0, 1.0]
    out = run_ranks(
        lambda c: c.all_reduce(np.array([values[c.rank]], dtype=np.float16)),
        3,
        transport_servers[:3],
    )
    assert all(o.dtype == np.float16 and o[0] == 2050.0 for o in out)
    # bf16: 256 + 1 + 1 == 256 in bf16 arithmetic, 258 in fp32 then rounded once
    bf_values = [256.0, 1.0, 1.0]
    bf = run_ranks(
        lambda c: c.all_reduce(torch.tensor([bf_values[c.rank]], dtype=torch.bfloat16)),
        3,
        transport_servers[:3],
    )
    assert all(o.dtype == torch.bfloat16 and o.item() == 258.0 for o in bf)
    # bf16 mean rounds the fp32 quotient once: (1 + 2^-7 + 0) / 3 in fp32, then to bf16
    parts = [1.0, 2.0**-7, 0.0]
    mean = run_ranks(
        lambda c: c.all_reduce(torch.tensor([parts[c.rank]], dtype=torch.bfloat16), op="mean"),
        3,
        transport_servers[:3],
    )
    want = torch.tensor([np.float32(1.0 + 2.0**-7) / np.float32(3)]).to(torch.bfloat16)
    assert all(torch.equal(m, want) for m in mean)


def test_large_tensor_many_chunks(transport_servers, run_ranks) -> None:
    """A tensor far bigger than chunk_bytes: many chunks per server, few in flight."""
    world, n = 3, 10_007  # 40 KB of float32 over 4 KiB chunks

    def values(rank: int) -> np.ndarray:
        return (np.arange(n, dtype=np.float32) % 1000 - 500) * (rank + 1)

    def work(c: ShardClient) -> dict[str, Any]:
        x = values(c.rank)
        return {
            "sum": c.all_reduce(x),
            "bf16": c.all_reduce(torch.from_numpy(x).to(torch.bfloat16), op="max"),
            "rs": c.reduce_scatter(x),
            "ag": c.all_gather(x),
            "bc": c.broadcast(x, src=1),
            "p2p": (c.send(x, (c.rank + 1) % world), c.recv((c.rank - 1) % world))[1],
        }

    results = run_ranks(work, world, transport_servers[:3], chunk_bytes=4096, max_in_flight=2)
    total = sum(values(r) for r in range(world))
    top = torch.from_numpy(np.maximum.reduce([values(r) for r in range(world)])).to(torch.bfloat16)
    for rank, out in enumerate(results):
        np.testing.assert_array_equal(out["sum"], total)
        assert torch.equal(out["bf16"], top)
        a, b = slice_bounds(n, world, rank)
        np.testing.assert_array_equal(out["rs"], total[a:b])
        for j in range(world):
            np.testing.assert_array_equal(out["ag"][j], values(j))
        np.testing.assert_array_equal(out["bc"], values(1))
        np.testing.assert_array_equal(out["p2p"], values((rank - 1) % world))


def test_barrier_waits_for_every_rank(transport_servers, run_ranks) -> None:
    entered: dict[int, float] = {}

    def work(c: ShardClient) -> float:
        if c.rank == 2:
            time.sleep(0.3)
        entered[c.rank] = time.monotonic()
        c.barrier()
        return time.monotonic()

    left = run_ranks(work, 3, transport_servers[:3])
    assert min(left) >= entered[2]


def test_separate_processes(servers) -> None:
    """Three ranks in three spawned processes, each building its own client."""
    world = 3
    addresses = [s.address for s in servers(world)]
    run_id = unique_id("mp")
    ctx = multiprocessing.get_context("spawn")
    with cf.ProcessPoolExecutor(world, mp_context=ctx) as pool:
        futures = [
            pool.submit(collective_worker, addresses, r, world, run_id) for r in range(world)
        ]
        results = [f.result(timeout=120) for f in futures]
    assert len({r["pid"] for r in results} | {os.getpid()}) == world + 1
    xs = [np.arange(1001, dtype=np.float32) * (r + 1) for r in range(world)]
    for rank, out in enumerate(results):
        np.testing.assert_array_equal(out["all_reduce"], sum(xs))
        np.testing.assert_array_equal(out["max"], xs[-1])
        for j in range(world):
            np.testing.assert_array_equal(out["all_gather"][j], np.full(j + 2, j, np.int64))
        np.testing.assert_array_equal(out["broadcast"], xs[world - 1])
        a, b = slice_bounds(1001, world, rank)
        np.testing.assert_array_equal(out["reduce_scatter"], sum(xs)[a:b])
        np.testing.assert_array_equal(out["recv"], xs[(rank - 1) % world] + 0.5)


def test_servers_hold_no_slot_memory_afterwards(servers, run_ranks, transport) -> None:
    world = 3
    servers_started = servers(world)
    addresses = [s.address for s in servers_started]

    def work(c: ShardClient) -> None:
        for n in (0, 1, 1001, 5000):
            x = np.ones(n, dtype=np.float32)
            c.all_reduce(x)
            c.all_reduce(torch.from_numpy(x).to(torch.bfloat16), op="mean")
            c.reduce_scatter(x)
            c.all_gather(x[: n // 2])
            c.broadcast(x, src=n % world)
            c.send(x, (c.rank + 1) % world)
            c.recv((c.rank - 1) % world)
        c.barrier()

    run_ranks(work, world, addresses, chunk_bytes=4096)
    statuses = run_ranks(lambda c: c.status(), 1, addresses)[0]
    for st_ in statuses:
        assert "error" not in st_
        assert int(st_["open_slots"]) == 0, st_
        assert int(st_["slot_bytes"]) == 0, st_
    for s in servers_started:  # the clients closed: every segment was given back
        assert s.servicer.segments.usage() == (0, 0)


def test_two_worlds_on_the_same_servers_do_not_mix(transport_servers, run_ranks) -> None:
    results: dict[str, list[Any]] = {}

    def world_run(name: str, scale: float) -> None:
        results[name] = run_ranks(
            lambda c: c.all_reduce(np.full(100, scale * (c.rank + 1), np.float32)),
            2,
            transport_servers[:2],
        )

    threads = [threading.Thread(target=world_run, args=(n, s)) for n, s in (("a", 1), ("b", 10))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(np.all(o == 3.0) for o in results["a"])
    assert all(np.all(o == 30.0) for o in results["b"])


def test_mean_of_integers_is_rejected_at_once(transport_servers, run_ranks) -> None:
    """A rejected collective fails as it is sent, not after the client's timeout."""
    began = time.monotonic()
    with pytest.raises(ShardClientError) as info:
        run_ranks(
            lambda c: c.all_reduce(np.arange(5, dtype=np.int64), op="mean"),
            1,
            transport_servers[:1],
            timeout_s=4,
        )
    assert info.value.code.name == "INVALID_ARGUMENT"
    assert "MEAN" in info.value.details
    assert time.monotonic() - began < 2.0


def test_send_to_self(transport_servers, run_ranks) -> None:
    def work(c: ShardClient) -> list[np.ndarray]:
        c.send(np.arange(3, dtype=np.float32), c.rank)
        c.send(np.arange(4, dtype=np.float32), c.rank)
        return [c.recv(c.rank), c.recv(c.rank)]

    (got,) = run_ranks(work, 1, transport_servers[:1], timeout_s=2)
    np.testing.assert_array_equal(got[0], np.arange(3, dtype=np.float32))
    np.testing.assert_array_equal(got[1], np.arange(4, dtype=np.float32))


def test_argument_errors_are_raised_before_any_call(transport_servers) -> None:
    from paramshard.client import ClusterSpec

    c = ShardClient(
        ClusterSpec(transport_servers[:2]), rank=0, world_size=2, run_id=unique_id(), timeout_s=2
    )
    try:
        with pytest.raises(ValueError, match="op must be one of"):
            c.all_reduce(np.ones(3, np.float32), op="prod")
        with pytest.raises(ValueError, match="src=2"):
            c.broadcast(np.ones(3, np.float32), src=2)
        with pytest.raises(ValueError, match="dst=-1"):
            c.send(np.ones(3, np.float32), dst=-1)
        with pytest.raises(TypeError, match="unsupported"):
            c.all_reduce(np.ones(3, dtype=np.complex64))
        with pytest.raises(ValueError, match="outside a world"):
            ShardClient(ClusterSpec(transport_servers[:1]), rank=2, world_size=2)
    finally:
        c.close()
