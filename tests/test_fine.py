"""Fine-grained FP8 scaling (rowwise, block) through ``dot_general``: accuracy, outliers, state."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax.ops import block_cast, dot, fine, formats, scaling

from fp8_testing import FWD_TOL, GRAD_TOL, MIN_ERR, randn, rel_err

DENSE = (((1,), (0,)), ((), ()))  # [M, K] . [K, N]
FINE = ("rowwise", "block")


def _meta(name, **kw):
    return scaling.init_meta(scaling.make_recipe(name, **kw))


def _fp8(x, w, meta):
    return dot.dot_general(x, w, DENSE, meta, jnp.float32, "xla")


def _grads(x, w, meta, r):
    """(y, dx, dw, meta cotangent) of sum(fp8(x, w) * r)."""

    def loss(x, w, meta):
        y, _ = _fp8(x, w, meta)
        return jnp.sum(y * r), y

    (_, y), (dx, dw, dmeta) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
        x, w, meta
    )
    return y, dx, dw, dmeta


@pytest.mark.parametrize("name", FINE)
@pytest.mark.parametrize("shape", [(64, 256, 128), (40, 200, 72)])
@pytest.mark.parametrize("grad_format", ["e4m3", "e5m2"])
def test_forward_and_gradients_track_f32(name, shape, grad_format):
    """Each FP8 operand is off by at most 2**-4 relative (E4M3) or 2**-3 (E5M2): the products
    and gradients stay within the tensorwise tolerances, sides multiple of 128 or not."""
    m, k, n = shape
    x, w, r = randn(0, (m, k)), randn(1, (k, n), 0.05), randn(2, (m, n))
    y, dx, dw, _ = _grads(x, w, _meta(name, grad_format=grad_format), r)
    tol = FWD_TOL if grad_format == "e4m3" else GRAD_TOL
    ref = x @ w
    assert MIN_ERR < rel_err(y, ref) < FWD_TOL
    assert MIN_ERR < rel_err(dx, r @ w.T) < tol
    assert MIN_ERR < rel_err(dw, x.T @ r) < tol


@pytest.mark.parametrize("name", FINE)
def test_forward_is_the_exact_product_of_the_dequantized_tiles(name):
    """The GEMM applies each tile's inverse scale where it belongs: the output equals the f64
    product of the operands dequantized tile by tile (f32 accumulation: ~1e-6)."""
    x, w = randn(3, (48, 300)), randn(4, (300, 160), 0.05)
    x = x * jnp.logspace(-3, 3, 48)[:, None]  # rows over six decades: wrong scales show
    y, _ = _fp8(x, w, _meta(name))
    recipe = scaling.make_recipe(name)
    if name == "block":
        xq, x_inv, _ = block_cast.quantize_tiles(x, "e4m3", 128, recipe)
        wq, w_inv, _ = block_cast.quantize_blocks(w, "e4m3", 128, recipe)
        xd, wd = (
            block_cast.dequantize_tiles(xq, x_inv, 128),
            block_cast.dequantize_blocks(wq, w_inv, 128),
        )
    else:
        xq, x_inv, _ = block_cast.quantize_tiles(x, "e4m3", 300, recipe)
        wq_t, wt_inv, _ = block_cast.quantize_tiles(w.T, "e4m3", 300, recipe)
        xd, wd = xq.astype(jnp.float32) * x_inv, (wq_t.astype(jnp.float32) * wt_inv).T
    ref = np.asarray(xd, np.float64) @ np.asarray(wd, np.float64)
    assert rel_err(y, ref) < 1e-5


def _outlier_errors(kind, factor):
    """Relative errors (current, rowwise, block) on the ordinary rows of y (``kind='x'``: a few
    tokens of x are ``factor`` times the rest) or of dw (``kind='dy'``: of dy)."""
    rng = np.random.default_rng(5)
    m, k, n = 256, 512, 256
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
    r = rng.standard_normal((m, n)).astype(np.float32)
    hot = [5, 77, 200]
    (x if kind == "x" else r)[hot] *= factor
    ok = np.setdiff1d(np.arange(m), hot)
    out = []
    for name in ("current", *FINE):
        y, dx, _, _ = _grads(jnp.asarray(x), jnp.asarray(w), _meta(name), jnp.asarray(r))
        got, ref = (y, x @ w) if kind == "x" else (dx, r @ w.T)
        out.append(rel_err(np.asarray(got)[ok], np.asarray(ref)[ok]))
    return out


@pytest.mark.parametrize("kind", ["x", "dy"])
def test_outlier_tokens_cost_the_other_rows_nothing_with_fine_scales(kind):
    """Per-tensor E4M3 (x) spans 2**-9..448, about 18 binades, and E5M2 (dy) 2**-16..57344,
    about 32: under one scale, rows 1e5 (x) or 1e9 (dy) times larger push the others into the
    subnormals, which rowwise and block scales never do. The fine recipes' error on the
    ordinary rows is that of outlier-free data, under a quarter of per-tensor's. (At 1e3 the
    formats' range absorbs the outliers: x's errors are then equal, dy's 0.63x from E4M3.)"""
    current, rowwise, block = _outlier_errors(kind, 1e5 if kind == "x" else 1e9)
    assert rowwise < current / 4 and block < current / 4, (current, rowwise, block)
    assert rowwise < FWD_TOL and block < FWD_TOL


