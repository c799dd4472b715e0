"""Folders and files under the snapshot directory, reached without following a symbolic link.

Job and tag names are checked (server/snapshots/files.py), but a name is not enough: whoever can
write in the snapshot directory (another tenant's export, a shared NFS folder) can plant a tag
folder that is a symlink to any folder the server may write, and a path walked by name would
follow it (``Snapshot`` and ``CommitSnapshot`` wrote their shard and manifest there). So every
folder below the root is opened from its parent's descriptor with ``O_NOFOLLOW``
(``openat``), every file likewise, and a link, or anything that is not a plain folder or file
where one is expected, is refused with FAILED_PRECONDITION naming it. The root itself is the
operator's choice (``--snapshot-dir``) and may be a link.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import BinaryIO

from paramshard.server.runtime.errors import ShardError

__all__ = ["Folder", "open_root"]

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # a FIFO never blocks us
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_NO_LINKS = (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS)  # hard links unsupported
_FD_PATHS = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"


def _refused(shown: str, what: str) -> ShardError:
    return ShardError.precondition(
        f"{shown} is {what}; snapshots are read and written only in real folders and files"
        " under the snapshot directory (a symbolic link there could lead anywhere)"
    )


def open_root(root: str | os.PathLike, create: bool = False) -> Folder:
    """The snapshot directory (FileNotFoundError when it is missing and not ``create``)."""
    if create:
        os.makedirs(root, exist_ok=True)
    return Folder(os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), os.fspath(root))


class Folder:
    """An open folder (its descriptor) and its path for messages; closed by ``close`` or at
    the end of a ``with`` block."""

    def __init__(self, fd: int, shown: str) -> None:
        self.fd, self.shown = fd, shown

    def __enter__(self) -> Folder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def name(self, name: str) -> str:
        return f"{self.shown}/{name}"

    # -- folders ---------------------------------------------------------------------------
    def child(self, name: str, create: bool = False) -> Folder:
        """Sub-folder ``name`` (made first with ``create``); FileNotFoundError when missing,
        FAILED_PRECONDITION when it is a link or not a folder."""
        if create:
            try:
                os.mkdir(name, dir_fd=self.fd)
            except FileExistsError:
                pass
        try:
            return Folder(os.open(name, _DIR, dir_fd=self.fd), self.name(name))
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise _refused(self.name(name), "a symbolic link or not a folder") from None
            raise

    def entries(self) -> list[tuple[str, str]]:
        """(name, kind) of each entry, sorted: kind is "folder", "file", "link" or "other",
        as the entry itself is (links not followed)."""
        out = []
        with os.scandir(self.fd) as found:
            for entry in found:
                if entry.is_symlink():
                    kind = "link"
                elif entry.is_dir(follow_symlinks=False):
                    kind = "folder"
                elif entry.is_file(follow_symlinks=False):
                    kind = "file"
                else:
                    kind = "other"
                out.append((entry.name, kind))
        return sorted(out)

    # -- files ---------------------------------------------------------------------------------
    def kind(self, name: str) -> str | None:
        """What entry ``name`` is ("folder", "file", "link", "other"), None when missing."""
        try:
            mode = os.stat(name, dir_fd=self.fd, follow_symlinks=False).st_mode
        except FileNotFoundError:
            return None
        if stat.S_ISLNK(mode):
            return "link"
        return "folder" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "other"

    def size(self, name: str) -> int:
        return os.stat(name, dir_fd=self.fd, follow_symlinks=False).st_size

    def mtime_ns(self, name: str) -> int:
        return os.stat(name, dir_fd=self.fd, follow_symlinks=False).st_mtime_ns

    def open(self, name: str) -> int:
        """A descriptor of plain file ``name`` for reading (the caller closes it)."""
        try:
            fd = os.open(name, _FILE, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise _refused(self.name(name), "a symbolic link") from None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise _refused(self.name(name), "not a plain file")
        os.set_blocking(fd, True)
        return fd

    def read(self, name: str, most: int) -> bytes:
        """File ``name`` whole; ValueError (nothing read) past ``most`` bytes: a manifest is
        anyone's who can write in the folder, and one of 1 TiB (sparse) was read whole."""
        with os.fdopen(self.open(name), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > most:
                raise ValueError(f"{size:,} bytes, more than the {most:,} a manifest may have")
            return f.read(most + 1)

    @contextmanager
    def path_of(self, name: str) -> Iterator[str]:
        """A path that reaches the file ``name`` opened here (its descriptor's), for readers
        that take a path (safetensors' ``safe_open``); valid inside the block."""
        fd = self.open(name)
        try:
            yield f"{_FD_PATHS}/{fd}"
        finally:
            os.close(fd)

    def create(self, name: str) -> None:
        """Creates empty file ``name``; FileExistsError when anything has that name."""
        os.close(os.open(name, _NEW, 0o600, dir_fd=self.fd))

    def unlink(self, name: str) -> None:
        os.unlink(name, dir_fd=self.fd)

    def rmdir(self, name: str) -> None:
        """Removes empty folder ``name`` (OSError when it is not empty or not a folder)."""
        os.rmdir(name, dir_fd=self.fd)

    def write_once(self, name: str, data: bytes | Sequence[bytes | memoryview]) -> None:
        """Creates ``name`` with ``data`` (bytes, or parts written one after the other: a
        shard's arrays, not joined first) whole or not at all, never replacing anything there
        (FileExistsError): written to a temporary name, fsynced, then hard-linked to its name,
        which fails if the name exists (a link included), even when servers share the folder
        over NFS."""
        tmp = f".{name}.{secrets.token_hex(6)}"
        fd = os.open(tmp, _NEW, 0o600, dir_fd=self.fd)
        try:
            with os.fdopen(fd, "wb") as f:
                _write(f, data)
            try:
                os.link(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd, follow_symlinks=False)
            except OSError as exc:  # a filesystem without hard links: exclusive create instead
                if exc.errno not in _NO_LINKS:
                    raise  # FileExistsError (errno EEXIST) goes to the caller
                with os.fdopen(os.open(name, _NEW, 0o600, dir_fd=self.fd), "wb") as f:
                    _write(f, data)
        finally:
            os.unlink(tmp, dir_fd=self.fd)
        os.fsync(self.fd)  # the new name survives a crash


def _write(f: BinaryIO, data: bytes | Sequence[bytes | memoryview]) -> None:
    """``data`` (bytes or parts) into ``f``, on disk when this returns."""
    for part in [data] if isinstance(data, bytes) else data:
        f.write(part)
    f.flush()
    os.fsync(f.fileno())
