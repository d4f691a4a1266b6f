"""Non-finite operands propagate (never laundered) without poisoning the scale state; zero-size
dimensions behave as plain JAX/Flax; mismatched shapes are a clear error."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx

import fp8jax
from fp8jax import FP8, FP8_STATS
from fp8jax.nn import nnx as fnnx
from fp8jax.ops import act_kernels, dot, kernels, mlp

from fp8_testing import nnx_grads, randn

DENSE = (((1,), (0,)), ((), ()))  # [M, K] . [K, N]
HI = jax.lax.Precision.HIGHEST


def _with(a, idx, value):
    """``a`` with one element replaced (a numpy copy back to jax)."""
    a = np.array(a)
    a[idx] = value
    return jnp.asarray(a)


def assert_same_non_finite(a, ref, what="", reads_bad=True):
    """``a`` is non-finite exactly where the high-precision reference is; the reference has a
    non-finite element when ``a`` reads the bad operand and none otherwise (not vacuous)."""
    fin, fin_ref = np.isfinite(np.asarray(a, np.float32)), np.isfinite(np.asarray(ref, np.float32))
    np.testing.assert_array_equal(fin, fin_ref, err_msg=f"{what}: non-finite pattern differs")
    assert fin_ref.all() != reads_bad, f"{what}: the reference pattern is not the premise"


def assert_all_finite(tree, what="FP8 state"):
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        assert np.all(np.isfinite(np.asarray(leaf))), (what, jax.tree_util.keystr(path))


def assert_same_bits_or_nan(a, b):
    """FP8 arrays equal bit for bit, except that any NaN matches any NaN (payloads differ by
    convert implementation)."""
    nan_a, nan_b = np.isnan(np.asarray(a, np.float32)), np.isnan(np.asarray(b, np.float32))
    np.testing.assert_array_equal(nan_a, nan_b)
    bits_a, bits_b = np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)
    np.testing.assert_array_equal(np.where(nan_a, 0, bits_a), np.where(nan_b, 0, bits_b))


def metas(tree) -> list[fp8jax.Fp8Meta]:
    return jax.tree.leaves(tree, is_leaf=lambda m: isinstance(m, fp8jax.Fp8Meta))


# ---- non-finite operands: the functional dot_general, forward and backward ----------------


@functools.cache
def _dot_step(cast):
    @jax.jit
    def step(x, w, r, meta):
        def loss(x, w, meta):
            y, m = dot.dot_general(x, w, DENSE, meta, cast_kernel=cast)
            return jnp.sum(y * r), (y, m)

        (_, (y, m)), (dx, dw, dm) = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(x, w, meta)
        return y, dx, dw, fp8jax.update_state(m, dm)

    return step


@jax.jit
def _dot_ref(x, w, r):
    y, vjp = jax.vjp(lambda x, w: jnp.dot(x, w, precision=HI), x, w)
    return (y, *vjp(r))


PATHS = [("xla", "delayed"), ("interpret", "delayed"), ("xla", "current")]


@pytest.mark.parametrize("operand", ["x", "w", "dy"])
@pytest.mark.parametrize("cast,recipe", PATHS)
def test_dot_general_propagates_inf_and_keeps_the_scales(operand, cast, recipe):
    """An Inf in x, w or dy makes exactly the outputs a f32 matmul makes non-finite non-finite
    (E4M3 has no Inf: it becomes NaN), and the next step's scales are the previous ones."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((32, 64), np.float32))
    w = jnp.asarray(rng.standard_normal((64, 16), np.float32) * 0.1)
    r = jnp.asarray(rng.standard_normal((32, 16), np.float32) * 1e-3)
    step = _dot_step(cast)
    rec = {"delayed": fp8jax.DelayedScaling(), "current": fp8jax.CurrentScaling()}[recipe]
    *_, meta1 = step(x, w, r, fp8jax.init_meta(rec))  # a clean step sets the scales
    assert all(float(s.scale) != 1.0 for s in (meta1.x, meta1.w, meta1.dy))
    if operand == "x":
        x = _with(x, (3, 5), np.inf)
    elif operand == "w":
        w = _with(w, (7, 2), -np.inf)
    else:
        r = _with(r, (4, 9), np.inf)  # d loss / d y = r
    y, dx, dw, meta2 = step(x, w, r, meta1)
    y_ref, dx_ref, dw_ref = _dot_ref(x, w, r)
    # y = x . w does not read dy, dx = dy . w.T not x, dw = x.T . dy not w.
    assert_same_non_finite(y, y_ref, "y", reads_bad=operand != "dy")
    assert_same_non_finite(dx, dx_ref, "dx", reads_bad=operand != "x")
    assert_same_non_finite(dw, dw_ref, "dw", reads_bad=operand != "w")
    assert_all_finite(meta2)
    # The bad step recorded no amax above the clean one's: every scale stays as it was.
    for new, old in zip((meta2.x, meta2.w, meta2.dy), (meta1.x, meta1.w, meta1.dy), strict=True):
        assert float(new.scale) == float(old.scale)


