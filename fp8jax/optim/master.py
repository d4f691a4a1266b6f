"""Scaled low-precision tensors: FP16 master weights and the storage of FP8/FP16 Adam moments.

A ``ScaledTensor(data, scale)`` stores ``x`` as ``data = saturate(x * scale)`` in a narrow dtype
(``x ~= data / scale``), with one f32 scale per tensor. The same type holds the master weights
(``to_master``) and the optimizer moments (``optim.adam``), so orbax and ``jax.tree`` see plain
arrays.

Scale rule (``scale_for``), recomputed from the new amax every time a tensor is written:

* E4M3 / E5M2: ``scale = fmax / amax`` (448 or 57344): the largest value lands on the format max.
* float16: ``scale = 2**floor(log2(65504 / amax))``: amax lands in ``(32752, 65504]``. Adam's
  second moment is tiny (grad**2, often 1e-12 or less) and would flush to zero in unscaled FP16,
  whose smallest normal is 6.1e-5; mapping amax to the top keeps the widest range below it. The
  power of two makes the scaling itself exact, so only FP16 rounding remains.
* bfloat16 / float32: ``scale = 1``: their exponent range is float32's, so scaling buys nothing.

In every case an amax that is 0, Inf or NaN (or a scale that would overflow) keeps the previous
scale, so an all-zero or broken tensor never poisons the scale.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import struct, traverse_util

from fp8jax._tree import leaf_name, path_key
from fp8jax.ops import formats

__all__ = [
    "F32_LAYERS",
    "STORAGE_FORMATS",
    "ScaledTensor",
    "apply_updates",
    "carry_masters",
    "dequantize_carried",
    "dequantize_carrier",
    "encode",
    "encode_like",
    "floor_log2",
    "fp8_op_name",
    "fresh_scales",
    "hash_bits",
    "is_matmul_weight",
    "is_scaled",
    "joint_amaxes",
    "leaf_salt",
    "materialize",
    "pow2",
    "quantize_scaled",
    "rebuild",
    "resolve_mask",
    "scale_for",
    "scaled_amaxes",
    "storage_dtype",
    "to_master",
    "updated_value",
    "write",
]

# Accepted spellings of the storage formats (lower-cased before lookup).
STORAGE_FORMATS = {
    "e4m3": jnp.float8_e4m3fn,
    "float8_e4m3fn": jnp.float8_e4m3fn,
    "e5m2": jnp.float8_e5m2,
    "float8_e5m2": jnp.float8_e5m2,
    "float16": jnp.float16,
    "fp16": jnp.float16,
    "bfloat16": jnp.bfloat16,
    "bf16": jnp.bfloat16,
    "float32": jnp.float32,
    "fp32": jnp.float32,
}
_FP8 = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def storage_dtype(fmt) -> jnp.dtype:
    """The dtype for a format name ('e4m3', 'e5m2', 'float16', 'bfloat16', 'float32') or dtype."""
    if isinstance(fmt, str):
        key = fmt.lower()
        if key not in STORAGE_FORMATS:
            raise ValueError(
                f"unknown storage format {fmt!r}: use one of "
                "'e4m3', 'e5m2', 'float16', 'bfloat16', 'float32'"
            )
        return jnp.dtype(STORAGE_FORMATS[key])
    dtype = jnp.dtype(fmt)
    if dtype not in {jnp.dtype(d) for d in STORAGE_FORMATS.values()}:
        raise ValueError(f"unsupported storage dtype {dtype}")
    return dtype


@struct.dataclass
class ScaledTensor:
    """``x`` stored as ``data = saturate(x * scale)`` in a narrow dtype; ``x ~= data / scale``."""

    data: jax.Array  # [...] e4m3 / e5m2 / f16 / bf16 / f32 storage
    scale: jax.Array  # [] f32 per-tensor scale

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of the represented tensor."""
        return tuple(self.data.shape)

    @property
    def ndim(self) -> int:
        """Rank of the represented tensor."""
        return len(self.data.shape)

    @property
    def size(self) -> int:
        """Number of elements of the represented tensor."""
        n = 1
        for d in self.data.shape:
            n *= int(d)
        return n

    @property
    def dtype(self) -> jnp.dtype:
        """Storage dtype of ``data``."""
        return jnp.dtype(self.data.dtype)

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """``data / scale`` in ``dtype`` (computed in f32)."""
        return (self.data.astype(jnp.float32) / self.scale).astype(dtype)


