"""Tensor-parallel plans: which module gets which style, and applying them.

A plan maps module-name patterns to styles, as ``parallelize_plan`` does in torch's
``torch.distributed.tensor.parallel.parallelize_module``: ``*`` matches one name atom (the
atoms are matched with ``fnmatch``, so ``"blocks.*.attn.c_attn"`` names that module in every
block). With no plan, a model's own is used (``default_plan``):

1. a Hugging Face model's: ``config.base_model_tp_plan`` (its keys are relative to the base
   model, so a ``*ForCausalLM`` prefixes them with ``base_model_prefix``) plus the class's own
   ``_tp_plan`` (Llama's ``{"lm_head": "colwise_gather_output"}``);
2. else the base model class's own ``_tp_plan`` (keys relative to the base model, values our
   styles or Hugging Face's strings), as ``paramshard.models.gpt.GPT`` carries one;
3. else a plan the project ships for a family it knows (``SHIPPED_PLANS``): Hugging Face GPT-2,
   for which transformers has none.

A module whose weight is tied to another module's (an ``lm_head`` sharing the embedding,
Press & Wolf, arXiv 1608.05859) stays replicated: splitting one of the two would untie them.
Default plans leave such modules out; an explicit plan naming one is an error.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Callable
from fnmatch import fnmatchcase
from typing import Any

from torch import nn

from paramshard.strategies.tensor.heads import PlannedSplit, adjust_counts, assign_units
from paramshard.strategies.tensor.layers import ColumnParallelLinear, RowParallelLinear, layout_of
from paramshard.strategies.tensor.styles import (
    ColwiseParallel,
    Replicated,
    RowwiseParallel,
    resolve_style,
)

__all__ = ["SHIPPED_PLANS", "default_plan", "parallelize_module", "matches"]

log = logging.getLogger(__name__)

_GPT2_PLAN = {  # relative to GPT2Model; c_attn is a Conv1D holding q|k|v
    "h.*.attn.c_attn": ColwiseParallel(packed=3),
    "h.*.attn.c_proj": RowwiseParallel(),
    "h.*.mlp.c_fc": ColwiseParallel(),
    "h.*.mlp.c_proj": RowwiseParallel(),
}
SHIPPED_PLANS: dict[str, dict[str, Any]] = {
    "transformers.models.gpt2.modeling_gpt2.GPT2Model": _GPT2_PLAN,
}
"""Base-model class -> its plan (keys relative to that base model), for models whose library
ships none."""


def matches(pattern: str, name: str) -> bool:
    """Whether module ``name`` matches plan key ``pattern`` (atom by atom, ``*`` one atom)."""
    p, n = pattern.split("."), name.split(".")
    return len(p) == len(n) and all(fnmatchcase(a, b) for a, b in zip(n, p, strict=True))


def _class_name(obj: Any) -> list[str]:
    return [f"{c.__module__}.{c.__qualname__}" for c in type(obj).__mro__]


def _base(model: nn.Module) -> tuple[nn.Module, str]:
    """(the base model, the prefix of its module names in ``model``)."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    inner = getattr(model, prefix, None) if prefix else None
    if isinstance(inner, nn.Module) and inner is not model:
        return inner, f"{prefix}."
    return model, ""


def _tied_to(module: nn.Module, name: str, owners: dict[int, list[str]]) -> str | None:
    """Another name of ``module``'s weight when it is tied to a tensor outside ``module``."""
    weight = module._parameters.get("weight")
    if weight is None:
        return None
    prefix = f"{name}." if name else ""
    others = [n for n in owners.get(id(weight), []) if not n.startswith(prefix)]
    return others[0] if others else None


def _owners(model: nn.Module) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), []).append(n)
    return out


def _untied(model: nn.Module, plan: dict[str, Any]) -> dict[str, Any]:
    """``plan`` without the modules whose weight is tied elsewhere (they stay replicated)."""
    owners = _owners(model)
    modules = dict(model.named_modules())
    out: dict[str, Any] = {}
    for key, style in plan.items():
        hits = [n for n in modules if n and matches(key, n)]
        tied = {n for n in hits if _tied_to(modules[n], n, owners)}
        if not tied:
            out[key] = style
        else:  # keep the untied matches of a wildcard, by exact name
            out.update({n: style for n in hits if n not in tied})
    return out


def default_plan(model: nn.Module) -> dict[str, Any]:
    """The model's own plan (see the module docstring): module-name pattern -> style. Modules
    whose weight is tied to another module's are left out (replicated)."""
    base, prefix = _base(model)
    plan: dict[str, Any] = {}
    hf_plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    if hf_plan:
        plan = {f"{prefix}{k}": v for k, v in hf_plan.items()}
        plan.update(getattr(type(model), "_tp_plan", None) or {})
    elif getattr(type(base), "_tp_plan", None):
        plan = {f"{prefix}{k}": v for k, v in type(base)._tp_plan.items()}
    else:
        for name in _class_name(base):
            if name in SHIPPED_PLANS:
                plan = {f"{prefix}{k}": v for k, v in SHIPPED_PLANS[name].items()}
                break
    if not plan:
        raise ValueError(
            f"no tensor-parallel plan is known for {type(model).__name__} (no"
            " config.base_model_tp_plan, no _tp_plan, not a family the project ships a plan for:"
            f" {', '.join(sorted(n.rsplit('.', 1)[1] for n in SHIPPED_PLANS))}): pass"
            ' parallelize_plan={"blocks.*.attn.q": ColwiseParallel(), ...}'
        )
    return _untied(model, plan)


