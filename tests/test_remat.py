"""Remat policies that name the FP8 matmuls' residuals (fp8jax.ops.remat).

What a policy keeps is read from the residuals ``jax.vjp`` holds (the leaves of its backward
function), under ``jax.eval_shape``: no compile. Only the FP8 matmuls make E4M3 arrays, so every
E4M3 residual is a saved FP8 operand.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

import fp8jax
from fp8jax import FP8, spec
from fp8jax.models import layers
from fp8jax.models.config import REMAT_POLICIES
from fp8jax.models.layers import Block
from fp8jax.ops import dot, mlp, remat
from fp8jax.trainer import loop as train_lib

from fp8_testing import (
    ROOT,
    pallas_calls,
)

E4M3 = jnp.dtype(jnp.float8_e4m3fn)
BF16 = jnp.dtype(jnp.bfloat16)
DENSE = (((1,), (0,)), ((), ()))
M, K, N = 32, 64, 48  # one GEMM's sizes, all different: a shape says which operand it is
NEW = tuple(remat.POLICIES)
ACTIVATIONS = ("activations_saveable", "activations_and_weights_saveable")
# (recipe, cast kernel) pairs that take each forward rule: ops.dot's XLA casts, ops.gemm's fused
# cast (Pallas' interpreter), ops.fine's rowwise and block GEMMs (block: a Pallas kernel).
PATHS = {
    "current": (fp8jax.CurrentScaling(), "xla"),
    "fused": (fp8jax.DelayedScaling(), "interpret"),
    "rowwise": (fp8jax.RowwiseScaling(), "xla"),
    "block": (fp8jax.BlockScaling(), "interpret"),
}
# The E4M3 operands each path's backward GEMMs read: x [M, K] or its transpose, w [K, N].
OPERANDS = {
    "current": [(M, K), (K, N)],
    "fused": [(K, M), (K, N)],
    "rowwise": [(K, M), (K, N)],
    "block": [(K, M), (K, N)],
}


def randn(seed, shape, dtype=jnp.bfloat16):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32), dtype)


def residuals(f, *args) -> list[tuple]:
    """(dtype, shape) of every residual ``jax.vjp(f, *args)`` keeps, without running it."""
    leaves = jax.eval_shape(lambda *a: jax.tree.leaves(jax.vjp(f, *a)[1]), *args)
    return [(jnp.dtype(r.dtype), tuple(r.shape)) for r in leaves]


def fp8_saved(res) -> list[tuple]:
    return sorted(shape for dtype, shape in res if dtype == E4M3)


def checkpointed(f, policy):
    """``f`` under ``jax.checkpoint`` with ``policy`` (a REMAT_POLICIES name; 'none': as is)."""
    if policy == "none":
        return f
    return jax.checkpoint(f, policy=REMAT_POLICIES[policy])


def matmul(path):
    """``sin(x . w)`` through one FP8 matmul: sin keeps the output a residual of the backward."""
    recipe, cast = PATHS[path]
    meta = fp8jax.init_meta(recipe)

    def f(x_MxK, w_KxN):
        y_MxN, _ = dot.dot_general(x_MxK, w_KxN, DENSE, meta, cast_kernel=cast)
        return jnp.sin(y_MxN)

    return f


# Large enough that every path's E4M3 operands reach 256..448 (delayed scaling's first scale is
# 1): jax.checkpoint's reduce_precision of a saved E4M3 residual would turn those into NaN.
X, W = randn(0, (M, K)) * 100, randn(1, (K, N)) * 100


@pytest.mark.parametrize("path", list(PATHS))
def test_fp8_operands_saved_by_name(path):
    """The policies that save FP8_X and FP8_W keep exactly the E4M3 operands the backward
    GEMMs read; 'full' and jax's dots_saveable keep none (dots_saveable re-quantizes them)."""
    for policy in ("fp8_inputs_saveable", "fp8_dots_and_inputs_saveable"):
        assert fp8_saved(residuals(checkpointed(matmul(path), policy), X, W)) == sorted(
            OPERANDS[path]
        ), policy
    for policy in ("full", "dots_saveable", "fp8_dots_saveable"):
        assert fp8_saved(residuals(checkpointed(matmul(path), policy), X, W)) == [], policy
    # Without remat, autodiff keeps the same E4M3 operands: the names add no residual.
    assert fp8_saved(residuals(matmul(path), X, W)) == sorted(OPERANDS[path])


