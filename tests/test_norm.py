"""GPT's LayerNorm folded into the E4M3 cast of the matmul after it (``fp8.fuse_norm``,
``fp8jax.ops.norm``): flax's norm, quantized in one pass, and its gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

import fp8jax
from fp8jax import FP8, models, spec
from fp8jax.models import layers
from fp8jax.ops import formats, kernels, mlp, norm, qkv, remat
from fp8jax.trainer import loop as train_lib

from fp8_testing import (
    bits,
    lm_grads,
)

M, K = 64, 256
EPS = 1e-5


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((M, K)) * 3.0 + 1.5, jnp.bfloat16)  # mean far from 0
    gamma = jnp.asarray(1.0 + 0.5 * rng.standard_normal(K), jnp.float32)
    beta = jnp.asarray(0.5 * rng.standard_normal(K), jnp.float32)
    return x, gamma, beta


def _flax_ln(x, gamma, beta, dtype=jnp.float32):
    """flax's own LayerNorm, the models' unfolded norm: the independent reference."""
    params = {"params": {"scale": gamma, "bias": beta}}
    return nn.LayerNorm(epsilon=EPS, dtype=dtype, param_dtype=jnp.float32).apply(params, x)


def test_folded_cast_quantizes_flax_layer_norm():
    """The cast with ``norm`` writes the E4M3 bits of flax's f32 LayerNorm output, both
    layouts, with its amax; the Pallas kernel (interpreted) and the XLA ops agree bit for bit,
    and the backward's one-layout rebuild writes the same bits."""
    x, gamma, beta = _inputs()
    scale = jnp.float32(16.0)
    want_MxK = _flax_ln(x, gamma, beta)
    want = formats.quantize(want_MxK, scale, formats.E4M3)
    folded = (*norm.layer_norm_stats(x, EPS), gamma, beta)
    for impl in ("xla", "interpret"):
        q, q_t, amax = kernels.cast_transpose(x, scale, "e4m3", impl, norm=folded)
        np.testing.assert_array_equal(bits(q), bits(want), err_msg=impl)
        np.testing.assert_array_equal(bits(q_t), bits(want.T), err_msg=impl)
        assert float(amax) == float(jnp.max(jnp.abs(want_MxK))), impl
        _, col, none = kernels.cast_transpose(
            x, scale, "e4m3", impl, norm=folded, layouts="col", record=False
        )
        assert none is None
        np.testing.assert_array_equal(bits(col), bits(want.T), err_msg=impl)


def test_layer_norm_matches_flax_in_the_compute_dtype():
    """The unfolded paths' norm (``norm.layer_norm``) is flax's ``nn.LayerNorm`` bit for bit."""
    x, gamma, beta = _inputs(1)
    got = norm.layer_norm(x, (gamma, beta, EPS))
    assert got.dtype == x.dtype
    np.testing.assert_array_equal(bits(got), bits(_flax_ln(x, gamma, beta, x.dtype)))


def test_layer_norm_bwd_is_autodiff_of_flax():
    """dx, dgamma and dbeta from the saved statistics equal autodiff through flax's LayerNorm
    (f32) to f32 rounding: each is a handful of f32 operations and a K- or M-term sum, so
    within 2 * (K + 8) * 2**-24 of the gradient's norm."""
    x, gamma, beta = _inputs(2)
    x = x.astype(jnp.float32)
    dy = jnp.asarray(np.random.default_rng(3).standard_normal((M, K)), jnp.float32)
    _, vjp = jax.vjp(_flax_ln, x, gamma, beta)
    want = vjp(dy)
    mean_M, rstd_M = norm.layer_norm_stats(x, EPS)
    got = norm.layer_norm_bwd(x, mean_M, rstd_M, gamma, dy)
    bound = 2 * (max(M, K) + 8) * 2.0**-24
    for name, a, b in zip(("dx", "dgamma", "dbeta"), got, want, strict=True):
        rel = float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
        assert rel < bound, (name, rel, bound)


