"""The block-scaled FP8 GEMM: ``y = a . b^T`` with one f32 dequant multiplier per tile along K.

Layout "NT": both operands are FP8 (``float8_e4m3fn`` or ``float8_e5m2``, either mix) with the
contraction axis K innermost, the layout Hopper's FP8 tensor cores take. ``a`` [M, K] has one
multiplier per 1 x ``block`` tile of a row (``a_inv_MxT``, T = ceil(K / block)); ``b`` [N, K]
has either one per ``block`` x ``block`` tile (``b_inv`` [ceil(N / block), T], DeepSeek-V3's
weights: the forward and dgrad GEMMs) or one per 1 x ``block`` tile of a row (``b_inv``
[N, T]: the wgrad GEMM, both operands tiled along the contraction).

The arithmetic, the same in the reference and the kernel (so that the two agree bit for bit in
Pallas' interpreter), for t = 0, 1, ..., T - 1 in order::

    partial = dot(a[:, tile t], b[:, tile t]^T)              # f32: FP8 products are exact
    acc = acc + (partial * a_inv[:, t][:, None]) * b_inv_t[None, :]

and ``acc.astype(out_dtype)`` at the end. Off Triton the scaled partial is rounded before the
add (``promote``): XLA:CPU contracts a multiply and an add into one FMA in some programs and
not in others, which would make the same GEMM's bits depend on what surrounds it. Block scales
along K do not factor out of the sum, so each ``block``-wide partial is moved into the f32
accumulator with its scales: DeepSeek-V3's promotion every 128 of K, which also bounds the
error of the tensor cores' limited-precision FP8 accumulation to one tile.

``impl``: 'pallas' (and 'auto' on GPUs) runs a GPU kernel on CUDA and the reference elsewhere;
'xla' the reference; 'interpret' the Triton kernel in Pallas' interpreter (any backend: tests).
On CUDA (``kernel_for``) a 128-block GEMM whose dimensions are multiples of 16 runs cuBLASLt's
own block-scaled GEMM where it is available (``ops.cublaslt``: the same promotion every 128 of
K, measured bit-identical to the Mosaic kernel in bf16 on an H200, and faster); else a GEMM of
whole 128 x 128 output tiles and tiles of K runs the warp-specialized Mosaic GPU kernel
(``block_gemm_mgpu``: Hopper's FP8 WGMMA, TMA pipelines), any other shape the Triton kernel
here, which pads. Mixed formats (E5M2 x E4M3) take either:
FP8 WGMMA takes the pair; Triton's dot wants both operands of one type, so the Triton kernel
converts both tiles to f16, which holds every E4M3 and E5M2 value exactly (same products and
sums, half the FP8 tensor-core rate). The Mosaic kernel promotes with the product of a row's
and b's block multipliers (one rounding less than the contract's two multiplies) where b has
blocks, so on the GPU the two kernels agree to f32 rounding, not bit for bit.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from fp8jax.ops import block_gemm_mgpu, cublaslt, kernels, tile_dot

__all__ = [
    "BLOCK",
    "BM",
    "BN",
    "GROUP",
    "OUT_DTYPES",
    "PREFETCH",
    "STAGES",
    "WARPS",
    "block_scaled_dot",
    "block_scaled_dot_reference",
    "check_operands",
    "kernel_for",
    "mosaic_block_scaled_dot",
    "pallas_block_scaled_dot",
    "promote",
    "resolve_b_blocks",
]

BLOCK = 128  # DeepSeek-V3's tile: elements of K per scale
OUT_DTYPES = (jnp.bfloat16, jnp.float32, jnp.float16)
_FP8 = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
_NT = (((1,), (1,)), ((), ()))  # contract dim 1 of both: y = a . b^T
# The kernel's defaults, the fastest of benchmarks/block_gemm.py's sweep on an H200 (8192^3):
# rows x columns of a program's output, Triton warps and pipeline stages, row blocks per group
# of the launch order, and the scales' prefetch. Small programs win: two or more share an SM,
# so one's tensor-core dot overlaps another's f32 rescale of its partial.
BM, BN, WARPS, STAGES, GROUP, PREFETCH = 64, 128, 4, 3, 8, True


def _pow2(n) -> bool:
    return isinstance(n, int) and n >= 1 and not n & (n - 1)


def _check_dtype(name: str, x: jax.Array) -> None:
    if jnp.dtype(x.dtype) not in _FP8:
        raise TypeError(
            f"block_scaled_dot: {name} is {jnp.dtype(x.dtype)}: quantize it to float8_e4m3fn "
            f"or float8_e5m2 first (ops.block_cast)"
        )


def resolve_b_blocks(n: int, b_inv_rows: int, b_blocks: bool | None) -> bool:
    """Whether ``b_inv`` holds ``block`` x ``block`` tiles: ``b_blocks``, else ``rows != N``."""
    return b_inv_rows != n if b_blocks is None else bool(b_blocks)


def check_operands(a_MxK, a_inv_MxT, b_NxK, b_inv, block: int, out_dtype, b_blocks) -> bool:
    """Validate a block-scaled GEMM's operands (one-line errors); return whether b has blocks."""
    if not _pow2(block) or block < 16:
        raise ValueError(f"block_scaled_dot: block must be a power of two >= 16, got {block!r}")
    _check_dtype("a", a_MxK)
    _check_dtype("b", b_NxK)
    if a_MxK.ndim != 2 or b_NxK.ndim != 2 or a_MxK.shape[1] != b_NxK.shape[1] or 0 in a_MxK.shape:
        raise ValueError(
            f"block_scaled_dot: a [M, K] and b [N, K] must be 2-D, non-empty, with the same K, "
            f"got {a_MxK.shape} and {b_NxK.shape}"
        )
    if jnp.dtype(out_dtype) not in map(jnp.dtype, OUT_DTYPES) or 0 in b_NxK.shape:
        raise ValueError(
            f"block_scaled_dot: out_dtype must be bfloat16, float32 or float16 and N >= 1, "
            f"got {jnp.dtype(out_dtype)} and {b_NxK.shape}"
        )
    (m, k), n = a_MxK.shape, b_NxK.shape[0]
    t, nb = math.ceil(k / block), math.ceil(n / block)
    blocks = resolve_b_blocks(n, jnp.shape(b_inv)[0] if jnp.ndim(b_inv) else -1, b_blocks)
    want = (nb, t) if blocks else (n, t)
    if jnp.shape(a_inv_MxT) != (m, t) or jnp.shape(b_inv) != want:
        forms = f"{want}" if b_blocks is not None else f"({nb}, {t}) (blocks) or ({n}, {t}) (rows)"
        raise ValueError(
            f"block_scaled_dot: with block {block}, a_inv must be {(m, t)} and b_inv {forms}, "
            f"got {jnp.shape(a_inv_MxT)} and {jnp.shape(b_inv)}"
        )
    return blocks


