"""The hang doctor (docs/design.md §3.7): who a waiting slot or gradient step waits for.

A collective hangs when a rank never reaches it. Every open reduction slot knows which
contributors arrived, which readers wait and since when; this module turns that into words (a
timed-out read names the missing ranks, the run and the sequence number) and into the
``PendingWork`` rows of ``Status`` (``paramshard status --pending``). It reads the internals of
``server.slots`` and ``server.store`` under their locks; callers hold them.

Slot keys are made by ``client/collectives.py``, one form per collective:

- ``<run>:ar<seq>/<server>`` all-reduce part reduced on that server, read by every rank;
- ``<run>:rs<seq>/<rank>``   reduce-scatter part of ``rank``, read by that rank only;
- ``<run>:ag<seq>/<rank>``   all-gather part sent by ``rank`` (one SET contribution);
- ``<run>:bc<seq>/<server>`` broadcast part on that server, sent by the source rank;
- ``<run>:p2p<src>-<dst>[.<tag>]/<n>`` the n-th message from ``src`` to ``dst``.

``<run>`` is the client's run id, a group's ``<run>/<group>`` or a restart's ``<run>.e<epoch>``;
a group's ranks are its members' indices. Keys of any other form are reported as they are.

A slot may say it expects up to 2**32 - 1 contributors or readers, and a buffer as many
contributors: rank lists are built from what arrived, never from ``range(expected)``, and list
at most ``MAX_LISTED`` ranks (the chaos fuzzer's Status took 22 GB before).
"""

from __future__ import annotations

import heapq
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from paramshard.protos import shard_pb2 as pb
from paramshard.server.runtime.errors import ShardError
from paramshard.server.runtime.rank_lists import MAX_LISTED, absent, listed

if TYPE_CHECKING:
    from paramshard.server.buffers.store import BufferSlice
    from paramshard.server.collectives.slot import Slot
    from paramshard.server.runtime.run_names import RankNews

__all__ = [
    "SlotName",
    "parse_key",
    "run_epoch",
    "who",
    "missing",
    "waited_out",
    "expired",
    "slot_row",
    "step_row",
    "pending_rows",
    "DEFAULT_PENDING",
    "MAX_PENDING",
]

DEFAULT_PENDING = 100
"""Rows of ``StatusReply.pending`` when the request does not say."""
MAX_PENDING = 1000
"""Rows a Status reply lists at most, whatever the request asks: the reply stays small."""

_MAX_SEQ, _MAX_RANK = 2**64 - 1, 2**32 - 1  # PendingWork's seq; its part and rank lists
_KINDS = {"ar": "all_reduce", "rs": "reduce_scatter", "ag": "all_gather", "bc": "broadcast"}
_COLLECTIVE = re.compile(r"(?P<run>.*):(?P<kind>ar|rs|ag|bc)(?P<seq>\d+)/(?P<part>\d+)")
_MESSAGE = re.compile(
    r"(?P<run>.*?):p2p(?P<src>\d+)-(?P<dst>\d+)(?:\.(?P<tag>.*))?/(?P<seq>\d+)", re.DOTALL
)


@dataclass(frozen=True)
class SlotName:
    """What a slot key says: the collective, its run and sequence number, and its part."""

    key: str
    run: str = ""
    kind: str = "slot"
    """all_reduce | reduce_scatter | all_gather | broadcast | send | slot (another form)."""
    seq: int = 0
    part: int = 0
    src: int = -1
    """send: the sending rank."""
    dst: int = -1
    """send: the receiving rank."""
    tag: str = ""

    @property
    def channel(self) -> str:
        if self.kind != "send":
            return ""
        return f"{self.src}-{self.dst}" + (f".{self.tag}" if self.tag else "")

    def what(self) -> str:
        """``all_reduce #3 of run 'r'``, ``message #2 from rank 0 to rank 1 of run 'r'``, or
        "" for a key of another form."""
        if self.kind == "slot":
            return ""
        if self.kind == "send":
            tag = f" tagged '{self.tag}'" if self.tag else ""
            return (
                f"message #{self.seq} from rank {self.src} to rank {self.dst}{tag} of run"
                f" '{self.run}'"
            )
        return f"{self.kind} #{self.seq} of run '{self.run}'"

    def describe(self) -> str:
        """``slot 'r:ar3/0' (all_reduce #3 of run 'r')``, for messages."""
        what = self.what()
        return f"slot '{self.key}'" + (f" ({what})" if what else "")

    def rank_of(self, contributor: int) -> int | None:
        """The rank behind a contributor index; None when the key does not say. A SET slot's
        only contributor is 0: an all-gather part's rank, a message's sender, or a
        broadcast's source (which its key does not name)."""
        if self.kind == "all_gather":
            return self.part
        if self.kind == "send":
            return self.src
        if self.kind == "broadcast":
            return None
        return contributor

    def readers(self, meta: pb.SlotHeader) -> Iterable[int] | None:
        """The ranks that read it, where the key tells them (lazily: ``meta.readers`` may be
        2**32 - 1)."""
        if self.kind == "all_reduce":
            return range(meta.readers)
        if self.kind == "reduce_scatter":
            return (self.part,)
        if self.kind == "all_gather":
            return (r for r in range(meta.readers + 1) if r != self.part)
        if self.kind == "send":
            return (self.dst,)
        return None


