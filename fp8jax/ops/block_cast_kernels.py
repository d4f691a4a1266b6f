"""Pallas kernels of the fine-grained casts: one read of a tensor, every per-tile output written.

``pallas_cast_transpose_tiles`` reads each [T, T] block of x [M, K] once and writes both GEMM
operands DeepSeek-V3's recipe takes from x (and dy): q [M, K] with one scale per 1 x T tile
along K (the forward / dgrad operand) and qt [K, M] with one scale per T x 1 tile of x, i.e. per
1 x T tile along M of x.T (the wgrad operand), with both inverse-scale arrays and the tensor's
amax. ``pallas_cast_transpose_blocks`` does the same for a weight's T x T blocks: one scale per
block, so the transpose keeps the values and qt is q.T.

The arithmetic is ``block_cast``'s references' (``scaling.scale_from_amax``: scale 1 for a zero
or non-finite tile amax; ``formats.saturate``), so the interpreted kernel gives their bits. On
the GPU both sides divide with PTX ``div.full.f32``: XLA lowers an f32 division to it, and so
does Triton. A tile's amax takes Inf for any non-finite element before the max, so whether the
backend's max propagates NaN changes nothing (``tile_abs``, the references' rule too).

The tiles kernel quantizes a ``cast_source.Source``: x itself, an MLP's activation of its
pre-activation, or that activation's gradient, evaluated in f32 on each block it reads, so those
values are never written out; on the GPU an activation's tanh is ``kernels.kernel_tanh``'s
approximation. With ``col_sums`` it also writes each block's column sums (a bias gradient's),
added over the block rows in XLA.

A block is held whole in registers, so the kernels take tiles up to ``MAX_KERNEL_TILE``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from fp8jax.ops import cast_source, formats, kernels, scaling

__all__ = [
    "MAX_KERNEL_TILE",
    "finite_max",
    "kernel_takes",
    "pallas_cast_transpose_blocks",
    "pallas_cast_transpose_tiles",
    "tile_abs",
    "tile_scales",
]

MAX_KERNEL_TILE = 128  # a [T, T] f32 block in registers: 64 KiB at T = 128
# Warps per [128, 128] block, the fastest of 4, 8, 16 on an H200 (x [16384, 2048] bf16, w
# [2048, 8192] bf16): the tiles kernel keeps two scaled copies live, the blocks kernel one. A
# tiles source of more operands than one tensor (an activation's gradient: [16384, 8192]) takes
# 8: with 4 its blocks spill (four times slower).
_TILES_WARPS, _SOURCE_WARPS, _BLOCKS_WARPS = 4, 8, 8


def kernel_takes(shape: tuple[int, ...], tile: int) -> bool:
    """Whether the kernels take a 2-D ``shape`` with ``tile``: both sides whole tiles, none empty.

    ``tile`` is a power of two >= 16, so whole tiles are whole Triton blocks.
    """
    return (
        len(shape) == 2 and tile <= MAX_KERNEL_TILE and all(n > 0 and n % tile == 0 for n in shape)
    )


def tile_scales(amax, fmt, recipe: scaling.Recipe) -> tuple[jax.Array, jax.Array]:
    """``(scale, inv)`` per tile from each tile's amax (any shape, f32; usable in a kernel)."""
    scale = scaling.scale_from_amax(amax, jnp.float32(1.0), fmt, recipe)
    return scale, (1.0 / scale).astype(jnp.float32)


def tile_abs(x: jax.Array) -> jax.Array:
    """``|x|`` with Inf for every non-finite element: a tile's max is non-finite exactly when the
    tile has one, whatever a backend's max does with NaN (vectorized CPU maxima drop it)."""
    return jnp.where(jnp.isfinite(x), jnp.abs(x), jnp.inf)


