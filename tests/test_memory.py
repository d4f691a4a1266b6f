"""Memory account: bytes/param at O0/O1/O2 from the actual (abstract) trees; compiled stats."""

import jax
import jax.numpy as jnp
import optax
import pytest

from fp8jax import memory, optim

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


def level_trees(level, params):
    """(params, opt_state) as the train state holds them at ``level``."""
    opts = optim.LEVELS[level]
    if level == "O2":
        tx = optim.fp8_adamw(1e-3, m_format=opts["m_format"], v_format=opts["v_format"])
    else:
        tx = optax.adamw(1e-3)
    tx = optax.chain(optax.clip_by_global_norm(1.0), tx)
    return jax.eval_shape(lambda p: (optim.to_master(p, opts["master_format"]), tx.init(p)), params)


@pytest.fixture(scope="module")
def rows():
    params = abstract_params()
    out = []
    for level in ("O0", "O1", "O2"):
        p, s = level_trees(level, params)
        # level=: from O1 on the matmul weights' gradients count as FP8 (1 byte), others f32.
        out.append(memory.bytes_per_param(p, s, level=level))
    print("\n" + memory.memory_table(out))
    return {r["label"]: r for r in out}


def test_matmul_bytes_per_param_by_level(rows):
    # O0: 4 master + 4 grad + 4 m + 4 v; O1: 2 (FP16 master) + 1 (FP8 grad) + 8; O2: 2 + 1 + 1 + 2.
    assert rows["O0"]["matmul_total"] == pytest.approx(16.0, abs=1e-9)
    assert rows["O1"]["matmul_total"] == pytest.approx(11.0, abs=1e-5)
    assert rows["O2"]["matmul_total"] == pytest.approx(6.0, abs=1e-5)
    # The only excess over 6 is three f32 scales per kernel (master, m, v).
    assert rows["O2"]["matmul_total"] - 6.0 < 1e-6
    o2 = rows["O2"]
    assert (o2["matmul_params"], o2["matmul_grads"]) == (pytest.approx(2.0, abs=1e-5), 1.0)
    assert o2["matmul_opt_state"] == pytest.approx(3.0, abs=1e-5)


def test_overall_includes_fp32_leaves(rows):
    o2 = rows["O2"]
    # Embedding, norms and head bias keep f32 params, f32 grads and f32 moments: 16 B each.
    n_other = o2["n_params"] - o2["n_matmul"]
    expect = (6.0 * o2["n_matmul"] + 16.0 * n_other) / o2["n_params"]
    assert o2["total"] == pytest.approx(expect, rel=1e-5)
    assert rows["O0"]["total"] == pytest.approx(16.0, rel=1e-6)  # + step counters
    assert rows["O0"]["total_mib"] > rows["O1"]["total_mib"] > rows["O2"]["total_mib"]


def test_table_lists_levels(rows):
    table = memory.memory_table(list(rows.values()))
    lines = table.splitlines()
    assert len(lines) == 6 and all(level in table for level in ("O0", "O1", "O2"))
    assert "6.00" in lines[-1]


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
