"""NumPy arrays and torch tensors in, the same type out, without importing torch here.

The client package must not depend on torch (servers and tools use it without torch); a torch
tensor is recognised by its type's module and converted through the torch already imported.
bfloat16 (which NumPy lacks) travels as its raw uint16 bits, labelled "bfloat16".
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["Flat", "as_flat", "is_torch"]

_NUMPY_NAMES = {"float32", "float16", "float64", "int64", "int32"}


def is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


class Flat:
    """A tensor as a contiguous 1-D host array plus what is needed to give back the same type."""

    def __init__(self, array: np.ndarray, dtype: str, shape: tuple[int, ...], back: Callable):
        self.array = array  # 1-D, C-contiguous; bfloat16 as uint16 bits
        self.dtype = dtype
        self.shape = shape
        self._back = back

    def wrap(self, flat: np.ndarray, shape: tuple[int, ...] | None = None) -> Any:
        """``flat`` (same wire dtype) as the caller's type, reshaped to ``shape``."""
        return self._back(flat, self.shape if shape is None else shape)


def _numpy_back(dtype: str) -> Callable:
    def back(flat: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        return flat.reshape(shape)

    return back


def _torch_back(dtype: Any, device: Any) -> Callable:
    torch = sys.modules["torch"]

    def back(flat: np.ndarray, shape: tuple[int, ...]) -> Any:
        t = torch.from_numpy(np.ascontiguousarray(flat))
        if dtype == torch.bfloat16:
            t = t.view(torch.bfloat16)
        return t.reshape(shape).to(device)

    return back


def as_flat(x: Any) -> Flat:
    """Wraps a NumPy array or a torch tensor; raises TypeError naming unsupported dtypes."""
    if is_torch(x):
        torch = sys.modules["torch"]
        t = x.detach()
        device = t.device
        t = t.cpu().contiguous()
        if t.dtype == torch.bfloat16:
            arr, name = t.view(torch.int16).numpy().view(np.uint16), "bfloat16"
        else:
            arr = t.numpy()
            name = arr.dtype.name
        if name not in _NUMPY_NAMES | {"bfloat16"}:
            raise TypeError(f"unsupported tensor dtype {t.dtype}")
        return Flat(arr.reshape(-1), name, tuple(t.shape), _torch_back(x.dtype, device))
    arr = np.ascontiguousarray(x)
    name = arr.dtype.name
    if name not in _NUMPY_NAMES:
        raise TypeError(
            f"unsupported array dtype {arr.dtype}; use one of {sorted(_NUMPY_NAMES)}"
            " (or a torch bfloat16 tensor)"
        )
    return Flat(arr.reshape(-1), name, arr.shape, _numpy_back(name))
