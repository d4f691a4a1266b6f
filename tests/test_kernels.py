"""The fused FP8 cast+transpose+amax kernel: same bits as XLA's quantize, lowering per platform."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax import spec
from fp8jax.ops import dot, kernels
from fp8jax.trainer import loop as train_lib

from fp8_testing import bits

DENSE = (((1,), (0,)), ((), ()))  # [M, K] . [K, N]
TRITON = "__gpu$xla.gpu.triton"


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_kernel_matches_xla_quantize_bit_for_bit(fmt, dtype):
    # [48, 272]: 16-wide blocks on the first axis and 16 on the second (272 = 17 x 16), values
    # far above the format's max (saturate), tiny ones (flush) and negative zero.
    rng = np.random.default_rng(0)
    x = rng.standard_normal((48, 272)).astype(np.float32) * 40
    x[0, :8] = [1e9, -1e9, 1e-30, -0.0, 0.0, 3e4, -6e4, 7e-3]
    x = jnp.asarray(x, dtype)
    scale = jnp.float32(1.7)
    q, q_t, amax = jax.jit(lambda x, s: kernels.cast_transpose(x, s, fmt, "interpret"))(x, scale)
    ref_q, ref_t, ref_amax = kernels.cast_transpose(x, scale, fmt, "xla")
    assert q.dtype == fp8jax.ops.formats.as_dtype(fmt) and q.shape == (48, 272)
    assert q_t.shape == (272, 48)
    np.testing.assert_array_equal(bits(q), bits(ref_q))
    np.testing.assert_array_equal(bits(q_t), bits(ref_t))
    np.testing.assert_array_equal(bits(q_t), bits(q).T)
    assert float(amax) == float(ref_amax) == float(jnp.max(jnp.abs(x.astype(jnp.float32))))
    assert np.all(np.isfinite(np.asarray(q, np.float32)))  # saturated, never Inf/NaN


@pytest.mark.parametrize("pending", [0.25, 1e6])
def test_kernel_records_the_amax_into_a_history_in_place(pending):
    """With ``pending=``, slot 0 of the history takes the amax by max (scaling.record's rule),
    the other slots stay, and the kernel's bits equal XLA's; on CUDA the history is aliased."""
    x = jnp.asarray(np.random.default_rng(3).standard_normal((32, 64)) * 5, jnp.bfloat16)
    hist = jnp.arange(17, dtype=jnp.float32).at[0].set(pending)
    cast = lambda impl: jax.jit(  # noqa: E731
        lambda x, h: kernels.cast_transpose(x, jnp.float32(2.0), "e4m3", impl, pending=h)
    )
    q, _, new = cast("interpret")(x, hist)
    ref_q, _, ref = cast("xla")(x, hist)
    amax = float(jnp.max(jnp.abs(x.astype(jnp.float32))))
    np.testing.assert_array_equal(np.asarray(new), np.asarray(ref))
    np.testing.assert_array_equal(bits(q), bits(ref_q))
    assert float(new[0]) == max(pending, amax)
    np.testing.assert_array_equal(np.asarray(new[1:]), np.arange(1, 17, dtype=np.float32))
    cuda = cast("pallas").trace(x, hist).lower(lowering_platforms=("cuda",)).as_text()
    assert cuda.count(TRITON) == 1 and cuda.count("stablehlo.output_operand_alias<") == 1
    with pytest.raises(ValueError, match="pending must be an f32 vector"):
        kernels.cast_transpose(x, 2.0, "e4m3", "interpret", pending=hist.astype(jnp.bfloat16))


def test_kernel_records_the_finite_blocks_of_a_tensor_with_inf():
    """Per block, a non-finite amax counts as 0: the other blocks' amax is still recorded."""
    x = np.ones((32, 256), np.float32)  # two blocks of [32, 128]
    x[20, 200] = 7.0  # the second block
    x[0, 0] = np.inf  # the first
    amax = jax.jit(lambda x: kernels.cast_transpose(x, 1.0, "e4m3", "interpret")[2])(x)
    assert float(amax) == 7.0


def test_unaligned_shapes_take_the_xla_path():
    x = jnp.ones((20, 24), jnp.float32)  # neither side a multiple of 16
    lowered = jax.jit(lambda x: kernels.cast_transpose(x, jnp.float32(1.0), "e4m3", "pallas"))
    text = lowered.trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert TRITON not in text


def test_unknown_kernel_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown FP8 cast kernel 'triton'.*fp8.cast_kernel"):
        dot.dot_general(
            jnp.ones((16, 16)), jnp.ones((16, 16)), DENSE, fp8jax.init_meta(), None, "triton"
        )


def test_auto_cast_is_xla_on_cpu_and_the_kernel_on_gpus():
    assert jax.default_backend() == "cpu"
    assert kernels.resolve_impl("auto") == "xla"
    assert kernels.resolve_impl("auto", "cpu") == "xla"
    assert kernels.resolve_impl("auto", "gpu") == "pallas"
    assert kernels.resolve_impl("auto", "tpu") == "xla"
    for impl in kernels.IMPLS:  # explicit choices stand on every platform
        assert kernels.resolve_impl(impl, "gpu") == kernels.resolve_impl(impl, "cpu") == impl
    with pytest.raises(ValueError, match="unknown FP8 cast kernel 'triton'"):
        kernels.resolve_impl("triton", "gpu")
    # The ops' default is 'auto': on CPU it runs, and traces, as the explicit 'xla'.
    x, w, meta = _linear_inputs()
    default = jax.jit(lambda x, w, m: dot.dot_general(x, w, DENSE, m))
    xla = jax.jit(lambda x, w, m: dot.dot_general(x, w, DENSE, m, cast_kernel="xla"))
    assert default.lower(x, w, meta).as_text() == xla.lower(x, w, meta).as_text()
    a, b = jax.tree.leaves(default(x, w, meta)), jax.tree.leaves(xla(x, w, meta))
    for u, v in zip(a, b, strict=True):
        np.testing.assert_array_equal(np.asarray(u, np.float32), np.asarray(v, np.float32))


def _step(impl, recipe=None):
    """jit(loss, new meta and grads of an FP8 linear) with the given cast kernel."""

    def loss(x, w, meta):
        y, new_meta = dot.dot_general(x, w, DENSE, meta, cast_kernel=impl)
        weights = jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape) / y.size - 0.5
        return jnp.sum(y.astype(jnp.float32) * weights), (y, new_meta)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def _linear_inputs():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((64, 48)), jnp.bfloat16)  # [M, K]
    w = jnp.asarray(rng.standard_normal((48, 80)) * 0.1, jnp.float32)  # [K, N]
    # A meta after one step, so the scales in use are not all 1.
    (_, (_, m)), (_, _, dm) = _step("xla")(x, w, fp8jax.init_meta())
    return x, w, fp8jax.update_state(m, dm)


