"""coverage_report: dot_general listing, FP8 share, call-graph counts, inputs, GPU GEMM parsing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax.diagnostics import coverage
from fp8jax.diagnostics.coverage import coverage_report

DENSE = (((1,), (0,)), ((), ()))


def _mixed(x, w1, w2, meta):
    """One FP8 matmul [16,32]x[32,16] and one f32 matmul [16,16]x[16,2]."""
    h, _ = fp8jax.dot_general(x, w1, DENSE, meta)
    return h @ w2


def _args():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((16, 32), np.float32))
    w1 = jnp.asarray(rng.standard_normal((32, 16), np.float32))
    w2 = jnp.asarray(rng.standard_normal((16, 2), np.float32))
    return x, w1, w2, fp8jax.init_meta()


def test_lists_every_dot_with_types_shapes_and_share():
    report = coverage_report(_mixed, *_args(), compile=False)
    assert (report.num_total, report.num_fp8, report.fp8_share) == (2, 1, 0.5)
    fp8, f32 = report.entries
    assert (fp8.lhs_dtype, fp8.rhs_dtype, fp8.out_dtype) == ("f8E4M3FN", "f8E4M3FN", "f32")
    assert (fp8.lhs_shape, fp8.rhs_shape, fp8.out_shape) == ((16, 32), (32, 16), (16, 16))
    assert fp8.contracting == ((1,), (0,)) and fp8.batching == ((), ())
    assert fp8.is_fp8 and not f32.is_fp8 and f32.lhs_dtype == "f32"
    # FLOP share: 2*16*16*32 FP8 vs 2*16*2*16 f32.
    assert report.fp8_flop_share == pytest.approx(16384 / (16384 + 1024))
    assert report.gemm_counts is None and report.num_fp8_gemms is None
    text = str(report)
    assert "1/2 dot_generals in FP8 (50.0%)" in text
    assert "f8E4M3FN[16,32]" in text and "f32[16,2]" in text and " NO " in text


def test_backward_dots_and_names():
    def loss(x, w1, w2, meta):
        return jnp.sum(_mixed(x, w1, w2, meta) ** 2)

    report = coverage_report(jax.grad(loss, argnums=(0, 1, 2)), *_args(), compile=False)
    # fwd + dgrad + wgrad for each matmul: 3 FP8 (E4M3xE4M3, E5M2xE4M3, E4M3xE5M2) + 3 f32.
    assert (report.num_total, report.num_fp8) == (6, 3)
    fp8_kinds = sorted((e.lhs_dtype, e.rhs_dtype) for e in report.entries if e.is_fp8)
    assert fp8_kinds == [("f8E4M3FN", "f8E4M3FN"), ("f8E4M3FN", "f8E5M2"), ("f8E5M2", "f8E4M3FN")]
    assert any("transpose" in e.name for e in report.entries)  # backward dots are named so


def test_accepts_jitted_function_and_lowered():
    args = _args()
    jitted = jax.jit(_mixed)
    by_jit = coverage_report(jitted, *args, compile=False)
    by_lowered = coverage_report(jitted.lower(*args), compile=False)
    assert by_jit.entries == by_lowered.entries and by_jit.num_total == 2
    with pytest.raises(TypeError, match="Lowered takes no further arguments"):
        coverage_report(jitted.lower(*args), *args)


def test_counts_a_helper_called_twice():
    inner = jax.jit(lambda a, b: a @ b)  # lowered once as a private function, called twice

    def outer(a, b):
        return inner(a, b) + 2 * inner(a, b)

    a = jnp.ones((4, 8))
    report = coverage_report(outer, a, a.T, compile=False)
    assert report.num_total == 2 and report.num_fp8 == 0 and report.fp8_share == 0.0
    assert sum(e.count == 2 for e in report.entries) == 1


def test_no_dots():
    report = coverage_report(lambda x: x * 2, jnp.ones(3), compile=False)
    assert report.num_total == 0 and report.fp8_share == 0.0 and report.fp8_flop_share == 0.0


def test_compiles_on_request():
    # On CPU no cuBLAS call exists: the count is an empty dict, not None.
    report = coverage_report(_mixed, *_args(), compile=True)
    assert report.gemm_counts == {} or jax.default_backend() == "gpu"
    assert "compiled GEMMs" in str(report)


def test_parses_gpu_gemm_custom_calls():
    # Lines in the shape of XLA's optimized HLO on Hopper (abridged).
    hlo = "\n".join(
        [
            "%a = (bf16[64,32]{1,0}, s8[0]{0}) custom-call(%p0, %p1, %s0, %s1), "
            'custom_call_target="__cublas$lt$matmul$f8", backend_config={}',
            "%b = (bf16[64,32]{1,0}, s8[0]{0}) custom-call(%p2, %p3, %s2, %s3), "
            'custom_call_target="__cublas$lt$matmul$f8"',
            "%c = (f32[8,8]{1,0}, s8[0]{0}) custom-call(%x, %y), "
            'custom_call_target="__cublas$lt$matmul"',
            '%d = f32[8,8]{1,0} custom-call(%x, %y), custom_call_target="__cublas$gemm"',
            "%e = f32[8,8]{1,0} fusion(%x, %y), kind=kCustom, calls=%f, "
            'backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}',
            '%g = f32[8]{0} custom-call(%x), custom_call_target="SomethingElse"',
        ]
    )
    counts = coverage.gemm_counts(hlo)
    assert counts == {
        "__cublas$lt$matmul$f8": 2,
        "__cublas$lt$matmul": 1,
        "__cublas$gemm": 1,
        "__triton_gemm": 1,
    }
    report = coverage.CoverageReport(entries=(), gemm_counts=counts)
    assert (report.num_fp8_gemms, report.num_other_gemms) == (2, 3)
    assert "compiled GEMMs: 2 FP8, 3 other" in str(report)


def test_parses_generic_syntax_and_plain_dot():
    text = "\n".join(
        [
            "func.func public @main(%arg0: tensor<2x3xbf16>) -> tensor<2x2xf32> {",
            '  %0 = "stablehlo.dot_general"(%a, %b) <{dot_dimension_numbers = #stablehlo.dot<'
            "lhs_batching_dimensions = [0], rhs_batching_dimensions = [0], "
            "lhs_contracting_dimensions = [2], rhs_contracting_dimensions = [1]>}> : "
            "(tensor<5x2x3xf8E5M2>, tensor<5x3x7xf8E4M3FN>) -> tensor<5x2x7xbf16>",
            "  %1 = stablehlo.dot %c, %d : (tensor<2x3xbf16>, tensor<3x2xbf16>) -> tensor<2x2xf32>",
            "}",
        ]
    )
    batched, plain = coverage.parse_stablehlo(text)
    assert batched.batching == ((0,), (0,)) and batched.contracting == ((2,), (1,))
    assert batched.is_fp8 and batched.flops == 2 * 5 * 2 * 7 * 3
    assert plain.contracting == ((1,), (0,)) and not plain.is_fp8 and plain.lhs_dtype == "bf16"


@pytest.mark.parametrize(
    "recipe,kernel,platform",
    [
        ("delayed", "dot_general", "cpu"),
        ("rowwise", "dot_general", "cuda"),
        ("block", coverage.BLOCK_GEMM, "cuda"),
        ("block", "dot_general", "cpu"),  # the XLA reference's per-tile dots
    ],
)
def test_entries_name_their_recipe_and_kernel(recipe, kernel, platform):
    """Each FP8 matmul's fwd, dgrad and wgrad carry the recipe; lowered for CUDA, the block
    recipe's GEMMs are the block-scaled kernel's Triton calls, counted as FP8 GEMMs."""
    x, w1, w2, _ = _args()
    meta = fp8jax.init_meta(fp8jax.make_recipe(recipe))
    cast = "pallas" if platform == "cuda" else "xla"  # 'auto' resolves for this host's CPU

    def loss(x, w1, w2, meta):
        h, _ = fp8jax.dot_general(x, w1, DENSE, meta, cast_kernel=cast)
        return jnp.sum((h @ w2) ** 2)

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    lowered = step.trace(x, w1, w2, meta).lower(lowering_platforms=(platform,))
    report = coverage_report(lowered, compile=False)
    fp8 = [e for e in report.entries if e.is_fp8]
    assert len(fp8) == 3 and {e.recipe for e in fp8} == {recipe}
    assert {e.kernel for e in fp8} == {kernel}
    assert {e.recipe for e in report.entries if not e.is_fp8} == {""}  # the f32 matmul's
    if kernel == coverage.BLOCK_GEMM:
        # a [M, K] . b [N, K]^T as the kernel reads them: K padded to whole 128-wide tiles.
        assert all(e.lhs_shape[1] == e.rhs_shape[1] and e.lhs_shape[1] % 128 == 0 for e in fp8)
        assert f"{recipe:<8} {coverage.BLOCK_GEMM}" in str(report)


def test_the_mosaic_block_kernel_is_named_as_the_block_gemm():
    """Whole 128 x 128 tiles run the Mosaic GPU kernel on CUDA: its three calls (fwd, dgrad,
    wgrad) are the block recipe's FP8 GEMMs, with the operands the kernel reads."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((256, 256), np.float32))
    w = jnp.asarray(rng.standard_normal((256, 256), np.float32))
    meta = fp8jax.init_meta(fp8jax.make_recipe("block"))

    def loss(x, w, meta):
        return jnp.sum(fp8jax.dot_general(x, w, DENSE, meta, cast_kernel="pallas")[0] ** 2)

    lowered = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(x, w, meta)
    lowered = lowered.lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    report = coverage.coverage_report(lowered, compile=False)
    fp8 = [e for e in report.entries if e.is_fp8]
    assert text.count("@mosaic_gpu") == 3 and "fp8_block_scaled_dot" not in text.split("@mosaic")[0]
    assert len(fp8) == 3 and {(e.kernel, e.recipe) for e in fp8} == {(coverage.BLOCK_GEMM, "block")}
    assert all(e.lhs_shape == e.rhs_shape == (256, 256) for e in fp8)