def _rows(b_inv, blocks: bool, block: int, n: int) -> jax.Array:
    """``b_inv`` as one multiplier per row of b and tile: [N, T] f32."""
    b_inv = jnp.asarray(b_inv, jnp.float32)
    return jnp.repeat(b_inv, block, axis=0)[:n] if blocks else b_inv


def _pad(x, rows: int, cols: int):
    """``x`` zero-padded at the end to [rows, cols]."""
    pad = ((0, rows - x.shape[0]), (0, cols - x.shape[1]))
    return jnp.pad(x, pad) if any(p[1] for p in pad) else x


def promote(acc, partial, a_s, b_s, rounded: bool):
    """``acc + (partial * a_s) * b_s`` in f32; ``rounded``: the product rounded before the add
    (an optimization barrier: no FMA), the same bits whatever program the GEMM sits in."""
    scaled = (partial * a_s) * b_s
    if rounded:
        scaled = jax.lax.optimization_barrier(scaled)
    return acc + scaled


def _reference(a_MxK, a_inv_MxT, b_NxK, b_inv_NxT, block: int, out_dtype):
    """The contract with XLA ops: one tile of K per ``fori_loop`` step, never [T, M, N]."""
    m, n, t = a_MxK.shape[0], b_NxK.shape[0], a_inv_MxT.shape[1]
    a_MxKp, b_NxKp = _pad(a_MxK, m, t * block), _pad(b_NxK, n, t * block)

    def step(i, acc_MxN):
        a_t = jax.lax.dynamic_slice_in_dim(a_MxKp, i * block, block, axis=1)  # [M, block]
        b_t = jax.lax.dynamic_slice_in_dim(b_NxKp, i * block, block, axis=1)  # [N, block]
        partial = jax.lax.dot_general(a_t, b_t, _NT, preferred_element_type=jnp.float32)
        a_s = jax.lax.dynamic_index_in_dim(a_inv_MxT, i, axis=1, keepdims=False)  # [M]
        b_s = jax.lax.dynamic_index_in_dim(b_inv_NxT, i, axis=1, keepdims=False)  # [N]
        return promote(acc_MxN, partial, a_s[:, None], b_s[None, :], rounded=True)

    acc = jax.lax.fori_loop(0, t, step, jnp.zeros((m, n), jnp.float32))
    return acc.astype(out_dtype)


