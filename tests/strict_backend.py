"""The ``strict`` test backend: NumPy on the CPU, refusing what CuPy refuses.

No GPU is lent to this project's CI, yet the servers keep their shards in CuPy arrays on GPU
hosts. CuPy arrays do not convert to NumPy implicitly ("NumPy functions cannot take
cupy.ndarrays as inputs, and vice versa": docs.cupy.dev, reference/ndarray), so a NumPy-only
call in server code works on the CPU backend and fails on the first GPU. This backend makes it
fail on the CPU: ``backend.use_device("strict")``, or ``PARAMSHARD_TEST_BACKEND=strict`` (then
every server this process starts with ``device="cpu"`` gets it; server/runtime/backend.py). It is a
test backend, not a device: its memory is host memory and Status reports ``cpu``.

Its ``xp`` is this module: NumPy's namespace with every function wrapped so that device arrays
(``StrictArray``) go in and come out. What fails here, as on CuPy:

- ``np.asarray(d)``, ``np.array(d)``, ``host[...] = d``, any NumPy function that needs the
  values on the host (``__array__`` raises TypeError with CuPy's message);
- the buffer protocol: ``np.frombuffer(d)``, ``memoryview(d)``, ``bytes(d)``, a protobuf bytes
  field, ``file.write(d)``;
- a host array meeting a device array: ``d + host``, ``xp.maximum(d, host)``, ``d[...] = host``
  (CuPy: "Unsupported type numpy.ndarray" / "non-scalar numpy.ndarray cannot be used for fill");
- ``d.flags.writeable`` (CuPy's flags have c_contiguous, f_contiguous and owndata only).

Stricter than CuPy, because this project routes every host/device crossing through
``backend.to_host`` / ``backend.to_device`` (one place to stage, pin or count copies):
``xp.asarray(host)`` / ``xp.array(host)`` refuse NumPy arrays (CuPy copies them to the device),
and ``d.tobytes()``, ``d.tolist()``, ``d.tofile()``, ``d.data`` and pickling refuse (CuPy
copies to the host silently). DLPack stays, as on CuPy: it is the device-to-device path to a
trainer in the server's process (``from_dlpack`` imports a producer's memory as a device
array; ``__dlpack__`` hands a device array to torch), never a copy to the host.
What CuPy allows stays allowed:
``float(d)``/``int(d)``/``bool(d)`` of a one-element array, ``d.item()``, ``d.get()``,
``xp.asnumpy(d)``, and NumPy ufuncs and functions called on device arrays (NEP 13/18 dispatch),
whose results stay device arrays. Reductions and scalar indexing give 0-d device arrays.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.lib.mixins import NDArrayOperatorsMixin

__all__ = ["StrictArray", "ndarray", "asarray", "array", "asnumpy", "from_dlpack", "upload"]

_HOST_SCALARS = (int, float, complex, bool, np.generic, type(None), str, slice, type(Ellipsis))
_IMPLICIT = (
    "Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct a"
    " NumPy array explicitly (strict test backend: server code copies with backend.to_host)"
)


def _host_meets_device(what: str, value: Any) -> TypeError:
    return TypeError(
        f"Unsupported type {type(value).__module__}.{type(value).__name__} in {what}: a host"
        " value cannot meet a device array (strict test backend, as CuPy; server code copies"
        " host arrays to the device with backend.to_device)"
    )


def _unwrap(value: Any, what: str) -> Any:
    """A device array's NumPy storage; scalars pass; host arrays and buffers are refused."""
    if isinstance(value, StrictArray):
        return value._a
    if isinstance(value, (list, tuple)):
        return type(value)(_unwrap(v, what) for v in value)
    if isinstance(value, _HOST_SCALARS) or isinstance(value, (type, np.dtype)):
        return value
    raise _host_meets_device(what, value)


