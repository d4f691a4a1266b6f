"""What the per-tensor recipes (delayed, current) share: one scale per tensor.

Their matmul is ``ops.dot.tensor_matmul`` (E4M3 x and w, E5M2 dy, one scale each), their MLP
``ops.mlp.tensor_gelu_mlp`` and their expert GEMM ``ops.grouped.tensor_grouped_matmul``; the
scale is kept in the ``ScaleState``, so checkpoints serve with it and O3 gathers kernels as E4M3
under it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fp8jax.ops import dot, formats, grouped, mlp, scaling
from fp8jax.ops.gemm import GemmConfig
from fp8jax.ops.scaling import Fp8Meta, QuantizedWeight, ScaleState

__all__ = ["TensorRecipe"]


class TensorRecipe(scaling.Recipe):
    """A recipe with one scale per tensor, on the per-tensor FP8 GEMM."""

    @property
    def dy_format(self) -> str:
        """E5M2: one scale covers a gradient's many decades, so range before mantissa."""
        return "e5m2"

    @property
    def per_tensor(self) -> bool:
        """One scale per tensor, kept in its ``ScaleState``."""
        return True

    def saturation_stats(self, x: jax.Array, state: ScaleState) -> tuple[jax.Array, jax.Array]:
        """(saturated share, flushed share) of ``x`` under the one scale a use of it takes."""
        scale = self.use_scale(state, formats.amax(x))
        return formats.saturation_stats(x, scale, state.fmt)

    def matmul(self, cfg, x: jax.Array, w: jax.Array, meta: Fp8Meta) -> tuple[jax.Array, Fp8Meta]:
        """``ops.dot.tensor_matmul``: batched or not, one scale per operand."""
        return dot.tensor_matmul(cfg, x, w, meta)

    @property
    def quantizes_weights_once(self) -> bool:
        """One scale per weight, the same at every use: its E4M3 copy serves every token."""
        return True

    def quantize_weight(self, w: jax.Array, state: ScaleState) -> QuantizedWeight:
        """``w`` in E4M3 under the scale a use of it takes (delayed: the stored one; current:
        from its amax, the same at every call since w does not change)."""
        scale = self.use_scale(state, formats.amax(w))
        return QuantizedWeight(q=formats.quantize(w, scale, formats.E4M3), scale=scale)

    def prequantized_matmul(self, cfg, x: jax.Array, w: QuantizedWeight, meta: Fp8Meta):
        """``ops.dot.tensor_forward`` on the E4M3 copy."""
        return dot.tensor_forward(cfg, x, w.q, w.scale, meta)

    def prequantized_grouped_matmul(
        self,
        x_MxK: jax.Array,
        w: QuantizedWeight,
        group_sizes_G: jax.Array,
        meta: Fp8Meta,
        out_dtype,
        layout=None,
    ) -> jax.Array:
        """``ops.grouped.tensor_grouped_forward`` on the E4M3 copy of w^T."""
        return grouped.tensor_grouped_forward(
            x_MxK, w.q, w.scale, group_sizes_G, meta, out_dtype, layout
        )

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
        """``ops.grouped.tensor_grouped_matmul``: one scale for x, one for the whole weight
        stack (its amax merged over ``w_split_axis``'s shards), on ``layout``'s padded rows."""
        cfg = GemmConfig(
            jnp.dtype(x_MxK.dtype),
            jnp.dtype(w_GxKxN.dtype),
            out_dtype,
            False,
            w_split_axis=w_split_axis,
        )
        return grouped.tensor_grouped_matmul(cfg, x_MxK, w_GxKxN, group_sizes_G, meta, layout)

    @property
    def pads_grouped_rows(self) -> bool:
        """The per-tensor grouped GEMM runs on rows padded to whole tiles per group."""
        return True

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
        """``ops.mlp.tensor_gelu_mlp``: one VJP where the scales are known ahead."""
        return mlp.tensor_gelu_mlp(
            x_MxD, w1_DxF, b1_F, w2_FxD, meta1, meta2, cast_kernel, recompute_cast, rebuild, ln
        )
