"""Token losses of the train and eval steps, and the model inputs a batch carries.

A pre-training batch holds ``inputs`` and ``targets``: its loss is the mean token cross entropy.
A fine-tuning batch (fp8jax.trainer.sft_data) adds ``weights`` (f32, 0 on prompt and padding
tokens), ``positions`` and ``segment_ids``: its loss is ``sum(w * ce) / sum(w)`` over the
global batch. The train step hands each micro-batch ``1 / sum(w)`` of the global batch as its
scale, so micro-batches and data-parallel replicas add up to the global weighted mean whatever
their token counts (a mean of per-micro-batch means would weight a short micro-batch's tokens
more).

A preference batch (fp8jax.trainer.dpo) is a fine-tuning batch whose rows are pairs (chosen,
rejected) of one prompt, weights on the response tokens only; the DPO step adds the frozen
reference's sequence log-probs of each row (``ref_logps``) and DPO's beta and label smoothing
(per row, all equal). Its loss is DPO's, summed over the pairs; the step's scale is 1/pairs of
the global batch, so micro-batches and replicas again add up to the global mean.

Every loss derives from the token cross entropy [B, L]: the steps get it from the model
itself (``model.apply(..., targets_BxL=...)``, chunked with ``model.loss_chunk`` so that no
[B, L, V] logits are kept). ``micro_batch_loss`` runs the model on a train micro-batch: for
pre-training and fine-tuning it hands the model the targets' weights (``token_weights``) and
takes the weighted sum it returns, which the chunked head computes with its gradient in one
pass; for DPO it takes the token CE and ``response_logps``. The eval step's
``mean_cross_entropy`` takes the token CE too. The logits-based functions (``cross_entropy``,
``weighted_ce``, ``sequence_logps``) are those applied to ``token_cross_entropy(logits,
targets)``, for callers holding logits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

WEIGHTS = "weights"  # the batch key of the per-target loss weights
REF_LOGPS, BETA, SMOOTHING = "ref_logps", "dpo_beta", "dpo_label_smoothing"  # preference keys
PAIR_STATS = ("reward_accuracy", "reward_margin", "chosen_logp", "rejected_logp")  # pair sums
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


def scale(batch, replicas: int):
    """Each replica's loss scale: 1/N of its mean, 1/sum(w) of the global weighted batch, or
    1/pairs of the global preference batch."""
    if is_preference(batch):
        return 1.0 / jnp.maximum(jnp.sum(pair_mask(batch[WEIGHTS])), 1.0)
    return 1.0 / weight_total(batch[WEIGHTS]) if is_weighted(batch) else 1.0 / replicas


def is_preference(batch) -> bool:
    """Whether ``batch`` is a DPO batch of (chosen, rejected) row pairs with reference log-probs."""
    return REF_LOGPS in batch


def response_logps(losses_BxL, weights_BxL) -> jax.Array:
    """Each row's summed log-probability of its weighted targets (the response), float32 [B],
    from the token cross entropies ``losses_BxL``."""
    return -jnp.sum(losses_BxL.astype(jnp.float32) * weights_BxL.astype(jnp.float32), axis=-1)


def sequence_logps(logits_BxLxV, targets_BxL, weights_BxL) -> jax.Array:
    """Each row's summed log-probability of its weighted targets (the response), float32 [B]."""
    return response_logps(token_cross_entropy(logits_BxLxV, targets_BxL), weights_BxL)


def pair_mask(weights_BxL) -> jax.Array:
    """1.0 for each (chosen, rejected) row pair with a response token, 0.0 for padding [B/2]."""
    has_tokens_B = jnp.sum(weights_BxL.astype(jnp.float32), axis=-1) > 0
    return has_tokens_B.reshape(-1, 2)[:, 0].astype(jnp.float32)


def dpo_sums(policy_B, ref_B, mask_P, beta, label_smoothing=0.0) -> dict:
    """DPO's loss and pair statistics, each summed over the real pairs (``mask_P``).

    Rows alternate chosen, rejected. Implicit reward r = beta * (log pi - log pi_ref) of a
    response; per pair the loss is -log sigmoid(r_c - r_r) (with label smoothing e:
    -(1 - e) log sigmoid(d) - e log sigmoid(-d), the loss for labels flipped with chance e).
    """
    pi_Px2 = policy_B.astype(jnp.float32).reshape(-1, 2)
    reward_Px2 = beta * (pi_Px2 - jax.lax.stop_gradient(ref_B).astype(jnp.float32).reshape(-1, 2))
    d_P = reward_Px2[:, 0] - reward_Px2[:, 1]
    loss_P = -(1.0 - label_smoothing) * jax.nn.log_sigmoid(d_P)
    loss_P -= label_smoothing * jax.nn.log_sigmoid(-d_P)
    terms = dict(loss=loss_P, reward_accuracy=(d_P > 0).astype(jnp.float32), reward_margin=d_P,
                 chosen_logp=pi_Px2[:, 0], rejected_logp=pi_Px2[:, 1])  # fmt: skip
    return {k: jnp.sum(v * mask_P) for k, v in terms.items()}


def micro_batch_loss(apply: Callable, batch) -> tuple[dict, Any]:
    """One micro-batch's loss sums (keys: :func:`loss_keys`), as the train step sums them (times
    its scale), and what the model returned beside its output.

    ``apply(inputs, **kwargs) -> (output, aux)`` runs the model (e.g. ``model.apply`` with
    ``mutable=``). Pre-training and fine-tuning batches: the model's weighted sum of the token
    CEs with :func:`token_weights` (a chunked head forms its gradient in the same pass);
    preference batches: DPO's pair sums from each row's token CEs.
    """
    if is_preference(batch):
        losses_BxL, aux = apply(batch["inputs"], **loss_kwargs(batch))
        logps_B = response_logps(losses_BxL, batch[WEIGHTS])
        beta, smoothing = batch[BETA][0], batch[SMOOTHING][0]
        mask_P = pair_mask(batch[WEIGHTS])
        return dpo_sums(logps_B, batch[REF_LOGPS], mask_P, beta, smoothing), aux
    weights_BxL = token_weights(batch)
    (_, total), aux = apply(batch["inputs"], **loss_kwargs(batch), loss_weights_BxL=weights_BxL)
    return {"loss": total}, aux


def loss_keys(batch) -> tuple[str, ...]:
    """The keys of :func:`micro_batch_loss` for ``batch``."""
    return ("loss", *PAIR_STATS) if is_preference(batch) else ("loss",)
