"""Transformer invariants on tiny shapes: FP8 placement, causality, scan/remat equivalence."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from fp8jax import FP8, FP8_STATS, models, spec
from fp8jax.trainer import loop as train_lib

B, L = 2, 16  # batch, sequence length of every test input
LINEARS_PER_LAYER = 5  # q, kv, o, wi, wo
LOGICAL_PARAM_AXES = {"vocab", "embed", "mlp", "heads", "kv_heads", "head_dim", "layers", "norm"}


def tiny(style="gpt", level="O1", **model):
    """configs/tiny.py with overrides; the test models are that size."""
    config = train_lib.load_config("tiny", style)
    config.fp8.level = level
    config.model.update(model)
    return config


def build(config):
    """The model of a config, as the trainer builds it."""
    return models.build_model(spec.parse(config).model)


def tokens(seed=0):
    return jax.random.randint(jax.random.key(seed), (B, L), 0, 512, jnp.int32)


def init(config, abstract=False):
    """(model, unboxed variables); O0 gets an empty FP8 collection so one loss fits all."""
    model = build(config)
    init_fn = jax.eval_shape if abstract else lambda f, *a: jax.jit(f)(*a)
    variables = nn.unbox(init_fn(model.init, jax.random.key(0), tokens()))
    return model, {"params": variables["params"], FP8: variables.get(FP8, {})}


@functools.cache
def _cached_init(style, level, overrides):
    return init(tiny(style, level, **dict(overrides)))


def cached_init(style="gpt", level="O1", **overrides):
    """``init`` shared between tests (XLA compiles dominate this file's run time)."""
    return _cached_init(style, level, tuple(sorted(overrides.items())))


@functools.partial(jax.jit, static_argnums=0)
def apply_mutable(model, variables, tokens_BxL):
    """Forward pass as in training: logits plus the FP8 state with this step's amax."""
    logits_BxLxV, mutated = model.apply(variables, tokens_BxL, mutable=[FP8])
    return logits_BxLxV, mutated.get(FP8, {})


@functools.partial(jax.jit, static_argnums=0)
def loss_and_grads(model, variables, tokens_BxL):
    """Next-token loss and grads, the train-step pattern of fp8jax/nn/state.py."""

    def loss_fn(params, fp8):
        logits_BxLxV, mutated = model.apply({"params": params, FP8: fp8}, tokens_BxL, mutable=[FP8])
        logp = jax.nn.log_softmax(logits_BxLxV[:, :-1])
        nll = -jnp.take_along_axis(logp, tokens_BxL[:, 1:, None], axis=-1)
        return jnp.mean(nll), mutated.get(FP8, {})

    grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)
    return grad_fn(variables["params"], variables[FP8])


# Same math, different XLA fusions: on CPU results agree to rounding. On GPU a last-bit change
# in an operand can flip an FP8 rounding step (E4M3 spacing is 1/8 relative), which moves some
# gradient entries by ~1e-3 of the tensor's scale; a wrong layer order or a missing term moves
# them by O(1).
TOL = 1e-5 if jax.default_backend() == "cpu" else 5e-3


def assert_trees_close(a, b):
    """Every leaf equal within TOL, relative to the element and to the leaf's largest value."""

    def close(x, y):
        scale = float(np.max(np.abs(y))) if np.size(y) else 0.0
        np.testing.assert_allclose(x, y, rtol=TOL, atol=TOL * scale + 1e-7)

    jax.tree.map(close, a, b)


@pytest.mark.parametrize("style", ["gpt", "llama"])
@pytest.mark.parametrize("level", ["O0", "O1"])
def test_forward_and_causality(style, level):
    model, variables = cached_init(style, level)
    t = L // 2
    a = tokens(1)
    b = a.at[:, t + 1 :].set((a[:, t + 1 :] + 7) % 512)  # change every token after t
    logits_a, fp8 = apply_mutable(model, variables, a)
    logits_b, _ = apply_mutable(model, variables, b)
    assert logits_a.shape == (B, L, 512) and logits_a.dtype == jnp.float32
    assert np.isfinite(logits_a).all()
    # Untrained logits ~ N(0, small): the head is not accidentally scaled up.
    assert 0 < float(jnp.std(logits_a)) < 2
    # Causal: logits up to t are bit-identical; later ones do change.
    np.testing.assert_array_equal(logits_a[:, : t + 1], logits_b[:, : t + 1])
    assert not np.allclose(logits_a[:, t + 1 :], logits_b[:, t + 1 :])
    # FP8 state exists only at O1+, and every FP8 matmul recorded this step's x and w amax.
    assert bool(jax.tree.leaves(fp8)) == (level != "O0")
    pending = pending_amax(fp8)
    assert all(v > 0 for k, v in pending.items() if "/x/" in k or "/w/" in k), pending


