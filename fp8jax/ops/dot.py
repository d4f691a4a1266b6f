"""A functional FP8 ``dot_general`` with a custom VJP.

Forward  y  = x(E4M3) . w(E4M3)
dgrad    dx = dy(E5M2) . w(E4M3)
wgrad    dw = x(E4M3) . dy(E5M2)       (cuBLASLt has no E5M2 x E5M2 GEMM)

FP8 arrays go straight into ``lax.dot_general`` with ``preferred_element_type``: that is the
form XLA lowers to ``__cublas$lt$matmul$f8`` on Hopper regardless of flags. The residuals kept
for the backward pass are the FP8 copies of x and w, not their bf16/f32 originals; the forward
rule names them (and the output) for remat policies (``ops.remat``).

Scale state travels as an ``Fp8Meta`` (x, w, dy ``ScaleState``s). The call returns an updated
meta whose x and w pending amax include this call; the dy amax is only known in the backward
pass, so it comes back as the cotangent of the meta *input*, max-merged with the cotangent of
the meta *output*. When callers thread the returned meta into the next use of the same state
(which the Flax modules do), repeated uses form a chain and the amax combines by max.

With a ``prologue`` (an elementwise activation, ``activations.ACTIVATIONS``) the matmul computes
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
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from fp8jax.ops import activations, formats, gemm, kernels, scaling
from fp8jax.ops.gemm import GemmConfig
from fp8jax.ops.remat import FP8_OUT, FP8_W, FP8_X
from fp8jax.ops.scaling import Fp8Meta, QuantizedWeight

__all__ = [
    "PAD",
    "check_operand",
    "check_shapes",
    "dot_general",
    "einsum_dimension_numbers",
    "fp8_einsum",
    "plain_dot_general",
    "plain_einsum",
    "tensor_forward",
    "tensor_matmul",
]

DimensionNumbers = tuple[tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], ...]]


def check_operand(name: str, x: jax.Array) -> None:
    """Reject operands the FP8 path cannot take, naming the fix."""
    dtype = jnp.dtype(x.dtype)
    if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        raise TypeError(
            f"fp8jax.dot_general: {name} has dtype {dtype}; FP8 matmuls take float32, bfloat16 "
            f"or float16 inputs (cast with x.astype(jnp.bfloat16))"
        )


def _meta_cotangent(meta: Fp8Meta, ct_meta: Fp8Meta, amax_g) -> Fp8Meta:
    """The state cotangent with dy's amax max-merged into what later uses sent back."""
    return gemm.dy_cotangent(meta, ct_meta, scaling.record(ct_meta.dy, amax_g).amax_history)


def _fwd_impl(cfg: GemmConfig, x, w, meta: Fp8Meta):
    if gemm.uses_fused_cast(cfg, meta):
        return gemm.fwd_fused(cfg, x, w, meta)
    x_pre = x if cfg.prologue else None
    if cfg.prologue:
        x = activations.activation(cfg.prologue)(x.astype(jnp.float32))  # f32, as the kernel's
    amax_x, amax_w = formats.amax(x), formats.amax(w)
    sx, sw = scaling.use_scale(meta.x, amax_x), scaling.use_scale(meta.w, amax_w)
    # E4M3 for both forward operands: activations and weights need precision more than range.
    xq = formats.quantize(x, sx, formats.E4M3)
    wq = formats.quantize(w, sw, formats.E4M3)
    # The residuals, named for remat policies (ops.remat), with their scales. The forward GEMM
    # reads the unnamed copies: jax.checkpoint passes a saved residual that its forward also
    # reads through reduce_precision at the residual's own format, and XLA's reduce_precision
    # takes E4M3's top binade for Inf, so every |q| >= 256 would come back NaN.
    xq_saved, sx_saved = checkpoint_name((xq, sx), FP8_X)
    wq_saved, sw_saved = checkpoint_name((wq, sw), FP8_W)
    m_axis = 1 if cfg.batched else 0
    # Current scaling of dy: its scale comes from the backward's own amax, so no f32[3] here.
    current_dy = not meta.dy.recipe.scales_known_ahead
    inv = None if current_dy else gemm.inverse_scales(sx, sw, meta.dy.scale)
    y = gemm.mm(xq, wq, m_axis + 1, m_axis, cfg.batched, gemm.acc_dtype(cfg.out_dtype))
    y = gemm.unscale(y, 1.0 / (sx * sw) if inv is None else inv[0], cfg.out_dtype)
    y = checkpoint_name(y, FP8_OUT)
    new_meta = meta.replace(x=scaling.record(meta.x, amax_x), w=scaling.record(meta.w, amax_w))
    return y, new_meta, (xq_saved, wq_saved, sx_saved, sw_saved, inv, x_pre)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def tensor_matmul(cfg: GemmConfig, x, w, meta: Fp8Meta) -> tuple[jax.Array, Fp8Meta]:
    """``(x . w [(B,) M, N], meta with x's and w's amax recorded)`` under per-tensor scales."""
    y, new_meta, _ = _fwd_impl(cfg, x, w, meta)
    return y, new_meta


