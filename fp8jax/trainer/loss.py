"""Token losses of the train and eval steps, and the model inputs a batch carries.

A pre-training batch holds ``inputs`` and ``targets``: its loss is the mean token cross entropy.
A fine-tuning batch (fp8jax.trainer.sft_data) adds ``weights`` (f32, 0 on prompt and padding
tokens), ``positions`` and ``segment_ids``: its loss is ``sum(w * ce) / sum(w)`` over the
global batch. The train step hands each micro-batch ``1 / sum(w)`` of the global batch as its
scale, so micro-batches and data-parallel replicas add up to the global weighted mean whatever
their token counts (a mean of per-micro-batch means would weight a short micro-batch's tokens
more).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

WEIGHTS = "weights"  # the batch key of the per-target loss weights
MODEL_KEYS = {"positions": "positions_BxL", "segment_ids": "segment_ids_BxL"}  # batch -> model


def token_cross_entropy(logits_BxLxV, targets_BxL) -> jax.Array:
    """Cross entropy of every target token, float32 [B, L]."""
    return optax.softmax_cross_entropy_with_integer_labels(
        logits_BxLxV.astype(jnp.float32), targets_BxL
    )


def cross_entropy(logits_BxLxV, targets_BxL, weights_BxL=None) -> jax.Array:
    """Mean token cross-entropy in float32; with ``weights_BxL``: ``sum(w * ce) / sum(w)``."""
    losses_BxL = token_cross_entropy(logits_BxLxV, targets_BxL)
    if weights_BxL is None:
        return jnp.mean(losses_BxL)
    return weighted_sum(losses_BxL, weights_BxL) / weight_total(weights_BxL)


def weighted_sum(losses_BxL, weights_BxL) -> jax.Array:
    """``sum(w * ce)`` in float32."""
    return jnp.sum(losses_BxL * weights_BxL.astype(jnp.float32))


def weight_total(weights_BxL) -> jax.Array:
    """``sum(w)``, at least 1 so that a batch without loss tokens gives loss 0, not 0/0."""
    return jnp.maximum(jnp.sum(weights_BxL.astype(jnp.float32)), 1.0)


def is_weighted(batch) -> bool:
    """Whether ``batch`` carries per-target loss weights (a fine-tuning batch)."""
    return WEIGHTS in batch


def model_kwargs(batch) -> dict:
    """The model's keyword inputs that ``batch`` carries (none for a pre-training batch)."""
    return {arg: batch[key] for key, arg in MODEL_KEYS.items() if key in batch}


def weighted_ce(logits_BxLxV, targets_BxL, weights_BxL) -> jax.Array:
    """``sum(w * ce)`` of one micro-batch (the train step scales it by the global 1/sum(w))."""
    return weighted_sum(token_cross_entropy(logits_BxLxV, targets_BxL), weights_BxL)


def scale(batch, replicas: int):
    """Each replica's loss scale: 1/N of its mean, or 1/sum(w) of the global weighted batch."""
    return 1.0 / weight_total(batch[WEIGHTS]) if is_weighted(batch) else 1.0 / replicas
