"""The kernel's names for a server's busy threads.

Python 3.11 leaves every thread it starts with its process's name in the kernel (``python``),
so what reads threads from outside (``top -H``, ``ps -L``, /proc/<pid>/task/<tid>/comm, the
scale benchmark's servers' CPU by kind of thread) cannot tell a session's worker from grpc's
handlers or its poller. The server's pools and session readers give the kernel their Python
name (``session_3``, ``shard_0``, ``session-reader``): its first 15 bytes, the kernel's limit.
Threads grpc starts itself (its poller) keep the process's name. Linux only; elsewhere, or
where the call fails, nothing changes.
"""

from __future__ import annotations

import ctypes
import sys
import threading

__all__ = ["name_this_thread"]

_PR_SET_NAME = 15  # prctl(2): the calling thread's name
_COMM_BYTES = 15  # the kernel's limit, less the terminating NUL


def _prctl() -> ctypes._CFuncPtr | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl()


def name_this_thread(name: str | None = None) -> None:
    """Gives the calling thread's Python name (or ``name``) to the kernel. Never raises: a
    pool's ``initializer`` that raised would break the pool."""
    if _PRCTL is None:
        return
    raw = (name or threading.current_thread().name).encode("utf-8", "replace")[:_COMM_BYTES]
    try:
        _PRCTL(_PR_SET_NAME, ctypes.c_char_p(raw), 0, 0, 0)
    except Exception:  # noqa: BLE001 - a name is worth less than the thread
        pass