def _wrap(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return StrictArray(value)
    if isinstance(value, np.generic):
        return StrictArray(np.asarray(value))  # CuPy gives 0-d device arrays, not scalars
    if isinstance(value, tuple):
        return tuple(_wrap(v) for v in value)
    return value


def _device_function(name: str, func: Any) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        what = f"xp.{name}"
        args = tuple(_unwrap(a, what) for a in args)
        kwargs = {k: _unwrap(v, what) for k, v in kwargs.items()}
        return _wrap(func(*args, **kwargs))

    call.__name__ = call.__qualname__ = name
    return call


class _Flags:
    """CuPy's ``ndarray.flags``: no ``writeable`` (a device array is always writeable)."""

    def __init__(self, a: np.ndarray) -> None:
        self.c_contiguous = bool(a.flags.c_contiguous)
        self.f_contiguous = bool(a.flags.f_contiguous)
        self.owndata = a.base is None


_METHODS = frozenset(
    "all any argmax argmin astype clip copy cumsum dot fill max mean min nonzero prod ravel"
    " reshape squeeze std sum transpose var view".split()
)
_HIDDEN_COPIES = frozenset(("tobytes", "tolist", "tofile", "data", "ctypes", "dumps", "dump"))


class StrictArray(NDArrayOperatorsMixin):
    """A device array of the strict backend: a NumPy array that refuses to leave implicitly."""

    __slots__ = ("_a",)

    def __init__(self, a: np.ndarray) -> None:
        self._a = a

    # -- what CuPy refuses ------------------------------------------------------------------
    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        raise TypeError(_IMPLICIT)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError("a strict device array is not pickled: copy it with backend.to_host")

    def __getattr__(self, name: str) -> Any:
        if name in _METHODS:
            method = getattr(self._a, name)
            return _device_function(name, method)
        if name in _HIDDEN_COPIES:
            raise TypeError(
                f"StrictArray.{name} would copy device memory to the host implicitly: use"
                " backend.to_host (strict test backend)"
            )
        raise AttributeError(f"strict device array has no attribute {name!r}")

    # -- NumPy dispatch (NEP 13 / NEP 18), as CuPy implements it -----------------------------
    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        what = f"{ufunc.__name__}.{method}" if method != "__call__" else ufunc.__name__
        args = tuple(_unwrap(x, what) for x in inputs)
        out = kwargs.get("out")
        kwargs = {k: _unwrap(v, what) for k, v in kwargs.items()}
        result = getattr(ufunc, method)(*args, **kwargs)
        if out is not None:
            return out[0] if len(out) == 1 else out
        return _wrap(result)

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        return _device_function(func.__name__, func)(*args, **kwargs)

    # -- the ndarray surface the server uses --------------------------------------------------
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    size = property(lambda self: self._a.size)
    ndim = property(lambda self: self._a.ndim)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    T = property(lambda self: StrictArray(self._a.T))
    flags = property(lambda self: _Flags(self._a))
    base = property(lambda self: None if self._a.base is None else StrictArray(self._a.base))

    def __getitem__(self, key: Any) -> Any:
        return _wrap(self._a[_unwrap(key, "indexing")])

    def __setitem__(self, key: Any, value: Any) -> None:
        self._a[_unwrap(key, "indexing")] = _unwrap(value, "assignment into a device array")

    def __len__(self) -> int:
        return len(self._a)

    def __iter__(self) -> Any:
        return (_wrap(row) for row in self._a)

    def __bool__(self) -> bool:
        return bool(self._a)

    def __float__(self) -> float:
        return float(self._a)

    def __int__(self) -> int:
        return int(self._a)

    def __complex__(self) -> complex:
        return complex(self._a)

    def __format__(self, spec: str) -> str:
        return format(self._a.item() if self._a.ndim == 0 else str(self), spec)

    def __copy__(self) -> StrictArray:
        return StrictArray(self._a.copy())

    def __deepcopy__(self, memo: Any) -> StrictArray:
        return StrictArray(self._a.copy())

    def __repr__(self) -> str:
        return f"strict_array({np.array2string(self._a)}, dtype={self._a.dtype})"

    def item(self) -> Any:
        return self._a.item()

    def get(self) -> np.ndarray:
        """The explicit device-to-host copy (``cupy.ndarray.get``)."""
        return self._a.copy()

    # -- DLPack: device memory shared with another library on the same device ----------------
    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._a.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> Any:
        return self._a.__dlpack_device__()


ndarray = StrictArray


def upload(host: Any) -> StrictArray:
    """The host-to-device copy ``backend.to_device`` makes (always a copy, as on a GPU)."""
    return StrictArray(np.array(host, copy=True))


def from_dlpack(obj: Any) -> StrictArray:
    """``cupy.from_dlpack``: a producer's device memory as a device array, no copy."""
    return StrictArray(np.from_dlpack(obj))


def asnumpy(a: Any) -> np.ndarray:
    """``cupy.asnumpy``: the explicit device-to-host copy."""
    return a.get() if isinstance(a, StrictArray) else np.array(a, copy=True)


def _refuse_host_arrays(name: str) -> Any:
    func = getattr(np, name)

    def make(obj: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(obj, np.ndarray):
            raise TypeError(
                f"xp.{name} of a host array: server code copies host arrays to the device with"
                " backend.to_device (strict test backend)"
            )
        return _device_function(name, func)(obj, *args, **kwargs)

    make.__name__ = name
    return make


asarray = _refuse_host_arrays("asarray")
array = _refuse_host_arrays("array")
ascontiguousarray = _refuse_host_arrays("ascontiguousarray")


def __getattr__(name: str) -> Any:
    """Everything else NumPy has: types and constants as they are (CuPy shares NumPy's
    dtypes), functions and ufuncs wrapped to take and give device arrays."""
    value = getattr(np, name)
    if callable(value) and not isinstance(value, type):
        return _device_function(name, value)
    return value
