"""A Snapshot call's hold on one shard of a tag until it ends: ``.shard-I-of-N.reserved``,
made with O_EXCL (servers sharing the folder see it) and naming its owner: the host, the
server's process (its pid and a random id, since a restarted container's server often has
the pid its dead predecessor had) and the call. A hold whose owner is gone is taken over:
before, a server killed while its Snapshot waited left its marker for good, and that tag could
never be written again ("being written by another Snapshot call"), its partial shard file left
beside it.

Taking a hold, taking one over and letting it go run under one lock of the process, so two
calls of this server never both hold a shard, and a call lets go only of its own marker.
Shard I of a tag is written by server I alone, so no two live processes contend for a marker
(two servers configured with one index are not supported). A marker is the caller's to write
only through this module; one planted in the folder is read bounded (``_MARKER_MAX``) and, if
it does not parse, is taken for held until ``STALE_S`` old."""

from __future__ import annotations

import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc

from paramshard.server.runtime.errors import ShardError
from paramshard.server.snapshots.folders import Folder

__all__ = ["STALE_S", "Reservation", "no_writers", "take"]

STALE_S = 3600.0
"""A marker of another host (whose process this server cannot look up) is taken for abandoned
once it is this old: far past any Snapshot's wait (``--max-wait-s``) and shard write."""
_MARKER_MAX = 512  # bytes of a marker read: ours take about 100
_MARKER = re.compile(r"\.(shard-[0-9]+-of-[0-9]+\.safetensors)\.reserved")  # ``take``'s names
_PROCESS = secrets.token_hex(8)  # this server process, beside its pid
_LOCK = threading.Lock()
_LIVE: set[tuple[int, int, str, str]] = set()  # (folder's device, inode, marker, call) held


class Reservation:
    """Shard marker ``marker`` in ``folder``, held by one Snapshot call until ``release``."""

    def __init__(self, folder: Folder, marker: str, call: str) -> None:
        self.folder, self.marker, self.call = folder, marker, call

    def release(self) -> None:
        try:
            with _LOCK:
                _LIVE.discard(_key(self.folder, self.marker, self.call))
                if _fields(self.folder, self.marker).get("call") == self.call:
                    _remove(self.folder, self.marker)  # only its own: never a successor's
        finally:
            self.folder.close()


def take(folder: Folder, name: str, what: str) -> Reservation:
    """Holds shard file ``name`` of ``folder`` for this call; ALREADY_EXISTS when a live call
    holds it, FAILED_PRECONDITION when something not a plain file has the marker's name.
    ``what`` names the snapshot in the error."""
    marker, call = f".{name}.reserved", secrets.token_hex(8)
    owner = f"paramshard reservation host={socket.gethostname()} pid={os.getpid()}"
    owner += f" process={_PROCESS} call={call}\n"
    with _LOCK:
        try:
            folder.write_once(marker, owner.encode())
        except FileExistsError:
            kind = folder.kind(marker)
            if kind not in ("file", None):
                raise ShardError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{what}: {folder.name(marker)} is a {kind}, not a Snapshot's marker:"
                    " remove it",
                ) from None
            if not _abandoned(folder, marker):
                raise _held(what, name) from None
            _remove(folder, marker)  # taken over, with what its call left half written
            partial = re.compile(rf"\.{re.escape(name)}\.[0-9a-f]{{12}}")  # ``write_once``'s
            for entry, kind in folder.entries():
                if kind == "file" and partial.fullmatch(entry):
                    _remove(folder, entry)
            try:
                folder.write_once(marker, owner.encode())
            except FileExistsError:  # another server's call took it over first
                raise _held(what, name) from None
        _LIVE.add(_key(folder, marker, call))
    return Reservation(folder, marker, call)


@contextmanager
def no_writers(folder: Folder, what: str, tidy: bool = True) -> Iterator[None]:
    """Holds off every Snapshot call of this process from taking a shard of ``folder`` (a
    tag's) for the block, which runs only when no live call holds one: FAILED_PRECONDITION
    naming the shard otherwise. With ``tidy``, markers of calls that are gone are removed
    first (a deletion's: the tag's files go with them)."""
    with _LOCK:
        for entry, kind in folder.entries():
            found = _MARKER.fullmatch(entry)
            if found is None or kind != "file":
                continue
            if not _abandoned(folder, entry):
                fields = _fields(folder, entry)
                raise ShardError.precondition(
                    f"{what}: shard {found.group(1)} is being written by a Snapshot call"
                    f" (host {fields.get('host', '?')}, pid {fields.get('pid', '?')}; a"
                    f" marker of another host counts for {STALE_S / 3600:g} h): try again"
                    " once it has ended"
                )
            if tidy:
                _remove(folder, entry)
        yield


def _key(folder: Folder, marker: str, call: str) -> tuple[int, int, str, str]:
    st = os.fstat(folder.fd)
    return st.st_dev, st.st_ino, marker, call


def _held(what: str, name: str) -> ShardError:
    return ShardError(
        grpc.StatusCode.ALREADY_EXISTS, f"{what}: {name} is being written by another Snapshot call"
    )


def _fields(folder: Folder, marker: str) -> dict[str, str]:
    """A marker's ``key=value`` words, read bounded; {} when it is gone or not a plain file."""
    try:
        fd = folder.open(marker)
    except (OSError, ShardError):
        return {}
    try:
        said = os.read(fd, _MARKER_MAX).decode("utf-8", "replace")
    except OSError:
        return {}
    finally:
        os.close(fd)
    return dict(part.split("=", 1) for part in said.split() if "=" in part)


def _abandoned(folder: Folder, marker: str) -> bool:
    """Whether the call that made ``marker`` is gone: on this host, a call of this process that
    ended, or a process that no longer runs (one with this process's pid but not its id ran
    before it); on another host (or with no owner it can read), the marker is ``STALE_S``
    old."""
    fields = _fields(folder, marker)
    try:
        age = time.time() - folder.mtime_ns(marker) / 1e9
    except OSError:
        return False  # gone meanwhile: the caller's next try makes its own
    pid = fields.get("pid", "")
    here = fields.get("host") == socket.gethostname()
    if not (here and pid.isascii() and pid.isdigit() and int(pid) > 0):
        return age > STALE_S
    if int(pid) == os.getpid():
        if fields.get("process") != _PROCESS:
            return True  # an earlier process that had this pid (a restarted container)
        return _key(folder, marker, fields.get("call", "")) not in _LIVE
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError, ValueError):  # another user's, or no pid at all
        pass
    return age > STALE_S


def _remove(folder: Folder, name: str) -> None:
    try:
        folder.unlink(name)
    except FileNotFoundError:
        pass
