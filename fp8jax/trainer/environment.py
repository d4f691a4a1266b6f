"""A parsed run checked against the machine (devices, platform) and its files (corpus, vocabulary).

``spec.parse`` checks a config on its own; these check it against where it runs.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from fp8jax import errors
from fp8jax.errors import ConfigError
from fp8jax.models.config import ModelConfig
from fp8jax.parallel import sharding as sharding_lib
from fp8jax.spec import RunSpec
from fp8jax.trainer import corpus, formats

__all__ = [
    "check_compute_dtype",
    "check_corpus",
    "check_environment",
    "check_platform",
]


def check_environment(run: RunSpec, devices=None, *, training: bool = True) -> Mesh:
    """Check ``run`` against the machine; return its mesh (``check_corpus``: the files).

    ``devices`` default to ``jax.devices()``. ``training=False`` (diagnostics.inspect) also
    accepts fp8.impl='flax', which only the step benchmark builds.
    """
    if training and run.model.fp8_impl != "fp8jax":
        raise ConfigError(
            f"fp8.impl={run.model.fp8_impl!r} is for the step benchmark's comparison with "
            f"flax's own FP8 op: train with fp8.impl='fp8jax'"
        )
    with errors.reraise_as(ConfigError, ValueError):
        mesh = sharding_lib.make_mesh(run.mesh, devices)
    check_platform(run.model, mesh)
    if run.fp8.level.sharded_state and mesh.shape["fsdp"] == 1:
        # O3 is O2 with the masters and Adam state sharded over fsdp: with nothing to shard
        # over it would train as O2 under O3's name.
        raise ConfigError(
            f"fp8.level='O3' shards the O2 state over mesh.fsdp, but the mesh has fsdp=1 "
            f"({dict(mesh.shape)}): use fp8.level='O2', or set mesh.fsdp > 1 (and as many devices)"
        )
    o = run.optim
    replicas = sharding_lib.dp_size(mesh) * o.grad_accum_steps
    replicas *= 2 if run.data.pairs else 1  # DPO: whole (chosen, rejected) row pairs
    if o.batch_size % replicas:
        raise ConfigError(
            f"batch_size={o.batch_size} does not split over data x expert x fsdp x grad_accum_steps"
            f"{' x 2 (DPO pairs)' if run.data.pairs else ''} = {replicas}: use a "
            f"multiple of {replicas} or change config.mesh"
        )
    return mesh


def check_corpus(run: RunSpec) -> None:
    """Raise a ConfigError unless the corpus path exists and the vocabulary fits the BPE."""
    path, fix = run.data.path, formats.get(run.data.format).path_fix
    if path and fix and not corpus.names_files(path):
        pattern = corpus.is_pattern(path)
        missing = "is a glob pattern that matches nothing" if pattern else "does not exist"
        raise ConfigError(f"config.data.path={path!r} {missing}: {fix}")
    if run.init_from or run.data.tokenizer:  # the tokenizer brings its vocabulary
        return
    from fp8jax import tokenizer  # its BPE sets the vocabulary's floor

    vocab, low = run.model.vocab_size, tokenizer.MIN_VOCAB_SIZE
    if vocab < low:
        raise ConfigError(
            f"config.model.vocab_size={vocab!r}: the byte-level tokenizer needs at least {low} "
            f"ids (256 bytes + EOS); use model.vocab_size >= {low}"
        )


def check_platform(model: ModelConfig, mesh: Mesh) -> None:
    """Raise a ConfigError if the model asks for a GPU-only kernel or compute dtype that the
    devices lack."""
    platform = mesh.devices.flat[0].platform
    check_compute_dtype(model.dtype, "config.model.dtype", platform)
    if model.attention_impl == "cudnn" and platform != "gpu":
        # jax.nn.dot_product_attention would fail deep inside tracing with "cuDNN is not detected".
        raise ConfigError(
            f"model.attention_impl='cudnn' (cuDNN flash attention) needs an NVIDIA GPU, but JAX "
            f"runs on {platform}: add --config.model.attention_impl=xla to run this config here"
        )


def check_compute_dtype(dtype, name: str, platform: str | None = None) -> None:
    """Raise a ConfigError naming the setting ``name`` if ``dtype`` cannot compute on
    ``platform`` (default: JAX's backend): XLA's CPU backend has no float16 matmuls (it fails
    deep inside the first compile)."""
    platform = platform or jax.default_backend()
    if platform == "cpu" and np.dtype(dtype) == np.float16:
        raise ConfigError(
            f"{name}='float16' has no matmuls on a CPU (XLA's CPU backend lacks float16 dots): "
            "use float32 or bfloat16 here"
        )
