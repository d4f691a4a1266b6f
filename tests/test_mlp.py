"""GPT's MLP as one FP8 custom VJP (``fp8.fuse_mlp``): same math as two FP8 matmuls."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax import spec
from fp8jax.ops import act_kernels, activations, dot, kernels, mlp
from fp8jax.trainer import loop as train_lib

from fp8_testing import bits, same_step_grads

ACT = "gelu_tanh"
TRITON = "__gpu$xla.gpu.triton"


@pytest.mark.optimized
def test_gelu_derivative_formula_matches_autodiff():
    x = jnp.linspace(-8.0, 8.0, 4097, dtype=jnp.float32)
    auto = jax.vmap(jax.grad(lambda v: jax.nn.gelu(v, approximate=True)))(x)
    np.testing.assert_allclose(activations.gelu_tanh_grad(x), auto, rtol=1e-5, atol=1e-6)


@pytest.mark.optimized
def test_gelu_and_grad_from_one_tanh_keep_each_functions_bits():
    """The GELU' pass that also rebuilds GELU shares one tanh: both halves bit-equal the
    functions alone, jitted (XLA fuses them) and not."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal(4096) * 4, jnp.float32)
    for f in (lambda v: v, jax.jit):
        a, g = f(activations.gelu_tanh_and_grad)(x)
        np.testing.assert_array_equal(bits(a), bits(f(activations.gelu_tanh)(x)))
        np.testing.assert_array_equal(bits(g), bits(f(activations.gelu_tanh_grad)(x)))


