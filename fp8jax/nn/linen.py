"""Flax linen integration: ``nn.Dense(dot_general_cls=Fp8DotGeneral)`` and an FP8 ``Einsum``.

Scale state lives in the ``fp8_state`` collection. Apply with ``mutable=['fp8_state']`` in the
train step so each use writes its recorded amax back and the next use reads it (uses chain,
amax merges by max); without it the module still runs (evaluation) and writes nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from fp8jax.nn.state import FP8, FP8_STATS, FP8_WEIGHTS
from fp8jax.ops import activations, dot, grouped, kernels, scaling
from fp8jax.ops.dot import einsum_dimension_numbers, fp8_einsum  # noqa: F401 (re-exported)
from fp8jax.recipes import DelayedScaling

__all__ = [
    "FP8",
    "Einsum",
    "Fp8DotGeneral",
    "Fp8Einsum",
    "Fp8Meta",
    "Fp8RaggedDot",
    "fp8_dot_general_cls",
    "fp8_einsum",
    "fp8_scan",
    "keep_kernel_dtype",
]


class _Fp8Op(nn.Module):
    """An FP8 matmul's ``meta`` variable: read it, record health stats, write the new amax."""

    recipe: scaling.Recipe = DelayedScaling()
    w_recipe: scaling.Recipe | None = None  # weights' recipe if different (MS-AMP: history 1)
    # 'auto' (the fused cast+transpose kernel on GPUs, XLA ops elsewhere), 'xla', 'pallas' or
    # 'interpret': how operands are quantized (fp8jax.ops.kernels)
    cast_kernel: str = kernels.AUTO
    prologue: str | None = (
        None  # an activation applied to lhs in its cast (activations.ACTIVATIONS)
    )
    # the operands ('x', 'w', 'xw'; True: both) the backward pass casts to FP8 again instead of
    # keeping their FP8 copies: for a remat policy that keeps none of them
    # (ops.gemm.GemmConfig.rebuild)
    rebuild: bool | str = False

    def _with_meta(self, lhs, rhs, matmul, plain):
        """``matmul(meta, rhs) -> (out, new_meta)`` under this module's state; returns ``out``.

        Initialisation creates the variables and reads only the output's shape and dtype:
        ``plain(rhs)``, the plain product, instead of tracing the FP8 GEMM and its custom VJP
        (most of an FP8 model's init trace)."""
        rhs, meta = self._read(lhs, rhs)
        if self.is_initializing():
            return plain(rhs)
        out, new_meta = matmul(meta, rhs)
        self._write(new_meta)
        return out

    def _read(self, lhs, rhs):
        """``(rhs, meta)``: the weight and the stored scales; health stats when asked for
        (``lhs=None``: none for x). Call from a compact method."""
        meta = self.variable(FP8, "meta", scaling.init_meta, self.recipe, self.w_recipe).value
        if lhs is not None and self.is_mutable_collection(FP8_STATS) and not self.is_initializing():
            self._sow_stats(lhs, rhs, meta)
        return rhs, meta

    def _weight_cache(self):
        """``dot.dot_general``'s ``weight_cache`` while decoding (the ``FP8_WEIGHTS``
        collection is mutable, or holds this op's weight), else None: the copy stored in the
        collection, or the one ``make`` quantizes now (stored where the collection is
        mutable). Call from a compact method."""
        writable = self.is_mutable_collection(FP8_WEIGHTS) and not self.is_initializing()
        if not (writable or self.has_variable(FP8_WEIGHTS, "w")):
            return None

        def cached(make):
            if self.has_variable(FP8_WEIGHTS, "w"):
                return self.get_variable(FP8_WEIGHTS, "w")
            made = make()
            if writable:
                self.put_variable(FP8_WEIGHTS, "w", made)
            return made

        return cached

    def _write(self, new_meta: scaling.Fp8Meta) -> None:
        """Store the meta with this call's amax (train steps; evaluation writes nothing)."""
        if self.is_mutable_collection(FP8) and not self.is_initializing():
            self.put_variable(FP8, "meta", new_meta)

    def _sow_stats(self, lhs, rhs, meta: scaling.Fp8Meta):
        """Record the share of saturated and flushed values under the scales in use."""
        act_lhs = activations.activation(self.prologue)(
            jax.lax.stop_gradient(lhs).astype(jnp.float32)
        )
        for name, x, s in (("x", act_lhs, meta.x), ("w", rhs, meta.w)):
            x = jax.lax.stop_gradient(x)
            sat, flush = s.recipe.saturation_stats(x, s)
            self.sow(FP8_STATS, f"{name}_saturated", sat)
            self.sow(FP8_STATS, f"{name}_flushed", flush)


