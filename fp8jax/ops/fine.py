"""FP8 matmul under fine-grained scales (``RowwiseScaling``, ``BlockScaling``), with its VJP.

Each GEMM quantizes its operands along its own contraction axis, with scales from this call's
values (no history):

============  =========================================  ==========================================
GEMM          rowwise                                    block (T = ``block_size``)
============  =========================================  ==========================================
fwd  x . w    x per row (along K), w per column           x 1 x T along K, w T x T
dgrad dy . wT dy per row (along N), w per row (along N)   dy 1 x T along N, w T x T (the same q)
wgrad xT . dy x per column, dy per column (along M)       x T x 1, dy T x 1 (along M)
============  =========================================  ==========================================

Rowwise scales factor out of the contraction: an FP8 GEMM runs on the quantized operands and its
output is multiplied by the row and column inverse scales, in cuBLASLt's epilogue where its
vector scales are available (``ops.cublaslt``, Hopper), else by XLA after a per-tensor FP8 GEMM.
Block scales along K do not: ``block_gemm.block_scaled_dot`` rescales each T-wide partial
product into an f32 accumulator. x and w are E4M3 (precision); dy is the recipe's
``grad_format``, E4M3 by default, since per-row or per-tile scales follow a gradient's range.
Each operand's two layouts come from one ``block_cast`` call (``cast_transpose_rows``,
``cast_transpose_tiles``, ``cast_transpose_blocks``): fused Pallas kernels on CUDA GPUs
(``GemmConfig.cast``), the XLA references elsewhere, the same bits either way.

The FP8 state keeps per-tensor amaxes for health reporting only (recorded as under current
scaling); the scales themselves are never stored.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from fp8jax.ops import (
    block_cast,
    block_cast_kernels,
    cublaslt,
    formats,
    gemm,
    scaling,
)
from fp8jax.ops.gemm import GemmConfig
from fp8jax.ops.remat import FP8_OUT, FP8_W, FP8_X
from fp8jax.ops.scaling import Fp8Meta

__all__ = [
    "Out",
    "check_recipes",
    "check_unbatched",
    "fine_matmul",
    "out_rowwise",
    "rowwise_gemm",
    "saturation_stats",
]


def check_recipes(meta: Fp8Meta) -> scaling.Recipe:
    """The fine recipe of ``meta``; one clear error if x, w and dy do not share it."""
    names = sorted(s.recipe.name for s in (meta.x, meta.w, meta.dy))
    if len(set(names)) != 1:
        raise ValueError(
            f"fp8jax: a rowwise or block recipe scales x, w and dy alike, got recipes {names}: "
            f"leave w_recipe unset with fine-grained scaling"
        )
    return meta.x.recipe


def check_unbatched(recipe: scaling.Recipe, batched: bool) -> None:
    """Fine recipes tile one GEMM per call: a batched dot_general is one clear error."""
    if batched:
        raise ValueError(
            f"fp8jax.dot_general: the {recipe.name!r} recipe tiles plain GEMMs "
            f"and cannot tile batch dimensions: use recipe 'delayed' or 'current' for batched "
            f"einsums"
        )


def _scaled(y_MxN, inv_rows_M1, inv_cols_N1, dtype):
    """A rowwise GEMM's output times its row and column inverse scales, in f32."""
    return (y_MxN.astype(jnp.float32) * inv_rows_M1 * inv_cols_N1[:, 0][None, :]).astype(dtype)


class Out(NamedTuple):
    """A GEMM's output and what unscales it: ``y * inv_M[:, None] * inv_N[None, :]`` (rowwise,
    with ``raw``) or ``y`` itself (both None: unscaled already)."""

    y: jax.Array
    inv_M: jax.Array | None = None
    inv_N: jax.Array | None = None


def rowwise_gemm(impl: str, a, a_inv_M1, b, b_inv_N1, dtype, acc_dtype) -> jax.Array:
    """``(a . b^T) * a_inv * b_inv^T`` [M, N] in ``dtype`` from FP8 a [M, K] and b [N, K]:
    cuBLASLt applies the multipliers in its f32 epilogue where it can (CUDA, ``impl`` not
    'xla' or 'interpret'); otherwise an XLA FP8 GEMM into ``acc_dtype``, then ``_scaled``."""

    def xla(a, a_inv, b, b_inv):
        return _scaled(gemm.mm(a, b, 1, 1, False, acc_dtype), a_inv, b_inv, dtype)

    (m, k), n = a.shape, b.shape[0]
    fits = cublaslt.supports(m, n, k, a.dtype, b.dtype, dtype)
    if impl in ("xla", "interpret") or not fits or not cublaslt.available():
        return xla(a, a_inv_M1, b, b_inv_N1)

    def lt(a, a_inv, b, b_inv):
        return cublaslt.rowwise_dot(a, a_inv[:, 0], b, b_inv[:, 0], dtype)

    return jax.lax.platform_dependent(a, a_inv_M1, b, b_inv_N1, cuda=lt, default=xla)