def is_scaled(x) -> bool:
    """True for a ``ScaledTensor`` (use as ``is_leaf`` when mapping over trees that hold them)."""
    return isinstance(x, ScaledTensor)


def pow2(n: jax.Array) -> jax.Array:
    """Exact ``2.0**n`` in f32 for integer ``n`` (Inf above 127), built from the exponent bits.

    ``jnp.exp2``/``jnp.ldexp`` go through a float ``pow`` that is not exact on every backend.
    """
    biased = jnp.clip(jnp.asarray(n, jnp.int32) + 127, 1, 255)  # 255: the Inf bit pattern
    return jax.lax.bitcast_convert_type(biased << 23, jnp.float32)


def floor_log2(x: jax.Array) -> jax.Array:
    """Exact ``floor(log2(|x|))`` as int32 for finite nonzero ``x`` (read off ``frexp``)."""
    _, e = jnp.frexp(x)  # |x| = f * 2**e with f in [0.5, 1)
    return e - 1


def scale_for(amax: jax.Array, prev_scale: jax.Array, dtype) -> jax.Array:
    """Per-tensor scale for storing a tensor of this ``amax`` in ``dtype`` (module docstring)."""
    dtype = storage_dtype(dtype)
    amax = jnp.asarray(amax, jnp.float32)
    if dtype in _FP8:
        ratio = formats.fmax(dtype) / amax
        scale = ratio
    elif dtype == jnp.dtype(jnp.float16):
        ratio = float(jnp.finfo(jnp.float16).max) / amax
        scale = pow2(floor_log2(ratio))
    else:
        return jnp.ones_like(jnp.asarray(prev_scale, jnp.float32))
    # A denormal amax may be flushed to 0 inside the division (GPUs do), giving ratio = Inf.
    ok = jnp.isfinite(amax) & (amax > 0) & jnp.isfinite(ratio) & jnp.isfinite(scale) & (scale > 0)
    return jnp.where(ok, scale, prev_scale).astype(jnp.float32)


def hash_bits(shape, seed, offset=0) -> jax.Array:
    """Random-looking uint32 per element from a hash of (element index, ``seed``).

    A counter-based hash (murmur3's finalizer) rather than ``jax.random``: it needs no key in the
    optimizer state and costs a few integer ops per element inside the fused update. ``offset``
    (uint32, wrapping) is added to every row-major index: a slice starting at flat element
    ``offset`` of a larger tensor gets that tensor's noise.
    """
    shape = tuple(shape)
    idx = jnp.zeros(shape, jnp.uint32) + jnp.asarray(offset).astype(jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):
        idx = idx + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride)
        stride *= int(shape[axis])
    h = idx * jnp.uint32(0x9E3779B1) + jnp.asarray(seed).astype(jnp.uint32)
    h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _round_stochastic(y: jax.Array, dtype, noise: jax.Array) -> jax.Array:
    """Round f32 ``y`` to ``dtype``'s mantissa width, up with probability equal to the remainder.

    Unbiased: a moment whose per-step change is below half a grid step still moves in expectation
    (with round-to-nearest, E4M3's 6-12% spacing freezes m once ``(1-b1)|g-m|`` drops under it).
    Adding random bits below the kept mantissa bits and truncating does this in integer ops; a
    carry rolls into the exponent, as rounding up should. Values in ``dtype``'s subnormal range
    keep f32-normal mantissa width here and are rounded to nearest by the cast that follows.
    """
    drop = 23 - int(jnp.finfo(dtype).nmant)  # f32 mantissa bits below the target's
    bits = jax.lax.bitcast_convert_type(y, jnp.uint32)
    bits = (bits + (noise >> (32 - drop))) & jnp.uint32((0xFFFFFFFF << drop) & 0xFFFFFFFF)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def encode(x: jax.Array, scale: jax.Array, dtype, noise: jax.Array | None = None) -> jax.Array:
    """``saturate(x * scale)`` cast to ``dtype``; clipping first so nothing becomes Inf/NaN.

    With ``noise`` (random uint32 shaped like ``x``, e.g. ``hash_bits``) the cast rounds
    stochastically.
    """
    dtype = storage_dtype(dtype)
    x = x.astype(jnp.float32)
    if dtype == jnp.dtype(jnp.float32):
        return x * scale.astype(jnp.float32)
    limit = float(jnp.finfo(dtype).max)
    y = jnp.clip(x * scale.astype(jnp.float32), -limit, limit)
    if noise is not None:
        y = jnp.clip(_round_stochastic(y, dtype, noise), -limit, limit)
    # Narrow cast (E4M3/E5M2 for m, FP16 for v and master weights, BF16 if asked): clipped
    # first, since out-of-range values would become NaN (E4M3) or Inf (E5M2, FP16).
    return y.astype(dtype)