def pending_amax(fp8):
    """Pending (this step's) amax of every x/w/dy state, by path."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(fp8)[0]:
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        if name.endswith("amax_history"):
            out[name] = float(jnp.min(leaf[..., 0]))
    return out


def test_forward_bf16_tied_fp8_head():
    model, variables = init(tiny("llama", dtype="bfloat16", tie_embeddings=True, fp8_lm_head=True))
    assert "head" not in variables["params"] and "head" in variables[FP8]
    # The health pass (FP8_STATS) works through nn.scan: one value per layer.
    apply = jax.jit(lambda v, t: model.apply(v, t, mutable=[FP8, FP8_STATS]))
    logits, mutated = apply(variables, tokens())
    assert logits.dtype == jnp.float32 and np.isfinite(logits).all()
    (saturated,) = mutated[FP8_STATS]["blocks"]["mlp"]["wo"]["Fp8DotGeneral_0"]["x_saturated"]
    assert saturated.shape == (2,)


def restack(tree, num_layers):
    """Python-loop layout ({'block_0': ..., 'block_1': ...}) -> nn.scan layout ({'blocks': ...})."""
    tree = dict(tree)
    layers = [tree.pop(f"block_{i}") for i in range(num_layers)]
    tree["blocks"] = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
    return tree


def test_scan_matches_loop():
    # LLaMA style: RoPE and grouped-query attention inside the scanned block too.
    loop_model, loop_vars = init(tiny("llama", scan_layers=False))
    scan_model = build(tiny("llama", scan_layers=True))
    scan_vars = {k: restack(v, 2) for k, v in loop_vars.items()}
    # The restacked tree has exactly the structure nn.scan initialises.
    expected = jax.eval_shape(scan_model.init, jax.random.key(0), tokens())
    assert jax.tree.structure(nn.unbox(expected)) == jax.tree.structure(scan_vars)

    (loss_l, fp8_l), grads_l = loss_and_grads(loop_model, loop_vars, tokens())
    (loss_s, fp8_s), grads_s = loss_and_grads(scan_model, scan_vars, tokens())
    np.testing.assert_allclose(loss_l, loss_s, rtol=TOL)
    assert_trees_close(restack(grads_l[0], 2), grads_s[0])
    assert_trees_close(restack(fp8_l, 2), fp8_s)  # amaxes recorded in the forward pass
    assert_trees_close(restack(grads_l[1], 2), grads_s[1])  # dy amaxes from the backward pass


# Two of the policies: the others differ only inside jax.checkpoint, not in this code.
@pytest.mark.parametrize("policy", ["full", "dots_with_no_batch_dims_saveable"])
def test_remat_matches_no_remat(policy):
    model, variables = cached_init("llama")
    remat_model = build(tiny("llama", remat_policy=policy))
    (loss, fp8), grads = loss_and_grads(model, variables, tokens())
    (loss_r, fp8_r), grads_r = loss_and_grads(remat_model, variables, tokens())
    np.testing.assert_allclose(loss, loss_r, rtol=TOL)
    assert_trees_close(grads, grads_r)
    assert_trees_close(fp8, fp8_r)


def test_tied_block_grads_change_only_the_schedule():
    """Unrolled + remat: one optimization barrier per block joins its input and weight
    gradients (so XLA:GPU cannot defer the weight-gradient GEMMs); every number is the same."""
    cfg = dict(scan_layers=False, remat_policy="full")
    model, variables = init(tiny("llama", tie_block_grads=False, **cfg))
    tied = build(tiny("llama", tie_block_grads=True, **cfg))
    (loss, fp8), grads = loss_and_grads(model, variables, tokens())
    (loss_t, fp8_t), grads_t = loss_and_grads(tied, variables, tokens())
    assert float(loss) == float(loss_t)
    jax.tree.map(np.testing.assert_array_equal, (grads, fp8), (grads_t, fp8_t))

    def barriers(m):
        return loss_and_grads.lower(m, variables, tokens()).as_text().count("optimization_barrier")

    assert barriers(tied) - barriers(model) == tiny("llama").model.num_layers


def count_dots(hlo: str) -> tuple[int, int]:
    """(FP8 dot_generals, other dot_generals) in StableHLO text, all of which must be in main."""
    funcs = re.split(r"\n\s*func\.func ", hlo)
    assert all("dot_general" not in f for f in funcs if not f.startswith("public @main")), (
        "a dot_general sits in an outlined function; counting text would miss its calls"
    )
    dots = [line for line in hlo.splitlines() if "stablehlo.dot_general" in line]
    fp8 = [line for line in dots if re.search(r"xf8E(4M3FN|5M2)>", line)]
    return len(fp8), len(dots) - len(fp8)


@pytest.mark.parametrize("style", ["gpt", "llama"])
def test_fp8_gemms_in_hlo(style):
    """O1: each block linear is 3 FP8 GEMMs (fwd, dgrad, wgrad); no other dot changes."""
    counts = {}
    for level, fp8_lm_head in (("O0", False), ("O1", False), ("O1", True)):
        config = tiny(style, level, scan_layers=False, fp8_lm_head=fp8_lm_head)
        model, variables = init(config, abstract=True)  # lowering needs shapes only
        lowered = loss_and_grads.lower(model, variables, tokens())
        counts[level, fp8_lm_head] = count_dots(lowered.as_text())
    fp8_o0, other_o0 = counts["O0", False]
    fp8_o1, other_o1 = counts["O1", False]
    block_gemms = 3 * LINEARS_PER_LAYER * 2  # 2 layers
    assert fp8_o0 == 0
    assert fp8_o1 == block_gemms
    # Exactly the block linears moved to FP8: attention and the LM head did not.
    assert other_o1 == other_o0 - block_gemms
    assert counts["O1", True] == (block_gemms + 3, other_o1 - 3)


def _fuse_qkv(attn, num_kv_heads):
    """The fused layout's params from separate q [.., N, H] and kv [.., 2, K, H] params."""
    out = {k: v for k, v in attn.items() if k not in ("q", "kv")}
    out["qkv"] = {}
    for leaf in attn["q"]:  # kernel, and bias in the GPT style
        q, kv = attn["q"][leaf], attn["kv"][leaf]
        q_KxGxH = q.reshape(*q.shape[:-2], num_kv_heads, -1, q.shape[-1])
        kv_Kx2xH = jnp.moveaxis(kv, -3, -2)
        out["qkv"][leaf] = jnp.concatenate([q_KxGxH, kv_Kx2xH], axis=-2)
    return out


