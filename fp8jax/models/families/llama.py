"""LLaMA style: RoPE, RMSNorm, SwiGLU MLP, no biases (Qwen2: biases on q, k and v).

Hugging Face: LLaMA (2/3), Mistral and Qwen2 import as this family (torch ``Linear`` weights
``[out, in]``; fp8jax's ``wi [D, 2, F]`` holds gate then up; HF's q/k weights are already in
rotate-half order, as fp8jax's RoPE). Mistral's ``sliding_window`` (and Qwen2's, where
``use_sliding_window`` applies it to every layer) imports as ``sliding_window``. An fp8jax model
exports as Qwen2 with q/k/v biases, else as Mistral with a sliding window, else as LLaMA.
"""

from __future__ import annotations

from typing import Any

from fp8jax.errors import CheckpointError
from fp8jax.models.config import Family, ModelConfig, RopeScaling, register
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

__all__ = ["LLAMA", "MISTRAL", "QWEN2", "Llama"]

LLAMA, MISTRAL, QWEN2 = "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"


@register
class Llama(Family):
    """LLaMA (2/3), Mistral and Qwen2: RMSNorm, RoPE, SwiGLU, grouped-query attention."""

    name = "llama"
    norm = "rmsnorm"
    positions = "rope"
    mlp = "swiglu"
    use_bias = False
    hf_architectures = (LLAMA, MISTRAL, QWEN2)
    hf_model_types = {"llama": LLAMA, "mistral": MISTRAL, "qwen2": QWEN2}

    def from_hf_config(self, hfc: dict[str, Any], architecture: str, where: str) -> dict[str, Any]:
        """The ModelConfig architecture fields of a LLaMA, Mistral or Qwen2 config.json dict."""
        name = architecture
        d_model = int(require(hfc, "hidden_size", where))
        heads = int(require(hfc, "num_attention_heads", where))
        head_dim = hfc.get("head_dim") or d_model // heads
        if head_dim * heads != d_model:
            reject(where, name, f"head_dim {head_dim} x {heads} heads != hidden_size {d_model}")
        if hfc.get("hidden_act", "silu") != "silu":
            reject(where, name, f"hidden_act {hfc.get('hidden_act')!r} (not 'silu')")
        for key in ("attention_bias", "mlp_bias"):
            if hfc.get(key):
                reject(where, name, f"{key}=True")
        rope = hfc.get("rope_parameters") or {}
        scaling = hfc.get("rope_scaling") or rope
        kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
        if kind not in ("default", "llama3"):
            reject(where, name, f"rope type {kind!r} (only 'default' and 'llama3')")
        rope_scaling = None
        if kind == "llama3":
            rope_scaling = RopeScaling(
                factor=float(scaling["factor"]),
                low_freq_factor=float(scaling["low_freq_factor"]),
                high_freq_factor=float(scaling["high_freq_factor"]),
                original_max_len=int(scaling["original_max_position_embeddings"]),
            )
        max_len = int(require(hfc, "max_position_embeddings", where))
        return dict(
            style=self.name,
            vocab_size=int(require(hfc, "vocab_size", where)),
            d_model=d_model,
            num_layers=int(require(hfc, "num_hidden_layers", where)),
            num_heads=heads,
            num_kv_heads=int(hfc.get("num_key_value_heads") or heads),
            d_ff=int(require(hfc, "intermediate_size", where)),
            max_len=max_len,
            tie_embeddings=bool(hfc.get("tie_word_embeddings", False)),
            norm_eps=float(hfc.get("rms_norm_eps", 1e-6)),
            rope_theta=float(hfc.get("rope_theta", rope.get("rope_theta", DEFAULT_ROPE_THETA))),
            rope_scaling=rope_scaling,
            qkv_bias=name == QWEN2,  # Qwen2: biases on q, k and v only
            qk_norm="",
            sliding_window=_window(hfc, name, where),
            moe=None,
        )

    def hf_export_name(self, cfg: ModelConfig) -> str:
        """Qwen2 where q, k and v carry biases, else Mistral with a sliding window, else LLaMA."""
        if cfg.qkv_bias:
            return QWEN2
        return MISTRAL if cfg.sliding_window else LLAMA

    def to_hf_config(self, cfg: ModelConfig) -> dict[str, Any]:
        """LLaMA's (or Qwen2's, or Mistral's) config.json keys of ``cfg``."""
        m, name = cfg, self.hf_export_name(cfg)
        if m.num_heads % m.num_kv_heads or m.d_model % m.num_heads:
            raise CheckpointError(
                f"num_heads {m.num_heads} must divide d_model {m.d_model} and be a multiple of "
                f"num_kv_heads {m.num_kv_heads} for a {name} export"
            )
        scaling = None
        if m.rope_scaling is not None:
            s = m.rope_scaling
            scaling = dict(
                rope_type="llama3",
                factor=s.factor,
                low_freq_factor=s.low_freq_factor,
                high_freq_factor=s.high_freq_factor,
                original_max_position_embeddings=s.original_max_len,
            )
        out = dict(
            model_type={QWEN2: "qwen2", MISTRAL: "mistral"}.get(name, "llama"),
            hidden_size=m.d_model,
            num_hidden_layers=m.num_layers,
            num_attention_heads=m.num_heads,
            num_key_value_heads=m.num_kv_heads,
            head_dim=m.head_dim,
            intermediate_size=m.d_ff,
            max_position_embeddings=m.max_len,
            rms_norm_eps=m.norm_eps,
            rope_theta=m.rope_theta,
            rope_scaling=scaling,
            hidden_act="silu",
        )
        if name == LLAMA:
            out.update(attention_bias=False, mlp_bias=False)
        if m.sliding_window and name == QWEN2:  # Qwen2 windows the layers from max_window_layers
            out.update(
                use_sliding_window=True, sliding_window=m.sliding_window, max_window_layers=0
            )
        elif name == MISTRAL:
            out.update(sliding_window=m.sliding_window)
        return out

    def hf_tensors(self, cfg: ModelConfig) -> list[HfTensor]:
        """LLaMA / Mistral / Qwen2 state dict (torch Linear [out, in])."""
        m = cfg
        d, n, kh, h, f, v = m.d_model, m.num_heads, m.num_kv_heads, m.head_dim, m.d_ff, m.vocab_size
        g = n // kh
        out = [one("model.embed_tokens.weight", (v, d), None, ("embed", "embedding"))]
        for i in range(m.num_layers):
            p = f"model.layers.{i}."
            for qkv, heads in (("q", n), ("k", kh), ("v", kh)):

                def kernel_views(rank, heads=heads):  # [heads*H, D] -> [D, heads, H] / [D, K, G, H]
                    if rank == 3:
                        return lambda w: w.reshape(kh, g, h, d).transpose(3, 0, 1, 2)
                    return lambda w: w.reshape(heads, h, d).transpose(2, 0, 1)

                def bias_views(rank, heads=heads):
                    shape = (kh, g, h) if rank == 3 else (heads, h)
                    return lambda b: b.reshape(shape)

                name = f"{p}self_attn.{qkv}_proj"
                pieces = attn_pieces(m.fused_qkv, g, qkv, "kernel", kernel_views)
                out.append(HfTensor(f"{name}.weight", (heads * h, d), i, pieces))
                if m.qkv_bias:
                    pieces = attn_pieces(m.fused_qkv, g, qkv, "bias", bias_views)
                    out.append(HfTensor(f"{name}.bias", (heads * h,), i, pieces))
            o_view = lambda w: w.reshape(d, n, h).transpose(1, 2, 0)  # [D, N*H] -> [N, H, D]
            wi = ("mlp", "wi", "kernel")
            out += [
                one(
                    f"{p}self_attn.o_proj.weight",
                    (d, n * h),
                    i,
                    ("attn", "o", "kernel"),
                    (),
                    o_view,
                ),
                one(f"{p}mlp.gate_proj.weight", (f, d), i, wi, (ALL, 0), transpose),
                one(f"{p}mlp.up_proj.weight", (f, d), i, wi, (ALL, 1), transpose),
                one(f"{p}mlp.down_proj.weight", (d, f), i, ("mlp", "wo", "kernel"), (), transpose),
                one(f"{p}input_layernorm.weight", (d,), i, ("attn_norm", "scale")),
                one(f"{p}post_attention_layernorm.weight", (d,), i, ("mlp_norm", "scale")),
            ]
        out.append(one("model.norm.weight", (d,), None, ("final_norm", "scale")))
        if not m.tie_embeddings:
            out.append(one("lm_head.weight", (v, d), None, ("head", "kernel"), (), transpose))
        return out