def finite_max(amax: jax.Array) -> jax.Array:
    """Max over the finite tile amaxes (0 if none): one Inf or NaN tile leaves the others'
    record of the tensor's amax."""
    return jnp.max(jnp.where(jnp.isfinite(amax), amax, 0.0))


def _record(amax_ref, tile_amax):
    """Max the finite tile amaxes of this block into ``amax_ref[0]`` (atomic on the GPU; the
    interpreter discharges it into a plain max)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    block_max = finite_max(tile_amax)
    plt.atomic_max(amax_ref, (pl.ds(0, 1),), jnp.full((1,), block_max, jnp.float32))


def _tiles_kernel(*refs, src, tanh, fmt, recipe, sums: bool):
    dtype, limit = formats.as_dtype(fmt), formats.fmax(fmt)
    x_TxT, refs = cast_source.evaluate_block(src, refs, tanh)  # block (i, j), read once
    _amax_in, q_ref, inv_ref, qt_ref, inv_t_ref, *sum_ref, amax_ref = refs
    abs_TxT = tile_abs(x_TxT)
    # Row r's amax over this block's K slice: the 1 x T tile (r, j) of q. Column c's over its M
    # slice: the T x 1 tile of x that is tile (c, i) of x.T.
    amax_row_T, amax_col_T = jnp.max(abs_TxT, axis=1), jnp.max(abs_TxT, axis=0)
    scale_row_T, inv_row_T = tile_scales(amax_row_T, fmt, recipe)
    scale_col_T, inv_col_T = tile_scales(amax_col_T, fmt, recipe)
    inv_ref[...] = inv_row_T  # column j of inv [M, K/T], rows of block i
    inv_t_ref[...] = inv_col_T  # column i of inv_t [K, M/T], rows of block j
    finite_TxT = jnp.isfinite(x_TxT)
    # f32 multiply and clip before the narrow cast, as formats.quantize: out-of-range values
    # saturate, Inf and NaN become NaN. Cast to the FP8 format first, then transpose a quarter of
    # the bytes through shared memory.
    y_TxT = formats.saturate(x_TxT * scale_row_T[:, None], finite_TxT, limit)
    q_ref[...] = y_TxT.astype(dtype)
    yt_TxT = formats.saturate(x_TxT * scale_col_T[None, :], finite_TxT, limit)
    qt_ref[...] = yt_TxT.astype(dtype).T
    if sums:  # this block's column sums: row i of the [M / T, K] partial sums
        sum_ref[0][...] = jnp.sum(x_TxT, axis=0)
    _record(amax_ref, amax_row_T)  # the tensor's amax is over q's (1 x T) tiles


def _blocks_kernel(w_ref, _amax_in, q_ref, qt_ref, inv_ref, amax_ref, *, fmt, recipe):
    dtype, limit = formats.as_dtype(fmt), formats.fmax(fmt)
    w_TxT = w_ref[...].astype(jnp.float32)  # block (i, j) of w, read once
    amax_1x1 = jnp.max(tile_abs(w_TxT), keepdims=True)
    scale_1x1, inv_1x1 = tile_scales(amax_1x1, fmt, recipe)
    inv_ref[...] = inv_1x1
    # One scale for the block: its transpose is the same FP8 values, transposed.
    q_TxT = formats.saturate(w_TxT * scale_1x1, jnp.isfinite(w_TxT), limit).astype(dtype)
    q_ref[...] = q_TxT
    qt_ref[...] = q_TxT.T
    _record(amax_ref, amax_1x1)


def _call(kernel, src: cast_source.Source, tile, interpret, num_warps, in_out):
    """``pallas_call`` of ``kernel`` over the [tile, tile] blocks of ``src``: its operands, then
    the amax target (aliased), then ``in_out``'s outputs and the amax."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    (m, k), t = src.shape, tile
    whole = pl.BlockSpec((1,), lambda i, j: (0,))
    specs, shapes = zip(*in_out(pl, m, k, t), strict=True)
    return pl.pallas_call(
        kernel,
        grid=(m // t, k // t),
        in_specs=[*cast_source.block_specs(src, t, t), whole],
        out_specs=[*specs, whole],
        out_shape=[*shapes, jax.ShapeDtypeStruct((1,), jnp.float32)],
        input_output_aliases={len(src.operands): len(specs)},
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1),
        name=kernel.func.__name__.strip("_"),
    )(*src.operands, jnp.zeros((1,), jnp.float32))


