"""Parameters at flax's paths for the fused ops that run their math themselves.

``FusedLinear`` declares ``nn.DenseGeneral``'s kernel, bias and FP8 state, ``NormParams``
``nn.LayerNorm``'s scale and bias, with the same initialisers, shapes and logical axes: a model
that fuses a matmul (``ops.mlp``, ``ops.qkv``) or folds a norm into one (``ops.norm``) has the
same params tree as one that does not, so checkpoints and Hugging Face conversions serve both.
"""

from __future__ import annotations

import math

import jax
from flax import linen as nn

from fp8jax.models.config import ModelConfig
from fp8jax.nn.linen import Fp8Meta

__all__ = ["INIT_STD", "FusedLinear", "NormParams", "bias_init", "norm_scale_init", "normal_init"]

INIT_STD = 0.02  # GPT-2 / LLaMA initialiser scale for embeddings and linears


def normal_init(names, std: float = INIT_STD):
    """Normal(std) initialiser carrying logical axis names for sharding."""
    return nn.with_logical_partitioning(nn.initializers.normal(std), names)


def bias_init(names):
    """Zeros initialiser of a linear layer's bias, carrying its logical axis names."""
    return nn.with_logical_partitioning(nn.initializers.zeros, names)


def norm_scale_init():
    """Ones initialiser of a norm's scale, on the ``norm`` logical axis."""
    return nn.with_logical_partitioning(nn.initializers.ones, ("norm",))


class FusedLinear(nn.Module):
    """``nn.DenseGeneral``'s kernel, bias and FP8 state at its paths, for a fused op (the MLP,
    the Q/K/V projection) that runs the matmul itself."""

    cfg: ModelConfig
    shape: tuple[int, ...]  # [in, *features]
    names: tuple[str | None, ...]  # logical axes of the kernel
    std: float
    use_bias: bool = True

    def setup(self):
        c = self.cfg
        # Initialised as nn.DenseGeneral does: [in, prod(features)], then reshaped.
        flat = (self.shape[0], math.prod(self.shape[1:]))

        def init_kernel(key, shape, dtype):
            boxed = normal_init(self.names, self.std)(key, flat, dtype)
            return nn.meta.replace_boxed(boxed, boxed.unbox().reshape(shape))

        self.kernel = self.param("kernel", init_kernel, self.shape, c.param_dtype)
        self.bias = None
        if self.use_bias:
            init_b = bias_init(self.names[1:])
            self.bias = self.param("bias", init_b, self.shape[1:], c.param_dtype)
        self.Fp8DotGeneral_0 = Fp8Meta(c.recipe, cast_kernel=c.cast_kernel)


class NormParams(nn.Module):
    """``nn.LayerNorm``'s params at its path, for an FP8 op that folds the norm into its cast:
    returns ``(scale, bias, eps)``."""

    cfg: ModelConfig

    @nn.compact
    def __call__(self) -> tuple[jax.Array, jax.Array, float]:
        c = self.cfg
        scale = self.param("scale", norm_scale_init(), (c.d_model,), c.param_dtype)
        bias = self.param("bias", bias_init(("norm",)), (c.d_model,), c.param_dtype)
        return scale, bias, c.norm_eps
