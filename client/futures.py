"""Futures of ``RpcCore.run`` beside grpc's: a call whose payload or reply is in a shared
segment, and a call that already ended."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from paramshard.client.retries import BUSY_MARK
from paramshard.protos.shm import Segment, SharedMemory

__all__ = ["ShmFuture", "Done", "refused_busy"]


class ShmFuture:
    """A call whose payload or reply is in a shared segment (protos/shm.py): a failure
    retires the segment, unless the server refused the call "retry later" (it had done
    with the segment, or never touched it, when it answered); ``settle`` gives it back after
    the reply was used."""

    def __init__(self, fut: Any, shm: SharedMemory, seg: Segment) -> None:
        self._fut, self._shm, self.seg = fut, shm, seg

    def cancel(self) -> bool:
        return self._fut.cancel()

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        self._fut.add_done_callback(lambda _: fn(self))

    def result(self, timeout: float | None = None) -> Any:
        try:
            reply = self._fut.result(timeout)
            return self._shm.reply_payload(self.seg, reply)
        except grpc.RpcError as exc:
            if refused_busy(exc):  # before, each retry opened, mapped and faulted in a
                self._shm.settle(self.seg, None, consumed=True)  # new segment
            else:
                self._shm.retire(self.seg)
            raise
        except BaseException:
            self._shm.retire(self.seg)
            raise

    def settle(self, reply: Any, consumed: bool) -> Any:
        return self._shm.settle(self.seg, reply, consumed)


def refused_busy(exc: grpc.RpcError) -> bool:
    """Whether ``exc`` is a server's "busy, retry later" refusal (client/retries.py): a
    status the server sent once its handler was done, not a deadline or a lost connection
    while it may still be running."""
    code, details = getattr(exc, "code", None), getattr(exc, "details", None)
    if code is None or details is None:
        return False
    return code() == grpc.StatusCode.RESOURCE_EXHAUSTED and BUSY_MARK in (details() or "")


class Done:
    """A call already finished (see ``RpcCore._send``'s blocking path), as a future."""

    def __init__(self, reply: Any = None, error: grpc.RpcError | None = None) -> None:
        self._reply, self._error = reply, error

    def cancel(self) -> bool:
        return False

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        fn(self)  # done already

    def result(self, timeout: float | None = None) -> Any:
        if self._error is not None:
            raise self._error
        return self._reply