def quantize_scaled(x, prev_scale, dtype, noise=None, amax=None) -> ScaledTensor:
    """Store ``x`` in ``dtype`` with a fresh scale from its amax (``prev_scale`` if unusable).

    ``amax`` may be passed when the caller already reduced it.
    """
    amax = formats.amax(x) if amax is None else amax
    scale = scale_for(amax, prev_scale, dtype)
    return ScaledTensor(encode(x, scale, dtype, noise), scale)


def joint_amaxes(*xs: jax.Array) -> tuple[jax.Array, ...]:
    """``formats.amax`` of each of ``xs`` (one shape) from one reduction: one read of the inputs.

    Separate reductions of m and v each re-read the gradient and their moment, and XLA does not
    merge them.
    """
    abs_xs = [jnp.abs(x).astype(jnp.float32) for x in xs]
    zeros = [jnp.zeros((), jnp.float32)] * len(xs)

    def pairwise_max(a, b):
        return tuple(jnp.maximum(u, v) for u, v in zip(a, b, strict=True))

    return tuple(jax.lax.reduce(abs_xs, zeros, pairwise_max, tuple(range(xs[0].ndim))))


def scaled_amaxes(values, stores) -> tuple[jax.Array, ...]:
    """Amaxes of the ``values`` whose store is a ``ScaledTensor`` (one reduction), in order."""
    scaled = [x for x, st in zip(values, stores, strict=True) if is_scaled(st)]
    return joint_amaxes(*scaled) if scaled else ()


def fresh_scales(amaxes, stores) -> list:
    """New scales of the ``ScaledTensor`` stores from ``amaxes`` (in order), None for plain ones."""
    it = iter(amaxes)
    return [scale_for(next(it), st.scale, st.dtype) if is_scaled(st) else None for st in stores]


def encode_like(values, stores, scales, seeds, ok=None, offset=0) -> list:
    """Each f32 value in its store's form: a ``ScaledTensor``'s data (``encode`` with its new
    scale, rounding stochastically where the store is narrow and its seed is not None), or the
    value itself for a plain store. Where ``ok`` is False the old data; ``offset``: the flat
    index of the values' first element in the stored tensor (a slice of it gets its noise)."""
    out = []
    for x, st, scale, seed in zip(values, stores, scales, seeds, strict=True):
        if is_scaled(st):
            narrow = st.data.dtype != jnp.dtype(jnp.float32)
            noise = hash_bits(x.shape, seed, offset) if seed is not None and narrow else None
            new = encode(x, scale, st.dtype, noise)
            out.append(new if ok is None else jnp.where(ok, new, st.data))
        else:
            out.append(x if ok is None else jnp.where(ok, x, st))
    return out


def rebuild(datas, stores, scales, ok=None) -> list:
    """New stores from ``encode_like``'s data and ``fresh_scales``' scales (old where not ok)."""
    return [
        ScaledTensor(d, sc if ok is None else jnp.where(ok, sc, st.scale)) if is_scaled(st) else d
        for d, st, sc in zip(datas, stores, scales, strict=True)
    ]


def write(values, stores, seeds, ok=None) -> list:
    """Whole f32 ``values`` stored like ``stores``: each ``ScaledTensor`` with a fresh scale from
    its value's amax and the narrow cast, stochastic where its seed is not None; plain stores
    take the values. Where ``ok`` is False every store keeps its old bits."""
    scales = fresh_scales(scaled_amaxes(values, stores), stores)
    return rebuild(encode_like(values, stores, scales, seeds, ok), stores, scales, ok)


# Layers whose kernels stay plain f32 params at every level (no FP16 master, no FP8 moments):
# an MoE block's router and its shared expert's gate, whose f32 scores pick the experts.
F32_LAYERS = ("router", "shared_gate")


