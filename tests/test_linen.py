"""Linen modules: accuracy vs plain Flax, exact state updates, reuse (max not sum), scan, remat."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

import fp8jax
from fp8jax import FP8, FP8_STATS, Fp8DotGeneral
from fp8jax.diagnostics.coverage import coverage_report
from fp8jax.nn.linen import fp8_scan
from fp8jax.ops import formats

from fp8_testing import (
    E4M3_MAX,
    E5M2_MAX,
    FWD_TOL,
    GRAD_TOL,
    MIN_ERR,
    amax,
    f32_div,
    randn,
    rel_err,
)


def metas(tree) -> list[fp8jax.Fp8Meta]:
    return jax.tree.leaves(tree, is_leaf=lambda m: isinstance(m, fp8jax.Fp8Meta))


def init(model, *args):
    """Jitted init: one compile instead of running the forward pass op by op."""
    return jax.jit(model.init)(jax.random.key(0), *args)


def grad_step(model):
    """jit: y, fp8 state after the forward, and grads of sum(y * r) w.r.t. params, fp8, x."""

    @jax.jit
    def step(variables, x, r):
        def loss(params, fp8, x):
            y, mutated = model.apply({"params": params, FP8: fp8}, x, mutable=[FP8])
            return jnp.sum(y * r), (y, mutated[FP8])

        (_, (y, fp8_fwd)), grads = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(
            variables["params"], variables[FP8], x
        )
        return y, fp8_fwd, *grads

    return step


def ref_grads(model, params, x, r):
    """f32 reference: y and grads of sum(y * r) w.r.t. params and x."""
    y, vjp = jax.vjp(lambda p, x: model.apply({"params": p}, x), params, x)
    return y, *vjp(r)


def check_against_reference(fp8_model, ref_model, x, r_scale=1e-3):
    """Two FP8 train steps (the first sets the scales), then compare with the f32 model."""
    variables = init(fp8_model, x)
    step = grad_step(fp8_model)
    y0 = jax.eval_shape(lambda: fp8_model.apply(variables, x))
    r = randn(1, y0.shape, r_scale)
    _, fwd, _, g_fp8, _ = step(variables, x, r)
    variables = {**variables, FP8: fp8jax.update_state(fwd, g_fp8)}
    y, _, g_params, _, g_x = step(variables, x, r)
    with jax.default_matmul_precision("highest"):
        y_ref, gp_ref, gx_ref = jax.jit(ref_grads, static_argnums=0)(
            ref_model, variables["params"], x, r
        )
    assert MIN_ERR < rel_err(y, y_ref) < FWD_TOL
    assert MIN_ERR < rel_err(g_x, gx_ref) < GRAD_TOL
    errs = jax.tree_util.tree_map_with_path(
        lambda path, g, g_ref: (jax.tree_util.keystr(path), rel_err(g, g_ref)), g_params, gp_ref
    )
    for name, err in jax.tree.leaves(errs, is_leaf=lambda e: isinstance(e, tuple)):
        assert err < (1e-6 if "bias" in name else GRAD_TOL), (name, err)  # bias: no GEMM


def test_dense_fwd_and_grads_vs_f32():
    x = randn(0, (16, 32))
    check_against_reference(nn.Dense(24, dot_general_cls=Fp8DotGeneral), nn.Dense(24), x)


def test_dense_general_multi_axis_vs_f32():
    # [B, S, N, H] contracted over (N, H) into features (E, F): two contracting, two free axes.
    kw = dict(features=(6, 5), axis=(-2, -1))
    x = randn(2, (2, 3, 4, 8))
    fp8_model = nn.DenseGeneral(**kw, dot_general_cls=Fp8DotGeneral)
    check_against_reference(fp8_model, nn.DenseGeneral(**kw), x)


def test_einsum_module_vs_jnp_einsum():
    eq = "bsd,dhk->bshk"  # b batch, s sequence, d model, h heads, k head dim
    fp8_model = fp8jax.Einsum(shape=(16, 3, 5), einsum_str=eq, use_bias=True)
    ref_model = fp8jax.Einsum(shape=(16, 3, 5), einsum_str=eq, use_bias=True, recipe=None)
    check_against_reference(fp8_model, ref_model, randn(3, (2, 4, 16)))


def test_train_step_state_update_is_exact():
    model = nn.Dense(8, use_bias=False, dot_general_cls=Fp8DotGeneral)
    x, r = randn(4, (4, 16)), randn(5, (4, 8), 1e-2)
    variables = init(model, x)
    _, fwd, _, g_fp8, _ = grad_step(model)(variables, x, r)
    (m_fwd,), (m_grad,) = metas(fwd), metas(g_fp8)
    kernel = variables["params"]["kernel"]
    assert float(m_fwd.x.amax_history[0]) == amax(x)
    assert float(m_fwd.w.amax_history[0]) == amax(kernel)
    assert float(m_grad.dy.amax_history[0]) == amax(r)
    (new,) = metas(fp8jax.update_state(fwd, g_fp8))
    for s, a, fmax in ((new.x, amax(x), E4M3_MAX), (new.w, amax(kernel), E4M3_MAX)):
        assert float(s.amax_history[1]) == a and float(s.amax_history[0]) == 0.0
        assert float(s.scale) == f32_div(fmax, a)
    assert float(new.dy.scale) == f32_div(E5M2_MAX, amax(r))


class Shared(nn.Module):
    """One Dense applied to two inputs (weight sharing): its state must see max, not sum."""

    @nn.compact
    def __call__(self, x):
        dense = nn.Dense(8, use_bias=False, dot_general_cls=Fp8DotGeneral)
        return jnp.stack([dense(x[0]), dense(x[1])])


def test_shared_module_called_twice_takes_max_not_sum():
    x = jnp.stack([randn(6, (4, 16)), randn(7, (4, 16), 3.0)])
    r = jnp.stack([randn(8, (4, 8), 5.0), randn(9, (4, 8))])  # dy of call 0 is the larger
    model = Shared()
    variables = init(model, x)
    _, fwd, _, g_fp8, _ = grad_step(model)(variables, x, r)
    (m_fwd,), (m_grad,) = metas(fwd), metas(g_fp8)
    x_own, dy_own = [amax(x[0]), amax(x[1])], [amax(r[0]), amax(r[1])]  # each call's own
    assert float(m_fwd.x.amax_history[0]) == max(x_own) < sum(x_own)
    assert float(m_grad.dy.amax_history[0]) == max(dy_own) < sum(dy_own)


def test_grad_accumulation_merges_micro_batches_by_max():
    model = nn.Dense(8, use_bias=False, dot_general_cls=Fp8DotGeneral)
    xs = [randn(10, (4, 16), 2.0), randn(11, (4, 16))]
    rs = [randn(12, (4, 8)), randn(13, (4, 8), 4.0)]
    variables = init(model, xs[0])
    step, fp8 = grad_step(model), variables[FP8]
    for x, r in zip(xs, rs, strict=True):  # the state threads through the micro-batches
        _, fwd, _, g_fp8, _ = step({**variables, FP8: fp8}, x, r)
        fp8 = fp8jax.merge_grads(fwd, g_fp8)
    (new,) = metas(fp8jax.commit(fp8))
    x_own, dy_own = [amax(x) for x in xs], [amax(r) for r in rs]
    assert float(new.x.last_amax) == max(x_own) < sum(x_own)
    assert float(new.dy.last_amax) == max(dy_own) < sum(dy_own)
    assert float(new.dy.scale) == f32_div(E5M2_MAX, max(dy_own))


class Block(nn.Module):
    """A residual Dense block for the scan tests."""

    @nn.compact
    def __call__(self, h, _):
        y = nn.Dense(16, use_bias=False, dot_general_cls=Fp8DotGeneral)(h)
        return h + jnp.tanh(y), None


class ReusedScan(nn.Module):
    """One Block (one weight) applied 3 times through ``fp8_scan``."""

    @nn.compact
    def __call__(self, x):
        scan = fp8_scan(Block, variable_broadcast="params", split_rngs={"params": False}, length=3)
        return scan(name="block")(x, None)[0]


@jax.jit
def _replay_reused(kernel, meta, x, r):
    """The 3 calls of ReusedScan unrolled: each call's own input and output-gradient amax."""

    def net(eps):  # eps [3, B, D]: a zero added to each call's output exposes its dy
        h, m, x_amax = x, meta, []
        for i in range(3):
            x_amax.append(formats.amax(h))
            y, m = fp8jax.dot_general(h, kernel, (((1,), (0,)), ((), ())), m)
            h = h + jnp.tanh(y + eps[i])
        return jnp.sum(h * r), jnp.stack(x_amax)

    dy, x_amax = jax.grad(net, has_aux=True)(jnp.zeros((3, *x.shape)))
    return x_amax, jnp.max(jnp.abs(dy), axis=(1, 2))


