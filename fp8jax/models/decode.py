"""Key/value cache for autoregressive decoding: prefill a prompt batch once, then one token a step.

Shape suffixes: B batch, L tokens in this call, M cache slots (the longest sequence decoded),
N query heads, K key/value heads, H head dim, V vocabulary.

The cache is the ``cache`` collection: per attention layer ``k`` and ``v`` of [B, K, M, H]
(with ``model.scan_layers``, one stacked [layers, B, K, M, H] pair). ``Attention`` switches to
the cached path when that collection is mutable, so training and evaluation never see it.

Each row of the batch has its own positions: a call writes the new keys and values at
``positions_BxL`` and each query attends to the slots at or before its own position. Prompts of
different lengths are right-padded; a pad's slot lies after its row's last prompt token, so it
is never attended to before the row's decoded token overwrites it. With a sliding window
(``KVCache.window``), a query also skips the slots more than ``window - 1`` positions before its
own: the cache keeps every slot (no rolling buffer), the mask narrows what each query reads.
A decode step (one token per row) reads only the slots up to its row's position where the
Pallas decode kernel applies (``ops.decode_attention``: CUDA, a 16-bit cache).

Weights are quantized once per prompt batch where the FP8 recipe allows it
(``Recipe.quantizes_weights_once``): ``prefill`` writes each FP8 matmul's E4M3 weight to the
``FP8_WEIGHTS`` collection and every ``step`` given that collection reads it, so a decode step
reads one byte per FP8 weight and casts only its activations. ``decoding_config`` runs every
such matmul as a plain FP8 dot (the fused MLP and Q/K/V ops compute the same forward but cast
their weights at each call).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from fp8jax.models.config import ModelConfig
from fp8jax.nn.state import FP8_WEIGHTS
from fp8jax.ops import decode_attention, kernels

__all__ = [
    "CACHE",
    "KVCache",
    "attend",
    "decoding",
    "decoding_config",
    "init_cache",
    "prefill",
    "step",
]

CACHE = "cache"  # the variable collection of the key/value cache


class KVCache(nn.Module):
    """Writes a call's keys/values into the cache; attends its queries to the cached ones.

    The slots are laid out [B, K, M, H]: each key/value head's slots are contiguous, so the
    attention GEMMs (batched over B and K, contracting H, then M) read the cache in place,
    with no transposed copy of it per step.
    """

    window: int = 0  # a query sees the slots of its last ``window`` positions; 0 = all before it
    # a decode step's attention (``ops.decode_attention``): kernels.AUTO or one of kernels.IMPLS
    impl: str = kernels.AUTO

    @nn.compact
    def __call__(
        self,
        q_BxLxNxH: jax.Array,
        k_BxLxKxH: jax.Array,
        v_BxLxKxH: jax.Array,
        positions_BxL: jax.Array,
    ) -> jax.Array:
        # The slots are created on the sizing call (``init_cache``), whose L is the cache's M.
        b, m, k, h = k_BxLxKxH.shape
        dtype = k_BxLxKxH.dtype
        cache_k = self.variable(CACHE, "k", jnp.zeros, (b, k, m, h), dtype)
        cache_v = self.variable(CACHE, "v", jnp.zeros, (b, k, m, h), dtype)
        rows_Bx1 = jnp.arange(q_BxLxNxH.shape[0])[:, None]
        # [rows, :, positions] indexes a [B, L, K, H] block: the call's keys as they come. A
        # position past the cache (a finished row's) is dropped, not clamped onto a slot.
        slot = (rows_Bx1, slice(None), positions_BxL)
        cache_k.value = cache_k.value.at[slot].set(k_BxLxKxH, mode="drop")
        cache_v.value = cache_v.value.at[slot].set(v_BxLxKxH, mode="drop")
        if q_BxLxNxH.shape[1] == 1:  # a decode step: the kernel reads only the filled slots
            o_BxNxH = decode_attention.attend_filled(
                q_BxLxNxH[:, 0],
                cache_k.value,
                cache_v.value,
                positions_BxL[:, 0],
                self.window,
                self.impl,
                self._attend_one,
            )
            return o_BxNxH[:, None]
        return self._attend(q_BxLxNxH, cache_k.value, cache_v.value, positions_BxL)

    def _attend(self, q_BxLxNxH, k_BxKxMxH, v_BxKxMxH, positions_BxL) -> jax.Array:
        """``attend`` with each query's mask: its own slot and those before it (in its window)."""
        slots_M = jnp.arange(k_BxKxMxH.shape[2])
        mask_BxLxM = slots_M[None, None, :] <= positions_BxL[:, :, None]
        if self.window:  # the model's sliding window: the token itself and window - 1 before
            mask_BxLxM &= slots_M[None, None, :] > positions_BxL[:, :, None] - self.window
        return attend(q_BxLxNxH, k_BxKxMxH, v_BxKxMxH, mask_BxLxM)

    def _attend_one(self, q_BxNxH, k_BxKxMxH, v_BxKxMxH, positions_B) -> jax.Array:
        """``_attend`` of one query per row, [B, N, H]: the decode kernel's XLA reference."""
        return self._attend(q_BxNxH[:, None], k_BxKxMxH, v_BxKxMxH, positions_B[:, None])[:, 0]


