"""Cutting any ``nn.Module`` into pipeline stages at module boundaries.

A stage begins at each *split point* (a module name such as ``"blocks.2"`` or
``"model.layers.4"``). The modules on the way from the root to a split point are the *path*;
every other module hanging off the path is a *unit*, and units belong to stages in
registration order: a unit belongs to the stage of the last split point registered before it.
Units without parameters (dropout, a rotary-embedding cache) are not owned: every stage runs
them. Parameters of path modules themselves (a learned position table on the root) are held
by every stage.

Each stage runs the user's own ``forward`` on a *skeleton* of the model: the path modules are
shallow copies whose children are this stage's units (the user's module objects, so the
user's parameters are kept), the shared units, and stand-ins (``Stub``) for other stages'
units. Running stage ``k``:

- a stand-in of an earlier stage returns zeros of the shape the real module would return (found
  once per input shape by running a parameter-less meta-device copy of it), so the code
  before stage ``k`` (masks, positions, rotary tables) runs as written, on the real inputs;
- when the forward reaches stage ``k``'s first module, its arguments' tensors that need a
  gradient (the activations, computed from zeros here) are replaced by the ones received from
  stage ``k - 1``;
- when it reaches a module of stage ``k + 1``, the forward stops there (``_Cut``), and that
  module's arguments that need a gradient are what stage ``k`` sends on.

So several tensors may cross a boundary, the code between modules is the user's, any batch
size and sequence length work, and nothing is traced. What must hold is that the forward calls
each stage's units in one stretch, in registration order (checked: a violation is an error
naming the module). A weight shared by units of several stages (a tied embedding and head) is
kept as a copy by every pipeline rank holding it; ``holders`` says which ranks, and their
gradients are summed over them (Megatron's embedding group).
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from paramshard.strategies.pipeline.stand_ins import Replacements, reached

__all__ = ["StagePlan", "plan_stages", "StageRunner", "Stub", "meta_copy", "units_of", "OWN_STATE"]

# Per-instance containers nn.Module.__init__ creates: a skeleton gets its own.
OWN_STATE = tuple(k for k, v in nn.Module().__dict__.items() if isinstance(v, (dict, set)))


class _Cut(BaseException):
    """Raised by the next stage's first module: the forward of this stage ends here.
    A BaseException, so the user's ``except Exception`` does not swallow it."""

    def __init__(self, unit: str, args: tuple, kwargs: dict) -> None:
        super().__init__(unit)
        self.unit, self.args, self.kwargs = unit, args, kwargs


@dataclass(frozen=True)
class StagePlan:
    """Which virtual stage each unit of the model belongs to (the same on every rank)."""

    split_points: tuple[str, ...]
    units: dict[str, int]
    """Unit name -> virtual stage, or -1 for units every stage runs (no parameters)."""
    path: frozenset[str]
    """Names of the modules on the way to a split point ("" is the root)."""

    @property
    def num_stages(self) -> int:
        return len(self.split_points) + 1

    def unit_of(self, name: str) -> str | None:
        """The unit a module or tensor name lies in (None for a path module's own)."""
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix in self.units:
                return prefix
        return None

    def stage_of(self, name: str) -> int:
        """Virtual stage of a module or tensor name; -1 when every stage holds it."""
        unit = self.unit_of(name)
        return -1 if unit is None else self.units[unit]


def units_of(model: nn.Module, path: frozenset[str]) -> list[tuple[str, nn.Module]]:
    out: list[tuple[str, nn.Module]] = []

    def walk(module: nn.Module, prefix: str) -> None:
        for name, child in module._modules.items():
            if child is None:
                continue
            full = f"{prefix}.{name}" if prefix else name
            if full in path:
                walk(child, full)
            else:
                out.append((full, child))

    walk(model, "")
    return out


def plan_stages(model: nn.Module, split_points: Iterable[str]) -> StagePlan:
    """The stage of every unit when a stage begins at each of ``split_points``."""
    points = tuple(split_points)
    known = dict(model.named_modules())
    for p in points:
        if not isinstance(p, str) or p not in known or p == "":
            raise ValueError(
                f"split point {p!r} is not a module of {type(model).__name__}"
                " (name one as model.named_modules() does, e.g. 'blocks.2')"
            )
    if len(set(points)) != len(points):
        raise ValueError(f"split_points name a module twice: {list(points)}")
    for a in points:
        for b in points:
            if b.startswith(a + "."):
                raise ValueError(f"split point '{a}' contains split point '{b}'")
    path = frozenset(".".join(p.split(".")[:i]) for p in points for i in range(len(p.split("."))))
    units, stage = {}, 0
    for name, unit in units_of(model, path):
        if name in points:
            if stage >= len(points) or points[stage] != name:
                order = [n for n, _ in units_of(model, path) if n in points]
                raise ValueError(
                    f"split_points must follow the model's module order: {order},"
                    f" got {list(points)}"
                )
            stage += 1
        has_params = any(True for _ in unit.parameters())
        units[name] = stage if (has_params or name in points) else -1
    return StagePlan(points, units, path)


