"""The Mixture-of-Experts layer (``models.moe``) against a per-token plain-JAX reference, its
dispatch, auxiliary losses and gradients, and ``configs/moe_tiny.py`` trained end to end."""

import dataclasses
import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from fp8jax import errors, models, spec
from fp8jax.models import moe
from fp8jax.nn.state import FP8
from fp8jax.ops import grouped, grouped_mgpu, rows
from fp8jax.optim import master
from fp8jax.trainer import loop as train_lib
from fp8jax.trainer import step as step_lib

from fp8_testing import (
    FWD_TOL,
    GRAD_TOL,
    MIN_ERR,
    rel_err,
    scatter_results,
)

B, L, D = 2, 8, 32  # 16 tokens of width 32


def moe_cfg(level="O0", **moe_fields) -> models.ModelConfig:
    """configs/moe_tiny.py's model, 32 wide, with ``moe_fields`` overriding its MoE settings."""
    c = train_lib.load_config("moe_tiny")
    c.fp8.level = level
    c.model.update(d_model=D, num_heads=2, num_kv_heads=2)
    c.model.moe.update(num_experts=4, top_k=2, d_ff=16, **moe_fields)
    return spec.parse(c).model


def init_block(cfg, seed=0, bias=None):
    """``(variables, x)`` of an ``MoeMlp``: random params (and ``bias`` as the router's)."""
    x = jax.random.normal(jax.random.key(seed + 1), (B, L, D), jnp.float32)
    variables = nn.unbox(moe.MoeMlp(cfg).init(jax.random.key(seed), x))
    variables = {k: v for k, v in variables.items() if k in ("params", moe.MOE_STATE)}
    if bias is not None:
        variables[moe.MOE_STATE] = {"router": {"bias": jnp.asarray(bias, jnp.float32)}}
    return variables, x


def apply_block(cfg, variables, x):
    """``(y, sown losses, sown metrics)`` of the block, jitted."""
    fn = jax.jit(
        lambda v, x: moe.MoeMlp(cfg).apply(v, x, mutable=[moe.MOE_LOSSES, moe.MOE_METRICS])
    )
    y, sown = fn(variables, x)
    metrics = {k: v[0] for k, v in sown[moe.MOE_METRICS].items()}
    return y, sown[moe.MOE_LOSSES]["aux_loss"][0], metrics


def silu(v):
    return v / (1.0 + np.exp(-v))


def reference_routes(x_TxD, p, spec_: models.config.MoeSpec, bias=None):
    """Per token: its experts (best first) and their weights, from numpy's sort."""
    logits = x_TxD @ p["router"]["kernel"]
    out = []
    for row in logits:
        if spec_.router == "softmax":
            scores = np.exp(row - row.max())
            scores = scores / scores.sum()
            select = scores
        else:
            scores = 1.0 / (1.0 + np.exp(-row))
            select = scores + (0.0 if bias is None else bias)
        experts = np.argsort(-select, kind="stable")[: spec_.top_k]
        w = scores[experts]
        if spec_.normalize_top_k:
            w = w / w.sum()
        out.append((experts, w))
    return out


def reference_block(cfg, variables, x, bias=None, kept=None):
    """The layer token by token: each of its k experts as dense matmuls, weighted and summed
    (``kept[t][j]`` False: pair (t, j) dropped); plus the shared expert."""
    p = jax.tree.map(np.asarray, variables["params"])
    s = cfg.moe
    x_TxD = np.asarray(x, np.float64).reshape(-1, D)
    wi, wo = p["experts_wi"]["kernel"], p["experts_wo"]["kernel"]  # [E, D, 2, F], [E, F, D]
    y = np.zeros_like(x_TxD)
    for t, (experts, w) in enumerate(reference_routes(x_TxD, p, s, bias)):
        for j, (e, wj) in enumerate(zip(experts, w, strict=True)):
            if kept is not None and not kept[t][j]:
                continue
            gate, up = x_TxD[t] @ wi[e][:, 0], x_TxD[t] @ wi[e][:, 1]
            y[t] += wj * ((silu(gate) * up) @ wo[e])
    if s.shared_d_ff:
        sh = p["shared"]
        gu = np.einsum("td,dkf->tkf", x_TxD, sh["wi"]["kernel"])
        out = (silu(gu[:, 0]) * gu[:, 1]) @ sh["wo"]["kernel"]
        if s.shared_gate:
            out = out / (1.0 + np.exp(-(x_TxD @ p["shared_gate"]["kernel"])))
        y = y + out
    return y.reshape(B, L, D)


