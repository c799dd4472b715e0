"""Valid requests of the Shard service for the chaos fuzzer (tests/chaos_requests.py mutates
them): for a job and its run (slot keys ``<run>:ar<seq>/0``, leases of its ranks with short
TTLs, releases and aborts), for the shared segments every caller holds (offers of any size,
confirmations, releases, payloads and replies referencing any segment at any offset), and for
snapshots and replicas (a real manifest, a well-formed replica)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from chaos_values import U64, Context, N, manifest, payload, pick, run_of

from paramshard.protos import shard_pb2 as pb
from paramshard.server.snapshots.shards import Captured, encode_shard

__all__ = ["valid_request", "replica_blob"]


def replica_blob(job: str, version: int) -> bytes:
    """A well-formed replica of server 0's slice of buffer "w" of ``job`` (values zero)."""
    spec = pb.RegisterBufferRequest(
        ref=pb.BufferRef(job=job, buffer="w"),
        numel=N,
        num_servers=1,
        contributors=1,
        optimizer=pb.OptimizerSpec(name="adam", hyper={"lr": 0.01}),
    )
    captured = [Captured("w", 0, np.zeros(N, np.float32), {}, 0)]
    return encode_shard(job, "replica", 0, 1, version, captured, {"w": spec.SerializeToString()})


def valid_request(rng: np.random.Generator, name: str, job: str, ctx: Context) -> Any | None:
    """A well-formed request of Shard method ``name`` for ``job``; None without a template."""
    version = ctx.versions.get(job, 2)
    ref = pb.BufferRef(job=job, buffer=str(rng.choice(["w", "w", "w", "v", "x"])))
    n = int(rng.choice((1, 7, 16, N)))
    chunk = pb.Chunk(offset=0, numel=n, dtype=pb.FLOAT32)
    data = payload(rng, pb.FLOAT32, n)
    run = run_of(job)
    key = str(rng.choice([f"{run}:ar{rng.integers(3)}/0", f"fz{rng.integers(4)}/all_reduce/0"]))
    tag = str(rng.choice(["baseline", "latest", "d0", f"fz-{ctx.tags}"]))
    ctx.tags += 1
    args = pb.StepArgs(hyper={"lr": 0.01}, clip_coef=1.0)
    make: dict[str, Callable[[], Any]] = {
        "RegisterBuffer": lambda: pb.RegisterBufferRequest(
            ref=ref,
            numel=N,
            num_servers=1,
            contributors=1,
            params=[
                pb.ParamEntry(name="a", shape=[8, 4], dtype="float32", offset=0, numel=32),
                pb.ParamEntry(name="b", shape=[32], dtype="float32", offset=32, numel=32),
            ],
            optimizer=pb.OptimizerSpec(name="adam", hyper={"lr": 0.01}),
        ),
        "SetParams": lambda: pb.SetParamsRequest(
            header=pb.SetParamsHeader(
                ref=ref, chunk=chunk, version=version, state=str(rng.choice(["", "exp_avg"]))
            ),
            data=data,
        ),
        "PushGrad": lambda: pb.PushGradRequest(
            header=pb.PushGradHeader(
                ref=ref,
                chunk=chunk,
                step=version,
                num_micro=1,
                step_args=args if rng.random() < 0.5 else None,
            ),
            data=data,
        ),
        "PullParams": lambda: pb.PullParamsRequest(
            ref=ref, min_version=version, chunk=chunk, state=str(rng.choice(["", "exp_avg"]))
        ),
        "GradNorm": lambda: pb.GradNormRequest(job=job, buffers=["w"], step=version),
        "Step": lambda: pb.StepRequest(
            job=job, step=version, buffers=[pb.BufferStep(buffer="w", args=args)]
        ),
        "Contribute": lambda: pb.ContributeRequest(
            header=pb.SlotHeader(
                key=key, expected=1, readers=1, total_numel=n, chunk=chunk, chunk_numel=n
            ),
            data=data,
        ),
        "ReadSlot": lambda: pb.ReadSlotRequest(key=key),
        "ContributeRead": lambda: pb.ContributeRequest(
            header=pb.SlotHeader(
                key=key, expected=1, readers=1, total_numel=n, chunk=chunk, chunk_numel=n
            ),
            data=data,
        ),
        "DropJob": lambda: pb.DropJobRequest(job=job),
        "Status": lambda: pb.StatusRequest(pending=bool(rng.integers(2))),
        "Snapshot": lambda: pb.SnapshotRequest(
            job=job, tag=tag, version=version, server_index=0, num_servers=1
        ),
        "CommitSnapshot": lambda: pb.CommitSnapshotRequest(
            job=job, tag=tag, manifest_json=manifest(rng, ctx, job, tag) if ctx.manifest else ""
        ),
        "Restore": lambda: pb.RestoreRequest(
            job=job, tag=tag, server_index=0, num_servers=1, check_only=bool(rng.integers(2))
        ),
        "ListSnapshots": lambda: pb.ListSnapshotsRequest(job=job),
        "DeleteSnapshot": lambda: pb.DeleteSnapshotRequest(job=job, tag=tag),
        "ConfigureReplication": lambda: pb.ReplicationConfig(
            job=job, every=1, neighbour=ctx.address, server_index=0, num_servers=1
        ),
        "StoreReplica": lambda: _replica_chunk(rng, job, version),
        "ListReplicas": lambda: pb.ListReplicasRequest(job=job),
        "FetchReplica": lambda: pb.FetchReplicaRequest(job=job, version=version, max_bytes=4096),
        "LoadReplica": lambda: _replica_chunk(rng, job, version),
        "RollbackToReplica": lambda: pb.RollbackRequest(job=job, version=version),
        "Join": lambda: pb.JoinRequest(
            run=run,
            job=job,
            rank=int(rng.integers(2)),
            world_size=2,
            step=version,
            min_members=1,
            window_ms=int(rng.choice((0, 50))),
            leave=bool(rng.random() < 0.2),
            recovery=bool(rng.random() < 0.2),
        ),
        "Lease": lambda: pb.LeaseRequest(
            run=run,
            rank=int(rng.integers(3)),
            world_size=2,
            epoch=int(rng.integers(2)),
            ttl_ms=int(pick(rng, (100, 1000, 600_000))),
            release=rng.random() < 0.2,
            abort=str(rng.choice(["", "", "", "fuzzed abort"])),
        ),
        "OfferSegment": lambda: pb.OfferSegmentRequest(
            nbytes=int(pick(rng, (16, 4096, 2**20, 2**28, 2**30, 2**40)))
        ),
        "ConfirmSegment": lambda: pb.ConfirmSegmentRequest(
            segment=_segment(rng, ctx), proof=rng.bytes(16)
        ),
        "ReleaseSegments": lambda: pb.ReleaseSegmentsRequest(
            segments=[_segment(rng, ctx) for _ in range(int(rng.integers(3)))]
        ),
    }
    request = make[name]() if name in make else None
    if request is not None and ctx.segments and rng.random() < 0.3:
        _into_segment(rng, request, ctx)
    return request


