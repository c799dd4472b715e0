"""Attention heads under tensor parallelism: split by whole heads, and the counts modules keep.

Megatron splits attention by heads (arXiv 1909.08053, §3, Fig. 3a): each rank runs attention
on its own heads alone. So the projections of one attention module are cut in whole heads,
the same heads in q, k, v (Colwise) and in the output projection's input (Rowwise). With
grouped-query attention (GQA: ``g`` query heads share one key/value head) the unit is a whole
group: ``g`` query heads and their key/value head stay together, so Llama's
``num_key_value_groups`` stays right on every rank. Uneven counts follow the slice rule (the
first ranks get one more group); fewer groups than ranks is an error.

After the split, a module that stores a head count or a width (``n_head``, ``split_size``,
``embed_dim``, ...) no longer matches its rank's part. For the families the project knows it
sets them to the local values (``ADJUSTED``); attention that infers its head count from the
local width (Llama: ``view(*shape, -1, head_dim)``) works unchanged; any other stale count is
an error naming the module and the attribute, rather than a shape error deep in ``forward``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from paramshard.protos import slicing

__all__ = ["PlannedSplit", "assign_units", "adjust_counts", "ADJUSTED", "OWN_ADJUST"]

HEAD_COUNT_ATTRS = ("n_head", "n_heads", "num_heads", "num_attention_heads")
"""Attributes that hold an attention module's (query) head count."""
KV_COUNT_ATTRS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_kv_head")
"""Attributes that hold its key/value head count (GQA)."""
WIDTH_ATTRS = ("split_size", "embed_dim", "hidden_size", "all_head_size")
"""Attributes that hold a width a split projection may have had."""


@dataclass
class PlannedSplit:
    """One module a plan splits, before it is replaced."""

    name: str
    """Its full name in the model."""
    module: nn.Module
    """The ``nn.Linear`` or ``Conv1D`` to split."""
    colwise: bool
    """Output features split (Colwise) or input features (Rowwise)."""
    width: int
    """Whole length of one block of the split feature dim."""
    packed: int = 1
    """Blocks side by side in the split dim (3 for q|k|v)."""
    gathered: bool = False
    """A Colwise output all-gathered: the module's users see the whole width."""
    unit: int = 1
    """Parts hold whole units of this width (set by ``assign_units``)."""
    heads: int = 0
    """Whole heads in one block (0: not an attention projection)."""


