"""Removing one tag of a job from a snapshot folder (``DeleteSnapshot``).

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
or restoring; a live Snapshot call of any process, seen by its marker, refuses it here.
Servers sharing the folder may all be asked: the first removes the tag, the others find
nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from paramshard.server.snapshots.folders import Folder, open_root
from paramshard.server.snapshots.reservations import no_writers

__all__ = ["Removed", "remove_tag"]

_SHARD = r"shard-[0-9]+-of-[0-9]+\.safetensors"
_OURS = re.compile(
    rf"manifest\.json|{_SHARD}"  # a snapshot's files
    rf"|\.(?:manifest\.json|{_SHARD})\.[0-9a-f]{{12}}"  # ``write_once``'s unfinished writes
)


@dataclass
class Removed:
    """What a deletion found and removed."""

    found: bool = False
    complete: bool = False
    files: int = 0
    bytes: int = 0
    kept: list[str] = field(default_factory=list)


def remove_tag(root: Path, job: str, tag: str, what: str) -> Removed:
    """Removes folder ``tag`` of ``job`` under ``root`` (names checked by the caller);
    ``what`` names the snapshot in errors."""
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
            with tdir, no_writers(tdir, what):
                names = [n for n, kind in tdir.entries() if kind == "file" and _OURS.fullmatch(n)]
                done.complete = "manifest.json" in names
                for name in sorted(names, key=lambda n: n != "manifest.json"):  # manifest first
                    try:
                        size = tdir.size(name)
                        tdir.unlink(name)
                    except FileNotFoundError:  # another server of a shared folder took it
                        continue
                    done.files, done.bytes = done.files + 1, done.bytes + size
                done.kept = [n for n, _ in tdir.entries()]
            if not done.kept:
                try:
                    jdir.rmdir(tag)
                except FileNotFoundError:
                    pass
                except OSError:  # written to meanwhile (a new Snapshot of the tag)
                    done.kept = [n for n, _ in _entries(jdir, tag)]
    return done


def _entries(jdir: Folder, tag: str) -> list[tuple[str, str]]:
    try:
        with jdir.child(tag) as tdir:
            return tdir.entries()
    except OSError:
        return []
