"""Neighbour replicas through shared memory (server/replication/neighbour_shm.py).

Two real servers on 127.0.0.1 with tokens: server 0 sends its replicas to server 1 with the
peer token, through a segment server 1 offers it, since both share this host's memory. The
replica server 1 keeps is byte for byte the one server 0 encoded, on this path and in-band
(``PARAMSHARD_SHM=0``); a neighbour that forgot the segments (as after a restart) still gets
every replica. The peer token may ask for segments, and nothing else it could not before.
"""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest
from test_hardening_replication import TOKENS, client_for, refused

from paramshard.client import StepArgs, tools
from paramshard.protos import shard_pb2 as pb
from paramshard.protos.shm import SHM_MIN_BYTES
from paramshard.server.rpc import auth

pytestmark = pytest.mark.timeout(120)
N = 100_000  # Adam: params + two moments of half of it, a 600 kB replica: one chunk


def replicas_of_two_steps(servers) -> tuple[dict[int, bytes], dict[int, bytes], int]:
    """Server 0's own replicas, the ones server 1 holds for it, and server 1's segment views."""
    nodes = servers(2, tokens=TOKENS)
    admin = client_for([s.address for s in nodes])
    try:
        admin.register_buffer("j", "w", N, optimizer="adam", hyper={"lr": 0.1})
        admin.set_params("j", "w", np.arange(N, dtype=np.float32))
        tools.configure_replication(admin, "j", 1)
        for s in range(2):
            admin.push_grads("j", "w", np.full(N, s + 1.0, np.float32), step=s)
            admin.step("j", s, {"w": StepArgs({"lr": 0.1})})
            if s == 0:  # as a restart would: server 1 forgets every segment it offered
                wait_held(nodes[1], {0, 1})
                nodes[1].servicer.segments.idle_s = 0.0
                nodes[1].servicer.segments.expire()
                nodes[1].servicer.segments.idle_s = 600.0
        wait_held(nodes[1], {1, 2})
        own = {v: b.joined() for v, b in nodes[0].servicer.replicator.own["j"].items()}
        held = {v: b.joined() for v, b in nodes[1].servicer.replicator.held[("j", 0)].items()}
        return own, held, nodes[1].servicer.segments.views
    finally:
        admin.close()


def wait_held(node, versions: set[int]) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if {r.version for r in node.servicer.replicator.list("j") if not r.own} == versions:
            return
        time.sleep(0.05)
    raise AssertionError(f"server 1 never held versions {versions} of server 0's replica")


def test_replicas_through_segments_equal_the_in_band_ones(servers, monkeypatch) -> None:
    monkeypatch.delenv("PARAMSHARD_SHM", raising=False)
    own, held, views = replicas_of_two_steps(servers)
    assert views >= 2  # both versions went through segments, before and after the forgetting
    assert held == own and len(own[2]) > SHM_MIN_BYTES  # a payload that takes a segment
    monkeypatch.setenv("PARAMSHARD_SHM", "0")
    own_in_band, held_in_band, views = replicas_of_two_steps(servers)
    assert views == 0 and held_in_band == own_in_band
    assert held_in_band[2] == held[2]  # the same replica, whichever way it travelled


def test_the_peer_token_may_ask_for_segments_only() -> None:
    for method in auth.PEER_SEGMENTS:
        assert auth.METHOD_ROLES[method] == "read"
        assert auth.role_allows("peer", "read", method)
    for method, need in auth.METHOD_ROLES.items():
        if method not in auth.PEER_SEGMENTS and need != "peer":
            assert not auth.role_allows("peer", need, method), method
    assert not auth.role_allows("peer", "read")  # no method: the ladder alone


def test_a_replica_chunk_naming_a_segment_it_does_not_own_is_refused(servers) -> None:
    nodes = servers(2, tokens=TOKENS)
    admin = client_for([s.address for s in nodes])
    try:
        admin.register_buffer("j", "w", N, optimizer="adam", hyper={"lr": 0.1})
        # a segment the *admin* token holds on server 1: the peer token may not name it
        admin.set_params("j", "w", np.arange(N, dtype=np.float32))
        owned = next(iter(nodes[1].servicer.segments._segments))  # noqa: SLF001
        chunk = pb.ReplicaChunk(job="j", source_index=0, version=1, offset=0, total=64)
        for ref, code in (
            (pb.ShmRef(segment=owned, offset=0, nbytes=64), grpc.StatusCode.FAILED_PRECONDITION),
            (pb.ShmRef(segment=2**40, offset=0, nbytes=64), grpc.StatusCode.FAILED_PRECONDITION),
        ):
            chunk.shm.CopyFrom(ref)
            assert refused(nodes[1].address, chunk).code() == code
        chunk.data = b"x" * 64  # in-band and in a segment at once
        assert refused(nodes[1].address, chunk).code() == grpc.StatusCode.INVALID_ARGUMENT
        assert nodes[1].servicer.replicator.list("j") == []  # nothing was stored
    finally:
        admin.close()
