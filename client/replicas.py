"""Neighbour replication of a job: ``configure_replication`` (server i copies its slices to
server i+1 every k versions) and ``recover_from_replicas`` (every server back to the newest
version all of them can reach), docs/design.md §5.2."""

from __future__ import annotations

import logging

import grpc

from paramshard.client.rpc import Call, ShardClientError, unusable_reply
from paramshard.client.shard_client import ShardClient
from paramshard.client.unreachable import lacks_role
from paramshard.protos import shard_pb2 as pb
from paramshard.protos.placement import replica_holder

__all__ = ["CHECK_STEPS", "configure_replication", "recover_from_replicas", "say_failures"]

log = logging.getLogger("paramshard.replication")

CHECK_STEPS = 20
"""How often (in steps) ``train_with_recovery``'s rank 0 asks whether replicas fail."""

ASK_TIMEOUT_S = 5.0
"""The longest ``say_failures`` waits on the servers' answers (asked at once)."""


def configure_replication(client: ShardClient, job: str, every: int) -> None:
    """Server i copies ``job`` to server (i+1) mod N every ``every`` versions (0 stops).
    ``client``'s servers are the job's (a model's own client), slice i on server i. Servers
    with tokens need an admin token here (the servers then send with their own peer token)."""
    n = client.num_servers
    try:
        _configure(client, job, every, n)
    except ShardClientError as exc:
        if not lacks_role(exc.code, exc.details):
            raise
        raise PermissionError(
            f"replicate_every for job '{job}' needs an admin token on rank 0 (replication sends"
            f" the model to another server, so it is an admin's decision): {exc.details}"
        ) from exc


def _configure(client: ShardClient, job: str, every: int, n: int) -> None:
    client.run(
        Call(
            i,
            "ConfigureReplication",
            pb.ReplicationConfig(
                job=job,
                every=every,
                neighbour=client.spec.addresses[replica_holder(i, n)],
                server_index=i,
                num_servers=n,
            ),
        )
        for i in range(n)
    )


def recover_from_replicas(client: ShardClient, job: str) -> int:
    """Brings every server back to the newest version all of them can reach: a server with
    its own copy rolls back to it, a restarted one gets its copy from its neighbour. Returns
    that version; LookupError when there is none (fall back to a snapshot). ``client``'s
    servers are the job's, as for ``configure_replication``."""
    n = client.num_servers
    lists = client.run(Call(i, "ListReplicas", pb.ListReplicasRequest(job=job)) for i in range(n))
    own = [{r.version for r in lists[i].replicas if r.own} for i in range(n)]
    held = [{r.version for r in _held_for(lists, i)} for i in range(n)]
    reachable = set.intersection(*(own[i] | held[i] for i in range(n)))
    if not reachable:
        failed = "".join(
            f"; server {i}'s last replica failed: {r.failure}"
            for i, r in enumerate(lists)
            if r.failure
        )
        raise LookupError(f"no version of job '{job}' is replicated for every server{failed}")
    version = max(reachable)
    for i in range(n):
        if version in own[i]:
            client.call(i, "RollbackToReplica", pb.RollbackRequest(job=job, version=version))
            continue
        holder, offset = replica_holder(i, n), 0
        size = max(r.bytes for r in _held_for(lists, i) if r.version == version)
        if not size:  # a replica is never empty: nothing would be loaded
            raise unusable_reply(client, holder, "ListReplicas", f"server {i}'s replica of 0 bytes")
        while offset < size:
            chunk = client.call(
                holder,
                "FetchReplica",
                pb.FetchReplicaRequest(job=job, source_index=i, version=version, offset=offset),
            )
            got = len(chunk.data)
            if chunk.offset != offset or chunk.total != size or not 0 < got <= size - offset:
                raise unusable_reply(client, holder, "FetchReplica", (
                    f"{got:,} bytes at offset {chunk.offset:,} of {chunk.total:,} for a fetch at"
                    f" {offset:,} of server {i}'s replica, listed at {size:,} bytes"
                ))  # fmt: skip
            client.call(i, "LoadReplica", chunk)
            offset += got
    return version


def say_failures(client: ShardClient, job: str) -> list[str]:
    """Logs a warning naming the servers whose newest replica of ``job`` was not made or
    not sent (``ListReplicasReply.failure``: a copy past ``--max-memory``, a neighbour down);
    returns those lines. Before, a rank trained on with no replica for every step it took,
    and learnt it only when a server died. A server that does not answer within
    ``ASK_TIMEOUT_S`` (all are asked at once) is left out, unretried: a lost server is the
    recovery's to find, and the step waits on this (before, a stalled server held it for the
    client's whole deadline and retries)."""
    request = pb.ListReplicasRequest(job=job)
    try:
        asked = [
            client.stub(i, "ListReplicas").future(
                request, timeout=ASK_TIMEOUT_S, metadata=client.spec.metadata()
            )
            for i in range(client.num_servers)
        ]
    except ValueError:  # the client was closed
        return []
    failed = []
    for i, fut in enumerate(asked):
        try:
            reply = fut.result()
        except grpc.RpcError:
            continue
        if reply.failure:
            failed.append(f"server {i}: {reply.failure}")
    if failed:
        log.warning(
            "job '%s': replicas fail (%s); a server lost now comes back from an older replica"
            " or the newest snapshot",
            job,
            "; ".join(failed),
        )
    return failed


def _held_for(lists: list[pb.ListReplicasReply], i: int) -> list[pb.ReplicaInfo]:
    """The replicas of server ``i``'s slice its holder lists (``lists``: every server's
    ListReplicas reply)."""
    return [
        r
        for r in lists[replica_holder(i, len(lists))].replicas
        if not r.own and r.source_index == i
    ]
