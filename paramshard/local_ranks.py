"""What a rank of ``LocalCluster`` is made of, in threads or processes alike: its configuration
(``rank_config``) and how its failure is reported (``RankFailed``). Both ``local_cluster`` and
``local_processes`` use it, so neither imports the other's internals."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["RankFailed", "RankLeft", "all_left", "rank_config"]


class RankFailed(RuntimeError):
    """A rank raised. ``rank`` says which; ``error`` (also ``__cause__``) is what it raised."""

    def __init__(self, rank: int, world_size: int, error: BaseException, detail: str = "") -> None:
        super().__init__(
            f"rank {rank} of {world_size} failed: {type(error).__name__}: {error}{detail}"
        )
        self.rank = rank
        self.world_size = world_size
        self.error = error


@dataclasses.dataclass(frozen=True)
class RankLeft:
    """An elastic run's rank that raised and left the job while the others trained on
    (``ShardingConfiguration(elastic=True)``): its entry in ``LocalCluster.run``'s results."""

    rank: int
    error: BaseException


def all_left(results: Sequence[Any], world_size: int) -> None:
    """Raises ``RankFailed`` for the first rank when every rank of an elastic run left."""
    if results and all(isinstance(r, RankLeft) for r in results):
        first = results[0]
        raise RankFailed(first.rank, world_size, first.error, " (every rank left)") from first.error


def rank_config(
    addresses: Sequence[str], rank: int, world_size: int, run_id: str, fields: Mapping[str, Any]
) -> Any:
    """Rank ``rank``'s ShardingConfiguration: a client of its own, whose deadline the
    configuration's ``timeout_s`` sets (strategies/config.py)."""
    from paramshard.client import ClusterSpec, ShardClient
    from paramshard.strategies.config import ShardingConfiguration

    client = ShardClient(
        ClusterSpec(list(addresses)), rank=rank, world_size=world_size, run_id=run_id
    )
    try:
        return ShardingConfiguration(client, **fields)
    except BaseException:
        client.close()
        raise
