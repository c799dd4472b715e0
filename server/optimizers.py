"""Server-side optimizers: torch.optim's update rules, run in place on flat shards.

Each class reproduces the *single-tensor* CPU path of its torch.optim counterpart
(``_single_tensor_sgd`` / ``_adam`` / ``_adagrad`` / ``_rmsprop`` in torch 2.13, the path
torch takes for CPU tensors with ``foreach=False``) term by term: the same tensor ops in the
same order, Python-float scalar arithmetic done in double exactly where torch does it, and
each scalar rounded to float32 at the point torch hands it to a float32 kernel. Where
ATen's kernels fuse a multiply and an add into one FMA (``add`` with alpha, ``addcmul``,
``lerp``) we do too (see ``_fma``), so SGD matches torch bit for bit and the others to a
few float32 ulps; the remaining difference is ``sqrt``: torch's CPU build uses a vectorised
(MKL) routine that is not correctly rounded (about 1 result in 6 is 1 ulp off), while
NumPy/CuPy round correctly.

float64 shards (the master of a float64 model) run the same formulas with every scalar a
float64, as torch's kernels receive it for float64 tensors (``Scalar.to<double>``). Their
multiply-adds are rounded twice (NumPy has no FMA and no wider type to emulate one with), which
costs at most an ulp of float64 (1e-16) per operation: far below any bound a float64 test sets.

The server never imports torch. Array code goes through ``backend.xp`` looked up at call
time (the backend can switch from NumPy to CuPy after import), using only operations the
two libraries share.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

from server import backend

__all__ = ["OPTIMIZERS", "OptimizerError", "ServerOptimizer", "make_optimizer"]
__all__ += ["SGD", "Adam", "AdamW", "Adagrad", "RMSprop"]


class OptimizerError(ValueError):
    """Bad optimizer name, hyper-parameter, state array or step input."""


def _scalar(value: float, like: Any) -> Any:
    """A Python float as the scalar torch's CPU kernel receives for a tensor like ``like``:
    ``Scalar.to<float>`` for float32 (rounded), ``Scalar.to<double>`` for float64."""
    return like.dtype.type(value)


_CHUNK = 1 << 20  # bounds the float64 scratch of _fma to 8 MiB per temporary


def _fma(a: Any, b: Any, c: Any, out: Any) -> None:
    """``out = fl32(a*b + c)`` with a single rounding, like the FMA torch's kernels use.

    ATen's vectorised CPU ``add`` (``vec::fmadd(other, alpha, self)``), ``lerp`` and
    ``addcmul`` fuse multiply and add (measured on x86 AVX2/AVX-512 builds, including the
    loop tails); rounding the product separately drifts by a few ulps per step. A product of
    two float32 values is exact in float64, so one float64 add and the cast back give a
    correctly rounded FMA except for rare double-rounding cases. ``a`` is a float32 scalar
    or array; ``out`` may alias any input, as each chunk is read before it is written.
    float64 has no wider type, so there it is a multiply and an add (see the module docstring).
    """
    xp = backend.xp
    if out.dtype == xp.float64:
        product = b * a
        product += c
        out[...] = product
        return
    scalar = not hasattr(a, "shape") or a.shape == ()
    for lo in range(0, out.size, _CHUNK):
        hi = min(lo + _CHUNK, out.size)
        acc = b[lo:hi].astype(xp.float64)
        acc *= xp.float64(a) if scalar else a[lo:hi]
        acc += c[lo:hi]
        out[lo:hi] = acc


def _add_scaled(dst: Any, src: Any, alpha: float) -> None:
    """``dst.add_(src, alpha=alpha)``: fma(src, fl32(alpha), dst)."""
    if alpha == 1.0:
        dst += src
    else:
        _fma(_scalar(alpha, dst), src, dst, out=dst)


def _lerp(start: Any, end: Any, weight: float) -> None:
    """``start.lerp_(end, weight)`` as ATen's CPU ``lerp_vec`` computes it.

    weight is rounded to the tensor's dtype; |w| < 0.5 gives fma(w, end-start, start),
    otherwise fma(w-1, end-start, end) with w-1 computed in that dtype.
    """
    w = _scalar(weight, start)
    diff = end - start
    if abs(w) < 0.5:
        _fma(w, diff, start, out=start)
    else:
        _fma(w - _scalar(1.0, start), diff, end, out=start)


def _addcmul_sq(dst: Any, t: Any, value: float) -> None:
    """``dst.addcmul_(t, t, value=value)``: fma(fl32(value)*t, t, dst), ATen's order."""
    _fma(t * _scalar(value, dst), t, dst, out=dst)


