"""LayerNorm folded into the FP8 cast of the matmul after it: statistics and backward pass.

A pre-norm block's LayerNorm output feeds only the next FP8 matmul, whose cast reads it once.
Folded, that cast reads the norm's input and its row statistics instead (``kernels.
cast_transpose(norm=...)``): the normalized tensor is never written in high precision, and a
backward pass that casts the operand again (``rebuild``) needs no norm pass of its own. The
statistics are f32 per row, as flax's ``nn.LayerNorm`` computes them (fast variance: ``E[x^2]
- E[x]^2``, clipped at 0); the backward pass reads them with the norm's input, named
``remat.NORM_STATS`` for remat policies.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from fp8jax.ops import gemm, kernels, remat

__all__ = ["fold", "folded_dgrad", "layer_norm", "layer_norm_bwd", "layer_norm_stats", "refold"]


def layer_norm_stats(x_MxK: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
    """``(mean [M], rstd [M])`` in f32 of each row of ``x``: ``rstd = 1 / sqrt(var + eps)``."""
    x = x_MxK.astype(jnp.float32)
    mean_M = jnp.mean(x, axis=1)
    var_M = jnp.maximum(jnp.mean(x * x, axis=1) - mean_M * mean_M, 0.0)
    stats = (mean_M, jax.lax.rsqrt(var_M + eps))
    return tuple(checkpoint_name(s, remat.NORM_STATS) for s in stats)


def fold(x_MxK: jax.Array, ln, eps: float | None):
    """``(norm, normed)`` for an op whose x is the input of the LayerNorm ``ln = (gamma,
    beta)``: the cast's ``norm = (mean, rstd, gamma, beta)`` and the residuals its backward
    reads, ``normed = (x, (mean, rstd))``; ``(None, None)`` for ``ln=None``."""
    if ln is None:
        return None, None
    stats = layer_norm_stats(x_MxK, eps)
    return (*stats, *ln), (x_MxK, stats)


def refold(normed, ln):
    """The backward's cast ``norm`` from ``fold``'s residuals and ``ln``, or None."""
    return None if ln is None else (*normed[1], *ln)


def layer_norm_bwd(x_MxK, mean_M, rstd_M, gamma_K, dy_MxK):
    """``(dx [M, K], dgamma [K], dbeta [K])`` in f32 of ``y = (x - mean) * rstd * gamma +
    beta`` from its output gradient ``dy`` and the forward's statistics.

    ``dx = rstd * (g - mean_K(g) - xhat * mean_K(g * xhat))`` with ``xhat = (x - mean) * rstd``
    and ``g = dy * gamma``: the statistics' own gradients folded in.
    """
    dy = dy_MxK.astype(jnp.float32)
    xhat = (x_MxK.astype(jnp.float32) - mean_M[:, None]) * rstd_M[:, None]
    g = dy * gamma_K.astype(jnp.float32)[None, :]
    mean_g = jnp.mean(g, axis=1, keepdims=True)
    mean_gx = jnp.mean(g * xhat, axis=1, keepdims=True)
    dx = rstd_M[:, None] * (g - mean_g - xhat * mean_gx)
    return dx, jnp.sum(dy * xhat, axis=0), jnp.sum(dy, axis=0)


def layer_norm(x_MxK: jax.Array, ln) -> jax.Array:
    """The LayerNorm ``ln = (gamma, beta, eps)`` of x in x's dtype (computed in f32), as flax's
    ``nn.LayerNorm(dtype=x.dtype)``; x itself for ``ln=None``. The unfolded paths' norm."""
    if ln is None:
        return x_MxK
    gamma_K, beta_K, eps = ln
    stats = layer_norm_stats(x_MxK, eps)
    return kernels.apply_norm(x_MxK, (*stats, gamma_K, beta_K)).astype(x_MxK.dtype)


def folded_dgrad(cfg: gemm.GemmConfig, dx_raw, inv, normed, ln):
    """``(dx, (dgamma, dbeta) or None)`` from dgrad's raw GEMM output (``inv`` unscales it).

    ``normed = (x, (mean, rstd))`` and ``ln = (gamma, beta)`` for a folded LayerNorm: the GEMM
    output is the gradient of the norm's output, taken through the norm in f32. Without one
    (``ln=None``), ``gemm.dgrad_out``'s unscale.
    """
    if ln is None:
        return gemm.dgrad_out(cfg, dx_raw, inv, None), None
    x_MxK, (mean_M, rstd_M) = normed
    gamma_K, beta_K = ln
    dy = dx_raw.astype(jnp.float32) * inv
    dx, dgamma, dbeta = layer_norm_bwd(x_MxK, mean_M, rstd_M, gamma_K, dy)
    return dx.astype(x_MxK.dtype), (dgamma.astype(gamma_K.dtype), dbeta.astype(beta_K.dtype))
