"""The grouped GEMMs' Hopper kernels (``ops.grouped_mgpu``, and the block-scaled ones of
``ops.block_gemm_mgpu`` that ``ops.grouped_block`` runs) as far as a CPU can check them.

The padded layout against its definition (each group at a tile boundary, zeros between groups,
rows past the groups dropped); the kernels' operands (transposes, the E4M3 x E5M2 pair, the
block multipliers' layouts) with the kernels replaced by plain-JAX tile products of the same
contracts, against the references; the per-tensor VJP on the padded layout against the unpadded
one; the per-tensor and block recipes' expert steps lowered for CUDA run the three FP8 kernels,
while shapes that are not whole tiles, 64-wide blocks and rowwise do not. On a Hopper GPU the
kernels themselves run against the references (skipped elsewhere); ``benchmarks/grouped_gemm.py``
times them and reports their errors against bf16.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax.diagnostics import coverage
from fp8jax.ops import formats, grouped
from fp8jax.ops import grouped_mgpu as gm

TILE = gm.TILE
SIZES = (7, 0, 130, 1)  # an empty group, one over a tile, one of one row
M = sum(SIZES) + 5  # five rows past the groups, as a dropless dispatch pads
KERNEL_CALL = re.compile(r"stablehlo\.custom_call @mosaic_gpu\w*")


def _gs() -> jax.Array:
    return jnp.asarray(SIZES, jnp.int32)


def test_layout_starts_each_group_at_a_tile_and_drops_the_rows_past_the_groups():
    lay = gm.layout(_gs(), M)
    assert lay.rows % TILE == 0 and lay.rows >= M
    tiles = [-(-s // TILE) for s in SIZES]
    np.testing.assert_array_equal(lay.tiles_G, tiles)
    np.testing.assert_array_equal(lay.first_tile_G, np.cumsum(tiles) - tiles)
    want_group_T = np.full(lay.rows // TILE, -1)
    for g, (first, n) in enumerate(zip(np.cumsum(tiles) - tiles, tiles, strict=True)):
        want_group_T[first : first + n] = g
    np.testing.assert_array_equal(lay.tile_group_T, want_group_T)
    rows = np.arange(M, dtype=np.float32)[:, None] + 1  # row i holds i + 1: 0 marks padding
    padded = np.asarray(gm.pad_rows(jnp.asarray(rows), lay))[:, 0]
    start = 0
    for g, size in enumerate(SIZES):
        at = int(lay.first_tile_G[g]) * TILE
        np.testing.assert_array_equal(padded[at : at + size], rows[start : start + size, 0])
        start += size
    assert np.count_nonzero(padded) == sum(SIZES)  # the rest is 0, rows past the groups too
    back = np.asarray(gm.unpad_rows(gm.pad_rows(jnp.asarray(rows), lay), lay))[:, 0]
    np.testing.assert_array_equal(back[: sum(SIZES)], rows[: sum(SIZES), 0])
    assert not back[sum(SIZES) :].any()


def _nt_tiles(a_RxK, b_GxNxK, tile_group_T, inv_scale, *, out_dtype, warp_specialized=None):
    """``grouped_nt``'s contract in plain JAX: each tile of rows times its group's b^T."""
    del warp_specialized
    t = tile_group_T.shape[0]
    a = a_RxK.astype(jnp.float32).reshape(t, TILE, -1)
    b = b_GxNxK.astype(jnp.float32)[jnp.maximum(tile_group_T, 0)]
    y = jnp.einsum("tmk,tnk->tmn", a, b) * (tile_group_T >= 0)[:, None, None]
    return (y.reshape(t * TILE, -1) * inv_scale).astype(out_dtype)


def _tn_tiles(a_KxR, b_NxR, first_tile_G, tiles_G, inv_scale, *, out_dtype, warp_specialized=None):
    """``grouped_tn``'s contract in plain JAX: per group, the product over its tiles of rows."""
    del warp_specialized
    t = a_KxR.shape[1] // TILE
    tile_T = jnp.arange(t)
    member_GxT = (tile_T >= first_tile_G[:, None]) & (tile_T < (first_tile_G + tiles_G)[:, None])
    a = a_KxR.astype(jnp.float32).reshape(a_KxR.shape[0], t, TILE)
    b = b_NxR.astype(jnp.float32).reshape(b_NxR.shape[0], t, TILE)
    out = jnp.einsum("gt,ktr,ntr->gkn", member_GxT.astype(jnp.float32), a, b)
    return (out * inv_scale).astype(out_dtype)


