"""DDP: full replica per rank; gradients averaged through the servers in buckets, overlapped
with backward (as torch DistributedDataParallel); the trainer's own torch optimizer steps.

Buckets are filled in reverse parameter order (gradients arrive roughly in that order) up to
``bucket_size_bytes``, one dtype class per bucket (float64 parameters' gradients travel as
float64: ``config.reduce_dtype_for``). When a bucket's last gradient is accumulated, its
all-reduce starts on a single background thread (one thread, so every rank issues the
collectives in the same order) while backward goes on; the end of backward waits for them and
writes the averages back. Collectives reduce in rank order (``config.deterministic``).
A step whose averaged gradient holds NaN or Inf is skipped: every rank holds the same averages,
so each rank's own check is the global decision (strategies/nonfinite.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch import nn

from strategies.base import ShardedModelBase
from strategies.config import ShardingConfiguration, master_dtype
from strategies.layout import copy_flat_into, to_master, torch_dtype
from strategies.nonfinite import nonfinite_grads, settle

__all__ = ["DDPModel"]


@dataclass
class _Bucket:
    master: str  # the dtype class of its parameters: "float64" or "float32"
    params: list[nn.Parameter]
    ready: set[int] = field(default_factory=set)
    future: Future | None = None


class DDPModel(ShardedModelBase):
    """Distributed data parallel: replicas kept equal by averaging gradients every step."""

    strategy = "ddp"

    def __init__(self, model: nn.Module, config: ShardingConfiguration) -> None:
        super().__init__(model, config)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="allreduce")
        self._sync = True
        params = [p for _, p in self._named]
        # every replica starts from rank 0's values (torch DDP broadcasts them too)
        flat = torch.cat([p.detach().reshape(-1) for p in params])  # the widest dtype
        copy_flat_into(self.client.broadcast(flat, src=0), params)  # each keeps its dtype
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

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no communication) until the context ends; the next
        backward outside it averages the accumulated sums, as torch DDP's no_sync."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    # -- gradient hooks ----------------------------------------------------------------------
    def _on_grad(self, p: nn.Parameter) -> None:
        if self._keep_local(p) or not (self._sync and self.config.auto_sync_gradients):
            return
        self._start_backward()
        bucket = self._bucket_of[id(p)]
        bucket.ready.add(id(p))
        if len(bucket.ready) == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        dtype = torch_dtype(self.config.reduce_dtype_for(bucket.master))
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
        flat = torch.cat([g.detach().reshape(-1).to(dtype) for g in grads])
        bucket.future = self._pool.submit(self.client.all_reduce, flat, "mean")

    def _finish(self, bucket: _Bucket) -> None:
        fut, bucket.future = bucket.future, None
        bucket.ready.clear()
        if fut is None:
            return
        averaged = fut.result().to(torch_dtype(bucket.master))
        offset = 0
        for p in bucket.params:
            n = p.numel()
            value = averaged[offset : offset + n].view_as(p)
            if p.grad is None:
                p.grad = value.clone()
            else:
                p.grad.copy_(value)
            offset += n

    def _end_backward(self) -> None:
        for bucket in self._buckets:  # unused parameters: their buckets go now, in order
            if bucket.future is None:
                self._launch(bucket)
        for bucket in self._buckets:
            self._finish(bucket)
        super()._end_backward()

    def synchronize_gradients(self) -> None:
        """Averages the current gradients over all ranks now (e.g. after backward under
        ``no_sync`` or with ``auto_sync_gradients=False``)."""
        for bucket in self._buckets:
            self._launch(bucket)
        for bucket in self._buckets:
            self._finish(bucket)

    # -- the strategy primitives -----------------------------------------------------------
    def _full_state(self) -> dict[str, torch.Tensor]:
        return {n: to_master(p).clone() for n, p in self._named}

    def _load_full_state(self, tensors: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for n, p in self._named:
                p.copy_(tensors[n])

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Gradients are already averaged, so torch's own clipping gives the global norm."""
        params = [p for _, p in self._named if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)

    def _optimizer_step(self) -> None:
        where = nonfinite_grads(self._named)  # the same averages, so the same verdict, on all
        if not where:
            self.optimizer.inner.step()
        self._invalidate()
        if where:
            settle(self, self.config.job, None, where)

    def _local_gradients(self, run_backward: Callable[[], None]) -> dict[str, torch.Tensor]:
        return self._gradients_from_hooks(run_backward)
