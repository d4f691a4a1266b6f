"""The backward pass of an activation fused into an FP8 cast: act' applied, E5M2 out.

``act_grad_cast_transpose`` is ``kernels.cast_transpose``'s counterpart for the layer whose
output went through an activation (GPT's fused MLP, ``ops.mlp``): it reads the pre-activation
and the next layer's raw dgrad output, writes ``d = act'(pre) * da * inv`` in both FP8 layouts
with its amax and column sums (a bias gradient), and optionally ``act(pre)`` in E4M3 again,
transposed, for the next layer's weight gradient. A Pallas kernel on GPUs, XLA ops elsewhere
(``kernels.dispatch``), the same arithmetic either way.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from fp8jax.ops import activations, formats
from fp8jax.ops.kernels import (
    ACT_COL_BLOCKS,
    WARPS,
    apply_affine,
    check_affine,
    dispatch,
    grid_layout,
    kernel_tanh,
    record_amax,
    record_reference,
    untarget,
)

__all__ = [
    "act_grad_cast_transpose",
    "pallas_act_grad_cast_transpose",
]


def _grad_reference(pre, da, inv, scale, pending, affine, act_scale, dtype, act):
    """XLA version of ``act_grad_cast_transpose``."""
    pre = apply_affine(pre.astype(jnp.float32), affine)
    d = activations.ACTIVATION_GRADS[act](pre) * (da.astype(jnp.float32) * inv)
    q = formats.quantize(d, scale, dtype)  # [M, K]
    out = (q, q.T, record_reference(formats.amax(d), pending), jnp.sum(d, axis=0))
    if act_scale is None:
        return out
    # act(pre) in E4M3 as the forward's prologue cast wrote it (same f32 operations, same bits).
    return (*out, formats.quantize(activations.activation(act)(pre), act_scale, formats.E4M3).T)


def _grad_kernel(*refs, limit, dtype, act, tanh, affine: bool, act_out: bool, cast_first: bool):
    # s_ref: [inv, scale, alpha, act_scale]; bias_ref: this block's [bk] of the bias (affine).
    s_ref, pre_ref, da_ref, *rest = refs
    bias_ref = rest.pop(0) if affine else None
    _pending_in, q_ref, qt_ref, pending_ref, sum_ref, *act_ref = rest
    # d = act'(pre) * da * inv for one [bm, bk] block, in f32, never written in high precision.
    pre_bxk = pre_ref[...].astype(jnp.float32)
    if affine:
        pre_bxk = apply_affine(pre_bxk, (s_ref[2], bias_ref[...]))
    if act_out:  # GELU and GELU' share their tanh (the pass is compute-bound)
        a_bxk, g_bxk = activations.ACTIVATION_AND_GRADS[act](pre_bxk, tanh)
    else:
        g_bxk = activations.ACTIVATION_GRADS[act](pre_bxk, tanh)
    d_bxk = g_bxk * (da_ref[...].astype(jnp.float32) * s_ref[0])
    record_amax(pending_ref, jnp.max(jnp.abs(d_bxk)))
    sum_ref[...] = jnp.sum(d_bxk, axis=0, keepdims=True)  # this block's rows of the bias grad
    y_bxk = formats.saturate(d_bxk * s_ref[1], jnp.isfinite(d_bxk), limit)  # as quantize
    q_bxk = y_bxk.astype(dtype)
    q_ref[...] = q_bxk
    qt_ref[...] = q_bxk.T if cast_first else y_bxk.T.astype(dtype)
    if act_out:  # act(pre) in E4M3, transposed: the forward cast's bits (``_kernel``)
        e4m3 = formats.as_dtype(formats.E4M3)
        ya_bxk = formats.saturate(a_bxk * s_ref[3], jnp.isfinite(a_bxk), formats.fmax(e4m3))
        act_ref[0][...] = ya_bxk.astype(e4m3).T if cast_first else ya_bxk.T.astype(e4m3)


def pallas_act_grad_cast_transpose(
    pre,
    da,
    inv,
    scale,
    dtype,
    act,
    bm: int,
    bk: int,
    interpret: bool,
    pending=None,
    affine=None,
    act_scale=None,
    num_warps=WARPS,
    num_stages=1,
    cast_first=False,
):
    """The Pallas kernel of ``act_grad_cast_transpose`` with explicit tuning, for tuning runs."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    (m, k), (gm, gk), target, whole, (alpha, bias, bias_spec) = grid_layout(
        pre, bm, bk, pending, affine
    )
    kernel = functools.partial(
        _grad_kernel,
        limit=formats.fmax(dtype),
        dtype=dtype,
        act=act,
        tanh=kernel_tanh(interpret),
        affine=affine is not None,
        act_out=act_scale is not None,
        cast_first=cast_first,
    )
    tile = pl.BlockSpec((bm, bk), lambda i, j: (i, j))
    tile_t = pl.BlockSpec((bk, bm), lambda i, j: (j, i))
    one = jnp.ones((), jnp.float32)
    scalars = [inv, scale, *(alpha or [one]), one if act_scale is None else act_scale]
    out_specs = [tile, tile_t, whole, pl.BlockSpec((1, bk), lambda i, j: (i, j))]
    out_shape = [
        jax.ShapeDtypeStruct((m, k), dtype),
        jax.ShapeDtypeStruct((k, m), dtype),
        jax.ShapeDtypeStruct(target.shape, jnp.float32),
        jax.ShapeDtypeStruct((gm, k), jnp.float32),
    ]
    if act_scale is not None:
        out_specs.append(tile_t)
        out_shape.append(jax.ShapeDtypeStruct((k, m), formats.as_dtype(formats.E4M3)))
    q, qt, target, sums_GMxK, *act_t = pl.pallas_call(
        kernel,
        grid=(gm, gk),
        in_specs=[pl.BlockSpec((len(scalars),), lambda i, j: (0,)), tile, tile, *bias_spec, whole],
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases={3 + len(bias): 2},
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="fp8_act_grad_cast_transpose",
    )(jnp.stack(scalars).astype(jnp.float32), pre, da, *bias, target)
    return (q, qt, untarget(target, pending), jnp.sum(sums_GMxK, axis=0), *act_t)


