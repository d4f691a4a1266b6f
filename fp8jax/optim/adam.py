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

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fp8jax.optim.master import (
    ScaledTensor,
    apply_updates,
    carry_masters,
    dequantize_carried,
    dequantize_carrier,
    hash_bits,
    is_matmul_weight,
    is_scaled,
    materialize,
    quantize_scaled,
    resolve_mask,
    scale_for,
    storage_dtype,
    to_master,
)

__all__ = [
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

# The clip sits at 2x the bound: quantized moments overshoot it by their rounding error (up to
# 12.5% for E4M3 m), and clipping there would bias early steps, where Adam runs at the bound.
BOUND_SLACK = 2.0


class Fp8AdamState(NamedTuple):
    """Adam state: selected leaves of ``mu``/``nu`` are ``ScaledTensor``, the rest f32 arrays."""

    count: jax.Array  # [] int32, steps taken (skipped non-finite steps do not count)
    mu: Any  # first moment
    nu: Any  # second moment


def update_bound(b1, b2, count) -> jax.Array:
    """Largest ``|m_hat| / sqrt(v_hat)`` exact Adam can produce at step ``count`` (Cauchy-Schwarz).

    ``m_t = sum_k (1-b1) b1^(t-k) g_k`` and ``v_t = sum_k (1-b2) b2^(t-k) g_k^2`` give
    ``|m_t| <= (1-b1)/sqrt(1-b2) * sqrt(sum_j r^j) * sqrt(v_t)`` with ``r = b1^2/b2``; the bias
    corrections then scale it by ``sqrt(1-b2^t) / (1-b1^t)``. It is 1 at t=1 and about 7.3 for
    (0.9, 0.999) at large t.
    """
    t = jnp.asarray(count, jnp.float32)
    b1, b2 = jnp.asarray(b1, jnp.float32), jnp.asarray(b2, jnp.float32)
    r = b1 * b1 / b2
    near_one = jnp.abs(1.0 - r) < 1e-6
    geo = jnp.where(near_one, t, (1.0 - r**t) / jnp.where(near_one, 1.0, 1.0 - r))
    bound = (1.0 - b1) / (1.0 - b1**t) * jnp.sqrt((1.0 - b2**t) / (1.0 - b2) * geo)
    return jnp.where(t >= 1, bound, 1.0)


def _zero_moment(p, selected: bool, dtype) -> Any:
    shape = tuple(p.shape)
    if not selected:
        return jnp.zeros(shape, jnp.float32)
    # Start from zeros with scale 1: the first write computes the real scale from the new amax.
    return ScaledTensor(jnp.zeros(shape, dtype), jnp.ones((), jnp.float32))


def _read(x) -> jax.Array:
    """A stored moment as f32; non-finite entries (a corrupt state) read as 0."""
    v = x.dequantize() if is_scaled(x) else x.astype(jnp.float32)
    return jnp.where(jnp.isfinite(v), v, 0.0)


def _write(new: jax.Array, old, ok: jax.Array, seed, amax=None) -> Any:
    """Store ``new`` like ``old`` (fresh scale for a ``ScaledTensor``); keep ``old`` if not ``ok``.

    ``seed`` None rounds to nearest; otherwise the narrow cast rounds stochastically. ``amax``:
    ``new``'s, if the caller already reduced it.
    """
    if is_scaled(old):
        narrow = old.data.dtype != jnp.float32
        noise = hash_bits(new.shape, seed) if narrow and seed is not None else None
        # Cast to old.data.dtype (E4M3/E5M2/FP16/BF16 per config) with a scale from new's amax.
        fresh = quantize_scaled(new, old.scale, old.data.dtype, noise, amax)
        return jax.tree.map(lambda n, o: jnp.where(ok, n, o), fresh, old)
    return jnp.where(ok, new, old)


def moment_seeds(base: jax.Array, index: int) -> tuple[jax.Array, jax.Array]:
    """Stochastic-rounding seeds of leaf ``index``'s m and v from the step's ``base`` seed."""
    salt = base + jnp.uint32((2 * index + 1) * 0x632BE5AB % 2**32)
    return salt, salt ^ jnp.uint32(0x5BD1E995)


def step_seed(count: jax.Array, seed: int) -> jax.Array:
    """The step's base seed: noise differs per step and is fixed by (seed, count)."""
    return count.astype(jnp.uint32) * jnp.uint32(0x9E3779B1) + jnp.uint32(seed)


def new_moments(g, mu, nu, b1, b2) -> tuple[jax.Array, jax.Array]:
    """This step's f32 ``m`` and ``v`` from the gradient and the stored moments."""
    g32 = g.astype(jnp.float32)
    m = b1 * _read(mu) + (1.0 - b1) * g32
    v = b2 * _read(nu) + (1.0 - b2) * jnp.square(g32)
    return m, v


def direction(m, v, c1, c2, eps, limit) -> jax.Array:
    """Adam's f32 update ``m_hat / (sqrt(v_hat) + eps)``, non-finite as 0, clipped to ``limit``."""
    # From this step's f32 moments; quantization only affects later steps.
    u = (m / c1) / (jnp.sqrt(v / c2) + eps)
    return jnp.clip(jnp.where(jnp.isfinite(u), u, 0.0), -limit, limit)


def bias_corrections(b1, b2, count) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(1 - b1**count, 1 - b2**count, update clip limit)`` of step ``count``."""
    c1 = 1.0 - jnp.asarray(b1, jnp.float32) ** count.astype(jnp.float32)
    c2 = 1.0 - jnp.asarray(b2, jnp.float32) ** count.astype(jnp.float32)
    return c1, c2, BOUND_SLACK * update_bound(b1, b2, count)


def joint_amaxes(*xs: jax.Array) -> tuple[jax.Array, ...]:
    """``formats.amax`` of each of ``xs`` (one shape) from one reduction: one read of the inputs.

    Separate reductions of m and v each re-read the gradient and their moment, and XLA does not
    merge them.
    """
    abs_xs = [jnp.abs(x).astype(jnp.float32) for x in xs]
    zeros = [jnp.zeros((), jnp.float32)] * len(xs)

    def pairwise_max(a, b):
        return tuple(jnp.maximum(u, v) for u, v in zip(a, b, strict=True))

    return tuple(jax.lax.reduce(abs_xs, zeros, pairwise_max, tuple(range(xs[0].ndim))))


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
    m_dtype, v_dtype = storage_dtype(m_format), storage_dtype(v_format)

    def init_fn(params):
        selected = resolve_mask(params, mask, cover_all)
        mu = jax.tree.map(
            lambda p, s: _zero_moment(p, s, m_dtype), params, selected, is_leaf=is_scaled
        )
        nu = jax.tree.map(
            lambda p, s: _zero_moment(p, s, v_dtype), params, selected, is_leaf=is_scaled
        )
        return Fp8AdamState(count=jnp.zeros((), jnp.int32), mu=mu, nu=nu)

    def update_fn(updates, state, params=None):
        del params
        count = optax.safe_increment(state.count)
        c1, c2, limit = bias_corrections(b1, b2, count)

        g_leaves, treedef = jax.tree.flatten(updates)
        mu_leaves = treedef.flatten_up_to(state.mu)
        nu_leaves = treedef.flatten_up_to(state.nu)
        # One read of the gradients decides the step: a finite sum of squares means every
        # gradient and every square (hence every new m and v, stored moments reading as finite)
        # is finite. Deciding first lets each leaf's moments be computed, used and re-quantized
        # in one place, so XLA need not keep every leaf's f32 m/v (8 bytes/param) alive at once,
        # and the graph (and its compile time) is smaller.
        if assume_finite:
            ok = jnp.array(True)
        else:
            sq = [jnp.sum(jnp.square(g.astype(jnp.float32))) for g in g_leaves]
            ok = jnp.isfinite(sum(sq)) if sq else jnp.array(True)

        # Noise differs per step, leaf and moment, and is fixed by (seed, count): runs reproduce.
        base = step_seed(count, seed)
        out_u, out_m, out_v = [], [], []
        for i, (g, mu, nu) in enumerate(zip(g_leaves, mu_leaves, nu_leaves, strict=True)):
            if out_m:
                # Leaves in order: this leaf's inputs wait for the previous leaf's update and
                # new state, so XLA need not keep every leaf's f32 moments alive at once (as
                # master.apply_updates' chain does for the masters).
                prev = (out_u[-1], out_m[-1], out_v[-1])
                g, mu, nu, _ = jax.lax.optimization_barrier((g, mu, nu, prev))
            m_seed, v_seed = moment_seeds(base, i) if stochastic_rounding else (None, None)
            m, v = new_moments(g, mu, nu, b1, b2)
            u = direction(m, v, c1, c2, eps, limit)
            out_u.append(jnp.where(ok, u, 0.0).astype(g.dtype))
            amax_m = amax_v = None
            if is_scaled(mu) and is_scaled(nu):
                amax_m, amax_v = joint_amaxes(m, v)
            out_m.append(_write(m, mu, ok, m_seed, amax_m))
            out_v.append(_write(v, nu, ok, v_seed, amax_v))
        new_state = Fp8AdamState(
            count=jnp.where(ok, count, state.count),
            mu=treedef.unflatten(out_m),
            nu=treedef.unflatten(out_v),
        )
        return treedef.unflatten(out_u), new_state

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
) -> optax.GradientTransformation:
    """AdamW (decoupled weight decay) on ``scale_by_fp8_adam``; ``learning_rate`` may be a schedule.

    ``mask``/``cover_all`` select the low-precision states; ``weight_decay_mask`` is optax's
    (None decays every leaf, as ``optax.adamw``). ``params`` may hold ``ScaledTensor`` masters:
    they are dequantized for weight decay. A non-finite gradient skips the whole step.
    """
    inner = optax.chain(
        scale_by_fp8_adam(
            b1,
            b2,
            eps,
            m_format,
            v_format,
            mask,
            cover_all,
            stochastic_rounding,
            seed,
            assume_finite,
        ),
        optax.add_decayed_weights(weight_decay, weight_decay_mask),
        optax.scale_by_learning_rate(learning_rate),
    )

    def init_fn(params):
        return inner.init(materialize(params))

    def update_fn(updates, state, params=None):
        params = None if params is None else materialize(params)
        new_updates, new_state = inner.update(updates, state, params)
        if assume_finite:
            return new_updates, new_state
        ok = new_state[0].count != state[0].count  # Adam's count stands still on a skipped step
        # Weight decay and the schedule's counter would still move on a skipped step: undo both.
        new_updates = jax.tree.map(lambda u: jnp.where(ok, u, jnp.zeros_like(u)), new_updates)
        new_state = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new_state, state)
        return new_updates, new_state

    return optax.GradientTransformation(init_fn, update_fn)
