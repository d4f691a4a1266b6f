"""The trainer's AdamW step in one pass per leaf: Adam, weight decay, learning rate and masters.

``FusedAdamW.transform()`` is the optax chain (global-norm clipping, then ``adam.fp8_adamw``)
that library code drives as ``tx.update`` + ``adam.apply_updates``. ``FusedAdamW.apply`` takes
the same state and runs the same operations on each element, but computes each leaf's new
moments, update and master together and writes them straight into the state, old values kept
where the step is skipped (``ok`` False): nothing else needs the old state, so its donated
buffers are updated in place. The results are the same bits, up to XLA's default excess
precision, which may keep a bf16 intermediate (the update) in f32 in one program and not in
the other; compiled with ``xla_allow_excess_precision=False`` they are equal.

A per-tensor scale needs the amax of the whole new tensor before anything is cast, so a plain
update materialises every f32 temporary of a leaf (m, v, the update, the new master: 16 bytes a
parameter). With ``slice_bytes`` set, a leaf stacked over layers (``nn.scan``) is done a group
of layer slices at a time (``slab_layers``), in two loops: the first reduces the new m, v and
master amaxes over all groups, the second recomputes each group and writes it with the scales
those give. Only one group's f32 values are alive at a time, for twice the arithmetic (not the
memory traffic of f32 temporaries); the loops' small kernels cost step time on a small model.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from fp8jax.optim import adam
from fp8jax.optim.master import (
    ScaledTensor,
    encode,
    hash_bits,
    is_scaled,
    leaf_salt,
    resolve_mask,
    scale_for,
    updated_value,
)


def _as_bits(x: jax.Array, after: jax.Array | None = None) -> jax.Array:
    """``x`` bit-cast to an unsigned integer of its width where XLA:CPU lacks its dynamic slices.

    XLA's CPU backend computes a bf16 or FP8 dynamic slice (or update) in a wider float, and
    then widens the whole stacked array once, outside the loop (an f32 copy of a gradient, an
    f16 copy of an E4M3 moment). Integers are sliced as they are; the bit-cast costs one copy of
    the array, so other backends and f16 (which CPU slices natively) skip it. ``after``: a bool
    that is False whenever the copy is read, OR-ed into it so that XLA cannot make the copy
    before ``after`` exists (a copy of the train state would otherwise be scheduled before the
    forward pass and held across it).
    """
    dtype = jnp.dtype(x.dtype)
    narrow = jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4
    if not (narrow and dtype != jnp.dtype(jnp.float16) and jax.default_backend() == "cpu"):
        return x
    bits = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * dtype.itemsize}"))
    return bits if after is None else bits | after.astype(bits.dtype)


def _from_bits(bits: jax.Array, dtype) -> jax.Array:
    """Inverse of ``_as_bits`` for an array of ``dtype``."""
    return bits if bits.dtype == jnp.dtype(dtype) else jax.lax.bitcast_convert_type(bits, dtype)


def _take(x, i: jax.Array, k: int, dtype=None):
    """Slices ``[i * k, (i + 1) * k)`` of ``x``'s leading axis (a ``ScaledTensor`` keeps its
    per-tensor scale). ``x`` may be ``_as_bits``' view of an array of ``dtype``."""
    if is_scaled(x):
        return ScaledTensor(_take(x.data, i, k, dtype), x.scale)
    part = jax.lax.dynamic_slice_in_dim(_as_bits(x), i * k, k, 0)
    return _from_bits(part, x.dtype if dtype is None else dtype)


def slab_layers(shape: tuple[int, ...], slice_bytes: int) -> int:
    """Leading-axis slices of a stacked leaf updated together: the most that divide its length
    and whose f32 values take at most ``slice_bytes`` (at least 1; the whole leaf for 0)."""
    n, per_slice = shape[0], math.prod(shape[1:])
    if slice_bytes <= 0:
        return n
    fits = [k for k in range(1, n + 1) if n % k == 0 and 4 * k * per_slice <= slice_bytes]
    return max(fits, default=1)


