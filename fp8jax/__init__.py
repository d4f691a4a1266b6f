"""fp8jax: FP8 mixed-precision training (FP8-LM levels O1/O2/O3) for JAX and Flax."""

from fp8jax.diagnostics.coverage import CoverageReport, coverage_report
from fp8jax.nn import nnx
from fp8jax.nn.linen import (
    Einsum,
    Fp8DotGeneral,
    Fp8Einsum,
    Fp8RaggedDot,
    fp8_dot_general_cls,
    fp8_einsum,
    fp8_scan,
    keep_kernel_dtype,
)
from fp8jax.nn.state import (
    FP8,
    FP8_STATS,
    commit,
    keep_if_finite,
    merge_grads,
    summarize,
    update_state,
)
from fp8jax.ops.dot import dot_general
from fp8jax.ops.grouped import ragged_dot
from fp8jax.ops.scaling import Fp8Meta, ScaleState, init_meta, make_recipe
from fp8jax.optim.adam import fp8_adamw
from fp8jax.recipes import BlockScaling, CurrentScaling, DelayedScaling, Recipe, RowwiseScaling

__version__ = "0.1.0"

_TRAINER = {"train_and_evaluate"}


def __getattr__(name: str):
    """``fp8jax.train_and_evaluate``, imported on first use (the trainer imports orbax, grain)."""
    if name in _TRAINER:
        from fp8jax.trainer import loop

        return getattr(loop, name)
    raise AttributeError(f"module 'fp8jax' has no attribute {name!r}")


__all__ = [
    "FP8",
    "FP8_STATS",
    "BlockScaling",
    "CoverageReport",
    "CurrentScaling",
    "DelayedScaling",
    "Einsum",
    "Fp8DotGeneral",
    "Fp8Einsum",
    "Fp8Meta",
    "Fp8RaggedDot",
    "Recipe",
    "RowwiseScaling",
    "ScaleState",
    "commit",
    "coverage_report",
    "dot_general",
    "fp8_adamw",
    "fp8_dot_general_cls",
    "fp8_einsum",
    "fp8_scan",
    "init_meta",
    "keep_if_finite",
    "keep_kernel_dtype",
    "make_recipe",
    "merge_grads",
    "nnx",
    "ragged_dot",
    "summarize",
    "train_and_evaluate",
    "update_state",
]