class _Template:
    """Shape, dtype and grad flag of a tensor a stand-in returns."""

    __slots__ = ("shape", "dtype", "requires_grad")

    def __init__(self, t: torch.Tensor) -> None:
        self.shape, self.dtype, self.requires_grad = t.shape, t.dtype, t.requires_grad

    def zeros(self, device: torch.device, requires_grad: bool | None = None) -> torch.Tensor:
        """Zeros of this shape and dtype, needing a gradient as recorded (or as told)."""
        grad = self.requires_grad if requires_grad is None else requires_grad
        return torch.zeros(self.shape, dtype=self.dtype, device=device).requires_grad_(grad)


def _filled(template: Any, make: Any) -> Any:
    """A stand-in's output: ``template`` with each ``_Template`` made into a tensor by
    ``make``."""
    return pytree.tree_map(lambda x: make(x) if isinstance(x, _Template) else x, template)


def _key(args: tuple, kwargs: dict) -> Any:
    leaves, spec = pytree.tree_flatten((args, kwargs))
    out: list[Any] = [str(spec)]
    for x in leaves:
        if isinstance(x, torch.Tensor):
            out.append((tuple(x.shape), x.dtype, x.requires_grad))
        elif x is None or isinstance(x, (bool, int, float, str)):
            out.append(x)
        else:
            out.append(type(x).__name__)
    return tuple(out)