def test_gemm_counts_count_the_block_kernel_as_fp8():
    text = "\n".join(
        [
            'a = f8e4m3fn[8,8] custom-call(x), custom_call_target="__cublas$lt$matmul$f8"',
            'b = bf16[8,8] custom-call(x), custom_call_target="__gpu$xla.gpu.triton", '
            'backend_config={"name":"fp8_block_scaled_dot"}',
            'c = bf16[8,8] custom-call(x), custom_call_target="__gpu$xla.gpu.triton", '
            'backend_config={"name":"fp8_cast_transpose"}',
            'd = bf16[8,8] custom-call(x), custom_call_target="__cublas$lt$matmul"',
            'e = bf16[8,8] custom-call(x), custom_call_target="mosaic_gpu_v2", '
            'metadata={op_name="jit(f)/fp8_block/fp8_block_scaled_dot/pallas_call"}',
            'f = bf16[8,8] custom-call(x), custom_call_target="mosaic_gpu_v2", '
            'metadata={op_name="jit(f)/attention/pallas_call"}',
        ]
    )
    counts = coverage.gemm_counts(text)
    assert counts == {"__cublas$lt$matmul$f8": 1, coverage.BLOCK_GEMM: 2, "__cublas$lt$matmul": 1}
    report = coverage.CoverageReport(entries=(), gemm_counts=counts)
    assert (report.num_fp8_gemms, report.num_other_gemms) == (3, 1)
