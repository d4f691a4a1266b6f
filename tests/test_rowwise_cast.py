"""The rowwise recipe's fused cast (``block_cast.cast_transpose_rows``): the kernels' bits against
the references', non-finite rows and columns, the lowering per platform, and ``fine_matmul``
through the kernels against the XLA path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax.ops import block_cast, dot, formats, row_cast_kernels, scaling

from fp8_testing import bits, randn

TRITON = "__gpu$xla.gpu.triton"
DENSE = (((1,), (0,)), ((), ()))  # [M, K] . [K, N]


def _assert_same(a, b):
    """Bit for bit where ``b`` is a number; NaN where ``b`` is NaN (a NaN's payload is the
    backend's convert's)."""
    assert a.shape == b.shape and a.dtype == b.dtype
    nan = np.isnan(np.asarray(b, np.float32))
    np.testing.assert_array_equal(np.isnan(np.asarray(a, np.float32)), nan)
    np.testing.assert_array_equal(bits(a)[~nan], bits(b)[~nan])


def _rows(impl, fmt, recipe):
    return jax.jit(lambda x: block_cast.cast_transpose_rows(x, fmt, recipe, impl))


def _hard(shape, dtype, seed=0):
    """Rows over six decades with an all-zero row and column, a huge value (its row's and its
    column's amax: their small values flush), tiny values and negative zero."""
    m, k = shape
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * np.logspace(-3, 3, m)[:, None]
    x[1], x[:, 2] = 0.0, 0.0
    huge = 6e4 if dtype == jnp.float16 else 1e9  # float16's max is 65504
    x[3, 5], x[9, 1:5] = huge, [1e-30, -0.0, 3e-5, -7e-3]
    x[m - 1, k - 1] = -huge / 500
    return jnp.asarray(x.astype(np.float32), dtype)


CASES = [  # shape, input dtype, format, power_of_two, margin
    ((128, 256), jnp.bfloat16, "e4m3", False, 0),  # whole 64 x 128 blocks
    ((128, 256), jnp.float32, "e5m2", True, 1),
    ((48, 80), jnp.float32, "e4m3", True, 0),  # multiples of 16 only: 16 x 16 blocks
    ((48, 80), jnp.bfloat16, "e5m2", False, -1),  # scales past the max: saturates
    ((32, 64), jnp.float16, "e4m3", False, 2),
]


@pytest.mark.parametrize(("shape", "dtype", "fmt", "pow2", "margin"), CASES)
def test_kernels_equal_the_references_bit_for_bit(shape, dtype, fmt, pow2, margin):
    """Both FP8 layouts, both inverse-scale columns and both amaxes: those of
    ``quantize_tiles(x)`` and ``quantize_tiles(x.T)`` with one tile per row."""
    recipe = scaling.RowwiseScaling(power_of_two=pow2, margin=margin)
    x = _hard(shape, dtype)
    m, k = shape
    assert row_cast_kernels.blocks(shape) is not None
    cast = lambda x: block_cast.cast_transpose_rows(x, fmt, recipe, "interpret")  # noqa: E731
    assert "pallas_call" in str(jax.make_jaxpr(cast)(x))  # the kernels ran, not the references
    got = jax.jit(cast)(x)
    # The rowwise recipe's XLA casts: one tile per row of x and of x.T.
    want = jax.jit(
        lambda x: [
            block_cast.quantize_tiles(x, fmt, k, recipe),
            block_cast.quantize_tiles(x.T, fmt, m, recipe),
        ]
    )(x)
    (q, inv, amax), (qt, inv_t, amax_t) = want
    for a, b in zip(got, (q, inv, qt, inv_t, amax, amax_t), strict=True):
        _assert_same(a, b)
    q, inv, qt, inv_t, amax, amax_t = got
    assert q.shape == (m, k) and qt.shape == (k, m) and q.dtype == formats.as_dtype(fmt)
    assert inv.shape == (m, 1) and inv_t.shape == (k, 1)
    assert not np.array_equal(bits(qt), bits(q).T)  # x.T's own rows, not q transposed
    assert float(inv[1, 0]) == float(inv_t[2, 0]) == 1.0  # the all-zero row and column
    assert float(amax) == float(amax_t) == float(x[3, 5])
    if margin < 0:  # the row maxima scale past the format's max and clip there
        assert float(jnp.max(jnp.abs(q.astype(jnp.float32)))) == formats.fmax(fmt)
    if pow2:
        assert (np.frexp(np.asarray(inv))[0] == 0.5).all()


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_non_finite_elements_touch_their_own_rows_and_columns_only(fmt):
    """An Inf and a NaN: their rows (of q) and columns (of qt) keep scale 1 and they come out
    NaN; every other row and column keeps its values and scale; each amax is the finite rows'
    or columns' maximum."""
    x = np.array(randn(1, (64, 128), 3.0))
    x[40, 100] = 50.0  # in no row or column of a bad element
    x[7, 90] = 60.0  # the tensor's amax: in the Inf's row, not its column
    bad = x.copy()
    bad[7, 20], bad[30, 90] = np.inf, np.nan  # column 90 holds 60 and the NaN
    cast = _rows("interpret", fmt, scaling.RowwiseScaling())
    clean, got = cast(x), cast(bad)
    for a, b in zip(got, _rows("xla", fmt, scaling.RowwiseScaling())(bad), strict=True):
        _assert_same(a, b)
    q, inv, qt, inv_t, amax, amax_t = got
    assert np.isnan(float(q[7, 20])) and np.isnan(float(qt[20, 7]))
    assert np.isnan(float(q[30, 90])) and np.isnan(float(qt[90, 30]))
    bad_rows, bad_cols = [7, 30], [20, 90]
    np.testing.assert_array_equal(np.asarray(inv)[bad_rows, 0], 1.0)
    np.testing.assert_array_equal(np.asarray(inv_t)[bad_cols, 0], 1.0)
    ok_rows, ok_cols = np.setdiff1d(np.arange(64), bad_rows), np.setdiff1d(np.arange(128), bad_cols)
    np.testing.assert_array_equal(bits(q)[ok_rows], bits(clean[0])[ok_rows])
    np.testing.assert_array_equal(bits(inv)[ok_rows], bits(clean[1])[ok_rows])
    np.testing.assert_array_equal(bits(qt)[ok_cols], bits(clean[2])[ok_cols])
    np.testing.assert_array_equal(bits(inv_t)[ok_cols], bits(clean[3])[ok_cols])
    # The bad rows' finite values are x * 1, saturated.
    finite = np.isfinite(bad[7])
    want = formats.quantize(jnp.asarray(bad[7]), jnp.float32(1.0), fmt)
    np.testing.assert_array_equal(bits(q[7])[finite], bits(want)[finite])
    assert float(clean[4]) == float(clean[5]) == 60.0
    assert float(amax) == 50.0  # row 7 (60) has the Inf
    assert float(amax_t) == float(np.abs(np.delete(x, bad_cols, axis=1)).max())


def test_lowering_and_the_shapes_the_kernels_take():
    """Two Triton kernels on CUDA (amaxes, then both casts); the references on other platforms,
    for 'xla', and for sides that are not multiples of 16, which give the same bits."""
    recipe = scaling.RowwiseScaling()

    def text(impl, shape, platform):
        fn = jax.jit(lambda x: block_cast.cast_transpose_rows(x, "e4m3", recipe, impl))
        x = jnp.zeros(shape, jnp.bfloat16)
        return fn.trace(x).lower(lowering_platforms=(platform,)).as_text()

    cuda = text("pallas", (256, 384), "cuda")
    assert cuda.count(TRITON) == 2
    assert "fp8_row_col_amax" in cuda and "fp8_cast_rows_cols" in cuda
    assert TRITON not in text("pallas", (256, 384), "cpu")
    assert TRITON not in text("xla", (256, 384), "cuda")
    assert TRITON not in text("pallas", (200, 136), "cuda")
    assert text("auto", (64, 128), "cpu") == text("xla", (64, 128), "cpu")  # this CPU host
    assert row_cast_kernels.blocks((200, 136)) is None
    assert row_cast_kernels.blocks((16, 48)) == (16, 16)
    x = _hard((40, 130), jnp.float32)
    got, want = _rows("interpret", "e4m3", recipe)(x), _rows("xla", "e4m3", recipe)(x)
    for a, b in zip(got, want, strict=True):
        _assert_same(a, b)


def _step(cast, grad_format, prologue=None):
    """(y, dx, dw, x's and w's recorded amaxes, dy's) of sum(y * r) under the rowwise recipe."""
    meta = scaling.init_meta(scaling.RowwiseScaling(grad_format=grad_format))

    def loss(x, w, r):
        y, new = dot.dot_general(x, w, DENSE, meta, jnp.float32, cast, prologue)
        return jnp.sum(y * r), (y, new.x.amax_history[0], new.w.amax_history[0])

    def step(x, w, r):
        (_, aux), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, w, r)
        return *aux, *grads

    return jax.jit(step)


