"""Config validation: every field of configs/base.py is type- and range-checked up front.

``train_and_evaluate`` must refuse each bad value in ``spec.parse`` or
``environment.check_environment``, before the work dir exists and before any data, tokenizer or
compile work, with a one-line ``ConfigError`` naming the field, the value and the fix; ``python
train.py`` turns it into one stderr line and exit 2.
"""

import functools
import math
import os
import pathlib
import subprocess
import sys

import pytest

from fp8jax import errors, spec
from fp8jax.parallel import comm
from fp8jax.trainer import environment
from fp8jax.trainer import loop as train_lib

from fp8_testing import base_config, flat_fields, set_field

ROOT = pathlib.Path(__file__).resolve().parents[1]
NAN, INF = math.nan, math.inf
OPT_FLAG = "jax_disable_most_optimizations"

# Field -> values validation must refuse. Every field of configs/base.py needs an entry
# (test_every_field_has_bad_values), so a new field cannot be added unchecked.
BAD = {
    "seed": [-1, 2**32, 1.5],
    "model.style": ["bert"],
    "model.vocab_size": [0, 256],  # 256: below the byte-level BPE's 257 (bytes + EOS)
    "model.d_model": [0, -128],
    "model.num_layers": [0],
    "model.num_heads": [0],
    "model.num_kv_heads": [0],
    "model.head_width": [-1, 2.5],
    "model.d_ff": [0],
    "model.max_len": [0],
    "model.dtype": ["int8"],
    "model.param_dtype": ["float64"],
    "model.scan_layers": ["yes", 1],
    "model.fused_qkv": ["yes"],
    "model.remat_policy": ["some"],
    "model.tie_block_grads": [1],
    "model.fp8_lm_head": ["no"],
    "model.tie_embeddings": [None],
    "model.qkv_bias": [1],
    "model.recompute_elementwise": ["yes"],
    "model.moe.num_experts": [-1, 2.0],
    "model.moe.top_k": [0],
    "model.moe.d_ff": [0],
    "model.moe.shared_d_ff": [-1],
    "model.moe.shared_gate": ["yes"],
    "model.moe.router": ["topk"],
    "model.moe.normalize_top_k": [1],
    "model.moe.dispatch": ["drop"],
    "model.moe.capacity_factor": [0.0, -1.0, NAN],
    "model.moe.aux_loss_coef": [-0.01, INF],
    "model.moe.z_loss_coef": [-1e-3],
    "model.moe.bias_update_rate": [-1e-3],
    "model.moe.fp8_dispatch": ["yes"],
    "model.qk_norm": ["both"],
    "model.sliding_window": [-1, 1.5],
    "init_from": [None, 3],
    "data.format": ["csv", ""],
    "data.packing": ["yes"],
    "data.overlong": ["cut"],
    "model.norm_eps": [0.0, -1e-5, float("nan"), "1e-5"],
    "model.rope_theta": [0.5, float("inf")],
    "model.attention_impl": ["flash"],
    "model.decode_attention": ["triton"],
    "model.loss_chunk": [-1, 1.5, True],
    "fp8.level": ["O4"],
    "fp8.recipe": ["mxfp8"],
    "fp8.history_len": [0, 2.0],
    "fp8.amax_compute_algo": ["mean"],
    "fp8.margin": [NAN, 0.5, 17, -17],
    "fp8.power_of_two": ["yes"],
    "fp8.block_size": [NAN, 0, 8, 96, 64.0],
    "fp8.grad_format": ["e3m4", "float16"],
    "fp8.impl": ["triton", "flax"],  # 'flax' is for benchmarks/step.py only
    "fp8.cast_kernel": ["cuda"],
    "fp8.fuse_activation": [0],
    "fp8.fuse_mlp": ["yes"],
    "fp8.fuse_qkv": ["yes"],
    "fp8.fuse_norm": ["yes"],
    "fp8.m_format": ["int8"],
    "fp8.v_format": ["e3m4"],
    "fp8.master_format": ["fp16"],
    "fp8.master_rounding": ["up"],
    "data.path": [3, "/nonexistent/corpus.txt"],
    "data.val_fraction": [0.0, 1.0, NAN],
    "data.tokenizer": [3],
    "data.tokenizer_min_frequency": [-1, 1.5],
    "data.encode_workers": [-1, 1.5],
    "data.cache_dir": [None],
    "data.allow_corpus_change": ["yes", 1],
    "data.verify_corpus": ["yes", 1],
    "data.sources": [3, "csv:books/"],  # "csv:": no such source format (and no 'mix' format)
    "data.weights": [3, "1,2"],  # "1,2": two weights for no source
    "dpo.beta": [0.0, -1.0, INF, "0.1"],
    "dpo.label_smoothing": [-0.1, 0.5, NAN],
    "batch_size": [0],
    "seq_len": [0, 65],  # 65: longer than model.max_len
    "grad_accum_steps": [0, 3],  # 3: does not divide batch_size
    "grad_accum_dtype": ["bfloat16"],
    "num_train_steps": [-1],
    "learning_rate": [NAN, INF, 0.0, -3e-3, "3e-3"],
    "warmup_steps": [-1, 1.5],
    "min_lr_ratio": [-0.1, 1.5, NAN],
    "weight_decay": [-0.1, NAN, INF],
    "b1": [1.0, -0.1, NAN],
    "b2": [1.0, 1.5],
    "eps": [0.0, -1e-8, INF],
    "grad_clip": [-1.0, NAN, INF],
    "update_slice_mib": [-1.0, NAN, INF],
    "eval_every_steps": [0],
    "eval_batches": [0],
    "log_every_steps": [0],
    "fp8_stats_every_steps": [0],
    "checkpoint_every_steps": [-1],
    "keep_checkpoints": [0],
    "max_bad_steps": [0],
    "sample_tokens": [-1, True],
    "compilation_cache_dir": [3, None],
    "mesh.data": [0, -2],
    "mesh.fsdp": [0, 1.5],
    "mesh.tensor": [0, "1"],
    "mesh.expert": [0, -1],
    "distributed": ["yes", 1],
    "comm.enabled": ["yes"],
    "comm.grad_format": ["float16"],
    "comm.wire": ["tcp"],
    "comm.min_fp8_size": [-1, 4096.0],
    "comm.mu_init": [0.0, NAN, -1.0],
    "comm.mu_growth": [0.5, INF],
    "comm.saturation_limit": [-1e-5, 1.5, NAN],
    "comm.bucket_by_layer": [1],
    "comm.gather": ["zero3", True],
}
CASES = [(field, value) for field, values in BAD.items() for value in values]