def test_scan_reused_layer_carries_state_and_takes_max():
    x, r = randn(14, (4, 16)), randn(15, (4, 16))
    scanned = ReusedScan()
    variables = init(scanned, x)
    y_train, fwd, _, g_fp8, _ = grad_step(scanned)(variables, x, r)
    (m_fwd,), (m_grad,) = metas(fwd), metas(g_fp8)
    kernel = variables["params"]["block"]["Dense_0"]["kernel"]
    x_own, dy_own = _replay_reused(kernel, metas(variables[FP8])[0], x, r)
    assert float(m_fwd.x.amax_history[0]) == pytest.approx(float(x_own.max()), rel=1e-6)
    assert float(m_grad.dy.amax_history[0]) == pytest.approx(float(dy_own.max()), rel=1e-6)
    # The 3 calls differ enough that a sum (or a mean) would be caught.
    for own in (x_own, dy_own):
        assert float(own.max()) < 0.9 * float(own.sum()) and float(own.min()) < 0.9 * own.max()
    # Evaluation (fp8_state not mutable) broadcasts the state and matches the training forward.
    np.testing.assert_allclose(jax.jit(scanned.apply)(variables, x), y_train, rtol=1e-6)


def test_plain_scan_cannot_write_broadcast_state():
    # Why fp8_scan exists: Flax refuses loop-dependent writes to a broadcast collection.
    scan = nn.scan(
        Block, variable_broadcast=["params", FP8], split_rngs={"params": False}, length=2
    )
    model = scan()
    x = randn(16, (2, 16))
    variables = init(model, x, None)
    with pytest.raises(ValueError, match="broadcasted variable has a data dependency"):
        model.apply(variables, x, None, mutable=[FP8])


