"""ZeRO stages 1 and 2 (arXiv 1910.02054): replicated parameters, optimizer state on the servers.

- ZeRO-1: the trainer keeps full gradients until backward ends; ``optimizer.step()`` pushes them
  (server i receives slice i: a reduce-scatter), the servers step, the trainer pulls the new
  parameters (an all-gather).
- ZeRO-2 (§5.2): gradients are pushed bucket by bucket *during* backward, as soon as a bucket's
  gradients are complete, and freed, so no rank ever holds the full gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from paramshard.strategies.base import eager_hook
from paramshard.strategies.config import ShardingConfiguration
from paramshard.strategies.data_parallel.sharded import ServerShardedModel
from paramshard.strategies.device import Outgoing, device_of
from paramshard.strategies.layout import BufferSpec, flat_views, flatten, to_master, torch_dtype
from paramshard.strategies.mixed_precision import compute_views, gather_dtype

__all__ = ["ZeRO1Model", "ZeRO2Model"]


class _ReplicatedParams(ServerShardedModel):
    """ZeRO-1 and ZeRO-2 keep a full replica of the parameters on every rank: with
    ``param_dtype`` a working copy in that dtype (the float32 master is on the servers).

    On the CPU, after the first pull each buffer's parameters are views of the one flat tensor
    it landed in (``_replica``), and every later pull lands in that tensor: no second copy of
    the model, no copy per step (a pull into new memory held 4 bytes a parameter more while it
    was copied into the parameters, and copied them all)."""

    def _in_place(self, b: BufferSpec) -> bool:
        """Whether buffer ``b``'s parameters can be views of one flat CPU tensor of its gather
        dtype (they compute in it: no mixed dtypes, no working copy of another dtype)."""
        dtype = torch_dtype(gather_dtype(self.config, b))
        return device_of(b.params).type == "cpu" and all(p.dtype == dtype for p in b.params)

    def _initial_flat(self, b: BufferSpec) -> torch.Tensor:
        """Rank 0's values for a new job. Its replica is made first: the parameters are copied
        into one flat tensor and become views of it (their old storage is freed), and that
        tensor is what goes to the servers (no second flat copy next to the model)."""
        if b.master_dtype != gather_dtype(self.config, b) or not self._in_place(b):
            return super()._initial_flat(b)
        flat = flatten(b.params, b.numel, torch_dtype(b.master_dtype))
        with torch.no_grad():
            for view, p in zip(flat_views(flat, b.entries), b.params, strict=True):
                p.data = view
        self.__dict__.setdefault("_replica", {})[b.name] = flat
        return flat

    def _refresh_replica(self) -> None:
        replica: dict[str, torch.Tensor] = self.__dict__.setdefault("_replica", {})
        for b in self._flat_buffers:
            if b.name not in replica and self._in_place(b):
                for p in b.params:  # their values come from the servers: free them first
                    p.data = torch.empty(0, dtype=p.dtype)
        with self.comm_times.blocked("pull"):
            flats = self._pull(self._flat_buffers, self._step, compute=True, into=replica)
        with torch.no_grad():
            for b in self._flat_buffers:
                flat = flats[b.name]
                if replica.get(b.name) is flat:
                    continue  # pulled in place: the parameters are views of it
                values = compute_views(self.config, flat, b)
                views = all(v.dtype == flat.dtype for v in values)
                for value, p in zip(values, b.params, strict=True):
                    if views and flat.device.type == "cpu":
                        p.data = value  # from now on the parameter lives in ``flat``
                    elif p.dtype == value.dtype:
                        p.copy_(value)
                    else:  # the first pull makes the working copy
                        p.data = value.clone()
                if views and flat.device.type == "cpu":
                    replica[b.name] = flat

    _after_register = _refresh_replica
    _after_step = _refresh_replica
    _after_load = _refresh_replica

    def _full_state(self) -> dict[str, torch.Tensor]:
        if self.registered and self._holds_working_copy():
            return super()._full_state()  # a narrower working copy: the servers' masters
        return {n: to_master(p).clone() for n, p in self._named}


class ZeRO1Model(_ReplicatedParams):
    """ZeRO stage 1: optimizer state and master copy sharded over the servers."""

    strategy = "zero1"

    def __init__(self, model: nn.Module, config: ShardingConfiguration) -> None:
        super().__init__(model, config)
        self._pushed = False

    def _ensure_reduced(self) -> None:
        if self._pushed:
            return
        calls = []
        for b in self._flat_buffers:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in b.params]
            flat = flatten(grads, b.numel, torch_dtype(b.master_dtype))
            calls += self.client.push_calls(
                self.config.job,
                b.name,
                Outgoing(flat, flat.dtype),
                self._step,
                dtype=self.config.reduce_dtype_for(b.master_dtype),
                membership=self._push_membership(),
            )
        with self.comm_times.blocked("push"):
            self.client.run(calls)
        self._pushed = True

    def _after_step(self) -> None:
        self._pushed = False
        self._refresh_replica()

    def _abandon_local(self) -> None:
        self._pushed = False

    def _local_gradients(self, run_backward: Callable[[], None]) -> dict[str, torch.Tensor]:
        return self._gradients_by_swapping(run_backward)


@dataclass
class _Bucket:
    buffer: BufferSpec
    start: int  # offset in the buffer
    numel: int
    params: list[nn.Parameter]
    ready: set[int] = field(default_factory=set)
    pushed_micro: int = -1  # the micro-batch this bucket was last pushed for


class ZeRO2Model(_ReplicatedParams):
    """ZeRO stage 2: gradients reduce-scattered bucket by bucket during backward, then freed."""

    strategy = "zero2"

    def __init__(self, model: nn.Module, config: ShardingConfiguration) -> None:
        super().__init__(model, config)
        self._buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}

    def _num_micro(self) -> int:
        return self.config.gradient_accumulation_steps

    def _after_register(self) -> None:
        self._refresh_replica()
        self._flats.max_idle_bytes = 2 * self.config.bucket_size_bytes  # two buckets
        for b in self._flat_buffers:
            limit = max(1, self.config.bucket_size_bytes // torch_dtype(b.master_dtype).itemsize)
            bucket: _Bucket | None = None
            for e, p in zip(b.entries, b.params, strict=True):
                if bucket is None or bucket.numel + e.numel > limit:
                    bucket = _Bucket(b, e.offset, 0, [])
                    self._buckets.append(bucket)
                bucket.numel += e.numel
                bucket.params.append(p)
                self._bucket_of[id(p)] = bucket
                p.register_post_accumulate_grad_hook(eager_hook(self._on_grad))

    def _on_grad(self, p: nn.Parameter) -> None:
        if self._keep_local(p):
            return
        self._start_backward()
        bucket = self._bucket_of[id(p)]
        bucket.ready.add(id(p))
        if len(bucket.ready) == len(bucket.params):
            self._push_bucket(bucket)

    def _push_bucket(self, bucket: _Bucket) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
        master = torch_dtype(bucket.buffer.master_dtype)
        out = self._flats.take(bucket.numel, master, grads[0].device)
        flat = flatten(grads, bucket.numel, master, out=out)
        for p in bucket.params:
            p.grad = None  # ZeRO-2: the full gradient never stays on the trainer
        bucket.ready.clear()
        bucket.pushed_micro = self._micro
        self._push_async(bucket.buffer, flat, bucket.start)

    def _end_backward(self) -> None:
        """After each backward: buckets whose parameters got no gradient (unused) go now, so
        the servers see every contribution they wait for."""
        for bucket in self._buckets:
            if bucket.pushed_micro != self._micro:
                self._push_bucket(bucket)
        self._micro += 1
        super()._end_backward()

    def _abandon_local(self) -> None:
        for bucket in self._buckets:
            bucket.ready.clear()
            bucket.pushed_micro = -1
        self._in_backward = False

    def _ensure_reduced(self) -> None:
        self._wait_pushes()
        self._check_micro_count()

    def _local_gradients(self, run_backward: Callable[[], None]) -> dict[str, torch.Tensor]:
        return self._gradients_from_hooks(run_backward)
