"""The grouped GEMM of expert layers (``fp8jax.ragged_dot``, ``ops.grouped``, the linen and NNX
``Fp8RaggedDot`` and ``nn.grouped.GroupedLinear``).

O0 against a per-group loop; under every registered recipe, the FP8 forward, dgrad and wgrad
against per-group products of operands quantized here independently (numpy and ml_dtypes, with
the recipe's scales: one per tensor, or per tile as the recipe's ``tile_width`` and
``weight_tile`` say), within E4M3's rounding of the f32 product; rows past ``sum(group_sizes)``
and empty groups; the amaxes recorded (the max over every expert); delayed scaling over two
steps; per-layer state under ``nn.scan`` and remat; the coverage report's expert GEMMs. Each
recipe's step compiles once and serves every property.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import linen as nn
from jax import export

import fp8jax
from fp8jax.diagnostics import coverage
from fp8jax.nn.grouped import GroupedLinear
from fp8jax.ops import formats, grouped, scaling

from fp8_testing import MIN_ERR, f32_div, rel_err

NAMES = sorted(scaling.RECIPES)
G, K, N = 3, 32, 16
SIZES = (7, 0, 13)  # group 1 is empty
M = sum(SIZES) + 3  # three rows past sum(SIZES), as a dropless dispatch pads
EPS32 = float(np.finfo(np.float32).eps)
NP_FORMATS = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}


def _recipe(name: str) -> scaling.Recipe:
    """The recipe with tiles that fit the tiny shapes (block_size 16: two tiles along K)."""
    return fp8jax.make_recipe(name, block_size=16)


def _inputs(scale_x: float = 1.0):
    """x [M, K], w [G, K, N], dy [M, N] and the group sizes. Expert 2 holds w's largest value
    (one outlier in one tile); x one outlier; the padding rows past sum(SIZES) are huge, so an
    amax or a product that reads them shows it."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((M, K), np.float32) * np.float32(scale_x)
    x[3, 5] = 20.0 * scale_x
    w = rng.standard_normal((G, K, N), np.float32) * np.float32(0.1)
    w[2, 0, 0] = 8.0
    g = rng.standard_normal((M, N), np.float32)
    x[sum(SIZES) :], g[sum(SIZES) :] = 1e4, 1e4
    return x, w, g, np.asarray(SIZES, np.int32)


def _rows(g: int) -> slice:
    start = sum(SIZES[:g])
    return slice(start, start + SIZES[g])


def _valid(a: np.ndarray) -> np.ndarray:
    """``a`` with the rows past sum(SIZES) set to 0 (they enter no GEMM and no amax)."""
    a = np.array(a, np.float32)
    a[sum(SIZES) :] = 0
    return a


@jax.jit
def _step(x, w, gs, g, meta):
    """y, the meta after the forward, dx, dw and the meta's cotangent (dy's amax): one program."""

    def f(x, w, meta):  # the public FP8 ragged_dot: the GEMMs of meta's recipe
        return fp8jax.ragged_dot(x, w, gs, meta)

    (y, new_meta), vjp = jax.vjp(f, x, w, meta)
    dx, dw, dmeta = vjp((g, jax.tree.map(jnp.zeros_like, new_meta)))
    return y, new_meta, dx, dw, dmeta


@functools.cache
def _run(name: str):
    """The recipe's fresh meta and ``_step`` on ``_inputs`` (one compile per recipe)."""
    meta = fp8jax.init_meta(_recipe(name))
    x, w, g, gs = _inputs()
    return meta, jax.device_get(_step(x, w, gs, g, meta))


# The reference quantizers: round to nearest with numpy's FP8 types, saturating.


def _fq(a: np.ndarray, fmt: str, scale) -> np.ndarray:
    """``a`` quantized to ``fmt`` under ``scale`` (broadcast) and dequantized, float64."""
    scale = np.asarray(scale, np.float32)
    y = np.clip(np.asarray(a, np.float32) * scale, -formats.fmax(fmt), formats.fmax(fmt))
    return y.astype(NP_FORMATS[fmt]).astype(np.float64) / scale


def _tile_scale(amax: np.ndarray, fmt: str) -> np.ndarray:
    """fmax / amax per tile (f32), 1 for an all-zero tile."""
    amax = np.asarray(amax, np.float32)
    safe = np.where(amax > 0, amax, np.float32(1))
    return np.where(amax > 0, np.float32(formats.fmax(fmt)) / safe, np.float32(1))


