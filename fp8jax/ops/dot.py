"""A functional FP8 ``dot_general`` with a custom VJP.

Forward  y  = x(E4M3) . w(E4M3)
dgrad    dx = dy(E5M2) . w(E4M3)
wgrad    dw = x(E4M3) . dy(E5M2)       (cuBLASLt has no E5M2 x E5M2 GEMM)

FP8 arrays go straight into ``lax.dot_general`` with ``preferred_element_type``: that is the
form XLA lowers to ``__cublas$lt$matmul$f8`` on Hopper regardless of flags. The residuals kept
for the backward pass are the FP8 copies of x and w, not their bf16/f32 originals.

Scale state travels as an ``Fp8Meta`` (x, w, dy ``ScaleState``s). The call returns an updated
meta whose x and w pending amax include this call; the dy amax is only known in the backward
pass, so it comes back as the cotangent of the meta *input*, max-merged with the cotangent of
the meta *output*. When callers thread the returned meta into the next use of the same state
(which the Flax modules do), repeated uses form a chain and the amax combines by max.

With a ``prologue`` (an elementwise activation, ``kernels.ACTIVATIONS``) the matmul computes
``act(x) . w``: the activation is applied inside the pass that quantizes x, and the backward pass
keeps the pre-activation x (not act(x)) and applies act' to dgrad's output in f32.

A non-finite operand (x, w, or dy in the backward) is never saturated away: the cast makes it
NaN, which the GEMM spreads along its row or column, so the loss or the gradients show the bad
step; its amax records as 0 (the fused kernels: per block), so no scale turns non-finite. An
empty dimension gives the plain ``lax.dot_general`` result (zeros for an empty contraction) and
leaves the state unchanged.
"""

from __future__ import annotations

import functools
import math
import string
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from fp8jax.ops import formats, kernels, scaling
from fp8jax.ops.scaling import CurrentScaling, Recipe, ScaleState

DimensionNumbers = tuple[tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], ...]]


@struct.dataclass
class Fp8Meta:
    """Scale state of one FP8 matmul: inputs x, weights w, output gradients dy."""

    x: ScaleState
    w: ScaleState
    dy: ScaleState


def init_meta(recipe: Recipe = scaling.DEFAULT_RECIPE, w_recipe: Recipe | None = None) -> Fp8Meta:
    """Fresh state for one FP8 matmul (E4M3 for x and w, E5M2 for dy)."""
    return Fp8Meta(
        x=scaling.init_scale_state("e4m3", recipe),
        w=scaling.init_scale_state("e4m3", w_recipe or recipe),
        dy=scaling.init_scale_state("e5m2", recipe),
    )


def check_operand(name: str, x: jax.Array) -> None:
    """Reject operands the FP8 path cannot take, naming the fix."""
    dtype = jnp.dtype(x.dtype)
    if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise TypeError(
            f"fp8jax.dot_general: {name} has dtype {dtype}; FP8 matmuls take float32, bfloat16 "
            f"or float16 inputs (cast with x.astype(jnp.bfloat16))"
        )


class _Cfg(NamedTuple):
    """Static facts the backward pass needs (hashable, passed as a non-diff argument)."""

    x_dtype: jnp.dtype
    w_dtype: jnp.dtype
    out_dtype: jnp.dtype
    batched: bool
    cast: str = "xla"  # kernels.IMPLS: how operands are quantized (fused kernel or XLA ops)
    prologue: str | None = None  # kernels.ACTIVATIONS: x is a pre-activation


def _use_scale(state: ScaleState, amax: jax.Array) -> jax.Array:
    """Delayed scaling uses the stored scale; current scaling derives it from this amax."""
    if isinstance(state.recipe, CurrentScaling):
        return scaling.scale_from_amax(amax, state.scale, state.fmt, state.recipe)
    return state.scale


def _mm(a, b, contract_a: int, contract_b: int, batched: bool, out_dtype):
    """GEMM of FP8 operands on one contracting and one free axis (plus an optional batch)."""
    batch = ((0,), (0,)) if batched else ((), ())
    return lax.dot_general(
        a, b, (((contract_a,), (contract_b,)), batch), preferred_element_type=out_dtype
    )


