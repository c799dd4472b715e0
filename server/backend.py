"""The array backend: NumPy on CPU, CuPy on a GPU. Chosen once per process.

No other module touches device specifics: everything else writes ``backend.xp`` code that
runs the same on both libraries, and crosses the host/device boundary only through
``to_device`` / ``to_host`` here. bfloat16 has no NumPy dtype, so it travels as its raw
uint16 bits and is converted here, with the same round-to-nearest-even torch uses.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from protos import codec

__all__ = [
    "xp",
    "device",
    "use_device",
    "to_device",
    "to_host",
    "bf16_bits_to_f32",
    "f32_to_bf16_bits",
    "device_memory",
    "BackendError",
]


class BackendError(RuntimeError):
    """The requested device cannot be used here."""


xp: Any = np
device: str = "cpu"


def use_device(name: str) -> None:
    """Select the array library for this process: ``cpu`` (NumPy) or ``cuda[:k]`` (CuPy)."""
    global xp, device
    if name == "cpu":
        xp, device = np, "cpu"
        return
    if not name.startswith("cuda"):
        raise BackendError(f"unknown device {name!r}: use 'cpu' or 'cuda:N'")
    try:
        import cupy  # noqa: PLC0415 - optional dependency, only on GPU hosts
    except ImportError as exc:
        raise BackendError(
            f"device {name!r} needs CuPy: pip install 'paramshard[gpu]' ({exc})"
        ) from exc
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDA driver missing or broken
        raise BackendError(f"device {name!r}: CUDA is not available here ({exc})") from exc
    index = int(name.split(":", 1)[1]) if ":" in name else 0
    if not 0 <= index < count:
        raise BackendError(f"device {name!r}: this host has {count} CUDA device(s)")
    cupy.cuda.Device(index).use()
    xp, device = cupy, f"cuda:{index}"


def to_device(host: np.ndarray) -> Any:
    """Copy a host array to the backend's device (a no-op view on CPU)."""
    return host if xp is np else xp.asarray(host)


def to_host(arr: Any) -> np.ndarray:
    """Copy a backend array to host memory (a no-op on CPU)."""
    return arr if isinstance(arr, np.ndarray) else arr.get()


def bf16_bits_to_f32(bits: Any) -> Any:
    """uint16 bfloat16 bit patterns -> float32 values, on the array's own device."""
    return codec.bf16_bits_to_f32(bits, _module_of(bits))


def f32_to_bf16_bits(values: Any) -> Any:
    """float32 values -> uint16 bfloat16 bits (round to nearest even), on the array's device."""
    return codec.f32_to_bf16_bits(values, _module_of(values))


def _module_of(arr: Any) -> Any:
    return np if isinstance(arr, np.ndarray) else xp


def device_memory() -> dict[str, int]:
    """Bytes used and total on the device (host RSS and RAM on CPU)."""
    if xp is np:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        try:
            with open("/proc/self/statm") as f:
                rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            rss = 0
        return {"used": rss, "total": total}
    free, total = xp.cuda.runtime.memGetInfo()
    return {"used": int(total - free), "total": int(total)}
