"""The array backend: NumPy on CPU, CuPy on a GPU. Chosen once per process.

No other module touches device specifics: everything else writes ``backend.xp`` code that
runs the same on both libraries, and crosses the host/device boundary only through
``to_device`` / ``to_host`` here. bfloat16 has no NumPy dtype, so it travels as its raw
uint16 bits and is converted here, with the same round-to-nearest-even torch uses.

Tests also select ``strict`` (tests/strict_backend.py): NumPy whose arrays refuse implicit
conversion to NumPy as CuPy's do, so a NumPy-only call in server code fails on CPU CI instead of
on the first GPU. ``PARAMSHARD_TEST_BACKEND=strict`` makes every ``use_device("cpu")`` of the
process select it, in servers that tests start as processes too (it needs a checkout: the
module lives in tests/, which no wheel or image ships). On a GPU host,
``PARAMSHARD_TEST_BACKEND=cuda:N`` does the same with CuPy on device N, so the CPU suites run
against real device arrays (``make test-gpu``).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from paramshard.protos import codec

__all__ = [
    "xp",
    "device",
    "use_device",
    "to_device",
    "to_host",
    "from_dlpack",
    "nonfinite_quietly",
    "bf16_bits_to_f32",
    "f32_to_bf16_bits",
    "sum_squares",
    "device_memory",
    "BackendError",
]


class BackendError(RuntimeError):
    """The requested device cannot be used here."""


TEST_BACKEND_ENV = "PARAMSHARD_TEST_BACKEND"

xp: Any = np
device: str = "cpu"
_upload: Any = None  # host -> device copy of a non-NumPy backend (cupy.asarray, ...)


def use_device(name: str) -> None:
    """Select the array library for this process: ``cpu`` (NumPy) or ``cuda[:k]`` (CuPy)."""
    global xp, device, _upload
    if name == "cpu" and os.environ.get(TEST_BACKEND_ENV):
        name = os.environ[TEST_BACKEND_ENV]
        if name != "strict" and not name.startswith("cuda"):
            raise BackendError(
                f"{TEST_BACKEND_ENV}={name!r}: test backends are 'strict' and 'cuda[:N]'"
            )
    if name == "cpu":
        xp, device, _upload = np, "cpu", None
        return
    if name == "strict":
        strict = _strict_backend()
        xp, device, _upload = strict, "cpu", strict.upload
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
    xp, device, _upload = cupy, f"cuda:{index}", cupy.asarray


def _strict_backend() -> Any:
    """tests/strict_backend.py, one module object however it is reached (pytest puts tests/ on
    ``sys.path``; a server process started by a test finds it beside this package)."""
    if "strict_backend" in sys.modules:
        return sys.modules["strict_backend"]
    path = Path(__file__).resolve().parents[2] / "tests" / "strict_backend.py"  # server/runtime/
    if not path.is_file():
        raise BackendError(f"device 'strict' is a test backend: {path} is not here")
    spec = importlib.util.spec_from_file_location("strict_backend", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["strict_backend"] = module
    spec.loader.exec_module(module)
    return module


def to_device(host: np.ndarray) -> Any:
    """Copy a host array to the backend's device (a no-op view on CPU, so the caller must not
    write into the result unless it copies, nor rely on writes reaching ``host``)."""
    return host if _upload is None or is_device_array(host) else _upload(host)


def to_host(arr: Any) -> np.ndarray:
    """Copy a backend array to host memory (a no-op on CPU)."""
    return arr if isinstance(arr, np.ndarray) else arr.get()


def nonfinite_quietly() -> Any:
    """A context in which arithmetic reaching Inf or NaN does not warn (NumPy's RuntimeWarning;
    CuPy never warns): a non-finite gradient is input the servers expect and refuse to step on
    (server/buffers/nonfinite.py), not a fault to print."""
    return np.errstate(over="ignore", invalid="ignore")


def from_dlpack(obj: Any) -> Any:
    """A DLPack producer's memory (``__dlpack__``: a torch tensor of this process on the
    backend's device) as a backend array, without a copy: the device-to-device path."""
    return xp.from_dlpack(obj)


def is_device_array(arr: Any) -> bool:
    """Whether ``arr`` is already a backend array (no ``to_device`` copy needed)."""
    return xp is not np and isinstance(arr, xp.ndarray)


def bf16_bits_to_f32(bits: Any) -> Any:
    """uint16 bfloat16 bit patterns -> float32 values, on the array's own device."""
    return codec.bf16_bits_to_f32(bits, _module_of(bits))


def f32_to_bf16_bits(values: Any) -> Any:
    """float32 values -> uint16 bfloat16 bits (round to nearest even), on the array's device."""
    return codec.f32_to_bf16_bits(values, _module_of(values))


SQUARES_CHUNK = 1 << 20
"""Elements squared at a time by ``sum_squares`` (4 MiB of float32 scratch)."""


def sum_squares(values: Any) -> float:
    """The sum of squares of a 1-D array, added up in float64 whatever its dtype. A float32
    dot accumulates in float32, its error growing with the length: 4.2e-4 relative for a
    62M-element slice (GPT-2 124M on two servers), where torch's float32 norm of the same
    gradient was off by 2.7e-6 (measured beside torch). Squared a chunk at a time and summed
    pairwise in float64 (8e-12 relative there, in the time one float32 dot took), on the
    array's device."""
    mod = _module_of(values)
    if values.dtype == mod.float64:
        return float(mod.dot(values, values))
    total = mod.zeros((), dtype=mod.float64)
    for lo in range(0, values.size, SQUARES_CHUNK):
        total += mod.square(values[lo : lo + SQUARES_CHUNK]).sum(dtype=mod.float64)
    return float(total)


def _module_of(arr: Any) -> Any:
    return np if isinstance(arr, np.ndarray) else xp


def device_memory() -> dict[str, int]:
    """Bytes used and total on the device (host RSS and RAM on CPU)."""
    if not device.startswith("cuda"):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        try:
            with open("/proc/self/statm") as f:
                rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            rss = 0
        return {"used": rss, "total": total}
    free, total = xp.cuda.runtime.memGetInfo()
    return {"used": int(total - free), "total": int(total)}


if os.environ.get(TEST_BACKEND_ENV):
    use_device("cpu")  # the test backend is the process default too, not only the servers'
