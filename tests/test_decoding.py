"""Fast decoding: FP8 weights quantized once per call, prefill and decode as separate programs,
the trainer's end-of-run sample through the same programs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_generate import PROMPTS, VOCAB, build, greedy_reference, jitted_apply, model_cfg

from fp8jax.models import decode
from fp8jax.nn.state import FP8_WEIGHTS
from fp8jax.ops import scaling
from fp8jax.ops.gemm import GemmConfig
from fp8jax.trainer import generate

E4M3 = jnp.dtype(jnp.float8_e4m3fn)


ONCE = sorted(n for n in scaling.RECIPES if scaling.make_recipe(n).quantizes_weights_once)


def test_the_per_tensor_recipes_quantize_weights_once():
    assert ONCE and all(scaling.make_recipe(n).per_tensor for n in ONCE)


@pytest.mark.parametrize("name", ONCE)
@pytest.mark.parametrize("prologue", [None, "gelu_tanh"])
def test_prequantized_matmul_equals_the_matmuls_forward(name, prologue):
    """Every recipe that quantizes weights once: its E4M3 copy's GEMM gives the values of its
    per-call matmul (same bits, x cast the same way; the copy holds E4M3 values), under a
    stored scale that is not the weight's own amax's."""
    recipe = scaling.make_recipe(name)
    key_x, key_w = jax.random.split(jax.random.PRNGKey(0))
    x = jax.random.normal(key_x, (32, 64), jnp.float32)
    w = jax.random.normal(key_w, (64, 48), jnp.float32) * 0.1
    meta = scaling.init_meta(recipe)
    meta = meta.replace(w=meta.w.replace(scale=jnp.float32(500.0)))
    cfg = GemmConfig(x.dtype, w.dtype, x.dtype, False, "xla", prologue)
    want, _ = recipe.matmul(cfg, x, w, meta)
    wq = recipe.quantize_weight(w, meta.w)
    assert wq.q.dtype == E4M3 and wq.q.shape == w.shape
    got = recipe.prequantized_matmul(cfg, x, wq, meta)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert float(jnp.abs(want).max()) > 0


def trained_fp8(model, variables):
    """The FP8 state as a trained run leaves it: scales from a forward pass's amax."""
    tokens = jax.random.randint(jax.random.PRNGKey(3), (2, 12), 0, VOCAB)
    apply = jax.jit(functools.partial(model.apply, mutable=["fp8_state"]))
    _, mutated = apply(variables, tokens)
    return jax.tree.map(
        lambda m: m.replace(x=scaling.commit(m.x), w=scaling.commit(m.w)),
        mutated["fp8_state"],
        is_leaf=lambda m: hasattr(m, "dy"),
    )


@pytest.fixture(scope="module")
def gpt_o1():
    """A tiny unrolled O1 GPT (fused Q/K/V and MLP, as gpt_1b3) with trained scales."""
    model, variables = build(model_cfg("gpt", level="O1", scan_layers=False, fused_qkv=True))
    fp8 = trained_fp8(model, variables)
    return model, {"params": variables["params"], "fp8_state": fp8}


def e4m3_casts(closed_jaxpr) -> int:
    """How many casts to E4M3 a program holds (inner jaxprs included)."""
    return str(closed_jaxpr.jaxpr).count("new_dtype=float8_e4m3fn")