def act_grad_cast_transpose(
    pre,
    da,
    inv,
    scale,
    fmt,
    impl: str = "pallas",
    act="gelu_tanh",
    pending=None,
    affine=None,
    act_scale=None,
):
    """``d = act'(pre) * da * inv`` quantized: ``(q [M, K], q.T [K, M], amax(d), sum_M(d))``.

    The backward of ``act(pre) . w`` followed by the E5M2 cast of the layer that made ``pre``,
    in one pass: ``da`` is the dgrad GEMM's raw output and ``inv`` its inverse scale. The
    column sums are the gradient of a bias added to ``pre``. ``pending`` and ``affine`` (the
    pre-activation is ``pre * alpha + bias``): as in ``cast_transpose``. With ``act_scale`` a
    fifth output, ``act(pre)`` cast to E4M3 with that scale, transposed [K, M]: the weight
    gradient's operand that ``cast_transpose(pre, act_scale, 'e4m3', prologue=act)`` wrote in
    the forward pass (the same bits), rebuilt by this pass for one more FP8 write.
    """
    dtype = formats.as_dtype(fmt)
    activations.check_activation(act, activations.ACTIVATION_GRADS)
    check_affine(affine, pre.shape[-1])
    return dispatch(
        impl,
        pre.shape,
        lambda p, d, i, s, t, a, c: _grad_reference(p, d, i, s, t, a, c, dtype, act),
        lambda p, d, i, s, t, a, c, bm, bk, interpret: pallas_act_grad_cast_transpose(
            p, d, i, s, dtype, act, bm, bk, interpret, t, a, c
        ),
        pre,
        da,
        inv,
        scale,
        pending,
        affine,
        act_scale,
        col_blocks=ACT_COL_BLOCKS,
    )
