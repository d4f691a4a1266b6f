"""The fused Q/K/V projection as one FP8 custom VJP (``fp8.fuse_qkv``): one matmul's math."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from fp8jax import models, spec
from fp8jax.ops import formats, qkv, scaling
from fp8jax.trainer import loop as train_lib

from fp8_testing import bits, lm_grads, pallas_calls, pallas_name, same_step_grads


@pytest.mark.parametrize("heads", [(2, 3, 32), (4, 1, 16)])  # (kv heads, group, head dim)
@pytest.mark.parametrize("sums", [True, False])
def test_parts_kernel_writes_the_assembled_cast(heads, sums):
    """The Pallas kernels (interpreted) write dq, dk and dv's E5M2 cast in the fused output's
    column order, the bits of quantizing an assembly built here with numpy."""
    kv, g, h = heads
    rng = np.random.default_rng(0)
    m = 64
    parts = [
        jnp.asarray(rng.standard_normal((m, kv * n * h)) * (i + 1), jnp.bfloat16)
        for i, n in enumerate((g, 1, 1))
    ]
    # The expected [M, kv, g + 2, h] assembly, slot by slot.
    want = np.zeros((m, kv, g + 2, h), np.float32)
    q_np, k_np, v_np = (np.asarray(p, np.float32) for p in parts)
    for j in range(kv):
        for i in range(g):
            want[:, j, i] = q_np[:, (j * g + i) * h : (j * g + i + 1) * h]
        want[:, j, g] = k_np[:, j * h : (j + 1) * h]
        want[:, j, g + 1] = v_np[:, j * h : (j + 1) * h]
    want = want.reshape(m, -1)
    scale = jnp.float32(2.0**10)
    ref_q = formats.quantize(jnp.asarray(want), scale, formats.E5M2)
    pending = jnp.zeros((4,), jnp.float32)

    def run(impl):
        f = functools.partial(qkv.cast_transpose_parts, fmt="e5m2", impl=impl, sums=sums)
        return jax.jit(lambda p, s, pend: f(p, heads, s, pending=pend))(parts, scale, pending)

    for impl in ("interpret", "xla"):
        q, q_t, hist, col_sums = run(impl)
        np.testing.assert_array_equal(bits(q), bits(ref_q), err_msg=impl)
        np.testing.assert_array_equal(bits(q_t), bits(ref_q).T, err_msg=impl)
        assert float(hist[0]) == float(np.max(np.abs(want))), impl  # recorded into slot 0
        np.testing.assert_array_equal(hist[1:], 0.0)
        if sums:
            np.testing.assert_allclose(col_sums, want.sum(axis=0), rtol=1e-5, atol=1e-4)
        else:
            assert col_sums is None


@pytest.mark.parametrize("rebuild", ["", "xw"])
def test_qkv_projection_equals_its_dot_general_path(rebuild):
    """The custom VJP (fused casts, interpreted) against the op's own fallback, one
    ``dot_general`` on XLA's casts and slices: outputs, state and x and w gradients bit for bit;
    the bias gradient against the cotangents' own f32 sums."""
    kv, g, h, d = 2, 3, 16, 64
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((2, 16, d)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((d, kv, g + 2, h)) * 0.05, jnp.float32)
    b = jnp.asarray(rng.standard_normal((kv, g + 2, h)) * 0.1, jnp.float32)
    meta = scaling.init_meta(scaling.DelayedScaling())
    cts = [
        jnp.asarray(rng.standard_normal(s), jnp.bfloat16)
        for s in ((2, 16, kv * g, h), (2, 16, kv, h), (2, 16, kv, h))
    ]

    def run(impl):
        def f(x, w, b, meta):
            q, k, v, new_meta = qkv.qkv_projection(x, w, b, meta, impl, rebuild)
            outs = (q, k, v)
            loss = sum(jnp.sum(o.astype(jnp.float32) * c) for o, c in zip(outs, cts, strict=True))
            return loss, ((q, k, v), new_meta)

        return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3), has_aux=True))(x, w, b, meta)

    (dx, dw, db, dmeta), (outs, new_meta) = run("interpret")
    (rdx, rdw, rdb, rdmeta), (routs, rnew_meta) = run("xla")
    got = jax.tree.leaves((outs, new_meta, dx, dw, dmeta))
    want = jax.tree.leaves((routs, rnew_meta, rdx, rdw, rdmeta))
    for a, r in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, r)
    assert float(jnp.max(jnp.abs(dw))) > 0
    # The bias gradient: each slot's cotangent summed over the tokens, in f32 (the fallback
    # adds the bias in bf16, so its sum is in bf16).
    q_c, k_c, v_c = (np.asarray(c, np.float32).reshape(32, kv, -1, h) for c in cts)
    want_db = np.concatenate([q_c, k_c, v_c], axis=2).sum(axis=0)  # [kv, g + 2, h]
    np.testing.assert_allclose(db, want_db, rtol=1e-5, atol=1e-5)
    # The fallback's bf16 sum of n = 32 terms, in whatever order XLA adds them: within
    # gamma_(n-1) = (n - 1) u / (1 - (n - 1) u) of the sum of |terms| (u = 2**-8, bf16's unit
    # roundoff), plus one rounding of the result. Its values are checked tightly in f32 by
    # test_fused_qkv_equals_one_fp8_matmul.
    n, u = q_c.shape[0], 2.0**-8
    abs_sum = np.concatenate([np.abs(q_c), np.abs(k_c), np.abs(v_c)], axis=2).sum(axis=0)
    bound = (n - 1) * u / (1 - (n - 1) * u) * abs_sum + u * np.abs(want_db)
    assert np.all(np.abs(np.asarray(rdb) - want_db) <= bound)


