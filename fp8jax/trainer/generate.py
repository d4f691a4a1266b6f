"""Using a trained state: validation loss over fixed batches, and sampling text."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax.optim import adam as optim
from fp8jax.parallel import sharding as sharding_lib
from fp8jax.trainer import step as step_lib


def evaluate(eval_step, state, batches, sharding) -> dict:
    """Mean validation loss and perplexity over fixed batches (weighted: per loss token)."""
    losses = [eval_step(state, sharding_lib.put_batch(b, sharding)) for b in batches]
    # A weighted batch's loss is its mean over its loss tokens: batches count by those.
    weights = [float(np.sum(b["weights"])) for b in batches] if "weights" in batches[0] else None
    loss = float(np.average(jax.device_get(losses), weights=weights))
    return {"val_loss": loss, "val_perplexity": float(np.exp(min(loss, 50.0)))}


def sample(model, state, tokenizer, prompt: str, num_tokens: int, max_len: int, seed=0) -> str:
    """Sample ``num_tokens`` tokens after ``prompt`` (temperature 0.8, fixed-length buffer).

    The parameters and FP8 state are arguments of the one jitted step, not constants captured
    in its program (at 1.3B those would be gigabytes of constants to lower and compile).
    """
    ids = tokenizer.encode(prompt)[-(max_len - num_tokens) :] or [0]
    n0 = len(ids)
    buf = np.zeros((1, max_len), np.int32)
    buf[0, :n0] = ids
    coll = step_lib.state_collection(model)

    @jax.jit
    def next_token(params, fp8, tokens_1xL, pos, key):
        logits_1xLxV = model.apply({"params": optim.materialize(params), coll: fp8}, tokens_1xL)
        return jax.random.categorical(key, logits_1xLxV[0, pos - 1] / 0.8)

    key = jax.random.PRNGKey(seed)
    pos = n0 - 1
    for pos in range(n0, min(max_len, n0 + num_tokens)):
        key, sub = jax.random.split(key)
        buf[0, pos] = int(next_token(state.params, state.fp8, jnp.asarray(buf), pos, sub))
    return tokenizer.decode(buf[0, : pos + 1].tolist())
