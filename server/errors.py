"""The one error type the store raises: a gRPC status code and a message that names the thing."""

from __future__ import annotations

import grpc

__all__ = ["ShardError"]


class ShardError(Exception):
    """A rejected request. The servicer turns it into a gRPC status; state is left untouched."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    @classmethod
    def invalid(cls, message: str) -> ShardError:
        return cls(grpc.StatusCode.INVALID_ARGUMENT, message)

    @classmethod
    def not_found(cls, message: str) -> ShardError:
        return cls(grpc.StatusCode.NOT_FOUND, message)

    @classmethod
    def precondition(cls, message: str) -> ShardError:
        return cls(grpc.StatusCode.FAILED_PRECONDITION, message)

    @classmethod
    def exhausted(cls, message: str) -> ShardError:
        return cls(grpc.StatusCode.RESOURCE_EXHAUSTED, message)

    @classmethod
    def deadline(cls, message: str) -> ShardError:
        return cls(grpc.StatusCode.DEADLINE_EXCEEDED, message)

    @classmethod
    def aborted(cls, message: str) -> ShardError:
        return cls(grpc.StatusCode.ABORTED, message)
