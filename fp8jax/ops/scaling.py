"""The FP8 scaling recipe protocol and registry, and the per-tensor scale state recipes update.

``Recipe`` is what the matmuls, the Flax modules, the FSDP gathers and the checkpoint code ask
of a recipe; each recipe is one module of ``fp8jax.recipes`` that registers itself in
``RECIPES`` (``make_recipe(name, **fields)`` builds one by name).

A ``ScaleState`` holds one tensor's scale and amax history; an ``Fp8Meta`` the three of one
FP8 matmul (inputs x, weights w, output gradients dy). Slot 0 of the history is the
*pending* amax of the current step: every use of the tensor in a step (shared weights,
``nn.scan`` reuse, micro-batches) merges into it by ``max``. ``commit`` ends the step: it
moves the pending amax into the history, recomputes the scale and clears slot 0.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from fp8jax.ops import formats

__all__ = [
    "AMAX_ALGOS",
    "DEFAULT",
    "RECIPES",
    "Fp8Meta",
    "QuantizedWeight",
    "Recipe",
    "ScaleState",
    "commit",
    "init_meta",
    "init_scale_state",
    "make_recipe",
    "recipe_name",
    "record",
    "record_history",
    "register",
    "sanitize_amax",
    "scale_from_amax",
    "use_scale",
]
AMAX_ALGOS = ("max", "most_recent")  # a recipe's amax_compute_algo choices (``commit``)
DEFAULT = "delayed"  # the recipe ``init_meta`` and the Flax modules use when none is given


class Recipe(abc.ABC):
    """An FP8 scaling recipe: how the scales of one matmul's operands are found and used.

    Each recipe is a frozen dataclass in its own module of ``fp8jax.recipes``, registered by
    name in ``RECIPES`` (``register``). Its fields include ``history_len``,
    ``amax_compute_algo``, ``margin`` and ``power_of_two`` (read by ``commit`` and
    ``scale_from_amax``). Code elsewhere asks the recipe what to do and never which one it is.
    """

    name: ClassVar[str]  # registry key; the 'fp8_<name>' scope of its matmuls; model.json's name

    @property
    @abc.abstractmethod
    def dy_format(self) -> str:
        """The FP8 format output gradients are quantized to ('e5m2' or 'e4m3')."""

    @property
    @abc.abstractmethod
    def scales_known_ahead(self) -> bool:
        """Whether every scale is stored before the GEMM runs (the fused cast paths need it)."""

    @property
    @abc.abstractmethod
    def per_tensor(self) -> bool:
        """Whether one scale, kept in the ``ScaleState``, covers a whole tensor: checkpoints
        serve with it and O3 gathers a kernel as E4M3 under it (else the scales come from each
        call's values and the state keeps amaxes for health reporting only)."""

    @property
    @abc.abstractmethod
    def fuses_mlp(self) -> bool:
        """Whether ``gelu_mlp`` can run GPT's MLP as one custom VJP (``fp8.fuse_mlp``)."""

    @property
    def weight_tile(self) -> int | None:
        """The side of the square tiles a weight is scaled in (one scale each), or None."""
        return None

    def use_scale(self, state: ScaleState, amax: jax.Array) -> jax.Array:
        """The scale one use of the tensor quantizes with, ``amax`` being this use's."""
        return state.scale

    @property
    def pads_grouped_rows(self) -> bool:
        """Whether ``grouped_matmul`` runs on rows padded to whole tiles per group
        (``ops.grouped.dispatch_layout``), so that a dispatch writes its rows there directly."""
        return False

    @property
    def quantizes_weights_once(self) -> bool:
        """Whether decoding can quantize each weight once per call (``quantize_weight``) and
        run its forward GEMMs on that copy (``prequantized_matmul``) instead of casting the
        weight at every token; else the matmul casts it at every call, as in training."""
        return False

    def quantize_weight(self, w: jax.Array, state: ScaleState) -> QuantizedWeight:
        """The forward GEMM's weight operand ``w`` [(B,) K, N] as that GEMM reads it, under
        the scale one use of it takes (``state``: the weight's)."""
        raise NotImplementedError(f"the FP8 recipe {self.name!r} quantizes weights per call")

    def prequantized_matmul(self, cfg, x: jax.Array, w: QuantizedWeight, meta: Fp8Meta):
        """``x . w`` [(B,) M, N] (forward only, no amax recorded) on a ``quantize_weight`` copy:
        the same values as ``matmul``'s forward on the weight it was made from."""
        raise NotImplementedError(f"the FP8 recipe {self.name!r} quantizes weights per call")

    def prequantized_grouped_matmul(
        self,
        x_MxK: jax.Array,
        w: QuantizedWeight,
        group_sizes_G: jax.Array,
        meta: Fp8Meta,
        out_dtype,
        layout=None,
    ) -> jax.Array:
        """The grouped GEMM's forward (``grouped_matmul``, no amax recorded, x's rows in
        ``layout`` where given) on the stacked [G, K, N] weight's decoding copy
        (``ops.grouped.decode_copy``: ``quantize_weight`` of w^T, [G, N, K])."""
        raise NotImplementedError(f"the FP8 recipe {self.name!r} quantizes weights per call")

    @abc.abstractmethod
    def saturation_stats(self, x: jax.Array, state: ScaleState) -> tuple[jax.Array, jax.Array]:
        """(saturated share, flushed share) of ``x`` under this recipe's scales for ``state``."""

    @abc.abstractmethod
    def matmul(self, cfg, x: jax.Array, w: jax.Array, meta: Fp8Meta) -> tuple[jax.Array, Fp8Meta]:
        """``(x . w, meta with this call's amaxes)``: the FP8 GEMM with its custom VJP.

        ``cfg`` is the call's ``gemm.GemmConfig``; x [(B,) M, K], w [(B,) K, N] padded to tiles.
        """

    @abc.abstractmethod
    def gelu_mlp(
        self,
        x_MxD: jax.Array,
        w1_DxF: jax.Array,
        b1_F: jax.Array,
        w2_FxD: jax.Array,
        meta1: Fp8Meta,
        meta2: Fp8Meta,
        cast_kernel: str,
        recompute_cast: bool,
        rebuild: str,
        ln: tuple[jax.Array, jax.Array, float] | None,
    ) -> tuple[jax.Array, Fp8Meta, Fp8Meta]:
        """``(gelu(x . w1 + b1) . w2 [M, D], meta1, meta2)``: ``ops.mlp.gelu_mlp`` on 2-D x."""

    def grouped_matmul(
        self,
        x_MxK: jax.Array,
        w_GxKxN: jax.Array,
        group_sizes_G: jax.Array,
        meta: Fp8Meta,
        out_dtype,
        w_split_axis: str | None = None,
        layout=None,
    ) -> tuple[jax.Array, Fp8Meta]:
        """``(y [M, N], meta with this call's amaxes)``: ``ops.grouped.grouped_matmul``'s FP8
        grouped GEMM (rows of x sorted by group, w [G, K, N] stacked; ``w_split_axis``: the
        mesh axis over which the stack's other groups lie; ``layout``: x's rows already padded
        per group, ``ops.grouped.dispatch_layout``'s), with its custom VJP."""
        has = sorted(n for n, c in RECIPES.items() if c.grouped_matmul is not Recipe.grouped_matmul)
        raise NotImplementedError(
            f"the FP8 recipe {self.name!r} has no grouped GEMM: use one of {has} for expert layers"
        )


RECIPES: dict[str, type[Recipe]] = {}  # name -> recipe class, filled by ``register``


def register(cls: type[Recipe]) -> type[Recipe]:
    """Class decorator: enter a recipe class in ``RECIPES`` under its ``name``."""
    if cls.name in RECIPES and RECIPES[cls.name] is not cls:
        raise ValueError(f"FP8 recipe name {cls.name!r} is taken by {RECIPES[cls.name]}")
    RECIPES[cls.name] = cls
    return cls


def make_recipe(name: str, **kwargs) -> Recipe:
    """Build a recipe by name (one of ``RECIPES``); unknown names raise a clear error."""
    if name not in RECIPES:
        raise ValueError(f"unknown FP8 scaling recipe {name!r}: use one of {sorted(RECIPES)}")
    fields = {f.name for f in dataclasses.fields(RECIPES[name])}
    return RECIPES[name](**{k: v for k, v in kwargs.items() if k in fields})


def recipe_name(recipe: Recipe) -> str:
    """The recipe's name in ``RECIPES`` ('delayed', 'current', 'rowwise', 'block')."""
    return recipe.name


def __getattr__(name: str):
    """The registered recipe classes by class name (``scaling.BlockScaling``) and
    ``DEFAULT_RECIPE``, from ``RECIPES`` (the recipe modules import this one)."""
    if name == "DEFAULT_RECIPE":
        return make_recipe(DEFAULT)
    for cls in RECIPES.values():
        if cls.__name__ == name:
            return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@struct.dataclass
class ScaleState:
    """Scale and amax history of one tensor; ``q = saturate(x * scale)``."""

    scale: jax.Array  # [...] f32
    amax_history: jax.Array  # [..., history_len + 1] f32; slot 0 is this step's pending amax
    fmt: str = struct.field(pytree_node=False, default="e4m3")
    recipe: Recipe | None = struct.field(pytree_node=False, default=None)

    @property
    def last_amax(self) -> jax.Array:
        """Amax of the most recent completed step (the step before the pending one)."""
        return self.amax_history[..., 1]


def init_scale_state(fmt: str, recipe: Recipe) -> ScaleState:
    """A fresh state: scale 1 and an empty history."""
    formats.as_dtype(fmt)
    return ScaleState(
        scale=jnp.ones((), jnp.float32),
        amax_history=jnp.zeros((recipe.history_len + 1,), jnp.float32),
        fmt=fmt,
        recipe=recipe,
    )


def sanitize_amax(amax: jax.Array) -> jax.Array:
    """Non-finite amax becomes 0, which every consumer treats as 'no information'."""
    return jnp.where(jnp.isfinite(amax), amax, 0.0).astype(jnp.float32)


def scale_from_amax(amax, prev_scale, fmt: str, recipe: Recipe) -> jax.Array:
    """``fmax / (amax * 2**margin)``, optionally a power of two; keep ``prev_scale`` if unusable."""
    amax = amax.astype(jnp.float32)
    scale = formats.fmax(fmt) / (amax * (2.0**recipe.margin))
    # Decide before rounding: frexp(inf) would round an overflowed scale to a finite 0.5.
    ok = jnp.isfinite(amax) & (amax > 0) & jnp.isfinite(scale) & (scale > 0)
    if recipe.power_of_two:
        # exp2(floor(log2(s))) is inexact on CPU (2^15 came out as 32767.984) and jnp.ldexp is
        # a float pow too: read the exponent off frexp (scale = m * 2^e, m in [0.5, 1)) and
        # write 2^(e-1) straight into the f32 exponent bits.
        _, e = jnp.frexp(scale)
        biased = jnp.clip(e - 1 + 127, 1, 254).astype(jnp.int32)  # normal f32 exponents only
        scale = jax.lax.bitcast_convert_type(biased << 23, jnp.float32)
    return jnp.where(ok, scale, prev_scale).astype(jnp.float32)


def use_scale(state: ScaleState, amax: jax.Array) -> jax.Array:
    """The scale a use of the tensor quantizes with (``Recipe.use_scale``): the stored one, or
    one from this use's ``amax``."""
    return state.recipe.use_scale(state, amax)


def record_history(hist: jax.Array, amax: jax.Array) -> jax.Array:
    """``hist`` [..., H + 1] with ``amax`` merged into slot 0 (pending) by max."""
    return hist.at[..., 0].set(jnp.maximum(hist[..., 0], sanitize_amax(amax)))


def record(state: ScaleState, amax: jax.Array) -> ScaleState:
    """Merge one use's amax into the pending slot by max (never by sum)."""
    return state.replace(amax_history=record_history(state.amax_history, amax))


def _window_max(hist: jax.Array) -> jax.Array:
    """Max over the last axis; short windows as a chain of elementwise maxima.

    A reduce is a GPU kernel of its own, and the scale computed from it another; elementwise,
    XLA fuses both into one. Max is exact: same bits.
    """
    n = hist.shape[-1]
    if n > 64:
        return jnp.max(hist, axis=-1)
    return functools.reduce(jnp.maximum, [hist[..., i] for i in range(n)])


def commit(state: ScaleState) -> ScaleState:
    """End a step: push the pending amax into the history and recompute the scale."""
    hist = state.amax_history
    # The pending amax enters the window sanitized, whoever wrote it: no Inf/NaN in the history.
    completed = jnp.concatenate([sanitize_amax(hist[..., :1]), hist[..., 1:-1]], axis=-1)
    if state.recipe.amax_compute_algo == "max":
        amax = _window_max(completed)
    else:
        amax = completed[..., 0]
    scale = scale_from_amax(amax, state.scale, state.fmt, state.recipe)
    new_hist = jnp.concatenate([jnp.zeros_like(hist[..., :1]), completed], axis=-1)
    return state.replace(scale=scale, amax_history=new_hist)


@struct.dataclass
class Fp8Meta:
    """Scale state of one FP8 matmul: inputs x, weights w, output gradients dy."""

    x: ScaleState
    w: ScaleState
    dy: ScaleState


@struct.dataclass
class QuantizedWeight:
    """A weight quantized once (``Recipe.quantize_weight``): its E4M3 values in the GEMM's
    [(B,) K, N] layout (an expert stack's decoding copy: w^T, ``ops.grouped.decode_copy``) and
    the scale they were cast with (``q = saturate(w * scale)``)."""

    q: jax.Array  # [(B,) K, N] float8_e4m3fn
    scale: jax.Array  # f32, broadcast against q as the recipe scales it (per tensor: [])


def init_meta(recipe: Recipe | None = None, w_recipe: Recipe | None = None) -> Fp8Meta:
    """Fresh state for one FP8 matmul under ``recipe`` (None: ``DEFAULT``'s): E4M3 for x and w;
    the recipe's ``dy_format`` for dy."""
    recipe = make_recipe(DEFAULT) if recipe is None else recipe
    return Fp8Meta(
        x=init_scale_state("e4m3", recipe),
        w=init_scale_state("e4m3", w_recipe or recipe),
        dy=init_scale_state(recipe.dy_format, recipe),
    )