@pytest.mark.parametrize("path", list(PATHS))
def test_gemm_output_saved_by_name(path):
    """fp8_dots_saveable keeps the FP8 GEMM's output ([M, N] bf16) on every path; jax's
    dots_saveable misses the block recipe's GEMM, a Pallas kernel rather than a dot_general."""
    out = (BF16, (M, N))
    for policy in ("fp8_dots_saveable", "fp8_dots_and_inputs_saveable"):
        assert out in residuals(checkpointed(matmul(path), policy), X, W), policy
    for policy in ("full", "fp8_inputs_saveable"):
        assert out not in residuals(checkpointed(matmul(path), policy), X, W), policy
    assert (out in residuals(checkpointed(matmul(path), "dots_saveable"), X, W)) == (
        path != "block"
    )


def test_fused_mlp_residuals_named():
    """The fused GELU MLP (one custom VJP): its four E4M3 operands and its hidden GEMM output."""
    d, f = 48, 64  # with M = 32: every shape tells its tensor apart
    meta1, meta2 = fp8jax.init_meta(), fp8jax.init_meta()
    b1 = jnp.zeros((f,), jnp.float32)

    def fn(x_MxD, w1_DxF, w2_FxD):
        y_MxD, _, _ = mlp.gelu_mlp(x_MxD, w1_DxF, b1, w2_FxD, meta1, meta2, "interpret")
        return y_MxD

    args = randn(2, (M, d)), randn(3, (d, f)), randn(4, (f, d))
    operands = sorted([(d, M), (d, f), (f, M), (f, d)])  # x.T, w1, gelu(h).T, w2
    for policy in ("fp8_inputs_saveable", "fp8_dots_and_inputs_saveable"):
        assert fp8_saved(residuals(checkpointed(fn, policy), *args)) == operands, policy
    assert fp8_saved(residuals(checkpointed(fn, "full"), *args)) == []
    assert (BF16, (M, f)) in residuals(checkpointed(fn, "fp8_dots_saveable"), *args)
    assert (BF16, (M, f)) not in residuals(checkpointed(fn, "full"), *args)


@pytest.mark.parametrize("path", list(PATHS))
def test_matmul_gradients_unchanged_by_policy(path):
    """Recomputation repeats the forward's arithmetic: the same gradients bit for bit (and no
    NaN from a saved E4M3 residual)."""
    r = randn(5, (M, N), jnp.float32)
    policies = ("none", "full", *NEW)

    def grads(x, w):  # every policy in one program: one compile
        out = []
        for policy in policies:
            f = checkpointed(matmul(path), policy)
            out.append(jax.grad(lambda x, w, f=f: jnp.sum(f(x, w) * r), argnums=(0, 1))(x, w))
        return out

    ref, *others = jax.jit(grads)(X, W)
    assert np.isfinite(np.asarray(ref[0], np.float32)).all()
    for policy, got in zip(policies[1:], others, strict=True):
        for a, b in zip(got, ref, strict=True):
            np.testing.assert_array_equal(
                np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=policy
            )


# --- A tiny model's block ----------------------------------------------------------------

B, L = 2, 16


def model_cfg(level, policy, style="gpt"):
    c = train_lib.load_config("tiny", style)
    c.fp8.level, c.fp8.cast_kernel = level, "xla"
    c.model.remat_policy, c.model.dtype = policy, "bfloat16"
    return spec.parse(c).model