def test_o1_decode_reads_weights_quantized_once(gpt_o1):
    """O1 greedy decoding gives the tokens of a full-recompute loop on the training model (its
    fused FP8 MLP and Q/K/V, every weight cast per call). The prefill casts each FP8 matmul's
    weight once and hands the E4M3 copies to the decode program, whose steps cast only the
    activations: one E4M3 cast per matmul, not two."""
    model, variables = gpt_o1
    params, fp8 = variables["params"], variables["fp8_state"]
    out = generate.generate_ids(model, params, fp8, PROMPTS, 6)
    for prompt, got in zip(PROMPTS, out, strict=True):
        assert got == greedy_reference(model, variables, prompt, 6)
    decoder = generate.decoder_for(model.cfg, "fp8_state")
    tokens_BxP = np.zeros((4, 16), np.int32)
    lengths_B = np.asarray([3, 10, 1, 0], np.int32)
    pick = (jax.random.PRNGKey(0), 0.0, 0, 1.0, jnp.asarray([-1]), np.ones(VOCAB, bool))
    fixed = (params, fp8, {})
    prefill = decoder.prefill.trace(*fixed, tokens_BxP, lengths_B, *pick, cache_len=32)
    cast, weights, cache, out_BxM, tok_B, done_B, bad = decoder.prefill(
        *fixed, tokens_BxP, lengths_B, *pick, cache_len=32
    )
    assert cast == {}  # O1: the E4M3 copies are what the steps read
    copies = jax.tree.leaves(weights, is_leaf=lambda w: isinstance(w, scaling.QuantizedWeight))
    matmuls = len(jax.tree.leaves(fp8, is_leaf=lambda m: isinstance(m, scaling.Fp8Meta)))
    assert matmuls == 4 * 2 and len(copies) == matmuls  # qkv, o, wi, wo per layer
    assert all(w.q.dtype == E4M3 for w in copies)
    kernels = sum(
        x.size for path, x in jax.tree_util.tree_leaves_with_path(params) if "kernel" in str(path)
    )
    head = model.cfg.d_model * VOCAB  # the LM head stays in cfg.dtype
    assert sum(w.q.size for w in copies) == kernels - head
    loop = (lengths_B, jnp.int32(6), *pick)
    step = decoder.decode.trace(
        *fixed, weights, cache, out_BxM, tok_B, done_B, bad, *loop, watch=False
    )
    assert e4m3_casts(prefill.jaxpr) == 2 * matmuls  # x and w of each matmul
    assert e4m3_casts(step.jaxpr) == matmuls  # x only: the weights come in as E4M3
    e4m3_in = [a for a in jax.tree.leaves(step.args_info) if a.dtype == E4M3]
    assert len(e4m3_in) == matmuls


def test_o1_cached_logits_equal_the_training_models(gpt_o1):
    """Prefill (which quantizes the weights) then single-token steps on those weights: every
    logit equals the training model's full forward pass (per-call casts) under the same scales,
    for right-padded prompts of unequal lengths (a cache position off by one is O(scale))."""
    model, variables = gpt_o1
    decoding = decoder_model(model)
    lengths, steps = [3, 7], 4
    seqs = np.asarray(jax.random.randint(jax.random.PRNGKey(1), (2, 7 + steps), 0, VOCAB))
    full_BxLxV = jitted_apply(model)(variables, jnp.asarray(seqs))
    tol = 1e-5 * float(jnp.abs(full_BxLxV).max())
    cache = decode.init_cache(decoding, variables, 2, 16)
    prompt_Bx8 = np.where(np.arange(8) < np.asarray(lengths)[:, None], seqs[:, :8], 0)
    positions = jnp.broadcast_to(jnp.arange(8), (2, 8))
    prefill = jax.jit(functools.partial(decode.prefill, decoding))
    logits, cache, weights = prefill(variables, cache, jnp.asarray(prompt_Bx8), positions)
    assert weights, "the prefill quantized no weight"
    for i, n in enumerate(lengths):
        np.testing.assert_allclose(logits[i, :n], full_BxLxV[i, :n], atol=tol, rtol=0)
    step = jax.jit(functools.partial(decode.step, decoding))
    with_weights = {**variables, FP8_WEIGHTS: weights}
    for t in range(steps):
        pos_Bx1 = jnp.asarray(lengths)[:, None] + t
        toks_Bx1 = jnp.asarray([[seqs[i, n + t]] for i, n in enumerate(lengths)])
        logits, cache = step(with_weights, cache, toks_Bx1, pos_Bx1)
        for i, n in enumerate(lengths):
            np.testing.assert_allclose(logits[i, 0], full_BxLxV[i, n + t], atol=tol, rtol=0)


def f32_to_bf16_converts(closed_jaxpr, sizes: set[int]) -> int:
    """How many f32 -> bf16 casts of an array of one of ``sizes`` elements a program holds."""
    found = 0

    def walk(jaxpr):
        nonlocal found
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "convert_element_type":
                (x,), (y,) = eqn.invars, eqn.outvars
                if (x.aval.dtype, y.aval.dtype) == (jnp.float32, jnp.bfloat16):
                    found += int(np.prod(x.aval.shape)) in sizes
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(closed_jaxpr.jaxpr)
    return found


