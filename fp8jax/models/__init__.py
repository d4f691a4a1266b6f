"""Decoder-only transformers (GPT-2 and LLaMA style) with FP8 linears, built from a ModelConfig.

The model families (``families``: GPT-2 and LLaMA style) register themselves on import.
"""

from fp8jax.models import families
from fp8jax.models.config import (
    Architecture,
    Execution,
    Family,
    ModelConfig,
    count_params,
    flops_per_token,
    get_family,
    matmul_params,
    matmul_params_read,
)
from fp8jax.models.layers import Attention, Block, Mlp
from fp8jax.models.transformer import Transformer, abstract_variables, build_model

__all__ = [
    "Architecture",
    "Attention",
    "Block",
    "Execution",
    "Family",
    "Mlp",
    "ModelConfig",
    "Transformer",
    "abstract_variables",
    "build_model",
    "count_params",
    "families",
    "flops_per_token",
    "get_family",
    "matmul_params",
    "matmul_params_read",
]
