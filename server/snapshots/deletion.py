"""Removing one tag of a job from a snapshot folder (``DeleteSnapshot``), and finding the torn
ones (``ListSnapshots`` with ``torn``).

Nothing else ever removes a snapshot: a job that snapshots every few hundred steps fills its
disk, and a failed attempt (a torn tag: shards and no manifest) stays for good. The manifest
goes first, so the tag stops counting (listings, ``latest``) before any shard it names is
gone; then the shard files, the temporary files of writes that never finished, and the
markers of Snapshot calls that are gone; then the folder, when nothing else is in it.

Only names a snapshot writes are removed (files.py, folders.py ``write_once``,
reservations.py), and only plain files: anything else planted in the folder (a link, a
folder, a file of another name) is left, and named in the reply, with the folder itself.
Everything is reached through descriptors without following a link (folders.py).

The caller (server/snapshot_calls.py) refuses a tag that this server is writing, committing
or restoring (a restore from its check until it loads); a live Snapshot call of any process,
seen by its marker, refuses it here. Servers sharing the folder are all asked, first whether
they would (``check_only``), then to do it: the first removes the tag, the others find
nothing.

A torn tag is a folder with shard files and no manifest: a Snapshot whose commit never came
(a server failed during it, or it is under way). Listings leave it out unless asked, and its
name is refused at the version its shards hold; ``torn_tags`` finds them, to be deleted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paramshard.protos.placement import MAX_SERVERS
from paramshard.server.runtime.errors import ShardError
from paramshard.server.snapshots.folders import Folder, open_root
from paramshard.server.snapshots.reservations import no_writers
from paramshard.server.snapshots.shards import shard_version

__all__ = ["Removed", "remove_tag", "torn_tags"]

_SHARD = re.compile(r"shard-[0-9]+-of-([0-9]+)\.safetensors")  # group 1: the servers
_OURS = re.compile(
    rf"manifest\.json|{_SHARD.pattern}"  # a snapshot's files
    rf"|\.(?:manifest\.json|{_SHARD.pattern})\.[0-9a-f]{{12}}"  # ``write_once``'s unfinished
    rf"|\.\.{_SHARD.pattern}\.reserved\.[0-9a-f]{{12}}"  # ... of a marker (reservations.py)
)
KEPT_NAMED = 100
"""Entries kept (not a snapshot's) named in a reply at most; the rest are counted."""


@dataclass
class Removed:
    """What a deletion found and removed (or, checking, would remove)."""

    found: bool = False
    complete: bool = False
    files: int = 0
    bytes: int = 0
    kept: list[str] = field(default_factory=list)


def remove_tag(root: Path, job: str, tag: str, what: str, check_only: bool = False) -> Removed:
    """Removes folder ``tag`` of ``job`` under ``root`` (names checked by the caller); with
    ``check_only``, changes nothing and says what it would remove. ``what`` names the snapshot
    in errors."""
    done = Removed()
    try:
        top = open_root(root)
    except FileNotFoundError:
        return done
    with top:
        try:
            jdir = top.child(job)
        except FileNotFoundError:
            return done
        with jdir:
            try:
                tdir = jdir.child(tag)
            except FileNotFoundError:
                return done
            done.found = True
            # the folder goes under the lock too: a Snapshot of this process that comes for
            # the tag meanwhile takes its marker in a new folder, never in this one
            with tdir, no_writers(tdir, what, tidy=not check_only):
                names = [n for n, kind in tdir.entries() if kind == "file" and _OURS.fullmatch(n)]
                done.complete = "manifest.json" in names
                for name in sorted(names, key=lambda n: n != "manifest.json"):  # manifest first
                    try:
                        size = tdir.size(name)
                        if not check_only:
                            tdir.unlink(name)
                    except FileNotFoundError:  # another server of a shared folder took it
                        continue
                    done.files, done.bytes = done.files + 1, done.bytes + size
                done.kept = [n for n, _ in tdir.entries() if not check_only or n not in names]
                if not done.kept and not check_only:
                    _rmdir(jdir, tag, done)
    return done


def _rmdir(jdir: Folder, tag: str, done: Removed) -> None:
    try:
        jdir.rmdir(tag)
    except FileNotFoundError:
        pass
    except OSError:  # written to meanwhile (another process's new Snapshot of the tag)
        try:
            with jdir.child(tag) as tdir:
                done.kept = [n for n, _ in tdir.entries()]
        except OSError:
            pass


def torn_tags(jdir: Folder, job: str) -> list[dict[str, Any]]:
    """The torn tags in ``job``'s folder ``jdir``, oldest first: job, tag, version (of the newest
    shard there; 0 when it cannot be read), num_servers, created_unix (that shard's time)."""
    found = []
    for tag, kind in jdir.entries():
        if kind != "folder":
            continue
        try:
            with jdir.child(tag) as tdir:
                if tdir.kind("manifest.json") is not None:
                    continue
                shards = [
                    (n, m) for n, k in tdir.entries() if k == "file" and (m := _SHARD.fullmatch(n))
                ]
                if not shards:
                    continue
                newest, named = max(shards, key=lambda s: tdir.mtime_ns(s[0]))
                num = int(named.group(1))
                if not 1 <= num <= MAX_SERVERS:  # its reply failed: not ours
                    continue
                row = {
                    "job": job,
                    "tag": tag,
                    "version": shard_version(tdir, newest) or 0,
                    "num_servers": num,
                    "created_unix": tdir.mtime_ns(newest) / 1e9,
                    "torn": True,
                }
        except (OSError, ShardError):  # gone meanwhile, or a link planted: not listed
            continue
        found.append(row)
    return sorted(found, key=lambda r: r["created_unix"])
