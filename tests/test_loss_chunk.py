"""The LM head's loss over token chunks (``model.loss_chunk``): the same token cross entropy,
gradients, train/eval/SFT/DPO steps as the full logits, and less compiled temp memory."""

import dataclasses
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from fp8jax import errors, models, spec
from fp8jax.models import head_loss
from fp8jax.trainer import loop
from fp8jax.trainer import step as step_lib
from fp8jax.trainer.objectives import dpo

from fp8_testing import with_overrides

ROOT = pathlib.Path(__file__).resolve().parents[1]
B, L, V = 3, 10, 512  # B * L = 30 tokens: chunks of 7 leave 2 padding tokens in the last
CHUNK = 7
RTOL = 1e-5  # f32 model: the chunked and full paths differ only in summation order


def run_spec(style="gpt", level="O0", **changes):
    """configs/tiny.py (f32) with ``changes`` as dotted keys, parsed."""
    c = loop.load_config("tiny", style)
    c.fp8.level, c.compilation_cache_dir = level, ""
    c.model.update(num_layers=1, d_model=32, num_heads=2, num_kv_heads=2, d_ff=64)  # fast
    with_overrides(c, changes)
    return spec.parse(c)


def chunked(model, chunk=CHUNK):
    """``model`` with ``loss_chunk=chunk``."""
    return models.build_model(dataclasses.replace(model.cfg, loss_chunk=chunk))


def data(seed=0, batch=B, length=L, vocab=V):
    rng = np.random.default_rng(seed)
    inputs = rng.integers(0, vocab, (batch, length)).astype(np.int32)
    targets = rng.integers(0, vocab, (batch, length)).astype(np.int32)
    return inputs, targets


def reference_ce(logits_BxLxV, targets_BxL):
    """Token cross entropy of the full logits in plain JAX f32 (log_softmax, target picked)."""
    logp = jax.nn.log_softmax(logits_BxLxV.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, targets_BxL[..., None], axis=-1)[..., 0]


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def assert_trees_close(got, want, rtol=RTOL):
    """Every leaf within ``rtol`` of its own norm, or of the largest gradient anywhere for a
    leaf that is zero up to rounding (a key bias: softmax ignores it)."""
    assert jax.tree.structure(got) == jax.tree.structure(want)
    flat = jax.tree_util.tree_flatten_with_path(want)[0]
    scale = max(float(np.max(np.abs(w))) for _, w in flat)
    for (path, w), g in zip(flat, jax.tree.leaves(got), strict=True):
        err = float(np.max(np.abs(np.asarray(g, np.float64) - np.asarray(w, np.float64))))
        ok = rel_err(g, w) < rtol or err < rtol * scale
        assert ok, (jax.tree_util.keystr(path), rel_err(g, w), err / scale)


@pytest.mark.parametrize("style, tie", [("gpt", True), ("llama", False)])
def test_chunked_token_ce_and_grads_equal_the_full_logits(style, tie):
    run = run_spec(style, **{"model.tie_embeddings": tie})
    full = models.build_model(run.model)
    inputs, targets = data()
    params = nn.unbox(jax.jit(full.init)(jax.random.key(0), inputs)["params"])
    # Per-token weights: a token lost, duplicated or moved by the chunking changes the sum.
    g_BxL = jnp.asarray(np.random.default_rng(1).normal(size=(B, L)), jnp.float32)

    def ref_loss(p):
        ce = reference_ce(full.apply({"params": p}, inputs), targets)
        return jnp.sum(g_BxL * ce), ce

    def model_loss(model):
        def loss(p):
            ce = model.apply({"params": p}, inputs, targets_BxL=targets)
            return jnp.sum(g_BxL * ce), ce

        return loss

    (want, want_ce), want_g = jax.jit(jax.value_and_grad(ref_loss, has_aux=True))(params)
    head = ("embed", "embedding") if tie else ("head", "kernel")
    assert ("head" in want_g) != tie
    for model in (full, chunked(full)):  # targets without chunks: the full logits' CE
        grad_fn = jax.jit(jax.value_and_grad(model_loss(model), has_aux=True))
        (got, got_ce), got_g = grad_fn(params)
        assert got_ce.shape == (B, L) and got_ce.dtype == jnp.float32
        assert rel_err(got_ce, want_ce) < RTOL
        assert rel_err(got, want) < RTOL
        assert_trees_close(got_g, want_g)
        assert rel_err(got_g[head[0]][head[1]], want_g[head[0]][head[1]]) < RTOL


