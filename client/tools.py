"""Look into a running job and keep it: status, inspect, get, snapshot, restore, export.

Each ``paramshard`` command is one of these functions. Everything works from the servers'
manifests (names, shapes, offsets of every original parameter), so none of it needs the model's
code or torch. Export streams: the safetensors header is computed from the manifest first, then
each parameter is pulled and written in turn, so memory stays about one parameter.

A 3D-parallel job (``HybridShardedModel``) is one server job per (pipeline stage, tensor
rank), ``<job>.pp<s>.tp<t>``. Given the base name ``<job>`` (no job of that exact name, but
its parts on the servers), ``get_param``, ``inspect`` and ``export`` join the parts into the
whole model (``client.tensor_parts``), ``snapshot`` takes every part at one version and
``restore`` checks every part on every server before any server swaps.

A job need not be on every server: each server's Status says which slice of a job it holds
and of how many (a 3D job's part lives on its data-parallel group's servers), so these tools
ask every server and drive each job through a view of the client on its own servers
(``ShardClient.on_servers``). Snapshots record those servers, and a restore into the same
cluster puts every slice back where it was.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from client.rpc import Call, ShardClientError
from client.shard_client import ShardClient
from client.tensor_parts import (
    PartParam,
    PartsError,
    WholeParam,
    check_complete,
    find_parts,
    join_parts,
    parse_part_job,
)
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
    "export_dtype",
    "whole_items",
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
    # tensor-parallel part (see ParamEntry in shard.proto); split_parts 0: the whole tensor
    split_dim: int = 0
    split_parts: int = 0
    split_index: int = 0
    split_packed: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class _Held:
    """What the servers of a client hold: each job's status and the servers of its slices."""

    client: ShardClient
    replies: list[Any]  # every server's StatusReply, in server order
    status: dict[str, Any] = field(default_factory=dict)  # job -> JobStatus of one holder
    slices: dict[str, dict[int, int]] = field(default_factory=dict)  # job -> slice -> server
    counts: dict[str, set[int]] = field(default_factory=dict)  # job -> num_servers reported

    def __post_init__(self) -> None:
        n = self.client.num_servers
        for i, reply in enumerate(self.replies):
            for j in reply.jobs:
                # a server that does not report its slice holds slice i of all n (older servers)
                index, count = (j.server_index, j.num_servers) if j.num_servers else (i, n)
                self.status.setdefault(j.job, j)
                self.slices.setdefault(j.job, {})[index] = i
                self.counts.setdefault(j.job, set()).add(count)

    @property
    def jobs(self) -> list[str]:
        return sorted(self.status)

    def placement(self, job: str) -> list[int] | None:
        """The server (index in this client) of each slice of ``job`` in slice order; None
        when some slice is on no server (a restarted server lost it) or holders disagree."""
        counts, slices = self.counts.get(job, set()), self.slices.get(job, {})
        if len(counts) != 1:
            return None
        (count,) = counts
        if sorted(slices) != list(range(count)):
            return None
        return [slices[k] for k in range(count)]

    def servers_of(self, job: str) -> list[int]:
        """``placement``, or an error that says which slices are missing."""
        if job not in self.status:
            raise self.not_found(job)
        found = self.placement(job)
        if found is None:
            held = ", ".join(
                f"slice {k} on server {i}" for k, i in sorted(self.slices[job].items())
            )
            counts = " or ".join(str(c) for c in sorted(self.counts[job]))
            raise RuntimeError(
                f"job '{job}' is split into {counts} slices but the servers hold only {held}:"
                " a server lost its slice (restarted?); restore a snapshot"
            )
        return found

    def view(self, job: str) -> ShardClient:
        """The client on ``job``'s servers, slice i on server i."""
        servers = self.servers_of(job)
        if servers == list(range(self.client.num_servers)):
            return self.client
        return self.client.on_servers(servers)

    def versions(self, job: str) -> list[int]:
        """Every buffer version of ``job`` that any server reports."""
        return [b.version for r in self.replies for j in r.jobs if j.job == job for b in j.buffers]

    def not_found(self, job: str) -> KeyError:
        known = ", ".join(self.jobs) or "none"
        addresses = ", ".join(self.client.spec.addresses)
        return KeyError(f"job '{job}' is not on the servers ({addresses}); jobs: {known}")


def _held(client: ShardClient) -> _Held:
    """Asks every server what it holds."""
    n = client.num_servers
    return _Held(client, client.run(Call(i, "Status", pb.StatusRequest()) for i in range(n)))


