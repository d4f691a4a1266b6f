"""Scaling recipes and the per-tensor scale state they update.

A ``ScaleState`` holds one tensor's scale and amax history; an ``Fp8Meta`` the three of one
FP8 matmul (inputs x, weights w, output gradients dy). Slot 0 of the history is the
*pending* amax of the current step: every use of the tensor in a step (shared weights,
``nn.scan`` reuse, micro-batches) merges into it by ``max``. ``commit`` ends the step: it
moves the pending amax into the history, recomputes the scale and clears slot 0.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import struct

from fp8jax.ops import formats

AMAX_ALGOS = ("max", "most_recent")  # DelayedScaling.amax_compute_algo's choices


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
    """Scale at step t from the amax of steps < t (a window of ``history_len`` steps)."""

    history_len: int = 16  # steps of amax kept; MS-AMP uses 16, Transformer Engine 1024
    amax_compute_algo: str = "max"  # 'max' over the window or 'most_recent' step
    margin: int = 0  # scale = fmax / (amax * 2**margin): headroom in powers of two
    power_of_two: bool = False  # round the scale down to a power of two (exact rescaling)

    def __post_init__(self):
        if self.amax_compute_algo not in AMAX_ALGOS:
            raise ValueError(
                f"unknown amax_compute_algo {self.amax_compute_algo!r}: use one of {AMAX_ALGOS}"
            )
        if int(self.history_len) < 1:
            raise ValueError(f"history_len must be >= 1, got {self.history_len}")


@dataclasses.dataclass(frozen=True)
class CurrentScaling:
    """Scale from this call's own amax (one extra reduction per tensor, no lag)."""

    margin: int = 0  # scale = fmax / (amax * 2**margin)
    power_of_two: bool = False  # round the scale down to a power of two
    history_len: int = 1  # kept for health reporting only
    amax_compute_algo: str = "most_recent"


def _check_grad_format(fmt: str) -> None:
    if fmt not in formats.FORMATS:
        raise ValueError(
            f"unknown FP8 gradient format {fmt!r}: use one of {sorted(formats.FORMATS)}"
        )


@dataclasses.dataclass(frozen=True)
class RowwiseScaling:
    """One scale per row of each GEMM operand along its contraction axis, from this call's values.

    The forward scales x per row and w per column (the scales factor out of the contraction and
    unscale the output); dgrad and wgrad re-quantize their operands along their own contraction
    axes. Runs on the per-tensor FP8 GEMM (cuBLASLt on Hopper).
    """

    margin: int = 0  # scale = fmax / (amax * 2**margin)
    power_of_two: bool = False  # round each scale down to a power of two
    grad_format: str = "e4m3"  # dy's format: E4M3 (its scales follow each row) or 'e5m2'
    history_len: int = 1  # per-tensor amax kept for health reporting only
    amax_compute_algo: str = "most_recent"

    def __post_init__(self):
        _check_grad_format(self.grad_format)


@dataclasses.dataclass(frozen=True)
class BlockScaling:
    """DeepSeek-V3's recipe: 1 x ``block_size`` tiles for x and dy, ``block_size``^2 for w.

    Scales come from each tile's own amax. Block scales along the contraction do not factor out
    of a GEMM, so it runs on fp8jax's block-scaled GEMM (``ops.block_gemm``), which rescales
    each ``block_size``-wide slice of K into an f32 accumulator.
    """

    block_size: int = 128  # tile width (a power of two, >= 16): elements per scale along K
    margin: int = 0  # scale = fmax / (amax * 2**margin)
    power_of_two: bool = False  # round each scale down to a power of two
    grad_format: str = "e4m3"  # dy's format: E4M3 as DeepSeek-V3 (per-tile scales) or 'e5m2'
    history_len: int = 1  # per-tensor amax kept for health reporting only
    amax_compute_algo: str = "most_recent"

    def __post_init__(self):
        b = self.block_size
        if not isinstance(b, int) or b < 16 or b & (b - 1):
            raise ValueError(
                f"FP8 block_size must be a power of two >= 16 (the GEMM's tile), got {b!r}: "
                f"use 128 (DeepSeek-V3's)"
            )
        _check_grad_format(self.grad_format)


Recipe = DelayedScaling | CurrentScaling | RowwiseScaling | BlockScaling
FineRecipe = RowwiseScaling | BlockScaling
DEFAULT_RECIPE = DelayedScaling()
RECIPES = {
    "delayed": DelayedScaling,
    "current": CurrentScaling,
    "rowwise": RowwiseScaling,
    "block": BlockScaling,
}


def make_recipe(name: str, **kwargs) -> Recipe:
    """Build a recipe by name (one of ``RECIPES``); unknown names raise a clear error."""
    if name not in RECIPES:
        raise ValueError(f"unknown FP8 scaling recipe {name!r}: use one of {sorted(RECIPES)}")
    fields = {f.name for f in dataclasses.fields(RECIPES[name])}
    return RECIPES[name](**{k: v for k, v in kwargs.items() if k in fields})


def is_delayed(recipe) -> bool:
    """Whether every scale is known before the GEMM (delayed scaling: the fused paths' case)."""
    return isinstance(recipe, DelayedScaling)


def is_fine(recipe) -> bool:
    """Whether ``recipe`` scales per row or per tile (``RowwiseScaling``, ``BlockScaling``)."""
    return isinstance(recipe, RowwiseScaling | BlockScaling)


def recipe_name(recipe) -> str:
    """The recipe's name in ``RECIPES`` ('delayed', 'current', 'rowwise', 'block')."""
    return next(k for k, v in RECIPES.items() if isinstance(recipe, v))


@struct.dataclass
class ScaleState:
    """Scale and amax history of one tensor; ``q = saturate(x * scale)``."""

    scale: jax.Array  # [...] f32
    amax_history: jax.Array  # [..., history_len + 1] f32; slot 0 is this step's pending amax
    fmt: str = struct.field(pytree_node=False, default="e4m3")
    recipe: Recipe = struct.field(pytree_node=False, default=DEFAULT_RECIPE)

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
    """The scale a use of the tensor quantizes with: delayed scaling's stored one, or current
    scaling's from this use's ``amax``."""
    if isinstance(state.recipe, CurrentScaling):
        return scale_from_amax(amax, state.scale, state.fmt, state.recipe)
    return state.scale


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


def init_meta(recipe: Recipe = DEFAULT_RECIPE, w_recipe: Recipe | None = None) -> Fp8Meta:
    """Fresh state for one FP8 matmul: E4M3 for x and w; E5M2 for dy under per-tensor scales
    (range for one scale over many decades), the recipe's ``grad_format`` under fine ones."""
    return Fp8Meta(
        x=init_scale_state("e4m3", recipe),
        w=init_scale_state("e4m3", w_recipe or recipe),
        dy=init_scale_state(recipe.grad_format if is_fine(recipe) else "e5m2", recipe),
    )
