"""The one error type the store raises: a gRPC status code and a message that names the thing."""

from __future__ import annotations

import grpc

__all__ = ["MAX_DETAILS", "ShardError", "clip", "named", "reason"]

MAX_DETAILS = 2048
"""Characters of an error's message a caller gets. A status's message travels as metadata,
which a client refuses above 16 KiB (grpcio's hard limit): a message that quotes a long name
from the request would otherwise reach the caller as a transport error instead of its own."""


def clip(message: str) -> str:
    """``message`` in at most ``MAX_DETAILS`` characters: its start and its end (where a
    message says what was wrong after quoting the name), and how much was cut between."""
    if len(message) <= MAX_DETAILS:
        return message
    keep = (MAX_DETAILS - 48) // 2
    cut = len(message) - 2 * keep
    return f"{message[:keep]} ...({cut:,} characters cut)... {message[-keep:]}"


def reason(exc: BaseException) -> str:
    """Why a parser refused a caller's bytes, in a line: its type and the first 200
    characters of its words. Not its ``repr``: a UnicodeDecodeError's quotes every byte it
    was given (4 MB for a replica header of 1 MB of non-UTF-8), which said nothing."""
    return f"{type(exc).__name__}: {str(exc)[:200]}"


def named(call: str, message: str) -> str:
    """``message`` as call ``call`` answers it: after the call's name, unless it starts with
    it already ("Lease: ..." from the lease table, answered by ``Lease``)."""
    return message if message.startswith(f"{call}:") else f"{call}: {message}"


def _status(code: grpc.StatusCode) -> classmethod:
    """``ShardError.<name>(message)``: a ShardError with status ``code``."""
    return classmethod(lambda cls, message: cls(code, message))


class ShardError(Exception):
    """A rejected request. The servicer turns it into a gRPC status; state is left untouched."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        message = clip(message)
        super().__init__(message)
        self.code = code
        self.message = message

    # One factory per status code the store uses: ``ShardError.invalid("...")``.
    invalid = _status(grpc.StatusCode.INVALID_ARGUMENT)
    not_found = _status(grpc.StatusCode.NOT_FOUND)
    precondition = _status(grpc.StatusCode.FAILED_PRECONDITION)
    exhausted = _status(grpc.StatusCode.RESOURCE_EXHAUSTED)
    deadline = _status(grpc.StatusCode.DEADLINE_EXCEEDED)
    aborted = _status(grpc.StatusCode.ABORTED)
    cancelled = _status(grpc.StatusCode.CANCELLED)
    conflict = _status(grpc.StatusCode.ALREADY_EXISTS)
