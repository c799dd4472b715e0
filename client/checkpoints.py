"""Keep a job and bring it back: ``snapshot``, ``restore``, ``list_snapshots`` (neighbour
replication is client/replicas.py).

A snapshot captures every buffer of a job at one version while training runs; every server
holding the job writes its shard, and the client commits the manifest (docs/design.md §5.1),
which records the servers the slices came from: a restore into a cluster of the same size
puts every slice back where it was, into another size it reshards over every server. Of a
3D job's base name, ``snapshot`` takes every part at one version and ``restore`` checks every
part on every server before any server swaps any.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from paramshard.client.jobs import ServerJobs, server_jobs
from paramshard.client.rpc import Call, ShardClientError, unusable_reply
from paramshard.client.shard_client import ShardClient
from paramshard.client.snapshot_layouts import snapshot_parts
from paramshard.client.tensor_parts import (
    PartsError,
    check_complete,
    find_parts,
    recorded_parts,
)
from paramshard.protos import codec
from paramshard.protos import shard_pb2 as pb
from paramshard.protos.manifest import ParamEntry, new_manifest, taken_order
from paramshard.protos.placement import MAX_SERVERS, parse_part_job, part_job, restore_placement

__all__ = ["snapshot", "restore", "list_snapshots"]


def _every_call(client: ShardClient, calls: list[Call]) -> list[Any]:
    """Each call's reply, or its ShardClientError, every call run to its end. One ``run`` of
    them all would cancel the rest at the first failure, but a server goes on with a
    cancelled Snapshot, holding its shard until written: the next attempt would find it
    taken ("being written by another Snapshot call")."""

    def one(call: Call) -> Any:
        try:
            return client.run([call])[0]
        except ShardClientError as exc:
            return exc

    with ThreadPoolExecutor(min(16, len(calls)), thread_name_prefix="snapshot") as pool:
        return list(pool.map(one, calls))


def _snapshot_jobs(
    held: ServerJobs, jobs: list[str], tag: str, hybrid: dict[str, Any] | None = None
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
        flat = _every_call(
            client,
            [
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
            ],
        )
        failed = [r for r in flat if isinstance(r, ShardClientError)]
        if not failed:
            break
        # training stepped past the version between Status and Snapshot: aim further
        if attempt == 4 or not all("past the snapshot's" in e.details for e in failed):
            raise next((e for e in failed if "past the snapshot's" not in e.details), failed[0])
        version += 1
    manifests, k = {}, 0
    for job in order:
        n = len(servers[job])
        replies, k = flat[k : k + n], k + n
        listed = {tuple((b.buffer, b.numel) for b in r.buffers) for r in replies}
        if len(listed) > 1:  # a buffer registered or dropped while the shards were written
            raise RuntimeError(
                f"snapshot '{tag}' of job '{job}': its servers' shards hold different buffers"
                f" {sorted(sorted(name for name, _ in x) for x in listed)}; not committed,"
                " snapshot again under another tag once the job's buffers are registered"
            )
        buffers = {
            b.buffer: {
                "numel": b.numel,
                "master_dtype": codec.master_dtype(b.dtype),
                "contributors": b.contributors,
                "optimizer": {"name": b.optimizer, "hyper": dict(b.hyper)},
                "params": [ParamEntry.from_pb(p).to_manifest() for p in b.params],
            }
            for b in replies[0].buffers
        }
        shards = [
            {"file": r.file, "server": i, "bytes": r.bytes, "sha256": r.sha256}
            for i, r in enumerate(replies)
        ]
        where = [client.servers[s] for s in servers[job]]  # in the whole cluster
        manifest = new_manifest(
            job,
            tag,
            version,
            n,
            buffers,
            shards,
            where,
            client.cluster_size,
            held.status[job].model_config,
        )
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
    returns a summary: job, tag, version, parts and each part's servers (in the cluster).
    """
    held = server_jobs(client)
    parts = find_parts(job, held.jobs) if job not in held.status else {}
    if parts:
        check_complete(job, parts)
        names = list(parts.values())
        version, manifests = _snapshot_jobs(held, names, tag, {"base": job, "parts": names})
        return {
            "job": job,
            "tag": tag,
            "version": version,
            "parts": names,
            "servers": {name: manifests[name]["servers"] for name in names},
        }
    if job not in held.status:
        raise held.not_found(job)
    hybrid = None
    parsed = parse_part_job(job)
    if parsed is not None:  # one part of a 3D job (HybridShardedModel.save_checkpoint)
        hybrid = {"base": parsed[0], "parts": list(find_parts(parsed[0], held.jobs).values())}
    _, manifests = _snapshot_jobs(held, [job], tag, hybrid)
    return manifests[job]


def _restore_servers(held: ServerJobs, row: dict[str, Any] | None, job: str) -> list[int]:
    """Where to restore ``job``: the servers it is registered on (a trainer registered it
    before restoring); else, in the cluster the snapshot was taken in, the servers it was on
    (a server restarted empty gets its own slice back); else every server (resharded)."""
    client = held.client
    live = held.placement(job)
    if live is not None:
        return live
    home = None if row is None else restore_placement(row, client.cluster_size)
    if home is not None and all(g in client.servers for g in home):
        return [client.servers.index(g) for g in home]
    return list(range(client.num_servers))


