"""``ShardedModelBase``: AiDotNet's ShardedModelBase surface, once for all strategies.

A strategy supplies four primitives: ``_full_state()`` (the wrapped model's full parameters, as
tensors under its own names), ``_load_full_state(...)``, ``clip_grad_norm_`` and
``_optimizer_step``. Everything else the seeds ask for (flat parameter vectors, gradients
without an update, (de)serialisation, save/load, metadata, ``train_on_batch``) is written here
against those, so every strategy behaves the same way.

Three protected methods are the model's side of its protocol with what drives it, called from
other modules on purpose: ``_attach`` and ``_optimizer_step`` by the optimizer wrappers
(data_parallel/optim.py), ``_unscale_grads`` by the loss scaler (grad_scaler.py) and a 3D
model's replica. Protected, so that a user's model does not offer them as its own API.

AiDotNet's "local shard" is this rank's slice of the flat vector of all parameters by the slice
rule (protos/slicing.py); the servers' real shards are per buffer and shown by ``status``.
"""

from __future__ import annotations

import copy
import json
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from paramshard.client import restarts
from paramshard.protos import slicing
from paramshard.protos.manifest import MODEL_CONFIG_MAX_BYTES
from paramshard.strategies.config import ClientRank, ShardingConfiguration
from paramshard.strategies.layout import (
    copy_flat_into,
    incompatible_keys,
    master_torch_dtype,
    to_master,
)
from paramshard.strategies.losses import default_loss
from paramshard.strategies.mixed_precision import cast_forward_inputs, outputs_for_loss
from paramshard.strategies.model_files import ModelFiles
from paramshard.strategies.timing import CommTimes

__all__ = ["ShardedModelBase", "eager_hook", "hf_model_config", "owner_of"]

# parameter id -> the wrapper holding it, so an optimizer wrapper built from
# ``model.parameters()`` finds its model (torch's optimizers know only parameters).
OWNERS: weakref.WeakValueDictionary[int, ShardedModelBase] = weakref.WeakValueDictionary()


def owner_of(params: list[nn.Parameter]) -> ShardedModelBase:
    """The sharded model wrapper that holds ``params``."""
    owners = {id(OWNERS[id(p)]): OWNERS[id(p)] for p in params if id(p) in OWNERS}
    if len(owners) != 1:
        raise ValueError(
            "the optimizer's parameters must come from exactly one sharded model's parameters()"
            f" (found {len(owners)} models); build the optimizer from model.parameters()"
        )
    return next(iter(owners.values()))


def eager_hook(hook: Callable) -> Callable:
    """``hook`` as torch.compile never traces it: the strategies' hooks gather, free and push
    through the servers, so they run eagerly between compiled regions (a graph break around
    each call), as FSDP2's hooks do (``_dynamo_disable`` in torch's ``fully_shard``)."""
    return torch.compiler.disable(hook, recursive=True, reason="paramshard hooks run eagerly")


def hf_model_config(model: nn.Module) -> str:
    """What the servers keep of a Hugging Face ``PreTrainedModel`` so its job exports as a
    folder ``from_pretrained`` loads, without the model's code: JSON {"architecture": its
    class name, "config": ``config.to_dict()``}; "" for any other model."""
    if not any(
        c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
        for c in type(model).__mro__
    ):
        return ""
    config = json.loads(model.config.to_json_string(use_diff=False))  # to_dict(), as JSON
    described = json.dumps({"architecture": type(model).__name__, "config": config})
    if len(described.encode()) > MODEL_CONFIG_MAX_BYTES:  # the servers would refuse it
        warnings.warn(
            f"{type(model).__name__}'s config is {len(described.encode()):,} bytes, over the"
            f" servers' {MODEL_CONFIG_MAX_BYTES:,}: not recorded, so no export with --hf-dir",
            stacklevel=3,
        )
        return ""
    return described