def test_scan_variable_axes_gives_per_layer_states():
    layers = nn.scan(
        Block,
        variable_axes={"params": 0, FP8: 0},
        split_rngs={"params": True},
        length=3,
    )
    model = layers()
    x, r = randn(17, (4, 16)), randn(18, (4, 16), 1e-2)
    variables = init(model, x, None)
    (m0,) = metas(variables[FP8])
    assert m0.x.scale.shape == (3,) and m0.x.amax_history.shape == (3, 17)

    @jax.jit
    def step(variables):
        def loss(params, fp8):
            (y, _), mut = model.apply({"params": params, FP8: fp8}, x, None, mutable=[FP8])
            return jnp.sum(y * r), mut[FP8]

        return jax.value_and_grad(loss, (0, 1), has_aux=True)(variables["params"], variables[FP8])

    (_, fwd), (_, g_fp8) = step(variables)
    (new,) = metas(fp8jax.update_state(fwd, g_fp8))

    # Layer l's state saw layer l's input only: replay the layers one by one.
    @jax.jit
    def replay(kernels_LxDxD, meta):
        h, x_own = x, []
        for layer in range(3):
            x_own.append(formats.amax(h))
            m = jax.tree.map(lambda a, i=layer: a[i], meta)
            y, _ = fp8jax.dot_general(h, kernels_LxDxD[layer], (((1,), (0,)), ((), ())), m)
            h = h + jnp.tanh(y)
        return jnp.stack(x_own)

    x_own = replay(variables["params"]["Dense_0"]["kernel"], m0)
    np.testing.assert_allclose(new.x.last_amax, x_own, rtol=1e-6)
    assert len(set(np.asarray(new.x.last_amax).tolist())) == 3  # really per layer
    np.testing.assert_allclose(new.x.scale, E4M3_MAX / np.asarray(x_own), rtol=1e-6)
    assert np.all(np.asarray(new.dy.last_amax) > 0)


