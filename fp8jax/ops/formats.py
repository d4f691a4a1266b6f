"""FP8 formats: saturating quantize, dequantize and amax.

Convention (as in FP8-LM and Transformer Engine): ``q = saturate(x * scale)`` and
``x ~= q / scale``. A larger scale uses more of the format's range.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

__all__ = [
    "E4M3",
    "E5M2",
    "FORMATS",
    "amax",
    "as_dtype",
    "clip_threshold",
    "dequantize",
    "fmax",
    "quantize",
    "saturate",
    "saturation_stats",
]

E4M3 = jnp.float8_e4m3fn  # 4 exponent bits, max 448: forward tensors (activations, weights).
E5M2 = jnp.float8_e5m2  # 5 exponent bits, max 57344: gradients, which need the range.

FORMATS = {"e4m3": E4M3, "e5m2": E5M2}


def as_dtype(fmt) -> jnp.dtype:
    """Return the FP8 dtype for 'e4m3'/'e5m2' or an FP8 dtype; raise a clear error otherwise."""
    if isinstance(fmt, str):
        if fmt.lower() not in FORMATS:
            raise ValueError(f"unknown FP8 format {fmt!r}: use one of {sorted(FORMATS)}")
        return jnp.dtype(FORMATS[fmt.lower()])
    dtype = jnp.dtype(fmt)
    if dtype not in (jnp.dtype(E4M3), jnp.dtype(E5M2)):
        raise ValueError(f"unsupported FP8 dtype {dtype}: use float8_e4m3fn or float8_e5m2")
    return dtype


def fmax(fmt) -> float:
    """Largest finite value of an FP8 format."""
    return float(jnp.finfo(as_dtype(fmt)).max)


def clip_threshold(fmt) -> float:
    """The smallest magnitude a saturating cast really clips: the max plus half its step."""
    info = jnp.finfo(as_dtype(fmt))
    top_step = 2.0 ** (math.floor(math.log2(float(info.max))) - int(info.nmant))
    return float(info.max) + top_step / 2


def amax(x: jax.Array) -> jax.Array:
    """Absolute maximum of ``x`` as a float32 scalar (0 for an empty ``x``)."""
    if x.size == 0:  # static: no element, no information (a max over nothing would raise)
        return jnp.zeros((), jnp.float32)
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


def saturate(y: jax.Array, finite: jax.Array, limit: float) -> jax.Array:
    """``y`` (f32, already scaled) clipped to ``+-limit`` where ``finite``, NaN elsewhere.

    ``finite`` says whether the value before scaling was finite: a finite value whose product
    with the scale overflows still saturates, while Inf and NaN stay non-finite through the cast,
    so a bad operand reaches the GEMM output instead of turning into the format max. NaN, not
    Inf, for both formats: E4M3 has no Inf, and Triton's convert (``cvt.rn.satfinite``) maps
    Inf to the format max even for E5M2, while every convert keeps NaN. One select inside the
    cast's fusion; finite inputs give the same bits as the plain clip.
    """
    return jnp.where(finite, jnp.clip(y, -limit, limit), jnp.nan)


def quantize(x: jax.Array, scale: jax.Array, fmt) -> jax.Array:
    """Scale ``x`` and cast it to FP8, saturating finite values at the format max.

    Non-finite values of ``x`` become NaN (``saturate``): never laundered into finite ones.

    The multiply runs in f32 inside the same fusion as the cast (no extra memory pass), so the
    scale applied here is exactly the f32 scale the GEMM output is divided by; a bf16-rounded
    scale would bias every product by up to 0.4%.
    """
    dtype = as_dtype(fmt)
    limit = fmax(dtype)
    x = x.astype(jnp.float32)
    y = x * scale.astype(jnp.float32)
    # Clip before the cast: a plain convert maps out-of-range values to NaN (E4M3) or Inf (E5M2).
    return saturate(y, jnp.isfinite(x), limit).astype(dtype)


def dequantize(q: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Map FP8 values back to ``dtype`` by dividing out ``scale``."""
    return (q.astype(jnp.float32) / scale.astype(jnp.float32)).astype(dtype)


def saturation_stats(x: jax.Array, scale: jax.Array, fmt) -> tuple[jax.Array, jax.Array]:
    """Return (share of values clipped at the format max, share of nonzeros flushed to zero)."""
    dtype = as_dtype(fmt)
    xs = jnp.abs(x.astype(jnp.float32) * scale.astype(jnp.float32))
    n = x.size
    if n == 0:
        return jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)
    # Clipped: past where round-to-nearest would still give the max (half a top-binade step
    # above it), so a tile's amax that its f32 scale rounds a hair past the max is not counted.
    saturated = jnp.sum(xs >= clip_threshold(dtype)) / n
    # Values below half the smallest subnormal round to zero in the cast.
    tiny = float(jnp.finfo(dtype).smallest_subnormal) / 2
    flushed = jnp.sum((xs > 0) & (xs < tiny)) / n
    return saturated.astype(jnp.float32), flushed.astype(jnp.float32)