@pytest.fixture
def tile_kernels(monkeypatch):
    monkeypatch.setattr(gm, "grouped_nt", _nt_tiles)
    monkeypatch.setattr(gm, "grouped_tn", _tn_tiles)


@pytest.mark.parametrize("dy_fmt", ["e4m3", "e5m2"])
def test_the_kernels_operands_give_the_reference_gemms(tile_kernels, dy_fmt):
    """``padded_kernel`` (operands as the kernels take them, E4M3 x E5M2 paired) with the two
    kernels' contracts in plain JAX equals ``padded_reference`` for the three GEMMs."""
    k, n = 24, 40
    rng = np.random.default_rng(0)
    e4m3, dy_dtype = jnp.float8_e4m3fn, formats.FORMATS[dy_fmt]
    lay = gm.layout(_gs(), M)
    x = gm.pad_rows(jnp.asarray(rng.standard_normal((M, k)), e4m3), lay)
    w = jnp.asarray(rng.standard_normal((len(SIZES), k, n)), e4m3)
    dy = gm.pad_rows(jnp.asarray(rng.standard_normal((M, n)), dy_dtype), lay)
    inv = jnp.float32(0.375)
    cases = {
        grouped.FORWARD: (x, jnp.swapaxes(w, 1, 2)),
        grouped.DGRAD: (dy, w),
        grouped.WGRAD: (x.T, dy.T),
    }
    for kind, (a, b) in cases.items():
        got = np.asarray(grouped.padded_kernel(kind, a, b, lay, inv, jnp.float32))
        want = np.asarray(grouped.padded_reference(kind, a, b, lay, inv, jnp.float32))
        assert got.shape == want.shape, kind
        # The same exact FP8 products in f32, summed in another order: within f32's rounding of
        # the sum of |terms| (at most k, n or R terms).
        bound = lay.rows * np.finfo(np.float32).eps * np.abs(want).max()
        np.testing.assert_allclose(got, want, rtol=0, atol=bound, err_msg=kind)
        if kind == grouped.WGRAD:
            assert not got[1].any()  # the empty group's gradient is 0


def _block_nt(a_RxK, a_s_TxR, b_GxNxK, b_s_GxTxN, tile_group_T, *, out_dtype):
    """``block_gemm_mgpu.grouped_nt``'s contract in plain JAX: per tile of rows and tile of K,
    the partial product times a's row and b's row multipliers, summed in f32."""
    t, tk = tile_group_T.shape[0], a_s_TxR.shape[0]
    a = a_RxK.astype(jnp.float32).reshape(t, TILE, tk, TILE)
    g = jnp.maximum(tile_group_T, 0)
    b = b_GxNxK.astype(jnp.float32)[g].reshape(t, -1, tk, TILE)
    partial = jnp.einsum("imsk,insk->ismn", a, b)
    a_s = jnp.transpose(a_s_TxR.reshape(tk, t, TILE), (1, 0, 2))[..., None]  # [t, tk, 128, 1]
    b_s = b_s_GxTxN[g][:, :, None, :]  # [t, tk, 1, N]
    y = jnp.sum(partial * a_s * b_s, axis=1) * (tile_group_T >= 0)[:, None, None]
    return y.reshape(t * TILE, -1).astype(out_dtype)