@functools.cache
def block_setup(level, style="gpt", scales=False):
    """(Block module, params, FP8 state, input) of configs/tiny.py's block at ``level``;
    ``scales``: the FP8 state's scales set per operand kind instead of the initial 1s."""
    cfg = model_cfg(level, "none", style)
    x = randn(6, (B, L, cfg.d_model))
    pos = jnp.broadcast_to(jnp.arange(L), (B, L))
    variables = jax.jit(Block(cfg).init)(jax.random.key(0), x, pos, None)
    # A scale per operand kind, none 1: a scale that a rebuilt FP8 copy takes from the wrong
    # operand changes the gradients.
    by_kind = {".x.scale": 8.0, ".w.scale": 64.0, ".dy.scale": 4.0}

    def scaled(path, v):
        key = jax.tree_util.keystr(path)
        return v * next((f for k, f in by_kind.items() if key.endswith(k)), 1.0)

    fp8 = variables.get(FP8, {})
    fp8 = jax.tree_util.tree_map_with_path(scaled, fp8) if scales else fp8
    return cfg, variables["params"], fp8, x, pos


def block_fn(level, policy, style="gpt", cfg=None, scales=False):
    """``(params, x) -> (block output, FP8 state)`` under ``nn.remat`` with ``policy``, as
    ``Transformer._blocks`` wraps it; ``cfg`` replaces the block's model config (same params);
    ``scales``: as ``block_setup``'s."""
    setup_cfg, _, fp8, _, pos = block_setup(level, style, scales=scales)
    block = Block if policy == "none" else nn.remat(Block, policy=REMAT_POLICIES[policy])
    # The config names the policy too, as the model's does: layers read it (rebuilds_operands).
    module = block(dataclasses.replace(setup_cfg if cfg is None else cfg, remat_policy=policy))

    def f(params, x):
        (y, _), state = module.apply({"params": params, FP8: fp8}, x, pos, None, mutable=[FP8])
        return y, state[FP8]

    return f


def test_block_saves_named_fp8_operands():
    """GPT block at O1: the FP8 policies keep each linear's E4M3 input (q, kv, o, wi: d_model
    wide; wo: d_ff wide) and kernel; 'full' and dots_saveable keep no E4M3 tensor."""
    cfg, params, _, x, _ = block_setup("O1")
    t, d, f = B * L, cfg.d_model, cfg.d_ff
    inputs = [(t, d)] * 4 + [(t, f)]
    kernels = [(d, d), (d, 2 * d), (d, d), (d, f), (f, d)]  # q, kv, o, wi, wo
    for policy in ("fp8_inputs_saveable", "fp8_dots_and_inputs_saveable"):
        saved = fp8_saved(residuals(block_fn("O1", policy), params, x))
        assert saved == sorted(inputs + kernels), policy
    for policy in ("full", "dots_saveable", "fp8_dots_saveable"):
        assert fp8_saved(residuals(block_fn("O1", policy), params, x)) == [], policy


def test_block_o0_policies():
    """At O0 (no FP8 matmul) fp8_dots_saveable keeps what dots_saveable keeps and
    fp8_inputs_saveable what 'full' keeps."""
    _, params, _, x, _ = block_setup("O0")
    res = {p: sorted(residuals(block_fn("O0", p), params, x)) for p in REMAT_POLICIES}
    assert res["fp8_dots_saveable"] == res["dots_saveable"] != res["full"]
    assert res["fp8_dots_and_inputs_saveable"] == res["dots_saveable"]
    assert res["fp8_inputs_saveable"] == res["full"]


