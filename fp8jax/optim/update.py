"""FP8-LM's AdamW step, one leaf at a time: the one implementation of fp8jax's optimizer.

``adamw_leaf`` is a leaf's arithmetic: global-norm clipping, Adam's moments and direction (f32,
from the dequantized stored moments), decoupled weight decay and the signed learning rate, each
as optax's ``clip_by_global_norm``, ``adamw`` and ``scale_by_learning_rate`` compute it.
``LeafStep`` adds how its results are stored (``master.write``: a fresh per-tensor scale, the
narrow cast, stochastic rounding, the old values kept on a skipped step), and ``step_leaves``
runs it over a tree. Every face of the optimizer is that loop: ``adam.scale_by_fp8_adam`` and
``adam.fp8_adamw`` (optax: the updates out, the moments into the state) and
``fused.FusedAdamW.apply`` (the new masters written together with the moments), so the faces
agree bit for bit and a change to the step is written once.

The optax state is read by the names of its parts (``Fp8AdamState``, optax's
``ScaleByScheduleState`` and ``WeightDecaySchedule``), wherever a chain puts them.

``|update|`` is clipped at ``BOUND_SLACK`` times the bound exact Adam obeys (``update_bound``):
quantized moments overshoot it by their rounding error (up to 12.5% for E4M3 m), so clipping
at the bound itself would bias early steps, where Adam runs at the bound; the clip only touches
entries that quantization broke (a v entry flushed to zero under a live m).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fp8jax.optim.master import (
    ScaledTensor,
    encode_like,
    is_scaled,
    leaf_salt,
    materialize,
    rebuild,
    resolve_mask,
    storage_dtype,
    updated_value,
    write,
)

__all__ = [
    "BOUND_SLACK",
    "Fp8AdamState",
    "Hparams",
    "LeafStep",
    "RunLeaf",
    "StepScalars",
    "adamw_leaf",
    "adamw_transformation",
    "bias_corrections",
    "clip_gradient",
    "direction",
    "init_moments",
    "moment_seeds",
    "new_moments",
    "step_leaves",
    "step_scalars",
    "step_seed",
    "update_bound",
]

# The clip of |update| sits at 2x the bound exact Adam obeys (module docstring).
BOUND_SLACK = 2.0

# optax's state types that count steps, read and advanced by name (optax does not export
# WeightDecaySchedule, the state of a scheduled weight decay).
_SCHEDULE = "ScaleByScheduleState"
_DECAY_SCHEDULE = "WeightDecaySchedule"


class Fp8AdamState(NamedTuple):
    """Adam state: selected leaves of ``mu``/``nu`` are ``ScaledTensor``, the rest f32 arrays."""

    count: jax.Array  # [] int32, steps taken (skipped non-finite steps do not count)
    mu: Any  # first moment
    nu: Any  # second moment


@dataclasses.dataclass(frozen=True)
class Hparams:
    """AdamW's hyper-parameters: ``optax.adamw``'s behind ``optax.clip_by_global_norm``."""

    # A constant, an optax schedule (of the steps taken), or None: the Adam direction alone,
    # neither scaled nor negated (``adam.scale_by_fp8_adam``).
    learning_rate: float | Callable[[jax.Array], jax.Array] | None = None
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float | Callable[[jax.Array], jax.Array] = 0.0  # a constant or a schedule
    weight_decay_mask: Any = None  # optax's: None decays every leaf
    grad_clip: float = 0.0  # global-norm clip of the gradients (0: none)
    stochastic_rounding: bool = False  # of the narrow moment casts
    seed: int = 0  # of the moments' rounding noise

    @property
    def decays(self) -> bool:
        """Whether weight decay is applied at all (``optax.add_decayed_weights`` skips 0)."""
        wd = self.weight_decay
        return not (isinstance(wd, (int, float)) and wd == 0.0)


class StepScalars(NamedTuple):
    """The scalars one step shares across its leaves."""

    c1: jax.Array  # 1 - b1**count
    c2: jax.Array  # 1 - b2**count
    limit: jax.Array  # clip of |update|: BOUND_SLACK * update_bound
    lr: Any  # the signed rate, -learning_rate (None: no rate)
    weight_decay: Any  # this step's weight decay rate
    norm: jax.Array | None  # the gradients' global norm (None: no clipping)
    trigger: jax.Array | None  # norm < grad_clip: the gradients pass unclipped


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


def bias_corrections(b1, b2, count) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(1 - b1**count, 1 - b2**count, update clip limit)`` of step ``count``."""
    c1 = 1.0 - jnp.asarray(b1, jnp.float32) ** count.astype(jnp.float32)
    c2 = 1.0 - jnp.asarray(b2, jnp.float32) ** count.astype(jnp.float32)
    return c1, c2, BOUND_SLACK * update_bound(b1, b2, count)


