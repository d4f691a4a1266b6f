"""Grouped GEMMs of expert layers as Mosaic GPU kernels for Hopper (sm_90a), FP8 and bf16.

The FP8 kernels take the groups in a padded layout: every group's rows start at a multiple of
``TILE`` rows, the rows between groups are 0 (``Layout``, built once per call from the group
sizes). A tile of ``TILE`` rows then belongs to one group, so

* ``grouped_nt``: ``y[rows of g] = a[rows of g] . b[g]^T`` with a [R, K] and b [G, N, K], both
  K innermost (the layout FP8 WGMMA takes), walks output tiles of ``TILE`` x ``TILE`` and reads
  the tile's group from a table; the forward GEMM (b = w transposed per group) and dgrad
  (b = w as stored) are both this kernel;
* ``grouped_tn``: ``out[g] = a^T[:, rows of g] . b^T[:, rows of g]^T`` with a^T [K, R] and
  b^T [N, R] (the padded rows innermost: the contraction), walks (group, output tile) and
  pipelines over its group's row tiles only (a dynamic trip count); wgrad is this kernel on
  the transposed FP8 operands.

Both multiply the f32 accumulator by the pair's inverse scale before the one rounding to the
output dtype: the result is the FP8 GEMM with f32 accumulation of ``ops.grouped``'s reference
up to summation order. Padding costs at most ``TILE - 1`` rows per group. Where the output is
whole ``WS_COLS``-wide tiles each runs warp-specialized (a TMA warpgroup feeding two compute
warpgroups of ``TILE`` x ``TILE``), else with one warpgroup per ``TILE`` x ``TILE`` tile.
E4M3 times E5M2 (dgrad, wgrad) runs in one WGMMA where this JAX's Mosaic GPU takes the mixed
pair (``mixed_fp8``), else both operands go in as f16, which holds both formats exactly.
``ops.grouped.padded_gemm`` is the one caller.

The bf16 grouped GEMM of level O0 on Hopper is JAX's own Mosaic GPU ragged-dot kernels
(``jax.experimental.pallas.ops.gpu``: ``ragged_dot`` for the forward and dgrad,
``transposed_ragged_dot`` for wgrad) behind one custom VJP, ``bf16_grouped_matmul``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from fp8jax.ops._kernel_launch import unbatched

__all__ = [
    "layout_rows",
    "BF16_KERNEL_NAME",
    "KERNEL_NAME",
    "Layout",
    "TILE",
    "available",
    "bf16_grouped_matmul",
    "bf16_takes",
    "enabled",
    "grouped_nt",
    "grouped_tn",
    "k_tile",
    "layout",
    "mixed_fp8",
    "pad_rows",
    "pair",
    "reference_only",
    "takes",
    "unpad_rows",
    "valid_rows",
    "ws_takes",
]

KERNEL_NAME = "fp8_grouped_gemm"  # the FP8 kernels' name in the program (diagnostics.coverage)
BF16_KERNEL_NAME = "bf16_grouped_gemm"  # the scope of JAX's bf16 kernels
TILE = 128  # rows per group tile, the output tile's side and K's tile: 128 FP8 bytes
STAGES = 4  # tiles of K in flight in shared memory


_SWITCH = {"on": True}  # ``reference_only`` turns the kernels off while a program traces


@contextlib.contextmanager
def reference_only():
    """Trace with the kernels off: every grouped GEMM runs XLA's reference (benchmarks compare
    the two in one process)."""
    before, _SWITCH["on"] = _SWITCH["on"], False
    try:
        yield
    finally:
        _SWITCH["on"] = before


def enabled() -> bool:
    """Whether the kernels may run: ``available`` and not inside ``reference_only``."""
    return _SWITCH["on"] and available()


@functools.cache
def available() -> bool:
    """Whether the kernels can run: Pallas' Mosaic GPU backend and a Hopper GPU (or none
    attached: lowering for CUDA elsewhere)."""
    try:
        import jax.experimental.pallas.mosaic_gpu  # noqa: F401
        import jax.experimental.pallas.ops.gpu.ragged_dot_mgpu  # noqa: F401
        import jax.experimental.pallas.ops.gpu.transposed_ragged_dot_mgpu  # noqa: F401
    except ImportError:  # pragma: no cover
        return False
    try:
        gpus = jax.devices("cuda")
    except RuntimeError:
        return True
    return str(getattr(gpus[0], "compute_capability", "9.0")).startswith("9.")


def takes(*dims: int) -> bool:
    """Whether the FP8 kernels take a GEMM whose non-ragged dims are ``dims``: whole tiles."""
    return all(d > 0 and d % TILE == 0 for d in dims)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["src_R", "dst_M", "tile_group_T", "first_tile_G", "tiles_G"],
    meta_fields=["rows"],
)
@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each group's rows go in the padded layout (all int32, built in the program)."""

    rows: int  # R: padded rows, a static bound (M plus TILE - 1 per group, whole tiles)
    src_R: jax.Array  # the sorted row each padded row reads; M (a zero row) for padding
    dst_M: jax.Array  # the padded row of each sorted row; R (a zero row) past sum(sizes)
    tile_group_T: jax.Array  # the group of each tile of TILE padded rows; -1 past the end
    first_tile_G: jax.Array  # each group's first tile
    tiles_G: jax.Array  # each group's number of tiles (0 for an empty group)


