"""FP8-LM's FP8 Adam (level O2): low-precision Adam moments and FP16 master weights for optax.

Precision decoupling: the first moment m is stored in E4M3 and the second moment v in FP16,
each with a per-tensor f32 scale recomputed from the new amax at every step (rule: see
``optim.master``). The update is computed in f32 from the dequantized moments. By default only
the matmul weights ('kernel' leaves of rank >= 2) get low-precision states; embeddings, norms and
biases keep f32 moments.

Beyond the paper: a step with a non-finite gradient is skipped inside the transform; ``|update|``
is capped at twice the bound exact Adam obeys; ``stochastic_rounding=True`` rounds the narrow
moment casts stochastically. Round-to-nearest (the default, as in FP8-LM) lets an E4M3 m stall
when its per-step change ``(1-b1)|g-m|`` stays under half a grid step (3-6%): harmless with noisy
mini-batch gradients, but it slows a smooth full-batch problem. SR removes that bias at the price
of more noise per cast and more optimizer time (measured: docs/performance.md).

Both transformations run ``optim.update``'s step, the one ``optim.fused.FusedAdamW`` also runs.

Train-step pattern with FP16 master weights::

    tx = fp8jax.optim.adam.fp8_adamw(schedule, weight_decay=0.1)
    opt_state = tx.init(params)
    params = fp8jax.optim.adam.to_master(params)    # kernels -> ScaledTensor(f16, scale)
    ...
    p32 = fp8jax.optim.adam.materialize(params)                   # f32 view for model.apply
    grads = jax.grad(loss_fn)(p32, batch)
    updates, opt_state = tx.update(grads, opt_state, p32)
    params = fp8jax.optim.adam.apply_updates(params, updates)     # add in f32, re-quantize
"""

from __future__ import annotations

import jax.numpy as jnp
import optax

from fp8jax.optim.master import (
    ScaledTensor,
    apply_updates,
    carry_masters,
    dequantize_carried,
    dequantize_carrier,
    is_matmul_weight,
    is_scaled,
    joint_amaxes,
    materialize,
    scale_for,
    storage_dtype,
    to_master,
)
from fp8jax.optim.update import (
    BOUND_SLACK,
    Fp8AdamState,
    Hparams,
    adamw_transformation,
    bias_corrections,
    direction,
    init_moments,
    moment_seeds,
    new_moments,
    step_leaves,
    step_seed,
    update_bound,
)

__all__ = [
    "BOUND_SLACK",
    "Fp8AdamState",
    "ScaledTensor",
    "apply_updates",
    "bias_corrections",
    "carry_masters",
    "dequantize_carried",
    "dequantize_carrier",
    "direction",
    "fp8_adamw",
    "is_matmul_weight",
    "is_scaled",
    "joint_amaxes",
    "materialize",
    "moment_seeds",
    "new_moments",
    "scale_by_fp8_adam",
    "scale_for",
    "step_seed",
    "storage_dtype",
    "to_master",
    "update_bound",
]


def scale_by_fp8_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    m_format="e4m3",
    v_format="float16",
    mask=None,
    cover_all: bool = False,
    stochastic_rounding: bool = False,
    seed: int = 0,
    assume_finite: bool = False,
) -> optax.GradientTransformation:
    """Adam scaling with m/v of the selected leaves stored in ``m_format``/``v_format`` + scale.

    ``mask``: None (matmul weights), a bool, a tree of bools or a callable ``params -> tree``;
    ``cover_all=True`` selects every leaf. If any gradient is non-finite (or its square overflows
    f32) the step is skipped: zero updates, state unchanged. ``|update|`` is clipped to
    ``BOUND_SLACK * update_bound``; exact Adam never exceeds the bound, so the clip only touches
    entries that quantization broke (a v entry flushed to zero under a live m).
    ``stochastic_rounding``: narrow moment casts round up with probability equal to the
    remainder (noise hashed from ``seed``, the step and the leaf), so m and v stay unbiased;
    off by default (round to nearest, as FP8-LM). ``assume_finite=True``: the caller discards
    any step with a non-finite gradient itself (as ``trainer.step``'s train step does), so the
    transform skips its own pass over the gradients.
    """
    hp = Hparams(b1=b1, b2=b2, eps=eps, stochastic_rounding=stochastic_rounding, seed=seed)

    def init_fn(params):
        return init_moments(params, m_format, v_format, mask, cover_all)

    def update_fn(updates, state, params=None):
        del params  # no weight decay: the Adam direction alone
        return step_leaves(hp, updates, state, None, jnp.array(True) if assume_finite else None)

    return optax.GradientTransformation(init_fn, update_fn)


def fp8_adamw(
    learning_rate,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-4,
    m_format="e4m3",
    v_format="float16",
    mask=None,
    cover_all: bool = False,
    weight_decay_mask=None,
    stochastic_rounding: bool = False,
    seed: int = 0,
    assume_finite: bool = False,
    grad_clip: float = 0.0,
) -> optax.GradientTransformation:
    """AdamW (decoupled weight decay) with FP8/FP16 moments; ``learning_rate`` may be a schedule.

    ``mask``/``cover_all`` select the low-precision states (as ``scale_by_fp8_adam``);
    ``weight_decay_mask`` is optax's (None decays every leaf, as ``optax.adamw``). ``params`` may
    hold ``ScaledTensor`` masters: they are dequantized for weight decay. ``grad_clip`` > 0 clips
    the gradients' global norm first, as ``optax.clip_by_global_norm`` chained before it. A
    non-finite gradient skips the whole step: zero updates, the state (schedules included) as
    it was. The state has ``optax.adamw``'s layout: ``(Fp8AdamState, weight decay's, learning
    rate's)``.
    """
    hp = Hparams(
        learning_rate=learning_rate,
        b1=b1,
        b2=b2,
        eps=eps,
        weight_decay=weight_decay,
        weight_decay_mask=weight_decay_mask,
        grad_clip=grad_clip,
        stochastic_rounding=stochastic_rounding,
        seed=seed,
    )
    return adamw_transformation(hp, m_format, v_format, mask, cover_all, assume_finite)
