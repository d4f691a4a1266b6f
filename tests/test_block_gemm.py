"""The block-scaled FP8 GEMM: the kernel (Pallas' interpreter) equals the reference bit for bit,
both are within the f32 error bound of an f64 product, and the Triton kernel lowers on CUDA."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax.ops import block_gemm, block_gemm_mgpu

from fp8_testing import bits

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
TRITON = "__gpu$xla.gpu.triton"
U32 = 2.0**-24  # f32's unit roundoff
BLOCK = block_gemm.BLOCK
NT = (((1,), (1,)), ((), ()))  # y = a . b^T


def _inv(rng, shape, decades: float) -> jax.Array:
    """Log-uniform f32 multipliers over 2**-decades .. 2**decades."""
    return jnp.asarray(np.exp2(rng.uniform(-decades, decades, shape)), jnp.float32)


def _operands(m, n, k, fa=E4M3, fb=E4M3, blocks=True, seed=0, integers=True, decades=20.0):
    """``(a [M, K], a_inv [M, T], b [N, K], b_inv)``; b_inv [ceil(N/128), T] or [N, T].

    ``integers``: FP8 values are integers of magnitude <= 16, so every tile's sum of products
    (<= 128 * 256 < 2**24) is exact in f32 whatever order a dot adds them in: the bit equality
    then tests the contract's order (scales, tiles), not the CPU's dot kernel. The multipliers
    span many decades, so every product with them rounds."""
    rng = np.random.default_rng(seed)
    t = math.ceil(k / BLOCK)
    if integers:
        a, b = rng.integers(-16, 17, (m, k)), rng.integers(-16, 17, (n, k))
    else:  # any FP8 value: normal values over the format's range, subnormals, zeros
        a = rng.standard_normal((m, k)) * np.exp2(rng.uniform(-8, 6, (m, k)))
        b = rng.standard_normal((n, k)) * np.exp2(rng.uniform(-8, 6, (n, k)))
    b_rows = math.ceil(n / BLOCK) if blocks else n
    return (
        jnp.asarray(a, jnp.float32).astype(fa),
        _inv(rng, (m, t), decades),
        jnp.asarray(b, jnp.float32).astype(fb),
        _inv(rng, (b_rows, t), decades),
    )


def _dequantized(a, a_inv, b, b_inv) -> tuple[np.ndarray, np.ndarray]:
    """a and b in f64, each element times its tile's multiplier."""
    k, n = a.shape[1], b.shape[0]
    a_inv, b_inv = np.asarray(a_inv, np.float64), np.asarray(b_inv, np.float64)
    a64 = np.asarray(a.astype(jnp.float32), np.float64) * np.repeat(a_inv, BLOCK, 1)[:, :k]
    b_full = np.repeat(b_inv, BLOCK, 1)[:, :k]
    if b_inv.shape[0] != n:  # 128 x 128 blocks
        b_full = np.repeat(b_full, BLOCK, 0)[:n]
    return a64, np.asarray(b.astype(jnp.float32), np.float64) * b_full


# (M, N, K): multiples of 128 or not, one row, T from 1 to 8 tiles of K.
SHAPES = [(256, 384, 128), (130, 200, 260), (1, 17, 129), (64, 96, 1024)]


# Per shape: (a's format, b's format, out dtype, b in blocks, tuning); every shape runs both b
# forms, both out dtypes and both orders of mixed formats; bn = 256 > block: per-row b multipliers.
CASES = [
    ((E4M3, E4M3, jnp.float32, True, {}), (E5M2, E4M3, jnp.bfloat16, False, {})),
    ((E5M2, E4M3, jnp.float32, True, {}), (E4M3, E4M3, jnp.bfloat16, False, {})),
    ((E4M3, E5M2, jnp.bfloat16, True, {"bm": 16, "bn": 256}), (E4M3, E4M3, jnp.float32, False, {})),
    ((E4M3, E4M3, jnp.bfloat16, True, {}), (E4M3, E5M2, jnp.float32, False, {"prefetch": False})),
]


