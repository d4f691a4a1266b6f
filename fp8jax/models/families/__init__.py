"""The model families, one module each, registered by name (``model.style``).

``gpt``: GPT-2 style (learned positions, LayerNorm, tanh-GELU MLP, biases); ``llama``: LLaMA
style (RoPE, RMSNorm, SwiGLU, no biases), which also imports Mistral and Qwen2; ``moe``: LLaMA's
attention with routed SwiGLU experts (``fp8jax.models.moe``). Importing this
package registers them; a new family is a new module here that subclasses
``fp8jax.models.config.Family``, registers itself with ``@register`` and is imported below.
"""

from fp8jax.models.config import FAMILIES, Family, get_family, register
from fp8jax.models.families import gpt, llama, moe

__all__ = ["FAMILIES", "Family", "get_family", "gpt", "llama", "moe", "register"]
