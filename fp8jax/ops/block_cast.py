"""Fine-grained FP8 quantization: one scale per 1 x T tile along a row, or per T x T block.

A tile's scale comes from its own amax (``scaling.scale_from_amax``: ``fmax / (amax *
2**margin)``, optionally a power of two; an all-zero or non-finite tile keeps scale 1), and
``q = saturate(x * scale)`` as in ``formats.quantize``: a non-finite element becomes NaN. The
GEMMs take the inverse scales (``inv = 1 / scale``, f32), one per tile, to dequantize with.

Rowwise scaling is the case T = the whole row. Sides that are not multiples of T end in a
partial tile, scaled by the amax of the elements it has (zero padding changes no amax).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from fp8jax.ops import formats, scaling


def num_tiles(n: int, tile: int) -> int:
    """Tiles of width ``tile`` covering ``n`` elements (the last one possibly partial)."""
    return max(1, math.ceil(n / tile))


def _pad_to(x: jax.Array, axis: int, tile: int) -> jax.Array:
    pad = -x.shape[axis] % tile
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def tile_scales(amax: jax.Array, fmt, recipe: scaling.Recipe) -> tuple[jax.Array, jax.Array]:
    """``(scale, inv)`` per tile from each tile's amax (any shape, f32)."""
    scale = scaling.scale_from_amax(amax, jnp.float32(1.0), fmt, recipe)
    return scale, (1.0 / scale).astype(jnp.float32)


def quantize_tiles(
    x_MxK: jax.Array, fmt, tile: int, recipe: scaling.Recipe
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(q [M, K], inv [M, ceil(K / tile)], amax)``: 1 x ``tile`` tiles along the last axis.

    ``amax`` is the whole tensor's (non-finite tiles count 0): the per-tensor figure the FP8
    state's health report records.
    """
    m, k = x_MxK.shape
    x = _pad_to(x_MxK.astype(jnp.float32), 1, tile)  # [M, K'] f32
    x_MxTxt = x.reshape(m, -1, tile)
    amax_MxT = jnp.max(jnp.abs(x_MxTxt), axis=-1)
    scale_MxT, inv_MxT = tile_scales(amax_MxT, fmt, recipe)
    q = formats.quantize(x_MxTxt, scale_MxT[..., None], fmt).reshape(m, -1)[:, :k]
    return q, inv_MxT, scaling.sanitize_amax(_finite_max(amax_MxT))


def quantize_blocks(
    w_KxN: jax.Array, fmt, block: int, recipe: scaling.Recipe
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(q [K, N], inv [ceil(K / block), ceil(N / block)], amax)``: ``block`` x ``block`` tiles."""
    k, n = w_KxN.shape
    w = _pad_to(_pad_to(w_KxN.astype(jnp.float32), 0, block), 1, block)  # [K', N'] f32
    kb, nb = w.shape[0] // block, w.shape[1] // block
    w_4d = w.reshape(kb, block, nb, block)
    amax_KbxNb = jnp.max(jnp.abs(w_4d), axis=(1, 3))
    scale, inv_KbxNb = tile_scales(amax_KbxNb, fmt, recipe)
    q = formats.quantize(w_4d, scale[:, None, :, None], fmt).reshape(kb * block, nb * block)
    return q[:k, :n], inv_KbxNb, scaling.sanitize_amax(_finite_max(amax_KbxNb))


def _finite_max(amax: jax.Array) -> jax.Array:
    """Max over the finite tile amaxes (0 if none): one Inf tile leaves the others' record."""
    return jnp.max(jnp.where(jnp.isfinite(amax), amax, 0.0))


def dequantize_tiles(q_MxK: jax.Array, inv_MxT: jax.Array, tile: int) -> jax.Array:
    """``q * inv`` per 1 x ``tile`` tile, f32 (tests and references)."""
    inv = jnp.repeat(inv_MxT, tile, axis=1)[:, : q_MxK.shape[1]]
    return q_MxK.astype(jnp.float32) * inv


def dequantize_blocks(q_KxN: jax.Array, inv_KbxNb: jax.Array, block: int) -> jax.Array:
    """``q * inv`` per ``block`` x ``block`` tile, f32 (tests and references)."""
    k, n = q_KxN.shape
    inv = jnp.repeat(jnp.repeat(inv_KbxNb, block, axis=0), block, axis=1)[:k, :n]
    return q_KxN.astype(jnp.float32) * inv
