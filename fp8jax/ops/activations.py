"""Elementwise activations an FP8 cast may apply first (a cast *prologue*), and their derivatives.

Each is ``f(x, tanh)`` on f32 arrays, written with plain multiplies so Triton and XLA lower the
same operations; ``tanh`` is a parameter so a GPU kernel can pass its fast approximation. Every
activation has ``act(0) = 0``, so the zero padding of unaligned GEMMs changes no amax.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax.numpy as jnp

__all__ = [
    "ACTIVATIONS",
    "ACTIVATION_AND_GRADS",
    "ACTIVATION_GRADS",
    "activation",
    "check_activation",
    "gelu_tanh",
    "gelu_tanh_and_grad",
    "gelu_tanh_grad",
]

_C, _A = 0.7978845608028654, 0.044715  # sqrt(2 / pi) and the cubic term of GELU's tanh form


def _gelu_tanh_t(x, tanh):
    """GELU's tanh term, tanh(sqrt(2/pi) (x + 0.044715 x^3))."""
    return tanh(_C * (x + _A * (x * x * x)))


def gelu_tanh(x, tanh=jnp.tanh):
    """GPT-2's tanh approximation of GELU (``jax.nn.gelu(approximate=True)``)."""
    return 0.5 * x * (1.0 + _gelu_tanh_t(x, tanh))


def gelu_tanh_and_grad(x, tanh=jnp.tanh):
    """``(gelu_tanh(x), gelu_tanh_grad(x))`` from one tanh, each with its own function's bits."""
    t = _gelu_tanh_t(x, tanh)
    return 0.5 * x * (1.0 + t), _gelu_tanh_grad_of(x, t)


def _gelu_tanh_grad_of(x, t):
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * (_C * (1.0 + 3.0 * _A * (x * x)))


def gelu_tanh_grad(x, tanh=jnp.tanh):
    """d/dx of ``gelu_tanh``, written out (f32): 0.5 (1 + t) + 0.5 x (1 - t^2) u'(x)."""
    return _gelu_tanh_grad_of(x, _gelu_tanh_t(x, tanh))


ACTIVATIONS = {"gelu_tanh": gelu_tanh}
ACTIVATION_GRADS = {"gelu_tanh": gelu_tanh_grad}
# Both at once, one tanh: the GELU' pass that also rebuilds the activation (act_kernels).
ACTIVATION_AND_GRADS = {"gelu_tanh": gelu_tanh_and_grad}


def check_activation(name: str, table=ACTIVATIONS) -> None:
    """A clear error for a prologue name that ``table`` does not hold."""
    if name not in table:
        raise ValueError(f"unknown FP8 cast prologue {name!r}: use one of {sorted(table)}")


def activation(name: str | None, tanh=jnp.tanh) -> Callable:
    """The prologue ``name`` as a function of f32 arrays (identity for None); a clear error."""
    if name is None:
        return lambda x: x
    check_activation(name, ACTIVATIONS)
    return functools.partial(ACTIVATIONS[name], tanh=tanh)