def test_quantize_keeps_non_finite_values_and_still_saturates_overflow():
    """Finite values saturate (also when x * scale overflows f32); Inf and NaN become NaN in
    both formats (E4M3 has no Inf, and Triton's E5M2 convert would saturate an Inf)."""
    x = jnp.array([1e30, -1e30, 3e38, np.inf, -np.inf, np.nan, 1.0], jnp.float32)
    for fmt in ("e4m3", "e5m2"):
        limit = fp8jax.ops.formats.fmax(fmt)
        q = np.asarray(fp8jax.ops.formats.quantize(x, jnp.float32(1e10), fmt).astype(jnp.float32))
        np.testing.assert_array_equal(q[:3], [limit, -limit, limit])
        assert np.all(np.isnan(q[3:6])) and np.isfinite(q[6])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_cast_kernel_keeps_non_finite_values_bit_for_bit_as_xla(fmt):
    x = np.array(randn(1, (32, 256)))
    x[0, 0], x[20, 200], x[5, 130] = np.inf, -np.inf, np.nan
    outs = {
        impl: jax.jit(lambda x, impl=impl: kernels.cast_transpose(x, jnp.float32(2.0), fmt, impl))(
            x
        )
        for impl in ("xla", "interpret")
    }
    q, q_t, amax = outs["interpret"]
    for a, b in zip(outs["interpret"][:2], outs["xla"][:2], strict=True):
        assert_same_bits_or_nan(a, b)
    bad = ~np.isfinite(x)
    np.testing.assert_array_equal(~np.isfinite(np.asarray(q, np.float32)), bad)
    np.testing.assert_array_equal(~np.isfinite(np.asarray(q_t, np.float32)), bad.T)
    assert np.isfinite(float(amax)) and np.isfinite(float(outs["xla"][2]))


def test_act_grad_kernel_keeps_non_finite_gradients():
    pre, da = np.array(randn(2, (32, 128))), np.array(randn(3, (32, 128)))
    da[1, 2], da[30, 100] = np.inf, np.nan
    hist = jnp.zeros((17,), jnp.float32)
    outs = {
        impl: jax.jit(
            lambda p, d, impl=impl: act_kernels.act_grad_cast_transpose(
                p, d, jnp.float32(0.5), jnp.float32(4.0), "e5m2", impl, pending=hist
            )
        )(pre, da)
        for impl in ("xla", "interpret")
    }
    for a, b in zip(outs["interpret"][:2], outs["xla"][:2], strict=True):
        assert_same_bits_or_nan(a, b)
    for q, _, h, dsum in outs.values():
        np.testing.assert_array_equal(~np.isfinite(np.asarray(q, np.float32)), ~np.isfinite(da))
        assert np.all(np.isfinite(np.asarray(h)))  # the history takes no Inf/NaN
        assert not np.all(np.isfinite(np.asarray(dsum)))  # the bias gradient sees it too


# ---- non-finite operands through the Flax modules and the fused MLP ------------------------


def _linen_case(fp8_model, ref_model, x, bad_x, y_shape):
    """Forward (Inf in x) and backward (Inf in dy) of an FP8 linen model against its plain twin."""
    variables = jax.jit(fp8_model.init)(jax.random.key(0), x)
    params = variables["params"]

    @jax.jit
    def step(x, r, fp8):
        def loss(params, fp8, x):
            y, mutated = fp8_model.apply({"params": params, FP8: fp8}, x, mutable=[FP8])
            return jnp.sum(y * r), (y, mutated[FP8])

        (_, (y, fwd)), (gp, gf, gx) = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(
            params, fp8, x
        )
        return y, gp, gx, fp8jax.update_state(fwd, gf)

    @jax.jit
    def ref(x, r):
        y, vjp = jax.vjp(lambda p, x: ref_model.apply({"params": p}, x), params, x)
        return y, *vjp(r)

    r = randn(1, y_shape, 1e-3)
    bad_r = _with(r, (0,) * len(y_shape), np.inf)
    for xi, ri, where in ((bad_x, r, "fwd"), (x, bad_r, "bwd")):
        y, gp, gx, fp8 = step(xi, ri, variables[FP8])
        y_ref, gp_ref, gx_ref = ref(xi, ri)
        assert_same_non_finite(y, y_ref, "y", reads_bad=where == "fwd")
        assert_same_non_finite(gx, gx_ref, "dx", reads_bad=where == "bwd")
        for (path, g), g_ref in zip(
            jax.tree_util.tree_leaves_with_path(gp), jax.tree.leaves(gp_ref), strict=True
        ):
            fin, fin_ref = np.isfinite(np.asarray(g)), np.isfinite(np.asarray(g_ref))
            np.testing.assert_array_equal(fin, fin_ref, err_msg=f"{where} {path}")
        assert_all_finite(fp8)