def _refs(status: Any) -> list[ParamRef]:
    """The parameters of one JobStatus, in buffer order."""
    return [
        ParamRef(
            p.name,
            b.buffer,
            b.numel,
            p.offset,
            tuple(p.shape),
            p.dtype,
            tuple(p.aliases),
            b.version,
            p.split_dim,
            p.split_parts,
            p.split_index,
            p.split_packed,
        )
        for b in status.buffers
        for p in b.params
    ]


def job_params(client: ShardClient, job: str) -> list[ParamRef]:
    """Every original parameter of ``job``, in buffer order."""
    held = _held(client)
    if job not in held.status:
        raise held.not_found(job)
    return _refs(held.status[job])


def _part_param(client: ShardClient, job: str, r: ParamRef) -> PartParam:
    return PartParam(
        r.name,
        r.shape,
        r.dtype,
        r.aliases,
        lambda: _pull_param(client, job, r),
        r.split_dim,
        r.split_parts,
        r.split_index,
        r.split_packed,
    )


def _holders(held: _Held, job: str, ref: ParamRef) -> list[int]:
    """The servers (indices in the tools' client) holding pieces of ``ref``."""
    servers = held.servers_of(job)
    pieces = slicing.pieces(ref.buffer_numel, len(servers), ref.offset, ref.offset + ref.numel)
    return [servers[p.server] for p in pieces]


