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

from collections.abc import Mapping
from typing import Any

from paramshard.server.optimizers.adagrad import Adagrad
from paramshard.server.optimizers.adam import Adam, AdamW
from paramshard.server.optimizers.base import OptimizerError, ServerOptimizer
from paramshard.server.optimizers.rmsprop import RMSprop
from paramshard.server.optimizers.sgd import SGD

__all__ = ["OPTIMIZERS", "OptimizerError", "ServerOptimizer", "make_optimizer"]
__all__ += ["SGD", "Adam", "AdamW", "Adagrad", "RMSprop"]


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
