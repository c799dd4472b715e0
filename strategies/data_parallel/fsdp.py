"""FSDP (ZeRO stage 3): parameters, gradients and optimizer state all sharded over the servers.

The model is cut into units (wrap policy; the root unit holds what is left, e.g. embeddings).
Per unit, as in PyTorch FSDP:
- before its forward: gather (pull its buffers at the current version), and start gathering
  the next unit in the background (prefetch);
- after its forward: free the gathered parameters when ``reshard_after_forward``, and hook the
  outputs so the unit is gathered again just before its backward (prefetching the unit before);
- once every parameter of the unit has its gradient: push the unit's gradients (server i gets
  slice i: a reduce-scatter), free them and the parameters.
The root unit is gathered at the start of forward and freed when its gradients are pushed.
A parameter "freed" keeps its Python object (optimizers and hooks hold it) with empty storage.

Activation checkpointing (non-reentrant ``torch.utils.checkpoint``) recomputes a unit's forward
inside backward, after its pre-backward hook gathered it: that forward keeps the unit gathered
(its backward comes next) and prefetches nothing. ``torch.compile`` of a unit (``block.compile()``
or ``torch.compile(block)``) compiles its forward only: every hook here is ``eager_hook``, so
gathers, frees and pushes run between the compiled regions.

``wrap`` defaults to the classes a Hugging Face model lists in ``_no_split_modules`` (its
decoder blocks: ``GPT2Block``, ``LlamaDecoderLayer``), transformers' own unit of sharding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from paramshard.strategies.base import eager_hook
from paramshard.strategies.config import ShardingConfiguration
from paramshard.strategies.data_parallel.sharded import ServerShardedModel
from paramshard.strategies.layout import BufferSpec, flatten, torch_dtype
from paramshard.strategies.mixed_precision import cast_forward_inputs, compute_views

__all__ = ["FSDPModel", "ZeRO3Model", "held_bytes", "no_split_classes"]


@dataclass
class _Unit:
    index: int
    name: str
    module: nn.Module
    buffers: list[BufferSpec] = field(default_factory=list)
    params: list[nn.Parameter] = field(default_factory=list)
    own_dtypes: list[torch.dtype] = field(default_factory=list)  # what a freed param shows
    nbytes: int = 0  # bytes its gathered parameters hold (in the compute dtype)
    materialized: bool = False
    fetch: Future | None = None  # a prefetch in flight
    ready: set[int] = field(default_factory=set)  # params whose gradient arrived
    pushed_micro: int = -1


def no_split_classes(model: nn.Module) -> tuple[type[nn.Module], ...]:
    """The module classes a Hugging Face model names in ``_no_split_modules`` (transformers'
    "never cut inside one of these": its decoder blocks), as found among its modules; () for
    a model without them."""
    names = getattr(model, "_no_split_modules", None) or ()
    names = {names} if isinstance(names, str) else set(names)
    found = {type(m) for m in model.modules() if type(m).__name__ in names}
    return tuple(sorted(found, key=lambda cls: cls.__name__))


def held_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages ``tensors`` hold (views of one flat count it once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in tensors}
    return sum(s.nbytes() for s in storages.values())


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    if isinstance(out, dict):
        return [t for o in out.values() for t in _tensors(o)]
    return []


class FSDPModel(ServerShardedModel):
    """Fully sharded data parallel over the shard servers (``wrap``: module classes that
    become units, e.g. ``(Block,)``; None: a Hugging Face model's ``_no_split_modules``
    classes, else none; ``config.wrap_min_params`` adds a size policy)."""

    strategy = "fsdp"

    def __init__(
        self,
        model: nn.Module,
        config: ShardingConfiguration,
        wrap: tuple[type[nn.Module], ...] | None = None,
    ) -> None:
        if wrap is None:
            wrap = no_split_classes(model) or None
        super().__init__(model, config, wrap=wrap)
        self._unit_list = [_Unit(i, name, m) for i, (name, m) in enumerate(self._units)]
        self._unit_of: dict[int, _Unit] = {}
        self._fetcher = ThreadPoolExecutor(1, thread_name_prefix="gather")
        self.live_bytes = 0  # gathered parameter bytes held right now
        self.peak_live_bytes = 0
        self._summoned = False  # inside summon_full_params: every unit stays gathered
        for unit in self._unit_list[1:]:
            unit.module.register_forward_pre_hook(eager_hook(self._make_pre_forward(unit)))
            unit.module.register_forward_hook(eager_hook(self._make_post_forward(unit)))

    def _num_micro(self) -> int:
        return self.config.gradient_accumulation_steps

    # -- registration: after it, the trainer keeps no parameters -------------------------------
    def _after_register(self) -> None:
        by_unit = {u.name: u for u in self._unit_list}
        for b in self._flat_buffers:
            unit = by_unit[b.unit]
            unit.buffers.append(b)
            unit.params += b.params
            unit.own_dtypes += [torch_dtype(e.dtype) for e in b.entries]
            for p in b.params:
                self._unit_of[id(p)] = unit
                p.register_post_accumulate_grad_hook(eager_hook(self._on_grad))
        for unit in self._unit_list:
            self._free(unit)
        # the flats of two units wait for reuse; the root's (embeddings, often the largest)
        # is kept only when it fits in that
        self._flats.max_idle_bytes = 2 * max(
            (
                sum(b.numel * torch_dtype(b.master_dtype).itemsize for b in u.buffers)
                for u in self._unit_list[1:]
            ),
            default=0,
        )

    # -- gather and free ---------------------------------------------------------------------
    def _fetch(self, unit: _Unit) -> dict[str, torch.Tensor]:
        return self._pull(unit.buffers, self._step, compute=True)

    def _prefetched(self, unit: _Unit) -> dict[str, torch.Tensor]:
        with self.comm_times.busy("gather"):
            return self._fetch(unit)

    def _prefetch(self, unit: _Unit) -> None:
        if self.config.prefetch and not unit.materialized and unit.fetch is None:
            unit.fetch = self._fetcher.submit(self._prefetched, unit)

    def _gather(self, unit: _Unit) -> None:
        if unit.materialized or not unit.buffers:
            return
        fetch, unit.fetch = unit.fetch, None
        with self.comm_times.blocked("gather"):
            flats = fetch.result() if fetch is not None else self._fetch(unit)
        for b in unit.buffers:  # in param_dtype: forward and backward compute in it (FSDP2)
            for view, p in zip(compute_views(self.config, flats[b.name], b), b.params, strict=True):
                p.data = view
        unit.materialized = True
        unit.nbytes = held_bytes(unit.params)
        self.live_bytes += unit.nbytes
        self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)

    def _free(self, unit: _Unit) -> None:
        if unit.fetch is not None:  # a prefetch nobody used: let it finish, drop it
            unit.fetch.result()
            unit.fetch = None
        # freed, a parameter shows its own dtype (FSDP2's sharded parameter keeps it)
        for p, own in zip(unit.params, unit.own_dtypes, strict=True):
            p.data = torch.empty(0, dtype=own, device=p.device)
        if unit.materialized:
            self.live_bytes -= unit.nbytes
        unit.materialized = False

    @contextlib.contextmanager
    def summon_full_params(self) -> Iterator[None]:
        """Every parameter gathered for the block, as torch FSDP's ``summon_full_params``: the
        whole model runs outside the wrapper's forward (``model.module.generate(...)``), and
        its parameters can be read in place. Values at the servers' step, in the compute dtype
        (``param_dtype``); the block runs without grad, and what it changes in them is not
        written back (``load_state_dict`` writes). It holds the whole model's parameters at
        once. Not inside a step's backward; any rank may call it alone."""
        if not self.registered or self._summoned:
            yield
            return
        if self._in_backward:
            raise RuntimeError("summon_full_params: not inside a backward pass")
        self._summoned = True
        try:
            for unit in self._unit_list:
                self._gather(unit)
            with torch.no_grad():
                yield
        finally:
            self._summoned = False
            for unit in self._unit_list:
                self._free(unit)

    # -- forward -------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self.registered:  # no optimizer yet: still the plain local model
            return self.module(*args, **kwargs)
        if torch.is_grad_enabled():
            self.join_step()  # elastic: a step is trained by its members only
            self._begin_training()
        args, kwargs = cast_forward_inputs(self.config, args, kwargs)
        root = self._unit_list[0]
        self._gather(root)
        if len(self._unit_list) > 1:
            self._prefetch(self._unit_list[1])
        out = self.module(*args, **kwargs)
        if not torch.is_grad_enabled() and not self._summoned:  # no backward will free them
            for unit in self._unit_list:
                self._free(unit)
        return out

    def _make_pre_forward(self, unit: _Unit) -> Callable:
        def pre_forward(module: nn.Module, args: Any) -> None:
            if not self.registered:
                return
            self._gather(unit)
            if self._in_backward:  # recomputed for its backward: the next unit is done
                return
            if unit.index + 1 < len(self._unit_list):
                self._prefetch(self._unit_list[unit.index + 1])

        return pre_forward

    def _make_post_forward(self, unit: _Unit) -> Callable:
        def post_forward(module: nn.Module, args: Any, output: Any) -> None:
            if not self.registered or self._in_backward:
                # Recomputed inside backward (activation checkpointing): its backward runs
                # next, so it stays gathered until its gradients are pushed.
                return
            if torch.is_grad_enabled():
                for t in _tensors(output):
                    if t.requires_grad:
                        t.register_hook(eager_hook(self._make_pre_backward(unit)))
            if self._summoned:
                return
            if self.config.reshard_after_forward or not torch.is_grad_enabled():
                self._free(unit)

        return post_forward

    # -- backward ------------------------------------------------------------------------------
    def _make_pre_backward(self, unit: _Unit) -> Callable:
        def pre_backward(grad: torch.Tensor) -> None:
            self._start_backward()
            self._gather(unit)
            if unit.index > 1:  # the unit before it runs its backward next
                self._prefetch(self._unit_list[unit.index - 1])

        return pre_backward

    def _on_grad(self, p: nn.Parameter) -> None:
        unit = self._unit_of[id(p)]
        self._start_backward()
        if self._keep_local(p):
            return
        unit.ready.add(id(p))
        if len(unit.ready) == len(unit.params):
            self._push_unit(unit)

    def _push_unit(self, unit: _Unit) -> None:
        for b in unit.buffers:
            master = torch_dtype(b.master_dtype)
            grads = [
                p.grad
                if p.grad is not None
                else torch.zeros(e.shape, dtype=master, device=p.device)
                for p, e in zip(b.params, b.entries, strict=True)
            ]
            out = self._flats.take(b.numel, master, grads[0].device)
            flat = flatten(grads, b.numel, master, out=out)
            for p in b.params:
                p.grad = None
            self._push_async(b, flat)
        unit.ready.clear()
        unit.pushed_micro = self._micro
        self._free(unit)

    def _end_backward(self) -> None:
        """After each backward: units with unused parameters push what they have (zeros for
        the rest) so the servers see every contribution; nothing stays gathered."""
        if self._collect is None:
            for unit in self._unit_list:
                if unit.buffers and unit.pushed_micro != self._micro:
                    self._push_unit(unit)
            self._micro += 1
        for unit in self._unit_list:
            self._free(unit)
        super()._end_backward()

    def _abandon_local(self) -> None:
        for unit in self._unit_list:
            try:
                self._free(unit)
            except Exception:  # noqa: BLE001 - a prefetch from the dead server
                unit.fetch = None
                self._free(unit)
            unit.ready.clear()
            unit.pushed_micro = -1
        self._in_backward = False

    def _ensure_reduced(self) -> None:
        self._wait_pushes()
        self._check_micro_count()

    def _local_gradients(self, run_backward: Callable[[], None]) -> dict[str, torch.Tensor]:
        if not self.registered:  # no optimizer yet: the plain local model, no hooks
            return self._gradients_by_swapping(run_backward)
        return self._gradients_from_hooks(run_backward)


ZeRO3Model = FSDPModel
