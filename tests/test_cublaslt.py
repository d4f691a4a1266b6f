"""cuBLASLt's scaled FP8 GEMMs (ops.cublaslt): availability, scale layouts, dispatch, lowering.

The GEMMs themselves run on Hopper only; ``benchmarks/block_gemm.py``'s check compares them
there with the reference and an f64 product. Here: the scale layouts the handler documents
(``csrc/scaled_gemm.cc``), read back by an independent f64 model of that contract, against the
reference GEMM; which kernel each shape gets; and what the CUDA lowering calls.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax.diagnostics import coverage
from fp8jax.ops import block_gemm, cublaslt, dot, scaling

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
CALL = f"@{cublaslt.TARGET}("


def _operands(m, n, k, b_fmt=E4M3, blocks=True, seed=0):
    t = math.ceil(k / 128)
    ka, kb, ks, kt = jax.random.split(jax.random.PRNGKey(seed), 4)
    a = (jax.random.normal(ka, (m, k)) * 8).astype(E4M3)
    b = (jax.random.normal(kb, (n, k)) * 8).astype(b_fmt)
    rows = math.ceil(n / 128) if blocks else n
    inv = lambda key, s: jnp.exp2(jax.random.uniform(key, s, jnp.float32, -3, 3))  # noqa: E731
    return a, inv(ks, (m, t)), b, inv(kt, (rows, t))


def _model(a, a_s, b, b_s, kind):
    """The handler's documented contract in f64, reading the scales in cuBLASLt's layouts:
    kind BLOCKS: a_s [T, M], b_s [Nb, T4]; kind TILES: a_s [T, M], b_s [T, N]."""
    a64 = np.asarray(a.astype(jnp.float32), np.float64)
    b64 = np.asarray(b.astype(jnp.float32), np.float64)
    (m, k), n = a64.shape, b64.shape[0]
    a_s, b_s = np.asarray(a_s, np.float64), np.asarray(b_s, np.float64)
    y = np.zeros((m, n))
    for t in range(math.ceil(k / 128)):
        cols = slice(t * 128, min(k, (t + 1) * 128))
        part = a64[:, cols] @ b64[:, cols].T
        b_t = b_s[np.arange(n) // 128, t] if kind == cublaslt.BLOCKS else b_s[t, :]
        y += part * a_s[t, :][:, None] * b_t[None, :]
    return y


@pytest.fixture
def lt_available(monkeypatch):
    """Pretend the handler is built (lowering for CUDA needs only its target name)."""
    monkeypatch.setattr(cublaslt, "_load", lambda: None)


def _has_cuda() -> bool:
    try:
        return bool(jax.devices("cuda"))
    except RuntimeError:
        return False


def test_unavailable_here_says_why_and_the_raw_call_refuses(monkeypatch):
    cublaslt._load.cache_clear()
    if not _has_cuda():
        assert not cublaslt.available() and cublaslt.unavailable_reason() == "no CUDA GPU"
        a, _, b, _ = _operands(32, 32, 64)
        with pytest.raises(RuntimeError, match="unavailable here: no CUDA GPU"):
            cublaslt.rowwise_dot(a, jnp.ones(32), b, jnp.ones(32), jnp.float32)
    monkeypatch.setenv("FP8JAX_CUBLASLT", "0")
    cublaslt._load.cache_clear()
    try:
        assert cublaslt.unavailable_reason() == "disabled by FP8JAX_CUBLASLT=0"
    finally:
        monkeypatch.delenv("FP8JAX_CUBLASLT")
        cublaslt._load.cache_clear()


@pytest.mark.parametrize("k", [384, 512, 640, 1040])  # T = 3, 4, 5 and a partial last tile
@pytest.mark.parametrize("blocks", [True, False])
def test_block_scales_in_cublaslt_layout_give_the_reference_product(k, blocks):
    """``block_scales`` lays out the contract's multipliers so that the handler's documented
    reading of them reproduces ``block_scaled_dot_reference`` (f32 out, to f32 rounding)."""
    m, n = 48, 272  # N not a multiple of 128: a partial last block of b
    a, a_inv, b, b_inv = _operands(m, n, k, blocks=blocks)
    a_s, b_s = cublaslt.block_scales(a_inv, b_inv, blocks)
    t = math.ceil(k / 128)
    assert a_s.shape == (t, m)
    assert b_s.shape == ((math.ceil(n / 128), 4 * math.ceil(t / 4)) if blocks else (t, n))
    if blocks:  # the padding to 4 tiles of K is zeros: never read for a real tile
        assert not np.any(np.asarray(b_s)[:, t:])
    kind = cublaslt.BLOCKS if blocks else cublaslt.TILES
    got = _model(a, a_s, b, b_s, kind)
    ref = block_gemm.block_scaled_dot_reference(
        a, a_inv, b, b_inv, out_dtype=jnp.float32, b_blocks=blocks
    )
    ref = np.asarray(ref, np.float64)
    # f32 accumulation of T promoted tiles against f64: a few f32 ulps of the largest value.
    np.testing.assert_allclose(got, ref, rtol=0, atol=16 * 2.0**-24 * np.max(np.abs(ref)))


def test_supports_fp8_pairs_and_multiples_of_16():
    assert cublaslt.supports(32, 48, 64, E4M3, E4M3, jnp.bfloat16)
    assert cublaslt.supports(32, 48, 64, E5M2, E4M3, jnp.float32)  # mixed pairs run
    assert not cublaslt.supports(32, 48, 64, E5M2, E5M2, jnp.bfloat16)  # no E5M2 x E5M2
    assert not cublaslt.supports(32, 48, 64, jnp.bfloat16, E4M3, jnp.bfloat16)
    assert not cublaslt.supports(32, 48, 64, E4M3, E4M3, jnp.float8_e4m3fn)  # FP8 out
    for m, n, k in ((33, 48, 64), (32, 40, 64), (32, 48, 72)):
        assert not cublaslt.supports(m, n, k, E4M3, E4M3, jnp.bfloat16)


def _cuda_text(fn, *args) -> str:
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    return lowered.as_text(debug_info=True)


@pytest.mark.parametrize("blocks", [True, False])
def test_available_cublaslt_runs_the_block_gemm_on_cuda(lt_available, blocks):
    """With the handler available, a 128-block GEMM of multiples of 16 lowers to one cuBLASLt
    call on CUDA and the reference on CPU; other shapes and block sizes keep the Pallas kernels;
    the coverage report reads the call as an FP8 GEMM of its operands."""
    args = _operands(256, 384, 512, blocks=blocks)
    assert block_gemm.kernel_for(256, 384, 512, 128, blocks) == "cublaslt"
    text = _cuda_text(lambda *x: block_gemm.block_scaled_dot(*x, impl="pallas"), *args)
    assert text.count(CALL) == 1 and coverage.MOSAIC not in text
    (entry,) = coverage.parse_stablehlo(text)
    assert entry.kernel == coverage.SCALED_GEMM and entry.is_fp8
    assert (entry.lhs_shape, entry.rhs_shape, entry.out_shape) == (
        (256, 512),
        (384, 512),
        (256, 384),
    )
    cpu = jax.jit(lambda *x: block_gemm.block_scaled_dot(*x, impl="pallas")).lower(*args)
    assert CALL not in cpu.as_text()
    assert block_gemm.kernel_for(256, 384, 520, 128, blocks) != "cublaslt"  # K % 16
    assert block_gemm.kernel_for(256, 384, 512, 64, blocks) != "cublaslt"  # its blocks are 128
    dtypes = (E5M2, E5M2, jnp.bfloat16)
    assert block_gemm.kernel_for(256, 384, 512, 128, blocks, dtypes) != "cublaslt"


def test_vmapped_cublaslt_gemm_runs_per_replica_in_a_loop(lt_available):
    a, a_inv, b, b_inv = (jnp.stack([x, x]) for x in _operands(256, 256, 256))
    f = jax.vmap(lambda *x: block_gemm.block_scaled_dot(*x, impl="pallas"))
    text = _cuda_text(f, a, a_inv, b, b_inv)
    (call,) = [line for line in text.splitlines() if CALL in line]
    assert "tensor<256x256xbf16>" in call and "stablehlo.while" in text


@pytest.mark.parametrize("recipe", ["rowwise", "block"])
def test_fine_matmul_gemms_lower_to_cublaslt(lt_available, recipe):
    """A fine recipe's three GEMMs (through ``dot_general``, with the GPU casts) each call
    cuBLASLt once on CUDA when it is available: rowwise with the scales in its epilogue, block
    with its block scales; no other GEMM, and the coverage report names each by its recipe."""
    meta = scaling.init_meta(scaling.make_recipe(recipe))

    def loss(x, w):
        y, _ = dot.dot_general(x, w, (((1,), (0,)), ((), ())), meta, cast_kernel="pallas")
        return y.astype(jnp.float32).sum()

    x = jax.random.normal(jax.random.PRNGKey(0), (256, 384), jnp.bfloat16)
    w = jax.random.normal(jax.random.PRNGKey(1), (384, 512), jnp.float32)
    text = _cuda_text(jax.value_and_grad(loss, argnums=(0, 1)), x, w)
    assert text.count(CALL) == 3  # fwd, dgrad and wgrad
    entries = coverage.parse_stablehlo(text)
    assert [e.kernel for e in entries] == [coverage.SCALED_GEMM] * 3
    assert {e.recipe for e in entries} == {recipe}
    cpu = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).as_text()
    assert CALL not in cpu
