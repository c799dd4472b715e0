"""The 3D rank grid: which rank holds which pipeline stage, tensor slice and data replica.

This is the one place for rank arithmetic (as picotron's ``process_group_manager.py``): every
"who is my neighbour / who is in my group" question is answered here, nowhere else.

Layout, as AiDotNet's HybridShardedModel lays out 512 GPUs = 8 pipeline x 8 tensor x 8 data
("Stage 0: GPUs 0-63; tensor group 0: GPUs 0-7 (data replicas); tensor group 1: GPUs 8-15"):
the grid is indexed [pipeline][tensor][data], data fastest, so

    rank = (pp * tensor_parallel_size + tp) * data_parallel_size + dp

A stage is a contiguous block of ranks, and the data replicas of one (stage, tensor slice)
are neighbours. Naming: "axis" is one of the three grid axes (pipeline, tensor, data);
a "group" is the list of global ranks that differ only along one axis.

Pure Python (no torch): the pipeline, tensor- and data-parallel code all import it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["Topology", "GroupClients", "ring_neighbours"]


def ring_neighbours(index: int, size: int) -> tuple[int, int]:
    """(previous, next) of ``index`` on a ring of ``size``: a pipeline stage's senders and
    receivers (with interleaved chunks, the last stage's chunk c feeds stage 0's chunk c + 1)."""
    if not 0 <= index < size:
        raise ValueError(f"index {index} is outside the ring 0..{size - 1}")
    return (index - 1) % size, (index + 1) % size


class GroupClients(NamedTuple):
    """One rank's clients for collectives inside its three groups (from ``client.subgroup``)."""

    tp: Any
    """Tensor-parallel group: the ranks holding the other slices of this rank's layers."""
    pp: Any
    """Pipeline group: the ranks holding the other stages of this rank's model replica."""
    dp: Any
    """Data-parallel group: the ranks holding the same parameters, fed different data."""