@dataclass(frozen=True)
class _LiveParam:
    """One whole parameter of a live job: where it is and how to read it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    aliases: tuple[str, ...]
    version: int
    buffer: str  # its buffer; of a 3D job's base name, the part jobs it is joined from
    servers: list[int]
    produce: Callable[[], np.ndarray]  # flat fp32 values


def _live_params(client: ShardClient, job: str) -> tuple[list[_LiveParam], list[str]]:
    """Every whole parameter of ``job`` and the server jobs it is read from: the job itself,
    or, for a 3D job's base name, its parts (tensor-parallel slices joined). KeyError when the
    servers hold neither, PartsError when a part is missing or they do not fit together."""
    held = _held(client)
    if job in held.status:
        view = held.view(job)
        return [
            _LiveParam(
                r.name,
                r.shape,
                r.dtype,
                r.aliases,
                r.version,
                r.buffer,
                _holders(held, job, r),
                lambda r=r: _pull_param(view, job, r),
            )
            for r in _refs(held.status[job])
        ], [job]
    parts = find_parts(job, held.jobs)
    if not parts:
        raise held.not_found(job)
    check_complete(job, parts)
    refs = {k: _refs(held.status[name]) for k, name in parts.items()}
    version = max((r.version for rs in refs.values() for r in rs), default=0)
    where: dict[tuple[str, str], list[int]] = {}
    params = {}
    for k, rs in refs.items():
        view = held.view(parts[k])
        params[k] = [_part_param(view, parts[k], r) for r in rs]
        where.update(((parts[k], r.name), _holders(held, parts[k], r)) for r in rs)
    whole = join_parts(job, params, parts)
    out = [
        _LiveParam(
            w.name,
            w.shape,
            w.dtype,
            w.aliases,
            version,
            ",".join(w.source),
            sorted({s for part in w.source for s in where[part, w.name]}),
            w.produce,
        )
        for w in whole
    ]
    return out, list(parts.values())


def get_param(client: ShardClient, job: str, name: str) -> np.ndarray:
    """One full parameter (fp32), gathered from the servers holding its pieces; of a 3D job's
    base name, joined from its tensor-parallel parts."""
    params, jobs = _live_params(client, job)
    for p in params:
        if name == p.name or name in p.aliases:
            return p.produce().reshape(p.shape)
    parts = f" (parts {', '.join(jobs)})" if jobs != [job] else ""
    raise KeyError(f"job '{job}'{parts} has no parameter '{name}'")


def _pull_param(client: ShardClient, job: str, ref: ParamRef) -> np.ndarray:
    out = np.empty(ref.numel, dtype=np.float32)
    client.run(client.pull_calls(job, ref.buffer, out, 0, start=ref.offset, numel=ref.buffer_numel))
    return out


def _stats(values: np.ndarray) -> dict[str, Any]:
    return {
        "norm": float(np.linalg.norm(values.astype(np.float64))),
        "min": float(values.min()) if values.size else 0.0,
        "max": float(values.max()) if values.size else 0.0,
        "finite": bool(np.isfinite(values).all()),
    }


def inspect(client: ShardClient, job: str) -> list[dict[str, Any]]:
    """One row per parameter: name, shape, dtype, servers holding it, version, norm, min, max,
    all finite. Pulls one parameter at a time (of a 3D job's base name: the whole tensors,
    joined from the parts listed in "buffer")."""
    params, _ = _live_params(client, job)
    return [
        {
            "name": p.name,
            "shape": list(p.shape),
            "dtype": p.dtype,
            "servers": p.servers,
            "version": p.version,
            "buffer": p.buffer,
            **_stats(p.produce()),
            "aliases": list(p.aliases),
        }
        for p in params
    ]


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


def _snapshot_jobs(
    held: _Held, jobs: list[str], tag: str, hybrid: dict[str, Any] | None = None
) -> tuple[int, dict[str, dict[str, Any]]]:
    """Snapshots every job of ``jobs`` at one version (the newest any of their buffers has
    reached, on any server); returns it and each job's committed manifest. ``hybrid`` (the
    base name and its part jobs) goes into each manifest, so offline export knows every part."""
    client = held.client
    versions = {job: held.versions(job) for job in jobs}
    for job, found in versions.items():
        if not found:
            raise KeyError(f"job '{job}' is not on the servers")
    servers = {job: held.servers_of(job) for job in jobs}
    version = max(max(v) for v in versions.values())
    # The jobs furthest on first: each is captured as soon as its call arrives, before the
    # others' steps let it move past the version.
    order = sorted(jobs, key=lambda job: -max(versions[job]))
    for attempt in range(5):
        try:
            flat = client.run(
                Call(
                    server,
                    "Snapshot",
                    pb.SnapshotRequest(
                        job=job,
                        tag=tag,
                        version=version,
                        server_index=i,
                        num_servers=len(servers[job]),
                    ),
                )
                for job in order
                for i, server in enumerate(servers[job])
            )
            break
        except ShardClientError as exc:
            # training stepped past the version between Status and Snapshot: aim further
            if "past the snapshot's" not in exc.details or attempt == 4:
                raise
            version += 1
    manifests, k = {}, 0
    for job in order:
        n = len(servers[job])
        replies, k = flat[k : k + n], k + n
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
        where = [client.servers[s] for s in servers[job]]  # in the whole cluster
        manifest = new_manifest(job, tag, version, n, buffers, shards, where, client.cluster_size)
        if hybrid is not None:
            manifest["hybrid"] = hybrid
        manifests[job] = manifest
    # committed only once every job's shards are written
    client.run(
        Call(
            server,
            "CommitSnapshot",
            pb.CommitSnapshotRequest(job=job, tag=tag, manifest_json=json.dumps(manifests[job])),
        )
        for job in jobs
        for server in servers[job]
    )
    return version, manifests


def snapshot(client: ShardClient, job: str, tag: str) -> dict[str, Any]:
    """Takes a snapshot of ``job`` on one version while training runs; returns the manifest.

    The version is the newest any buffer has reached: every server holding the job captures
    each buffer as it arrives there (before its next step), writes its shard, and then the
    manifest is committed on every one of them.

    Of a 3D job's base name: every part ``job.pp<s>.tp<t>`` at one version (the parts step in
    lockstep), each a snapshot of its own under ``tag``, committed once all are written;
    returns a summary: job, tag, version, num_servers, parts.
    """
    held = _held(client)
    parts = find_parts(job, held.jobs) if job not in held.status else {}
    if parts:
        check_complete(job, parts)
        names = list(parts.values())
        version, _ = _snapshot_jobs(held, names, tag, {"base": job, "parts": names})
        return {
            "job": job,
            "tag": tag,
            "version": version,
            "num_servers": client.num_servers,
            "parts": names,
        }
    if job not in held.status:
        raise held.not_found(job)
    hybrid = None
    parsed = parse_part_job(job)
    if parsed is not None:  # one part of a 3D job (HybridShardedModel.save_checkpoint)
        hybrid = {"base": parsed[0], "parts": list(find_parts(parsed[0], held.jobs).values())}
    _, manifests = _snapshot_jobs(held, [job], tag, hybrid)
    return manifests[job]


def _snapshot_parts(
    held: _Held, rows: list[dict[str, Any]], job: str, tag: str
) -> tuple[dict[tuple[int, int], str], str]:
    """For restoring ``job``: its parts with snapshot ``tag`` and that tag resolved, when
    ``job`` is a 3D job's base name with snapshots of its parts; ({}, tag) for a plain job."""
    if job in held.status or any(r["job"] == job for r in rows):
        return {}, tag
    by_tag: dict[str, dict[tuple[int, int], dict[str, Any]]] = {}
    for r in rows:
        parsed = parse_part_job(r["job"])
        if parsed is not None and parsed[0] == job:
            by_tag.setdefault(r["tag"], {})[parsed[1], parsed[2]] = r
    if not by_tag:
        return {}, tag
    expected = list(find_parts(job, held.jobs).values())  # a registered job has all its parts
    if tag == "latest":
        complete = []
        for t, found in by_tag.items():
            try:
                check_complete(job, found, expected)
            except PartsError:
                continue
            complete.append((max((r["version"], r["created_unix"]) for r in found.values()), t))
        if not complete:
            raise PartsError(
                f"job '{job}' has snapshots of its parts ({', '.join(sorted(by_tag))}) but none"
                " with every part"
            )
        tag = max(complete)[1]
    if tag not in by_tag:
        raise KeyError(
            f"job '{job}' has no snapshot '{tag}' of its parts; tags: {', '.join(sorted(by_tag))}"
        )
    found = by_tag[tag]
    check_complete(job, found, expected, f"snapshot '{tag}' of job '{job}'")
    return {k: r["job"] for k, r in sorted(found.items())}, tag


