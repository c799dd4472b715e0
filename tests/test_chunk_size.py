"""The default chunk (client/chunk_size.py): a budget divided among the servers of one host,
so that a client's shared segments with its host's servers, and a server's segments from the
trainers of its host, stay near the same size however many share the host; between hosts,
where nothing is mapped, messages stay large."""

from __future__ import annotations

import numpy as np
from conftest import run_ranks

from paramshard.client import ClusterSpec, ShardClient
from paramshard.client.chunk_size import CHUNK_BUDGET_BYTES, default_chunk_bytes
from paramshard.protos.shm import IN_FLIGHT_PER_SERVER

MiB = 2**20


def test_the_default_chunk_divides_a_budget_among_a_hosts_servers() -> None:
    want = {1: 16, 2: 8, 3: 4, 4: 4, 5: 2, 7: 2, 8: 2, 9: 1, 16: 1, 64: 1}
    assert {n: default_chunk_bytes(n) // MiB for n in want} == want


def test_servers_per_host_counts_the_fullest_host_of_the_addresses() -> None:
    assert ClusterSpec(["gpu-a:1", "gpu-a:2", "gpu-b:1"]).servers_per_host == 2
    assert ClusterSpec(["10.0.0.1:7", "10.0.0.2:7", "10.0.0.3:7"]).servers_per_host == 1
    loopback = ["localhost:1", "127.0.0.1:2", "[::1]:3", "127.0.1.1:4", "GPU-A:5", "gpu-a:6"]
    assert ClusterSpec(loopback).servers_per_host == 4  # one loopback host; names fold case


def test_ranks_of_eight_servers_on_one_host_send_and_map_two_mib_chunks(servers) -> None:
    eight = servers(8, local_calls=False)  # through gRPC, so payloads take shared segments
    n = 5 * MiB  # 20 MiB of float32: 2.5 MiB a server, two messages each way
    mapped_bound = IN_FLIGHT_PER_SERVER + 1  # segments a server's pool grows to (protos/shm.py)

    def rank(c: ShardClient) -> tuple[float, float, int, int]:
        group = c.on_servers([0, 1])
        assert c.chunk_bytes == group.chunk_bytes == 2 * MiB  # a view keeps its client's chunk
        out = c.all_reduce(np.full(n, c.rank + 1, dtype=np.float32))
        return float(out.min()), float(out.max()), c.shm.segment_bytes, c.shm.opened

    results = run_ranks(rank, 2, [s.address for s in eight])
    for low, high, segment, opened in results:
        assert low == high == 3.0
        assert segment == 2 * MiB + 4096  # a segment holds one message and its header room
        assert 0 < opened <= 8 * mapped_bound
        assert opened * segment <= mapped_bound * (CHUNK_BUDGET_BYTES + 8 * 4096)


def test_servers_on_other_hosts_get_large_messages_and_a_given_chunk_wins() -> None:
    spec = ClusterSpec(["10.0.0.1:50051", "10.0.0.2:50051"])  # never dialled: no call is made
    default, given = ShardClient(spec), ShardClient(spec, chunk_bytes=MiB)
    try:
        assert (default.chunk_bytes, given.chunk_bytes) == (16 * MiB, MiB)
        assert given.shm.segment_bytes == MiB + 4096
    finally:
        default.close()
        given.close()
