"""The block-scaled grouped GEMM of expert layers (DeepSeek-V3's tiles) on the padded layout.

``ops.grouped``'s grouped GEMM under the block recipe with 128-wide tiles, where K and N are
whole tiles: the rows go into ``grouped_mgpu``'s padded layout (each group's rows start at a
multiple of 128), so every 128-row tile of x and dy lies in one group, and the three GEMMs run
block-scaled, promoting each 128-wide slice of the contraction into an f32 accumulator:

========  ==============================================================================
GEMM      operands (E4M3 x and w; dy in the recipe's ``dy_format``)
========  ==============================================================================
fwd       x 1 x 128 along K; w 128 x 128 blocks per group, read as w^T [N, K]
dgrad     dy 1 x 128 along N; w's blocks, read as stored [K, N]
wgrad     x^T and dy^T 1 x 128 along the rows (128 x 1 tiles of x and dy), per group over
          the tiles of rows it holds: no tile spans two experts
========  ==============================================================================

On a Hopper GPU the GEMMs are ``block_gemm_mgpu``'s grouped Mosaic GPU kernels (the rows of a
tile pick their expert's weight from the layout's table; wgrad walks each group's tiles of
rows); elsewhere XLA's ``ragged_dot_general`` on the dequantized values, the reference. The
state keeps per-tensor amaxes for health reporting only, as for every tiled recipe.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from fp8jax.ops import block_cast, block_gemm_mgpu, formats, grouped, grouped_mgpu, kernels, scaling
from fp8jax.ops.gemm import GemmConfig
from fp8jax.ops.remat import FP8_OUT, FP8_W, FP8_X
from fp8jax.ops.scaling import Fp8Meta

__all__ = [
    "TILE",
    "block_grouped_matmul",
    "padded_gemm",
    "padded_kernel",
    "padded_reference",
    "takes",
]

TILE = grouped_mgpu.TILE  # the block width, the padded layout's row tile and the kernels' tile


def takes(recipe: scaling.Recipe, x_MxK: jax.Array, w_GxKxN: jax.Array) -> bool:
    """Whether ``recipe``'s grouped GEMM of x and w runs here: blocks of ``TILE``
    (``Recipe.pads_grouped_rows``) and K and N whole tiles, kernels not turned off."""
    return recipe.pads_grouped_rows and grouped.padded(x_MxK, w_GxKxN)


def padded_reference(kind: str, a, a_inv, b, b_inv, lay: grouped_mgpu.Layout, out_dtype):
    """``padded_gemm`` in XLA ops: ``grouped.fp8_grouped_gemm`` on the dequantized operands
    (FP8 values times their tile's multiplier, f32) over the layout's padded group sizes."""
    sizes_G = grouped.padded_sizes(lay)
    a_f = block_cast.dequantize_tiles(a, a_inv, TILE)
    if kind == grouped.WGRAD:
        b_f = block_cast.dequantize_tiles(b, b_inv, TILE)
        return grouped.fp8_grouped_gemm(grouped.WGRAD, a_f.T, b_f.T, sizes_G, 1.0, out_dtype)
    b_f = jax.vmap(lambda q, inv: block_cast.dequantize_blocks(q, inv, TILE))(b, b_inv)
    # a [R, C] . b[g]^T with b [G, N, C]: dgrad's contraction (b's last axis) for both kinds.
    return grouped.fp8_grouped_gemm(grouped.DGRAD, a_f, b_f, sizes_G, 1.0, out_dtype)


def padded_kernel(kind: str, a, a_inv, b, b_inv, lay: grouped_mgpu.Layout, out_dtype):
    """``padded_gemm`` on ``block_gemm_mgpu``'s grouped kernels (multipliers transposed, b's
    blocks repeated per row, as the kernels read them)."""
    out_dtype = jnp.dtype(out_dtype)
    if kind == grouped.WGRAD:
        return block_gemm_mgpu.grouped_tn(
            a, a_inv.T, b, b_inv.T, lay.first_tile_G, lay.tiles_G, out_dtype=out_dtype
        )
    b_s_GxTxN = jnp.swapaxes(jnp.repeat(b_inv, TILE, axis=1), 1, 2)  # one per row of b
    return block_gemm_mgpu.grouped_nt(
        a, a_inv.T, b, b_s_GxTxN, lay.tile_group_T, out_dtype=out_dtype
    )


def padded_gemm(kind: str, a, a_inv, b, b_inv, lay: grouped_mgpu.Layout, out_dtype) -> jax.Array:
    """One block-scaled grouped GEMM on the padded layout, in ``out_dtype``:

    * ``FORWARD``, ``DGRAD``: a [R, C] in 1 x 128 tiles (``a_inv`` [R, C / 128]) times its
      rows' group of b [G, N, C] in 128 x 128 blocks (``b_inv`` [G, N / 128, C / 128]) -> [R, N]
    * ``WGRAD``: a = x^T [K, R] and b = dy^T [N, R] in 1 x 128 tiles along the rows (``a_inv``
      [K, R / 128], ``b_inv`` [N, R / 128]), contracted per group -> [G, K, N]

    The Hopper kernels on CUDA (where WGMMA takes the pair of formats), the reference elsewhere.
    """
    args = (a, a_inv, b, b_inv, lay)
    reference = functools.partial(padded_reference, kind, out_dtype=out_dtype)
    if a.dtype != b.dtype and not grouped_mgpu.mixed_fp8():
        return reference(*args)  # no f16 copy fits the kernel's 128-byte FP8 tiles
    kernel = functools.partial(padded_kernel, kind, out_dtype=out_dtype)
    return jax.lax.platform_dependent(*args, cuda=kernel, default=reference)


def _fwd_impl(cfg: GemmConfig, x, w, gs, meta: Fp8Meta, given):
    recipe = meta.x.recipe
    lay = given if given is not None else grouped_mgpu.layout(gs, x.shape[0])
    if given is None:  # rows past the groups are dropped; each group starts at a tile
        x = grouped_mgpu.pad_rows(x, lay)
    # E4M3 x (activations: precision before range; each tile's scale gives the range) in
    # 1 x 128 tiles along K for this GEMM and 128 x 1 along the rows for wgrad's x^T.
    xq, x_inv, xq_t, xt_inv, amax_x = block_cast.cast_transpose_tiles(
        x, formats.E4M3, TILE, recipe, kernels.AUTO
    )
    # E4M3 w (weights: precision before range) in 128 x 128 blocks per expert, which serve the
    # forward (as w^T [N, K]) and dgrad (as stored) alike.
    cast = lambda w_KxN: block_cast.cast_transpose_blocks(  # noqa: E731
        w_KxN, formats.E4M3, TILE, recipe, kernels.AUTO
    )
    wq, wq_t, w_inv, amax_G = jax.vmap(cast)(w)
    y = padded_gemm(grouped.FORWARD, xq, x_inv, wq_t, jnp.swapaxes(w_inv, 1, 2), lay, cfg.out_dtype)
    y = grouped.from_layout(y, lay, given is not None)
    # Residuals named for remat policies (ops.remat): wgrad's x^T and dgrad's w, FP8.
    x_saved = checkpoint_name((xq_t, xt_inv), FP8_X)
    w_saved = checkpoint_name((wq, w_inv), FP8_W)
    y = checkpoint_name(y, FP8_OUT)
    new_meta = meta.replace(
        x=scaling.record(meta.x, amax_x), w=scaling.record(meta.w, jnp.max(amax_G))
    )
    own = None if given is not None else lay  # the layout built here (the given one is kept)
    return y, new_meta, (x_saved, w_saved, own, given)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def block_grouped_matmul(
    cfg: GemmConfig, x_MxK, w_GxKxN, group_sizes_G, meta: Fp8Meta, layout=None
):
    """``(y [M, N], meta with x's and w's amax)``: the grouped GEMM under 128-wide block
    scales on the padded layout (``layout``: x's rows already in it, as ``grouped_matmul``
    takes them; else built here and y returned in the sorted rows)."""
    y, new_meta, _ = _fwd_impl(cfg, x_MxK, w_GxKxN, group_sizes_G, meta, layout)
    return y, new_meta


def _fwd(cfg: GemmConfig, x, w, gs, meta: Fp8Meta, layout):
    y, new_meta, res = _fwd_impl(cfg, x, w, gs, meta, layout)
    return (y, new_meta), (*res, meta)


def _bwd(cfg: GemmConfig, res, cts):
    (xq_t, xt_inv), (wq, w_inv), own, given, meta = res
    lay = own if given is None else given
    g, ct_meta = cts  # g [M, N] (or [R, N] in a given layout, 0 in its padding rows)
    if given is None:
        g = grouped_mgpu.pad_rows(g, lay)
    # dy in the recipe's dy format: 1 x 128 tiles along N for dgrad, 128 x 1 along the rows
    # for wgrad (its tiles, like x's, within one group).
    gq, g_inv, gq_t, gt_inv, amax_g = block_cast.cast_transpose_tiles(
        g, meta.dy.fmt, TILE, meta.x.recipe, kernels.AUTO
    )
    dx = padded_gemm(grouped.DGRAD, gq, g_inv, wq, w_inv, lay, cfg.x_dtype)  # [R, K]
    dx = grouped.from_layout(dx, lay, given is not None)
    dw = padded_gemm(grouped.WGRAD, xq_t, xt_inv, gq_t, gt_inv, lay, cfg.w_dtype)  # [G, K, N]
    return dx, dw, None, grouped.meta_cotangent(meta, ct_meta, amax_g), None


block_grouped_matmul.defvjp(_fwd, _bwd)