def _restore_servers(held: _Held, row: dict[str, Any] | None, job: str) -> list[int]:
    """Where to restore ``job``: the servers it is registered on (a trainer registered it
    before restoring); else, in the cluster the snapshot was taken in, the servers it was on
    (a server restarted empty gets its own slice back); else every server (resharded)."""
    client = held.client
    live = held.placement(job)
    if live is not None:
        return live
    if row is not None and row["cluster_servers"] == client.cluster_size:
        if all(g in client.servers for g in row["servers"]):
            return [client.servers.index(g) for g in row["servers"]]
    return list(range(client.num_servers))


def restore(client: ShardClient, job: str, tag: str = "latest", contributors: int = 0) -> int:
    """Loads snapshot ``tag`` into the servers (any number: resharded); returns its version.

    A job registered on the servers is restored into its own servers; one that is not, into
    the servers it was snapshotted from when the cluster is the same, else into every server.
    Of a 3D job's base name: every part's snapshot ``tag`` ("latest": the newest tag every
    part has). Every job is read and checked on every server before any server swaps any."""
    held = _held(client)
    try:
        rows = list_snapshots(client)
    except ShardClientError:
        rows = []  # no snapshot directory and the like: the servers' Restore says so
    parts, tag = _snapshot_parts(held, rows, job, tag)
    jobs = list(parts.values()) or [job]
    if tag == "latest" and not parts:  # the newest, as the servers would resolve it
        tag = next((r["tag"] for r in reversed(rows) if r["job"] == job), tag)
    recorded = {r["job"]: r for r in rows if r["tag"] == tag}
    servers = {j: _restore_servers(held, recorded.get(j), j) for j in jobs}

    def calls(tag: str, check_only: bool) -> list[Call]:
        return [
            Call(
                server,
                "Restore",
                pb.RestoreRequest(
                    job=j,
                    tag=tag,
                    server_index=i,
                    num_servers=len(servers[j]),
                    contributors=contributors,
                    check_only=check_only,
                ),
            )
            for j in jobs
            for i, server in enumerate(servers[j])
        ]

    # Phase one: every server reads and checks its part of every job; only then does any
    # server swap, so a snapshot that one server cannot load leaves every server as it was.
    checks = client.run(calls(tag, True))
    tags = {c.tag for c in checks}
    if len(tags) != 1:
        raise RuntimeError(f"servers resolve {tag!r} to different snapshots {sorted(tags)}")
    resolved = tags.pop()
    first = dict(zip([j for j in jobs for _ in servers[j]], checks, strict=True))
    versions = {j: first[j].version for j in jobs}
    if len(set(versions.values())) != 1:
        raise RuntimeError(
            f"the parts of snapshot '{job}/{resolved}' hold different versions"
            f" ({', '.join(f'{j}: {v}' for j, v in versions.items())}); nothing was restored"
        )
    replies = client.run(calls(resolved, False))
    restored = {r.version for r in replies}
    if len(restored) != 1:
        raise RuntimeError(f"servers restored different versions {sorted(restored)}")
    return restored.pop()


