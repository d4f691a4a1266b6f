"""GPT's MLP as one custom VJP under the fine recipes (``ops.fine_mlp``) and the cast sources it
hands the fine casts (``ops.cast_source``)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from fp8jax import models, spec
from fp8jax.ops import block_cast, cast_source, mlp, scaling
from fp8jax.trainer import loop as train_lib

from fp8_testing import bits, lm_grads

ACT = "gelu_tanh"
TRITON = "__gpu$xla.gpu.triton"
M, F = 64, 256


def _operands():
    """h and da as GEMMs leave them (bf16, scaled by row and column scales), their inverse
    scales and a bias."""
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.standard_normal((M, F)) * 300, jnp.bfloat16)
    da = jnp.asarray(rng.standard_normal((M, F)) * 50, jnp.bfloat16)
    vec = lambda n: jnp.asarray(rng.uniform(0.001, 0.02, n), jnp.float32)  # noqa: E731
    bias = jnp.asarray(rng.standard_normal(F), jnp.float32)
    return h, da, vec(M), vec(F), bias, vec(M), vec(F)


# An f32 tanh (XLA's, whichever approximation a program compiles to) is within a few ulps of
# 1 of the true value; near saturation GELU' amplifies that error (1 + tanh cancels).
TANH_ERR = 2.0**-21


def _independent(h, da, ir, ic, b, jr, jc, scaled, biased):
    """(gelu(pre), gelu'(pre) * da) in float64 NumPy from the tanh form's closed-form
    derivative, and per element how far an f32 tanh's error moves each of them."""
    pre = np.asarray(h, np.float64)
    d = np.asarray(da, np.float64)
    if scaled:
        pre = pre * np.asarray(ir)[:, None] * np.asarray(ic)[None, :]
        d = d * np.asarray(jr)[:, None] * np.asarray(jc)[None, :]
    if biased:
        pre = pre + np.asarray(b)[None, :]
    k, c = np.sqrt(2.0 / np.pi), 0.044715
    t = np.tanh(k * (pre + c * pre**3))
    du = k * (1.0 + 3.0 * c * pre**2)  # d(inner)/d(pre)
    act = 0.5 * pre * (1.0 + t)
    grad = (0.5 * (1.0 + t) + 0.5 * pre * (1.0 - t**2) * du) * d
    # d act / dt = pre / 2; d grad / dt = (1/2 - pre t du) d
    act_tol = 0.5 * np.abs(pre) * TANH_ERR
    grad_tol = np.abs(0.5 - pre * t * du) * np.abs(d) * TANH_ERR
    return (act, act_tol), (grad, grad_tol)


@pytest.mark.parametrize("kind", ["rows", "tiles"])
@pytest.mark.parametrize("scaled,biased", [(True, True), (False, True), (False, False)])
def test_cast_sources_give_the_references_bits_and_the_right_values(kind, scaled, biased):
    """The interpreted kernels quantize an activation and its gradient, computed from their
    operands in the cast, to the XLA references' bits; the values and the column sums match an
    independent float64 computation."""
    h, da, ir, ic, b, jr, jc = ops = _operands()
    r, c = (ir, ic) if scaled else (None, None)
    dr, dc = (jr, jc) if scaled else (None, None)
    bias = b if biased else None
    act = cast_source.activated(h, r, c, bias, ACT)
    grad = cast_source.activation_grad(h, r, c, bias, da, dr, dc, ACT)
    want_act, want_grad = _independent(*ops, scaled, biased)
    if kind == "rows":
        cast = functools.partial(block_cast.cast_transpose_rows, recipe=scaling.RowwiseScaling())
    else:
        cast = functools.partial(
            block_cast.cast_transpose_tiles, tile=32, recipe=scaling.BlockScaling(block_size=32)
        )
    for src, (want, tanh_tol) in ((act, want_act), (grad, want_grad)):
        # f32 against float64: a few f32 ulps of the largest value, and the f32 tanh's error.
        atol = 1e-6 * np.max(np.abs(want))
        err = np.abs(np.asarray(cast_source.evaluate(src), np.float64) - want)
        bound = 2e-5 * np.abs(want) + atol + tanh_tol
        assert np.all(err <= bound), np.max(err / bound)
        run = lambda impl: jax.jit(  # noqa: E731
            lambda s: cast(s, fmt="e4m3", impl=impl, col_sums=True)
        )(src)
        got, ref = run("interpret"), run("xla")
        for a, e in zip(got[:-1], ref[:-1], strict=True):
            np.testing.assert_array_equal(bits(a), bits(e))
        for sums in (got[-1], ref[-1]):  # f32 sums of M terms, in two orders
            np.testing.assert_allclose(sums, want.sum(axis=0), rtol=1e-5, atol=M * atol)


def _tiny(fuse_mlp: bool, recipe: str, kernel="interpret"):
    c = train_lib.load_config("tiny")
    c.fp8.level, c.fp8.fuse_mlp, c.fp8.cast_kernel, c.fp8.recipe = "O1", fuse_mlp, kernel, recipe
    c.fp8.block_size = 16
    m = c.model
    m.num_layers, m.d_model, m.num_heads, m.num_kv_heads, m.d_ff = 1, 64, 2, 2, 256
    m.vocab_size, m.max_len, m.dtype, c.seq_len, c.batch_size = 128, 16, "float32", 16, 4
    return c


@pytest.mark.parametrize("recipe", ["rowwise", "block"])
def test_fused_fine_mlp_equals_two_fine_matmuls_in_f32(recipe):
    """Same loss and FP8 state as wi and wo as two ``fine_matmul`` calls (the GELU as wo's
    prologue); gradients and the state cotangents (dy's amaxes) to f32 rounding: the fused
    backward writes GELU' out, the two-matmul path takes it from autodiff (measured below
    2e-7)."""
    tok = jax.random.randint(jax.random.key(0), (2, 16), 0, 128, jnp.int32)
    fused, plain = _tiny(True, recipe), _tiny(False, recipe)
    model = models.build_model(spec.parse(fused).model)
    variables = nn.unbox(jax.jit(model.init)(jax.random.key(0), tok))
    wi = variables["params"]["blocks"]["mlp"]["wi"]  # a bias that matters (it starts at zero)
    wi["bias"] = jax.random.normal(jax.random.key(1), wi["bias"].shape, wi["bias"].dtype)
    (loss_f, fp8_f), (g_f, gm_f) = lm_grads(fused, variables, tok)
    (loss_p, fp8_p), (g_p, gm_p) = lm_grads(plain, variables, tok)
    assert float(loss_f) == float(loss_p)
    for a, b in zip(jax.tree.leaves(fp8_f), jax.tree.leaves(fp8_p), strict=True):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(gm_f), jax.tree.leaves(gm_p), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    pairs = zip(jax.tree_util.tree_leaves_with_path(g_f), jax.tree.leaves(g_p), strict=True)
    for (path, a), b in pairs:
        rel = np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b))
        assert rel < 1e-6, (jax.tree_util.keystr(path), rel)


