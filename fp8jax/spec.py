"""The run spec: a config file's fields as frozen, typed, validated dataclasses.

Config files stay ml_collections files (configs/*.py); configs/base.py declares every field
once, with its default and valid values (``fp8jax.configs.fields``). ``parse(config)`` checks
each field against that declaration, the recipes' fields with the recipes' own validation and
the fields against each other, and returns a ``RunSpec``; the library below takes the spec and
never a ConfigDict. ``check_environment(run, devices)`` adds what depends on the machine (the
mesh against the devices, GPU-only kernels), ``check_corpus(run)`` the corpus.
Every problem is a one-line ``fp8jax.errors.ConfigError`` naming the field and the fix.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from fp8jax import errors
from fp8jax.configs import base, fields
from fp8jax.data_spec import DataSpec, DpoSpec, parse_data, parse_dpo
from fp8jax.errors import ConfigError
from fp8jax.models import config as model_lib
from fp8jax.models.config import ModelConfig
from fp8jax.ops import scaling
from fp8jax.optim.levels import Level, Storage
from fp8jax.parallel import comm as comm_lib

__all__ = [
    "CommSpec",
    "DataSpec",
    "Fp8Spec",
    "Level",
    "LoopSpec",
    "MeshSpec",
    "OptimSpec",
    "RunSpec",
    "parse",
    "with_level",
]

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
    expert: int  # expert-parallel shards (MoE: the routed experts split, tokens by all-to-all)


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
            fields.validate(config, base.declarations())  # each field's type and range
            fp8, model = _fp8_and_model(config.model, config.fp8)
            optim = _optim(config)
            _check_float16_adam(fp8, model, optim)
            if not config.init_from:  # else the checkpoint's max_len, checked on import
                _check_shapes(model, optim)
            mesh = MeshSpec(**{f.name: config.mesh[f.name] for f in dataclasses.fields(MeshSpec)})
            _check_experts(model, mesh)
            return RunSpec(
                seed=config.seed,
                init_from=config.init_from,
                model=model,
                fp8=fp8,
                data=(data := parse_data(config.data)),
                dpo=parse_dpo(config.dpo, data, optim.batch_size, optim.grad_accum_steps),
                optim=optim,
                loop=LoopSpec(**{f.name: config[f.name] for f in dataclasses.fields(LoopSpec)}),
                mesh=mesh,
                comm=_comm(config.comm, mesh),
                distributed=config.distributed,
            )
    except (KeyError, AttributeError) as e:  # ml_collections: a field the config file lacks
        raise ConfigError(
            f"the config has no field {errors.field_name(e)!r}: add it (fp8jax/configs/base.py "
            f"lists every field with its default)"
        ) from e


def _fp8_and_model(m, f) -> tuple[Fp8Spec, ModelConfig]:
    if m.loss_chunk and m.fp8_lm_head:
        raise ConfigError(
            f"model.loss_chunk={m.loss_chunk} needs model.fp8_lm_head=False (the chunked loss "
            f"runs the LM head in model.dtype): set one of them off"
        )
    if not m.head_width and m.d_model % m.num_heads:
        raise ConfigError(
            f"model.num_heads={m.num_heads} does not divide model.d_model={m.d_model}: "
            f"pick num_heads so that d_model % num_heads == 0, or set model.head_width"
        )
    if m.num_heads % m.num_kv_heads:
        raise ConfigError(
            f"model.num_heads={m.num_heads} is not divisible by model.num_kv_heads="
            f"{m.num_kv_heads}: use a divisor of num_heads (num_heads itself for plain MHA)"
        )
    model_lib.get_family(m.style).check(m)  # e.g. RoPE's even head dim
    fp8 = Fp8Spec(
        level=Level.parse(f.level),
        recipe=scaling.make_recipe(f.recipe, **_recipe_fields(f)),
        m_format=f.m_format,
        v_format=f.v_format,
        master_format=f.master_format,
        master_rounding=f.master_rounding,
    )
    model = ModelConfig(
        **{name: m[name] for name in ("style", "vocab_size", *model_lib.MODEL_SIZES)},
        head_width=m.head_width,
        dtype=jnp.dtype(m.dtype),
        param_dtype=jnp.dtype(m.param_dtype),
        **{name: m[name] for name in model_lib.MODEL_FLAGS},
        remat_policy=m.remat_policy,
        attention_impl=m.attention_impl or None,  # '' -> JAX picks
        decode_attention=m.decode_attention,
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
        qk_norm=m.qk_norm,
        sliding_window=m.sliding_window,
        moe=_moe(m.moe),
    )
    return fp8, model


def _moe(e) -> model_lib.MoeSpec | None:
    """``config.model.moe`` as a ``MoeSpec``, or None for a dense MLP (num_experts 0)."""
    if not e.num_experts:
        return None
    if e.top_k > e.num_experts:
        raise ConfigError(
            f"model.moe.top_k={e.top_k} exceeds model.moe.num_experts={e.num_experts}: "
            f"route each token to at most num_experts experts"
        )
    # Options that would change nothing are refused rather than silently ignored.
    if e.shared_gate and not e.shared_d_ff:
        raise ConfigError(
            "model.moe.shared_gate=True gates the shared expert, which model.moe.shared_d_ff=0 "
            "leaves out: set model.moe.shared_d_ff > 0 or shared_gate=False"
        )
    if e.bias_update_rate and e.router != "sigmoid":
        raise ConfigError(
            f"model.moe.bias_update_rate={e.bias_update_rate} balances a sigmoid router's "
            f"selection, but model.moe.router={e.router!r}: set model.moe.router='sigmoid' or "
            f"bias_update_rate=0"
        )
    return model_lib.MoeSpec(**{f.name: e[f.name] for f in dataclasses.fields(model_lib.MoeSpec)})


def _check_experts(model: ModelConfig, mesh: MeshSpec) -> None:
    """The routed experts split evenly over the mesh's 'expert' axis."""
    if model.moe is not None and model.moe.num_experts % mesh.expert:
        raise ConfigError(
            f"mesh.expert={mesh.expert} does not divide model.moe.num_experts="
            f"{model.moe.num_experts}: use an expert axis size that divides the expert count"
        )