def parse_key(key: str) -> SlotName:
    """The ``SlotName`` of ``key`` (kind ``slot`` when it has none of the collectives' forms,
    or numbers past what ``PendingWork`` holds: a sequence of 64 bits, a part or rank of 32)."""
    m = _COLLECTIVE.fullmatch(key)
    if m is not None:
        seq, part = int(m["seq"]), int(m["part"])
        if seq <= _MAX_SEQ and part <= _MAX_RANK:
            return SlotName(key, m["run"], _KINDS[m["kind"]], seq, part)
    m = _MESSAGE.fullmatch(key)
    if m is not None:
        seq, src, dst = int(m["seq"]), int(m["src"]), int(m["dst"])
        if seq <= _MAX_SEQ and max(src, dst) <= _MAX_RANK:
            return SlotName(key, m["run"], "send", seq, dst, src, dst, m["tag"] or "")
    return SlotName(key)


def _ranks(name: SlotName, contributors: Any) -> list[int]:
    return sorted({r for c in contributors if (r := name.rank_of(c)) is not None})[:MAX_LISTED]


def who(slot: Slot, offset: int) -> str:
    """Who contributed to the chunk at ``offset`` and who is missing (caller holds its cond)."""
    name = parse_key(slot.key)
    meta = slot.meta
    if meta is None:
        sender = name.rank_of(0)
        if name.kind in ("all_gather", "send"):
            return f"no contribution has arrived: rank {sender} has not sent it"
        if name.kind == "broadcast":
            return "no contribution has arrived: the source rank has not sent it"
        return "no contribution has arrived (no rank has reached this collective)"
    chunk = slot.chunks.get(offset)
    arrived = set() if chunk is None else chunk.contributors
    if chunk is not None and len(arrived) == meta.expected:
        return f"complete; read by {len(chunk.readers)} of {meta.readers} reader(s)"
    return (
        f"{len(arrived)} of {meta.expected} contributions arrived; missing rank(s)"
        f" {listed(missing(slot, offset))} (arrived: {listed(_ranks(name, arrived))})"
    )


def missing(slot: Slot, offset: int) -> list[int]:
    """The ranks whose contribution to the chunk at ``offset`` has not arrived, where the key
    names them (caller holds its cond): before any contribution, an all-gather part's or a
    message's sender only."""
    name = parse_key(slot.key)
    if slot.meta is None:
        sender = name.rank_of(0) if name.kind in ("all_gather", "send") else None
        return [] if sender is None else [sender]
    chunk = slot.chunks.get(offset)
    arrived = set() if chunk is None else chunk.contributors
    return _ranks(name, absent(range(slot.meta.expected), arrived))


def waited_out(slot: Slot, offset: int, gone: str, timeout: float, news: RankNews) -> ShardError:
    """The error of a read of the chunk at ``offset`` whose wait ended without it (caller
    holds its cond): FAILED_PRECONDITION when the missing ranks ended for good (``gone`` says
    how), else DEADLINE_EXCEEDED after ``timeout``, naming who is missing and where ``news``
    (the server's leases) says they are."""
    name = parse_key(slot.key)
    head = f"{name.describe()}, chunk at {offset:,}"
    if gone:
        return ShardError.precondition(f"{head}: {who(slot, offset)}; {gone}")
    where = news.whereabouts(name.run, missing(slot, offset))
    return ShardError.deadline(f"{head}: waited {timeout:.1f} s; {who(slot, offset)}{where}")


def expired(slot: Slot, ttl_s: float) -> str:
    """Why a slot that got no contribution or read for ``ttl_s`` seconds ends (caller holds its
    cond): ``slot 'r:ar3/0' expired: ... (all_reduce #3 of run 'r'; 1 of 2 ...)``."""
    what = parse_key(slot.key).what()
    what = f"{what}; " if what else ""
    first = min(slot.chunks, default=0)
    return (
        f"slot '{slot.key}' expired: no contribution or read for {ttl_s:g} s"
        f" ({what}{who(slot, first)})"
    )