# Edge values inside each range: validation must accept them (it is not just refusing all).
EDGES = {
    "seed": 2**32 - 1,
    "num_train_steps": 0,
    "warmup_steps": 0,
    "checkpoint_every_steps": 0,
    "sample_tokens": 0,
    "min_lr_ratio": 1.0,
    "weight_decay": 0.0,
    "b1": 0.0,
    "b2": 0.0,
    "grad_clip": 0.0,
    "fp8.history_len": 1,
    "fp8.margin": -4,
    "data.val_fraction": 0.5,
    "data.tokenizer_min_frequency": 0,
    "dpo.label_smoothing": 0.0,
    "model.vocab_size": 257,
    "model.attention_impl": "",
    "model.loss_chunk": 1,
    "mesh.data": 1,
    "comm.min_fp8_size": 0,
    "comm.mu_growth": 1.0,
    "comm.saturation_limit": 0.0,
    "compilation_cache_dir": "",
}


def tiny():
    """configs/tiny.py as train.py loads it."""
    return train_lib.load_config(str(ROOT / "configs" / "tiny.py"))


def test_every_field_has_bad_values():
    fields = flat_fields(base_config())
    assert fields == set(BAD), (
        f"fields without a bad-value case: {sorted(fields - set(BAD))}; "
        f"cases for no field: {sorted(set(BAD) - fields)}"
    )
    assert set(EDGES) <= fields


def validate(config) -> None:
    """Everything ``train_and_evaluate`` checks before it writes anything."""
    run = spec.parse(config)
    environment.check_corpus(run)
    environment.check_environment(run)


def test_tiny_and_edge_values_validate():
    validate(tiny())
    for field, value in EDGES.items():
        c = tiny()
        set_field(c, field, value)
        validate(c)


@pytest.fixture
def no_work_after_validation(monkeypatch):
    """Any data, tokenizer or model work after validation fails the test at once."""
    from fp8jax.trainer import data as data_lib

    def refuse(*args, **kwargs):
        raise AssertionError("validation let a bad config through")

    monkeypatch.setattr(data_lib, "build", refuse)
    monkeypatch.setattr(train_lib, "setup", refuse)