def moment_seeds(base: jax.Array, index: int) -> tuple[jax.Array, jax.Array]:
    """Stochastic-rounding seeds of leaf ``index``'s m and v from the step's ``base`` seed."""
    salt = base + jnp.uint32((2 * index + 1) * 0x632BE5AB % 2**32)
    return salt, salt ^ jnp.uint32(0x5BD1E995)


def step_seed(count: jax.Array, seed: int) -> jax.Array:
    """The step's base seed: noise differs per step and is fixed by (seed, count)."""
    return count.astype(jnp.uint32) * jnp.uint32(0x9E3779B1) + jnp.uint32(seed)


def _zero_moment(p, selected: bool, dtype) -> Any:
    shape = tuple(p.shape)
    if not selected:
        return jnp.zeros(shape, jnp.float32)
    # Start from zeros with scale 1: the first write computes the real scale from the new amax.
    return ScaledTensor(jnp.zeros(shape, dtype), jnp.ones((), jnp.float32))


def init_moments(
    params, m_format="e4m3", v_format="float16", mask=None, cover_all: bool = False
) -> Fp8AdamState:
    """Zero moments: ``m_format``/``v_format`` with a scale on the selected leaves, else f32.

    ``mask``/``cover_all`` select as ``master.resolve_mask`` (None: the matmul weights).
    """
    m_dtype, v_dtype = storage_dtype(m_format), storage_dtype(v_format)
    selected = resolve_mask(params, mask, cover_all)
    mu = jax.tree.map(lambda p, s: _zero_moment(p, s, m_dtype), params, selected, is_leaf=is_scaled)
    nu = jax.tree.map(lambda p, s: _zero_moment(p, s, v_dtype), params, selected, is_leaf=is_scaled)
    return Fp8AdamState(count=jnp.zeros((), jnp.int32), mu=mu, nu=nu)


def step_scalars(hp: Hparams, count: jax.Array, grads, state) -> StepScalars:
    """Step ``count``'s scalars; the schedules read their counts from the optax ``state``."""
    c1, c2, limit = bias_corrections(hp.b1, hp.b2, count)
    rate, wd = hp.learning_rate, hp.weight_decay
    lr = None
    if rate is not None:  # optax.scale_by_learning_rate's sign
        lr = -1 * (rate(_schedule_count(state, _SCHEDULE)) if callable(rate) else rate)
    if callable(wd):
        wd = wd(_schedule_count(state, _DECAY_SCHEDULE))
    norm = trigger = None
    if hp.grad_clip > 0:  # optax.clip_by_global_norm's norm and trigger
        norm = optax.tree.norm(grads)
        trigger = jnp.squeeze(norm < hp.grad_clip)
    return StepScalars(c1, c2, limit, lr, wd, norm, trigger)


def _schedule_count(state, name: str) -> jax.Array:
    found = optax.tree.get(state, name)
    if found is None:
        raise ValueError(
            f"the optimizer state holds no {name}: build it with this optimizer's init"
        )
    return found.count


def _read(x) -> jax.Array:
    """A stored moment as f32; non-finite entries (a corrupt state) read as 0."""
    v = x.dequantize() if is_scaled(x) else x.astype(jnp.float32)
    return jnp.where(jnp.isfinite(v), v, 0.0)


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


def clip_gradient(g: jax.Array, hp: Hparams, s: StepScalars) -> jax.Array:
    """``g`` clipped as ``optax.clip_by_global_norm`` clips it (unchanged without clipping)."""
    if s.norm is None:
        return g
    return jax.lax.select(s.trigger, g, (g / s.norm.astype(g.dtype)) * hp.grad_clip)