def test_chunk_sizes_from_one_token_to_more_than_the_batch():
    """x [N, D] and a head [D, V] in f32: every chunk size gives the full product's CE."""
    rng = np.random.default_rng(2)
    x_NxD = jnp.asarray(rng.normal(size=(30, 16)), jnp.float32)
    w_DxV = jnp.asarray(rng.normal(size=(16, 40)) * 0.5, jnp.float32)
    t_N = jnp.asarray(rng.integers(0, 40, 30), jnp.int32)
    g_N = jnp.asarray(rng.normal(size=30), jnp.float32)
    want_ce = reference_ce(x_NxD @ w_DxV, t_N)
    want_g = jax.grad(lambda x, w: jnp.sum(g_N * reference_ce(x @ w, t_N)), (0, 1))(x_NxD, w_DxV)
    for chunk in (1, 7, 30, 64):
        for w, w_d in ((w_DxV, 0), (w_DxV.T, 1)):  # untied kernel, tied [V, D] table

            def loss(x, w, chunk=chunk, w_d=w_d):
                ce = head_loss.chunked_cross_entropy(x, w, t_N, chunk, jnp.float32, w_d)
                return jnp.sum(g_N * ce), ce

            (_, ce), (gx, gw) = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(x_NxD, w)
            assert rel_err(ce, want_ce) < RTOL, chunk
            assert rel_err(gx, want_g[0]) < RTOL, chunk
            assert rel_err(gw if w_d == 0 else gw.T, want_g[1]) < RTOL, chunk


def test_weighted_loss_forms_its_gradient_in_one_pass():
    """``weighted_cross_entropy``: the weighted sum of the full product's CE and its gradients
    (plain JAX), for every chunk size, under a cotangent != 1; the gradient program multiplies
    by the head once per chunk for the logits and twice for dx and dw (three ``dot_general``s
    where the per-token chunked loss runs four: it recomputes the logits); ce has no gradient."""
    rng = np.random.default_rng(5)
    x_NxD = jnp.asarray(rng.normal(size=(30, 16)), jnp.float32)
    w_DxV = jnp.asarray(rng.normal(size=(16, 40)) * 0.5, jnp.float32)
    t_N = jnp.asarray(rng.integers(0, 40, 30), jnp.int32)
    wt_N = jnp.asarray(rng.uniform(size=30) * (rng.uniform(size=30) > 0.3), jnp.float32)
    want_ce = reference_ce(x_NxD @ w_DxV, t_N)
    ref = lambda x, w: 2.5 * jnp.sum(wt_N * reference_ce(x @ w, t_N))  # noqa: E731
    want, want_g = jax.value_and_grad(ref, (0, 1))(x_NxD, w_DxV)
    for chunk in (1, 7, 30, 64):
        for w, w_d in ((w_DxV, 0), (w_DxV.T, 1)):

            def loss(x, w, chunk=chunk, w_d=w_d):
                ce, total = head_loss.weighted_cross_entropy(
                    x, w, t_N, wt_N, chunk, jnp.float32, w_d
                )
                return 2.5 * total + jnp.sum(ce), ce  # ce: no gradient, so no term in it

            grad_fn = jax.value_and_grad(loss, (0, 1), has_aux=True)
            (got, ce), (gx, gw) = jax.jit(grad_fn)(x_NxD, w)
            assert rel_err(ce, want_ce) < RTOL, chunk
            assert rel_err(got - jnp.sum(ce), want) < RTOL, chunk
            assert rel_err(gx, want_g[0]) < RTOL, chunk
            assert rel_err(gw if w_d == 0 else gw.T, want_g[1]) < RTOL, chunk
    weighted = lambda x, w: head_loss.weighted_cross_entropy(  # noqa: E731
        x, w, t_N, wt_N, 7, jnp.float32, 0
    )[1]
    per_token = lambda x, w: jnp.sum(  # noqa: E731
        wt_N * head_loss.chunked_cross_entropy(x, w, t_N, 7, jnp.float32, 0)
    )
    dots = lambda f: str(jax.make_jaxpr(jax.grad(f, (0, 1)))(x_NxD, w_DxV)).count("dot_general")  # noqa: E731
    assert dots(weighted) == 3 and dots(per_token) == 4