@pytest.mark.parametrize("field, value", CASES, ids=[f"{f}={v!r}" for f, v in CASES])
def test_bad_value_is_refused_before_anything_is_written(
    field, value, tmp_path, no_work_after_validation
):
    c = tiny()
    set_field(c, field, value)
    workdir = tmp_path / "work"
    with pytest.raises(errors.ConfigError) as info:
        train_lib.train_and_evaluate(c, str(workdir))
    msg = str(info.value)
    assert "\n" not in msg and ": " in msg, msg  # one line: the problem, then the fix
    assert field in msg and repr(value) in msg, msg
    assert not workdir.exists()


def test_o3_needs_fsdp(tmp_path, no_work_after_validation):
    c = tiny()
    c.fp8.level = "O3"  # one CPU device: nothing to shard over
    with pytest.raises(errors.ConfigError, match=r"fp8.level='O3'.*mesh.fsdp.*O2") as info:
        train_lib.train_and_evaluate(c, str(tmp_path / "work"))
    assert "\n" not in str(info.value)
    assert not (tmp_path / "work").exists()


COMM_CASES = [(f, v) for f, v in CASES if f.startswith("comm.")]


@pytest.mark.parametrize("field, value", COMM_CASES, ids=[f"{f}={v!r}" for f, v in COMM_CASES])
def test_comm_config_built_directly_refuses_what_the_config_refuses(field, value):
    """A library user's ``CommConfig`` checks its fields as configs/base.py declares them."""
    with pytest.raises(errors.ConfigError, match=field) as info:
        comm.CommConfig(**{field.removeprefix("comm."): value})
    assert "\n" not in str(info.value)


def test_layer_gathers_need_no_tensor_parallelism():
    c = tiny()
    c.mesh.tensor, c.comm.gather = 2, "layer"
    with pytest.raises(errors.ConfigError, match=r"comm.gather='layer'.*mesh.tensor=1") as info:
        spec.parse(c)
    assert "\n" not in str(info.value)
    c.comm.gather = "auto"  # O3 with tensor parallelism gathers up front instead
    spec.parse(c)


@pytest.mark.parametrize(
    "fields, fragment",
    [
        ({"shared_gate": True}, "shared_gate=True gates the shared expert"),
        ({"bias_update_rate": 0.01}, "bias_update_rate=0.01 balances a sigmoid router"),
    ],
)
def test_moe_options_that_would_change_nothing_are_refused(fields, fragment):
    c = train_lib.load_config("moe_tiny")
    c.model.moe.update(fields)
    with pytest.raises(errors.ConfigError, match=fragment) as info:
        spec.parse(c)
    assert "\n" not in str(info.value)
    # With what they act on, the same values are a valid config.
    c.model.moe.update(shared_d_ff=16, router="sigmoid")
    moe = spec.parse(c).model.moe
    assert all(getattr(moe, k) == v for k, v in fields.items()), moe


def _cli(*flags: str, devices: int = 1, code: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "FP8JAX_DEBUG"}
    env.update(
        JAX_PLATFORMS="cpu",
        PYTHONPATH=str(ROOT),
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
    )
    cmd = [sys.executable, "-c", code] if code else [sys.executable, str(ROOT / "train.py")]
    return subprocess.run(
        [*cmd, *flags], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )


@pytest.mark.parametrize(
    "fields, fragment",
    [
        (
            {"model.param_dtype": "float16"},
            "model.param_dtype='float16' at fp8.level O1 keeps Adam's moments in float16, where "
            "eps=1e-08 rounds to 0",
        ),
        ({"model.dtype": "float16"}, "config.model.dtype='float16' has no matmuls on a CPU"),
    ],
)
def test_float16_that_cannot_train_here_is_refused(
    fields, fragment, tmp_path, no_work_after_validation
):
    """float16 weights under plain Adam with an eps float16 rounds to 0 (the weights turned
    Inf within 2 steps), and float16 compute on a CPU (XLA's CPU dot has no float16; a
    traceback from the first compile): refused in one line before any work."""
    c = tiny()
    for field, value in fields.items():
        set_field(c, field, value)
    workdir = tmp_path / "work"
    with pytest.raises(errors.ConfigError) as info:
        train_lib.train_and_evaluate(c, str(workdir))
    assert fragment in str(info.value) and "\n" not in str(info.value), info.value
    assert not workdir.exists()
    # float16 weights train at O2 (its fused Adam computes in float32) or with a larger eps.
    for field, value in {"fp8.level": "O2", "eps": 1e-4}.items():
        d = tiny()
        d.model.param_dtype = "float16"
        set_field(d, field, value)
        spec.parse(d)


