"""Delayed scaling: the scale at step t from the amax of steps before t."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from fp8jax.ops import scaling
from fp8jax.recipes.tensor import TensorRecipe

__all__ = ["DelayedScaling"]


@scaling.register
@dataclasses.dataclass(frozen=True)
class DelayedScaling(TensorRecipe):
    """Scale at step t from the amax of steps < t (a window of ``history_len`` steps)."""

    name: ClassVar[str] = "delayed"

    history_len: int = 16  # steps of amax kept; MS-AMP uses 16, Transformer Engine 1024
    amax_compute_algo: str = "max"  # 'max' over the window or 'most_recent' step
    margin: int = 0  # scale = fmax / (amax * 2**margin): headroom in powers of two
    power_of_two: bool = False  # round the scale down to a power of two (exact rescaling)

    def __post_init__(self):
        if self.amax_compute_algo not in scaling.AMAX_ALGOS:
            raise ValueError(
                f"unknown amax_compute_algo {self.amax_compute_algo!r}: use one of "
                f"{scaling.AMAX_ALGOS}"
            )
        if int(self.history_len) < 1:
            raise ValueError(f"history_len must be >= 1, got {self.history_len}")

    @property
    def scales_known_ahead(self) -> bool:
        """Every scale is stored before the step: the fused cast kernels can use it."""
        return True

    @property
    def fuses_mlp(self) -> bool:
        """GPT's MLP is one custom VJP (``ops.mlp``) on the fused cast kernels."""
        return True
