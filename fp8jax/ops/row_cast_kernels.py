"""Pallas kernels of the rowwise cast: both GEMM layouts of an operand, one scale per row of each.

The rowwise recipe quantizes x [M, K] per row along K (the forward / dgrad operand) and x.T per
row along M, i.e. x per column (the wgrad operand). A row's scale needs the whole row's amax, so
one pass cannot both find the scales and apply them; two passes over x do it:

1. ``pallas_row_col_amax`` reads each [bm, bk] block of x once and maxes its rows' and columns'
   maxima into the row and column amaxes (atomic on the GPU: max is exact in any order).
2. ``pallas_cast_rows_cols`` reads x once more and writes q [M, K] (x times its row scales) and
   qt [K, M] (x times its column scales, transposed) in FP8, with both inverse-scale vectors.

Pass 2 computes each block's scales from those amaxes with ``block_cast_kernels.tile_scales``,
the references' own ops on the same values (dividing as XLA does on the GPU), then multiplies,
saturates and casts as ``formats.quantize``. So the kernels give ``block_cast.quantize_tiles``'
bits for x and x.T with one tile per row. What they quantize is a ``cast_source.Source``: x
itself, an MLP's activation of its pre-activation, or that activation's gradient. Both passes
read the source's operands and evaluate it in f32 on each block, so its values are never
written out; on the GPU an activation's tanh is ``kernels.kernel_tanh``'s approximation. With
``col_sums`` the first pass also writes each block's column sums (a bias gradient's), added
over the block rows in XLA. ``tile_abs`` maps every non-finite element to Inf before a max: a
row or column with one keeps scale 1 and its non-finite elements come out NaN.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from fp8jax.ops import block_cast_kernels, cast_source, formats, kernels, scaling

__all__ = [
    "COL_BLOCKS",
    "ROW_BLOCKS",
    "blocks",
    "default_tuning",
    "pallas_cast_rows_cols",
    "pallas_cast_transpose_rows",
    "pallas_row_col_amax",
]

# Power-of-two Triton blocks that divide a side; fp8jax pads GEMM sides to 16. Default tunings
# (the fastest of 64/32/128 rows x 64/128/256 columns and 4 or 8 warps on an H200, for
# gpt_1b3's [16384, 8192] MLP activation): 64 x 128 blocks with 8 warps for a tensor alone
# (4 with an activation), 64 x 64 with 4 warps for a source of more operands.
ROW_BLOCKS, COL_BLOCKS = (64, 32, 16), (128, 64, 32, 16)


def blocks(shape: tuple[int, ...]) -> tuple[int, int] | None:
    """``(bm, bk)``: the largest ``ROW_BLOCKS`` x ``COL_BLOCKS`` block that tiles a 2-D ``shape``,
    or None where none does (a side not a multiple of 16, or empty): the references' shapes."""
    if len(shape) != 2 or 0 in shape:
        return None
    bm = next((b for b in ROW_BLOCKS if shape[0] % b == 0), None)
    bk = next((b for b in COL_BLOCKS if shape[1] % b == 0), None)
    return None if bm is None or bk is None else (bm, bk)


def default_tuning(src: cast_source.Source) -> tuple[int, int, int, int]:
    """``(bm, bk, amax warps, cast warps)`` for ``src`` (the measured defaults above)."""
    if blocks(src.shape) is None:
        raise ValueError(f"x_MxK sides must be multiples of 16, got shape {src.shape}")
    bm, bk = blocks(src.shape)
    if len(src.operands) > 1:
        return bm, min(bk, 64), 4, 4
    with_act = src.fn is not cast_source.identity
    return (bm, bk, 4, 4) if with_act else (bm, bk, 8, 8)


def _params(num_warps: int):
    from jax.experimental.pallas import triton as plt

    return plt.CompilerParams(num_warps=num_warps, num_stages=1)


def _amax_kernel(*refs, src, tanh, sums: bool):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    x_bxk, refs = cast_source.evaluate_block(src, refs, tanh)  # block (i, j), read once
    _row_in, _col_in, row_ref, col_ref, *sum_ref = refs
    abs_bxk = block_cast_kernels.tile_abs(x_bxk)
    bm, bk = abs_bxk.shape
    # Rows of block row i over block column j's K slice, columns of block column j over block
    # row i's M slice: maxed into their amaxes (atomic on the GPU, a plain max interpreted).
    plt.atomic_max(row_ref, (pl.ds(0, bm),), jnp.max(abs_bxk, axis=1))
    plt.atomic_max(col_ref, (pl.ds(0, bk),), jnp.max(abs_bxk, axis=0))
    if sums:  # this block's column sums: row i of the [M / bm, K] partial sums
        sum_ref[0][...] = jnp.sum(x_bxk, axis=0)