def test_fp8_linear_with_kernel_equals_xla_path():
    """Output, dx and every amax exactly; dw to f32 rounding (its GEMM sums in another order)."""
    x, w, meta = _linear_inputs()
    (loss_a, (y_a, m_a)), (dx_a, dw_a, dm_a) = _step("xla")(x, w, meta)
    (loss_b, (y_b, m_b)), (dx_b, dw_b, dm_b) = _step("interpret")(x, w, meta)
    np.testing.assert_array_equal(np.asarray(y_a, np.float32), np.asarray(y_b, np.float32))
    np.testing.assert_array_equal(np.asarray(dx_a, np.float32), np.asarray(dx_b, np.float32))
    np.testing.assert_allclose(np.asarray(dw_b), np.asarray(dw_a), rtol=1e-6, atol=1e-6)
    assert float(loss_a) == float(loss_b)
    for a, b in zip(jax.tree.leaves((m_a, dm_a)), jax.tree.leaves((m_b, dm_b)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(dm_b.dy.amax_history[0]) > 0  # the backward pass recorded dy's amax


def _cuda_text(impl, recipe=None):
    x, w, _ = _linear_inputs()
    meta = fp8jax.init_meta(recipe) if recipe else fp8jax.init_meta()
    return _step(impl).trace(x, w, meta).lower(lowering_platforms=("cuda",)).as_text()


def test_kernel_lowers_to_triton_on_cuda_and_xla_on_cpu():
    text = _cuda_text("pallas")
    # x and w in the forward pass, dy in the backward: three fused kernels, three FP8 GEMMs.
    assert text.count(TRITON) == 3
    # Each kernel writes its amax into its state's history in place (no reduction after it).
    assert text.count("stablehlo.output_operand_alias<") == 3
    f8_dots = [ln for ln in text.splitlines() if "stablehlo.dot_general" in ln and "f8E" in ln]
    assert len(f8_dots) == 3
    x, w, meta = _linear_inputs()
    assert TRITON not in _step("pallas").lower(x, w, meta).as_text()  # this (CPU) machine
    assert TRITON not in _cuda_text("xla")


def test_current_scaling_keeps_the_xla_path():
    # The scale depends on this call's amax, so the kernel (one pass, scale known) cannot apply.
    assert TRITON not in _cuda_text("pallas", fp8jax.ops.scaling.CurrentScaling())


def test_config_field_reaches_every_fp8_linear():
    c = train_lib.load_config("tiny")
    c.fp8.level, c.fp8.cast_kernel = "O1", "pallas"
    c.model.num_layers = 1
    env = train_lib.setup(spec.parse(c), donate=False)
    state = jax.eval_shape(env.init, jax.random.PRNGKey(0))
    tok = jax.ShapeDtypeStruct((c.batch_size, c.seq_len), jnp.int32)
    lowered = env.train_step.trace(state, {"inputs": tok, "targets": tok})
    text = lowered.lower(lowering_platforms=("cuda",)).as_text()
    # tiny's GPT block: q, kv, o, mlp wi, mlp wo; 3 kernels each (x, w, dy).
    assert text.count(TRITON) == 5 * 3
    c.fp8.cast_kernel = "fused"
    with pytest.raises(ValueError, match="unknown fp8.cast_kernel 'fused'"):
        spec.parse(c)


def test_nnx_linear_with_kernel_equals_xla_path():
    from flax import nnx

    def run(impl):
        layer = nnx.Linear(
            48, 80, dot_general=fp8jax.nn.nnx.Fp8DotGeneral(cast_kernel=impl), rngs=nnx.Rngs(0)
        )
        x = jnp.asarray(np.random.default_rng(2).standard_normal((32, 48)), jnp.float32)
        return np.asarray(nnx.jit(lambda m, x: m(x))(layer, x))

    np.testing.assert_array_equal(run("xla"), run("interpret"))
    with pytest.raises(ValueError, match="unknown FP8 cast kernel"):
        fp8jax.nn.nnx.Fp8DotGeneral(cast_kernel="cuda")


def test_kernel_under_vmap_as_the_data_parallel_step_runs_it():
    """The multi-replica step vmaps the model over replicas: same results, still Triton."""
    x, w, meta = _linear_inputs()
    x_2 = jnp.stack([x, -x])  # [replicas, M, K]

    def replicas(impl):
        def one(xr):
            y, new_meta = dot.dot_general(xr, w, DENSE, meta, cast_kernel=impl)
            return y, new_meta.x.amax_history[0]

        return jax.jit(jax.vmap(one))

    y_a, amax_a = replicas("xla")(x_2)
    y_b, amax_b = replicas("interpret")(x_2)
    np.testing.assert_array_equal(np.asarray(y_a, np.float32), np.asarray(y_b, np.float32))
    np.testing.assert_array_equal(np.asarray(amax_a), np.asarray(amax_b))
    cuda = replicas("pallas").trace(x_2).lower(lowering_platforms=("cuda",)).as_text()
    assert cuda.count(TRITON) == 2  # x and w, batched over replicas by Pallas' vmap rule