def test_init_with_targets_makes_the_same_params():
    """The chunked loss reads the untied head's kernel through ``HeadKernel``: same path,
    shape and initial values as ``nn.Dense`` 'head'."""
    full = models.build_model(run_spec().model)
    inputs, targets = data()
    want = jax.jit(full.init)(jax.random.key(0), inputs)["params"]
    got = jax.jit(chunked(full).init)(jax.random.key(0), inputs, targets_BxL=targets)["params"]
    jax.tree.map(np.testing.assert_array_equal, got, want)


def test_fp8_lm_head_with_loss_chunk_is_refused():
    with pytest.raises(errors.ConfigError) as info:
        run_spec(level="O1", **{"model.fp8_lm_head": True, "model.loss_chunk": 64})
    msg = str(info.value)
    assert "\n" not in msg and "loss_chunk=64" in msg and "fp8_lm_head=False" in msg, msg
    run = run_spec(level="O1", **{"model.fp8_lm_head": True})  # a library user's own config
    model = models.build_model(dataclasses.replace(run.model, loss_chunk=64))
    inputs, targets = data()
    variables = jax.jit(model.init)(jax.random.key(0), inputs)
    with pytest.raises(ValueError, match="loss_chunk > 0 needs model.fp8_lm_head=False"):
        model.apply(variables, inputs, targets_BxL=targets)


# The one-device step's mean loss, FP8 state and mean gradients, compiled (model static).
batch_gradients = jax.jit(
    step_lib.batch_gradients, static_argnums=(0,), static_argnames=("objective",)
)


def train_setup(run, batch_size=4, abstract=False):
    """(model, optimizer, state, batch); ``abstract``: the state's shapes only."""
    model = models.build_model(run.model)
    tx = step_lib.make_optimizer(run)
    init = jax.eval_shape if abstract else lambda f, *a: jax.jit(f)(*a)
    state = init(lambda key: step_lib.init_state(model, tx, run, key), jax.random.key(0))
    inputs, targets = data(3, batch_size, run.optim.seq_len)
    return model, tx, state, {"inputs": inputs, "targets": targets}


def test_train_step_with_loss_chunk_equals_without():
    """One train step at O0 (f32): loss, gradients and the params after the update."""
    run = run_spec(seq_len=16, batch_size=4)
    model, tx, state, batch = train_setup(run)
    run_c = dataclasses.replace(run, model=dataclasses.replace(run.model, loss_chunk=CHUNK))
    model_c = models.build_model(run_c.model)  # 64 tokens: chunks of 7, one padded
    want = batch_gradients(model, state.params, state.fp8, batch)
    got = batch_gradients(model_c, state.params, state.fp8, batch)
    assert rel_err(got[0], want[0]) < RTOL
    assert_trees_close(got[2], want[2])
    new, metrics = jax.jit(step_lib.make_train_step(model, tx, run))(state, batch)
    new_c, metrics_c = jax.jit(step_lib.make_train_step(model_c, tx, run_c))(state, batch)
    assert rel_err(metrics_c["loss"], metrics["loss"]) < RTOL
    assert rel_err(metrics_c["grad_norm"], metrics["grad_norm"]) < RTOL
    assert_trees_close(new_c.params, new.params)


def test_weighted_sft_loss_through_the_chunked_head():
    run = run_spec("llama", seq_len=16)
    model = models.build_model(run.model)
    inputs, targets = data(4, 4, 16)
    weights = np.zeros((4, 16), np.float32)
    weights[0, 15], weights[1:, 5:] = 1.0, 1.0  # prompt tokens (weight 0) carry no loss
    batch = dict(inputs=inputs, targets=targets, weights=weights)
    params = nn.unbox(jax.jit(model.init)(jax.random.key(0), inputs)["params"])
    ce = reference_ce(jax.jit(model.apply)({"params": params}, inputs), targets)
    want = float(np.sum(np.asarray(ce) * weights) / np.sum(weights))
    loss_f, _, grads_f = batch_gradients(model, params, {}, batch)
    loss_c, _, grads_c = batch_gradients(chunked(model), params, {}, batch)
    assert rel_err(loss_f, want) < RTOL and rel_err(loss_c, want) < RTOL
    assert_trees_close(grads_c, grads_f)
    state = step_lib.TrainState(0, params, None, {}, 0, 0)
    assert rel_err(jax.jit(step_lib.make_eval_step(chunked(model)))(state, batch), want) < RTOL


