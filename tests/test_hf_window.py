"""Sliding-window attention (Mistral, Qwen2's use_sliding_window) against transformers itself,
past the window: logits, greedy generation through the key/value cache, the export, and the
window combined with packed segments."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hf_testing import FAMILIES, VOCAB, random_init, rel_max, torch_logits

from fp8jax import errors, hf
from fp8jax import tokenizer as tokenizer_lib
from fp8jax.hf import weights
from fp8jax.models import build_model
from fp8jax.models.layers import segment_mask
from fp8jax.ops.attention import causal_attention
from fp8jax.trainer import generate

WINDOW, LENGTH = 8, 24  # three windows: every query past the first window drops keys
TOKENS = np.random.default_rng(1).integers(0, VOCAB, (2, LENGTH))
F32_TOL = 1e-4  # as tests/test_hf.py: the same math in another order; a mapping error is O(1)


def windowed(family, directory, **changes):
    """A random ``family`` (hf_testing.FAMILIES) model with ``changes`` saved in ``directory``."""
    import transformers

    cls_name, kwargs = FAMILIES[family]
    config = getattr(transformers, cls_name)(vocab_size=VOCAB, **{**kwargs, **changes})
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    random_init(model)
    model.save_pretrained(directory)
    tokenizer_lib.train(["a b c"] * 4, VOCAB, min_frequency=1).save(directory / "tokenizer.json")
    return model


def apply(model_cfg, params, tokens, **kwargs):
    return np.asarray(build_model(model_cfg).apply({"params": params}, tokens, **kwargs))


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """A Mistral of window 8 and 128 positions, loaded into fp8jax (f32)."""
    d = tmp_path_factory.mktemp("mistral")
    model = windowed("mistral", d, sliding_window=WINDOW)
    return model, hf.load(d)


def test_mistral_logits_equal_transformers_past_the_window(mistral):
    model, loaded = mistral
    assert (loaded.model_cfg.sliding_window, loaded.model_cfg.max_len) == (WINDOW, 128)
    theirs = torch_logits(model, TOKENS)
    assert rel_max(apply(loaded.model_cfg, loaded.params, TOKENS), theirs) <= F32_TOL
    # The same weights attending to the whole prefix differ past the window: the test sees it.
    full = dataclasses.replace(loaded.model_cfg, sliding_window=0)
    assert rel_max(apply(full, loaded.params, TOKENS), theirs) > 1e-2


def test_greedy_generation_past_the_window_equals_transformers(mistral):
    """Greedy ids through fp8jax's key/value cache equal transformers' ``generate`` (whose
    cache honours the window) token for token, 20 tokens after a 12-token prompt."""
    import torch

    model, loaded = mistral
    prompts = [TOKENS[0, :12].tolist(), TOKENS[1, :5].tolist()]
    ours = generate.generate_ids(build_model(loaded.model_cfg), loaded.params, {}, prompts, 20)
    for prompt, got in zip(prompts, ours, strict=True):
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=20,
                min_new_tokens=20,
                do_sample=False,
                pad_token_id=0,
            )
        assert got == out[0, len(prompt) :].tolist()


def test_sliding_window_imports_only_where_every_layer_has_it(tmp_path):
    model = windowed(
        "qwen2",
        tmp_path / "all",
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=0,
    )
    loaded = hf.load(tmp_path / "all")
    assert loaded.model_cfg.sliding_window == WINDOW
    theirs = torch_logits(model, TOKENS)
    assert rel_max(apply(loaded.model_cfg, loaded.params, TOKENS), theirs) <= F32_TOL
    # A window recorded but unused (Qwen2: use_sliding_window=False, or no layer past
    # max_window_layers) is no window; a window on some layers only has no fp8jax form.
    windowed("qwen2", tmp_path / "off", sliding_window=WINDOW)
    assert hf.architecture(tmp_path / "off")["sliding_window"] == 0
    windowed("qwen2", tmp_path / "none", use_sliding_window=True, sliding_window=WINDOW)
    assert hf.architecture(tmp_path / "none")["sliding_window"] == 0  # 2 layers < 28
    windowed("mistral", tmp_path / "null", sliding_window=None)  # Mistral 7B v0.2 and later
    assert hf.architecture(tmp_path / "null")["sliding_window"] == 0
    windowed(
        "qwen2",
        tmp_path / "some",
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=1,
    )
    with pytest.raises(errors.CheckpointError, match=r"sliding window on layers \[1\] of 2"):
        hf.architecture(tmp_path / "some")


EXPORTS = {  # a windowed fp8jax model -> the HF family that carries its window
    "mistral": dict(style="llama", qkv_bias=False, tie_embeddings=False),
    "qwen2": dict(style="llama", qkv_bias=True, tie_embeddings=True),
}


@pytest.mark.parametrize("kind", sorted(EXPORTS))
def test_windowed_export_equals_transformers_past_the_window(tmp_path, kind):
    import transformers

    m = dataclasses.replace(
        hf.default_model_cfg(),
        vocab_size=VOCAB,
        d_model=64,
        num_heads=4,
        num_kv_heads=2,
        d_ff=96,
        max_len=64,
        rope_scaling=None,
        sliding_window=WINDOW,
        **EXPORTS[kind],
    )
    rng = np.random.default_rng(0)
    flat = {}
    for k, s in weights.param_shapes(m).items():  # bf16-representable: the export is exact
        x = rng.standard_normal(s.shape).astype(np.float32)
        x = x * 0.3 + 1 if x.ndim == 1 else x * 0.08
        flat[k] = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    params = weights.unflatten(flat)
    tok = tokenizer_lib.train(["a b c"] * 4, VOCAB, min_frequency=1)
    hf.save_hf(tmp_path / "out", m, params, tok)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype="float32")
    assert type(model).__name__.lower().startswith(kind)
    assert rel_max(apply(m, params, TOKENS), torch_logits(model.eval(), TOKENS)) <= F32_TOL
    assert hf.architecture(tmp_path / "out")["sliding_window"] == WINDOW  # and back


def test_window_without_a_hugging_face_form_is_refused(tmp_path):
    m = dataclasses.replace(
        hf.default_model_cfg(),
        style="gpt",
        vocab_size=VOCAB,
        d_model=32,
        num_heads=2,
        num_kv_heads=2,
        d_ff=64,
        max_len=32,
        sliding_window=WINDOW,
    )
    params = weights.unflatten(
        {k: np.zeros(s.shape, np.float32) for k, s in weights.param_shapes(m).items()}
    )
    tok = tokenizer_lib.train(["a b c"] * 4, VOCAB, min_frequency=1)
    with pytest.raises(errors.CheckpointError, match="GPT2LMHeadModel has no sliding-window"):
        hf.save_hf(tmp_path / "out", m, params, tok)
    assert not (tmp_path / "out").exists()


def test_window_with_packed_segments():
    """The op's window with a segment mask equals softmax over an explicit mask (keys i-7..i
    of the query's own segment); and a model fed two packed documents gives each the logits it
    has alone."""
    rng = np.random.default_rng(2)
    q, k, v = (jnp.asarray(rng.standard_normal((2, LENGTH, 4, 16)), jnp.float32) for _ in "qkv")
    k, v = k[:, :, :2], v[:, :, :2]  # grouped-query: 2 key/value heads
    seg = np.repeat(np.array([[0, 1, 2], [0, 0, 1]]), LENGTH // 3, axis=1)  # 8, 16 tokens
    seg[0, 5:8] = 1  # and a segment shorter than the window
    mask = segment_mask(jnp.asarray(seg))
    got = causal_attention(q, k, v, mask, "xla", WINDOW)
    i, j = np.arange(LENGTH)[:, None], np.arange(LENGTH)[None, :]
    allowed = (j <= i) & (j > i - WINDOW) & (seg[:, :, None] == seg[:, None, :])  # [B, L, L]
    kk, vv = np.repeat(np.asarray(k), 2, axis=2), np.repeat(np.asarray(v), 2, axis=2)
    s = np.einsum("blnh,bmnh->bnlm", np.asarray(q), kk) / 4.0
    s = np.where(allowed[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("bnlm,bmnh->blnh", p / p.sum(-1, keepdims=True), vv)
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=0)

    m = dataclasses.replace(
        hf.default_model_cfg(),
        vocab_size=VOCAB,
        d_model=32,
        num_heads=2,
        num_kv_heads=1,
        d_ff=64,
        max_len=64,
        sliding_window=WINDOW,
        qkv_bias=False,
        rope_scaling=None,
    )
    params = weights.unflatten(
        {
            k: (np.random.default_rng(3).standard_normal(s.shape) * 0.1).astype(np.float32)
            + (1.0 if len(s.shape) == 1 else 0.0)
            for k, s in weights.param_shapes(m).items()
        }
    )
    a, b = TOKENS[0, :10], TOKENS[1, :14]  # each longer than the window
    packed = np.concatenate([a, b])[None]
    positions = np.concatenate([np.arange(10), np.arange(14)])[None]
    segments = np.concatenate([np.zeros(10, int), np.ones(14, int)])[None]
    together = jax.jit(lambda t, p, s: build_model(m).apply({"params": params}, t, p, s))(
        packed, positions, segments
    )
    alone = np.concatenate([apply(m, params, a[None]), apply(m, params, b[None])], axis=1)
    np.testing.assert_allclose(np.asarray(together), alone, atol=1e-5, rtol=0)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN flash attention needs a GPU")
def test_cudnn_window_equals_xla_window_with_segments():
    """cuDNN's ``sliding_window_length`` keeps the same keys as the XLA mask: output and
    gradients of bf16 windowed attention with packed segments agree within bf16 rounding."""
    rng = np.random.default_rng(4)
    length, window = 256, 64
    q, k, v = (jnp.asarray(rng.standard_normal((2, length, 4, 64)), jnp.bfloat16) for _ in "qkv")
    seg = np.repeat(np.array([[0, 1], [0, 0]]), length // 2, axis=1)
    mask = segment_mask(jnp.asarray(seg))

    def loss(q, k, v, impl):
        o = causal_attention(q, k, v, mask, impl, window)
        return jnp.sum(o.astype(jnp.float32) * jnp.arange(64, dtype=jnp.float32)), o

    run = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True), static_argnums=3)
    (_, o_xla), g_xla = run(q, k, v, "xla")
    (_, o_cudnn), g_cudnn = run(q, k, v, "cudnn")
    assert rel_max(o_cudnn.astype(jnp.float32), o_xla.astype(jnp.float32)) <= 2e-2
    for a, b in zip(g_cudnn, g_xla, strict=True):
        assert rel_max(a.astype(jnp.float32), b.astype(jnp.float32)) <= 2e-2
    # Against the whole causal prefix the outputs differ: the window is really applied.
    full = causal_attention(q, k, v, mask, "cudnn").astype(jnp.float32)
    assert rel_max(full, o_xla.astype(jnp.float32)) > 5e-2