def restore(
    client: ShardClient,
    job: str,
    tag: str = "latest",
    contributors: int = 0,
    layout: tuple[int, int] | None = None,
    into: str = "",
) -> int:
    """Loads snapshot ``tag`` into the servers (any number: resharded); returns its version.

    A job registered on the servers is restored into its own servers; one that is not, into
    the servers it was snapshotted from when the cluster is the same, else into every server.
    Of a 3D job's base name: every part's snapshot ``tag`` ("latest": the newest tag every
    part has). Every job is read and checked on every server before any server swaps any.
    ``layout``: (stages, tensor ranks) of the 3D model that loads it; a snapshot of another
    is refused before anything is restored (the live parts cannot say: a recovery finds some
    of them lost). ``into``: loads it as that job (a 3D job's parts as ``into``'s parts)
    beside the live ones, which stay as they are; the servers refuse a name they hold."""
    held = server_jobs(client)
    try:
        rows = list_snapshots(client)
    except ShardClientError:
        rows = []  # no snapshot directory and the like: the servers' Restore says so
    parts, tag = snapshot_parts(held, rows, job, tag, layout, into)
    jobs = list(parts.values()) or [job]
    if tag == "latest" and not parts:  # the newest, as the servers would resolve it
        tag = next((r["tag"] for r in reversed(rows) if r["job"] == job), tag)
    recorded = {r["job"]: r for r in rows if r["tag"] == tag}
    named = {j: into for j in jobs}  # the names loaded as ("": their own)
    if into and parts:
        named = {j: part_job(into, s, t) for (s, t), j in parts.items()}
    servers = {j: _restore_servers(held, recorded.get(j), named[j] or j) for j in jobs}

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
                    run=client.run_id,  # a rank recovering its own job (or a tool: no run)
                    into=named[j],
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
    owners = [j for j in jobs for _ in servers[j]]  # the job of each check, in call order
    versions = {j: c.version for j, c in zip(owners, checks, strict=True)}
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


def recovery_tag(client: ShardClient, job: str, loaded: tuple[str, float] | None) -> str:
    """The snapshot a recovery restores: "latest", unless ``loaded`` (a tag this process
    restored, and its ``time.time()`` then) and no snapshot of ``job`` was taken since: then
    that tag. Those taken before it belong to the history the load left (a rollback), and
    the newest of them was "latest". (Times from two hosts' clocks are compared here.)"""
    if loaded is None:
        return "latest"
    tag, at = loaded
    rows = list_snapshots(client, job, combine_parts=True)
    return "latest" if any(r["job"] == job and r["created_unix"] >= at for r in rows) else tag


def list_snapshots(
    client: ShardClient, job: str = "", combine_parts: bool = False, torn: bool = False
) -> list[dict[str, Any]]:
    """The complete snapshots in server 0's snapshot directory, oldest first. With
    ``combine_parts``, the part snapshots of a 3D job under one tag (every part there, all at
    one version) make one row under the base name, with "parts"; ``job`` may then be a base.
    With ``torn``, then the torn tags (shards, no manifest: never committed), each with
    "torn", one row per part of a 3D job."""
    reply = client.call(0, "ListSnapshots", pb.ListSnapshotsRequest(job=job, torn=torn))
    for s in reply.snapshots:  # a count is expanded into a list below
        if max(s.num_servers, len(s.servers), s.cluster_servers) > MAX_SERVERS:
            why = f"snapshot {s.job[:256]!r} {s.tag[:256]!r} of {s.num_servers:,} servers"
            why += f" ({len(s.servers):,} listed of {s.cluster_servers:,}; at most {MAX_SERVERS:,})"
            raise unusable_reply(client, 0, "ListSnapshots", why)
    rows = [
        {
            "job": s.job,
            "tag": s.tag,
            "version": s.version,
            "num_servers": s.num_servers,
            "created_unix": s.created_unix,
            "servers": list(s.servers) or list(range(s.num_servers)),
            "cluster_servers": s.cluster_servers or s.num_servers,
            **({"hybrid": {"parts": list(s.parts)}} if s.parts else {}),
            **({"torn": True} if s.torn else {}),
        }
        for s in reply.snapshots
    ]
    if not combine_parts:
        return rows
    if job and not rows:  # maybe a 3D job's base name
        rows = [
            r
            for r in list_snapshots(client, torn=torn)
            if (parsed := parse_part_job(r["job"])) is not None and parsed[0] == job
        ]
    torn_rows = [r for r in rows if r.get("torn")]
    rows = [r for r in rows if not r.get("torn")]
    groups: dict[tuple[str, str], dict[tuple[int, int], dict[str, Any]]] = {}
    for r in rows:
        parsed = parse_part_job(r["job"])
        if parsed is not None:
            groups.setdefault((parsed[0], r["tag"]), {})[parsed[1], parsed[2]] = r
    out, merged = [], set()
    for (base, tag), found in groups.items():
        try:  # the parts each manifest recorded: a tag some part lacks is not complete
            check_complete(base, found, recorded_parts(found.values()))
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
    return sorted(out, key=taken_order) + torn_rows
