"""Mixture of Experts: LLaMA attention (RoPE, RMSNorm, grouped-query; optional q/k/v biases and
q/k norms) with routed SwiGLU experts (``fp8jax.models.moe.MoeMlp``) in place of the MLP;
``model.moe`` sets the experts.

Hugging Face: Mixtral, Qwen2-MoE (a shared expert with its sigmoid gate, q/k/v biases),
Qwen3-MoE (q/k norms per head) and OLMoE (q/k norms over all heads' width) import as this
family and export back; which one a model exports as follows from those features. Checkpoints
hold each expert as its own torch ``Linear`` weights (``experts.{j}.gate_proj.weight [F, D]``,
Mixtral's ``w1``/``w3``/``w2``), as transformers writes them whatever it stacks inside; the rows
index the expert axis of the stacked kernels ``experts_wi [E, D, 2, F]`` (gate then up) and
``experts_wo [E, F, D]``. The router ``gate.weight [E, D]`` is ``router/kernel [D, E]``
transposed.
"""

from __future__ import annotations

from typing import Any

from fp8jax.errors import CheckpointError, ConfigError
from fp8jax.models import moe  # noqa: F401 (registers the 'moe' block kind's module)
from fp8jax.models.config import Family, ModelConfig, MoeSpec, num_experts, register
from fp8jax.models.families import llama
from fp8jax.models.hf_table import ALL, HfTensor, one, reject, require, transpose

__all__ = ["MIXTRAL", "OLMOE", "QWEN2_MOE", "QWEN3_MOE", "Moe"]

MIXTRAL, QWEN2_MOE = "MixtralForCausalLM", "Qwen2MoeForCausalLM"
QWEN3_MOE, OLMOE = "Qwen3MoeForCausalLM", "OlmoeForCausalLM"
# HF architecture -> (config.json model_type, the block's MLP prefix, each expert's gate, up
# and down projection names, its qk_norm).
_LAYOUTS = {
    MIXTRAL: ("mixtral", "block_sparse_moe", ("w1", "w3", "w2"), ""),
    QWEN2_MOE: ("qwen2_moe", "mlp", ("gate_proj", "up_proj", "down_proj"), ""),
    QWEN3_MOE: ("qwen3_moe", "mlp", ("gate_proj", "up_proj", "down_proj"), "head"),
    OLMOE: ("olmoe", "mlp", ("gate_proj", "up_proj", "down_proj"), "full"),
}
# The config.json keys an export writes as LLaMA's does (attention, norms, RoPE).
_LLAMA_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "hidden_act",
)


