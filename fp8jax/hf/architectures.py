"""Hugging Face ``config.json`` <-> the architecture fields of a ``ModelConfig``.

Only the architecture lives in a checkpoint: the training fields of a ``ModelConfig`` (dtypes,
layer scan, fused QKV, remat, the FP8 recipe ...) come from a base config, as
``dataclasses.replace(base, **architecture_fields)``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from fp8jax.errors import CheckpointError
from fp8jax.models.config import ModelConfig, RopeScaling

LLAMA, MISTRAL, QWEN2, GPT2 = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "GPT2LMHeadModel"
)  # fmt: skip
SUPPORTED = (LLAMA, MISTRAL, QWEN2, GPT2)
MODEL_TYPES = {"llama": LLAMA, "mistral": MISTRAL, "qwen2": QWEN2, "gpt2": GPT2}
# The ModelConfig fields a checkpoint determines.
ARCHITECTURE_FIELDS = (
    "style", "vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "d_ff",
    "max_len", "tie_embeddings", "norm_eps", "rope_theta", "rope_scaling", "qkv_bias",
)  # fmt: skip
CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
DEFAULT_ROPE_THETA = 10_000.0  # transformers' default when a config names none


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; CheckpointError (one line) if it is missing or malformed."""
    try:
        value = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from e
    except ValueError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); restore the file") from e
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} holds a JSON {type(value).__name__}, not an object")
    return value


def architecture_name(hfc: dict[str, Any], where: str = CONFIG) -> str:
    """The supported architecture a config.json describes; CheckpointError naming the others."""
    names = hfc.get("architectures") or [MODEL_TYPES.get(hfc.get("model_type"), "")]
    name = names[0] if isinstance(names, list) and names else str(names)
    if name not in SUPPORTED:
        found = name or f"model_type {hfc.get('model_type')!r}"
        raise CheckpointError(
            f"{where} describes {found}, which fp8jax cannot import: supported architectures "
            f"are {', '.join(SUPPORTED)}"
        )
    return name


def from_hf_config(hfc: dict[str, Any], where: str = CONFIG) -> dict[str, Any]:
    """The ModelConfig architecture fields (ARCHITECTURE_FIELDS) of a HF config.json dict."""
    name = architecture_name(hfc, where)
    return _gpt2(hfc, where) if name == GPT2 else _llama_like(hfc, name, where)


def _require(hfc: dict[str, Any], key: str, where: str):
    if hfc.get(key) is None:
        raise CheckpointError(f"{where} lacks {key!r}; it is not a complete config.json")
    return hfc[key]


def _reject(where: str, name: str, problem: str) -> None:
    raise CheckpointError(f"{where}: {problem}, which fp8jax's {name} import does not support")


def _llama_like(hfc: dict[str, Any], name: str, where: str) -> dict[str, Any]:
    """LLaMA (2/3), Mistral and Qwen2: RMSNorm, RoPE, SwiGLU, grouped-query attention."""
    d_model = int(_require(hfc, "hidden_size", where))
    heads = int(_require(hfc, "num_attention_heads", where))
    head_dim = hfc.get("head_dim") or d_model // heads
    if head_dim * heads != d_model:
        _reject(where, name, f"head_dim {head_dim} x {heads} heads != hidden_size {d_model}")
    if hfc.get("hidden_act", "silu") != "silu":
        _reject(where, name, f"hidden_act {hfc.get('hidden_act')!r} (not 'silu')")
    for key in ("attention_bias", "mlp_bias"):
        if hfc.get(key):
            _reject(where, name, f"{key}=True")
    rope = hfc.get("rope_parameters") or {}
    scaling = hfc.get("rope_scaling") or rope
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind not in ("default", "llama3"):
        _reject(where, name, f"rope type {kind!r} (only 'default' and 'llama3')")
    rope_scaling = None
    if kind == "llama3":
        rope_scaling = RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_len=int(scaling["original_max_position_embeddings"]),
        )
    max_len = int(_require(hfc, "max_position_embeddings", where))
    window = hfc.get("sliding_window")
    if name == QWEN2 and not hfc.get("use_sliding_window"):
        window = None  # Qwen2 records a window it does not use
    if window:
        # Sliding-window attention equals full causal attention on sequences no longer than
        # the window, so the model is exact up to max_len = the window.
        max_len = min(max_len, int(window))
    return dict(
        style="llama",
        vocab_size=int(_require(hfc, "vocab_size", where)),
        d_model=d_model,
        num_layers=int(_require(hfc, "num_hidden_layers", where)),
        num_heads=heads,
        num_kv_heads=int(hfc.get("num_key_value_heads") or heads),
        d_ff=int(_require(hfc, "intermediate_size", where)),
        max_len=max_len,
        tie_embeddings=bool(hfc.get("tie_word_embeddings", False)),
        norm_eps=float(hfc.get("rms_norm_eps", 1e-6)),
        rope_theta=float(hfc.get("rope_theta", rope.get("rope_theta", DEFAULT_ROPE_THETA))),
        rope_scaling=rope_scaling,
        qkv_bias=name == QWEN2,  # Qwen2: biases on q, k and v only
    )


