"""A sigmoid router's balancing bias (``TrainState.moe_state``) wherever a model runs outside
the train step: evaluation, scoring and generation of a trained work dir, DPO's reference."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from fp8jax import errors, models, spec
from fp8jax.models import moe
from fp8jax.trainer import checkpoint, data, dpo_data, generate, inference, scoring
from fp8jax.trainer import loop as train_lib
from fp8jax.trainer import loss as loss_lib
from fp8jax.trainer import step as step_lib
from fp8jax.trainer.objectives import dpo

RATE = 0.05  # a bias step large enough to change routing within a few steps


def bias_of(tree):
    return np.asarray(tree["blocks"]["mlp"]["router"]["bias"])


@pytest.fixture(scope="module")
def sigmoid_workdir(tmp_path_factory):
    """3 steps of configs/moe_tiny.py:sigmoid (shrunk, a large bias step), checkpointed."""
    c = train_lib.load_config("moe_tiny", "sigmoid")
    c.model.update(num_layers=2, vocab_size=320)
    c.model.moe.bias_update_rate = RATE
    c.update(seq_len=16, batch_size=4, warmup_steps=1, sample_tokens=0, eval_batches=2)
    c.update(num_train_steps=3, eval_every_steps=3, checkpoint_every_steps=3)
    c.update(compilation_cache_dir="")
    wd = tmp_path_factory.mktemp("moe_state") / "wd"
    train_lib.train_and_evaluate(c, str(wd))
    return wd, c


def test_a_work_dir_evaluates_scores_and_generates_with_its_trained_biases(sigmoid_workdir):
    """``inference.load`` brings the checkpoint's biases; its evaluation equals the trainer's
    eval step on the trainer's validation batches and differs with the biases zeroed;
    scoring and generation run with them."""
    wd, c = sigmoid_workdir
    run = spec.parse(c)
    env = train_lib.setup(run)
    ckpt = checkpoint.Checkpointer(str(wd))
    state, _ = ckpt.restore(checkpoint.abstract_like(env.abstract, env.state_shardings))
    ckpt.close()
    dataset = data.build(run, str(wd))
    trainer = env.objective.evaluate(env.eval_step, state, dataset.eval_batches(2), None)

    inf = inference.load(str(wd))
    trained = bias_of(jax.device_get(state.moe_state))
    assert np.abs(trained).max() > 0  # stepped by the training
    np.testing.assert_array_equal(bias_of(inf.moe_state), trained)
    assert not any(x.committed for x in jax.tree.leaves(inf.moe_state))  # follows the params
    tokens = np.asarray(dataset.val_tokens)
    ours = inference.evaluate(inf, tokens, 4, 16, 2)
    assert ours["loss"] == pytest.approx(trainer["val_loss"], rel=1e-6)
    zeroed = jax.tree.map(jnp.zeros_like, inf.moe_state)
    fresh = inference.evaluate(
        inference.Inference(**{**vars(inf), "moe_state": zeroed}), tokens, 4, 16, 2
    )
    assert fresh["loss"] != ours["loss"]  # the biases route differently

    scorer = scoring.scorer_for(inf.model.cfg, step_lib.state_collection(inf.model), 2)
    requests = [(tokens[:6].tolist(), tokens[6:9].tolist())]
    ((logp, _),) = scorer(inf.params, inf.fp8_state, requests, inf.moe_state)
    ((logp0, _),) = scorer(inf.params, inf.fp8_state, requests, zeroed)
    assert math.isfinite(logp) and logp != logp0
    (text,) = generate.generate(
        inf.model, inf.params, inf.fp8_state, inf.tokenizer, ["It is"], 3, moe_state=inf.moe_state
    )
    assert isinstance(text, str)


def test_init_from_a_work_dir_starts_from_its_trained_biases(
    sigmoid_workdir, tmp_path, monkeypatch
):
    """A run ``init_from`` the work dir starts from its checkpoint's biases (in the run's own
    scan layout), not zeros; a model of other experts than those biases is refused."""
    wd, c = sigmoid_workdir
    source = inference.load(str(wd))
    trained = moe.stacked_bias(source.moe_state, source.model.cfg.scan_layers)
    assert np.abs(trained).max() > 0  # stepped by the training
    seen = []
    built = train_lib.setup

    def spy(run, *args, **kwargs):  # the fine-tuning run's initial state, as built
        env = built(run, *args, **kwargs)

        def init(*a, **k):
            state = env.init(*a, **k)
            seen.append(jax.device_get(state.moe_state))
            return state

        return dataclasses.replace(env, init=init)

    monkeypatch.setattr(train_lib, "setup", spy)
    tuned = c.copy_and_resolve_references()
    tuned.init_from = str(wd)
    tuned.model.scan_layers = not source.model.cfg.scan_layers  # the biases change layout
    tuned.update(num_train_steps=1, eval_every_steps=1, checkpoint_every_steps=1)
    train_lib.train_and_evaluate(tuned, str(tmp_path / "tuned"))
    (initial,) = seen
    np.testing.assert_array_equal(moe.stacked_bias(initial, tuned.model.scan_layers), trained)

    other = c.copy_and_resolve_references()
    other.init_from = str(wd)
    other.model.moe.num_experts = c.model.moe.num_experts // 2
    layers, experts = trained.shape
    with pytest.raises(
        errors.ConfigError,
        match=rf"holds router biases of {layers} layers x {experts} experts, the model "
        rf"{layers} x {experts // 2}: point init_from at",
    ):
        train_lib.init_moe_state(spec.parse(other))


def test_dpo_reference_keeps_the_initial_biases_of_an_moe_policy(tmp_path):
    """The reference holds a copy of the initial biases and runs with them while the policy's
    step on: step 0's loss is log 2, later reference log-probs are those of the initial model."""
    c = train_lib.load_config("dpo_tiny")
    c.model.update(style="moe", num_layers=1, d_model=32, num_heads=2, num_kv_heads=2)
    c.model.moe.update(num_experts=4, top_k=2, d_ff=32, router="sigmoid")
    c.model.moe.update(bias_update_rate=RATE, aux_loss_coef=0.0)
    c.update(batch_size=8, seq_len=32, compilation_cache_dir="")
    c.model.max_len = 32
    run = spec.parse(c)
    ds = dpo_data.build(run, tmp_path)
    env = train_lib.setup(run, donate=False)
    state = env.init(jax.random.PRNGKey(0))
    initial = jax.device_get(state)
    np.testing.assert_array_equal(bias_of(initial.objective[moe.MOE_STATE]), 0.0)
    it = ds.train_iter()
    batch = next(it)
    at_zero = env.objective.evaluate(env.eval_step, state, [batch], env.batch_sharding)
    assert at_zero["val_loss"] == pytest.approx(math.log(2), rel=1e-7)
    state, _ = env.train_step(state, next(it))
    stepped = jax.device_get(state.moe_state)
    assert np.abs(bias_of(stepped)).max() > 0  # the policy's biases stepped
    state, metrics = env.train_step(state, next(it))
    assert math.isfinite(float(metrics["loss"]))
    ref = jax.device_get(state.objective)
    np.testing.assert_array_equal(bias_of(ref[moe.MOE_STATE]), 0.0)  # frozen

    got, _ = dpo.reference_logps(env.model, state.objective, batch, update=False)
    variables = {
        "params": initial.objective["params"],
        step_lib.state_collection(env.model): ref["fp8"],  # its scales as the steps left them
        moe.MOE_STATE: initial.moe_state,
    }
    kwargs = loss_lib.loss_kwargs(batch)
    want = loss_lib.response_logps(
        env.model.apply(variables, batch["inputs"], **kwargs), batch["weights"]
    )
    np.testing.assert_allclose(got, want, rtol=1e-6)
    moved = {**variables, moe.MOE_STATE: stepped}
    other = loss_lib.response_logps(
        env.model.apply(moved, batch["inputs"], **kwargs), batch["weights"]
    )
    assert not np.allclose(other, want, rtol=1e-6)  # the policy's biases would route otherwise
    env.objective.evaluate(env.eval_step, state, [batch], env.batch_sharding)


def test_dpo_reference_stores_the_router_and_shared_gate_in_f32():
    """bf16 reference weights but the router's and shared gate's f32 kernels (f32 logits)."""
    c = train_lib.load_config("moe_tiny")
    c.model.update(num_layers=1, d_model=32, num_heads=2, num_kv_heads=2)
    c.model.moe.update(num_experts=4, d_ff=16, shared_d_ff=16, shared_gate=True)
    model = models.build_model(spec.parse(c).model)
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]
    ref = dpo.reference_params(nn.unbox(params), jnp.bfloat16)
    mlp = ref["blocks"]["mlp"]
    assert mlp["router"]["kernel"].dtype == mlp["shared_gate"]["kernel"].dtype == jnp.float32
    for name in ("experts_wi", "experts_wo"):
        assert mlp[name]["kernel"].dtype == jnp.bfloat16, name
    assert ref["blocks"]["attn"]["q"]["kernel"].dtype == jnp.bfloat16