@pytest.mark.parametrize("style", ["gpt", "llama"])
def test_fused_qkv_is_the_same_attention(style):
    """fused_qkv: one GEMM with q, k, v in [embed, kv_heads, group + 2, head_dim] order."""
    model, variables = cached_init(style, "O0")
    fused_config = tiny(style, "O0", fused_qkv=True)
    fused_model, fused_abstract = init(fused_config, abstract=True)
    params = dict(variables["params"])
    blocks = dict(params["blocks"])
    blocks["attn"] = _fuse_qkv(blocks["attn"], model.cfg.num_kv_heads)
    params["blocks"] = blocks
    shapes = lambda t: jax.tree.map(lambda x: x.shape, t)  # noqa: E731
    assert shapes(params) == shapes(fused_abstract["params"])
    a = tokens(3)
    logits = model.apply(variables, a)
    fused = fused_model.apply({"params": params, FP8: {}}, a)
    np.testing.assert_allclose(fused, logits, rtol=1e-5, atol=1e-6)
    # O1: 4 block linears (qkv, o, wi, wo), each 3 FP8 GEMMs, in each of the 2 layers.
    o1_model, o1_vars = init(tiny(style, "O1", fused_qkv=True, scan_layers=False), abstract=True)
    fp8_dots, _ = count_dots(loss_and_grads.lower(o1_model, o1_vars, a).as_text())
    assert fp8_dots == 3 * (LINEARS_PER_LAYER - 1) * 2


def test_partition_names():
    model = build(tiny("llama"))
    boxed = jax.eval_shape(model.init, jax.random.key(0), tokens())["params"]
    specs = nn.get_partition_spec(boxed)
    flat = jax.tree_util.tree_flatten_with_path(specs)[0]
    shapes = jax.tree.leaves(nn.unbox(boxed))
    assert len(flat) == len(shapes)
    for (path, axes), shape in zip(flat, shapes, strict=True):
        name = jax.tree_util.keystr(path)
        assert len(axes) == len(shape.shape), name
        assert {a for a in axes if a} <= LOGICAL_PARAM_AXES, name
        assert any(axes), f"{name} has no logical axis names"
        assert (axes[0] == "layers") == name.startswith("['blocks']"), name


def test_matmul_params_match_model():
    for style in ("gpt", "llama"):
        config = tiny(style)
        _, variables = init(config, abstract=True)
        kernels = [
            x
            for p, x in jax.tree_util.tree_flatten_with_path(variables["params"])[0]
            if "kernel" in jax.tree_util.keystr(p)
        ]
        assert models.matmul_params(spec.parse(config).model) == sum(x.size for x in kernels)
        n = models.count_params(variables["params"])
        assert n == models.count_params(nn.unbox(variables["params"]))