def test_linen_dense_propagates_inf_forward_and_backward():
    x = randn(0, (16, 32))
    fp8_model = nn.Dense(24, dot_general_cls=fp8jax.fp8_dot_general_cls())
    _linen_case(fp8_model, nn.Dense(24), x, _with(x, (2, 3), np.inf), (16, 24))


def test_linen_einsum_propagates_inf_forward_and_backward():
    eq = "bsd,dhk->bshk"
    kw = dict(shape=(16, 3, 5), einsum_str=eq, use_bias=True)
    x = randn(2, (2, 4, 16))
    _linen_case(
        fp8jax.Einsum(**kw),
        fp8jax.Einsum(**kw, recipe=None),
        x,
        _with(x, (1, 2, 3), -np.inf),
        (2, 4, 3, 5),
    )


@pytest.mark.parametrize("kind", ["linear", "einsum"])
def test_nnx_propagates_inf_forward_and_backward(kind):
    eq = "bsd,dhk->bshk"
    if kind == "linear":
        x, y_shape = randn(4, (4, 16)), (4, 8)
        model = nnx.Linear(16, 8, dot_general=fnnx.Fp8DotGeneral(), rngs=nnx.Rngs(0))
        ref = nnx.Linear(16, 8, rngs=nnx.Rngs(1))
    else:
        x, y_shape = randn(4, (2, 4, 16)), (2, 4, 3, 5)
        model = nnx.Einsum(eq, (16, 3, 5), (3, 5), einsum_op=fnnx.Fp8Einsum(), rngs=nnx.Rngs(0))
        ref = nnx.Einsum(eq, (16, 3, 5), (3, 5), rngs=nnx.Rngs(1))
    nnx.update(ref, nnx.state(model, nnx.Param))
    r = randn(5, y_shape, 1e-3)
    cases = ((_with(x, (0,) * x.ndim, np.inf), r), (x, _with(r, (1,) * len(y_shape), np.inf)))
    for i, (xi, ri) in enumerate(cases):
        y, grads, fp8_grads = nnx.jit(nnx_grads)(model, xi, ri)
        with jax.default_matmul_precision("highest"):
            y_ref, grads_ref, _ = nnx.jit(nnx_grads)(ref, xi, ri)
        assert_same_non_finite(y, y_ref, "y", reads_bad=i == 0)
        assert_same_non_finite(grads["kernel"][...], grads_ref["kernel"][...], "dkernel")
        fnnx.update_fp8_state(model, fp8_grads)
        assert_all_finite(nnx.state(model, fnnx.Fp8State))


@pytest.mark.parametrize("cast", ["interpret", "xla"])  # the one fused VJP / two dot_generals
def test_fused_mlp_propagates_inf_forward_and_backward(cast):
    x, w1, b1, w2 = randn(6, (32, 32)), randn(7, (32, 64), 0.2), randn(8, (64,)), randn(9, (64, 32))
    r = randn(10, (32, 32), 1e-3)

    @jax.jit
    def step(x, r, m1, m2):
        def loss(x, w1, b1, w2, m1, m2):
            y, m1, m2 = mlp.gelu_mlp(x, w1, b1, w2, m1, m2, cast)
            return jnp.sum(y * r), (y, m1, m2)

        grad = jax.value_and_grad(loss, tuple(range(6)), has_aux=True)
        (_, (y, f1, f2)), (dx, dw1, db1, dw2, g1, g2) = grad(x, w1, b1, w2, m1, m2)
        return (y, dx, dw1, db1, dw2), fp8jax.update_state((f1, f2), (g1, g2))

    @jax.jit
    def ref(x, r):
        f = lambda x, w1, b1, w2: jnp.dot(  # noqa: E731
            jax.nn.gelu(jnp.dot(x, w1, precision=HI) + b1, approximate=True), w2, precision=HI
        )
        y, vjp = jax.vjp(f, x, w1, b1, w2)
        return (y, *vjp(r))

    m = (fp8jax.init_meta(), fp8jax.init_meta())
    cases = ((_with(x, (3, 4), np.inf), r), (x, _with(r, (5, 6), np.inf)))
    names = ("y", "dx", "dw1", "db1", "dw2")
    for i, (xi, ri) in enumerate(cases):
        outs, state = step(xi, ri, *m)
        for name, a, a_ref in zip(names, outs, ref(xi, ri), strict=True):
            # Only y reads no Inf in dy; the Inf in x reaches dx through gelu'(pre).
            assert_same_non_finite(a, a_ref, name, reads_bad=(i, name) != (1, "y"))
        assert_all_finite(state)


