"""The block recipe's fused casts: the kernel's bits against the references, the references against
numpy in f64, what per-tile scales buy over one scale, and the lowering per platform."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax.ops import block_cast, block_cast_kernels, dot, formats, scaling

from fp8_testing import bits

TRITON = "__gpu$xla.gpu.triton"


def _assert_same(a, b):
    """Bit for bit where ``b`` is a number; NaN where ``b`` is NaN (a NaN's payload is no value,
    and which payload a convert writes is the backend's)."""
    assert a.shape == b.shape and a.dtype == b.dtype
    nan = np.isnan(np.asarray(b, np.float32))
    np.testing.assert_array_equal(np.isnan(np.asarray(a, np.float32)), nan)
    np.testing.assert_array_equal(bits(a)[~nan], bits(b)[~nan])


def _tiles(impl, fmt, tile, recipe):
    return jax.jit(lambda x: block_cast.cast_transpose_tiles(x, fmt, tile, recipe, impl))


def _blocks(impl, fmt, block, recipe):
    return jax.jit(lambda w: block_cast.cast_transpose_blocks(w, fmt, block, recipe, impl))


def _hard(shape, dtype, seed=0):
    """Normal values x 40 with an all-zero [128, 128] block, a huge value (the amax of its tiles:
    their other values flush), tiny ones, negative zero."""
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 40
    x[:128, -128:] = 0.0
    x[3, 5], x[9, 1:5] = 1e9, [1e-30, -0.0, 3e-5, -7e-3]
    x[shape[0] - 1, 2] = -2e6
    return jnp.asarray(x, dtype)


CASES = [  # shape, input dtype, format, tile, power_of_two, margin
    ((256, 384), jnp.bfloat16, "e4m3", 128, False, 0),
    ((256, 384), jnp.float32, "e5m2", 128, True, 1),
    ((128, 128), jnp.float32, "e4m3", 128, True, 0),
    ((128, 128), jnp.bfloat16, "e5m2", 128, False, -1),  # scales past the max: saturates
    ((128, 192), jnp.float32, "e4m3", 64, False, 2),
]


@pytest.mark.parametrize(("shape", "dtype", "fmt", "tile", "pow2", "margin"), CASES)
def test_kernel_equals_the_references_bit_for_bit(shape, dtype, fmt, tile, pow2, margin):
    recipe = scaling.BlockScaling(block_size=tile, power_of_two=pow2, margin=margin)
    x = _hard(shape, dtype)
    assert block_cast_kernels.kernel_takes(shape, tile)
    got = _tiles("interpret", fmt, tile, recipe)(x)
    want = _tiles("xla", fmt, tile, recipe)(x)
    for a, b in zip(got, want, strict=True):
        _assert_same(a, b)
    q, inv, qt, inv_t, amax = got
    m, k = shape
    assert q.shape == (m, k) and qt.shape == (k, m) and q.dtype == formats.as_dtype(fmt)
    assert inv.shape == (m, k // tile) and inv_t.shape == (k, m // tile)
    # The transposed copy is x.T's own 1 x T tiles, not q's transpose (other scales).
    ref_qt, ref_inv_t, _ = block_cast.quantize_tiles(x.T, fmt, tile, recipe)
    _assert_same(qt, ref_qt)
    _assert_same(inv_t, ref_inv_t)
    assert not np.array_equal(bits(qt), bits(q).T)
    assert float(amax) == float(jnp.max(jnp.abs(x.astype(jnp.float32))))
    if margin < 0:  # the tile maxima scale past the format's max and clip there
        assert float(jnp.max(jnp.abs(q.astype(jnp.float32)))) == formats.fmax(fmt)

    got = _blocks("interpret", fmt, tile, recipe)(x)
    want = _blocks("xla", fmt, tile, recipe)(x)
    for a, b in zip(got, want, strict=True):
        _assert_same(a, b)
    q, qt, inv, _ = got
    np.testing.assert_array_equal(bits(qt), bits(q).T)
    assert inv.shape == (m // tile, k // tile)
    if k >= 256:  # _hard's zero block is not the whole tensor
        assert float(inv[0, -1]) == 1.0  # the all-zero block keeps scale 1


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_a_non_finite_element_touches_its_own_tiles_only(bad):
    """Its 1 x T tile and its T x 1 tile (its T x T block for w) get scale 1 and it comes out
    NaN; every other tile keeps its values and scale; the amax is the finite tiles'."""
    t, (r, c) = 128, (7, 200)
    x = np.random.default_rng(1).standard_normal((256, 256)).astype(np.float32) * 3
    x[150, 100] = 50.0  # in no tile or block of the bad element's
    x[7, 130] = 60.0  # the tensor's amax, in the bad element's 1 x T tile (not its T x 1 one)
    x_bad = x.copy()
    x_bad[r, c] = bad
    cast = _tiles("interpret", "e4m3", t, scaling.BlockScaling())
    (q, inv, qt, inv_t, amax), (q2, inv2, qt2, inv_t2, amax2) = cast(x), cast(x_bad)
    want = _tiles("xla", "e4m3", t, scaling.BlockScaling())(x_bad)
    for a, b in zip((q2, inv2, qt2, inv_t2, amax2), want, strict=True):
        _assert_same(a, b)
    assert np.isnan(float(q2[r, c])) and np.isnan(float(qt2[c, r]))
    row_tile, col_tile = (r, slice(c // t * t, c // t * t + t)), (slice(0, t), c)
    assert float(inv2[r, c // t]) == 1.0 and float(inv_t2[c, r // t]) == 1.0
    # The bad tile's finite values are x * 1, saturated.
    finite = np.isfinite(x_bad[row_tile])
    want = formats.quantize(jnp.asarray(x_bad[row_tile]), jnp.float32(1.0), "e4m3")
    np.testing.assert_array_equal(bits(q2[row_tile])[finite], bits(want)[finite])
    same_q = np.ones(q.shape, bool)
    same_q[row_tile] = False
    same_qt = np.ones(qt.shape, bool)
    same_qt[col_tile[1], col_tile[0]] = False
    np.testing.assert_array_equal(bits(q2)[same_q], bits(q)[same_q])
    np.testing.assert_array_equal(bits(qt2)[same_qt], bits(qt)[same_qt])
    changed = (bits(inv2) != bits(inv), bits(inv_t2) != bits(inv_t))
    assert changed[0].sum() == 1 and changed[1].sum() == 1
    assert float(amax) == 60.0 and float(amax2) == 50.0  # the 1 x T tiles' finite maximum

    cast = _blocks("interpret", "e4m3", t, scaling.BlockScaling())
    (q, _, inv, amax), (q2, qt2, inv2, amax2) = cast(x), cast(x_bad)
    assert float(inv2[0, 1]) == 1.0 and np.isnan(float(qt2[c, r]))
    others = ([0, 1, 1], [0, 0, 1])  # the blocks other than (0, 1)
    np.testing.assert_array_equal(np.asarray(inv2)[others], np.asarray(inv)[others])
    np.testing.assert_array_equal(bits(q2[t:]), bits(q[t:]))
    assert float(amax) == 60.0 and float(amax2) == 50.0  # 60 is in the bad block


def _np_tile_amax(x: np.ndarray, tile: int) -> np.ndarray:
    """f64 amax of each 1 x ``tile`` tile along the last axis (the last one partial)."""
    m, k = x.shape
    t = -(-k // tile)
    pad = np.zeros((m, t * tile))
    pad[:, :k] = np.abs(x.astype(np.float64))
    return pad.reshape(m, t, tile).max(axis=-1)


def _fp8_bound(x, inv, fmt):
    """Half an FP8 step of each dequantized element: relative 2**-(mantissa bits + 1) of a normal
    value, half the smallest subnormal (times inv) below, plus f32 rounding of x * scale."""
    fi = jnp.finfo(formats.as_dtype(fmt))
    rel = 2.0 ** -(fi.nmant + 1)
    return np.maximum(rel * np.abs(x), float(fi.smallest_subnormal) / 2 * inv) + 2**-20 * np.abs(x)


@pytest.mark.parametrize(
    ("shape", "tile", "fmt"), [((200, 130), 128, "e4m3"), ((96, 256), 32, "e5m2")]
)
def test_references_against_numpy_in_f64(shape, tile, fmt):
    """Scales fmax / amax per tile (two f32 roundings: inv within 2**-22), and every element within
    half an FP8 step of its value in both layouts; partial tiles included."""
    x = np.random.default_rng(2).standard_normal(shape) * np.logspace(-3, 3, shape[1])
    x = x.astype(np.float32)
    recipe = scaling.BlockScaling(block_size=tile)
    q, inv, qt, inv_t, _ = _tiles("xla", fmt, tile, recipe)(jnp.asarray(x))
    fmax = formats.fmax(fmt)
    np.testing.assert_allclose(np.asarray(inv), _np_tile_amax(x, tile) / fmax, rtol=2**-22)
    np.testing.assert_allclose(np.asarray(inv_t), _np_tile_amax(x.T, tile) / fmax, rtol=2**-22)
    for q_, inv_, x_ in ((q, inv, x), (qt, inv_t, x.T)):
        inv_e = np.repeat(np.asarray(inv_, np.float64), tile, axis=1)[:, : x_.shape[1]]
        err = np.abs(np.asarray(q_, np.float64) * inv_e - x_)
        assert np.all(err <= _fp8_bound(x_, inv_e, fmt))

    w = x[:, : shape[1] // 2 * 2]
    q, qt, inv, _ = _blocks("xla", fmt, tile, recipe)(jnp.asarray(w))
    kb, nb = -(-w.shape[0] // tile), -(-w.shape[1] // tile)
    pad = np.zeros((kb * tile, nb * tile))
    pad[: w.shape[0], : w.shape[1]] = np.abs(w)
    amax = pad.reshape(kb, tile, nb, tile).max(axis=(1, 3))
    np.testing.assert_allclose(np.asarray(inv), amax / fmax, rtol=2**-22)
    inv_e = np.repeat(np.repeat(np.asarray(inv, np.float64), tile, 0), tile, 1)
    inv_e = inv_e[: w.shape[0], : w.shape[1]]
    err = np.abs(np.asarray(q, np.float64) * inv_e - w)
    assert np.all(err <= _fp8_bound(w, inv_e, fmt))
    np.testing.assert_array_equal(bits(qt), bits(q).T)


def test_tiles_keep_the_small_values_that_one_scale_for_outlier_channels_flushes():
    """Two channels 1000x the rest: one tensor scale fmax / amax puts the others' small values in
    E4M3's subnormals, and those below half its smallest subnormal (2**-10 / scale) become 0, a
    relative error of 1. The 1 x 128 tiles free of the outliers scale by their own amax: there
    every element normal in its tile is within 2**-4 of itself (E4M3's half step), none flushed,
    below even the mean error of one scale over the same elements."""
    x = np.random.default_rng(3).standard_normal((256, 512)).astype(np.float32)
    x[:, [5, 60]] *= 1000.0  # both in the first K tile
    q, inv, _ = block_cast.quantize_tiles(jnp.asarray(x), "e4m3", 128, scaling.BlockScaling())
    tiles = np.asarray(block_cast.dequantize_tiles(q, inv, 128), np.float64)
    scale = formats.fmax("e4m3") / float(np.abs(x).max())
    one = formats.quantize(jnp.asarray(x), jnp.float32(scale), "e4m3")
    one = np.asarray(one, np.float64) / scale
    free = np.s_[:, 128:]  # the tiles without an outlier
    rel_tiles = np.abs(tiles[free] - x[free]) / np.abs(x[free])
    rel_one = np.abs(one[free] - x[free]) / np.abs(x[free])
    flushed = np.abs(x[free]) * scale < 2.0**-10  # below half the smallest subnormal: to zero
    assert flushed.sum() > 0 and np.all(rel_one[flushed] == 1.0)
    tile_scale = 1.0 / np.repeat(np.asarray(inv, np.float64), 128, axis=1)[free]
    # In one scale's subnormal range, in their tiles' normal one (E4M3's smallest normal 2**-6):
    small = (np.abs(x[free]) * scale < 2.0**-6) & (np.abs(x[free]) * tile_scale >= 2.0**-6)
    assert small.sum() > 0.05 * small.size and not np.any(tiles[free][small] == 0.0)
    assert np.all(rel_tiles[small] <= 2.0**-4 * (1 + 2**-20))
    assert rel_one[small].mean() > 2.0**-4  # one scale's mean error: over the tiles' worst


def _text(fn, x, platform):
    return jax.jit(fn).trace(x).lower(lowering_platforms=(platform,)).as_text()


def test_pallas_lowers_to_one_triton_kernel_per_call_on_cuda_only():
    recipe = scaling.BlockScaling()
    x = jnp.zeros((256, 384), jnp.bfloat16)
    for cast in (block_cast.cast_transpose_tiles, block_cast.cast_transpose_blocks):
        pallas = lambda x, cast=cast: cast(x, "e4m3", 128, recipe, "pallas")  # noqa: E731
        cuda = _text(pallas, x, "cuda")
        assert cuda.count(TRITON) == 1
        assert cuda.count("output_operand_alias<") == 1  # the amax target, in place
        assert TRITON not in _text(pallas, x, "cpu")
        xla = lambda x, cast=cast: cast(x, "e4m3", 128, recipe, "xla")  # noqa: E731
        assert TRITON not in _text(xla, x, "cuda")
        # Sides that are not whole tiles, and tiles over the kernel's, take the references.
        assert TRITON not in _text(pallas, jnp.zeros((200, 130), jnp.bfloat16), "cuda")
        big = lambda x, cast=cast: cast(x, "e4m3", 256, recipe, "pallas")  # noqa: E731
        assert TRITON not in _text(big, jnp.zeros((256, 512), jnp.bfloat16), "cuda")
    # 'auto' is the references on this (CPU) machine.
    auto = lambda x: block_cast.cast_transpose_tiles(x, "e4m3", 128, recipe)  # noqa: E731
    xla = lambda x: block_cast.cast_transpose_tiles(x, "e4m3", 128, recipe, "xla")  # noqa: E731
    assert jax.jit(auto).lower(x).as_text() == jax.jit(xla).lower(x).as_text()


def test_unaligned_shapes_take_the_references():
    recipe = scaling.BlockScaling()
    x = _hard((200, 130), jnp.float32)
    want = block_cast.cast_transpose_tiles(x, "e4m3", 128, recipe, "xla")
    for a, b in zip(_tiles("interpret", "e4m3", 128, recipe)(x), want, strict=True):
        _assert_same(a, b)
    q, inv, _ = block_cast.quantize_tiles(x, "e4m3", 128, recipe)
    got = block_cast.cast_transpose_tiles(x, "e4m3", 128, recipe, "interpret")
    _assert_same(got[0], q)
    _assert_same(got[1], inv)


def test_bad_inputs_are_one_line_errors():
    r, x = scaling.BlockScaling(), jnp.ones((128, 128))
    with pytest.raises(ValueError, match="must be 2-D.*reshape"):
        block_cast.cast_transpose_tiles(jnp.ones((2, 128, 128)), "e4m3", 128, r)
    with pytest.raises(TypeError, match="bfloat16 or float16 or float32.*cast it"):
        block_cast.cast_transpose_blocks(jnp.ones((128, 128), jnp.int32), "e4m3", 128, r)
    with pytest.raises(ValueError, match="power of two >= 16.*use 128"):
        block_cast.cast_transpose_tiles(x, "e4m3", 96, r)
    with pytest.raises(ValueError, match="unknown FP8 format"):
        block_cast.cast_transpose_blocks(x, "e3m4", 128, r)
    with pytest.raises(ValueError, match="unknown FP8 cast kernel 'triton'"):
        block_cast.cast_transpose_tiles(x, "e4m3", 128, r, "triton")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_tiles_prologue_casts_the_activation(dtype):
    """``prologue='gelu_tanh'``: the tiles kernel reads the pre-activation; its outputs are the
    XLA path's bit for bit, and q and qt dequantize to gelu(x) within E4M3's rounding (2**-4
    relative, 2**-10 of the tile's inverse scale for subnormals); the cast of x differs."""
    recipe = scaling.BlockScaling()
    x = jnp.asarray(np.random.default_rng(6).standard_normal((256, 256)) * 3, dtype)

    def cast(impl):
        return jax.jit(
            lambda x: block_cast.cast_transpose_tiles(x, "e4m3", 128, recipe, impl, "gelu_tanh")
        )

    assert "pallas_call" in str(jax.make_jaxpr(cast("interpret"))(x))
    got = cast("interpret")(x)
    for a, b in zip(got, cast("xla")(x), strict=True):
        _assert_same(a, b)
    gelu = np.asarray(jax.nn.gelu(x.astype(jnp.float32), approximate=True))
    q, inv, qt, inv_t, _ = got
    for q_, inv_, want in ((q, inv, gelu), (qt, inv_t, gelu.T)):
        inv_full = np.repeat(np.asarray(inv_), 128, axis=1)
        err = np.abs(np.asarray(q_, np.float32) * inv_full - want)
        assert (err <= 2**-4 * np.abs(want) + 2**-10 * inv_full * (1 + 1e-6)).all(), err.max()
    assert not np.array_equal(bits(q), bits(_tiles("interpret", "e4m3", 128, recipe)(x)[0]))


@pytest.mark.parametrize(
    ("dtype", "block", "pow2", "margin"),
    [
        (jnp.bfloat16, 128, False, 0),
        (jnp.float32, 128, True, 0),
        (jnp.float32, 16, False, 2),
        (jnp.bfloat16, 32, True, -1),
    ],
)
def test_requantizable_blocks_give_back_the_same_bits(dtype, block, pow2, margin):
    """O3's FP8 block gather: shards quantized at tile boundaries are the whole weight's tiles;
    the handed-over ``requantizable_blocks`` quantizes back to the same q, inv and amax bit for
    bit, where plain dequantization (q * inv) moves some tiles' scales."""
    recipe = scaling.BlockScaling(block_size=block, power_of_two=pow2, margin=margin)
    rng = np.random.default_rng(7)
    w = rng.standard_normal((4 * block, 6 * block)) * np.logspace(-3, 2, 6 * block)[None, :]
    w[:block, :block] = 0.0  # an all-zero tile
    w[3, 5] = -3e4  # its tile's amax, negative
    w = jnp.asarray(w, dtype)
    quant = jax.jit(lambda w: block_cast.quantize_blocks(w, "e4m3", block, recipe))
    q, inv, amax = quant(w)
    # Shards along either axis, each quantized alone: the whole weight's tiles.
    for axis in (0, 1):
        parts = [quant(p) for p in jnp.split(w, 2, axis=axis)]
        for i, whole in ((0, q), (1, inv)):
            joined = jnp.concatenate([p[i] for p in parts], axis)
            np.testing.assert_array_equal(bits(joined), bits(whole))
    amax_b = block_cast.block_amaxes(w, block)
    assert float(jnp.max(amax_b)) == float(amax)
    handed = jax.jit(block_cast.requantizable_blocks, static_argnums=3)(q, inv, amax_b, block)
    assert handed.dtype == jnp.float32
    for a, b in zip(quant(handed), (q, inv, amax), strict=True):
        _assert_same(a, b)
    # q * inv but at each tile's largest |q|, which carries the tile's amax.
    plain = np.asarray(block_cast.dequantize_blocks(q, inv, block))
    full = lambda t: np.repeat(np.repeat(np.asarray(t), block, 0), block, 1)  # noqa: E731
    abs_q = np.abs(np.asarray(q, np.float32))
    top = (abs_q == full(block_cast.block_amaxes(jnp.asarray(abs_q), block))) & (abs_q > 0)
    np.testing.assert_array_equal(np.asarray(handed)[~top], plain[~top])
    np.testing.assert_array_equal(np.abs(np.asarray(handed))[top], full(amax_b)[top])
    if not pow2:  # with powers of two most tiles' scales survive plain dequantization too
        assert not np.array_equal(bits(quant(plain)[1]), bits(inv))


def test_float16_operands_take_the_kernels():
    """A float16 model's operands: the kernels read them as the references do (same bits), and
    the block recipe's matmul runs on them."""
    recipe = scaling.BlockScaling()
    x = jnp.asarray(np.random.default_rng(3).standard_normal((256, 256)) * 50, jnp.float16)
    for cast in (_tiles, _blocks):
        got, want = cast("interpret", "e4m3", 128, recipe)(x), cast("xla", "e4m3", 128, recipe)(x)
        for a, b in zip(got, want, strict=True):
            _assert_same(a, b)
    meta = scaling.init_meta(recipe)
    dims = (((1,), (0,)), ((), ()))
    h = x / 50  # a product well inside float16's range
    y, _ = jax.jit(lambda x, w: dot.dot_general(x, w, dims, meta, None, "xla", "gelu_tanh"))(h, h)
    want = jax.nn.gelu(h.astype(jnp.float32), approximate=True) @ h.astype(jnp.float32)
    assert y.dtype == jnp.float16
    err = float(jnp.linalg.norm(y.astype(jnp.float32) - want) / jnp.linalg.norm(want))
    # Each E4M3 operand is within half a step (2**-4 relative) of its value: the product within
    # about twice that, far from the error of a wrong activation or a zero GEMM (1.0).
    assert err < 2 * 2**-4, err