def _inverse_scales(sx, sw, sg) -> jax.Array:
    """``1 / (s_a * s_b)`` of the forward, dgrad and wgrad GEMMs, as one f32[3].

    With delayed scaling all three scales are known before the forward GEMM, so one tiny
    kernel serves the layer's three GEMMs; computed apart, each was a kernel of its own (XLA
    does not copy a divide into the large fusion that uses it): 240 launches per step fewer at
    gpt_1b3. Same f32 operations, same bits.
    """
    return 1.0 / jnp.stack([sx * sw, sg * sw, sx * sg])


def _unscale(y, inv, dtype):
    """``y * inv`` in ``dtype`` (``inv = 1 / (s_a * s_b)``), multiplied in f32, fused with the cast.

    The inverse scale is not rounded to bf16 first: that would bias every element of the GEMM
    output the same way, by up to 2**-9 relative.
    """
    return (y.astype(jnp.float32) * inv).astype(dtype)


def _dgrad_out(cfg: _Cfg, dx, inv, x_pre):
    """dgrad's GEMM output unscaled; through act' of the prologue when there is one."""
    if cfg.prologue is None:
        return _unscale(dx, inv, cfg.x_dtype)
    da = dx.astype(jnp.float32) * inv  # d loss / d act(x), kept in f32 until after act'
    _, act_vjp = jax.vjp(kernels.activation(cfg.prologue), x_pre.astype(jnp.float32))
    return act_vjp(da)[0].astype(cfg.x_dtype)


def _acc_dtype(dtype):
    # f32 outputs stay f32; bf16/f16 outputs come straight from the GEMM epilogue.
    return jnp.float32 if jnp.dtype(dtype) == jnp.float32 else dtype


def _wgrad_dtype(cfg: _Cfg):
    """The dtype dw leaves its GEMM in: the narrower of x's and w's. An f32 master weight
    multiplied by bf16 activations gets its gradient as a bf16 matmul on a bf16 copy of it
    would (then unscaled into f32); f32 only when both operands are."""
    return min(cfg.x_dtype, cfg.w_dtype, key=lambda d: jnp.dtype(d).itemsize)


def _fused(cfg: _Cfg, meta: Fp8Meta) -> bool:
    """Quantize with kernels.cast_transpose: 2-D GEMMs whose scales are known beforehand."""
    delayed = not any(isinstance(s.recipe, CurrentScaling) for s in (meta.x, meta.w, meta.dy))
    return cfg.cast != "xla" and not cfg.batched and delayed


def _fwd_fused(cfg: _Cfg, x, w, meta: Fp8Meta, affine=None, raw: bool = False):
    """Forward with both layouts from one pass per operand; keeps x.T and w as residuals.

    ``affine`` (``kernels.cast_transpose``'s) makes x's pass quantize ``act(x * alpha + bias)``;
    ``raw`` returns the GEMM's output still scaled by ``sx * sw`` (``inv[0]`` unscales it).
    """
    sx, sw = meta.x.scale, meta.w.scale
    # E4M3 for both forward operands, as in _fwd_impl. x [M, K] -> xq [M, K] for this GEMM and
    # xq_t [K, M] for the weight gradient; w [K, N] -> wq [K, N] for dgrad, wq_t [N, K] here.
    # With a prologue the same pass computes act(x) first: act(x) is never written out.
    # Each pass also records its amax into its state's pending slot (in place on GPUs).
    xq, xq_t, hist_x = kernels.cast_transpose(
        x, sx, formats.E4M3, cfg.cast, cfg.prologue, pending=meta.x.amax_history, affine=affine
    )
    wq, wq_t, hist_w = kernels.cast_transpose(
        w, sw, formats.E4M3, cfg.cast, pending=meta.w.amax_history
    )
    inv = _inverse_scales(sx, sw, meta.dy.scale)  # delayed scaling: dy's scale is known
    y = _mm(xq, wq_t, 1, 1, False, _acc_dtype(cfg.out_dtype))  # [M, N]: K innermost in both
    if not raw:
        y = _unscale(y, inv[0], cfg.out_dtype)
    new_meta = meta.replace(
        x=meta.x.replace(amax_history=hist_x), w=meta.w.replace(amax_history=hist_w)
    )
    x_pre = x if cfg.prologue else None  # act' needs the pre-activation (bf16), not act(x)
    return y, new_meta, (xq_t, wq, inv, x_pre)


