"""Decoder-only transformers (GPT-2 and LLaMA style) with FP8 linears, built from a ModelConfig."""

from fp8jax.models.config import ModelConfig, count_params, flops_per_token, matmul_params
from fp8jax.models.layers import Attention, Block, Mlp
from fp8jax.models.transformer import Transformer, build_model

__all__ = [
    "Attention",
    "Block",
    "Mlp",
    "ModelConfig",
    "Transformer",
    "build_model",
    "count_params",
    "flops_per_token",
    "matmul_params",
]