def _addcdiv(dst: Any, t1: Any, t2: Any, value: float) -> None:
    """``dst.addcdiv_(t1, t2, value=value)``: dst + (fl32(value)*t1)/t2 (no FMA: a division)."""
    quotient = t1 * _scalar(value, dst)
    quotient /= t2
    dst += quotient


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

    def _count(self, what: str, value: Any) -> int:
        """An int >= 0 (Python or NumPy integer, as protobuf or array code may pass)."""
        count = -1 if isinstance(value, bool) or not hasattr(value, "__index__") else int(value)
        if count < 0:
            raise OptimizerError(f"{self.name}: {what} must be an int >= 0, got {value!r}")
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
        step_count = self._count("step_count", step_count)
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
        step_count = self._count("step_count", step_count)
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
        """One optimizer step in place on ``param``; ``grad`` may be overwritten."""
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
        if self.hyper.get("maximize", 0.0):
            xp.negative(grad, out=grad)  # torch: grad = -grad
        self._update(param, grad, self.hyper)

    def _update(self, param: Any, grad: Any, h: Mapping[str, float]) -> None:
        raise NotImplementedError


class SGD(ServerOptimizer):
    """torch.optim.SGD (``_single_tensor_sgd``).

    The momentum buffer is absent until the first step with momentum != 0, which seeds it
    with a copy of the (decayed) gradient without dampening, exactly as torch does.
    """

    name = "sgd"
    defaults = {"lr": 1e-3, "momentum": 0.0, "dampening": 0.0, "nesterov": 0.0}
    defaults |= {"weight_decay": 0.0, "maximize": 0.0}
    flags = frozenset({"nesterov", "maximize"})
    state_names = ("momentum_buffer",)

    def _check(self, h: dict[str, float]) -> None:
        self._nonneg(h, "lr", "momentum", "weight_decay")
        if h["nesterov"] and (h["momentum"] <= 0 or h["dampening"] != 0):
            raise self._error(
                "nesterov", h["nesterov"], "Nesterov momentum requires momentum > 0 and dampening 0"
            )

    def _usable_state(self, h: Mapping[str, float]) -> tuple[str, ...]:
        return ("momentum_buffer",) if h["momentum"] != 0 else ()

    def _update(self, param: Any, grad: Any, h: Mapping[str, float]) -> None:
        if h["weight_decay"] != 0:
            _add_scaled(grad, param, h["weight_decay"])
        momentum = h["momentum"]
        if momentum != 0:
            buf = self._state.get("momentum_buffer")
            if buf is None:
                buf = grad.copy()
                self._state["momentum_buffer"] = buf
            else:
                buf *= _scalar(momentum, buf)
                _add_scaled(buf, grad, 1 - h["dampening"])
            if h["nesterov"]:
                _add_scaled(grad, buf, momentum)
            else:
                grad = buf
        _add_scaled(param, grad, -h["lr"])


class Adam(ServerOptimizer):
    """torch.optim.Adam (``_single_tensor_adam``, non-capturable branch).

    Bias corrections and step size are Python doubles as in torch; only the values passed
    to kernels (step_size, sqrt of bias correction 2, eps, betas) are rounded to the shard's
    dtype (float32 rounds them; float64 keeps them).
    """

    name = "adam"
    defaults = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}
    defaults |= {"amsgrad": 0.0, "maximize": 0.0}
    flags = frozenset({"amsgrad", "maximize"})
    state_names = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    decoupled_weight_decay: ClassVar[bool] = False

    def _check(self, h: dict[str, float]) -> None:
        self._nonneg(h, "lr", "eps", "weight_decay")
        for key in ("beta1", "beta2"):
            if not 0.0 <= h[key] < 1.0:
                raise self._error(key, h[key], "must satisfy 0 <= beta < 1")

    def _required_state(self, h: Mapping[str, float]) -> tuple[str, ...]:
        return self.state_names if h["amsgrad"] else self.state_names[:2]

    def _update(self, param: Any, grad: Any, h: Mapping[str, float]) -> None:
        xp = backend.xp
        lr, beta1, beta2 = h["lr"], h["beta1"], h["beta2"]
        exp_avg, exp_avg_sq = self._state["exp_avg"], self._state["exp_avg_sq"]
        if h["weight_decay"] != 0:
            if self.decoupled_weight_decay:
                param *= _scalar(1 - lr * h["weight_decay"], param)
            else:
                _add_scaled(grad, param, h["weight_decay"])
        _lerp(exp_avg, grad, 1 - beta1)
        exp_avg_sq *= _scalar(beta2, exp_avg_sq)
        _addcmul_sq(exp_avg_sq, grad, 1 - beta2)

        step = float(self.step_count)  # torch keeps step as a float32 tensor, read via .item()
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = lr / bias_correction1
        bias_correction2_sqrt = bias_correction2**0.5

        second = exp_avg_sq
        if h["amsgrad"]:
            second = self._state["max_exp_avg_sq"]
            xp.maximum(second, exp_avg_sq, out=second)
        denom = xp.sqrt(second)
        denom /= _scalar(bias_correction2_sqrt, denom)
        denom += _scalar(h["eps"], denom)
        _addcdiv(param, exp_avg, denom, -step_size)


