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


def _jobs(client: ShardClient) -> dict[str, Any]:
    """Server 0's jobs, name -> JobStatus (every server holds the same manifests)."""
    reply = client.call(0, "Status", pb.StatusRequest())
    return {j.job: j for j in reply.jobs}


def _not_found(client: ShardClient, job: str, jobs: Iterable[str]) -> KeyError:
    known = ", ".join(jobs) or "none"
    return KeyError(f"job '{job}' is not on server 0 ({client.spec.addresses[0]}); jobs: {known}")


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
    jobs = _jobs(client)
    if job not in jobs:
        raise _not_found(client, job, jobs)
    return _refs(jobs[job])


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


def _live_hybrid(client: ShardClient, job: str) -> tuple[list[WholeParam], int] | None:
    """The whole parameters of a 3D job's base name and its parts' newest version; None when
    ``job`` is a plain job. KeyError when the servers hold neither, PartsError when a part is
    missing or they do not fit together."""
    jobs = _jobs(client)
    if job in jobs:
        return None
    parts = find_parts(job, jobs)
    if not parts:
        raise _not_found(client, job, jobs)
    check_complete(job, parts)
    refs = {k: _refs(jobs[name]) for k, name in parts.items()}
    params = {k: [_part_param(client, parts[k], r) for r in rs] for k, rs in refs.items()}
    version = max((r.version for rs in refs.values() for r in rs), default=0)
    return join_parts(job, params, parts), version


def _find(client: ShardClient, job: str, name: str) -> ParamRef:
    for p in job_params(client, job):
        if name == p.name or name in p.aliases:
            return p
    raise KeyError(f"job '{job}' has no parameter '{name}'")


def get_param(client: ShardClient, job: str, name: str) -> np.ndarray:
    """One full parameter (fp32), gathered from the servers holding its pieces; of a 3D job's
    base name, joined from its tensor-parallel parts."""
    hybrid = _live_hybrid(client, job)
    if hybrid is None:
        ref = _find(client, job, name)
        return _pull_param(client, job, ref).reshape(ref.shape)
    for w in hybrid[0]:
        if name == w.name or name in w.aliases:
            return w.produce().reshape(w.shape)
    raise KeyError(
        f"job '{job}' (parts {', '.join(_part_names(hybrid[0]))}) has no parameter '{name}'"
    )