@pytest.mark.parametrize("shape,cases", list(zip(SHAPES, CASES, strict=True)))
def test_kernel_equals_reference_bit_for_bit(shape, cases):
    m, n, k = shape
    for i, (fa, fb, out, blocks, tuning) in enumerate(cases):
        args = _operands(m, n, k, fa, fb, blocks, seed=i)
        y = block_gemm.pallas_block_scaled_dot(*args, out_dtype=out, interpret=True, **tuning)
        ref = block_gemm.block_scaled_dot_reference(*args, out_dtype=out)
        assert y.shape == (m, n) and y.dtype == out and ref.dtype == out
        np.testing.assert_array_equal(bits(y), bits(ref), err_msg=str((fa, fb, blocks)))
    public = block_gemm.block_scaled_dot(*args, out_dtype=out, impl="interpret")
    if not tuning:  # the entry point's 'interpret' is the same kernel
        np.testing.assert_array_equal(bits(public), bits(y))


def test_reference_follows_the_contract_not_a_reordering():
    """Reorderings of the contract's arithmetic give other bits on these inputs: the bit
    equality above would catch a kernel (or reference) that made one of them. Each variant is
    compiled whole, as the reference is (XLA may fuse the last multiply and add into an FMA)."""
    a, a_inv, b, b_inv = _operands(64, 96, 1024, blocks=False)
    ref = block_gemm.block_scaled_dot_reference(a, a_inv, b, b_inv, out_dtype=jnp.float32)
    ref = np.asarray(ref)
    t = a_inv.shape[1]

    def run(term, reverse=False):  # the reference's loop with another step
        def step(j, acc):
            i = t - 1 - j if reverse else j
            a_t = jax.lax.dynamic_slice_in_dim(a, i * BLOCK, BLOCK, axis=1)
            b_t = jax.lax.dynamic_slice_in_dim(b, i * BLOCK, BLOCK, axis=1)
            p = jax.lax.dot_general(a_t, b_t, NT, preferred_element_type=jnp.float32)
            x, y = a_inv[:, i][:, None], b_inv[:, i][None, :]
            return acc + term(p, x, y)

        loop = jax.jit(lambda: jax.lax.fori_loop(0, t, step, jnp.zeros((64, 96), jnp.float32)))
        return np.asarray(loop())

    np.testing.assert_array_equal(run(lambda p, x, y: (p * x) * y), ref)  # the contract itself
    for wrong in (
        run(lambda p, x, y: p * (x * y)),  # one combined multiplier
        run(lambda p, x, y: (p * y) * x),  # b's multiplier first
        run(lambda p, x, y: (p * x) * y, reverse=True),  # tiles in reverse
    ):
        assert np.sum(wrong.view(np.uint32) != ref.view(np.uint32)) > 100


@pytest.mark.parametrize("blocks", [True, False])
def test_both_impls_within_the_f32_error_bound_of_an_f64_product(blocks):
    """f32 out: each tile's sum (<= 128 terms), two multiplies and T additions in f32 give at
    most (block + T + 1) u (|a| |b|^T) in f64; bf16 out adds its rounding, 2**-8 |y|."""
    m, n, k = 96, 160, 520
    args = _operands(m, n, k, E5M2, E4M3, blocks, seed=5, integers=False, decades=8)
    a64, b64 = _dequantized(*args)
    exact, scale = a64 @ b64.T, np.abs(a64) @ np.abs(b64).T
    t = args[1].shape[1]
    bound = (BLOCK + t + 1) * U32 * scale
    assert np.median(bound / np.abs(exact)) < 1e-3  # a bound that a wrong result would break
    for impl in ("xla", "interpret"):
        y32 = block_gemm.block_scaled_dot(*args, out_dtype=jnp.float32, impl=impl)
        err = np.abs(np.asarray(y32, np.float64) - exact)
        assert np.all(err <= bound), (impl, np.max(err / np.maximum(bound, 1e-300)))
        y16 = block_gemm.block_scaled_dot(*args, out_dtype=jnp.bfloat16, impl=impl)
        err = np.abs(np.asarray(y16.astype(jnp.float32), np.float64) - exact)
        assert np.all(err <= bound + 2.0**-8 * np.abs(exact) * (1 + 2e-7)), impl


