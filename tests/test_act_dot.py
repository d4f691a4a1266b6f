"""ops.act_dot: a matmul of GELU(h) that keeps h alone for its backward pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from fp8jax.ops.act_dot import act_dot_general

T, F, D = 64, 96, 32
DIMS = (((2,), (0,)), ((), ()))  # nn.DenseGeneral's: [B, L, F] x [F, D]


def operands(dtype=jnp.float32):
    rng = np.random.default_rng(0)
    h = jnp.asarray(3 * rng.standard_normal((2, T // 2, F)), dtype)  # GELU's curved range too
    w = jnp.asarray(rng.standard_normal((F, D)) / np.sqrt(F), dtype)
    dy = jnp.asarray(rng.standard_normal((2, T // 2, D)), dtype)
    return h, w, dy


def act_dot(h, w):
    return act_dot_general("gelu_tanh")(h, w, DIMS)


def reference(h, w):
    return lax.dot_general(jax.nn.gelu(h, approximate=True), w, DIMS)


def test_value_and_gradients_match_autodiff():
    """Forward bits equal plain ``dot(gelu(h), w)``; the gradients equal autodiff's to f32
    rounding, bounded per element from the operands' magnitudes. dh = da * gelu'(h): the two
    forms of gelu' (sigmoid, tanh) round about 8 times each, |gelu'| <= 1 + |h| 2c (1 + 3a h^2)
    term by term, and da's own sum over D may run in another order. dw = gelu(h)^T dy: each
    product's GELU differs by such roundings of |h|, summed over T tokens."""
    h, w, dy = operands()
    got, vjp = jax.vjp(act_dot, h, w)
    ref, ref_vjp = jax.vjp(reference, h, w)
    np.testing.assert_array_equal(got, ref)
    dh, dw = (np.asarray(g, np.float64) for g in vjp(dy))
    ref_dh, ref_dw = (np.asarray(g, np.float64) for g in ref_vjp(dy))
    eps = float(np.finfo(np.float32).eps)
    x, dy_, w_ = (np.abs(np.asarray(a, np.float64)) for a in (h, dy, w))
    c, a = np.sqrt(2 / np.pi), 0.044715
    da_mag = np.einsum("bld,fd->blf", dy_, w_)
    dh_bound = (16 + D) * eps * da_mag * (1 + x * 2 * c * (1 + 3 * a * x * x))
    dw_bound = (16 + T) * eps * np.einsum("blf,bld->fd", x, dy_)
    assert (np.abs(dh - ref_dh) <= dh_bound).all(), np.abs(dh - ref_dh).max()
    assert (np.abs(dw - ref_dw) <= dw_bound).all(), np.abs(dw - ref_dw).max()


def test_keeps_only_its_operands():
    """The residuals are h and w: not GELU(h), not GELU's intermediates (autodiff keeps
    several [T, F] arrays)."""
    h, w, _ = operands()

    def shapes(f):
        return sorted(r.shape for r in jax.tree.leaves(jax.vjp(f, h, w)[1]))

    assert shapes(act_dot) == sorted([h.shape, w.shape])
    assert sum(s == h.shape for s in shapes(reference)) > 1


def test_bf16_gradients_round_like_autodiff():
    """bf16 operands: the cotangents come back in bf16, within bf16 rounding of f32 autodiff:
    da, the recomputed GELU(h) (as the forward's) and each cotangent are rounded to bf16, half
    an ulp each (4 eps of the largest leaves room for dw's sum over tokens)."""
    h, w, dy = operands(jnp.bfloat16)
    got = jax.vjp(act_dot, h, w)[1](dy)
    f32 = [x.astype(jnp.float32) for x in (h, w, dy)]
    ref = jax.vjp(reference, *f32[:2])[1](f32[2])
    eps = float(jnp.finfo(jnp.bfloat16).eps)
    for a, b in zip(got, ref, strict=True):
        assert a.dtype == jnp.bfloat16
        b = np.asarray(b)
        err = np.abs(np.asarray(a, np.float32) - b).max()
        assert err <= 4 * eps * np.abs(b).max(), err


@pytest.mark.parametrize(
    "dims",
    [
        (((1,), (0,)), ((), ())),  # a middle lhs axis
        (((2,), (0,)), ((0,), (0,))),  # batch axes
    ],
)
def test_rejects_other_contractions(dims):
    h, w, _ = operands()
    with pytest.raises(ValueError, match="trailing lhs axes"):
        act_dot_general("gelu_tanh")(h, jnp.zeros((T // 2, D)), dims)


def test_unknown_activation_is_named():
    with pytest.raises(ValueError, match="unknown activation 'relu'.*gelu_tanh"):
        act_dot_general("relu")