@pytest.mark.parametrize("style", ["gpt", "llama"])
def test_o0_bf16_decode_reads_weights_cast_once(style, monkeypatch):
    """At O0 computing in bf16 on f32 params, the prefill casts each matmul weight and
    embedding table to bf16 once and the decode steps read those casts: the step program casts
    none of them, the logits from the casts are the f32 params' bit for bit (the cast each
    layer makes), and the generated tokens are those of decoding on the f32 params' own step
    program."""
    model, variables = build(model_cfg(style, scan_layers=style == "gpt", dtype="bfloat16"))
    params = variables["params"]
    decoder = generate.decoder_for(model.cfg, "fp8_state")
    cast = decoder.step_params(params)
    leaves = dict(jax.tree_util.tree_leaves_with_path(params))
    kinds = {str(p): x.dtype for p, x in jax.tree_util.tree_leaves_with_path(cast)}
    read = {k for k in kinds if "kernel" in k or "embedding" in k}
    assert read and all(kinds[k] == jnp.bfloat16 for k in read)
    assert all(kinds[k] == jnp.float32 for k in kinds.keys() - read)  # norms, biases
    for path, x in jax.tree_util.tree_leaves_with_path(cast):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(leaves[path].astype(x.dtype)))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 12), 0, VOCAB)
    apply = jitted_apply(model)
    np.testing.assert_array_equal(
        np.asarray(apply({"params": cast}, tokens)), np.asarray(apply(variables, tokens))
    )
    tokens_BxP, lengths_B = np.zeros((2, 16), np.int32), np.asarray([3, 10], np.int32)
    pick = (jax.random.PRNGKey(0), 0.0, 0, 1.0, jnp.asarray([-1]), np.ones(VOCAB, bool))
    fixed = (params, {}, {})
    out = decoder.prefill(*fixed, tokens_BxP, lengths_B, *pick, cache_len=32)
    assert jax.tree.structure(out[0]) == jax.tree.structure(params)
    loop = (lengths_B, jnp.int32(6), *pick)
    sizes = {x.size for k, x in jax.tree_util.tree_leaves_with_path(params) if str(k) in read}
    step = decoder.decode.trace(out[0], *fixed[1:], *out[1:], *loop, watch=False)
    uncast = decoder.decode.trace(*fixed, *out[1:], *loop, watch=False)
    assert f32_to_bf16_converts(step.jaxpr, sizes) == 0
    assert f32_to_bf16_converts(uncast.jaxpr, sizes) >= len(sizes)  # what the cast saves
    read = []  # the params each decode call of generate_ids gets
    decode_call = decoder.decode
    spy = lambda p, *a, **k: (read.append(p), decode_call(p, *a, **k))[1]  # noqa: E731
    monkeypatch.setattr(decoder, "decode", spy)
    generate.generate_ids(model, params, {}, [[1, 2, 3]], 6)
    monkeypatch.undo()
    assert len(read) == 1 and jax.tree.map(lambda x: x.dtype, read[0]) == jax.tree.map(
        lambda x: x.dtype, out[0]
    )
    got = decoder.decode(out[0], *fixed[1:], *out[1:], *loop, watch=False)[0]
    out = decoder.prefill(*fixed, tokens_BxP, lengths_B, *pick, cache_len=32)
    want = decoder.decode(*fixed, *out[1:], *loop, watch=False)[0]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def decoder_model(model):
    """The model the decoder of ``model`` runs."""
    return generate.decoder_for(model.cfg, "fp8_state").model


def test_prefill_per_prompt_bucket_one_decode_per_cache_bucket():
    """Prompts in two prompt-length buckets with the same cache bucket: two prefill programs,
    one decode program; the tokens equal a full-recompute argmax loop's."""
    model, variables = build(model_cfg("llama", scan_layers=True, num_kv_heads=2))
    params = variables["params"]
    generate.decoder_for.cache_clear()
    short = generate.generate_ids(model, params, {}, [[5, 6, 7]], 20)  # prompt 8, cache 32
    decoder = generate.decoder_for(model.cfg, "fp8_state")
    assert dict(decoder.traces) == {"prefill": 1, "decode": 1}
    long = generate.generate_ids(model, params, {}, [list(range(1, 13))], 14)  # prompt 16
    assert dict(decoder.traces) == {"prefill": 2, "decode": 1}
    assert short[0] == greedy_reference(model, variables, [5, 6, 7], 20)
    assert long[0] == greedy_reference(model, variables, list(range(1, 13)), 14)