class MLP(nn.Module):
    remat: bool = False

    @nn.compact
    def __call__(self, x):
        dense = nn.remat(nn.Dense) if self.remat else nn.Dense
        h = jax.nn.gelu(dense(32, dot_general_cls=Fp8DotGeneral, name="Dense_0")(x))
        return dense(16, dot_general_cls=Fp8DotGeneral, name="Dense_1")(h)


def test_remat_gives_identical_outputs_grads_and_state():
    x, r = randn(19, (4, 16)), randn(20, (4, 16))
    variables = init(MLP(), x)
    plain = grad_step(MLP())(variables, x, r)
    remat = grad_step(MLP(remat=True))(variables, x, r)
    chex.assert_trees_all_close(plain, remat, rtol=1e-6, atol=0)
    assert metas(plain[1])[0].x.amax_history[0] > 0  # the state really was written


def test_dense_fwd_bwd_lowers_to_three_fp8_dots_per_layer():
    x, r = randn(21, (4, 16)), randn(22, (4, 16))
    variables = init(MLP(), x)
    report = coverage_report(grad_step(MLP()), variables, x, r)
    assert report.num_total == report.num_fp8 == 6, str(report)  # no non-FP8 dot at all
    for layer in ("Dense_0", "Dense_1"):
        kinds = sorted((e.lhs_dtype, e.rhs_dtype) for e in report.entries if layer in e.name)
        assert kinds == [
            ("f8E4M3FN", "f8E4M3FN"),  # forward  x . w
            ("f8E4M3FN", "f8E5M2"),  # wgrad    x . dy
            ("f8E5M2", "f8E4M3FN"),  # dgrad    dy . w
        ], str(report)


