"""What each rank of a pipeline holds, by name, shape and dtype (a *layout*), and the whole
model's tensors gathered from every rank by those layouts: every rank knows every rank's
layout, so the all-gather sends no names (``PipelineParallelModel.gather_full_state_dict``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from paramshard.strategies.pipeline.split import StagePlan

__all__ = ["Layout", "gather", "layout_of"]

Layout = list[tuple[str, torch.Size, torch.dtype]]


def layout_of(
    items: Iterable[tuple[str, torch.Tensor]],
    plan: StagePlan,
    num_stages: int,
    rank: int,
    dedupe: bool = False,
) -> Layout:
    """(name, shape, dtype) of what pipeline rank ``rank`` holds of ``items``, in their order;
    with ``dedupe``, a tensor under several names (a tied weight) under its first only."""
    out, seen = [], set()
    for name, t in items:
        stage = plan.stage_of(name)
        if stage != -1 and stage % num_stages != rank:
            continue
        if dedupe and id(t) in seen:
            continue
        seen.add(id(t))
        out.append((name, t.shape, t.dtype))
    return out


def gather(pp: Any, layouts: list[Layout], mine: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every rank's tensors on every rank (collective over pipeline group ``pp``, None for a
    single stage): one all-gather per dtype of each rank's tensors flattened in layout order.
    A name several ranks hold (a tied weight) comes from its first holder."""
    out: dict[str, torch.Tensor] = {}
    dtypes = sorted({dt for layout in layouts for _, _, dt in layout}, key=str)
    for dt in dtypes:
        # one spare element: a rank without tensors of this dtype still sends something
        pieces = [t.detach().reshape(-1) for t in mine.values() if t.dtype == dt]
        spare = torch.zeros(1, dtype=dt, device=pieces[0].device if pieces else None)
        flat = torch.cat([*pieces, spare])
        gathered = [flat] if pp is None else pp.all_gather(flat)
        for layout, buf in zip(layouts, gathered, strict=True):
            offset = 0
            for name, shape, d in layout:
                if d != dt:
                    continue
                n = shape.numel()
                out.setdefault(name, buf[offset : offset + n].reshape(shape).clone())
                offset += n
    return out