def _tiny(style, fuse_qkv, dtype, kernel="interpret", policy="none"):
    c = train_lib.load_config("tiny")
    c.fp8.level, c.fp8.fuse_qkv, c.fp8.cast_kernel = "O1", fuse_qkv, kernel
    c.fp8.fuse_norm = False  # the op against the sliced matmul; the folded norm: test_norm
    m = c.model
    m.style, m.fused_qkv, m.remat_policy, m.dtype = style, True, policy, dtype
    m.num_layers, m.d_model, m.num_heads, m.d_ff, m.vocab_size, m.max_len = 1, 64, 4, 128, 128, 16
    m.num_kv_heads = 2 if style == "llama" else 4  # GQA: 2 query heads per key/value head
    c.seq_len, c.batch_size = 16, 2
    return c


@pytest.mark.parametrize(
    "style,dtype,policy",
    [
        ("gpt", "float32", "none"),
        ("llama", "float32", "none"),
        ("gpt", "bfloat16", "none"),
        ("gpt", "float32", "activations_saveable"),
    ],
)
@pytest.mark.optimized
def test_fused_qkv_equals_one_fp8_matmul(style, dtype, policy):
    """Same params, loss, scale state and FP8 cotangents as the sliced ``dot_general``; the
    weight and input gradients bit for bit (the same E5M2 operands), the bias gradient summed
    in f32 (the sliced path's in the compute dtype)."""
    tok = jax.random.randint(jax.random.key(0), (2, 16), 0, 128, jnp.int32)
    fused, plain = (
        _tiny(style, True, dtype, policy=policy),
        _tiny(style, False, dtype, policy=policy),
    )
    g_f, g_p = same_step_grads(fused, plain, tok)
    # The sliced path sums the bias gradient in the compute dtype: in bf16, 2**-5 of its norm
    # bounds that sum's rounding over these 32 tokens (measured: 0.006); f32 sums agree to 1e-6.
    bias_rtol = 1e-6 if dtype == "float32" else 2.0**-5
    pairs = zip(jax.tree_util.tree_leaves_with_path(g_f), jax.tree.leaves(g_p), strict=True)
    for (path, a), b in pairs:
        name = jax.tree_util.keystr(path)
        if "qkv" in name and "bias" in name:
            rel = np.linalg.norm(np.asarray(a) - np.asarray(b)) / np.linalg.norm(np.asarray(b))
            assert rel < bias_rtol, (name, rel)
            assert np.any(np.asarray(a) != 0), name
        else:  # the GEMMs, the x gradient and everything before: the same bits
            np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.mark.parametrize("fuse_qkv", [True, False])
def test_fused_qkv_backward_casts_the_three_parts_in_place(fuse_qkv):
    """The backward pass casts dq, dk and dv with one parts kernel each, and the plain path's
    one cast of their concatenation is gone (no other cast of an [M, C] E5M2 gradient)."""
    config = _tiny("gpt", fuse_qkv, "bfloat16")
    tok = jax.random.randint(jax.random.key(0), (2, 16), 0, 128, jnp.int32)
    model = models.build_model(spec.parse(config).model)
    variables = nn.unbox(jax.jit(model.init)(jax.random.key(0), tok))
    jaxpr = jax.make_jaxpr(lambda v: lm_grads(config, v, tok))(variables).jaxpr
    names = [pallas_name(eqn) for eqn in pallas_calls(jaxpr)]
    assert names.count("fp8_cast_transpose_parts") == (3 if fuse_qkv else 0)
    # Forward: x, w of qkv, o, wi and wo's casts; backward: dy of wo, o and (plain) qkv's.
    assert names.count("fp8_cast_transpose") == 8 + 2 + (0 if fuse_qkv else 1)
