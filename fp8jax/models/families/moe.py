"""Mixture of Experts: LLaMA attention (RoPE, RMSNorm, grouped-query) with routed SwiGLU experts
(``fp8jax.models.moe.MoeMlp``) in place of the MLP; ``model.moe`` sets the experts.

No Hugging Face form yet: import and export refuse with one line.
"""

from __future__ import annotations

from typing import Any

from fp8jax.errors import CheckpointError, ConfigError
from fp8jax.models import moe  # noqa: F401 (registers the 'moe' block kind's module)
from fp8jax.models.config import Family, ModelConfig, num_experts, register
from fp8jax.models.hf_table import HfTensor

__all__ = ["Moe"]


@register
class Moe(Family):
    """LLaMA's block with a routed-expert feed-forward layer (``model.moe``)."""

    name = "moe"
    norm = "rmsnorm"
    positions = "rope"
    mlp = "moe"
    use_bias = False
    hf_architectures = ()
    hf_model_types = {}

    def matmul_params_per_layer(self, cfg: ModelConfig) -> int:
        """Attention's weights, the router's, every routed expert's and the shared expert's."""
        e, d = cfg.moe, cfg.d_model
        return self._attention(cfg) + d * e.num_experts * (1 + 3 * e.d_ff) + self._shared(cfg)

    def active_matmul_params_per_layer(self, cfg: ModelConfig) -> int:
        """Attention's weights, the router's, top_k routed experts' and the shared expert's."""
        e, d = cfg.moe, cfg.d_model
        experts = d * e.num_experts + 3 * d * e.d_ff * e.top_k
        return self._attention(cfg) + experts + self._shared(cfg)

    @staticmethod
    def _attention(cfg: ModelConfig) -> int:
        h = cfg.d_model // cfg.num_heads
        return cfg.d_model * h * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)  # q, k, v, out

    @staticmethod
    def _shared(cfg: ModelConfig) -> int:
        e = cfg.moe
        return 3 * cfg.d_model * e.shared_d_ff + (cfg.d_model if e.shared_gate else 0)

    def check(self, cfg: Any) -> None:
        """The dense checks, and experts to route to."""
        super().check(cfg)
        if not num_experts(cfg):
            raise ConfigError(
                "model.style='moe' routes tokens to experts: set model.moe.num_experts > 0"
            )

    def check_hf_export(self, cfg: ModelConfig) -> None:
        """No Hugging Face form yet."""
        raise CheckpointError(f"model.style={self.name!r} has no Hugging Face form yet")

    def hf_tensors(self, cfg: ModelConfig) -> list[HfTensor]:
        """No Hugging Face form yet."""
        raise CheckpointError(f"model.style={self.name!r} has no Hugging Face form yet")
