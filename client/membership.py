"""A rank's side of elastic membership: join each step, leave, take part in a recovery round.

The protocol is numbered once, in server/collectives/membership.py. Here a rank of an elastic
job (``Membership``) asks the job's coordinator (its client's server 0) which ranks train a
step, waiting for the decision, and says goodbye when it ends. Torch-free: the strategies turn
a step's members into batch parts and pushes (strategies/data_parallel/elastic.py).

A rank that ends while it is a member of a step not applied yet (an exception in a
``LocalCluster`` rank, a script that stops early) gives up its epoch when it leaves, so the
others redo that step without it at once instead of waiting for its gradient. Every
``Membership`` leaves at interpreter exit too, before the client's lease is released.
"""

from __future__ import annotations

import atexit
import logging
import os
import random
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import grpc

from paramshard.client import slow_waits
from paramshard.client.restarts import ELASTIC_ENV
from paramshard.client.rpc import ShardClientError, unusable_reply
from paramshard.protos import shard_pb2 as pb
from paramshard.protos import slicing
from paramshard.protos.run_ids import MAX_EPOCH
from paramshard.protos.words import listed

__all__ = [
    "ELASTIC_ENV",
    "MIN_NPROC_ENV",
    "Finished",
    "Membership",
    "MembershipError",
    "StepMembers",
    "leave",
]

log = logging.getLogger(__name__)

MIN_NPROC_ENV = "PARAMSHARD_MIN_NPROC"
"""``paramshard launch --min-nproc M``: the fewest members a step trains with."""
LEAVE_TIMEOUT_S = 2.0
MAX_PAUSE_S = 5.0
"""The longest pause before asking again that a coordinator's ``retry_after_ms`` can set
(it asks for at most 2 s; this bounds what a wrong server could make a rank sleep)."""


class MembershipError(RuntimeError):
    """A step could not get its minimum of members within the wait allowed."""


@dataclass(frozen=True)
class StepMembers:
    """The ranks that train one step (a decided round, server/collectives/membership.py)."""

    step: int
    generation: int
    members: tuple[int, ...]
    epoch: int

    @property
    def leader(self) -> int:
        """The lowest member: the one that takes a checkpoint for all."""
        return self.members[0]

    def index(self, rank: int) -> int:
        """``rank``'s place among the members (rank order)."""
        return self.members.index(rank)

    def part(self, rank: int, global_batch: int) -> slice:
        """``rank``'s rows of a global batch of ``global_batch`` rows: the members cut it in
        rank order, contiguous parts whose sizes differ by at most one (protos/slicing.py)."""
        if global_batch < len(self.members):
            raise ValueError(
                f"a global batch of {global_batch} rows cannot give each of the"
                f" {len(self.members)} members of step {self.step} a row"
            )
        lo, hi = slicing.slice_bounds(global_batch, len(self.members), self.index(rank))
        return slice(lo, hi)

    def to_pb(self, global_batch: int) -> pb.StepMembership:
        return pb.StepMembership(
            generation=self.generation, members=self.members, global_batch=global_batch
        )


@dataclass(frozen=True)
class Finished:
    """What ``Membership.join(step, until)`` returns when the servers have applied ``until``
    steps (``applied``, at least that) while this rank waited: the others trained the loop's
    last step, nothing is left for this rank to join."""

    applied: int