def adamw_leaf(
    g: jax.Array, mu, nu, p, hp: Hparams, s: StepScalars, decay: bool, decay_dtype=jnp.float32
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One leaf's AdamW step: its new f32 ``m`` and ``v`` and its update (``g.dtype`` or wider).

    ``mu``/``nu``: the stored moments; ``p``: the weights weight decay reads (a master is
    dequantized to ``decay_dtype``); ``decay``: whether it applies to this leaf.
    """
    g = clip_gradient(g, hp, s)
    m, v = new_moments(g, mu, nu, hp.b1, hp.b2)
    u = direction(m, v, s.c1, s.c2, hp.eps, s.limit).astype(g.dtype)
    if decay:  # optax.add_decayed_weights
        u = u + s.weight_decay * (p.dequantize(decay_dtype) if is_scaled(p) else p)
    if s.lr is not None:  # optax.scale_by_learning_rate: a schedule's rate in the update's dtype
        u = (jnp.array(s.lr, dtype=u.dtype) if callable(hp.learning_rate) else s.lr) * u
    return m, v, u


@dataclasses.dataclass(frozen=True)
class LeafStep:
    """One leaf's step: its f32 values from a slab of its inputs, and their stored form.

    ``stores`` are the leaf's stored moments ``(mu, nu)``, with its master (or plain param) as a
    third when the step writes the new weights itself; a slab is any leading-axis slice of them.
    """

    hp: Hparams
    scalars: StepScalars
    decay: bool  # weight decay applies to this leaf
    decay_dtype: jnp.dtype  # the dtype weight decay reads masters in
    seeds: tuple  # rounding seeds of m, v and the master (None: round to nearest)
    ok: jax.Array  # write the new values (else keep the old)

    def values(self, g: jax.Array, stores: tuple, weight=None) -> tuple[tuple, jax.Array]:
        """``(new f32 values of stores, update)``; the new weight is ``master.updated_value``'s.

        ``weight``: what weight decay reads when ``stores`` holds no weight.
        """
        mu, nu, *param = stores
        p = param[0] if param else weight
        m, v, u = adamw_leaf(g, mu, nu, p, self.hp, self.scalars, self.decay, self.decay_dtype)
        return ((m, v, updated_value(p, u)) if param else (m, v)), u

    def encode(self, vals, stores, scales, offset) -> list:
        """The slab's stored form (``master.encode_like``): old where not ``ok``."""
        seeds = self.seeds[: len(stores)]
        return encode_like(vals, stores, scales, seeds, self.ok, offset)

    def finish(self, datas, stores, scales) -> list:
        """New stores from written data and scales (``master.rebuild``)."""
        return rebuild(datas, stores, scales, self.ok)

    def whole(self, g: jax.Array, stores: tuple, weight=None) -> tuple[list, jax.Array]:
        """``(new stores, update)`` of the leaf at once."""
        vals, u = self.values(g, stores, weight)
        return write(vals, stores, self.seeds[: len(stores)], self.ok), u


# How ``step_leaves`` steps leaf i: ``(i, step, g, stores) -> (new stores, update)``.
RunLeaf = Callable[[int, LeafStep, jax.Array, tuple], tuple[list, Any]]


def _decay_flags(hp: Hparams, grads, treedef) -> list[bool]:
    """Per leaf of ``grads``: whether weight decay applies (optax.masked's reading of the mask)."""
    if not hp.decays:
        return [False] * treedef.num_leaves
    if hp.weight_decay_mask is None:
        return [True] * treedef.num_leaves
    mask = resolve_mask(grads, hp.weight_decay_mask)  # a tree, or a prefix of grads
    full = jax.tree.map(lambda m, sub: jax.tree.map(lambda _: m, sub), mask, grads)
    return [bool(m) for m in treedef.flatten_up_to(full)]


def _finite(g_leaves, hp: Hparams, s: StepScalars) -> jax.Array:
    """Whether every (clipped) gradient and its square are finite: one read of the gradients.

    A finite sum of squares means every gradient and every square (hence every new m and v,
    stored moments reading as finite) is finite. Deciding first lets each leaf's moments be
    computed, used and re-quantized in one place, so XLA need not keep every leaf's f32 m/v
    (8 bytes/param) alive at once.
    """
    sq = [jnp.sum(jnp.square(clip_gradient(g, hp, s).astype(jnp.float32))) for g in g_leaves]
    return jnp.isfinite(sum(sq)) if sq else jnp.array(True)


def step_leaves(
    hp: Hparams,
    grads,
    state,
    params=None,
    ok: jax.Array | None = None,
    *,
    masters: bool = False,
    decay_dtype=jnp.float32,
    master_seed: jax.Array | None = None,
    run_leaf: RunLeaf | None = None,
) -> tuple[Any, Any]:
    """One AdamW step over every leaf of ``grads``: ``(out, new state)``.

    ``state``: an optax state holding one ``Fp8AdamState`` (and the states of the schedules
    ``hp`` reads). ``out``: the updates, as an optax transformation returns them; with
    ``masters``, the new ``params`` (``ScaledTensor`` masters re-quantized, stochastically with
    ``master_seed``), as ``master.apply_updates`` would make them. ``params``: the weights weight
    decay reads (masters in ``decay_dtype``). ``ok`` False (a bool array): out and state are the
    old values (zero updates); None: a non-finite gradient (or square) skips the step.
    ``run_leaf``: how leaf i is stepped (default ``LeafStep.whole``).
    """
    adam = optax.tree.get(state, Fp8AdamState.__name__)
    count = optax.safe_increment(adam.count)
    s = step_scalars(hp, count, grads, state)
    g_leaves, treedef = jax.tree.flatten(grads)
    ok = _finite(g_leaves, hp, s) if ok is None else jnp.asarray(ok, jnp.bool_)
    decays = _decay_flags(hp, grads, treedef)
    if params is None and any(decays):
        raise ValueError("weight decay reads the params: call update(grads, state, params)")
    p_leaves = [None] * len(g_leaves) if params is None else treedef.flatten_up_to(params)
    mu_leaves = treedef.flatten_up_to(adam.mu)
    nu_leaves = treedef.flatten_up_to(adam.nu)
    # Noise differs per step, leaf and moment, and is fixed by (seed, count): runs reproduce.
    m_base = step_seed(count, hp.seed) if hp.stochastic_rounding else None
    p_base = None if master_seed is None else jnp.asarray(master_seed).astype(jnp.uint32)

    out, out_m, out_v = [], [], []
    for i, (g, p, mu, nu) in enumerate(zip(g_leaves, p_leaves, mu_leaves, nu_leaves, strict=True)):
        if out_m:
            # Leaves in order: a leaf's inputs wait for the previous leaf's outputs, so XLA
            # need not hold several leaves' f32 temporaries at once.
            prev = (out[-1], out_m[-1], out_v[-1])
            (g, p, mu, nu), _ = jax.lax.optimization_barrier(((g, p, mu, nu), prev))
        seeds = [None, None, None]
        if m_base is not None:
            seeds[0], seeds[1] = moment_seeds(m_base, i)
        if p_base is not None:
            seeds[2] = leaf_salt(p_base, i)
        step = LeafStep(hp, s, decays[i], jnp.dtype(decay_dtype), tuple(seeds), ok)
        stores = (mu, nu, p) if masters else (mu, nu)
        if run_leaf is None:
            new, u = step.whole(g, stores, p)
        else:
            new, u = run_leaf(i, step, g, stores)
        out_m.append(new[0])
        out_v.append(new[1])
        out.append(new[2] if masters else jnp.where(ok, u, jnp.zeros_like(u)))

    new_state = {
        Fp8AdamState.__name__: Fp8AdamState(
            count=jnp.where(ok, count, adam.count),
            mu=treedef.unflatten(out_m),
            nu=treedef.unflatten(out_v),
        )
    }
    for name in (_SCHEDULE, _DECAY_SCHEDULE):  # schedules count the steps taken
        sched = optax.tree.get(state, name)
        if sched is not None:
            new_count = jnp.where(ok, optax.safe_increment(sched.count), sched.count)
            new_state[name] = sched._replace(count=new_count)
    return treedef.unflatten(out), optax.tree.set(state, **new_state)


def adamw_transformation(
    hp: Hparams,
    m_format="e4m3",
    v_format="float16",
    mask=None,
    cover_all: bool = False,
    assume_finite: bool = False,
) -> optax.GradientTransformation:
    """``hp``'s AdamW as an optax transformation with ``optax.adamw``'s state layout.

    The state is ``(Fp8AdamState, weight decay's, learning rate's)``, as the chain
    ``scale_by_adam``, ``add_decayed_weights``, ``scale_by_learning_rate`` keeps it (so
    checkpoints keep their tree); ``mask``/``cover_all`` select the low-precision moments.
    ``assume_finite``: the caller discards a step with a non-finite gradient itself.
    """

    def init_fn(params):
        params = materialize(params)
        return (
            init_moments(params, m_format, v_format, mask, cover_all),
            optax.add_decayed_weights(hp.weight_decay, hp.weight_decay_mask).init(params),
            optax.scale_by_learning_rate(hp.learning_rate).init(params),
        )

    def update_fn(updates, state, params=None):
        return step_leaves(hp, updates, state, params, jnp.array(True) if assume_finite else None)

    return optax.GradientTransformation(init_fn, update_fn)
