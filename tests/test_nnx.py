"""NNX callables: Linear/Einsum accuracy, exact state updates, reuse by max, the jitted step."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import fp8jax
from fp8jax.nn import nnx as fnnx

from fp8_testing import (
    E4M3_MAX,
    E5M2_MAX,
    FWD_TOL,
    GRAD_TOL,
    MIN_ERR,
    amax,
    f32_div,
    nnx_grads,
    randn,
    rel_err,
)

grad_step = nnx.jit(nnx_grads)  # output, param grads, FP8 state grads (state written back)


@nnx.jit
def ref_step(model, x, r):
    def loss(model):
        y = model(x)
        return jnp.sum(y * r), y

    with jax.default_matmul_precision("highest"):
        (_, y), grads = nnx.value_and_grad(loss, has_aux=True)(model)
    return y, grads


def check_against_reference(model, ref, x, r):
    """Step 1 sets the scales, step 2 is compared with the f32 twin (same parameters)."""
    nnx.update(ref, nnx.state(model, nnx.Param))
    _, _, fp8_grads = grad_step(model, x, r)
    fnnx.update_fp8_state(model, fp8_grads)
    y, grads, _ = grad_step(model, x, r)
    y_ref, grads_ref = ref_step(ref, x, r)
    assert MIN_ERR < rel_err(y, y_ref) < FWD_TOL
    assert rel_err(grads["kernel"][...], grads_ref["kernel"][...]) < GRAD_TOL
    assert rel_err(grads["bias"][...], grads_ref["bias"][...]) < 1e-6  # bias: no GEMM


def test_linear_fwd_and_grads_vs_f32():
    model = nnx.Linear(32, 24, dot_general=fnnx.Fp8DotGeneral(), rngs=nnx.Rngs(0))
    ref = nnx.Linear(32, 24, rngs=nnx.Rngs(1))
    check_against_reference(model, ref, randn(0, (16, 32)), randn(1, (16, 24), 1e-3))


def test_einsum_fwd_and_grads_vs_f32():
    eq = "bsd,dhk->bshk"  # b batch, s sequence, d model, h heads, k head dim
    model = nnx.Einsum(eq, (16, 3, 5), (3, 5), einsum_op=fnnx.Fp8Einsum(), rngs=nnx.Rngs(0))
    ref = nnx.Einsum(eq, (16, 3, 5), (3, 5), rngs=nnx.Rngs(1))
    check_against_reference(model, ref, randn(2, (2, 4, 16)), randn(3, (2, 4, 3, 5), 1e-3))


def test_state_update_is_exact_and_kept_out_of_param_grads():
    model = nnx.Linear(16, 8, use_bias=False, dot_general=fnnx.Fp8DotGeneral(), rngs=nnx.Rngs(0))
    x, r = randn(4, (4, 16)), randn(5, (4, 8), 1e-2)
    _, param_grads, fp8_grads = grad_step(model, x, r)
    assert not jax.tree.leaves(nnx.state(param_grads, fnnx.Fp8State))
    assert set(jax.tree.leaves(nnx.state(param_grads, nnx.Param))[0].shape) == {16, 8}
    meta = model.dot_general.meta.get_value()  # the forward's amax was written back
    kernel = model.kernel[...]
    assert float(meta.x.amax_history[0]) == amax(x)
    assert float(meta.w.amax_history[0]) == amax(kernel)
    (g_meta,) = jax.tree.leaves(fp8_grads, is_leaf=lambda m: isinstance(m, fp8jax.Fp8Meta))
    assert float(g_meta.dy.amax_history[0]) == amax(r)
    fnnx.update_fp8_state(model, fp8_grads)
    new = model.dot_general.meta.get_value()
    for s, a, fmax in ((new.x, amax(x), E4M3_MAX), (new.dy, amax(r), E5M2_MAX)):
        assert float(s.amax_history[1]) == a and float(s.amax_history[0]) == 0.0
        assert float(s.scale) == f32_div(fmax, a)


class Shared(nnx.Module):
    """One Linear applied to two inputs: its state must see the max, not the sum."""

    def __init__(self):
        self.dense = nnx.Linear(
            16, 8, use_bias=False, dot_general=fnnx.Fp8DotGeneral(), rngs=nnx.Rngs(0)
        )

    def __call__(self, x):
        return jnp.stack([self.dense(x[0]), self.dense(x[1])])


def test_shared_module_and_micro_batches_take_max_not_sum():
    model = Shared()
    x = jnp.stack([randn(6, (4, 16)), randn(7, (4, 16), 3.0)])
    r = jnp.stack([randn(8, (4, 8), 5.0), randn(9, (4, 8))])
    _, _, fp8_grads = grad_step(model, x, r)
    meta = model.dense.dot_general.meta.get_value()
    x_own, dy_own = [amax(x[0]), amax(x[1])], [amax(r[0]), amax(r[1])]
    assert float(meta.x.amax_history[0]) == max(x_own) < sum(x_own)
    fnnx.merge_fp8_grads(model, fp8_grads)
    assert float(model.dense.dot_general.meta.get_value().dy.amax_history[0]) == max(dy_own)
    # A second micro-batch with a larger dy, then one commit: the step's amax is the max.
    r2 = 2 * r
    _, _, fp8_grads = grad_step(model, x, r2)
    fnnx.merge_fp8_grads(model, fp8_grads)
    fnnx.commit_fp8_state(model)
    new = model.dense.dot_general.meta.get_value()
    assert float(new.dy.last_amax) == 2 * max(dy_own) < 3 * max(dy_own)
    assert float(new.x.last_amax) == max(x_own)


def test_eval_mode_records_nothing():
    model = nnx.Linear(16, 8, dot_general=fnnx.Fp8DotGeneral(), rngs=nnx.Rngs(0))
    x = randn(10, (4, 16))
    model.eval()
    y_eval = nnx.jit(lambda m, x: m(x))(model, x)
    assert float(jnp.sum(model.dot_general.meta.get_value().x.amax_history)) == 0.0
    model.train()
    y_train = nnx.jit(lambda m, x: m(x))(model, x)
    assert float(model.dot_general.meta.get_value().x.amax_history[0]) == amax(x)
    np.testing.assert_array_equal(y_eval, y_train)


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(16, 32, dot_general=fnnx.Fp8DotGeneral(), rngs=rngs)
        self.down = nnx.Einsum("bf,fd->bd", (32, 16), einsum_op=fnnx.Fp8Einsum(), rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))


def test_jitted_train_step_traces_once_and_updates_everything():
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    x, y = randn(11, (8, 16)), randn(12, (8, 16))

    @nnx.jit
    @chex.assert_max_traces(n=1)
    def train_step(model, optimizer, x, y):
        def loss_fn(model):
            return jnp.mean((model(x) - y) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn, argnums=fnnx.diff_state())(model)
        param_grads, fp8_grads = fnnx.split_grads(grads)
        optimizer.update(model, param_grads)
        fnnx.update_fp8_state(model, fp8_grads)
        return loss

    kernel0 = model.up.kernel[...]
    losses = [float(train_step(model, optimizer, x, y)) for _ in range(3)]
    chex.clear_trace_counter()
    assert losses[2] < losses[0]
    assert not np.allclose(model.up.kernel[...], kernel0)
    for op in (model.up.dot_general, model.down.einsum_op):
        meta = op.meta.get_value()
        # 3 committed steps, each with a usable amax, and scales derived from them.
        assert np.all(np.asarray(meta.x.amax_history[1:4]) > 0)
        assert np.all(np.asarray(meta.dy.amax_history[1:4]) > 0)
        assert float(meta.dy.scale) == f32_div(E5M2_MAX, np.max(meta.dy.amax_history[1:]))