class ShardedModelBase(ModelFiles, ClientRank, nn.Module):
    """A torch model wrapped for training over the shard servers.

    The wrapper is an ``nn.Module``: ``model(x)``, ``parameters()``, ``state_dict()`` (full
    tensors under the wrapped model's own names) and ``load_state_dict()`` work as usual.
    """

    strategy = "base"
    state_on_servers = False
    """Parameters and optimizer state live on the servers, so a restarted rank can rejoin
    (``paramshard launch --max-restarts``; client/restarts.py)."""

    def __init__(self, model: nn.Module, config: ShardingConfiguration) -> None:
        if model is None or config is None:
            raise TypeError(f"{type(self).__name__} needs a model and a ShardingConfiguration")
        super().__init__()
        self.module = model
        self.config = config
        self.client = config.client
        if config.elastic and not self.state_on_servers:
            raise ValueError(
                f"ShardingConfiguration(elastic=True) needs ZeRO-1, ZeRO-2 or FSDP: a"
                f" {self.strategy} rank keeps parameters and optimizer state in its process,"
                " so no rank can leave or join it; run it without elastic (a lost rank then"
                " ends the job at once)"
            )
        restarts.declare(self.strategy, self.state_on_servers, self.client.rank)
        if not self.state_on_servers:  # a restart cannot rejoin: the servers wait for none
            self.client.run_state.cannot_rejoin()
        # collectives reduce in rank order unless the configuration says arrival order
        self.client.deterministic = config.deterministic
        self.default_loss_function: Callable[[Any, Any], torch.Tensor] = default_loss
        self.optimizer: Any = None  # the attached optimizer wrapper
        self.skipped_steps = 0
        self.comm_times = CommTimes()
        """Seconds spent waiting on and talking to the servers, by kind (strategies/timing.py)."""
        """Steps skipped because their gradient held NaN or Inf (strategies/nonfinite.py)."""
        self._named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        # shapes as built: FSDP frees parameters' storage, so p.shape says nothing later
        self._shapes = {n: p.shape for n, p in self._named}
        self._masters = {n: master_torch_dtype(p.dtype) for n, p in self._named}
        self._cache: torch.Tensor | None = None
        self._collect: dict[int, torch.Tensor] | None = None  # see _keep_local
        self._in_backward = False
        for _, p in self._named:
            OWNERS[id(p)] = self

    # -- AiDotNet's properties (``rank`` and ``world_size``: ClientRank) ----------------------
    @property
    def wrapped_model(self) -> nn.Module:
        return self.module

    @property
    def sharding_configuration(self) -> ShardingConfiguration:
        return self.config

    @property
    def parameter_count(self) -> int:
        return sum(e.numel() for _, e in self._named_shapes())

    def _named_shapes(self) -> list[tuple[str, torch.Size]]:
        return list(self._shapes.items())

    @property
    def shard_start_index(self) -> int:
        return slicing.slice_bounds(self.parameter_count, self.world_size, self.rank)[0]

    @property
    def shard_size(self) -> int:
        start, stop = slicing.slice_bounds(self.parameter_count, self.world_size, self.rank)
        return stop - start

    @property
    def local_parameter_shard(self) -> torch.Tensor:
        start = self.shard_start_index
        return self.gather_full_parameters()[start : start + self.shard_size].clone()

    # -- primitives each strategy provides -----------------------------------------------
    def _full_state(self) -> dict[str, torch.Tensor]:
        """Full copies of the trainable parameters, by name (gathered if sharded), each in
        its master dtype: float64 for float64 parameters, float32 for the rest."""
        raise NotImplementedError

    def _load_full_state(self, tensors: dict[str, torch.Tensor]) -> None:
        """Sets every trainable parameter (on the servers too, if they hold it)."""
        raise NotImplementedError

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        raise NotImplementedError

    def _optimizer_step(self) -> None:
        raise NotImplementedError

    def synchronize_gradients(self) -> None:
        """Reduces this step's gradients over the data-parallel ranks now."""
        raise NotImplementedError

    def _unscale_grads(self, inv_scale: float) -> None:
        """A loss scaler's ``unscale_`` (strategies/grad_scaler.py): this step's gradients,
        once reduced, are to be multiplied by ``inv_scale`` before clipping and the step."""
        raise NotImplementedError(f"{type(self).__name__} does not support loss scaling")

    def _local_gradients(self, run_backward: Callable[[], None]) -> dict[str, torch.Tensor]:
        """Runs ``run_backward`` without reducing anything; this rank's gradients by name."""
        raise NotImplementedError

    # -- gradient-hook helpers the strategies share --------------------------------------------
    def _keep_local(self, p: nn.Parameter) -> bool:
        """In ``compute_gradients`` a gradient hook keeps the gradient here instead of
        reducing it; returns True when it did."""
        if self._collect is None:
            return False
        self._collect[id(p)] = p.grad.detach().clone()
        p.grad = None
        return True

    def _start_backward(self) -> None:
        """First gradient hook of a backward pass: run ``_end_backward`` when it finishes."""
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        self._in_backward = False

    def _gradients_from_hooks(self, run_backward: Callable[[], None]) -> dict[str, torch.Tensor]:
        """``_local_gradients`` for strategies whose gradient hooks call ``_keep_local``."""
        self._collect = {}
        try:
            run_backward()
            return {n: self._collect[id(p)] for n, p in self._named if id(p) in self._collect}
        finally:
            self._collect = None

    def _gradients_by_swapping(self, run_backward: Callable[[], None]) -> dict[str, torch.Tensor]:
        """``_local_gradients`` for strategies without gradient hooks: set the accumulated
        gradients aside, run backward, put them back."""
        saved = {n: p.grad for n, p in self._named}
        for _, p in self._named:
            p.grad = None
        try:
            run_backward()
            return {n: p.grad.clone() for n, p in self._named if p.grad is not None}
        finally:
            for n, p in self._named:
                p.grad = saved[n]

    def _attach(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    def _invalidate(self) -> None:
        self._cache = None

    def _holds_working_copy(self) -> bool:
        """Whether this rank's parameters are a ``param_dtype`` working copy narrower than
        their masters (strategies/mixed_precision.py): full values are then the servers'."""
        return any(p.dtype != self._masters[n] for n, p in self._named)

    # -- flat parameter vectors ----------------------------------------------------------
    def gather_full_parameters(self) -> torch.Tensor:
        """All trainable parameters as one flat vector (named_parameters order), float64 if
        any parameter is float64, else float32; cached until the parameters change."""
        if self._cache is None:
            state = self._full_state()
            self._cache = torch.cat([to_master(state[n]).reshape(-1) for n, _ in self._named])
        return self._cache

    def get_parameters(self) -> torch.Tensor:
        return self.gather_full_parameters().clone()

    def set_parameters(self, parameters: torch.Tensor) -> None:
        vec = torch.as_tensor(parameters).reshape(-1)
        if vec.numel() != self.parameter_count:
            raise ValueError(
                f"set_parameters: the model has {self.parameter_count:,} parameters,"
                f" the vector has {vec.numel():,}"
            )
        tensors, offset = {}, 0
        for name, shape in self._named_shapes():
            n = shape.numel()
            tensors[name] = vec[offset : offset + n].reshape(shape).to(self._masters[name]).clone()
            offset += n
        self._load_full_state(tensors)
        self._invalidate()

    def with_parameters(self, parameters: torch.Tensor) -> nn.Module:
        """A plain (unwrapped) copy of the model holding ``parameters``; self is unchanged."""
        clone = self.deep_copy()
        vec = torch.as_tensor(parameters).reshape(-1)
        if vec.numel() != self.parameter_count:
            raise ValueError(
                f"with_parameters: the model has {self.parameter_count:,} parameters,"
                f" the vector has {vec.numel():,}"
            )
        # each parameter keeps its own dtype
        copy_flat_into(vec, [p for p in clone.parameters() if p.requires_grad])
        return clone

    def deep_copy(self) -> nn.Module:
        """A plain copy of the wrapped model with the current full parameters. A wrapped copy
        would need its own job on the servers; wrap the copy yourself if you want one."""
        state = self.state_dict()
        # The strategy's hooks on the modules point back at this wrapper (and its channels):
        # copy the modules without them.
        memo: dict[int, Any] = {id(self): None}
        for m in self.module.modules():
            for attr in ("_forward_pre_hooks", "_forward_hooks"):
                hooks = getattr(m, attr)
                memo[id(hooks)] = type(hooks)()
        clone = copy.deepcopy(self.module, memo)
        for n, p in clone.named_parameters():  # FSDP leaves freed (empty) storage behind
            if n in self._shapes:
                p.data = torch.empty(self._shapes[n], dtype=p.dtype, device=p.device)
        clone.load_state_dict(state)
        return clone

    # -- gradients ---------------------------------------------------------------------------
    def compute_gradients(self, x: Any, y: Any, loss_fn: Callable | None = None) -> torch.Tensor:
        """This rank's gradients for (x, y) as one flat vector; parameters, gradients already
        accumulated and the servers are left unchanged."""
        loss_fn = loss_fn or self.default_loss_function

        def run() -> None:
            loss_fn(self(x), y).backward()

        grads = self._local_gradients(run)
        params = dict(self._named)
        return torch.cat(
            [
                to_master(grads[n]).reshape(-1)
                if n in grads
                else torch.zeros(s.numel(), dtype=self._masters[n], device=params[n].device)
                for n, s in self._named_shapes()
            ]
        )

    def apply_gradients(self, gradients: torch.Tensor, learning_rate: float) -> None:
        """Plain SGD on the full vector: theta <- theta - lr * g (AiDotNet's ApplyGradients)."""
        full = self.gather_full_parameters()
        grads = torch.as_tensor(gradients).reshape(-1).to(full.dtype)
        self.set_parameters(full - learning_rate * grads)

    # -- training and prediction -----------------------------------------------------------
    def predict(self, x: Any) -> Any:
        with torch.no_grad():
            return self(x)

    def train_on_batch(self, x: Any, y: Any) -> float:
        """AiDotNet's Train: forward, backward with the default loss, step the attached
        optimizer wrapper; returns the loss."""
        if self.optimizer is None:
            raise RuntimeError(
                f"{type(self).__name__}.train_on_batch needs an optimizer wrapper: build one"
                " from model.parameters() first"
            )
        loss = self.default_loss_function(outputs_for_loss(self.config, self(x)), y)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return float(loss.detach())

    # -- state dicts -------------------------------------------------------------------------
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """Full tensors under the wrapped model's own names (no wrapper prefix)."""
        full = self._full_state()
        out = {}
        by_id = {id(p): n for n, p in self._named}
        for name, t in self.module.state_dict(keep_vars=True).items():
            canonical = by_id.get(id(t))
            out[name] = full[canonical].clone() if canonical else t.detach().clone()
        return out

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False):  # type: ignore[override]
        own = self.module.state_dict(keep_vars=True)
        keys = incompatible_keys(own, state_dict, strict)
        by_id = {id(p): n for n, p in self._named}
        tensors: dict[str, torch.Tensor] = {}
        for name, t in own.items():
            if name not in state_dict:
                continue
            value = torch.as_tensor(state_dict[name])
            canonical = by_id.get(id(t))
            if canonical is None:
                with torch.no_grad():
                    t.copy_(value)
            elif canonical not in tensors:
                tensors[canonical] = value.to(self._masters[canonical]).clone()
        if tensors:
            current = self._full_state() if len(tensors) < len(self._named) else {}
            self._load_full_state({**current, **tensors})
        self._invalidate()
        return keys

    def get_model_metadata(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "model": type(self.module).__name__,
            "parameter_count": self.parameter_count,
            "world_size": self.world_size,
            "rank": self.rank,
            "job": self.config.job,
            "parameters": {n: list(s) for n, s in self._named_shapes()},
        }

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = cast_forward_inputs(self.config, args, kwargs)
        return self.module(*args, **kwargs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}/{self.world_size}, {self.module!r})"