class Fp8DotGeneral(_Fp8Op):
    """Drop-in ``dot_general_cls`` for ``nn.Dense``/``nn.DenseGeneral`` running FP8 GEMMs."""

    # The output dtype when the caller names none (flax's Dense never does): with
    # ``keep_kernel_dtype`` as the layer's promote_dtype, an f32 kernel reaches the FP8 cast
    # as stored, and this keeps the output in the activations' dtype.
    out_dtype: Any = None

    @nn.compact
    def __call__(
        self,
        lhs,
        rhs,
        dimension_numbers,
        precision=None,
        preferred_element_type=None,
        out_sharding=None,
    ):
        del precision, out_sharding  # FP8 GEMMs have one precision; sharding follows the inputs
        return self._with_meta(
            lhs,
            rhs,
            lambda meta, rhs: dot.dot_general(
                lhs,
                rhs,
                dimension_numbers,
                meta,
                preferred_element_type or self.out_dtype,
                self.cast_kernel,
                self.prologue,
                self.rebuild,
                self._weight_cache(),
            ),
            lambda rhs: dot.plain_dot_general(
                lhs, rhs, dimension_numbers, preferred_element_type or self.out_dtype
            ),
        )


class Fp8RaggedDot(_Fp8Op):
    """FP8 ``jax.lax.ragged_dot`` for expert layers: ``(lhs [M, K], rhs [G, K, N], group_sizes
    [G]) -> [M, N]``, rows sorted by group; its state in the ``fp8_state`` collection."""

    @nn.compact
    def __call__(
        self, lhs, rhs, group_sizes, precision=None, preferred_element_type=None, group_offset=None
    ):
        del precision  # FP8 GEMMs have one precision
        grouped.check_ragged_call(lhs, rhs, group_sizes, group_offset, "fp8jax.Fp8RaggedDot")
        # Health stats of the grouped rows only: rows past sum(group_sizes) enter no GEMM.
        return self._with_meta(
            grouped.valid_rows(lhs, group_sizes),
            rhs,
            lambda meta, rhs: grouped.ragged_dot(
                lhs, rhs, group_sizes, meta, preferred_element_type
            ),
            lambda rhs: grouped.grouped_matmul(
                lhs, rhs, group_sizes, None, None, out_dtype=preferred_element_type
            )[0],
        )


class Fp8Meta(_Fp8Op):
    """The state of an FP8 matmul that a fused op (``ops.mlp``) runs: read, then ``write``."""

    @nn.compact
    def __call__(self, lhs, rhs):
        """``(rhs, meta)``: the weight and the stored scales."""
        return self._read(lhs, rhs)

    def write(self, new_meta: scaling.Fp8Meta) -> None:
        """Store the meta with this step's amax (train steps; evaluation writes nothing)."""
        self._write(new_meta)

    def weight_copy(self, make: Callable[[], scaling.QuantizedWeight]):
        """While decoding, the weight's FP8 copy (``make()`` once per generate call, kept in
        the ``FP8_WEIGHTS`` collection); None otherwise (the op quantizes it per call)."""
        cache = self._weight_cache()
        return None if cache is None else cache(make)


class Fp8Einsum(_Fp8Op):
    """FP8 version of ``jnp.einsum(eq, x, kernel)``; state in the ``fp8_state`` collection."""

    @nn.compact
    def __call__(self, eq: str, lhs, rhs, preferred_element_type=None):
        return self._with_meta(
            lhs,
            rhs,
            lambda meta, rhs: fp8_einsum(
                eq,
                lhs,
                rhs,
                meta,
                preferred_element_type,
                self.cast_kernel,
                self.prologue,
                self.rebuild,
            ),
            lambda rhs: dot.plain_einsum(eq, lhs, rhs, preferred_element_type),
        )


