"""Settings from a config: every field's validation, the FP8 recipe, size/FLOP accounting."""

from __future__ import annotations

import dataclasses
import math
import numbers
import pathlib
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn

from fp8jax.errors import ConfigError
from fp8jax.ops import kernels, scaling

STYLES = ("gpt", "llama")
LEVELS = ("O0", "O1", "O2", "O3")
# Storage formats the O2+ optimizer may use for Adam moments and master weights.
STATE_FORMATS = ("e4m3", "e5m2", "float16", "bfloat16", "float32")
MASTER_ROUNDING = ("stochastic", "nearest")  # how O2+ masters are re-quantized
ATTENTION_IMPLS = ("", "xla", "cudnn")
# 'flax': flax's own nn.Fp8DirectDotGeneralOp in the same model, for benchmarks/step.py.
FP8_IMPLS = ("fp8jax", "flax")
DTYPES = ("float32", "bfloat16", "float16")
# Remat policy name -> jax.checkpoint policy ('full' = save nothing: recompute the whole block).
REMAT_POLICIES = {
    "none": None,
    "full": None,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _check_choice(value, choices, field: str) -> None:
    if value not in choices:
        raise ConfigError(f"unknown {field} {value!r}: use one of {list(choices)}")


def check_int(value, field: str, low: int, high: int | None = None, also=()) -> None:
    """Raise a one-line ConfigError unless ``value`` is an int in [low, high] or in ``also``."""
    is_int = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if is_int and (value in also or (value >= low and (high is None or value <= high))):
        return
    span = f">= {low}" if high is None else f"in [{low}, {high}]"
    extra = "".join(f" (or {a})" for a in also)
    raise ConfigError(f"config.{field}={value!r}: use an integer {span}{extra}")


def check_number(value, field: str, interval: str) -> None:
    """Raise a one-line ConfigError unless ``value`` is a finite number in ``interval``.

    ``interval`` reads as in mathematics: '(0, inf)', '[0, 1)', '[1, inf)' ...
    """
    lo, hi = (float(x) for x in interval[1:-1].split(","))
    is_real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if is_real and math.isfinite(value):
        above = value > lo if interval[0] == "(" else value >= lo
        below = value < hi if interval[-1] == ")" else value <= hi
        if above and below:
            return
    op = ">" if interval[0] == "(" else ">="
    span = f"{op} {interval[1:-1].split(',')[0]}" if math.isinf(hi) else f"in {interval}"
    raise ConfigError(f"config.{field}={value!r}: use a finite number {span}")


def check_bool(value, field: str) -> None:
    """Raise a one-line ConfigError unless ``value`` is True or False."""
    if not isinstance(value, bool):
        raise ConfigError(f"config.{field}={value!r}: use True or False")


# Positive sizes of config.model (the fields a model needs at least one of).
MODEL_SIZES = ("d_model", "num_layers", "num_heads", "num_kv_heads", "d_ff", "max_len")
MODEL_FLAGS = ("scan_layers", "fused_qkv", "tie_block_grads", "fp8_lm_head", "tie_embeddings")
FP8_FLAGS = ("power_of_two", "fuse_activation", "fuse_mlp")


def check_config(config) -> None:
    """Raise a one-line ConfigError naming the first bad or inconsistent field and the fix."""
    m, f = config.model, config.fp8
    _check_choice(m.style, STYLES, "model.style")
    check_int(m.vocab_size, "model.vocab_size", 1)
    for name in MODEL_SIZES:
        check_int(m[name], f"model.{name}", 1)
    _check_choice(m.dtype, DTYPES, "model.dtype")
    _check_choice(m.param_dtype, DTYPES, "model.param_dtype")
    for name in MODEL_FLAGS:
        check_bool(m[name], f"model.{name}")
    _check_choice(m.remat_policy, tuple(REMAT_POLICIES), "model.remat_policy")
    _check_choice(m.attention_impl or "", ATTENTION_IMPLS, "model.attention_impl")
    _check_choice(f.level, LEVELS, "fp8.level")
    _check_choice(f.recipe, tuple(sorted(scaling.RECIPES)), "fp8.recipe")
    check_int(f.history_len, "fp8.history_len", 1)
    _check_choice(f.amax_compute_algo, scaling.AMAX_ALGOS, "fp8.amax_compute_algo")
    # scale = fmax / (amax * 2**margin): negative margins clip on purpose, positive ones leave
    # headroom; past 16 binades either way an E4M3 operand would clip or flush almost entirely.
    check_int(f.margin, "fp8.margin", -16, 16)
    for name in FP8_FLAGS:
        check_bool(f.get(name, True), f"fp8.{name}")
    _check_choice(f.impl, FP8_IMPLS, "fp8.impl")
    _check_choice(f.cast_kernel, kernels.IMPLS, "fp8.cast_kernel")
    _check_choice(f.get("master_rounding", "nearest"), MASTER_ROUNDING, "fp8.master_rounding")
    for name in ("m_format", "v_format", "master_format"):
        _check_choice(f[name], STATE_FORMATS, f"fp8.{name}")
    check_int(config.seq_len, "seq_len", 1)
    if m.d_model % m.num_heads:
        raise ConfigError(
            f"model.num_heads={m.num_heads} does not divide model.d_model={m.d_model}: "
            f"pick num_heads so that d_model % num_heads == 0"
        )
    if m.num_heads % m.num_kv_heads:
        raise ConfigError(
            f"model.num_heads={m.num_heads} is not divisible by model.num_kv_heads="
            f"{m.num_kv_heads}: use a divisor of num_heads (num_heads itself for plain MHA)"
        )
    if m.style == "llama" and (m.d_model // m.num_heads) % 2:
        raise ConfigError(
            f"RoPE needs an even head dim, got d_model/num_heads={m.d_model // m.num_heads}: "
            f"change model.d_model or model.num_heads"
        )
    if config.seq_len > m.max_len:
        raise ConfigError(
            f"seq_len={config.seq_len} exceeds model.max_len={m.max_len}: "
            f"raise model.max_len or lower seq_len"
        )


# Real-valued training fields and the interval each must lie in (all finite).
NUMBER_RANGES = {
    "learning_rate": "(0, inf)",  # peak; <= 0 would stand still or train uphill
    "min_lr_ratio": "[0, 1]",
    "weight_decay": "[0, inf)",
    "b1": "[0, 1)",
    "b2": "[0, 1)",
    "eps": "(0, inf)",  # 0 turns a zero gradient's update into 0/0
    "grad_clip": "[0, inf)",  # 0 = off
    "data.val_fraction": "(0, 1)",  # evaluation needs held-out tokens, training the rest
}
# Integer training fields and their least value.
INT_MINIMA = dict(seed=0, num_train_steps=0, warmup_steps=0, checkpoint_every_steps=0,
                  batch_size=1, grad_accum_steps=1, log_every_steps=1,
                  eval_every_steps=1, eval_batches=1, fp8_stats_every_steps=1,
                  keep_checkpoints=1, max_bad_steps=1, sample_tokens=0)  # fmt: skip


def check_training_fields(config) -> None:
    """Raise a one-line ConfigError for a bad optimizer, loop or mesh field (the trainer's)."""
    for name, low in INT_MINIMA.items():
        check_int(config[name], name, low, 2**32 - 1 if name == "seed" else None)
    for name, interval in NUMBER_RANGES.items():
        section, _, key = name.rpartition(".")
        check_number((config[section] if section else config)[key], name, interval)
    for axis in ("data", "fsdp", "tensor"):
        check_int(config.mesh[axis], f"mesh.{axis}", 1, also=(-1,))
    check_bool(config.get("distributed", False), "distributed")
    if not isinstance(config.compilation_cache_dir, str):
        raise ConfigError(
            f"config.compilation_cache_dir={config.compilation_cache_dir!r}: use a directory "
            f"path, or '' to compile without JAX's persistent cache"
        )


def check_data_config(config, corpus: bool = False) -> None:
    """Raise a one-line ConfigError for a bad ``config.data`` field.

    ``corpus=True`` also checks what building the corpus needs: the path exists and the
    vocabulary holds the byte-level BPE's bytes and EOS.
    """
    d = config.data
    fix = "set config.data.path to a text file, a folder of .txt files or a .jsonl file"
    if not isinstance(d.path, str):
        raise ConfigError(f"config.data.path={d.path!r}: {fix} ('' = the shipped corpus)")
    check_int(d.tokenizer_min_frequency, "data.tokenizer_min_frequency", 0)
    check_bool(d.allow_corpus_change, "data.allow_corpus_change")
    if not corpus:
        return
    if d.path and not pathlib.Path(d.path).expanduser().exists():
        raise ConfigError(
            f"config.data.path={d.path!r} does not exist: {fix} ('' = the shipped corpus)"
        )
    from fp8jax.trainer import tokenizer  # its BPE sets the vocabulary's floor

    if config.model.vocab_size < tokenizer.MIN_VOCAB_SIZE:
        low = tokenizer.MIN_VOCAB_SIZE
        raise ConfigError(
            f"config.model.vocab_size={config.model.vocab_size!r}: the byte-level tokenizer "
            f"needs at least {low} ids (256 bytes + EOS); use model.vocab_size >= {low}"
        )


def recipe_from_config(fp8_cfg) -> scaling.Recipe:
    """The scaling recipe named by ``config.fp8`` (whatever the level; O0 just doesn't use it)."""
    return scaling.make_recipe(
        fp8_cfg.recipe,
        history_len=fp8_cfg.history_len,
        amax_compute_algo=fp8_cfg.amax_compute_algo,
        margin=fp8_cfg.margin,
        power_of_two=fp8_cfg.power_of_two,
    )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hashable copy of ``config.model`` plus the FP8 recipe (None: O0, no FP8 matmuls)."""

    style: str
    vocab_size: int
    d_model: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    d_ff: int
    max_len: int
    dtype: Any
    param_dtype: Any
    scan_layers: bool
    fused_qkv: bool
    remat_policy: str
    tie_block_grads: bool
    fp8_lm_head: bool
    tie_embeddings: bool
    attention_impl: str | None
    recipe: scaling.Recipe | None
    fp8_impl: str = "fp8jax"
    cast_kernel: str = "pallas"
    fuse_activation: bool = True
    fuse_mlp: bool = True

    @classmethod
    def from_config(cls, config) -> ModelConfig:
        """Validate ``config`` and take the fields the model needs."""
        check_config(config)
        fp8_fields = {"recipe", "fp8_impl", "cast_kernel", "fuse_activation", "fuse_mlp"}
        fields = {f.name for f in dataclasses.fields(cls)} - fp8_fields
        kw = {k: config.model[k] for k in fields}
        kw["dtype"], kw["param_dtype"] = jnp.dtype(kw["dtype"]), jnp.dtype(kw["param_dtype"])
        kw["attention_impl"] = kw["attention_impl"] or None  # '' -> JAX picks
        use_fp8 = config.fp8.level != "O0"
        recipe = recipe_from_config(config.fp8) if use_fp8 else None
        return cls(
            **kw,
            recipe=recipe,
            fp8_impl=config.fp8.impl,
            cast_kernel=config.fp8.cast_kernel,
            fuse_activation=bool(config.fp8.get("fuse_activation", True)),
            fuse_mlp=bool(config.fp8.get("fuse_mlp", True)),
        )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def use_bias(self) -> bool:
        return self.style == "gpt"  # GPT-2 linears carry biases, LLaMA's don't


def count_params(params) -> int:
    """Number of parameters in a params tree (arrays, shape structs or partitioned boxes)."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nn.unbox(params)))


def matmul_params(model_cfg) -> int:
    """Weights that take part in matmuls: block linears and the LM head (not embedding lookups)."""
    m = model_cfg
    h = m.d_model // m.num_heads
    attn = m.d_model * h * (2 * m.num_heads + 2 * m.num_kv_heads)  # q, k, v, out
    mlp = (2 if m.style == "gpt" else 3) * m.d_model * m.d_ff  # GELU: in/out; SwiGLU: gate/up/out
    return m.num_layers * (attn + mlp) + m.d_model * m.vocab_size


def flops_per_token(config) -> float:
    """Training FLOPs per token: 6N (N = matmul params) + attention, PaLM convention.

    Attention counts QK^T and AV over the full sequence (12 * layers * d_model * seq_len for
    forward + backward), not halved for the causal mask, so MFU stays comparable with PaLM,
    MaxText and torchtitan numbers.
    """
    m = config.model
    attn = 12 * m.num_layers * m.d_model * config.seq_len
    return 6.0 * matmul_params(m) + attn
