"""The run spec: a config file's fields as frozen, typed, validated dataclasses.

Config files stay ml_collections files (configs/*.py, every field in configs/base.py, which
alone decides the defaults); ``load_config(name)`` reads one. ``parse(config)`` reads each
field once, checks its type and range and the fields against each other, and returns a
``RunSpec``; the library below takes the spec and never a ConfigDict.
``check_environment(run, devices)`` adds what depends on the machine (the mesh against the
devices, GPU-only kernels), ``check_corpus(run)`` the corpus.
Every problem is a one-line ``fp8jax.errors.ConfigError`` naming the field and the fix.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pathlib

import jax.numpy as jnp
import ml_collections

from fp8jax import errors
from fp8jax.data_spec import DataSpec, DpoSpec, parse_data, parse_dpo
from fp8jax.errors import ConfigError, check_bool, check_choice, check_int, check_number
from fp8jax.models import config as model_lib
from fp8jax.models.config import ModelConfig
from fp8jax.ops import formats, kernels, scaling
from fp8jax.optim.levels import MASTER_ROUNDING, STATE_FORMATS, Level, Storage
from fp8jax.parallel import comm as comm_lib

GRAD_ACCUM_DTYPES = ("float32", "")  # '' = the gradients' own dtype

CommSpec = comm_lib.CommConfig  # FP8 gradient communication (``config.comm``)


@dataclasses.dataclass(frozen=True)
class Fp8Spec:
    """``config.fp8`` beyond the matmuls (those are in ``RunSpec.model``): level and state."""

    level: Level
    recipe: scaling.Recipe  # the configured scaling recipe (the model uses it from O1 on)
    m_format: str  # O2+: Adam first moment's storage format
    v_format: str  # O2+: Adam second moment's storage format
    master_format: str  # O2+: matmul masters' storage format
    master_rounding: str  # O2+: 'stochastic' or 'nearest' re-quantization of the masters

    @property
    def storage(self) -> Storage:
        """What the train state stores for the matmul weights at this level."""
        return self.level.storage(self.m_format, self.v_format, self.master_format)


@dataclasses.dataclass(frozen=True)
class OptimSpec:
    """Batch shape, schedule and AdamW (configs/base.py's optimisation section)."""

    batch_size: int  # sequences per optimizer step (global)
    seq_len: int  # tokens per sequence
    grad_accum_steps: int  # micro-batches per step
    grad_accum_dtype: str  # 'float32' or '' (the gradients' own dtype)
    num_train_steps: int  # optimizer steps
    learning_rate: float  # peak
    warmup_steps: int  # linear warm-up steps
    min_lr_ratio: float  # cosine decays to this fraction of the peak
    weight_decay: float  # decoupled, matmul weights only
    b1: float
    b2: float
    eps: float
    grad_clip: float  # global-norm clipping (0 = off)
    update_slice_mib: float  # O2+: f32 MiB per value a stacked leaf's update takes at a time


@dataclasses.dataclass(frozen=True)
class LoopSpec:
    """How often the loop evaluates, logs, checkpoints; when it gives up."""

    eval_every_steps: int
    eval_batches: int
    log_every_steps: int
    fp8_stats_every_steps: int
    checkpoint_every_steps: int  # 0: only at the end
    keep_checkpoints: int
    max_bad_steps: int  # consecutive non-finite steps before the run stops
    sample_tokens: int  # 0 = no sample at the end
    compilation_cache_dir: str  # '' = no persistent compilation cache


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """Axis sizes of the device mesh (-1: all remaining devices)."""

    data: int
    fsdp: int
    tensor: int


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One training run, validated (``parse``)."""

    seed: int
    init_from: str  # checkpoint dir (HF or fp8jax work dir) of the initial weights; '' = random
    model: ModelConfig
    fp8: Fp8Spec
    data: DataSpec
    dpo: DpoSpec
    optim: OptimSpec
    loop: LoopSpec
    mesh: MeshSpec
    comm: CommSpec
    distributed: bool  # call jax.distributed.initialize() first

    def __post_init__(self):
        want = self.fp8.recipe if self.fp8.level.fp8_gemms else None
        if self.model.recipe != want:  # a dataclasses.replace that changed one side only
            raise ValueError(
                f"model.recipe={self.model.recipe} does not match fp8 (level {self.fp8.level}, "
                f"recipe {self.fp8.recipe}): use with_level() to change the level"
            )


def with_level(run: RunSpec, level: Level) -> RunSpec:
    """``run`` at another FP8 level (the model's matmuls follow it)."""
    recipe = run.fp8.recipe if level.fp8_gemms else None
    return dataclasses.replace(
        run,
        fp8=dataclasses.replace(run.fp8, level=level),
        model=dataclasses.replace(run.model, recipe=recipe),
    )


def parse(config) -> RunSpec:
    """The validated ``RunSpec`` of a config (ml_collections.ConfigDict with base.py's fields).

    Raises a one-line ConfigError naming the first bad or inconsistent field and the fix.
    """
    try:
        with errors.reraise_as(ConfigError, ValueError, TypeError):
            fp8, model = _fp8_and_model(config.model, config.fp8)
            optim = _optim(config)
            loop = _loop(config)
            init_from = _init_from(config.init_from)
            if not init_from:  # else the checkpoint's max_len, checked on import
                _check_shapes(model, optim)
            mesh = _mesh(config.mesh)
            check_bool(config.distributed, "distributed")
            return RunSpec(
                seed=_seed(config.seed),
                init_from=init_from,
                model=model,
                fp8=fp8,
                data=(data := parse_data(config.data)),
                dpo=parse_dpo(config.dpo, data, optim.batch_size, optim.grad_accum_steps),
                optim=optim,
                loop=loop,
                mesh=mesh,
                comm=_comm(config.comm, mesh),
                distributed=config.distributed,
            )
    except (KeyError, AttributeError) as e:  # ml_collections: a field the config file lacks
        raise ConfigError(
            f"the config has no field {errors.field_name(e)!r}: add it (configs/base.py lists "
            f"every field with its default)"
        ) from e


def _seed(seed) -> int:
    check_int(seed, "seed", 0, 2**32 - 1)
    return seed


def _init_from(path) -> str:
    if not isinstance(path, str):
        raise ConfigError(f"config.init_from={path!r}: use a checkpoint directory (Hugging Face "
                          f"model or fp8jax work dir) or '' for a random init")  # fmt: skip
    return path


def _fp8_and_model(m, f) -> tuple[Fp8Spec, ModelConfig]:
    check_choice(m.style, model_lib.STYLES, "model.style")
    check_int(m.vocab_size, "model.vocab_size", 1)
    for name in model_lib.MODEL_SIZES:
        check_int(m[name], f"model.{name}", 1)
    check_choice(m.dtype, model_lib.DTYPES, "model.dtype")
    check_choice(m.param_dtype, model_lib.DTYPES, "model.param_dtype")
    for name in model_lib.MODEL_FLAGS:
        check_bool(m[name], f"model.{name}")
    check_choice(m.remat_policy, tuple(model_lib.REMAT_POLICIES), "model.remat_policy")
    check_number(m.norm_eps, "model.norm_eps", "(0, 1)")
    check_number(m.rope_theta, "model.rope_theta", "(1, inf)")
    check_choice(m.attention_impl or "", model_lib.ATTENTION_IMPLS, "model.attention_impl")
    check_int(m.loss_chunk, "model.loss_chunk", 0)
    if m.loss_chunk and m.fp8_lm_head:
        raise ConfigError(
            f"model.loss_chunk={m.loss_chunk} needs model.fp8_lm_head=False (the chunked loss "
            f"runs the LM head in model.dtype): set one of them off"
        )
    check_choice(f.level, tuple(Level.__members__), "fp8.level")
    check_choice(f.recipe, tuple(sorted(scaling.RECIPES)), "fp8.recipe")
    check_int(f.history_len, "fp8.history_len", 1)
    check_int(f.block_size, "fp8.block_size", 16)
    if f.block_size & (f.block_size - 1):
        raise ConfigError(
            f"fp8.block_size={f.block_size} is not a power of two: the block-scaled GEMM tiles "
            f"K by it; use 128 (DeepSeek-V3's) or another power of two >= 16"
        )
    check_choice(f.grad_format, tuple(sorted(formats.FORMATS)), "fp8.grad_format")
    check_choice(f.amax_compute_algo, scaling.AMAX_ALGOS, "fp8.amax_compute_algo")
    # scale = fmax / (amax * 2**margin): negative margins clip on purpose, positive ones leave
    # headroom; past 16 binades either way an E4M3 operand would clip or flush almost entirely.
    check_int(f.margin, "fp8.margin", -16, 16)
    for name in ("power_of_two", "fuse_activation", "fuse_mlp", "fuse_qkv", "fuse_norm"):
        check_bool(f[name], f"fp8.{name}")
    check_choice(f.impl, model_lib.FP8_IMPLS, "fp8.impl")
    check_choice(f.cast_kernel, kernels.IMPLS, "fp8.cast_kernel")
    check_choice(f.master_rounding, MASTER_ROUNDING, "fp8.master_rounding")
    for name in ("m_format", "v_format", "master_format"):
        check_choice(f[name], STATE_FORMATS, f"fp8.{name}")
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
    fp8 = Fp8Spec(
        level=Level.parse(f.level),
        recipe=scaling.make_recipe(
            f.recipe,
            history_len=f.history_len,
            amax_compute_algo=f.amax_compute_algo,
            margin=f.margin,
            power_of_two=f.power_of_two,
            block_size=f.block_size,
            grad_format=f.grad_format,
        ),
        m_format=f.m_format,
        v_format=f.v_format,
        master_format=f.master_format,
        master_rounding=f.master_rounding,
    )
    model = ModelConfig(
        **{name: m[name] for name in ("style", "vocab_size", *model_lib.MODEL_SIZES)},
        dtype=jnp.dtype(m.dtype),
        param_dtype=jnp.dtype(m.param_dtype),
        **{name: m[name] for name in model_lib.MODEL_FLAGS},
        remat_policy=m.remat_policy,
        attention_impl=m.attention_impl or None,  # '' -> JAX picks
        recipe=fp8.recipe if fp8.level.fp8_gemms else None,
        fp8_impl=f.impl,
        cast_kernel=f.cast_kernel,
        fuse_activation=f.fuse_activation,
        fuse_mlp=f.fuse_mlp,
        fuse_qkv=f.fuse_qkv,
        fuse_norm=f.fuse_norm,
        norm_eps=m.norm_eps,
        rope_theta=m.rope_theta,
        rope_scaling=None,  # only an imported checkpoint brings Llama 3's scaling
        loss_chunk=m.loss_chunk,
    )
    return fp8, model


# Integer fields and their least value.
OPTIM_INT_MINIMA = dict(num_train_steps=0, warmup_steps=0, batch_size=1, grad_accum_steps=1)
LOOP_INT_MINIMA = dict(checkpoint_every_steps=0, log_every_steps=1, eval_every_steps=1,
                       eval_batches=1, fp8_stats_every_steps=1, keep_checkpoints=1,
                       max_bad_steps=1, sample_tokens=0)  # fmt: skip
# Real-valued fields and the interval each must lie in (all finite).
OPTIM_RANGES = {
    "learning_rate": "(0, inf)",  # peak; <= 0 would stand still or train uphill
    "min_lr_ratio": "[0, 1]",
    "weight_decay": "[0, inf)",
    "b1": "[0, 1)",
    "b2": "[0, 1)",
    "eps": "(0, inf)",  # 0 turns a zero gradient's update into 0/0
    "grad_clip": "[0, inf)",  # 0 = off
    "update_slice_mib": "[0, inf)",  # 0 = whole leaves
}


def _optim(c) -> OptimSpec:
    for name, low in OPTIM_INT_MINIMA.items():
        check_int(c[name], name, low)
    check_int(c.seq_len, "seq_len", 1)
    for name, interval in OPTIM_RANGES.items():
        check_number(c[name], name, interval)
    if c.grad_accum_dtype not in GRAD_ACCUM_DTYPES:
        raise ConfigError(
            f"config.grad_accum_dtype={c.grad_accum_dtype!r}: use 'float32' or '' (the "
            f"gradients' own dtype)"
        )
    if c.batch_size % c.grad_accum_steps:
        raise ConfigError(
            f"batch_size={c.batch_size} is not divisible by grad_accum_steps="
            f"{c.grad_accum_steps}: change one of them"
        )
    return OptimSpec(**{f.name: c[f.name] for f in dataclasses.fields(OptimSpec)})


def _loop(c) -> LoopSpec:
    for name, low in LOOP_INT_MINIMA.items():
        check_int(c[name], name, low)
    if not isinstance(c.compilation_cache_dir, str):
        raise ConfigError(
            f"config.compilation_cache_dir={c.compilation_cache_dir!r}: use a directory "
            f"path, or '' to compile without JAX's persistent cache"
        )
    return LoopSpec(**{f.name: c[f.name] for f in dataclasses.fields(LoopSpec)})


def _check_shapes(model: ModelConfig, optim: OptimSpec) -> None:
    if optim.seq_len > model.max_len:
        raise ConfigError(
            f"seq_len={optim.seq_len} exceeds model.max_len={model.max_len}: "
            f"raise model.max_len or lower seq_len"
        )


def _mesh(mesh) -> MeshSpec:
    for axis in ("data", "fsdp", "tensor"):
        check_int(mesh[axis], f"mesh.{axis}", 1, also=(-1,))
    return MeshSpec(data=mesh.data, fsdp=mesh.fsdp, tensor=mesh.tensor)


def _comm(raw, mesh: MeshSpec) -> CommSpec:
    """``config.comm`` (CommConfig checks each field's range itself)."""
    fields = {f.name for f in dataclasses.fields(CommSpec)}
    unknown = sorted(set(raw.keys()) - fields)
    if unknown:
        raise ConfigError(f"unknown config.comm fields {unknown}: use some of {sorted(fields)}")
    spec = CommSpec(**{name: raw[name] for name in sorted(fields)})
    if spec.gather == "layer" and mesh.tensor != 1:
        raise ConfigError(
            f"comm.gather='layer' with mesh.tensor={mesh.tensor}: per-layer gathers run the "
            f"replicas one per device, without tensor parallelism; set mesh.tensor=1 or "
            f"comm.gather='upfront'"
        )
    return spec


CONFIG_DIR = pathlib.Path(__file__).resolve().parents[1] / "configs"  # in a source checkout


def load_config(name: str | os.PathLike, arg: str | None = None) -> ml_collections.ConfigDict:
    """``get_config(arg)`` of a config file, given its path or its name under ``configs/``."""
    path = pathlib.Path(name)
    if path.suffix != ".py":
        path = CONFIG_DIR / f"{name}.py"
    if not path.is_file():
        raise FileNotFoundError(f"no config file {path}: pass a path or a name in {CONFIG_DIR}")
    # Loaded by path, as ml_collections' --config flag does (configs/ is not a package).
    module_spec = importlib.util.spec_from_file_location(f"fp8jax_config_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config() if arg is None else module.get_config(arg)
