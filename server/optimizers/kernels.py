"""torch's fused CPU kernels on NumPy/CuPy arrays: scalars rounded where torch rounds them,
multiply-adds fused as ATen's vectorised ``add``/``lerp``/``addcmul`` fuse them (see the
package docstring)."""

from __future__ import annotations

from typing import Any

from paramshard.server.runtime import backend


def scalar(value: float, like: Any) -> Any:
    """A Python float as the scalar torch's CPU kernel receives for a tensor like ``like``:
    ``Scalar.to<float>`` for float32 (rounded), ``Scalar.to<double>`` for float64."""
    return like.dtype.type(value)


CHUNK = 1 << 20  # bounds the float64 scratch of fma to 8 MiB per temporary


def fma(a: Any, b: Any, c: Any, out: Any) -> None:
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
    is_scalar = not hasattr(a, "shape") or a.shape == ()
    for lo in range(0, out.size, CHUNK):
        hi = min(lo + CHUNK, out.size)
        acc = b[lo:hi].astype(xp.float64)
        acc *= xp.float64(a) if is_scalar else a[lo:hi]
        acc += c[lo:hi]
        out[lo:hi] = acc


def add_scaled(dst: Any, src: Any, alpha: float) -> None:
    """``dst.add_(src, alpha=alpha)``: fma(src, fl32(alpha), dst)."""
    if alpha == 1.0:
        dst += src
    else:
        fma(scalar(alpha, dst), src, dst, out=dst)


def lerp(start: Any, end: Any, weight: float) -> None:
    """``start.lerp_(end, weight)`` as ATen's CPU ``lerp_vec`` computes it.

    weight is rounded to the tensor's dtype; |w| < 0.5 gives fma(w, end-start, start),
    otherwise fma(w-1, end-start, end) with w-1 computed in that dtype.
    """
    w = scalar(weight, start)
    diff = end - start
    if abs(w) < 0.5:
        fma(w, diff, start, out=start)
    else:
        fma(w - scalar(1.0, start), diff, end, out=start)


def addcmul_sq(dst: Any, t: Any, value: float) -> None:
    """``dst.addcmul_(t, t, value=value)``: fma(fl32(value)*t, t, dst), ATen's order."""
    fma(t * scalar(value, dst), t, dst, out=dst)


def addcdiv(dst: Any, t1: Any, t2: Any, value: float) -> None:
    """``dst.addcdiv_(t1, t2, value=value)``: dst + (fl32(value)*t1)/t2 (no FMA: a division)."""
    quotient = t1 * scalar(value, dst)
    quotient /= t2
    dst += quotient