def _fp8_matmul_fwd(cfg: GemmConfig, x, w, meta: Fp8Meta):
    y, new_meta, res = _fwd_impl(cfg, x, w, meta)
    return (y, new_meta), (*res, meta)


def _fp8_matmul_bwd(cfg: GemmConfig, res, cts):
    g, ct_meta = cts  # g: [(B,) M, N] in the output dtype
    meta = res[-1]
    if gemm.uses_fused_cast(cfg, meta):
        return gemm.bwd_fused(cfg, res[:-1], g, meta, ct_meta)
    xq, wq, sx, sw, inv, x_pre, meta = res
    amax_g = formats.amax(g)
    sg = scaling.use_scale(meta.dy, amax_g)
    # E5M2 for gradients: they span many decades and need range more than mantissa.
    gq = formats.quantize(g, sg, formats.E5M2)
    b = 1 if cfg.batched else 0
    # dgrad: contract N (g axis b+1, w axis b+1) -> [(B,) M, K]
    dx = gemm.mm(gq, wq, b + 1, b + 1, cfg.batched, gemm.acc_dtype(cfg.x_dtype))
    if inv is None:
        inv = gemm.inverse_scales(sx, sw, sg)
    dx = gemm.dgrad_out(cfg, dx, inv[1], x_pre)
    # wgrad: contract M (x axis b, g axis b) -> [(B,) K, N]
    dw = gemm.mm(xq, gq, b, b, cfg.batched, gemm.acc_dtype(gemm.wgrad_dtype(cfg)))
    dw = gemm.unscale(dw, inv[2], cfg.w_dtype)
    return dx, dw, _meta_cotangent(meta, ct_meta, amax_g)


tensor_matmul.defvjp(_fp8_matmul_fwd, _fp8_matmul_bwd)


def tensor_forward(cfg: GemmConfig, x, wq, sw, meta: Fp8Meta) -> jax.Array:
    """``tensor_matmul``'s forward output on a weight already in E4M3 (``wq`` under scale
    ``sw``): x is cast as there (prologue, scale, E4M3) and the output unscaled by the same f32
    operations, so the values are ``tensor_matmul``'s; no amax is recorded (decoding)."""
    if cfg.prologue:
        x = activations.activation(cfg.prologue)(x.astype(jnp.float32))
    sx = scaling.use_scale(meta.x, formats.amax(x))
    xq = formats.quantize(x, sx, formats.E4M3)  # E4M3, as the forward's x
    inv = (
        None
        if not meta.dy.recipe.scales_known_ahead
        else gemm.inverse_scales(sx, sw, meta.dy.scale)
    )
    m_axis = 1 if cfg.batched else 0
    y = gemm.mm(xq, wq, m_axis + 1, m_axis, cfg.batched, gemm.acc_dtype(cfg.out_dtype))
    return gemm.unscale(y, 1.0 / (sx * sw) if inv is None else inv[0], cfg.out_dtype)


def _remaining(ndim: int, *used) -> list[int]:
    taken = {d for group in used for d in group}
    return [d for d in range(ndim) if d not in taken]


PAD = 16  # cuBLASLt FP8 GEMMs need M, K, N in multiples of 16


