"""Attention's fused Q/K/V projection as one FP8 custom VJP: q, k and v out, their gradients in.

As one FP8 ``dot_general`` whose output is then sliced, the backward pass first writes dq, dk
and dv side by side in bf16 (XLA's concatenate, [tokens, C]) for the E5M2 cast to read back.
Here the custom VJP owns the split: ``cast_transpose_parts`` casts each gradient straight into
its columns of the E5M2 operands, in both layouts, with the amax and the bias gradient's column
sums, so the bf16 concatenation is never written. The forward pass and the GEMMs are
``ops.gemm``'s fused path, as one ``dot_general`` runs them: the same bits.

The fused output's columns, C = kv_heads * (G + 2) * head_dim: per key/value head, its G query
heads, then its key, then its value (``models.layers.Attention``'s kernel layout).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fp8jax.ops import dot, formats, gemm, kernels, norm
from fp8jax.ops.gemm import GemmConfig
from fp8jax.ops.scaling import Fp8Meta

__all__ = [
    "cast_transpose_parts",
    "pallas_cast_transpose_parts",
    "qkv_projection",
]

DENSE = (((1,), (0,)), ((), ()))  # [M, D] . [D, C]


def _assemble(parts, heads):
    """dq [M, K*G*H], dk and dv [M, K*H] side by side as the fused output's [M, C]."""
    kv, g, h = heads
    m = parts[0].shape[0]
    q, k, v = (p.reshape(m, kv, -1, h) for p in parts)
    return jnp.concatenate([q, k, v], axis=2).reshape(m, kv * (g + 2) * h)


def _parts_reference(parts, heads, scale, pending, dtype, sums: bool):
    """XLA version of ``cast_transpose_parts``: the concatenation, then the one cast."""
    g_MxC = _assemble(parts, heads)
    q, q_t, hist = kernels.cast_transpose(g_MxC, scale, dtype, "xla", pending=pending)
    return q, q_t, hist, jnp.sum(g_MxC.astype(jnp.float32), axis=0) if sums else None


def _part_kernel(s_ref, x_ref, *refs, n_prev: int, limit: float, dtype, sums: bool):
    # refs: the pending amax input and the previous parts' outputs (aliased to this call's
    # outputs, never read), then q [bm, bk], q.T [bk, bm], the column sums [1, bk], the amax.
    q_ref, qt_ref, *rest = refs[1 + n_prev :]
    x_bxk = x_ref[...].astype(jnp.float32)
    kernels.record_amax(rest[-1], jnp.max(jnp.abs(x_bxk)))
    if sums:  # this block's rows of the bias gradient
        rest[0][...] = jnp.sum(x_bxk, axis=0, keepdims=True)
    # f32 multiply and clip before the narrow cast, exactly as formats.quantize.
    y_bxk = formats.saturate(x_bxk * s_ref[0], jnp.isfinite(x_bxk), limit)
    q_ref[...] = y_bxk.astype(dtype)
    qt_ref[...] = y_bxk.T.astype(dtype)