# ---- zero-size dimensions and mismatched shapes ----------------------------------------


ZERO_SHAPES = [
    ("mk,kn->mn", (0, 8), (8, 4)),  # M = 0
    ("mk,kn->mn", (4, 0), (0, 4)),  # K = 0: zeros
    ("mk,kn->mn", (4, 8), (8, 0)),  # N = 0
    ("bmk,bkn->bmn", (0, 4, 8), (0, 8, 4)),  # no batch
    ("bsd,dhk->bshk", (2, 0, 16), (16, 3, 5)),  # an empty free axis among others
]


@pytest.mark.parametrize("cast", ["xla", "interpret"])
@pytest.mark.parametrize("eq,x_shape,w_shape", ZERO_SHAPES)
def test_zero_size_dims_match_jnp_einsum_and_keep_the_state(eq, x_shape, w_shape, cast):
    x, w = jnp.ones(x_shape), jnp.ones(w_shape)
    meta = jax.tree.map(lambda a: a + 1.5, fp8jax.init_meta())  # a used state

    def f(x, w, meta):
        return dot.fp8_einsum(eq, x, w, meta, cast_kernel=cast)

    (y, new_meta), vjp = jax.vjp(jax.jit(f), x, w, meta)
    y_ref, vjp_ref = jax.vjp(lambda x, w: jnp.einsum(eq, x, w), x, w)
    assert y.shape == y_ref.shape and y.dtype == y_ref.dtype
    np.testing.assert_array_equal(y, y_ref)
    r = jnp.full(y.shape, 2.0)
    dx, dw, dmeta = vjp((r, jax.tree.map(jnp.zeros_like, new_meta)))
    for g, g_ref in zip((dx, dw), vjp_ref(r), strict=True):
        assert g.shape == g_ref.shape and g.dtype == g_ref.dtype
        np.testing.assert_array_equal(g, g_ref)
    for a, b in zip(jax.tree.leaves(new_meta), jax.tree.leaves(meta), strict=True):
        np.testing.assert_array_equal(a, b)  # an empty tensor's amax is 0: nothing recorded
    assert_all_finite(fp8jax.update_state(new_meta, dmeta))


def test_zero_size_linen_dense_and_einsum_match_plain_flax():
    init = nn.initializers.normal(0.1)  # lecun_normal divides by fan_in, 0 for K = 0
    cls = fp8jax.fp8_dot_general_cls()
    fp8 = lambda n: nn.Dense(n, kernel_init=init, dot_general_cls=cls)  # noqa: E731
    plain = lambda n: nn.Dense(n, kernel_init=init)  # noqa: E731
    cases = [
        (fp8(4), plain(4), (0, 8)),
        (fp8(4), plain(4), (3, 0)),
        (fp8(0), plain(0), (3, 8)),
        (
            fp8jax.Einsum(shape=(16, 3, 5), einsum_str="bsd,dhk->bshk", use_bias=True),
            fp8jax.Einsum(shape=(16, 3, 5), einsum_str="bsd,dhk->bshk", use_bias=True, recipe=None),
            (2, 0, 16),
        ),
    ]
    for fp8_model, ref_model, shape in cases:
        x = jnp.ones(shape)
        variables = fp8_model.init(jax.random.key(0), x)

        def loss(params, fp8, x, fp8_model=fp8_model):
            y, mut = fp8_model.apply({"params": params, FP8: fp8}, x, mutable=[FP8, FP8_STATS])
            return jnp.sum(y * 2.0), (y, mut)

        (_, (y, mut)), (gp, gf, gx) = jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(
            variables["params"], variables[FP8], x
        )
        ref_loss = lambda p, x, m=ref_model: jnp.sum(m.apply({"params": p}, x) * 2.0)  # noqa: E731
        y_ref = ref_model.apply({"params": variables["params"]}, x)
        gp_ref, gx_ref = jax.grad(ref_loss, (0, 1))(variables["params"], x)
        assert y.shape == y_ref.shape, shape
        np.testing.assert_array_equal(y, y_ref)
        np.testing.assert_array_equal(gx, gx_ref)
        for a, b in zip(jax.tree.leaves(gp), jax.tree.leaves(gp_ref), strict=True):
            np.testing.assert_array_equal(a, b)
        new = fp8jax.update_state(mut[FP8], gf)
        assert_all_finite(new)
        assert_all_finite(mut.get(FP8_STATS, {}), "health stats")
        for a, b in zip(metas(new), metas(variables[FP8]), strict=True):
            assert float(a.x.scale) == float(b.x.scale) == 1.0  # no amax, no new scale


