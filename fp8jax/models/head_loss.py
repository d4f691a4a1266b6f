"""The LM head's token cross entropy over chunks of tokens, without the [tokens, V] logits.

Shape suffixes: N tokens (batch x length, flattened), C tokens per chunk, D d_model,
V vocabulary.

``chunked_cross_entropy`` runs the head matmul (in the compute dtype, as the model's head),
the f32 upcast and ``logsumexp - target logit`` one chunk of C tokens at a time inside a
``lax.scan``, so only a chunk's [C, V] logits are ever alive. Its custom VJP keeps each
token's log-sum-exp (f32 [N]) and recomputes a chunk's logits in the backward pass, where
``softmax - onehot`` gives the chunk's input gradient and adds its weight gradient into an f32
accumulator; the unchunked head keeps the f32 [N, V] logits, their compute-dtype copy and
their gradient alive instead.

``weighted_cross_entropy`` is for a loss that is a weighted sum of the token CE with weights
known up front (pre-training's mean, SFT's masked sum; the train step's): each chunk's
gradient is formed in the forward scan beside its loss, so the head's logits GEMM runs once,
and the backward pass only scales the kept dx [N, D] and dw. DPO's loss, a function of each
row's log-probs, takes ``chunked_cross_entropy``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

__all__ = [
    "chunk_size",
    "chunked_cross_entropy",
    "token_cross_entropy",
    "weighted_cross_entropy",
]


def token_cross_entropy(logits_NxV: jax.Array, targets_N: jax.Array) -> jax.Array:
    """``logsumexp(logits) - logits[target]`` of every token, float32 (any leading shape)."""
    logits_NxV = logits_NxV.astype(jnp.float32)
    target_N = jnp.take_along_axis(logits_NxV, targets_N[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits_NxV, axis=-1) - target_N


def _dims(w_ndim_d: int):
    """``dot_general`` dimensions of x [C, D] with the head weight, whose D is axis ``w_ndim_d``
    (0: an untied kernel [D, V]; 1: the tied embedding table [V, D])."""
    return ((1,), (w_ndim_d,)), ((), ())


def _logits(x_CxD, w_c, w_d: int) -> jax.Array:
    # The head's GEMM in the compute dtype (w_c's), as the model's unchunked head, upcast after.
    return jax.lax.dot_general(x_CxD.astype(w_c.dtype), w_c, _dims(w_d)).astype(jnp.float32)


def _chunks(a_N, chunk: int):
    """``a_N`` zero-padded to n * ``chunk`` tokens, as [n, chunk, ...]: chunk j holds tokens
    j, j + n, j + 2n, ...

    Strided, each chunk spans every row of the batch, so a batch sharded over devices (its
    leading axis) stays sharded within each chunk and the scan runs over an unsharded axis
    (contiguous chunks would put the sharding on the scanned axis: every device would gather
    and run every chunk).
    """
    pad = -a_N.shape[0] % chunk
    a_N = jnp.pad(a_N, ((0, pad),) + ((0, 0),) * (a_N.ndim - 1))
    return jnp.swapaxes(a_N.reshape(chunk, -1, *a_N.shape[1:]), 0, 1)


def _tokens(a_nxC, n_tokens: int):
    """The inverse of ``_chunks``: [n, chunk, ...] back to the first ``n_tokens`` tokens."""
    a = jnp.swapaxes(a_nxC, 0, 1)
    return a.reshape(-1, *a.shape[2:])[:n_tokens]


def chunk_size(num_tokens: int, chunk: int) -> int:
    """Tokens per chunk for ``num_tokens``: ``chunk``, at most the tokens there are."""
    return max(1, min(chunk, num_tokens))


def _dlogits(logits_CxV, lse_C, t_C, g_C, vocab: int) -> jax.Array:
    """``(softmax - onehot(target)) * g``: d (g * ce) / d logits, f32 (padding tokens: g = 0)."""
    p_CxV = jnp.exp(logits_CxV - lse_C[:, None])
    return (p_CxV - jax.nn.one_hot(t_C, vocab, dtype=jnp.float32)) * g_C[:, None]


def _chunk_grads(x_CxD, dlogits_CxV, w_c, w_d: int, dtype):
    """``(dx [C, D] in x's dtype, dw f32)`` of one chunk from its logits' gradient.

    The GEMMs run in the compute dtype, as autodiff runs the unchunked head's.
    """
    dlogits_CxV = dlogits_CxV.astype(dtype)
    dx_CxD = jax.lax.dot_general(dlogits_CxV, w_c, (((1,), (1 - w_d,)), ((), ())))
    x_c = x_CxD.astype(dtype)
    if w_d == 0:  # kernel [D, V]: x^T @ dlogits
        dw = jax.lax.dot_general(
            x_c, dlogits_CxV, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )
    else:  # embedding [V, D]: dlogits^T @ x
        dw = jax.lax.dot_general(
            dlogits_CxV, x_c, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )
    return dx_CxD.astype(x_CxD.dtype), dw


def _forward(x_NxD, w, targets_N, chunk: int, dtype, w_d: int):
    n_tokens, w_c = x_NxD.shape[0], w.astype(dtype)
    chunk = chunk_size(n_tokens, chunk)

    def body(_, xt):
        x_CxD, t_C = xt
        logits_CxV = _logits(x_CxD, w_c, w_d)
        lse_C = jax.nn.logsumexp(logits_CxV, axis=-1)
        target_C = jnp.take_along_axis(logits_CxV, t_C[:, None], axis=-1)[:, 0]
        return None, (lse_C - target_C, lse_C)

    xs = (_chunks(x_NxD, chunk), _chunks(targets_N, chunk))
    _, (ce_nxC, lse_nxC) = jax.lax.scan(body, None, xs)
    # Padding tokens (x = 0, target 0) sit past n_tokens and are dropped here.
    return _tokens(ce_nxC, n_tokens), _tokens(lse_nxC, n_tokens)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def chunked_cross_entropy(x_NxD, w, targets_N, chunk: int, dtype, w_d: int) -> jax.Array:
    """Token cross entropy f32 [N] of the head ``w`` on ``x_NxD``, ``chunk`` tokens at a time.

    ``w``: the head's weight, its D on axis ``w_d`` (0: kernel [D, V]; 1: embedding [V, D]).
    ``dtype``: the head GEMM's compute dtype. Matches ``token_cross_entropy`` of the full
    logits ``x @ w`` computed in ``dtype`` and upcast to f32.
    """
    return _forward(x_NxD, w, targets_N, chunk, dtype, w_d)[0]


def _fwd(x_NxD, w, targets_N, chunk, dtype, w_d):
    ce_N, lse_N = _forward(x_NxD, w, targets_N, chunk, dtype, w_d)
    return ce_N, (x_NxD, w, targets_N, lse_N)


def _bwd(chunk, dtype, w_d, res, g_N):
    x_NxD, w, targets_N, lse_N = res
    w_c, n_tokens = w.astype(dtype), x_NxD.shape[0]
    chunk, vocab = chunk_size(n_tokens, chunk), w.shape[1 - w_d]

    def body(dw_acc, xs):
        x_CxD, t_C, lse_C, g_C = xs
        logits_CxV = _logits(x_CxD, w_c, w_d)
        dlogits_CxV = _dlogits(logits_CxV, lse_C, t_C, g_C, vocab)
        dx_CxD, dw = _chunk_grads(x_CxD, dlogits_CxV, w_c, w_d, dtype)
        # The weight gradient sums over chunks in f32: one rounding to w's dtype at the end.
        return dw_acc + dw, dx_CxD

    xs = tuple(_chunks(a, chunk) for a in (x_NxD, targets_N, lse_N, g_N.astype(jnp.float32)))
    dw, dx_nxCxD = jax.lax.scan(body, jnp.zeros(w.shape, jnp.float32), xs)
    return _tokens(dx_nxCxD, n_tokens), dw.astype(w.dtype), None


chunked_cross_entropy.defvjp(_fwd, _bwd)


def _forward_with_grads(x_NxD, w, targets_N, weights_N, chunk: int, dtype, w_d: int):
    """``(ce_N, dx_NxD, dw)``: the token CE and the gradients of ``sum(weights * ce)``, in one
    pass over the chunks (each chunk's logits computed once, for its loss and its gradient)."""
    n_tokens, w_c = x_NxD.shape[0], w.astype(dtype)
    chunk, vocab = chunk_size(n_tokens, chunk), w.shape[1 - w_d]

    def body(dw_acc, xs):
        x_CxD, t_C, wt_C = xs
        logits_CxV = _logits(x_CxD, w_c, w_d)
        lse_C = jax.nn.logsumexp(logits_CxV, axis=-1)
        target_C = jnp.take_along_axis(logits_CxV, t_C[:, None], axis=-1)[:, 0]
        dlogits_CxV = _dlogits(logits_CxV, lse_C, t_C, wt_C, vocab)
        dx_CxD, dw = _chunk_grads(x_CxD, dlogits_CxV, w_c, w_d, dtype)
        return dw_acc + dw, (lse_C - target_C, dx_CxD)

    xs = tuple(_chunks(a, chunk) for a in (x_NxD, targets_N, weights_N.astype(jnp.float32)))
    dw, (ce_nxC, dx_nxCxD) = jax.lax.scan(body, jnp.zeros(w.shape, jnp.float32), xs)
    return _tokens(ce_nxC, n_tokens), _tokens(dx_nxCxD, n_tokens), dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _weighted(x_NxD, w, targets_N, weights_N, chunk: int, dtype, w_d: int):
    ce_N = _forward(x_NxD, w, targets_N, chunk, dtype, w_d)[0]
    return ce_N, jnp.sum(ce_N * weights_N.astype(jnp.float32))


def _weighted_fwd(x_NxD, w, targets_N, weights_N, chunk, dtype, w_d):
    ce_N, dx_NxD, dw = _forward_with_grads(x_NxD, w, targets_N, weights_N, chunk, dtype, w_d)
    # dw in w's dtype: one rounding, as chunked_cross_entropy's; scaled by the cotangent after.
    total = jnp.sum(ce_N * weights_N.astype(jnp.float32))
    return (ce_N, total), (dx_NxD, dw.astype(w.dtype))


def _weighted_bwd(chunk, dtype, w_d, res, cts):
    dx_NxD, dw = res
    _, g = cts  # ce_N leaves weighted_cross_entropy without a gradient: its cotangent is 0
    g = g.astype(jnp.float32)
    scaled = lambda a: (a.astype(jnp.float32) * g).astype(a.dtype)  # noqa: E731
    return scaled(dx_NxD), scaled(dw), None, None


_weighted.defvjp(_weighted_fwd, _weighted_bwd)


def weighted_cross_entropy(
    x_NxD, w, targets_N, weights_N, chunk: int, dtype, w_d: int
) -> tuple[jax.Array, jax.Array]:
    """``(ce_N, sum(weights_N * ce_N))``: ``chunked_cross_entropy`` and its weighted sum, whose
    gradient the forward pass computes.

    Each chunk's logits give its loss and, with its tokens' weights, its share of dx and dw in
    the same scan step, so the backward pass only scales the kept dx [N, D] and f32 dw by the
    sum's cotangent: no head GEMM runs twice. ``ce_N`` comes back without a gradient (use the
    sum); the weights get none.
    """
    ce_N, total = _weighted(x_NxD, w, targets_N, weights_N, chunk, dtype, w_d)
    return jax.lax.stop_gradient(ce_N), total
