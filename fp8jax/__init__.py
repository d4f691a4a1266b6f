"""fp8jax: FP8 mixed-precision training (FP8-LM levels O1/O2/O3) for JAX and Flax."""

from fp8jax.diagnostics.coverage import CoverageReport, coverage_report
from fp8jax.nn import nnx
from fp8jax.nn.linen import (
    Einsum,
    Fp8DotGeneral,
    Fp8Einsum,
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
from fp8jax.ops import formats, kernels, remat, scaling
from fp8jax.ops.dot import dot_general
from fp8jax.ops.formats import E4M3, E5M2, amax, dequantize, quantize
from fp8jax.ops.kernels import cast_transpose
from fp8jax.ops.scaling import (
    BlockScaling,
    CurrentScaling,
    DelayedScaling,
    Fp8Meta,
    RowwiseScaling,
    ScaleState,
    init_meta,
    make_recipe,
)
from fp8jax.optim.adam import fp8_adamw

__version__ = "0.1.0"

_TRAINER = {"train_and_evaluate"}


def __getattr__(name: str):
    """``fp8jax.train_and_evaluate``, imported on first use (the trainer imports orbax, grain)."""
    if name in _TRAINER:
        from fp8jax.trainer import loop

        return getattr(loop, name)
    raise AttributeError(f"module 'fp8jax' has no attribute {name!r}")


__all__ = [
    "E4M3",
    "E5M2",
    "FP8",
    "FP8_STATS",
    "BlockScaling",
    "CoverageReport",
    "CurrentScaling",
    "DelayedScaling",
    "Einsum",
    "Fp8DotGeneral",
    "Fp8Einsum",
    "RowwiseScaling",
    "Fp8Meta",
    "ScaleState",
    "amax",
    "cast_transpose",
    "commit",
    "coverage_report",
    "dequantize",
    "dot_general",
    "formats",
    "fp8_adamw",
    "fp8_dot_general_cls",
    "fp8_einsum",
    "fp8_scan",
    "init_meta",
    "keep_if_finite",
    "keep_kernel_dtype",
    "kernels",
    "make_recipe",
    "merge_grads",
    "nnx",
    "quantize",
    "remat",
    "scaling",
    "summarize",
    "train_and_evaluate",
    "update_state",
]
