"""The one error type the store raises: a gRPC status code and a message that names the thing."""

from __future__ import annotations

import grpc

__all__ = ["ShardError"]


def _status(code: grpc.StatusCode) -> classmethod:
    """``ShardError.<name>(message)``: a ShardError with status ``code``."""
    return classmethod(lambda cls, message: cls(code, message))


class ShardError(Exception):
    """A rejected request. The servicer turns it into a gRPC status; state is left untouched."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
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