def _window(hfc: dict[str, Any], name: str, where: str) -> int:
    """The sliding window every layer of a LLaMA, Mistral or Qwen2 config.json applies; 0: none.

    Mistral windows every layer by ``sliding_window`` (null: none). Qwen2 windows only with
    ``use_sliding_window``, and then the layers its ``layer_types`` mark ``sliding_attention``
    (without them: the layers from ``max_window_layers`` on); fp8jax has one window for all.
    """
    if name == LLAMA or (name == QWEN2 and not hfc.get("use_sliding_window")):
        return 0  # LLaMA has none; Qwen2 may record a window it does not use
    window = int(hfc.get("sliding_window") or 0)
    if name == MISTRAL or not window:
        return window
    num_layers = int(require(hfc, "num_hidden_layers", where))
    first = int(hfc.get("max_window_layers", 28))  # transformers' Qwen2 default
    types = hfc.get("layer_types") or [
        "sliding_attention" if i >= first else "full_attention" for i in range(num_layers)
    ]
    windowed = [i for i, t in enumerate(types) if t == "sliding_attention"]
    if windowed and len(windowed) < len(types):
        reject(
            where,
            name,
            f"a sliding window on layers {windowed} of {len(types)} only (fp8jax windows every "
            "layer or none)",
        )
    return window if windowed else 0
