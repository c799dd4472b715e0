"""Jobs that live on some servers only: how the tools find them, and what the servers refuse.

A job's placement is which server holds which of its slices (``JobStatus.server_index`` /
``num_servers``); a 3D job's parts are placed on their data-parallel groups' servers. The
tools ask every server (``client.jobs.server_jobs``); a placement that is ambiguous or
incomplete is an error naming the servers, never a silent pick.
"""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np
import pytest

from paramshard.client import ClusterSpec, ParamInfo, ShardClient, ShardClientError, tools
from paramshard.protos import shard_pb2 as pb


def client_for(addresses: list[str], **kw) -> ShardClient:
    kw.setdefault("timeout_s", 5.0)
    return ShardClient(ClusterSpec(list(addresses)), **kw)


def register(view: ShardClient, job: str, values: np.ndarray) -> None:
    """One buffer "b" holding one parameter "w" of ``values``, on ``view``'s servers."""
    params = [ParamInfo("w", (values.size,), 0)]
    view.register_buffer(job, "b", values.size, params=params, optimizer="sgd", hyper={"lr": 0.1})
    view.set_params(job, "b", values, version=1)


def test_tools_find_a_job_on_some_servers(servers):
    """Registered on servers 2 and 0 (in that order) of three: get, inspect and export read
    slice 0 from server 2 and slice 1 from server 0."""
    addresses = [s.address for s in servers(3)]
    c = client_for(addresses)
    try:
        values = np.arange(10, dtype=np.float32)
        register(c.on_servers([2, 0]), "j", values)
        np.testing.assert_array_equal(tools.get_param(c, "j", "w").reshape(-1), values)
        status = [c.call(i, "Status", pb.StatusRequest()) for i in range(3)]
        held = {
            i: [(j.job, j.server_index, j.num_servers) for j in s.jobs]
            for i, s in enumerate(status)
        }
        assert held == {0: [("j", 1, 2)], 1: [], 2: [("j", 0, 2)]}
    finally:
        c.close()


def test_a_job_registered_on_two_sets_of_servers_is_an_error(servers):
    """The same job name on servers [0, 1] and again on [2, 1] (server 1 takes the second
    as the same registration): slice 0 is then on servers 0 and 2, and the tools say so
    instead of reading either."""
    addresses = [s.address for s in servers(3)]
    c = client_for(addresses)
    try:
        register(c.on_servers([0, 1]), "twice", np.zeros(4, np.float32))
        register(c.on_servers([2, 1]), "twice", np.ones(4, np.float32))
        with pytest.raises(RuntimeError, match=r"slice 0 is on servers 0, 2"):
            tools.get_param(c, "twice", "w")
        with pytest.raises(RuntimeError, match=r"slice 0 is on servers 0, 2"):
            tools.snapshot(c, "twice", "t")
    finally:
        c.close()


def test_an_unreachable_server_matters_only_to_its_jobs(servers):
    """Server 2 stops: a job on servers 0 and 1 is still read; one with a slice on server 2
    is an error that names the server that did not answer."""
    nodes = servers(3)
    c = client_for([s.address for s in nodes], retries=1, timeout_s=3.0)
    try:
        register(c.on_servers([0, 1]), "here", np.arange(6, dtype=np.float32))
        register(c.on_servers([1, 2]), "there", np.arange(6, dtype=np.float32))
        nodes[2].stop(0)
        np.testing.assert_array_equal(
            tools.get_param(c, "here", "w").reshape(-1), np.arange(6, dtype=np.float32)
        )
        with pytest.raises(RuntimeError, match=r"slice 0 on server 1; server 2 did not answer"):
            tools.get_param(c, "there", "w")
    finally:
        c.close()


def test_snapshot_names_the_slice_the_server_holds(servers, tmp_path):
    """A Snapshot request must name the slice the server holds: written under another
    slice's file name, a restore would put the values in the wrong place."""
    nodes = servers(2, snapshot_dir=str(tmp_path))
    c = client_for([n.address for n in nodes])
    try:
        register(c, "j", np.arange(4, dtype=np.float32))
        req = pb.SnapshotRequest(job="j", tag="swapped", version=1, server_index=1, num_servers=2)
        with pytest.raises(ShardClientError) as info:
            c.call(0, "Snapshot", req)
        err = info.value
        assert err.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "holds slice 0 of 2" in err.details and "shard 1 of 2" in err.details
        assert not (tmp_path / "j" / "swapped").exists() or not any(
            (tmp_path / "j" / "swapped").iterdir()
        )
    finally:
        c.close()


def test_concurrent_registrations_agree_on_one_placement(servers, monkeypatch):
    """Buffers of one new job registered at once with different placements: exactly the
    calls with the first placement to land succeed, the others are refused, and the job has
    one placement on the server. Allocating a slice is slowed down (the server runs in this
    process), so every call is past the first check before any inserts its buffer."""
    from paramshard.server.buffers import store

    made = store.BufferSlice.__init__

    def slow(self, *a, **kw):
        time.sleep(0.05)
        made(self, *a, **kw)

    monkeypatch.setattr(store.BufferSlice, "__init__", slow)
    (node,) = servers(1)
    c = client_for([node.address])
    try:
        for round_ in range(3):
            job = f"race{round_}"
            outcomes: list[tuple[int, str]] = []
            start = threading.Barrier(6)

            def attempt(k: int, job: str = job, outcomes: list = outcomes, start=start) -> None:
                req = pb.RegisterBufferRequest(
                    ref=pb.BufferRef(job=job, buffer=f"b{k}"),
                    numel=8,
                    num_servers=2 + k % 2,  # two placements: slice 0 of 2, slice 0 of 3
                    server_index=0,
                    contributors=1,
                    optimizer=pb.OptimizerSpec(name="sgd"),
                )
                start.wait()
                try:
                    c.call(0, "RegisterBuffer", req)
                    outcomes.append((k, "ok"))
                except ShardClientError as exc:
                    assert exc.code == grpc.StatusCode.FAILED_PRECONDITION, exc
                    outcomes.append((k, "refused"))

            threads = [threading.Thread(target=attempt, args=(k,)) for k in range(6)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(10)
            (status,) = [j for j in c.call(0, "Status", pb.StatusRequest()).jobs if j.job == job]
            ok = {k for k, what in outcomes if what == "ok"}
            assert len(outcomes) == 6 and ok
            assert {2 + k % 2 for k in ok} == {status.num_servers}  # one placement won
            assert sorted(b.buffer for b in status.buffers) == sorted(f"b{k}" for k in ok)
    finally:
        c.close()