class Membership:
    """Rank ``client.rank``'s membership in elastic job ``job``: ``join`` each step.

    ``min_members``: a step trains with at least this many members; ``window_s``: how long a
    round waits for the ranks it expects; ``wait_s``: how long a rank waits while fewer than
    ``min_members`` are there before ``MembershipError``."""

    def __init__(
        self, client: Any, job: str, *, min_members: int, window_s: float, wait_s: float
    ) -> None:
        self.client, self.job = client, job
        self.min_members, self.window_s, self.wait_s = min_members, window_s, wait_s
        self.run = client.__dict__.get("_base_run_id", client.run_id)
        self.known: tuple[int, ...] = tuple(range(client.world_size))
        self.left = False
        self.training: int | None = None
        """The step this rank began training (its batch part taken, a forward or a push made),
        until it is applied: leaving then makes the others redo it (``leave``)."""
        client.run_state.elastic = True
        _registry.add(self)

    def _request(self, known: bool = False, **kw: Any) -> pb.JoinRequest:
        """``known``: with the members this rank knew last, which the coordinator asks for
        only to open a round it has no record for (``send_known``); a Join of W ranks that
        carried them each time made a step cost the coordinator O(W^2)."""
        return pb.JoinRequest(
            run=self.run,
            job=self.job,
            rank=self.client.rank,
            world_size=self.client.world_size,
            epoch=self.client.run_state.epoch,
            min_members=self.min_members,
            window_ms=int(self.window_s * 1000),
            known_members=self.known if known else (),
            **kw,
        )

    def _call(self, **kw: Any) -> pb.JoinReply:
        """One Join, sent again with the known members when the coordinator asks for them."""
        reply = self.client.call(0, "Join", self._request(**kw))
        if reply.send_known:
            reply = self.client.call(0, "Join", self._request(known=True, **kw))
        return reply

    def _ask(self, label: str, until: int | None = None, **kw: Any) -> pb.JoinReply:
        """Asks the coordinator until the round is decided (and, for ``final``, done) or, with
        ``until``, the servers have applied that many steps; raises ``MembershipError`` once it
        waited ``wait_s`` below the minimum."""
        below_since, began = None, time.monotonic()
        said, every = 0.0, slow_waits.notice_s()
        while True:
            reply = self._call(**kw)
            recovery = kw.get("recovery", False)
            if _finished(reply, until) or (
                reply.decided and (not recovery or reply.done or self._leads(reply))
            ):
                return reply
            now = time.monotonic()
            notice = self.client.run_state.current()
            if recovery and (notice is not None or now - began > self.wait_s):
                # this round's leader gave up (a new failure): recover again, in a new epoch
                why = notice.reason if notice else f"no restore after {now - began:.0f} s"
                address = self.client.spec.addresses[0]
                raise ShardClientError(0, address, "Join", grpc.StatusCode.ABORTED, why)
            if reply.retry_after_ms:  # it answered before it could wait: ask again later
                pause = min(reply.retry_after_ms / 1000, MAX_PAUSE_S)
                time.sleep(pause * random.uniform(0.5, 1.0))
            if not reply.below_min:
                below_since, said = None, 0.0
                continue
            below_since = below_since or now
            if now - below_since >= said + every > 0:  # says so while it waits (slow_waits)
                said = now - below_since
                log.warning(
                    "job '%s' %s: %d rank(s) there (%s), fewer than the minimum of %d; waited"
                    " %.0f s of %.0f s (elastic_wait_s) for more",
                    self.job, label, reply.announced_count,
                    _listed(reply.announced, reply.announced_count), self.min_members, said,
                    self.wait_s,
                )  # fmt: skip
            if now - below_since > self.wait_s:
                there = _listed(reply.announced, reply.announced_count)
                raise MembershipError(
                    f"job '{self.job}' {label}: {reply.announced_count} rank(s) there"
                    f" ({there}), fewer than the minimum of {self.min_members}"
                    f" (min_world_size, paramshard launch --min-nproc);"
                    f" waited {now - below_since:.0f} s (elastic_wait_s)"
                )

    def _leads(self, reply: pb.JoinReply) -> bool:
        """This rank restores the job: the coordinator names it the recovery round's leader (a
        member, or a rank that came late once every member was lost before restoring)."""
        return reply.decided and reply.leader == self.client.rank

    def join(self, step: int, until: int | None = None) -> StepMembers | Finished:
        """Waits until this rank is a member of step ``step`` or a later one (protocol steps
        1-3); moves the client to the round's epoch. Returns the members, or ``Finished`` once
        the servers have applied ``until`` steps (a training loop's end: a rank that comes as
        the others train the last step, or after, would wait below the minimum for ranks that
        are gone)."""
        while True:
            reply = self._ask(f"step {step}", until=until, step=step)
            if reply.member:
                self._check_members(reply, step)
                self._adopt_epoch(reply.epoch)
                self.known = tuple(reply.members)
                return StepMembers(reply.step, reply.generation, tuple(reply.members), reply.epoch)
            if _finished(reply, until):
                self._adopt_epoch(reply.epoch)  # its pulls at the servers' step go there
                return Finished(reply.applied)
            step = reply.next_step  # too late for this one: the next (a joining rank)

    def _check_members(self, reply: pb.JoinReply, step: int) -> None:
        """A decided step's members can be: this rank among them, each rank of the world
        once, in order, and the step the one asked or later. The coordinator's word decides
        who trains on which rows and how many members every server waits for: a list of
        [0, 0, 0] had rank 0 train 3 of 8 rows, one without this rank failed in ``part``."""
        members, world = list(reply.members), self.client.world_size
        if (
            reply.step >= step
            and members == sorted(set(members))
            and members[-1:] < [world]
            and self.client.rank in members
        ):
            return
        raise unusable_reply(self.client, 0, "Join", (
            f"step {reply.step} (this rank asked for {step} or later) with members"
            f" {_listed(members, len(members))} ({len(members):,}), in a"
            f" world of {world} where this rank is {self.client.rank}"
        ))  # fmt: skip

    def recovery(self, epoch: int) -> bool:
        """Takes part in the recovery round of ``epoch`` (protocol step 7): True when this
        rank is to restore the job (then call ``recovered``), False once another did."""
        reply = self._ask(f"recovery round {epoch}", recovery=True)
        self._adopt_epoch(reply.epoch)
        return not reply.done

    def recovered(self) -> None:
        """The leader of this epoch's recovery round restored the job."""
        self._call(recovery=True, done=True)

    def leave(self, reason: str = "") -> bool:
        """Protocol step 6, best effort: says goodbye; when this rank began training a step
        not applied yet, ends its epoch so the others redo that step. Whether it did."""
        if self.left:
            return False
        self.left = True
        reply = self._say_leave()
        if reply is None:  # the coordinator is gone: its leases will tell
            return False
        if reply.in_flight and self.training is not None:
            why = f": {reason}" if reason else ""
            self.client.run_state.give_up(f"left job '{self.job}'{why}")
        return reply.in_flight and self.training is not None

    def sit_out(self) -> None:
        """Best effort: the coordinator stops waiting for this rank in the rounds open now
        (its next ``join`` takes it back). A rank that comes while a server is rebuilt
        (strategies/data_parallel/elastic.py) says so, or the others' recovery round, which
        expects it as it is alive again, would wait ``window_s`` for it; the job's history
        records it leaving the step it does not train."""
        self._say_leave()  # no answer: the round then waits its window, no more

    def _say_leave(self) -> pb.JoinReply | None:
        """``Join(leave=True)`` to the coordinator, once, briefly; None without an answer."""
        try:
            return self.client.plain_call(0, "Join", self._request(leave=True), LEAVE_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - best effort: the callers say what follows
            return None

    def catch_up(self) -> None:
        """A rank new to the run moves past an epoch the run aborted before it came (the
        notice its lease's first answer carried: a rank lost earlier): its first pulls, made
        before it joins a step, would be refused in that epoch. Joining moves it on to the
        members' epoch after."""
        notice = self.client.run_state.current()
        if notice is not None and not notice.final:
            self._adopt_epoch(notice.epoch + 1)

    def _adopt_epoch(self, epoch: int) -> None:
        if epoch > MAX_EPOCH:  # no run reaches it; its next would not fit a lease request
            raise unusable_reply(self.client, 0, "Join", f"epoch {epoch:,} (at most {MAX_EPOCH:,})")
        if epoch > self.client.run_state.epoch:
            self.client.restart_collectives(epoch)


def leave(client: Any, reason: str = "") -> None:
    """Every elastic membership of ``client`` leaves (``LocalCluster`` when a rank raises)."""
    for m in _registry.of(client):
        m.leave(reason)


class _Registry:
    """The process's memberships, left at interpreter exit before the leases are released
    (atexit runs the last registered first: this is registered after the lease keeper)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: weakref.WeakSet[Membership] = weakref.WeakSet()
        self._registered = False

    def add(self, m: Membership) -> None:
        with self._lock:
            self._items.add(m)
            if not self._registered:
                atexit.register(self._leave_all)
                self._registered = True

    def of(self, client: Any) -> list[Membership]:
        with self._lock:
            return [m for m in self._items if m.client is client]

    def forget_inherited(self) -> None:
        """In a forked child: the memberships are the parent's (a child's exit left them, over
        the parent's channels, and its step went on without the rank: a review); new lock."""
        self._lock, self._items = threading.Lock(), weakref.WeakSet()

    def _leave_all(self) -> None:
        with self._lock:
            items = list(self._items)
        for m in items:
            try:
                m.leave("its process ended")
            except (ShardClientError, ValueError):
                pass


_registry = _Registry()
if hasattr(os, "register_at_fork"):  # as protos/closing.py's registry
    os.register_at_fork(after_in_child=_registry.forget_inherited)


def _listed(ranks: Any, count: int) -> str:
    """The lowest ranks a reply lists, of ``count``."""
    return f"ranks {listed(ranks, count)}" if count else "none"


def _finished(reply: pb.JoinReply, until: int | None) -> bool:
    """Whether ``reply`` says the servers applied ``until`` steps (a coordinator older than
    the ``applied`` field never says so: the rank waits as before)."""
    return until is not None and reply.HasField("applied") and reply.applied >= until
