"""Text another process sent (a server's error details, a lease notice, a pending row, a
parameter's name): bounded and with its control characters shown as escapes before this
process logs, raises or prints it.

A server that lies, or a team that named its job so, could otherwise make a trainer's error 20
MB long (gRPC bounds a unary call's status details, but not what a session's reply or a notice
carries) or retitle, clear and recolour the terminal its words reach (OSC 52 writes a
terminal's clipboard). The command line writes all its output through ``printable``
(paramshard/terminal.py); the client library through ``said``, and a failed call's status
details through ``details_of``.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable
from typing import Any

import grpc

__all__ = ["MAX_LISTED", "MAX_WORDS", "details_of", "listed", "printable", "said"]

MAX_WORDS = 16 * 2**10
"""Characters of another's words kept (gRPC's own bound on a status's details is 16 KiB)."""
MAX_LISTED = 16
"""Items of a list another sent (ranks, parts) that are named; the rest are counted."""
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
"""C0 controls but tab and newline, DEL and C1 controls (ESC, BEL, CSI, OSC among them)."""


def printable(text: str) -> str:
    """``text`` with each control character written as its escape (``\\x1b``)."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def said(text: str, most: int = MAX_WORDS) -> str:
    """Another's words as this process repeats them: at most ``most`` characters (the rest
    counted), printable."""
    if len(text) > most:
        text = f"{text[:most]}... ({len(text) - most:,} more characters)"
    return printable(text)


def details_of(exc: grpc.RpcError) -> str:
    """A failed call's status details, printable. gRPC bounds their length itself: details
    past its metadata limit (8 KiB by default) reach the caller as RESOURCE_EXHAUSTED "Stream
    removed" instead."""
    return printable(exc.details() or "")


def listed(items: Iterable[Any], count: int | None = None, most: int = MAX_LISTED) -> str:
    """The first ``most`` of ``items`` ("1, 2, 3"), the rest of ``count`` counted ("1, 2, 3
    and 5 more"), or "none". Without ``count``, ``items`` is a sized collection; with it, any
    iterable, of which no more than ``most`` are taken."""
    named = list(itertools.islice(items, most))
    more = (len(items) if count is None else count) - len(named)
    return (", ".join(map(str, named)) or "none") + (f" and {more:,} more" if more > 0 else "")
