"""Files written whole or not at all: a temporary file beside the target, fsynced, renamed over
it, and the folder fsynced so the rename itself survives a crash. Torch-free: the client, the
server and the strategies all write through it.

What is replaced is what ``open(path, "w")`` (``torch.save``, ``cp``) would write to: a
symbolic link at ``path`` is followed, and the file it points to is replaced, in its own
folder, so the link stays a link. Anything there that is not a regular file (a folder, a
device such as ``/dev/full``, a fifo, a socket) is refused with an OSError naming it, where a
rename would silently put a file in its place. An existing file keeps its permission bits
(not its owner, nor its other hard links: the rename makes a new file)."""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

__all__ = ["atomic_write", "fsync_dir", "read_bytes", "replaced_file", "write_bytes"]

_KINDS = {
    stat.S_IFDIR: "a folder",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFIFO: "a fifo",
    stat.S_IFSOCK: "a socket",
}


def fsync_dir(folder: str | os.PathLike) -> None:
    """Makes the entries of ``folder`` (a rename, a new file) durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replaced_file(path: str | os.PathLike) -> tuple[str, os.stat_result | None]:
    """The file a write to ``path`` replaces, and its current status (None: a new file).

    That is ``path`` itself, or, where ``path`` is a symbolic link (or a chain of them), the
    file it resolves to; a dangling link's target is created, as ``open`` does. OSError naming
    ``path`` (IsADirectoryError for a folder) when what is there is not a regular file."""
    path = os.fspath(path)
    real = os.path.realpath(path)
    try:
        status = os.stat(real)  # a loop of links fails here (ELOOP), naming it
    except FileNotFoundError:
        return real, None
    if not stat.S_ISREG(status.st_mode):
        kind = _KINDS.get(stat.S_IFMT(status.st_mode), "not a regular file")
        via = f" (a link to {real})" if os.path.islink(path) else ""
        code = errno.EISDIR if stat.S_ISDIR(status.st_mode) else errno.EINVAL
        raise OSError(code, f"is {kind}{via}, not a regular file: not replaced", path)
    return real, status


@contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO[Any]]:
    """``with atomic_write(path) as f: f.write(...)``: ``path`` holds what was written once
    the block ends, or, if it raises, stays as it was (the temporary file is removed). What
    ``path`` is (a link, a device) is checked before the block runs (``replaced_file``)."""
    target, status = replaced_file(path)
    folder = os.path.dirname(target)
    tmp = os.path.join(
        folder, f".{os.path.basename(target)}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    )
    text = {} if "b" in mode else {"encoding": "utf-8"}
    try:
        with open(tmp, mode, **text) as f:
            yield f
            f.flush()
            if status is not None:  # as an overwrite in place would: a 0600 file stays 0600
                os.fchmod(f.fileno(), status.st_mode & 0o777)  # not set-user-id and the like
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(folder)


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Writes ``data`` to ``path`` atomically."""
    with atomic_write(path) as f:
        f.write(data)


def read_bytes(path: str | os.PathLike, caller: str, what: str) -> bytes:
    """The bytes of ``path``; FileNotFoundError naming ``caller`` and ``what`` it expected."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{caller}: no {what} file at {os.fspath(path)!r}")
    with open(path, "rb") as f:
        return f.read()
