"""Wire payload <-> backend arrays: every wire-dtype conversion of the fp32 master lives here.

Uses only ``backend`` for device specifics, so the same code runs on NumPy and CuPy.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from paramshard.protos import codec
from paramshard.protos import shard_pb2 as pb
from paramshard.server.runtime import backend
from paramshard.server.runtime.errors import ShardError

__all__ = [
    "payload_array",
    "to_compute",
    "from_compute",
    "wire_array",
    "device_wire",
    "accumulator_dtype",
    "FLOAT_WIRE",
]

FLOAT_WIRE = (pb.FLOAT32, pb.FLOAT16, pb.BFLOAT16, pb.FLOAT64)


def payload_array(data: Any, dtype: int, numel: int, what: str) -> Any:
    """A host view of a payload (bytes), or the device array of a DLPack payload (a caller in
    this process, protos/local_servers.py), checked against the header's dtype and count."""
    try:
        np_dtype = codec.numpy_dtype(dtype)
    except ValueError as exc:
        raise ShardError.invalid(f"{what}: {exc}") from None
    if hasattr(data, "__dlpack__"):
        return _device_payload(data, np_dtype, numel, what)
    expected = numel * np_dtype.itemsize
    if len(data) != expected:
        raise ShardError.invalid(
            f"{what}: header says {numel:,} {codec.dtype_name(dtype)} values "
            f"({expected:,} bytes), payload has {len(data):,} bytes"
        )
    return np.frombuffer(data, dtype=np_dtype)


def _device_payload(data: Any, np_dtype: np.dtype, numel: int, what: str) -> Any:
    try:
        values = backend.from_dlpack(data)
    except (BufferError, TypeError, ValueError, RuntimeError) as exc:
        raise ShardError.invalid(
            f"{what}: the payload is not on this server's device: {exc}"
        ) from None
    bits = values.dtype.kind in "iu" and np_dtype.kind in "iu"
    if bits and values.dtype.itemsize == np_dtype.itemsize:  # bfloat16 bits come as int16
        values = values.view(np_dtype)
    if values.dtype != np_dtype or values.ndim != 1 or values.size != numel:
        raise ShardError.invalid(
            f"{what}: header says {numel:,} {np_dtype} values, the device payload holds"
            f" {values.size:,} {values.dtype} values of shape {list(values.shape)}"
        )
    return values


def device_wire(values: Any, dtype: int) -> Any:
    """Device values converted to a wire dtype as a new device array (bfloat16 as its uint16
    bits): what a PullParams reply carries to a caller in this process."""
    if dtype == pb.BFLOAT16:
        return backend.f32_to_bf16_bits(values.astype(backend.xp.float32, copy=False))
    return values.astype(codec.numpy_dtype(dtype), copy=True)


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
    # the caller's memory itself (a host view on CPU, or a DLPack payload already on the
    # device): astype(copy=False) of the same dtype shares it, whatever object it returns
    return out.copy() if own and dev is host and out.dtype == host.dtype else out


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
