"""Flat gradient tensors reused from one push to the next (ZeRO-2's buckets, FSDP's units).

ZeRO-2 flattens each bucket's gradients, and FSDP each unit's, into a flat tensor that is
pushed to the servers and then dropped. Made new each time, the allocator may map those bytes
anew, to fault in page by page in the training thread, or grow past the freed ones (GPT-2
124M at W = 2, docs/benchmarks.md "Flat gradients reused": ZeRO-2's step 5% shorter, FSDP's
trainer peak 150-300 MB lower with the pool). The pool keeps flats whose push finished, at
most ``max_idle_bytes`` of them, and hands one to the next flatten of the same size and dtype.
A strategy's memory stays what it was: a flat is held idle only in place of the next one,
never a whole model's gradients (ZeRO-2's bound: two buckets; FSDP's: two units).

Only host flats are kept: CUDA's caching allocator already reuses device memory, in the order
of its streams, which a pool outside it would not know.

A flat comes back only after its push returned: a server of this process adds from the caller's
memory during the call and copies what it keeps past it (server/runtime/arrays.py
``to_compute``), as any allocator's reuse of freed memory already requires. A push that failed
does not give its flat back.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["FlatPool"]

_Key = tuple[int, torch.dtype]


class FlatPool:
    """Idle host flat tensors by (numel, dtype), ``max_idle_bytes`` of them at most (0: none
    kept, every ``take`` is new memory)."""

    def __init__(self, max_idle_bytes: int = 0) -> None:
        self.max_idle_bytes = max_idle_bytes
        self.idle_bytes = 0
        self.reused = 0  # takes served from the pool, for tests and benchmarks
        self._idle: dict[_Key, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, numel: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """A flat tensor of ``numel`` elements (its values are whatever it held)."""
        key = (numel, dtype)
        with self._lock:
            idle = self._idle.get(key) if torch.device(device).type == "cpu" else None
            if idle:
                t = idle.pop()
                self.idle_bytes -= _nbytes(t)
                self.reused += 1
                return t
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, t: torch.Tensor) -> None:
        """``t`` (from ``take``, no longer read or written by anyone) is free for reuse; kept
        while the idle flats stay within ``max_idle_bytes``, else dropped."""
        key = (t.numel(), t.dtype)
        with self._lock:
            if t.device.type != "cpu" or self.idle_bytes + _nbytes(t) > self.max_idle_bytes:
                return
            self._idle.setdefault(key, []).append(t)
            self.idle_bytes += _nbytes(t)

    def clear(self) -> None:
        """Drops every idle flat."""
        with self._lock:
            self._idle.clear()
            self.idle_bytes = 0


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
