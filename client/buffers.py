"""The flat-buffer API: register, initialise, push gradients, pull parameters, step.

A flat buffer of n elements lives as N slices (protos/slicing.py); these calls take and return
the *whole* buffer (or, for ``push_grads``/``pull_params``, any range of it) and split the work
over the servers and into ``chunk_bytes`` messages, all in flight together.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from paramshard.client.grad_check import GradCheck
from paramshard.client.rpc import Call, RpcCore
from paramshard.protos import codec, slicing
from paramshard.protos import shard_pb2 as pb
from paramshard.protos.manifest import ParamEntry

__all__ = ["FlatBuffers", "ParamInfo", "StepArgs"]


ParamInfo = ParamEntry
"""One original parameter inside a flat buffer, as ``register_buffer`` takes it:
``ParamInfo(name, shape, offset, dtype="float32", aliases=(), split=None)`` (the one
parameter record, ``protos.manifest.ParamEntry``)."""


@dataclass(frozen=True)
class StepArgs:
    """Hyper-parameters of one optimizer step (torch param_group names) and the clip coefficient."""

    hyper: Mapping[str, float]
    clip_coef: float = 1.0

    def to_pb(self) -> pb.StepArgs:
        return pb.StepArgs(
            hyper={k: float(v) for k, v in self.hyper.items()}, clip_coef=float(self.clip_coef)
        )


def _to_wire(values: np.ndarray, dtype: str) -> np.ndarray:
    """Float values (float32 or float64) as the raw elements of a wire dtype. float64 goes
    to float64 as it is; bfloat16 rounds once, from float32 values (as torch does)."""
    if dtype == "bfloat16":
        return codec.f32_to_bf16_bits(values)
    return np.ascontiguousarray(values, dtype=codec.numpy_dtype(codec.wire_dtype(dtype)))


def _master_wire(values: np.ndarray, dtype: str | None) -> str:
    """The dtype ``set_params`` writes: ``dtype``, or float64 for a float64 array and float32
    for everything else (a float32 master's dtype)."""
    if dtype is not None:
        if dtype not in codec.MASTER_DTYPES:
            raise ValueError(f"set_params writes float32 or float64 values, got dtype={dtype!r}")
        return dtype
    return codec.master_dtype(values.dtype)


class FlatBuffers(RpcCore):
    rank: int
    world_size: int
    has_peers: bool
    run_id: str

    def _ref(self, job: str, buffer: str) -> pb.BufferRef:
        return pb.BufferRef(job=job, buffer=buffer)

    def register_buffer(
        self,
        job: str,
        buffer: str,
        numel: int,
        *,
        params: Sequence[ParamInfo] = (),
        optimizer: str = "sgd",
        hyper: Mapping[str, float] | None = None,
        contributors: int | None = None,
        master_dtype: str = "float32",
        arrival_order: bool = False,
        model_config: str = "",
    ) -> list[pb.RegisterBufferReply]:
        """Declares the buffer on every server (idempotent); returns each server's reply.
        ``master_dtype``: "float64" keeps the master copy, gradient sums and optimizer state
        in float64 (float64 parameters), "float32" for every other dtype. ``arrival_order``:
        sum gradient contributions as they arrive instead of in (contributor, micro) order
        (not bitwise reproducible, no staging memory on the servers). ``model_config``: the
        job's model description for export (RegisterBufferRequest.model_config)."""
        if master_dtype not in codec.MASTER_DTYPES:
            raise ValueError(f"master_dtype must be 'float32' or 'float64', got {master_dtype!r}")
        entries = [p.to_pb() for p in params]
        spec = pb.OptimizerSpec(
            name=optimizer, hyper={k: float(v) for k, v in (hyper or {}).items()}
        )
        return self.run(
            Call(
                i,
                "RegisterBuffer",
                pb.RegisterBufferRequest(
                    ref=self._ref(job, buffer),
                    numel=numel,
                    num_servers=self.num_servers,
                    server_index=i,
                    contributors=contributors or self.world_size,
                    params=entries,
                    optimizer=spec,
                    master_dtype=codec.wire_dtype(master_dtype),
                    arrival_order=arrival_order,
                    model_config=model_config,
                    # a refusal ends this run's waits on it (ranks disagree); a client without
                    # peers holds no lease, so it names no run (a scoped token checks it)
                    run=self.run_id if self.has_peers else "",
                ),
            )
            for i in range(self.num_servers)
        )

    def _chunked(self, numel: int, start: int, stop: int, itemsize: int):
        """(server, local offset, global offset, length) chunks of the range [start, stop)."""
        chunk = max(1, self.chunk_bytes // itemsize)
        for piece in slicing.pieces(numel, self.num_servers, start, stop):
            for o, n in slicing.chunk_ranges(piece.numel, chunk):
                if n:
                    yield piece.server, piece.local_offset + o, piece.global_offset + o, n

    def set_params(
        self,
        job: str,
        buffer: str,
        flat: np.ndarray,
        *,
        version: int = 0,
        state: str = "",
        optimizer_steps: int = 0,
        dtype: str | None = None,
    ) -> None:
        """Writes the whole buffer's values and sets every slice's version; with ``state``,
        writes that optimizer state array instead (at the servers' current ``version``) and
        sets the optimizer's step count. The values travel as ``dtype`` ("float32" or
        "float64", the buffer's master dtype); None: float64 for a float64 array, else
        float32."""
        wire = _master_wire(np.asarray(flat), dtype)
        values = _to_wire(np.asarray(flat).reshape(-1), wire)
        ref = self._ref(job, buffer)
        calls = []
        for server, local, glob, n in self._chunked(values.size, 0, values.size, values.itemsize):
            header = pb.SetParamsHeader(
                ref=ref,
                version=version,
                chunk=pb.Chunk(offset=local, numel=n, dtype=codec.wire_dtype(wire)),
                state=state,
                optimizer_steps=optimizer_steps,
            )
            calls.append(Call(server, "SetParams", (header, values[glob : glob + n])))
        self.run(calls)

    def push_calls(
        self,
        job: str,
        buffer: str,
        flat: Any,
        step: int,
        *,
        micro: int = 0,
        num_micro: int = 1,
        step_args: StepArgs | None = None,
        dtype: str = "float32",
        start: int = 0,
        numel: int | None = None,
        membership: pb.StepMembership | None = None,
    ) -> list[Call]:
        """The calls that push gradient ``flat`` (covering [start, start+len) of a buffer of
        ``numel`` elements) for ``step``; run them with ``run`` (or batch with other calls).
        ``membership``: an elastic step's members (client/membership.py), carried by every
        push so the servers weight it by its share.

        ``flat`` is a host array, or a device payload (strategies/device.py ``Outgoing``:
        ``dlpack_device``, ``size``, ``host()``, ``dlpack(start, n, wire dtype)``): its piece
        for a server of this process on that device goes device to device (DLPack), the
        others from ``host()``, staged once."""
        device = getattr(flat, "dlpack_device", None)
        grads = flat.reshape(-1) if device is None else None
        size = flat.size

        def host() -> np.ndarray:
            return grads if device is None else flat.host()

        total = start + size if numel is None else numel
        wire = codec.wire_dtype(dtype)
        itemsize = max(4, codec.numpy_dtype(wire).itemsize)  # chunks of float32 (or wider)
        ref = self._ref(job, buffer)
        args = step_args.to_pb() if step_args is not None else None
        calls = []
        for server, local, glob, n in self._chunked(total, start, start + size, itemsize):
            direct = device is not None and self.local_device(server, n * itemsize) == device

            def build(local: int = local, a: int = glob - start, n: int = n, d=direct) -> tuple:
                header = pb.PushGradHeader(
                    ref=ref,
                    step=step,
                    contributor=self.rank,
                    micro=micro,
                    num_micro=num_micro,
                    chunk=pb.Chunk(offset=local, numel=n, dtype=wire),
                    step_args=args,
                    membership=membership,
                )
                if d:
                    return header, flat.dlpack(a, n, dtype)
                return header, _to_wire(host()[a : a + n], dtype)

            calls.append(Call(server, "PushGrad", build))
        return calls

    def push_grads(self, job: str, buffer: str, flat: np.ndarray, step: int, **kw: Any) -> None:
        """Pushes this rank's gradient for the whole buffer (see ``push_calls`` for options)."""
        self.run(self.push_calls(job, buffer, flat, step, **kw))

    def pull_calls(
        self,
        job: str,
        buffer: str,
        out: Any,
        min_version: int,
        *,
        dtype: str = "float32",
        start: int = 0,
        numel: int | None = None,
        state: str = "",
        headers: list[Any] | None = None,
    ) -> list[Call]:
        """Calls filling ``out`` (wire dtype elements; uint16 for bfloat16) with the buffer's
        range [start, start + out.size) at a version >= ``min_version``; with ``state``, that
        optimizer state array instead. ``headers`` collects the reply headers (version,
        optimizer step count).

        ``out`` may be a device landing (strategies/device.py ``Landing``: ``dlpack_device``,
        ``array``, ``put(start, values)``): a server of this process on that device hands its
        values over as a device array (DLPack), the others land in ``array``."""
        landing, device = out, getattr(out, "dlpack_device", None)
        if device is not None:
            out = landing.array
        total = start + out.size if numel is None else numel
        wire = codec.wire_dtype(dtype)
        ref = self._ref(job, buffer)
        calls = []
        for server, local, glob, n in self._chunked(total, start, start + out.size, out.itemsize):

            def store(reply: Any, a: int = glob - start, n: int = n) -> None:
                if reply[0].version < min_version:  # the server waits until it is there
                    raise codec.BadReply(
                        f"values of version {reply[0].version} for a pull of version"
                        f" {min_version} or later"
                    )
                if isinstance(reply[1], (bytes, memoryview)):
                    out[a : a + n] = codec.values_of(reply[1], out.dtype, n)
                else:  # a device array from a server of this process (device_reply)
                    landing.put(a, reply[1])
                if headers is not None:
                    headers.append(reply[0])

            req = pb.PullParamsRequest(
                ref=ref,
                min_version=min_version,
                chunk=pb.Chunk(offset=local, numel=n, dtype=wire),
                state=state,
            )
            direct = device is not None and self.local_device(server) == device
            calls.append(Call(server, "PullParams", req, store, device_reply=direct))
        return calls

    def pull_params(
        self,
        job: str,
        buffer: str,
        numel: int,
        min_version: int = 0,
        *,
        dtype: str = "float32",
    ) -> np.ndarray:
        """The whole buffer at a version >= ``min_version`` (waits for it), as ``dtype``
        (bfloat16 comes back as uint16 bits)."""
        out = np.empty(numel, dtype=codec.numpy_dtype(codec.wire_dtype(dtype)))
        self.run(self.pull_calls(job, buffer, out, min_version, dtype=dtype))
        return out

    def grad_sum_squares(self, job: str, buffers: Sequence[str], step: int) -> list[float]:
        """Sum of squares of each buffer's reduced gradient of ``step``, over all servers."""
        replies = self.run(
            Call(i, "GradNorm", pb.GradNormRequest(job=job, buffers=buffers, step=step))
            for i in range(self.num_servers)
        )
        return [float(sum(r.sum_squares[k] for r in replies)) for k in range(len(buffers))]

    def grad_check(
        self,
        job: str,
        buffers: Sequence[str],
        step: int,
        params: Mapping[str, int] | None = None,
        *,
        generation: int | None = None,
    ) -> GradCheck:
        """Every server's sum of squares and finiteness of each buffer's reduced gradient of
        ``step`` (waits until reduced): the first phase of a step (client/grad_check.py).
        ``params`` (buffer -> how many parameters it registered): each parameter's sum of
        squares too (``GradCheck.param_sum_squares``). ``generation``: an elastic step's
        membership generation (a step the servers accumulate for another one is refused)."""
        names = list(buffers)
        req = pb.GradNormRequest(
            job=job, buffers=names, step=step, per_param=params is not None, generation=generation
        )
        replies = self.run(Call(i, "GradNorm", req) for i in range(self.num_servers))
        servers = getattr(self, "servers", range(self.num_servers))
        return GradCheck.from_replies(
            job, step, names, replies, servers, self.spec.addresses, params
        )

    def param_sum_squares(
        self, job: str, buffers: Mapping[str, int], step: int
    ) -> dict[str, list[float]]:
        """Per buffer (name -> how many parameters it registered), each parameter's sum of
        squares of the reduced gradient of ``step``, in registration order, over all servers."""
        return self.grad_check(job, list(buffers), step, buffers).param_sum_squares or {}

    def optimizer_state_info(self, job: str) -> dict[str, tuple[list[str], int]]:
        """Buffer -> (the optimizer state arrays that exist, the optimizer's step count), from
        server 0 (which holds a slice of every non-empty buffer)."""
        reply = self.call(0, "Status", pb.StatusRequest())
        for j in reply.jobs:
            if j.job == job:
                return {b.buffer: (list(b.state_keys), b.optimizer_steps) for b in j.buffers}
        raise KeyError(f"job '{job}' is not on server 0 ({self.spec.addresses[0]})")

    def step(
        self,
        job: str,
        step: int,
        args: Mapping[str, StepArgs],
        *,
        skip: bool = False,
        generation: int | None = None,
    ) -> None:
        """Applies step ``step`` to the named buffers on every server (first caller wins), or
        with ``skip`` discards it on all of them (parameters and optimizer state unchanged, the
        version moves on). ``skip`` is the caller's decision from ``grad_check``: a server
        whose slice is not finite refuses to apply it (FAILED_PRECONDITION), but the others
        would have; ``step_if_finite`` asks first, so the step is applied everywhere or nowhere."""
        req = pb.StepRequest(
            job=job,
            step=step,
            buffers=[pb.BufferStep(buffer=b, args=a.to_pb()) for b, a in args.items()],
            skip=skip,
            generation=generation,
        )
        self.run(Call(i, "Step", req) for i in range(self.num_servers))

    def step_if_finite(self, job: str, step: int, args: Mapping[str, StepArgs]) -> GradCheck:
        """Both phases of a step (server/buffers/nonfinite.py): every server's ``grad_check``, then
        the step applied on all of them, or skipped on all of them when any slice holds NaN or Inf
        (``check.finite`` False; ``check.nonfinite`` says where). Returns the check."""
        check = self.grad_check(job, list(args), step)
        self.step(job, step, args, skip=not check.finite)
        return check

    def drop_job(self, job: str) -> None:
        """Drops the job on every server that has it."""
        for i in range(self.num_servers):
            try:
                self.call(i, "DropJob", pb.DropJobRequest(job=job))
            except Exception as exc:  # noqa: BLE001 - a server without the job is fine
                if "NOT_FOUND" not in str(exc):
                    raise
