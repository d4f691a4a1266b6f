"""Token losses of the train and eval steps, and the model inputs a batch carries.

A pre-training batch holds ``inputs`` and ``targets``: its loss is the mean token cross entropy.
A fine-tuning batch (fp8jax.trainer.sft_data) adds ``weights`` (f32, 0 on prompt and padding
tokens), ``positions`` and ``segment_ids``: its loss is ``sum(w * ce) / sum(w)`` over the
global batch. The train step hands each micro-batch ``1 / sum(w)`` of the global batch as its
scale, so micro-batches and data-parallel replicas add up to the global weighted mean whatever
their token counts (a mean of per-micro-batch means would weight a short micro-batch's tokens
more). The objectives (``fp8jax.trainer.objectives``) build their losses from these.

Every loss derives from the token cross entropy [B, L]: the steps get it from the model
itself (``model.apply(..., targets_BxL=...)``, chunked with ``model.loss_chunk`` so that no
[B, L, V] logits are kept). The language-model objective hands the model the targets' weights
(``token_weights``) and takes the weighted sum it returns, which the chunked head computes with
its gradient in one pass; DPO takes the token CE and ``response_logps``. The eval step's
``mean_cross_entropy`` takes the token CE too. The logits-based functions (``cross_entropy``,
``weighted_ce``, ``sequence_logps``) are those applied to ``token_cross_entropy(logits,
targets)``, for callers holding logits.
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


def mean_cross_entropy(losses_BxL, weights_BxL=None) -> jax.Array:
    """Mean of the token cross entropies ``losses_BxL`` in float32; with ``weights_BxL``:
    ``sum(w * ce) / sum(w)``."""
    if weights_BxL is None:
        return jnp.mean(losses_BxL.astype(jnp.float32))
    return weighted_sum(losses_BxL, weights_BxL) / weight_total(weights_BxL)


def cross_entropy(logits_BxLxV, targets_BxL, weights_BxL=None) -> jax.Array:
    """Mean token cross-entropy in float32; with ``weights_BxL``: ``sum(w * ce) / sum(w)``."""
    return mean_cross_entropy(token_cross_entropy(logits_BxLxV, targets_BxL), weights_BxL)


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


def loss_kwargs(batch) -> dict:
    """``model_kwargs`` plus the targets: the model then returns their token CE [B, L]."""
    return {**model_kwargs(batch), "targets_BxL": batch["targets"]}


def token_weights(batch) -> jax.Array:
    """Each target's weight in a pre-training or fine-tuning micro-batch's loss, f32 [B, L]:
    ``weights`` (the loss is their weighted sum), else ``1 / (B * L)`` (the mean)."""
    if is_weighted(batch):
        return batch[WEIGHTS].astype(jnp.float32)
    targets_BxL = batch["targets"]
    return jnp.full(targets_BxL.shape, 1.0 / targets_BxL.size, jnp.float32)


def weighted_ce(logits_BxLxV, targets_BxL, weights_BxL) -> jax.Array:
    """``sum(w * ce)`` of one micro-batch (the train step scales it by the global 1/sum(w))."""
    return weighted_sum(token_cross_entropy(logits_BxLxV, targets_BxL), weights_BxL)


def response_logps(losses_BxL, weights_BxL) -> jax.Array:
    """Each row's summed log-probability of its weighted targets (the response), float32 [B],
    from the token cross entropies ``losses_BxL``."""
    return -jnp.sum(losses_BxL.astype(jnp.float32) * weights_BxL.astype(jnp.float32), axis=-1)


def sequence_logps(logits_BxLxV, targets_BxL, weights_BxL) -> jax.Array:
    """Each row's summed log-probability of its weighted targets (the response), float32 [B]."""
    return response_logps(token_cross_entropy(logits_BxLxV, targets_BxL), weights_BxL)


__all__ = [
    "MODEL_KEYS",
    "WEIGHTS",
    "cross_entropy",
    "is_weighted",
    "loss_kwargs",
    "mean_cross_entropy",
    "model_kwargs",
    "response_logps",
    "sequence_logps",
    "token_cross_entropy",
    "token_weights",
    "weight_total",
    "weighted_ce",
    "weighted_sum",
]
