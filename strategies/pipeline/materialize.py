"""A model built on the meta device, made real on each rank for its own stage and parts only.

    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)                      # no memory anywhere
    model = HybridShardedModel(model, config, 2, 2, split_points=["model.layers.2"],
                               init_weights="ckpt/")       # or a .safetensors file, a state
    # dict, or init_weights=model._init_weights, init_seed=0  (a seeded init, as a whole build)

``init_weights`` (``initialize_model`` is the same for a whole model in one process, the twin
each rank's share equals):

- **a state dict** or **a safetensors checkpoint** (a ``.safetensors`` file, or a directory with
  ``model.safetensors`` or ``model.safetensors.index.json``): each rank reads its own tensors,
  of a tensor-parallel one only its part (``get_slice``); a tied weight under any of its names.
- **"reset_parameters"** or **a callable** ``fn(module)``, with ``init_seed``: the init of a
  whole build, replayed under ``torch.manual_seed(init_seed)`` in a build's order so that every
  draw is the same. The order (``init_steps``): modules children first, in registration order
  (``nn.Module.apply``'s; a module is built after its children); each one that defines
  ``reset_parameters`` calls it (torch's layers do, ending their ``__init__``); with ``fn``,
  after the model's last reset, ``fn(m)`` for every module in that order, and likewise right
  after its own subtree for each Hugging Face ``PreTrainedModel`` inside (its ``__init__`` ends
  in ``post_init``); a module gets ``fn`` once. So ``fn = model._init_weights`` draws what
  ``torch.manual_seed(s); LlamaForCausalLM(cfg)`` does, in the model's dtype (one built in
  float32 and then converted drew in float32). A weight tied to an earlier one (a head to the
  embedding) was its module's own when a whole build initialised that module: that init writes
  a scratch tensor (the same draws), dropped. Draws a constructor makes outside
  ``reset_parameters`` (GPT-2's ``Conv1D``) are not replayed.

Each rank replays the whole order one unit (``split.py``) at a time: the unit's tensors are made
real and whole (this rank's whole tensors in place, the others temporaries, NaN until set), its
steps run, this rank keeps its parts (``TensorSplit.ranges``) and the temporaries are dropped:
a rank holds its share plus one unit (another rank's, or its own split one) at most. An init may
use its module's tensors and its submodules' (a module on the way to a split point: its own
only); anything else is an error naming the tensor, which is not real at that point.

Buffers a state dict lacks (non-persistent: a rotary ``inv_freq``) or a seeded init leaves
unset are rebuilt, in modules without parameters, by their Hugging Face model's
``_init_weights`` (rotary tables from the module's rope function); any other unset tensor is an
error naming it.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from itertools import chain, groupby
from typing import Any, Literal

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from paramshard.strategies.pipeline.split import StagePlan, meta_copy, plan_stages
from paramshard.strategies.pipeline.weights import (
    WeightSource,
    blank,
    make_real,
    move_to,
    named_tensors,
    put,
    take,
)
from paramshard.strategies.tensor.gather import tensor_splits
from paramshard.strategies.tensor.layers import TensorSplit

__all__ = ["InitWeights", "WeightInit", "init_steps", "initialize_model"]

InitWeights = (
    None
    | Literal["reset_parameters"]
    | Callable[[nn.Module], Any]
    | Mapping[str, torch.Tensor]
    | str
    | os.PathLike
)
"""None (the model's own tensors), "reset_parameters", ``fn(module)``, a state dict, or the path
of a safetensors checkpoint."""

_RNG_LOCK = threading.Lock()  # ranks in threads of one process share torch's generator


# -- the order a whole build initialises in ---------------------------------------------------
def _is_hf_model(module: nn.Module) -> bool:
    hf = "transformers.modeling_utils.PreTrainedModel"
    return any(f"{c.__module__}.{c.__qualname__}" == hf for c in type(module).__mro__)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _within(name: str, module: str) -> bool:
    return module in ("", name) or name.startswith(module + ".")


def _post_order(module: nn.Module, prefix: str, seen: set[int]) -> Iterator[tuple[str, nn.Module]]:
    """(name, module) children first, in registration order, each module once."""
    if id(module) not in seen:
        seen.add(id(module))
        for name, child in module.named_children():
            yield from _post_order(child, _join(prefix, name), seen)
        yield prefix, module


def init_steps(model: nn.Module, with_fn: bool) -> list[tuple[str, str]]:
    """The replayed order (module docstring): (module name, "reset_parameters" or "fn")."""
    steps: list[tuple[str, str]] = []
    given_fn: set[int] = set()
    for name, module in _post_order(model, "", set()):
        if callable(getattr(module, "reset_parameters", None)):
            steps.append((name, "reset_parameters"))
        if with_fn and (module is model or _is_hf_model(module)):
            for sub_name, _ in _post_order(module, name, given_fn):
                steps.append((sub_name, "fn"))
    return steps


def _check(init_weights: Any, init_seed: Any) -> str:
    """The kind of ``init_weights``: "none", "seeded" or "load"; errors name the field."""
    path = init_weights if isinstance(init_weights, (str, os.PathLike)) else ""
    if init_weights == "reset_parameters" or (
        callable(init_weights) and not path and not isinstance(init_weights, Mapping)
    ):
        if isinstance(init_seed, int) and not isinstance(init_seed, bool):
            return "seeded"
        raise ValueError(
            f"init_weights={getattr(init_weights, '__name__', init_weights)!r} is a seeded init:"
            f" it needs init_seed, an int (the same on every rank), got {init_seed!r}"
        )
    if init_seed is not None:
        raise ValueError(f"init_seed={init_seed!r} is for a seeded init_weights only")
    if init_weights is None or isinstance(init_weights, Mapping):
        return "none" if init_weights is None else "load"
    if os.path.isdir(path) or (str(path).endswith(".safetensors") and os.path.exists(path)):
        return "load"
    raise ValueError(
        "init_weights must be None, 'reset_parameters', a callable fn(module), a state dict,"
        " or the path of an existing .safetensors file or of a directory holding"
        f" model.safetensors[.index.json]; got {init_weights!r}"
    )


# -- replaying the inits -------------------------------------------------------------------------
class _NoMetaOps(TorchDispatchMode):
    """During a replayed init, an op on a tensor that is not real here is an error naming it (on
    meta it would draw no random numbers, and the stream would drift silently)."""

    def __init__(self, names: dict[int, str], step: tuple[str, str]) -> None:
        super().__init__()
        self.names, self.step = names, step

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        for t in pytree.tree_leaves((args, kwargs or {})):
            if isinstance(t, torch.Tensor) and t.is_meta:
                name, kind = self.step
                raise RuntimeError(
                    f"init_weights: {kind} of '{name or 'the model'}' uses"
                    f" '{self.names.get(id(t), 'a meta tensor')}', which is not its own:"
                    " replayed one unit at a time, an init may use its module's tensors and its"
                    " submodules' (a module on the way to a split point: its own only)"
                )
        return func(*args, **(kwargs or {}))


def _run_step(model: nn.Module, step: tuple[str, str], fn: Any, owners: dict[int, str]) -> None:
    """One init call. A weight first registered outside the module (a tie) is a scratch tensor
    meanwhile: it was the module's own when a whole build ran this."""
    name, kind = step
    module = model.get_submodule(name)
    slots = []  # (name, table, attr, the tensor, what the init sees)
    for sub_name, sub in module.named_modules(prefix=name, remove_duplicate=False):
        for table in (sub._parameters, sub._buffers):
            for attr, t in table.items():
                if t is not None:
                    seen = t if _within(owners[id(t)], name) else blank(t)
                    table[attr] = seen
                    slots.append((_join(sub_name, attr), table, attr, t, seen))
    try:
        module.reset_parameters() if kind == "reset_parameters" else fn(module)
    finally:
        replaced = [n for n, table, attr, _, seen in slots if table[attr] is not seen]
        for _, table, attr, t, _ in slots:
            table[attr] = t
    if replaced:
        raise RuntimeError(
            f"init_weights: {kind} of '{name or 'the model'}' replaced {replaced} with new"
            " tensors; initialise in place (torch.nn.init.*_, copy_) so ties and parts keep them"
        )


@dataclass
class _Held:
    """One tensor this rank holds, and how it is a part of the whole model's."""

    actual: torch.Tensor
    split: TensorSplit | None
    name: str
    written: bool = False


class _Replay:
    """The whole model (``template``, on meta) against the tensors this rank holds."""

    def __init__(self, template: nn.Module, plan: StagePlan, stage: nn.Module) -> None:
        self.template, self.plan = template, plan
        self.named = named_tensors(template)
        self.names = {id(t): n for n, t in reversed(self.named.items())}  # first names
        self.aliases: dict[int, list[str]] = {}
        for n, t in self.named.items():
            self.aliases.setdefault(id(t), []).append(n)
        splits, self.held = tensor_splits(stage), {}
        for name, actual in named_tensors(stage).items():
            whole, split = self.named.get(name), splits.get(name)
            shape = list(whole.shape) if whole is not None else None
            if shape is not None and split is not None:
                shape[split.dim] = sum(len(r) for r in split.ranges())
            if shape != list(actual.shape):
                raise ValueError(
                    f"init_weights: this rank's '{name}' {list(actual.shape)} is not a part of"
                    f" the model's {None if whole is None else list(whole.shape)}"
                )
            self.held.setdefault(id(whole), _Held(actual, split, name))

    def region(self, name: str, subtree: bool) -> list[torch.Tensor]:
        """What a visit makes real: the tensors a module (``subtree``: and its submodules)
        registers first."""
        module = self.template.get_submodule(name)
        tensors = (
            chain(module.parameters(), module.buffers())
            if subtree
            else chain(module._parameters.values(), module._buffers.values())
        )
        owned = {id(t): t for t in tensors if t is not None and _within(self.names[id(t)], name)}
        return list(owned.values())

    @contextlib.contextmanager
    def visit(self, region: list[torch.Tensor]) -> Iterator[None]:
        """``region`` real and whole while the body runs: this rank's whole tensors themselves
        (swapped in, no copy), the rest temporaries (this rank's parts put back). Then this
        rank keeps its parts of what was written, and the temporaries are dropped."""
        shells, versions = [], []
        for t in region:
            h = self.held.get(id(t))
            real = h.actual if h is not None and h.split is None else blank(t)
            if h is not None and h.split is not None and h.written:
                put(real, h.actual, h.split)
            torch.utils.swap_tensors(t, real)  # t is real now, ``real`` the meta shell
            shells.append(real)
            versions.append(t._version)
        try:
            yield
            for t, version in zip(region, versions, strict=True):
                h = self.held.get(id(t))
                if h is not None and t._version != version:  # written in the body
                    if h.split is not None:
                        h.actual.copy_(take(t, t.dim(), h.split))
                    h.written = True
        finally:
            for t, shell in zip(region, shells, strict=True):
                torch.utils.swap_tensors(t, shell)  # a whole tensor of this rank's goes back

    def step(self, step: tuple[str, str], fn: Any) -> None:
        with _NoMetaOps(self.names, step):
            _run_step(self.template, step, fn, self.names)

    def replay(self, fn: Any) -> None:
        """The whole order, each unit's consecutive steps in one visit."""

        def unit(step: tuple[str, str]) -> tuple[str, bool]:
            name = self.plan.unit_of(step[0])
            return (name, True) if name is not None else (step[0], False)

        for (name, subtree), steps in groupby(init_steps(self.template, fn is not None), unit):
            with self.visit(self.region(name, subtree)):
                for step in steps:
                    self.step(step, fn)

    def load(self, source: WeightSource) -> None:
        """This rank's persistent tensors, or their parts, read from ``source``."""
        persistent, missing = set(self.template.state_dict(keep_vars=True)), []
        for tid, h in self.held.items():
            names = [n for n in self.aliases[tid] if n in persistent]
            value = source.read(names, self.named[h.name].shape, h.split)
            if value is not None:
                h.actual.copy_(value)
                h.written = True
            elif names:  # else a non-persistent buffer, rebuilt after
                missing.append(" / ".join(names))
        if missing:
            raise ValueError(
                f"init_weights: {source.what} has no tensor for {len(missing)} of this rank's:"
                f" {missing[:8]}{' ...' * (len(missing) > 8)}"
            )

    def rebuild_buffers(self) -> None:
        """Unset buffers of modules without parameters, by their Hugging Face model's
        ``_init_weights`` (rotary tables from the module's rope function; no random draws)."""
        buffers = {id(t) for t in self.template.buffers()}
        modules = {
            self.names[tid].rpartition(".")[0]
            for tid, h in self.held.items()
            if not h.written and tid in buffers
        }
        for name in sorted(modules):
            parts, module = name.split("."), self.template.get_submodule(name)
            owners = [self.template.get_submodule(".".join(parts[:i])) for i in range(len(parts))]
            hf = [m for m in [*owners, module] if _is_hf_model(m)]
            if hf and not any(True for _ in module.parameters()):  # else named as unset below
                with _RNG_LOCK, torch.random.fork_rng(devices=[]):
                    with self.visit(self.region(name, subtree=False)):
                        self.step((name, "fn"), hf[-1]._init_weights)

    def check_all_set(self, kind: str) -> None:
        unset = [h.name for h in self.held.values() if not h.written]
        how = {
            "seeded": "set by no replayed init: set it in its module's reset_parameters or in"
            " the init_weights callable",
            "load": "in neither init_weights nor rebuilt (a non-persistent buffer): make it"
            " persistent, or build the model with it real",
        }
        if unset:
            raise ValueError(f"init_weights: {unset[:8]}{' ...' * (len(unset) > 8)} is {how[kind]}")


class WeightInit:
    """``init_weights`` of a model, checked at once (with ``init_seed`` for a seeded one). A meta
    copy of the whole model is kept until ``materialize`` sets this rank's tensors."""

    def __init__(self, model: nn.Module, init_weights: InitWeights, init_seed: int | None) -> None:
        self.kind = _check(init_weights, init_seed)
        self.init_weights, self.init_seed = init_weights, init_seed
        self.template = meta_copy(model) if self.kind != "none" else None  # before TP splits
        meta = [n for n, t in named_tensors(model).items() if t.is_meta]
        if self.kind == "none" and meta:
            raise ValueError(
                f"the model's {meta[:3]}{' ...' * (len(meta) > 3)} are on the meta device: pass"
                " init_weights ('reset_parameters' or fn(module) with init_seed, a state dict,"
                " or a safetensors path) to make each rank's share real"
            )

    def materialize(
        self, plan: StagePlan, stage: nn.Module, device: torch.device | str | None = None
    ) -> None:
        """Makes ``stage`` (this rank's tensors under the whole model's names, tensor-parallel
        parts included) real in place, sets it from ``init_weights`` on the CPU (so a seeded
        init draws what a whole CPU build draws) and then moves it to ``device``."""
        if self.template is None:
            if device is not None:
                raise ValueError(
                    f"init_device={str(device)!r} is where a meta-built model is made real (with"
                    " init_weights); move a real model with model.to(device) before wrapping it"
                )
            return
        replay, self.template = _Replay(self.template, plan, stage), None
        make_real(stage)
        with torch.no_grad():
            if self.kind == "load":
                replay.load(WeightSource(self.init_weights))
            else:
                with _RNG_LOCK, torch.random.fork_rng(devices=[]):  # the caller's RNG kept
                    torch.manual_seed(self.init_seed)  # type: ignore[arg-type]
                    fn = None if self.init_weights == "reset_parameters" else self.init_weights
                    replay.replay(fn)
            replay.rebuild_buffers()
        replay.check_all_set(self.kind)
        if device is not None:
            move_to(stage, torch.device(device))


def initialize_model(
    model: nn.Module, init_weights: InitWeights, init_seed: int | None = None
) -> nn.Module:
    """``model`` set from ``init_weights`` (meta tensors made real on the CPU, in place) as a
    rank's share is, for the whole model in one process: the single-process twin."""
    WeightInit(model, init_weights, init_seed).materialize(plan_stages(model, []), model)
    return model