def _style_of(name: str, plan: list[tuple[str, Any]]) -> Any:
    """The style of the first plan entry matching ``name``, or None."""
    for key, style in plan:
        if matches(key, name):
            return style
    return None


def _planned(name: str, module: nn.Module, style: Any, owners: dict) -> PlannedSplit:
    if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
        raise ValueError(f"'{name}' is already tensor-parallel ({type(module).__name__})")
    try:
        _, inp, out = layout_of(module)
    except ValueError as err:
        raise ValueError(f"'{name}': {err}") from None
    tied = _tied_to(module, name, owners)
    if tied is not None:
        raise ValueError(
            f"'{name}' shares its weight with '{tied}' (tied); splitting it would untie them:"
            " leave it out of the plan (it stays replicated, as default plans do)"
        )
    if not isinstance(style, ColwiseParallel):
        return PlannedSplit(name, module, colwise=False, width=inp)
    if out % style.packed:
        raise ValueError(
            f"'{name}': {out} output features do not split into {style.packed} packed blocks"
        )
    return PlannedSplit(
        name,
        module,
        colwise=True,
        width=out // style.packed,
        packed=style.packed,
        gathered=style.gather_output,
    )


def _build(s: PlannedSplit, style: Any, tp_client: Any) -> nn.Module:
    if s.colwise:
        return ColumnParallelLinear.from_linear(
            s.module, tp_client, gather_output=s.gathered, packed=s.packed, unit=s.unit
        )
    return RowParallelLinear.from_linear(
        s.module, tp_client, input_is_parallel=style.input_is_parallel, unit=s.unit
    )


def parallelize_module(
    module: nn.Module,
    tp_client: Any,
    plan: dict[str, Any] | None = None,
    *,
    only: Callable[[str], bool] | None = None,
) -> nn.Module:
    """Splits ``module``'s submodules over ``tp_client``'s group by ``plan``, in place, and
    returns ``module``.

    ``plan``: {module-name pattern: style}, the style ``ColwiseParallel()`` /
    ``RowwiseParallel()``, torch's instances of them, or a Hugging Face string (``"colwise"``,
    ``"rowwise"``, ``"colwise_gather_output"``, ``"replicate"``, ...); a module takes the first
    entry that matches it; an entry that matches no module is warned about (as torch's), a plan
    none of whose entries match one is an error. ``None``: the model's own
    (``default_plan``). ``only(name)``: False leaves that module alone (a pipeline stage splits
    the modules it owns only).

    Every rank must start from the same weights (same seed, or a loaded state dict): each keeps
    its part of them, under the same names. Attention projections are split by whole heads,
    and the head counts of known families set per rank (see ``strategies.tensor.heads``).
    At tensor-parallel size 1 the modules are replaced by parallel layers holding the same
    parameter objects (so nothing changes numerically).
    """
    if plan is None:
        plan = default_plan(module)
    else:
        _check_keys(module, plan)
    entries = [(key, resolve_style(style, key)) for key, style in plan.items()]
    owners = _owners(module)
    planned: list[tuple[PlannedSplit, Any]] = []
    for name, sub in module.named_modules():
        if not name or (only is not None and not only(name)):
            continue
        style = _style_of(name, entries)
        if style is None or isinstance(style, Replicated):
            continue
        planned.append((_planned(name, sub, style, owners), style))
    by_parent: dict[str, list[PlannedSplit]] = {}
    for s, _ in planned:
        by_parent.setdefault(s.name.rpartition(".")[0], []).append(s)
    parts, index = tp_client.world_size, tp_client.rank
    for parent_name, splits in by_parent.items():
        assign_units(parent_name, module.get_submodule(parent_name), splits, parts)
    for s, style in planned:
        parent_name, _, atom = s.name.rpartition(".")
        setattr(module.get_submodule(parent_name), atom, _build(s, style, tp_client))
    for parent_name, splits in by_parent.items():
        adjust_counts(parent_name, module.get_submodule(parent_name), splits, parts, index)
    return module


def _check_keys(module: nn.Module, plan: dict[str, Any]) -> None:
    """Warns of each key of a user's ``plan`` that names no module of ``module`` (a typo
    leaves those modules whole, every rank holding all of their weights, silently otherwise);
    ValueError when no key names one."""
    names = [n for n, _ in module.named_modules() if n]
    missed = [k for k in plan if not any(matches(k, n) for n in names)]
    if not missed:
        return
    like = sorted({".".join("*" if a.isdigit() else a for a in n.split(".")) for n in names})
    said = []
    for key in missed:
        close = difflib.get_close_matches(key, like, n=1)
        said.append(f"'{key}'" + (f" (did you mean '{close[0]}'?)" if close else ""))
    words = f"of {type(module).__name__}: " + ", ".join(said)
    if len(missed) == len(plan):
        raise ValueError(f"no entry of parallelize_plan names a module {words}")
    log.warning("parallelize_plan entries name no module %s; they split nothing", words)
