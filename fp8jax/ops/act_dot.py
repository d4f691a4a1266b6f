"""A matmul of an elementwise activation of its input that keeps the input, not the
activation, for its backward pass (GPT's O0 MLP under ``model.recompute_elementwise``).

``act_dot_general(name)(h, w, dims)`` is ``lax.dot_general(act(h), w, dims)``. Autodiff of
that expression keeps ``act(h)`` for w's gradient and act's intermediates (GELU's tanh terms)
for h's; this custom VJP keeps only ``h`` and ``w``. Its backward pass computes ``act(h)`` and
h's cotangent in one f32 expression, which XLA:GPU runs as one two-output pass over h (with
the bias gradient's reduction): the recomputation costs about one write of ``act(h)``, and the
forward's act is free to fuse into the first matmul (cuBLAS's GELU epilogue).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["ACTIVATIONS", "act_dot_general"]

_C, _A = 0.7978845608028654, 0.044715  # sqrt(2 / pi) and the cubic term of GELU's tanh form


def _gelu_tanh_bwd(h, da):
    """``(gelu(h), da * gelu'(h))`` of GPT-2's GELU (tanh form) from one sigmoid:
    0.5 (1 + tanh z) = sigmoid(2 z) = s, so gelu = h s and gelu' = s + h s (1 - s) 2 z'(h)."""
    x = h.astype(jnp.float32)
    s = jax.nn.sigmoid(2.0 * _C * (x + _A * x * x * x))
    grad = s + x * s * (1.0 - s) * (2.0 * _C) * (1.0 + 3.0 * _A * x * x)
    return x * s, da.astype(jnp.float32) * grad


# name: (the activation, its backward pass: (h, da) -> (act(h), dh) in f32). The forward is
# jax's GELU, which XLA:GPU fuses into the producing matmul's cuBLAS epilogue.
ACTIVATIONS: dict[str, tuple[Callable, Callable]] = {
    "gelu_tanh": (functools.partial(jax.nn.gelu, approximate=True), _gelu_tanh_bwd),
}


def act_dot_general(name: str) -> Callable:
    """A ``dot_general`` (``nn.DenseGeneral``'s signature) of ``act(lhs)`` and ``rhs``, act one
    of ``ACTIVATIONS``; it contracts lhs's trailing axes, with no batch axes."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}: use one of {sorted(ACTIVATIONS)}")

    def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
        (lc, rc), (lb, rb) = dimension_numbers
        lc = tuple(d % lhs.ndim for d in lc)
        if lb or rb or lc != tuple(range(lhs.ndim - len(lc), lhs.ndim)):
            raise ValueError(f"act_dot_general contracts trailing lhs axes only, got {lc}, {lb}")
        dims = ((lc, tuple(rc)), ((), ()))
        return _act_dot(name, dims, precision, preferred_element_type, lhs, rhs)

    return dot_general


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _act_dot(name, dims, precision, out_type, h, w):
    act = ACTIVATIONS[name][0]
    return lax.dot_general(act(h), w, dims, precision, preferred_element_type=out_type)


def _act_dot_fwd(name, dims, precision, out_type, h, w):
    return _act_dot(name, dims, precision, out_type, h, w), (h, w)


def _act_dot_bwd(name, dims, precision, out_type, saved, dy):
    h, w = saved
    # The barrier makes the act(h) below wait for dy: XLA may not run it early (or merge it
    # with the forward's) and keep act(h) alive from the forward pass to here. With h alone
    # in the barrier gpt_1b3 O0 kept 3.3 GiB more on an H200 (docs/performance.md).
    h, dy = lax.optimization_barrier((h, dy))

    def dot(a, w):
        return lax.dot_general(a, w, dims, precision, preferred_element_type=out_type)

    # The two transposes of the (linear) matmul: da needs w only, dw the recomputed act(h).
    (da,) = jax.linear_transpose(lambda a: dot(a, w), h)(dy)  # act keeps h's shape and dtype
    a, dh = ACTIVATIONS[name][1](h, da)
    (dw,) = jax.linear_transpose(lambda w: dot(a.astype(h.dtype), w), w)(dy)
    return dh.astype(h.dtype), dw.astype(w.dtype)


_act_dot.defvjp(_act_dot_fwd, _act_dot_bwd)