def pallas_row_col_amax(
    src: cast_source.Source,
    bm: int,
    bk: int,
    interpret: bool,
    num_warps: int = 4,
    col_sums: bool = False,
) -> tuple[jax.Array, ...]:
    """``(amax_M, amax_K)`` f32: each row's and each column's max ``tile_abs`` of the source's
    values, one read of its operands; with ``col_sums`` also each column's sum (f32 [K])."""
    from jax.experimental import pallas as pl

    m, k = src.shape
    rows, cols = cast_source.vector_specs(bm, bk)
    f32 = jnp.float32
    kernel = functools.partial(
        _amax_kernel, src=src, tanh=kernels.kernel_tanh(interpret), sums=col_sums
    )
    n_in = len(src.operands)
    out_specs = [rows, cols]
    out_shape = [jax.ShapeDtypeStruct((m,), f32), jax.ShapeDtypeStruct((k,), f32)]
    if col_sums:
        out_specs.append(pl.BlockSpec((pl.squeezed, bk), lambda i, j: (i, j)))
        out_shape.append(jax.ShapeDtypeStruct((m // bm, k), f32))
    out = pl.pallas_call(
        kernel,
        grid=(m // bm, k // bk),
        in_specs=[*cast_source.block_specs(src, bm, bk), rows, cols],
        out_specs=out_specs,
        out_shape=out_shape,
        # The amaxes start at zero and are maxed in place.
        input_output_aliases={n_in: 0, n_in + 1: 1},
        interpret=interpret,
        compiler_params=_params(num_warps),
        name="fp8_row_col_amax",
    )(*src.operands, jnp.zeros((m,), f32), jnp.zeros((k,), f32))
    if col_sums:  # the partial sums of the [M / bm] block rows, added in a fixed order
        return out[0], out[1], jnp.sum(out[2], axis=0)
    return out[0], out[1]


def _cast_kernel(*refs, src, tanh, fmt, recipe):
    dtype, limit = formats.as_dtype(fmt), formats.fmax(fmt)
    x_bxk, refs = cast_source.evaluate_block(src, refs, tanh)  # block (i, j), read once
    a_row_ref, a_col_ref, q_ref, qt_ref, inv_row_ref, inv_col_ref = refs
    finite_bxk = jnp.isfinite(x_bxk)
    # This block's rows' and columns' scales from their amaxes; every program of a block row
    # (column) writes the same inverse scales.
    s_row, inv_row_ref[...] = block_cast_kernels.tile_scales(a_row_ref[...], fmt, recipe)
    s_col, inv_col_ref[...] = block_cast_kernels.tile_scales(a_col_ref[...], fmt, recipe)
    # FP8 (E4M3 for x and w, the grad format for dy) of x scaled per row for q, per column for
    # qt. f32 multiply and clip before the narrow cast, as formats.quantize: out-of-range values
    # saturate, Inf and NaN become NaN.
    q_ref[...] = formats.saturate(x_bxk * s_row[:, None], finite_bxk, limit).astype(dtype)
    yt_bxk = formats.saturate(x_bxk * s_col[None, :], finite_bxk, limit)
    qt_ref[...] = yt_bxk.astype(dtype).T  # cast first: a quarter of the bytes to transpose


def pallas_cast_rows_cols(
    src: cast_source.Source,
    amax_M: jax.Array,
    amax_K: jax.Array,
    fmt,
    recipe: scaling.Recipe,
    bm: int,
    bk: int,
    interpret: bool,
    num_warps: int = 4,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``(q [M, K], qt [K, M], inv_M, inv_K)``: ``saturate(a * scale_M[:, None])`` and
    ``saturate(a * scale_K[None, :]).T`` cast to ``fmt`` with ``scale_M, inv_M`` and ``scale_K,
    inv_K`` the ``tile_scales`` of ``amax_M`` and ``amax_K``, ``a`` the source's values, one
    read of its operands."""
    from jax.experimental import pallas as pl

    m, k = src.shape
    dtype = formats.as_dtype(fmt)
    tanh = kernels.kernel_tanh(interpret)
    kernel = functools.partial(_cast_kernel, src=src, tanh=tanh, fmt=fmt, recipe=recipe)
    rows, cols = cast_source.vector_specs(bm, bk)
    f32 = jnp.float32
    return pl.pallas_call(
        kernel,
        grid=(m // bm, k // bk),
        in_specs=[*cast_source.block_specs(src, bm, bk), rows, cols],
        out_specs=[
            pl.BlockSpec((bm, bk), lambda i, j: (i, j)),
            pl.BlockSpec((bk, bm), lambda i, j: (j, i)),
            rows,
            cols,
        ],
        out_shape=[
            jax.ShapeDtypeStruct((m, k), dtype),
            jax.ShapeDtypeStruct((k, m), dtype),
            jax.ShapeDtypeStruct((m,), f32),
            jax.ShapeDtypeStruct((k,), f32),
        ],
        interpret=interpret,
        compiler_params=_params(num_warps),
        name="fp8_cast_rows_cols",
    )(*src.operands, amax_M.astype(f32), amax_K.astype(f32))


def pallas_cast_transpose_rows(
    src: cast_source.Source,
    fmt,
    recipe: scaling.Recipe,
    interpret: bool,
    tuning: tuple[int, int, int, int] | None = None,
    col_sums: bool = False,
) -> tuple[jax.Array, ...]:
    """``(q [M, K], inv [M, 1], qt [K, M], inv_t [K, 1], amax, amax_t)`` of the source's values,
    two kernels; with ``col_sums`` also their column sums (f32 [K], from the first kernel).

    As ``block_cast.cast_transpose_rows``. ``tuning``: ``(bm, bk, amax warps, cast warps)``,
    default ``default_tuning(src)``; sides must be multiples of bm and bk.
    """
    if tuning is None:
        tuning = default_tuning(src)
    bm, bk, amax_warps, cast_warps = tuning
    amax_M, amax_K, *sums = pallas_row_col_amax(src, bm, bk, interpret, amax_warps, col_sums)
    q, qt, inv_M, inv_K = pallas_cast_rows_cols(
        src, amax_M, amax_K, fmt, recipe, bm, bk, interpret, cast_warps
    )
    amax, amax_t = (
        scaling.sanitize_amax(block_cast_kernels.finite_max(a)) for a in (amax_M, amax_K)
    )
    return (q, inv_M[:, None], qt, inv_K[:, None], amax, amax_t, *sums)
