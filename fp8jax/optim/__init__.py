"""Optimizer: FP8/FP16 Adam moments and FP16 master weights, per FP8-LM level."""

from fp8jax.optim.adam import fp8_adamw, scale_by_fp8_adam
from fp8jax.optim.fused import FusedAdamW
from fp8jax.optim.levels import Level
from fp8jax.optim.master import (
    ScaledTensor,
    apply_updates,
    carry_masters,
    dequantize_carried,
    materialize,
    to_master,
)

__all__ = [
    "FusedAdamW",
    "Level",
    "ScaledTensor",
    "apply_updates",
    "carry_masters",
    "dequantize_carried",
    "fp8_adamw",
    "materialize",
    "scale_by_fp8_adam",
    "to_master",
]
