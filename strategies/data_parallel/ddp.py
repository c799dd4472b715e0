"""DDP: full replica per rank; gradients averaged through the servers in buckets, overlapped
with backward (as torch DistributedDataParallel); the trainer's own torch optimizer steps.

Buckets are filled in reverse parameter order (gradients arrive roughly in that order) up to
``bucket_size_bytes``, one dtype class per bucket (float64 parameters' gradients travel as
float64: ``config.reduce_dtype_for``). When a bucket's last gradient is accumulated, its
all-reduce starts on a single background thread (one thread, so every rank issues the
collectives in the same order) while backward goes on; the end of backward waits for them.

Each bucket's gradients are copied into a flat buffer of its own, made at its first use and
kept (as torch DDP's reducer keeps its buckets): a new one each step cost GPT-2 124M's
backward 0.3 s of page faults a step on one core. The all-reduce averages it in place, and
the end of backward copies the averages back into the gradients. With
``gradient_as_bucket_view`` (torch DDP's option, off by default there and here) each gradient
becomes a view of its bucket instead, from the moment it is copied in: no copy back (0.09 s of
the training thread's CPU a step for GPT-2 124M here), and no gradient held twice. A gradient
still a view at the next backward (``zero_grad(set_to_none=False)``, ``no_sync``) accumulates
in place and is not copied again. While its bucket's all-reduce runs, a view holds part
local, part averaged values, and a failed all-reduce leaves it so (recovery drops the step's
gradients: strategies/recovery.py). A parameter computing in another dtype than its
bucket's (``param_dtype``) takes its view at the end of backward.

Collectives reduce in rank order (``config.deterministic``).
With ``param_dtype`` each forward computes on a working copy of the parameters in that dtype
and backward's gradients come back to the float32 parameters, which the torch optimizer steps
(strategies/mixed_precision.py; torch DDP's ``_MixedPrecision`` does the same).
A step whose averaged gradient holds NaN or Inf is skipped: every rank holds the same averages,
so each rank's own check is the global decision (strategies/nonfinite.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from paramshard.strategies.base import ShardedModelBase
from paramshard.strategies.config import ShardingConfiguration, master_dtype
from paramshard.strategies.device import claim_backward_device
from paramshard.strategies.layout import copy_flat_into, to_master, torch_dtype
from paramshard.strategies.mixed_precision import compute_dtype
from paramshard.strategies.nonfinite import nonfinite_grads, settle

__all__ = ["DDPModel"]


@dataclass
class _Bucket:
    master: str  # the dtype class of its parameters: "float64" or "float32"
    params: list[nn.Parameter]
    ready: set[int] = field(default_factory=set)
    future: Future | None = None
    flat: torch.Tensor | None = None  # its gradients' flat copy, made once; averaged in place


class DDPModel(ShardedModelBase):
    """Distributed data parallel: replicas kept equal by averaging gradients every step."""

    strategy = "ddp"

    def __init__(self, model: nn.Module, config: ShardingConfiguration) -> None:
        super().__init__(model, config)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="allreduce")
        self._sync = True
        self._full_precision: dict[int, torch.Tensor] = {}  # id(p) -> its data, while swapped
        params = [p for _, p in self._named]
        self._buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}
        limit, size = config.bucket_size_bytes, 0
        for p in reversed(params):
            master = master_dtype(p.dtype)
            nbytes = p.numel() * torch_dtype(master).itemsize
            if not self._buckets or size + nbytes > limit or self._buckets[-1].master != master:
                self._buckets.append(_Bucket(master, []))
                size = 0
            self._buckets[-1].params.append(p)
            self._bucket_of[id(p)] = self._buckets[-1]
            size += nbytes
            p.register_post_accumulate_grad_hook(self._on_grad)
        # Every replica starts from rank 0's values (torch DDP broadcasts them too), a bucket
        # at a time: one flat copy of the whole model (and its broadcast result) held 8 bytes
        # a parameter at once, and its 16 MiB chunks, 8 in flight, grew the client's pool of
        # shared segments to 8 a server for good (GPT-2 124M: 256 MB resident all run long).
        for bucket in self._buckets:
            flat = torch.cat([p.detach().reshape(-1) for p in bucket.params])  # the widest dtype
            copy_flat_into(self.client.broadcast(flat, src=0), bucket.params)  # each its own

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no communication) until the context ends; the next
        backward outside it averages the accumulated sums, as torch DDP's no_sync."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    # -- mixed precision: a working copy for forward and backward ----------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled() and self._syncing() and self._named:
            what = "DDP's end-of-backward all-reduce"
            claim_backward_device(self._named[0][1].device, self.client, what)
        self._use_working_copy()
        out = super().forward(*args, **kwargs)
        if not torch.is_grad_enabled():  # no backward will come to swap the parameters back
            self._use_full_precision()
        return out

    def _use_working_copy(self) -> None:
        """Each parameter's data becomes a copy in its compute dtype (cast once per forward);
        its own data is kept aside until backward ends."""
        if self.config.param_dtype is None:  # each parameter computes in its own dtype
            return
        for _, p in self._named:
            want = compute_dtype(self.config, p.dtype)
            if id(p) not in self._full_precision and want != p.dtype:
                self._full_precision[id(p)] = p.data
                p.data = p.data.to(want)

    def _use_full_precision(self) -> None:
        """Parameters back to their own data; gradients cast to it (backward made them in the
        compute dtype)."""
        if not self._full_precision:  # no working copy: nothing to swap back or cast
            return
        for _, p in self._named:
            own = self._full_precision.pop(id(p), None)
            if own is not None:
                p.data = own
            if p.grad is not None and p.grad.dtype != p.dtype:
                p.grad = p.grad.to(p.dtype)

    # -- gradient hooks ----------------------------------------------------------------------
    def _on_grad(self, p: nn.Parameter) -> None:
        self._start_backward()  # its end swaps the parameters back (and reduces, if syncing)
        if self._keep_local(p) or not self._syncing():
            return
        bucket = self._bucket_of[id(p)]
        bucket.ready.add(id(p))
        if len(bucket.ready) == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        if bucket.future is not None:  # launched again before its end: its buffer is in use
            wait([bucket.future])  # (its outcome is dropped, as a relaunch always did)
        dtype = torch_dtype(self.config.reduce_dtype_for(bucket.master))
        device = bucket.params[0].device
        flat = bucket.flat
        if flat is None or flat.dtype != dtype or flat.device != device:
            numel = sum(p.numel() for p in bucket.params)
            flat = bucket.flat = torch.empty(numel, dtype=dtype, device=device)
        offset, views = 0, self.config.gradient_as_bucket_view
        for p in bucket.params:  # each gradient into its place, cast to dtype
            n, g = p.numel(), p.grad
            place = flat[offset : offset + n]
            if g is None:  # unused this step
                place.zero_()
            elif g.dtype != dtype or g.data_ptr() != place.data_ptr():  # not already a view
                place.copy_(g.detach().reshape(-1))
                if views and p.dtype == dtype:  # its own tensor goes: the bucket holds it
                    p.grad = place.view_as(p)
            offset += n
        bucket.future = self._pool.submit(self._all_reduce, flat)

    def _all_reduce(self, flat: torch.Tensor) -> torch.Tensor:
        # in place: a bucket's average replaces its flat copy instead of a second buffer (at
        # the end of backward every bucket's flat and average were held at once: 8 bytes a
        # parameter on top of the 16 of parameters, gradients and Adam's moments)
        with self.comm_times.busy("all_reduce"):
            return self.client.all_reduce(flat, "mean", in_place=True)

    def _finish(self, bucket: _Bucket) -> None:
        fut, bucket.future = bucket.future, None
        bucket.ready.clear()
        if fut is None:
            return
        with self.comm_times.blocked("all_reduce"):
            averaged = fut.result()
        views = self.config.gradient_as_bucket_view
        if views and averaged.data_ptr() != bucket.flat.data_ptr():  # a device tensor's: a copy
            averaged = bucket.flat.copy_(averaged)
        offset = 0
        for p in bucket.params:
            n = p.numel()
            value = averaged[offset : offset + n].view_as(p)
            if views and p.dtype == averaged.dtype:
                p.grad = value
            elif p.grad is None:
                p.grad = value.to(p.dtype, copy=True)
            else:
                p.grad.copy_(value)
            offset += n

    def _syncing(self) -> bool:
        return self._sync and self.config.auto_sync_gradients

    def _end_backward(self) -> None:
        self._use_full_precision()
        if self._syncing() and self._collect is None:
            for bucket in self._buckets:  # unused parameters: their buckets go now, in order
                if bucket.future is None:
                    self._launch(bucket)
            for bucket in self._buckets:
                self._finish(bucket)
        super()._end_backward()

    def synchronize_gradients(self) -> None:
        """Averages the current gradients over all ranks now (e.g. after backward under
        ``no_sync`` or with ``auto_sync_gradients=False``)."""
        self._use_full_precision()
        for bucket in self._buckets:
            self._launch(bucket)
        for bucket in self._buckets:
            self._finish(bucket)

    # -- the strategy primitives -----------------------------------------------------------
    def _full_state(self) -> dict[str, torch.Tensor]:
        own = self._full_precision
        return {n: to_master(own.get(id(p), p)).clone() for n, p in self._named}

    def _load_full_state(self, tensors: dict[str, torch.Tensor]) -> None:
        self._use_full_precision()
        with torch.no_grad():
            for n, p in self._named:
                p.copy_(tensors[n])

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Gradients are already averaged, so torch's own clipping gives the global norm."""
        self._use_full_precision()
        params = [p for _, p in self._named if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)

    def _unscale_grads(self, inv_scale: float) -> None:
        """The averaged gradients (the same on every rank) divided by the loss scale."""
        self._use_full_precision()
        for _, p in self._named:
            if p.grad is not None:
                p.grad.mul_(inv_scale)

    def _optimizer_step(self) -> None:
        self._use_full_precision()
        where = nonfinite_grads(self._named)  # the same averages, so the same verdict, on all
        if not where:
            self.optimizer.inner.step()
        self._invalidate()
        if where:
            settle(self, self.config.job, None, where)

    def _local_gradients(self, run_backward: Callable[[], None]) -> dict[str, torch.Tensor]:
        return self._gradients_from_hooks(run_backward)