def is_matmul_weight(path, leaf) -> bool:
    """Default selection: leaves named 'kernel' of rank >= 2 (not embeddings, norms, biases),
    but not those of ``F32_LAYERS``; stacked expert kernels ([E, ...]) count."""
    if leaf_name(path) != "kernel" or getattr(leaf, "ndim", 0) < 2:
        return False
    return not set(path_key(path)) & set(F32_LAYERS)


def resolve_mask(params, mask=None, cover_all: bool = False):
    """A tree of bools like ``params``: ``mask`` may be None (matmul weights), a bool, a callable
    ``params -> tree`` or a tree; ``cover_all`` selects every leaf."""
    if cover_all or mask is True or mask is False:
        value = bool(cover_all or mask)
        return jax.tree.map(lambda _: value, params, is_leaf=is_scaled)
    if mask is None:
        return jax.tree_util.tree_map_with_path(is_matmul_weight, params, is_leaf=is_scaled)
    return mask(params) if callable(mask) else mask


def to_master(params, master_format="float16", mask=None, cover_all: bool = False):
    """Params with the selected leaves (default: matmul weights) as ``ScaledTensor`` masters.

    ``master_format`` None or 'float32' returns ``params`` unchanged (f32 is already the master).
    """
    if master_format is None or storage_dtype(master_format) == jnp.dtype(jnp.float32):
        return params
    dtype = storage_dtype(master_format)
    mask_tree = resolve_mask(params, mask, cover_all)

    def convert(p, selected):
        if not selected or is_scaled(p):
            return p
        return quantize_scaled(p, jnp.ones((), jnp.float32), dtype)

    return jax.tree.map(convert, params, mask_tree, is_leaf=is_scaled)


def materialize(params, dtype=jnp.float32):
    """Dequantize every ``ScaledTensor`` leaf to ``dtype``; plain arrays pass through unchanged."""
    return jax.tree.map(
        lambda p: p.dequantize(dtype) if is_scaled(p) else p, params, is_leaf=is_scaled
    )


def updated_value(p, u) -> jax.Array:
    """``p + u``: a ``ScaledTensor`` in f32 (before re-quantization), non-finite sums kept at the
    old value; a plain leaf as ``optax.apply_updates`` (in its own dtype)."""
    if not is_scaled(p):
        return jnp.asarray(p + u).astype(jnp.asarray(p).dtype)
    old = p.dequantize()
    new = old + u.astype(jnp.float32)  # the update is applied in f32
    return jnp.where(jnp.isfinite(new), new, old)


def leaf_salt(base: jax.Array, index: int) -> jax.Array:
    """Rounding seed of leaf ``index`` from the step's uint32 ``base`` (distinct per leaf)."""
    return base * jnp.uint32(0x9E3779B1) + jnp.uint32((index * 0x632BE5AB) & 0xFFFFFFFF)