def test_act_grad_kernel_matches_xla_bit_for_bit():
    rng = np.random.default_rng(0)
    pre = jnp.asarray(rng.standard_normal((64, 256)) * 3, jnp.bfloat16)  # [M, F]
    da = jnp.asarray(rng.standard_normal((64, 256)) * 50, jnp.bfloat16)  # raw dgrad output
    inv, scale = jnp.float32(0.01), jnp.float32(2.0**12)

    def run(impl):
        f = functools.partial(act_kernels.act_grad_cast_transpose, fmt="e5m2", impl=impl)
        return jax.jit(f)(pre, da, inv, scale)

    q, q_t, amax, db = run("interpret")
    ref_q, _, ref_amax, ref_db = run("xla")
    np.testing.assert_array_equal(bits(q), bits(ref_q))
    np.testing.assert_array_equal(bits(q_t), bits(q).T)
    assert float(amax) == float(ref_amax) > 0
    d = activations.gelu_tanh_grad(pre.astype(jnp.float32)) * (da.astype(jnp.float32) * inv)
    np.testing.assert_allclose(db, jnp.sum(d, axis=0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ref_db, db, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_affine_prologues_match_xla_bit_for_bit(dtype):
    """``affine=(alpha, bias)``: the casts rebuild ``pre = h_raw * alpha + bias`` in f32 first;
    the GELU' pass's ``act_scale`` output is the forward cast's E4M3 ``act(pre)``, transposed."""
    rng = np.random.default_rng(2)
    h_raw = jnp.asarray(rng.standard_normal((64, 256)) * 300, dtype)  # [M, F] scaled GEMM output
    da = jnp.asarray(rng.standard_normal((64, 256)) * 50, jnp.bfloat16)
    bias = jnp.asarray(rng.standard_normal(256), jnp.float32)
    affine, scale = (jnp.float32(0.01), bias), jnp.float32(2.0**10)
    pre = h_raw.astype(jnp.float32) * 0.01 + bias  # [M, F] f32, as the kernels compute it

    def fwd(impl):
        f = functools.partial(kernels.cast_transpose, fmt="e4m3", impl=impl, prologue=ACT)
        return jax.jit(lambda h, s, a: f(h, s, affine=a))(h_raw, jnp.float32(3.0), affine)

    def bwd(impl):  # with the forward's scale: wo's E4M3 input rebuilt, transposed
        f = functools.partial(act_kernels.act_grad_cast_transpose, fmt="e5m2", impl=impl)
        return jax.jit(
            lambda h, d, a: f(h, d, jnp.float32(0.02), scale, affine=a, act_scale=jnp.float32(3.0))
        )(h_raw, da, affine)

    (q, q_t, amax), (ref_q, _, ref_amax) = fwd("interpret"), fwd("xla")
    np.testing.assert_array_equal(bits(q), bits(ref_q))
    np.testing.assert_array_equal(bits(q_t), bits(q).T)
    assert float(amax) == float(ref_amax) == float(jnp.max(jnp.abs(activations.gelu_tanh(pre))))
    (g, g_t, g_amax, db, a_t), (ref_g, _, ref_g_amax, ref_db, ref_a_t) = (
        bwd("interpret"),
        bwd("xla"),
    )
    np.testing.assert_array_equal(bits(g), bits(ref_g))
    np.testing.assert_array_equal(bits(g_t), bits(g).T)
    # The rebuilt wo input is the forward cast's, bit for bit, from either implementation.
    np.testing.assert_array_equal(bits(a_t), bits(q_t))
    np.testing.assert_array_equal(bits(ref_a_t), bits(q_t))
    assert float(g_amax) == float(ref_g_amax) > 0
    d = activations.gelu_tanh_grad(pre) * (da.astype(jnp.float32) * 0.02)
    np.testing.assert_allclose(db, jnp.sum(d, axis=0), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(ref_db, db, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match=r"affine must be .*bias of shape \(256,\)"):
        kernels.cast_transpose(h_raw, scale, "e4m3", "xla", affine=(1.0, bias[:8]))


def _tiny(fuse_mlp, dtype, kernel="interpret", level="O1"):
    c = train_lib.load_config("tiny")
    c.fp8.level, c.fp8.fuse_mlp, c.fp8.cast_kernel = level, fuse_mlp, kernel
    c.fp8.fuse_norm = False  # the op against two matmuls; the folded norm: test_norm
    m = c.model
    m.num_layers, m.d_model, m.num_heads, m.num_kv_heads, m.d_ff = 1, 64, 2, 2, 256
    m.vocab_size, m.max_len, m.dtype, c.seq_len, c.batch_size = 128, 16, dtype, 16, 4
    return c


def test_fused_mlp_equals_two_fp8_matmuls_in_f32(kernel="interpret"):
    """Same params, loss, new scale state and FP8 cotangents; grads to f32 rounding."""
    tok = jax.random.randint(jax.random.key(0), (2, 16), 0, 128, jnp.int32)
    fused, plain = _tiny(True, "float32", kernel), _tiny(False, "float32", kernel)
    g_f, g_p = same_step_grads(fused, plain, tok)
    pairs = zip(jax.tree_util.tree_leaves_with_path(g_f), jax.tree.leaves(g_p), strict=True)
    for (path, a), b in pairs:
        rel = np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b))
        assert rel < 1e-6, (jax.tree_util.keystr(path), rel)


def test_fused_mlp_lowers_to_six_triton_kernels_and_no_xla_tanh():
    """Forward: x, w1, gelu(pre), w2 casts; backward: dy's cast and GELU' + wi's E5M2 cast."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((32, 64)), jnp.bfloat16)
    w1 = jnp.asarray(rng.standard_normal((64, 128)) * 0.1, jnp.bfloat16)
    b1 = jnp.zeros((128,), jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((128, 64)) * 0.1, jnp.bfloat16)
    m = fp8jax.init_meta()

    def loss(x, w1, b1, w2):
        y, _, _ = mlp.gelu_mlp(x, w1, b1, w2, m, m, "pallas")
        return jnp.sum(y.astype(jnp.float32))

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
    text = grad.trace(x, w1, b1, w2).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count(TRITON) == 6
    assert "stablehlo.tanh" not in text  # GELU and GELU' both run inside the kernels
    f8_dots = [ln for ln in text.splitlines() if "stablehlo.dot_general" in ln and "f8E" in ln]
    assert len(f8_dots) == 6


def test_fused_mlp_writes_no_pre_activation_and_casts_f32_weights_directly():
    """wi's unscale and bias run inside wo's cast: no XLA op makes a [M, F] tensor, and f32
    weights reach their casts without a bf16 copy; their gradients come back in f32."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((32, 64)), jnp.bfloat16)  # [M, D]
    w1 = jnp.asarray(rng.standard_normal((64, 128)) * 0.1, jnp.float32)  # [D, F]
    b1 = jnp.asarray(rng.standard_normal(128), jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((128, 64)) * 0.1, jnp.float32)
    m = fp8jax.init_meta()

    def loss(x, w1, b1, w2, kernel):
        y, _, _ = mlp.gelu_mlp(x, w1, b1, w2, m, m, kernel)
        return jnp.sum(y.astype(jnp.float32))

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)), static_argnums=4)
    text = grad.trace(x, w1, b1, w2, "pallas").lower(lowering_platforms=("cuda",)).as_text()
    skip = ("custom_call", "dot_general", "stablehlo.return")  # GEMMs, casts, branch results
    ops = [ln for ln in text.splitlines() if "stablehlo." in ln and not any(s in ln for s in skip)]
    at_mf = [ln for ln in ops if "tensor<32x128x" in ln]
    assert not at_mf, at_mf  # only the GEMMs and the Triton casts touch [M, F]
    assert not [ln for ln in ops if "(tensor<64x128xf32>) -> tensor<64x128xbf16>" in ln]
    # Against the two-matmul path on bf16 copies of the weights: FP8 noise apart (E5M2 dy).
    (_, g), (_, g_ref) = grad(x, w1, b1, w2, "interpret"), grad(x, w1, b1, w2, "xla")
    assert [a.dtype for a in g] == [jnp.bfloat16, jnp.float32, jnp.float32, jnp.float32]
    for a, b in zip(g, g_ref, strict=True):  # 0.6-4.7% measured; a lost bias or scale: O(1)
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < 0.1