def _out_block(part: int, heads, hpb: int):
    """Input column block j of ``part`` (0 q, 1 k, 2 v) -> its column block in [M, C]."""
    g = heads[1]
    per, first = (g, 0) if part == 0 else (1, g + part - 1)  # heads per kv head, first slot

    def block(j):
        head, r = j // hpb, j % hpb
        return ((head // per) * (g + 2) + first + head % per) * hpb + r

    return block


def pallas_cast_transpose_parts(parts, heads, scale, dtype, bm, bk, interpret, pending, sums):
    """The Pallas kernels of ``cast_transpose_parts``: one call per part, each writing its
    column blocks of the outputs the previous call made (aliased, so written in place)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    m, c = parts[0].shape[0], sum(p.shape[1] for p in parts)
    out_shape = [jax.ShapeDtypeStruct((m, c), dtype), jax.ShapeDtypeStruct((c, m), dtype)]
    if sums:
        out_shape.append(jax.ShapeDtypeStruct((m // bm, c), jnp.float32))
    prev, target = [], None
    for part, x in enumerate(parts):
        (_, _), grid, target, whole, _ = kernels.grid_layout(
            x, bm, bk, pending if part == 0 else target, None
        )
        block = _out_block(part, heads, heads[2] // bk)
        out_specs = [
            pl.BlockSpec((bm, bk), lambda i, j, block=block: (i, block(j))),
            pl.BlockSpec((bk, bm), lambda i, j, block=block: (block(j), i)),
            *([pl.BlockSpec((1, bk), lambda i, j, block=block: (i, block(j)))] if sums else []),
            whole,
        ]
        kernel = functools.partial(
            _part_kernel, n_prev=len(prev), limit=formats.fmax(dtype), dtype=dtype, sums=sums
        )
        n_out = len(out_specs)
        *prev, target = pl.pallas_call(
            kernel,
            grid=grid,
            in_specs=[
                pl.BlockSpec((1,), lambda i, j: (0,)),
                pl.BlockSpec((bm, bk), lambda i, j: (i, j)),
                whole,
                *out_specs[: len(prev)],
            ],
            out_specs=out_specs,
            out_shape=[*out_shape, jax.ShapeDtypeStruct(target.shape, jnp.float32)],
            input_output_aliases={2: n_out - 1, **{3 + k: k for k in range(len(prev))}},
            interpret=interpret,
            compiler_params=plt.CompilerParams(num_warps=kernels.WARPS, num_stages=1),
            name="fp8_cast_transpose_parts",
        )(jnp.reshape(scale, (1,)).astype(jnp.float32), x, target, *prev)
    q, q_t, *sums_GMxC = prev
    col_sums = jnp.sum(sums_GMxC[0], axis=0) if sums else None
    return q, q_t, kernels.untarget(target, pending), col_sums


def cast_transpose_parts(parts, heads, scale, fmt, impl: str = "pallas", pending=None, sums=False):
    """``kernels.cast_transpose`` of dq, dk and dv side by side, without writing them so.

    ``parts``: [M, K*G*H], [M, K*H], [M, K*H] for ``heads = (K, G, H)``. Returns ``(q [M, C],
    q.T [C, M], amax or the ``pending`` history, column sums [C] or None)`` of their assembly
    in the fused output's column order (module docstring); the sums (``sums=True``) are in f32.
    """
    dtype = formats.as_dtype(fmt)
    return kernels.dispatch(
        impl,
        (parts[0].shape[0], heads[2]),  # blocks divide head_dim: each lies in one head
        lambda q, k, v, s, p: _parts_reference((q, k, v), heads, s, p, dtype, sums),
        lambda q, k, v, s, p, bm, bk, interpret: pallas_cast_transpose_parts(
            (q, k, v), heads, s, dtype, bm, bk, interpret, p, sums
        ),
        *parts,
        scale,
        pending,
    )


class _Cfg(NamedTuple):
    gemm: GemmConfig
    heads: tuple[int, int, int]  # K (key/value heads), G (query heads per K), H (head dim)
    b_dtype: jnp.dtype | None  # the bias' dtype; None without one
    norm_eps: float | None = None  # x is a LayerNorm's input, folded into its cast (ops.norm)


def _split(cfg: _Cfg, y_MxC):
    kv, g, h = cfg.heads
    y_MxKxG2xH = y_MxC.reshape(y_MxC.shape[0], kv, g + 2, h)
    return y_MxKxG2xH[:, :, :g], y_MxKxG2xH[:, :, g], y_MxKxG2xH[:, :, g + 1]


def _fwd_impl(cfg: _Cfg, x, w, b, ln, meta: Fp8Meta):
    # ln: the folded LayerNorm's (gamma, beta), or None; its statistics join the residuals.
    folded, normed = norm.fold(x, ln, cfg.norm_eps)
    y_MxC, new_meta, res = gemm.fwd_fused(cfg.gemm, x, w, meta, norm=folded)
    if b is not None:  # b [C], in the output dtype, as nn.DenseGeneral adds it
        y_MxC = y_MxC + b.astype(y_MxC.dtype)
    return (*_split(cfg, y_MxC), new_meta), (res, normed)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _qkv(cfg: _Cfg, x, w, b, ln, meta: Fp8Meta):
    return _fwd_impl(cfg, x, w, b, ln, meta)[0]


def _qkv_fwd(cfg: _Cfg, x, w, b, ln, meta: Fp8Meta):
    out, res = _fwd_impl(cfg, x, w, b, ln, meta)
    return out, (res, ln, meta)


def _qkv_bwd(cfg: _Cfg, saved, cts):
    ((xq_t, wq, inv, _), normed), ln, meta = saved
    dq, dk, dv, ct_meta = cts
    c = cfg.gemm
    folded = norm.refold(normed, ln)
    xq_t, wq = gemm.rebuilt_input(c, xq_t, meta, folded), gemm.rebuilt_weight(c, wq, meta)
    m = dq.shape[0]
    # E5M2 for the gradient, both layouts, from the three parts where autodiff left them.
    gq, gq_t, hist_g, db = cast_transpose_parts(
        [p.reshape(m, -1) for p in (dq, dk, dv)],
        cfg.heads,
        meta.dy.scale,
        formats.E5M2,
        c.cast,
        pending=ct_meta.dy.amax_history,
        sums=cfg.b_dtype is not None,
    )
    dx, dw = gemm.fused_grads(c, xq_t, wq, inv, gq, gq_t)
    db = None if db is None else db.astype(cfg.b_dtype)
    dx, d_ln = norm.folded_dgrad(c, dx, inv[1], normed, ln)
    return dx, dw, db, d_ln, gemm.dy_cotangent(meta, ct_meta, hist_g)


_qkv.defvjp(_qkv_fwd, _qkv_bwd)


def qkv_projection(
    x,
    w,
    b,
    meta: Fp8Meta,
    cast_kernel: str = kernels.AUTO,
    rebuild: bool | str = False,
    ln: tuple[jax.Array, jax.Array, float] | None = None,
):
    """q, k and v from one FP8 GEMM: ``x . w + b`` split per key/value head.

    x [..., D], w [D, K, G + 2, H] (module docstring's layout), b [K, G + 2, H] or None.
    Returns ``(q [..., K * G, H], k [..., K, H], v [..., K, H], meta)``, what one
    ``dot.dot_general`` and the slices give. Wider weights (f32 masters) are quantized as
    given and get their gradients in their own dtype; ``rebuild``: as ``gemm.GemmConfig``'s.
    Off the fused path (current scaling, fine recipes, ``cast_kernel='xla'``, sides not in
    multiples of 16) it is that ``dot_general`` and the slices. ``ln = (gamma [D], beta [D],
    eps)``: x is a LayerNorm's input and the GEMM reads its output, folded into x's cast
    (``ops.norm``); elsewhere the norm is applied first, in x's dtype.
    """
    cast_kernel = kernels.resolve_impl(cast_kernel)
    dot.check_operand("x", x)
    dot.check_operand("w", w)
    lead, (d, kv, g2, h) = x.shape[:-1], w.shape
    heads = (kv, g2 - 2, h)
    x_MxD = x.reshape(-1, x.shape[-1])
    w_DxC = w.reshape(d, -1)
    dtype = jnp.dtype(x.dtype)
    cfg = _Cfg(
        GemmConfig(
            dtype,
            jnp.dtype(w.dtype),
            dtype,
            False,
            cast_kernel,
            None,
            gemm.rebuilt_operands(rebuild),
        ),
        heads,
        None if b is None else jnp.dtype(b.dtype),
        None if ln is None else float(ln[2]),
    )
    aligned = all(n % dot.PAD == 0 and n > 0 for n in (*x_MxD.shape, h))
    if aligned and gemm.uses_fused_cast(cfg.gemm, meta):
        b_C = None if b is None else b.reshape(-1)
        with jax.named_scope(f"fp8_{meta.x.recipe.name}"):  # the recipe, as ops.dot names it
            q, k, v, meta = _qkv(cfg, x_MxD, w_DxC, b_C, None if ln is None else ln[:2], meta)
    else:
        x_MxD = norm.layer_norm(x_MxD, ln)
        y_MxC, meta = dot.dot_general(
            x_MxD, w_DxC, DENSE, meta, dtype, cast_kernel, rebuild=rebuild
        )
        q, k, v = _split(cfg, y_MxC if b is None else y_MxC + b.reshape(-1).astype(dtype))
    return (
        q.reshape(*lead, kv * (g2 - 2), h),
        k.reshape(*lead, kv, h),
        v.reshape(*lead, kv, h),
        meta,
    )
