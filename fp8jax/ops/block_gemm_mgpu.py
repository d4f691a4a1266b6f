"""The block-scaled FP8 GEMM as a warp-specialized Mosaic GPU kernel for Hopper (sm_90a).

The contract is ``block_gemm``'s: ``y = a . b^T`` with a [M, K] and b [N, K] FP8 (K innermost,
the layout FP8 WGMMA takes), one f32 multiplier per row of a and per row of b for each
``block``-wide tile of K, and for each tile t in order::

    partial = dot(a[:, tile t], b[:, tile t]^T)              # f32, in the tensor cores
    acc = acc + (partial * a_inv[:, t][:, None]) * b_inv[:, t][None, :]

except that where b's multipliers come from ``block`` x ``block`` tiles (one per warpgroup and
tile of K) the two are multiplied first, ``partial * (a_inv * b_inv)``: one multiply per element
instead of two, and a result that can differ from the contract's in the last bit.

The kernel is persistent (one CTA per SM walks the output tiles) and warp-specialized: a memory
warpgroup streams each tile of K of a, b and their multipliers into shared memory through TMA,
``stages`` deep, while two compute warpgroups each own ``tile_m`` x ``tile_n`` of the CTA's
output. A compute warpgroup runs the WGMMA of one tile of K into a scratch accumulator of 64
rows, waits for it, and promotes it into its f32 accumulator with the two multipliers; while it
promotes, the other warpgroup's WGMMA keeps the tensor cores busy (DeepSeek-V3's promotion
every 128 of K). A warpgroup of 128 rows runs two 64-row WGMMAs a tile, promoting the first
while the second runs. The epilogue rounds to the output dtype and stores through shared memory
with TMA.

Registers bound the shapes: a compute warpgroup holds its accumulator (tile_m * tile_n / 128
f32 per thread) and its 64-row partials (tile_n / 2 each), within the 232 registers the
pipeline gives it, so tile_n is at most 128.

Operands must be whole tiles (``takes``); ``block_gemm`` pads the rest.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
from jax import lax

from fp8jax.ops import grouped_mgpu
from fp8jax.ops._kernel_launch import unbatched

__all__ = [
    "BLOCKS",
    "COMPUTE_WGS",
    "DEFAULT",
    "GROUP_ROWS",
    "KERNEL_NAME",
    "ROWS",
    "WGMMA_ROWS",
    "Tuning",
    "available",
    "block_scaled_dot",
    "grouped_nt",
    "grouped_tn",
    "takes",
    "tuning_for",
]

KERNEL_NAME = "fp8_block_scaled_dot"  # the Triton kernel's name too: coverage counts either
WGMMA_ROWS = 64  # rows of one FP8 WGMMA accumulator fragment (m64nNk32)
COMPUTE_WGS = 2  # compute warpgroups per CTA; a third warpgroup issues the TMA copies


@dataclasses.dataclass(frozen=True)
class Tuning:
    """One launch configuration of the kernel (benchmarks/block_gemm.py sweeps these)."""

    tile_m: int = 64  # output rows per compute warpgroup (64 or 128)
    tile_n: int = 128  # output columns per compute warpgroup
    wg_dim: str = "m"  # the compute warpgroups split the CTA's tile along "m" or "n"
    stages: int = 4  # tiles of K in flight in shared memory
    grid_minor: str = "n"  # launch order: output tiles walk "n" (or "m") fastest ...
    grid_width: int = 8  # ... in bands of this many tiles (L2 reuse)
    cluster: str | None = None  # two CTAs along "m" (or "n") share b's (a's) tiles by multicast
    epi_n: int = 64  # columns per epilogue store

    @property
    def cta(self) -> tuple[int, int]:
        """The CTA's output tile (rows, columns)."""
        two = COMPUTE_WGS
        return (
            self.tile_m * (two if self.wg_dim == "m" else 1),
            self.tile_n * (two if self.wg_dim == "n" else 1),
        )

    @property
    def cluster_tile(self) -> tuple[int, int]:
        """The output tile of one cluster (rows, columns)."""
        rows, cols = self.cta
        return (rows * (2 if self.cluster == "m" else 1), cols * (2 if self.cluster == "n" else 1))