class AdamW(Adam):
    """torch.optim.AdamW: in torch 2.13 literally Adam with ``decoupled_weight_decay=True``."""

    name = "adamw"
    defaults = {**Adam.defaults, "weight_decay": 1e-2}
    decoupled_weight_decay = True


class Adagrad(ServerOptimizer):
    """torch.optim.Adagrad (``_single_tensor_adagrad``, dense gradients).

    Like torch, ``sum`` is allocated at construction filled with
    ``initial_accumulator_value``; changing that value later has no effect.
    """

    name = "adagrad"
    defaults = {"lr": 1e-2, "lr_decay": 0.0, "weight_decay": 0.0, "eps": 1e-10}
    defaults |= {"initial_accumulator_value": 0.0, "maximize": 0.0}
    flags = frozenset({"maximize"})
    state_names = ("sum",)

    def _check(self, h: dict[str, float]) -> None:
        self._nonneg(h, "lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps")

    def _required_state(self, h: Mapping[str, float]) -> tuple[str, ...]:
        return self.state_names

    def _initialized(self) -> bool:
        return True  # torch creates the state in Adagrad.__init__

    def _init_state(self) -> None:
        xp = backend.xp
        init = self.hyper["initial_accumulator_value"]
        self._state = {"sum": xp.full(self.numel, init, dtype=self.dtype)}

    def _update(self, param: Any, grad: Any, h: Mapping[str, float]) -> None:
        xp = backend.xp
        state_sum = self._state["sum"]
        if h["weight_decay"] != 0:
            _add_scaled(grad, param, h["weight_decay"])
        step = float(self.step_count)
        clr = h["lr"] / (1 + (step - 1) * h["lr_decay"])
        _addcmul_sq(state_sum, grad, 1.0)
        std = xp.sqrt(state_sum)
        std += _scalar(h["eps"], std)
        _addcdiv(param, grad, std, -clr)


class RMSprop(ServerOptimizer):
    """torch.optim.RMSprop (``_single_tensor_rmsprop``).

    ``momentum_buffer`` exists only if momentum > 0 and ``grad_avg`` only if centered at
    the first step, as torch's ``_init_group`` decides.
    """

    name = "rmsprop"
    defaults = {"lr": 1e-2, "alpha": 0.99, "eps": 1e-8, "weight_decay": 0.0, "momentum": 0.0}
    defaults |= {"centered": 0.0, "maximize": 0.0}
    flags = frozenset({"centered", "maximize"})
    state_names = ("square_avg", "momentum_buffer", "grad_avg")

    def _check(self, h: dict[str, float]) -> None:
        self._nonneg(h, "lr", "eps", "momentum", "weight_decay", "alpha")

    def _required_state(self, h: Mapping[str, float]) -> tuple[str, ...]:
        wanted = (True, h["momentum"] > 0, bool(h["centered"]))
        return tuple(n for n, want in zip(self.state_names, wanted, strict=True) if want)

    def _update(self, param: Any, grad: Any, h: Mapping[str, float]) -> None:
        xp = backend.xp
        alpha = h["alpha"]
        square_avg = self._state["square_avg"]
        if h["weight_decay"] != 0:
            _add_scaled(grad, param, h["weight_decay"])
        square_avg *= _scalar(alpha, square_avg)
        _addcmul_sq(square_avg, grad, 1 - alpha)
        if h["centered"]:
            grad_avg = self._state["grad_avg"]
            _lerp(grad_avg, grad, 1 - alpha)
            avg = square_avg.copy()  # square_avg.addcmul(grad_avg, grad_avg, value=-1).sqrt_()
            _addcmul_sq(avg, grad_avg, -1.0)
            xp.sqrt(avg, out=avg)
        else:
            avg = xp.sqrt(square_avg)
        avg += _scalar(h["eps"], avg)
        if h["momentum"] > 0:
            buf = self._state["momentum_buffer"]
            buf *= _scalar(h["momentum"], buf)
            _addcdiv(buf, grad, avg, 1.0)
            _add_scaled(param, buf, -h["lr"])
        else:
            _addcdiv(param, grad, avg, -h["lr"])


OPTIMIZERS: dict[str, type[ServerOptimizer]] = {
    cls.name: cls for cls in (SGD, Adam, AdamW, Adagrad, RMSprop)
}


def make_optimizer(
    name: str, numel: int, hyper: Mapping[str, float], dtype: Any = None
) -> ServerOptimizer:
    """Build the optimizer registered under ``name`` (torch's lower-case class name) for a
    shard of ``dtype`` (float32 when None)."""
    cls = OPTIMIZERS.get(name)
    if cls is None:
        known = ", ".join(sorted(OPTIMIZERS))
        raise OptimizerError(f"unknown optimizer {name!r}; known optimizers: {known}")
    return cls(numel, hyper, dtype)
