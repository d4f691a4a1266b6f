"""Hugging Face checkpoints in and out, BF16 safetensors: LLaMA (2/3), Mistral, Qwen2, Qwen3,
GPT-2 and the MoE architectures Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE.

``load(path)`` reads a HF model dir or an fp8jax work dir into ``Loaded(model_cfg, params,
tokenizer)``; ``export(src, out_dir)`` writes either as a HF dir; ``architecture(path)`` gives
the ``ModelConfig`` architecture fields; ``hf_config(model_cfg)`` the config.json of an export.
Command line: ``python -m fp8jax.hf.export_cli SRC OUT``.
"""

from fp8jax.hf.architectures import ARCHITECTURE_FIELDS, SUPPORTED, hf_config
from fp8jax.hf.io import (
    Loaded,
    architecture,
    default_model_cfg,
    export,
    load,
    load_params,
    model_config,
    save_hf,
    tokenizer,
)

__all__ = [
    "ARCHITECTURE_FIELDS",
    "SUPPORTED",
    "Loaded",
    "architecture",
    "default_model_cfg",
    "export",
    "hf_config",
    "load",
    "load_params",
    "model_config",
    "save_hf",
    "tokenizer",
]