def test_block_gradients_unchanged_by_policy():
    """A LLaMA block at O1: parameter and input gradients and the FP8 state (dy's amax) are the
    same bits under every policy as without remat."""
    _, params, _, x, _ = block_setup("O1", "llama")
    r = randn(7, x.shape, jnp.float32)
    # The activations_* policies save bf16 values (the residual stream, the MLP's hidden layer)
    # that XLA:CPU otherwise keeps in f32 inside a fusion: test_activations_saveable_gradients.
    policies = ("none", "full", *(p for p in NEW if p not in ACTIVATIONS))

    def grads(params, x):  # every policy in one program: one compile
        out = []
        for policy in policies:
            f = block_fn("O1", policy, "llama")

            def loss(params, x, f=f):
                y, state = f(params, x)
                return jnp.sum(y.astype(jnp.float32) * r), state

            out.append(jax.grad(loss, argnums=(0, 1), has_aux=True)(params, x))
        return out

    ref, *others = jax.jit(grads)(params, x)
    for policy, got in zip(policies[1:], others, strict=True):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
            np.testing.assert_array_equal(
                np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=policy
            )


def elementwise_fn(level, style, on):
    """``(params, x) -> block output`` without block remat, ``recompute_elementwise=on``."""
    cfg, _, fp8, _, pos = block_setup(level, style)
    module = Block(dataclasses.replace(cfg, recompute_elementwise=on))

    def f(params, x):
        (y, _), _ = module.apply({"params": params, FP8: fp8}, x, pos, None, mutable=[FP8])
        return y

    return f


def dot_count(f, params, x) -> int:
    """``dot_general`` equations in the gradient program of ``f``: forward, recomputation and
    backward GEMMs (attention's too, under ``attention_impl='xla'``)."""

    def loss(p, x):
        return jnp.sum(f(p, x)[0].astype(jnp.float32))

    return str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(params, x)).count("dot_general")


@pytest.mark.parametrize("cast", ["xla", "interpret"])
@pytest.mark.parametrize("level", ["O0", "O1"])
@pytest.mark.parametrize("style", ["gpt", "llama"])
def test_activations_saveable_recomputes_no_gemm(style, level, cast):
    """'activations_saveable' keeps no E4M3 copy and no f32 norm intermediate, yet its backward
    pass runs as many GEMMs as without remat: no matmul or attention forward is recomputed
    ('full' runs more, so the count sees a recomputation). Its bf16 [B, L, D] residuals are
    the block's input and the MLP norm's. 'activations_and_weights_saveable' keeps the same
    plus, at O1, one E4M3 copy of each weight and nothing else in E4M3. ``cast='interpret'``:
    the fused casts (``rebuild``) and GPT's fused FP8 MLP."""
    cfg, params, _, x, _ = block_setup(level, style)
    cfg = dataclasses.replace(cfg, cast_kernel=cast)

    def fn(policy):
        return block_fn(level, policy, style, cfg)

    res = residuals(fn("activations_saveable"), params, x)
    assert fp8_saved(res) == []
    assert (jnp.dtype(jnp.float32), (B, L, cfg.d_model)) not in res
    assert [r for r in res if r == (BF16, (B, L, cfg.d_model))] == [(BF16, (B, L, cfg.d_model))] * 2
    with_w = residuals(fn("activations_and_weights_saveable"), params, x)
    kept = lambda rs: sorted(activations(r for r in rs if r[0] != E4M3))  # noqa: E731
    assert kept(with_w) == kept(res)  # the same activations
    leaves = jax.tree_util.tree_leaves_with_path(params)
    kernels = sorted(v.size for p, v in leaves if "kernel" in jax.tree_util.keystr(p))
    saved = sorted(math.prod(shape) for shape in fp8_saved(with_w))  # as [K, N] GEMM operands
    assert len(saved) == (len(kernels) if level == "O1" else 0), (saved, kernels)
    for s, k in zip(saved, kernels if saved else [], strict=True):  # XLA's casts pad K and N
        assert k <= s <= 1.1 * k, (saved, kernels)  # to multiples of 16
    ref = dot_count(fn("none"), params, x)
    for policy in ACTIVATIONS:
        assert dot_count(fn(policy), params, x) == ref < dot_count(fn("full"), params, x), policy


