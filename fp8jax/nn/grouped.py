"""Flax linen ``GroupedLinear``: a stack of G linear maps applied to rows sorted by group.

The expert layers of a Mixture-of-Experts block: param ``kernel`` [G, K, *features] and, under
an FP8 recipe, one ``Fp8Meta`` for the whole stack in the ``fp8_state`` collection (child
``fp8``; per-tensor scales over all G groups), read and written as ``nn.Dense``'s FP8 state is
(``nn.linen.Fp8Meta``).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from fp8jax.nn.linen import Fp8Meta
from fp8jax.ops import grouped, scaling
from fp8jax.ops.grouped_mgpu import Layout

__all__ = ["GroupedLinear"]

INIT_STD = 0.02  # the transformer's linears' initialiser scale (models.params.INIT_STD)


class GroupedLinear(nn.Module):
    """``y[rows of g] = x[rows of g] . kernel[g]`` for sorted rows; FP8 under ``recipe``.

    Called ``(x [M, K], group_sizes [G]) -> y [M, *features]`` (rows past ``sum(group_sizes)``
    give 0). ``recipe`` None runs ``jax.lax.ragged_dot`` (level O0) and keeps no FP8 state.
    """

    num_groups: int  # G: experts (all of them, also where split_axis splits them)
    in_features: int  # K
    features: tuple[int, ...]  # the output axes, e.g. (2, F) for gate and up
    recipe: scaling.Recipe | None = None  # None: O0, no FP8
    # the kernel's logical axes, one per axis (e.g. ('expert', 'embed', None, 'mlp')); None: none
    names: tuple[str | None, ...] | None = None
    std: float = INIT_STD  # normal initialiser's standard deviation
    dtype: Any = None  # compute dtype (None: x's)
    param_dtype: Any = jnp.float32
    # The mesh axis (bound where the layer runs, e.g. expert parallelism's) whose shards hold
    # the stack's other groups: the kernel here is this shard's groups, and one per-tensor scale
    # still covers them all. None: the kernel is the whole stack.
    split_axis: str | None = None

    @nn.compact
    def __call__(
        self, x_MxK: jax.Array, group_sizes_G: jax.Array, layout: Layout | None = None
    ) -> jax.Array:
        """``y [M, *features]``: each group's rows times its kernel; ``layout``: x's rows are
        already that padded layout's (``ops.grouped.grouped_matmul``'s ``layout``)."""
        features = tuple(self.features)
        groups = self.num_groups
        if self.split_axis is not None:  # this shard's consecutive share of the groups
            groups //= jax.lax.axis_size(self.split_axis)
        shape = (groups, self.in_features, *features)
        init = nn.initializers.normal(self.std)
        if self.names is not None:
            if len(self.names) != len(shape):
                raise ValueError(
                    f"GroupedLinear: names {tuple(self.names)} do not match the kernel's "
                    f"{len(shape)} axes {shape}: give one logical name (or None) per axis"
                )
            init = nn.with_logical_partitioning(init, tuple(self.names))
        kernel = self.param("kernel", init, shape, self.param_dtype)
        dtype = jnp.dtype(self.dtype or x_MxK.dtype)
        w_GxKxN = kernel.reshape(groups, self.in_features, math.prod(features))
        x_MxK = x_MxK.astype(dtype)
        if self.recipe is None:
            y, _ = grouped.grouped_matmul(
                x_MxK, w_GxKxN.astype(dtype), group_sizes_G, None, None, out_dtype=dtype
            )
        else:
            # The kernel reaches the FP8 cast as stored (an f32 master is read once, no bf16 copy).
            state = Fp8Meta(self.recipe, name="fp8")
            # Health stats (fp8_stats) of the grouped rows only: the padding enters no GEMM.
            w_GxKxN, meta = state(grouped.valid_rows(x_MxK, group_sizes_G), w_GxKxN)
            copy = None
            if self.is_initializing():  # init reads the output's shape: the plain grouped GEMM
                y, _ = grouped.grouped_matmul(
                    x_MxK, w_GxKxN.astype(dtype), group_sizes_G, None, None, out_dtype=dtype
                )
                return y.reshape(x_MxK.shape[0], *features)
            if self.recipe.quantizes_weights_once:  # decoding: the stack's E4M3 copy, made once
                copy = state.weight_copy(lambda: grouped.decode_copy(self.recipe, w_GxKxN, meta.w))
            if copy is not None:
                y = self.recipe.prequantized_grouped_matmul(
                    x_MxK, copy, group_sizes_G, meta, dtype, layout
                )
            else:
                y, new_meta = grouped.grouped_matmul(
                    x_MxK,
                    w_GxKxN,
                    group_sizes_G,
                    self.recipe,
                    meta,
                    out_dtype=dtype,
                    w_split_axis=self.split_axis,
                    layout=layout,
                )
                state.write(new_meta)
        return y.reshape(x_MxK.shape[0], *features)
