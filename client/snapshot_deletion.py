"""Deleting snapshots: one tag of a job (``delete_snapshot``), or all but the ones taken last
(``prune_snapshots``, what ``train_with_recovery(keep_last=...)`` runs after each checkpoint,
as torchtitan's ``keep_latest_k`` does).

Every server of the cluster is asked (``DeleteSnapshot``), twice: first whether it would
(``check_only``), then to do it. Servers share one folder, so a server that is writing,
committing or restoring the tag must refuse (FAILED_PRECONDITION) before another removes the
files; the first to delete removes them, and the others find nothing. A 3D job's base name
stands for every part's snapshot of the tag, torn parts included (written before a failure,
never committed: ``list_snapshots(..., torn=True)`` shows them).
"""

from __future__ import annotations

import re
from typing import Any

from paramshard.client.checkpoints import list_snapshots
from paramshard.client.jobs import server_jobs
from paramshard.client.rpc import Call
from paramshard.client.shard_client import ShardClient
from paramshard.client.tensor_parts import find_parts
from paramshard.protos import shard_pb2 as pb
from paramshard.protos.placement import parse_part_job

__all__ = ["delete_snapshot", "prune_snapshots"]


def delete_snapshot(client: ShardClient, job: str, tag: str) -> dict[str, Any]:
    """Removes snapshot ``tag`` of ``job`` (or of every part of 3D job ``job``) from every
    server's folder; returns what was removed: job, tag, jobs, files, bytes, complete (and
    kept: what no snapshot writes, left in place). KeyError when no server had it.

    Every server is asked first whether it would (``check_only``): servers share one folder,
    so one that is writing or restoring the tag must stop the deletion before another removes
    the files. A server that begins to use the tag after its check may still find it gone
    (its call then fails FAILED_PRECONDITION, saying so)."""
    return _delete(client, job, tag, _Jobs(client).of(job, tag))


def _delete(client: ShardClient, job: str, tag: str, jobs: list[str]) -> dict[str, Any]:
    """``delete_snapshot`` of ``tag`` from the folders of ``jobs`` (``job``'s, or its parts')."""

    def each(check_only: bool) -> list[Any]:
        return client.run(
            Call(
                server,
                "DeleteSnapshot",
                pb.DeleteSnapshotRequest(job=j, tag=tag, check_only=check_only),
            )
            for j in jobs
            for server in range(client.num_servers)
        )

    if not any(r.found for r in each(True)):
        raise KeyError(f"job '{job}' has no snapshot '{tag}' on any server")
    replies = each(False)
    if not any(r.found for r in replies):  # between the two asks
        raise KeyError(f"job '{job}' snapshot '{tag}' was deleted meanwhile by another caller")
    kept = sorted({name for r in replies for name in r.kept})
    more = max((r.more_kept for r in replies), default=0)
    return {
        "job": job,
        "tag": tag,
        "jobs": jobs,
        "files": sum(r.files for r in replies),
        "bytes": sum(r.bytes for r in replies),
        "complete": any(r.complete for r in replies),
        **({"kept": kept + ([f"... and {more} more"] if more else [])} if kept else {}),
    }


class _Jobs:
    """The jobs whose folders a tag is deleted from, found from one listing of every job's
    snapshots (torn ones too) and at most one Status of the servers, however many tags are
    asked about (a prune's)."""

    def __init__(self, client: ShardClient) -> None:
        self.client = client
        self._rows: list[dict[str, Any]] | None = None
        self._held: Any = None

    def of(self, job: str, tag: str) -> list[str]:
        """``job``'s own, or, for a 3D job's base name, its parts' (those registered on the
        servers, and those its listed snapshots of ``tag`` name)."""
        if self._rows is None:
            self._rows = list_snapshots(self.client, torn=True)
        if any(r["job"] == job for r in self._rows):
            return [job]
        if self._held is None:
            self._held = server_jobs(self.client)
        if job in self._held.status:
            return [job]
        parts = set(find_parts(job, self._held.jobs).values())
        for r in self._rows:
            parsed = parse_part_job(r["job"])
            if parsed is not None and parsed[0] == job and r["tag"] == tag:
                parts.update(r.get("hybrid", {}).get("parts", [r["job"]]))
        return sorted(parts) or [job]


def prune_snapshots(
    client: ShardClient,
    job: str,
    keep_last: int,
    prefix: str | None = None,
) -> list[dict[str, Any]]:
    """Deletes the complete snapshots of ``job`` (a 3D job's: by base name), all but the
    ``keep_last`` taken last; returns what each deletion removed,
    oldest first. With ``prefix`` (``train_with_recovery``'s ``tag_prefix``, "" included),
    only the tags it names its checkpoints, ``<prefix>-<step>`` with its ``-e<epoch>`` and
    ``.<n>`` forms (a tag saved by hand in that form is taken for one). Torn tags (of that
    form) older than the newest snapshot kept are deleted too; a newer one may be under way.
    A tag deleted by another caller meanwhile is skipped. KeyError when ``job`` has no
    snapshot at all (a name mistyped)."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, not {keep_last}")
    own = None
    if prefix is not None:
        own = re.compile(rf"{re.escape(prefix)}-[0-9]+(-e[0-9]+)?(\.[0-9]+)?")
    listed = [
        r
        for r in list_snapshots(client, job, combine_parts=True, torn=True)
        if job in (r["job"], _base(r["job"]))
    ]  # complete ones oldest first (taken order), then the torn ones
    if not listed:  # a name mistyped: not "nothing to delete"
        raise KeyError(f"job '{job}' has no snapshot on the servers")
    rows = [r for r in listed if own is None or own.fullmatch(r["tag"])]
    # of a 3D job, a part's row is a tag some other part lacks: torn for the job
    done = [r for r in rows if r["job"] == job and not r.get("torn")]
    torn = [r for r in rows if r["job"] != job or r.get("torn")]
    doomed = [r["tag"] for r in done[: max(0, len(done) - keep_last)]]
    if done:
        newest = done[-1]["created_unix"]
        doomed += [r["tag"] for r in torn if r["created_unix"] < newest]
    jobs = _Jobs(client)  # each tag's folders, found before any deletion
    found = [(tag, jobs.of(job, tag)) for tag in dict.fromkeys(doomed)]  # a 3D tag: once
    gone = []
    for tag, folders in found:
        try:
            gone.append(_delete(client, job, tag, folders))
        except KeyError:  # deleted meanwhile (another prune: a job's own, a cron's)
            continue
    return gone


def _base(job: str) -> str:
    """The job a listing's row belongs to: a 3D job's part's base name, else its own."""
    parsed = parse_part_job(job)
    return job if parsed is None else parsed[0]
