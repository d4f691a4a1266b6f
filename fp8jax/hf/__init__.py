"""Hugging Face checkpoints in and out: LLaMA (2/3), Mistral, Qwen2 and GPT-2, BF16 safetensors.

``load(path)`` reads a HF model dir or an fp8jax work dir into ``Loaded(model_cfg, params,
tokenizer)``; ``export(src, out_dir)`` writes either as a HF dir; ``architecture(path)`` gives
the ``ModelConfig`` architecture fields; ``hf_config(model_cfg)`` the config.json of an export.
Command line: ``python -m fp8jax.hf.export SRC OUT``.
"""

from fp8jax.hf.architectures import ARCHITECTURE_FIELDS, SUPPORTED, hf_config
from fp8jax.hf.io import Loaded, architecture, default_model_cfg, export, load, save_hf

__all__ = [
    "ARCHITECTURE_FIELDS",
    "SUPPORTED",
    "Loaded",
    "architecture",
    "default_model_cfg",
    "export",
    "hf_config",
    "load",
    "save_hf",
]