@pytest.mark.parametrize("policy", ACTIVATIONS)
@pytest.mark.parametrize(
    "style,cast,fuse_mlp",
    [
        ("gpt", "xla", True),
        ("gpt", "interpret", True),
        ("gpt", "interpret", False),
        ("llama", "xla", True),
    ],
)
def test_activations_saveable_gradients(style, cast, fuse_mlp, policy):
    """In f32 (no bf16 value rounded where a fusion ends) 'activations_saveable' gives the same
    parameter and input gradients and FP8 state as no remat: what it saves is what the forward
    computed, and what it recomputes is the forward's arithmetic again. To f32 summation order:
    XLA:CPU sums GPT's bias gradients over the B * L tokens in another order under remat
    ('full' too). ``cast='interpret'``: the fused casts, which cast x and w again under this
    policy; with ``fuse_mlp`` GPT's fused FP8 MLP, whose backward rebuilds wo's E4M3 input,
    without it wo's own cast, which rebuilds act(h) through its GELU prologue."""
    cfg, params, _, x, _ = block_setup("O1", style, scales=True)  # cached before block_fn
    cfg = dataclasses.replace(
        cfg, dtype=jnp.dtype(jnp.float32), cast_kernel=cast, fuse_mlp=fuse_mlp
    )
    x = x.astype(jnp.float32)
    r = randn(9, x.shape, jnp.float32)

    def grads(params, x):
        out = []
        for p in ("none", policy):
            f = block_fn("O1", p, style, cfg, scales=True)

            def loss(p, x, f=f):
                y, st = f(p, x)
                return jnp.sum(y * r), st

            out.append(jax.grad(loss, argnums=(0, 1), has_aux=True)(params, x))
        return out

    ref, got = jax.jit(grads)(params, x)
    eps = float(np.finfo(np.float32).eps)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        b = np.asarray(b, np.float32)
        np.testing.assert_allclose(
            np.asarray(a, np.float32), b, rtol=B * L * eps, atol=eps * np.abs(b).max()
        )


def fp8_kernel_outputs(f, *args) -> list[tuple[str, ...]]:
    """The output dtypes of every Pallas call in the jaxpr of ``grad(sum(f(*args)[0]))``."""

    def loss(*a):
        return jnp.sum(f(*a)[0].astype(jnp.float32))

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=tuple(range(len(args)))))(*args).jaxpr
    return [tuple(str(v.aval.dtype) for v in eqn.outvars) for eqn in pallas_calls(jaxpr)]


@pytest.mark.parametrize(
    "policy,x_rebuilt,w_rebuilt",
    [("none", 0, 0), ("activations_saveable", 4, 5), ("activations_and_weights_saveable", 4, 0)],
)
def test_remat_policies_cast_each_operand_once_per_layout(policy, x_rebuilt, w_rebuilt):
    """GPT block at O1 with the fused casts: under 'activations_saveable' no E4M3 cast writes
    both layouts (each forward cast the one its GEMM reads), and the backward casts x for the
    four GEMMs whose input it rebuilds (q, kv, o, wi: wo's comes out of the GELU' pass) and the
    five weights again, one layout each and without an amax. Keeping the weights' copies
    ('activations_and_weights_saveable') leaves only x's; without remat nothing is cast twice."""
    cfg, params, _, x, _ = block_setup("O1")
    cfg = dataclasses.replace(cfg, cast_kernel="interpret")
    calls = fp8_kernel_outputs(block_fn("O1", policy, "gpt", cfg), params, x)
    e4m3 = [c for c in calls if set(c) <= {"float8_e4m3fn", "float32"} and "float8_e4m3fn" in c]
    both = [c for c in e4m3 if c.count("float8_e4m3fn") == 2]
    again = [c for c in e4m3 if c == ("float8_e4m3fn",)]  # one layout, no amax
    assert len(again) == x_rebuilt + w_rebuilt, calls
    if policy == "none":
        assert both and len(both) == len(e4m3), calls
    elif policy == "activations_saveable":
        assert both == [], calls
    else:  # the weights' forward casts keep dgrad's layout too
        assert both, calls