@pytest.mark.parametrize("name", FINE)
def test_one_huge_element_leaves_the_other_rows_exact(name):
    """One 1e30 in x: per-tensor scaling flushes every other row of the product to zero; fine
    scales confine it to its row (rowwise) or its 1 x 128 tile (block)."""
    x, w = randn(6, (32, 256)), randn(7, (256, 64), 0.05)
    x = x.at[3, 10].set(1e30)
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    others = np.r_[0:3, 4:32]
    y_current, _ = _fp8(x, w, _meta("current"))
    assert np.abs(np.asarray(y_current)[others]).max() == 0.0  # flushed: the failure fixed here
    y, _ = _fp8(x, w, _meta(name))
    assert rel_err(np.asarray(y)[others], ref[others]) < FWD_TOL


@pytest.mark.parametrize("name", FINE)
def test_non_finite_input_reaches_the_output(name):
    """NaN in x makes its row of y NaN (never a finite value); the recorded amax stays finite."""
    x, w = randn(8, (16, 128)), randn(9, (128, 32))
    x = x.at[2, 5].set(jnp.nan)
    y, new = _fp8(x, w, _meta(name))
    y = np.asarray(y)
    assert np.isnan(y[2]).all() and np.isfinite(np.delete(y, 2, axis=0)).all()
    assert np.isfinite(float(new.x.amax_history[0]))


@pytest.mark.parametrize("name", FINE)
def test_state_records_amaxes_and_keeps_its_scales(name):
    """The per-tensor amaxes land in the pending slots (health), the stored scales stay 1."""
    x, w, r = randn(10, (24, 136)), randn(11, (136, 40)), randn(12, (24, 40))
    meta = _meta(name)
    _, new = _fp8(x, w, meta)
    assert float(new.x.amax_history[0]) == float(jnp.max(jnp.abs(x)))
    assert float(new.w.amax_history[0]) == float(jnp.max(jnp.abs(w)))
    _, _, _, dmeta = _grads(x, w, meta, r)
    assert float(dmeta.dy.amax_history[0]) == float(jnp.max(jnp.abs(r)))
    assert float(new.x.scale) == float(new.w.scale) == 1.0
    assert meta.dy.fmt == "e4m3" and _meta(name, grad_format="e5m2").dy.fmt == "e5m2"