def block_scaled_dot_reference(
    a_MxK: jax.Array,
    a_inv_MxT: jax.Array,
    b_NxK: jax.Array,
    b_inv: jax.Array,
    *,
    block: int = BLOCK,
    out_dtype=jnp.bfloat16,
    b_blocks: bool | None = None,
) -> jax.Array:
    """``y`` [M, N] = a . b^T by the contract (module docstring), in XLA ops (any backend).

    ``b_blocks``: whether ``b_inv`` is [ceil(N / block), T] (block x block tiles) or [N, T]
    (1 x block tiles per row); None reads it from the shape (``b_inv.shape[0] != N``: blocks;
    the two readings differ only for N > 1, where the shapes differ too).

    On GPUs it is the fallback, not the fast path: each tile is an XLA FP8 dot, whose
    accumulation was measured (H200, K = 4096) 3e-4 of the output's largest value away from an
    f64 product, where the kernel is within 3e-7.
    """
    blocks = check_operands(a_MxK, a_inv_MxT, b_NxK, b_inv, block, out_dtype, b_blocks)
    a_inv_MxT = jnp.asarray(a_inv_MxT, jnp.float32)
    b_inv_NxT = _rows(b_inv, blocks, block, b_NxK.shape[0])
    return _reference(a_MxK, a_inv_MxT, b_NxK, b_inv_NxT, block, out_dtype)