def _narrow(store) -> bool:
    """Whether ``store`` is a ``ScaledTensor`` narrower than f32 (its casts may round)."""
    return is_scaled(store) and store.data.dtype != jnp.dtype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class FusedAdamW:
    """AdamW with FP8/FP16 moments (``adam.fp8_adamw``) behind global-norm clipping."""

    learning_rate: float | Callable[[jax.Array], jax.Array]  # a constant or an optax schedule
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 1e-4
    weight_decay_mask: Any = None  # optax's: None decays every leaf
    m_format: str = "e4m3"
    v_format: str = "float16"
    grad_clip: float = 0.0  # global-norm clip (0: none)
    stochastic_rounding: bool = False  # of the moments (``scale_by_fp8_adam``'s option)
    seed: int = 0  # of the moments' rounding noise
    # f32 bytes per value (m, v, update, master) a stacked leaf's update handles at a time: its
    # leading-axis slices are updated in groups this size. 0: every leaf whole.
    slice_bytes: int = 0

    def transform(self) -> optax.GradientTransformation:
        """The optax chain whose ``update`` + ``apply_updates`` equal ``apply`` bit for bit."""
        clip = [optax.clip_by_global_norm(self.grad_clip)] if self.grad_clip > 0 else []
        adamw = adam.fp8_adamw(
            self.learning_rate,
            b1=self.b1,
            b2=self.b2,
            eps=self.eps,
            weight_decay=self.weight_decay,
            weight_decay_mask=self.weight_decay_mask,
            m_format=self.m_format,
            v_format=self.v_format,
            stochastic_rounding=self.stochastic_rounding,
            seed=self.seed,
            assume_finite=True,  # ``apply``'s caller decides ``ok``
        )
        return optax.chain(*clip, adamw)

    def apply(
        self,
        grads,
        opt_state,
        params,
        ok: jax.Array,
        decay_dtype=jnp.float32,
        master_seed: jax.Array | None = None,
        stacked=None,
    ) -> tuple[Any, Any]:
        """``(params, opt_state)`` after one step; both unchanged where ``ok`` is False.

        Equals ``transform().update(grads, opt_state, materialize(params, decay_dtype))``, then
        ``apply_updates(params, updates, master_seed)``, then keeping the old params and state
        where not ``ok``. ``stacked``: a tree of bools like ``grads`` (or None): leaves whose
        leading axis is unsharded and done in groups of slices (layers stacked by ``nn.scan``)
        whose f32 values fit ``slice_bytes``.
        """
        ok = jnp.asarray(ok, jnp.bool_)
        *head, (adam_state, decay_state, lr_state) = opt_state
        count = optax.safe_increment(adam_state.count)
        c1, c2, limit = adam.bias_corrections(self.b1, self.b2, count)
        g_leaves, treedef = jax.tree.flatten(grads)
        rate = self.learning_rate
        lr = -1 * (rate(lr_state.count) if callable(rate) else rate)  # scale_by_learning_rate's
        steps = {"c1": c1, "c2": c2, "limit": limit, "lr": lr}
        if self.grad_clip > 0:  # optax.clip_by_global_norm's norm and trigger
            steps["norm"] = optax.tree.norm(grads)
            steps["trigger"] = jnp.squeeze(steps["norm"] < self.grad_clip)
        decays = (
            [True] * len(g_leaves)
            if self.weight_decay_mask is None
            else treedef.flatten_up_to(resolve_mask(grads, self.weight_decay_mask))
        )
        sliced = [False] * len(g_leaves) if stacked is None else treedef.flatten_up_to(stacked)
        p_leaves = treedef.flatten_up_to(params)  # masters stay whole ScaledTensors
        mu_leaves = treedef.flatten_up_to(adam_state.mu)
        nu_leaves = treedef.flatten_up_to(adam_state.nu)
        m_base = adam.step_seed(count, self.seed) if self.stochastic_rounding else None
        p_base = None if master_seed is None else jnp.asarray(master_seed).astype(jnp.uint32)

        out_p, out_m, out_v = [], [], []
        for i, (g, p, mu, nu) in enumerate(
            zip(g_leaves, p_leaves, mu_leaves, nu_leaves, strict=True)
        ):
            if out_p:
                # Leaves in order, as the unfused path: a leaf's inputs wait for the previous
                # leaf's outputs, so XLA need not hold several leaves' temporaries at once.
                prev = (out_p[-1], out_m[-1], out_v[-1])
                (g, p, mu, nu), _ = jax.lax.optimization_barrier(((g, p, mu, nu), prev))
            seeds = [None, None, None]
            if m_base is not None:
                seeds[0], seeds[1] = adam.moment_seeds(m_base, i)
            if p_base is not None:
                seeds[2] = leaf_salt(p_base, i)
            step = _Leaf(self, steps, decays[i], jnp.dtype(decay_dtype), seeds, ok)
            k = slab_layers(g.shape, self.slice_bytes) if sliced[i] and g.ndim >= 1 else 0
            stores = (mu, nu, p)
            new_m, new_v, new_p = (
                step.sliced(g, stores, k) if 0 < k < g.shape[0] else step.whole(g, stores)
            )
            out_m.append(new_m)
            out_v.append(new_v)
            out_p.append(new_p)

        new_adam = adam.Fp8AdamState(
            count=jnp.where(ok, count, adam_state.count),
            mu=treedef.unflatten(out_m),
            nu=treedef.unflatten(out_v),
        )
        if isinstance(lr_state, optax.ScaleByScheduleState):  # a schedule counts its steps
            lr_state = lr_state._replace(
                count=jnp.where(ok, optax.safe_increment(lr_state.count), lr_state.count)
            )
        return treedef.unflatten(out_p), (*head, (new_adam, decay_state, lr_state))


