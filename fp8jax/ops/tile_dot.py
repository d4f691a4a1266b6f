"""``tile_dot``: the FP8 dot of a Pallas (Triton) kernel, with Hopper's fast FP8 accumulation.

Hopper's FP8 WGMMA accumulates in reduced precision. Triton's dot takes a
``max_num_imprecise_acc`` attribute saying how many products it may accumulate that way before
it adds the partial sum into an f32 accumulator; Pallas' lowering leaves the attribute unset,
which means zero, so every WGMMA instruction (K = 32) is followed by f32 adds and a wait, and an
FP8 GEMM runs at about half of BF16's rate. A block-scaled GEMM promotes every ``block`` of K
into f32 itself (DeepSeek-V3's recipe), so its tile dots may accumulate the whole tile in the
tensor cores: ``tile_dot(a, b, k_imprecise=block)``.

``tile_dot`` is a primitive of its own, which computes what ``lax.dot_general`` computes (a
[m, k] . b [n, k]^T in f32) everywhere, and on Triton lowers through Pallas' own dot lowering
with the attribute set. The interpreter and the CPU run ``lax.dot_general`` itself.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.interpreters import mlir

__all__ = [
    "tile_dot",
    "tile_dot_p",
]

_NT = (((1,), (1,)), ((), ()))  # a [m, k] . b [n, k]^T

try:  # jax >= 0.4.36 keeps Primitive in jax.extend
    from jax.extend.core import Primitive
except ImportError:  # pragma: no cover
    from jax.core import Primitive

tile_dot_p = Primitive("fp8_tile_dot")


def _params(a, b) -> dict:
    """The parameters ``lax.dot_general`` binds for ``a . b^T`` in f32 (this JAX version's)."""
    eqn = jax.make_jaxpr(
        lambda a, b: lax.dot_general(a, b, _NT, preferred_element_type=jnp.float32)
    )(jax.ShapeDtypeStruct(a.shape, a.dtype), jax.ShapeDtypeStruct(b.shape, b.dtype)).eqns[0]
    return dict(eqn.params)


def _impl(a, b, *, k_imprecise: int):
    del k_imprecise
    return lax.dot_general(a, b, _NT, preferred_element_type=jnp.float32)


def _abstract(a, b, *, k_imprecise: int):
    del k_imprecise
    return jax.core.ShapedArray((a.shape[0], b.shape[0]), jnp.float32)


tile_dot_p.def_impl(_impl)
tile_dot_p.def_abstract_eval(_abstract)
mlir.register_lowering(tile_dot_p, mlir.lower_fun(_impl, multiple_results=False))


def _triton_rule(ctx, a, b, *, k_imprecise: int):
    """Pallas' dot_general lowering with ``max_num_imprecise_acc`` set on Triton's dot."""
    from jax._src.pallas.triton import lowering as triton_lowering

    dialect = triton_lowering.tt_dialect
    plain = dialect.dot
    a_aval, b_aval = ctx.avals_in

    def dot(*args, **kwargs):
        return plain(*args, max_num_imprecise_acc=k_imprecise, **kwargs)

    dialect.dot = dot  # for this one lowering call only
    try:
        rule = triton_lowering.triton_lowering_rules[lax.dot_general_p]
        return rule(ctx, a, b, **_params(a_aval, b_aval))
    finally:
        dialect.dot = plain


@functools.cache
def _register() -> None:
    from jax._src.pallas.triton import lowering as triton_lowering

    triton_lowering.triton_lowering_rules[tile_dot_p] = _triton_rule


def tile_dot(a: jax.Array, b: jax.Array, k_imprecise: int) -> jax.Array:
    """``a [m, k] . b [n, k]^T`` in f32 inside a Pallas kernel; on Triton the tensor cores may
    accumulate ``k_imprecise`` products before promoting to f32."""
    _register()
    return tile_dot_p.bind(a, b, k_imprecise=int(k_imprecise))
