"""GPT-2 style: learned positions, LayerNorm, tanh-GELU MLP, biases on every linear.

Hugging Face: ``GPT2LMHeadModel`` (``Conv1D`` kernels ``[in, out]``; ``c_attn``'s output is
q | k | v).
"""

from __future__ import annotations

from typing import Any

from fp8jax.errors import CheckpointError
from fp8jax.models.config import Family, ModelConfig, register
from fp8jax.models.hf_table import (
    ALL,
    DEFAULT_ROPE_THETA,
    HfTensor,
    attn_pieces,
    one,
    reject,
    require,
    transpose,
)

__all__ = ["GPT2", "Gpt"]

GPT2 = "GPT2LMHeadModel"


@register
class Gpt(Family):
    """GPT-2: LayerNorm, learned positions, tanh-GELU MLP, biases everywhere."""

    name = "gpt"
    norm = "layernorm"
    positions = "learned"
    mlp = "gelu"
    use_bias = True
    hf_architectures = (GPT2,)
    hf_model_types = {"gpt2": GPT2}

    def from_hf_config(self, hfc: dict[str, Any], architecture: str, where: str) -> dict[str, Any]:
        """The ModelConfig architecture fields of a GPT-2 config.json dict."""
        d_model, heads = int(require(hfc, "n_embd", where)), int(require(hfc, "n_head", where))
        if d_model % heads:
            reject(where, GPT2, f"n_embd {d_model} not divisible by n_head {heads}")
        if hfc.get("activation_function", "gelu_new") != "gelu_new":
            reject(where, GPT2, f"activation_function {hfc.get('activation_function')!r}")
        for key in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
            if hfc.get(key):
                reject(where, GPT2, f"{key}=True")
        if hfc.get("scale_attn_weights") is False:
            reject(where, GPT2, "scale_attn_weights=False")
        return dict(
            style=self.name,
            vocab_size=int(require(hfc, "vocab_size", where)),
            d_model=d_model,
            num_layers=int(require(hfc, "n_layer", where)),
            num_heads=heads,
            num_kv_heads=heads,
            head_width=0,  # d_model / n_head
            d_ff=int(hfc.get("n_inner") or 4 * d_model),
            max_len=int(require(hfc, "n_positions", where)),
            tie_embeddings=bool(hfc.get("tie_word_embeddings", True)),
            norm_eps=float(hfc.get("layer_norm_epsilon", 1e-5)),
            rope_theta=DEFAULT_ROPE_THETA,  # unused by the GPT style
            rope_scaling=None,
            qkv_bias=False,  # GPT's linears all carry biases (ModelConfig.use_bias)
            qk_norm="",
            sliding_window=0,
            moe=None,
        )

    def hf_export_name(self, cfg: ModelConfig) -> str:
        """GPT-2."""
        return GPT2

    def check_hf_export(self, cfg: ModelConfig) -> None:
        """GPT-2 has one key/value head per query head, no q/k norms, and heads that split
        d_model."""
        if cfg.num_kv_heads != cfg.num_heads:
            raise CheckpointError(
                "GPT-2 has no grouped-query attention: num_kv_heads must equal num_heads"
            )
        if cfg.qk_norm:
            raise CheckpointError(
                f"GPT-2 has no q/k norms: qk_norm must be '', not {cfg.qk_norm!r}"
            )
        if cfg.head_dim * cfg.num_heads != cfg.d_model:
            raise CheckpointError(
                f"GPT-2's heads split d_model: head_dim {cfg.head_dim} x {cfg.num_heads} heads "
                f"must equal d_model {cfg.d_model} (set model.head_width=0)"
            )

    def to_hf_config(self, cfg: ModelConfig) -> dict[str, Any]:
        """GPT-2's config.json keys of ``cfg``."""
        return dict(
            model_type="gpt2",
            n_embd=cfg.d_model,
            n_layer=cfg.num_layers,
            n_head=cfg.num_heads,
            n_inner=cfg.d_ff,
            n_positions=cfg.max_len,
            layer_norm_epsilon=cfg.norm_eps,
            activation_function="gelu_new",
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )

    def hf_tensors(self, cfg: ModelConfig) -> list[HfTensor]:
        """GPT-2's state dict (Conv1D kernels [in, out]; c_attn's output is q | k | v)."""
        m = cfg
        d, n, h, f, v = m.d_model, m.num_heads, m.head_dim, m.d_ff, m.vocab_size
        k, g = m.num_kv_heads, m.num_heads // m.num_kv_heads

        def c_attn(qkv, part):
            j = "qkv".index(qkv)
            lead = (d,) if part == "kernel" else ()  # [D, 3D] or [3D]

            def views(rank):
                shape = (*lead, 3, k, g, h) if rank == 3 else (*lead, 3, n, h)
                return lambda w: w.reshape(shape)[(ALL,) * len(lead) + (j,)]

            return attn_pieces(m.fused_qkv, g, qkv, part, views)

        def norm(name, leaf, i):
            return [
                one(f"{name}.weight", (d,), i, (leaf, "scale")),
                one(f"{name}.bias", (d,), i, (leaf, "bias")),
            ]

        out = [
            one("transformer.wte.weight", (v, d), None, ("embed", "embedding")),
            one("transformer.wpe.weight", (m.max_len, d), None, ("pos_embed",)),
        ]
        o_view = lambda w: w.reshape(n, h, d)  # [N*H, D] -> [N, H, D]
        for i in range(m.num_layers):
            p = f"transformer.h.{i}."
            w_pieces = sum((c_attn(qkv, "kernel") for qkv in "qkv"), ())
            b_pieces = sum((c_attn(qkv, "bias") for qkv in "qkv"), ())
            out += norm(f"{p}ln_1", "attn_norm", i)
            out += [
                HfTensor(f"{p}attn.c_attn.weight", (d, 3 * d), i, w_pieces),
                HfTensor(f"{p}attn.c_attn.bias", (3 * d,), i, b_pieces),
                one(f"{p}attn.c_proj.weight", (d, d), i, ("attn", "o", "kernel"), (), o_view),
                one(f"{p}attn.c_proj.bias", (d,), i, ("attn", "o", "bias")),
            ]
            out += norm(f"{p}ln_2", "mlp_norm", i)
            out += [
                one(f"{p}mlp.c_fc.weight", (d, f), i, ("mlp", "wi", "kernel")),
                one(f"{p}mlp.c_fc.bias", (f,), i, ("mlp", "wi", "bias")),
                one(f"{p}mlp.c_proj.weight", (f, d), i, ("mlp", "wo", "kernel")),
                one(f"{p}mlp.c_proj.bias", (d,), i, ("mlp", "wo", "bias")),
            ]
        out += norm("transformer.ln_f", "final_norm", None)
        if not m.tie_embeddings:
            out.append(one("lm_head.weight", (v, d), None, ("head", "kernel"), (), transpose))
        return out
