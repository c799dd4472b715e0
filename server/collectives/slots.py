"""Reduction slots: keyed accumulators behind the collectives, broadcasts and mailboxes.

A slot is one tensor (or one server's part of it) cut into chunks of ``chunk_numel`` elements.
Each chunk completes on its own when ``expected`` contributors have added it, and is freed once
``readers`` distinct readers have read it. Because every rank cuts a tensor the same way, a
reader can fetch chunk k while chunk k+1 is still being reduced: the reduce-scatter and the
all-gather halves of an all-reduce overlap.

A contribution is identified by (key, chunk offset, contributor) and counted once; recently
freed keys are remembered (server/collectives/gone_keys.py, until their run is forgotten) so a
late retry is acknowledged instead of opening a ghost slot.

Float SUM and MEAN add a chunk's contributions in contributor order, whatever order they
arrive in (unless the header asks for ``arrival_order``): contributor c is added once 0..c-1
are in; an early arrival first waits for its turn holding its own request (bounded:
server/runtime/turns.py), and past those bounds waits as a copy in ``Chunk.staged``. Float
addition is not associative, so this is what makes two runs of the same training bitwise
identical, as gloo's fixed reduction order does. MAX, MIN, integers and SET do not depend on
the order.

Pending work ends (docs/design.md §3.7): ``expire`` (the server's sweeper) drops a slot idle
for ``ttl_s`` seconds, ``drop_run`` every slot of a run (``DropJob``); their memory (paid for
from the server's ``MemoryBudget`` first) is given back, and their readers and any later call
on the key fail ABORTED saying why. A timed-out read and Status name who arrived and who is
missing (the hang doctor, server/collectives/pending.py).
"""

from __future__ import annotations

import threading
import time

from paramshard.protos import shard_pb2 as pb
from paramshard.server.collectives import pending
from paramshard.server.collectives.gone_keys import GoneKeys
from paramshard.server.collectives.slot import (
    CHUNK_RECORD_BYTES,
    ENTRY_RECORD_BYTES,
    Chunk,
    Slot,
    SlotMemory,
    array_charge,
    missed,
    slot_charge,
)
from paramshard.server.collectives.slot_checks import check_header, check_same, ordered, slot_meta
from paramshard.server.runtime import arrays, backend, callers
from paramshard.server.runtime.errors import ShardError
from paramshard.server.runtime.limits import MemoryBudget
from paramshard.server.runtime.request_bounds import check_key
from paramshard.server.runtime.run_names import NOTHING_KNOWN, RankNews, wait_asking
from paramshard.server.runtime.turns import TurnWaits

__all__ = ["SlotStore"]