def test_o3_with_fsdp_validates():
    code = (
        "from fp8jax import spec as s; from fp8jax.trainer import environment as e, loop as t; "
        "c = t.load_config('tiny'); c.fp8.level = 'O3'; c.mesh.data, c.mesh.fsdp = 1, 2; "
        "e.check_environment(s.parse(c)); c.mesh.fsdp = -1; e.check_environment(s.parse(c))"
    )
    proc = _cli(devices=2, code=code)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize(
    "config, flag, fragments",
    [
        ("configs/tiny.py", "--config.learning_rate=nan", ["learning_rate=nan", "> 0"]),
        ("configs/tiny.py", "--config.model.num_layers=0", ["model.num_layers=0", ">= 1"]),
        ("configs/tiny.py", "--config.fp8.history_len=0", ["fp8.history_len=0", ">= 1"]),
        # A shipped config by name, with its argument: the LLaMA variant's own check.
        ("tiny:llama", "--config.model.d_model=132", ["RoPE needs an even head dim"]),
        ("moe_tiny", "--config.model.moe.top_k=9", ["top_k=9 exceeds", "num_experts=8"]),
        ("no_such_config", "--config.seed=1", ["cannot load the --config file", "tiny"]),
    ],
)
def test_train_py_exits_2_with_one_line(config, flag, fragments, tmp_path):
    workdir = tmp_path / "work"
    proc = _cli("--config", config, f"--workdir={workdir}", flag)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines[-5:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert not workdir.exists()


# --- the step's guard: a non-finite update is skipped like a non-finite loss ---------------


@functools.cache  # one compile per (level, lr, eps), shared by the tests below
def _two_steps(level: str, lr, eps: float = 1e-8):
    """Two steps of a one-layer tiny GPT (one compile, no donation) with learning rate ``lr``.

    ``lr``: a function of the step count (the schedule, past validation). Returns the states
    before, between and after the steps, and both steps' metrics.
    """
    import jax
    import numpy as np

    from fp8jax import models
    from fp8jax.trainer import step as step_lib

    c = tiny()
    c.fp8.level, c.eps = level, eps
    m = c.model
    m.num_layers, m.d_model, m.num_heads, m.num_kv_heads, m.d_ff = 1, 64, 2, 2, 128
    # Position rows 16..31 never see a token, so their gradient is exactly zero.
    m.vocab_size, m.max_len, c.seq_len, c.batch_size = 128, 32, 16, 4
    run = spec.parse(c)
    real, fast = step_lib.learning_rate_schedule, jax.config.values[OPT_FLAG]
    step_lib.learning_rate_schedule = lambda optim: lr
    jax.config.update(OPT_FLAG, True)  # the compile dominates; exact checks need no speed
    try:
        model = models.build_model(run.model)
        tx = step_lib.make_optimizer(run)
        init = jax.jit(lambda key: step_lib.init_state(model, tx, run, key))
        states = [init(jax.random.PRNGKey(0))]
        train_step = jax.jit(step_lib.make_train_step(model, tx, run))
        tokens = np.random.default_rng(0).integers(0, 128, (4, 17)).astype(np.int32)
        batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
        metrics = []
        for _ in range(2):
            state, m = train_step(states[-1], batch)
            states.append(state)
            metrics.append(m)
    finally:
        step_lib.learning_rate_schedule = real
        jax.config.update(OPT_FLAG, fast)
    return jax.device_get((states, metrics))


def _leaves_equal(a, b) -> bool:
    import jax
    import numpy as np

    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(x, y) for x, y in zip(la, lb, strict=True))


def _lr_then_nan(step):
    import jax.numpy as jnp

    return jnp.where(step == 0, jnp.float32(1e-3), jnp.float32(NAN))


@pytest.mark.parametrize("level", ["O0", "O2"])
def test_step_with_non_finite_update_is_skipped(level):
    """A NaN learning rate leaves loss and gradients finite and poisons only the update."""
    states, metrics = _two_steps(level, _lr_then_nan, 1e-8)
    (first, second), (before, after) = metrics, states[1:]
    assert int(before.step) == 1 and math.isfinite(first["learning_rate"]), first
    assert math.isfinite(second["loss"]) and math.isfinite(second["grad_norm"]), second
    assert (int(after.step), int(after.skipped), int(after.bad_steps)) == (1, 1, 1)
    assert (int(second["skipped_steps"]), int(second["bad_steps"])) == (1, 1)
    for part in ("params", "opt_state", "fp8", "comm"):
        assert _leaves_equal(getattr(after, part), getattr(before, part)), part