def _ln_grads(op, rebuild, fold):
    """Loss and f32 gradients (x, kernel(s), bias(es), gamma, beta) of LayerNorm -> ``op`` in f32:
    the norm folded into the op (``ln=``) or flax's ``nn.LayerNorm`` in front of it."""
    x, gamma, beta = _inputs(4)
    x = x.astype(jnp.float32)
    rng = np.random.default_rng(5)
    w1 = jnp.asarray(rng.standard_normal((K, 2, 4, 32)) * 0.05, jnp.float32)  # qkv, or wi
    b1 = jnp.asarray(rng.standard_normal((2, 4, 32)) * 0.1, jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((256, K)) * 0.05, jnp.float32)  # wo
    meta = fp8jax.init_meta()

    def loss(x, w1, b1, w2, gamma, beta):
        ln = (gamma, beta, EPS) if fold else None
        x_in = x if fold else _flax_ln(x, gamma, beta)
        if op == "qkv":
            *outs, _ = qkv.qkv_projection(x_in, w1, b1, meta, "interpret", rebuild, ln=ln)
        else:
            w1_KxF, b1_F = w1.reshape(K, -1), b1.reshape(-1)
            y, _, _ = mlp.gelu_mlp(
                x_in, w1_KxF, b1_F, w2, meta, meta, "interpret", rebuild=rebuild, ln=ln
            )
            outs = [y]
        r = np.random.default_rng(6)
        return sum(jnp.sum(o * r.standard_normal(o.shape).astype(np.float32)) for o in outs)

    return jax.jit(jax.value_and_grad(loss, argnums=range(6)))(x, w1, b1, w2, gamma, beta)


@pytest.mark.parametrize("op", ["qkv", "mlp"])
@pytest.mark.parametrize("rebuild", ["", "x"])
def test_folded_ops_equal_flax_norm_then_op_in_f32(op, rebuild):
    """The Q/K/V projection and the GELU MLP with the norm folded (kept E4M3 copy of x, or cast
    again in the backward) against flax's norm in front: the same loss bit for bit (the cast
    quantizes the values flax writes), gradients to f32 rounding (the norm's backward is written
    out: 1e-6 of each gradient's norm)."""
    (loss_f, g_f), (loss_p, g_p) = _ln_grads(op, rebuild, True), _ln_grads(op, rebuild, False)
    assert float(loss_f) == float(loss_p)
    for i, (a, b) in enumerate(zip(g_f, g_p, strict=True)):
        if op == "qkv" and i == 3:  # w2: not an input of the projection
            continue
        assert _rel(a, b) < 1e-6, (i, _rel(a, b))
        assert np.any(np.asarray(a) != 0), i


def test_norms_fold_where_the_backward_casts_x_again():
    """The fold applies under a remat policy that rebuilds x (where it spares a norm pass), not
    without remat nor with ``fp8.fuse_norm=False``, and to GPT only."""
    for policy, fuse, style, want in [
        ("activations_saveable", True, "gpt", True),
        ("activations_and_weights_saveable", True, "gpt", True),
        ("none", True, "gpt", False),
        ("fp8_dots_and_inputs_saveable", True, "gpt", False),  # keeps x's E4M3 copy
        ("activations_saveable", False, "gpt", False),
        ("activations_saveable", True, "llama", False),
    ]:
        c = _tiny(fuse, policy=policy)
        c.model.style = style
        cfg = spec.parse(c).model
        got = (layers.folds_norm(cfg, layers.fuses_qkv), layers.folds_norm(cfg, layers.fuses_mlp))
        assert got == (want, want), (policy, fuse, style)


def _tiny(fuse_norm, dtype="float32", level="O1", policy="activations_saveable"):
    c = train_lib.load_config("tiny")
    c.fp8.level, c.fp8.cast_kernel, c.fp8.fuse_norm = level, "interpret", fuse_norm
    m = c.model
    m.style, m.fused_qkv, m.remat_policy, m.dtype = "gpt", True, policy, dtype
    m.num_layers, m.d_model, m.num_heads, m.num_kv_heads = 1, 64, 4, 4
    m.d_ff, m.vocab_size, m.max_len, c.seq_len, c.batch_size = 128, 128, 16, 16, 2
    return c


TOK = jax.random.randint(jax.random.key(0), (2, 16), 0, 128, jnp.int32)


