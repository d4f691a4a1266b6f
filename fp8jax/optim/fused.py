"""The trainer's AdamW step in one pass per leaf: Adam, weight decay, learning rate and masters.

``FusedAdamW.transform()`` is the optimizer as an optax transformation (``adam.fp8_adamw`` with
its global-norm clipping) that library code drives as ``tx.update`` + ``adam.apply_updates``.
``FusedAdamW.apply`` takes the same state and runs the same per-leaf step
(``update.step_leaves``), but stores each leaf's new moments and master together, straight into
the state, old values kept where the step is skipped (``ok`` False): nothing else needs the old
state, so its donated buffers are updated in place. The results are the same bits, up to XLA's
default excess precision, which may keep a bf16 intermediate (the update) in f32 in one program
and not in the other; compiled with ``xla_allow_excess_precision=False`` they are equal.

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

from fp8jax.optim.master import ScaledTensor, fresh_scales, is_scaled, scaled_amaxes
from fp8jax.optim.update import Hparams, LeafStep, adamw_transformation, step_leaves

__all__ = ["FusedAdamW", "slab_layers"]


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


@dataclasses.dataclass(frozen=True)
class FusedAdamW:
    """AdamW with FP8/FP16 moments (``adam.fp8_adamw``) behind global-norm clipping."""

    learning_rate: float | Callable[[jax.Array], jax.Array]  # a constant or an optax schedule
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    weight_decay: float | Callable[[jax.Array], jax.Array] = 1e-4  # a constant or a schedule
    weight_decay_mask: Any = None  # optax's: None decays every leaf
    m_format: str = "e4m3"
    v_format: str = "float16"
    grad_clip: float = 0.0  # global-norm clip (0: none)
    stochastic_rounding: bool = False  # of the moments (``scale_by_fp8_adam``'s option)
    seed: int = 0  # of the moments' rounding noise
    # f32 bytes per value (m, v, update, master) a stacked leaf's update handles at a time: its
    # leading-axis slices are updated in groups this size. 0: every leaf whole.
    slice_bytes: int = 0

    def hparams(self) -> Hparams:
        """The hyper-parameters ``transform`` and ``apply`` both step with."""
        return Hparams(
            learning_rate=self.learning_rate,
            b1=self.b1,
            b2=self.b2,
            eps=self.eps,
            weight_decay=self.weight_decay,
            weight_decay_mask=self.weight_decay_mask,
            grad_clip=self.grad_clip,
            stochastic_rounding=self.stochastic_rounding,
            seed=self.seed,
        )

    def transform(self) -> optax.GradientTransformation:
        """The optax transformation whose ``update`` + ``apply_updates`` equal ``apply``, bitwise.

        Its state keeps the layout of ``optax.chain(optax.clip_by_global_norm, adam.fp8_adamw)``
        (checkpoints keep their tree): the clip's empty state, then fp8_adamw's.
        """
        adamw = adamw_transformation(
            self.hparams(),
            self.m_format,
            self.v_format,
            assume_finite=True,  # ``apply``'s caller decides ``ok``
        )
        clip = [optax.identity()] if self.grad_clip > 0 else []  # adamw clips the gradients
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
        g_leaves, treedef = jax.tree.flatten(grads)
        sliced = [False] * len(g_leaves) if stacked is None else treedef.flatten_up_to(stacked)

        def run_leaf(i: int, step: LeafStep, g: jax.Array, stores: tuple) -> tuple[list, None]:
            k = slab_layers(g.shape, self.slice_bytes) if sliced[i] and g.ndim >= 1 else 0
            if 0 < k < g.shape[0]:
                return _step_in_slabs(step, g, stores, k), None
            return step.whole(g, stores)

        return step_leaves(
            self.hparams(),
            grads,
            opt_state,
            params,  # masters stay whole ScaledTensors
            ok,
            masters=True,
            decay_dtype=decay_dtype,
            master_seed=master_seed,
            run_leaf=run_leaf,
        )


def _step_in_slabs(step: LeafStep, g: jax.Array, stores: tuple, k: int) -> list:
    """The leaf's new stores, ``k`` leading-axis slices at a time: amaxes over all slabs, then
    the writes (module docstring)."""
    n, per_slab = g.shape[0] // k, k * math.prod(g.shape[1:])
    zeros = tuple(jnp.zeros((), jnp.float32) for st in stores if is_scaled(st))
    olds = [st.data if is_scaled(st) else st for st in stores]
    # Both loops read the stores from the buffers the second one writes: in place where
    # they are the (donated) stores themselves.
    never = step.ok & ~step.ok  # False, known only once the step has decided
    bufs = [_as_bits(x, never) for x in olds]
    g_bits = _as_bits(g)

    def slab_of(bufs, i):
        return [
            _take(ScaledTensor(b, st.scale) if is_scaled(st) else b, i, k, old.dtype)
            for b, st, old in zip(bufs, stores, olds, strict=True)
        ]

    def reduce_slice(i, acc):
        slab = slab_of(bufs, i)
        vals, _ = step.values(_take(g_bits, i, k, g.dtype), slab)
        amaxes = scaled_amaxes(vals, slab)
        return tuple(jnp.maximum(a, b) for a, b in zip(acc, amaxes, strict=True))

    scales = fresh_scales(jax.lax.fori_loop(0, n, reduce_slice, zeros), stores)

    def write_slice(i, bufs):
        slab = slab_of(bufs, i)  # slice i still holds its old values
        offset = i.astype(jnp.uint32) * jnp.uint32(per_slab % 2**32)
        vals, _ = step.values(_take(g_bits, i, k, g.dtype), slab)
        new = step.encode(vals, slab, scales, offset)
        return [
            jax.lax.dynamic_update_slice_in_dim(b, _as_bits(x), i * k, 0)
            for b, x in zip(bufs, new, strict=True)
        ]

    bufs = jax.lax.fori_loop(0, n, write_slice, bufs)
    datas = [_from_bits(b, old.dtype) for b, old in zip(bufs, olds, strict=True)]
    return step.finish(datas, stores, scales)
