"""A step's contributions under an elastic job's membership: who may push, and each one's weight.

An elastic job's pushes carry the step's ``StepMembership`` (decided on the job's coordinator,
server/collectives/membership.py). Member i (in rank order) cuts its part of the global batch of
B rows into ``num_micro`` micro-batches by the slice rule (protos/slicing.py), so micro-batch j
of member i has ``n_ij`` rows, and its gradient (of those rows' mean loss) is weighted
``n_ij / B``: the weighted sum is the gradient of the global batch's mean loss whoever the
members are, and it is summed in rank order like any other (bitwise reproducible for the same
membership). With ``global_batch`` 0 every contribution weighs ``1 / len(members)``.

A push of a newer generation replaces what the step had accumulated for an older one (a member
was lost mid-step and the others redo it); a push, GradNorm or Step of an older generation is
refused (FAILED_PRECONDITION), so its rank learns to redo the step instead of waiting.
"""

from __future__ import annotations

from collections.abc import Sequence

from paramshard.protos import shard_pb2 as pb
from paramshard.protos import slicing
from paramshard.server.buffers.slice_state import PendingStep
from paramshard.server.runtime.errors import ShardError

__all__ = ["Weights", "check_generation", "check_membership", "elastic_pending"]


class Weights(Sequence[float]):
    """Contribution k's weight (k = member index * num_micro + micro-batch), computed when
    asked: a list of them would be ``members * num_micro`` long, and ``num_micro`` is the
    push's (a push of 2**26 micro-batches built one of 571 MB)."""

    def __init__(self, members: int, num_micro: int, global_batch: int) -> None:
        self.members, self.num_micro, self.global_batch = members, num_micro, global_batch

    def __len__(self) -> int:
        return self.members * self.num_micro

    def __getitem__(self, k: int) -> float:  # type: ignore[override]  # no slices
        if not 0 <= k < len(self):
            raise IndexError(f"contribution {k} of {len(self)}")
        if self.global_batch == 0:
            return 1.0 / self.members
        i, j = divmod(k, self.num_micro)
        lo, hi = slicing.slice_bounds(self.global_batch, self.members, i)
        a, b = slicing.slice_bounds(hi - lo, self.num_micro, j)
        return (b - a) / self.global_batch


def check_membership(
    label: str, contributors: int, h: pb.PushGradHeader, known: PendingStep | None = None
) -> bytes:
    """The checks of push ``h``'s membership that need nothing but the request; returns the
    membership's key (its encoding), which ``elastic_pending`` compares.

    Every member pushes every bucket to every server with the step's W members, so a server
    takes W pushes of W members a bucket: checking each list rank by rank made a step cost
    it O(W^2) in Python. A membership equal to that of ``known`` (the step the slice
    accumulates, whose first push was checked in full) is compared as bytes instead."""
    m = h.membership
    key = m.SerializeToString()
    if known is not None and known.positions is not None and key == known.membership_key:
        if h.contributor not in known.positions:
            raise ShardError.precondition(_not_member(label, h, known.members or ()))
        if m.global_batch and m.global_batch < len(known.positions) * h.num_micro:
            raise ShardError.invalid(_too_few_rows(label, h, len(known.positions)))
        return key
    members = tuple(m.members)
    if not members or any(b <= a for a, b in zip(members, members[1:], strict=False)):
        raise ShardError.invalid(
            f"{label}: step {h.step}'s members must be distinct ranks in ascending order,"
            f" got {list(members)[:16]}"
        )
    if members[-1] >= contributors:
        raise ShardError.invalid(
            f"{label}: member rank {members[-1]} is outside 0..{contributors - 1} (the job's"
            " world size)"
        )
    if h.contributor not in members:
        raise ShardError.precondition(_not_member(label, h, members))
    if m.global_batch and m.global_batch < len(members) * h.num_micro:
        raise ShardError.invalid(_too_few_rows(label, h, len(members)))
    return key


def _not_member(label: str, h: pb.PushGradHeader, members: tuple[int, ...]) -> str:
    return (
        f"{label}: rank {h.contributor} is not a member of step {h.step} (generation"
        f" {h.membership.generation}: ranks {_listed(members)})"
    )


def _too_few_rows(label: str, h: pb.PushGradHeader, members: int) -> str:
    return (
        f"{label}: a global batch of {h.membership.global_batch} rows cannot give each of"
        f" {members} members {h.num_micro} micro-batch(es) of at least one row"
    )


def elastic_pending(
    label: str, current: PendingStep | None, h: pb.PushGradHeader, key: bytes
) -> tuple[PendingStep, bool]:
    """(the pending step push ``h`` adds to, whether it replaces ``current``: an older
    generation's). Checks only (after ``check_membership``, whose key ``key`` is): nothing
    changes here."""
    m = h.membership
    if current is not None and current.positions is not None and key == current.membership_key:
        return current, False  # the step's own membership, byte for byte
    members = tuple(m.members)
    if current is not None and current.members is None:
        raise ShardError.precondition(
            f"{label}: step {h.step} accumulates pushes without membership; an elastic push"
            " cannot join it (every rank of a job is elastic or none is)"
        )
    if current is not None and m.generation < current.generation:
        raise ShardError.precondition(stale(label, h.step, m.generation, current.generation))
    if current is not None and m.generation == current.generation:
        if (members, m.global_batch) != (current.members, current.global_batch):
            raise ShardError.invalid(
                f"{label}: step {h.step} generation {m.generation} has members"
                f" {_listed(current.members)} and a global batch of {current.global_batch};"
                f" this push says {_listed(members)} and {m.global_batch}"
            )
        return current, False
    fresh = PendingStep(
        h.step,
        h.num_micro,
        members=members,
        generation=m.generation,
        global_batch=m.global_batch,
        weights=Weights(len(members), h.num_micro, m.global_batch),
        membership_key=key,
    )
    return fresh, current is not None


def check_generation(label: str, pending: PendingStep | None, step: int, generation: int) -> bool:
    """For a GradNorm or Step of ``step`` trained under ``generation``: False while the step
    has not seen that generation's pushes yet; raises when it moved to a newer one."""
    if pending is None or pending.step != step or pending.members is None:
        return True
    if pending.generation > generation:
        raise ShardError.precondition(stale(label, step, generation, pending.generation))
    return pending.generation == generation


def stale(label: str, step: int, generation: int, current: int) -> str:
    return (
        f"{label}: step {step} is accumulated for membership generation {current}, not"
        f" {generation}: its members changed; join the step again"
    )


def _listed(ranks: tuple[int, ...] | None) -> str:
    ranks = ranks or ()
    return ", ".join(map(str, ranks[:16])) + (", ..." if len(ranks) > 16 else "")
