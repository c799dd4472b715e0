"""What every server optimizer shares: hyper-parameter validation, lazy state, state reads and
writes for snapshots and ``opt.state_dict()``, and the step's bookkeeping."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

from paramshard.server.runtime import backend
from paramshard.server.runtime.request_bounds import MAX_VERSION

__all__ = ["BLOCK", "OptimizerError", "ServerOptimizer"]

BLOCK = 1 << 16
"""Elements one pass of an update covers on the CPU (256 KiB of float32 per array):
temporaries stay this size and in cache; the Python loop over blocks costs about 0.1 ns per
element."""
DEVICE_BLOCK = 1 << 24
"""The same on a GPU, where each term is a kernel launch (~10 us): 64 MiB temporaries."""
MAX_STEP_COUNT = MAX_VERSION
"""A step count loaded or written (a snapshot's, a replica's, SetState's) is at most a
version's bound, 2**53: past it, Status's int64 fields and the bias corrections' floats
break (a replica with 2**64 made every later Status of the server end INTERNAL)."""


class OptimizerError(ValueError):
    """Bad optimizer name, hyper-parameter, state array or step input."""


class ServerOptimizer:
    """Base class: hyper-parameter validation, lazy state, snapshots.

    Subclasses set ``name``, ``defaults`` (torch's defaults; tuples flattened, booleans as
    0.0/1.0), ``flags`` (the boolean keys), ``state_names`` and implement ``_check``,
    ``_required_state`` and ``_update``.
    """

    name: ClassVar[str] = ""
    defaults: ClassVar[dict[str, float]] = {}
    flags: ClassVar[frozenset[str]] = frozenset()
    state_names: ClassVar[tuple[str, ...]] = ()

    def __init__(self, numel: int, hyper: Mapping[str, float], dtype: Any = None) -> None:
        self.numel = self._count("numel", numel)
        self.dtype = backend.xp.dtype(dtype or "float32")
        """Dtype of the shard, its gradient and every state array: float32 or float64."""
        if self.dtype not in (backend.xp.float32, backend.xp.float64):
            raise OptimizerError(f"{self.name}: shards are float32 or float64, not {self.dtype}")
        self.hyper: dict[str, float] = self._validated({**self.defaults, **hyper})
        self.step_count = 0
        self._state: dict[str, Any] = {}
        self._init_state()

    def _count(self, what: str, value: Any, most: int | None = None) -> int:
        """An int >= 0 (Python or NumPy integer, as protobuf or array code may pass), at most
        ``most`` when given."""
        count = -1 if isinstance(value, bool) or not hasattr(value, "__index__") else int(value)
        if count < 0:
            raise OptimizerError(f"{self.name}: {what} must be an int >= 0, got {value!r}")
        if most is not None and count > most:
            raise OptimizerError(f"{self.name}: {what} {count:,} is over {most:,}")
        return count

    def _error(self, key: str, value: object, rule: str) -> OptimizerError:
        allowed = ", ".join(self.defaults)
        return OptimizerError(f"{self.name}: invalid {key}={value!r} ({rule}); allowed: {allowed}")

    def _validated(self, merged: Mapping[str, Any]) -> dict[str, float]:
        """Coerce to floats and apply torch's constructor checks, plus finiteness.

        Non-finite values are rejected outright (torch lets e.g. ``lr=nan`` through its
        ``lr < 0`` test), because on a shared server they would silently poison the shard.
        """
        out: dict[str, float] = {}
        for key, raw in merged.items():
            if key not in self.defaults:
                raise self._error(key, raw, "unknown hyper-parameter")
            try:
                value = float(raw)
            except (TypeError, ValueError):
                raise self._error(key, raw, "must be a number") from None
            if not math.isfinite(value):
                raise self._error(key, raw, "must be finite")
            if key in self.flags and value not in (0.0, 1.0):
                raise self._error(key, raw, "a boolean: must be 0.0 or 1.0")
            out[key] = value
        self._check(out)
        return out

    def _check(self, h: dict[str, float]) -> None:
        """Optimizer-specific range checks, mirroring the torch constructor."""

    def _nonneg(self, h: Mapping[str, float], *keys: str) -> None:
        for key in keys:
            if not 0.0 <= h[key]:
                raise self._error(key, h[key], "must be >= 0, as torch requires")

    def update_hyper(self, hyper: Mapping[str, float]) -> None:
        """Merge per-step values (e.g. an LR scheduler's lr); all-or-nothing.

        A change that needs a state array the optimizer never allocated (turning on
        ``amsgrad``, ``centered`` or RMSprop momentum after the first step) is refused:
        torch would raise ``KeyError`` at the next step for the same change.
        """
        self.hyper = self.check_hyper(hyper)

    def check_hyper(self, hyper: Mapping[str, float]) -> dict[str, float]:
        """What ``update_hyper(hyper)`` would set, or OptimizerError; changes nothing.

        The server checks a step's arguments before it counts the push that carries them.
        """
        new = self._validated({**self.hyper, **hyper})
        if self._initialized():
            missing = [n for n in self._required_state(new) if n not in self._state]
            if missing:
                key = next((k for k in hyper if new[k] != self.hyper.get(k)), next(iter(hyper)))
                raise self._error(
                    key, hyper[key], f"would need state {missing} not allocated at step 1"
                )
        return new

    def _required_state(self, h: Mapping[str, float]) -> tuple[str, ...]:
        """State arrays that exist once the optimizer is initialised under hyper ``h``."""
        return ()

    def _usable_state(self, h: Mapping[str, float]) -> tuple[str, ...]:
        """State arrays that may exist under hyper ``h`` (also those created lazily)."""
        return self._required_state(h)

    def _initialized(self) -> bool:
        """Whether torch would consider the per-parameter state created."""
        return self.step_count > 0

    def _init_state(self) -> None:
        """Allocate state at construction (only Adagrad does, as torch does)."""

    def state_arrays(self) -> dict[str, Any]:
        """The live state arrays by torch's state key; copy them before the next step."""
        return dict(self._state)

    def load_state(self, arrays: Mapping[str, Any], step_count: int) -> None:
        """Replace the state with copies of ``arrays`` (the inverse of ``state_arrays``)."""
        step_count = self._count("step_count", step_count, MAX_STEP_COUNT)
        loaded: dict[str, Any] = {}
        for key, arr in arrays.items():
            if key not in self.state_names:
                known = ", ".join(self.state_names)
                raise OptimizerError(f"{self.name}: unknown state array {key!r}; known: {known}")
            if int(arr.size) != self.numel:
                raise OptimizerError(
                    f"{self.name}: state array {key!r} has {arr.size} elements, not {self.numel}"
                )
            loaded[key] = backend.to_device(arr).astype(self.dtype).reshape(-1)  # a copy
        if step_count > 0 or loaded:
            missing = [n for n in self._required_state(self.hyper) if n not in loaded]
            if missing:
                raise OptimizerError(f"{self.name}: state arrays {missing} missing from snapshot")
        self._state = loaded
        self.step_count = step_count
        if not loaded:
            self._init_state()

    def read_state(self, key: str) -> Any:
        """The live state array ``key`` (torch's state key); copy it before the next step."""
        self._check_state_key(key)
        if key not in self._state:
            raise OptimizerError(
                f"{self.name}: state {key!r} does not exist yet (step count {self.step_count});"
                " torch creates it at the first step"
            )
        return self._state[key]

    def write_state(self, key: str, offset: int, values: Any, step_count: int) -> None:
        """Writes ``values`` into state array ``key`` at ``offset`` and sets the step count;
        the arrays the hyper-parameters use are created as zeros first (as torch's first
        step would), so a partly loaded state still steps."""
        self._check_state_key(key)
        if key not in self._usable_state(self.hyper):
            raise OptimizerError(
                f"{self.name}: state {key!r} is not used with these hyper-parameters; used:"
                f" {', '.join(self._usable_state(self.hyper)) or 'none'}"
            )
        step_count = self._count("step_count", step_count, MAX_STEP_COUNT)
        n = int(values.size)
        if offset < 0 or offset + n > self.numel:
            raise OptimizerError(
                f"{self.name}: state range [{offset}, {offset + n}) is outside {self.numel}"
            )
        xp = backend.xp
        for k in (*self._required_state(self.hyper), key):
            if k not in self._state:
                self._state[k] = xp.zeros(self.numel, dtype=self.dtype)
        self._state[key][offset : offset + n] = values
        self.step_count = step_count

    def _check_state_key(self, key: str) -> None:
        if key not in self.state_names:
            known = ", ".join(self.state_names) or "none"
            raise OptimizerError(f"{self.name}: unknown state {key!r}; known: {known}")

    def state_bytes(self) -> int:
        """Bytes held by allocated state arrays."""
        return sum(int(a.nbytes) for a in self._state.values())

    def step(self, param: Any, grad: Any) -> None:
        """One optimizer step in place on ``param``; ``grad`` may be overwritten.

        The update runs over ``BLOCK`` elements at a time: every rule is elementwise, so the
        result is the same, while each temporary the formulas make (``sqrt``, quotients, the
        FMA's float64 scratch) is one block, not one slice. Whole-slice temporaries cost up to
        8 bytes per element at once on top of the 16 the slice holds (Adam: 1.5x the memory
        formula at the step), and streaming each block through every term stays in cache."""
        xp = backend.xp
        for what, arr in (("param", param), ("grad", grad)):
            if arr.size != self.numel or arr.dtype != self.dtype:
                raise OptimizerError(
                    f"{self.name}: {what} must be {self.dtype} with {self.numel} elements, "
                    f"got {arr.dtype} with {arr.size}"
                )
        if not self._initialized():  # torch's _init_group: zeros on the first step
            for key in self._required_state(self.hyper):
                if key not in self._state:
                    self._state[key] = xp.zeros(self.numel, dtype=self.dtype)
        self.step_count += 1
        h = self.hyper
        self._before_update(grad, h)
        block = BLOCK if backend.device == "cpu" else DEVICE_BLOCK
        for lo in range(0, self.numel, block):
            hi = min(lo + block, self.numel)
            g = grad[lo:hi]
            if h.get("maximize", 0.0):
                xp.negative(g, out=g)  # torch: grad = -grad
            state = {k: v[lo:hi] for k, v in self._state.items()}
            self._update(param[lo:hi], g, state, h)
        self._after_update()

    def _before_update(self, grad: Any, h: Mapping[str, float]) -> None:
        """Allocates state the first blocks need (SGD's momentum buffer, seeded in them)."""

    def _after_update(self) -> None:
        """Runs after the last block."""

    def _update(self, param: Any, grad: Any, state: dict[str, Any], h: Mapping[str, float]) -> None:
        """The rule on one block: ``param``, ``grad`` and each state array's same elements."""
        raise NotImplementedError