class SlotStore:
    """Every reduction slot and mailbox on this server."""

    def __init__(
        self,
        max_bytes: int = 0,
        budget: MemoryBudget | None = None,
        ttl_s: float = 600.0,
        turns: TurnWaits | None = None,
    ) -> None:
        self.memory = SlotMemory(max_bytes, budget or MemoryBudget())  # 0: no bound of its own
        self.turns = turns or TurnWaits()  # the server's, shared with its buffers
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._slots: dict[str, Slot] = {}
        self._gone = GoneKeys()  # freed and ended keys, aborted runs: a late call is answered
        self.news: RankNews = NOTHING_KNOWN  # the server's leases (servicer.py)
        self._stopped: str | None = None  # why, once ``interrupt`` ran: no slot opens again
        self.max_chunk_bytes = 2**31 - 1  # the server lowers it to its message bound (app.py)

    def usage(self) -> tuple[int, int]:
        """(bytes held, open slots)."""
        with self._lock:
            return self.memory.held, len(self._slots)

    def chunk_nbytes(self, key: str, offset: int) -> int | None:
        """The bytes a read of slot ``key``'s chunk at ``offset`` replies at most (in its wire
        dtype); None while it has no contribution. A peek without the slot's lock, for the
        count of unsent replies (server/call_peeks.py)."""
        with self._lock:
            slot = self._slots.get(key)
        return None if slot is None else slot.chunk_nbytes(offset)

    def complete(self, key: str, offset: int) -> bool:
        """Whether a read of the chunk at ``offset`` of slot ``key`` would not wait: it has
        all its contributions, or it (or its slot) is gone."""
        with self._lock:
            slot = self._slots.get(key)
        if slot is None:
            return True
        with slot.cond:
            return slot.ended is not None or offset in slot.freed or slot.complete(offset)

    def open_slots(self) -> list[Slot]:
        """Every open slot, for Status (server/collectives/pending.py reads each under its cond)."""
        with self._lock:
            return list(self._slots.values())

    def _slot(self, key: str) -> Slot | None:
        """The slot for ``key``, created on first use; None when it was freed already."""
        with self._lock:
            if key in self._gone.ended:
                raise ShardError.aborted(self._gone.ended[key])
            slot = self._slots.get(key)
            if slot is None and self._stopped is not None:
                raise ShardError.aborted(f"slot '{key}': {self._stopped}")
            if slot is None and key not in self._gone.freed:
                if (why := self._gone.aborted(key)) is not None:
                    raise ShardError.aborted(why)
                owner = callers.who()
                self.memory.reserve(slot_charge(key), key, owner)
                slot = self._slots[key] = Slot(key, owner)
            return slot

    def contribute(
        self,
        h: pb.SlotHeader,
        data: memoryview,
        timeout: float = 0.0,
        turn_until: float = 0.0,
        hold: bool = False,
    ) -> bool:
        """Adds a contribution; returns True when it had been counted before. One that came
        before its turn waits for it first, within ``timeout`` and the server's bounds
        (server/runtime/turns.py), then is staged as a copy. ``hold``: the caller keeps
        ``data`` alive until it calls ``release_hold``, so a chunk's first contribution may
        stay where it is instead of being copied (server/collectives/contribute_read.py)."""
        deadline, turn_until = time.monotonic() + timeout, turn_until or TurnWaits.until(timeout)
        check_header(h, self.max_chunk_bytes)
        host = arrays.payload_array(data, h.chunk.dtype, h.chunk.numel, f"slot '{h.key}'")
        slot = self._slot(h.key)
        if slot is None:
            return True  # read by everyone and freed: a late retry
        with slot.cond:
            if slot.ended is not None:
                raise ShardError.aborted(slot.ended)
            if slot.forgotten:  # a reader gave up on it, unused, as this call found it
                return self.contribute(h, data, deadline - time.monotonic(), turn_until, hold)
            if slot.meta is not None:
                try:
                    check_same(slot, h)
                except ShardError as exc:
                    # The ranks disagree about this collective (world size, shape, dtype): its
                    # readers would wait for a contribution that is not coming, so a read that
                    # would wait fails now, not at its deadline. The slot itself is untouched:
                    # contributions that agree may still complete it.
                    slot.conflict = f"{exc.message}: the ranks of the run disagree about it"
                    slot.cond.notify_all()
                    raise
            if h.chunk.offset in slot.freed:
                return True
            chunk = slot.chunks.get(h.chunk.offset)
            if chunk is not None and h.contributor in chunk.contributors:
                return True
            in_order = ordered(h)
            early = in_order and (chunk.head if chunk is not None else 0) != h.contributor
            if early and slot.wait_turn(self.turns, h, int(host.nbytes), turn_until):
                return self.contribute(h, data, deadline - time.monotonic(), turn_until, hold)
            acc = None
            if early or chunk is None or chunk.acc is None:
                # A chunk's first contribution becomes its accumulator, and in rank order an
                # early one is kept aside. Its memory is reserved before anything changes, so
                # a rejected contribution leaves no trace; a held one (the caller's own
                # memory, nothing to convert) is paid for as the copy it may become.
                if h.op == pb.SET:
                    acc = backend.to_device(host.copy())
                elif hold and not early and h.expected > 1:
                    acc = arrays.to_compute(host, h.chunk.dtype)
                else:
                    acc = arrays.to_compute(host, h.chunk.dtype, own=True)
                try:
                    record = CHUNK_RECORD_BYTES if chunk is None else 0
                    self.memory.reserve(array_charge(acc) + record, h.key, slot.owner)
                except ShardError:
                    self._forget_if_unused(slot)
                    raise
            # -- all checks passed: mutate --
            slot.touched = time.monotonic()
            if slot.meta is None:
                slot.meta, slot.dtype = slot_meta(h), h.chunk.dtype
                if slot.waiting:
                    slot.cond.notify_all()  # a read at an offset it now shows is none ends
            if chunk is None:
                chunk = slot.chunks[h.chunk.offset] = Chunk(h.chunk.numel)
            if early:
                chunk.staged[h.contributor] = acc
            elif acc is not None:
                chunk.acc = acc
                chunk.held_by = h.contributor if acc is host else None
            else:
                chunk.add(arrays.to_compute(host, h.chunk.dtype), h.op)
            if in_order and not early:
                chunk.head += 1
                while chunk.head in chunk.staged:  # the ones that waited for this one
                    kept = chunk.staged.pop(chunk.head)
                    chunk.add(kept, h.op)
                    self.memory.release(array_charge(kept), slot.owner)
                    chunk.head += 1
                if slot.turn_waiters:
                    slot.cond.notify_all()  # a contribution waiting for its turn may have it
            chunk.contributors.add(h.contributor)
            if len(chunk.contributors) == h.expected:
                chunk.own()  # (never held here: a second contribution replaced it)
                if h.op == pb.MEAN and h.expected > 1:
                    chunk.acc /= chunk.acc.dtype.type(h.expected)
                slot.cond.notify_all()
            return False

    def release_hold(self, h: pb.SlotHeader) -> None:
        """The chunk's accumulator copied out of ``h``'s request if it is still that: the call
        that held it ends (server/collectives/contribute_read.py)."""
        with self._lock:
            slot = self._slots.get(h.key)
        if slot is None:
            return
        with slot.cond:
            chunk = slot.chunks.get(h.chunk.offset)
            if chunk is not None and chunk.held_by == h.contributor:
                chunk.own()

    def read(self, req: pb.ReadSlotRequest, timeout: float) -> tuple[pb.SlotHeader, bytes]:
        """Waits for the chunk at ``req.offset`` to complete and returns it. An offset that
        cannot hold a chunk is refused once the slot's first contribution shows it, or with
        ``req.guess`` answered with the slot's header and no elements."""
        check_key(req.key, "ReadSlot")
        slot = self._slot(req.key)
        if slot is None:
            with self._lock:  # a guessed offset it never had, after its last read: none now
                cut = self._gone.freed.get(req.key)
            if req.guess and cut is not None and missed(*cut, req.offset):
                chunk = pb.Chunk(offset=req.offset)
                return pb.SlotHeader(key=req.key, total_numel=cut[0], chunk=chunk), b""
            raise ShardError.not_found(f"slot '{req.key}' was read by all its readers and freed")

        def over() -> bool:
            return slot.complete(req.offset) or bool(slot.missed(req.offset))

        with slot.cond:
            if slot.forgotten and slot.ended is None and not slot.freed:
                return self.read(req, timeout)  # another reader gave up on it, unused
            slot.touched = time.monotonic()
            if req.offset in slot.freed:
                raise ShardError.not_found(
                    f"slot '{req.key}': the chunk at {req.offset:,} was read by all its readers"
                    " and freed"
                )
            slot.waiting[req.reader] += 1
            name = pending.parse_key(req.key)
            raised = True
            try:
                done, gone = wait_asking(
                    slot.cond,
                    lambda: slot.ended is not None or slot.conflict is not None or over(),
                    timeout,
                    lambda: self.news.ended(name.run, pending.missing(slot, req.offset)),
                    f"slot '{req.key}' at {req.offset:,}",
                )
                raised = False
            finally:
                slot.waiting[req.reader] -= 1
                if not slot.waiting[req.reader]:
                    del slot.waiting[req.reader]
                if raised:  # cancelled (its caller left): as a wait that ran out
                    self._forget_if_unused(slot)
            if slot.ended is not None:
                raise ShardError.aborted(slot.ended)
            if slot.conflict is not None and not over():
                raise ShardError.precondition(slot.conflict)
            if not done and not gone:
                self._forget_if_unused(slot)
            if gone or not done:
                raise pending.waited_out(slot, req.offset, gone, timeout, self.news)
            none = slot.missed(req.offset)
            if none and not req.guess:
                raise ShardError.invalid(f"slot '{req.key}': {none}")
            if none:
                return slot.reply(req.offset, 0), b""
            meta, chunk = slot.meta, slot.chunks[req.offset]
            header, payload = slot.reply(req.offset, chunk.numel), slot.payload(chunk)
            if req.reader not in chunk.readers:
                if len(chunk.readers) + 1 >= meta.readers:  # its last reader: it goes now
                    self._free_chunk(slot, req.offset)
                    return header, payload
                # paid for (a chunk may expect 2**32 - 1 readers), but for the last, whose
                # read gives the chunk back: a caller at its share can drain its slots
                self.memory.reserve(ENTRY_RECORD_BYTES, req.key, slot.owner)
                chunk.readers.add(req.reader)
        return header, payload

    def _free_chunk(self, slot: Slot, offset: int) -> None:
        """Caller holds slot.cond."""
        chunk = slot.chunks.pop(offset)
        slot.freed.add(offset)
        with self._lock:  # the freed offset's entry stays paid for until the slot goes
            self.memory.release(chunk.charged() - ENTRY_RECORD_BYTES, slot.owner)
            if len(slot.freed) == slot.num_chunks():
                self._forget_locked(slot)
                cut = (slot.meta.total_numel, slot.meta.chunk_numel)
                self._gone.note_freed(slot.key, cut, slot.owner)

    def _forget_if_unused(self, slot: Slot) -> None:
        """A reader gave up on a slot nobody contributed to and no one else reads: do not
        keep the empty entry (caller holds ``slot.cond``)."""
        if slot.meta is None and not slot.chunks and not slot.waiting:
            with self._lock:
                self._forget_locked(slot)

    def _forget_locked(self, slot: Slot) -> None:
        """Drops ``slot``'s entry if it is still the store's, its record's charge with it
        (caller holds ``_lock``, and ``slot.cond``: a call that found the slot before and
        takes it after sees ``forgotten``; before, a contribution added to a forgotten slot
        was lost, its charge with it, out of reach of DropJob and the sweeper)."""
        if self._slots.get(slot.key) is slot:
            del self._slots[slot.key]
            slot.forgotten = True
            freed = len(slot.freed) * ENTRY_RECORD_BYTES
            self.memory.release(slot_charge(slot.key) + freed, slot.owner)

    # -- the end of pending work -------------------------------------------------------------
    def expire(self) -> int:
        """Drops the slots that got no contribution or read for ``ttl_s`` seconds; returns
        how many."""
        limit = time.monotonic() - self.ttl_s
        with self._lock:
            stale = [s for s in self._slots.values() if s.touched < limit]
        ended = 0
        for slot in stale:
            with slot.cond:
                if slot.touched < limit and slot.ended is None:
                    self._end(slot, pending.expired(slot, self.ttl_s))
                    ended += 1
        return ended

    def drop_run(self, run: str) -> int:
        """Drops every slot and mailbox of run ``run`` (keys ``<run>:...``, and its groups'
        ``<run>/<group>:...`` and restarts' ``<run>.e<epoch>:...``); returns how many."""
        with self._lock:
            self._gone.forget_abort(run)
        return self._end_run(run, None, f"was dropped with run '{run}' (DropJob)")

    def abort_run(self, run: str, epoch: int, why: str) -> int:
        """Aborts epochs ``0..epoch`` of run ``run`` (its lease lapsed,
        server/collectives/leases.py): its open slots end, and a key of those epochs not open yet is
        refused, both with ABORTED and ``why``. Returns how many slots ended."""
        with self._lock:
            self._gone.abort(run, epoch, why)
        return self._end_run(run, epoch, f"ended: {why}")

    def interrupt(self, why: str) -> None:
        """The server stops: every open slot ends with ``why``, its readers' waits with it,
        and a call that comes later (one that waited for a thread) opens none."""
        with self._lock:
            self._stopped = why
            slots = list(self._slots.values())
        for slot in slots:
            with slot.cond:
                if slot.ended is None:
                    self._end(slot, f"slot '{slot.key}': {why}")

    def forget_run(self, run: str) -> int:
        """Run ``run`` is over (the lease table forgot it): a new run under its id starts clean,
        its freed and ended keys forgotten, its open slots dropped (a new rank's contribution
        would read as a retry of the old one's). Returns how many were dropped."""
        with self._lock:
            self._gone.forget_run(run)
        return self._end_run(run, None, f"was dropped: run '{run}' ended", remember=False)

    def _end_run(self, run: str, epoch: int | None, why: str, remember: bool = True) -> int:
        """Ends the open slots of ``run`` (of epochs up to ``epoch``; None: all)."""
        with self._lock:
            mine = [
                slot
                for key, slot in self._slots.items()
                if (e := pending.run_epoch(key, run)) is not None and (epoch is None or e <= epoch)
            ]
        for slot in mine:
            with slot.cond:
                if slot.ended is None:
                    self._end(slot, f"slot '{slot.key}' {why}", remember)
        return len(mine)

    def _end(self, slot: Slot, why: str, remember: bool = True) -> None:
        """Caller holds ``slot.cond``: frees it, wakes its readers, remembers why (unless
        not ``remember``: its key may open again)."""
        slot.ended = why
        slot.cond.notify_all()
        with self._lock:
            self.memory.release(sum(c.charged() for c in slot.chunks.values()), slot.owner)
            slot.chunks.clear()
            self._forget_locked(slot)
            if remember:
                self._gone.note_ended(slot.key, why, slot.owner)
