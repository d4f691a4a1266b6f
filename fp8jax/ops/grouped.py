"""Grouped GEMM for expert layers: ``y[rows of group g] = x[rows of group g] . w[g]``.

x [M, K] holds the rows of every group back to back, sorted by group: group g is rows
``[sum(sizes[:g]), sum(sizes[:g + 1]))``; rows past ``sum(sizes)`` give 0 in y (a dropless
dispatch pads M to a static size). w [G, K, N] stacks the groups' weights.

With no recipe (level O0) the GEMM is ``jax.lax.ragged_dot``, accumulating in f32. With one, the
recipe runs it (``Recipe.grouped_matmul``): the FP8 GEMM with its custom VJP, returning the
``Fp8Meta`` with this call's amaxes, as ``ops.dot.dot_general`` does for a dense GEMM.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from fp8jax.ops import dot, scaling
from fp8jax.ops.scaling import Fp8Meta

__all__ = ["check_shapes", "grouped_matmul", "ragged_dot"]


def ragged_dot(x_MxK: jax.Array, w_GxKxN: jax.Array, group_sizes_G: jax.Array, out_dtype):
    """``jax.lax.ragged_dot`` accumulating in f32, the result in ``out_dtype``: the O0 GEMM."""
    y = lax.ragged_dot(x_MxK, w_GxKxN, group_sizes_G, preferred_element_type=jnp.float32)
    return y.astype(out_dtype)


def check_shapes(x_MxK: jax.Array, w_GxKxN: jax.Array, group_sizes_G: jax.Array) -> None:
    """Reject operands that do not form one grouped GEMM, naming the shapes and the fix."""
    if x_MxK.ndim != 2 or w_GxKxN.ndim != 3 or group_sizes_G.ndim != 1:
        raise ValueError(
            f"fp8jax.grouped_matmul: x {tuple(x_MxK.shape)}, w {tuple(w_GxKxN.shape)} and "
            f"group_sizes {tuple(group_sizes_G.shape)} must be [M, K], [G, K, N] and [G]: "
            f"flatten the tokens and stack the groups' weights"
        )
    if x_MxK.shape[1] != w_GxKxN.shape[1] or w_GxKxN.shape[0] != group_sizes_G.shape[0]:
        raise ValueError(
            f"fp8jax.grouped_matmul: x {tuple(x_MxK.shape)}, w {tuple(w_GxKxN.shape)} and "
            f"group_sizes {tuple(group_sizes_G.shape)} disagree on K or G: pass x [M, K], "
            f"w [G, K, N] and one size per group"
        )
    if not jnp.issubdtype(group_sizes_G.dtype, jnp.integer):
        raise TypeError(
            f"fp8jax.grouped_matmul: group_sizes has dtype {group_sizes_G.dtype}; pass int32 "
            f"counts (group_sizes.astype(jnp.int32))"
        )


def grouped_matmul(
    x_MxK: jax.Array,
    w_GxKxN: jax.Array,
    group_sizes_G: jax.Array,
    recipe: scaling.Recipe | None,
    meta: Fp8Meta | None,
    *,
    out_dtype=None,
) -> tuple[jax.Array, Fp8Meta | None]:
    """``(y [M, N], meta with this call's amaxes)``: each group's rows times its weight.

    ``recipe`` None is level O0 (``ragged_dot``, ``meta`` returned as given); otherwise the
    recipe's FP8 grouped GEMM under ``meta`` (``Recipe.grouped_matmul``). ``out_dtype``
    defaults to the operands' common dtype.
    """
    check_shapes(x_MxK, w_GxKxN, group_sizes_G)
    out_dtype = jnp.dtype(out_dtype or jnp.result_type(x_MxK.dtype, w_GxKxN.dtype))
    group_sizes_G = group_sizes_G.astype(jnp.int32)
    if recipe is None:
        return ragged_dot(x_MxK, w_GxKxN, group_sizes_G, out_dtype), meta
    dot.check_operand("x", x_MxK)
    dot.check_operand("w", w_GxKxN)
    # The scope names the recipe in the program (fp8jax.diagnostics.coverage reads it).
    with jax.named_scope(f"fp8_grouped_{recipe.name}"):
        return recipe.grouped_matmul(x_MxK, w_GxKxN, group_sizes_G, meta, out_dtype)