def list_snapshots(
    client: ShardClient, job: str = "", combine_parts: bool = False
) -> list[dict[str, Any]]:
    """The complete snapshots in server 0's snapshot directory, oldest first. With
    ``combine_parts``, the part snapshots of a 3D job under one tag (every part there, all at
    one version) make one row under the base name, with "parts"; ``job`` may then be a base."""
    reply = client.call(0, "ListSnapshots", pb.ListSnapshotsRequest(job=job))
    rows = [
        {
            "job": s.job,
            "tag": s.tag,
            "version": s.version,
            "num_servers": s.num_servers,
            "created_unix": s.created_unix,
            "servers": list(s.servers) or list(range(s.num_servers)),
            "cluster_servers": s.cluster_servers or s.num_servers,
        }
        for s in reply.snapshots
    ]
    if not combine_parts:
        return rows
    if job and not rows:  # maybe a 3D job's base name
        rows = [
            r
            for r in list_snapshots(client)
            if (parsed := parse_part_job(r["job"])) is not None and parsed[0] == job
        ]
    groups: dict[tuple[str, str], dict[tuple[int, int], dict[str, Any]]] = {}
    for r in rows:
        parsed = parse_part_job(r["job"])
        if parsed is not None:
            groups.setdefault((parsed[0], r["tag"]), {})[parsed[1], parsed[2]] = r
    out, merged = [], set()
    for (base, tag), found in groups.items():
        try:
            check_complete(base, found)
        except PartsError:
            continue
        if len({(r["version"], r["num_servers"]) for r in found.values()}) != 1:
            continue
        first = next(iter(found.values()))
        out.append(
            {
                "job": base,
                "tag": tag,
                "version": first["version"],
                "num_servers": first["num_servers"],
                "created_unix": max(r["created_unix"] for r in found.values()),
                "parts": [r["job"] for _, r in sorted(found.items())],
            }
        )
        merged |= {id(r) for r in found.values()}
    out += [r for r in rows if id(r) not in merged]
    return sorted(out, key=lambda r: (r["version"], r["created_unix"]))


# -- neighbour replication ----------------------------------------------------------------
def configure_replication(client: ShardClient, job: str, every: int) -> None:
    """Server i copies ``job`` to server (i+1) mod N every ``every`` versions (0 stops).
    ``client``'s servers are the job's (a model's own client), slice i on server i."""
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
    that version; LookupError when there is none (fall back to a snapshot). ``client``'s
    servers are the job's, as for ``configure_replication``."""
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
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(head)))
            f.write(head)
            for name, dtype, shape, produce in items:
                values = produce()
                if values.size != math.prod(shape):  # the header promised that many
                    raise RuntimeError(
                        f"'{name}': got {values.size} values for shape {list(shape)}"
                    )
                if dtype == "bfloat16":
                    raw = codec.f32_to_bf16_bits(values)
                else:
                    raw = values.astype(codec.numpy_dtype(codec.wire_dtype(dtype)))
                f.write(raw.tobytes())
                del values, raw
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):  # no half-written file left behind
            os.unlink(tmp)
        raise


def _export_items(
    params: Iterable[tuple[str, str, tuple, tuple, Callable[[], np.ndarray]]],
) -> Iterator[tuple[str, str, tuple, Callable[[], np.ndarray]]]:
    """Each parameter once per name it has (tied weights under every name)."""
    for name, dtype, shape, aliases, produce in params:
        for each in (name, *aliases):
            yield each, dtype, shape, produce


def export_dtype(dtype: str) -> str:
    """The dtype a parameter is exported in: its own, or float32 where safetensors has none."""
    return dtype if dtype in _ST_DTYPES else "float32"


def whole_items(
    params: Iterable[WholeParam],
) -> list[tuple[str, str, tuple, Callable[[], np.ndarray]]]:
    """``write_safetensors`` items of a 3D job's whole parameters (every name of each)."""
    return list(
        _export_items(
            (w.name, export_dtype(w.dtype), w.shape, w.aliases, w.produce) for w in params
        )
    )


def export(client: ShardClient, job: str, out: str | os.PathLike) -> int:
    """The job's full state dict from live servers into one safetensors file, under the
    model's own names; returns the number of tensors. Consistent when training is paused;
    while it runs, snapshot first and export the snapshot.

    Of a 3D job's base name: the whole model, each tensor joined from its parts (tensor
    rank 0's copy of a replicated one), every stage; one whole tensor in memory at a time."""
    params, jobs = _live_params(client, job)
    items = list(
        _export_items(
            (p.name, export_dtype(p.dtype), p.shape, p.aliases, p.produce) for p in params
        )
    )
    meta = {"job": job, "version": str(max((p.version for p in params), default=0))}
    if jobs != [job]:
        meta["parts"] = ",".join(jobs)
    write_safetensors(out, items, meta)
    return len(items)