class _Ids:
    """A tokenizer of plain ids: text is the ids joined by spaces."""

    eos_id = None

    def encode(self, text):
        return [int(t) for t in text.split()]

    def decode(self, ids):
        return "".join(f" {i}" for i in ids)


def test_end_sample_is_generates_sample_compiled_ahead(gpt_o1):
    """The trainer's end-of-run sample is ``generate``'s text for its prompt and settings; with
    its programs compiled ahead in the background (``compile_sample``, from a state committed
    to a device as the trainer's, whose arrays are gone by then) it compiles nothing."""
    model, variables = gpt_o1
    generate.decoder_for.cache_clear()
    device = jax.devices()[0]

    def on_device():  # fresh copies of the params and scales, committed to the device
        trees = (variables["params"], variables["fp8_state"])
        return jax.tree.map(lambda x: jax.device_put(jnp.array(x, copy=True), device), trees)

    committed = on_device()

    class State:
        params, fp8, moe_state = committed[0], committed[1], None

    ahead = generate.compile_sample(model, State, _Ids(), 5, prompt="7 8")
    State.params, State.fp8 = on_device()
    compiles = []

    def listener(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    ahead.result()
    jax.tree.map(lambda x: x.delete(), committed)  # a train step donated them
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        text = generate.end_sample(model, State, _Ids(), 5, prompt="7 8", compiled=ahead)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == []
    want = generate.generate(
        model, State.params, State.fp8, _Ids(), ["7 8"], 5, temperature=generate.SAMPLE_TEMPERATURE
    )
    assert text == "7 8" + want[0] and len(text.split()) == 7


@pytest.mark.parametrize("width", [32, 128])
def test_o1_moe_decode_reads_the_expert_stacks_quantized_once(width):
    """An O1 MoE model decodes the tokens of full recompute, and its expert stacks join the
    weights the prefill casts once: every decode step casts only the activations. At 128 wide
    the experts' rows come in the dispatch's padded layout, as the Hopper kernels read them."""
    from fp8jax import spec
    from fp8jax.trainer import loop as train_lib

    c = train_lib.load_config("moe_tiny")
    c.fp8.level, c.seq_len = "O1", 16
    c.model.update(d_model=width, num_heads=2, num_kv_heads=2, vocab_size=VOCAB, max_len=32)
    c.model.moe.update(num_experts=4, top_k=2, d_ff=width // 2 if width < 128 else width)
    model, variables = build(spec.parse(c).model)
    params, fp8 = variables["params"], trained_fp8(model, variables)
    out = generate.generate_ids(model, params, fp8, PROMPTS, 4)
    for prompt, got in zip(PROMPTS, out, strict=True):
        assert got == greedy_reference(model, {"params": params, "fp8_state": fp8}, prompt, 4)
    decoder = generate.decoder_for(model.cfg, "fp8_state")
    tokens_BxP, lengths_B = np.zeros((2, 16), np.int32), np.asarray([3, 10], np.int32)
    pick = (jax.random.PRNGKey(0), 0.0, 0, 1.0, jnp.asarray([-1]), np.ones(VOCAB, bool))
    fixed = (params, fp8, {})
    cast, weights, cache, out_BxM, tok_B, done_B, bad = decoder.prefill(
        *fixed, tokens_BxP, lengths_B, *pick, cache_len=32
    )
    copies = jax.tree.leaves(weights, is_leaf=lambda w: isinstance(w, scaling.QuantizedWeight))
    metas = jax.tree.leaves(fp8, is_leaf=lambda m: isinstance(m, scaling.Fp8Meta))
    stacks = [w for w in copies if w.q.ndim == 3]  # [E, N, K]: the experts' gate/up and down
    assert len(copies) == len(metas) and stacks and all(w.q.dtype == E4M3 for w in copies)
    loop = (lengths_B, jnp.int32(4), *pick)
    step = decoder.decode.trace(
        *fixed, weights, cache, out_BxM, tok_B, done_B, bad, *loop, watch=False
    )
    assert e4m3_casts(step.jaxpr) == len(metas)  # x only: the weights come in as E4M3