def _part_names(params: Iterable[WholeParam]) -> list[str]:
    return sorted({s for w in params for s in w.source})


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
    rows = []
    n = client.num_servers
    hybrid = _live_hybrid(client, job)
    if hybrid is not None:
        params, version = hybrid
        for w in params:
            rows.append(
                {
                    "name": w.name,
                    "shape": list(w.shape),
                    "dtype": w.dtype,
                    "servers": list(range(n)),  # every part is sharded over every server
                    "version": version,
                    "buffer": ",".join(w.source),
                    **_stats(w.produce()),
                    "aliases": list(w.aliases),
                }
            )
        return rows
    for ref in job_params(client, job):
        values = _pull_param(client, job, ref)
        holders = [
            p.server
            for p in slicing.pieces(ref.buffer_numel, n, ref.offset, ref.offset + ref.numel)
        ]
        rows.append(
            {
                "name": ref.name,
                "shape": list(ref.shape),
                "dtype": ref.dtype,
                "servers": holders,
                "version": ref.version,
                "buffer": ref.buffer,
                **_stats(values),
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


def _snapshot_jobs(
    client: ShardClient,
    jobs: list[str],
    tag: str,
    statuses: list[Any],
    hybrid: dict[str, Any] | None = None,
) -> tuple[int, dict[str, dict[str, Any]]]:
    """Snapshots every job of ``jobs`` at one version (the newest any of their buffers has
    reached, on any server); returns it and each job's committed manifest. ``hybrid`` (the
    base name and its part jobs) goes into each manifest, so offline export knows every part."""
    versions = {
        job: [b.version for st in statuses for j in st.jobs if j.job == job for b in j.buffers]
        for job in jobs
    }
    for job, found in versions.items():
        if not found:
            raise KeyError(f"job '{job}' is not on the servers")
    version = max(max(v) for v in versions.values())
    # The jobs furthest on first: each is captured as soon as its call arrives, before the
    # others' steps let it move past the version.
    order = sorted(jobs, key=lambda job: -max(versions[job]))
    n = client.num_servers
    for attempt in range(5):
        try:
            flat = client.run(
                Call(
                    i,
                    "Snapshot",
                    pb.SnapshotRequest(
                        job=job, tag=tag, version=version, server_index=i, num_servers=n
                    ),
                )
                for job in order
                for i in range(n)
            )
            break
        except ShardClientError as exc:
            # training stepped past the version between Status and Snapshot: aim further
            if "past the snapshot's" not in exc.details or attempt == 4:
                raise
            version += 1
    manifests = {}
    for k, job in enumerate(order):
        replies = flat[k * n : (k + 1) * n]
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
        if hybrid is not None:
            manifest["hybrid"] = hybrid
        manifests[job] = manifest
    # committed only once every job's shards are written
    client.run(
        Call(
            i,
            "CommitSnapshot",
            pb.CommitSnapshotRequest(job=job, tag=tag, manifest_json=json.dumps(manifests[job])),
        )
        for job in jobs
        for i in range(n)
    )
    return version, manifests


def snapshot(client: ShardClient, job: str, tag: str) -> dict[str, Any]:
    """Takes a snapshot of ``job`` on one version while training runs; returns the manifest.

    The version is the newest any buffer has reached: every server captures each buffer as
    it arrives there (before its next step), writes its shard, and then the manifest is
    committed on every server.

    Of a 3D job's base name: every part ``job.pp<s>.tp<t>`` at one version (the parts step in
    lockstep), each a snapshot of its own under ``tag``, committed once all are written;
    returns a summary: job, tag, version, num_servers, parts.
    """
    statuses = [client.call(i, "Status", pb.StatusRequest()) for i in range(client.num_servers)]
    on_first = [j.job for j in statuses[0].jobs]
    parts = find_parts(job, on_first) if job not in on_first else {}
    if parts:
        check_complete(job, parts)
        names = list(parts.values())
        version, _ = _snapshot_jobs(client, names, tag, statuses, {"base": job, "parts": names})
        return {
            "job": job,
            "tag": tag,
            "version": version,
            "num_servers": client.num_servers,
            "parts": names,
        }
    hybrid = None
    parsed = parse_part_job(job)
    if parsed is not None:  # one part of a 3D job (HybridShardedModel.save_checkpoint)
        hybrid = {"base": parsed[0], "parts": list(find_parts(parsed[0], on_first).values())}
    _, manifests = _snapshot_jobs(client, [job], tag, statuses, hybrid)
    return manifests[job]


def _snapshot_parts(
    client: ShardClient, job: str, tag: str
) -> tuple[dict[tuple[int, int], str], str]:
    """For restoring ``job``: its parts with snapshot ``tag`` and that tag resolved, when
    ``job`` is a 3D job's base name with snapshots of its parts; ({}, tag) for a plain job."""
    try:
        live = _jobs(client)
        if job in live:
            return {}, tag
        rows = list_snapshots(client)
    except ShardClientError:
        return {}, tag  # no snapshot directory and the like: the plain restore says so
    if any(r["job"] == job for r in rows):
        return {}, tag
    by_tag: dict[str, dict[tuple[int, int], dict[str, Any]]] = {}
    for r in rows:
        parsed = parse_part_job(r["job"])
        if parsed is not None and parsed[0] == job:
            by_tag.setdefault(r["tag"], {})[parsed[1], parsed[2]] = r
    if not by_tag:
        return {}, tag
    expected = list(find_parts(job, live).values())  # a job still registered has all its parts
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


def restore(client: ShardClient, job: str, tag: str = "latest", contributors: int = 0) -> int:
    """Loads snapshot ``tag`` into these servers (any number: resharded); returns its version.

    Of a 3D job's base name: every part's snapshot ``tag`` ("latest": the newest tag every
    part has); all parts are read and checked on every server before any server swaps any."""
    n = client.num_servers
    parts, tag = _snapshot_parts(client, job, tag)
    jobs = list(parts.values()) or [job]

    def request(job: str, i: int, tag: str, check_only: bool) -> pb.RestoreRequest:
        return pb.RestoreRequest(
            job=job,
            tag=tag,
            server_index=i,
            num_servers=n,
            contributors=contributors,
            check_only=check_only,
        )

    # Phase one: every server reads and checks its part of every job; only then does any
    # server swap, so a snapshot that one server cannot load leaves every server as it was.
    checks = client.run(
        Call(i, "Restore", request(j, i, tag, True)) for j in jobs for i in range(n)
    )
    tags = {c.tag for c in checks}
    if len(tags) != 1:
        raise RuntimeError(f"servers resolve {tag!r} to different snapshots {sorted(tags)}")
    resolved = tags.pop()
    held = {j: checks[k * n].version for k, j in enumerate(jobs)}
    if len(set(held.values())) != 1:
        raise RuntimeError(
            f"the parts of snapshot '{job}/{resolved}' hold different versions"
            f" ({', '.join(f'{j}: {v}' for j, v in held.items())}); nothing was restored"
        )
    replies = client.run(
        Call(i, "Restore", request(j, i, resolved, False)) for j in jobs for i in range(n)
    )
    versions = {r.version for r in replies}
    if len(versions) != 1:
        raise RuntimeError(f"servers restored different versions {sorted(versions)}")
    return versions.pop()


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
    hybrid = _live_hybrid(client, job)
    if hybrid is not None:
        params, version = hybrid
        items = whole_items(params)
        meta = {"job": job, "version": str(version), "parts": ",".join(_part_names(params))}
        write_safetensors(out, items, meta)
        return len(items)
    refs = job_params(client, job)
    items = list(
        _export_items(
            (
                r.name,
                export_dtype(r.dtype),
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