def _variables(config):
    model = models.build_model(spec.parse(config).model)
    return nn.unbox(jax.jit(model.init)(jax.random.key(0), TOK))


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("policy", ["activations_saveable", "activations_and_weights_saveable"])
def test_folded_model_equals_unfolded_in_f32(policy):
    """In f32 the folded block quantizes the values flax's norm writes: the same params tree,
    loss and new FP8 state bit for bit; gradients to f32 rounding (the norms' backward is
    written out rather than autodiff's, a reordering of f32 sums: 1e-6 of each gradient's
    norm). The backward casts the norm's output again from its input and statistics: a wrong
    rebuild changes the GEMMs' gradients."""
    fold, plain = _tiny(True, policy=policy), _tiny(False, policy=policy)
    variables = _variables(fold)
    assert jax.tree.structure(variables) == jax.tree.structure(_variables(plain))
    (loss_f, fp8_f), (g_f, _) = lm_grads(fold, variables, TOK)
    (loss_p, fp8_p), (g_p, _) = lm_grads(plain, variables, TOK)
    assert float(loss_f) == float(loss_p)
    for a, b in zip(jax.tree.leaves(fp8_f), jax.tree.leaves(fp8_p), strict=True):
        np.testing.assert_array_equal(a, b)
    pairs = zip(jax.tree_util.tree_leaves_with_path(g_f), jax.tree.leaves(g_p), strict=True)
    for (path, a), b in pairs:
        assert _rel(a, b) < 1e-6, (jax.tree_util.keystr(path), _rel(a, b))


def test_folded_model_in_bf16_is_within_the_fp8_error():
    """In bf16 the fold quantizes the f32 norm where the unfolded path quantizes its bf16
    rounding, so E4M3 roundings differ; each gradient stays closer to the unfolded one than
    the unfolded one is to O0's (the FP8 error itself, measured in the same test)."""
    fold, plain, o0 = _tiny(True, "bfloat16"), _tiny(False, "bfloat16"), _tiny(True, "bfloat16")
    o0.fp8.level = "O0"
    variables = _variables(fold)
    (_, _), (g_f, _) = lm_grads(fold, variables, TOK)
    (_, _), (g_p, _) = lm_grads(plain, variables, TOK)
    (_, _), (g_0, _) = lm_grads(o0, {"params": variables["params"], FP8: {}}, TOK)
    leaves = jax.tree_util.tree_leaves_with_path(g_f), jax.tree.leaves(g_p), jax.tree.leaves(g_0)
    pairs = zip(*leaves, strict=True)
    for (path, a), b, c in pairs:
        assert _rel(a, b) < _rel(b, c), (jax.tree_util.keystr(path), _rel(a, b), _rel(b, c))


def test_folded_norms_keep_their_statistics_under_activations_saveable():
    """Under ``activations_saveable`` the folded block keeps what the unfolded one keeps plus
    each norm's f32 mean and 1/std (``remat.NORM_STATS``): 2 x 2 x tokens x 4 bytes."""
    from fp8jax.models.config import REMAT_POLICIES
    from fp8jax.models.layers import Block

    def residual_bytes(fuse_norm):
        cfg = spec.parse(_tiny(fuse_norm)).model
        x = jnp.ones((2, 16, cfg.d_model), jnp.float32)
        pos = jnp.broadcast_to(jnp.arange(16), (2, 16))
        variables = Block(cfg).init(jax.random.key(0), x, pos, None)

        def f(params, x):
            out, _ = Block(cfg).apply({**variables, "params": params}, x, pos, None, mutable=[FP8])
            return out[0]

        f = jax.checkpoint(f, policy=REMAT_POLICIES["activations_saveable"])
        res = jax.eval_shape(
            lambda p, x: jax.tree.leaves(jax.vjp(f, p, x)[1]), variables["params"], x
        )
        stats = [r for r in res if r.shape == (32,) and r.dtype == jnp.float32]
        return sum(r.size * r.dtype.itemsize for r in res), len(stats)

    (fold_bytes, fold_stats), (plain_bytes, plain_stats) = (
        residual_bytes(True),
        residual_bytes(False),
    )
    assert (fold_stats, plain_stats) == (4, 0)
    assert fold_bytes == plain_bytes + 4 * 32 * 4
    assert remat.NORM_STATS in remat.ACTIVATION_NAMES