def activations(res) -> list[tuple]:
    """The residuals with a token axis first ([B, L, ...] or [B * L, ...]): not the weights."""
    return [(d, s) for d, s in res if len(s) >= 2 and s[0] in (B, B * L)]


# Not GPT at O1: its unfused MLP's GELU output feeds only wo's E4M3 cast, so autodiff keeps
# nothing more than the recompute would; the fused FP8 MLP's saving is the next test's.
@pytest.mark.parametrize(("level", "style"), [("O0", "gpt"), ("O0", "llama"), ("O1", "llama")])
def test_recompute_elementwise_keeps_no_activation_intermediates(level, style):
    """With model.recompute_elementwise, the MLP keeps one wide (>= d_ff per token) tensor
    besides its E4M3 operands (its first matmul's output), and the activation residuals
    shrink."""
    cfg, params, _, x, _ = block_setup(level, style)

    def wide(res):
        return [(d, s) for d, s in res if d != E4M3 and math.prod(s) >= B * L * cfg.d_ff]

    def nbytes(res):
        return sum(d.itemsize * math.prod(s) for d, s in res)

    off = activations(residuals(elementwise_fn(level, style, False), params, x))
    on = activations(residuals(elementwise_fn(level, style, True), params, x))
    assert len(wide(on)) == 1 <= len(wide(off)), (wide(off), wide(on))
    assert nbytes(on) < nbytes(off)


def test_recompute_elementwise_rebuilds_the_fused_mlps_fp8_input():
    """GPT's fused FP8 MLP (fused casts) with model.recompute_elementwise keeps no E4M3
    [d_ff, tokens] residual (wo's input for its weight gradient), only the narrower ones."""
    cfg, params, fp8, x, pos = block_setup("O1")
    cfg = dataclasses.replace(cfg, cast_kernel="interpret")
    assert layers.fuses_mlp(cfg)

    def saved(on):
        module = Block(dataclasses.replace(cfg, recompute_elementwise=on))

        def f(params, x):
            (y, _), _ = module.apply({"params": params, FP8: fp8}, x, pos, None, mutable=[FP8])
            return y

        return fp8_saved(residuals(f, params, x))

    wo_input = (cfg.d_ff, B * L)
    off, on = saved(False), saved(True)
    assert wo_input in off and wo_input not in on, (off, on)
    assert sorted(off) == sorted([*on, wo_input])


@pytest.mark.parametrize("style", ["gpt", "llama"])
def test_recompute_elementwise_o0_mechanism(style):
    """At O0, GPT's MLP recomputes GELU in wo's own backward (ops.act_dot, no remat barrier
    around the MLP: measured faster on an H200); LLaMA's runs under nn.remat."""
    _, params, _, x, _ = block_setup("O0", style)
    f = elementwise_fn("O0", style, True)
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda p, x: jnp.sum(f(p, x)), argnums=(0, 1)))(params, x))
    assert ("name=_act_dot" in jaxpr) == (style == "gpt")
    assert ("checkpoint" in jaxpr or "remat" in jaxpr) == (style == "llama")


