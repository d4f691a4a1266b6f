"""Memory account: bytes of the trainer's state per level, estimated and read from its trees."""

import jax
import jax.numpy as jnp
import pytest

from fp8jax import spec
from fp8jax.diagnostics import memory
from fp8jax.optim import adam as optim
from fp8jax.optim.levels import Level
from fp8jax.trainer import loop as train_lib

D, F, V = 4096, 11008, 32000  # LLaMA-7B widths: one layer is enough for per-param figures


def abstract_params():
    """One LLaMA-7B block plus embedding and head, as ShapeDtypeStructs (no memory used)."""
    sds = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    return {
        "embed": {"embedding": sds(V, D)},
        "layer_0": {
            "attn_norm": {"scale": sds(D)},
            "attn": {"qkv": {"kernel": sds(D, 3 * D)}, "out": {"kernel": sds(D, D)}},
            "mlp_norm": {"scale": sds(D)},
            "mlp": {"up": {"kernel": sds(D, 2 * F)}, "down": {"kernel": sds(F, D)}},
        },
        "final_norm": {"scale": sds(D)},
        "head": {"kernel": sds(D, V), "bias": sds(V)},
    }


def tiny_config(level, **fp8):
    """A one-layer GPT at ``level`` (``fp8``: config.fp8 overrides)."""
    c = train_lib.load_config("tiny")
    c.fp8.level = level
    c.model.num_layers, c.model.d_model, c.model.d_ff, c.model.vocab_size = 1, 64, 128, 128
    for k, v in fp8.items():
        c.fp8[k] = v
    return c


def trainer_state(c):
    """The train state ``loop.setup`` builds for ``c``, abstract (nothing allocated)."""
    return train_lib.setup(spec.parse(c)).abstract


@pytest.mark.parametrize(
    "level,fp8",
    [
        ("O0", {}),
        ("O1", {}),
        ("O2", {}),
        ("O3", {}),
        ("O2", {"m_format": "e5m2", "v_format": "bfloat16", "master_format": "bfloat16"}),
    ],
)
def test_estimate_matches_the_trainers_state(level, fp8):
    """``state_bytes`` from the table gives, to the byte, what the trainer's state holds."""
    c = tiny_config(level, **fp8)
    state, run = trainer_state(c), spec.parse(c)
    f32 = jax.eval_shape(optim.materialize, state.params)  # the f32 params the model sees
    est = memory.state_bytes(f32, run.fp8.storage)
    got = memory.account(state.params, state.opt_state)
    assert got["all"]["params"] == est["params"] and got["all"]["opt_state"] == est["opt_state"]
    assert got["matmul"]["params"] == est["matmul_params"]
    assert got["matmul"]["opt_state"] == est["matmul_opt_state"]
    assert bool(jax.tree.leaves(state.fp8)) == run.fp8.level.fp8_gemms  # FP8 scale state
    kernel = state.params["blocks"]["mlp"]["wi"]["kernel"]
    if run.fp8.storage.master_format == "float32":
        assert kernel.dtype == jnp.float32  # O0 and O1 keep f32 params
    else:
        assert kernel.data.dtype == optim.storage_dtype(c.fp8.master_format)


def test_matmul_bytes_per_param_by_level():
    params = abstract_params()
    n_mm = D * 3 * D + D * D + D * 2 * F + F * D + D * V
    n_all = n_mm + V * D + 3 * D + V
    for level in (Level.O0, Level.O1):  # f32 params, f32 m and v
        est = memory.state_bytes(params, level.storage())
        assert est["matmul_params"] + est["matmul_opt_state"] == 12 * n_mm
        assert est["params"] + est["opt_state"] == 12 * n_all + 8  # + two int32 step counts
    # O2: FP16 master (2) + E4M3 m (1) + FP16 v (2), and an f32 scale each per kernel (five).
    est = memory.state_bytes(params, Level.O2.storage())
    assert est["matmul_params"] == 2 * n_mm + 5 * 4
    assert est["matmul_opt_state"] == 3 * n_mm + 5 * 2 * 4
    # Embedding, norms and head bias keep f32 params and f32 moments.
    assert est["params"] + est["opt_state"] == 5 * n_mm + 15 * 4 + 12 * (n_all - n_mm) + 8


@pytest.fixture(scope="module")
def rows():
    """``bytes_per_param`` rows of the trainer's O0, O1 and O2 states."""
    out = []
    for level in ("O0", "O1", "O2"):
        state = trainer_state(tiny_config(level))
        row = memory.bytes_per_param(state.params, state.opt_state, level=Level.parse(level))
        out.append(row)
    print("\n" + memory.memory_table(out))
    return {r["label"]: r for r in out}


def test_rows_by_level(rows):
    o0, o1, o2 = rows["O0"], rows["O1"], rows["O2"]
    # O0: 4 param + 4 grad + 8 moments; O1 stores the same, with FP8-LM's 1-byte FP8 gradients.
    assert o0["matmul_total"] == 16.0 and o1["matmul_total"] == 13.0
    assert o0["matmul_params"] == o1["matmul_params"] == 4.0
    # O2: FP16 master + FP8 grad + E4M3 m + FP16 v = 6, plus three f32 scales per kernel.
    n_kernels = 6  # q, kv, o, wi, wo (one stacked layer) and the head: rank-2 'kernel' leaves
    assert o2["matmul_total"] == pytest.approx(6.0 + 3 * 4 * n_kernels / o2["n_matmul"])
    assert o0["total_mib"] > o1["total_mib"] > o2["total_mib"]


