"""Using a trained model: the log-likelihood of a continuation after a context, batched.

What multiple-choice and perplexity benchmarks ask of a model (``fp8jax.lm_eval`` serves them
to lm-evaluation-harness): for each ``(context ids, continuation ids)`` the summed log
probability of the continuation's tokens, each predicted from everything before it, and whether
greedy decoding would have produced the continuation. One forward pass per batch of rows; the
rows are right-padded to a power-of-two length bucket and the batch to a fixed size, so the
jitted program compiles once per length bucket. At O1 the FP8 matmuls use the stored delayed
scales as they are; scoring never updates them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax import errors, models
from fp8jax.models import moe
from fp8jax.optim import adam as optim
from fp8jax.trainer import generate as generate_lib

__all__ = [
    "Scorer",
    "scorer_for",
    "sequence",
]


def sequence(context: Sequence[int], continuation: Sequence[int], max_len: int):
    """``(inputs, targets, n)`` of one request: the model reads ``inputs`` and predicts
    ``targets`` (inputs shifted by one); the continuation is the last ``n`` targets. A sequence
    longer than ``max_len + 1`` tokens loses its oldest context tokens."""
    if not continuation:
        raise errors.ConfigError("an empty continuation: there is nothing to score")
    if not context:
        raise errors.ConfigError("an empty context: start it with the tokenizer's EOS or BOS")
    whole = [*context, *continuation][-(max_len + 1) :]
    return whole[:-1], whole[1:], min(len(continuation), len(whole) - 1)


class Scorer:
    """The jitted log-likelihood program of one model; ``traces`` counts its compilations."""

    def __init__(self, model_cfg: models.ModelConfig, collection: str, batch_size: int):
        errors.check_int(batch_size, "batch_size", 1)
        self.model = models.build_model(dataclasses.replace(model_cfg, remat_policy="none"))
        self.collection = collection
        self.batch_size = batch_size
        self.traces = 0
        self._run = jax.jit(self._score)

    def _score(self, params, fp8, moe_state, inputs_BxL, targets_BxL, scored_BxL):
        self.traces += 1  # runs only while tracing: one per compilation
        variables = {"params": optim.materialize(params), self.collection: fp8}
        if moe_state:
            variables[moe.MOE_STATE] = moe_state
        logits_BxLxV = self.model.apply(variables, inputs_BxL).astype(jnp.float32)
        logp_BxLxV = jax.nn.log_softmax(logits_BxLxV, axis=-1)
        logp_BxL = jnp.take_along_axis(logp_BxLxV, targets_BxL[..., None], axis=-1)[..., 0]
        greedy_BxL = jnp.argmax(logits_BxLxV, axis=-1) == targets_BxL
        total_B = jnp.sum(jnp.where(scored_BxL, logp_BxL, 0.0), axis=-1)
        return total_B, jnp.all(greedy_BxL | ~scored_BxL, axis=-1)

    def __call__(
        self,
        params,
        fp8_state,
        requests: Sequence[tuple[Sequence[int], Sequence[int]]],
        moe_state=None,
    ) -> list[tuple[float, bool]]:
        """``(log-likelihood, greedy)`` of each ``(context ids, continuation ids)``, in order;
        ``moe_state``: an MoE model's router biases (``TrainState.moe_state``), if it has any."""
        max_len = self.model.cfg.max_len
        rows = [sequence(c, t, max_len) for c, t in requests]
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))  # one bucket a batch
        out: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            length = generate_lib.bucket(len(rows[chunk[0]][0]), max_len)
            inputs_BxL = np.zeros((self.batch_size, length), np.int32)
            targets_BxL = np.zeros((self.batch_size, length), np.int32)
            scored_BxL = np.zeros((self.batch_size, length), bool)
            for r, i in enumerate(chunk):
                inputs, targets, n = rows[i]
                inputs_BxL[r, : len(inputs)] = inputs
                targets_BxL[r, : len(targets)] = targets
                scored_BxL[r, len(targets) - n : len(targets)] = True
            total_B, greedy_B = jax.device_get(
                self._run(params, fp8_state, moe_state or {}, inputs_BxL, targets_BxL, scored_BxL)
            )
            for r, i in enumerate(chunk):
                out[i] = (float(total_B[r]), bool(greedy_B[r]))
        return out


@functools.lru_cache(maxsize=8)
def scorer_for(model_cfg: models.ModelConfig, collection: str, batch_size: int) -> Scorer:
    """The (cached) ``Scorer`` of a model: one per model config, collection and batch size."""
    return Scorer(model_cfg, collection, batch_size)