@pytest.mark.parametrize(
    "fields",
    [
        dict(),  # softmax, top-2 renormalised
        dict(normalize_top_k=False, shared_d_ff=24, shared_gate=True),
        dict(router="sigmoid", bias_update_rate=1e-3),  # selection with a bias
    ],
    ids=["softmax", "shared-gated", "sigmoid-bias"],
)
def test_dropless_block_matches_a_per_token_reference(fields):
    cfg = moe_cfg(**fields)
    # A bias large enough to change which experts some tokens pick.
    bias = [0.3, -0.2, 0.0, 0.1] if cfg.moe.router == "sigmoid" else None
    variables, x = init_block(cfg, bias=bias)
    y, _, metrics = apply_block(cfg, variables, x)
    want = reference_block(cfg, variables, x, bias=None if bias is None else np.array(bias))
    np.testing.assert_allclose(np.asarray(y), want, rtol=2e-5, atol=2e-6)
    assert "dropped" not in metrics  # dropless
    if bias is not None:  # the bias mattered: without it the routing differs
        plain = reference_block(cfg, variables, x)
        assert np.abs(plain - want).max() > 1e-3


def test_capacity_drops_exactly_the_pairs_past_each_experts_capacity():
    cfg = moe_cfg(dispatch="capacity", capacity_factor=1.0)
    variables, x = init_block(cfg, seed=3)
    # Skew the router toward expert 0 so that it overflows.
    variables["params"]["router"]["kernel"] = (
        variables["params"]["router"]["kernel"].at[:, 0].add(0.5)
    )
    y, _, metrics = apply_block(cfg, variables, x)
    p = jax.tree.map(np.asarray, variables["params"])
    x_TxD = np.asarray(x).reshape(-1, D)
    routes = reference_routes(x_TxD, p, cfg.moe)
    capacity = math.ceil(1.0 * len(routes) * cfg.moe.top_k / cfg.moe.num_experts)
    taken = np.zeros(cfg.moe.num_experts, int)
    kept = []
    for experts, _ in routes:  # token order, then each token's experts best first
        kept.append([])
        for e in experts:
            kept[-1].append(taken[e] < capacity)
            taken[e] += 1
    dropped = 1 - np.mean(kept)
    assert dropped > 0, "the skewed router must overflow an expert"
    np.testing.assert_allclose(float(metrics["dropped"]), dropped, rtol=1e-6)
    want = reference_block(cfg, variables, x, kept=kept)
    np.testing.assert_allclose(np.asarray(y), want, rtol=2e-5, atol=2e-6)


def test_a_run_dropping_most_pairs_is_warned(tmp_path, caplog):
    """A logged step whose capacity dispatch dropped most token-expert pairs (a tiny
    model.moe.capacity_factor: the experts see almost nothing) warns, naming the fixes."""
    import logging

    from fp8jax.trainer import metrics as metrics_lib

    log = metrics_lib.RunLog(str(tmp_path), 2, 16, 0)
    share = metrics_lib.MOE_DROP_WARN_SHARE
    with caplog.at_level(logging.WARNING):
        log.train(1, {"loss": np.float32(6.0), "moe_dropped": np.float32(share / 2)})
        assert "capacity_factor" not in caplog.text
        log.train(2, {"loss": np.float32(6.0), "moe_dropped": np.float32((1 + share) / 2)})
    log.close()
    assert "step 2: MoE capacity dispatch dropped" in caplog.text
    assert "model.moe.capacity_factor or set model.moe.dispatch='dropless'" in caplog.text