class Einsum(nn.Module):
    """Like ``nn.Einsum`` (kernel of ``shape``, optional bias), with the contraction in FP8."""

    shape: Sequence[int]
    einsum_str: str
    use_bias: bool = False
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Callable = nn.initializers.lecun_normal()
    bias_init: Callable = nn.initializers.zeros_init()
    recipe: scaling.Recipe | None = DelayedScaling()  # None: plain einsum (FP8 off)

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", self.kernel_init, tuple(self.shape), self.param_dtype)
        dtype = self.dtype or jnp.result_type(x.dtype, kernel.dtype)
        x, kernel = x.astype(dtype), kernel.astype(dtype)
        if self.recipe is None:
            y = jnp.einsum(self.einsum_str, x, kernel)
        else:
            y = Fp8Einsum(recipe=self.recipe, name="fp8")(self.einsum_str, x, kernel)
        if self.use_bias:
            out_letters = self.einsum_str.split("->")[1]
            w_letters = self.einsum_str.split("->")[0].split(",")[1]
            bias_shape = tuple(
                self.shape[w_letters.index(c)] if c in w_letters else 1 for c in out_letters
            )
            bias = self.param("bias", self.bias_init, bias_shape, self.param_dtype)
            y = y + bias.astype(dtype)
        return y


def _add_collection(filt, name: str):
    """Add one collection to an ``nn.scan`` collection filter (False, a name or a list)."""
    if filt is True:
        return True
    if filt is False or filt is None:
        return [name]
    return [filt, name] if isinstance(filt, str) else [*filt, name]


def fp8_scan(target, *, variable_broadcast=False, variable_carry=False, **scan_kwargs):
    """``nn.scan`` of one block reused on every iteration, carrying its ``fp8_state``.

    Flax cannot create a carried collection inside the loop (init) and refuses loop-dependent
    writes to a broadcast one (apply). So a call that writes ``fp8_state`` carries it and any
    other call (init, evaluation) broadcasts it: the writing iterations form one chain and the
    amax merges by max. For a stack of distinct layers use plain ``nn.scan`` with
    ``variable_axes={'params': 0, 'fp8_state': 0}`` instead.
    """
    axes = scan_kwargs.get("variable_axes", {})
    if FP8 in axes or scan_kwargs.get("methods") is not None:
        raise ValueError("fp8_scan carries fp8_state through __call__: use nn.scan instead")
    read_cls = nn.scan(
        target,
        variable_broadcast=_add_collection(variable_broadcast, FP8),
        variable_carry=variable_carry,
        **scan_kwargs,
    )
    write_cls = nn.scan(
        target,
        variable_broadcast=variable_broadcast,
        variable_carry=_add_collection(variable_carry, FP8),
        **scan_kwargs,
    )

    def __call__(self, *args, **kwargs):
        # Only a step that writes fp8_state carries it; init and evaluation read it broadcast.
        writes = self.is_mutable_collection(FP8) and not self.is_initializing()
        cls = write_cls if writes else read_cls
        return cls.__call__(self, *args, **kwargs)

    return type(f"Fp8Scan{target.__name__}", (target,), {"__call__": __call__})


def keep_kernel_dtype(inputs, kernel, bias, *, dtype=None, **kwargs):
    """``promote_dtype`` for ``nn.Dense``/``nn.DenseGeneral`` with ``Fp8DotGeneral``: inputs
    and bias in ``dtype``, the kernel as stored. Its FP8 cast then reads the f32 master
    directly instead of a bf16 copy written first (O1: 4 bytes per weight per step less)."""
    inputs, bias = nn.dtypes.promote_dtype(inputs, bias, dtype=dtype, **kwargs)
    return inputs, kernel, bias


def fp8_dot_general_cls(recipe: scaling.Recipe | None = None, **kwargs):
    """``dot_general_cls`` for ``nn.Dense`` with a given recipe (a partial of Fp8DotGeneral)."""
    fields = {"recipe": recipe or DelayedScaling(), **kwargs}
    return _Partial(Fp8DotGeneral, fields)


@dataclasses.dataclass(frozen=True)
class _Partial:
    """Hashable stand-in for functools.partial so modules holding it stay comparable."""

    cls: type
    kwargs: dict

    def __call__(self, *args, **kwargs):
        return self.cls(*args, **{**self.kwargs, **kwargs})

    def __hash__(self):
        return hash((self.cls, tuple(sorted(self.kwargs.items()))))