# The fastest of benchmarks/block_gemm.py's sweep on an H200 (8192^3, bf16 out). With b in
# block x block tiles (fwd, dgrad) a warpgroup promotes with one multiplier per row (a's times
# b's block), and a 128 x 128 CTA of two 64-row warpgroups is fastest; with per-row multipliers
# of b (wgrad) each promotion multiplies twice, and a 128 x 256 CTA of two 128 x 128 warpgroups,
# which reads less per FLOP, wins.
BLOCKS = Tuning(tile_m=64, tile_n=128, wg_dim="m", stages=4, grid_width=16)
ROWS = Tuning(tile_m=128, tile_n=128, wg_dim="n", stages=3, grid_width=16)
DEFAULT = BLOCKS


def takes(m: int, n: int, k: int, block: int, tuning: Tuning = DEFAULT) -> bool:
    """Whether the kernel takes [m, k] . [n, k]^T as it is: whole cluster tiles and tiles of K."""
    rows, cols = tuning.cluster_tile
    return block == 128 and m % rows == 0 and n % cols == 0 and k % block == 0


def tuning_for(m: int, n: int, k: int, block: int, b_blocks: bool) -> Tuning | None:
    """The tuning for a GEMM's shape and b's multipliers, or None where no tuning tiles it."""
    for tuning in (BLOCKS,) if b_blocks else (ROWS, BLOCKS):
        if takes(m, n, k, block, tuning):
            return tuning
    return None


@functools.cache
def available() -> bool:
    """Whether the kernel can run: this JAX has Pallas' Mosaic GPU backend, and the GPU is a
    Hopper (WGMMA is sm_90a's), or no GPU is attached (lowering for CUDA elsewhere)."""
    try:
        import jax.experimental.pallas.mosaic_gpu  # noqa: F401
    except ImportError:  # pragma: no cover
        return False
    try:
        gpus = jax.devices("cuda")
    except RuntimeError:
        return True
    return str(getattr(gpus[0], "compute_capability", "9.0")).startswith("9.")


def _check(tuning: Tuning) -> None:
    ok = (
        tuning.tile_m in (64, 128)
        and tuning.tile_n in (64, 128)
        and tuning.wg_dim in ("m", "n")
        and tuning.grid_minor in ("m", "n")
        and tuning.cluster in (None, "m", "n")
        and tuning.stages >= 2
        and tuning.tile_n % tuning.epi_n == 0
    )
    if not ok:
        raise ValueError(f"block_gemm_mgpu: unsupported tuning {tuning}")


