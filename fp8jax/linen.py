"""Flax linen integration: ``nn.Dense(dot_general_cls=Fp8DotGeneral)`` and an FP8 ``Einsum``.

Scale state lives in the ``fp8_state`` collection. Apply with ``mutable=['fp8_state']`` in the
train step so each use writes its recorded amax back and the next use reads it (uses chain,
amax merges by max); without it the module still runs (evaluation) and writes nothing.
"""

from __future__ import annotations

import dataclasses
import string
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from flax import linen as nn

from fp8jax import dot, formats, scaling
from fp8jax.state import FP8, FP8_STATS


class Fp8DotGeneral(nn.Module):
    """Drop-in ``dot_general_cls`` for ``nn.Dense``/``nn.DenseGeneral`` running FP8 GEMMs."""

    recipe: scaling.Recipe = scaling.DelayedScaling()
    w_recipe: scaling.Recipe | None = None  # weights' recipe if different (MS-AMP: history 1)

    @nn.compact
    def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
        del precision  # FP8 GEMMs have one precision
        meta_var = self.variable(FP8, "meta", dot.init_meta, self.recipe, self.w_recipe)
        meta = meta_var.value
        if self.is_mutable_collection(FP8_STATS) and not self.is_initializing():
            self._sow_stats(lhs, rhs, meta)
        out, new_meta = dot.dot_general(lhs, rhs, dimension_numbers, meta, preferred_element_type)
        if self.is_mutable_collection(FP8) and not self.is_initializing():
            meta_var.value = new_meta
        return out

    def _sow_stats(self, lhs, rhs, meta: dot.Fp8Meta):
        """Record the share of saturated and flushed values under the scales in use."""
        for name, x, s in (("x", lhs, meta.x), ("w", rhs, meta.w)):
            x = jax.lax.stop_gradient(x)
            scale = dot._use_scale(s, formats.amax(x))
            sat, flush = formats.saturation_stats(x, scale, s.fmt)
            self.sow(FP8_STATS, f"{name}_saturated", sat)
            self.sow(FP8_STATS, f"{name}_flushed", flush)


def einsum_dimension_numbers(eq: str, lhs_ndim: int, rhs_ndim: int):
    """Translate a two-operand einsum into dot_general numbers plus the output permutation."""
    eq = eq.replace(" ", "")
    if "->" not in eq or "." in eq or eq.count(",") != 1:
        raise ValueError(
            f"FP8 einsum needs an explicit two-operand equation like 'bsd,dhk->bshk', got {eq!r}"
        )
    ins, out = eq.split("->")
    a, b = ins.split(",")
    if len(a) != lhs_ndim or len(b) != rhs_ndim:
        raise ValueError(f"einsum {eq!r} does not match operand ranks {lhs_ndim} and {rhs_ndim}")
    for c in a + b + out:
        if c not in string.ascii_letters:
            raise ValueError(f"einsum {eq!r}: only letters are supported, found {c!r}")
    batch = [c for c in a if c in b and c in out]
    contract = [c for c in a if c in b and c not in out]
    if any((c in a) + (c in b) == 1 and c not in out for c in a + b):
        raise ValueError(f"einsum {eq!r} sums over an axis of one operand; reduce it first")
    dims = (
        (tuple(a.index(c) for c in contract), tuple(b.index(c) for c in contract)),
        (tuple(a.index(c) for c in batch), tuple(b.index(c) for c in batch)),
    )
    result = batch + [c for c in a if c not in b] + [c for c in b if c not in a]
    perm = tuple(result.index(c) for c in out)
    return dims, perm


def fp8_einsum(eq: str, lhs, rhs, meta: dot.Fp8Meta, preferred_element_type=None):
    """Functional FP8 einsum (two operands): returns (result, updated meta)."""
    dims, perm = einsum_dimension_numbers(eq, lhs.ndim, rhs.ndim)
    out, new_meta = dot.dot_general(lhs, rhs, dims, meta, preferred_element_type)
    return jnp.transpose(out, perm), new_meta


class Fp8Einsum(nn.Module):
    """FP8 version of ``jnp.einsum(eq, x, kernel)``; state in the ``fp8_state`` collection."""

    recipe: scaling.Recipe = scaling.DelayedScaling()

    @nn.compact
    def __call__(self, eq: str, lhs, rhs, preferred_element_type=None):
        meta_var = self.variable(FP8, "meta", dot.init_meta, self.recipe)
        out, new_meta = fp8_einsum(eq, lhs, rhs, meta_var.value, preferred_element_type)
        if self.is_mutable_collection(FP8) and not self.is_initializing():
            meta_var.value = new_meta
        return out


class Einsum(nn.Module):
    """Like ``nn.Einsum`` (kernel of ``shape``, optional bias), with the contraction in FP8."""

    shape: Sequence[int]
    einsum_str: str
    use_bias: bool = False
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Callable = nn.initializers.lecun_normal()
    bias_init: Callable = nn.initializers.zeros_init()
    recipe: scaling.Recipe | None = scaling.DelayedScaling()  # None: plain einsum (FP8 off)

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


def fp8_dot_general_cls(recipe: scaling.Recipe | None = None, **kwargs):
    """``dot_general_cls`` for ``nn.Dense`` with a given recipe (a partial of Fp8DotGeneral)."""
    fields = {"recipe": recipe or scaling.DelayedScaling(), **kwargs}
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
