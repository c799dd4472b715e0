"""The one numerical contract of the equivalence tests, and the helper that checks it.

Every equivalence test trains in float64 (models converted with ``.double()``, float inputs
too, for the sharded run and the single-process reference alike; ``ShardingConfiguration`` at
its defaults, so parameters, gradients on the wire and the servers' masters and optimizer state
are float64) and compares, tensor by tensor, losses and final parameters with the
single-process values ``b``::

    max|a - b| / max|b| <= REL_BOUND = 1e-9          (max|b| >= TINY = 1e-6)
    max|a - b|           <= ABS_BOUND = 1e-15         (max|b| <  TINY: a tensor that is ~0)

Why 1e-9. A correct sharded run differs from single-process training only in the order of
floating-point additions: gradients averaged over ranks, micro-batches and accumulation steps,
squared norms summed over shards and tensor-parallel parts. Each reordering changes a result by
a few units of round-off, 2**-53 ~ 1.1e-16 in float64, and training amplifies that: the tiny
GPTs of these tests, 20 steps of AdamW with clipping, turn float32's round-off (2**-24 ~ 6e-8)
into at most ~3e-5, a factor of a few hundred, and a few thousand at worst (Adam's near-zero
gradients). In float64 the same amplification ends near 1e-13 (measured over every equivalence
test, with AVX-512, AVX2 and the scalar kernels: at most 4e-12, a one-step gradient summed in
another order); 1e-9 is over two orders of magnitude above that, and round-off cannot explain
a deviation beyond it. Anything that can is a bug: a wrong
learning rate, clip coefficient or bias correction, a missed or doubled contribution, and also a
single float32 rounding anywhere on the path (one rounding is already ~6e-8 relative). The bound
needs no tuning per machine or CPU (AVX-512, AVX2, the scalar ``default`` kernels): float32
bounds did, float64 has the margin.

Tensors that are (nearly) zero in the reference get an absolute bound instead: relative error
means nothing there. 1e-15 is the relative bound applied to a tensor at the threshold (1e-9 of
1e-6), and stays a few round-offs of the O(1) quantities such tensors are computed from.

``assert_equivalent(got, want, what)`` takes a tensor, a number, a numpy array, a list of them
(losses: one tensor) or a dict of them (state dicts: same keys, each value its own tensor), and
returns the worst relative deviation it saw. With ``PARAMSHARD_NUMERICS_LOG=path`` set, every
comparison appends ``what<TAB>relative|absolute<TAB>deviation`` to that file (how the measured
deviations in reports are collected).

Float32 tests that remain (mixed precision, compressed gradients, codecs) do not use this bound:
they have measured ones, ``assert_within_twin`` (no worse than ``TWIN_FACTOR`` times the
deviation of torch's own distributed twin, at least ``TWIN_FLOOR``) or an exact reference.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = [
    "ABS_BOUND",
    "REL_BOUND",
    "TINY",
    "TWIN_FACTOR",
    "TWIN_FLOOR",
    "assert_equivalent",
    "assert_within_twin",
    "deviation",
    "worst_deviation",
]

REL_BOUND = 1e-9
"""max|a - b| / max|b| per tensor, float64 runs against single-process float64."""
TINY = 1e-6
"""Reference tensors with max|b| below this are compared absolutely."""
ABS_BOUND = 1e-15
"""max|a - b| for reference tensors below TINY."""
TWIN_FACTOR = 3.0
"""Float32: at most this many times the deviation of torch's own distributed twin ..."""
TWIN_FLOOR = 1e-7
"""... or this, whichever is larger (a twin that happens to agree exactly proves nothing)."""


def _tensor(x: Any) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach()
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(x))
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return torch.tensor(float(x), dtype=torch.float64)
    if isinstance(x, (list, tuple)) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in x
    ):
        return torch.tensor([float(v) for v in x], dtype=torch.float64)
    raise TypeError(f"cannot compare a {type(x).__name__} as a tensor")