def _mlp_inputs(dtype=jnp.bfloat16):
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((32, 64)), jnp.bfloat16)  # [M, D]
    w1 = jnp.asarray(rng.standard_normal((64, 128)) * 0.1, dtype)  # [D, F]
    b1 = jnp.asarray(rng.standard_normal(128) * 0.1, dtype)
    w2 = jnp.asarray(rng.standard_normal((128, 64)) * 0.1, dtype)  # [F, D]
    return x, w1, b1, w2


def _lowered(recipe, recompute=False):
    m = scaling.init_meta(recipe)

    def loss(x, w1, b1, w2):
        y, _, _ = mlp.gelu_mlp(x, w1, b1, w2, m, m, "pallas", recompute_cast=recompute)
        return jnp.sum(y.astype(jnp.float32))

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
    return grad.trace(*_mlp_inputs(jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()


def test_fused_rowwise_mlp_lowers_to_twelve_triton_kernels_and_no_mxf_xla_op():
    """Two rowwise kernels per cast: x, w1, gelu(pre), w2 forward; dy and gelu'(pre) * da
    backward. No XLA op makes a [M, F] tensor (pre, gelu, gelu' and db1 live in the casts) and
    no tanh runs in XLA."""
    text = _lowered(scaling.RowwiseScaling())
    assert text.count(TRITON) == 12
    assert "stablehlo.tanh" not in text
    skip = ("custom_call", "dot_general", "stablehlo.return")  # GEMMs, casts, branch results
    ops = [ln for ln in text.splitlines() if "stablehlo." in ln and not any(s in ln for s in skip)]
    at_mf = [ln for ln in ops if "tensor<32x128x" in ln]
    assert not at_mf, at_mf


@pytest.mark.parametrize("recipe", ["rowwise", "block"])
def test_recompute_cast_rebuilds_wo_input_bit_for_bit(recipe):
    """``recompute_cast``: the same outputs, gradients and FP8 state bits; the residuals lose
    exactly wo's transposed E4M3 input ([F, M], a byte each) and its inverse scales (f32)."""
    kw = {"block_size": 16} if recipe == "block" else {}
    r = scaling.make_recipe(recipe, **kw)
    m = scaling.init_meta(r)
    x, w1, b1, w2 = _mlp_inputs()
    ct = jnp.asarray(np.random.default_rng(2).standard_normal((32, 64)), jnp.bfloat16)

    def run(recompute):
        def f(x, w1, b1, w2):
            y, m1, m2 = mlp.gelu_mlp(x, w1, b1, w2, m, m, "interpret", recompute_cast=recompute)
            return y, (m1, m2)

        (y, metas), vjp = jax.vjp(f, x, w1, b1, w2)
        saved = sum(v.nbytes for v in jax.tree.leaves(vjp) if hasattr(v, "nbytes"))
        return (y, metas, vjp((ct, jax.tree.map(jnp.zeros_like, metas)))), saved

    (kept, kept_bytes), (rebuilt, rebuilt_bytes) = run(False), run(True)
    for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(rebuilt), strict=True):
        np.testing.assert_array_equal(bits(a), bits(b))
    inv_t = 128 * 4 if recipe == "rowwise" else 128 * (32 // 16) * 4  # [F, 1] or [F, M / T]
    assert kept_bytes - rebuilt_bytes == 128 * 32 + inv_t
    if recipe == "rowwise":
        assert _lowered(r, True).count(TRITON) == _lowered(r).count(TRITON) + 2


def test_fine_mlp_layers_must_share_a_recipe():
    x, w1, b1, w2 = _mlp_inputs()
    rows, block = (scaling.init_meta(scaling.make_recipe(n)) for n in ("rowwise", "block"))
    with pytest.raises(ValueError, match="must share one fine recipe"):
        mlp.gelu_mlp(x, w1, b1, w2, rows, block, "xla")