def test_zero_size_nnx_linear_matches_plain_nnx():
    for d_in, d_out, shape in ((8, 4, (0, 8)), (0, 4, (3, 0)), (8, 0, (3, 8))):
        kw = dict(kernel_init=nnx.initializers.normal(0.1), rngs=nnx.Rngs(0))  # fan_in may be 0
        model = nnx.Linear(d_in, d_out, dot_general=fnnx.Fp8DotGeneral(), **kw)
        ref = nnx.Linear(d_in, d_out, **kw)
        x, r = jnp.ones(shape), jnp.full((shape[0], d_out), 2.0)
        y, grads, fp8_grads = nnx_grads(model, x, r)
        y_ref, grads_ref, _ = nnx_grads(ref, x, r)
        assert y.shape == y_ref.shape
        np.testing.assert_array_equal(y, y_ref)
        np.testing.assert_array_equal(grads["kernel"][...], grads_ref["kernel"][...])
        fnnx.update_fp8_state(model, fp8_grads)
        assert_all_finite(nnx.state(model, fnnx.Fp8State))


def test_mismatched_shapes_name_both_shapes_and_the_contracting_dims():
    meta = fp8jax.init_meta()
    with pytest.raises(ValueError, match=r"\(4, 8\).*\(6, 2\).*contract.*\(1,\).*\(0,\)"):
        dot.dot_general(jnp.ones((4, 8)), jnp.ones((6, 2)), DENSE, meta)
    batched = (((2,), (1,)), ((0,), (0,)))
    with pytest.raises(ValueError, match=r"\(2, 4, 8\).*\(3, 8, 2\).*batch"):
        dot.dot_general(jnp.ones((2, 4, 8)), jnp.ones((3, 8, 2)), batched, meta)


def test_zero_size_nnx_einsum_and_fused_mlp_match_plain():
    eq = "bsd,dhk->bshk"
    kw = dict(rngs=nnx.Rngs(0))
    model = nnx.Einsum(eq, (16, 3, 5), (3, 5), einsum_op=fnnx.Fp8Einsum(), **kw)
    ref = nnx.Einsum(eq, (16, 3, 5), (3, 5), rngs=nnx.Rngs(0))
    x, r = jnp.ones((2, 0, 16)), jnp.ones((2, 0, 3, 5))
    (y, grads, fp8_grads), (y_ref, grads_ref, _) = nnx_grads(model, x, r), nnx_grads(ref, x, r)
    assert y.shape == y_ref.shape == (2, 0, 3, 5)
    np.testing.assert_array_equal(grads["kernel"][...], grads_ref["kernel"][...])  # zeros
    fnnx.update_fp8_state(model, fp8_grads)
    assert_all_finite(nnx.state(model, fnnx.Fp8State))
    # The fused MLP with no tokens: an empty output, zero weight and bias gradients.
    x, w1, b1, w2 = jnp.ones((0, 32)), randn(7, (32, 64)), randn(8, (64,)), randn(9, (64, 32))

    def loss(x, w1, b1, w2):
        y, m1, m2 = mlp.gelu_mlp(x, w1, b1, w2, fp8jax.init_meta(), fp8jax.init_meta(), "interpret")
        return jnp.sum(y), (y, m1, m2)

    (_, (y, m1, m2)), grads = jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True)(x, w1, b1, w2)
    assert y.shape == (0, 32)
    for g, v in zip(grads, (x, w1, b1, w2), strict=True):
        assert g.shape == v.shape and not np.any(np.asarray(g))
    fresh = jax.tree.leaves((fp8jax.init_meta(), fp8jax.init_meta()))
    for a, b in zip(jax.tree.leaves((m1, m2)), fresh, strict=True):
        np.testing.assert_array_equal(a, b)