def test_aux_losses_on_a_hand_made_routing():
    # 4 tokens, 4 experts, top-1: tokens pick experts 0, 0, 1, 2 (f = 1/2, 1/4, 1/4, 0).
    logits = np.array([[3.0, 1, 0, 0], [2.0, 0, 1, 0], [0.0, 2, 1, 0], [0.0, 1, 4, 1]], np.float32)
    spec_ = models.config.MoeSpec(num_experts=4, top_k=1, d_ff=8)
    r = moe.route(jnp.asarray(logits), spec_)
    got = moe.aux_losses(jnp.asarray(logits), r, 4)
    np.testing.assert_array_equal(np.asarray(r.idx_Txk)[:, 0], [0, 0, 1, 2])
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    f = np.array([0.5, 0.25, 0.25, 0.0])
    np.testing.assert_allclose(got["balance_loss"], 4 * np.sum(f * probs.mean(0)), rtol=1e-6)
    lse = np.log(np.exp(logits).sum(-1))
    np.testing.assert_allclose(got["z_loss"], np.mean(lse**2), rtol=1e-6)
    np.testing.assert_allclose(got[moe.LOAD], f, rtol=1e-6)
    np.testing.assert_allclose(got["load_max_over_mean"], 2.0, rtol=1e-6)
    entropy = -np.sum(probs * np.log(probs), -1).mean()
    np.testing.assert_allclose(got["router_entropy"], entropy, rtol=1e-5)


def test_sown_aux_loss_is_the_weighted_sum_and_gradients_reach_router_and_experts():
    cfg = moe_cfg(aux_loss_coef=0.5, z_loss_coef=0.25)
    variables, x = init_block(cfg)
    _, aux, metrics = apply_block(cfg, variables, x)
    want = 0.5 * metrics["balance_loss"] + 0.25 * metrics["z_loss"]
    np.testing.assert_allclose(aux, want, rtol=1e-6)

    def loss(params):
        y, sown = moe.MoeMlp(cfg).apply({"params": params}, x, mutable=[moe.MOE_LOSSES])
        return jnp.sum(y**2) + sown[moe.MOE_LOSSES]["aux_loss"][0]

    grads = jax.jit(jax.grad(loss))(variables["params"])
    for name in ("router", "experts_wi", "experts_wo"):
        g = np.asarray(grads[name]["kernel"])
        assert np.abs(g).max() > 0, name
    # Each expert that got tokens has a gradient (the sort hands each its own rows).
    used = set(np.asarray(reference_routes_idx(cfg, variables, x)).ravel())
    for e in range(cfg.moe.num_experts):
        assert (np.abs(np.asarray(grads["experts_wo"]["kernel"][e])).max() > 0) == (e in used)