def attend(q_BxLxNxH, k_BxKxMxH, v_BxKxMxH, mask_BxLxM) -> jax.Array:
    """Grouped-query attention of queries to the cache's [B, K, M, H] slots where ``mask``
    allows, [B, L, N, H]: the operations of ``jax.nn.dot_product_attention``'s XLA path (f32
    logits scaled by 1/sqrt(H), softmax in f32, probabilities in the cache's dtype)."""
    b, length, n, h = q_BxLxNxH.shape
    k = k_BxKxMxH.shape[1]
    q_BxLxKxGxH = q_BxLxNxH.reshape(b, length, k, n // k, h)  # query head i: kv i // G
    logits_dtype = jnp.promote_types(q_BxLxNxH.dtype, jnp.float32)
    presets = {
        jnp.dtype(jnp.bfloat16): jax.lax.DotAlgorithmPreset.BF16_BF16_F32,
        jnp.dtype(jnp.float16): jax.lax.DotAlgorithmPreset.F16_F16_F32,
    }
    logits_BxKxGxLxM = jnp.einsum(
        "blkgh,bkmh->bkglm",
        q_BxLxKxGxH,
        k_BxKxMxH,
        precision=presets.get(jnp.dtype(q_BxLxNxH.dtype)),
        preferred_element_type=logits_dtype,
    )
    logits_BxKxGxLxM *= jnp.array(1.0 / np.sqrt(h), logits_dtype)
    large_negative = -0.7 * min(jnp.finfo(logits_dtype).max, jnp.finfo(jnp.float32).max)
    mask_Bx1x1xLxM = mask_BxLxM[:, None, None]
    logits_BxKxGxLxM = jnp.where(mask_Bx1x1xLxM, logits_BxKxGxLxM, large_negative)
    probs = jax.nn.softmax(logits_BxKxGxLxM.astype(jnp.float32), axis=-1).astype(k_BxKxMxH.dtype)
    o_BxLxKxGxH = jnp.einsum("bkglm,bkmh->blkgh", probs, v_BxKxMxH)
    return o_BxLxKxGxH.reshape(b, length, n, h)


def decoding(module: nn.Module) -> bool:
    """Whether ``module`` runs the cached path (the ``cache`` collection is mutable)."""
    return module.is_mutable_collection(CACHE) and not module.is_initializing()


def init_cache(model: nn.Module, variables: dict, batch: int, length: int) -> dict:
    """An empty cache (zeros) of ``length`` slots for ``batch`` rows, matching ``model``'s layers.

    Runs the model abstractly on a [batch, length] input, which sizes every layer's slots; call
    inside a jitted function so the zeros are made on the device, never transferred. A model
    with FP8 matmuls is sized through its plain-matmul twin (the same params, layers and
    dtypes, no recipe): the slots do not depend on the recipe, and tracing every FP8 matmul's
    casts for them would be most of a deep unrolled model's prefill trace.
    """
    tokens_BxM = jnp.zeros((batch, length), jnp.int32)
    positions_BxM = jnp.broadcast_to(jnp.arange(length), (batch, length))
    cfg = getattr(model, "cfg", None)
    if isinstance(cfg, ModelConfig) and cfg.recipe is not None:
        model = model.clone(cfg=dataclasses.replace(cfg, recipe=None))

    def sizing():
        _, cache = model.apply(variables, tokens_BxM, positions_BxM, mutable=[CACHE])
        return cache[CACHE]

    shapes = jax.eval_shape(sizing)
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def decoding_config(cfg: ModelConfig) -> ModelConfig:
    """The config of the model that decodes for ``cfg``: no remat (it only matters for
    gradients) and, where the recipe ``quantizes_weights_once``, every FP8 matmul a plain FP8
    dot that reads its weight from ``FP8_WEIGHTS`` (same params, state and forward values)."""
    cfg = dataclasses.replace(cfg, remat_policy="none")
    if cfg.recipe and cfg.recipe.quantizes_weights_once and cfg.fp8_impl == "fp8jax":
        cfg = dataclasses.replace(cfg, fuse_mlp=False, fuse_qkv=False, recompute_elementwise=False)
    return cfg


def prefill(model: nn.Module, variables: dict, cache: dict, tokens_BxL, positions_BxL):
    """``(logits_BxLxV f32, cache, weights)``: ``step`` on the prompt, which also quantizes each
    FP8 weight once where the recipe allows it (``weights``: the ``FP8_WEIGHTS`` collection, to
    pass to every later ``step`` in ``variables``; empty at O0 or for per-call recipes)."""
    logits_BxLxV, mutated = model.apply(
        {**variables, CACHE: cache}, tokens_BxL, positions_BxL, mutable=[CACHE, FP8_WEIGHTS]
    )
    return logits_BxLxV, mutated[CACHE], mutated.get(FP8_WEIGHTS, {})


def step(model: nn.Module, variables: dict, cache: dict, tokens_BxL, positions_BxL):
    """``(logits_BxLxV f32, cache)``: run ``tokens_BxL`` at ``positions_BxL`` against ``cache``.

    ``variables`` hold the params and the FP8 state, and ``prefill``'s ``FP8_WEIGHTS`` if any;
    the FP8 state is read (its delayed scales used as stored) and never written, since only the
    cache is mutable.
    """
    logits_BxLxV, mutated = model.apply(
        {**variables, CACHE: cache}, tokens_BxL, positions_BxL, mutable=[CACHE]
    )
    return logits_BxLxV, mutated[CACHE]
