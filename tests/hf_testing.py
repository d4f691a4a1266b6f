"""Tiny random Hugging Face checkpoints built with transformers itself, for tests/test_hf.py."""

import dataclasses
import json
import pathlib

import numpy as np

VOCAB, MAX_POS = 300, 64

# name -> (transformers config class, its kwargs). Each family's switches are exercised:
# GQA, Llama 3 rope scaling, tied and untied heads, Mistral's window, Qwen2's q/k/v biases,
# Qwen3's q/k norms per head.
FAMILIES = {
    "llama3": (
        "LlamaConfig",
        dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=MAX_POS,
            rope_theta=5e5,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
    ),
    "llama": (
        "LlamaConfig",
        dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=MAX_POS,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
    ),
    "mistral": (
        "MistralConfig",
        dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            max_position_embeddings=128,
            sliding_window=MAX_POS,
            head_dim=16,
            tie_word_embeddings=False,
        ),
    ),
    "qwen2": (
        "Qwen2Config",
        dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=MAX_POS,
            rope_theta=1e6,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3": (
        "Qwen3Config",
        dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,  # wider than hidden_size / heads, as Qwen3-30B-A3B's
            max_position_embeddings=MAX_POS,
            rope_theta=1e6,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        ),
    ),
    # MoE: 4 experts, 2 per token; Qwen2-MoE's shared expert, each router's top-k weighting
    "mixtral": (
        "MixtralConfig",
        dict(
            hidden_size=64,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=MAX_POS,
            sliding_window=None,
            tie_word_embeddings=False,
        ),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            hidden_size=64,
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            max_position_embeddings=MAX_POS,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            hidden_size=64,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,  # wider than hidden_size / heads, as Qwen3-30B-A3B's
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            max_position_embeddings=MAX_POS,
            tie_word_embeddings=False,
        ),
    ),
    "olmoe": (
        "OlmoeConfig",
        dict(
            hidden_size=64,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            max_position_embeddings=MAX_POS,
            eos_token_id=1,
            tie_word_embeddings=False,
        ),
    ),
    "gpt2": (
        "GPT2Config",
        dict(
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=MAX_POS,
            n_inner=96,
            layer_norm_epsilon=1e-5,
            bos_token_id=0,
            eos_token_id=0,
        ),
    ),
}


def random_init(model, seed: int = 0) -> None:
    """Random weights whose every part matters: norm scales 1 +- 0.3, biases +- 0.3."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.ndim == 1:
                p.copy_(noise * 0.3 + (0.0 if name.endswith("bias") else 1.0))
            else:
                p.copy_(noise * 0.08)


def build(family: str, directory: pathlib.Path, dtype: str = "float32", **save_kwargs):
    """A random ``family`` model saved in ``directory``; returns the torch model (eval)."""
    import torch
    import transformers

    cls_name, kwargs = FAMILIES[family]
    config = getattr(transformers, cls_name)(vocab_size=VOCAB, **kwargs)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    random_init(model)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(directory, **save_kwargs)
    return model


def torch_logits(model, tokens_BxL: np.ndarray) -> np.ndarray:
    """transformers' logits of ``tokens`` in f32."""
    import torch

    with torch.no_grad():
        return model(torch.tensor(np.asarray(tokens_BxL))).logits.float().numpy()


def rel_max(a, b) -> float:
    """max |a - b| relative to max |b| (f64)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def byte_bpe(texts, bos: bool):
    """A byte-level BPE ``tokenizers`` tokenizer trained on ``texts`` (BOS prepended if ``bos``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)]
        )
    return tok


def save_hf_tokenizer(tok, directory: pathlib.Path, chat_template=None):
    """``tok`` wrapped in transformers' PreTrainedTokenizerFast and saved in ``directory``."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    if chat_template:
        fast.chat_template = chat_template
    fast.save_pretrained(directory)
    return fast


def edit_json(path: pathlib.Path, **changes) -> None:
    """Set keys of the JSON object in ``path``."""
    value = json.loads(path.read_text())
    value.update(changes)
    path.write_text(json.dumps(value))


def replace_cfg(model_cfg, **changes):
    """``dataclasses.replace`` for ModelConfig."""
    return dataclasses.replace(model_cfg, **changes)