def _cuda_text(impl, args, **kw) -> str:
    f = jax.jit(lambda *x: block_gemm.block_scaled_dot(*x, impl=impl, **kw))
    return f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_pallas_lowers_to_one_triton_kernel_on_cuda_and_none_on_cpu():
    for fb, blocks in ((E4M3, True), (E5M2, False)):  # same formats; mixed (f16 in the kernel)
        args = _operands(130, 200, 260, E4M3, fb, blocks)
        assert _cuda_text("pallas", args).count(TRITON) == 1
        assert _cuda_text("auto", args, out_dtype=jnp.float32).count(TRITON) == 0  # CPU: 'xla'
        assert TRITON not in _cuda_text("xla", args)
        cpu = jax.jit(lambda *x: block_gemm.block_scaled_dot(*x, impl="pallas")).lower(*args)
        assert TRITON not in cpu.as_text()
    tuned = jax.jit(
        lambda *x: block_gemm.pallas_block_scaled_dot(*x, bm=128, bn=256, num_warps=8, num_stages=3)
    )
    text = tuned.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count(TRITON) == 1


MOSAIC = "@mosaic_gpu"  # Pallas' Mosaic GPU custom call (mosaic_gpu or mosaic_gpu_v2)


@pytest.mark.parametrize("blocks", [True, False])
def test_whole_tiles_run_the_mosaic_kernel_on_cuda(blocks):
    """Whole 128 x 128 output tiles and tiles of K lower to one Mosaic GPU call (no Triton),
    any other shape to the Triton kernel, and never either on the CPU."""
    whole = _operands(256, 512, 384, blocks=blocks)
    text = _cuda_text("pallas", whole)
    assert text.count(MOSAIC) == 1 and TRITON not in text
    assert block_gemm.kernel_for(256, 512, 384, BLOCK, blocks) == "mosaic"
    ragged = _operands(256, 512, 300, blocks=blocks)  # K not whole tiles
    text = _cuda_text("pallas", ragged)
    assert text.count(TRITON) == 1 and MOSAIC not in text
    assert block_gemm.kernel_for(256, 512, 300, BLOCK, blocks) == "triton"
    assert MOSAIC not in jax.jit(lambda *x: block_gemm.block_scaled_dot(*x)).lower(*whole).as_text()


def test_vmapped_mosaic_kernel_launches_unbatched_in_a_loop():
    """Batched (vmapped replicas), the persistent Mosaic kernel runs once per batch element on
    unbatched operands inside a loop, not as a batched grid."""
    a, a_inv, b, b_inv = (jnp.stack([x, x]) for x in _operands(256, 256, 256))
    f = jax.jit(jax.vmap(lambda *x: block_gemm.block_scaled_dot(*x, impl="pallas")))
    text = f.trace(a, a_inv, b, b_inv).lower(lowering_platforms=("cuda",)).as_text()
    (call,) = [line for line in text.splitlines() if MOSAIC in line]
    assert call.endswith("-> tensor<256x256xbf16>") and "stablehlo.while" in text