def test_dpo_logps_and_loss_through_the_chunked_head():
    run = run_spec(seq_len=16)
    model = models.build_model(run.model)
    inputs, targets = data(5, 4, 16)  # rows: chosen, rejected, chosen, rejected
    weights = np.zeros((4, 16), np.float32)
    weights[:, 6:] = 1.0  # the responses
    weights[2, 6:12] = 0.0
    batch = dict(inputs=inputs, targets=targets, weights=weights)
    params = nn.unbox(jax.jit(model.init)(jax.random.key(0), inputs)["params"])
    ref = {"params": jax.tree.map(lambda p: p * 0.9, params), "fp8": {}}
    logits = jax.jit(model.apply)({"params": ref["params"]}, inputs)
    want_B = -np.sum(np.asarray(reference_ce(logits, targets)) * weights, axis=-1)
    for m in (model, chunked(model)):
        ref_B, _ = jax.jit(dpo.reference_logps, static_argnums=(0, 3))(m, ref, batch, False)
        assert rel_err(ref_B, want_B) < RTOL
    objective = dpo.Dpo.from_run(run)
    rows = {dpo.REF_LOGPS: jnp.asarray(want_B, jnp.float32)}
    loss_f, _, grads_f = batch_gradients(model, params, {}, batch, objective=objective, rows=rows)
    loss_c, _, grads_c = batch_gradients(
        chunked(model), params, {}, batch, objective=objective, rows=rows
    )
    assert float(loss_f) > 0 and rel_err(loss_c, loss_f) < RTOL
    assert_trees_close(grads_c, grads_f)
    state = step_lib.TrainState(0, params, None, {}, 0, 0, objective=ref)
    want = jax.jit(step_lib.make_eval_step(model, None, objective))(state, batch)
    got = jax.jit(step_lib.make_eval_step(chunked(model), None, objective))(state, batch)
    for key in ("loss", *dpo.PAIR_STATS):
        assert rel_err(got[key], want[key]) < RTOL, key


def test_chunked_train_step_compiles_to_less_temp_memory():
    """V=8192, 1024 tokens, d=64: the full logits are 32 MiB in f32. Chunks of 128 tokens save
    at least half of that against the full logits, and against one chunk of all 1024 tokens
    at least half of the (1024 - 128) tokens' f32 logits: the chunk bounds the buffers."""
    vocab, batch_size, seq_len, chunk = 8192, 4, 256, 128
    tokens = batch_size * seq_len
    run = run_spec(
        seq_len=seq_len,
        batch_size=batch_size,
        **{
            "model.vocab_size": vocab,
            "model.d_model": 64,
            "model.d_ff": 128,
            "model.num_layers": 1,
            "model.num_heads": 2,
            "model.num_kv_heads": 2,
            "model.max_len": seq_len,
        },
    )
    temps = {}
    jax.config.update("jax_disable_most_optimizations", False)  # the memory XLA really plans
    try:
        for c in (0, tokens, chunk):
            r = dataclasses.replace(run, model=dataclasses.replace(run.model, loss_chunk=c))
            model, tx, state, batch = train_setup(r, batch_size, abstract=True)
            compiled = jax.jit(step_lib.make_train_step(model, tx, r)).lower(state, batch).compile()
            temps[c] = compiled.memory_analysis().temp_size_in_bytes
    finally:
        jax.config.update("jax_disable_most_optimizations", True)
    f32_logits = lambda n: n * vocab * 4
    assert temps[chunk] < temps[0] - f32_logits(tokens) / 2, temps
    assert temps[chunk] < temps[tokens] - f32_logits(tokens - chunk) / 2, temps


# Two simulated devices, tokens sharded over 'data': the chunked loss and its gradients compiled.
SHARDED = """
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from fp8jax.models import head_loss
mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
rows = NamedSharding(mesh, P("data"))
x = jax.device_put(jnp.ones((1024, 32)), rows)
t = jax.device_put(jnp.zeros((1024,), jnp.int32), rows)
w = jax.device_put(jnp.ones((32, 2048)), NamedSharding(mesh, P()))
loss = lambda x, w: jnp.sum(head_loss.chunked_cross_entropy(x, w, t, 128, jnp.float32, 0))
hlo = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(x, w).compile().as_text()
print(sum("all-gather" in line for line in hlo.splitlines()))
"""


def test_chunks_keep_a_sharded_batch_local():
    """Each chunk spans every row: with the tokens sharded over devices no device gathers
    another's activations (contiguous chunks would scan over the sharded axis)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    proc = subprocess.run(
        [sys.executable, "-c", SHARDED], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1] == "0", proc.stdout