def out_rowwise(impl, a, a_inv_M1, b, b_inv_N1, dtype, raw: bool) -> Out:
    """A rowwise GEMM's Out: unscaled (``rowwise_gemm``), or with ``raw`` its raw output in
    ``dtype`` and the multipliers that unscale it."""
    acc = gemm.acc_dtype(dtype)
    if raw:
        return Out(gemm.mm(a, b, 1, 1, False, acc), a_inv_M1[:, 0], b_inv_N1[:, 0])
    return Out(rowwise_gemm(impl, a, a_inv_M1, b, b_inv_N1, dtype, acc))


def _forward(cfg: GemmConfig, x, w, meta: Fp8Meta):
    recipe = check_recipes(meta)
    # With a prologue x is the pre-activation: the cast applies act in f32 to what it reads
    # (act(x) is quantized unrounded and never written out) and the backward keeps x for act'.
    x_pre = x if cfg.prologue else None
    out, (amax_x, amax_w), (xq_t, xt_inv, wq, w_inv) = recipe.forward(cfg, x, w)
    # Named for remat policies (ops.remat): the backward GEMMs' operands with their tile scales.
    res = (*checkpoint_name((xq_t, xt_inv), FP8_X), *checkpoint_name((wq, w_inv), FP8_W))
    y = checkpoint_name(out.y, FP8_OUT)
    new_meta = meta.replace(x=scaling.record(meta.x, amax_x), w=scaling.record(meta.w, amax_w))
    return y, new_meta, (*res, x_pre)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def fine_matmul(cfg: GemmConfig, x_MxK, w_KxN, meta: Fp8Meta):
    """``(x . w [M, N], meta with x's and w's amax recorded)`` under ``meta``'s fine recipe."""
    y, new_meta, _ = _forward(cfg, x_MxK, w_KxN, meta)
    return y, new_meta


def _fine_fwd(cfg: GemmConfig, x, w, meta: Fp8Meta):
    y, new_meta, res = _forward(cfg, x, w, meta)
    return (y, new_meta), (res, meta)


def _fine_bwd(cfg: GemmConfig, saved, cts):
    (*res, x_pre), meta = saved
    g, ct_meta = cts  # g [M, N] in the output dtype
    recipe = check_recipes(meta)
    dx_dtype = jnp.float32 if cfg.prologue else cfg.x_dtype  # act' in f32, as the tensorwise path
    dx, dw, amax_g, _ = recipe.backward(cfg, tuple(res), g, meta.dy.fmt, dx_dtype)
    dx = dx.y
    if cfg.prologue:
        dx = gemm.dgrad_out(cfg, dx, 1.0, x_pre)
    hist = scaling.record(ct_meta.dy, amax_g).amax_history
    return dx, dw, gemm.dy_cotangent(meta, ct_meta, hist)


fine_matmul.defvjp(_fine_fwd, _fine_bwd)


def saturation_stats(x: jax.Array, state: scaling.ScaleState) -> tuple[jax.Array, jax.Array]:
    """(saturated share, flushed share) of ``x`` under its fine recipe's scales, tiled along the
    last axis (the contraction of a Dense layer's input)."""
    x_2d = x.reshape(-1, x.shape[-1]) if x.ndim else x.reshape(1, 1)
    recipe = state.recipe
    tile = recipe.tile_width(x_2d.shape[1])
    x_3d = block_cast.split_tiles(x_2d, tile)
    # Each tile's scale as the quantizer computes it (block_cast.quantize_tiles).
    amax = jnp.max(block_cast_kernels.tile_abs(x_3d), axis=-1)
    scale, _ = block_cast_kernels.tile_scales(amax, state.fmt, recipe)
    sat, flush = formats.saturation_stats(x_3d, scale[..., None], state.fmt)
    share = x_3d.size / max(x_2d.size, 1)  # the padding zeros neither clip nor flush
    return sat * share, flush * share