def _segment(rng: np.random.Generator, ctx: Context) -> int:
    """A segment some caller holds (or held), or one nobody does."""
    return int(pick(rng, ctx.segments)) if ctx.segments and rng.random() < 0.8 else 12345


def _into_segment(rng: np.random.Generator, request: Any, ctx: Context) -> None:
    """Moves a tensor request's payload into a shared segment reference (any caller's; the
    segment holds whatever it holds), or asks for a reply in one."""
    offset = int(pick(rng, (0, 0, 8, 2**20 - 4, 2**20, 2**62)))
    fields = request.DESCRIPTOR.fields_by_name
    if "reply_shm" in fields:
        request.reply_shm.CopyFrom(
            pb.ShmRef(segment=_segment(rng, ctx), offset=offset, nbytes=2**16)
        )
    elif "header" in fields and "shm" in request.header.DESCRIPTOR.fields_by_name:
        nbytes = len(request.data) if rng.random() < 0.8 else int(pick(rng, U64))
        ref = pb.ShmRef(segment=_segment(rng, ctx), offset=offset, nbytes=nbytes)
        request.header.shm.CopyFrom(ref)
        if rng.random() < 0.9:
            request.data = b""


def _replica_chunk(rng: np.random.Generator, job: str, version: int) -> pb.ReplicaChunk:
    blob = replica_blob(job, version)
    if rng.random() < 0.5:  # the whole replica in one chunk
        return pb.ReplicaChunk(job=job, version=version, total=len(blob), data=blob)
    start = int(rng.integers(len(blob)))
    end = int(rng.integers(start, len(blob) + 1))
    return pb.ReplicaChunk(
        job=job, version=version, offset=start, total=len(blob), data=blob[start:end]
    )
