"""Look into a running job and keep it: status, inspect, get, snapshot, restore, export.

Each ``paramshard`` command is one of these functions. Everything works from the servers'
manifests (names, shapes, offsets of every original parameter), so none of it needs the model's
code or torch. Export streams: the safetensors header is computed from the manifest first, then
each parameter is pulled and written in turn, so memory stays about one parameter.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from client.rpc import Call, ShardClientError
from client.shard_client import ShardClient
from protos import codec, slicing
from protos import shard_pb2 as pb
from protos.manifest import new_manifest

__all__ = [
    "ParamRef",
    "job_params",
    "get_param",
    "inspect",
    "snapshot",
    "restore",
    "list_snapshots",
    "configure_replication",
    "recover_from_replicas",
    "export",
    "write_safetensors",
]

_ST_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64"}


@dataclass(frozen=True)
class ParamRef:
    """Where one original parameter lives: its buffer, offset and shape."""

    name: str
    buffer: str
    buffer_numel: int
    offset: int
    shape: tuple[int, ...]
    dtype: str
    aliases: tuple[str, ...]
    version: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _buffers(client: ShardClient, job: str) -> dict[str, Any]:
    """Server 0's view of the job's buffers (every server holds the same manifest)."""
    reply = client.call(0, "Status", pb.StatusRequest())
    for j in reply.jobs:
        if j.job == job:
            return {b.buffer: b for b in j.buffers}
    known = ", ".join(j.job for j in reply.jobs) or "none"
    raise KeyError(f"job '{job}' is not on server 0 ({client.spec.addresses[0]}); jobs: {known}")


def job_params(client: ShardClient, job: str) -> list[ParamRef]:
    """Every original parameter of ``job``, in buffer order."""
    out = []
    for b in _buffers(client, job).values():
        for p in b.params:
            out.append(
                ParamRef(
                    p.name,
                    b.buffer,
                    b.numel,
                    p.offset,
                    tuple(p.shape),
                    p.dtype,
                    tuple(p.aliases),
                    b.version,
                )
            )
    return out


def _find(client: ShardClient, job: str, name: str) -> ParamRef:
    for p in job_params(client, job):
        if name == p.name or name in p.aliases:
            return p
    raise KeyError(f"job '{job}' has no parameter '{name}'")


def get_param(client: ShardClient, job: str, name: str) -> np.ndarray:
    """One full parameter (fp32), gathered from the servers holding its pieces."""
    ref = _find(client, job, name)
    return _pull_param(client, job, ref).reshape(ref.shape)


def _pull_param(client: ShardClient, job: str, ref: ParamRef) -> np.ndarray:
    out = np.empty(ref.numel, dtype=np.float32)
    client.run(client.pull_calls(job, ref.buffer, out, 0, start=ref.offset, numel=ref.buffer_numel))
    return out


def inspect(client: ShardClient, job: str) -> list[dict[str, Any]]:
    """One row per parameter: name, shape, dtype, servers holding it, version, norm, min, max,
    all finite. Pulls one parameter at a time."""
    rows = []
    n = client.num_servers
    for ref in job_params(client, job):
        values = _pull_param(client, job, ref)
        holders = [
            p.server
            for p in slicing.pieces(ref.buffer_numel, n, ref.offset, ref.offset + ref.numel)
        ]
        finite = bool(np.isfinite(values).all())
        rows.append(
            {
                "name": ref.name,
                "shape": list(ref.shape),
                "dtype": ref.dtype,
                "servers": holders,
                "version": ref.version,
                "buffer": ref.buffer,
                "norm": float(np.linalg.norm(values.astype(np.float64))),
                "min": float(values.min()) if values.size else 0.0,
                "max": float(values.max()) if values.size else 0.0,
                "finite": finite,
                "aliases": list(ref.aliases),
            }
        )
    return rows


# -- snapshots --------------------------------------------------------------------------------
def _entry(p: pb.ParamEntry) -> dict[str, Any]:
    entry = {
        "name": p.name,
        "shape": list(p.shape),
        "dtype": p.dtype,
        "offset": p.offset,
        "numel": p.numel,
        "aliases": list(p.aliases),
    }
    if p.split_parts > 1:  # a tensor-parallel part (see ParamEntry in shard.proto)
        entry.update(
            split_dim=p.split_dim,
            split_parts=p.split_parts,
            split_index=p.split_index,
            split_packed=p.split_packed,
        )
    return entry


def snapshot(client: ShardClient, job: str, tag: str) -> dict[str, Any]:
    """Takes a snapshot of ``job`` on one version while training runs; returns the manifest.

    The version is the newest any buffer has reached: every server captures each buffer as
    it arrives there (before its next step), writes its shard, and then the manifest is
    committed on every server.
    """
    versions = [
        b.version
        for i in range(client.num_servers)
        for j in client.call(i, "Status", pb.StatusRequest()).jobs
        if j.job == job
        for b in j.buffers
    ]
    if not versions:
        raise KeyError(f"job '{job}' is not on the servers")
    version = max(versions)
    n = client.num_servers
    for attempt in range(5):
        try:
            replies = client.run(
                Call(
                    i,
                    "Snapshot",
                    pb.SnapshotRequest(
                        job=job, tag=tag, version=version, server_index=i, num_servers=n
                    ),
                )
                for i in range(n)
            )
            break
        except ShardClientError as exc:
            # training stepped past the version between Status and Snapshot: aim further
            if "past the snapshot's" not in exc.details or attempt == 4:
                raise
            version += 1
    buffers = {
        b.buffer: {
            "numel": b.numel,
            "contributors": b.contributors,
            "optimizer": {"name": b.optimizer, "hyper": dict(b.hyper)},
            "params": [_entry(p) for p in b.params],
        }
        for b in replies[0].buffers
    }
    shards = [
        {"file": r.file, "server": i, "bytes": r.bytes, "sha256": r.sha256}
        for i, r in enumerate(replies)
    ]
    manifest = new_manifest(job, tag, version, n, buffers, shards)
    text = json.dumps(manifest)
    client.run(
        Call(i, "CommitSnapshot", pb.CommitSnapshotRequest(job=job, tag=tag, manifest_json=text))
        for i in range(n)
    )
    return manifest


def restore(client: ShardClient, job: str, tag: str = "latest", contributors: int = 0) -> int:
    """Loads snapshot ``tag`` into these servers (any number: resharded); returns its version."""
    n = client.num_servers

    def request(i: int, tag: str, check_only: bool) -> pb.RestoreRequest:
        return pb.RestoreRequest(
            job=job,
            tag=tag,
            server_index=i,
            num_servers=n,
            contributors=contributors,
            check_only=check_only,
        )

    # Phase one: every server reads and checks its part; only then does any server swap, so a
    # snapshot that one server cannot load leaves every server as it was.
    checks = client.run(Call(i, "Restore", request(i, tag, True)) for i in range(n))
    tags = {c.tag for c in checks}
    if len(tags) != 1:
        raise RuntimeError(f"servers resolve {tag!r} to different snapshots {sorted(tags)}")
    resolved = tags.pop()
    replies = client.run(Call(i, "Restore", request(i, resolved, False)) for i in range(n))
    versions = {r.version for r in replies}
    if len(versions) != 1:
        raise RuntimeError(f"servers restored different versions {sorted(versions)}")
    return versions.pop()


def list_snapshots(client: ShardClient, job: str = "") -> list[dict[str, Any]]:
    reply = client.call(0, "ListSnapshots", pb.ListSnapshotsRequest(job=job))
    return [
        {
            "job": s.job,
            "tag": s.tag,
            "version": s.version,
            "num_servers": s.num_servers,
            "created_unix": s.created_unix,
        }
        for s in reply.snapshots
    ]


# -- neighbour replication ----------------------------------------------------------------
def configure_replication(client: ShardClient, job: str, every: int) -> None:
    """Server i copies ``job`` to server (i+1) mod N every ``every`` versions (0 stops)."""
    n = client.num_servers
    client.run(
        Call(
            i,
            "ConfigureReplication",
            pb.ReplicationConfig(
                job=job,
                every=every,
                neighbour=client.spec.addresses[(i + 1) % n],
                server_index=i,
                num_servers=n,
                token=client.spec.token or "",
            ),
        )
        for i in range(n)
    )


def recover_from_replicas(client: ShardClient, job: str) -> int:
    """Brings every server back to the newest version all of them can reach: a server with
    its own copy rolls back to it, a restarted one gets its copy from its neighbour. Returns
    that version; LookupError when there is none (fall back to a snapshot)."""
    n = client.num_servers
    lists = client.run(Call(i, "ListReplicas", pb.ListReplicasRequest(job=job)) for i in range(n))
    own = [{r.version for r in lists[i].replicas if r.own} for i in range(n)]
    held = [
        {r.version for r in lists[(i + 1) % n].replicas if not r.own and r.source_index == i}
        for i in range(n)
    ]
    reachable = set.intersection(*(own[i] | held[i] for i in range(n)))
    if not reachable:
        raise LookupError(f"no version of job '{job}' is replicated for every server")
    version = max(reachable)
    for i in range(n):
        if version in own[i]:
            client.call(i, "RollbackToReplica", pb.RollbackRequest(job=job, version=version))
            continue
        holder, offset, total = (i + 1) % n, 0, None
        while total is None or offset < total:
            chunk = client.call(
                holder,
                "FetchReplica",
                pb.FetchReplicaRequest(job=job, source_index=i, version=version, offset=offset),
            )
            client.call(i, "LoadReplica", chunk)
            total, offset = chunk.total, offset + len(chunk.data)
            if not chunk.data:
                break
    return version


# -- export -----------------------------------------------------------------------------------
def write_safetensors(
    path: str | os.PathLike,
    items: Iterable[tuple[str, str, tuple[int, ...], Callable[[], np.ndarray]]],
    metadata: dict[str, str] | None = None,
) -> None:
    """Streams tensors into a safetensors file: (name, dtype, shape, produce fp32 values).

    The header (names, dtypes, shapes, offsets) is written first from the shapes alone, then
    each tensor's bytes as it is produced: memory stays about one tensor.
    """
    items = list(items)
    header: dict[str, Any] = {"__metadata__": metadata or {}}
    offset = 0
    for name, dtype, shape, _ in items:
        size = math.prod(shape) * (
            2 if dtype in ("float16", "bfloat16") else 8 if dtype == "float64" else 4
        )
        header[name] = {
            "dtype": _ST_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    tmp = f"{os.fspath(path)}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for _, dtype, _, produce in items:
            values = produce()
            if dtype == "bfloat16":
                raw = codec.f32_to_bf16_bits(values)
            else:
                raw = values.astype(codec.numpy_dtype(codec.wire_dtype(dtype)))
            f.write(raw.tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _export_items(
    params: Iterable[tuple[str, str, tuple, tuple, Callable[[], np.ndarray]]],
) -> Iterator[tuple[str, str, tuple, Callable[[], np.ndarray]]]:
    """Each parameter once per name it has (tied weights under every name)."""
    for name, dtype, shape, aliases, produce in params:
        for each in (name, *aliases):
            yield each, dtype, shape, produce


def export(client: ShardClient, job: str, out: str | os.PathLike) -> int:
    """The job's full state dict from live servers into one safetensors file, under the
    model's own names; returns the number of tensors. Consistent when training is paused;
    while it runs, snapshot first and export the snapshot."""
    refs = job_params(client, job)
    items = list(
        _export_items(
            (
                r.name,
                r.dtype if r.dtype in _ST_DTYPES else "float32",
                r.shape,
                r.aliases,
                lambda r=r: _pull_param(client, job, r),
            )
            for r in refs
        )
    )
    write_safetensors(
        out, items, {"job": job, "version": str(max((r.version for r in refs), default=0))}
    )
    return len(items)
