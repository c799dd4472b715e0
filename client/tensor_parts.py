"""The parts of a 3D-parallel job, put back together into the whole model (NumPy only).

``HybridShardedModel`` registers one server job per (pipeline stage, tensor rank), named
``<job>.pp<s>.tp<t>``; each holds that stage's parameters under the whole model's own names.
A tensor-parallel parameter is one part of the whole tensor: its ``ParamEntry.split``
(``protos.manifest.ParamSplit``: dim, parts, index, packed, unit; see shard.proto) says which,
and ``protos.slicing.tensor_parallel_ranges`` says where the part sits in the
whole tensor (parts may differ in size: 3 heads on 2 ranks are 2 + 1). Any
other tensor is replicated on every tensor rank: tensor rank 0's copy is the one taken.

This module is the one place for that: finding the parts of a base job name (``find_parts``),
checking that none is missing (``check_complete``) and joining them (``join_parts``). Live
export (``client.tools``) and offline export of snapshot folders (``paramshard export
--snapshot``) both go through it; they only differ in how a part's values are read.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from paramshard.protos import manifest, slicing
from paramshard.protos.manifest import ParamEntry, taken_order
from paramshard.protos.placement import parse_part_job, part_job
from paramshard.protos.words import listed

if TYPE_CHECKING:
    from typing import Self  # Python 3.11; annotations only (3.10 is supported)

__all__ = [
    "PartsError",
    "PartParam",
    "WholeParam",
    "part_job",
    "parse_part_job",
    "find_parts",
    "check_complete",
    "part_snapshots",
    "recorded_parts",
    "newest_complete_tag",
    "join_parts",
]


class PartsError(RuntimeError):
    """The parts of a 3D job are missing or do not fit together."""


def find_parts(base: str, names: Iterable[str]) -> dict[tuple[int, int], str]:
    """(stage, tensor rank) -> job name, for the names among ``names`` that are parts of
    ``base``; empty when there are none (``base`` is not a 3D job there)."""
    out = {}
    for name in names:
        parsed = parse_part_job(name)
        if parsed is not None and parsed[0] == base and part_job(*parsed) == name:
            out[parsed[1], parsed[2]] = name
    return dict(sorted(out.items()))


def check_complete(
    base: str, found: Iterable[tuple[int, int]], expected: Iterable[str] = (), what: str = ""
) -> tuple[int, int]:
    """(pipeline size, tensor size) when the parts ``found`` make a full grid: every stage
    0..S-1 with every tensor rank 0..T-1. ``expected`` (part job names known to exist, e.g.
    those a snapshot's manifests list) widens the grid. PartsError names what is missing;
    ``what`` says what is checked (default: "job '<base>'")."""
    what = what or f"job '{base}'"
    have = set(found)
    if not have:
        raise PartsError(f"{what}: no parts ({base}.pp<stage>.tp<rank>)")
    want = set(have)
    for name in expected:
        parsed = parse_part_job(name)
        if parsed is not None and parsed[0] == base:
            want.add((parsed[1], parsed[2]))
    stages = max(s for s, _ in want) + 1
    ranks = max(t for _, t in want) + 1
    if len(have) < stages * ranks:  # the numbers are names' (a server's word): none listed
        grid = ((s, t) for s in range(stages) for t in range(ranks))
        # lazily: a name such as ``m.pp0.tp400000000`` makes a grid of 400 million
        missing = (part_job(base, s, t) for s, t in grid if (s, t) not in have)
        raise PartsError(
            f"{what} is incomplete: {len(have)} of {stages * ranks:,} parts"
            f" ({stages:,} stage(s) x {ranks:,} tensor rank(s)); missing "
            + listed(missing, stages * ranks - len(have))
        )
    return stages, ranks


def part_snapshots(base: str, rows: Iterable[Mapping]) -> dict[str, dict[tuple[int, int], Mapping]]:
    """tag -> (stage, tensor rank) -> row, of the snapshot rows (``job``, ``tag``, ...) that
    are of ``base``'s parts."""
    by_tag: dict[str, dict[tuple[int, int], Mapping]] = {}
    for r in rows:
        parsed = parse_part_job(r["job"])
        if parsed is not None and parsed[0] == base:
            by_tag.setdefault(r["tag"], {})[parsed[1], parsed[2]] = r
    return by_tag


def recorded_parts(rows: Iterable[Mapping]) -> list[str]:
    """Every part the snapshots ``rows`` (manifests, or snapshot listings) say their 3D job
    had when they were taken (``{"hybrid": {"parts": [...]}}``)."""
    return sorted({p for r in rows for p in manifest.recorded_parts(r)})


def newest_complete_tag(
    base: str, by_tag: Mapping[str, Mapping[tuple[int, int], Mapping]], expected: Iterable[str] = ()
) -> str:
    """The newest tag (``taken_order``: the last taken) of ``part_snapshots`` that has every part
    (``check_complete``, with the parts its snapshots recorded and ``expected``): what "latest"
    means for a 3D job. PartsError when none has."""
    expected = list(expected)
    complete = []
    for tag, found in by_tag.items():
        try:
            check_complete(base, found, expected + recorded_parts(found.values()))
        except PartsError:
            continue
        complete.append((max(taken_order(r) for r in found.values()), tag))
    if not complete:
        raise PartsError(
            f"job '{base}' has snapshots of its parts ({', '.join(sorted(by_tag))}) but none"
            " with every part"
        )
    return max(complete)[1]


@dataclass(frozen=True, kw_only=True)
class PartParam(ParamEntry):
    """One parameter's entry as one part job holds it, and how to read its values."""

    read: Callable[[], np.ndarray]
    """Its values (any shape), in its master dtype (float64 or float32)."""


@dataclass(frozen=True, kw_only=True)
class WholeParam(ParamEntry):
    """One whole parameter of the model (its entry: whole shape, offset 0, no split), and how
    to put its values together."""

    produce: Callable[[], np.ndarray]
    """Its values, flat: float64 for a float64 master, else float32."""
    source: tuple[str, ...]
    """The jobs it is read from (a 3D job's part jobs)."""

    @classmethod
    def of(cls, p: ParamEntry, **fields: Any) -> Self:
        """The whole parameter of entry ``p`` (a part's, or a live buffer's): its name, dtype
        and aliases; ``fields`` give the rest (``shape`` when not ``p``'s)."""
        fields.setdefault("shape", p.shape)
        return cls(name=p.name, dtype=p.dtype, aliases=p.aliases, **fields)


def _join(
    shape: tuple[int, ...], dim: int, packed: int, unit: int, parts: Sequence[PartParam]
) -> np.ndarray:
    """The whole tensor from its tensor-parallel parts, one part in memory besides it."""
    whole: np.ndarray | None = None
    count = len(parts)
    for t, p in enumerate(parts):
        values = _read(p)
        if whole is None:
            whole = np.empty(shape, dtype=values.dtype)
        if values.size != math.prod(p.shape):
            raise PartsError(
                f"'{p.name}' part {t}: read {values.size} values, its shape {list(p.shape)}"
                f" holds {math.prod(p.shape)}"
            )
        values = values.reshape(p.shape)
        offset = 0
        for r in slicing.tensor_parallel_ranges(shape[dim], count, t, packed, unit):
            into = [slice(None)] * len(shape)
            into[dim] = slice(r.start, r.stop)
            take = [slice(None)] * len(shape)
            take[dim] = slice(offset, offset + len(r))
            whole[tuple(into)] = values[tuple(take)]
            offset += len(r)
        del values
    assert whole is not None  # a split parameter has at least one part
    return whole.reshape(-1)


def _read(p: PartParam) -> np.ndarray:
    """``p``'s values: float64 stays float64 (a float64 master), the rest float32."""
    values = np.asarray(p.read())
    return values if values.dtype == np.float64 else values.astype(np.float32, copy=False)


def _flat(p: PartParam) -> np.ndarray:
    values = _read(p).reshape(-1)
    if values.size != math.prod(p.shape):
        raise PartsError(
            f"'{p.name}': read {values.size} values, its shape {list(p.shape)} holds"
            f" {math.prod(p.shape)}"
        )
    return values


def join_parts(
    base: str,
    parts: Mapping[tuple[int, int], Sequence[PartParam]],
    names: Mapping[tuple[int, int], str] | None = None,
    expected: Iterable[str] = (),
    what: str = "",
) -> list[WholeParam]:
    """The whole model's parameters, stage by stage, from the parameters of each (stage,
    tensor rank) part. Nothing is read here: each ``WholeParam.produce`` reads its parts.

    Checks first that no part is missing (``check_complete``), that every stage's tensor ranks
    hold the same names, that every tensor-parallel parameter is split in as many parts as
    there are tensor ranks (each rank its own index, same dim, shape and packing) and that
    replicated tensors have the same shape everywhere; PartsError otherwise.
    """
    names = dict(names or {k: part_job(base, *k) for k in parts})
    stages, ranks = check_complete(base, parts, expected, what)
    out: list[WholeParam] = []
    seen: dict[str, str] = {}
    any_split = False
    for s in range(stages):
        by_rank = [{p.name: p for p in parts[s, t]} for t in range(ranks)]
        first = by_rank[0]
        for t in range(1, ranks):
            if set(by_rank[t]) != set(first):
                only0 = sorted(set(first) - set(by_rank[t]))
                only_t = sorted(set(by_rank[t]) - set(first))
                raise PartsError(
                    f"parts {names[s, 0]} and {names[s, t]} hold different parameters"
                    f" (only in the first: {only0}; only in the second: {only_t})"
                )
        for name, p0 in first.items():
            group = [by_rank[t][name] for t in range(ranks)]
            source = tuple(names[s, t] for t in range(ranks))
            for each in (name, *p0.aliases):
                if each in seen:
                    raise PartsError(
                        f"'{each}' is held by both {seen[each]} and {names[s, 0]}: the parts"
                        " belong to different models"
                    )
                seen[each] = names[s, 0]
            if any(p.split is not None for p in group):
                any_split = True
                out.append(_split_param(group, ranks, source))
            else:
                for t, p in enumerate(group[1:], 1):
                    if p.shape != p0.shape:
                        raise PartsError(
                            f"'{name}' is replicated but has shape {list(p0.shape)} in"
                            f" {source[0]} and {list(p.shape)} in {source[t]}"
                        )
                out.append(WholeParam.of(p0, produce=lambda p=p0: _flat(p), source=source[:1]))
    if ranks > 1 and not any_split:
        raise PartsError(
            f"job '{base}' has {ranks} tensor ranks but no parameter says how it is split"
            " (split_parts in the manifests): written by a paramshard older than the split"
            " fields, its parts cannot be joined"
        )
    return out


def _split_param(group: Sequence[PartParam], ranks: int, source: tuple[str, ...]) -> WholeParam:
    p0, s0 = group[0], group[0].split  # s0 is checked first, in the loop's first round
    for t, p in enumerate(group):
        s, problem = p.split, None
        if s is None or s.parts != ranks:
            parts = s.parts if s is not None else 0
            problem = f"is split in {parts} part(s), but there are {ranks} tensor ranks"
        elif s.index != t:
            problem = f"says it is part {s.index}"
        elif (s.dim, s.packed, s.unit, p.dtype) != (s0.dim, s0.packed, s0.unit, p0.dtype) or (
            _without(p.shape, s.dim) != _without(p0.shape, s0.dim)
        ):
            problem = (
                f"is split along dim {s.dim} in {s.packed} block(s) of units of {s.unit} with"
                f" shape {list(p.shape)} ({p.dtype}), but {source[0]}'s part along dim"
                f" {s0.dim} in {s0.packed} block(s) of units of {s0.unit} with shape"
                f" {list(p0.shape)} ({p0.dtype})"
            )
        elif s.dim >= len(p.shape):
            problem = f"cannot be split along dim {s.dim}: its shape is {list(p.shape)}"
        if problem:
            raise PartsError(f"'{p.name}' in {source[t]} {problem}")
    dim, packed, unit = s0.dim, s0.packed, s0.unit
    size = sum(p.shape[dim] for p in group)
    for t, p in enumerate(group):  # each part holds what the one split rule gives it
        try:
            want = sum(map(len, slicing.tensor_parallel_ranges(size, ranks, t, packed, unit)))
        except ValueError as exc:
            raise PartsError(f"'{p.name}': {exc}") from None
        if p.shape[dim] != want:
            raise PartsError(
                f"'{p.name}' in {source[t]} holds {p.shape[dim]} of {size} along dim {dim},"
                f" but part {t} of {ranks} ({packed} block(s), units of {unit}) holds {want}"
            )
    shape = tuple(size if d == dim else n for d, n in enumerate(p0.shape))

    def produce() -> np.ndarray:
        return _join(shape, dim, packed, unit, group)

    return WholeParam.of(p0, shape=shape, produce=produce, source=source)


def _without(shape: tuple[int, ...], dim: int) -> tuple[int, ...]:
    return tuple(n for d, n in enumerate(shape) if d != dim)