@dataclasses.dataclass(frozen=True)
class _Leaf:
    """One leaf's step: its f32 values from a slab of its inputs, and their stored form."""

    opt: FusedAdamW
    steps: dict[str, jax.Array]  # the step's scalars: bias corrections, limit, rate, clip
    decay: bool  # weight decay applies to this leaf
    decay_dtype: jnp.dtype  # the dtype weight decay reads the masters in
    seeds: list  # rounding seeds of m, v and the master (None: round to nearest)
    ok: jax.Array  # write the new values (else keep the old)

    def values(self, g: jax.Array, stores: tuple) -> tuple[jax.Array, jax.Array, jax.Array]:
        """New m, v (f32) and param (f32 for a master) of a slab, as the optax chain does."""
        o, s = self.opt, self.steps
        mu, nu, p = stores
        if "norm" in s:  # optax.clip_by_global_norm's clip_fn
            g = jax.lax.select(s["trigger"], g, (g / s["norm"].astype(g.dtype)) * o.grad_clip)
        m, v = adam.new_moments(g, mu, nu, o.b1, o.b2)
        u = adam.direction(m, v, s["c1"], s["c2"], o.eps, s["limit"]).astype(g.dtype)
        if self.decay:  # optax.add_decayed_weights on the materialised params
            u = u + o.weight_decay * (p.dequantize(self.decay_dtype) if is_scaled(p) else p)
        lr = s["lr"]
        u = (jnp.array(lr, dtype=u.dtype) if callable(o.learning_rate) else lr) * u
        return m, v, updated_value(p, u)

    def amaxes(self, vals, stores) -> tuple[jax.Array, ...]:
        """Amaxes of the values stored scaled (one reduction)."""
        scaled = [x for x, st in zip(vals, stores, strict=True) if is_scaled(st)]
        return adam.joint_amaxes(*scaled) if scaled else ()

    def scales(self, amaxes, stores) -> list:
        """New per-tensor scales of the scaled stores (None for plain ones)."""
        it = iter(amaxes)
        return [scale_for(next(it), st.scale, st.dtype) if is_scaled(st) else None for st in stores]

    def encode(self, vals, stores, scales, offset) -> list:
        """The slab's stored form: scaled data or plain values, old where not ``ok``."""
        out = []
        for x, st, scale, seed in zip(vals, stores, scales, self.seeds, strict=True):
            if is_scaled(st):
                noise = (
                    hash_bits(x.shape, seed, offset) if seed is not None and _narrow(st) else None
                )
                out.append(jnp.where(self.ok, encode(x, scale, st.dtype, noise), st.data))
            else:
                out.append(jnp.where(self.ok, x, st))
        return out

    def finish(self, datas, stores, scales) -> list:
        """New stores from written data and scales."""
        return [
            ScaledTensor(d, jnp.where(self.ok, sc, st.scale)) if is_scaled(st) else d
            for d, st, sc in zip(datas, stores, scales, strict=True)
        ]

    def whole(self, g: jax.Array, stores: tuple) -> list:
        """The leaf at once (small or unstacked leaves)."""
        vals = self.values(g, stores)
        scales = self.scales(self.amaxes(vals, stores), stores)
        return self.finish(self.encode(vals, stores, scales, 0), stores, scales)

    def sliced(self, g: jax.Array, stores: tuple, k: int) -> list:
        """The leaf ``k`` leading-axis slices at a time: amaxes over all slabs, then the writes."""
        n, per_slab = g.shape[0] // k, k * math.prod(g.shape[1:])
        zeros = tuple(jnp.zeros((), jnp.float32) for st in stores if is_scaled(st))
        olds = [st.data if is_scaled(st) else st for st in stores]
        # Both loops read the stores from the buffers the second one writes: in place where
        # they are the (donated) stores themselves.
        never = self.ok & ~self.ok  # False, known only once the step has decided
        bufs = [_as_bits(x, never) for x in olds]
        g_bits = _as_bits(g)

        def slab_of(bufs, i):
            return [
                _take(ScaledTensor(b, st.scale) if is_scaled(st) else b, i, k, old.dtype)
                for b, st, old in zip(bufs, stores, olds, strict=True)
            ]

        def reduce_slice(i, acc):
            slab = slab_of(bufs, i)
            amaxes = self.amaxes(self.values(_take(g_bits, i, k, g.dtype), slab), slab)
            return tuple(jnp.maximum(a, b) for a, b in zip(acc, amaxes, strict=True))

        scales = self.scales(jax.lax.fori_loop(0, n, reduce_slice, zeros), stores)

        def write_slice(i, bufs):
            slab = slab_of(bufs, i)  # slice i still holds its old values
            offset = i.astype(jnp.uint32) * jnp.uint32(per_slab % 2**32)
            vals = self.values(_take(g_bits, i, k, g.dtype), slab)
            new = self.encode(vals, slab, scales, offset)
            return [
                jax.lax.dynamic_update_slice_in_dim(b, _as_bits(x), i * k, 0)
                for b, x in zip(bufs, new, strict=True)
            ]

        bufs = jax.lax.fori_loop(0, n, write_slice, bufs)
        datas = [_from_bits(b, old.dtype) for b, old in zip(bufs, olds, strict=True)]
        return self.finish(datas, stores, scales)