def test_dispatch_and_unsort_gradients_are_gathers_equal_to_autodiff():
    """``ops.rows``' moves give autodiff's gradients of their plain gathers (empty slots and
    dropped pairs included), and the block's backward scatters no activation rows."""
    t, k = 6, 3
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((t, D)), jnp.float32)
    order = jnp.asarray(rng.permutation(t * k), jnp.int32)
    inv = jnp.argsort(order)
    g = jnp.asarray(rng.standard_normal((t * k, D)), jnp.float32)
    got = jax.vjp(lambda x: rows.repeat_rows(x, order // k, inv.reshape(t, k)), x)[1](g)[0]
    want = jax.vjp(lambda x: x[order // k], x)[1](g)[0]
    # A token's gradient sums its k = 3 rows of g in another order than autodiff's scatter-add:
    # two f32 roundings apart, at most 2 * 2^-24 * sum |g_j| (under 8e-7 for these rows).
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    got = jax.vjp(lambda y: rows.take_rows(y, inv, order), g)[1](g * 2)[0]
    want = jax.vjp(lambda y: y[inv], g)[1](g * 2)[0]
    np.testing.assert_array_equal(got, want)
    # Partial: 4 of 18 rows read nowhere (dropped) and 4 of 18 outputs empty (index past the
    # rows), as the expert-parallel buffers are.
    idx = np.asarray(order).copy()
    idx[rng.choice(t * k, 4, replace=False)] = t * k
    back = np.full(t * k, t * k)
    for b, a in enumerate(idx):
        if a < t * k:
            back[a] = b
    idx, back = jnp.asarray(idx), jnp.asarray(back)

    def plain(y):
        return jnp.where((idx < t * k)[:, None], y[jnp.minimum(idx, t * k - 1)], 0.0)

    y_out = rows.take_rows(g, idx, back)
    np.testing.assert_array_equal(y_out, plain(g))
    got = jax.vjp(lambda y: rows.take_rows(y, idx, back), g)[1](g * 3)[0]
    np.testing.assert_array_equal(got, jax.vjp(plain, g)[1](g * 3)[0])
    tok = jnp.where(idx < t * k, jnp.minimum(idx, t * k - 1) // k, t)
    slots = back.reshape(t, k)
    got = jax.vjp(lambda x: rows.repeat_rows(x, tok, slots), x)[1](g)[0]
    want = jax.vjp(lambda x: jnp.where((tok < t)[:, None], x[jnp.minimum(tok, t - 1)], 0.0), x)
    np.testing.assert_allclose(got, want[1](g)[0], rtol=1e-6, atol=1e-6)  # as above

    cfg = moe_cfg()
    variables, x = init_block(cfg)

    def loss(x):
        return jnp.sum(moe.MoeMlp(cfg).apply(variables, x, mutable=[moe.MOE_LOSSES])[0] ** 2)

    results = scatter_results(jax.jit(jax.grad(loss)).lower(x).as_text())
    assert results  # the router's small scatters are there: the scan sees the program
    assert not [r for r in results if re.search(rf"tensor<\d+x{D}x", r)], results


@pytest.mark.parametrize("dispatch", ["dropless", "capacity"])
def test_fp8_experts_on_the_padded_layout_equal_the_sorted_rows(dispatch):
    """At O1 with whole-tile widths the dispatch gathers the pairs straight into the padded
    layout the FP8 grouped GEMMs read (``ops.grouped.dispatch_layout``): the output, the
    gradients and every recorded amax equal those of the sorted rows' path (kernels off)."""
    c = train_lib.load_config("moe_tiny")
    c.fp8.level = "O1"
    c.model.update(d_model=128, num_heads=2, num_kv_heads=2)
    c.model.moe.update(num_experts=4, top_k=2, d_ff=128, dispatch=dispatch, capacity_factor=0.75)
    cfg = spec.parse(c).model
    block = moe.MoeMlp(cfg)
    x = jax.random.normal(jax.random.key(1), (B, L, 128), jnp.float32)
    variables = nn.unbox(block.init(jax.random.key(0), x))
    variables = {k: v for k, v in variables.items() if k in ("params", FP8)}
    n = B * L * 2  # token-expert pairs
    sizes = jnp.asarray([7, 0, 12, 13], jnp.int32)
    assert grouped.dispatch_layout(cfg.recipe, sizes, n, (128, 256), (128, 128)) is not None

    def step(params, state, x):
        def loss(params, x):
            y, new = block.apply({"params": params, FP8: state}, x, mutable=[FP8, moe.MOE_LOSSES])
            return jnp.sum(y.astype(jnp.float32) ** 2), new[FP8]

        (value, new_state), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
            params, x
        )
        return value, grads, new_state

    got = jax.jit(step)(variables["params"], variables[FP8], x)
    with grouped_mgpu.reference_only():  # a new function: jit's cache would return the padded
        want = jax.jit(lambda *a: step(*a))(variables["params"], variables[FP8], x)
    for a, b in zip(jax.tree.leaves(got[:2]), jax.tree.leaves(want[:2]), strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        # The same FP8 products (the padding rows add exact zeros), summed in another order:
        # within f32's rounding of sums of at most 128 terms (K = D or F; the wgrads' 32 pairs).
        bound = 128 * np.finfo(np.float32).eps * np.abs(b).max()
        np.testing.assert_allclose(a, b, rtol=0, atol=bound)
    for a, b in zip(jax.tree.leaves(got[2]), jax.tree.leaves(want[2]), strict=True):
        np.testing.assert_array_equal(a, b)  # x's, w's and dy's amaxes: the same bits


def test_block_scaled_experts_take_the_dispatched_layout():
    """The block recipe at 128-wide tiles: the dispatch writes the padded layout its grouped
    GEMMs read (no tile of rows spans two experts), and the layer's output and gradients are
    O0's within FP8 rounding (and not O0's: the GEMMs quantized)."""
    c = train_lib.load_config("moe_tiny")
    c.fp8.update(level="O1", recipe="block")
    c.model.update(d_model=128, num_heads=2, num_kv_heads=2)
    c.model.moe.update(num_experts=4, top_k=2, d_ff=128)
    cfg = spec.parse(c).model
    sizes = jnp.asarray([7, 0, 12, 13], jnp.int32)
    assert grouped.dispatch_layout(cfg.recipe, sizes, 32, (128, 256), (128, 128)) is not None
    x = jax.random.normal(jax.random.key(1), (B, L, 128), jnp.float32)

    def run(cfg):
        block = moe.MoeMlp(cfg)
        variables = nn.unbox(block.init(jax.random.key(0), x))

        def loss(params, x):
            v = {**variables, "params": params}
            y, _ = block.apply(v, x, mutable=[FP8, moe.MOE_LOSSES, moe.MOE_METRICS])
            return jnp.sum(y.astype(jnp.float32) * x)

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(variables["params"], x)

    (fp8_loss, (fp8_dp, fp8_dx)) = run(cfg)
    (o0_loss, (o0_dp, o0_dx)) = run(dataclasses.replace(cfg, recipe=None))
    experts = ("experts_wi", "experts_wo")
    for name in experts:
        err = rel_err(fp8_dp[name]["kernel"], o0_dp[name]["kernel"])
        assert MIN_ERR < err < GRAD_TOL, (name, err)
    assert MIN_ERR / 10 < rel_err(fp8_dx, o0_dx) < GRAD_TOL
    assert abs(float(fp8_loss) - float(o0_loss)) < FWD_TOL * abs(float(o0_loss))


def reference_routes_idx(cfg, variables, x):
    p = jax.tree.map(np.asarray, variables["params"])
    routes = reference_routes(np.asarray(x).reshape(-1, D), p, cfg.moe)
    return [experts for experts, _ in routes]


def tiny_run(level="O0", variant="softmax", **overrides):
    """configs/moe_tiny.py (``variant``) at ``level``: 1 block, 16-token rows, logging each step."""
    c = train_lib.load_config("moe_tiny", variant)
    c.fp8.level = level
    c.model.update(num_layers=2, vocab_size=320)
    c.update(seq_len=16, batch_size=4, warmup_steps=2, log_every_steps=1, sample_tokens=0)
    c.update(eval_batches=1, fp8_stats_every_steps=1000)
    for k, v in overrides.items():
        c[k] = v
    return c


def lm_batch(c, seed=0, weighted=False):
    rng = np.random.default_rng(seed)
    tok = rng.integers(0, c.model.vocab_size, (c.batch_size, c.seq_len + 1)).astype(np.int32)
    batch = {"inputs": tok[:, :-1], "targets": tok[:, 1:]}
    if weighted:  # a fine-tuning batch: loss on some tokens only (the sums add up)
        batch["weights"] = (rng.random(batch["targets"].shape) < 0.6).astype(np.float32)
    return batch


@pytest.mark.parametrize("accum, weighted", [(1, False), (2, False), (2, True)])
def test_step_trains_on_the_mean_aux_loss_over_micro_batches(accum, weighted):
    """The step's gradient is the objective's plus that of the layers' auxiliary losses, each a
    mean over a micro-batch, averaged over the micro-batches (a wrong sign or scale fails)."""
    c = tiny_run()
    c.model.moe.update(aux_loss_coef=0.5, z_loss_coef=0.0)
    run = spec.parse(c)
    model = models.build_model(run.model)
    plain = models.build_model(
        dataclasses.replace(run.model, moe=dataclasses.replace(run.model.moe, aux_loss_coef=0.0))
    )
    batch = jax.tree.map(jnp.asarray, lm_batch(c, weighted=weighted))
    params = nn.unbox(model.init(jax.random.key(0), batch["inputs"]))["params"]

    @jax.jit
    def grads(params):
        _, _, g = step_lib.batch_gradients(model, params, {}, batch, accum)
        _, _, g0 = step_lib.batch_gradients(plain, params, {}, batch, accum)
        return jax.tree.map(jnp.subtract, g, g0)

    def aux(params):  # mean over the micro-batches of the layers' summed aux losses
        total = 0.0
        for inputs in jnp.split(batch["inputs"], accum):
            _, sown = model.apply({"params": params}, inputs, mutable=[moe.MOE_LOSSES])
            total += jnp.sum(sown[moe.MOE_LOSSES]["blocks"]["mlp"]["aux_loss"][0])
        return total / accum

    want = jax.jit(jax.grad(aux))(params)["blocks"]["mlp"]["router"]["kernel"]
    got = grads(params)["blocks"]["mlp"]["router"]["kernel"]
    assert np.abs(want).max() > 0
    np.testing.assert_allclose(got, want, atol=2e-6 * float(np.abs(want).max()), rtol=1e-3)


def test_sigmoid_router_bias_steps_against_the_load():
    c = tiny_run(variant="sigmoid")
    env = train_lib.setup(spec.parse(c), donate=False)
    state = env.init(jax.random.PRNGKey(0))
    bias0 = np.asarray(state.moe_state["blocks"]["mlp"]["router"]["bias"])
    assert bias0.shape == (2, 8) and not bias0.any()
    batch = lm_batch(c)
    # The loads the step sees: each layer's expert shares at the step's params.
    variables = {"params": master.materialize(state.params), moe.MOE_STATE: state.moe_state}
    _, sown = env.model.apply(variables, batch["inputs"], mutable=[moe.MOE_METRICS])
    load = np.asarray(sown[moe.MOE_METRICS]["blocks"]["mlp"][moe.LOAD][0])
    state, metrics = env.train_step(state, batch)
    bias = np.asarray(state.moe_state["blocks"]["mlp"]["router"]["bias"])
    rate = c.model.moe.bias_update_rate
    np.testing.assert_allclose(bias, rate * np.sign(load.mean(-1, keepdims=True) - load))
    assert np.abs(bias).max() == rate  # some experts are over or under their share
    assert "moe_balance_loss_1" in metrics and "moe_load" not in metrics


@pytest.mark.parametrize("level", ["O0", "O1"])
def test_moe_tiny_trains_end_to_end_and_logs_its_routing(level, tmp_path):
    c = tiny_run(level, num_train_steps=8, eval_every_steps=8, checkpoint_every_steps=8)
    c.learning_rate = 1e-2
    summary = train_lib.train_and_evaluate(c, str(tmp_path))
    assert summary["step"] == 8 and np.isfinite(summary["val_loss"])
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r and "grad_norm" in r]
    assert len(train) == 8
    losses = [r["loss"] for r in train]
    assert np.isfinite(losses).all() and np.mean(losses[-2:]) < np.mean(losses[:2]), losses
    for name in ("load_max_over_mean", "router_entropy", "balance_loss", "z_loss"):
        per_layer = [train[-1][f"moe_{name}_{i}"] for i in range(2)]
        np.testing.assert_allclose(train[-1][f"moe_{name}"], np.mean(per_layer), rtol=1e-6)
    assert 1.0 <= train[-1]["moe_load_max_over_mean"] <= 8.0


def test_o2_stores_expert_kernels_as_matmul_weights_and_the_router_in_f32():
    c = tiny_run("O2")
    c.model.moe.update(shared_d_ff=16, shared_gate=True)
    env = train_lib.setup(spec.parse(c), donate=False)
    state = jax.eval_shape(env.init, jax.random.PRNGKey(0))
    mlp = state.params["blocks"]["mlp"]
    for name in ("experts_wi", "experts_wo"):
        kernel = mlp[name]["kernel"]
        assert master.is_scaled(kernel) and kernel.data.dtype == jnp.float16, name
    assert mlp["experts_wi"]["kernel"].data.shape == (2, 8, 64, 2, 64)
    assert master.is_scaled(mlp["shared"]["wi"]["kernel"])
    for name in ("router", "shared_gate"):
        kernel = mlp[name]["kernel"]
        assert not master.is_scaled(kernel) and kernel.dtype == jnp.float32, name
    # Adam's moments: FP8/FP16 with scales for the experts, plain f32 for the router.
    leaves = jax.tree_util.tree_flatten_with_path(state.opt_state, is_leaf=master.is_scaled)[0]
    router = [x for p, x in leaves if "router" in jax.tree_util.keystr(p)]
    experts = [x for p, x in leaves if "experts_wo" in jax.tree_util.keystr(p)]
    assert router and all(not master.is_scaled(x) and x.dtype == jnp.float32 for x in router)
    assert experts and all(master.is_scaled(x) for x in experts)


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        ({"model.moe.top_k": 9}, "model.moe.top_k=9 exceeds model.moe.num_experts=8"),
        ({"model.moe.num_experts": 0}, "model.style='moe' routes tokens to experts"),
        ({"model.style": "llama"}, "model.style='llama' has a dense MLP"),
        ({"model.moe.capacity_factor": 0.0}, "model.moe.capacity_factor"),
    ],
)
def test_bad_moe_settings_are_one_line(overrides, fragment):
    c = train_lib.load_config("moe_tiny")
    for k, v in overrides.items():
        section, _, field = k.rpartition(".")
        node = c
        for part in section.split("."):
            node = node[part]
        node[field] = v
    with pytest.raises(errors.ConfigError) as e:
        spec.parse(c)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_layer_metrics_and_bias_update_keep_block_order_without_scan():
    """Unscanned blocks are layers in block order (block_2 before block_10), both ways."""
    names = [f"block_{i}" for i in range(12)]
    sown = {n: {"mlp": {"z_loss": (jnp.float32(i),)}} for i, n in enumerate(names)}
    np.testing.assert_array_equal(moe.layer_metrics(sown, scanned=False)["z_loss"], range(12))
    state = {n: {"mlp": {"router": {"bias": jnp.zeros(3)}}} for n in names}
    loads = jnp.asarray([[0.5, 0.25, 0.25]] * 11 + [[0.2, 0.2, 0.6]])  # the last layer differs
    new = moe.update_bias(state, loads, 0.1, scanned=False)
    np.testing.assert_allclose(new["block_11"]["mlp"]["router"]["bias"], [0.1, 0.1, -0.1])
    np.testing.assert_allclose(new["block_2"]["mlp"]["router"]["bias"], [-0.1, 0.1, 0.1])


def test_routing_metrics_do_not_depend_on_how_the_batch_is_split():
    """Micro-batches average the per-token metrics and sum the loads: the step reports those of
    the whole batch whatever grad_accum_steps."""
    got = []
    for accum in (1, 2):
        c = tiny_run(grad_accum_steps=accum)
        env = train_lib.setup(spec.parse(c), donate=False)
        state = env.init(jax.random.PRNGKey(0))
        got.append(jax.device_get(env.train_step(state, lm_batch(c))[1]))
    one, two = got
    for name in ("load_max_over_mean", "router_entropy", "z_loss"):
        for key in (f"moe_{name}", f"moe_{name}_0", f"moe_{name}_1"):
            np.testing.assert_allclose(two[key], one[key], rtol=1e-5, err_msg=key)
    assert one["moe_load_max_over_mean_0"] > 1.0  # not balanced by construction
