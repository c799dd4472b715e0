"""A pipeline stage's traffic: activations forward, their gradients backward.

Tensors travel through the receiver's server mailbox (``client.send`` / ``client.recv``),
activations under tag "act" and gradients under "grad". Per pair of ranks and tag both sides
go in the schedule's order, so the mailboxes' message counters line up.

What crosses one boundary is one message, however many tensors it holds: one floating-point
tensor goes as itself; several are packed into one int64 message (a header of dtypes and
shapes, then each tensor's bytes, padded to 8). An activation is a tensor that needs a
gradient, so it is never int64, and the dtype alone says which form arrived.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

__all__ = ["pack", "unpack", "Mailroom"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
RECV_LIKE = torch.empty(0)  # recv template: "give me a torch tensor"


def pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One message for ``tensors`` (detached, on the CPU)."""
    if len(tensors) == 1 and tensors[0].dtype in _DTYPES:
        return tensors[0].detach()
    header = [len(tensors)]
    chunks = []
    for t in tensors:
        if t.dtype not in _DTYPES:
            raise TypeError(f"a pipeline activation must be floating point, got {t.dtype}")
        header += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
        raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        pad = (-raw.numel()) % 8
        chunks.append(torch.cat([raw, raw.new_zeros(pad)]) if pad else raw)
    head = torch.tensor(header, dtype=torch.int64)
    return torch.cat([head, *(c.view(torch.int64) for c in chunks)])


def unpack(message: torch.Tensor) -> list[torch.Tensor]:
    """The tensors of one message (inverse of ``pack``)."""
    if message.dtype != torch.int64:
        return [message]
    try:
        pos, specs = 1, []
        for _ in range(int(message[0])):
            code, ndim = message[pos : pos + 2].tolist()
            specs.append((_DTYPES[code], torch.Size(message[pos + 2 : pos + 2 + ndim].tolist())))
            pos += 2 + ndim
    except (IndexError, ValueError, RuntimeError) as exc:
        raise ValueError(f"malformed pipeline message of {message.numel()} words") from exc
    raw = message[pos:].view(torch.uint8)
    out, offset = [], 0
    for dtype, shape in specs:
        nbytes = shape.numel() * torch.empty((), dtype=dtype).element_size()
        if offset + nbytes > raw.numel():
            raise ValueError(f"malformed pipeline message: {list(shape)} {dtype} runs past its end")
        out.append(raw[offset : offset + nbytes].view(dtype).reshape(shape).clone())
        offset += nbytes + (-nbytes) % 8
    return out


IN_FLIGHT = 4
"""Sends (and posted receives) a stage keeps in flight at once. Each message's mailbox key is
taken in schedule order on the stage's own thread (``send_key``/``recv_key``), so messages may
travel together and in any order and are still matched in order: a send no longer waits for
the one before it to be stored (one round trip each, one after another, was the floor under
a stage's idle time), and receives are read as soon as they land."""


class Mailroom:
    """One schedule's traffic: sends go out in the background (like Megatron's isend) and
    receives are posted ahead, keys taken in the schedule's order, up to ``IN_FLIGHT`` of each
    at once, so a tensor is usually here by the time its step needs it."""

    def __init__(self, pp: Any, pools: tuple[Any, Any], recvs: list[tuple[int, str]]) -> None:
        self.pp, (self._send_pool, recv_pool) = pp, pools
        self._incoming = [
            recv_pool.submit(pp.recv, src, RECV_LIKE, tag, key=pp.recv_key(src, tag))
            for src, tag in recvs
        ]
        self._incoming.reverse()  # pop() takes the earliest
        self._sent: list[Any] = []

    def send(self, tensors: list[torch.Tensor], dst: int, tag: str) -> None:
        key = self.pp.send_key(dst, tag)  # here, in schedule order
        self._sent.append(self._send_pool.submit(self.pp.send, pack(tensors), dst, tag, key=key))

    def recv(self) -> list[torch.Tensor]:
        return unpack(self._incoming.pop().result())

    def finish(self) -> None:
        """Waits for every send (raising the first error)."""
        for fut in self._sent:
            fut.result()

    def abandon(self) -> None:
        """After an error: receives not started yet are never posted."""
        for fut in self._incoming:
            fut.cancel()


def new_pools() -> tuple[ThreadPoolExecutor, ThreadPoolExecutor]:
    """The send and the receive threads of a pipeline model (``IN_FLIGHT`` each)."""
    return (
        ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="pp-send"),
        ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="pp-recv"),
    )