def test_mosaic_tuning_follows_b_and_the_shape():
    """With per-row multipliers of b a 128 x 256 CTA where N allows, else 128 x 128; with b's
    blocks always 128 x 128 (one b multiplier per warpgroup); none for partial tiles."""
    rows, blocks = block_gemm_mgpu.ROWS, block_gemm_mgpu.BLOCKS
    assert rows.cta == (128, 256) and blocks.cta == (128, 128)
    assert block_gemm_mgpu.tuning_for(256, 512, 256, 128, b_blocks=False) == rows
    assert block_gemm_mgpu.tuning_for(256, 384, 256, 128, b_blocks=False) == blocks
    assert block_gemm_mgpu.tuning_for(256, 512, 256, 128, b_blocks=True) == blocks
    for m, n, k, block in ((200, 256, 256, 128), (256, 192, 256, 128), (256, 256, 256, 64)):
        assert block_gemm_mgpu.tuning_for(m, n, k, block, b_blocks=True) is None
    with pytest.raises(ValueError, match="not whole 128 x 128 output tiles") as info:
        block_gemm.mosaic_block_scaled_dot(*_operands(200, 256, 256))
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="unsupported tuning"):
        block_gemm_mgpu.block_scaled_dot(
            *_operands(256, 256, 256, blocks=False), tuning=block_gemm_mgpu.Tuning(tile_m=32)
        )


def test_b_blocks_reads_the_shape_unless_told():
    a, a_inv, b, rows = _operands(32, 100, 256, blocks=False)
    blocks = rows[:1]  # [ceil(100 / 128), T] = [1, 2]
    by_rows = block_gemm.block_scaled_dot(a, a_inv, b, rows, impl="xla", out_dtype=jnp.float32)
    by_block = block_gemm.block_scaled_dot(a, a_inv, b, blocks, impl="xla", out_dtype=jnp.float32)
    told = block_gemm.block_scaled_dot(
        a, a_inv, b, blocks, impl="xla", out_dtype=jnp.float32, b_blocks=True
    )
    same_rows = jnp.broadcast_to(blocks, rows.shape)  # row 0's multipliers for every row
    as_rows = block_gemm.block_scaled_dot(a, a_inv, b, same_rows, impl="xla", out_dtype=jnp.float32)
    np.testing.assert_array_equal(bits(by_block), bits(as_rows))
    np.testing.assert_array_equal(bits(told), bits(by_block))
    assert not np.array_equal(bits(by_rows), bits(by_block))
    with pytest.raises(ValueError, match=r"b_inv \(100, 2\), got \(32, 2\) and \(1, 2\)"):
        block_gemm.block_scaled_dot(a, a_inv, b, blocks, impl="xla", b_blocks=False)


def _one_line_error(exc, match, *args, **kw):
    with pytest.raises(exc, match=match) as info:
        block_gemm.block_scaled_dot(*args, **kw)
    assert "\n" not in str(info.value)


def test_bad_input_is_a_one_line_error():
    a, a_inv, b, b_inv = _operands(32, 48, 200)
    for block in (100, 8, 0):
        _one_line_error(
            ValueError, "block must be a power of two >= 16", a, a_inv, b, b_inv, block=block
        )
    _one_line_error(
        ValueError,
        r"a_inv must be \(32, 2\) and b_inv \(1, 2\) \(blocks\) or "
        r"\(48, 2\) \(rows\), got \(32, 1\)",
        a,
        a_inv[:, :1],
        b,
        b_inv,
    )
    _one_line_error(ValueError, r"got \(32, 2\) and \(3, 2\)", a, a_inv, b, jnp.ones((3, 2)))
    _one_line_error(
        ValueError, r"with block 64, a_inv must be \(32, 4\)", a, a_inv, b, b_inv, block=64
    )
    _one_line_error(
        TypeError, "a is bfloat16: quantize it to float8", a.astype(jnp.bfloat16), a_inv, b, b_inv
    )
    _one_line_error(TypeError, "b is float32", a, a_inv, b.astype(jnp.float32), b_inv)
    _one_line_error(ValueError, "same K", a, a_inv, b[:, :100], b_inv)
    _one_line_error(ValueError, "out_dtype must be", a, a_inv, b, b_inv, out_dtype=jnp.int32)
    _one_line_error(ValueError, "unknown FP8 cast kernel 'cuda'", a, a_inv, b, b_inv, impl="cuda")
    with pytest.raises(ValueError, match="bm, bn must be powers of two >= 16") as info:
        block_gemm.pallas_block_scaled_dot(a, a_inv, b, b_inv, bm=48, interpret=True)
    assert "\n" not in str(info.value)
