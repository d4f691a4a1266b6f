"""FP8 GEMM building blocks shared by ``ops.dot`` (one matmul) and ``ops.mlp`` (the fused MLP).

Operands reach these functions already reduced to one (optionally batched) GEMM layout:
x [(B,) M, K], w [(B,) K, N]. A GEMM of FP8 operands leaves ``lax.dot_general`` scaled by the
product of its operands' scales; ``unscale`` multiplies by the inverse in f32.

The fused path (``uses_fused_cast``) quantizes each operand with ``kernels.cast_transpose``: one
pass writes its FP8 copy in both layouts the forward and backward GEMMs need, and records its
amax into the state's pending slot.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from fp8jax.ops import activations, formats, kernels
from fp8jax.ops.remat import FP8_OUT, FP8_W, FP8_X
from fp8jax.ops.scaling import Fp8Meta

__all__ = [
    "REBUILD",
    "GemmConfig",
    "acc_dtype",
    "bwd_fused",
    "dgrad_out",
    "dy_cotangent",
    "fused_grads",
    "fwd_fused",
    "inverse_scales",
    "mm",
    "rebuilt_input",
    "rebuilt_operands",
    "rebuilt_weight",
    "unscale",
    "uses_fused_cast",
    "wgrad_dtype",
]


class GemmConfig(NamedTuple):
    """Static facts the backward pass needs (hashable, passed as a non-diff argument)."""

    x_dtype: jnp.dtype
    w_dtype: jnp.dtype
    out_dtype: jnp.dtype
    batched: bool
    cast: str = "xla"  # kernels.IMPLS: how operands are quantized (fused kernel or XLA ops)
    prologue: str | None = None  # activations.ACTIVATIONS: x is a pre-activation
    # The operands ('x', 'w', 'xw' or '') the fused path's backward casts to E4M3 again (the
    # forward's scales: the same bits), one layout each, instead of keeping their FP8 copies;
    # the forward writes only the layout its GEMM reads of those. For remat policies that keep
    # no FP8 copy of them (models.layers' ``rebuilds_operands``). The ops take a bool too
    # (``rebuilt_operands``: True is 'xw').
    rebuild: str = ""
    # The mesh axis a grouped GEMM's weight stack is split over inside a manual region (each
    # shard holds some of the groups): w's amax is merged over it, so the whole stack keeps one
    # per-tensor scale as on one device. None: w is whole.
    w_split_axis: str | None = None


REBUILD = ("", "x", "w", "xw")  # GemmConfig.rebuild's values


def rebuilt_operands(rebuild: bool | str) -> str:
    """``rebuild`` as GemmConfig's string: True means both operands ('xw'), False none ('')."""
    if isinstance(rebuild, bool):
        return "xw" if rebuild else ""
    if rebuild not in REBUILD:
        raise ValueError(f"rebuild must be a bool or one of {REBUILD}, got {rebuild!r}")
    return rebuild


def mm(a, b, contract_a: int, contract_b: int, batched: bool, out_dtype) -> jax.Array:
    """GEMM of FP8 operands on one contracting and one free axis (plus an optional batch)."""
    batch = ((0,), (0,)) if batched else ((), ())
    return lax.dot_general(
        a, b, (((contract_a,), (contract_b,)), batch), preferred_element_type=out_dtype
    )


def inverse_scales(sx, sw, sg) -> jax.Array:
    """``1 / (s_a * s_b)`` of the forward, dgrad and wgrad GEMMs, as one f32[3].

    With delayed scaling all three scales are known before the forward GEMM, so one tiny
    kernel serves the layer's three GEMMs; computed apart, each is a kernel of its own (XLA
    does not copy a divide into the large fusion that uses it). Same f32 operations, same bits.
    """
    return 1.0 / jnp.stack([sx * sw, sg * sw, sx * sg])


def unscale(y, inv, dtype) -> jax.Array:
    """``y * inv`` in ``dtype`` (``inv = 1 / (s_a * s_b)``), multiplied in f32, fused with the cast.

    The inverse scale is not rounded to bf16 first: that would bias every element of the GEMM
    output the same way, by up to 2**-9 relative.
    """
    return (y.astype(jnp.float32) * inv).astype(dtype)