def apply_updates(params, updates, seed=None) -> Any:
    """``params + updates``; ``ScaledTensor`` leaves add in f32 and re-quantize with a fresh scale.

    An element whose new value is not finite keeps its old value, so one bad update cannot turn a
    master weight into NaN. Plain leaves behave as in ``optax.apply_updates``. ``seed`` (an int
    or uint32 array, e.g. from the step count) rounds the narrow masters stochastically.
    """

    def add(p, u, salt):
        if u is None:
            return p
        if not is_scaled(p):
            return updated_value(p, u)
        # An update below half a storage step (FP16: 2**-11 of the weight; small warm-up
        # learning rates) is lost to round-to-nearest; rounding stochastically keeps it in
        # expectation, as FP32 masters would.
        (new,) = write([updated_value(p, u)], [p], [salt])
        return new

    is_leaf = lambda x: is_scaled(x) or x is None  # noqa: E731
    p_leaves, treedef = jax.tree.flatten(params, is_leaf=is_leaf)
    u_leaves = treedef.flatten_up_to(updates)
    base = None if seed is None else jnp.asarray(seed).astype(jnp.uint32)
    out, last = [], None
    for i, (p, u) in enumerate(zip(p_leaves, u_leaves, strict=True)):
        if is_scaled(p) and u is not None and last is not None:
            # Masters one at a time: each re-quantization needs its f32 value twice (amax,
            # then the cast), and XLA kept every leaf's f32 value alive at once otherwise.
            p, u, _ = jax.lax.optimization_barrier((p, u, last))
        salt = None if base is None else leaf_salt(base, i)
        out.append(add(p, u, salt))
        if is_scaled(out[-1]):
            last = out[-1]
    return treedef.unflatten(out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def dequantize_carrier(carrier: jax.Array, scale: jax.Array, storage) -> jax.Array:
    """A master's ``data`` carried bit-cast in the compute dtype, as a weight in that dtype.

    The gradient passes straight through to ``carrier``: it is d loss / d weight (what the
    optimizer wants), not d loss / d data, which would underflow in FP16.
    """
    data = jax.lax.bitcast_convert_type(carrier, jnp.dtype(storage))
    return ScaledTensor(data, scale).dequantize(carrier.dtype)


def _carrier_fwd(carrier, scale, storage):
    return dequantize_carrier(carrier, scale, storage), jnp.zeros_like(scale)


def _carrier_bwd(storage, zero_scale, g):
    del storage
    return g, zero_scale


dequantize_carrier.defvjp(_carrier_fwd, _carrier_bwd)


def fp8_op_name(fp8_state, module_path: tuple[str, ...]) -> str | None:
    """Name of the fp8jax FP8 matmul (a child holding ``meta``) of the module at this path."""
    node = fp8_state
    for k in module_path:
        if not isinstance(node, Mapping) or k not in node:
            return None
        node = node[k]
    if not isinstance(node, Mapping):
        return None
    ops = [k for k, v in node.items() if isinstance(v, Mapping) and "meta" in v]
    return ops[0] if len(ops) == 1 else None


def carry_masters(params, fp8_state, dtype) -> tuple[Any, dict[str, dict[str, jax.Array]]]:
    """``(params, masters)`` for a train step's ``model.apply``, masters dequantized in the layers.

    A master kernel whose layer runs an fp8jax FP8 matmul is handed over as its ``data`` bit-cast
    to the compute ``dtype`` (same width: no copy); ``masters`` maps that matmul's module path
    ('blocks/mlp/wi/Fp8DotGeneral_0') to ``{storage dtype name: scale}``. Applied under
    ``dequantize_carried(masters)``, each such matmul dequantizes its kernel itself
    (``dequantize_carrier``), so under remat no dequantized copy of a weight lives between the
    forward pass and the layer's backward pass. Other masters are dequantized here; the gradient
    tree is the one ``materialize(params, dtype)`` gives.
    """
    dtype = jnp.dtype(dtype)
    flat = traverse_util.flatten_dict(params)
    out, masters = {}, {}
    for path, p in flat.items():
        if not is_scaled(p):
            out[path] = p
            continue
        op = fp8_op_name(fp8_state, path[:-1])
        data = p.data
        if op is not None and data.dtype.itemsize == dtype.itemsize:
            out[path] = jax.lax.bitcast_convert_type(data, dtype)
            masters["/".join((*path[:-1], op))] = {jnp.dtype(data.dtype).name: p.scale}
        else:
            out[path] = p.dequantize(dtype)
    return traverse_util.unflatten_dict(out), masters


@contextlib.contextmanager
def dequantize_carried(masters: Mapping[str, Mapping[str, jax.Array]] | None) -> Iterator[None]:
    """Within it, a Flax FP8 op that ``carry_masters`` handed a carried kernel gets it dequantized.

    A method interceptor (``nn.intercept_methods``): when the ``__call__`` of a module whose path
    is a key of ``masters`` runs, its ``rhs`` argument (the carried bits) is replaced by
    ``dequantize_carrier(rhs, scale, storage)`` before the op sees it. It runs inside the op's
    own call, so inside its ``nn.remat`` and ``nn.scan`` bodies, and the op itself knows nothing
    of masters. No-op for empty ``masters``.
    """
    if not masters:
        yield
        return

    def interceptor(next_fun, args, kwargs, context):
        module = context.module
        if context.method_name != "__call__" or module.scope is None:
            return next_fun(*args, **kwargs)
        entry = masters.get("/".join(module.path))
        if entry is None:
            return next_fun(*args, **kwargs)
        ((storage, scale),) = entry.items()
        bound = inspect.signature(context.orig_method).bind(*args, **kwargs)
        bound.arguments["rhs"] = dequantize_carrier(bound.arguments["rhs"], scale, storage)
        return next_fun(*bound.args, **bound.kwargs)

    with nn.intercept_methods(interceptor):
        yield