def test_table_lists_levels(rows):
    table = memory.memory_table(list(rows.values()))
    lines = table.splitlines()
    assert len(lines) == 6 and all(level in table for level in ("O0", "O1", "O2"))
    assert f"{rows['O2']['matmul_total']:.2f}" in lines[-1]


def test_concrete_trees_exact_bytes():
    params = {"d": {"kernel": jnp.ones((8, 16)), "bias": jnp.ones(16)}}
    tx = optim.fp8_adamw(1e-3)
    state = tx.init(params)
    master = optim.to_master(params)
    acc = memory.account(master, state, grads_dtype=jnp.bfloat16, matmul_grads_dtype=1)
    n = 8 * 16
    assert acc["matmul"]["n"] == n and acc["all"]["n"] == n + 16
    assert acc["matmul"]["params"] == 2 * n + 4  # FP16 data + f32 scale
    assert acc["matmul"]["grads"] == n and acc["all"]["grads"] == n + 2 * 16
    assert acc["matmul"]["opt_state"] == (n + 4) + (2 * n + 4)  # E4M3 m, FP16 v, scales
    # Plus the bias's f32 m and v and Adam's int32 step count (a constant lr keeps no counter).
    assert acc["all"]["opt_state"] - acc["matmul"]["opt_state"] == 2 * 4 * 16 + 4
    row = memory.bytes_per_param(master, state, grads_dtype="float32", matmul_grads_dtype="e5m2")
    assert row["matmul_total"] == pytest.approx(((2 * n + 4) + n + (3 * n + 8)) / n)
    assert row["grads"] == pytest.approx((n + 4 * 16) / (n + 16))


def test_default_grads_follow_materialised_dtype():
    params = {"d": {"kernel": jnp.ones((4, 4), jnp.bfloat16)}}
    master = optim.to_master({"d": {"kernel": jnp.ones((4, 4))}})
    assert memory.bytes_per_param(params, ())["grads"] == 2.0
    assert memory.bytes_per_param(master, ())["grads"] == 4.0  # the f32 view is what's diffed


def test_compiled_memory():
    compiled = jax.jit(lambda x: jnp.tanh(x @ x)).lower(jnp.ones((64, 64))).compile()
    stats = memory.compiled_memory(compiled)
    line = memory.format_compiled_memory(stats)
    if stats is not None:  # CPU reports it on current jax; other backends may not
        assert set(stats) >= {"argument", "output", "temp", "generated_code", "peak"}
        assert stats["argument"] == 64 * 64 * 4 and stats["output"] == 64 * 64 * 4
        assert stats["peak"] >= stats["argument"]
        assert "MiB" in line

    class NoStats:
        def memory_analysis(self):
            return None

    class Raises:
        def memory_analysis(self):
            raise NotImplementedError

    assert memory.compiled_memory(NoStats()) is None
    assert memory.compiled_memory(Raises()) is None
    assert "not reported" in memory.format_compiled_memory(None)


def test_fused_adamw_holds_no_f32_copy_of_a_stacked_leaf():
    """Compiled with the state donated (as the trainer does), ``FusedAdamW.apply`` on a stacked
    kernel needs less than one f32 copy of it in temporaries: per layer slice, in place. The
    unfused update (``tx.update``, ``apply_updates``, keeping the old state for a skipped step)
    holds several (m, v, the update, the new master)."""
    import optax

    from fp8jax.nn.state import keep_if_finite
    from fp8jax.optim.fused import FusedAdamW

    shape = (32, 64, 256)  # [layers, d_in, d_out]
    n = shape[0] * shape[1] * shape[2]
    slice_bytes = 4 * shape[1] * shape[2]  # one layer's f32 values at a time
    opt = FusedAdamW(
        optax.constant_schedule(1e-3), weight_decay=0.1, grad_clip=1.0, slice_bytes=slice_bytes
    )
    tx = opt.transform()
    p32 = {"blocks": {"wi": {"kernel": jax.ShapeDtypeStruct(shape, jnp.float32)}}}
    masters = jax.eval_shape(optim.to_master, p32)
    state = jax.eval_shape(tx.init, p32)
    grads = {"blocks": {"wi": {"kernel": jax.ShapeDtypeStruct(shape, jnp.bfloat16)}}}
    stacked = {"blocks": {"wi": {"kernel": True}}}
    scalars = jax.ShapeDtypeStruct((), jnp.bool_), jax.ShapeDtypeStruct((), jnp.uint32)

    def fused(params, opt_state, grads, ok, seed):
        return opt.apply(grads, opt_state, params, ok, jnp.bfloat16, seed, stacked)

    def unfused(params, opt_state, grads, ok, seed):
        updates, new = tx.update(grads, opt_state, optim.materialize(params, jnp.bfloat16))
        new_params = optim.apply_updates(params, updates, seed)
        return keep_if_finite(new_params, params, ok), keep_if_finite(new, opt_state, ok)

    def temp_per_param(fn):
        # Params and state in the outputs' order, so each donated buffer becomes its own output.
        lowered = jax.jit(fn, donate_argnums=(0, 1)).lower(masters, state, grads, *scalars)
        return memory.compiled_memory(lowered.compile())["temp"] / n

    assert temp_per_param(fused) < 4  # bytes per parameter: less than one f32 copy
    assert temp_per_param(unfused) > 8