def _gpt2(hfc: dict[str, Any], where: str) -> dict[str, Any]:
    """GPT-2: LayerNorm, learned positions, tanh-GELU MLP, biases everywhere."""
    d_model, heads = int(_require(hfc, "n_embd", where)), int(_require(hfc, "n_head", where))
    if d_model % heads:
        _reject(where, GPT2, f"n_embd {d_model} not divisible by n_head {heads}")
    if hfc.get("activation_function", "gelu_new") != "gelu_new":
        _reject(where, GPT2, f"activation_function {hfc.get('activation_function')!r}")
    for key in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
        if hfc.get(key):
            _reject(where, GPT2, f"{key}=True")
    if hfc.get("scale_attn_weights") is False:
        _reject(where, GPT2, "scale_attn_weights=False")
    return dict(
        style="gpt",
        vocab_size=int(_require(hfc, "vocab_size", where)),
        d_model=d_model,
        num_layers=int(_require(hfc, "n_layer", where)),
        num_heads=heads,
        num_kv_heads=heads,
        d_ff=int(hfc.get("n_inner") or 4 * d_model),
        max_len=int(_require(hfc, "n_positions", where)),
        tie_embeddings=bool(hfc.get("tie_word_embeddings", True)),
        norm_eps=float(hfc.get("layer_norm_epsilon", 1e-5)),
        rope_theta=DEFAULT_ROPE_THETA,  # unused by the GPT style
        rope_scaling=None,
        qkv_bias=False,  # GPT's linears all carry biases (ModelConfig.use_bias)
    )


def export_name(model_cfg: ModelConfig) -> str:
    """The HF architecture an fp8jax model exports as: GPT-2, Qwen2 (q/k/v biases) or LLaMA."""
    if model_cfg.style == "gpt":
        return GPT2
    return QWEN2 if model_cfg.qkv_bias else LLAMA


def hf_config(model_cfg: ModelConfig, eos_id: int | None = None, bos_id: int | None = None):
    """config.json of ``model_cfg`` for export (BF16 weights, transformers' key names)."""
    m, name = model_cfg, export_name(model_cfg)
    common = dict(
        architectures=[name],
        torch_dtype="bfloat16",
        vocab_size=m.vocab_size,
        tie_word_embeddings=m.tie_embeddings,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
    )
    if name == GPT2:
        return dict(
            common,
            model_type="gpt2",
            n_embd=m.d_model,
            n_layer=m.num_layers,
            n_head=m.num_heads,
            n_inner=m.d_ff,
            n_positions=m.max_len,
            layer_norm_epsilon=m.norm_eps,
            activation_function="gelu_new",
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
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
        common,
        model_type="qwen2" if name == QWEN2 else "llama",
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
    return out


def to_json(fields: dict[str, Any]) -> dict[str, Any]:
    """Architecture fields as JSON values (RopeScaling as a dict)."""
    out = dict(fields)
    if out.get("rope_scaling") is not None:
        out["rope_scaling"] = dataclasses.asdict(out["rope_scaling"])
    return out


def from_json(value: dict[str, Any], where: str) -> dict[str, Any]:
    """Architecture fields from :func:`to_json`'s form; CheckpointError if any is missing."""
    missing = [k for k in ARCHITECTURE_FIELDS if k not in value]
    if missing:
        raise CheckpointError(f"{where} lacks the model fields {missing}; it is incomplete")
    out = {k: value[k] for k in ARCHITECTURE_FIELDS}
    if out["rope_scaling"] is not None:
        out["rope_scaling"] = RopeScaling(**out["rope_scaling"])
    if not all(isinstance(out[k], int) for k in ("vocab_size", "d_model", "max_len")):
        raise CheckpointError(f"{where} holds non-integer model sizes")
    if not math.isfinite(float(out["norm_eps"])):
        raise CheckpointError(f"{where} holds a non-finite norm_eps")
    return out


def fields_of(model_cfg: ModelConfig) -> dict[str, Any]:
    """The architecture fields of ``model_cfg``."""
    return {k: getattr(model_cfg, k) for k in ARCHITECTURE_FIELDS}