@pytest.mark.parametrize("style", ["gpt", "llama"])
@pytest.mark.parametrize("level", ["O0", "O1"])
def test_recompute_elementwise_gradients_unchanged(level, style):
    """The same parameter and input gradients with and without the recompute, to f32 rounding
    (f32 activations: XLA:CPU rounds a recomputed bf16 value where its fusions end)."""
    cfg, params, fp8, x, pos = block_setup(level, style)
    cfg = dataclasses.replace(cfg, dtype=jnp.dtype(jnp.float32))
    x = x.astype(jnp.float32)
    r = randn(8, x.shape, jnp.float32)

    def grads(params, x):
        out = []
        for on in (False, True):
            module = Block(dataclasses.replace(cfg, recompute_elementwise=on))

            def loss(p, x, module=module):
                (y, _), _ = module.apply({"params": p, FP8: fp8}, x, pos, None, mutable=[FP8])
                return jnp.sum(y * r)

            out.append(jax.grad(loss, argnums=(0, 1))(params, x))
        return out

    ref, got = jax.jit(grads)(params, x)
    # The recomputation is elementwise and gives the same bits on the CPUs measured; XLA:CPU
    # may still fuse (and contract into FMAs) the recomputed terms apart from the forward's,
    # and the backward sums them over d_model: relative error up to d_model ulps, plus one ulp
    # of the largest gradient where an entry cancels to near zero.
    eps = float(np.finfo(np.float32).eps)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        b = np.asarray(b)
        np.testing.assert_allclose(
            np.asarray(a), b, rtol=cfg.d_model * eps, atol=eps * np.abs(b).max()
        )


# --- A compiled train step ------------------------------------------------------------------


def micro_config(policy, recompute=False):
    """configs/tiny.py shrunk to one block at O1, with ``policy``. f32 activations: with bf16,
    XLA:CPU rounds a recomputed bf16 value where its fusions end, which differ between the
    forward and the recomputation, so even 'full' moves the gradients by bf16 rounding."""
    c = train_lib.load_config("tiny")
    m = c.model
    m.num_layers, m.d_model, m.num_heads, m.num_kv_heads, m.d_ff = 1, 64, 2, 2, 128
    m.vocab_size, m.max_len, m.remat_policy = 128, 16, policy
    m.recompute_elementwise = recompute
    c.seq_len, c.batch_size = 16, 4
    return c


def two_step_losses(policy, recompute=False):
    """The losses of two compiled train steps (the second after the first's update)."""
    c = micro_config(policy, recompute)
    env = train_lib.setup(spec.parse(c))
    state = env.init(jax.random.PRNGKey(c.seed))
    tok = np.random.default_rng(0).integers(0, 128, (4, 17)).astype(np.int32)
    losses = []
    for _ in range(2):
        state, metrics = env.train_step(state, {"inputs": tok[:, :-1], "targets": tok[:, 1:]})
        losses.append(float(metrics["loss"]))
    return losses


def test_train_step_loss_matches_full():
    """The policy that saves the most of ours against 'full' (the block tests cover the rest)."""
    assert two_step_losses("fp8_dots_and_inputs_saveable") == two_step_losses("full")


def test_train_step_with_recompute_elementwise_matches():
    """The scanned train step with model.recompute_elementwise. Remat leaves the forward pass
    as it is: the first loss is the same bits. The second follows an update whose gradients
    differ by summation order; Adam's normalized update times the learning rate moves a weight
    by far less than its ulp, so at most a few weights round the other way: a few ulps of
    the loss."""
    (first, second), (first_ref, second_ref) = (
        two_step_losses("none", True),
        two_step_losses("none"),
    )
    assert first == first_ref
    np.testing.assert_allclose(second, second_ref, rtol=4 * float(np.finfo(np.float32).eps))


def test_policies_named_in_config_comment():
    """configs/base.py's comment on model.remat_policy (the lines just above it) lists every
    policy."""
    lines = (ROOT / "configs/base.py").read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if "m.remat_policy =" in line)
    start = at
    while lines[start - 1].strip().startswith("#"):
        start -= 1
    text = "\n".join(lines[start : at + 1])
    missing = [name for name in REMAT_POLICIES if f"'{name}'" not in text]
    assert not missing, f"configs/base.py: model.remat_policy's comment lacks {missing}"