def _fq_tiles(a_MxK: np.ndarray, fmt: str, tile: int) -> np.ndarray:
    """``a`` in 1 x ``tile`` tiles along its last axis, each scaled by its own amax."""
    m, k = a_MxK.shape
    padded = np.zeros((m, -(-k // tile) * tile), np.float32)
    padded[:, :k] = a_MxK
    tiles = padded.reshape(m, -1, tile)
    scale = _tile_scale(np.abs(tiles).max(axis=-1), fmt)[..., None]
    return _fq(tiles, fmt, scale).reshape(m, -1)[:, :k]


def _fq_blocks(w_KxN: np.ndarray, fmt: str, t: int) -> np.ndarray:
    """``w`` in ``t`` x ``t`` blocks, each scaled by its own amax."""
    k, n = w_KxN.shape
    padded = np.zeros((-(-k // t) * t, -(-n // t) * t), np.float32)
    padded[:k, :n] = w_KxN
    blocks = padded.reshape(padded.shape[0] // t, t, padded.shape[1] // t, t)
    scale = _tile_scale(np.abs(blocks).max(axis=(1, 3)), fmt)[:, None, :, None]
    return _fq(blocks, fmt, scale).reshape(padded.shape)[:k, :n]


def _operands(meta: scaling.Fp8Meta, x, w, g) -> dict[str, np.ndarray]:
    """Each GEMM's operands quantized and dequantized as the recipe of ``meta`` says: forward
    (x_f, w_f), dgrad (g_d, w_d) and wgrad (x_w, g_w)."""
    recipe, dy = meta.x.recipe, meta.dy.fmt
    x, g = _valid(x), _valid(g)
    if recipe.per_tensor:
        sx = scaling.use_scale(meta.x, jnp.float32(np.abs(x).max()))
        sw = scaling.use_scale(meta.w, jnp.float32(np.abs(w).max()))  # one over all experts
        sg = scaling.use_scale(meta.dy, jnp.float32(np.abs(g).max()))
        xq, wq, gq = _fq(x, "e4m3", sx), _fq(w, "e4m3", sw), _fq(g, dy, sg)
        return dict(x_f=xq, w_f=wq, g_d=gq, w_d=wq, x_w=xq, g_w=gq)
    width = recipe.tile_width
    if recipe.weight_tile:
        w_f = w_d = np.stack([_fq_blocks(wg, "e4m3", recipe.weight_tile) for wg in w])
    else:  # each GEMM's w along its own contraction: K for the forward, N for dgrad
        w_f = np.stack([_fq_tiles(wg.T, "e4m3", width(K)).T for wg in w])
        w_d = np.stack([_fq_tiles(wg, "e4m3", width(N)) for wg in w])
    return dict(
        x_f=_fq_tiles(x, "e4m3", width(K)),
        w_f=w_f,
        g_d=_fq_tiles(g, dy, width(N)),
        w_d=w_d,
        x_w=_fq_tiles(x.T, "e4m3", width(M)).T,  # wgrad contracts M: tiles along M
        g_w=_fq_tiles(g.T, dy, width(M)).T,
    )


def _per_group(op, out_shape) -> np.ndarray:
    """``op(g, rows of g)`` for each group into a zero array (rows past the groups stay 0)."""
    out = np.zeros(out_shape)
    for gi in range(G):
        op(out, gi, _rows(gi))
    return out


def _products(q: dict[str, np.ndarray]):
    """(y, dx, dw, and the |a| . |b| of each) per group in float64 from ``_operands``."""

    def fwd(out, gi, r, a=q["x_f"], b=q["w_f"]):
        out[r] = a[r] @ b[gi]

    def dgrad(out, gi, r, a=q["g_d"], b=q["w_d"]):
        out[r] = a[r] @ b[gi].T

    def wgrad(out, gi, r, a=q["x_w"], b=q["g_w"]):
        out[gi] = a[r].T @ b[r]

    shapes = ((M, N), (M, K), (G, K, N))
    exact = [_per_group(op, s) for op, s in zip((fwd, dgrad, wgrad), shapes, strict=True)]
    absq = {k: np.abs(v) for k, v in q.items()}
    bound = [
        _per_group(functools.partial(op, a=absq[a], b=absq[b]), s)
        for op, s, (a, b) in zip(
            (fwd, dgrad, wgrad),
            shapes,
            (("x_f", "w_f"), ("g_d", "w_d"), ("x_w", "g_w")),
            strict=True,
        )
    ]
    return exact, bound


def test_o0_equals_a_per_group_loop():
    x, w, g, gs = _inputs()

    def loop(x, w):  # the plain-JAX reference: one jnp.dot per group, padding rows 0
        parts = [jnp.dot(x[_rows(gi)], w[gi]) for gi in range(G)]
        return jnp.concatenate([*parts, jnp.zeros((M - sum(SIZES), N))])

    def o0(x, w):
        return grouped.grouped_matmul(x, w, jnp.asarray(gs), None, None)[0]

    for f, ref in ((o0, loop),):
        y, vjp = jax.vjp(f, x, w)
        y_ref, vjp_ref = jax.vjp(ref, x, w)
        np.testing.assert_allclose(y, y_ref, rtol=1e-6, atol=1e-6)
        for a, b in zip(vjp(g), vjp_ref(g), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)
    assert np.all(np.asarray(y)[sum(SIZES) :] == 0)


def _assert_quantized_products(meta: scaling.Fp8Meta, x, w, g, **got) -> None:
    """``got``'s y, dx and dw (those given) within f32 accumulation of the per-group products
    of the operands quantized under ``meta``'s scales (``_operands``)."""
    exact, bound = _products(_operands(meta, x, w, g))
    for what, ref, ab, k in zip(("y", "dx", "dw"), exact, bound, (K, N, M), strict=True):
        if what in got:
            tol = (k + 4) * EPS32 * ab + 1e-30  # the sum's and the unscaling's f32 roundings
            err = np.abs(np.asarray(got[what], np.float64) - ref)
            assert np.all(err <= tol), f"{what}: largest excess {np.max(err - tol)}"


@pytest.mark.parametrize("name", NAMES)
def test_fp8_gemms_equal_the_reference_on_quantized_operands(name):
    """y, dx and dw within f32 accumulation of per-group products of the operands quantized
    with the recipe's scales."""
    meta, (y, _, dx, dw, _) = _run(name)
    x, w, g, _ = _inputs()
    _assert_quantized_products(meta, x, w, g, y=y, dx=dx, dw=dw)


@pytest.mark.parametrize("name", NAMES)
def test_fp8_forward_is_within_e4m3_rounding_of_the_f32_product(name):
    meta, (y, *_) = _run(name)
    x, w, _, _ = _inputs()
    x = _valid(x)
    u = float(jnp.finfo(formats.E4M3).eps) / 2  # round to nearest: half an E4M3 ulp, relative
    sub = float(jnp.finfo(formats.E4M3).smallest_subnormal) / 2

    def rounding(a, state):  # each element's largest move; scale at least min(stored, own)
        scale = min(float(state.scale), formats.fmax("e4m3") / np.abs(a).max())
        return u * np.abs(a) + sub / scale

    rx, rw = rounding(x, meta.x), rounding(w, meta.w)
    exact = _per_group(lambda o, gi, r: o.__setitem__(r, x[r] @ w[gi]), (M, N))
    most = _per_group(
        lambda o, gi, r: o.__setitem__(
            r, rx[r] @ np.abs(w[gi]) + np.abs(x[r]) @ rw[gi] + rx[r] @ rw[gi]
        ),
        (M, N),
    )
    most += (
        (K + 4)
        * EPS32
        * _per_group(lambda o, gi, r: o.__setitem__(r, np.abs(x[r]) @ np.abs(w[gi])), (M, N))
    )
    err = np.abs(np.asarray(y, np.float64) - exact)
    assert np.all(err <= most), f"largest excess {np.max(err - most)}"
    valid = slice(0, sum(SIZES))
    assert rel_err(y[valid], exact[valid]) > MIN_ERR, "no FP8 rounding: ran in high precision"


@pytest.mark.parametrize("name", NAMES)
def test_padding_rows_and_empty_groups_are_zero(name):
    _, (y, _, dx, dw, _) = _run(name)
    assert np.all(y[sum(SIZES) :] == 0) and np.all(dx[sum(SIZES) :] == 0)
    assert np.all(dw[1] == 0), "the empty group's weight gradient"
    assert np.abs(dw[0]).max() > 0 and np.abs(dw[2]).max() > 0


@pytest.mark.parametrize("name", NAMES)
def test_amaxes_are_the_max_over_every_expert_and_the_grouped_rows(name):
    """x's, w's and dy's pending amax: plain per-tensor maxima (what expert-parallel shards
    all-reduce by max), over every expert's weights and no padding row."""
    _, (_, new_meta, _, _, dmeta) = _run(name)
    x, w, g, _ = _inputs()
    assert new_meta.x.amax_history[0] == np.abs(_valid(x)).max()
    assert new_meta.w.amax_history[0] == np.abs(w).max() == np.abs(w[2]).max()
    assert dmeta.dy.amax_history[0] == np.abs(_valid(g)).max()
    for s in (new_meta.x, new_meta.w, dmeta.dy):
        assert s.amax_history.shape == (s.recipe.history_len + 1,)
        assert np.all(s.amax_history[1:] == 0)


@pytest.mark.parametrize("name", NAMES)
def test_two_steps_quantize_with_the_committed_state(name):
    """Step 1's amaxes committed (``update_state``) give step 2's scales: delayed scaling
    quantizes step 2 with them, each recipe as its ``use_scale`` says."""
    meta, (_, new_meta, _, _, dmeta) = _run(name)
    x1, w, g, gs = _inputs()
    state = fp8jax.update_state(*jax.tree.map(jnp.asarray, (new_meta, dmeta)))
    for s, a in ((state.x, _valid(x1)), (state.w, w), (state.dy, _valid(g))):
        assert float(s.scale) == f32_div(formats.fmax(s.fmt), np.abs(a).max())
        assert s.amax_history[1] == np.abs(a).max() and s.amax_history[0] == 0
    x2 = _inputs(scale_x=0.25)[0]  # a smaller amax: a scale of its own would differ
    y2, meta2, dx2, dw2, _ = jax.device_get(_step(x2, w, gs, g, state))
    assert meta2.x.amax_history[0] == np.abs(_valid(x2)).max()
    assert meta2.x.amax_history[1] == np.abs(_valid(x1)).max()
    _assert_quantized_products(state, x2, w, g, y=y2, dx=dx2, dw=dw2)


@pytest.mark.parametrize("name", [n for n in NAMES if not _recipe(n).per_tensor])
def test_tiled_recipes_scale_each_expert_apart(name):
    """Under per-tile scales, one expert's weights change no other expert's products."""
    meta, (y, *_) = _run(name)
    x, w, g, gs = _inputs()
    w_big = w.copy()
    w_big[0] *= 1000.0
    y_big = jax.device_get(_step(x, w_big, gs, g, meta))[0]
    np.testing.assert_array_equal(y_big[_rows(2)], y[_rows(2)])
    assert not np.array_equal(y_big[_rows(0)], y[_rows(0)])


@pytest.mark.parametrize("name", NAMES)
def test_expert_shards_amaxes_merge_by_max_into_the_whole_stacks(name):
    """Each expert shard's GEMM on its own rows records plain per-tensor maxima: merged by max
    over the shards (``max_over_replicas``, what expert parallelism all-reduces) they are the
    whole stack's."""
    meta, (_, whole, *_) = _run(name)
    x, w, _, gs = _inputs()
    fwd = jax.jit(lambda x, w, gs, m: grouped.grouped_matmul(x, w, gs, m.x.recipe, m)[1])
    shards = [  # experts [0, 1] with their rows, then expert [2] with its rows and the padding
        fwd(x[: sum(SIZES[:2])], w[:2], gs[:2], meta),
        fwd(x[sum(SIZES[:2]) :], w[2:], np.asarray(SIZES[2:], np.int32), meta),
    ]
    assert shards[0].w.amax_history[0] < whole.w.amax_history[0]  # expert 2 holds w's max
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *shards)
    merged = jax.device_get(fp8jax.nn.state.max_over_replicas(stacked, meta))
    for got, want in ((merged.x, whole.x), (merged.w, whole.w)):
        np.testing.assert_array_equal(got.amax_history, want.amax_history)


@pytest.mark.parametrize("name", NAMES)
def test_two_uses_of_one_layer_merge_their_amaxes_by_max(name):
    """A GroupedLinear called twice in a step (shared weights): x's pending amax is the larger
    of its two inputs', dy's the larger of the two output gradients'."""
    x, _, g, gs = _inputs()
    x, g = _valid(x), _valid(g)[:, :8]

    class Twice(nn.Module):
        @nn.compact
        def __call__(self, x1, x2):
            shared = GroupedLinear(G, K, (8,), _recipe(name), name="experts")
            return shared(x1, gs), shared(x2, gs)

    # The larger amax where a chain that kept only the last record would lose it: x's in the
    # first use (the forward records first, then second), dy's in the second (the backward
    # records the second use's first).
    x2, g2 = x[::-1] / 3.0, 2.0 * g
    x2[sum(SIZES) :] = 0  # the reversed padding rows back past the groups
    variables = nn.unbox(jax.jit(Twice().init)(jax.random.key(0), x, x2))

    def loss(fp8):
        (y1, y2), mutated = Twice().apply(
            {"params": variables["params"], fp8jax.FP8: fp8}, x, x2, mutable=[fp8jax.FP8]
        )
        return jnp.sum(y1 * g) + jnp.sum(y2 * g2), mutated[fp8jax.FP8]

    dfp8, fp8 = jax.jit(jax.grad(loss, has_aux=True))(variables[fp8jax.FP8])
    meta, dmeta = fp8["experts"]["fp8"]["meta"], dfp8["experts"]["fp8"]["meta"]
    assert meta.x.amax_history[0] == np.abs(x).max() > np.abs(x2).max()
    assert dmeta.dy.amax_history[0] == np.abs(g2).max() > np.abs(g).max()


class _Layer(nn.Module):
    """One grouped linear layer [K -> K], its input as the scan's output."""

    recipe: scaling.Recipe | None

    @nn.compact
    def __call__(self, x, gs):
        names = ("expert", "embed", "mlp")
        return GroupedLinear(G, K, (K,), self.recipe, names, name="experts")(x, gs), x


@functools.cache
def _scanned(name: str):
    """A two-layer ``nn.scan`` stack of remat'd GroupedLinear: its variables, the step's new
    FP8 state, the state's cotangent, the layers' inputs and the output gradient."""
    stack = nn.scan(
        nn.remat(_Layer),
        variable_axes={"params": 0, fp8jax.FP8: 0},
        split_rngs={"params": True},
        in_axes=nn.broadcast,
        length=2,
        metadata_params={nn.PARTITION_NAME: "layers"},
    )(_recipe(name))
    x, _, _, gs = _inputs()
    x = x[:, :K]
    variables = nn.unbox(jax.jit(stack.init)(jax.random.key(0), x, gs))
    g = np.random.default_rng(1).standard_normal((M, K)).astype(np.float32)

    def loss(params, fp8):
        (y, xs), mutated = stack.apply(
            {"params": params, fp8jax.FP8: fp8}, x, gs, mutable=[fp8jax.FP8]
        )
        return jnp.sum(y * g), (mutated[fp8jax.FP8], xs)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))
    (_, dfp8), (fp8, xs) = grad(variables["params"], variables[fp8jax.FP8])
    return jax.device_get((variables, fp8, dfp8, xs, g))


@pytest.mark.parametrize("name", NAMES)
def test_scanned_layers_record_their_own_amaxes(name):
    variables, fp8, dfp8, xs, g = _scanned(name)
    meta, dmeta = fp8["experts"]["fp8"]["meta"], dfp8["experts"]["fp8"]["meta"]
    kernel = variables["params"]["experts"]["kernel"]  # [2, G, K, K]
    assert meta.x.amax_history.shape == (2, meta.x.recipe.history_len + 1)
    for layer in range(2):
        assert meta.x.amax_history[layer, 0] == np.abs(_valid(xs[layer])).max()
        assert meta.w.amax_history[layer, 0] == np.abs(kernel[layer]).max()
    assert meta.w.amax_history[0, 0] != meta.w.amax_history[1, 0]
    # The last layer's dy is the loss's g (its grouped rows); the first layer's the last's dx.
    assert dmeta.dy.amax_history[1, 0] == np.abs(_valid(g)).max()
    w1 = kernel[1].astype(np.float64)
    dx1 = _per_group(lambda o, gi, r: o.__setitem__(r, g[r] @ w1[gi].T), (M, K))
    # dx1 from g in dy's format and w in E4M3: each product within both formats' half steps
    # (2^-(mantissa bits + 1)) of the exact one, so the largest |dx| too.
    half_step = {"e4m3": 2.0**-4, "e5m2": 2.0**-3}
    rel = (1 + half_step[dmeta.dy.fmt]) * (1 + half_step["e4m3"]) - 1
    assert dmeta.dy.amax_history[0, 0] == pytest.approx(np.abs(dx1).max(), rel=rel)


def test_grouped_linear_params_state_and_dtypes():
    x, _, _, gs = _inputs()
    x = jnp.asarray(x, jnp.bfloat16)
    names = ("expert", "embed", None, "mlp")
    o0 = GroupedLinear(G, K, (2, 8), names=names)
    variables = jax.jit(o0.init)(jax.random.key(0), x, gs)
    boxed = variables["params"]["kernel"]
    assert boxed.names == names and boxed.value.shape == (G, K, 2, 8)
    assert boxed.value.dtype == jnp.float32 and set(variables) == {"params"}
    y = o0.apply(variables, x, gs)
    kernel = boxed.value.reshape(G, K, 16).astype(jnp.bfloat16)
    ref = grouped.grouped_matmul(x, kernel, gs, None, None)[0]
    assert y.shape == (M, 2, 8) and y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(y.reshape(M, 16), ref)

    fp8 = GroupedLinear(G, K, (2, 8), _recipe("delayed"), names)
    variables = nn.unbox(jax.jit(fp8.init)(jax.random.key(0), x, gs))
    meta = variables[fp8jax.FP8]["fp8"]["meta"]
    assert np.all(meta.x.amax_history == 0)
    y, mutated = fp8.apply(variables, x, gs, mutable=[fp8jax.FP8])
    assert y.dtype == jnp.bfloat16
    new = mutated[fp8jax.FP8]["fp8"]["meta"]
    assert new.x.amax_history[0] == float(jnp.max(jnp.abs(x[: sum(SIZES)].astype(jnp.float32))))
    assert new.w.amax_history[0] == float(jnp.max(jnp.abs(variables["params"]["kernel"])))
    with pytest.raises(ValueError, match="one logical name"):
        GroupedLinear(G, K, (2, 8), names=("expert", "embed")).init(jax.random.key(0), x, gs)


def test_linen_fp8_ragged_dot_keeps_its_state_and_sows_the_grouped_rows_health():
    """``fp8jax.Fp8RaggedDot`` in a linen module: its meta in ``fp8_state`` (fresh at init), the
    quantized products, x's amax and health over the grouped rows only (the padding rows'
    1e4 would clip at a scale of 1), dy's amax as the collection's gradient."""
    x, w, g, gs = _inputs()

    class Experts(nn.Module):
        @nn.compact
        def __call__(self, x):
            kernel = self.param("kernel", lambda _: jnp.asarray(w))
            return fp8jax.Fp8RaggedDot(_recipe("delayed"))(x, kernel, gs)

    model = Experts()
    variables = jax.jit(model.init)(jax.random.key(0), x)
    meta = variables[fp8jax.FP8]["Fp8RaggedDot_0"]["meta"]
    assert np.all(meta.x.amax_history == 0) and float(meta.x.scale) == 1.0

    @jax.jit
    def step(params, state):
        def f(params, state, x):
            return model.apply(
                {"params": params, fp8jax.FP8: state},
                x,
                mutable=[fp8jax.FP8, fp8jax.FP8_STATS],
            )

        (y, mutated), vjp = jax.vjp(f, params, state, x)
        zeros = jax.tree.map(jnp.zeros_like, mutated)
        d_params, d_state, dx = vjp((jnp.asarray(g), zeros))
        return y, mutated, d_params, d_state, dx

    y, mutated, d_params, d_state, dx = jax.device_get(
        step(variables["params"], variables[fp8jax.FP8])
    )
    _assert_quantized_products(meta, x, w, g, y=y, dx=dx, dw=d_params["kernel"])
    new = mutated[fp8jax.FP8]["Fp8RaggedDot_0"]["meta"]
    assert new.x.amax_history[0] == np.abs(_valid(x)).max()
    assert new.w.amax_history[0] == np.abs(w).max()
    assert d_state["Fp8RaggedDot_0"]["meta"].dy.amax_history[0] == np.abs(_valid(g)).max()
    stats = mutated[fp8jax.FP8_STATS]["Fp8RaggedDot_0"]
    assert float(stats["x_saturated"][0]) == 0.0  # max |x| of the grouped rows is 20 < 448
    assert float(stats["w_saturated"][0]) == 0.0


def test_nnx_fp8_ragged_dot_trains_with_the_nnx_helpers():
    """``fp8jax.nnx.Fp8RaggedDot`` in an NNX module: the quantized products, and one step of
    ``diff_state`` / ``split_grads`` / ``update_fp8_state`` commits x's, w's and dy's amaxes."""
    from flax import nnx

    x, w, g, gs = _inputs()

    class Experts(nnx.Module):
        def __init__(self):
            self.kernel = nnx.Param(jnp.asarray(w))
            self.ragged_dot = fp8jax.nnx.Fp8RaggedDot(_recipe("delayed"))

        def __call__(self, x):
            # As a drop-in for jax.lax.ragged_dot: its precision argument is taken (and moot).
            return self.ragged_dot(x, self.kernel[...], gs, precision=jax.lax.Precision.HIGHEST)

    model = Experts()
    meta = model.ragged_dot.meta.get_value()

    @nnx.jit
    def step(model):
        def loss(model):
            y = model(jnp.asarray(x))
            return jnp.sum(y * jnp.asarray(g)), y  # dL/dy = g

        (_, y), grads = nnx.value_and_grad(loss, argnums=fp8jax.nnx.diff_state(), has_aux=True)(
            model
        )
        param_grads, fp8_grads = fp8jax.nnx.split_grads(grads)
        fp8jax.nnx.update_fp8_state(model, fp8_grads)
        return y, param_grads

    y, param_grads = jax.device_get(step(model))
    _assert_quantized_products(meta, x, w, g, y=y, dw=param_grads["kernel"][...])
    state = model.ragged_dot.meta.get_value()
    for s, a in ((state.x, _valid(x)), (state.w, w), (state.dy, _valid(g))):
        assert s.amax_history[1] == np.abs(a).max() and s.amax_history[0] == 0
        assert float(s.scale) == f32_div(formats.fmax(s.fmt), np.abs(a).max())


def test_bad_operands_are_one_line_with_the_fix():
    x, w, _, gs = _inputs()
    with pytest.raises(ValueError, match=r"disagree on K or G.*pass x \[M, K\]"):
        grouped.grouped_matmul(x[:, :8], w, gs, None, None)
    with pytest.raises(ValueError, match="must be"):
        grouped.grouped_matmul(x[None], w, gs, None, None)
    with pytest.raises(TypeError, match="int32"):
        grouped.grouped_matmul(x, w, gs.astype(np.float32), None, None)
    # The public faces name themselves.
    meta = fp8jax.init_meta()
    with pytest.raises(TypeError, match=r"^fp8jax\.ragged_dot: group_sizes .* pass int32"):
        fp8jax.ragged_dot(x, w, gs.astype(np.float32), meta)
    with pytest.raises(ValueError, match=r"^fp8jax\.Fp8RaggedDot: .* disagree on K or G"):
        fp8jax.Fp8RaggedDot().init(jax.random.key(0), x[:, :8], w, gs)
    offset = jnp.zeros((1,), jnp.int32)  # jax.lax.ragged_dot's, for a shard of the groups
    with pytest.raises(ValueError, match=r"^fp8jax\.Fp8RaggedDot: group_offset is not supp"):
        fp8jax.Fp8RaggedDot().init(jax.random.key(0), x, w, gs, group_offset=offset)
    with pytest.raises(ValueError, match=r"^fp8jax\.nnx\.Fp8RaggedDot: group_offset is not"):
        fp8jax.nnx.Fp8RaggedDot()(x, w, gs, group_offset=offset)

    class NoGrouped(scaling.RECIPES["delayed"]):  # a recipe without a grouped GEMM
        grouped_matmul = scaling.Recipe.grouped_matmul

    recipe = NoGrouped()
    with pytest.raises(NotImplementedError, match=r"no grouped GEMM: use one of \['block'"):
        grouped.grouped_matmul(x, w, gs, recipe, fp8jax.init_meta(recipe))


@pytest.mark.parametrize("name", NAMES)
def test_coverage_lists_the_expert_gemms_with_their_formats(name):
    """On CPU (ragged_dot's dense expansion) and in a CUDA lowering (chlo.ragged_dot
    composites, their per-group decomposition not counted)."""
    meta, _ = _run(name)
    x, w, g, gs = _inputs()
    recipe, dy = meta.x.recipe, meta.dy.fmt
    fmt = {"e4m3": "f8E4M3FN", "e5m2": "f8E5M2"}
    cpu = coverage.coverage_report(_step, x, w, gs, g, meta)
    cuda_text = export.export(_step, platforms=["cuda"])(x, w, gs, g, meta).mlir_module()
    gpu = coverage.CoverageReport(coverage.parse_stablehlo(cuda_text), None)
    for report in (cpu, gpu):
        assert len(report.grouped) == 3 == len(report.entries)
        assert all(e.recipe == recipe.name for e in report.grouped)
        assert "grouped (expert) GEMMs" in str(report)
        if recipe.per_tensor:  # the FP8 operands themselves: E4M3 forward, dy's format after
            got = sorted((e.lhs_dtype, e.rhs_dtype) for e in report.grouped)
            want = [(fmt["e4m3"], fmt["e4m3"]), (fmt["e4m3"], fmt[dy]), (fmt[dy], fmt["e4m3"])]
            assert got == sorted(want) and report.num_fp8 == 3
        else:  # the reference multiplies tile-dequantized f32 values: not an FP8 GEMM
            assert report.num_fp8 == 0
    assert all(e.kernel == coverage.RAGGED_DOT for e in gpu.grouped)
    assert sorted(e.flops for e in gpu.grouped) == [2 * M * K * N] * 3
    assert sorted(e.ragged for e in gpu.grouped) == [((0,), ()), ((0,), (0,)), ((0,), (0,))]


# The block recipe at 128-wide tiles (DeepSeek-V3's) runs on rows padded per group
# (ops.grouped_block): every tile of rows lies in one group.

BLOCK_SIZES = (7, 0, 130, 1)  # group 2 spans two tiles of rows from row 7 on


def _block_inputs():
    """x [M, 128], w [G, 128, 256], dy [M, 256]: whole 128 tiles of K and N. x's outlier in
    group 0 shares column 5 with group 2's first rows (a tile of rows across the two groups
    would scale them by it); the rows past the groups are huge."""
    m = sum(BLOCK_SIZES) + 5
    rng = np.random.default_rng(5)
    x = rng.standard_normal((m, 128), np.float32)
    x[3, 5] = 50.0
    w = rng.standard_normal((len(BLOCK_SIZES), 128, 256), np.float32) * np.float32(0.1)
    w[2, 130 % 128, 200] = 6.0
    g = rng.standard_normal((m, 256), np.float32)
    x[sum(BLOCK_SIZES) :], g[sum(BLOCK_SIZES) :] = 1e4, 1e4
    return x, w, g, np.asarray(BLOCK_SIZES, np.int32)


def _per_group_rows(a_MxK: np.ndarray, fmt: str, sizes) -> np.ndarray:
    """``a`` in 128 x 1 tiles along the rows, tiled from each group's first row (a group's last
    tile partial), dequantized; the rows past the groups 0."""
    out = np.zeros(a_MxK.shape)
    start = 0
    for size in sizes:
        if size:
            out[start : start + size] = _fq_tiles(a_MxK[start : start + size].T, fmt, 128).T
        start += size
    return out


def test_block_expert_gemms_tile_each_groups_rows_apart():
    """Block scaling, 128-wide: y, dx and dw within f32 accumulation of per-group products of
    x and dy in 1 x 128 tiles, w in 128 x 128 blocks, and for wgrad x and dy in 128 x 1 tiles
    that start at each group's first row (the padded layout); rows past the groups are 0 and
    the amaxes are the whole tensors'."""
    recipe = fp8jax.make_recipe("block")
    x, w, g, gs = _block_inputs()
    m, sizes = x.shape[0], BLOCK_SIZES
    assert recipe.pads_grouped_rows and grouped.padded(x, w)
    meta = fp8jax.init_meta(recipe)
    y, new_meta, dx, dw, dmeta = jax.device_get(_step(x, w, gs, g, meta))
    xv, gv, dy = x.copy(), g.copy(), meta.dy.fmt
    xv[sum(sizes) :], gv[sum(sizes) :] = 0, 0
    q = dict(
        x_f=_fq_tiles(xv, "e4m3", 128),
        w_f=np.stack([_fq_blocks(wg, "e4m3", 128) for wg in w]),
        g_d=_fq_tiles(gv, dy, 128),
        x_w=_per_group_rows(xv, "e4m3", sizes),
        g_w=_per_group_rows(gv, dy, sizes),
    )
    starts = np.cumsum((0,) + sizes)
    exact = [np.zeros((m, 256)), np.zeros((m, 128)), np.zeros(w.shape)]
    bound = [np.zeros((m, 256)), np.zeros((m, 128)), np.zeros(w.shape)]
    for gi in range(len(sizes)):
        r = slice(starts[gi], starts[gi + 1])
        for i, (a, b) in enumerate(
            (
                (q["x_f"][r], q["w_f"][gi]),
                (q["g_d"][r], q["w_f"][gi].T),
                (q["x_w"][r].T, q["g_w"][r]),
            )
        ):
            at = gi if i == 2 else r
            exact[i][at] = a @ b
            bound[i][at] = np.abs(a) @ np.abs(b)
    for got, ref, ab, k, what in zip(
        (y, dx, dw), exact, bound, (128, 256, m), ("y", "dx", "dw"), strict=True
    ):
        err = np.abs(np.asarray(got, np.float64) - ref)
        assert np.all(err <= (k + 4) * EPS32 * ab + 1e-30), what
    assert not np.asarray(y)[sum(sizes) :].any() and not np.asarray(dx)[sum(sizes) :].any()
    assert not np.asarray(dw)[1].any()  # the empty group
    assert new_meta.x.amax_history[0] == np.abs(xv).max()
    assert new_meta.w.amax_history[0] == np.abs(w).max()
    assert dmeta.dy.amax_history[0] == np.abs(gv).max()


def test_block_expert_gemms_read_a_dispatched_layout_as_their_own():
    """Rows already in the padded layout (``dispatch_layout``, as the MoE layer writes them)
    give the sorted rows' y, dx and dw, 0 in every padding row."""
    from fp8jax.ops import grouped_mgpu

    recipe = fp8jax.make_recipe("block")
    x, w, g, gs = _block_inputs()
    meta = fp8jax.init_meta(recipe)
    lay = grouped.dispatch_layout(recipe, jnp.asarray(gs), x.shape[0], (128, 256))
    assert lay is not None

    def vjp(x, g, gs, layout):
        f = lambda x, w: grouped.grouped_matmul(x, w, gs, recipe, meta, layout=layout)[0]  # noqa: E731
        y, back = jax.vjp(f, x, w)
        return y, *back(g)

    pad = functools.partial(grouped_mgpu.pad_rows, lay=lay)
    y_p, dx_p, dw_p = jax.jit(vjp)(pad(x), pad(g), grouped.padded_sizes(lay), lay)
    y, dx, dw = jax.jit(vjp, static_argnums=3)(x, g, jnp.asarray(gs), None)
    dst = np.asarray(lay.dst_M)[: sum(BLOCK_SIZES)]
    filled = np.asarray(grouped_mgpu.layout_rows(lay))
    for padded_, plain in ((y_p, y), (dx_p, dx)):
        padded_, plain = np.asarray(padded_), np.asarray(plain)
        np.testing.assert_array_equal(padded_[dst], plain[: sum(BLOCK_SIZES)])
        assert not padded_[~filled].any()
    np.testing.assert_array_equal(dw_p, dw)
