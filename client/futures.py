"""Futures of ``RpcCore.run`` beside grpc's: a call whose payload or reply is in a shared
segment, and a call that already ended; and how ``run`` takes a future's reply (``used_reply``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from paramshard.client.local_calls import LocalRpcError
from paramshard.client.retries import BUSY_MARK
from paramshard.protos import codec
from paramshard.protos.shm import Segment, SharedMemory

__all__ = ["ShmFuture", "Done", "refused_busy", "used_reply", "UNUSABLE"]

UNUSABLE = "a reply this client cannot use"
"""What a DATA_LOSS error of the client's own says: the server's reply does not hold what the
call asked for (a lying or broken server); its values were not used."""


def used_reply(fut: Any, on_result: Callable[[Any], None] | None) -> Any:
    """``fut``'s reply, handed to ``on_result`` (where the call has one). A reply that does
    not hold what the call asked for (``codec.BadReply``: a lying or broken server) fails the
    call as DATA_LOSS, a final error that names the server like any other (``RpcCore.run``),
    and its values are never used."""
    try:
        reply = fut.result()  # a ShmFuture retires its segment itself
    except codec.BadReply as exc:
        raise _unusable(exc) from None
    if on_result is not None and reply is not None:
        try:
            on_result(reply)
        except codec.BadReply as exc:
            if isinstance(fut, ShmFuture):
                fut.retire()
            raise _unusable(exc) from None
    return reply


def _unusable(exc: codec.BadReply) -> LocalRpcError:
    return LocalRpcError(grpc.StatusCode.DATA_LOSS, f"{UNUSABLE}: {exc}")


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

    def retire(self) -> None:
        self._shm.retire(self.seg)


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