def test_recompute_cast_rebuilds_wo_input_bit_for_bit_and_keeps_it_out_of_the_residuals():
    """``recompute_cast``: the same outputs, gradients and FP8 state bits; the residuals lose
    exactly wo's E4M3 transposed input ([F, M], one byte each); lowered for CUDA, no more
    kernels: the backward's GELU' kernel writes that input as one more output."""
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((32, 64)), jnp.bfloat16)  # [M, D]
    w1 = jnp.asarray(rng.standard_normal((64, 128)) * 0.1, jnp.bfloat16)  # [D, F]
    b1 = jnp.asarray(rng.standard_normal(128) * 0.1, jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((128, 64)) * 0.1, jnp.bfloat16)
    m = fp8jax.init_meta()
    m = m.replace(x=m.x.replace(scale=jnp.float32(64.0)))  # wo's input scale != 1: it matters

    def run(recompute, kernel="interpret"):
        def f(x, w1, b1, w2):
            y, m1, m2 = mlp.gelu_mlp(x, w1, b1, w2, m, m, kernel, recompute_cast=recompute)
            return y, (m1, m2)

        (y, metas), vjp = jax.vjp(f, x, w1, b1, w2)
        ct_y = jnp.asarray(rng.standard_normal(y.shape), y.dtype)
        ct_metas = jax.tree.map(jnp.zeros_like, metas)
        saved = sum(v.nbytes for v in jax.tree.leaves(vjp) if hasattr(v, "nbytes"))
        return (y, metas, vjp((ct_y, ct_metas))), saved

    rng_state = rng.bit_generator.state
    kept, kept_bytes = run(False)
    rng.bit_generator.state = rng_state
    rebuilt, rebuilt_bytes = run(True)
    for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(rebuilt), strict=True):
        np.testing.assert_array_equal(bits(a), bits(b))
    assert kept_bytes - rebuilt_bytes == 128 * 32  # wo's E4M3 x.T: F x M bytes

    def lowered(recompute):
        def loss(x, w1, b1, w2):
            y, _, _ = mlp.gelu_mlp(x, w1, b1, w2, m, m, "pallas", recompute_cast=recompute)
            return jnp.sum(y.astype(jnp.float32))

        grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))  # the forward is used
        return grad.trace(x, w1, b1, w2).lower(lowering_platforms=("cuda",)).as_text()

    def kernel_outputs(recompute):
        text = lowered(recompute)
        return [line.split("->")[-1] for line in text.splitlines() if TRITON in line]

    kept_calls, rebuilt_calls = kernel_outputs(False), kernel_outputs(True)
    assert len(kept_calls) == len(rebuilt_calls) == 6
    wo_input = "tensor<128x32xf8E4M3FN>"  # [F, M] E4M3
    grad_kernel = [i for i, c in enumerate(rebuilt_calls) if "f8E5M2" in c and "1x128xf32" in c]
    assert len(grad_kernel) == 1 and rebuilt_calls[grad_kernel[0]].count(wo_input) == 1
    assert kept_calls[grad_kernel[0]].count(wo_input) == 0


def _cuda_kernel_outputs(f, *args) -> list[str]:
    """The result types of each Triton call in ``f``'s program lowered for CUDA."""
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return [line.split("->")[-1] for line in text.splitlines() if TRITON in line]


