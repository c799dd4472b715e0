"""How a torch model's parameters become named flat buffers: the torch side of slice arithmetic.

This is the one place that decides it. A model is cut into *units* (the FSDP wrap policy,
arXiv 2304.11277 §3.1): the root unit holds everything not inside another unit, e.g. the
embeddings, and each wrapped module (say each transformer block) is a unit of its own.
Each unit gets one flat buffer per optimizer param group, so a server-side optimizer applies
one set of hyperparameters per buffer. Server i then holds slice i of every buffer; how a
buffer is cut into slices is ``protos.slicing``'s job, not this module's.

Buffers are named ``"<unit>#g<group index>"``, e.g. ``"root#g0"`` or ``"blocks.3#g1"``, where
the group index is the position of the param group in the optimizer's list. A buffer has one
master dtype (``config.master_dtype``: float64 for float64 parameters, float32 for the rest),
so a (unit, group) whose parameters mix float64 with other dtypes is split in two: the others
keep that name and the float64 ones are ``"<unit>#g<group index>.f64"``; a (unit, group) of
float64 parameters only is one float64 buffer under the plain name. ``manifest()``
describes the buffers in JSON so that anyone can rebuild full tensors from the slices
without the model's code.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from paramshard.protos.manifest import ParamEntry
from paramshard.strategies.config import MasterDType, master_dtype

__all__ = [
    "incompatible_keys",
    "ROOT",
    "ParamEntry",
    "BufferSpec",
    "plan_units",
    "plan_buffers",
    "flatten",
    "unflatten_into",
    "copy_flat_into",
    "flat_views",
    "manifest",
    "buffers_from_manifest",
    "torch_dtype",
    "master_torch_dtype",
    "to_master",
    "norm_tensor",
]

ROOT = "root"
"""Name of the root unit: the model itself, holding every parameter not in another unit."""

# torch's size_based_auto_wrap_policy never wraps containers: they have no forward of their
# own, so there is no hook to gather their parameters in.
_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


@dataclass
class BufferSpec:
    """One flat buffer: the parameters of one param group inside one unit."""

    name: str
    """``"<unit>#g<group_index>"`` (``".f64"`` appended for the float64 part of a mixed
    group): the name the servers know the buffer by."""
    unit: str
    """Module path of the unit ("blocks.0"), or "root"."""
    group_index: int
    """Index of the optimizer param group these parameters belong to."""
    entries: list[ParamEntry]
    """The parameters, in ``named_parameters()`` order, at contiguous offsets from 0."""
    numel: int
    """Total number of elements (the sum of the entries)."""
    params: list[nn.Parameter] = field(default_factory=list, repr=False, compare=False)
    """The live parameters, one per entry; empty when rebuilt from a manifest."""
    master_dtype: MasterDType = "float32"
    """Dtype of the servers' master copy and optimizer state: "float64" for float64
    parameters, "float32" for every other dtype."""


def plan_units(
    model: nn.Module,
    wrap: tuple[type[nn.Module], ...] | None = None,
    min_params: int | None = None,
    *,
    min_unit_params: int = 0,
) -> list[tuple[str, nn.Module]]:
    """The FSDP units of ``model``: ``[("root", model), (path, module), ...]``.

    Root first, then the other units in definition order (pre-order), which is the order a
    forward pass gathers them in. A module becomes a unit when
      * it is an instance of one of ``wrap`` (outermost match only: nothing inside it is
        examined), or
      * ``min_params`` is given and, like torch's ``size_based_auto_wrap_policy``, the
        parameters it holds outside units already made below it number at least
        ``min_params`` (decided bottom-up; ModuleList/ModuleDict are never units).
    Either way a candidate with fewer than ``min_unit_params`` parameters stays with its
    parent: a round trip for a few hundred values costs more than holding them
    (``ShardingConfiguration.minimum_parameter_group_size``).
    """
    if min_params is not None and min_params < 1:
        raise ValueError(f"min_params must be >= 1 or None, got {min_params}")
    units: dict[str, nn.Module] = {}

    def total(module: nn.Module) -> int:
        return sum(p.numel() for p in module.parameters())

    def visit(path: str, module: nn.Module) -> int:
        """Make units in this subtree; return how many parameters they hold."""
        if wrap and isinstance(module, wrap) and total(module) >= min_unit_params:
            units[path] = module
            return total(module)
        wrapped = sum(
            visit(f"{path}.{name}" if path else name, child)
            for name, child in module.named_children()
        )
        remainder = total(module) - wrapped
        if (
            path
            and min_params is not None
            and not isinstance(module, _CONTAINERS)
            and remainder >= max(min_params, min_unit_params)
        ):
            units[path] = module
            return total(module)
        return wrapped

    for name, child in model.named_children():
        visit(name, child)
    if ROOT in units:
        raise ValueError(
            f"the model has a submodule named {ROOT!r}, which clashes with the "
            f"root unit's name; rename the submodule"
        )
    order = {path: i for i, (path, _) in enumerate(model.named_modules())}
    return [(ROOT, model)] + sorted(units.items(), key=lambda item: order[item[0]])


def _contains(unit_path: str, module_path: str) -> bool:
    """Whether the module at ``module_path`` is inside the unit at ``unit_path`` ("" = root)."""
    return unit_path in ("", module_path) or module_path.startswith(unit_path + ".")


def _owning_units(model: nn.Module, units: Sequence[tuple[str, nn.Module]]) -> dict[int, str]:
    """id(parameter) -> name of the unit whose buffer holds it.

    A parameter belongs to the innermost unit that contains every module using it. So a
    tied weight used from two units (GPT's ``wte.weight`` is also ``lm_head.weight``) goes to
    their common ancestor, usually the root, as torch FSDP requires.
    """
    if not units or units[0][0] != ROOT or units[0][1] is not model:
        raise ValueError(
            f"units must start with the root unit ({ROOT!r}, model); "
            f"build them with plan_units(model, ...)"
        )
    paths: list[str] = [""]
    for name, module in units[1:]:
        try:
            found = model.get_submodule(name)
        except AttributeError:
            found = None
        if found is not module:
            raise ValueError(f"unit {name!r} is not the submodule at that path of the model")
        paths.append(name)

    def innermost_unit(module_path: str) -> str:
        return max((p for p in paths if _contains(p, module_path)), key=len)

    uses: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        uses.setdefault(id(param), []).append(name.rpartition(".")[0])
    owners: dict[int, str] = {}
    for pid, module_paths in uses.items():
        candidates = {innermost_unit(p) for p in module_paths}
        if len(candidates) == 1:
            owner = candidates.pop()
        else:
            owner = max(
                (u for u in candidates | {""} if all(_contains(u, c) for c in candidates)),
                key=len,
            )
        owners[pid] = owner or ROOT
    return owners


def _group_index(
    named: list[tuple[str, nn.Parameter]],
    param_groups: Sequence[Iterable[nn.Parameter] | Mapping[str, Any]] | None,
) -> dict[int, int]:
    """id(trainable parameter) -> index of its param group, checking each is in exactly one."""
    if param_groups is None:
        return {id(p): 0 for _, p in named}
    names = {id(p): n for n, p in named}
    index: dict[int, int] = {}
    for g, group in enumerate(param_groups):
        params = group["params"] if isinstance(group, Mapping) else group
        if isinstance(params, torch.Tensor):
            params = [params]
        for p in params:
            pid = id(p)
            if pid in index and pid in names:
                where = (
                    f"twice in param group {g}"
                    if index[pid] == g
                    else f"in param groups {index[pid]} and {g}"
                )
                raise ValueError(
                    f"parameter {names[pid]!r} is {where}; "
                    f"each parameter must be in exactly one group, once"
                )
            if pid not in names and p.requires_grad:
                raise ValueError(
                    f"param group {g} holds a tensor of shape {tuple(p.shape)} "
                    f"that is not a trainable parameter of the model"
                )
            index[pid] = g
    missing = [n for n, p in named if id(p) not in index]
    if missing:
        raise ValueError(
            f"trainable parameter {missing[0]!r} is in no param group "
            f"({len(missing)} missing in all); every parameter with "
            f"requires_grad=True must be in exactly one"
        )
    return index


def plan_buffers(
    model: nn.Module,
    units: Sequence[tuple[str, nn.Module]],
    param_groups: Sequence[Iterable[nn.Parameter] | Mapping[str, Any]] | None = None,
) -> list[BufferSpec]:
    """One buffer per (unit, param group, master dtype) that has trainable parameters, units
    in order (see the module docstring for the names of a mixed group's float64 part).

    ``param_groups`` is a list of parameter lists, or an optimizer's ``param_groups`` (dicts
    with "params"); None means one group of all parameters. Parameters with
    ``requires_grad=False`` are in no buffer: they are never updated, so nothing is sharded.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    owners = _owning_units(model, units)
    groups = _group_index(named, param_groups)
    buffers: list[BufferSpec] = []
    for unit, _ in units:
        for g in sorted({groups[id(p)] for _, p in named if owners[id(p)] == unit}):
            chosen = [(n, p) for n, p in named if owners[id(p)] == unit and groups[id(p)] == g]
            masters = {master_dtype(p.dtype) for _, p in chosen}
            for master in ("float32", "float64"):
                if master not in masters:
                    continue
                mine = [(n, p) for n, p in chosen if master_dtype(p.dtype) == master]
                mixed = master == "float64" and len(masters) > 1
                name = f"{unit}#g{g}" + (".f64" if mixed else "")
                buffers.append(_buffer(name, unit, g, mine, master))
    return buffers


def _buffer(
    name: str, unit: str, group: int, chosen: list[tuple[str, nn.Parameter]], master: MasterDType
) -> BufferSpec:
    entries, offset = [], 0
    for n, p in chosen:
        entries.append(ParamEntry(n, tuple(p.shape), offset, dtype_name(p.dtype)))
        offset += p.numel()
    return BufferSpec(name, unit, group, entries, offset, [p for _, p in chosen], master)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a dtype name ("float64", "bfloat16", ...)."""
    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    """The name of a torch dtype ("float64", "bfloat16", ...): ``torch_dtype``'s inverse."""
    return str(dtype).removeprefix("torch.")


def master_torch_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """The master dtype of ``dtype``'s class as a torch dtype: float64 for float64, float32
    for every other dtype (``config.master_dtype``)."""
    return torch_dtype(master_dtype(dtype))


def to_master(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached, in its class's master dtype (float64 stays float64, the rest become
    float32); ``t`` itself when it is already in it."""
    return t.detach().to(master_torch_dtype(t.dtype))


def norm_tensor(total: float, dtypes: Iterable[torch.dtype]) -> torch.Tensor:
    """A global gradient norm as ``torch.nn.utils.clip_grad_norm_`` returns it: float64 when
    any of the parameters' ``dtypes`` is, else float32."""
    return torch.tensor(total, dtype=torch.float64 if torch.float64 in set(dtypes) else None)


def flatten(
    tensors: Sequence[torch.Tensor],
    numel: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Concatenate ``tensors`` (detached) into a new flat tensor of ``numel`` values, or into
    ``out`` (a flat tensor of ``numel`` values, kept by the caller across steps).

    Tensors are copied in order, cast to ``dtype``, so the result lines up with the entries of
    the buffer the tensors (parameters or their gradients) came from.
    """
    if device is None:
        device = tensors[0].device if tensors else "cpu"
    flat = torch.empty(numel, dtype=dtype, device=device) if out is None else out
    offset = 0
    for t in tensors:
        n = t.numel()
        if offset + n > numel:
            raise ValueError(f"tensors hold more than the {numel} values of the buffer")
        flat[offset : offset + n].copy_(t.detach().reshape(-1))
        offset += n
    if offset != numel:
        raise ValueError(f"tensors hold {offset} values; the buffer expects {numel}")
    return flat


def flat_views(flat: torch.Tensor, entries: Sequence[ParamEntry]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like each entry; writing to a view writes to ``flat``."""
    if entries and flat.numel() < entries[-1].offset + entries[-1].numel:
        raise ValueError(
            f"flat tensor has {flat.numel()} values; entries need "
            f"{entries[-1].offset + entries[-1].numel}"
        )
    return [flat[e.offset : e.offset + e.numel].view(e.shape) for e in entries]


@torch.no_grad()
def copy_flat_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Each of ``tensors`` takes the next ``numel`` values of ``flat``, cast to its own dtype
    (``flatten``'s inverse for tensors in order, without a buffer's entries)."""
    total = sum(t.numel() for t in tensors)
    if flat.numel() != total:
        raise ValueError(f"flat tensor has {flat.numel()} values; the tensors hold {total}")
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


@torch.no_grad()
def unflatten_into(
    flat: torch.Tensor, entries: Sequence[ParamEntry], tensors: Sequence[torch.Tensor]
) -> None:
    """Copy each entry's values from ``flat`` into the matching tensor, casting its dtype."""
    if len(entries) != len(tensors):
        raise ValueError(f"{len(entries)} entries but {len(tensors)} tensors")
    for e, view, t in zip(entries, flat_views(flat, entries), tensors, strict=True):
        if tuple(t.shape) != e.shape:
            raise ValueError(
                f"parameter {e.name!r} has shape {tuple(t.shape)}; the buffer describes {e.shape}"
            )
        t.copy_(view)


def manifest(buffers: Sequence[BufferSpec]) -> list[dict[str, Any]]:
    """JSON-serialisable description of ``buffers`` that the servers store with the slices."""
    return [
        {
            "name": b.name,
            "unit": b.unit,
            "group_index": b.group_index,
            "numel": b.numel,
            "master_dtype": b.master_dtype,
            "entries": [e.to_manifest() for e in b.entries],
        }
        for b in buffers
    ]


def buffers_from_manifest(described: Sequence[Mapping[str, Any]]) -> list[BufferSpec]:
    """The inverse of ``manifest``: buffer specs without live parameters (``params`` empty)."""
    return [
        BufferSpec(
            name=d["name"],
            unit=d["unit"],
            group_index=int(d["group_index"]),
            entries=[ParamEntry.from_manifest(e) for e in d["entries"]],
            numel=int(d["numel"]),
            master_dtype=master_dtype(d.get("master_dtype", "float32")),
        )
        for d in described
    ]


def incompatible_keys(own: Mapping[str, Any], state_dict: Mapping[str, Any], strict: bool) -> Any:
    """``load_state_dict``'s key check: the keys the model has that the state dict lacks and
    those it has that the model does not, as torch returns them; with ``strict``, an error
    naming both when either is not empty (torch's message)."""
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    if strict and (missing or unexpected):
        raise RuntimeError(f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
    return nn.modules.module._IncompatibleKeys(missing, unexpected)
