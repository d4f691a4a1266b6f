"""Row moves of the MoE dispatch whose gradients are gathers too.

Autodiff of a row gather ``a[idx]`` scatter-adds the cotangent rows back, and of a row scatter
``zeros.at[idx].set(a)`` gathers them; on a GPU a scatter of bf16 rows is atomics, or a sort and
a loop. The dispatch's moves are (partial) permutations, or each token copied to its k pairs,
whose inverses are known: each op here takes the forward indices and the inverse ones, and both
passes gather. An index past the source's rows (``len`` or more) reads a zero row: an empty
buffer slot, a dropped pair. ``combine`` sums each token's k rows back into one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["combine", "repeat_rows", "take_rows"]


def _gather(a_AxD: jax.Array, idx_B: jax.Array) -> jax.Array:
    """``a[idx]``, a zero row where ``idx`` is past ``a``'s rows."""
    valid_B = idx_B < a_AxD.shape[0]
    rows_BxD = a_AxD[jnp.where(valid_B, idx_B, 0)]
    return jnp.where(valid_B[:, None], rows_BxD, jnp.zeros((), a_AxD.dtype))


@jax.custom_vjp
def take_rows(a_AxD: jax.Array, idx_B: jax.Array, inv_A: jax.Array) -> jax.Array:
    """``out[b] = a[idx[b]]`` for a one-to-one ``idx`` (each row of ``a`` read at most once;
    ``inv[i]`` is the ``b`` reading row i, or B and up where none does); the gradient is the
    gather ``g[inv]``."""
    del inv_A
    return _gather(a_AxD, idx_B)


def _take_rows_fwd(a_AxD, idx_B, inv_A):
    return _gather(a_AxD, idx_B), inv_A


def _take_rows_bwd(inv_A, g_BxD):
    return _gather(g_BxD, inv_A), None, None


take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


@jax.custom_vjp
def repeat_rows(x_TxD: jax.Array, tok_N: jax.Array, back_Txk: jax.Array) -> jax.Array:
    """``out[n] = x[tok[n]]``: each token's row at its (up to) k places; ``back[t, j]`` is the
    j-th place of token t (N and up: none). The gradient gathers each token's k rows back and
    sums them in f32."""
    del back_Txk
    return _gather(x_TxD, tok_N)


def _repeat_rows_fwd(x_TxD, tok_N, back_Txk):
    return _gather(x_TxD, tok_N), back_Txk


def _repeat_rows_bwd(back_Txk, g_NxD):
    t, k = back_Txk.shape
    g_TxkxD = _gather(g_NxD, back_Txk.reshape(t * k)).reshape(t, k, -1)
    return jnp.sum(g_TxkxD.astype(jnp.float32), axis=1).astype(g_NxD.dtype), None, None


repeat_rows.defvjp(_repeat_rows_fwd, _repeat_rows_bwd)


def combine(y_TxkxD: jax.Array, weights_Txk: jax.Array) -> jax.Array:
    """``y [T, D]`` f32: each token's k pair outputs summed with their router weights.

    A product and a sum over k (one fused pass over ``y``, exact in f32), not a dot: a GPU
    would run an f32 ``dot_general`` on TF32 inputs and write ``y`` in f32 first.
    """
    w_Txkx1 = weights_Txk.astype(jnp.float32)[..., None]
    return jnp.sum(y_TxkxD.astype(jnp.float32) * w_Txkx1, axis=1)
