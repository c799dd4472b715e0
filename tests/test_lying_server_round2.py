"""A server that lies, round two: epochs, lease streams and replica recovery.

tests/test_lying_server_training.py drove the training side against a lying server; these go on
where it stopped. Each test failed on the code it was written against (b4658a6 and after).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

import grpc
import pytest
from lying_servers import lying_server

from paramshard.client import ClusterSpec, ShardClient
from paramshard.client.membership import Membership
from paramshard.client.replicas import recover_from_replicas
from paramshard.client.rpc import ShardClientError
from paramshard.protos import shard_pb2 as pb

TOP = 2**32 - 1
"""The highest epoch a LeaseRequest, a JoinRequest or a notice can carry (uint32)."""


def _client(address: str, run: str, *, servers: int = 1, world: int = 2) -> ShardClient:
    return ShardClient(
        ClusterSpec([address] * servers), rank=0, world_size=world, run_id=run,
        timeout_s=3, retries=1, shared_memory=False, sessions=False,
    )  # fmt: skip


def _wait(until: Any, seconds: float) -> Any:
    deadline = time.monotonic() + seconds
    while not (got := until()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return got


# -- epochs at the top of uint32 ---------------------------------------------------------------


@pytest.mark.parametrize("source", ["lease_notice", "join_reply"])
def test_epoch_at_uint32_top_does_not_end_the_ranks_leases(
    source: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A recoverable lease notice of epoch 2**32 - 1 (client/leases.py ``take_notice`` takes
    ``aborted_epoch`` as it came), or a Join reply of that epoch (client/membership.py
    ``_adopt_epoch``), is followed by what every recovery does
    (strategies/elastic_training.py, data_parallel/checkpoints.py):
    ``restart_collectives(run_state.next_epoch(notice))``, epoch 2**32. From then on every
    ``LeaseRequest`` fails to encode ("ValueError: Value out of range: 4294967296",
    client/leases.py ``_request``): the keeper logs "renewing leases failed" every second,
    the rank's lease lapses on every honest server of the run (which then abort the run for
    a rank lost), and ``client.close()`` raises the same ValueError. One server's word may
    not put a rank past the epochs it can say: refused (DATA_LOSS naming the server) or kept
    within uint32."""
    notice = pb.LeaseReply(aborted="server 1 lost", aborted_epoch=TOP, lost_rank=-1)
    calm = pb.LeaseReply()
    lying = source == "lease_notice"

    def lease(request: Any, context: grpc.ServicerContext) -> pb.LeaseReply:
        return notice if lying else calm

    def hold(request: Any, context: grpc.ServicerContext) -> Any:
        yield notice if lying else calm
        time.sleep(1.0)

    join = pb.JoinReply(decided=True, member=True, step=3, members=[0], leader=0, epoch=TOP)
    caplog.set_level(logging.WARNING)
    with lying_server(Lease=lease, HoldLease=hold, Join=lambda r, c: join) as server:
        client = _client(server.address, f"lying-top-{source}")
        closed = False
        try:
            state = client.run_state
            try:
                if lying:
                    _wait(state.current, 3.0)
                else:
                    Membership(client, "j", min_members=1, window_s=1, wait_s=3).join(3)
                epoch = state.next_epoch(state.current())
            except ShardClientError as exc:  # refused: fixed
                assert server.address in str(exc)
            else:
                client.restart_collectives(epoch)
                state.refresh()  # one renewal now: "Value out of range" before
                time.sleep(1.2)  # a round of the lease keeper
                client.close()
                closed = True
        finally:
            if not closed:
                with contextlib.suppress(Exception):
                    client.close()
    failed = [r.getMessage() for r in caplog.records if "renewing leases failed" in r.getMessage()]
    assert not failed, f"the lease keeper: {failed[0]}"


# -- a lease stream's notices ----------------------------------------------------------------------


def test_lease_stream_of_ever_newer_notices_does_not_flood_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An honest server posts a notice once per epoch the run's ranks abort (a handful a
    run). A HoldLease stream of notices for epochs 1, 2, 3, ... is taken whole
    (client/leases.py ``take_notice`` -> client/run_state.py ``RunState.abort``: each newer
    epoch is news, logged at warning and cancelling the calls in flight): 9,909 warnings in
    2 s here, on 4 billion epochs. A rank's log takes a bounded number of a server's notices
    (those of epochs this rank reached, or a rate)."""
    stop = threading.Event()

    def hold(request: Any, context: grpc.ServicerContext) -> Any:
        epoch = 0
        while not stop.is_set() and context.is_active():
            epoch += 1
            yield pb.LeaseReply(aborted=f"rank 1 lost ({epoch})", aborted_epoch=epoch)

    caplog.set_level(logging.WARNING, logger="paramshard.leases")
    with lying_server(Lease=lambda r, c: pb.LeaseReply(), HoldLease=hold) as server:
        client = _client(server.address, "lying-flood")
        try:
            time.sleep(2.0)
            count = sum(r.name == "paramshard.leases" for r in caplog.records)
        finally:
            stop.set()
            client.close()
    assert count <= 50, f"{count:,} notices logged in 2 s from one lease stream"


# -- recovery from replicas ------------------------------------------------------------------------


def test_replica_fetch_of_a_claimed_total_past_the_replica_ends(caplog: Any) -> None:
    """``recover_from_replicas`` (client/replicas.py) fetches a server's replica from its
    neighbour until ``offset`` reaches the ``total`` each chunk claims: a neighbour that
    lists the replica at 100 bytes (ListReplicas' ``bytes``) and answers every FetchReplica
    with 1 byte of a total of 2**60 keeps the recovering rank calling (and loading the bytes
    into the restarted server) without end: 1,000s of calls in 3 s here, 2**60 to go. A
    chunk past the replica's listed size, of another total, or at another offset than asked
    is DATA_LOSS naming the holder."""
    fetched: list[int] = []

    def listed(request: Any, context: grpc.ServicerContext) -> pb.ListReplicasReply:
        held = [pb.ReplicaInfo(source_index=i, version=5, bytes=100) for i in range(2)]
        return pb.ListReplicasReply(replicas=held)

    def fetch(request: Any, context: grpc.ServicerContext) -> pb.ReplicaChunk:
        fetched.append(request.offset)
        return pb.ReplicaChunk(
            job=request.job, source_index=request.source_index, version=request.version,
            offset=request.offset, total=2**60, data=b"x",
        )  # fmt: skip

    outcome: list[Any] = []

    def recover(client: ShardClient) -> None:
        try:
            outcome.append(recover_from_replicas(client, "j"))
        except Exception as exc:  # noqa: BLE001 - what it raised is the test's to judge
            outcome.append(exc)

    with lying_server(
        ListReplicas=listed, FetchReplica=fetch, LoadReplica=lambda r, c: pb.ReplicaAck()
    ) as server:
        client = _client(server.address, "lying-replica", servers=2)
        worker = threading.Thread(target=recover, args=(client,), daemon=True)
        try:
            worker.start()
            worker.join(3.0)
            calls = len(fetched)
        finally:
            client.close()  # a loop still running fails on the closed channel
            worker.join(3.0)
    assert calls <= 100, f"{calls:,} FetchReplica calls in 3 s for a replica of 100 bytes"
    assert outcome and isinstance(outcome[0], ShardClientError), outcome[:1]
    assert "DATA_LOSS" in str(outcome[0]) and server.address in str(outcome[0])
