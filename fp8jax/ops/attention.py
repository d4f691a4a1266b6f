"""Causal ``jax.nn.dot_product_attention`` whose backward residuals carry a remat name.

cuDNN's flash attention keeps its output and softmax statistics for the backward pass, but they
are outputs of a custom call inside jax's own custom VJP, which no ``jax.checkpoint`` policy can
name: under block remat with a name-based policy the backward pass would run the attention
forward again. Here the attention runs inside a custom VJP of its own whose forward rule takes
``jax.vjp`` of it and names every residual of that backward function ``ops.remat.ATTENTION``
(q, k, v, the output, the statistics; for ``implementation='xla'`` its probabilities). Without
remat, or under a policy that does not save the name, it is the same computation and residuals.

A sliding window (``window`` > 0, Mistral's) lets each query at index i see the keys at
i - window + 1 .. i, its own included: ``local_window_size=(window - 1, 0)``, which the XLA
implementation applies as one more mask and cuDNN as its ``sliding_window_length`` (= window),
skipping the blocks outside it. A packed-segment ``mask`` narrows it further.
"""

from __future__ import annotations

import functools

import jax
from jax.ad_checkpoint import checkpoint_name

from fp8jax.ops.remat import ATTENTION

__all__ = ["causal_attention"]


def _attend(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, mask_Bx1xLxL, impl, window):
    return jax.nn.dot_product_attention(
        q_BxLxNxH,
        k_BxLxKxH,
        v_BxLxKxH,
        mask=mask_Bx1xLxL,
        is_causal=True,
        implementation=impl,
        local_window_size=(window - 1, 0) if window else None,  # left keys besides itself
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attention(q, k, v, mask, impl, window):
    return _attend(q, k, v, mask, impl, window)


def _attention_fwd(q, k, v, mask, impl, window):
    o, backward = jax.vjp(lambda q, k, v: _attend(q, k, v, mask, impl, window), q, k, v)
    return o, jax.tree.map(lambda r: checkpoint_name(r, ATTENTION), backward)


def _attention_bwd(impl, window, backward, do):
    return (*backward(do), None)  # the mask is boolean: no cotangent


_attention.defvjp(_attention_fwd, _attention_bwd)


def causal_attention(
    q_BxLxNxH: jax.Array,
    k_BxLxKxH: jax.Array,
    v_BxLxKxH: jax.Array,
    mask_Bx1xLxL: jax.Array | None = None,
    implementation: str | None = None,
    window: int = 0,
) -> jax.Array:
    """Causal attention (``mask``: True = may attend), over the last ``window`` keys when
    ``window`` > 0; output and residuals named ATTENTION."""
    o_BxLxNxH = _attention(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, mask_Bx1xLxL, implementation, window)
    # The output is also the o projection's input: named, a policy keeps it for that GEMM's
    # backward too (the same buffer as the residual inside).
    return checkpoint_name(o_BxLxNxH, ATTENTION)