def layout(group_sizes_G: jax.Array, m: int) -> Layout:
    """The padded layout of ``m`` sorted rows in groups of ``group_sizes_G`` rows."""
    gs = group_sizes_G.astype(jnp.int32)
    g = gs.shape[0]
    rows = -(-(m + g * (TILE - 1)) // TILE) * TILE
    tiles_G = -(-gs // TILE)
    first_tile_G = jnp.cumsum(tiles_G) - tiles_G
    start_G = jnp.cumsum(gs) - gs
    row_M = jnp.arange(m, dtype=jnp.int32)
    # compare_all: one fused comparison of every row with the G group ends. The default binary
    # search is a loop whose every step is a kernel launched from the host.
    ends_G = jnp.cumsum(gs)
    group_M = jnp.searchsorted(ends_G, row_M, side="right", method="compare_all")
    group_M = group_M.astype(jnp.int32)
    valid_M = row_M < jnp.sum(gs)
    group_c = jnp.minimum(group_M, g - 1)
    dst_M = first_tile_G[group_c] * TILE + row_M - start_G[group_c]
    dst_M = jnp.where(valid_M, dst_M, rows)
    src_R = jnp.full((rows + 1,), m, jnp.int32).at[dst_M].set(row_M, mode="drop")[:rows]
    t = jnp.arange(rows // TILE, dtype=jnp.int32)
    tile_group_T = jnp.searchsorted(jnp.cumsum(tiles_G), t, side="right", method="compare_all")
    tile_group_T = tile_group_T.astype(jnp.int32)
    tile_group_T = jnp.where(tile_group_T < g, tile_group_T, -1)
    return Layout(rows, src_R, dst_M, tile_group_T, first_tile_G, tiles_G)


def layout_rows(lay: Layout) -> jax.Array:
    """bool [R]: the padded rows that hold a sorted row (the others are padding)."""
    return lay.src_R < lay.dst_M.shape[0]


def valid_rows(x_MxK: jax.Array, group_sizes_G: jax.Array) -> jax.Array:
    """``x`` with the rows past ``sum(group_sizes)`` set to 0: they enter no GEMM and no amax."""
    keep_M = jnp.arange(x_MxK.shape[0]) < jnp.sum(group_sizes_G)
    return jnp.where(keep_M[:, None], x_MxK, jnp.zeros((), x_MxK.dtype))


def pad_rows(a_MxK: jax.Array, lay: Layout) -> jax.Array:
    """``a`` [M, K] in the padded layout [R, K], 0 between groups."""
    zero = jnp.zeros((1, a_MxK.shape[1]), a_MxK.dtype)
    return jnp.concatenate([a_MxK, zero]).at[lay.src_R].get(mode="clip")


def unpad_rows(y_RxN: jax.Array, lay: Layout) -> jax.Array:
    """The sorted rows [M, N] of a padded result; 0 past ``sum(group_sizes)``."""
    zero = jnp.zeros((1, y_RxN.shape[1]), y_RxN.dtype)
    return jnp.concatenate([y_RxN, zero]).at[lay.dst_M].get(mode="clip")


def k_tile(dtype) -> int:
    """Elements of ``dtype`` in one tile of the contraction: 128 bytes (WGMMA's swizzle)."""
    return 128 // jnp.dtype(dtype).itemsize


def _transforms(plgpu, dtype):
    """Shared-memory transforms of a tile whose rows are 128 bytes of ``dtype`` (or more)."""
    swizzle = plgpu.find_swizzle(k_tile(dtype) * jnp.dtype(dtype).itemsize * 8)
    elems = swizzle // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(swizzle))


def _store(pl, plgpu, acc, inv_scale, o_smem, out_ref):
    """The accumulator times the inverse scale, rounded once, stored through shared memory."""
    o_smem[...] = (acc * inv_scale).astype(o_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, out_ref)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _num_sms() -> int:
    from jax.extend import backend

    return getattr(backend.get_default_device(), "core_count", 132)  # CPUs trace only


def _compiler_params(plgpu):
    return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup)


@functools.partial(jax.jit, static_argnames=("out_dtype", "warp_specialized"))
def grouped_nt(
    a_RxK: jax.Array,
    b_GxNxK: jax.Array,
    tile_group_T: jax.Array,
    inv_scale: jax.Array,
    *,
    out_dtype=jnp.bfloat16,
    warp_specialized: bool | None = None,
) -> jax.Array:
    """``y`` [R, N]: each tile of TILE rows of a times its group's ``b^T``, times ``inv_scale``.

    Tiles past the last group (``tile_group_T`` -1) are not written: ``unpad_rows`` never reads
    them. ``warp_specialized`` (None: where ``ws_takes`` N) picks the warp-specialized kernel.
    """
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    (r, k), n = a_RxK.shape, b_GxNxK.shape[1]
    inv = jnp.reshape(inv_scale, (1,)).astype(jnp.float32)
    if ws_takes(n) if warp_specialized is None else warp_specialized:
        with jax.named_scope(KERNEL_NAME):
            return _ws_nt(a_RxK, b_GxNxK, tile_group_T, inv, out_dtype)
    kt = k_tile(a_RxK.dtype)
    grid_m, grid_n, steps = r // TILE, n // TILE, k // kt
    a_transforms, b_transforms = _transforms(plgpu, a_RxK.dtype), _transforms(plgpu, b_GxNxK.dtype)
    out_transforms = _transforms(plgpu, out_dtype)

    def body(tile_group_gmem, inv_gmem, a_gmem, b_gmem, o_gmem):
        inv = inv_gmem[0]

        @plgpu.nd_loop((grid_m * grid_n,), collective_axes="sm")
        def _tiles(info):
            mi, ni = plgpu.planar_snake(info.index[0], (grid_m, grid_n), 1, 8)
            group = tile_group_gmem[mi]

            @pl.when(group >= 0)
            def _():
                def acc_scope(acc_ref):
                    plgpu.emit_pipeline(
                        lambda _, a_smem, b_smem: plgpu.wgmma(
                            acc_ref, a_smem, plgpu.transpose_ref(b_smem, (1, 0))
                        ),
                        grid=(steps,),
                        in_specs=[
                            plgpu.BlockSpec(
                                (TILE, kt),
                                lambda s: (mi, s),
                                transforms=a_transforms,
                                delay_release=1,
                            ),
                            plgpu.BlockSpec(
                                (TILE, kt),
                                lambda s: (ni, s),
                                transforms=b_transforms,
                                delay_release=1,
                            ),
                        ],
                        max_concurrent_steps=STAGES,
                    )(a_gmem, b_gmem.at[group])
                    return acc_ref[...]

                acc = pl.run_scoped(acc_scope, plgpu.ACC((TILE, TILE)))
                pl.run_scoped(
                    lambda o_smem: _store(
                        pl,
                        plgpu,
                        acc,
                        inv,
                        o_smem,
                        o_gmem.at[pl.ds(mi * TILE, TILE), pl.ds(ni * TILE, TILE)],
                    ),
                    plgpu.SMEM((TILE, TILE), out_dtype, transforms=out_transforms),
                )

    with jax.named_scope(KERNEL_NAME):
        kernel = plgpu.kernel(
            body,
            out_type=jax.ShapeDtypeStruct((r, n), out_dtype),
            grid=(_num_sms(),),
            grid_names=("sm",),
            kernel_name=KERNEL_NAME,
            compiler_params=_compiler_params(plgpu),
        )
        return unbatched(kernel)(tile_group_T, inv, a_RxK, b_GxNxK)


@functools.partial(jax.jit, static_argnames=("out_dtype", "warp_specialized"))
def grouped_tn(
    a_KxR: jax.Array,
    b_NxR: jax.Array,
    first_tile_G: jax.Array,
    tiles_G: jax.Array,
    inv_scale: jax.Array,
    *,
    out_dtype=jnp.float32,
    warp_specialized: bool | None = None,
) -> jax.Array:
    """``out`` [G, K, N]: per group, ``a^T`` and ``b^T`` contracted over its padded rows, times
    ``inv_scale``; 0 for an empty group. ``warp_specialized`` as in ``grouped_nt``."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    (k, _), n, g = a_KxR.shape, b_NxR.shape[0], tiles_G.shape[0]
    inv = jnp.reshape(inv_scale, (1,)).astype(jnp.float32)
    if ws_takes(n) if warp_specialized is None else warp_specialized:
        with jax.named_scope(KERNEL_NAME):
            return _ws_tn(a_KxR, b_NxR, first_tile_G, tiles_G, inv, out_dtype)
    kt = k_tile(a_KxR.dtype)
    per_tile = TILE // kt  # contraction steps per tile of padded rows
    grid_k, grid_n = k // TILE, n // TILE
    a_transforms, b_transforms = _transforms(plgpu, a_KxR.dtype), _transforms(plgpu, b_NxR.dtype)
    out_transforms = _transforms(plgpu, out_dtype)

    def body(first_gmem, tiles_gmem, inv_gmem, a_gmem, b_gmem, o_gmem):
        inv = inv_gmem[0]

        @plgpu.nd_loop((g, grid_k * grid_n), collective_axes="sm")
        def _tiles(info):
            gi = info.index[0]
            ki, ni = plgpu.planar_snake(info.index[1], (grid_k, grid_n), 1, 8)
            first, count = first_gmem[gi] * per_tile, tiles_gmem[gi] * per_tile

            def acc_scope(acc_ref):
                @pl.when(count > 0)
                def _():
                    plgpu.emit_pipeline(
                        lambda _, a_smem, b_smem: plgpu.wgmma(
                            acc_ref, a_smem, plgpu.transpose_ref(b_smem, (1, 0))
                        ),
                        grid=(count,),
                        in_specs=[
                            plgpu.BlockSpec(
                                (TILE, kt),
                                lambda s: (ki, first + s),
                                transforms=a_transforms,
                                delay_release=1,
                            ),
                            plgpu.BlockSpec(
                                (TILE, kt),
                                lambda s: (ni, first + s),
                                transforms=b_transforms,
                                delay_release=1,
                            ),
                        ],
                        max_concurrent_steps=STAGES,
                    )(a_gmem, b_gmem)

                return acc_ref[...]

            acc = pl.run_scoped(acc_scope, plgpu.ACC((TILE, TILE)))
            pl.run_scoped(
                lambda o_smem: _store(
                    pl,
                    plgpu,
                    acc,
                    inv,
                    o_smem,
                    o_gmem.at[gi, pl.ds(ki * TILE, TILE), pl.ds(ni * TILE, TILE)],
                ),
                plgpu.SMEM((TILE, TILE), out_dtype, transforms=out_transforms),
            )

    with jax.named_scope(KERNEL_NAME):
        kernel = plgpu.kernel(
            body,
            out_type=jax.ShapeDtypeStruct((g, k, n), out_dtype),
            grid=(_num_sms(),),
            grid_names=("sm",),
            kernel_name=KERNEL_NAME,
            compiler_params=_compiler_params(plgpu),
        )
        return unbatched(kernel)(first_tile_G, tiles_G, inv, a_KxR, b_NxR)


# Warp-specialized kernels: one memory warpgroup streams the tiles of the contraction through
# TMA, WS_STAGES deep, while two compute warpgroups each own TILE x TILE of a TILE x WS_COLS
# output tile (both read the same rows of a); a compute warpgroup's epilogue scales, rounds and
# stores its tile in 128-byte-wide pieces while the other keeps the tensor cores busy.

WS_COLS = 2 * TILE  # output columns of a warp-specialized CTA
WS_STAGES = 3  # contraction tiles in flight: 3 x 48 KiB of operands plus 64 KiB of epilogue


def ws_takes(n: int) -> bool:
    """Whether the warp-specialized kernels tile an output ``n`` wide (whole ``WS_COLS``)."""
    return n % WS_COLS == 0


def _ws_kernel(
    *refs,
    plgpu,
    pl,
    tiles: tuple,
    kt: int,
    tile_refs,
    static_steps: int | None,
):
    """The warp-specialized body: for each work item of ``tiles`` (an nd_loop grid),
    ``tile_refs(index, *refs)`` gives ``(a [TILE, C], b [WS_COLS, C], out [TILE, WS_COLS],
    first, steps, inv, run)``: the contraction tiles ``first`` .. ``first + steps`` of a and b
    are multiplied into the output tile when ``run``. ``static_steps``: the steps when every
    tile has the same number (the pipeline's stages are then at most that), else None."""
    *in_refs, o_gmem = refs
    # The shared-memory stages: the allocation below and every tile's pipeline must agree
    # (a pipeline over fewer static steps than stages allocates only that many).
    stages = WS_STAGES if static_steps is None else min(WS_STAGES, static_steps)
    out_dtype = o_gmem.dtype
    epi_n = 128 // jnp.dtype(out_dtype).itemsize
    out_transforms = _transforms(plgpu, out_dtype)

    def specs(a_dtype, b_dtype, first):
        return [
            plgpu.BlockSpec(
                (TILE, kt),
                lambda s: (0, first + s),
                transforms=_transforms(plgpu, a_dtype),
                memory_space=plgpu.SMEM,
            ),
            plgpu.BlockSpec(
                (WS_COLS, kt),
                lambda s: (0, first + s),
                transforms=_transforms(plgpu, b_dtype),
                memory_space=plgpu.SMEM,
            ),
        ]

    def pipeline(body, context, a_dtype, b_dtype, first, steps):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(steps,),
            memory_registers=40,
            in_specs=specs(a_dtype, b_dtype, first),
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=stages,
            compute_context=context,
        )

    a0, b0, *_ = tile_refs((jnp.int32(0),) * len(tiles), *in_refs, o_gmem)

    def ignore(*_, **__):
        return None

    @functools.partial(
        pl.run_scoped,
        allocs=pipeline(ignore, ignore, a0.dtype, b0.dtype, 0, stages).get_allocations(a0, b0),
        out_smem=plgpu.SMEM((2, 2, TILE, epi_n), out_dtype, transforms=out_transforms),
        collective_axes="wg",
    )
    def _scope(allocs, out_smem):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop(tiles, collective_axes="sm")
        def _tiles(info):
            a_ref, b_ref, o_ref, first, steps, inv, run = tile_refs(info.index, *in_refs, o_gmem)

            def mma(_, a_smem, b_smem, acc_ref):
                b_t = plgpu.transpose_ref(b_smem.at[pl.ds(wg * TILE, TILE)], (1, 0))
                plgpu.wgmma(acc_ref, a_smem, b_t)
                plgpu.wgmma_wait(0)
                return acc_ref

            def context(run_pipeline):
                def acc_scope(acc_ref):
                    run_pipeline(acc_ref)
                    y = (acc_ref[...] * inv).astype(out_dtype)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    for j in range(TILE // epi_n):
                        slot = j % 2
                        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                        out_smem[wg, slot] = y[:, j * epi_n : (j + 1) * epi_n]
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(
                            out_smem.at[wg, slot],
                            o_ref.at[:, pl.ds(wg * TILE + j * epi_n, epi_n)],
                        )

                pl.run_scoped(acc_scope, plgpu.ACC((TILE, TILE), jnp.float32))

            @pl.when(run)
            def _():
                pipeline(mma, context, a_ref.dtype, b_ref.dtype, first, steps)(
                    a_ref, b_ref, allocations=allocs
                )

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _ws_launch(body, out_shape, out_dtype, *operands):
    import jax.experimental.pallas.mosaic_gpu as plgpu

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct(out_shape, out_dtype),
        grid=(_num_sms(),),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        kernel_name=KERNEL_NAME,
        compiler_params=_compiler_params(plgpu),
    )
    return unbatched(kernel)(*operands)


def _ws_nt(a_RxK, b_GxNxK, tile_group_T, inv, out_dtype):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    (r, k), n = a_RxK.shape, b_GxNxK.shape[1]
    kt = k_tile(a_RxK.dtype)

    def tile_refs(index, tile_group_gmem, inv_gmem, a_gmem, b_gmem, o_gmem):
        mi, ni = plgpu.planar_snake(index[0], (r // TILE, n // WS_COLS), 1, 8)
        group = tile_group_gmem[mi]
        rows, cols = pl.ds(mi * TILE, TILE), pl.ds(ni * WS_COLS, WS_COLS)
        b_ref = b_gmem.at[jnp.maximum(group, 0), cols]
        return a_gmem.at[rows], b_ref, o_gmem.at[rows, cols], 0, k // kt, inv_gmem[0], group >= 0

    body = functools.partial(
        _ws_kernel,
        plgpu=plgpu,
        pl=pl,
        tiles=((r // TILE) * (n // WS_COLS),),
        kt=kt,
        tile_refs=tile_refs,
        static_steps=k // kt,
    )
    return _ws_launch(body, (r, n), out_dtype, tile_group_T, inv, a_RxK, b_GxNxK)


def _ws_tn(a_KxR, b_NxR, first_tile_G, tiles_G, inv, out_dtype):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    (k, _), n, g = a_KxR.shape, b_NxR.shape[0], tiles_G.shape[0]
    kt = k_tile(a_KxR.dtype)
    per_tile = TILE // kt

    def tile_refs(index, first_gmem, tiles_gmem, inv_gmem, a_gmem, b_gmem, o_gmem):
        gi = index[0]
        ki, ni = plgpu.planar_snake(index[1], (k // TILE, n // WS_COLS), 1, 8)
        rows, cols = pl.ds(ki * TILE, TILE), pl.ds(ni * WS_COLS, WS_COLS)
        first, steps = first_gmem[gi] * per_tile, tiles_gmem[gi] * per_tile
        # An empty group runs no step: its tile stores the accumulator's zeros.
        return (
            a_gmem.at[rows],
            b_gmem.at[cols],
            o_gmem.at[gi, rows, cols],
            first,
            steps,
            (inv_gmem[0]),
            True,
        )

    body = functools.partial(
        _ws_kernel,
        plgpu=plgpu,
        pl=pl,
        tiles=(g, (k // TILE) * (n // WS_COLS)),
        kt=kt,
        tile_refs=tile_refs,
        static_steps=None,
    )
    return _ws_launch(body, (g, k, n), out_dtype, first_tile_G, tiles_G, inv, a_KxR, b_NxR)


@functools.cache
def mixed_fp8() -> bool:
    """Whether this JAX's Mosaic GPU takes E4M3 times E5M2 in one WGMMA (PTX does; older
    Mosaic GPU asks for one element type), probed by lowering a one-tile kernel for CUDA."""
    a = jax.ShapeDtypeStruct((TILE, TILE), jnp.float8_e4m3fn)
    b = jax.ShapeDtypeStruct((1, TILE, TILE), jnp.float8_e5m2)
    t = jax.ShapeDtypeStruct((1,), jnp.int32)
    s = jax.ShapeDtypeStruct((), jnp.float32)
    try:
        grouped_nt.trace(a, b, t, s).lower(lowering_platforms=("cuda",))
    except Exception:  # noqa: BLE001 - any refusal of the mixed pair means: convert
        return False
    return True


def pair(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The operands as the kernels take them: FP8 as they are where WGMMA takes the pair; an
    E4M3 with an E5M2 operand otherwise both in f16, which holds every value of either
    format exactly (the products, and so the result, are the same; the GEMM runs at f16 rate)."""
    if a.dtype == b.dtype or mixed_fp8():
        return a, b
    return a.astype(jnp.float16), b.astype(jnp.float16)


# bf16 (level O0): JAX's Mosaic GPU ragged-dot kernels.

_BF16_TUNING = {"block_m": 128, "block_n": 128, "block_k": 64, "max_concurrent_steps": 4}


def bf16_takes(x_MxK: jax.Array, w_GxKxN: jax.Array) -> bool:
    """Whether JAX's bf16 ragged-dot kernels run this GEMM: bf16 operands, whole 128 tiles of
    K and N, traced for a Hopper GPU (the kernels read the device's SM count as they trace)."""
    bf16 = jnp.dtype(jnp.bfloat16)
    return (
        x_MxK.dtype == bf16
        and w_GxKxN.dtype == bf16
        and takes(*w_GxKxN.shape[1:])
        and jax.default_backend() == "gpu"
        and enabled()
    )


def _ragged(a, b, gs, transpose_rhs: bool):
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    return ragged_dot_mgpu.ragged_dot(
        a, b, group_sizes=gs, transpose_rhs=transpose_rhs, grid_block_n=8, **_BF16_TUNING
    )


def _transposed_ragged(a_MxK, b_MxN, gs):
    from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu

    return transposed_ragged_dot_mgpu.transposed_ragged_dot(
        a_MxK, b_MxN, group_sizes=gs, grid_block_n=8, **_BF16_TUNING
    )


@jax.custom_vjp
def bf16_grouped_matmul(x_MxK: jax.Array, w_GxKxN: jax.Array, group_sizes_G: jax.Array):
    """``y`` [M, N] bf16 through JAX's Mosaic GPU ragged-dot kernels (forward, dgrad, wgrad)."""
    with jax.named_scope(BF16_KERNEL_NAME):
        y = _ragged(x_MxK, w_GxKxN, group_sizes_G, transpose_rhs=False)
    return valid_rows(y, group_sizes_G)  # the kernel leaves rows past the groups unwritten


def _bf16_fwd(x, w, gs):
    return bf16_grouped_matmul(x, w, gs), (x, w, gs)


def _bf16_bwd(res, g):
    x, w, gs = res
    g = g.astype(jnp.bfloat16)
    with jax.named_scope(BF16_KERNEL_NAME):
        dx = _ragged(g, w, gs, transpose_rhs=True)  # w[e] [K, N] read as [out K, contraction N]
        dw = _transposed_ragged(x, g, gs)
    return valid_rows(dx, gs).astype(x.dtype), dw.astype(w.dtype), None


bf16_grouped_matmul.defvjp(_bf16_fwd, _bf16_bwd)
