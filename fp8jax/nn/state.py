"""Train-step helpers for the FP8 scale-state collection.

The pattern (see README)::

    def loss_fn(params, fp8):
        out, mutated = model.apply({"params": params, FP8: fp8}, x, mutable=[FP8])
        return loss(out), mutated[FP8]
    (loss, fp8_fwd), (g_params, g_fp8) = jax.value_and_grad(
        loss_fn, argnums=(0, 1), has_aux=True)(params, fp8)
    fp8 = fp8jax.update_state(fp8_fwd, g_fp8)   # never pass g_fp8 to the optimizer

``g_fp8`` holds amaxes, not derivatives; keeping it out of the params tree means neither the
optimizer nor global-norm clipping ever sees it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fp8jax.ops import scaling
from fp8jax.ops.scaling import Fp8Meta, ScaleState

__all__ = [
    "FP8",
    "FP8_STATS",
    "FP8_WEIGHTS",
    "commit",
    "keep_if_finite",
    "max_over_replicas",
    "merge_grads",
    "summarize",
    "update_state",
]

FP8 = "fp8_state"  # the Flax variable collection holding every FP8 matmul's scale state
FP8_STATS = "fp8_stats"  # optional collection: saturation / flush-to-zero shares (health pass)
# Decoding's collection: each FP8 matmul's weight quantized once per generate call (E4M3 and its
# scale, ``ops.scaling.QuantizedWeight``), written by the prefill and read by every decode step.
FP8_WEIGHTS = "fp8_weights"


def _is_state(x) -> bool:
    return isinstance(x, ScaleState)


def _is_meta_or_state(x) -> bool:
    return isinstance(x, (Fp8Meta, ScaleState))


def merge_grads(state, state_grads):
    """Fold the backward pass's dy amaxes (the state's 'gradient') into the pending slots by max.

    Call once per micro-batch when accumulating gradients; the amax stays the max over them.
    Of an ``Fp8Meta`` only dy is merged: x and w were recorded in the forward pass and their
    cotangents are zero (``dot``'s backward), so merging them would change nothing but cost
    tiny GPU kernels per tensor per step.
    """

    def merge(s, g):
        if isinstance(s, Fp8Meta):
            return s.replace(dy=scaling.record(s.dy, g.dy.amax_history[..., 0]))
        return scaling.record(s, g.amax_history[..., 0])

    return jax.tree.map(merge, state, state_grads, is_leaf=_is_meta_or_state)


def max_over_replicas(state_N, state):
    """The replicas' ``[N, ...]`` states merged: amax histories by ``max`` over N (the global
    amax); scales from ``state``, the step's input, which no replica changes (reducing them
    too cost one tiny GPU kernel per tensor)."""

    def merge(s_N: ScaleState, s: ScaleState) -> ScaleState:
        return s.replace(amax_history=jnp.max(s_N.amax_history, axis=0))

    return jax.tree.map(merge, state_N, state, is_leaf=_is_state)


def commit(state):
    """End a training step: roll every amax history and recompute every scale."""
    return jax.tree.map(scaling.commit, state, is_leaf=_is_state)


def update_state(state_after_fwd, state_grads):
    """``commit(merge_grads(...))``: the one call a single-batch train step needs."""
    return commit(merge_grads(state_after_fwd, state_grads))


def keep_if_finite(new_state, old_state, ok: jax.Array):
    """Select ``new_state`` where ``ok`` else ``old_state`` (skip a bad step, keep good scales)."""
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new_state, old_state)


def summarize(state) -> dict[str, jax.Array]:
    """Per-tensor health numbers: ``{'<path>/x/amax': ..., '<path>/x/scale': ...}``.

    Stacked (``nn.scan``) states give one entry per layer, suffixed ``_<layer>``.
    """
    out = {}
    leaves = jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_state)[0]
    for path, s in leaves:
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        amax, scale = s.last_amax, s.scale
        if scale.ndim == 0:
            out[f"{name}/amax"], out[f"{name}/scale"] = amax, scale
        else:
            for i in range(scale.shape[0]):
                out[f"{name}_{i}/amax"], out[f"{name}_{i}/scale"] = amax[i], scale[i]
    return out
