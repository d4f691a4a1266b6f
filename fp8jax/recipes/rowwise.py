"""Rowwise scaling: one scale per row of each GEMM operand along its contraction axis."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax

from fp8jax.ops import block_cast, fine, formats, gemm, scaling
from fp8jax.ops.gemm import GemmConfig
from fp8jax.recipes.tiled import TiledRecipe, check_grad_format

__all__ = ["RowwiseScaling"]


@scaling.register
@dataclasses.dataclass(frozen=True)
class RowwiseScaling(TiledRecipe):
    """One scale per row of each GEMM operand along its contraction axis, from this call's values.

    The forward scales x per row and w per column (the scales factor out of the contraction and
    unscale the output); dgrad and wgrad re-quantize their operands along their own contraction
    axes. Runs on the per-tensor FP8 GEMM (cuBLASLt on Hopper).
    """

    name: ClassVar[str] = "rowwise"

    margin: int = 0  # scale = fmax / (amax * 2**margin)
    power_of_two: bool = False  # round each scale down to a power of two
    grad_format: str = "e4m3"  # dy's format: E4M3 (its scales follow each row) or 'e5m2'
    history_len: int = 1  # per-tensor amax kept for health reporting only
    amax_compute_algo: str = "most_recent"

    def __post_init__(self):
        check_grad_format(self.grad_format)

    def tile_width(self, k: int) -> int:
        """A whole row: one scale per row."""
        return k

    def cast_x(self, cfg: GemmConfig, x) -> tuple[jax.Array, ...]:
        """x per row (along K) and x.T per row (along M), E4M3, in one call."""
        out = block_cast.cast_transpose_rows(x, formats.E4M3, self, cfg.cast, prologue=cfg.prologue)
        return out[:5]

    def forward(self, cfg: GemmConfig, x, w_KxN: jax.Array, raw: bool = False):
        """The forward GEMM on row-scaled operands; ``raw`` leaves its output scaled."""
        impl = cfg.cast
        # E4M3 for x and w, each in both layouts in one call. x per row (along K) for this GEMM
        # and x.T per row (along M) for wgrad; w.T per row (w per column, along K) for this GEMM
        # and w per row (along N) for dgrad. w's recorded amax is w.T's rows', as its forward
        # operand's.
        xq, x_inv, xq_t, xt_inv, amax_x = self.cast_x(cfg, x)
        wq, w_inv, wq_t, wt_inv, _, amax_w = block_cast.cast_transpose_rows(
            w_KxN, formats.E4M3, self, impl
        )
        out = fine.out_rowwise(impl, xq, x_inv, wq_t, wt_inv, cfg.out_dtype, raw)  # [M, N]
        return out, (amax_x, amax_w), (xq_t, xt_inv, wq, w_inv)

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
        """dgrad and wgrad on row-scaled operands; ``raw`` leaves dx scaled."""
        xq_t, xt_inv, wq, w_inv = res
        # dy in the recipe's grad format: per row (along N) for dgrad, dy.T per row (along M)
        # for wgrad, both in one call.
        gq, g_inv, gq_t, gt_inv, amax_g, _, *sums = block_cast.cast_transpose_rows(
            g, fmt, self, cfg.cast, col_sums=col_sums
        )
        dx = fine.out_rowwise(cfg.cast, gq, g_inv, wq, w_inv, dx_dtype, raw)  # [M, K], N contracted
        acc = gemm.acc_dtype(gemm.wgrad_dtype(cfg))
        dw = fine.rowwise_gemm(cfg.cast, xq_t, xt_inv, gq_t, gt_inv, cfg.w_dtype, acc)  # [K, N]
        return dx, dw, amax_g, sums
