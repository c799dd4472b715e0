"""The 3D rank grid: layout [pipeline][tensor][data] as AiDotNet's, groups, neighbours, errors."""

from __future__ import annotations

import itertools
import threading

import pytest
import torch

from paramshard.client import ClusterSpec, ShardClient
from paramshard.strategies.topology import GroupClients, Topology

SHAPES = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2), (2, 3, 4), (3, 1, 2)]


def test_layout_matches_the_seeds_512_gpu_example():
    # HybridShardedModel: 8 x 8 x 8; stage 0 is GPUs 0-63, tensor group 0 GPUs 0-7 (data
    # replicas), tensor group 1 GPUs 8-15, stage 1 starts at GPU 64.
    topo = Topology(512, 8, 8, 8)
    assert [r for r in range(512) if topo.coords(r)[0] == 0] == list(range(64))
    assert topo.data_group(0) == list(range(8))
    assert topo.data_group(8) == list(range(8, 16))
    assert topo.coords(64) == (1, 0, 0)
    assert topo.tensor_group(0) == list(range(0, 64, 8))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_coords_and_rank_of_are_inverse_and_follow_the_formula(shape):
    pp_size, tp_size, dp_size = shape
    topo = Topology(pp_size * tp_size * dp_size, *shape)
    seen = []
    for pp, tp, dp in itertools.product(range(pp_size), range(tp_size), range(dp_size)):
        rank = topo.rank_of(pp, tp, dp)
        assert rank == (pp * tp_size + tp) * dp_size + dp
        assert topo.coords(rank) == (pp, tp, dp)
        seen.append(rank)
    assert sorted(seen) == list(range(topo.world_size))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_groups_partition_the_world_along_one_axis(shape):
    topo = Topology(shape[0] * shape[1] * shape[2], *shape)
    for group_of, axis, size in (
        (topo.pipeline_group, 0, topo.pipeline_parallel_size),
        (topo.tensor_group, 1, topo.tensor_parallel_size),
        (topo.data_group, 2, topo.data_parallel_size),
    ):
        groups = {tuple(group_of(r)) for r in range(topo.world_size)}
        assert sorted(r for g in groups for r in g) == list(range(topo.world_size))
        for rank in range(topo.world_size):
            group = group_of(rank)
            assert len(group) == size and rank in group
            # members differ only along `axis`, listed in that axis's order
            coords = [topo.coords(r) for r in group]
            assert [c[axis] for c in coords] == list(range(size))
            others = {tuple(v for i, v in enumerate(c) if i != axis) for c in coords}
            assert len(others) == 1


def test_pipeline_neighbours_and_stage_ends():
    topo = Topology(8, 2, 2, 2)
    # PP(0)-TP(1)-DP(1) is rank 3; its next stage is PP(1)-TP(1)-DP(1), rank 7
    assert topo.next_stage_rank(3) == 7 and topo.prev_stage_rank(7) == 3
    assert topo.next_stage_rank(7) is None and topo.prev_stage_rank(3) is None
    assert [topo.is_first_stage(r) for r in range(8)] == [True] * 4 + [False] * 4
    assert [topo.is_last_stage(r) for r in range(8)] == [False] * 4 + [True] * 4
    three = Topology(3, 3, 1, 1)
    assert [three.next_stage_rank(r) for r in range(3)] == [1, 2, None]
    assert [three.prev_stage_rank(r) for r in range(3)] == [None, 0, 1]
    assert three.is_first_stage(0) and not three.is_last_stage(0)
    one = Topology(1, 1, 1, 1)
    assert one.is_first_stage(0) and one.is_last_stage(0)


def test_describe_and_repr():
    topo = Topology(8, 2, 2, 2)
    assert topo.describe(5) == "PP(1)-TP(0)-DP(1)-Rank(5)"
    assert topo.describe(0) == "PP(0)-TP(0)-DP(0)-Rank(0)"
    assert repr(topo) == (
        "Topology(world_size=8, pipeline_parallel_size=2, tensor_parallel_size=2, "
        "data_parallel_size=2)"
    )
    assert topo == Topology(8, 2, 2) and topo != Topology(8, 1, 2)


def test_minus_one_is_the_rest_of_the_world():
    assert Topology(12, 2, 3).data_parallel_size == 2
    assert Topology(12, 2, 3, -1).data_parallel_size == 2
    assert Topology(12, -1, 3, 2).pipeline_parallel_size == 2
    assert Topology(12, 2, -1, 3).tensor_parallel_size == 2
    assert Topology(4).data_parallel_size == 4


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((8, 2, 2, 3), r"pipeline_parallel_size \(2\) x tensor_parallel_size \(2\) x "
         r"data_parallel_size \(3\) = 12, but world_size is 8"),
        ((8, 4, 4, 1), r"\(4\) x .*\(4\) x .*\(1\) = 16, but world_size is 8"),
        ((8, 3, 1, -1), r"pipeline_parallel_size=3, tensor_parallel_size=1, "
         r"data_parallel_size=-1 cannot fill world_size 8"),
        ((8, -1, -1, 2), r"only one size may be -1"),
        ((8, 0, 2, 4), r"pipeline_parallel_size must be a positive size or -1, got 0"),
        ((8, 2, -3, 4), r"tensor_parallel_size must be a positive size or -1, got -3"),
        ((0, 1, 1, 1), r"world_size must be >= 1"),
    ],
)  # fmt: skip
def test_bad_sizes_name_the_numbers(args, message):
    with pytest.raises(ValueError, match=message):
        Topology(*args)


