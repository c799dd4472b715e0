"""One pipeline rank's part of a model cut by ``plan_stages`` (strategies/pipeline/split.py):
which parameters it holds (and copies of tied ones), and the skeletons its stages run on.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable

from torch import nn

from paramshard.strategies.pipeline.split import (
    OWN_STATE,
    StagePlan,
    StageRunner,
    Stub,
    meta_copy,
    units_of,
)

__all__ = ["RankStages"]


def _skeleton(
    module: nn.Module,
    prefix: str,
    plan: StagePlan,
    real: Callable[[str], nn.Module | None],
    stub: Callable[[str], nn.Module],
    clones: dict[int, nn.Parameter],
) -> nn.Module:
    """A shallow copy of the path module ``module`` with its children resolved."""
    new = copy.copy(module)
    for attr in OWN_STATE:
        if attr in module.__dict__:
            object.__setattr__(new, attr, copy.copy(module.__dict__[attr]))
    for name, p in module._parameters.items():
        if p is not None and id(p) in clones:
            new._parameters[name] = clones[id(p)]
    for name, child in module._modules.items():
        if child is None:
            continue
        full = f"{prefix}.{name}" if prefix else name
        if full in plan.path:
            new._modules[name] = _skeleton(child, full, plan, real, stub, clones)
        elif plan.units[full] == -1:
            new._modules[name] = child
        else:
            new._modules[name] = real(full) or stub(full)
    return new


class RankStages:
    """One pipeline rank's part of the model: its virtual stages ``rank, rank + p, ...``.

    ``module`` holds every parameter this rank keeps under the whole model's names (for the
    optimizer, state dicts, tensor parallelism); ``runners[c]`` runs chunk ``c``.
    ``holders[id(param)]`` lists the pipeline ranks keeping a copy of ``param`` (those with
    more than one sum its gradient); ``clones`` maps an original's id to this rank's copy,
    for the params an earlier rank holds as the original. Call ``build`` once, after tensor
    parallelism (``owns`` says which modules are this rank's).
    """

    def __init__(self, model: nn.Module, plan: StagePlan, rank: int, p: int) -> None:
        mine = [k for k in range(plan.num_stages) if k % p == rank]
        self.plan, self.rank, self.stages = plan, rank, mine
        all_ranks = tuple(range(p))
        holders: dict[int, set[int]] = {}
        for name, unit in units_of(model, plan.path):
            if plan.units[name] >= 0:
                for param in unit.parameters():
                    holders.setdefault(id(param), set()).add(plan.units[name] % p)
        for name, path_module in model.named_modules():
            if name in plan.path:
                for param in path_module.parameters(recurse=False):
                    holders.setdefault(id(param), set()).update(all_ranks)
        self.holders = {i: tuple(sorted(r)) for i, r in holders.items()}
        params = {id(q): q for q in model.parameters()}
        # A param held here but first held by an earlier rank: this rank keeps a copy.
        self.clones = {
            i: nn.Parameter(params[i].detach().clone(), params[i].requires_grad)
            for i, r in self.holders.items()
            if rank in r and r[0] != rank
        }
        latest = max(mine)
        # Meta copies are taken before tensor parallelism changes this rank's units.
        self._metas = {
            name: meta_copy(unit)
            for name, unit in units_of(model, plan.path)
            if 0 <= plan.units[name] < latest
        }
        self.model = model
        self.runners = [
            StageRunner(k, plan.num_stages, plan.split_points[k - 1] if k else None) for k in mine
        ]
        self.module: nn.Module = model

    def owns(self, name: str) -> bool:
        """Whether module ``name`` lies in a unit of this rank's stages."""
        return self.plan.stage_of(name) in self.stages

    def build(self) -> None:
        """Makes the skeletons, after tensor parallelism changed this rank's units in place."""
        model, plan = self.model, self.plan
        units = {}
        for name, _ in units_of(model, plan.path):
            if plan.units[name] in self.stages:
                unit = model.get_submodule(name)
                if any(id(q) in self.clones for q in unit.parameters()):
                    keep = {id(t): t for t in itertools.chain(unit.parameters(), unit.buffers())}
                    unit = copy.deepcopy(unit, {**keep, **self.clones})
                units[name] = unit
        self.units = units

        def holder_stub(name: str) -> nn.Module:
            return Stub(name, plan.units[name], _IDLE, None)

        self.module = _skeleton(model, "", plan, units.get, holder_stub, self.clones)
        for runner in self.runners:

            def real(name: str, k: int = runner.index) -> nn.Module | None:
                return units[name] if plan.units[name] == k else None

            def stub(name: str, r: StageRunner = runner) -> nn.Module:
                return Stub(name, plan.units[name], r, self._metas.get(name))

            skeleton = _skeleton(model, "", plan, real, stub, self.clones)
            entry = units.get(runner.entry) if runner.entry is not None else None
            runner.attach(skeleton, entry)
        original = {id(c): i for i, c in self.clones.items()}
        self.param_holders = {
            id(q): self.holders.get(original.get(id(q), id(q)), (self.rank,))
            for q in self.module.parameters()
        }
        """id(param) of each of this rank's params -> the pipeline ranks holding a copy (the
        first holds the original; a param made by tensor parallelism is this rank's alone)."""
        del self.model  # the rank's modules are in the skeletons; the rest may be freed


_IDLE = StageRunner(-1, 0, None)  # stand-ins of the holder module never run
