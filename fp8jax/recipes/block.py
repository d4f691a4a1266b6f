"""Block scaling (DeepSeek-V3's): 1 x T tiles for x and dy, T x T blocks for w."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from fp8jax.ops import block_cast, block_gemm, fine, formats, grouped_block, grouped_mgpu, scaling
from fp8jax.ops.gemm import GemmConfig
from fp8jax.recipes.tiled import TiledRecipe, check_grad_format

__all__ = ["BlockScaling"]


@scaling.register
@dataclasses.dataclass(frozen=True)
class BlockScaling(TiledRecipe):
    """DeepSeek-V3's recipe: 1 x ``block_size`` tiles for x and dy, ``block_size``^2 for w.

    Scales come from each tile's own amax. Block scales along the contraction do not factor out
    of a GEMM, so it runs on fp8jax's block-scaled GEMM (``ops.block_gemm``), which rescales
    each ``block_size``-wide slice of K into an f32 accumulator. At 128-wide tiles its expert
    layers' grouped GEMMs run on rows padded per expert (``ops.grouped_block``).
    """

    name: ClassVar[str] = "block"

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
        check_grad_format(self.grad_format)

    @property
    def weight_tile(self) -> int:
        """``block_size``: w is scaled in T x T blocks."""
        return self.block_size

    @property
    def pads_grouped_rows(self) -> bool:
        """128-wide blocks: the grouped GEMM runs on rows padded to whole 128-row tiles per
        group (``ops.grouped_block``), so no tile of rows spans two experts."""
        return self.block_size == grouped_mgpu.TILE

    def grouped_matmul(
        self,
        x_MxK: jax.Array,
        w_GxKxN: jax.Array,
        group_sizes_G: jax.Array,
        meta: scaling.Fp8Meta,
        out_dtype,
        w_split_axis: str | None = None,
        layout=None,
    ) -> tuple[jax.Array, scaling.Fp8Meta]:
        """``ops.grouped_block.block_grouped_matmul`` on the padded layout where it takes the
        shapes (a given ``layout`` says it does); the tiled reference otherwise."""
        if layout is None and not grouped_block.takes(self, x_MxK, w_GxKxN):
            return super().grouped_matmul(
                x_MxK, w_GxKxN, group_sizes_G, meta, out_dtype, w_split_axis
            )
        fine.check_recipes(meta)
        cfg = GemmConfig(jnp.dtype(x_MxK.dtype), jnp.dtype(w_GxKxN.dtype), out_dtype, False)
        return grouped_block.block_grouped_matmul(cfg, x_MxK, w_GxKxN, group_sizes_G, meta, layout)

    def tile_width(self, k: int) -> int:
        """``block_size``: 1 x T tiles along the contraction."""
        return self.block_size

    def cast_x(self, cfg: GemmConfig, x) -> tuple[jax.Array, ...]:
        """x in 1 x T tiles along K and T x 1 (x.T's 1 x T along M), E4M3, in one call."""
        return block_cast.cast_transpose_tiles(
            x, formats.E4M3, self.block_size, self, cfg.cast, prologue=cfg.prologue
        )

    def forward(self, cfg: GemmConfig, x, w_KxN: jax.Array, raw: bool = False):
        """The forward block-scaled GEMM; its output is unscaled whatever ``raw`` says."""
        t, impl = self.block_size, cfg.cast
        # E4M3 for x and w. x: 1 x T tiles along K for this GEMM and T x 1 (x.T's 1 x T along M)
        # for wgrad; w: T x T blocks, which serve the forward ([N, K]) and dgrad ([K, N]) alike.
        xq, x_inv, xq_t, xt_inv, amax_x = self.cast_x(cfg, x)
        wq, wq_t, w_inv, amax_w = block_cast.cast_transpose_blocks(
            w_KxN, formats.E4M3, t, self, impl
        )
        y = block_gemm.block_scaled_dot(
            xq, x_inv, wq_t, w_inv.T, block=t, out_dtype=cfg.out_dtype, impl=impl, b_blocks=True
        )
        return fine.Out(y), (amax_x, amax_w), (xq_t, xt_inv, wq, w_inv)

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
        """dgrad and wgrad as block-scaled GEMMs; dx is unscaled whatever ``raw`` says."""
        t, impl = self.block_size, cfg.cast
        xq_t, xt_inv, wq, w_inv = res
        # dy: 1 x T tiles along N for dgrad, T x 1 (dy.T's 1 x T along M) for wgrad.
        gq, g_inv, gq_t, gt_inv, amax_g, *sums = block_cast.cast_transpose_tiles(
            g, fmt, t, self, impl, col_sums=col_sums
        )
        dx = block_gemm.block_scaled_dot(
            gq, g_inv, wq, w_inv, block=t, out_dtype=dx_dtype, impl=impl, b_blocks=True
        )  # [M, K]: w [K, N] with its T x T blocks, N contracted
        dw = block_gemm.block_scaled_dot(
            xq_t, xt_inv, gq_t, gt_inv, block=t, out_dtype=cfg.w_dtype, impl=impl, b_blocks=False
        )  # [K, N]: M contracted, both operands tiled along M
        return fine.Out(dx), dw, amax_g, sums
