"""Which snapshot a restore loads (client/snapshot_layouts.py), from the servers' listing
alone: "latest" across a job's data-parallel snapshots and its 3D parts' snapshots (a run that
moved from FSDP to 3D and back under one job name), and which layout refuses which
(``OtherLayout``, whose tag is the one to carry). Listing rows as ``list_snapshots`` makes
them; the live jobs as ``server_jobs`` reports them (only their names matter here).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from paramshard.client.snapshot_layouts import PLAIN, OtherLayout, snapshot_parts

JOB = "run"
PARTS = [f"{JOB}.pp{s}.tp0" for s in range(2)]  # 2 stages x 1 tensor rank


def plain(tag: str, at: float) -> dict[str, Any]:
    return {"job": JOB, "tag": tag, "version": int(at), "created_unix": at}


def parts(tag: str, at: float, names: list[str] = PARTS) -> list[dict[str, Any]]:
    return [
        {"job": n, "tag": tag, "version": int(at), "created_unix": at, "hybrid": {"parts": names}}
        for n in names
    ]


def held(*live: str) -> Any:
    return SimpleNamespace(status={j: None for j in live}, jobs=sorted(live))


def test_latest_is_the_newest_of_either_kind():
    older_3d = [plain("a", 1), *parts("b", 2), plain("c", 3)]
    newer_3d = [plain("a", 1), *parts("b", 4), plain("c", 3)]
    # a data-parallel model (its job live) takes its own newest, or carries a newer 3D one
    assert snapshot_parts(held(JOB), older_3d, JOB, "latest", PLAIN, "") == ({}, "c")
    with pytest.raises(OtherLayout) as err:
        snapshot_parts(held(JOB), newer_3d, JOB, "latest", PLAIN, "")
    assert err.value.tag == "b" and "is data-parallel" in str(err.value)
    # a 3D model of the snapshot's layout takes it; of another, or a newer plain one, carries
    found, tag = snapshot_parts(held(*PARTS), newer_3d, JOB, "latest", (2, 1), "")
    assert (found, tag) == ({(0, 0): PARTS[0], (1, 0): PARTS[1]}, "b")
    with pytest.raises(OtherLayout) as err:
        snapshot_parts(held(*PARTS), newer_3d, JOB, "latest", (1, 2), "")
    assert err.value.tag == "b" and "2 stage(s) x 1 tensor rank(s) parts" in str(err.value)
    with pytest.raises(OtherLayout) as err:
        snapshot_parts(held(*PARTS), older_3d, JOB, "latest", (2, 1), "")
    assert err.value.tag == "c" and "a data-parallel job's parameters" in str(err.value)


def test_a_named_tag_and_the_copy_a_carry_loads():
    rows = [plain("a", 1), *parts("a", 2), *parts("b", 3)]
    # one tag of both kinds: each model takes its own kind
    assert snapshot_parts(held(JOB), rows, JOB, "a", PLAIN, "") == ({}, "a")
    assert snapshot_parts(held(*PARTS), rows, JOB, "a", (2, 1), "")[1] == "a"
    # loaded as another name (the carry's copy): as taken, whatever is live
    found, tag = snapshot_parts(held(JOB), rows, JOB, "b", None, "copy")
    assert tag == "b" and sorted(found.values()) == PARTS
    assert snapshot_parts(held(*PARTS), rows, JOB, "a", None, "copy") == ({}, "a")
    # a tool restoring as taken: a live plain job restores as itself, as before
    assert snapshot_parts(held(JOB), rows, JOB, "b", None, "") == ({}, "b")
    with pytest.raises(KeyError, match="no snapshot 'z' of its parts"):
        snapshot_parts(held(*PARTS), rows, JOB, "z", (2, 1), "")
    # a tag neither kind has, where only plain ones exist: not taken for one to carry
    with pytest.raises(KeyError, match="no snapshot 'z'; tags: a"):
        snapshot_parts(held(*PARTS), [plain("a", 1)], JOB, "z", (2, 1), "")


def test_latest_skips_an_incomplete_3d_tag():
    rows = [plain("a", 1), *parts("b", 2)[:1]]  # stage 1's snapshot of "b" is missing
    with pytest.raises(OtherLayout) as err:
        snapshot_parts(held(*PARTS), rows, JOB, "latest", (2, 1), "")
    assert err.value.tag == "a"  # the newest one that is whole