def _fused_grads(cfg: _Cfg, xq_t, wq, inv, gq, gq_t, dw_dtype=None):
    """``(dgrad's raw GEMM output, dw)`` from dy already in E5M2, in both layouts.

    dw leaves the GEMM in ``_wgrad_dtype(cfg)`` and is unscaled into ``dw_dtype`` (default
    ``cfg.w_dtype``).
    """
    dx = _mm(gq, wq, 1, 1, False, _acc_dtype(cfg.x_dtype))  # [M, K]: N innermost in both
    dw = _mm(xq_t, gq_t, 1, 1, False, _acc_dtype(_wgrad_dtype(cfg)))  # [K, N]: M innermost
    return dx, _unscale(dw, inv[2], dw_dtype or cfg.w_dtype)


def _bwd_fused(cfg: _Cfg, res, g, meta: Fp8Meta, ct_meta: Fp8Meta):
    """dgrad and wgrad from one pass over dy (E5M2, both layouts), and the state cotangent."""
    xq_t, wq, inv, x_pre = res
    sg = meta.dy.scale
    # [M, N], [N, M]; the amax goes straight into the cotangent's pending slot.
    gq, gq_t, hist_g = kernels.cast_transpose(
        g, sg, formats.E5M2, cfg.cast, pending=ct_meta.dy.amax_history
    )
    dx, dw = _fused_grads(cfg, xq_t, wq, inv, gq, gq_t)
    return _dgrad_out(cfg, dx, inv[1], x_pre), dw, _dy_cotangent(meta, ct_meta, hist_g)


def _dy_cotangent(meta: Fp8Meta, ct_meta: Fp8Meta, hist_g) -> Fp8Meta:
    """The state cotangent from dy's recorded history (``ct_meta.dy``'s, with this amax)."""
    zeros = jax.tree.map(jnp.zeros_like, meta)
    return zeros.replace(dy=ct_meta.dy.replace(amax_history=hist_g))


def _meta_cotangent(meta: Fp8Meta, ct_meta: Fp8Meta, amax_g) -> Fp8Meta:
    """The state cotangent: amaxes, not derivatives. x and w were recorded in the forward pass
    (zero here); dy's amax is max-merged into whatever later uses sent back."""
    return _dy_cotangent(meta, ct_meta, scaling.record(ct_meta.dy, amax_g).amax_history)


def _fwd_impl(cfg: _Cfg, x, w, meta: Fp8Meta):
    if _fused(cfg, meta):
        return _fwd_fused(cfg, x, w, meta)
    x_pre = x if cfg.prologue else None
    if cfg.prologue:
        x = kernels.activation(cfg.prologue)(x.astype(jnp.float32))  # f32, as the kernel's
    amax_x, amax_w = formats.amax(x), formats.amax(w)
    sx, sw = _use_scale(meta.x, amax_x), _use_scale(meta.w, amax_w)
    # E4M3 for both forward operands: activations and weights need precision more than range.
    xq = formats.quantize(x, sx, formats.E4M3)
    wq = formats.quantize(w, sw, formats.E4M3)
    m_axis = 1 if cfg.batched else 0
    # Current scaling of dy: its scale comes from the backward's own amax, so no f32[3] here.
    current_dy = isinstance(meta.dy.recipe, CurrentScaling)
    inv = None if current_dy else _inverse_scales(sx, sw, meta.dy.scale)
    y = _mm(xq, wq, m_axis + 1, m_axis, cfg.batched, _acc_dtype(cfg.out_dtype))
    y = _unscale(y, 1.0 / (sx * sw) if inv is None else inv[0], cfg.out_dtype)
    new_meta = meta.replace(x=scaling.record(meta.x, amax_x), w=scaling.record(meta.w, amax_w))
    return y, new_meta, (xq, wq, sx, sw, inv, x_pre)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8_matmul(cfg: _Cfg, x, w, meta: Fp8Meta):
    y, new_meta, _ = _fwd_impl(cfg, x, w, meta)
    return y, new_meta


def _fp8_matmul_fwd(cfg: _Cfg, x, w, meta: Fp8Meta):
    y, new_meta, res = _fwd_impl(cfg, x, w, meta)
    return (y, new_meta), (*res, meta)


