"""What a buffer's spec (a ``RegisterBufferRequest``) must be before a slice is built from it:
one a rank registers (``BufferStore.register``), or one read back from a replica that a caller
sent (``LoadReplica``, server/replication/recovery.py), which carries its specs inside the file."""

from __future__ import annotations

from paramshard.protos import shard_pb2 as pb
from paramshard.protos.manifest import check_model_config
from paramshard.server.buffers.slice_state import MASTER_DTYPES
from paramshard.server.runtime.errors import ShardError
from paramshard.server.runtime.request_bounds import (
    MAX_ALIASES,
    MAX_KEY,
    MAX_PARAM_NAME,
    check_name,
    check_placement,
    check_shape,
)

__all__ = ["check_spec"]


def check_spec(req: pb.RegisterBufferRequest, method: str) -> str:
    """Refuses (INVALID_ARGUMENT) a spec whose names, placement, contributors, dtype, model
    config or parameter records are out of bounds; returns the buffer's label for messages."""
    check_name(req.ref.job, "job", method)
    check_name(req.ref.buffer, "buffer", method)
    check_name(req.run, "run", method, empty=True, most=MAX_KEY)
    label = f"buffer '{req.ref.job}/{req.ref.buffer}'"
    check_placement(req.server_index, req.num_servers, label)
    if req.contributors == 0:
        raise ShardError.invalid(f"{label}: contributors must be at least 1")
    if req.master_dtype not in MASTER_DTYPES:
        raise ShardError.invalid(
            f"{label}: master_dtype must be FLOAT32 or FLOAT64 (for float64 models),"
            f" got DType value {req.master_dtype}"
        )
    if req.model_config:
        try:
            check_model_config(req.model_config)
        except ValueError as exc:
            raise ShardError.invalid(f"{label}: {exc}") from None
    for p in req.params:
        _check_param_names(p, label)
        check_shape(p.shape, p.numel, f"{label}: parameter '{p.name}'")
        if p.offset + p.numel > req.numel:
            raise ShardError.invalid(
                f"{label}: parameter '{p.name}' (shape {list(p.shape)}, offset {p.offset:,})"
                f" does not fit a buffer of {req.numel:,} elements"
            )
        if p.split_parts > 1 and (p.split_index >= p.split_parts or p.split_dim >= len(p.shape)):
            raise ShardError.invalid(
                f"{label}: parameter '{p.name}' is part {p.split_index} of {p.split_parts}"
                f" along dim {p.split_dim} in {p.split_packed} packed blocks, which does not"
                f" fit its shape {list(p.shape)}"
            )
    return label


def _check_param_names(p: pb.ParamEntry, label: str) -> None:
    """A parameter's name and aliases, which every Status and export carries, within bounds."""
    names = [p.name, *p.aliases]
    if len(p.aliases) > MAX_ALIASES or any(len(n) > MAX_PARAM_NAME for n in names):
        raise ShardError.invalid(
            f"{label}: parameter {p.name[:128]!r} has {len(p.aliases):,} aliases and names of"
            f" up to {max(map(len, names)):,} characters; at most {MAX_ALIASES} aliases of"
            f" {MAX_PARAM_NAME:,} characters"
        )
