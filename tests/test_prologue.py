"""The GELU fused into the FP8 cast of the MLP's second matmul (``prologue='gelu_tanh'``)."""

import contextlib
import functools
import io
import re

import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

import fp8jax
from fp8jax import FP8, models, spec
from fp8jax.ops import dot, formats, kernels
from fp8jax.trainer import loop as train_lib

from fp8_testing import bits

DENSE = (((1,), (0,)), ((), ()))  # [M, K] . [K, N]
TRITON = "__gpu$xla.gpu.triton"


def _gelu(x):
    return jax.nn.gelu(x.astype(jnp.float32), approximate=True)


def _inputs(dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.standard_normal((64, 48)) * 2, dtype)  # [M, K] pre-activation
    w = jnp.asarray(rng.standard_normal((48, 32)) * 0.1, jnp.float32)  # [K, N]
    r = jnp.asarray(rng.standard_normal((64, 32)), jnp.float32)  # [M, N] loss weights
    # Scales as after some steps, so a wrong scale in any of the three GEMMs shows.
    meta = fp8jax.init_meta().replace(
        x=fp8jax.init_meta().x.replace(scale=jnp.float32(90.0)),
        w=fp8jax.init_meta().w.replace(scale=jnp.float32(700.0)),
        dy=fp8jax.init_meta().dy.replace(scale=jnp.float32(2.0**12)),
    )
    return h, w, r, meta


def _grads(cast, prologue, outside=None):
    """jit(loss, grads of h, w, meta) of ``y = act(h) . w``, the act fused or ``outside``."""

    def loss(h, w, meta, r):
        x = outside(h) if outside else h
        y, new_meta = dot.dot_general(x, w, DENSE, meta, cast_kernel=cast, prologue=prologue)
        return jnp.sum(y.astype(jnp.float32) * r), new_meta

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_kernel_prologue_is_gelu_then_quantize_bit_for_bit(dtype):
    h = jnp.asarray(np.random.default_rng(1).standard_normal((48, 272)) * 30, dtype)
    scale = jnp.float32(3.0)
    cast = jax.jit(lambda h, s: kernels.cast_transpose(h, s, "e4m3", "interpret", "gelu_tanh"))
    q, q_t, amax = cast(h, scale)
    # The activation in f32, unrounded, then the ordinary saturating quantize.
    a = _gelu(h)
    np.testing.assert_array_equal(bits(q), bits(formats.quantize(a, scale, formats.E4M3)))
    np.testing.assert_array_equal(bits(q_t), bits(q).T)
    assert float(amax) == float(jnp.max(jnp.abs(a)))
    ref_q, _, ref_amax = kernels.cast_transpose(h, scale, "e4m3", "xla", "gelu_tanh")
    np.testing.assert_array_equal(bits(q), bits(ref_q))
    assert float(amax) == float(ref_amax)