def _fp8_matmul_bwd(cfg: _Cfg, res, cts):
    g, ct_meta = cts  # g: [(B,) M, N] in the output dtype
    meta = res[-1]
    if _fused(cfg, meta):
        return _bwd_fused(cfg, res[:-1], g, meta, ct_meta)
    xq, wq, sx, sw, inv, x_pre, meta = res
    amax_g = formats.amax(g)
    sg = _use_scale(meta.dy, amax_g)
    # E5M2 for gradients: they span many decades and need range more than mantissa.
    gq = formats.quantize(g, sg, formats.E5M2)
    b = 1 if cfg.batched else 0
    # dgrad: contract N (g axis b+1, w axis b+1) -> [(B,) M, K]
    dx = _mm(gq, wq, b + 1, b + 1, cfg.batched, _acc_dtype(cfg.x_dtype))
    if inv is None:
        inv = _inverse_scales(sx, sw, sg)
    dx = _dgrad_out(cfg, dx, inv[1], x_pre)
    # wgrad: contract M (x axis b, g axis b) -> [(B,) K, N]
    dw = _mm(xq, gq, b, b, cfg.batched, _acc_dtype(_wgrad_dtype(cfg)))
    dw = _unscale(dw, inv[2], cfg.w_dtype)
    return dx, dw, _meta_cotangent(meta, ct_meta, amax_g)


_fp8_matmul.defvjp(_fp8_matmul_fwd, _fp8_matmul_bwd)


def _remaining(ndim: int, *used) -> list[int]:
    taken = {d for group in used for d in group}
    return [d for d in range(ndim) if d not in taken]


PAD = 16  # cuBLASLt FP8 GEMMs need M, K, N in multiples of 16


def _pad_to_tiles(x, w, batched: bool):
    """Zero-pad M, K, N to multiples of ``PAD`` (a no-op for aligned shapes).

    XLA:GPU pads unaligned FP8 GEMM operands itself, but in jax 0.11.2 it kept the unpadded
    strides (and left a saved FP8 residual unpadded), so the GEMM read out of bounds: inf/NaN
    on an H200 for shapes like [4, 6] x [6, 8]. Padding the high-precision operands here keeps
    XLA off that path. Zeros change neither the product nor any amax, and autodiff slices
    the padding back off the gradients.
    """
    m, k = x.shape[-2:]
    n = w.shape[-1]
    up = lambda d: -d % PAD  # noqa: E731
    if up(m) == up(k) == up(n) == 0:
        return x, w
    lead = [(0, 0)] if batched else []
    x = jnp.pad(x, [*lead, (0, up(m)), (0, up(k))])
    w = jnp.pad(w, [*lead, (0, up(k)), (0, up(n))])
    return x, w


def check_shapes(lhs_shape, rhs_shape, dimension_numbers: DimensionNumbers) -> None:
    """Reject operands whose contracting or batch dims differ in size, naming both shapes."""
    (lc, rc), (lb, rb) = dimension_numbers
    for kind, ld, rd in (("contracting", lc, rc), ("batch", lb, rb)):
        sizes = lambda shape, dims: [shape[d] for d in dims]  # noqa: E731
        if len(ld) != len(rd) or sizes(lhs_shape, ld) != sizes(rhs_shape, rd):
            raise ValueError(
                f"fp8jax.dot_general: lhs shape {tuple(lhs_shape)} and rhs shape "
                f"{tuple(rhs_shape)} do not match on the {kind} dims {tuple(ld)} and "
                f"{tuple(rd)} (sizes {sizes(lhs_shape, ld)} vs {sizes(rhs_shape, rd)}); pass "
                f"operands whose {kind} dims have equal sizes"
            )


def dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers: DimensionNumbers,
    meta: Fp8Meta,
    preferred_element_type=None,
    cast_kernel: str = "xla",
    prologue: str | None = None,
) -> tuple[jax.Array, Fp8Meta]:
    """FP8 ``lax.dot_general``: returns the result and the meta with this call's amax recorded.

    Any dimension numbers are reduced to one (optionally batched) GEMM by transposing and
    reshaping the high-precision operands before quantization, so XLA sees the single
    contracting / single free axis layout cuBLASLt's FP8 GEMM needs. ``cast_kernel``
    ('xla', 'pallas', 'interpret'; see fp8jax.ops.kernels) picks how operands are quantized.
    ``prologue`` (a name in ``kernels.ACTIVATIONS``, e.g. 'gelu_tanh') multiplies ``act(lhs)``
    instead of ``lhs``, with the activation fused into lhs' quantization.
    """
    kernels.check_impl(cast_kernel)
    kernels.activation(prologue)  # a clear error for an unknown name
    check_operand("lhs", lhs)
    check_operand("rhs", rhs)
    (lc, rc), (lb, rb) = dimension_numbers
    lc, rc, lb, rb = map(lambda t: tuple(int(d) for d in t), (lc, rc, lb, rb))
    check_shapes(lhs.shape, rhs.shape, ((lc, rc), (lb, rb)))
    lf = _remaining(lhs.ndim, lc, lb)
    rf = _remaining(rhs.ndim, rc, rb)
    batch_shape = tuple(lhs.shape[d] for d in lb)
    lf_shape = tuple(lhs.shape[d] for d in lf)
    rf_shape = tuple(rhs.shape[d] for d in rf)
    k = math.prod(lhs.shape[d] for d in lc)
    m, n = math.prod(lf_shape), math.prod(rf_shape)
    batched = bool(lb)
    bsz = math.prod(batch_shape)

    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs.dtype, rhs.dtype))
    if 0 in (bsz, m, k, n):
        # Nothing to quantize or multiply: the plain product (zeros for K = 0, else empty) and
        # its plain gradients. An empty tensor's amax is 0, so the state stays as it is.
        dtype = jnp.result_type(lhs.dtype, rhs.dtype)
        dims = ((lc, rc), (lb, rb))
        y = lax.dot_general(lhs.astype(dtype), rhs.astype(dtype), dims)
        return y.astype(out_dtype), meta

    # Transposes are no-ops for Dense-style dims; otherwise they fuse into the quantize pass.
    x = jnp.transpose(lhs, (*lb, *lf, *lc))
    w = jnp.transpose(rhs, (*rb, *rc, *rf))
    x = x.reshape((bsz, m, k) if batched else (m, k))  # [(B,) M, K]
    w = w.reshape((bsz, k, n) if batched else (k, n))  # [(B,) K, N]
    cfg = _Cfg(jnp.dtype(x.dtype), jnp.dtype(w.dtype), out_dtype, batched, cast_kernel, prologue)
    x, w = _pad_to_tiles(x, w, batched)  # [(B,) M', K'], [(B,) K', N']
    y, new_meta = _fp8_matmul(cfg, x, w, meta)  # [(B,) M', N']
    y = y[..., :m, :n]  # [(B,) M, N]
    return y.reshape(batch_shape + lf_shape + rf_shape), new_meta


def einsum_dimension_numbers(eq: str, lhs_ndim: int, rhs_ndim: int):
    """Translate a two-operand einsum into dot_general numbers plus the output permutation."""
    eq = eq.replace(" ", "")
    if "->" not in eq or "." in eq or eq.count(",") != 1:
        raise ValueError(
            f"FP8 einsum needs an explicit two-operand equation like 'bsd,dhk->bshk', got {eq!r}"
        )
    ins, out = eq.split("->")
    a, b = ins.split(",")
    if len(a) != lhs_ndim or len(b) != rhs_ndim:
        raise ValueError(f"einsum {eq!r} does not match operand ranks {lhs_ndim} and {rhs_ndim}")
    for c in a + b + out:
        if c not in string.ascii_letters:
            raise ValueError(f"einsum {eq!r}: only letters are supported, found {c!r}")
    for term in (a, b, out):
        if len(set(term)) != len(term):
            raise ValueError(f"einsum {eq!r}: a letter repeats within {term!r} (no traces)")
    if set(out) - set(a + b):
        raise ValueError(f"einsum {eq!r}: output letters {sorted(set(out) - set(a + b))} unknown")
    batch = [c for c in a if c in b and c in out]
    contract = [c for c in a if c in b and c not in out]
    if any((c in a) + (c in b) == 1 and c not in out for c in a + b):
        raise ValueError(f"einsum {eq!r} sums over an axis of one operand; reduce it first")
    dims = (
        (tuple(a.index(c) for c in contract), tuple(b.index(c) for c in contract)),
        (tuple(a.index(c) for c in batch), tuple(b.index(c) for c in batch)),
    )
    result = batch + [c for c in a if c not in b] + [c for c in b if c not in a]
    perm = tuple(result.index(c) for c in out)
    return dims, perm


def fp8_einsum(
    eq: str,
    lhs,
    rhs,
    meta: Fp8Meta,
    preferred_element_type=None,
    cast_kernel: str = "xla",
    prologue: str | None = None,
):
    """Functional FP8 einsum (two operands): returns (result, updated meta)."""
    dims, perm = einsum_dimension_numbers(eq, lhs.ndim, rhs.ndim)
    out, new_meta = dot_general(lhs, rhs, dims, meta, preferred_element_type, cast_kernel, prologue)
    return jnp.transpose(out, perm), new_meta