class Topology:
    """The ``pipeline x tensor x data`` grid of ``world_size`` ranks.

    Any one size may be -1, meaning "the rest of the world" (``world_size`` divided by the
    other two); the product of the three must equal ``world_size``.
    """

    def __init__(
        self,
        world_size: int,
        pipeline_parallel_size: int = 1,
        tensor_parallel_size: int = 1,
        data_parallel_size: int = -1,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"Topology: world_size must be >= 1, got {world_size}")
        sizes = {
            "pipeline_parallel_size": pipeline_parallel_size,
            "tensor_parallel_size": tensor_parallel_size,
            "data_parallel_size": data_parallel_size,
        }
        given = (
            f"pipeline_parallel_size={pipeline_parallel_size}, "
            f"tensor_parallel_size={tensor_parallel_size}, "
            f"data_parallel_size={data_parallel_size}"
        )
        for name, size in sizes.items():
            if size == 0 or size < -1:
                raise ValueError(f"Topology: {name} must be a positive size or -1, got {size}")
        rest = [name for name, size in sizes.items() if size == -1]
        if len(rest) > 1:
            raise ValueError(
                f"Topology: only one size may be -1 ('the rest of the world'); got {given}"
            )
        if rest:
            known = 1
            for size in sizes.values():
                if size != -1:
                    known *= size
            if world_size % known:
                raise ValueError(
                    f"Topology: {given} cannot fill world_size {world_size}: "
                    f"{world_size} is not divisible by {known}"
                )
            sizes[rest[0]] = world_size // known
        product = (
            sizes["pipeline_parallel_size"]
            * sizes["tensor_parallel_size"]
            * sizes["data_parallel_size"]
        )
        if product != world_size:
            raise ValueError(
                f"Topology: pipeline_parallel_size ({pipeline_parallel_size}) x "
                f"tensor_parallel_size ({tensor_parallel_size}) x "
                f"data_parallel_size ({data_parallel_size}) = {product}, "
                f"but world_size is {world_size}"
            )
        self.world_size = world_size
        self.pipeline_parallel_size: int = sizes["pipeline_parallel_size"]
        self.tensor_parallel_size: int = sizes["tensor_parallel_size"]
        self.data_parallel_size: int = sizes["data_parallel_size"]

    # -- coordinates -------------------------------------------------------------------------
    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(pp, tp, dp)``: the stage, tensor slice and data replica of ``rank``."""
        self._check_rank(rank)
        rest, dp = divmod(rank, self.data_parallel_size)
        pp, tp = divmod(rest, self.tensor_parallel_size)
        return pp, tp, dp

    def rank_of(self, pp: int, tp: int, dp: int) -> int:
        """The global rank at grid position ``(pp, tp, dp)``."""
        for axis, index, size in (
            ("pp", pp, self.pipeline_parallel_size),
            ("tp", tp, self.tensor_parallel_size),
            ("dp", dp, self.data_parallel_size),
        ):
            if not 0 <= index < size:
                raise ValueError(f"Topology: {axis}={index} is outside 0..{size - 1}")
        return (pp * self.tensor_parallel_size + tp) * self.data_parallel_size + dp

    # -- groups ------------------------------------------------------------------------------
    def tensor_group(self, rank: int) -> list[int]:
        """Ranks with ``rank``'s stage and data replica, in tensor-slice order."""
        pp, _, dp = self.coords(rank)
        return [self.rank_of(pp, t, dp) for t in range(self.tensor_parallel_size)]

    def pipeline_group(self, rank: int) -> list[int]:
        """Ranks with ``rank``'s tensor slice and data replica, in stage order."""
        _, tp, dp = self.coords(rank)
        return [self.rank_of(p, tp, dp) for p in range(self.pipeline_parallel_size)]

    def data_group(self, rank: int) -> list[int]:
        """Ranks with ``rank``'s stage and tensor slice (its data replicas), in replica order."""
        pp, tp, _ = self.coords(rank)
        return [self.rank_of(pp, tp, d) for d in range(self.data_parallel_size)]

    # -- pipeline neighbours -----------------------------------------------------------------
    def is_first_stage(self, rank: int) -> bool:
        return self.coords(rank)[0] == 0

    def is_last_stage(self, rank: int) -> bool:
        return self.coords(rank)[0] == self.pipeline_parallel_size - 1

    def next_stage_rank(self, rank: int) -> int | None:
        """The rank that receives ``rank``'s activations; None on the last stage."""
        pp, tp, dp = self.coords(rank)
        if pp == self.pipeline_parallel_size - 1:
            return None
        return self.rank_of(pp + 1, tp, dp)

    def prev_stage_rank(self, rank: int) -> int | None:
        """The rank that sends ``rank`` its activations; None on the first stage."""
        pp, tp, dp = self.coords(rank)
        if pp == 0:
            return None
        return self.rank_of(pp - 1, tp, dp)

    # -- clients -----------------------------------------------------------------------------
    def group_clients(self, client: Any) -> GroupClients:
        """Clients for ``client.rank``'s tensor, pipeline and data groups.

        Group names are unique per group (``tp{pp}.{dp}``, ``pp{tp}.{dp}``, ``dp{pp}.{tp}``),
        so the slot keys of different groups never collide. Every rank must call this (it
        makes no RPC), and only once per run: a second call would restart each group's
        collective numbering under the same names.
        """
        if client.world_size != self.world_size:
            raise ValueError(
                f"Topology: client has world_size {client.world_size}, "
                f"the topology {self.world_size}"
            )
        rank = client.rank
        pp, tp, dp = self.coords(rank)
        return GroupClients(
            tp=client.subgroup(self.tensor_group(rank), f"tp{pp}.{dp}"),
            pp=client.subgroup(self.pipeline_group(rank), f"pp{tp}.{dp}"),
            dp=client.subgroup(self.data_group(rank), f"dp{pp}.{tp}"),
        )

    # -- printing ----------------------------------------------------------------------------
    def describe(self, rank: int) -> str:
        """``rank``'s place in the grid, e.g. ``PP(1)-TP(0)-DP(1)-Rank(5)``."""
        pp, tp, dp = self.coords(rank)
        return f"PP({pp})-TP({tp})-DP({dp})-Rank({rank})"

    def __repr__(self) -> str:
        return (
            f"Topology(world_size={self.world_size}, "
            f"pipeline_parallel_size={self.pipeline_parallel_size}, "
            f"tensor_parallel_size={self.tensor_parallel_size}, "
            f"data_parallel_size={self.data_parallel_size})"
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Topology) and repr(self) == repr(other)

    def __hash__(self) -> int:
        return hash(repr(self))

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"Topology: rank {rank} is outside 0..{self.world_size - 1}")
