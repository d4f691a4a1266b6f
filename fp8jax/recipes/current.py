"""Current scaling: the scale from each call's own amax."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax

from fp8jax.ops import scaling
from fp8jax.ops.scaling import ScaleState
from fp8jax.recipes.tensor import TensorRecipe

__all__ = ["CurrentScaling"]


@scaling.register
@dataclasses.dataclass(frozen=True)
class CurrentScaling(TensorRecipe):
    """Scale from this call's own amax (one extra reduction per tensor, no lag)."""

    name: ClassVar[str] = "current"

    margin: int = 0  # scale = fmax / (amax * 2**margin)
    power_of_two: bool = False  # round the scale down to a power of two
    history_len: int = 1  # kept for health reporting only
    amax_compute_algo: str = "most_recent"

    @property
    def scales_known_ahead(self) -> bool:
        """Each scale waits for its tensor's amax: no fused cast paths."""
        return False

    @property
    def fuses_mlp(self) -> bool:
        """GPT's MLP runs as two FP8 matmuls."""
        return False

    def use_scale(self, state: ScaleState, amax: jax.Array) -> jax.Array:
        """The scale from this use's ``amax`` (the stored one where it is unusable)."""
        return scaling.scale_from_amax(amax, state.scale, state.fmt, self)
