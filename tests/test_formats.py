"""FP8 formats: round trip within the grid, saturation, amax, clear errors."""

import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax.ops import formats

from fp8_testing import bits

# Round to nearest with m mantissa bits: |q - v| <= 2^-(m+1) * |v| for normal values.
GRID = {
    "e4m3": dict(max=448.0, min_normal=2.0**-6, rel=2.0**-4),
    "e5m2": dict(max=57344.0, min_normal=2.0**-14, rel=2.0**-3),
}


def _random_normal_range(seed, fmt, n=4096):
    """Values of both signs spread log-uniformly over the format's normal range."""
    g = GRID[fmt]
    rng = np.random.default_rng(seed)
    log2 = rng.uniform(np.log2(g["min_normal"]), np.log2(g["max"]), n)
    return jnp.asarray(rng.choice([-1.0, 1.0], n) * np.exp2(log2), jnp.float32)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("scale", [1.0, 0.25, 8.0])
def test_round_trip_within_grid(fmt, scale):
    g = GRID[fmt]
    v = _random_normal_range(0, fmt)  # values after scaling: x * scale = v
    x = v / scale
    q = formats.quantize(x, jnp.float32(scale), fmt)
    assert q.dtype == formats.as_dtype(fmt)
    back = formats.dequantize(q, jnp.float32(scale))
    rel = np.abs(np.asarray(back) - np.asarray(x)) / np.abs(np.asarray(x))
    assert rel.max() <= g["rel"] * (1 + 1e-6), rel.max()
    # Rounding really happens (the bound is close to tight), so the check above can fail.
    assert rel.max() > g["rel"] / 2
    np.testing.assert_array_equal(np.sign(back), np.sign(x))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_saturates_finite_values_at_format_max_and_keeps_non_finite_ones(fmt):
    limit = GRID[fmt]["max"]
    assert formats.fmax(fmt) == limit
    x = jnp.array([limit * 1.01, -limit * 1.5, 1e30, -1e30, limit * 4])
    q = formats.quantize(x, jnp.float32(1.0), fmt).astype(jnp.float32)
    np.testing.assert_array_equal(np.asarray(q), limit * np.sign(np.asarray(x)))
    # Inf and NaN are never laundered into the format max: they come out NaN.
    bad = formats.quantize(jnp.array([jnp.inf, -jnp.inf, jnp.nan]), jnp.float32(1.0), fmt)
    assert np.all(np.isnan(np.asarray(bad.astype(jnp.float32))))
    # A plain cast would give NaN (E4M3 has no Inf) or Inf (E5M2): the clip is what prevents it.
    raw = x[:2].astype(formats.as_dtype(fmt)).astype(jnp.float32)
    assert not np.all(np.isfinite(np.asarray(raw)) & (np.abs(np.asarray(raw)) <= limit))


def test_bf16_input_and_scale_applied():
    x = jnp.asarray(np.random.default_rng(1).standard_normal(64) + 3.0, jnp.bfloat16)
    scale = jnp.float32(4.0)
    q = formats.quantize(x, scale, formats.E4M3)
    back = formats.dequantize(q, scale, jnp.bfloat16)
    assert back.dtype == jnp.bfloat16
    x32, b32 = np.asarray(x, np.float32), np.asarray(back, np.float32)
    # E4M3 rounding 2^-4 plus the bf16 output rounding 2^-8.
    assert np.max(np.abs(b32 - x32) / np.abs(x32)) <= 2.0**-4 + 2.0**-8
    # q holds x * scale, not x: the largest value lands near 4 * max|x|.
    np.testing.assert_allclose(
        float(jnp.max(q.astype(jnp.float32))), 4 * float(jnp.max(x)), rtol=2.0**-4
    )


def test_amax_is_f32_absolute_max():
    x = jnp.array([[1.5, -7.25], [3.0, 0.5]], jnp.bfloat16)
    a = formats.amax(x)
    assert a.dtype == jnp.float32 and a.shape == ()
    assert float(a) == 7.25


def test_amax_and_stats_of_an_empty_tensor_are_zero():
    x = jnp.zeros((0, 8), jnp.bfloat16)
    a = formats.amax(x)
    assert a.dtype == jnp.float32 and a.shape == () and float(a) == 0.0
    assert [float(v) for v in formats.saturation_stats(x, jnp.float32(2.0), "e4m3")] == [0, 0]


def test_saturation_stats_exact():
    x = jnp.array([1000.0, 10.0, 1e-12, 0.0, -2000.0, 1.0, 2.0, 3.0])
    sat, flush = formats.saturation_stats(x, jnp.float32(1.0), "e4m3")
    assert float(sat) == 2 / 8  # 1000 and -2000 clip at 448
    assert float(flush) == 1 / 8  # 1e-12 is below half the smallest subnormal (2^-10)
    # Round-to-nearest gives 448 up to 464 (half of the top binade's step of 32): not clipped.
    assert formats.clip_threshold("e4m3") == 464.0 and formats.clip_threshold("e5m2") == 61440.0
    sat, _ = formats.saturation_stats(
        jnp.array([463.0, 464.0, 470.0, -448.0]), jnp.float32(1), "e4m3"
    )
    assert float(sat) == 2 / 4


def test_unknown_format_is_a_clear_value_error():
    with pytest.raises(ValueError, match="unknown FP8 format 'e3m4'"):
        formats.as_dtype("e3m4")
    with pytest.raises(ValueError, match="unsupported FP8 dtype"):
        formats.quantize(jnp.ones(3), jnp.float32(1.0), jnp.bfloat16)
    assert formats.as_dtype("E5M2") == jnp.dtype(jnp.float8_e5m2)


def test_bits_helper_reads_the_encodings():
    """``fp8_testing.bits``, which the bit-for-bit tests compare, gives each format's encoding:
    1.0 and -2.0 by the OCP FP8 and IEEE layouts (sign, exponent bias, mantissa)."""
    want = {
        jnp.float8_e4m3fn: (0x38, 0xC0),  # bias 7: 1.0 = 0 0111 000; -2.0 = 1 1000 000
        jnp.float8_e5m2: (0x3C, 0xC0),  # bias 15: 1.0 = 0 01111 00; -2.0 = 1 10000 00
        jnp.bfloat16: (0x3F80, 0xC000),
        jnp.float32: (0x3F800000, 0xC0000000),
    }
    for dtype, (one, minus_two) in want.items():
        got = bits(jnp.asarray([1.0, -2.0], dtype))
        assert got.dtype.itemsize == jnp.dtype(dtype).itemsize
        assert got.tolist() == [one, minus_two], (dtype, got)
