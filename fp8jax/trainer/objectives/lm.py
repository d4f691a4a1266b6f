"""The language-model objective: token cross entropy, a mean or weighted by the batch.

A pre-training batch (``inputs``, ``targets``) trains on the mean token cross entropy; a
fine-tuning batch adds ``weights`` (0 on prompt and padding tokens) and trains on
``sum(w * ce) / sum(w)`` over the global batch (``fp8jax.trainer.loss``). No hyper-parameters
and no train state of its own.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from fp8jax.parallel import sharding as sharding_lib
from fp8jax.trainer import loss as loss_lib
from fp8jax.trainer.objectives.base import Objective, register


@register
@dataclasses.dataclass(frozen=True)
class LanguageModel(Objective):
    """Next-token cross entropy: the mean, or weighted by the batch's ``weights``."""

    name = "lm"

    def scale(self, batch, replicas: int):
        """1/N of each replica's mean, or 1/sum(w) of the global weighted batch."""
        if loss_lib.is_weighted(batch):
            return 1.0 / loss_lib.weight_total(batch[loss_lib.WEIGHTS])
        return 1.0 / replicas

    def adds_up(self, batch) -> bool:
        """A weighted batch's sums are shares of the global weighted mean; else means."""
        return loss_lib.is_weighted(batch)

    def micro_batch_loss(self, apply, batch, rows):
        """The model's weighted sum of the token CEs with ``loss.token_weights`` (a chunked
        head forms its gradient in the same pass)."""
        del rows
        weights_BxL = loss_lib.token_weights(batch)
        (_, total), aux = apply(
            batch["inputs"], **loss_lib.loss_kwargs(batch), loss_weights_BxL=weights_BxL
        )
        return {"loss": total}, aux

    def make_eval(self, model, mesh=None):
        """The batch's mean token CE (weighted: over its loss tokens)."""
        del model, mesh
        return lambda state, batch, losses_BxL: loss_lib.mean_cross_entropy(
            losses_BxL, batch.get(loss_lib.WEIGHTS)
        )

    def evaluate(self, eval_step, state, batches, sharding) -> dict:
        """Mean validation loss and perplexity over fixed batches (weighted: per loss token)."""
        losses = [eval_step(state, sharding_lib.put_batch(b, sharding)) for b in batches]
        # A weighted batch's loss is its mean over its loss tokens: batches count by those.
        weighted = loss_lib.WEIGHTS in batches[0]
        weights = [float(np.sum(b[loss_lib.WEIGHTS])) for b in batches] if weighted else None
        loss = float(np.average(jax.device_get(losses), weights=weights))
        return {"val_loss": loss, "val_perplexity": float(np.exp(min(loss, 50.0)))}


__all__ = ["LanguageModel"]
