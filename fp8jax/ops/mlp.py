"""GPT's FP8 GELU MLP as one custom VJP: ``y = gelu(x . w1 + b1) . w2``.

With separate FP8 matmuls the backward pass writes ``dpre = gelu'(pre) * da`` in bf16 (an XLA
fusion that also sums the bias gradient), and the first layer's E5M2 cast reads it back. As
one custom VJP, ``act_kernels.act_grad_cast_transpose`` computes ``dpre`` from the second layer's
raw dgrad output and writes only its E5M2 layouts, its amax and the bias gradient. The forward
is the two fused-cast matmuls of ``ops.gemm``; the second one's cast reads the first GEMM's raw
output and applies its unscale, the bias and the GELU in f32, so no XLA pass writes the
pre-activation (a [tokens, d_ff] read and write per layer).

``recompute_cast`` keeps the backward pass's largest residual out of memory: wo's E4M3
transposed input (gelu(pre) in FP8, [d_ff, tokens], the wgrad operand) is rebuilt in the
backward from the raw GEMM output it keeps anyway, with the same scale and f32 operations, so
the same bits, by the pass that already reads that output for GELU' (one more FP8 write).

The recipe picks the MLP (``Recipe.gelu_mlp``): per-tensor recipes run ``tensor_gelu_mlp``,
one VJP here where every scale is known ahead (delayed scaling) on the fused kernels; the fine
recipes (rowwise, block) have theirs in ``ops.fine_mlp``; anything else (current scaling,
``cast_kernel='xla'``, shapes not in multiples of 16) runs the same math as two ``dot_general``
calls with the GELU as the second one's prologue.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fp8jax.ops import act_kernels, dot, formats, gemm, kernels, norm
from fp8jax.ops.gemm import GemmConfig
from fp8jax.ops.scaling import Fp8Meta

__all__ = [
    "ACT",
    "DENSE",
    "gelu_mlp",
    "tensor_gelu_mlp",
]

DENSE = (((1,), (0,)), ((), ()))  # [M, K] . [K, N]
ACT = "gelu_tanh"


class _Cfg(NamedTuple):
    layer1: GemmConfig  # x . w1 -> h (the GEMM output, before the bias)
    layer2: GemmConfig  # gelu(pre) . w2 -> y
    b_dtype: jnp.dtype
    w1_dtype: jnp.dtype  # the weights as given (f32 masters are quantized straight from f32)
    w2_dtype: jnp.dtype
    recompute_cast: bool  # rebuild wo's E4M3 transposed input in the backward (module doc)
    norm_eps: float | None = None  # x is a LayerNorm's input, folded into its cast (ops.norm)


def _fwd_impl(cfg: _Cfg, x, w1, b1, w2, ln, m1: Fp8Meta, m2: Fp8Meta):
    # ln: the folded LayerNorm's (gamma, beta), or None; its statistics join the residuals.
    folded, normed = norm.fold(x, ln, cfg.norm_eps)
    # Scopes named as the layers: coverage reports and profiles tell wi's GEMMs from wo's.
    with jax.named_scope("wi"):
        # h_raw = x . w1 still scaled by sx * sw (inv1[0] unscales it): the unscale and the
        # bias are left to wo's cast, so pre = h_raw * inv1[0] + b1 is never written out.
        h_raw, m1_new, (xq_t, w1q, inv1, _) = gemm.fwd_fused(
            cfg.layer1, x, w1, m1, raw=True, norm=folded
        )
    # E4M3 of gelu(h_raw * inv1[0] + b1), computed in f32 inside the cast from the raw output.
    affine = (inv1[0], b1)
    with jax.named_scope("wo"):
        y, m2_new, (aq_t, w2q, inv2, _) = gemm.fwd_fused(cfg.layer2, h_raw, w2, m2, affine)
    if cfg.recompute_cast:  # rebuilt in the backward from h_raw, which it keeps anyway
        aq_t = None
    return y, m1_new, m2_new, (xq_t, w1q, inv1, h_raw, b1, aq_t, w2q, inv2, normed)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _mlp(cfg: _Cfg, x, w1, b1, w2, ln, m1, m2):
    y, m1_new, m2_new, _ = _fwd_impl(cfg, x, w1, b1, w2, ln, m1, m2)
    return y, m1_new, m2_new


def _mlp_fwd(cfg: _Cfg, x, w1, b1, w2, ln, m1, m2):
    y, m1_new, m2_new, res = _fwd_impl(cfg, x, w1, b1, w2, ln, m1, m2)
    return (y, m1_new, m2_new), (res, ln, m1, m2)


def _mlp_bwd(cfg: _Cfg, saved, cts):
    g, ct_m1, ct_m2 = cts  # g: [M, D]
    (xq_t, w1q, inv1, h_raw, b1, aq_t, w2q, inv2, normed), ln, m1, m2 = saved
    c1, c2 = cfg.layer1, cfg.layer2
    folded = norm.refold(normed, ln)
    # Kept FP8 copies, or (those in ``rebuild``) cast again with the forward's scales.
    xq_t, w1q = gemm.rebuilt_input(c1, xq_t, m1, folded), gemm.rebuilt_weight(c1, w1q, m1)
    w2q = gemm.rebuilt_weight(c2, w2q, m2)
    with jax.named_scope("wo"):
        # Layer 2: E5M2 for its output gradient, both layouts; dgrad's output stays scaled.
        g2q, g2q_t, hist_g2 = kernels.cast_transpose(
            g, m2.dy.scale, formats.E5M2, c2.cast, pending=ct_m2.dy.amax_history
        )
        da = gemm.mm(g2q, w2q, 1, 1, False, gemm.acc_dtype(c2.x_dtype))  # [M, F] raw
    with jax.named_scope("wi"):
        # GELU' and layer 1's E5M2 cast in one pass; the same pass sums the bias gradient.
        # The pre-activation is rebuilt from the raw forward output, as wo's cast built it;
        # without a kept wo input, the same pass writes it again (wo's x scale: the same bits).
        g1q, g1q_t, hist_g1, db1, *rebuilt = act_kernels.act_grad_cast_transpose(
            h_raw,
            da,
            inv2[1],
            m1.dy.scale,
            formats.E5M2,
            c1.cast,
            ACT,
            ct_m1.dy.amax_history,
            affine=(inv1[0], b1),
            act_scale=m2.x.scale if aq_t is None else None,
        )
    with jax.named_scope("wo"):
        aq_t = rebuilt[0] if aq_t is None else aq_t  # [F, M]
        dw2 = gemm.mm(aq_t, g2q_t, 1, 1, False, gemm.acc_dtype(gemm.wgrad_dtype(c2)))
        dw2 = gemm.unscale(dw2, inv2[2], cfg.w2_dtype)
    with jax.named_scope("wi"):
        dx, dw1 = gemm.fused_grads(c1, xq_t, w1q, inv1, g1q, g1q_t, cfg.w1_dtype)
        dx, d_ln = norm.folded_dgrad(c1, dx, inv1[1], normed, ln)
    # Weight gradients leave the GEMMs in the compute dtype (as nn.Dense's do) and are unscaled
    # into the weights' own dtype, a widening XLA fuses into the optimizer's update.
    return (
        dx,
        dw1,
        db1.astype(cfg.b_dtype),
        dw2,
        d_ln,
        gemm.dy_cotangent(m1, ct_m1, hist_g1),
        gemm.dy_cotangent(m2, ct_m2, hist_g2),
    )


_mlp.defvjp(_mlp_fwd, _mlp_bwd)


def gelu_mlp(
    x,
    w1,
    b1,
    w2,
    meta1: Fp8Meta,
    meta2: Fp8Meta,
    cast_kernel: str = kernels.AUTO,
    recompute_cast: bool = False,
    rebuild: bool | str = False,
    ln: tuple[jax.Array, jax.Array, float] | None = None,
):
    """``gelu(x . w1 + b1) . w2`` in FP8 (x [..., D], w1 [D, F], b1 [F], w2 [F, D]).

    Computes in x's dtype; wider weights (f32 masters) are quantized as given, with no copy in
    x's dtype, and get their gradients back in their own dtype. Returns ``(y [..., D], meta1,
    meta2)`` with this call's amaxes recorded, as two ``dot.dot_general`` calls would; the
    output bias is the caller's. ``recompute_cast``: wo's FP8 input for its weight gradient is
    rebuilt in the backward pass rather than kept (module docstring). ``rebuild``
    (``gemm.GemmConfig``'s; True: 'xw'): the operands whose FP8 copies are not kept; the backward
    casts them again, one layout each (delayed scaling's fused path). 'x' covers both layers'
    inputs (so implies ``recompute_cast``), 'w' both weights. ``ln = (gamma [D], beta [D],
    eps)``: x is a LayerNorm's input and the MLP reads its output, folded into x's cast
    (``ops.norm``); elsewhere the norm is applied first, in x's dtype.
    """
    cast_kernel = kernels.resolve_impl(cast_kernel)
    for name, v in (("x", x), ("w1", w1), ("b1", b1), ("w2", w2)):
        dot.check_operand(name, v)
    lead = x.shape[:-1]
    x_MxD = x.reshape(math.prod(lead), x.shape[-1])
    # The recipe runs the MLP: ``tensor_gelu_mlp`` below, or its own (ops.fine_mlp).
    y, meta1, meta2 = meta1.x.recipe.gelu_mlp(
        x_MxD, w1, b1, w2, meta1, meta2, cast_kernel, recompute_cast, rebuild, ln
    )
    return y.reshape(*lead, w2.shape[1]), meta1, meta2


def tensor_gelu_mlp(
    x_MxD: jax.Array,
    w1: jax.Array,
    b1: jax.Array,
    w2: jax.Array,
    meta1: Fp8Meta,
    meta2: Fp8Meta,
    cast_kernel: str,
    recompute_cast: bool,
    rebuild: bool | str,
    ln: tuple[jax.Array, jax.Array, float] | None,
) -> tuple[jax.Array, Fp8Meta, Fp8Meta]:
    """``gelu_mlp`` on x [M, D] under per-tensor scales: one custom VJP where every scale is
    known ahead and the fused cast kernels run, else two ``dot.dot_general`` calls."""
    dtype = jnp.dtype(x_MxD.dtype)
    rebuild = gemm.rebuilt_operands(rebuild)
    layer1 = GemmConfig(dtype, dtype, dtype, False, cast_kernel, rebuild=rebuild)
    layer2 = GemmConfig(dtype, dtype, dtype, False, cast_kernel, ACT, rebuild)
    dims = (*x_MxD.shape, w1.shape[1], w2.shape[1])  # M, D, F, D
    aligned = all(d % dot.PAD == 0 and d > 0 for d in dims)  # empty: dot_general's own path
    if not (
        aligned and gemm.uses_fused_cast(layer1, meta1) and gemm.uses_fused_cast(layer2, meta2)
    ):
        w1, b1, w2 = w1.astype(dtype), b1.astype(dtype), w2.astype(dtype)
        x_MxD = norm.layer_norm(x_MxD, ln)
        h, meta1 = dot.dot_general(x_MxD, w1, DENSE, meta1, cast_kernel=cast_kernel)
        pre = h + b1
        y, meta2 = dot.dot_general(pre, w2, DENSE, meta2, cast_kernel=cast_kernel, prologue=ACT)
        return y, meta1, meta2
    recompute_cast = bool(recompute_cast or "x" in rebuild)
    eps = None if ln is None else float(ln[2])
    dtypes = (jnp.dtype(v.dtype) for v in (b1, w1, w2))
    cfg = _Cfg(layer1, layer2, *dtypes, recompute_cast, eps)
    with jax.named_scope(f"fp8_{meta1.x.recipe.name}"):  # the recipe, as ops.dot names it
        return _mlp(cfg, x_MxD, w1, b1, w2, None if ln is None else ln[:2], meta1, meta2)