def _pad_to_tiles(x, w, batched: bool):
    """Zero-pad M, K, N to multiples of ``PAD`` (a no-op for aligned shapes).

    XLA:GPU pads unaligned FP8 GEMM operands itself, but can keep the unpadded strides (and
    leave a saved FP8 residual unpadded), so the GEMM reads out of bounds: inf/NaN for shapes
    like [4, 6] x [6, 8]. Padding the high-precision operands here keeps XLA off that path.
    Zeros change neither the product nor any amax, and autodiff slices the padding back off
    the gradients.
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
    cast_kernel: str = kernels.AUTO,
    prologue: str | None = None,
    rebuild: bool | str = False,
    weight_cache: Callable[[Callable[[], QuantizedWeight]], QuantizedWeight] | None = None,
) -> tuple[jax.Array, Fp8Meta]:
    """FP8 ``lax.dot_general``: returns the result and the meta with this call's amax recorded.

    Any dimension numbers are reduced to one (optionally batched) GEMM by transposing and
    reshaping the high-precision operands before quantization, so XLA sees the single
    contracting / single free axis layout cuBLASLt's FP8 GEMM needs. ``cast_kernel``
    ('auto', 'xla', 'pallas', 'interpret'; see fp8jax.ops.kernels) picks how operands are
    quantized; 'auto' (``kernels.resolve_impl``) is the fused kernel on GPUs, XLA ops elsewhere.
    ``prologue`` (a name in ``activations.ACTIVATIONS``, e.g. 'gelu_tanh') multiplies ``act(lhs)``
    instead of ``lhs``, with the activation fused into lhs' quantization. ``rebuild``
    (``gemm.GemmConfig``'s; True: 'xw'): the operands the backward pass casts again rather than
    keep as FP8 copies (the fused-cast path; for remat policies that keep no FP8 copy of them).
    ``weight_cache`` (decoding, where the weight's recipe ``quantizes_weights_once``): called
    with a function that quantizes the GEMM's weight operand (``Recipe.quantize_weight``), it
    returns that copy, made now or kept from an earlier call; the forward GEMM reads it
    (``Recipe.prequantized_matmul``) and the meta comes back unchanged.
    """
    cast_kernel = kernels.resolve_impl(cast_kernel)
    activations.activation(prologue)  # a clear error for an unknown name
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
        return _plain_product(lhs, rhs, ((lc, rc), (lb, rb)), out_dtype), meta

    # Transposes are no-ops for Dense-style dims; otherwise they fuse into the quantize pass.
    x = jnp.transpose(lhs, (*lb, *lf, *lc))
    w = jnp.transpose(rhs, (*rb, *rc, *rf))
    x = x.reshape((bsz, m, k) if batched else (m, k))  # [(B,) M, K]
    w = w.reshape((bsz, k, n) if batched else (k, n))  # [(B,) K, N]
    cfg = GemmConfig(
        jnp.dtype(x.dtype),
        jnp.dtype(w.dtype),
        out_dtype,
        batched,
        cast_kernel,
        prologue,
        gemm.rebuilt_operands(rebuild),
    )
    x, w = _pad_to_tiles(x, w, batched)  # [(B,) M', K'], [(B,) K', N']
    # The scope names the recipe in the program (fp8jax.diagnostics.coverage reads it).
    with jax.named_scope(f"fp8_{meta.x.recipe.name}"):
        if weight_cache is not None and meta.w.recipe.quantizes_weights_once:
            wq = weight_cache(lambda: meta.w.recipe.quantize_weight(w, meta.w))
            y, new_meta = meta.x.recipe.prequantized_matmul(cfg, x, wq, meta), meta
        else:
            y, new_meta = meta.x.recipe.matmul(cfg, x, w, meta)  # [(B,) M', N']
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


def _plain_product(lhs, rhs, dims, out_dtype) -> jax.Array:
    """``lax.dot_general`` in the operands' common dtype, cast to ``out_dtype``."""
    dtype = jnp.result_type(lhs.dtype, rhs.dtype)
    return lax.dot_general(lhs.astype(dtype), rhs.astype(dtype), dims).astype(out_dtype)


def plain_dot_general(
    lhs: jax.Array, rhs: jax.Array, dimension_numbers: DimensionNumbers, preferred_element_type=None
) -> jax.Array:
    """``dot_general``'s result in shape and dtype (after its operand and shape checks), from
    the plain product: what a model's initialisation reads of an FP8 matmul, without tracing
    the quantization and the custom VJP."""
    check_operand("lhs", lhs)
    check_operand("rhs", rhs)
    (lc, rc), (lb, rb) = dimension_numbers
    dims = tuple(tuple(tuple(int(d) for d in t) for t in pair) for pair in ((lc, rc), (lb, rb)))
    check_shapes(lhs.shape, rhs.shape, dims)
    out_dtype = jnp.dtype(preferred_element_type or jnp.result_type(lhs.dtype, rhs.dtype))
    return _plain_product(lhs, rhs, dims, out_dtype)


def plain_einsum(eq: str, lhs, rhs, preferred_element_type=None) -> jax.Array:
    """``fp8_einsum``'s result in shape and dtype from the plain product (``plain_dot_general``)."""
    dims, perm = einsum_dimension_numbers(eq, lhs.ndim, rhs.ndim)
    return jnp.transpose(plain_dot_general(lhs, rhs, dims, preferred_element_type), perm)


def fp8_einsum(
    eq: str,
    lhs,
    rhs,
    meta: Fp8Meta,
    preferred_element_type=None,
    cast_kernel: str = kernels.AUTO,
    prologue: str | None = None,
    rebuild: bool | str = False,
):
    """Functional FP8 einsum (two operands): returns (result, updated meta)."""
    dims, perm = einsum_dimension_numbers(eq, lhs.ndim, rhs.ndim)
    out, new_meta = dot_general(
        lhs, rhs, dims, meta, preferred_element_type, cast_kernel, prologue, rebuild
    )
    return jnp.transpose(out, perm), new_meta
