"""Fine-grained FP8 quantization: one scale per 1 x T tile along a row, or per T x T block.

A tile's scale comes from its own amax (``block_cast_kernels.tile_scales``, the kernels' rule
too: ``scaling.scale_from_amax``, ``fmax / (amax * 2**margin)``, optionally a power of two; an
all-zero tile, or one with an Inf or NaN, keeps scale 1), and ``q = saturate(x * scale)`` as in
``formats.quantize``: a non-finite element becomes NaN. The
GEMMs take the inverse scales (``inv = 1 / scale``, f32), one per tile, to dequantize with.

Rowwise scaling is the case T = the whole row. Sides that are not multiples of T end in a
partial tile, scaled by the amax of the elements it has (zero padding changes no amax).

``cast_transpose_tiles`` and ``cast_transpose_blocks`` write both GEMM layouts of an operand with
their scales in one pass: a Pallas kernel (``block_cast_kernels``) lowered to Triton on CUDA,
these references elsewhere, the same bits either way. ``cast_transpose_rows`` does so for the
rowwise recipe in two passes (``row_cast_kernels``: a row's scale needs the whole row first).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fp8jax.ops import (
    block_cast_kernels,
    cast_source,
    formats,
    kernels,
    row_cast_kernels,
    scaling,
)

__all__ = [
    "block_amaxes",
    "cast_transpose_blocks",
    "cast_transpose_rows",
    "cast_transpose_tiles",
    "dequantize_blocks",
    "dequantize_tiles",
    "quantize_blocks",
    "quantize_tiles",
    "requantizable_blocks",
    "split_tiles",
]


def _pad_to(x: jax.Array, axis: int, tile: int) -> jax.Array:
    pad = -x.shape[axis] % tile
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def split_tiles(x_MxK: jax.Array, tile: int) -> jax.Array:
    """``x`` as f32 [M, ceil(K / tile), tile], the last tile zero-padded."""
    m = x_MxK.shape[0]
    return _pad_to(x_MxK.astype(jnp.float32), 1, tile).reshape(m, -1, tile)


def quantize_tiles(
    x_MxK: jax.Array, fmt, tile: int, recipe: scaling.Recipe
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(q [M, K], inv [M, ceil(K / tile)], amax)``: 1 x ``tile`` tiles along the last axis.

    ``amax`` is the whole tensor's (non-finite tiles count 0): the per-tensor figure the FP8
    state's health report records.
    """
    m, k = x_MxK.shape
    x_MxTxt = split_tiles(x_MxK, tile)
    amax_MxT = jnp.max(block_cast_kernels.tile_abs(x_MxTxt), axis=-1)
    scale_MxT, inv_MxT = block_cast_kernels.tile_scales(amax_MxT, fmt, recipe)
    q = formats.quantize(x_MxTxt, scale_MxT[..., None], fmt).reshape(m, -1)[:, :k]
    return q, inv_MxT, scaling.sanitize_amax(block_cast_kernels.finite_max(amax_MxT))