@register
class Moe(Family):
    """LLaMA's block with a routed-expert feed-forward layer (``model.moe``)."""

    name = "moe"
    norm = "rmsnorm"
    positions = "rope"
    mlp = "moe"
    use_bias = False
    hf_architectures = tuple(_LAYOUTS)
    hf_model_types = {layout[0]: name for name, layout in _LAYOUTS.items()}

    def matmul_params_per_layer(self, cfg: ModelConfig) -> int:
        """Attention's weights, the router's, every routed expert's and the shared expert's."""
        e, d = cfg.moe, cfg.d_model
        return self._attention(cfg) + d * e.num_experts * (1 + 3 * e.d_ff) + self._shared(cfg)

    def matmul_params_read_per_layer(self, cfg: ModelConfig, tokens: int) -> int:
        """Attention's weights, the router's, the shared expert's and those of the routed
        experts ``tokens`` tokens can reach: top_k each, at most all of them."""
        e, d = cfg.moe, cfg.d_model
        reached = min(e.num_experts, tokens * e.top_k)
        experts = d * e.num_experts + 3 * d * e.d_ff * reached
        return self._attention(cfg) + experts + self._shared(cfg)

    @staticmethod
    def _attention(cfg: ModelConfig) -> int:
        h = cfg.head_dim
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

    def from_hf_config(self, hfc: dict[str, Any], architecture: str, where: str) -> dict[str, Any]:
        """The ModelConfig architecture fields of a Mixtral, Qwen2-MoE, Qwen3-MoE or OLMoE
        config.json dict: LLaMA's attention fields and the experts (``moe``)."""
        name = architecture
        if name in (QWEN2_MOE, QWEN3_MOE):
            # Every block routed: Qwen's dense blocks (mlp_only_layers, a sparse step) are not.
            if int(hfc.get("decoder_sparse_step") or 1) != 1 or hfc.get("mlp_only_layers"):
                reject(
                    where,
                    name,
                    "dense blocks among the MoE ones (decoder_sparse_step != 1 or mlp_only_layers)",
                )
            if hfc.get("use_sliding_window"):
                reject(where, name, "use_sliding_window=True")
        if name == OLMOE and hfc.get("clip_qkv") is not None:
            reject(where, name, f"clip_qkv={hfc['clip_qkv']}")
        # LLaMA's reading of attention, norms and RoPE (attention_bias=True refused); the
        # window is Mixtral's alone (every layer; null: none), Qwen's recorded ones unused
        fields = llama.Llama().from_hf_config(dict(hfc, sliding_window=None), name, where)
        fields["sliding_window"] = int(hfc.get("sliding_window") or 0) if name == MIXTRAL else 0
        experts_key = "num_local_experts" if name == MIXTRAL else "num_experts"
        experts = hfc.get(experts_key) or hfc.get("num_local_experts")
        width_key = (
            "moe_intermediate_size" if name in (QWEN2_MOE, QWEN3_MOE) else "intermediate_size"
        )
        shared = int(hfc.get("shared_expert_intermediate_size") or 0) if name == QWEN2_MOE else 0
        if name == QWEN2_MOE and not shared:
            reject(where, name, "shared_expert_intermediate_size 0 (no shared expert)")
        spec = MoeSpec(
            num_experts=int(experts or require(hfc, experts_key, where)),
            top_k=int(require(hfc, "num_experts_per_tok", where)),
            d_ff=int(require(hfc, width_key, where)),
            shared_d_ff=shared,
            shared_gate=bool(shared),  # Qwen2-MoE's shared expert has its gate
            # Mixtral's router softmaxes the top-k logits: the renormalised top-k of all
            normalize_top_k=name == MIXTRAL or bool(hfc.get("norm_topk_prob", False)),
            aux_loss_coef=float(hfc.get("router_aux_loss_coef", MoeSpec.aux_loss_coef)),
            z_loss_coef=float(hfc.get("router_z_loss_coef", MoeSpec.z_loss_coef)),
        )
        if spec.top_k > spec.num_experts:
            reject(where, name, f"num_experts_per_tok {spec.top_k} > {spec.num_experts} experts")
        return dict(
            fields,  # d_ff: intermediate_size, Qwen's dense width (unused), else the experts'
            style=self.name,
            qkv_bias=name == QWEN2_MOE and bool(hfc.get("qkv_bias", True)),
            qk_norm=_LAYOUTS[name][3],
            moe=spec,
        )

    def hf_export_name(self, cfg: ModelConfig) -> str:
        """Qwen2-MoE with a shared expert, Qwen3-MoE with q/k norms per head, OLMoE with q/k
        norms over all heads' width, else Mixtral."""
        if cfg.moe.shared_d_ff:
            return QWEN2_MOE
        return {"head": QWEN3_MOE, "full": OLMOE}.get(cfg.qk_norm, MIXTRAL)

    def check_hf_export(self, cfg: ModelConfig) -> None:
        """Raise a one-line CheckpointError where no HF architecture holds ``cfg``."""
        e, name = cfg.moe, self.hf_export_name(cfg)
        problem = None
        if e.router != "softmax":
            problem = f"router {e.router!r}: use model.moe.router='softmax'"
        elif name == QWEN2_MOE and (cfg.qk_norm or not e.shared_gate):
            problem = (
                "a shared expert comes with its gate and without q/k norms: set "
                "model.moe.shared_gate=True and model.qk_norm=''"
            )
        elif name != QWEN2_MOE and cfg.qkv_bias:
            problem = (
                "q/k/v biases come with a shared expert only (Qwen2-MoE): set model.qkv_bias=False"
            )
        elif name == MIXTRAL and not e.normalize_top_k:
            problem = (
                "without q/k norms or a shared expert (Mixtral) the router renormalises its "
                "top-k weights: set model.moe.normalize_top_k=True"
            )
        elif cfg.sliding_window and name != MIXTRAL:
            problem = f"sliding_window {cfg.sliding_window}: only Mixtral's attention has one"
        if problem:
            raise CheckpointError(
                f"no Hugging Face MoE architecture holds this model ({name}): {problem}"
            )

    def to_hf_config(self, cfg: ModelConfig) -> dict[str, Any]:
        """The config.json keys of ``cfg``'s architecture (Mixtral, Qwen2-MoE, Qwen3-MoE or
        OLMoE): LLaMA's attention keys and the experts'."""
        e, name = cfg.moe, self.hf_export_name(cfg)
        attention = llama.Llama().to_hf_config(cfg)
        out = {k: attention[k] for k in _LLAMA_KEYS}
        out.update(
            model_type=_LAYOUTS[name][0],
            num_experts_per_tok=e.top_k,
            router_aux_loss_coef=e.aux_loss_coef,
            output_router_logits=False,
        )
        if e.z_loss_coef:
            out["router_z_loss_coef"] = e.z_loss_coef
        if name == MIXTRAL:
            out.update(
                num_local_experts=e.num_experts,
                intermediate_size=e.d_ff,
                sliding_window=cfg.sliding_window or None,
                router_jitter_noise=0.0,
            )
            return out
        out.update(num_experts=e.num_experts, norm_topk_prob=e.normalize_top_k)
        if name == OLMOE:
            out.update(intermediate_size=e.d_ff, attention_bias=False, clip_qkv=None)
            return out
        out.update(  # Qwen2-MoE and Qwen3-MoE: every block routed, no sliding window
            moe_intermediate_size=e.d_ff,
            intermediate_size=cfg.d_ff,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            use_sliding_window=False,
            sliding_window=None,
        )
        if name == QWEN2_MOE:
            out.update(shared_expert_intermediate_size=e.shared_d_ff, qkv_bias=cfg.qkv_bias)
        else:
            out.update(attention_bias=False)
        return out

    def hf_tensors(self, cfg: ModelConfig) -> list[HfTensor]:
        """The state dict of ``cfg``'s architecture: LLaMA's with each block's router, experts
        (one tensor per expert and projection) and Qwen2-MoE's shared expert and its gate."""
        return llama.decoder_tensors(cfg, self._moe_tensors)

    def _moe_tensors(self, cfg: ModelConfig, prefix: str, i: int) -> list[HfTensor]:
        """Block ``i``'s router, experts and shared expert rows."""
        e, d = cfg.moe, cfg.d_model
        _, mlp, (gate, up, down), _ = _LAYOUTS[self.hf_export_name(cfg)]
        p = f"{prefix}{mlp}."
        wi, wo = ("mlp", "experts_wi", "kernel"), ("mlp", "experts_wo", "kernel")
        router = ("mlp", "router", "kernel")
        out = [one(f"{p}gate.weight", (e.num_experts, d), i, router, (), transpose)]
        for j in range(e.num_experts):  # expert j: slot j of the stacked kernels
            q = f"{p}experts.{j}."
            out += [
                one(f"{q}{gate}.weight", (e.d_ff, d), i, wi, (j, ALL, 0), transpose),
                one(f"{q}{up}.weight", (e.d_ff, d), i, wi, (j, ALL, 1), transpose),
                one(f"{q}{down}.weight", (d, e.d_ff), i, wo, (j,), transpose),
            ]
        if e.shared_d_ff:
            s, fs = f"{p}shared_expert.", e.shared_d_ff
            swi, swo = ("mlp", "shared", "wi", "kernel"), ("mlp", "shared", "wo", "kernel")
            gate_leaf = ("mlp", "shared_gate", "kernel")  # [D, 1]: HF's [1, D] transposed
            out += [
                one(f"{s}gate_proj.weight", (fs, d), i, swi, (ALL, 0), transpose),
                one(f"{s}up_proj.weight", (fs, d), i, swi, (ALL, 1), transpose),
                one(f"{s}down_proj.weight", (d, fs), i, swo, (), transpose),
                one(f"{p}shared_expert_gate.weight", (1, d), i, gate_leaf, (), transpose),
            ]
        return out