@pytest.mark.parametrize(
    ("x_dtype", "grad_format", "prologue"),
    [
        (jnp.bfloat16, "e4m3", None),
        (jnp.float32, "e5m2", None),
        (jnp.bfloat16, "e4m3", "gelu_tanh"),
    ],
)
def test_fine_matmul_through_the_kernels_gives_the_xla_bits(x_dtype, grad_format, prologue):
    """y, dx, dw and the recorded amaxes, with an Inf in w (its amax is w.T's rows'): the same
    bits through the interpreted kernels as through XLA's casts; an unaligned M is padded.

    Every operand spans several blocks, so each interpreted grid stays a loop. A one-block grid
    is straight-line ops that XLA:CPU may fuse into the wgrad dot (x.T's transpose folded into
    its operand), which then sums in another order: an ulp of dw, from the CPU's dot, with the
    casts' bits still equal.
    """
    x = (randn(2, (40, 128)) * 4).astype(x_dtype)
    w = np.array(randn(3, (128, 96), 0.05))
    w[9, 7] = 3.0  # w's amax: in the Inf's row, not its column
    w[9, 60] = np.inf
    r = randn(4, (40, 96))
    kernels = _step("interpret", grad_format, prologue)
    jaxpr = str(jax.make_jaxpr(kernels)(x, jnp.asarray(w), r))
    assert jaxpr.count("pallas_call") == 6  # x, w and dy: two kernels each
    got = kernels(x, jnp.asarray(w), r)
    want = _step("xla", grad_format, prologue)(x, jnp.asarray(w), r)
    for a, b in zip(got, want, strict=True):
        _assert_same(a, b)
    y, amax_x, amax_w, dx, dw = got
    assert np.isnan(np.asarray(y)[:, 60]).all() and np.isfinite(np.asarray(y)[:, :60]).all()
    assert np.isnan(np.asarray(dx)[:, 9]).all()  # dgrad reads w per row: row 9 holds the Inf
    assert float(amax_w) == 3.0 and float(amax_x) > 0


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_prologue_casts_the_activation(dtype):
    """With ``prologue='gelu_tanh'`` both kernels read the pre-activation: their outputs are the
    XLA path's bit for bit (GELU in f32 in the same jitted program), and q dequantizes to gelu(x)
    within E4M3's rounding (half a step: 2**-4 relative, 2**-10 of the row's inverse scale for
    subnormals); the cast of x itself differs."""
    recipe = scaling.RowwiseScaling()
    x = jnp.asarray(randn(5, (64, 256), 3.0), dtype)

    def cast(impl):
        return jax.jit(
            lambda x: block_cast.cast_transpose_rows(x, "e4m3", recipe, impl, "gelu_tanh")
        )

    assert str(jax.make_jaxpr(cast("interpret"))(x)).count("pallas_call") == 2
    got = cast("interpret")(x)
    for a, b in zip(got, cast("xla")(x), strict=True):
        _assert_same(a, b)
    q, inv = np.asarray(got[0], np.float32), np.asarray(got[1])
    gelu = np.asarray(jax.nn.gelu(x.astype(jnp.float32), approximate=True))
    err = np.abs(q * inv - gelu)
    assert (err <= 2**-4 * np.abs(gelu) + 2**-10 * inv * (1 + 1e-6)).all(), err.max()
    plain = _rows("interpret", "e4m3", recipe)(x)
    assert not np.array_equal(bits(got[0]), bits(plain[0]))


def test_fine_prologue_runs_inside_the_cast_kernels_on_cuda():
    """A rowwise or block GEMM with a GELU prologue on a GPU: no XLA tanh (x's kernels apply
    it to the pre-activation they read), the GPU's tanh.approx inside them; XLA's casts keep
    XLA's tanh."""

    def text(recipe, cast):
        meta = scaling.init_meta(recipe)
        h, w = jnp.zeros((256, 256), jnp.bfloat16), jnp.zeros((256, 128), jnp.bfloat16)
        f = jax.jit(lambda h, w: dot.dot_general(h, w, DENSE, meta, None, cast, "gelu_tanh")[0])
        return f.trace(h, w).lower(lowering_platforms=("cuda",)).as_text()

    for recipe in (scaling.RowwiseScaling(), scaling.BlockScaling()):
        fused, plain = text(recipe, "pallas"), text(recipe, "xla")
        assert "stablehlo.tanh" not in fused and "tanh.approx.f32" in fused
        assert "stablehlo.tanh" in plain
