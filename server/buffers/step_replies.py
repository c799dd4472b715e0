"""The two phases of a step (buffers/nonfinite.py says why there are two): ``GradNorm``'s and
``Step``'s replies over the slices a request names."""

from __future__ import annotations

from paramshard.protos import shard_pb2 as pb
from paramshard.server.buffers.nonfinite import nonfinite_refusal
from paramshard.server.buffers.store import BufferSlice
from paramshard.server.runtime.errors import ShardError

__all__ = ["grad_norm_reply", "step_reply"]


def grad_norm_reply(
    slices: list[BufferSlice], req: pb.GradNormRequest, timeout: float
) -> pb.GradNormReply:
    """The first phase: each slice's sum of squares (per parameter too with ``per_param``)
    and whether it is finite."""
    gen = req.generation if req.HasField("generation") else None
    reply = pb.GradNormReply(sum_squares=[b.sum_squares(req.step, timeout, gen) for b in slices])
    if req.per_param:
        for b in slices:
            reply.param_sum_squares.extend(b.param_sum_squares(req.step, timeout, gen))
    reply.finite.extend(b.finite(req.step, timeout, gen) for b in slices)
    return reply


def step_reply(
    slices: list[tuple[BufferSlice, pb.StepArgs]], req: pb.StepRequest, timeout: float
) -> pb.StepReply:
    """The second phase: every buffer of the request applied, or skipped with ``req.skip``.
    Arguments and finiteness of every buffer are checked before any of them steps."""
    gen = req.generation if req.HasField("generation") else None
    for b, args in slices:
        b.check_step_args(args)
    if not req.skip:
        for b, _ in slices:
            if b.version == req.step and not b.finite(req.step, timeout, gen):
                raise ShardError.precondition(nonfinite_refusal(b.label, req.step))
    return pb.StepReply(
        versions=[b.step(req.step, args, timeout, req.skip, gen) for b, args in slices]
    )
