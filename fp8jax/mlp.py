"""GPT's FP8 GELU MLP as one custom VJP: ``y = gelu(x . w1 + b1) . w2``.

With separate FP8 matmuls the backward pass writes ``dpre = gelu'(pre) * da`` in bf16 (an XLA
fusion that also sums the bias gradient), and the first layer's E5M2 cast reads it back. As
one custom VJP, ``kernels.act_grad_cast_transpose`` computes ``dpre`` from the second layer's
raw dgrad output and writes only its E5M2 layouts, its amax and the bias gradient. The forward
is the two fused-cast matmuls of ``fp8jax.dot`` (the GELU inside the second one's cast).

Only the delayed-scaling, fused-kernel path is one VJP; anything else (current scaling,
``cast_kernel='xla'``, shapes not in multiples of 16) runs the same math as two ``dot_general``
calls with the GELU as the second one's prologue.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fp8jax import dot, formats, kernels
from fp8jax.dot import Fp8Meta

DENSE = (((1,), (0,)), ((), ()))  # [M, K] . [K, N]
ACT = "gelu_tanh"


class _Cfg(NamedTuple):
    layer1: dot._Cfg  # x . w1 -> h (the GEMM output, before the bias)
    layer2: dot._Cfg  # gelu(pre) . w2 -> y
    b_dtype: jnp.dtype


def _fwd_impl(cfg: _Cfg, x, w1, b1, w2, m1: Fp8Meta, m2: Fp8Meta):
    # Scopes named as the layers: coverage reports and profiles tell wi's GEMMs from wo's.
    with jax.named_scope("wi"):
        h, m1_new, (xq_t, w1q, inv1, _) = dot._fwd_fused(cfg.layer1, x, w1, m1)  # [M, F]
        pre = h + b1.astype(h.dtype)  # [M, F], the bias added as nn.DenseGeneral adds it
    # E4M3 of gelu(pre), computed inside the cast: gelu(pre) is never written out.
    with jax.named_scope("wo"):
        y, m2_new, (aq_t, w2q, inv2, _) = dot._fwd_fused(cfg.layer2, pre, w2, m2)  # [M, D]
    return y, m1_new, m2_new, (xq_t, w1q, inv1, pre, aq_t, w2q, inv2)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _mlp(cfg: _Cfg, x, w1, b1, w2, m1, m2):
    y, m1_new, m2_new, _ = _fwd_impl(cfg, x, w1, b1, w2, m1, m2)
    return y, m1_new, m2_new


def _mlp_fwd(cfg: _Cfg, x, w1, b1, w2, m1, m2):
    y, m1_new, m2_new, res = _fwd_impl(cfg, x, w1, b1, w2, m1, m2)
    return (y, m1_new, m2_new), (res, m1, m2)


def _mlp_bwd(cfg: _Cfg, saved, cts):
    g, ct_m1, ct_m2 = cts  # g: [M, D]
    (xq_t, w1q, inv1, pre, aq_t, w2q, inv2), m1, m2 = saved
    c1, c2 = cfg.layer1, cfg.layer2
    with jax.named_scope("wo"):
        # Layer 2: E5M2 for its output gradient, both layouts; dgrad's output stays scaled.
        g2q, g2q_t, hist_g2 = kernels.cast_transpose(
            g, m2.dy.scale, formats.E5M2, c2.cast, pending=ct_m2.dy.amax_history
        )
        da, dw2 = dot._fused_grads(c2, aq_t, w2q, inv2, g2q, g2q_t)  # [M, F], [F, D]
    with jax.named_scope("wi"):
        # GELU' and layer 1's E5M2 cast in one pass; the same pass sums the bias gradient.
        g1q, g1q_t, hist_g1, db1 = kernels.act_grad_cast_transpose(
            pre, da, inv2[1], m1.dy.scale, formats.E5M2, c1.cast, ACT, ct_m1.dy.amax_history
        )
        dx, dw1 = dot._fused_grads(c1, xq_t, w1q, inv1, g1q, g1q_t)
    return (
        dot._dgrad_out(c1, dx, inv1[1], None),
        dw1,
        db1.astype(cfg.b_dtype),
        dw2,
        dot._dy_cotangent(m1, ct_m1, hist_g1),
        dot._dy_cotangent(m2, ct_m2, hist_g2),
    )


_mlp.defvjp(_mlp_fwd, _mlp_bwd)


def gelu_mlp(x, w1, b1, w2, meta1: Fp8Meta, meta2: Fp8Meta, cast_kernel: str = "pallas"):
    """``gelu(x . w1 + b1) . w2`` in FP8 (x [..., D], w1 [D, F], b1 [F], w2 [F, D]).

    Returns ``(y [..., D], meta1, meta2)`` with this call's amaxes recorded, as two
    ``dot.dot_general`` calls would; the output bias is the caller's.
    """
    kernels.check_impl(cast_kernel)
    lead = x.shape[:-1]
    x_MxD = x.reshape(math.prod(lead), x.shape[-1])
    out_dtype = jnp.result_type(x.dtype, w1.dtype)
    layer1 = dot._Cfg(x_MxD.dtype, w1.dtype, out_dtype, False, cast_kernel)
    y_dtype = jnp.result_type(out_dtype, w2.dtype)
    layer2 = dot._Cfg(out_dtype, w2.dtype, y_dtype, False, cast_kernel, ACT)
    dims = (*x_MxD.shape, w1.shape[1], w2.shape[1])  # M, D, F, D
    aligned = all(d % dot.PAD == 0 for d in dims)
    if not (aligned and dot._fused(layer1, meta1) and dot._fused(layer2, meta2)):
        h, meta1 = dot.dot_general(x_MxD, w1, DENSE, meta1, cast_kernel=cast_kernel)
        pre = h + b1.astype(h.dtype)
        y, meta2 = dot.dot_general(pre, w2, DENSE, meta2, cast_kernel=cast_kernel, prologue=ACT)
        return y.reshape(*lead, -1), meta1, meta2
    cfg = _Cfg(layer1, layer2, jnp.dtype(b1.dtype))
    y, meta1, meta2 = _mlp(cfg, x_MxD, w1, b1, w2, meta1, meta2)
    return y.reshape(*lead, -1), meta1, meta2