def _block_tn(a_KxR, a_s_TxK, b_NxR, b_s_TxN, first_tile_G, tiles_G, *, out_dtype):
    """``block_gemm_mgpu.grouped_tn``'s contract in plain JAX: per group, over its tiles of
    rows, each partial product times a^T's and b^T's row multipliers."""
    t = a_KxR.shape[1] // TILE
    tile_T = jnp.arange(t)
    member_GxT = (tile_T >= first_tile_G[:, None]) & (tile_T < (first_tile_G + tiles_G)[:, None])
    a = a_KxR.astype(jnp.float32).reshape(a_KxR.shape[0], t, TILE)
    b = b_NxR.astype(jnp.float32).reshape(b_NxR.shape[0], t, TILE)
    partial = jnp.einsum("ktr,ntr->tkn", a, b) * a_s_TxK[:, :, None] * b_s_TxN[:, None, :]
    return jnp.einsum("gt,tkn->gkn", member_GxT.astype(jnp.float32), partial).astype(out_dtype)


@pytest.mark.parametrize("dy_fmt", ["e4m3", "e5m2"])
def test_the_block_kernels_operands_give_the_reference_gemms(monkeypatch, dy_fmt):
    """``grouped_block.padded_kernel`` (multipliers transposed, w's blocks repeated per row)
    with the grouped block kernels' contracts in plain JAX equals ``padded_reference`` for the
    three GEMMs, with two tiles of K and of N (each block's multiplier at its own place)."""
    from fp8jax.ops import block_gemm_mgpu, grouped_block

    monkeypatch.setattr(block_gemm_mgpu, "grouped_nt", _block_nt)
    monkeypatch.setattr(block_gemm_mgpu, "grouped_tn", _block_tn)
    k, n = 2 * TILE, 2 * TILE
    rng = np.random.default_rng(3)
    e4m3, dy_dtype = jnp.float8_e4m3fn, formats.FORMATS[dy_fmt]
    lay = gm.layout(_gs(), M)
    r, g = lay.rows, len(SIZES)

    def inv(*shape):
        return jnp.asarray(
            2.0 ** rng.integers(-6, 6, shape) * rng.uniform(1, 2, shape), jnp.float32
        )

    x = gm.pad_rows(jnp.asarray(rng.standard_normal((M, k)), e4m3), lay)
    dy = gm.pad_rows(jnp.asarray(rng.standard_normal((M, n)), dy_dtype), lay)
    w = jnp.asarray(rng.standard_normal((g, k, n)), e4m3)
    w_inv = inv(g, k // TILE, n // TILE)
    cases = {
        grouped.FORWARD: (x, inv(r, k // TILE), jnp.swapaxes(w, 1, 2), jnp.swapaxes(w_inv, 1, 2)),
        grouped.DGRAD: (dy, inv(r, n // TILE), w, w_inv),
        grouped.WGRAD: (x.T, inv(k, r // TILE), dy.T, inv(n, r // TILE)),
    }
    for kind, args in cases.items():
        got = np.asarray(grouped_block.padded_kernel(kind, *args, lay, jnp.float32))
        want = np.asarray(grouped_block.padded_reference(kind, *args, lay, jnp.float32))
        assert got.shape == want.shape, kind
        bound = r * np.finfo(np.float32).eps * np.abs(want).max()  # products and sums in f32
        np.testing.assert_allclose(got, want, rtol=0, atol=bound, err_msg=kind)
        assert np.abs(want).max() > 0
        if kind == grouped.WGRAD:
            assert not got[1].any()  # the empty group's gradient is 0


@pytest.mark.skipif(
    jax.default_backend() != "gpu" or not gm.available(),
    reason="the Mosaic GPU kernels need a Hopper GPU",
)
@pytest.mark.parametrize("scaled", ["per-tensor", "block"])
def test_hopper_kernels_equal_the_reference(scaled):
    """On a Hopper GPU, the grouped kernels (per-tensor ``grouped_nt``/``grouped_tn`` and the
    block-scaled ones) against their XLA references on the same FP8 operands, f32 out: within
    the tensor cores' accumulation inside a 128-wide tile (measured 3.6e-4 of the largest
    value at K = 2048), the empty group's gradient 0."""
    from fp8jax.ops import grouped_block

    k, n = 2 * TILE, 2 * TILE
    rng = np.random.default_rng(4)
    e4m3 = jnp.float8_e4m3fn
    lay = gm.layout(_gs(), M)
    r, g = lay.rows, len(SIZES)
    x = gm.pad_rows(jnp.asarray(rng.standard_normal((M, k)), e4m3), lay)
    dy = gm.pad_rows(jnp.asarray(rng.standard_normal((M, n)), e4m3), lay)
    w = jnp.asarray(rng.standard_normal((g, k, n)), e4m3)
    filled = np.asarray(gm.layout_rows(lay))
    if scaled == "block":
        inv = lambda *shape: jnp.asarray(rng.uniform(0.5, 2.0, shape), jnp.float32)  # noqa: E731
        w_inv = inv(g, k // TILE, n // TILE)
        cases = {
            grouped.FORWARD: (
                x,
                inv(r, k // TILE),
                jnp.swapaxes(w, 1, 2),
                jnp.swapaxes(w_inv, 1, 2),
            ),
            grouped.DGRAD: (dy, inv(r, n // TILE), w, w_inv),
            grouped.WGRAD: (x.T, inv(k, r // TILE), dy.T, inv(n, r // TILE)),
        }
        pair = grouped_block.padded_kernel, grouped_block.padded_reference
        run = lambda f, kind, args: f(kind, *args, lay, jnp.float32)  # noqa: E731
    else:
        cases = {
            grouped.FORWARD: (x, jnp.swapaxes(w, 1, 2)),
            grouped.DGRAD: (dy, w),
            grouped.WGRAD: (x.T, dy.T),
        }
        pair = grouped.padded_kernel, grouped.padded_reference
        run = lambda f, kind, args: f(kind, *args, lay, 0.375, jnp.float32)  # noqa: E731
    for kind, args in cases.items():
        got, want = (np.asarray(run(f, kind, args)) for f in pair)
        if kind != grouped.WGRAD:  # the kernels leave the tiles past the groups unwritten
            got, want = got[filled], want[filled]
        else:
            assert not got[1].any()
        # The measured 3.6e-4 (and the dense block kernel's 3.3e-4 from an f64 product) with
        # about 5x headroom; a wrong multiplier or tile moves the result by whole percents.
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-3 * np.abs(want).max(), err_msg=kind)


@pytest.mark.parametrize("name", ["delayed", "current"])
def test_the_padded_layout_gives_the_unpadded_vjp(name):
    """A per-tensor expert GEMM of whole tiles runs on the padded layout (on a CPU with XLA's
    GEMMs): y, dx, dw and the recorded amaxes equal those of the unpadded path."""
    recipe = fp8jax.make_recipe(name)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((M, TILE)), jnp.float32)
    x = x.at[sum(SIZES) :].set(1e4)  # rows past the groups: in no GEMM and no amax
    w = jnp.asarray(rng.standard_normal((len(SIZES), TILE, TILE)) * 0.1, jnp.float32)
    w = w.at[-1].multiply(3.0)  # the stack's amax is the last group's: each group counts
    g = jnp.asarray(rng.standard_normal((M, TILE)), jnp.float32)
    meta = fp8jax.init_meta(recipe)
    assert grouped.padded(x, w) and not grouped.padded(x[:, :64], w[:, :64])

    def step(x, w, meta):
        def f(x, w, meta):
            return grouped.grouped_matmul(x, w, _gs(), recipe, meta)

        (y, new_meta), vjp = jax.vjp(f, x, w, meta)
        dx, dw, _ = vjp((g, jax.tree.map(jnp.zeros_like, new_meta)))
        return y, dx, dw, new_meta

    got = jax.jit(step)(x, w, meta)
    with gm.reference_only():  # a new function: jit's cache would return the padded program
        want = jax.jit(lambda *args: step(*args))(x, w, meta)
    for name_, a, b in zip(("y", "dx", "dw"), got[:3], want[:3], strict=True):
        a, b = np.asarray(a), np.asarray(b)
        bound = M * np.finfo(np.float32).eps * np.abs(b).max()  # summation order only
        np.testing.assert_allclose(a, b, rtol=0, atol=bound, err_msg=name_)
    assert not np.asarray(got[0])[sum(SIZES) :].any()
    for a, b in zip(jax.tree.leaves(got[3]), jax.tree.leaves(want[3]), strict=True):
        np.testing.assert_array_equal(a, b)
    pending_w = np.asarray(got[3].w.amax_history)[..., 0]
    np.testing.assert_array_equal(pending_w, np.abs(np.asarray(w)).max())


@pytest.mark.parametrize("name", ["delayed", "current"])
def test_decoding_forward_equals_the_training_forward(name):
    """The decoding forward on the stack's E4M3 copy (``decode_copy``: w^T) gives the training
    forward's y on sorted rows and on rows in a given padded layout (0 in its padding rows), and
    for widths that are not whole tiles; for CUDA, whole tiles lower the FP8 kernel, no
    ``ragged_dot``."""
    recipe = fp8jax.make_recipe(name)
    rng = np.random.default_rng(6)
    meta = fp8jax.init_meta(recipe)
    lay = gm.layout(_gs(), M)
    for k, n in ((TILE, 2 * TILE), (TILE, TILE + 64)):
        x = jnp.asarray(rng.standard_normal((M, k)), jnp.float32)
        x = x.at[sum(SIZES) :].set(1e4)  # rows past the groups: in no GEMM and no amax
        w = jnp.asarray(rng.standard_normal((len(SIZES), k, n)) * 0.1, jnp.float32)
        if name == "delayed":  # a committed scale: the training forward's first step
            _, meta = grouped.grouped_matmul(x, w, _gs(), recipe, meta)
            meta = fp8jax.update_state(meta, jax.tree.map(jnp.zeros_like, meta))
        want = np.asarray(grouped.grouped_matmul(x, w, _gs(), recipe, meta)[0])
        copy = grouped.decode_copy(recipe, w, meta.w)
        assert copy.q.shape == (len(SIZES), n, k)

        def decode(x, gs, layout=None):
            return grouped.tensor_grouped_forward(
                x, copy.q, copy.scale, gs, meta, jnp.float32, layout
            )

        got = np.asarray(decode(x, _gs()))
        bound = k * np.finfo(np.float32).eps * np.abs(want).max()  # summation order only
        np.testing.assert_allclose(got, want, rtol=0, atol=bound, err_msg=f"{k}x{n}")
        assert not got[sum(SIZES) :].any()
        whole = n % TILE == 0
        if whole:
            padded = np.asarray(decode(gm.pad_rows(x, lay), grouped.padded_sizes(lay), lay))
            dst = np.asarray(lay.dst_M)[: sum(SIZES)]
            np.testing.assert_allclose(padded[dst], want[: sum(SIZES)], rtol=0, atol=bound)
            assert not padded[~np.asarray(gm.layout_rows(lay))].any()
        text = (
            jax.jit(decode)
            .trace(jax.ShapeDtypeStruct(x.shape, jnp.bfloat16), _gs())
            .lower(lowering_platforms=("cuda",))
            .as_text()
        )
        assert bool(KERNEL_CALL.search(text)) == whole and ("ragged_dot" in text) != whole


def test_the_layout_is_built_without_a_loop():
    """``layout`` lowers to straight-line ops: a loop in it (a binary search's) costs a kernel
    launched from the host per iteration, in every expert layer of every step."""
    build = jax.jit(lambda gs: gm.layout(gs, 4096))
    assert "stablehlo.while" not in build.lower(jnp.ones((64,), jnp.int32)).as_text()


def test_a_given_layout_keeps_the_rows_padded_and_their_padding_zero(monkeypatch):
    """x already in the padded layout (``layout``): y and dx stay in it, equal to the sorted
    rows' at their places and 0 in every padding row, whatever the GEMMs leave in the tiles
    past the groups (the kernels do not write them; 7 here)."""
    recipe = fp8jax.make_recipe("delayed")
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((M, TILE)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((len(SIZES), TILE, TILE)) * 0.1, jnp.float32)
    g = jnp.asarray(rng.standard_normal((M, TILE)), jnp.float32)
    meta = fp8jax.init_meta(recipe)
    lay = gm.layout(_gs(), M)
    assert (np.asarray(lay.tile_group_T) < 0).any()  # tiles past the groups exist
    real = grouped.padded_reference

    def unwritten(kind, a, b, lay, inv, out_dtype):
        y = real(kind, a, b, lay, inv, out_dtype=out_dtype)
        if kind == grouped.WGRAD:
            return y
        written_R = jnp.repeat(lay.tile_group_T >= 0, gm.TILE)
        return jnp.where(written_R[:, None], y, jnp.asarray(7.0, y.dtype))

    monkeypatch.setattr(grouped, "padded_reference", unwritten)

    def vjp(x, g, gs, layout):
        f = lambda x, w: grouped.grouped_matmul(x, w, gs, recipe, meta, layout=layout)[0]  # noqa: E731
        y, back = jax.vjp(f, x, w)
        return y, *back(g)

    y_p, dx_p, dw_p = jax.jit(vjp)(
        gm.pad_rows(x, lay), gm.pad_rows(g, lay), grouped.padded_sizes(lay), lay
    )
    y, dx, dw = jax.jit(vjp, static_argnums=3)(x, g, _gs(), None)
    filled = np.asarray(gm.layout_rows(lay))
    dst = np.asarray(lay.dst_M)[: sum(SIZES)]
    for name_, padded_, plain in (("y", y_p, y), ("dx", dx_p, dx)):
        padded_, plain = np.asarray(padded_), np.asarray(plain)
        assert not padded_[~filled].any(), name_
        bound = M * np.finfo(np.float32).eps * np.abs(plain).max()  # summation order only
        np.testing.assert_allclose(padded_[dst], plain[: sum(SIZES)], rtol=0, atol=bound)
    bound = M * np.finfo(np.float32).eps * np.abs(np.asarray(dw)).max()
    np.testing.assert_allclose(np.asarray(dw_p), np.asarray(dw), rtol=0, atol=bound)


def _expert_step(recipe, k, n):
    """The grad of a per-tensor or tiled expert GEMM, lowered for CUDA: its StableHLO text."""
    x = jax.ShapeDtypeStruct((M, k), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((len(SIZES), k, n), jnp.float32)
    meta = fp8jax.init_meta(recipe)

    def loss(x, w, meta):
        y, meta = grouped.grouped_matmul(x, w, _gs(), recipe, meta, out_dtype=jnp.bfloat16)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return step.trace(x, w, meta).lower(lowering_platforms=("cuda",)).as_text(debug_info=True)


def test_per_tensor_expert_step_lowers_the_three_fp8_kernels_for_cuda():
    text = _expert_step(fp8jax.make_recipe("delayed"), TILE, 2 * TILE)
    calls = [line for line in text.splitlines() if KERNEL_CALL.search(line)]
    assert len(calls) == 3  # forward, dgrad, wgrad
    # E4M3 x and w forward; dgrad and wgrad take dy's E5M2 (with E4M3 w, x) or f16 copies
    assert "f8E4M3FN>, tensor<4x256x128xf8E4M3FN>) -> tensor<" in text
    assert f'loc("{gm.KERNEL_NAME}' in text


def test_block_expert_step_lowers_the_three_block_scaled_kernels_for_cuda():
    """The block recipe at 128-wide tiles: forward, dgrad and wgrad are ``block_gemm_mgpu``'s
    grouped Mosaic GPU kernels on FP8 operands, no ragged_dot left."""
    from fp8jax.ops import block_gemm_mgpu

    text = _expert_step(fp8jax.make_recipe("block"), TILE, 2 * TILE)
    calls = [line for line in text.splitlines() if KERNEL_CALL.search(line)]
    assert len(calls) == 3
    assert f'loc("{block_gemm_mgpu.KERNEL_NAME}' in text and "ragged_dot" not in text
    assert "tensor<4x256x128xf8E4M3FN>" in text  # w^T per expert, E4M3, for the forward


ON_REFERENCE = {  # case -> (recipe, its fields)
    "not whole tiles": ("current", {}),
    "rowwise": ("rowwise", {}),
    "64-wide blocks": ("block", {"block_size": 64}),
}


@pytest.mark.parametrize("case", sorted(ON_REFERENCE))
def test_other_expert_gemms_keep_the_reference_on_cuda(case):
    name, fields = ON_REFERENCE[case]
    recipe = fp8jax.make_recipe(name, **fields)
    k, n = (TILE, TILE + 64) if case == "not whole tiles" else (TILE, TILE)
    text = _expert_step(recipe, k, n)
    assert not KERNEL_CALL.search(text)
    assert "ragged_dot" in text


def test_gemm_counts_count_the_grouped_kernels():
    text = "\n".join(
        [
            'a = bf16[8,8] custom-call(x), custom_call_target="mosaic_gpu_v2", '
            f'metadata={{op_name="jit(f)/grouped_gemm/fp8_delayed/{gm.KERNEL_NAME}/mpmd_map"}}',
            'b = bf16[8,8] custom-call(x), custom_call_target="mosaic_gpu_v2", '
            f'metadata={{op_name="jit(f)/grouped_gemm/{gm.BF16_KERNEL_NAME}/mpmd_map"}}',
        ]
    )
    counts = coverage.gemm_counts(text)
    assert counts == {gm.KERNEL_NAME: 1, gm.BF16_KERNEL_NAME: 1}
    report = coverage.CoverageReport(entries=(), gemm_counts=counts)
    assert (report.num_fp8_gemms, report.num_other_gemms) == (1, 1)


@pytest.mark.parametrize("kind", [grouped.FORWARD, grouped.WGRAD])
def test_vmapped_kernels_launch_unbatched_in_a_loop(kind):
    """Batched (vmapped replicas), each persistent kernel runs once per batch element on the
    unbatched operands inside a loop, not as a batched grid."""
    lay = gm.layout(_gs(), M)
    e4m3 = jnp.float8_e4m3fn
    if kind == grouped.FORWARD:  # a [R, K], b [G, N, K] -> [R, N]
        a, b = jnp.zeros((2, lay.rows, TILE), e4m3), jnp.zeros((2, len(SIZES), TILE, TILE), e4m3)
        want = f"-> tensor<{lay.rows}x{TILE}xbf16>"
    else:  # a^T [K, R], b^T [N, R] -> [G, K, N]
        a, b = jnp.zeros((2, TILE, lay.rows), e4m3), jnp.zeros((2, TILE, lay.rows), e4m3)
        want = f"-> tensor<{len(SIZES)}x{TILE}x{TILE}xbf16>"

    def gemm(a, b):
        return grouped.padded_kernel(kind, a, b, lay, jnp.float32(1), jnp.bfloat16)

    text = jax.jit(jax.vmap(gemm)).trace(a, b).lower(lowering_platforms=("cuda",)).as_text()
    (call,) = [line for line in text.splitlines() if KERNEL_CALL.search(line)]
    assert call.endswith(want) and "stablehlo.while" in text