@pytest.mark.optimized
@pytest.mark.parametrize("cast", ["xla", "interpret"])
def test_fused_gelu_equals_gelu_then_fp8_linear(cast):
    """f32: the output, dw and all amaxes exactly; dx through act' to f32 rounding."""
    h, w, r, meta = _inputs()
    (loss_a, m_a), (dh_a, dw_a, dm_a) = _grads(cast, None, outside=_gelu)(h, w, meta, r)
    (loss_b, m_b), (dh_b, dw_b, dm_b) = _grads(cast, "gelu_tanh")(h, w, meta, r)
    assert float(loss_a) == float(loss_b)
    np.testing.assert_array_equal(np.asarray(dw_a), np.asarray(dw_b))
    np.testing.assert_allclose(np.asarray(dh_b), np.asarray(dh_a), rtol=1e-5, atol=1e-6)
    assert float(jnp.max(jnp.abs(dh_b))) > 0
    for a, b in zip(jax.tree.leaves((m_a, dm_a)), jax.tree.leaves((m_b, dm_b)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_fused_gelu_kernel_equals_xla_path_in_bf16():
    h, w, r, meta = _inputs(jnp.bfloat16, seed=2)
    (loss_a, m_a), (dh_a, dw_a, dm_a) = _grads("xla", "gelu_tanh")(h, w, meta, r)
    (loss_b, m_b), (dh_b, dw_b, dm_b) = _grads("interpret", "gelu_tanh")(h, w, meta, r)
    assert float(loss_a) == float(loss_b) and dh_b.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(dh_a, np.float32), np.asarray(dh_b, np.float32))
    np.testing.assert_allclose(np.asarray(dw_b), np.asarray(dw_a), rtol=1e-6, atol=1e-6)
    for a, b in zip(jax.tree.leaves((m_a, dm_a)), jax.tree.leaves((m_b, dm_b)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_gelu_runs_inside_the_kernel_on_cuda():
    """Forward on a GPU: two Triton casts and no XLA tanh (the GELU is in x's kernel)."""
    h, w, _, meta = _inputs(jnp.bfloat16)

    def fwd(cast):
        f = jax.jit(
            lambda h, w, m: dot.dot_general(h, w, DENSE, m, cast_kernel=cast, prologue="gelu_tanh")
        )
        return f.trace(h, w, meta).lower(lowering_platforms=("cuda",)).as_text()

    fused, plain = fwd("pallas"), fwd("xla")
    assert fused.count(TRITON) == 2 and "stablehlo.tanh" not in fused
    assert "tanh.approx.f32" in fused  # the GPU's one-instruction tanh, inside the kernel
    assert TRITON not in plain and "stablehlo.tanh" in plain


def test_unknown_prologue_is_a_clear_error():
    h, w, _, meta = _inputs()
    with pytest.raises(ValueError, match="unknown FP8 cast prologue 'relu'.*gelu_tanh"):
        dot.dot_general(h, w, DENSE, meta, prologue="relu")
    with pytest.raises(ValueError, match="unknown FP8 cast prologue"):
        fp8jax.nn.nnx.Fp8DotGeneral(prologue="swish")


def _model(fuse: bool, dtype="bfloat16"):
    c = train_lib.load_config("tiny")
    c.fp8.level, c.fp8.fuse_activation, c.fp8.cast_kernel = "O1", fuse, "interpret"
    m = c.model
    m.num_layers, m.d_model, m.num_heads, m.num_kv_heads, m.d_ff = 1, 64, 2, 2, 256
    m.vocab_size, m.max_len, m.dtype = 128, 16, dtype
    c.seq_len = 16
    return models.build_model(spec.parse(c).model)


def _residuals(model, variables, tok):
    def loss(params):
        logits, _ = model.apply({**variables, "params": params}, tok, mutable=[FP8])
        return jnp.mean(logits.astype(jnp.float32))

    out = io.StringIO()  # print_saved_residuals is the public form of this query
    with contextlib.redirect_stdout(out):
        jax.ad_checkpoint.print_saved_residuals(loss, variables["params"])
    # Lines read "bf16[1,32,256] output of ..."; keep the bf16 [.., d_ff] activations.
    return re.findall(r"^bf16\[([\d,]*,256)\]", out.getvalue(), re.M)


def test_gpt_mlp_keeps_only_the_pre_activation():
    """Same params and state; the fused MLP saves one bf16 [tokens, d_ff] for the backward."""
    tok = jax.random.randint(jax.random.key(0), (2, 16), 0, 128, jnp.int32)
    fused, plain = _model(True), _model(False)
    variables = nn.unbox(jax.jit(fused.init)(jax.random.key(0), tok))
    assert jax.tree.structure(variables) == jax.tree.structure(
        nn.unbox(jax.eval_shape(plain.init, jax.random.key(0), tok))
    )
    kept = _residuals(fused, variables, tok)
    assert kept == ["1,32,256"], kept  # scan's layer axis, then [B * L, d_ff]
    # Unfused, autodiff keeps GELU's intermediates too (5 bf16 [1, 2, 16, 256] here).
    assert len(_residuals(plain, variables, tok)) > 1

    # bf16: the losses agree within the GELU's bf16 rounding (the fused one is f32), 1e-4.
    loss_f, loss_p = (float(_model_grads(m, variables, tok)[0]) for m in (fused, plain))
    assert abs(loss_f - loss_p) < 1e-4 * loss_p, (loss_f, loss_p)


def _model_grads(model, variables, tok):
    def loss(params):
        logits, _ = model.apply({**variables, "params": params}, tok, mutable=[FP8])
        logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
        return -jnp.mean(jnp.take_along_axis(logp, tok[:, 1:, None], axis=-1))

    return jax.jit(jax.value_and_grad(loss))(variables["params"])


def test_gpt_mlp_fused_equals_unfused_in_f32():
    """f32: the same GELU values reach the same E4M3 cast; only act' is computed apart."""
    tok = jax.random.randint(jax.random.key(1), (2, 16), 0, 128, jnp.int32)
    fused, plain = _model(True, "float32"), _model(False, "float32")
    variables = nn.unbox(jax.jit(fused.init)(jax.random.key(0), tok))
    (loss_f, g_f), (loss_p, g_p) = (
        _model_grads(fused, variables, tok),
        _model_grads(plain, variables, tok),
    )
    assert float(loss_f) == float(loss_p)
    for path, a in jax.tree_util.tree_flatten_with_path(g_f)[0]:
        b = functools.reduce(lambda t, k: t[k.key], path, g_p)
        rel = np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b))
        assert rel < 1e-4, (jax.tree_util.keystr(path), rel)
