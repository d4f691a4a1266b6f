"""Next-token choice from logits: greedy, temperature, top-k and top-p (nucleus) sampling.

Shape suffixes: B batch, V vocabulary. Every setting is a traced scalar, so one compiled decode
loop serves any temperature, k or p. Order of the filters: temperature, then top-k, then top-p
on what top-k kept (the order Hugging Face's ``generate`` applies them in).
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import jax
import jax.numpy as jnp

from fp8jax import errors

__all__ = [
    "GREEDY",
    "Sampling",
    "filtered_logits",
    "next_tokens",
    "top_k_mask",
    "top_p_mask",
]


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How to pick each token: ``temperature`` 0 is greedy (argmax); ``top_k`` 0 and ``top_p``
    1 switch those filters off."""

    temperature: float
    top_k: int
    top_p: float
    seed: int

    def __post_init__(self):
        t, k, p, seed = self.temperature, self.top_k, self.top_p, self.seed
        if not (_is_real(t) and math.isfinite(t) and t >= 0):
            raise errors.ConfigError(f"temperature={t!r}: use a finite number >= 0 (0: greedy)")
        if not (_is_int(k) and k >= 0):
            raise errors.ConfigError(f"top_k={k!r}: use an integer >= 0 (0: no top-k filter)")
        if not (_is_real(p) and 0 < p <= 1):
            raise errors.ConfigError(f"top_p={p!r}: use a number in (0, 1] (1: no nucleus filter)")
        if not (_is_int(seed) and seed >= 0):
            raise errors.ConfigError(f"seed={seed!r}: use an integer >= 0")


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


GREEDY = Sampling(temperature=0.0, top_k=0, top_p=1.0, seed=0)


def top_k_mask(logits_BxV: jax.Array, k: jax.Array) -> jax.Array:
    """True on each row's ``k`` largest logits (all of them where ``k`` is 0); ties at the
    k-th value are kept."""
    vocab = logits_BxV.shape[-1]
    k = jnp.where(k > 0, jnp.minimum(k, vocab), vocab)
    sorted_BxV = jnp.sort(logits_BxV, axis=-1)[:, ::-1]
    kth_Bx1 = jnp.take_along_axis(sorted_BxV, jnp.broadcast_to(k - 1, (len(sorted_BxV), 1)), -1)
    return logits_BxV >= kth_Bx1


def top_p_mask(logits_BxV: jax.Array, p: jax.Array) -> jax.Array:
    """True on each row's nucleus: the most likely tokens whose probabilities first sum to at
    least ``p`` (the top token always; every token where ``p`` is 1)."""
    probs_BxV = jax.nn.softmax(logits_BxV, axis=-1)
    order_BxV = jnp.argsort(-logits_BxV, axis=-1)
    sorted_BxV = jnp.take_along_axis(probs_BxV, order_BxV, -1)
    # A token is in the nucleus when the mass strictly above it is still short of p.
    before_BxV = jnp.cumsum(sorted_BxV, axis=-1) - sorted_BxV
    keep_sorted_BxV = (before_BxV < p) | (p >= 1.0)
    keep_sorted_BxV = keep_sorted_BxV.at[:, 0].set(True)
    rows_Bx1 = jnp.arange(len(logits_BxV))[:, None]
    return jnp.zeros_like(keep_sorted_BxV).at[rows_Bx1, order_BxV].set(keep_sorted_BxV)


def filtered_logits(logits_BxV, temperature, top_k, top_p) -> jax.Array:
    """``logits / temperature`` with -inf outside the top-k and then the top-p sets (f32)."""
    scaled_BxV = logits_BxV.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)
    scaled_BxV = jnp.where(top_k_mask(scaled_BxV, top_k), scaled_BxV, -jnp.inf)
    return jnp.where(top_p_mask(scaled_BxV, top_p), scaled_BxV, -jnp.inf)


def next_tokens(logits_BxV, key, temperature, top_k, top_p) -> jax.Array:
    """One token id per row (int32 [B]): argmax where ``temperature`` is 0, else a draw."""
    greedy_B = jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)

    def draw(_):
        filtered = filtered_logits(logits_BxV, temperature, top_k, top_p)
        return jax.random.categorical(key, filtered, axis=-1).astype(jnp.int32)

    # Greedy decoding skips the vocabulary sorts of the filters.
    return jax.lax.cond(temperature > 0, draw, lambda _: greedy_B, None)