def _int_attr(module: nn.Module, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = module.__dict__.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _where(parent_name: str, parent: nn.Module) -> str:
    return parent_name or type(parent).__name__


def _head_dim(parent: nn.Module, splits: list[PlannedSplit]) -> int | None:
    """The head width of ``parent``'s projections: its ``head_dim``, else its width over its
    head count, else its first projection's width over it; None when it is not attention."""
    family = _family(parent)
    if family is not None and family.head_dim is not None:
        return family.head_dim(parent)
    kept = _int_attr(parent, ("head_dim",))
    if kept:
        return kept
    count = _int_attr(parent, HEAD_COUNT_ATTRS)
    if count is None:
        return None
    width = _int_attr(parent, WIDTH_ATTRS)
    if width and width % count == 0:
        return width // count
    return splits[0].width // count if splits[0].width % count == 0 else None


def _query_and_kv_heads(parent: nn.Module, heads: list[int]) -> tuple[int, int]:
    """(query heads, key/value heads) of ``parent``: its own counts where it keeps them, else
    from its projections (the first one split is taken as q, as modules register q first)."""
    groups = _int_attr(parent, ("num_key_value_groups",))
    q = _int_attr(parent, HEAD_COUNT_ATTRS)
    if q is None:
        q = max(heads) if groups else next(h for h in heads if h)
    kv = _int_attr(parent, KV_COUNT_ATTRS)
    if kv is None and groups and q % groups == 0:
        kv = q // groups
    if kv is None:
        kv = min(h for h in heads + [q] if h and q % h == 0)
    return q, kv


def assign_units(parent_name: str, parent: nn.Module, splits: list[PlannedSplit], parts: int):
    """Sets ``unit`` and ``heads`` of the projections split under ``parent``: whole heads
    (whole GQA groups for query-sized ones) when ``parent`` is attention, else single
    features."""
    split = [s for s in splits if not s.gathered]
    head_dim = _head_dim(parent, split) if split else None
    if head_dim is None:
        return
    where = _where(parent_name, parent)
    heads = [s.width // head_dim if s.width % head_dim == 0 else 0 for s in split]
    if not any(heads):
        return
    q_heads, kv_heads = _query_and_kv_heads(parent, heads)
    if q_heads % kv_heads:
        raise ValueError(
            f"{where}: {q_heads} query heads do not group over {kv_heads} key/value heads"
        )
    group = q_heads // kv_heads
    known = _family(parent) is not None
    for s, h in zip(split, heads, strict=True):
        if h in (q_heads, kv_heads):
            s.heads, s.unit = h, head_dim * (group if h == q_heads else 1)
        elif known:  # e.g. a packed q|k|v split without packed=3
            counts = f"{q_heads}" if q_heads == kv_heads else f"{q_heads} or {kv_heads}"
            raise ValueError(
                f"'{s.name}': {s.width} features per block are not {counts} heads of"
                f" {head_dim}, as the projections of {where} ({type(parent).__name__}) are;"
                " a fused q|k|v needs ColwiseParallel(packed=3)"
            )
    if kv_heads < parts:
        what = "key/value head group(s)" if group > 1 else "head(s)"
        raise ValueError(
            f"{where}: {kv_heads} {what} cannot be split over tensor_parallel_size={parts} by"
            f" whole heads (every rank needs at least one); {q_heads} query heads,"
            f" {kv_heads} key/value heads"
        )


# -- the families the project adjusts ------------------------------------------------------
def _adjust_gpt2(parent: nn.Module, local_heads: int, head_dim: int) -> None:
    # GPT2Attention.forward splits c_attn's output at split_size (one of q|k|v).
    parent.num_heads = local_heads
    parent.split_size = parent.embed_dim = local_heads * head_dim


@dataclass(frozen=True)
class Family:
    """An attention class whose stored counts the project sets per rank."""

    adjust: Callable[[nn.Module, int, int], None]
    """(module, this rank's query heads, head width) -> None: sets its counts."""
    head_dim: Callable[[nn.Module], int] | None = None
    """Its head width, where it keeps none as ``head_dim``."""


ADJUSTED: dict[str, Family] = {
    "transformers.models.gpt2.modeling_gpt2.GPT2Attention": Family(_adjust_gpt2),
}
"""Attention classes (and their subclasses) of other libraries whose stored counts the project
sets per rank. A model of one's own sets them itself: see ``OWN_ADJUST``."""

OWN_ADJUST = "set_tensor_parallel_heads"
"""A module with this method (``(local_heads, head_dim) -> None``) sets its own counts after the
split, as ``paramshard.models.gpt.CausalSelfAttention`` does; its ``head_dim`` attribute gives its
head width."""


def _own_adjust(parent: nn.Module, local_heads: int, head_dim: int) -> None:
    getattr(parent, OWN_ADJUST)(local_heads, head_dim)


def _family(parent: nn.Module) -> Family | None:
    if callable(getattr(parent, OWN_ADJUST, None)):
        return Family(_own_adjust)
    for cls in type(parent).__mro__:
        found = ADJUSTED.get(f"{cls.__module__}.{cls.__qualname__}")
        if found is not None:
            return found
    return None


def _local(s: PlannedSplit, parts: int, index: int) -> int:
    """Features of one block that part ``index`` holds."""
    lo, hi = slicing.slice_bounds(s.width // s.unit, parts, index)
    return (hi - lo) * s.unit


def adjust_counts(
    parent_name: str, parent: nn.Module, splits: list[PlannedSplit], parts: int, index: int
) -> None:
    """After the split: sets the counts of a known family to this rank's, or raises when
    ``parent`` keeps a head count or width that no longer matches its projections' parts."""
    split = [s for s in splits if not s.gathered]
    if not split or parts == 1:
        return
    widths = {s.width: _local(s, parts, index) for s in split}
    counts: dict[int, int] = {}
    attention = [s for s in split if s.heads]
    if attention:
        head_dim = attention[0].width // attention[0].heads
        counts = {s.heads: _local(s, parts, index) // head_dim for s in attention}
        family = _family(parent)
        if family is not None:
            family.adjust(parent, counts[max(counts)], head_dim)
            return
    stale = []
    for names, changed in ((HEAD_COUNT_ATTRS + KV_COUNT_ATTRS, counts), (WIDTH_ATTRS, widths)):
        for attr in names:
            value = parent.__dict__.get(attr)
            if isinstance(value, int) and changed.get(value, value) != value:
                stale.append(
                    f"{_where(parent_name, parent)}.{attr} = {value} (this rank holds"
                    f" {changed[value]})"
                )
    if stale:
        raise ValueError(
            f"{'; '.join(stale)}: after splitting {', '.join(s.name for s in split)} over"
            f" tensor_parallel_size={parts}, {type(parent).__name__} keeps a head count or width"
            " that no longer matches its rank's part. Make its forward infer it from the local"
            " width (as Llama's view(*shape, -1, head_dim)) or set it per rank; the project"
            f" adjusts {', '.join(sorted(c.rsplit('.', 1)[1] for c in ADJUSTED))} and modules"
            f" with a {OWN_ADJUST}(local_heads, head_dim) method"
        )
