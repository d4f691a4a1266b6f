"""GPT's GELU MLP under a fine recipe (rowwise or block) as one custom VJP.

``y = gelu(x . w1 + b1) . w2``, the fine recipes' counterpart of ``ops.mlp``. As two
``fine_matmul`` calls, XLA would write the pre-activation ``h + b1`` for wo's cast to read, and
in the backward pass the activation's gradient ``gelu'(pre) * da`` (with the bias gradient, a
column sum) for wi's cast to read. Here neither is written: wo's input cast reads wi's GEMM
output ``h`` and computes ``gelu(h * unscale + b1)`` in f32 on each block
(``cast_source.activated``), and wi's output-gradient cast reads ``h`` and wo's dgrad output
``da`` and computes ``gelu'(pre) * da`` (``cast_source.activation_grad``), writing the bias
gradient's column sums from the same pass. Under rowwise scaling ``h`` and ``da`` stay as their
GEMMs wrote them (bf16, still scaled by their operands' row and column scales: the casts
unscale them in f32); under block scaling the block-scaled GEMM unscales them itself, and XLA
adds the bias to ``h`` (one bf16 pass, which measured faster than the tiles kernel reading it).

The backward pass keeps ``h`` (as the two-matmul path keeps the pre-activation) and the FP8
operands the two layers' ``fine`` GEMMs keep. ``recompute_cast`` leaves out wo's transposed
E4M3 input (the wgrad operand) and casts it again in the backward pass: the same source and
tiles, so the same bits.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from fp8jax.ops import cast_source, fine, gemm, scaling
from fp8jax.ops.gemm import GemmConfig
from fp8jax.ops.remat import FP8_OUT, FP8_W, FP8_X
from fp8jax.ops.scaling import Fp8Meta

__all__ = [
    "ACT",
    "gelu_mlp",
]

ACT = "gelu_tanh"


class _Cfg(NamedTuple):
    layer1: GemmConfig  # x . w1 -> h (before its unscale and bias)
    layer2: GemmConfig  # gelu(pre) . w2 -> y; its x is a cast source
    b_dtype: jnp.dtype
    recompute_cast: bool  # rebuild wo's E4M3 transposed input in the backward (module doc)


def _activation(out1: fine.Out, b1) -> cast_source.Source:
    """wo's input: ``gelu(h * unscale + b1)`` from wi's GEMM output, in f32 inside the cast
    (``b1`` None: h has its bias)."""
    return cast_source.activated(out1.y, out1.inv_M, out1.inv_N, b1, ACT)


def _fwd_impl(cfg: _Cfg, recipe, x, w1, b1, w2):
    # Scopes named as the layers: coverage reports and profiles tell wi's GEMMs from wo's.
    with jax.named_scope("wi"):
        out1, amax1, res1 = recipe.forward(cfg.layer1, x, w1, raw=True)  # h [M, F]
        if out1.inv_M is None:
            # The GEMM unscaled h itself (block), and an XLA bias add before the tiles cast is
            # faster than the tiles kernel reading the bias (H200): h keeps it from here on.
            out1, b1 = fine.Out(out1.y + b1.astype(out1.y.dtype)), None
    with jax.named_scope("wo"):
        out2, amax2, res2 = recipe.forward(cfg.layer2, _activation(out1, b1), w2)
    # Named for remat policies (ops.remat), as fine_matmul names its residuals.
    res1 = (*checkpoint_name(res1[:2], FP8_X), *checkpoint_name(res1[2:], FP8_W))
    res2 = (*checkpoint_name(res2[:2], FP8_X), *checkpoint_name(res2[2:], FP8_W))
    out1 = out1._replace(y=checkpoint_name(out1.y, FP8_OUT))
    if cfg.recompute_cast:  # rebuilt in the backward from h, which it keeps anyway
        res2 = (None, None, *res2[2:])
    return checkpoint_name(out2.y, FP8_OUT), amax1, amax2, (res1, out1, b1, res2)


def _recorded(meta: Fp8Meta, amaxes) -> Fp8Meta:
    amax_x, amax_w = amaxes
    return meta.replace(x=scaling.record(meta.x, amax_x), w=scaling.record(meta.w, amax_w))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _mlp(cfg: _Cfg, x, w1, b1, w2, m1: Fp8Meta, m2: Fp8Meta):
    recipe = fine.check_recipes(m1)
    y, amax1, amax2, _ = _fwd_impl(cfg, recipe, x, w1, b1, w2)
    return y, _recorded(m1, amax1), _recorded(m2, amax2)


def _mlp_fwd(cfg: _Cfg, x, w1, b1, w2, m1, m2):
    recipe = fine.check_recipes(m1)
    y, amax1, amax2, res = _fwd_impl(cfg, recipe, x, w1, b1, w2)
    return (y, _recorded(m1, amax1), _recorded(m2, amax2)), (res, m1, m2)


def _mlp_bwd(cfg: _Cfg, saved, cts):
    g, ct_m1, ct_m2 = cts  # g: [M, D]
    (res1, out1, b1, res2), m1, m2 = saved
    recipe = fine.check_recipes(m1)
    c1, c2 = cfg.layer1, cfg.layer2
    with jax.named_scope("wo"):
        if res2[0] is None:  # the forward's cast again: same source, scales and bits
            # Tied to the cotangent so that neither JAX nor XLA merges it with the forward's
            # cast (which would keep that cast's output alive until here after all).
            out_again, b_again, _ = jax.lax.optimization_barrier((out1, b1, g))
            xq_t, xt_inv = recipe.cast_x(c2, _activation(out_again, b_again))[2:4]
            res2 = (xq_t, xt_inv, *res2[2:])
        # da [M, F]: d loss / d gelu(pre), left as its GEMM wrote it (raw under rowwise).
        da, dw2, amax_g2, _ = recipe.backward(c2, res2, g, m2.dy.fmt, c2.x_dtype, raw=True)
    with jax.named_scope("wi"):
        # gelu'(pre) * da in f32 inside wi's output-gradient cast, which also sums db1.
        src = cast_source.activation_grad(
            out1.y, out1.inv_M, out1.inv_N, b1, da.y, da.inv_M, da.inv_N, ACT
        )
        dx, dw1, amax_g1, (db1,) = recipe.backward(
            c1, res1, src, m1.dy.fmt, c1.x_dtype, col_sums=True
        )
    return (
        dx.y,
        dw1,
        db1.astype(cfg.b_dtype),
        dw2,
        gemm.dy_cotangent(m1, ct_m1, scaling.record(ct_m1.dy, amax_g1).amax_history),
        gemm.dy_cotangent(m2, ct_m2, scaling.record(ct_m2.dy, amax_g2).amax_history),
    )


_mlp.defvjp(_mlp_fwd, _mlp_bwd)


def gelu_mlp(
    x_MxD: jax.Array,
    w1_DxF: jax.Array,
    b1_F: jax.Array,
    w2_FxD: jax.Array,
    meta1: Fp8Meta,
    meta2: Fp8Meta,
    cast_kernel: str,
    recompute_cast: bool = False,
) -> tuple[jax.Array, Fp8Meta, Fp8Meta]:
    """``(gelu(x . w1 + b1) . w2 [M, D], meta1, meta2)`` under the fine recipe the metas share.

    As ``ops.mlp.gelu_mlp`` (the fine recipes' ``gelu_mlp``): x [M, D] in the compute dtype,
    weights as given (f32 masters are quantized from f32 and get f32 gradients).
    """
    recipes = {fine.check_recipes(m).name for m in (meta1, meta2)}
    if len(recipes) != 1:
        raise ValueError("fp8jax: an MLP's two layers must share one fine recipe")
    dtype = jnp.dtype(x_MxD.dtype)
    layer1 = GemmConfig(dtype, jnp.dtype(w1_DxF.dtype), dtype, False, cast_kernel)
    layer2 = GemmConfig(dtype, jnp.dtype(w2_FxD.dtype), dtype, False, cast_kernel)
    cfg = _Cfg(layer1, layer2, jnp.dtype(b1_F.dtype), bool(recompute_cast))
    recipe = meta1.x.recipe
    with jax.named_scope(f"fp8_{recipe.name}"):  # the recipe, as ops.dot names it
        return _mlp(cfg, x_MxD, w1_DxF, b1_F, w2_FxD, meta1, meta2)