@pytest.mark.parametrize("rebuild", [True, "x", "w"])
@pytest.mark.parametrize("op", ["dot", "mlp"])
def test_rebuild_casts_operands_again_bit_for_bit_one_layout_each(op, rebuild):
    """``rebuild``: the same outputs, gradients and FP8 state bits as keeping the FP8 copies;
    the residuals hold the rebuilt operands as given (True: no E4M3 byte; 'x': the weights'
    E4M3 copies only; 'w': x's only), and lowered for CUDA (True) each cast writes one layout:
    x [M, K] and w.T [N, K] forward, x.T and w backward, no amax there."""
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((32, 64)), jnp.bfloat16)  # [M, D]
    w1 = jnp.asarray(rng.standard_normal((64, 128)) * 0.1, jnp.float32)  # [D, F], f32 masters
    b1 = jnp.asarray(rng.standard_normal(128) * 0.1, jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((128, 64)) * 0.1, jnp.float32)
    m = fp8jax.init_meta()
    m = m.replace(x=m.x.replace(scale=jnp.float32(8.0)), w=m.w.replace(scale=jnp.float32(64.0)))
    ct_y = jnp.asarray(rng.standard_normal((32, 64)), jnp.bfloat16)  # the MLP's output
    ct_h = jnp.asarray(rng.standard_normal((32, 128)), jnp.bfloat16)  # the dot's: x . w1

    def fn(rebuild, kernel):
        if op == "dot":
            return lambda x, w1, b1, w2: dot.dot_general(
                x, w1, mlp.DENSE, m, jnp.bfloat16, kernel, rebuild=rebuild
            )
        return lambda x, w1, b1, w2: mlp.gelu_mlp(x, w1, b1, w2, m, m, kernel, rebuild=rebuild)

    def run(rebuild):
        out, vjp = jax.vjp(fn(rebuild, "interpret"), x, w1, b1, w2)
        cts = jax.tree.map(jnp.zeros_like, out)
        cts = (ct_y, *cts[1:]) if op == "mlp" else (ct_h, cts[1])
        fp8_bytes = sum(v.nbytes for v in jax.tree.leaves(vjp) if v.dtype.itemsize == 1)
        return (out, vjp(cts)), fp8_bytes

    (kept, kept_fp8), (rebuilt, rebuilt_fp8) = run(False), run(rebuild)
    for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(rebuilt), strict=True):
        np.testing.assert_array_equal(bits(a), bits(b))
    w_bytes = w1.size + (w2.size if op == "mlp" else 0)  # one E4M3 byte per weight element
    want = {True: 0, "x": w_bytes, "w": kept_fp8 - w_bytes}[rebuild]
    assert kept_fp8 > w_bytes > 0 and rebuilt_fp8 == want, (kept_fp8, rebuilt_fp8)
    if rebuild is not True:
        return

    def grads(x, w1, b1, w2):
        y = fn(True, "pallas")(x, w1, b1, w2)[0]
        return jax.grad(
            lambda *a: jnp.sum(fn(True, "pallas")(*a)[0].astype(jnp.float32)), argnums=(0, 1, 3)
        )(x, w1, b1, w2), y

    calls = _cuda_kernel_outputs(grads, x, w1, b1, w2)
    e4m3 = [c for c in calls if "f8E4M3FN" in c and "f8E5M2" not in c]
    assert e4m3 and all(c.count("f8E4M3FN") == 1 for c in e4m3), e4m3
    assert any("32x64xf8E4M3FN" in c and "xf32" in c for c in e4m3)  # x forward, with amax
    assert any("64x32xf8E4M3FN" in c and "xf32" not in c for c in e4m3)  # x.T backward


def test_fused_mlp_train_step_at_o2_tracks_two_matmuls():
    """The whole train step at O2 (FP16 masters dequantized in the fused layers)."""

    def losses(fuse):
        c = _tiny(fuse, "float32", "pallas", "O2")  # 'pallas': XLA ops on this CPU
        tok = np.random.default_rng(0).integers(0, 128, (4, 17)).astype(np.int32)
        batch = {"inputs": tok[:, :-1], "targets": tok[:, 1:]}
        env = train_lib.setup(spec.parse(c))
        state = env.init(jax.random.PRNGKey(0))
        out = []
        for _ in range(3):
            state, metrics = env.train_step(state, batch)
            out.append(float(metrics["loss"]))
        stats = env.stats_step(state, batch)  # the FP8 health step takes the unfused path
        assert jax.tree.leaves(stats)
        return np.array(out)

    fused, plain = losses(True), losses(False)
    assert fused[-1] < fused[0]
    np.testing.assert_allclose(fused, plain, rtol=1e-5)


def test_gelu_mlp_checks_its_cast_kernel():
    x = jnp.ones((16, 16))
    with pytest.raises(ValueError, match="unknown FP8 cast kernel"):
        mlp.gelu_mlp(x, x, x[0], x, fp8jax.init_meta(), fp8jax.init_meta(), "cuda")
    with pytest.raises(ValueError, match="unknown FP8 cast prologue"):
        act_kernels.act_grad_cast_transpose(x, x, 1.0, 1.0, "e5m2", "xla", act="relu")
    assert dot.PAD == 16  # gelu_mlp's fused path needs every dim in multiples of this


def test_rebuild_rejects_unknown_operands():
    """``rebuild`` names operands ('x', 'w', 'xw') or is a bool: anything else is an error."""
    x = jnp.ones((16, 16), jnp.bfloat16)
    with pytest.raises(ValueError, match="rebuild must be"):
        dot.dot_general(x, x, mlp.DENSE, fp8jax.init_meta(), rebuild="wx")