def slot_row(slot: Slot, now: float) -> pb.PendingWork:
    """The ``PendingWork`` row of an open slot (caller holds ``slot.cond``). A rank has
    arrived once its contribution to every chunk is in."""
    name = parse_key(slot.key)
    row = pb.PendingWork(
        run=name.run,
        kind=name.kind,
        seq=name.seq,
        key=slot.key,
        part=name.part,
        channel=name.channel,
        age_seconds=max(0.0, now - slot.since),
        idle_seconds=max(0.0, now - slot.touched),
        bytes=sum(c.nbytes() for c in slot.chunks.values()),
        waiting=sorted(slot.waiting),
    )
    meta = slot.meta
    if meta is None:
        sender = name.rank_of(0)
        row.missing.extend([] if sender is None else [sender])
        return row
    row.expected = meta.expected
    chunks = list(slot.chunks.values())
    if len(chunks) + len(slot.freed) < slot.num_chunks():
        arrived, complete = set(), False  # a chunk nobody has sent yet
    elif chunks:
        arrived = set.intersection(*(c.contributors for c in chunks))
        complete = len(arrived) == meta.expected
    else:  # every chunk was read by all its readers and freed
        arrived, complete = set(range(min(meta.expected, MAX_LISTED))), True
    row.arrived.extend(_ranks(name, arrived))
    if not complete:
        row.missing.extend(_ranks(name, absent(range(meta.expected), arrived)))
    readers = name.readers(meta)
    if complete and readers is not None and chunks:
        done = set.intersection(*(c.readers for c in chunks))
        row.unread_by.extend(absent(readers, done))
    return row


def _waits(p: Any) -> bool:
    """Whether pending step ``p`` (or None) waits for contributions: some came, not all."""
    return p is not None and not p.reduced and bool(p.chunks)


def step_row(b: BufferSlice, now: float) -> pb.PendingWork | None:
    """The row of a gradient step of slice ``b`` that waits for contributions (caller holds
    ``b.cond``), or None when none does."""
    p = b.pending
    if not _waits(p):
        return None
    arrived = p.arrived(b.slice_numel)
    # an elastic step waits for its members only (server/buffers/membership.py)
    expected = range(b.contributors) if p.members is None else p.members
    missing = absent(expected, set(arrived))
    return pb.PendingWork(
        run=b.job,
        kind="push_grad",
        seq=p.step,
        key=f"{b.job}/{b.name}",
        expected=len(expected),
        arrived=arrived[:MAX_LISTED],
        missing=missing,
        age_seconds=max(0.0, now - p.opened),
        bytes=p.staged_bytes,
        # under the slice's run, which ``run`` (the job) does not name; a rank that failed
        # before it leased is "holds no lease here" (a field check: a step's wait said nothing)
        whereabouts=b.news.whereabouts(b.run_name, missing),
    )


def pending_rows(
    slots: list[Slot], buffers: list[BufferSlice], limit: int
) -> tuple[list[pb.PendingWork], int]:
    """Rows for ``slots`` and ``buffers``, the oldest first, at most ``limit`` (0: the
    default, capped at ``MAX_PENDING``); and how many were left out. Rows are made for the
    oldest only, picked by when each opened: a server may hold many slots (in review, a Status
    made a row for each of 150,000 and took 4.7 s)."""
    limit = min(limit or DEFAULT_PENDING, MAX_PENDING)
    now = time.monotonic()
    work: list[tuple[float, Any, bool]] = [(s.since, s, False) for s in slots if s.ended is None]
    work += [(p.opened, b, True) for b in buffers if _waits(p := b.pending)]
    rows = []
    for _, item, step in heapq.nsmallest(limit, work, key=lambda w: w[0]):
        with item.cond:  # looked at again under its lock: it may have ended since
            row = step_row(item, now) if step else None if item.ended else slot_row(item, now)
        if row is not None:
            rows.append(row)
    rows.sort(key=lambda r: -r.age_seconds)
    return rows, max(0, len(work) - limit)


def run_epoch(key: str, run: str) -> int | None:
    """The epoch of slot ``key`` when it belongs to run ``run``, else None: keys ``<run>:...``,
    its groups' ``<run>/<group>:...``, and after ``restart_collectives`` the same with
    ``.e<N>`` after the run or the group (``<run>.e<N>/<group>:...``); the largest N counts."""
    name = key.split(":", 1)[0]
    if not name.startswith(run):
        return None
    rest = name[len(run) :]
    if rest and not rest.startswith("/") and not _EPOCH_HEAD.match(rest):
        return None  # another run whose id starts with this one's ("r2", "r.eval")
    return max(map(int, _EPOCH.findall(rest)), default=0)


_EPOCH = re.compile(r"\.e(\d+)(?=/|$)")
_EPOCH_HEAD = re.compile(r"\.e\d+(?:/|$)")