def deviation(got: Any, want: Any) -> tuple[str, float]:
    """("relative", max|a-b|/max|b|) or, when max|b| < TINY, ("absolute", max|a-b|)."""
    a, b = _tensor(got).double(), _tensor(want).double()
    if a.shape != b.shape:
        raise AssertionError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    if b.numel() == 0:
        return "absolute", 0.0
    if not bool(torch.isfinite(a).all()):
        return "relative", math.inf
    diff = float((a - b).abs().max())
    scale = float(b.abs().max())
    if scale < TINY:
        return "absolute", diff
    return "relative", diff / scale


def _log(what: str, kind: str, value: float) -> None:
    path = os.environ.get("PARAMSHARD_NUMERICS_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{what}\t{kind}\t{value:.3e}\n")


def _leaves(got: Any, want: Any, what: str):
    """(name, got, want) for every tensor of the (nested) structures."""
    if isinstance(want, Mapping):
        assert isinstance(got, Mapping), f"{what}: expected a mapping, got {type(got).__name__}"
        assert set(got) == set(want), f"{what}: keys differ: {sorted(set(got) ^ set(want))}"
        for k in want:
            yield from _leaves(got[k], want[k], f"{what}[{k}]")
    elif isinstance(want, (list, tuple)) and not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in want
    ):
        assert len(got) == len(want), f"{what}: {len(got)} items vs {len(want)}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            yield from _leaves(g, w, f"{what}[{i}]")
    else:
        yield what, got, want


def assert_equivalent(got: Any, want: Any, what: str = "value") -> float:
    """Checks the float64 contract (see the module docstring) on every tensor of ``got``
    against ``want`` (the single-process value); returns the worst relative deviation.

    Tensors must have the reference's dtype: a float32 tensor where float64 was trained means
    the float64 path leaked through float32 somewhere, which the bound would catch anyway, but
    less clearly."""
    worst = 0.0
    failures = []
    for name, g, w in _leaves(got, want, what):
        if isinstance(w, torch.Tensor) and isinstance(g, torch.Tensor):
            assert g.dtype == w.dtype, f"{name}: dtype {g.dtype}, reference {w.dtype}"
        kind, dev = deviation(g, w)
        _log(name, kind, dev)
        if kind == "relative":
            worst = max(worst, dev)
            if not dev <= REL_BOUND:
                failures.append(f"{name}: max|a-b|/max|b| = {dev:.3e} > {REL_BOUND:g}")
        elif not dev <= ABS_BOUND:
            failures.append(f"{name}: max|a-b| = {dev:.3e} > {ABS_BOUND:g} (|b| < {TINY:g})")
    assert not failures, "not equivalent to single-process float64:\n" + "\n".join(failures)
    return worst


def worst_deviation(got: Any, want: Any) -> float:
    """max over tensors of max|a-b| / max(max|b|, TINY): one number for a whole run, used
    by the measured (float32) bounds."""
    worst = 0.0
    for _, g, w in _leaves(got, want, "x"):
        a, b = _tensor(g).double(), _tensor(w).double()
        assert a.shape == b.shape
        if b.numel():
            diff = float((a - b).abs().max())
            worst = max(worst, diff / max(float(b.abs().max()), TINY))
    return worst


def assert_within_twin(got: Any, twin: Any, want: Any, what: str) -> float:
    """Float32 measured bound: ``got``'s worst deviation from the single-process ``want`` is
    at most max(TWIN_FLOOR, TWIN_FACTOR x the worst deviation of ``twin``, torch's own
    distributed implementation of the same training); returns ``got``'s deviation."""
    ours, theirs = worst_deviation(got, want), worst_deviation(twin, want)
    bound = max(TWIN_FLOOR, TWIN_FACTOR * theirs)
    _log(what, "twin-bounded", ours)
    _log(what + " (torch twin)", "twin", theirs)
    assert ours <= bound, (
        f"{what}: deviation {ours:.3e} from single-process, torch's twin {theirs:.3e}: "
        f"more than max({TWIN_FLOOR:g}, {TWIN_FACTOR:g} x twin) = {bound:.3e}"
    )
    return ours