def test_fuse_mlp_applies_only_to_the_gpt_mlp_with_its_fused_gelu():
    """On by default, fp8.fuse_mlp is ignored (and the model builds) where it cannot apply."""
    from fp8jax.models import layers

    cases = [("gpt", True, True), ("gpt", False, False), ("llama", True, False)]
    for style, fuse_activation, want in cases:
        config = tiny(style) if style == "llama" else tiny()
        config.fp8.fuse_activation = fuse_activation
        assert config.fp8.fuse_mlp  # the default
        cfg = spec.parse(config).model
        assert layers.fuses_mlp(cfg) == want, (style, fuse_activation)
        models.build_model(cfg)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("model.num_heads", 3, r"num_heads=3 does not divide model.d_model=128"),
        ("model.num_kv_heads", 3, r"not divisible by model.num_kv_heads=3"),
        ("model.style", "bert", r"unknown model.style 'bert'"),
        ("fp8.level", "O4", r"unknown fp8.level 'O4'"),
        ("fp8.recipe", "mxfp8", r"unknown fp8.recipe 'mxfp8'"),
        ("fp8.m_format", "int8", r"unknown fp8.m_format 'int8'"),
        ("fp8.master_format", "fp16", r"unknown fp8.master_format 'fp16'"),
        ("model.remat_policy", "some", r"unknown model.remat_policy 'some'"),
        ("seq_len", 65, r"seq_len=65 exceeds model.max_len=64"),
        ("model.attention_impl", "flash", r"unknown model.attention_impl 'flash'"),
    ],
)
def test_parse_errors(field, value, message):
    config = tiny()
    section, _, key = field.rpartition(".")
    (config[section] if section else config)[key] = value
    with pytest.raises(ValueError, match=message) as err:
        spec.parse(config)
    assert "\n" not in str(err.value) and ": " in str(err.value)  # one line, with the fix


def test_recipe_comes_from_the_fp8_section():
    config = tiny()
    config.fp8.update(recipe="delayed", history_len=4, margin=1, power_of_two=True)
    run = spec.parse(config)
    recipe = run.fp8.recipe
    assert (recipe.history_len, recipe.margin, recipe.power_of_two) == (4, 1, True)
    assert run.model.recipe == recipe  # the model's matmuls use it from O1 on
    config.fp8.level = "O0"
    assert spec.parse(config).model.recipe is None  # plain matmuls


@pytest.mark.parametrize("style, scan", [("gpt", True), ("llama", True), ("llama", False)])
def test_packed_examples_equal_each_alone(style, scan):
    """Two examples packed in one row (segment ids, positions restarting at 0) give each one's
    logits alone: attention does not cross the boundary and positions restart."""
    model, variables = cached_init(style, "O0", scan_layers=scan)
    n = 5  # the first example's length; the second fills the rest of the row
    row = tokens(3)[:1]
    positions = jnp.concatenate([jnp.arange(n), jnp.arange(L - n)])[None]
    segments = jnp.concatenate([jnp.ones(n, jnp.int32), jnp.full(L - n, 2, jnp.int32)])[None]
    packed = model.apply(variables, row, positions, segments)
    first = model.apply(variables, row[:, :n])
    second = model.apply(variables, row[:, n:])
    np.testing.assert_allclose(packed[:, :n], first, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(packed[:, n:], second, rtol=1e-5, atol=1e-5)
    # Without the segment ids the second example sees the first one: its logits differ.
    unmasked = model.apply(variables, row, positions)
    assert not np.allclose(unmasked[:, n:], second, rtol=1e-3, atol=1e-3)


def test_rope_frequencies_follow_llama3_scaling():
    """The scaled inverse frequencies against a direct evaluation of Llama 3's rule."""
    from fp8jax.models.config import RopeScaling
    from fp8jax.models.rope import rope_frequencies

    s = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_len=64)
    half, theta = 16, 500_000.0
    got = np.asarray(rope_frequencies(half, theta, s))
    inv = theta ** (-np.arange(half) / half)
    want = []
    for f in inv:
        wavelen = 2 * np.pi / f
        if wavelen < s.original_max_len / s.high_freq_factor:
            want.append(f)  # short wavelengths: unchanged
        elif wavelen > s.original_max_len / s.low_freq_factor:
            want.append(f / s.factor)  # long wavelengths: slowed by the factor
        else:
            t = (s.original_max_len / wavelen - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor
            )
            want.append((1 - t) * f / s.factor + t * f)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    # All three regimes occur at this size, so each branch is checked.
    kept, slowed = np.isclose(got, inv), np.isclose(got, inv / s.factor)
    assert kept.any() and slowed.any() and (~kept & ~slowed).any()