def test_f32_kernel_reaches_its_fp8_cast_as_stored():
    """With ``keep_kernel_dtype``: no bf16 copy of the f32 kernel before its cast (CUDA
    lowering), a bf16 output, an f32 kernel gradient whose wgrad GEMM wrote bf16, and the same
    layer as flax's default promotion to FP8 noise."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((32, 64)), jnp.bfloat16)

    def layer(promote):
        fp8 = fp8jax.fp8_dot_general_cls(cast_kernel="pallas", out_dtype=jnp.bfloat16)
        kw = {} if promote is None else {"promote_dtype": promote}
        return nn.Dense(48, dtype=jnp.bfloat16, dot_general_cls=fp8, **kw)

    def run(promote):
        model = layer(promote)
        v = model.init(jax.random.PRNGKey(0), x)

        def loss(params):
            y, _ = model.apply({**v, "params": params}, x, mutable=[FP8])
            return jnp.sum(y.astype(jnp.float32) ** 2), y

        return jax.jit(jax.value_and_grad(loss, has_aux=True)), v["params"]

    grad, params = run(fp8jax.keep_kernel_dtype)
    text = grad.trace(params).lower(lowering_platforms=("cuda",)).as_text()
    assert "(tensor<64x48xf32>) -> tensor<64x48xbf16>" not in text  # no bf16 copy of w
    assert "-> tensor<64x48xbf16>" in text  # the wgrad GEMM's output, unscaled into f32 next
    (_, y), g = grad(params)
    (_, y_ref), g_ref = run(None)[0](params)  # flax's promotion: w copied to bf16 first
    assert y.dtype == jnp.bfloat16 and g["kernel"].dtype == jnp.float32
    assert rel_err(y, y_ref) < FWD_TOL and rel_err(g["kernel"], g_ref["kernel"]) < GRAD_TOL


def test_evaluation_without_mutable_runs_and_writes_nothing():
    model = MLP()
    x = randn(23, (4, 16))
    variables = init(model, x)
    # fp8_state not mutable (evaluation); the optional health collection is.
    y, mutated = jax.jit(lambda v: model.apply(v, x, mutable=[FP8_STATS]))(variables)
    assert y.shape == (4, 16) and bool(jnp.all(jnp.isfinite(y)))
    assert set(mutated) == {FP8_STATS}  # the scale state was left alone
    stats = jax.tree_util.tree_leaves(mutated[FP8_STATS])
    assert len(stats) == 8  # x/w saturated/flushed shares for 2 layers
    assert all(0.0 <= float(s) <= 1.0 for s in stats)


def test_einsum_records_health_stats_like_dense():
    """Fp8Einsum sows the same saturation/flush shares as Fp8DotGeneral, from the same meta."""
    model = fp8jax.Einsum(shape=(16, 8), einsum_str="bd,df->bf")
    x = randn(25, (4, 16)) * 1e3  # far above the initial scale's range: x saturates
    variables = init(model, x)
    _, mutated = jax.jit(lambda v: model.apply(v, x, mutable=[FP8_STATS]))(variables)
    stats = {k: float(v[0]) for k, v in mutated[FP8_STATS]["fp8"].items()}
    assert set(stats) == {"x_saturated", "x_flushed", "w_saturated", "w_flushed"}
    # Initial scale 1: every |x| > 448 clips, and no weight (lecun normal, |w| << 448) does.
    expected = float(jnp.mean(jnp.abs(x) > E4M3_MAX))
    assert stats["x_saturated"] == pytest.approx(expected) and expected > 0.5
    assert stats["w_saturated"] == 0.0


def test_train_step_jits_once():
    model = nn.Dense(8, dot_general_cls=fp8jax.fp8_dot_general_cls(fp8jax.CurrentScaling()))
    x = randn(24, (4, 16))
    variables = init(model, x)
    assert isinstance(metas(variables[FP8])[0].x.recipe, fp8jax.CurrentScaling)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def train_step(params, fp8):
        def loss(params, fp8):
            y, mut = model.apply({"params": params, FP8: fp8}, x, mutable=[FP8])
            return jnp.mean(y**2), mut[FP8]

        (_, fwd), (g_p, g_fp8) = jax.value_and_grad(loss, (0, 1), has_aux=True)(params, fp8)
        params = jax.tree.map(lambda p, g: p - 0.1 * g, params, g_p)
        return params, fp8jax.update_state(fwd, g_fp8)

    params, fp8 = variables["params"], variables[FP8]
    for _ in range(3):
        params, fp8 = train_step(params, fp8)
    chex.clear_trace_counter()


@pytest.mark.parametrize("layer", ["dense", "einsum"])
def test_init_traces_the_plain_product_not_the_fp8_gemm(layer):
    """Initialisation reads only an FP8 matmul's output shape: its program holds no FP8 value,
    its params are the plain layer's (same key), its FP8 state the initial meta; applying the
    initialised layer runs the FP8 GEMM."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 16)), jnp.float32)
    key = jax.random.PRNGKey(3)
    if layer == "dense":
        fp8_layer = nn.Dense(32, dot_general_cls=fp8jax.fp8_dot_general_cls())
        plain_layer = nn.Dense(32)
    else:
        fp8_layer = fp8jax.Einsum((16, 32), "bk,kn->bn")
        plain_layer = fp8jax.Einsum((16, 32), "bk,kn->bn", recipe=None)
    init_program = str(jax.make_jaxpr(fp8_layer.init)(key, x))
    assert "f8_" not in init_program
    variables = fp8_layer.init(key, x)
    chex.assert_trees_all_equal(variables["params"], plain_layer.init(key, x)["params"])
    (meta,) = jax.tree.leaves(variables[FP8], is_leaf=lambda m: isinstance(m, fp8jax.Fp8Meta))
    chex.assert_trees_all_equal(meta, fp8jax.init_meta(fp8jax.make_recipe("delayed")))
    apply = lambda v, x: fp8_layer.apply(v, x, mutable=[FP8])  # noqa: E731
    assert "f8_e4m3" in str(jax.make_jaxpr(apply)(variables, x))