def _tile(p, gm: int, gn: int, group: int):
    """Program ``p`` of the 1-D launch -> its (row block, column block): ``group`` row blocks
    run through all column blocks together, so their rows of a and columns of b stay in L2."""
    width = group * gn
    first = (p // width) * group
    size = jnp.minimum(gm - first, group)
    return first + (p % width) % size, (p % width) // size


def _kernel(
    a_ref,
    b_ref,
    a_s_ref,
    b_s_ref,
    y_ref,
    *,
    t,
    block,
    scalar_b,
    mixed,
    prefetch,
    fast_acc,
    interpret,
):
    from jax.experimental import pallas as pl

    bm, bn = y_ref.shape

    def scales(i):  # tile i's multipliers: a's rows [bm, 1]; one b block's (scalar) or b's rows
        b_s = b_s_ref[i, 0] if scalar_b else b_s_ref[i, :][None, :]
        return a_s_ref[i, :][:, None], b_s

    def step(i, carry):
        acc_bmxbn, a_s, b_s = carry
        if prefetch:  # the next tile's multipliers load while this tile's dot runs
            following = scales(jnp.minimum(i + 1, t - 1))
        else:
            a_s, b_s = following = scales(i)
        a_t = a_ref[:, pl.ds(i * block, block)]  # [bm, block] FP8
        b_t = b_ref[:, pl.ds(i * block, block)]  # [bn, block] FP8
        if mixed:  # E5M2 x E4M3: both exact in f16, which Triton's dot takes as a pair
            a_t, b_t = a_t.astype(jnp.float16), b_t.astype(jnp.float16)
        if fast_acc and not mixed:  # the whole tile in the tensor cores, then promoted here
            partial = tile_dot.tile_dot(a_t, b_t, k_imprecise=block)
        else:
            partial = jax.lax.dot_general(a_t, b_t, _NT, preferred_element_type=jnp.float32)
        return promote(acc_bmxbn, partial, a_s, b_s, rounded=interpret), *following

    acc = jax.lax.fori_loop(0, t, step, (jnp.zeros((bm, bn), jnp.float32), *scales(0)))[0]
    y_ref[...] = acc.astype(y_ref.dtype)


def pallas_block_scaled_dot(
    a_MxK: jax.Array,
    a_inv_MxT: jax.Array,
    b_NxK: jax.Array,
    b_inv: jax.Array,
    *,
    block: int = BLOCK,
    out_dtype=jnp.bfloat16,
    b_blocks: bool | None = None,
    bm: int = BM,
    bn: int = BN,
    num_warps: int = WARPS,
    num_stages: int = STAGES,
    group: int = GROUP,
    prefetch: bool = PREFETCH,
    fast_acc: bool = True,
    interpret: bool = False,
) -> jax.Array:
    """The Pallas kernel of ``block_scaled_dot`` with explicit tuning (tuning runs, tests).

    One program per [bm, bn] block of y (``group`` row blocks at a time in launch order) loops
    over the T tiles of K. With block x block tiles of b and ``bn`` dividing ``block``, each
    program and tile reads one scalar of b; otherwise a [bn] vector of per-row multipliers.
    Operands are zero-padded to whole programs (padded multipliers are 0: they scale zeros).
    ``prefetch`` loads the next tile's multipliers in the loop's current step. ``fast_acc``
    lets the tensor cores accumulate each whole tile before its f32 promotion
    (``ops.tile_dot``); without it Triton promotes after every WGMMA instruction.
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plt

    blocks = check_operands(a_MxK, a_inv_MxT, b_NxK, b_inv, block, out_dtype, b_blocks)
    blocks_ok = all(_pow2(v) and v >= 16 for v in (bm, bn)) and _pow2(num_warps)
    if not blocks_ok or not (isinstance(num_stages, int) and num_stages >= 1 and group >= 1):
        raise ValueError(
            f"pallas_block_scaled_dot: bm, bn must be powers of two >= 16, num_warps a power of "
            f"two, num_stages and group >= 1, got {(bm, bn, num_warps, num_stages, group)}"
        )
    (m, k), n = a_MxK.shape, b_NxK.shape[0]
    t = math.ceil(k / block)
    tp = 1 << (t - 1).bit_length()  # Triton blocks are powers of two: multipliers padded to Tp
    bm = min(bm, max(16, 1 << (m - 1).bit_length()))  # a small M needs no 128 padded rows
    bn = min(bn, max(16, 1 << (n - 1).bit_length()))
    gm, gn = math.ceil(m / bm), math.ceil(n / bn)
    a_pad = _pad(a_MxK, gm * bm, tp * block)  # [M', Tp * block]
    b_pad = _pad(b_NxK, gn * bn, tp * block)  # [N', Tp * block]
    a_s_TxM = _pad(jnp.asarray(a_inv_MxT, jnp.float32).T, tp, gm * bm)
    scalar_b = blocks and block % bn == 0
    if scalar_b:  # one multiplier per program: column block j lies in b block j * bn // block
        b_s = jnp.repeat(jnp.asarray(b_inv, jnp.float32), block // bn, axis=0)[:gn]
        b_s_TxG, b_cols = _pad(b_s.T, tp, gn), 1
    else:
        b_s_TxG, b_cols = _pad(_rows(b_inv, blocks, block, n).T, tp, gn * bn), bn
    group = min(group, gm)

    def rows(p):
        return _tile(p, gm, gn, group)[0]

    def cols(p):
        return _tile(p, gm, gn, group)[1]

    kernel = functools.partial(
        _kernel,
        t=t,
        block=block,
        scalar_b=scalar_b,
        mixed=a_MxK.dtype != b_NxK.dtype,
        prefetch=prefetch,
        fast_acc=fast_acc,
        interpret=interpret,
    )
    y = pl.pallas_call(
        kernel,
        grid=(gm * gn,),
        in_specs=[
            pl.BlockSpec((bm, tp * block), lambda p: (rows(p), 0)),
            pl.BlockSpec((bn, tp * block), lambda p: (cols(p), 0)),
            pl.BlockSpec((tp, bm), lambda p: (0, rows(p))),
            pl.BlockSpec((tp, b_cols), lambda p: (0, cols(p))),
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda p: (rows(p), cols(p))),
        out_shape=jax.ShapeDtypeStruct((gm * bm, gn * bn), out_dtype),
        interpret=interpret,
        compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="fp8_block_scaled_dot",
    )(a_pad, b_pad, a_s_TxM, b_s_TxG)
    return y[:m, :n]


def mosaic_block_scaled_dot(
    a_MxK: jax.Array,
    a_inv_MxT: jax.Array,
    b_NxK: jax.Array,
    b_inv: jax.Array,
    *,
    block: int = BLOCK,
    out_dtype=jnp.bfloat16,
    b_blocks: bool | None = None,
    tuning: block_gemm_mgpu.Tuning | None = None,
) -> jax.Array:
    """The Mosaic GPU kernel of ``block_scaled_dot`` (CUDA, Hopper) with the contract's operands;
    ``tuning`` defaults to ``block_gemm_mgpu.tuning_for`` the shape (one error if none tiles it).
    """
    blocks = check_operands(a_MxK, a_inv_MxT, b_NxK, b_inv, block, out_dtype, b_blocks)
    (m, k), n = a_MxK.shape, b_NxK.shape[0]
    tuning = tuning or block_gemm_mgpu.tuning_for(m, n, k, block, blocks)
    if tuning is None:
        raise ValueError(
            f"mosaic_block_scaled_dot: [{m}, {k}] . [{n}, {k}]^T with block {block} is not whole "
            f"128 x 128 output tiles and tiles of K: use block_scaled_dot, which pads"
        )
    return block_gemm_mgpu.block_scaled_dot(
        a_MxK,
        jnp.asarray(a_inv_MxT, jnp.float32).T,  # [T, M]: one tile of K's multipliers a row
        b_NxK,
        _rows(b_inv, blocks, block, n).T,  # [T, N]
        block=block,
        out_dtype=out_dtype,
        b_blocks=blocks,
        tuning=tuning,
    )


def kernel_for(
    m: int, n: int, k: int, block: int, b_blocks: bool, dtypes=(_FP8[0], _FP8[0], jnp.bfloat16)
) -> str:
    """The CUDA kernel ``block_scaled_dot`` runs for a shape and ``dtypes`` (a's, b's, the
    output's): 'cublaslt', 'mosaic' or 'triton'."""
    if block == cublaslt.BLOCK and cublaslt.supports(m, n, k, *dtypes) and cublaslt.available():
        return "cublaslt"
    whole = block_gemm_mgpu.tuning_for(m, n, k, block, b_blocks) is not None
    return "mosaic" if whole and block_gemm_mgpu.available() else "triton"


def block_scaled_dot(
    a_MxK: jax.Array,
    a_inv_MxT: jax.Array,
    b_NxK: jax.Array,
    b_inv: jax.Array,
    *,
    block: int = BLOCK,
    out_dtype=jnp.bfloat16,
    impl: str = "auto",
    b_blocks: bool | None = None,
) -> jax.Array:
    """``y`` [M, N] = a . b^T with per-tile multipliers along K (module docstring's contract).

    ``a_inv_MxT`` f32 [M, T]; ``b_inv`` f32 [ceil(N / block), T] (b in block x block tiles) or
    [N, T] (1 x block tiles per row), told apart by ``b_blocks`` or, when None, by the shape
    (``b_inv.shape[0] != N``: blocks). Any M, N, K >= 1. ``impl``: 'auto' / 'pallas' (on CUDA
    ``kernel_for``'s kernel, the reference elsewhere), 'xla' (the reference), 'interpret' (the
    Triton kernel in Pallas' interpreter).
    """
    impl = kernels.resolve_impl(impl)
    blocks = check_operands(a_MxK, a_inv_MxT, b_NxK, b_inv, block, out_dtype, b_blocks)
    options = {"block": block, "out_dtype": out_dtype, "b_blocks": b_blocks}
    (m, k), n = a_MxK.shape, b_NxK.shape[0]

    def reference(a, a_inv, b, b_inv):
        return block_scaled_dot_reference(a, a_inv, b, b_inv, **options)

    def kernel(a, a_inv, b, b_inv, interpret=False):
        chosen = kernel_for(m, n, k, block, blocks, (a.dtype, b.dtype, out_dtype))
        if not interpret and chosen == "cublaslt":
            return cublaslt.block_dot(a, a_inv, b, b_inv, blocks, out_dtype)
        if not interpret and chosen == "mosaic":
            return mosaic_block_scaled_dot(a, a_inv, b, b_inv, **options)
        return pallas_block_scaled_dot(a, a_inv, b, b_inv, **options, interpret=interpret)

    args = (a_MxK, a_inv_MxT, b_NxK, b_inv)
    if impl == "xla":
        return reference(*args)
    if impl == "interpret":
        return kernel(*args, interpret=True)
    return jax.lax.platform_dependent(*args, cuda=kernel, default=reference)