def dgrad_out(cfg: GemmConfig, dx, inv, x_pre) -> jax.Array:
    """dgrad's GEMM output unscaled; through act' of the prologue when there is one."""
    if cfg.prologue is None:
        return unscale(dx, inv, cfg.x_dtype)
    da = dx.astype(jnp.float32) * inv  # d loss / d act(x), kept in f32 until after act'
    _, act_vjp = jax.vjp(activations.activation(cfg.prologue), x_pre.astype(jnp.float32))
    return act_vjp(da)[0].astype(cfg.x_dtype)


def acc_dtype(dtype):
    """The dtype a GEMM accumulates into for an output of ``dtype``: f32 stays f32, bf16/f16
    outputs come straight from the GEMM epilogue."""
    return jnp.float32 if jnp.dtype(dtype) == jnp.float32 else dtype


def wgrad_dtype(cfg: GemmConfig):
    """The dtype dw leaves its GEMM in: the narrower of x's and w's. An f32 master weight
    multiplied by bf16 activations gets its gradient as a bf16 matmul on a bf16 copy of it
    would (then unscaled into f32); f32 only when both operands are."""
    return min(cfg.x_dtype, cfg.w_dtype, key=lambda d: jnp.dtype(d).itemsize)


def uses_fused_cast(cfg: GemmConfig, meta: Fp8Meta) -> bool:
    """Quantize with kernels.cast_transpose: 2-D GEMMs whose scales are known beforehand."""
    known = all(s.recipe.scales_known_ahead for s in (meta.x, meta.w, meta.dy))
    return cfg.cast != "xla" and not cfg.batched and known


def fwd_fused(cfg: GemmConfig, x, w, meta: Fp8Meta, affine=None, raw: bool = False, norm=None):
    """Forward with both layouts from one pass per operand; keeps x.T and w as residuals.

    Returns ``(y, new_meta, (xq_t, wq, inv, x_pre))`` (x and w as given in the places of xq_t
    and wq where ``cfg.rebuild`` names them). ``affine`` (``kernels.cast_transpose``'s) makes
    x's pass quantize ``act(x * alpha + bias)``, ``norm`` (its too) the LayerNorm of x; ``raw``
    returns the GEMM's output still scaled by ``sx * sw`` (``inv[0]`` unscales it).
    """
    sx, sw = meta.x.scale, meta.w.scale
    # E4M3 for both forward operands. x [M, K] -> xq [M, K] for this GEMM and xq_t [K, M] for
    # the weight gradient; w [K, N] -> wq [K, N] for dgrad, wq_t [N, K] here. With a prologue
    # the same pass computes act(x) first: act(x) is never written out. Each pass also records
    # its amax into its state's pending slot (in place on GPUs). An operand in ``rebuild``:
    # only this GEMM's layout; the backward casts it again (``rebuilt_input``, ``rebuilt_weight``).
    xq, xq_t, hist_x = kernels.cast_transpose(
        x,
        sx,
        formats.E4M3,
        cfg.cast,
        cfg.prologue,
        pending=meta.x.amax_history,
        affine=affine,
        layouts="row" if "x" in cfg.rebuild else kernels.BOTH,
        norm=norm,
    )
    wq, wq_t, hist_w = kernels.cast_transpose(
        w,
        sw,
        formats.E4M3,
        cfg.cast,
        pending=meta.w.amax_history,
        layouts="col" if "w" in cfg.rebuild else kernels.BOTH,
    )
    # A rebuilt operand is kept as given: the forward's input, which a remat recomputes or holds.
    # A kept one is named for remat policies (ops.remat): the layout the backward GEMM reads.
    xq_t = x if "x" in cfg.rebuild else checkpoint_name(xq_t, FP8_X)
    wq = w if "w" in cfg.rebuild else checkpoint_name(wq, FP8_W)
    inv = inverse_scales(sx, sw, meta.dy.scale)  # delayed scaling: dy's scale is known
    y = mm(xq, wq_t, 1, 1, False, acc_dtype(cfg.out_dtype))  # [M, N]: K innermost in both
    if not raw:
        y = unscale(y, inv[0], cfg.out_dtype)
    y = checkpoint_name(y, FP8_OUT)
    new_meta = meta.replace(
        x=meta.x.replace(amax_history=hist_x), w=meta.w.replace(amax_history=hist_w)
    )
    x_pre = x if cfg.prologue else None  # act' needs the pre-activation (bf16), not act(x)
    return y, new_meta, (xq_t, wq, inv, x_pre)