def quantize_blocks(
    w_KxN: jax.Array, fmt, block: int, recipe: scaling.Recipe
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(q [K, N], inv [ceil(K / block), ceil(N / block)], amax)``: ``block`` x ``block`` tiles."""
    k, n = w_KxN.shape
    w_4d = _split_blocks(w_KxN, block)
    kb, _, nb, _ = w_4d.shape
    amax_KbxNb = jnp.max(block_cast_kernels.tile_abs(w_4d), axis=(1, 3))
    scale, inv_KbxNb = block_cast_kernels.tile_scales(amax_KbxNb, fmt, recipe)
    q = formats.quantize(w_4d, scale[:, None, :, None], fmt).reshape(kb * block, nb * block)
    return q[:k, :n], inv_KbxNb, scaling.sanitize_amax(block_cast_kernels.finite_max(amax_KbxNb))


def _split_blocks(w_KxN: jax.Array, block: int) -> jax.Array:
    """``w`` as f32 [ceil(K / block), block, ceil(N / block), block], the edge tiles zero-padded."""
    w = _pad_to(_pad_to(w_KxN.astype(jnp.float32), 0, block), 1, block)  # [K', N'] f32
    return w.reshape(w.shape[0] // block, block, w.shape[1] // block, block)


def block_amaxes(w_KxN: jax.Array, block: int) -> jax.Array:
    """Each ``block`` x ``block`` tile's amax, f32 [ceil(K / block), ceil(N / block)] (Inf for a
    tile with a non-finite element): what ``quantize_blocks`` scales each tile from."""
    return jnp.max(block_cast_kernels.tile_abs(_split_blocks(w_KxN, block)), axis=(1, 3))


def requantizable_blocks(
    q_KxN: jax.Array, inv_KbxNb: jax.Array, amax_KbxNb: jax.Array, block: int
) -> jax.Array:
    """An f32 weight whose ``quantize_blocks`` is ``(q, inv)`` bit for bit (any margin, powers of
    two or not), from ``quantize_blocks``' q and inv of a weight and its ``block_amaxes``.

    Each element is ``q * inv`` clipped to its tile's amax, and the elements holding their
    tile's largest |q| are set to +-amax: each tile's amax, hence its scale and inv, comes out as
    before, and every ``q * inv * scale`` is within a few f32 ulps of q, far inside half an FP8
    step, so it rounds back to q. (Dequantizing alone would move the amax by the rounding of
    ``max|q| * inv``, and the scale with it.)
    """
    k, n = q_KxN.shape

    def full(t_KbxNb):  # one value per tile, repeated over its elements
        return jnp.repeat(jnp.repeat(t_KbxNb, block, axis=0), block, axis=1)[:k, :n]

    q = q_KxN.astype(jnp.float32)
    amax = full(amax_KbxNb.astype(jnp.float32))
    w = jnp.clip(dequantize_blocks(q_KxN, inv_KbxNb, block), -amax, amax)
    abs_q = block_cast_kernels.tile_abs(q)
    top = full(block_amaxes(abs_q, block))  # the tile's largest |q|
    at_top = (abs_q == top) & jnp.isfinite(top) & (top > 0)
    return jnp.where(at_top, jnp.sign(q) * amax, w)


def dequantize_tiles(q_MxK: jax.Array, inv_MxT: jax.Array, tile: int) -> jax.Array:
    """``q * inv`` per 1 x ``tile`` tile, f32 (tests and references)."""
    inv = jnp.repeat(inv_MxT, tile, axis=1)[:, : q_MxK.shape[1]]
    return q_MxK.astype(jnp.float32) * inv


def dequantize_blocks(q_KxN: jax.Array, inv_KbxNb: jax.Array, block: int) -> jax.Array:
    """``q * inv`` per ``block`` x ``block`` tile, f32."""
    k, n = q_KxN.shape
    inv = jnp.repeat(jnp.repeat(inv_KbxNb, block, axis=0), block, axis=1)[:k, :n]
    return q_KxN.astype(jnp.float32) * inv


def _check_operand(x: jax.Array, fmt, name: str, dtypes: tuple) -> None:
    """One-line errors for a format, a rank or a dtype that a fused cast does not take."""
    formats.as_dtype(fmt)
    if x.ndim != 2:
        raise ValueError(f"{name} must be 2-D, got shape {x.shape}: reshape it to [rows, K] first")
    if jnp.dtype(x.dtype) not in tuple(map(jnp.dtype, dtypes)):
        names = " or ".join(jnp.dtype(d).name for d in dtypes)
        raise TypeError(f"{name} must be {names}, got {x.dtype}: cast it first")


def _check_cast(x: jax.Array, fmt, tile: int, name: str) -> None:
    """One-line errors for what the fused tile and block casts do not take."""
    _check_operand(x, fmt, name, (jnp.bfloat16, jnp.float16, jnp.float32))
    if not isinstance(tile, int) or tile < 16 or tile & (tile - 1):
        raise ValueError(f"FP8 tile must be a power of two >= 16, got {tile!r}: use 128")


def _dispatch(impl: str, x, takes: bool, reference, pallas):
    """``reference(x)`` or ``pallas(x, interpret)``, as ``kernels.cast_transpose`` picks (``x`` an
    array or a ``cast_source.Source``).

    'xla', and shapes the kernel does not take (``takes`` false: e.g. sides not whole tiles,
    tiles over ``block_cast_kernels.MAX_KERNEL_TILE``), run the reference; 'interpret' the
    kernel in Pallas' interpreter; 'pallas' (and 'auto' on GPUs) the Triton kernel when lowered
    for CUDA and the reference for any other platform.
    """
    impl = kernels.resolve_impl(impl)
    if impl == "xla" or not takes:
        return reference(x)
    if impl == "interpret":
        return pallas(x, True)
    return jax.lax.platform_dependent(x, cuda=lambda x: pallas(x, False), default=reference)


def _source(x, prologue: str | None) -> cast_source.Source:
    """``x`` as a source: an array (through ``prologue``) or a source as given, checked."""
    if isinstance(x, cast_source.Source):
        if prologue is not None:
            raise ValueError("give a cast source its activation itself, not as prologue")
        cast_source.check(x)
        return x
    return cast_source.plain(x, prologue)


def _with_sums(value_MxK: jax.Array, col_sums: bool) -> tuple:
    """The references' column sums of the quantized values, when asked for."""
    return (jnp.sum(value_MxK, axis=0),) if col_sums else ()


