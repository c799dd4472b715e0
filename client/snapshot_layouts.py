"""Which snapshot a restore loads, and whether the model that asks can take it as it is:
a plain (data-parallel) job's snapshot, or the parts of a 3D job's (``<job>.pp<s>.tp<t>``),
"latest" resolved across both; a snapshot of another layout than the model's is
``OtherLayout`` (its ``load_checkpoint`` carries it: client/carry.py)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from paramshard.client.jobs import ServerJobs
from paramshard.client.tensor_parts import (
    PartsError,
    check_complete,
    find_parts,
    newest_complete_tag,
    part_snapshots,
    recorded_parts,
)
from paramshard.protos.manifest import taken_order

__all__ = ["PLAIN", "OtherLayout", "snapshot_parts"]


PLAIN = (0, 0)
"""``restore``'s ``layout`` for a data-parallel model: one job of its own name, no parts."""


def snapshot_parts(
    held: ServerJobs, rows: list[dict[str, Any]], job: str, tag: str, layout: Any, into: str
) -> tuple[dict[tuple[int, int], str], str]:
    """For restoring ``job``: its parts with snapshot ``tag`` and that tag resolved, when the
    snapshot is of a 3D job's parts under base name ``job``; ({}, tag) for a plain job's.
    ``layout`` None restores a snapshot as it was taken, and the parts registered live must
    all be in it; a model's (``PLAIN``, or its (stages, tensor ranks)) refuses a snapshot of
    another layout with OtherLayout (its ``load_checkpoint`` then carries it)."""
    plain = [r for r in rows if r["job"] == job]
    by_tag = part_snapshots(job, rows)
    if not by_tag or (job in held.status and layout is None and not into):
        return _plain(job, plain, tag, layout)  # a live plain job restores as itself
    live = layout is None and not into  # a registered job has all its parts
    expected = list(find_parts(job, held.jobs).values()) if live else []
    if tag == "latest":
        try:
            tag = newest_complete_tag(job, by_tag, expected)
        except PartsError:
            if not plain:
                raise
            tag = ""  # none has every part: the newest plain one
        newest = max(plain, key=taken_order, default=None)
        if newest is not None and (
            not tag or taken_order(newest) > max(map(taken_order, by_tag[tag].values()))
        ):
            return _plain(job, plain, newest["tag"], layout)
    if any(r["tag"] == tag for r in plain) and (tag not in by_tag or layout in (None, PLAIN)):
        return _plain(job, plain, tag, layout)
    if tag not in by_tag:
        raise KeyError(
            f"job '{job}' has no snapshot '{tag}' of its parts; tags: {', '.join(sorted(by_tag))}"
        )
    found = by_tag[tag]
    recorded = recorded_parts(found.values())
    taken = set(found) | set(find_parts(job, recorded))  # the layout the snapshot was taken in
    if layout is not None and _dims(taken) != tuple(layout):
        raise OtherLayout(tag, _other(job, tag, _said(_dims(taken)) + " parts", layout))
    check_complete(job, found, expected + recorded, f"snapshot '{tag}' of job '{job}'")
    return {k: r["job"] for k, r in sorted(found.items())}, tag


def _plain(job: str, plain: list[dict[str, Any]], tag: str, layout: Any) -> tuple[dict, str]:
    """A plain job's snapshot ``tag`` (``latest``: resolved by the servers, unless a 3D
    model's ``layout`` refuses it: OtherLayout, with the newest tag)."""
    if layout is None or tuple(layout) == PLAIN:
        return {}, tag
    if tag == "latest":
        if not plain:
            return {}, tag  # nothing to carry: the servers' refusal names the job
        tag = max(plain, key=taken_order)["tag"]
    if not any(r["tag"] == tag for r in plain):
        tags = ", ".join(sorted({r["tag"] for r in plain})) or "none"
        raise KeyError(f"job '{job}' has no snapshot '{tag}'; tags: {tags}")
    raise OtherLayout(tag, _other(job, tag, "a data-parallel job's parameters", layout))


def _other(job: str, tag: str, holds: str, layout: Any) -> str:
    loads = "is data-parallel" if tuple(layout) == PLAIN else f"has {_said(layout)}"
    return (
        f"snapshot '{tag}' of job '{job}' holds {holds}, and the job that loads it {loads}:"
        " a restore loads a snapshot into the layout it was taken in (the"
        " data-parallel size may change); the model's load_checkpoint carries it to another"
    )


class OtherLayout(PartsError):
    """A 3D snapshot taken in another pipeline x tensor layout than the restore's; ``tag``:
    the snapshot's (resolved, where "latest" was asked)."""

    def __init__(self, tag: str, message: str) -> None:
        super().__init__(message)
        self.tag = tag


def _dims(parts: Iterable[tuple[int, int]]) -> tuple[int, int]:
    """A 3D job's (stages, tensor ranks) from its parts (a part missing inside the grid is
    check_complete's to name)."""
    keys = list(parts)
    return max(s for s, _ in keys) + 1, max(t for _, t in keys) + 1


def _said(dims: tuple[int, int]) -> str:
    return f"{dims[0]} stage(s) x {dims[1]} tensor rank(s)"