def rebuilt_input(cfg: GemmConfig, x_or_xq_t, meta: Fp8Meta, norm=None) -> jax.Array:
    """The wgrad's E4M3 x.T [K, M]: ``fwd_fused``'s residual, or with 'x' in ``rebuild`` cast
    again from x (the forward's scale, prologue and ``norm``: the same bits, one layout, no
    amax). An affine input (the fused MLP's wo) is rebuilt by ``act_kernels`` instead."""
    if "x" not in cfg.rebuild:
        return x_or_xq_t
    return kernels.cast_transpose(
        x_or_xq_t,
        meta.x.scale,
        formats.E4M3,
        cfg.cast,
        cfg.prologue,
        layouts="col",
        record=False,
        norm=norm,
    )[1]


def rebuilt_weight(cfg: GemmConfig, w_or_wq, meta: Fp8Meta) -> jax.Array:
    """The dgrad's E4M3 w [K, N]: ``fwd_fused``'s residual, or with 'w' in ``rebuild`` cast
    again."""
    if "w" not in cfg.rebuild:
        return w_or_wq
    return kernels.cast_transpose(
        w_or_wq, meta.w.scale, formats.E4M3, cfg.cast, layouts="row", record=False
    )[0]


def fused_grads(cfg: GemmConfig, xq_t, wq, inv, gq, gq_t, dw_dtype=None):
    """``(dgrad's raw GEMM output, dw)`` from dy already in E5M2, in both layouts.

    dw leaves the GEMM in ``wgrad_dtype(cfg)`` and is unscaled into ``dw_dtype`` (default
    ``cfg.w_dtype``).
    """
    dx = mm(gq, wq, 1, 1, False, acc_dtype(cfg.x_dtype))  # [M, K]: N innermost in both
    dw = mm(xq_t, gq_t, 1, 1, False, acc_dtype(wgrad_dtype(cfg)))  # [K, N]: M innermost
    return dx, unscale(dw, inv[2], dw_dtype or cfg.w_dtype)


def bwd_fused(cfg: GemmConfig, res, g, meta: Fp8Meta, ct_meta: Fp8Meta):
    """dgrad and wgrad from one pass over dy (E5M2, both layouts), and the state cotangent."""
    xq_t, wq, inv, x_pre = res
    xq_t, wq = rebuilt_input(cfg, xq_t, meta), rebuilt_weight(cfg, wq, meta)
    sg = meta.dy.scale
    # [M, N], [N, M]; the amax goes straight into the cotangent's pending slot.
    gq, gq_t, hist_g = kernels.cast_transpose(
        g, sg, formats.E5M2, cfg.cast, pending=ct_meta.dy.amax_history
    )
    dx, dw = fused_grads(cfg, xq_t, wq, inv, gq, gq_t)
    return dgrad_out(cfg, dx, inv[1], x_pre), dw, dy_cotangent(meta, ct_meta, hist_g)


def dy_cotangent(meta: Fp8Meta, ct_meta: Fp8Meta, hist_g) -> Fp8Meta:
    """The state cotangent from dy's recorded history (``ct_meta.dy``'s, with this amax).

    Amaxes, not derivatives: x and w were recorded in the forward pass (zero here); dy's amax
    is max-merged into whatever later uses sent back.
    """
    zeros = jax.tree.map(jnp.zeros_like, meta)
    return zeros.replace(dy=ct_meta.dy.replace(amax_history=hist_g))