def cast_transpose_tiles(
    x_MxK,
    fmt,
    tile: int,
    recipe: scaling.Recipe,
    impl: str = kernels.AUTO,
    prologue: str | None = None,
    col_sums: bool = False,
) -> tuple[jax.Array, ...]:
    """``(q [M, K], inv [M, K/T], qt [K, M], inv_t [K, M/T], amax)`` of x in one pass.

    ``q, inv`` are ``quantize_tiles(x)``'s 1 x T tiles along K (the forward and dgrad operand),
    ``qt, inv_t`` are ``quantize_tiles(x.T)``'s: 1 x T tiles along M of x.T, T x 1 tiles of x
    (the wgrad operand). ``amax`` is ``quantize_tiles(x)``'s. ``fmt`` 'e4m3' or 'e5m2' (the
    recipe's format for x or dy); ``impl`` as in ``kernels.cast_transpose``. ``x`` is an array
    or a ``cast_source.Source`` (quantized as its f32 values); ``prologue`` (a name in
    ``activations.ACTIVATIONS``) casts ``act(x)`` in f32 instead, in the same pass. With
    ``col_sums`` the f32 column sums [K] of the quantized values come last.
    """
    src = _source(x_MxK, prologue)
    for a in src.mats:
        _check_cast(a, fmt, tile, "x_MxK")
    kernels.check_impl(impl)

    def reference(src):
        x = cast_source.evaluate(src)
        q, inv, amax = quantize_tiles(x, fmt, tile, recipe)
        qt, inv_t, _ = quantize_tiles(x.T, fmt, tile, recipe)
        return (q, inv, qt, inv_t, amax, *_with_sums(x, col_sums))

    return _dispatch(
        impl,
        src,
        block_cast_kernels.kernel_takes(src.shape, tile),
        reference,
        lambda src, interpret: block_cast_kernels.pallas_cast_transpose_tiles(
            src, fmt, tile, recipe, interpret, col_sums=col_sums
        ),
    )


def cast_transpose_blocks(
    w_KxN: jax.Array, fmt, block: int, recipe: scaling.Recipe, impl: str = kernels.AUTO
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``(q [K, N], qt [N, K], inv [K/B, N/B], amax)``: ``quantize_blocks(w)`` and q.T in one pass.

    A B x B block has one scale, so its transpose keeps its values: qt is q.T bit for bit (the
    forward GEMM takes w as [N, K], dgrad as [K, N]). ``impl`` as in ``kernels.cast_transpose``.
    """
    _check_cast(w_KxN, fmt, block, "w_KxN")
    kernels.check_impl(impl)

    def reference(w):
        q, inv, amax = quantize_blocks(w, fmt, block, recipe)
        return q, q.T, inv, amax

    return _dispatch(
        impl,
        w_KxN,
        block_cast_kernels.kernel_takes(w_KxN.shape, block),
        reference,
        lambda w, interpret: block_cast_kernels.pallas_cast_transpose_blocks(
            w, fmt, block, recipe, interpret
        ),
    )


def cast_transpose_rows(
    x_MxK,
    fmt,
    recipe: scaling.Recipe,
    impl: str = kernels.AUTO,
    prologue: str | None = None,
    col_sums: bool = False,
) -> tuple[jax.Array, ...]:
    """``(q [M, K], inv [M, 1], qt [K, M], inv_t [K, 1], amax, amax_t)``: x and x.T per row.

    ``q, inv, amax`` are ``quantize_tiles(x)``'s with one tile per row (along K), ``qt, inv_t,
    amax_t`` are ``quantize_tiles(x.T)``'s (one per column of x, along M): the rowwise recipe's
    two layouts of an operand. The kernels (``row_cast_kernels``) read x twice, once for the
    row and column amaxes and once for both FP8 copies; the references read it for each of x
    and x.T. ``x`` bfloat16, float16 or float32, or a ``cast_source.Source`` of them; ``fmt``
    'e4m3' or 'e5m2'; ``impl`` as in ``kernels.cast_transpose``; sides that are not multiples
    of 16 take the references. ``prologue`` (a name in ``activations.ACTIVATIONS``) casts
    ``act(x)`` in f32 instead: both kernels apply it to what they read. With ``col_sums`` the
    f32 column sums [K] of the quantized values come last.
    """
    src = _source(x_MxK, prologue)
    for a in src.mats:
        _check_operand(a, fmt, "x_MxK", (jnp.bfloat16, jnp.float16, jnp.float32))
    kernels.check_impl(impl)
    takes = row_cast_kernels.blocks(src.shape) is not None

    def reference(src):
        x = cast_source.evaluate(src)
        m, k = x.shape
        q, inv, amax = quantize_tiles(x, fmt, k, recipe)
        qt, inv_t, amax_t = quantize_tiles(x.T, fmt, m, recipe)
        return (q, inv, qt, inv_t, amax, amax_t, *_with_sums(x, col_sums))

    return _dispatch(
        impl,
        src,
        takes,
        reference,
        lambda src, interpret: row_cast_kernels.pallas_cast_transpose_rows(
            src, fmt, recipe, interpret, col_sums=col_sums
        ),
    )
