"""Grouped GEMM for expert layers: ``y[rows of group g] = x[rows of group g] . w[g]``.

x [M, K] holds the rows of every group back to back, sorted by group: group g is rows
``[sum(sizes[:g]), sum(sizes[:g + 1]))``; rows past ``sum(sizes)`` give 0 in y and get 0 in dx
(a dropless dispatch pads M to a static size), and enter no amax. w [G, K, N] stacks the
groups' weights.

With no recipe (level O0) the GEMM is ``jax.lax.ragged_dot``, accumulating in f32. With one,
the recipe runs it (``Recipe.grouped_matmul``) as one of the two custom VJPs here, which return
the ``Fp8Meta`` with this call's amaxes as ``ops.dot.dot_general`` does for a dense GEMM (x's and
w's recorded in the forward pass, dy's sent back as the meta's cotangent, all merged by max):

========  ===========================  ====================================================
GEMM      per-tensor (``tensor_*``)     tiled (``tiled_*``; T = the recipe's tile width)
========  ===========================  ====================================================
fwd       x E4M3, w E4M3 (one scale     x 1 x T along K; w T x T blocks per group (block) or
          over all G groups)            per column along K (rowwise); E4M3
dgrad     dy E5M2 (``dy_format``), w    dy 1 x T along N in ``dy_format``; w T x T (block)
          as in the forward             or per row along N (rowwise)
wgrad     x, dy as in the fwd, dgrad    x and dy T x 1 along M (the tiles cross group edges)
========  ===========================  ====================================================

Each amax is one f32 scalar, the max over all groups (and, under expert parallelism, merged
across shards by max like any other pending amax). The three GEMMs go through one function,
``fp8_grouped_gemm``: on a Hopper GPU, FP8 operands whose other dims are whole 128 tiles run
``ops.grouped_mgpu``'s Mosaic GPU kernels; elsewhere (and for the tiled recipes' dequantized
values) XLA's ``ragged_dot_general`` with f32 accumulation, the reference. Level O0's bf16
GEMM likewise runs JAX's Mosaic GPU ragged-dot kernels on a Hopper GPU. The block recipe at
128-wide tiles has its own VJP on the padded layout (``ops.grouped_block``), so that wgrad's
tiles of rows never span two groups and its GEMMs run block-scaled Hopper kernels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from fp8jax.ops import block_cast, dot, formats, gemm, grouped_mgpu, kernels, scaling
from fp8jax.ops.gemm import GemmConfig
from fp8jax.ops.grouped_mgpu import valid_rows  # re-exported: the rows a grouped GEMM reads
from fp8jax.ops.remat import FP8_OUT, FP8_W, FP8_X
from fp8jax.ops.scaling import Fp8Meta

__all__ = [
    "DGRAD",
    "FORWARD",
    "GEMMS",
    "SCOPE",
    "WGRAD",
    "check_ragged_call",
    "check_shapes",
    "decode_copy",
    "dispatch_layout",
    "fp8_grouped_gemm",
    "from_layout",
    "grouped_matmul",
    "meta_cotangent",
    "padded",
    "padded_gemm",
    "padded_kernel",
    "padded_reference",
    "padded_sizes",
    "plain_ragged_dot",
    "ragged_dot",
    "tensor_grouped_forward",
    "tensor_grouped_matmul",
    "tiled_grouped_matmul",
    "valid_rows",
]

FORWARD = "forward"  # x [M, K] . w[g] [K, N] -> [M, N], M ragged
DGRAD = "dgrad"  # dy [M, N] . w[g]^T [N, K] -> [M, K], M ragged
WGRAD = "wgrad"  # x_g^T [K, M_g] . dy_g [M_g, N] -> [G, K, N], M ragged and contracted
GEMMS = (FORWARD, DGRAD, WGRAD)
SCOPE = "grouped_gemm"  # the named scope around every grouped GEMM, O0 included

_DIMS = {  # (contracting dims, lhs ragged dims, rhs group dims) of lax.ragged_dot_general
    FORWARD: (((1,), (1,)), (0,), (0,)),
    DGRAD: (((1,), (2,)), (0,), (0,)),
    WGRAD: (((0,), (0,)), (0,), ()),
}


def plain_ragged_dot(
    x_MxK: jax.Array, w_GxKxN: jax.Array, group_sizes_G: jax.Array, out_dtype
) -> jax.Array:
    """The O0 GEMM accumulating in f32, the result in ``out_dtype``: JAX's Mosaic GPU
    ragged-dot kernels for bf16 on a Hopper GPU, ``jax.lax.ragged_dot`` elsewhere."""
    if grouped_mgpu.bf16_takes(x_MxK, w_GxKxN):
        return grouped_mgpu.bf16_grouped_matmul(x_MxK, w_GxKxN, group_sizes_G).astype(out_dtype)
    y = lax.ragged_dot(x_MxK, w_GxKxN, group_sizes_G, preferred_element_type=jnp.float32)
    return y.astype(out_dtype)


def fp8_grouped_gemm(
    kind: str, a: jax.Array, b: jax.Array, group_sizes_G: jax.Array, inv_scale, out_dtype
) -> jax.Array:
    """One grouped GEMM of an FP8 layer (``kind``: ``FORWARD``, ``DGRAD`` or ``WGRAD``) times
    ``inv_scale``, in ``out_dtype``: XLA's ``lax.ragged_dot_general``.

    The per-tensor path passes the FP8 operands themselves (E4M3, E5M2) and their inverse
    scale, the tiled path their tile-dequantized f32 values and 1. The FP8 values multiply
    exactly and accumulate in f32: the result an FP8 GEMM with f32 accumulation gives, up to
    summation order.
    """
    (contract, ragged, group) = _DIMS[kind]
    dims = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(contract, ((), ())),
        lhs_ragged_dimensions=list(ragged),
        rhs_group_dimensions=list(group),
    )
    y = lax.ragged_dot_general(a, b, group_sizes_G, dims, preferred_element_type=jnp.float32)
    return gemm.unscale(y, jnp.asarray(inv_scale, jnp.float32), out_dtype)


def padded(x_MxK: jax.Array, w_GxKxN: jax.Array) -> bool:
    """Whether a per-tensor grouped GEMM runs on ``grouped_mgpu``'s padded layout: K and N in
    whole tiles (the Hopper kernels' operands), kernels not turned off."""
    return _padded_dims(x_MxK.shape[1], w_GxKxN.shape[2])


def _padded_dims(k: int, n: int) -> bool:
    """``padded`` of a GEMM contracting ``k`` into ``n`` columns (also for w^T's copy)."""
    return grouped_mgpu.takes(k, n) and grouped_mgpu.enabled()


def padded_reference(kind: str, a, b, lay: grouped_mgpu.Layout, inv, out_dtype) -> jax.Array:
    """``padded_gemm``'s XLA version: ``fp8_grouped_gemm`` on the padded operands (the padding
    rows are 0: they add nothing)."""
    sizes_G = padded_sizes(lay)
    if kind == FORWARD:
        return fp8_grouped_gemm(kind, a, jnp.swapaxes(b, 1, 2), sizes_G, inv, out_dtype)
    if kind == WGRAD:
        return fp8_grouped_gemm(kind, a.T, b.T, sizes_G, inv, out_dtype)
    return fp8_grouped_gemm(kind, a, b, sizes_G, inv, out_dtype)


def padded_kernel(kind: str, a, b, lay: grouped_mgpu.Layout, inv, out_dtype) -> jax.Array:
    """``padded_gemm`` on the Hopper kernels (``grouped_mgpu.grouped_nt`` / ``grouped_tn``)."""
    a, b = grouped_mgpu.pair(a, b)
    if kind == WGRAD:
        return grouped_mgpu.grouped_tn(
            a, b, lay.first_tile_G, lay.tiles_G, inv, out_dtype=jnp.dtype(out_dtype)
        )
    return grouped_mgpu.grouped_nt(a, b, lay.tile_group_T, inv, out_dtype=jnp.dtype(out_dtype))


def padded_gemm(kind: str, a, b, lay: grouped_mgpu.Layout, inv_scale, out_dtype) -> jax.Array:
    """One grouped GEMM on the padded layout, times ``inv_scale``, in ``out_dtype``:

    * ``FORWARD``: a = x [R, K], b = w transposed per group [G, N, K] -> [R, N]
    * ``DGRAD``: a = dy [R, N], b = w [G, K, N] -> [R, K]
    * ``WGRAD``: a = x^T [K, R], b = dy^T [N, R] -> [G, K, N]

    Every operand has its contraction innermost (the layout FP8 WGMMA reads). The Hopper
    kernels on CUDA, ``padded_reference`` elsewhere.
    """
    inv = jnp.asarray(inv_scale, jnp.float32)
    return jax.lax.platform_dependent(
        a,
        b,
        lay,
        inv,
        cuda=functools.partial(padded_kernel, kind, out_dtype=out_dtype),
        default=functools.partial(padded_reference, kind, out_dtype=out_dtype),
    )


def check_shapes(
    x_MxK: jax.Array,
    w_GxKxN: jax.Array,
    group_sizes_G: jax.Array,
    caller: str = "fp8jax.grouped_matmul",
) -> None:
    """Reject operands that do not form one grouped GEMM, naming ``caller``, the shapes and
    the fix."""
    if x_MxK.ndim != 2 or w_GxKxN.ndim != 3 or group_sizes_G.ndim != 1:
        raise ValueError(
            f"{caller}: x {tuple(x_MxK.shape)}, w {tuple(w_GxKxN.shape)} and "
            f"group_sizes {tuple(group_sizes_G.shape)} must be [M, K], [G, K, N] and [G]: "
            f"flatten the tokens and stack the groups' weights"
        )
    if x_MxK.shape[1] != w_GxKxN.shape[1] or w_GxKxN.shape[0] != group_sizes_G.shape[0]:
        raise ValueError(
            f"{caller}: x {tuple(x_MxK.shape)}, w {tuple(w_GxKxN.shape)} and "
            f"group_sizes {tuple(group_sizes_G.shape)} disagree on K or G: pass x [M, K], "
            f"w [G, K, N] and one size per group"
        )
    if not jnp.issubdtype(group_sizes_G.dtype, jnp.integer):
        raise TypeError(
            f"{caller}: group_sizes has dtype {group_sizes_G.dtype}; pass int32 "
            f"counts (group_sizes.astype(jnp.int32))"
        )


def check_ragged_call(
    lhs_MxK: jax.Array, rhs_GxKxN: jax.Array, group_sizes_G: jax.Array, group_offset, caller: str
) -> None:
    """``check_shapes`` for a drop-in of ``jax.lax.ragged_dot``, which also refuses its
    ``group_offset`` (rows of a shard's groups within a larger stack) with the fix."""
    if group_offset is not None:
        raise ValueError(
            f"{caller}: group_offset is not supported; pass the groups this call multiplies "
            f"(rhs [G, K, N] and their group_sizes [G]) without an offset"
        )
    check_shapes(lhs_MxK, rhs_GxKxN, group_sizes_G, caller)


def meta_cotangent(meta: Fp8Meta, ct_meta: Fp8Meta, amax_g) -> Fp8Meta:
    """The state cotangent: dy's amax max-merged into what later uses sent back."""
    return gemm.dy_cotangent(meta, ct_meta, scaling.record(ct_meta.dy, amax_g).amax_history)


# Per-tensor recipes: one scale for x, one for all of w, one for dy.


def _on_layout(y_RxN: jax.Array, lay: grouped_mgpu.Layout) -> jax.Array:
    """A padded GEMM's output with its padding rows 0: the kernels leave the tiles past the
    last group unwritten (the zero rows inside a group's tiles are 0 already)."""
    return jnp.where(grouped_mgpu.layout_rows(lay)[:, None], y_RxN, jnp.zeros((), y_RxN.dtype))


def from_layout(y_RxN: jax.Array, lay: grouped_mgpu.Layout, given: bool) -> jax.Array:
    """A padded GEMM's output in its caller's rows: the layout's, 0 in its padding rows, where
    the caller ``given`` it; else the sorted rows (``unpad_rows``)."""
    return _on_layout(y_RxN, lay) if given else grouped_mgpu.unpad_rows(y_RxN, lay)


def _scales_known(meta: Fp8Meta) -> bool:
    """Whether every scale of the GEMM comes from the state's history (delayed scaling): then
    each cast records its amax in the same pass instead of reading the operand first."""
    return all(s.recipe.scales_known_ahead for s in (meta.x, meta.w, meta.dy))


def _stack_amax(cfg: GemmConfig, amax_w: jax.Array) -> jax.Array:
    """The whole stack's amax: over ``cfg.w_split_axis``'s shards where the stack is split
    (this shard holds some groups; one scale covers them all), else this one."""
    return amax_w if cfg.w_split_axis is None else lax.pmax(amax_w, cfg.w_split_axis)


def _cast_stack(w_GxKxN: jax.Array, sw: jax.Array, record: bool = True):
    """``(wq [G, K, N], wq_t [G, N, K], amax or None)``: a weight stack in E4M3 (weights need
    precision more than range) under one scale, in dgrad's layout and the forward's (K
    innermost), from one read of ``w`` (``kernels.cast_transpose`` per group); the amax over
    all groups where ``record``."""
    cast = lambda w_KxN: kernels.cast_transpose(w_KxN, sw, formats.E4M3, record=record)  # noqa: E731
    wq, wq_t, amax_G = jax.vmap(cast)(w_GxKxN)
    return wq, wq_t, (jnp.max(amax_G) if record else None)


def _tensor_fwd_impl(cfg: GemmConfig, x, w, gs, meta: Fp8Meta, given):
    # ``given``: x already in a padded layout (``dispatch_layout``), its zero rows included.
    lay = given
    if lay is None and padded(x, w):
        lay = grouped_mgpu.layout(gs, x.shape[0])
    # The rows past the groups enter no GEMM and no amax (the padded layout drops them; its
    # zero rows leave the amax as it is). On the padded layout each group is at a tile boundary.
    if lay is None:
        x = valid_rows(x, gs)
    elif given is None:
        x = grouped_mgpu.pad_rows(x, lay)
    # E4M3 for both forward operands: activations and weights need precision more than range.
    if lay is not None and _scales_known(meta):
        # Scales from the history: each operand's one pass writes both layouts and its amax.
        # x: the rows the forward GEMM reads and the transposed copy wgrad reads; w: per group
        # w [K, N] for dgrad and w^T [N, K] (K innermost) for this GEMM.
        sx, sw = meta.x.scale, meta.w.scale
        xq_pad, xq, amax_x = kernels.cast_transpose(x, sx, formats.E4M3)
        wq, wq_t, amax_w = _cast_stack(w, sw)
        amax_w = _stack_amax(cfg, amax_w)
    else:
        amax_x, amax_w = formats.amax(x), _stack_amax(cfg, formats.amax(w))
        sx, sw = scaling.use_scale(meta.x, amax_x), scaling.use_scale(meta.w, amax_w)
        if lay is not None:
            xq_pad, xq, _ = kernels.cast_transpose(x, sx, formats.E4M3, record=False)
            wq, wq_t, _ = _cast_stack(w, sw, record=False)
        else:
            xq, wq = formats.quantize(x, sx, formats.E4M3), formats.quantize(w, sw, formats.E4M3)
    if lay is not None:
        y = padded_gemm(FORWARD, xq_pad, wq_t, lay, 1.0 / (sx * sw), cfg.out_dtype)
        y = from_layout(y, lay, given is not None)
    else:
        y = fp8_grouped_gemm(FORWARD, xq, wq, gs, 1.0 / (sx * sw), cfg.out_dtype)  # [M, N]
    # Residuals named for remat policies (ops.remat): x (transposed [K, R] on the padded
    # layout), w; the GEMM read the unnamed copies, as in ops.dot (a saved residual read through
    # reduce_precision would turn |q| >= 256 into NaN).
    xq_saved, sx_saved = checkpoint_name((xq, sx), FP8_X)
    wq_saved, sw_saved = checkpoint_name((wq, sw), FP8_W)
    y = checkpoint_name(y, FP8_OUT)
    new_meta = meta.replace(x=scaling.record(meta.x, amax_x), w=scaling.record(meta.w, amax_w))
    own = None if given is not None else lay  # the layout built here (the given one is kept)
    return y, new_meta, (xq_saved, wq_saved, sx_saved, sw_saved, own, given)


def decode_copy(
    recipe: scaling.Recipe, w_GxKxN: jax.Array, state: scaling.ScaleState
) -> scaling.QuantizedWeight:
    """A weight stack's E4M3 copy for decoding (``Recipe.quantize_weight`` of w^T): [G, N, K],
    K innermost, the layout the forward GEMM reads (``padded_gemm``'s b), made once per
    generate call; one per-tensor scale, so the transposed stack takes the stack's."""
    return recipe.quantize_weight(jnp.swapaxes(w_GxKxN, 1, 2), state)


def tensor_grouped_forward(
    x_MxK, wq_GxNxK, sw, group_sizes_G, meta: Fp8Meta, out_dtype, layout=None
) -> jax.Array:
    """``tensor_grouped_matmul``'s forward output on a ``decode_copy`` (``wq`` under scale
    ``sw``): x cast as there, so the values are that forward's up to summation order; no amax
    is recorded (decoding). ``layout`` as ``grouped_matmul`` takes it; with none, rows of
    whole-tile K and N go through the padded layout too: the Hopper kernel on CUDA, where
    ``ragged_dot`` would multiply every row by every expert."""
    lay = layout
    k, n = x_MxK.shape[1], wq_GxNxK.shape[1]
    if lay is None and _padded_dims(k, n):
        lay = grouped_mgpu.layout(group_sizes_G, x_MxK.shape[0])
    if lay is None:
        x = valid_rows(x_MxK, group_sizes_G)
    else:  # padding rows 0: a given layout's by construction, the rows past the groups dropped
        x = x_MxK if layout is not None else grouped_mgpu.pad_rows(x_MxK, lay)
    sx = scaling.use_scale(meta.x, formats.amax(x))
    xq = formats.quantize(x, sx, formats.E4M3)  # E4M3, as the forward's x
    inv = 1.0 / (sx * sw)
    with jax.named_scope(SCOPE):
        if lay is None:  # x [M, K] . w^T[g]^T: dgrad's dims contract the copy's last axis
            return fp8_grouped_gemm(DGRAD, xq, wq_GxNxK, group_sizes_G, inv, out_dtype)
        y = padded_gemm(FORWARD, xq, wq_GxNxK, lay, inv, out_dtype)
    return from_layout(y, lay, layout is not None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def tensor_grouped_matmul(
    cfg: GemmConfig, x_MxK, w_GxKxN, group_sizes_G, meta: Fp8Meta, layout=None
):
    """``(y [M, N], meta with x's and w's amax)``: the grouped GEMM under per-tensor scales
    (``layout``: x's rows already padded, as ``grouped_matmul`` takes them)."""
    y, new_meta, _ = _tensor_fwd_impl(cfg, x_MxK, w_GxKxN, group_sizes_G, meta, layout)
    return y, new_meta


def _tensor_fwd(cfg: GemmConfig, x, w, gs, meta: Fp8Meta, layout):
    y, new_meta, res = _tensor_fwd_impl(cfg, x, w, gs, meta, layout)
    return (y, new_meta), (*res, gs, meta)


def _tensor_bwd(cfg: GemmConfig, res, cts):
    xq, wq, sx, sw, own, given, gs, meta = res
    lay = own if given is None else given
    g, ct_meta = cts  # g [M, N] in the output dtype
    # On the forward's layout: the padded one (x saved as x^T [K, R]) or the rows as they are.
    # A given layout's g comes padded, 0 in its padding rows (as x: they read no weight).
    if lay is None:
        g = valid_rows(g, gs)
    elif given is None:
        g = grouped_mgpu.pad_rows(g, lay)
    # dy in the recipe's dy format (E5M2 for per-tensor scales: gradients need range more than
    # mantissa). dx [M, K]: each row times its group's w^T; dw [G, K, N]: x_g^T . dy_g, 0 for
    # an empty group.
    if lay is not None and _scales_known(meta):  # one pass: both layouts and the amax
        sg = meta.dy.scale
        gq_pad, gq_t, amax_g = kernels.cast_transpose(g, sg, meta.dy.fmt)
    else:
        amax_g = formats.amax(g)
        sg = scaling.use_scale(meta.dy, amax_g)
        if lay is not None:
            gq_pad, gq_t, _ = kernels.cast_transpose(g, sg, meta.dy.fmt, record=False)
    if lay is not None:
        dx = padded_gemm(DGRAD, gq_pad, wq, lay, 1.0 / (sg * sw), cfg.x_dtype)
        dx = from_layout(dx, lay, given is not None)
        dw = padded_gemm(WGRAD, xq, gq_t, lay, 1.0 / (sx * sg), cfg.w_dtype)
    else:
        gq = formats.quantize(g, sg, meta.dy.fmt)
        dx = fp8_grouped_gemm(DGRAD, gq, wq, gs, 1.0 / (sg * sw), cfg.x_dtype)
        dw = fp8_grouped_gemm(WGRAD, xq, gq, gs, 1.0 / (sx * sg), cfg.w_dtype)
    return dx, dw, None, meta_cotangent(meta, ct_meta, amax_g), None


tensor_grouped_matmul.defvjp(_tensor_fwd, _tensor_bwd)


# Tiled recipes (rowwise, block): scales per row or tile from each call's values; the state keeps
# per-tensor amaxes for health reporting only.


def _qdq_tiles(a_MxK: jax.Array, fmt, tile: int, recipe) -> tuple[jax.Array, jax.Array]:
    """``(a quantized in 1 x tile tiles along its last axis and dequantized, f32; amax)``."""
    q, inv, amax = block_cast.quantize_tiles(a_MxK, fmt, tile, recipe)
    return block_cast.dequantize_tiles(q, inv, tile), amax


def _qdq_cols(a_MxK: jax.Array, fmt, tile: int, recipe) -> tuple[jax.Array, jax.Array]:
    """``_qdq_tiles`` of ``a.T``, transposed back: tiles of ``tile`` x 1 along the first axis."""
    a, amax = _qdq_tiles(a_MxK.T, fmt, tile, recipe)
    return a.T, amax


def _tiled_weights(w_GxKxN: jax.Array, recipe) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(w for the forward GEMM, w for dgrad, amax)``, E4M3 (weights: precision before range)
    dequantized to f32, per group.

    T x T blocks (the recipe's ``weight_tile``) serve both GEMMs; without one, the forward's
    w is scaled per column along K and dgrad's per row along N (each along its contraction).
    """
    _, k, n = w_GxKxN.shape
    t = recipe.weight_tile
    if t is not None:

        def blocks(w_KxN):
            q, inv, amax = block_cast.quantize_blocks(w_KxN, formats.E4M3, t, recipe)
            return block_cast.dequantize_blocks(q, inv, t), amax

        w, amax_G = jax.vmap(blocks)(w_GxKxN)
        return w, w, jnp.max(amax_G)
    fwd, amax_G = jax.vmap(lambda w: _qdq_cols(w, formats.E4M3, recipe.tile_width(k), recipe))(
        w_GxKxN
    )
    dgrad, _ = jax.vmap(lambda w: _qdq_tiles(w, formats.E4M3, recipe.tile_width(n), recipe))(
        w_GxKxN
    )
    return fwd, dgrad, jnp.max(amax_G)


def _tiled_fwd_impl(cfg: GemmConfig, x, w, gs, meta: Fp8Meta):
    recipe = meta.x.recipe
    x = valid_rows(x, gs)
    # E4M3 for x (activations need precision more than range; each tile's scale gives the
    # range), in 1 x T tiles along K, its contraction here.
    xd, amax_x = _qdq_tiles(x, formats.E4M3, recipe.tile_width(x.shape[1]), recipe)
    wd, _, amax_w = _tiled_weights(w, recipe)
    y = fp8_grouped_gemm(FORWARD, xd, wd, gs, 1.0, cfg.out_dtype)
    new_meta = meta.replace(x=scaling.record(meta.x, amax_x), w=scaling.record(meta.w, amax_w))
    return y, new_meta


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def tiled_grouped_matmul(cfg: GemmConfig, x_MxK, w_GxKxN, group_sizes_G, meta: Fp8Meta):
    """``(y [M, N], meta with x's and w's amax)``: the grouped GEMM under a tiled recipe.

    The reference on tile-dequantized values; the backward quantizes x and w again from the
    kept inputs (the same scales: each tile's come from its own values).
    """
    return _tiled_fwd_impl(cfg, x_MxK, w_GxKxN, group_sizes_G, meta)


def _tiled_fwd(cfg: GemmConfig, x, w, gs, meta: Fp8Meta):
    return _tiled_fwd_impl(cfg, x, w, gs, meta), (x, w, gs, meta)


def _tiled_bwd(cfg: GemmConfig, res, cts):
    x, w, gs, meta = res
    g, ct_meta = cts  # g [M, N] in the output dtype
    recipe = meta.x.recipe
    x, g = valid_rows(x, gs), valid_rows(g, gs)
    m, n = g.shape
    fmt = meta.dy.fmt  # the recipe's dy format (E4M3 by default: its scales follow each tile)
    _, wd, _ = _tiled_weights(w, recipe)
    gd, amax_g = _qdq_tiles(g, fmt, recipe.tile_width(n), recipe)  # 1 x T along N, for dgrad
    dx = fp8_grouped_gemm(DGRAD, gd, wd, gs, 1.0, cfg.x_dtype)
    # wgrad contracts M: x (E4M3) and dy (dy_format) in T x 1 tiles along M, across the
    # groups' edges (a kernel that scales each group's rows apart needs groups padded to T).
    xd_t, _ = _qdq_cols(x, formats.E4M3, recipe.tile_width(m), recipe)
    gd_t, _ = _qdq_cols(g, fmt, recipe.tile_width(m), recipe)
    dw = fp8_grouped_gemm(WGRAD, xd_t, gd_t, gs, 1.0, cfg.w_dtype)
    return dx, dw, None, meta_cotangent(meta, ct_meta, amax_g)


tiled_grouped_matmul.defvjp(_tiled_fwd, _tiled_bwd)


def grouped_matmul(
    x_MxK: jax.Array,
    w_GxKxN: jax.Array,
    group_sizes_G: jax.Array,
    recipe: scaling.Recipe | None,
    meta: Fp8Meta | None,
    *,
    out_dtype=None,
    w_split_axis: str | None = None,
    layout: grouped_mgpu.Layout | None = None,
) -> tuple[jax.Array, Fp8Meta | None]:
    """``(y [M, N], meta with this call's amaxes)``: each group's rows times its weight.

    ``recipe`` None is level O0 (``plain_ragged_dot``, ``meta`` returned as given); otherwise the
    recipe's FP8 grouped GEMM under ``meta`` (``Recipe.grouped_matmul``). ``out_dtype``
    defaults to the operands' common dtype. ``w_split_axis``: the mesh axis (bound here) whose
    shards hold the other groups of the stack ``w`` is part of (``GemmConfig.w_split_axis``).
    ``layout`` (``dispatch_layout``'s): x's rows are already that padded layout's, 0 in its
    padding rows, and ``group_sizes`` its padded sizes (``padded_sizes``); y (and dx) stay in
    it. Any GEMM reads such rows as groups of those sizes; the padded kernels without a copy.
    """
    check_shapes(x_MxK, w_GxKxN, group_sizes_G)
    if layout is not None and x_MxK.shape[0] != layout.rows:
        raise ValueError(
            f"fp8jax.grouped_matmul: x has {x_MxK.shape[0]} rows but its layout {layout.rows}: "
            f"pass the rows the layout places (dispatch_layout), sized by padded_sizes"
        )
    out_dtype = jnp.dtype(out_dtype or jnp.result_type(x_MxK.dtype, w_GxKxN.dtype))
    group_sizes_G = group_sizes_G.astype(jnp.int32)
    m, k = x_MxK.shape
    # The scopes name the grouped GEMM and its recipe in the program (diagnostics.coverage).
    with jax.named_scope(SCOPE):
        if recipe is None or 0 in (m, k, *w_GxKxN.shape):
            # O0; or nothing to quantize (an empty tensor's amax is 0: the state stays as it is).
            return plain_ragged_dot(x_MxK, w_GxKxN, group_sizes_G, out_dtype), meta
        dot.check_operand("x", x_MxK)
        dot.check_operand("w", w_GxKxN)
        with jax.named_scope(f"fp8_{recipe.name}"):
            return recipe.grouped_matmul(
                x_MxK, w_GxKxN, group_sizes_G, meta, out_dtype, w_split_axis, layout
            )


def ragged_dot(
    lhs_MxK: jax.Array,
    rhs_GxKxN: jax.Array,
    group_sizes_G: jax.Array,
    meta: Fp8Meta,
    preferred_element_type=None,
) -> tuple[jax.Array, Fp8Meta]:
    """FP8 ``lax.ragged_dot``: returns the result and the meta with this call's amax recorded.

    lhs [M, K] holds the groups' rows back to back, sorted by group (``group_sizes`` [G] rows
    each; rows past their sum give 0), rhs [G, K, N] the groups' weights. The GEMMs run as
    ``meta``'s recipe says (``meta.x.recipe``; E4M3 x and w, dy in the recipe's ``dy_format``
    in the backward pass), and dy's amax comes back as ``meta``'s cotangent, as
    ``fp8jax.dot_general``'s does: fold it in with ``fp8jax.update_state``.
    """
    check_shapes(lhs_MxK, rhs_GxKxN, group_sizes_G, "fp8jax.ragged_dot")
    return grouped_matmul(
        lhs_MxK,
        rhs_GxKxN,
        group_sizes_G,
        meta.x.recipe,
        meta,
        out_dtype=preferred_element_type,
    )


def dispatch_layout(
    recipe: scaling.Recipe | None, group_sizes_G: jax.Array, m: int, *dims_KxN: tuple[int, int]
) -> grouped_mgpu.Layout | None:
    """The padded layout (``grouped_mgpu.Layout``) that ``recipe``'s grouped GEMMs of the
    given (K, N) read for ``m`` rows sorted into groups of ``group_sizes_G``, for a dispatch to
    write its rows into directly; None where they read the sorted rows as they are (level O0,
    a recipe that does not pad, dims that are not whole tiles)."""
    if recipe is None or not recipe.pads_grouped_rows or not grouped_mgpu.enabled():
        return None
    if not all(grouped_mgpu.takes(k, n) for k, n in dims_KxN):
        return None
    return grouped_mgpu.layout(group_sizes_G, m)


def padded_sizes(layout: grouped_mgpu.Layout) -> jax.Array:
    """The group sizes of a padded layout's rows: whole tiles per group (int32 [G])."""
    return layout.tiles_G * grouped_mgpu.TILE
