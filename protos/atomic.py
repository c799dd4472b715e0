"""Files written whole or not at all: a temporary file beside the target, fsynced, renamed over
it, and the folder fsynced so the rename itself survives a crash. Torch-free: the client, the
server and the strategies all write through it."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

__all__ = ["atomic_write", "fsync_dir", "read_bytes", "write_bytes"]


def fsync_dir(folder: str | os.PathLike) -> None:
    """Makes the entries of ``folder`` (a rename, a new file) durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO[Any]]:
    """``with atomic_write(path) as f: f.write(...)``: ``path`` holds what was written once
    the block ends, or, if it raises, stays as it was (the temporary file is removed)."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(
        folder, f".{os.path.basename(path)}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    )
    text = {} if "b" in mode else {"encoding": "utf-8"}
    try:
        with open(tmp, mode, **text) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
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
