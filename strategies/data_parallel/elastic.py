"""Elastic data parallelism for ZeRO-1/2 and FSDP: the ranks that train may change between steps.

Every byte of these strategies' state lives on the servers, so a step can be trained by any
set of ranks, as long as the ranks agree on the set and the servers know it. With
``ShardingConfiguration(elastic=True)`` each step's members are agreed on the job's coordinator
(server/collectives/membership.py numbers the protocol; client/membership.py is the rank's
side), and the result does not depend on who was there:

- the step's *global* batch is fixed: ``batch_part(B)`` is this rank's contiguous part of it
  among the step's members (in rank order, sizes differing by at most one; the slice rule of
  protos/slicing.py), ``micro_batch_parts(B)`` that part cut for gradient accumulation;
- each push names the step's members and ``B``, and the servers weight member i's micro-batch
  j by its rows ``n_ij / B``, so the reduced gradient is the gradient of the global batch's mean
  loss (each micro-batch's loss is its own rows' mean), summed in rank order: equal to
  single-process training on the same global batches within float64 round-off, and bitwise
  equal across runs with the same membership schedule. Clipping and loss scaling act on that
  reduced gradient as without elasticity.

A rank joins at a step boundary: ``join_step()`` (``batch_part`` and a forward with gradients
call it) waits until the coordinator makes it a member of the step the servers train next, or
of a later one, whose step it then adopts (``step_count``). Building the optimizer joins
nothing: a rank restarted after the others finished finds the servers at the loop's end and
trains no step. Collectives of a step go over its
members only (``step_group()``; ``batch_mean`` is the weighted mean of a per-rank mean over
them): the world's collectives would wait for ranks that are not there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from paramshard.client.membership import Finished, Membership, StepMembers
from paramshard.protos import shard_pb2 as pb
from paramshard.protos import slicing

__all__ = ["ElasticSteps", "REBUILD_POLL_S"]

log = logging.getLogger(__name__)

REBUILD_POLL_S = 0.5
"""How often a rank that found a server restarted empty asks again whether it was rebuilt."""


class ElasticSteps:
    """Mixed into ``ServerShardedModel``: membership per step, batch parts, step groups."""

    config: Any
    client: Any
    _step: int

    def _init_elastic(self) -> None:
        self._members: StepMembers | None = None
        """The members of the step this rank joined last (for ``step_count`` while it
        trains, for the step just trained after ``optimizer.step()``)."""
        self._global_batch = 0  # rows of that step's global batch (batch_part), 0: not said
        self._groups: dict[tuple[int, int], Any] = {}
        self.membership: Membership | None = None
        """This rank's side of the membership protocol (None unless elastic)."""
        if self.config.elastic:
            # a lost rank is dropped from the next step, never waited for (client/leases.py)
            self.client.run_state.cannot_rejoin()
            self.membership = Membership(
                self.client,
                self.config.job,
                min_members=self.config.min_world_size,
                window_s=self.config.join_window_s,
                wait_s=self.config.elastic_wait_s,
            )

    @property
    def elastic(self) -> bool:
        """Whether the ranks may change between steps (``ShardingConfiguration.elastic``)."""
        return self.membership is not None

    @property
    def joined(self) -> StepMembers | None:
        """The members of the step this rank joined last (the step it trains, or after
        ``optimizer.step()`` the one it trained); None before it joined one or unless elastic."""
        return self._members

    @property
    def step_members(self) -> tuple[int, ...]:
        """The ranks training the current step (all ranks unless elastic)."""
        if not self.elastic:
            return tuple(range(self.client.world_size))
        return self.join_step().members

    def join_step(self, until: int | None = None) -> StepMembers | None:
        """Elastic: waits until this rank is a member of the step the servers train next or
        of a later one (a rank that joins, or that sat a step out, adopts that step's number:
        ``step_count``); returns the members. None unless elastic, or when ``until`` (a
        training loop's end) is given and the servers have applied that many steps while this
        rank waited: it adopts their step count, a member of no step."""
        if self.membership is None:
            return None
        if self._members is not None and self._members.step == self._step:
            return self._members
        got = self.membership.join(self._step, until)
        if isinstance(got, Finished):
            if got.applied != self._step:
                self._adopt_step(got.applied)
            return None
        if got.step != self._step:
            self._adopt_step(got.step)
        self._members, self._global_batch = got, 0
        return got

    def _await_rebuilt(
        self, register: Callable[[], tuple[set[int], set[int]]], held: set[int], empty: set[int]
    ) -> tuple[set[int], set[int]]:
        """A rank that comes while a server restarted empty (a node lost its trainer and its
        server at once): the running ranks rebuild it in their recovery (replicas, or the
        newest snapshot: strategies/elastic_training.py), so this rank waits for them,
        registering again every ``REBUILD_POLL_S``, up to the client's ``timeout_s``, instead
        of failing and spending a restart. Not rebuilt within ``join_window_s``: the ranks
        that ran are gone too (lost during their recovery) or stuck, so it takes part in a
        recovery round itself (``_rebuild``). ``register()``: the versions of the slices that
        hold values, and of those that hold none (``held``, ``empty``: its first answer);
        returns its last."""
        log.warning(
            "rank %d: job '%s' is at step %d on some servers and holds no values on others (a"
            " server restarted empty): waiting up to %.0f s for the running ranks to rebuild it",
            self.client.rank, self.config.job, max(held), self.client.timeout_s,
        )  # fmt: skip
        if self.membership is not None:  # the others' recovery round need not wait for it
            self.membership.sit_out()
        now = time.monotonic()
        deadline, alone_at = now + self.client.timeout_s, now + self.config.join_window_s
        while held and empty and time.monotonic() < deadline:
            if time.monotonic() < alone_at:
                time.sleep(REBUILD_POLL_S)
            else:
                alone_at = float("inf")  # once
                self._rebuild()
            held, empty = register()
        return held, empty

    def _rebuild(self) -> None:
        """A recovery round, as the running ranks hold one (strategies/elastic_training.py):
        its lowest live member restores the job (replicas, else the newest snapshot); a rank
        that still runs and recovers in the same epoch leads it or waits for it."""
        state = self.client.run_state
        epoch = state.next_epoch(state.current())
        log.warning(
            "rank %d: job '%s' not rebuilt within %.0f s (join_window_s): the ranks that ran"
            " are gone or stuck; joining a recovery round (epoch %d) to rebuild it",
            self.client.rank, self.config.job, self.config.join_window_s, epoch,
        )  # fmt: skip
        self.restart_collectives(epoch)
        self._recovery_round(epoch)

    def _adopt_step(self, step: int) -> None:
        """Continues at the servers' ``step`` (the strategy refreshes what it keeps)."""
        raise NotImplementedError

    def batch_part(self, global_batch_size: int) -> slice:
        """This rank's rows of the step's global batch of ``global_batch_size`` rows:
        contiguous, in rank order among the step's members (all ranks unless elastic), sizes
        differing by at most one. Elastic: joins the step first (it may adopt a later one:
        read ``step_count`` after this), and the servers weight this rank's gradient by its
        share, so compute the loss as the mean over these rows."""
        if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int):
            raise TypeError(
                f"batch_part: global_batch_size must be an int, got {global_batch_size!r}"
            )
        members = self.join_step()
        if members is None:
            world = self.client.world_size
            if global_batch_size < world:
                raise ValueError(
                    f"batch_part: a global batch of {global_batch_size} rows cannot give each"
                    f" of {world} ranks a row"
                )
            lo, hi = slicing.slice_bounds(global_batch_size, world, self.client.rank)
            return slice(lo, hi)
        part = members.part(self.client.rank, global_batch_size)
        self._global_batch = global_batch_size
        self._begin_training()
        return part

    def micro_batch_parts(self, global_batch_size: int) -> list[slice]:
        """``batch_part`` cut into ``gradient_accumulation_steps`` micro-batches (rows of the
        global batch, by the slice rule). Elastic: each micro-batch's loss is the mean over its
        own rows; the servers weight it by those rows (no dividing by the number of
        micro-batches)."""
        part = self.batch_part(global_batch_size)
        count = self.config.gradient_accumulation_steps
        if part.stop - part.start < count:
            raise ValueError(
                f"micro_batch_parts: {part.stop - part.start} rows cannot be cut into"
                f" {count} micro-batches (gradient_accumulation_steps)"
            )
        bounds = (slicing.slice_bounds(part.stop - part.start, count, j) for j in range(count))
        return [slice(part.start + lo, part.start + hi) for lo, hi in bounds]

    def step_group(self) -> Any:
        """A client for collectives among the members of the step joined last (the step
        being trained, or after ``optimizer.step()`` the one just trained); the client itself
        unless elastic. Every member makes the same calls on it."""
        m = self._members
        if self.membership is None:
            return self.client
        if m is None:
            m = self.join_step()
        key = (m.step, m.generation)
        group = self._groups.get(key)
        if group is None:
            name = f"s{m.step}g{m.generation}"
            group = self.client.subgroup(list(m.members), name)
            base = self.client.__dict__.get("_base_run_id", self.client.run_id)
            # the round's epoch, whatever this rank's own: every member meets on the same keys
            group.run_id = f"{base}.e{m.epoch}/{name}" if m.epoch else f"{base}/{name}"
            self._groups = {key: group}
        return group

    def batch_mean(self, value: float, global_batch_size: int | None = None) -> float:
        """The mean over a global batch of a per-rank mean ``value`` (a loss over this rank's
        part of it): the step's members' values weighted by their rows. The batch is the
        step's (``batch_part``'s) unless ``global_batch_size`` names another one cut the same
        way among the same members (a validation set); with neither (or not elastic), the
        plain mean over the step's ranks."""
        group = self.step_group()
        members, size = self._members, global_batch_size or self._global_batch
        weight = 1.0 / group.world_size
        if members is not None and size:
            part = members.part(self.client.rank, size)
            weight = (part.stop - part.start) / size
        out = group.all_reduce(torch.tensor([value * weight], dtype=torch.float64), "sum")
        return float(out[0])

    def leave(self, reason: str = "") -> None:
        """Elastic: this rank leaves the job (protocol step 6); the others go on without it."""
        if self.membership is not None:
            self.membership.leave(reason)

    def _begin_training(self) -> None:
        """This rank trains the step it joined: leaving now makes the others redo it."""
        if self.membership is not None:
            self.membership.training = self._step

    def _push_membership(self) -> pb.StepMembership | None:
        """What this step's pushes carry (None unless elastic)."""
        if self.membership is None:
            return None
        m = self._members
        if m is None or m.step != self._step:
            raise RuntimeError(
                f"elastic job '{self.config.job}': rank {self.client.rank} pushes gradients of"
                f" step {self._step} without having joined it; call model.batch_part(B) (or a"
                " forward with gradients) first"
            )
        self._begin_training()
        return m.to_pb(self._global_batch)

    def _generation(self) -> int | None:
        """The membership generation this rank trains the step under (None unless elastic)."""
        m = self._members
        return m.generation if self.membership is not None and m is not None else None