def pallas_cast_transpose_tiles(
    src: cast_source.Source,
    fmt,
    tile: int,
    recipe: scaling.Recipe,
    interpret: bool,
    num_warps: int | None = None,
    col_sums: bool = False,
) -> tuple[jax.Array, ...]:
    """``(q [M, K], inv [M, K/T], qt [K, M], inv_t [K, M/T], amax)`` of the source's values, one
    kernel; with ``col_sums`` also their column sums (f32 [K]).

    Sides must be multiples of ``tile`` (``kernel_takes``); ``block_cast.cast_transpose_tiles``
    routes the others to the references.
    """
    if num_warps is None:
        num_warps = _TILES_WARPS if len(src.operands) == 1 else _SOURCE_WARPS
    dtype, t = formats.as_dtype(fmt), tile
    tanh = kernels.kernel_tanh(interpret)
    kernel = functools.partial(
        _tiles_kernel, src=src, tanh=tanh, fmt=fmt, recipe=recipe, sums=col_sums
    )

    def in_out(pl, m, k, t):
        f32 = jnp.float32
        out = [
            (pl.BlockSpec((t, t), lambda i, j: (i, j)), jax.ShapeDtypeStruct((m, k), dtype)),
            (
                pl.BlockSpec((t, pl.squeezed), lambda i, j: (i, j)),
                jax.ShapeDtypeStruct((m, k // t), f32),
            ),
            (pl.BlockSpec((t, t), lambda i, j: (j, i)), jax.ShapeDtypeStruct((k, m), dtype)),
            (
                pl.BlockSpec((t, pl.squeezed), lambda i, j: (j, i)),
                jax.ShapeDtypeStruct((k, m // t), f32),
            ),
        ]
        if col_sums:
            out.append(
                (
                    pl.BlockSpec((pl.squeezed, t), lambda i, j: (i, j)),
                    jax.ShapeDtypeStruct((m // t, k), f32),
                )
            )
        return out

    q, inv, qt, inv_t, *sums, amax = _call(kernel, src, t, interpret, num_warps, in_out)
    # The partial sums of the [M / T] block rows, added in a fixed order.
    return (q, inv, qt, inv_t, amax[0], *(jnp.sum(p, axis=0) for p in sums))


def pallas_cast_transpose_blocks(
    w_KxN: jax.Array,
    fmt,
    block: int,
    recipe: scaling.Recipe,
    interpret: bool,
    num_warps: int = _BLOCKS_WARPS,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``(q [K, N], qt [N, K], inv [K/B, N/B], amax)`` of w, one kernel (sides multiples of
    ``block``, as ``kernel_takes``)."""
    dtype = formats.as_dtype(fmt)
    kernel = functools.partial(_blocks_kernel, fmt=fmt, recipe=recipe)

    def in_out(pl, k, n, b):
        return [
            (pl.BlockSpec((b, b), lambda i, j: (i, j)), jax.ShapeDtypeStruct((k, n), dtype)),
            (pl.BlockSpec((b, b), lambda i, j: (j, i)), jax.ShapeDtypeStruct((n, k), dtype)),
            (
                pl.BlockSpec((1, 1), lambda i, j: (i, j)),
                jax.ShapeDtypeStruct((k // b, n // b), jnp.float32),
            ),
        ]

    src = cast_source.plain(w_KxN)
    q, qt, inv, amax = _call(kernel, src, block, interpret, num_warps, in_out)
    return q, qt, inv, amax[0]