def test_out_of_range_ranks_and_coordinates():
    topo = Topology(8, 2, 2, 2)
    with pytest.raises(ValueError, match=r"rank 8 is outside 0..7"):
        topo.coords(8)
    with pytest.raises(ValueError, match=r"rank -1 is outside"):
        topo.tensor_group(-1)
    with pytest.raises(ValueError, match=r"tp=2 is outside 0..1"):
        topo.rank_of(0, 2, 0)
    with pytest.raises(ValueError, match=r"dp=-1 is outside"):
        topo.rank_of(0, 0, -1)


def test_group_clients_rejects_a_client_of_another_world():
    client = ShardClient(ClusterSpec(["127.0.0.1:1"]), rank=0, world_size=4)
    try:
        with pytest.raises(ValueError, match=r"client has world_size 4, the topology 8"):
            Topology(8, 2, 2, 2).group_clients(client)
    finally:
        client.close()


def test_group_clients_run_collectives_in_each_group(servers, run_ranks):
    """2 x 2 x 2 on real servers: each group's all-reduce sums exactly its members' ranks."""
    topo = Topology(8, 2, 2, 2)
    addresses = [s.address for s in servers(2)]

    def rank_fn(client):
        groups = topo.group_clients(client)
        assert isinstance(groups, GroupClients)
        me = torch.tensor([float(client.rank)])
        out = {}
        # a different order per axis on purpose: groups number their collectives separately
        for axis in ("dp", "tp", "pp"):
            group = getattr(groups, axis)
            out[axis] = (
                group.rank,
                group.world_size,
                group.global_ranks,
                float(group.all_reduce(me, "sum")),
            )
        out["tp2"] = float(groups.tp.all_reduce(me * 10, "sum"))
        return out

    results = run_ranks(rank_fn, 8, addresses)
    for rank, out in enumerate(results):
        pp, tp, dp = topo.coords(rank)
        for axis, group, index in (
            ("tp", topo.tensor_group(rank), tp),
            ("pp", topo.pipeline_group(rank), pp),
            ("dp", topo.data_group(rank), dp),
        ):
            assert out[axis] == (index, 2, group, float(sum(group)))
        assert out["tp2"] == 10.0 * sum(topo.tensor_group(rank))


def _open_slots(addresses: list[str]) -> list[int]:
    from paramshard.protos import shard_pb2 as pb

    c = ShardClient(ClusterSpec(addresses))
    try:
        return [c.call(i, "Status", pb.StatusRequest()).open_slots for i in range(len(addresses))]
    finally:
        c.close()


def test_groups_use_their_members_own_servers(servers, run_ranks):
    """A group's client has its members' servers only: a pipeline send waits in the
    receiver's own server's mailbox (docs/design.md §1), and a buffer registered through a
    data-parallel group is sharded over that group's servers, slice k on member k's."""
    from paramshard.protos import shard_pb2 as pb

    topo = Topology(4, 2, 1, 2)  # pipeline groups [0, 2] and [1, 3]; data groups [0, 1], [2, 3]
    addresses = [s.address for s in servers(4)]
    sent = threading.Event()

    def rank_fn(client):
        groups = topo.group_clients(client)
        assert groups.pp.spec.addresses == [addresses[r] for r in topo.pipeline_group(client.rank)]
        assert groups.pp.servers == topo.pipeline_group(client.rank)
        got = None
        if client.rank == 1:  # stage 0 of pipeline [1, 3] sends to stage 1 (rank 3)
            groups.pp.send(torch.arange(5.0), 1, "act")
            sent.set()
        if client.rank == 3:
            assert sent.wait(20)
            slots = _open_slots(addresses)
            got = groups.pp.recv(0, torch.empty(0), "act")
        groups.dp.register_buffer(f"j{groups.dp.servers[0]}", "b", 10, optimizer="sgd")
        return got, slots if client.rank == 3 else None

    results = run_ranks(rank_fn, 4, addresses)
    got, slots = results[3]
    assert torch.equal(got, torch.arange(5.0))
    assert slots == [0, 0, 0, 1]  # the mailbox of rank 3, on server 3 only
    c = ShardClient(ClusterSpec(addresses))
    try:
        for i in range(4):
            (job,) = c.call(i, "Status", pb.StatusRequest()).jobs
            # data group [0, 1] on servers 0 and 1, [2, 3] on 2 and 3
            assert (job.job, job.server_index, job.num_servers) == (f"j{i - i % 2}", i % 2, 2)
    finally:
        c.close()


def test_a_group_on_fewer_servers_shares_them(servers, run_ranks):
    """With fewer servers than ranks (rank r's server is r mod N), members sharing a server
    make a group of fewer servers, and collectives still sum exactly the members."""
    topo = Topology(4, 1, 2, 2)  # tensor groups [0, 2] and [1, 3]: each on one server of two
    addresses = [s.address for s in servers(2)]

    def rank_fn(client):
        groups = topo.group_clients(client)
        total = groups.tp.all_reduce(torch.tensor([float(client.rank)]))
        return groups.tp.spec.addresses, float(total)

    for rank, (group_servers, total) in enumerate(run_ranks(rank_fn, 4, addresses)):
        assert group_servers == [addresses[rank % 2]]
        assert total == float(sum(topo.tensor_group(rank)))


def test_ring_neighbours_wrap_around():
    from paramshard.strategies.topology import ring_neighbours

    assert ring_neighbours(0, 3) == (2, 1) and ring_neighbours(2, 3) == (1, 0)
    assert ring_neighbours(0, 1) == (0, 0)
    with pytest.raises(ValueError, match="outside the ring 0..1"):
        ring_neighbours(2, 2)