def test_power_of_two_tile_scales():
    """With power_of_two, every inverse scale is an exact power of two."""
    recipe = scaling.BlockScaling(power_of_two=True)
    x = randn(13, (8, 384)) * jnp.logspace(-4, 4, 8)[:, None]
    _, inv, _ = block_cast.quantize_tiles(x, "e4m3", 128, recipe)
    mantissa, _ = np.frexp(np.asarray(inv))
    assert (mantissa == 0.5).all()


def test_bad_input_is_one_clear_line():
    with pytest.raises(ValueError, match="block_size must be a power of two") as e:
        scaling.BlockScaling(block_size=96)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="unknown FP8 scaling recipe 'tiles'"):
        scaling.make_recipe("tiles")
    with pytest.raises(ValueError, match="unknown FP8 gradient format"):
        scaling.RowwiseScaling(grad_format="e3m4")
    batched = (((2,), (1,)), ((0,), (0,)))
    with pytest.raises(ValueError, match="cannot tile batch dimensions"):
        dot.dot_general(randn(0, (2, 8, 32)), randn(1, (2, 32, 16)), batched, _meta("block"))
    mixed = scaling.init_meta(scaling.BlockScaling(), scaling.DelayedScaling(history_len=1))
    with pytest.raises(ValueError, match="leave w_recipe unset"):
        _fp8(randn(0, (16, 32)), randn(1, (32, 16)), mixed)


def test_saturation_stats_follow_the_tiles():
    """Fine scales never clip (each tile's amax maps to the format max) and flush only what is
    below a tile's subnormals: a 1e6 flushes the rest of its 1 x 128 tile (under 1/32 of these
    16 x 256 values), where one scale for the tensor flushes nearly all of it."""
    x = randn(14, (16, 256)).at[0, 0].set(1e6)
    sat, flush = fine.saturation_stats(x, _meta("block").x)
    assert float(sat) == 0.0 and 0 < float(flush) <= 127 / x.size
    sat, flush = fine.saturation_stats(x, _meta("rowwise").x)  # the rest of row 0
    assert float(sat) == 0.0 and 127 / x.size < float(flush) <= 255 / x.size
    _, flush_tensor = formats.saturation_stats(x, jnp.float32(448 / 1e6), "e4m3")
    assert float(flush_tensor) > 0.8


@pytest.mark.parametrize("name", FINE)
def test_the_flax_integrations_take_fine_recipes(name):
    """linen's Dense (``fp8_dot_general_cls``) and Einsum and NNX's Linear and Einsum run the
    recipe: the same output as ``dot_general`` under it, bit for bit."""
    from flax import linen as nn
    from flax import nnx

    from fp8jax.nn import linen as flinen
    from fp8jax.nn import nnx as fnnx

    recipe = scaling.make_recipe(name)
    x = randn(15, (8, 160))
    dense = nn.Dense(48, use_bias=False, dot_general_cls=flinen.fp8_dot_general_cls(recipe))
    variables = dense.init(jax.random.PRNGKey(0), x)
    kernel = variables["params"]["kernel"]
    want, _ = dot.dot_general(x, kernel, DENSE, scaling.init_meta(recipe), jnp.float32)
    np.testing.assert_array_equal(dense.apply(variables, x), want)
    assert variables[flinen.FP8]["Fp8DotGeneral_0"]["meta"].x.recipe == recipe
    einsum = flinen.Einsum((160, 48), "bk,kn->bn", recipe=recipe)
    ev = einsum.init(jax.random.PRNGKey(1), x)
    want, _ = dot.fp8_einsum("bk,kn->bn", x, ev["params"]["kernel"], scaling.init_meta(recipe))
    np.testing.assert_array_equal(einsum.apply(ev, x), want)
    linear = nnx.Linear(
        160, 48, use_bias=False, dot_general=fnnx.Fp8DotGeneral(recipe), rngs=nnx.Rngs(0)
    )
    want, _ = dot.dot_general(x, linear.kernel[...], DENSE, scaling.init_meta(recipe))
    np.testing.assert_array_equal(linear(x), want)