def _to_meta(x: Any) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    meta = x.detach().to("meta")
    return meta.requires_grad_(x.requires_grad) if x.is_floating_point() else meta


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers live on the meta device (no memory)."""
    memo: dict[int, Any] = {}
    for t in itertools.chain(module.parameters(), module.buffers()):
        if id(t) not in memo:
            m = torch.empty_like(t, device="meta")
            memo[id(t)] = nn.Parameter(m, t.requires_grad) if isinstance(t, nn.Parameter) else m
    return copy.deepcopy(module, memo)


class Stub(nn.Module):
    """Stands in for another stage's unit in a stage's skeleton; holds no tensors."""

    def __init__(self, name: str, stage: int, runner: StageRunner, meta: nn.Module | None):
        super().__init__()
        self.unit, self.stage = name, stage
        object.__setattr__(self, "_runner", runner)  # not submodules
        object.__setattr__(self, "_meta", meta)
        self._templates: dict[Any, Any] = {}

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        r = self._runner
        key = _key(args, kwargs)
        template = self._templates.get(key)
        if not r.active and template is not None and torch._C._current_graph_task_id() >= 0:
            # a reentrant checkpoint recomputing this stand-in in backward: its zeros again,
            # needing a gradient as the real module's output would (what they feed is
            # replaced at the first module, in the recompute too)
            return _filled(template, lambda t: t.zeros(r.device, t.dtype.is_floating_point))
        if not r.active:
            raise RuntimeError(
                f"'{self.unit}' belongs to pipeline stage {self.stage}, not to this rank's:"
                " a stage runs through the pipeline (train_step / train_on_batch), not alone"
            )
        if self.stage > r.index:
            if not r.entered:
                raise RuntimeError(
                    f"pipeline stage {r.index}: the forward reached '{self.unit}' (stage"
                    f" {self.stage}) before its own first module '{r.entry}'; the forward must"
                    " call the modules of each stage in registration order"
                )
            raise _Cut(self.unit, args, kwargs)
        if r.entered:
            raise RuntimeError(
                f"pipeline stage {r.index} began at '{r.entry}', and then the forward called"
                f" '{self.unit}' of stage {self.stage}: the forward calls modules in another"
                " order than they are registered; choose split_points so that each stage's"
                " modules run in one stretch"
            )
        if template is None:
            margs, mkwargs = pytree.tree_map(_to_meta, (args, kwargs))
            with torch.device("meta"):  # tensors the forward makes itself, too
                out = self._meta(*margs, **mkwargs)  # type: ignore[misc]
            template = pytree.tree_map(
                lambda x: _Template(x) if isinstance(x, torch.Tensor) else x, out
            )
            self._templates[key] = template
        return _filled(template, lambda t: r.stand_in(t.zeros(r.device), self.unit))

    def extra_repr(self) -> str:
        return f"'{self.unit}' of pipeline stage {self.stage}"


def _grad_leaves(tree: Any) -> tuple[list[Any], Any, list[int]]:
    leaves, spec = pytree.tree_flatten(tree)
    slots = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
    return leaves, spec, slots


class StageRunner:
    """Runs virtual stage ``index`` of the model: ``run(args, kwargs, received)`` returns the
    tensors to send on (or, on the last stage, ``(None, output)``)."""

    def __init__(self, index: int, num_stages: int, entry: str | None) -> None:
        self.index, self.num_stages, self.entry = index, num_stages, entry
        self.module: nn.Module | None = None
        self.active = self.entered = False
        self._received: list[torch.Tensor] = []
        self._stand_ins: dict[int, tuple[torch.Tensor, str]] = {}  # id -> (zeros, its unit)
        self._replaced = Replacements()  # for activation checkpointing's recompute

    def stand_in(self, zeros: torch.Tensor, unit: str) -> torch.Tensor:
        """``zeros`` a stand-in of earlier stage's ``unit`` returns in this run: a value this
        stage must not compute with past its first module (``_check_reach``)."""
        if zeros.requires_grad:
            self._stand_ins[id(zeros)] = (zeros, unit)
        return zeros

    def attach(self, skeleton: nn.Module, entry_module: nn.Module | None) -> None:
        self.module = skeleton
        if entry_module is not None:
            entry_module.register_forward_pre_hook(self._enter, with_kwargs=True)

    @property
    def device(self) -> torch.device:
        """Where this stage's tensors are (the CPU for a stage without any, or not yet real)."""
        tensors = () if self.module is None else (self.module.parameters(), self.module.buffers())
        first = next(itertools.chain(*tensors), None)
        return first.device if first is not None and not first.is_meta else torch.device("cpu")

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        if not self.active:
            return self._replaced.recompute(args, kwargs)
        if self.entered:
            raise RuntimeError(f"pipeline stage {self.index}: '{self.entry}' ran twice")
        self.entered = True
        if self.index == 0:
            return None
        leaves, spec, slots = _grad_leaves((args, kwargs))
        if len(slots) != len(self._received):
            raise RuntimeError(
                f"pipeline stage {self.index} received {len(self._received)} tensor(s) for"
                f" '{self.entry}', whose arguments here hold {len(slots)} that need a gradient"
            )
        for i, t in zip(slots, self._received, strict=True):
            if t.shape != leaves[i].shape:
                raise RuntimeError(
                    f"pipeline stage {self.index}: '{self.entry}' expects an activation of"
                    f" shape {list(leaves[i].shape)}, received {list(t.shape)}"
                )
            self._replaced.add(leaves[i], t)
            leaves[i] = t
        return pytree.tree_unflatten(leaves, spec)

    def run(
        self, args: tuple, kwargs: dict, received: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor] | None, Any]:
        assert self.module is not None
        self._replaced.prune()
        self._received, self.entered, self.active = received, self.index == 0, True
        try:
            out = self.module(*args, **kwargs)
        except _Cut as cut:
            leaves, _, slots = _grad_leaves((cut.args, cut.kwargs))
            if not slots:
                raise RuntimeError(
                    f"pipeline stage {self.index}: no tensor that needs a gradient reaches"
                    f" '{cut.unit}' (where stage {self.index + 1} begins)"
                ) from None
            self._check_reach([leaves[i] for i in slots], self._stand_ins)
            return [leaves[i] for i in slots], None
        finally:
            self.active, self._received = False, []
            stand_ins, self._stand_ins = self._stand_ins, {}
        if not self.entered:
            raise RuntimeError(
                f"pipeline stage {self.index}: the forward never called '{self.entry}'"
            )
        if self.index != self.num_stages - 1:
            raise RuntimeError(
                f"pipeline stage {self.index}: the forward returned before reaching the next"
                " stage's first module"
            )
        self._check_reach(pytree.tree_leaves(out), stand_ins)
        return None, out

    def _check_reach(
        self, results: list[Any], stand_ins: dict[int, tuple[torch.Tensor, str]]
    ) -> None:
        """Raises when ``results`` (what this stage sends on, or the model's output) were
        computed from a stand-in's zeros: a value an earlier stage makes that reaches past
        this stage's first module other than as its argument, which is all a stage receives.
        Found through the autograd graph, so only for values that need a gradient."""
        unit = reached(results, stand_ins, self._replaced)
        if unit is not None:
            raise RuntimeError(
                f"pipeline stage {self.index} computes with the output of '{unit}', a"
                f" module of an earlier stage, past its own first module '{self.entry}': a"
                " stage receives only the arguments of its first module, so that value (a"
                " residual around the split point, a skip over whole stages) would be zeros"
                " here. Choose split points where every value that crosses them is an"
                " argument of the next stage's first module (a whole block, e.g. 'blocks.2',"
                " not a module inside one), and keep a block's residual inside the block"
                " (x = block(x), not x = x + block(x) in its parent)"
            )