def _recipe_fields(f) -> dict:
    """The recipes' fields of ``config.fp8``, each checked by every recipe that has it.

    A value is valid if each recipe taking that field accepts it (its own validation), so a
    config refuses, say, a block size the block recipe would refuse under any recipe.
    """
    values = {}
    for cls in scaling.RECIPES.values():
        for field in dataclasses.fields(cls):
            value = values[field.name] = f[field.name]
            try:
                cls(**{field.name: value})
            except (ValueError, TypeError) as e:
                raise ConfigError(f"config.fp8.{field.name}={value!r}: {e}") from e
    return values


def _optim(c) -> OptimSpec:
    if c.batch_size % c.grad_accum_steps:
        raise ConfigError(
            f"batch_size={c.batch_size} is not divisible by grad_accum_steps="
            f"{c.grad_accum_steps}: change one of them"
        )
    return OptimSpec(**{f.name: c[f.name] for f in dataclasses.fields(OptimSpec)})


def _check_float16_adam(fp8: Fp8Spec, model: ModelConfig, optim: OptimSpec) -> None:
    """Below O2 Adam's moments are in the weights' dtype: in float16 an eps that rounds to 0
    divides by 0 wherever a squared gradient underflows, and the weights turn Inf in steps."""
    if fp8.storage.fp8_adam or jnp.dtype(model.param_dtype) != jnp.float16:
        return
    if jnp.float16(optim.eps) == 0:
        raise ConfigError(
            f"model.param_dtype='float16' at fp8.level {fp8.level} keeps Adam's moments in "
            f"float16, where eps={optim.eps} rounds to 0: the update divides by 0 wherever a "
            "squared gradient underflows and the weights turn Inf within a few steps; use "
            "param_dtype 'float32' or 'bfloat16', fp8.level O2, or raise eps (e.g. 1e-4)"
        )


def _check_shapes(model: ModelConfig, optim: OptimSpec) -> None:
    if optim.seq_len > model.max_len:
        raise ConfigError(
            f"seq_len={optim.seq_len} exceeds model.max_len={model.max_len}: "
            f"raise model.max_len or lower seq_len"
        )


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
