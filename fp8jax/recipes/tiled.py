"""What the fine-grained recipes (rowwise, block) share: scales per row or tile, from each call.

Their matmul is ``ops.fine.fine_matmul`` and their MLP ``ops.fine_mlp.gelu_mlp``, whose custom
VJPs call the recipe's ``cast_x``, ``forward`` and ``backward`` for each GEMM's casts and kernels;
their expert GEMM is ``ops.grouped.tiled_grouped_matmul``, tiled by ``tile_width`` and
``weight_tile`` (block scaling's own at 128-wide tiles: ``ops.grouped_block``).
The ``ScaleState`` keeps per-tensor amaxes for health reporting only; no scale is stored.
"""

from __future__ import annotations

import abc

import jax
import jax.numpy as jnp

from fp8jax.ops import fine, fine_mlp, formats, grouped, norm, scaling
from fp8jax.ops.gemm import GemmConfig
from fp8jax.ops.scaling import Fp8Meta, ScaleState

__all__ = ["TiledRecipe", "check_grad_format"]


def check_grad_format(fmt: str) -> None:
    """One clear error for an unknown gradient format."""
    if fmt not in formats.FORMATS:
        raise ValueError(
            f"unknown FP8 gradient format {fmt!r}: use one of {sorted(formats.FORMATS)}"
        )


class TiledRecipe(scaling.Recipe):
    """A recipe that scales per row or tile from each call's values, on ``ops.fine``'s matmul.

    Subclasses have a ``grad_format`` field and supply ``tile_width``, ``cast_x``, ``forward``
    and ``backward``.
    """

    @property
    def dy_format(self) -> str:
        """The recipe's ``grad_format``: E4M3 by default, as the scales follow each row or tile."""
        return self.grad_format

    @property
    def scales_known_ahead(self) -> bool:
        """Each scale comes from the call's own values."""
        return False

    @property
    def per_tensor(self) -> bool:
        """Scales per row or tile; the state keeps amaxes only."""
        return False

    @property
    def fuses_mlp(self) -> bool:
        """GPT's MLP is one custom VJP (``ops.fine_mlp``)."""
        return True

    @abc.abstractmethod
    def tile_width(self, k: int) -> int:
        """How many consecutive elements of x along a ``k``-wide contraction share one scale."""

    @abc.abstractmethod
    def cast_x(self, cfg: GemmConfig, x) -> tuple[jax.Array, ...]:
        """``(xq, x_inv, xq_t, xt_inv, amax_x)``: a forward GEMM's x in E4M3 in both layouts
        with their scales, ``x`` an [M, K] array or a ``cast_source.Source``."""

    @abc.abstractmethod
    def forward(self, cfg: GemmConfig, x, w_KxN: jax.Array, raw: bool = False):
        """``(Out of x . w [M, N], (amax_x, amax_w), residuals for backward)``.

        ``x`` is an [M, K] array or a ``cast_source.Source``; ``raw`` may leave the output
        scaled (its ``fine.Out`` then carries the inverse scales), in
        ``acc_dtype(cfg.out_dtype)``.
        """

    @abc.abstractmethod
    def backward(
        self,
        cfg: GemmConfig,
        res,
        g,
        fmt,
        dx_dtype,
        raw: bool = False,
        col_sums: bool = False,
    ):
        """``(Out of dx [M, K], dw [K, N], amax_g, [column sums of g])`` from ``forward``'s
        residuals and ``g`` ([M, N] array or ``cast_source.Source``) quantized to ``fmt``.

        ``raw`` as in ``forward``; ``col_sums`` returns g's f32 column sums from its cast.
        """

    def saturation_stats(self, x: jax.Array, state: ScaleState) -> tuple[jax.Array, jax.Array]:
        """(saturated share, flushed share) of ``x`` under its tiles' scales (``fine``)."""
        return fine.saturation_stats(x, state)

    def matmul(self, cfg, x: jax.Array, w: jax.Array, meta: Fp8Meta) -> tuple[jax.Array, Fp8Meta]:
        """``ops.fine.fine_matmul``: one plain GEMM per call (a batched one is an error)."""
        fine.check_unbatched(self, cfg.batched)
        return fine.fine_matmul(cfg, x, w, meta)

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
        """``ops.grouped.tiled_grouped_matmul``: x and dy per tile, w per tile of each group
        (so a stack split over ``w_split_axis`` needs no merged scale: its amax is recorded for
        health only and merged with the other replicas' after the step). Rows in a ``layout``
        are read as groups of its padded sizes, as given."""
        del w_split_axis, layout
        fine.check_recipes(meta)
        cfg = GemmConfig(jnp.dtype(x_MxK.dtype), jnp.dtype(w_GxKxN.dtype), out_dtype, False)
        return grouped.tiled_grouped_matmul(cfg, x_MxK, w_GxKxN, group_sizes_G, meta)

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
        """``ops.fine_mlp.gelu_mlp`` on tiles of any shape, after the LayerNorm if any."""
        del rebuild  # delayed scaling's fused path only
        x_MxD = norm.layer_norm(x_MxD, ln)
        return fine_mlp.gelu_mlp(
            x_MxD, w1_DxF, b1_F, w2_FxD, meta1, meta2, cast_kernel, recompute_cast
        )
