"""Where a model is cut into pipeline stages when the user names no ``split_points``.

The cut is made in the model's *block container*: the ``nn.ModuleList`` / ``nn.Sequential`` /
``nn.ModuleDict`` holding the most parameters (a GPT's ``blocks``, GPT-2's ``transformer.h``,
Llama's ``model.layers``; an ``nn.Sequential`` model is its own container), as torchtitan
cuts at its ``layers``. A stage begins at each split point, a child of that container.

- ``uniform``: equal block counts (the first stages take the remainder); the modules before
  the container (embeddings) go with the first stage, those after it (final norm, head) with
  the last.
- ``balanced``: the sequence [modules before the container, block 0, ..., block n-1, modules
  after it] is cut where the stages' parameter counts are most even (``balanced_partition``).
  A weight shared by several modules (a tied embedding and head) counts for each, since every
  stage that uses it keeps a copy. The end stages may get fewer blocks, or none.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from torch import nn

__all__ = [
    "PartitionName",
    "UniformPartitionStrategy",
    "LoadBalancedPartitionStrategy",
    "partition_name",
    "uniform_partition",
    "balanced_partition",
    "block_container",
    "default_split_points",
]

PartitionName = Literal["uniform", "balanced"]
_PARTITIONS: tuple[str, ...] = get_args(PartitionName)
_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


class UniformPartitionStrategy:
    """Equal block counts per stage (``partition="uniform"``)."""

    name: PartitionName = "uniform"


class LoadBalancedPartitionStrategy:
    """Stages of near-equal parameter cost, AiDotNet's LoadBalancedPartitionStrategy
    (``partition="balanced"``; see ``balanced_partition``)."""

    name: PartitionName = "balanced"


_PARTITION_ALIASES = {"load_balanced": "balanced", "loadbalanced": "balanced"}


def partition_name(partition: Any) -> PartitionName:
    """ "uniform" or "balanced", from a name (case, '-' and "load_balanced" accepted) or a
    partition strategy class or instance."""
    kinds = (UniformPartitionStrategy, LoadBalancedPartitionStrategy)
    if isinstance(partition, kinds) or (
        isinstance(partition, type) and issubclass(partition, kinds)
    ):
        return partition.name
    if isinstance(partition, str):
        key = partition.lower().replace("-", "_")
        key = _PARTITION_ALIASES.get(key, key)
        if key in _PARTITIONS:
            return key  # type: ignore[return-value]
    raise ValueError(
        f"partition must be one of {', '.join(_PARTITIONS)} (or a partition strategy),"
        f" got {partition!r}"
    )


def uniform_partition(num_items: int, num_stages: int) -> list[range]:
    """Contiguous ranges of equal size; the first ``num_items % num_stages`` get one more."""
    base, extra = divmod(num_items, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        size = base + (1 if s < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def balanced_partition(costs: list[int], num_stages: int) -> list[range]:
    """Contiguous, non-empty ranges of ``costs`` that minimise the most expensive stage.

    AiDotNet's LoadBalancedPartitionStrategy idea (balance the stages' parameter cost), solved
    exactly as the linear-partition problem by dynamic programming: ``best[k][j]`` is the
    smallest possible maximum stage cost when the first ``j`` items form ``k`` stages.
    Ties go to the earliest cut, so every rank computes the same partition.
    """
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot cut {n} layers into {num_stages} non-empty pipeline stages")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for k in range(1, num_stages + 1):
        for j in range(k, n - (num_stages - k) + 1):
            for i in range(k - 1, j):
                cost = max(best[k - 1][i], prefix[j] - prefix[i])
                if cost < best[k][j]:
                    best[k][j], cut[k][j] = cost, i
    bounds, j = [], n
    for k in range(num_stages, 0, -1):
        i = cut[k][j]
        bounds.append(range(i, j))
        j = i
    return bounds[::-1]


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def block_container(model: nn.Module) -> str:
    """Name of the container of ``model``'s repeated blocks ("" for the model itself): the
    ModuleList / Sequential / ModuleDict with the most parameters."""
    found = [
        (_numel(m), -len(name), name)
        for name, m in model.named_modules()
        if isinstance(m, _CONTAINERS) and len(m) > 0
    ]
    if not found:
        raise TypeError(
            f"{type(model).__name__} has no nn.ModuleList / nn.Sequential of blocks to cut"
            " into pipeline stages: name where each stage begins with split_points=[...]"
        )
    return max(found)[2]


def _costs_around(model: nn.Module, container: str) -> tuple[int, int]:
    """Parameter counts of the modules before and after the container, in registration order
    (a weight shared between both sides counts on each; the container's ancestors' own
    parameters count before it)."""
    inside = container + "." if container else ""
    before, after, seen_container = 0, 0, False
    for name, module in model.named_modules():
        if name == container:
            seen_container = True
            continue
        if container and name.startswith(inside):
            continue
        n = sum(p.numel() for p in module.parameters(recurse=False))
        if seen_container:
            after += n
        else:
            before += n
    return before, after


def default_split_points(
    model: nn.Module, num_stages: int, partition: PartitionName = "uniform"
) -> list[str]:
    """The ``num_stages - 1`` module names where stages 1, 2, ... begin."""
    partition = partition_name(partition)
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    name = block_container(model)
    container = model.get_submodule(name) if name else model
    children = [k for k, c in container.named_children() if c is not None]
    dot = f"{name}." if name else ""
    n = len(children)
    if num_stages == 1:
        return []
    if partition == "uniform":
        if n < num_stages:
            raise ValueError(
                f"uniform partition needs at least one block per stage: {n} blocks,"
                f" {num_stages} stages"
            )
        ranges = uniform_partition(n, num_stages)
        return [f"{dot}{children[r.start]}" for r in ranges[1:]]
    before, after = _costs_around(model, name)
    costs = [_numel(container.get_submodule(k)) for k in children]
    items = [f"{dot}{k}" for k in children]
    head = _first_module_after(model, name) if after else None
    if before:
        costs, items = [before, *costs], [None, *items]
    if after and head is not None:
        costs, items = [*costs, after], [*items, head]
    ranges = balanced_partition(costs, num_stages)
    points = [items[r.start] for r in ranges[1:]]
    if any(p is None for p in points):  # cannot happen: item 0 starts the first range
        raise AssertionError(f"balanced partition produced no module for a stage: {ranges}")
    return points  # type: ignore[return-value]


def _first_module_after(model: nn.Module, container: str) -> str | None:
    """The first module with parameters registered after the container (the final norm or
    head), where the last stage of a balanced partition may begin."""
    inside = container + "." if container else ""
    seen = False
    for name, module in model.named_modules():
        if name == container:
            seen = True
            continue
        if not seen or (container and name.startswith(inside)):
            continue
        if any(True for _ in module.parameters(recurse=False)):
            return _top_after(model, name, container)
    return None


def _top_after(model: nn.Module, name: str, container: str) -> str:
    """The outermost module containing ``name`` that does not also contain the container."""
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        candidate = ".".join(parts[:i])
        if not (container == candidate or container.startswith(candidate + ".")):
            return candidate
    return name