def _kernel(
    *refs,
    tuning: Tuning,
    block: int,
    scalar_b: bool,
    tiles: tuple[int, ...],
    work,
    static_steps: int | None,
):
    """The kernel body. ``refs`` are the inputs, then the output; for each work item of the
    grid ``tiles`` (walked by every CTA of the launch in turn), ``work(index, cta, *refs)``
    gives ``(a [cta_m, C], b [cta_n, C], a_s [C / block, cta_m], b_s [C / block, cta_n],
    out [cta_m, cta_n], first, steps, run)``: the tiles of the contraction ``first`` ..
    ``first + steps`` of a and b are multiplied into ``out`` where ``run``. ``static_steps``:
    the steps when every work item has the same number, else None (a dynamic trip count)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    *in_refs, out_gmem = refs
    out_dtype = out_gmem.dtype
    tile_m, tile_n, epi_n = tuning.tile_m, tuning.tile_n, tuning.epi_n
    cta_m, cta_n = tuning.cta
    # The shared-memory stages: the allocation below and every work item's pipeline agree.
    steps_alloc = tuning.stages if static_steps is None else static_steps

    # FP8 tiles are 128 bytes wide along K: 128-byte swizzle, 8-row tiling (WGMMA's layout).
    swizzle = plgpu.find_swizzle(block * 8)
    fp8_transforms = (plgpu.TilingTransform((8, swizzle)), plgpu.SwizzleTransform(swizzle))
    out_bytes = jnp.dtype(out_dtype).itemsize
    out_swizzle = plgpu.find_swizzle(epi_n * out_bytes * 8)
    out_transforms = (
        plgpu.TilingTransform((8, out_swizzle // out_bytes)),
        plgpu.SwizzleTransform(out_swizzle),
    )
    a_shared = ("cluster",) if tuning.cluster == "n" else ()  # a's rows serve both CTAs
    b_shared = ("cluster",) if tuning.cluster == "m" else ()

    def operand(rows: int, shared: tuple, first):
        """The pipeline's specs of one operand: its [rows, block] FP8 tile of K and that tile's
        multipliers [1, rows], multicast over the cluster where ``shared``."""
        tile = plgpu.BlockSpec(
            (rows, block),
            lambda t: (0, first + t),
            transforms=fp8_transforms,
            memory_space=plgpu.SMEM,
            collective_axes=shared,
        )
        scales = plgpu.BlockSpec(
            (1, rows), lambda t: (first + t, 0), memory_space=plgpu.SMEM, collective_axes=shared
        )
        return tile, scales

    def pipeline(body, context, first, steps):
        (a_spec, a_s_spec), (b_spec, b_s_spec) = (
            operand(cta_m, a_shared, first),
            operand(cta_n, b_shared, first),
        )
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(steps,),
            memory_registers=40,
            in_specs=[a_spec, b_spec, a_s_spec, b_s_spec],
            wg_axis="wg",
            num_compute_wgs=COMPUTE_WGS,
            max_concurrent_steps=tuning.stages,
            compute_context=context,
        )

    def ignore(*_, **__):
        return None

    a0, b0, a_s0, b_s0, *_ = work((jnp.int32(0),) * len(tiles), jnp.int32(0), *refs)

    @functools.partial(
        pl.run_scoped,
        allocs=pipeline(ignore, ignore, 0, steps_alloc).get_allocations(a0, b0, a_s0, b_s0),
        out_smem=plgpu.SMEM(
            (COMPUTE_WGS, 2, WGMMA_ROWS, epi_n), out_dtype, transforms=out_transforms
        ),
        collective_axes="wg",
    )
    def _scope(allocs, out_smem):
        wg = lax.axis_index("wg")
        cta = lax.axis_index("cluster")

        @plgpu.nd_loop(tiles, collective_axes="cluster_grid")
        def _tiles(info):
            a_ref, b_ref, a_s_ref, b_s_ref, out_ref, first, steps, run = work(
                info.index, cta, *refs
            )
            wg_rows = pl.ds(wg * tile_m, tile_m) if tuning.wg_dim == "m" else pl.ds(0, tile_m)
            wg_cols = pl.ds(wg * tile_n, tile_n) if tuning.wg_dim == "n" else pl.ds(0, tile_n)
            subs = tile_m // WGMMA_ROWS
            ROW, COL = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)

            def scales(a_s_smem, b_s_smem, rows):
                """A sub-tile's multipliers: per row [64] (a's, times b's block multiplier with
                ``scalar_b``), and b's per column [tile_n] otherwise (None)."""
                a_s = _load(plgpu, a_s_smem.at[0, rows], ROW)
                if scalar_b:  # this warpgroup's columns lie in one b block: 64 copies of it
                    b_one = _load(plgpu, b_s_smem.at[0, pl.ds(wg_cols.start, WGMMA_ROWS)], ROW)
                    return a_s * b_one, None
                return a_s, _load(plgpu, b_s_smem.at[0, wg_cols], COL)

            def promote(acc, partial, a_s, b_s):
                shape = (WGMMA_ROWS, tile_n)
                scaled = partial * lax.broadcast_in_dim(a_s, shape, [0])
                if b_s is not None:
                    scaled = scaled * lax.broadcast_in_dim(b_s, shape, [1])
                return acc + scaled

            def body(_, a_smem, b_smem, a_s_smem, b_s_smem, acc):
                acc = list(acc)
                b_t = plgpu.transpose_ref(b_smem.at[wg_cols], (1, 0))  # [block, tile_n], K-major
                pending = None  # (sub-tile, partial, multipliers) awaiting promotion
                for i in range(subs):  # a 64-row WGMMA each; the previous one promoted meanwhile
                    rows = pl.ds(wg_rows.start + i * WGMMA_ROWS, WGMMA_ROWS)

                    def mma(tmp_ref, rows=rows, pending=pending):
                        plgpu.wgmma(tmp_ref, a_smem.at[rows], b_t)
                        promoted = (
                            None if pending is None else promote(acc[pending[0]], *pending[1:])
                        )
                        return tmp_ref[...], scales(a_s_smem, b_s_smem, rows), promoted

                    partial, (a_s, b_s), promoted = pl.run_scoped(
                        mma, plgpu.ACC((WGMMA_ROWS, tile_n), jnp.float32)
                    )
                    if pending is not None:
                        acc[pending[0]] = promoted
                    pending = (i, partial, a_s, b_s)
                acc[pending[0]] = promote(acc[pending[0]], *pending[1:])
                return tuple(acc)

            def context(run_pipeline):
                # The accumulators: 64-row f32 fragments in WGMMA's register layout (zero
                # where the work item has no step: an empty group's tile of wgrad).
                zero = plgpu.layout_cast(
                    jnp.zeros((WGMMA_ROWS, tile_n), jnp.float32), plgpu.Layout.WGMMA
                )
                acc = run_pipeline((zero,) * subs)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                slot = 0
                for i in range(subs):
                    y = acc[i].astype(out_dtype)
                    for j in range(tile_n // epi_n):
                        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                        out_smem[wg, slot] = y[:, j * epi_n : (j + 1) * epi_n]
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(
                            out_smem.at[wg, slot],
                            out_ref.at[pl.ds(wg_rows.start + i * WGMMA_ROWS, WGMMA_ROWS)].at[
                                :, pl.ds(wg_cols.start + j * epi_n, epi_n)
                            ],
                        )
                        slot = 1 - slot

            def launch():
                pipeline(body, context, first, steps)(
                    a_ref, b_ref, a_s_ref, b_s_ref, allocations=allocs
                )

            if run is True:  # every work item runs (the dense GEMM)
                launch()
            else:
                pl.when(run)(launch)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _cta_tile(lin, m: int, n: int, tuning: Tuning, cta=None):
    """``(rows, columns)`` of an [m, n] output that work item ``lin`` of the planar-snake launch
    order gives a CTA (the two CTAs of a cluster take neighbouring tiles, ``cta`` its index)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    cta_m, cta_n = tuning.cta
    cl_m, cl_n = tuning.cluster_tile
    mi, ni = plgpu.planar_snake(
        lin, (m // cl_m, n // cl_n), 0 if tuning.grid_minor == "m" else 1, tuning.grid_width
    )
    if tuning.cluster == "m":
        mi = mi * 2 + cta
    elif tuning.cluster == "n":
        ni = ni * 2 + cta
    return pl.ds(mi * cta_m, cta_m), pl.ds(ni * cta_n, cta_n)


def _dense_work(index, cta, a_gmem, b_gmem, a_s_gmem, b_s_gmem, out_gmem, *, tuning: Tuning):
    """The dense GEMM's work item: output tile ``index``, over every tile of K."""
    rows, cols = _cta_tile(index[0], a_gmem.shape[0], b_gmem.shape[0], tuning, cta)
    return (
        a_gmem.at[rows],
        b_gmem.at[cols],
        a_s_gmem.at[:, rows],
        b_s_gmem.at[:, cols],
        out_gmem.at[rows, cols],
        0,
        a_s_gmem.shape[0],  # every tile of K
        True,
    )


def _load(plgpu, ref, layout):
    """``ref`` read into registers in ``layout`` (older JAX takes the index positionally)."""
    needs_idx = inspect.signature(plgpu.load).parameters["idx"].default is inspect.Parameter.empty
    return plgpu.load(ref, (), layout=layout) if needs_idx else plgpu.load(ref, layout=layout)


def _num_sms() -> int:
    from jax.extend import backend

    return getattr(backend.get_default_device(), "core_count", 132)  # CPUs trace only


def block_scaled_dot(
    a_MxK: jax.Array,
    a_inv_TxM: jax.Array,
    b_NxK: jax.Array,
    b_inv_TxN: jax.Array,
    *,
    block: int = 128,
    out_dtype=jnp.bfloat16,
    b_blocks: bool = False,
    tuning: Tuning = DEFAULT,
) -> jax.Array:
    """``y`` [M, N] by the contract, with the multipliers transposed: a's [T, M], b's [T, N].

    The operands must be whole tiles (``takes``); one multiplier per row of b and tile, which
    with ``b_blocks`` repeats each ``block`` x ``block`` tile's multiplier along its rows (a
    warpgroup then reads one multiplier of b per tile and promotes with a * b per row).
    """
    _check(tuning)
    (m, k), n = a_MxK.shape, b_NxK.shape[0]
    if not takes(m, n, k, block, tuning):
        raise ValueError(
            f"block_gemm_mgpu: [{m}, {k}] . [{n}, {k}]^T with block {block} is not whole "
            f"{tuning.cluster_tile} tiles and tiles of K"
        )
    out_dtype = jnp.dtype(out_dtype)
    with jax.named_scope(KERNEL_NAME):  # the custom call's name stack, which coverage reads
        return _launch(
            a_MxK,
            b_NxK,
            jnp.asarray(a_inv_TxM, jnp.float32),
            jnp.asarray(b_inv_TxN, jnp.float32),
            block=block,
            out_dtype=out_dtype,
            scalar_b=b_blocks and block % tuning.tile_n == 0,
            tuning=tuning,
        )


@functools.partial(jax.jit, static_argnames=("block", "out_dtype", "scalar_b", "tuning"))
def _launch(a_MxK, b_NxK, a_s_TxM, b_s_TxN, *, block, out_dtype, scalar_b, tuning):
    """The kernel's launch, jitted: every call of one shape, dtype and tuning in a program
    shares one traced and lowered kernel (a model's layers lower it once, not once a layer)."""
    (m, k), n = a_MxK.shape, b_NxK.shape[0]
    cl_m, cl_n = tuning.cluster_tile
    cluster = 2 if tuning.cluster else 1
    body = functools.partial(
        _kernel,
        tuning=tuning,
        block=block,
        scalar_b=scalar_b,
        tiles=((m // cl_m) * (n // cl_n),),
        work=functools.partial(_dense_work, tuning=tuning),
        static_steps=k // block,
    )
    # Batched (vmapped replicas under tensor parallelism): one launch per batch element.
    launch = unbatched(_kernel_call(body, (m, n), out_dtype, cluster))
    return launch(a_MxK, b_NxK, a_s_TxM, b_s_TxN)


def _kernel_call(body, out_shape: tuple[int, ...], out_dtype, cluster: int = 1):
    """``body`` as a persistent launch: as many CTAs as SMs, in clusters of ``cluster``."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct(out_shape, out_dtype),
        grid=(_num_sms() // cluster,),
        grid_names=("cluster_grid",),
        cluster=(cluster,),
        cluster_names=("cluster",),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        kernel_name=KERNEL_NAME,
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )


# Grouped GEMMs of expert layers on ``grouped_mgpu``'s padded layout (every group's rows start
# at a multiple of ``grouped_mgpu.TILE`` = 128 rows): a CTA's 128 rows, or a tile of 128 rows of
# the contraction, then belong to one group.

GROUP_ROWS = grouped_mgpu.TILE  # the layout's row tile: one CTA's rows, one tile of contraction


def _nt_work(index, cta, tile_group_gmem, a_gmem, b_gmem, a_s_gmem, b_s_gmem, out_gmem, *, tuning):
    """``grouped_nt``'s work item: output tile ``index``, its rows' group from the table."""
    del cta
    rows, cols = _cta_tile(index[0], a_gmem.shape[0], b_gmem.shape[1], tuning)
    group = tile_group_gmem[rows.start // GROUP_ROWS]
    g = jnp.maximum(group, 0)
    return (
        a_gmem.at[rows],
        b_gmem.at[g, cols],
        a_s_gmem.at[:, rows],
        b_s_gmem.at[g, :, cols],
        out_gmem.at[rows, cols],
        0,
        a_s_gmem.shape[0],
        group >= 0,
    )


def _tn_work(
    index, cta, first_gmem, tiles_gmem, a_gmem, b_gmem, a_s_gmem, b_s_gmem, out_gmem, *, tuning
):
    """``grouped_tn``'s work item: group ``index[0]``'s output tile ``index[1]``, over the tiles
    of rows its group holds (none for an empty group: its tile stores zeros)."""
    del cta
    gi, lin = index
    rows, cols = _cta_tile(lin, a_gmem.shape[0], b_gmem.shape[0], tuning)
    return (
        a_gmem.at[rows],
        b_gmem.at[cols],
        a_s_gmem.at[:, rows],
        b_s_gmem.at[:, cols],
        out_gmem.at[gi].at[rows, cols],
        first_gmem[gi],
        tiles_gmem[gi],
        True,
    )


def _grouped_tuning(rows: int, n: int, k: int, b_blocks: bool) -> Tuning:
    """``block_scaled_dot``'s tuning of a grouped [rows, k] . [n, k]^T, with CTAs of at most
    one group tile of rows; one error where none tiles it."""
    tuning = tuning_for(rows, n, k, GROUP_ROWS, b_blocks)
    if tuning is None or tuning.cta[0] > GROUP_ROWS:
        raise ValueError(
            f"block_gemm_mgpu: a grouped [{rows}, {k}] . [{n}, {k}]^T is not whole "
            f"{GROUP_ROWS} x {GROUP_ROWS} tiles: pad the rows by grouped_mgpu.layout"
        )
    return tuning


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def grouped_nt(
    a_RxK: jax.Array,
    a_s_TxR: jax.Array,
    b_GxNxK: jax.Array,
    b_s_GxTxN: jax.Array,
    tile_group_T: jax.Array,
    *,
    out_dtype=jnp.bfloat16,
) -> jax.Array:
    """``y`` [R, N]: each tile of 128 rows of a times its group's ``b^T`` by the contract (b's
    multipliers from 128 x 128 blocks, repeated per row); tiles of group -1 are not written."""
    (r, k), n = a_RxK.shape, b_GxNxK.shape[1]
    tuning = _grouped_tuning(r, n, k, True)
    body = functools.partial(
        _kernel,
        tuning=tuning,
        block=GROUP_ROWS,
        scalar_b=GROUP_ROWS % tuning.tile_n == 0,
        tiles=((r // tuning.cta[0]) * (n // tuning.cta[1]),),
        work=functools.partial(_nt_work, tuning=tuning),
        static_steps=k // GROUP_ROWS,
    )
    with jax.named_scope(KERNEL_NAME):
        launch = unbatched(_kernel_call(body, (r, n), jnp.dtype(out_dtype)))
        return launch(
            tile_group_T,
            a_RxK,
            b_GxNxK,
            a_s_TxR.astype(jnp.float32),
            b_s_GxTxN.astype(jnp.float32),
        )


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def grouped_tn(
    a_KxR: jax.Array,
    a_s_TxK: jax.Array,
    b_NxR: jax.Array,
    b_s_TxN: jax.Array,
    first_tile_G: jax.Array,
    tiles_G: jax.Array,
    *,
    out_dtype=jnp.float32,
) -> jax.Array:
    """``out`` [G, K, N]: per group, a^T's and b^T's columns of its tiles of rows contracted by
    the contract (one multiplier per row of a^T and of b^T and tile of rows); 0 for an empty
    group."""
    (k, _), n, g = a_KxR.shape, b_NxR.shape[0], tiles_G.shape[0]
    tuning = _grouped_tuning(k, n, GROUP_ROWS, False)
    body = functools.partial(
        _kernel,
        tuning=tuning,
        block=GROUP_ROWS,
        scalar_b=False,
        tiles=(g, (k // tuning.cta[0]) * (n // tuning.cta[1])),
        work=functools.partial(_tn_work, tuning=tuning),
        static_steps=None,
    )
    with jax.named_scope(KERNEL_NAME):
        launch = unbatched(_kernel_call(body, (g, k, n), jnp.dtype(out_dtype)))
        return launch(
            first_tile_G,
            tiles_G,
            a_KxR,
            b_NxR,
            a_s_TxK.astype(jnp.float32),
            b_s_TxN.astype(jnp.float32),
        )
