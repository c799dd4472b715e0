"""Wire payload <-> backend arrays: every wire-dtype conversion of the fp32 master lives here.

Uses only ``backend`` for device specifics, so the same code runs on NumPy and CuPy.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from protos import codec
from protos import shard_pb2 as pb
from server import backend
from server.errors import ShardError

__all__ = [
    "payload_array",
    "to_compute",
    "from_compute",
    "wire_array",
    "accumulator_dtype",
    "FLOAT_WIRE",
]

FLOAT_WIRE = (pb.FLOAT32, pb.FLOAT16, pb.BFLOAT16, pb.FLOAT64)


def payload_array(data: memoryview, dtype: int, numel: int, what: str) -> np.ndarray:
    """A host view of a payload, checked against the header's dtype and element count."""
    try:
        np_dtype = codec.numpy_dtype(dtype)
    except ValueError as exc:
        raise ShardError.invalid(f"{what}: {exc}") from None
    expected = numel * np_dtype.itemsize
    if len(data) != expected:
        raise ShardError.invalid(
            f"{what}: header says {numel:,} {codec.dtype_name(dtype)} values "
            f"({expected:,} bytes), payload has {len(data):,} bytes"
        )
    return np.frombuffer(data, dtype=np_dtype)


def accumulator_dtype(dtype: int) -> Any:
    """The dtype reductions accumulate in: fp32 for 16-bit floats, int64 for integers."""
    xp = backend.xp
    if dtype == pb.FLOAT64:
        return xp.float64
    if dtype in (pb.INT64, pb.INT32):
        return xp.int64
    return xp.float32


def to_compute(host: np.ndarray, dtype: int, into: Any = None, own: bool = False) -> Any:
    """Payload values as a device array of the accumulator dtype (bf16 bits are decoded).

    The result may be ``host`` itself (on CPU, nothing to convert): ``own=True`` copies it
    then, for a caller that keeps or writes the values after the request's bytes are gone.
    """
    dev = backend.to_device(host)
    if dtype == pb.BFLOAT16:
        dev = backend.bf16_bits_to_f32(dev)
    acc = accumulator_dtype(dtype)
    if into is not None:
        into[...] = dev
        return into
    out = dev.astype(acc, copy=False)
    return out.copy() if own and out is host else out


def wire_array(values: Any, dtype: int) -> np.ndarray:
    """Device values as a host array of a wire dtype: a view of ``values`` when nothing needs
    converting (on CPU), so the caller must not let it change before it is serialised."""
    if dtype == pb.BFLOAT16:
        out = backend.f32_to_bf16_bits(values.astype(backend.xp.float32, copy=False))
    else:
        out = values.astype(codec.numpy_dtype(dtype), copy=False)
    return backend.to_host(out)


def from_compute(values: Any, dtype: int) -> bytes:
    """Device values converted to a wire dtype, as the bytes of a payload."""
    return wire_array(values, dtype).tobytes()
