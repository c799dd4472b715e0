"""A Snapshot call's hold on one shard of a tag until it ends: ``.shard-I-of-N.reserved``,
made with O_EXCL (servers sharing the folder see it) and naming its owner, the host and the
server's process. A hold whose owner is gone is taken over: before, a server killed while its
Snapshot waited left its marker for good, and that tag could never be written again ("being
written by another Snapshot call"), its partial shard file left beside it."""

from __future__ import annotations

import os
import re
import socket
import time

import grpc

from paramshard.server.runtime.errors import ShardError
from paramshard.server.snapshots.folders import Folder

__all__ = ["STALE_S", "Reservation", "take"]

STALE_S = 3600.0
"""A marker of another host (whose process this server cannot look up) is taken for abandoned
once it is this old: far past any Snapshot's wait (``--max-wait-s``) and shard write."""


class Reservation:
    """Shard marker ``marker`` in ``folder``, held by one Snapshot call until ``release``."""

    def __init__(self, folder: Folder, marker: str) -> None:
        self.folder, self.marker = folder, marker

    def release(self) -> None:
        try:
            self.folder.unlink(self.marker)
        except FileNotFoundError:
            pass
        finally:
            self.folder.close()


def take(folder: Folder, name: str, what: str) -> Reservation:
    """Holds shard file ``name`` of ``folder`` for this call; ALREADY_EXISTS when a live call
    holds it. ``what`` names the snapshot in the error."""
    marker = f".{name}.reserved"
    owner = f"paramshard reservation host={socket.gethostname()} pid={os.getpid()}\n"
    try:
        folder.write_once(marker, owner.encode())
        return Reservation(folder, marker)
    except FileExistsError:
        if not _abandoned(folder, marker):
            raise _held(what, name) from None
    _remove(folder, marker)  # taken over, with what its call left half written
    partial = re.compile(rf"\.{re.escape(name)}\.[0-9a-f]{{12}}")  # ``write_once``'s
    for entry, _ in folder.entries():
        if partial.fullmatch(entry):
            _remove(folder, entry)
    try:
        folder.write_once(marker, owner.encode())
    except FileExistsError:  # another call took it over first
        raise _held(what, name) from None
    return Reservation(folder, marker)


def _held(what: str, name: str) -> ShardError:
    return ShardError(
        grpc.StatusCode.ALREADY_EXISTS, f"{what}: {name} is being written by another Snapshot call"
    )


def _abandoned(folder: Folder, marker: str) -> bool:
    """Whether the call that made ``marker`` is gone: its process, on this host, no longer
    runs; on another host (or with no owner named), the marker is ``STALE_S`` old."""
    try:
        said = folder.read(marker).decode("utf-8", "replace").split()
        age = time.time() - folder.mtime_ns(marker) / 1e9
    except (OSError, ShardError):
        return False  # gone meanwhile, or not a plain file: the caller says it is held
    fields = dict(part.split("=", 1) for part in said if "=" in part)
    pid = fields.get("pid", "")
    if fields.get("host") == socket.gethostname() and pid.isdigit() and int(pid) > 0:
        if int(pid) == os.getpid():
            return False  # a call of this server's, running now
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # some other user's process runs under that pid
            pass
    return age > STALE_S


def _remove(folder: Folder, name: str) -> None:
    try:
        folder.unlink(name)
    except FileNotFoundError:
        pass
