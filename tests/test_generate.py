"""KV-cache decoding against full recomputation, sampling filters, compile counts, the CLIs."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax import errors, models, spec
from fp8jax.models import decode
from fp8jax.ops import scaling
from fp8jax.trainer import generate, sampling
from fp8jax.trainer import loop as train_lib

VOCAB, MAX_LEN = 300, 32


def model_cfg(style="llama", level="O0", **model) -> models.ModelConfig:
    """A tiny f32 model of ``style`` (configs/tiny.py's fields, smaller)."""
    config = train_lib.load_config("tiny", style)
    config.fp8.level, config.seq_len = level, 16
    sizes = dict(d_model=32, num_layers=2, num_heads=4, num_kv_heads=4, d_ff=64)
    config.model.update(dict(sizes, vocab_size=VOCAB, max_len=MAX_LEN, **model))
    return spec.parse(config).model


def build(cfg, seed=0):
    """The model and its variables (params, and the FP8 state at O1)."""
    model = models.build_model(cfg)
    variables = jax.jit(model.init)(jax.random.PRNGKey(seed), jnp.zeros((1, 8), jnp.int32))
    return model, variables


@functools.lru_cache
def jitted_apply(model):
    """``model.apply``, jitted once per model."""
    return jax.jit(model.apply)


def greedy_reference(model, variables, prompt, n):
    """``n`` greedy tokens, each from a full forward pass over the whole sequence so far.

    The sequence sits in a fixed [1, MAX_LEN] buffer (one compile): the model is causal, so
    the tokens after it change nothing at its last position.
    """
    apply = jitted_apply(model)
    buf = np.zeros((1, MAX_LEN), np.int32)
    buf[0, : len(prompt)] = prompt
    for i in range(len(prompt), len(prompt) + n):
        buf[0, i] = int(jnp.argmax(apply(variables, jnp.asarray(buf))[0, i - 1]))
    return buf[0, len(prompt) : len(prompt) + n].tolist()


CASES = {
    "gpt-scan": dict(style="gpt", scan_layers=True),
    "llama-scan-gqa": dict(style="llama", scan_layers=True, num_kv_heads=2),
    "llama-unrolled-mqa": dict(style="llama", scan_layers=False, num_kv_heads=1),
}


@pytest.mark.parametrize("case", CASES)
def test_cached_logits_equal_full_recompute(case):
    """Prefill right-padded prompts of unequal lengths, then decode one token per row and step:
    every logit equals the full forward pass over that row's own sequence (f32)."""
    model, variables = build(model_cfg(**CASES[case]))
    lengths, steps = [3, 7], 6
    seqs = np.asarray(jax.random.randint(jax.random.PRNGKey(1), (2, 7 + steps), 0, VOCAB))
    apply, step = jitted_apply(model), jax.jit(functools.partial(decode.step, model))
    # Causal: a row's logits at its first n + steps positions are those of its own sequence.
    full_BxLxV = apply(variables, jnp.asarray(seqs))
    scale = float(jnp.abs(full_BxLxV).max())
    tol = 1e-5 * scale  # f32 sums in another order; a wrong position or mask is O(scale)
    cache = decode.init_cache(model, variables, 2, 16)
    prompt_Bx8 = np.where(np.arange(8) < np.asarray(lengths)[:, None], seqs[:, :8], 0)
    positions = jnp.broadcast_to(jnp.arange(8), (2, 8))
    logits, cache = step(variables, cache, jnp.asarray(prompt_Bx8), positions)
    for i, n in enumerate(lengths):
        np.testing.assert_allclose(logits[i, :n], full_BxLxV[i, :n], atol=tol, rtol=0)
    for t in range(steps):
        pos_Bx1 = jnp.asarray(lengths)[:, None] + t
        toks_Bx1 = jnp.asarray([[seqs[i, n + t]] for i, n in enumerate(lengths)])
        logits, cache = step(variables, cache, toks_Bx1, pos_Bx1)
        for i, n in enumerate(lengths):
            np.testing.assert_allclose(logits[i, 0], full_BxLxV[i, n + t], atol=tol, rtol=0)


@pytest.fixture(scope="module")
def llama():
    """A tiny GQA LLaMA (scanned) and its variables, shared by the generation tests."""
    return build(model_cfg("llama", scan_layers=True, num_kv_heads=2))


PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [3]]


def test_greedy_generation_equals_full_recompute_argmax(llama):
    """Greedy tokens of a batch of unequal prompts equal a full-recompute argmax loop run on
    each prompt alone, and generating one prompt alone gives the same tokens as in the batch."""
    model, variables = llama
    params, fp8 = variables["params"], variables.get("fp8_state", {})
    out = generate.generate_ids(model, params, fp8, PROMPTS, 6)
    for prompt, got in zip(PROMPTS, out, strict=True):
        assert got == greedy_reference(model, variables, prompt, 6)
    assert generate.generate_ids(model, params, fp8, PROMPTS[1:2], 6) == out[1:2]


def test_eos_stops_a_row(llama):
    """A row stops at its first EOS (left out of its output); the other rows go on."""
    model, variables = llama
    params = variables["params"]
    free = generate.generate_ids(model, params, {}, PROMPTS, 6)
    eos = free[0][2]  # the third token of row 0 becomes the stop token
    out = generate.generate_ids(model, params, {}, PROMPTS, 6, eos_ids=[VOCAB - 1, eos])
    for row, got in zip(free, out, strict=True):
        cut = row.index(eos) if eos in row else len(row)
        assert got == row[:cut]
    assert len(out[0]) == 2


def test_one_compile_for_many_tokens_prompts_and_settings(llama):
    """Within a (batch, prompt, cache) bucket, more tokens, other prompts and other sampling
    settings reuse the one compiled program: no backend compile at all on the later calls."""
    model, variables = llama
    params = variables["params"]
    compiles = []

    def listener(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    generate.decoder_for.cache_clear()  # a fresh decoder: its first call compiles
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        # Prompts of 9 to 16 tokens, and prompt + new tokens of 17 to 32: one bucket.
        generate.generate_ids(model, params, {}, [[1, 2, 3, 4, 5, 6, 7, 8, 9]], 8)
        decoder = generate.decoder_for(model.cfg, "fp8_state")
        traces, first = dict(decoder.traces), len(compiles)
        again = sampling.Sampling(temperature=0.7, top_k=5, top_p=0.9, seed=3)
        generate.generate_ids(model, params, {}, [[4] * 12], 12, again)
        generate.generate_ids(model, params, {}, [[9, 8, 7, 6, 5, 4, 3, 2, 1, 0]], 7)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert first >= 1 and len(compiles) == first, compiles
    assert dict(decoder.traces) == traces


def test_low_temperature_equals_greedy(llama):
    """A temperature near 0 samples the argmax, whatever the seed."""
    model, variables = llama
    params = variables["params"]
    greedy = generate.generate_ids(model, params, {}, PROMPTS, 5)
    for seed in (0, 1):
        cold = sampling.Sampling(temperature=1e-4, top_k=0, top_p=1.0, seed=seed)
        assert generate.generate_ids(model, params, {}, PROMPTS, 5, cold) == greedy


def draws(logits_V, n, temperature=1.0, top_k=0, top_p=1.0, seed=0):
    """``n`` independent draws from one row of logits."""
    logits_NxV = jnp.broadcast_to(jnp.asarray(logits_V, jnp.float32), (n, len(logits_V)))
    key = jax.random.PRNGKey(seed)
    return np.asarray(_next_tokens(logits_NxV, key, temperature, top_k, top_p))


_next_tokens = jax.jit(sampling.next_tokens)


def test_top_k_never_outside_the_k_best():
    logits_V = np.asarray(jax.random.normal(jax.random.PRNGKey(0), (64,)))
    got = draws(logits_V, 4000, temperature=2.0, top_k=5)
    best = set(np.argsort(-logits_V)[:5].tolist())
    assert set(got.tolist()) == best  # all five drawn, nothing else


def test_top_p_never_outside_the_nucleus():
    """probs (0.5, 0.3, 0.15, 0.05): p=0.7 keeps {0, 1} (0.5 < 0.7 <= 0.8), p=0.85 adds 2."""
    logits_V = np.log([0.3, 0.05, 0.5, 0.15])  # shuffled: the mask must follow the sort
    got = draws(logits_V, 4000, top_p=0.7)
    assert set(got.tolist()) == {0, 2}
    # Renormalised over the nucleus: 0.5 / 0.8 of the draws are token 2.
    assert abs(np.mean(got == 2) - 0.625) < 0.03
    assert set(draws(logits_V, 4000, top_p=0.85).tolist()) == {0, 2, 3}
    assert set(draws(logits_V, 4000, top_p=1.0).tolist()) == {0, 1, 2, 3}
    assert set(draws(logits_V, 100, top_p=0.1).tolist()) == {2}  # the top token always


def test_temperature_zero_is_argmax():
    logits_BxV = jax.random.normal(jax.random.PRNGKey(2), (16, 50))
    got = sampling.next_tokens(logits_BxV, jax.random.PRNGKey(0), 0.0, 3, 0.5)
    np.testing.assert_array_equal(got, jnp.argmax(logits_BxV, -1))


def test_o1_decoding_reads_the_stored_scales_and_keeps_them():
    """At O1 the cached logits equal the full pass under the same stored scales; other stored
    scales change them (they are read), and decoding returns only the cache (never a new
    FP8 state)."""
    cfg = model_cfg("gpt", level="O1", scan_layers=True, cast_kernel="xla")
    model, variables = build(cfg)
    # Scales as a trained run leaves them: from the amax of a forward pass.
    tokens = jax.random.randint(jax.random.PRNGKey(3), (2, 12), 0, VOCAB)
    _, mutated = jax.jit(functools.partial(model.apply, mutable=["fp8_state"]))(variables, tokens)
    fp8 = jax.tree.map(
        lambda m: m.replace(x=scaling_commit(m.x), w=scaling_commit(m.w)),
        mutated["fp8_state"],
        is_leaf=lambda m: hasattr(m, "dy"),
    )
    trained = {"params": variables["params"], "fp8_state": fp8}
    full = jitted_apply(model)(trained, tokens)
    step = jax.jit(functools.partial(decode.step, model))
    cache = decode.init_cache(model, trained, 2, 16)
    positions = jnp.broadcast_to(jnp.arange(12), (2, 12))
    cached, cache = step(trained, cache, tokens, positions)
    np.testing.assert_allclose(cached, full, atol=1e-5 * float(jnp.abs(full).max()), rtol=0)
    halved = jax.tree.map(
        lambda m: m.replace(x=m.x.replace(scale=m.x.scale / 3)),
        fp8,
        is_leaf=lambda m: hasattr(m, "dy"),
    )
    other, _ = step(
        {**trained, "fp8_state": halved},
        decode.init_cache(model, trained, 2, 16),
        tokens,
        positions,
    )
    assert float(jnp.abs(other - cached).max()) > 1e-3 * float(jnp.abs(full).max())
    assert set(cache) <= {"blocks"}  # the cache tree only


def test_an_fp8_models_cache_is_sized_without_tracing_its_casts(monkeypatch):
    """``init_cache`` sizes an O1 model's slots through its plain twin: no FP8 cast traced (the
    FP8 model's own sizing traces one per matmul), the same slots and dtypes."""
    from fp8jax.ops import formats

    cfg = model_cfg("gpt", level="O1", cast_kernel="xla", dtype="bfloat16")
    model, variables = build(cfg)
    casts = []
    quantize = formats.quantize
    monkeypatch.setattr(formats, "quantize", lambda *a, **k: casts.append(1) or quantize(*a, **k))
    got = jax.eval_shape(lambda: decode.init_cache(model, variables, 2, 16))
    assert not casts
    tokens, positions = jnp.zeros((2, 16), jnp.int32), jnp.broadcast_to(jnp.arange(16), (2, 16))
    sized = lambda: model.apply(variables, tokens, positions, mutable=["cache"])[1]["cache"]  # noqa: E731
    want = jax.eval_shape(sized)
    assert casts  # the FP8 model's own sizing casts
    assert jax.tree.structure(got) == jax.tree.structure(want)
    assert jax.tree.leaves(got) == jax.tree.leaves(want)  # shapes and dtypes
    assert {leaf.dtype for leaf in jax.tree.leaves(got)} == {jnp.dtype(jnp.bfloat16)}


def scaling_commit(state):
    """Roll the pending amax into the scale, as a train step's commit does."""
    from fp8jax.ops import scaling as scaling_ops

    return scaling_ops.commit(state)


def test_prompt_longer_than_the_context_is_one_line(llama):
    model, variables = llama
    with pytest.raises(
        errors.ConfigError,
        match=r"prompt 1 has 30 tokens and --max_new_tokens is 5.*context of 32.*at most 27",
    ):
        generate.generate_ids(model, variables["params"], {}, [[1], [2] * 30], 5)
    # No room for the prompt at all: lower --max_new_tokens (never "at most -N tokens").
    with pytest.raises(
        errors.ConfigError, match=r"32 tokens; lower --max_new_tokens to at most 29"
    ):
        generate.generate_ids(model, variables["params"], {}, [[1, 2, 3]], 40)
    with pytest.raises(errors.ConfigError, match=r"shorten the prompt below 32 tokens and lower"):
        generate.generate_ids(model, variables["params"], {}, [[1] * 32], 32)
    with pytest.raises(errors.ConfigError, match="top_p=1.5"):
        sampling.Sampling(temperature=1.0, top_k=0, top_p=1.5, seed=0)
    with pytest.raises(errors.ConfigError, match="outside"):
        generate.generate_ids(model, variables["params"], {}, [[VOCAB]], 2)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A 3-step O1 GPT run of configs/tiny.py (shrunk) and its corpus."""
    return _tiny_run(tmp_path_factory, "delayed")


@pytest.fixture(scope="module")
def block_workdir(tmp_path_factory):
    """The same run under the block recipe (its FP8 state stores no scales)."""
    return _tiny_run(tmp_path_factory, "block")


def _tiny_run(tmp_path_factory, recipe):
    from fp8_testing import novel, with_overrides

    root = tmp_path_factory.mktemp("gen")
    corpus = root / "corpus.txt"
    corpus.write_text(novel("pride-and-prejudice", 60_000))
    small = {
        "model.d_model": 64,
        "model.num_heads": 2,
        "model.num_kv_heads": 2,
        "model.d_ff": 128,
        "model.vocab_size": 320,
        "model.max_len": 32,
        "seq_len": 32,
        "batch_size": 4,
        "num_train_steps": 3,
        "warmup_steps": 1,
        "eval_batches": 1,
        "sample_tokens": 4,
        "compilation_cache_dir": "",
        "data.path": str(corpus),
        "fp8.recipe": recipe,
    }
    config = with_overrides(train_lib.load_config("tiny"), small)
    train_lib.train_and_evaluate(config, str(root / "wd"))
    return root / "wd", corpus, config


def file_hashes(root):
    import hashlib

    return {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("run", ["workdir", "block_workdir"])
def test_evaluate_equals_the_trainers_eval_and_changes_nothing(run, request, monkeypatch):
    """The O1 loss of the loaded checkpoint (its stored FP8 scales, or the block recipe that
    model.json records) equals the trainer's eval step on the trainer's own validation
    batches, restored the trainer's way."""
    from fp8jax.trainer import checkpoint, data, inference

    wd, _, config = request.getfixturevalue(run)
    before = file_hashes(wd)
    run = spec.parse(config)
    env = train_lib.setup(run)
    ckpt = checkpoint.Checkpointer(str(wd))
    state, _ = ckpt.restore(checkpoint.abstract_like(env.abstract, env.state_shardings))
    ckpt.close()
    dataset = data.build(run, str(wd))
    batches = dataset.eval_batches(2)
    trainer = env.objective.evaluate(env.eval_step, state, batches, env.batch_sharding)
    inf = inference.load(str(wd))
    assert inf.level == "O1"
    assert scaling.recipe_name(inf.model.cfg.recipe) == config.fp8.recipe
    # Nothing is pinned to a device: an array committed to the CPU would run every program
    # on the CPU, the GPU's params included.
    assert not any(x.committed for x in jax.tree.leaves((inf.params, inf.fp8_state)))
    ours = inference.evaluate(inf, np.asarray(dataset.val_tokens), 4, 32, 2)
    assert ours["loss"] == pytest.approx(trainer["val_loss"], rel=1e-6)
    monkeypatch.setattr(inference, "restore_fp8_state", lambda *a: pytest.fail("read at O0"))
    o0 = inference.evaluate(inference.load(str(wd), "O0"), np.asarray(dataset.val_tokens), 4, 32, 2)
    assert o0["loss"] != ours["loss"]  # O1 really ran FP8 matmuls
    assert file_hashes(wd) == before


def run_cli(module, *args, cwd=None):
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", module, *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=600, cwd=cwd)


ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def test_command_lines_print_and_change_nothing(workdir):
    wd, corpus, _ = workdir
    before = file_hashes(wd)
    sampled = ["--max_new_tokens=5", "--temperature=0.8", "--top_k=20", "--top_p=0.9"]
    gen = run_cli("fp8jax.generate", f"--ckpt={wd}", "--prompt=It is", "--prompt=Mr", *sampled)
    assert gen.returncode == 0, gen.stderr
    lines = gen.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith("It is") and lines[1].startswith("Mr")
    ev = run_cli("fp8jax.evaluate", f"--ckpt={wd}", f"--data={corpus}", "--num_batches=2")
    assert ev.returncode == 0, ev.stderr
    import json

    result = json.loads(ev.stdout.strip().splitlines()[-1])
    assert result["level"] == "O1" and result["batches"] == 2 and np.isfinite(result["loss"])
    assert file_hashes(wd) == before


@pytest.mark.parametrize(
    "module,args,message",
    [
        ("fp8jax.generate", ["--prompt=" + "x " * 40, "--max_new_tokens=8"], "context of 32"),
        ("fp8jax.generate", ["--prompt=" + "x " * 40], "shorten it to at most 31 tokens"),
        ("fp8jax.generate", ["--prompt=a", "--dtype=float16"], "no matmuls on a CPU"),
        ("fp8jax.generate", ["--prompt=a", "--top_p=2"], "--top_p=2.0: use"),
        ("fp8jax.generate", ["--prompt=a", "--level=O7"], "--level"),
        ("fp8jax.evaluate", ["--data=/nonexistent/x.txt"], "does not exist"),
        ("fp8jax.evaluate", ["--data=/nonexistent/x.txt", "--seq_len=0"], "--seq_len=0: use"),
        ("fp8jax.evaluate", ["--data=x.txt", "--dtype=float16"], "no matmuls on a CPU"),
        ("fp8jax.generate", ["--prompt=It is", "--max_new_tokens=0"], "--max_new_tokens=0: use"),
        ("fp8jax.generate", ["--prompt=a", "--max_new_tokens=40"], "--max_new_tokens to at most"),
        ("fp8jax.generate", ["--prompt=a", "--chat"], "has no chat template"),
        ("fp8jax.generate", ["--prompt=a", "--system=Be"], "--system is a chat turn"),
        ("fp8jax.generate", ["--prompt=a", "--stop=.", "--stop="], "--stop '': an empty"),
        ("fp8jax.generate", ["--prompts_file=/dev/null"], "/dev/null holds no prompt"),
    ],
)
def test_command_line_bad_input_is_one_line(workdir, module, args, message):
    wd, _, _ = workdir
    before = file_hashes(wd)
    out = run_cli(module, f"--ckpt={wd}", *args)
    assert out.returncode == 2, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and message in out.stderr, out.stderr
    assert "config." not in out.stderr and "at most -" not in out.stderr, out.stderr
    assert out.stdout == ""  # the prompt is not printed before its error
    assert file_hashes(wd) == before


def _edited(params, name: str, edit):
    """``params`` (unboxed) with ``edit(array)`` applied to the top-level param ``name``."""
    import flax

    flat = flax.traverse_util.flatten_dict(flax.linen.unbox(params), sep="/")
    flat[name] = edit(np.array(flat[name]))
    return flax.traverse_util.unflatten_dict(flat, sep="/")


def _poison_embedding_but(ids):
    """NaN in the embedding rows of every id but ``ids``."""
    others = np.setdiff1d(np.arange(VOCAB), ids)
    return "embed/embedding", lambda e: e.__setitem__(others, np.nan) or e


def _inf_in_head(kernel):
    """One Inf weight of the head: that id's logit is +-Inf from the first step on."""
    kernel[0, 7] = np.inf
    return kernel


NON_FINITE = {
    # injection: (param, edit, what the error names)
    "NaN after the prompt": (*_poison_embedding_but([0, *PROMPTS[0]]), "NaN at generated token 2"),
    "Inf from the prompt": ("head/kernel", _inf_in_head, "Inf at generated token 1"),
}


@pytest.mark.parametrize("case", list(NON_FINITE))
def test_non_finite_logits_stop_generation_naming_the_step(llama, case):
    """Injects NaN into the embedding rows of every id but the prompt's and the padding's (the
    prompt's logits are finite, the first generated token's are not), or one Inf into the head.
    Generation stops with a one-line NonFiniteOutputError naming the generated token and what
    was non-finite, for greedy and sampled decoding, instead of returning text."""
    model, variables = llama
    name, edit, fragment = NON_FINITE[case]
    bad = _edited(variables["params"], name, edit)
    for s in (sampling.GREEDY, sampling.Sampling(0.8, 0, 1.0, 0)):
        with pytest.raises(errors.NonFiniteOutputError) as info:
            generate.generate_ids(model, bad, {}, [PROMPTS[0]], 4, s)
        msg = str(info.value)
        assert "\n" not in msg and f"hold {fragment}" in msg, msg


class _PaddedTokenizer:
    """A tokenizer of ``size`` ids whose last ``reserved`` ids are placeholders."""

    def __init__(self, size: int, reserved: int):
        self.vocab_size, self.reserved = size, reserved

    def id_to_token(self, i: int) -> str:
        return f"<|reserved_{i}|>" if i >= self.vocab_size - self.reserved else f"t{i}"


def test_generation_never_picks_ids_past_the_tokenizer(llama):
    """A head that prefers the ids past a tokenizer's vocabulary (a padded embedding) and its
    ``<|reserved_*|>`` placeholders: unmasked, greedy and sampled decoding pick them; with the
    tokenizer's ``allowed_ids`` mask, never."""
    model, variables = llama
    tok = _PaddedTokenizer(VOCAB - 40, reserved=10)  # ids >= VOCAB - 50 decode to nothing
    allowed = generate.allowed_ids(tok, VOCAB)
    assert allowed.sum() == VOCAB - 50 and allowed[: VOCAB - 50].all()
    boost = np.zeros(VOCAB, np.float32)
    boost[VOCAB - 50 :] = 1.0

    def prefer_padding(kernel):  # a large logit for every padded id, whatever the input
        return kernel + 10.0 * np.sign(kernel.sum(0, keepdims=True)) * boost

    params = _edited(variables["params"], "head/kernel", prefer_padding)
    for s in (sampling.GREEDY, sampling.Sampling(1.0, 0, 1.0, 3)):
        free = generate.generate_ids(model, params, {}, PROMPTS, 6, s)
        assert any(t >= VOCAB - 50 for row in free for t in row)
        masked = generate.generate_ids(model, params, {}, PROMPTS, 6, s, allowed_V=allowed)
        assert all(t < VOCAB - 50 for row in masked for t in row), masked


def test_evaluate_names_its_own_flags_and_takes_relative_paths(workdir, tmp_path):
    """``evaluate`` on a text shorter than one batch advises its own flags, not the trainer's
    ``config.data.val_fraction``; ``evaluate`` and ``generate`` take a work dir relative to
    the current directory (orbax restores absolute paths only)."""
    wd, corpus, _ = workdir
    short = tmp_path / "short.txt"
    short.write_text("It is a truth universally acknowledged.")
    out = run_cli("fp8jax.evaluate", f"--ckpt={wd}", f"--data={short}")
    assert out.returncode == 2, out.stderr
    line = out.stderr.strip()
    assert "\n" not in line and "--batch_size" in line and "--seq_len" in line, line
    assert "val_fraction" not in line and "config." not in line, line
    # --workdir (train.py's name) is --ckpt's alias.
    ev = run_cli("fp8jax.evaluate", f"--workdir={wd.name}", f"--data={corpus}", cwd=wd.parent)
    assert ev.returncode == 0, ev.stderr
    gen = run_cli("fp8jax.generate", f"--workdir={wd.name}", "--prompt=It is", cwd=wd.parent)
    assert gen.returncode == 0 and gen.stdout.startswith("It is"), gen.stderr


def test_generate_on_a_corrupt_checkpoint_is_one_line(workdir, tmp_path):
    """Every array data file of the latest checkpoint (``ocdbt.process_*/d/``; its metadata
    intact) cut to 100 bytes: ``generate`` exits 2 with one line naming the checkpoint: the
    checksums saved with it differ; without them, orbax cannot read the arrays, and its
    unfinished reads report nothing after that line."""
    import shutil

    from fp8jax import checksums
    from fp8jax.hf import workdir as workdir_lib

    wd, _, _ = workdir
    copy = tmp_path / "wd"
    shutil.copytree(wd, copy)
    step_dir = workdir_lib.latest_step_dir(copy)
    for f in (step_dir / "state").rglob("*"):
        if f.is_file() and f.parent.name == "d" and f.parent.parent.name.startswith("ocdbt"):
            f.write_bytes(f.read_bytes()[:100])
    args = (f"--ckpt={copy}", "--prompt=It is", "--max_new_tokens=2")
    for problem in ("changed on disk since it was saved", "is unreadable"):
        out = run_cli("fp8jax.generate", *args)
        assert out.returncode == 2, out.stderr
        assert "Traceback" not in out.stderr and "Exception ignored" not in out.stderr
        lines = out.stderr.strip().splitlines()
        assert lines[-1].startswith("error: ") and str(step_dir) in lines[-1], lines[-3:]
        assert problem in lines[-1] and "tensorstore_spec" not in lines[-1], lines[-1]
        assert sum(line.startswith("error: ") for line in lines) == 1, lines[-3:]
        (step_dir / checksums.CHECKSUMS).unlink(missing_ok=True)


def test_evaluate_refuses_a_non_finite_loss_and_a_step_that_cannot_fit(workdir, monkeypatch):
    """A NaN weight makes the evaluated loss NaN: a one-line NonFiniteOutputError, not a
    result. With the device's memory reported as 1 KiB, evaluation stops after the compile
    with one line naming --batch_size and --seq_len."""
    import dataclasses

    from fp8jax.diagnostics import memory
    from fp8jax.trainer import inference

    wd, corpus, _ = workdir
    inf = inference.load(str(wd))
    tokens = inference.text_tokens(inf.tokenizer, str(corpus), 4 * 33)
    assert np.isfinite(inference.evaluate(inf, tokens, 4, 32, 1)["loss"])
    bad = dataclasses.replace(inf, params=_edited(inf.params, "embed/embedding", _all_nan))
    with pytest.raises(errors.NonFiniteOutputError, match=r"the loss is nan \(first at batch 0"):
        inference.evaluate(bad, tokens, 4, 32, 1)
    monkeypatch.setattr(memory, "device_memory_limit", lambda: 2**10)
    with pytest.raises(errors.ConfigError) as info:
        inference.evaluate(inf, tokens, 4, 32, 1)
    msg = str(info.value)
    assert msg.startswith("evaluating --batch_size 4 x --seq_len 32 needs"), msg
    assert "pass a smaller --batch_size or --seq_len" in msg, msg


def _all_nan(e):
    e[...] = np.nan
    return e


def test_evaluate_defaults_to_the_trained_seq_len(workdir, tmp_path):
    """Without --seq_len, evaluation runs at the seq_len the work dir's latest checkpoint
    trained with (here config.seq_len), else at DEFAULT_SEQ_LEN, never past the context."""
    from fp8jax.trainer import inference

    wd, _, config = workdir
    assert inference.default_seq_len(str(wd), 131_072) == config.seq_len
    assert inference.default_seq_len(str(wd), 8) == 8
    assert inference.default_seq_len(str(tmp_path), 131_072) == inference.DEFAULT_SEQ_LEN
    assert inference.default_seq_len(str(tmp_path), 64) == 64


def test_stop_strings_end_the_text_and_the_decode(workdir):
    """A stop string cuts the completion before its first occurrence and stops that row's
    decode there (fewer tokens than allowed); what a ``TextStream`` shows as it goes adds up to
    the final text and never shows the stop string; without stop strings, nothing is cut."""
    from fp8jax.trainer import inference

    wd, _, _ = workdir
    inf = inference.load(str(wd))
    args = (inf.model, inf.params, inf.fp8_state, inf.tokenizer, ["It is", "Mr"], 12)
    free = generate.generate(*args)
    text = free[0]
    middle = len(text) // 2
    stop = text[middle : middle + 2]
    assert stop, free
    shown = ["", ""]
    stream = generate.TextStream(
        inf.tokenizer, 2, [stop], lambda row, s: shown.__setitem__(row, shown[row] + s)
    )
    got = generate.generate(*args, stop=[stop], stream=stream)
    assert got[0] == text[: text.find(stop)]
    assert got[1] == generate.cut_at_stop(free[1], [stop])[0]
    assert len(stream.ids[0]) < 12 and stream.ended[0]
    assert shown == got
    assert generate.generate(*args, stop=["\x00never"]) == free


@pytest.mark.parametrize("level", ["O0", "O1"])
def test_programs_compiled_ahead_from_the_plan_serve_the_call(workdir, level):
    """``inference.plan``'s shapes are those ``load`` gives, and the programs ``compile_ahead``
    builds from them while the weights load (a streamed decode, as the command line runs it)
    are the ones the call runs: the call compiles nothing. The plan reads the checkpoint's tree
    metadata at either level (before any compile thread), and the load reads it no more."""
    from fp8jax.hf import workdir as workdir_lib
    from fp8jax.trainer import inference

    wd, _, _ = workdir
    workdir_lib._state_metadata.cache_clear()
    planned = inference.plan(str(wd), level)
    assert workdir_lib._state_metadata.cache_info().misses == 1
    texts = ["It is", "Mr"]
    lengths = [len(planned.tokenizer.encode(t)) for t in texts]
    model = models.build_model(planned.model_cfg)
    generate.decoder_for.cache_clear()  # a fresh decoder: nothing compiled before
    ahead = generate.compile_ahead(model, planned.shapes(), planned.tokenizer, lengths, 5, True)
    inf = planned.load()
    assert inf.level == level
    assert workdir_lib._state_metadata.cache_info().misses == 1  # the plan's read served it
    layout = lambda tree: jax.tree.map(lambda x: (x.shape, jnp.dtype(x.dtype)), tree)
    assert layout((inf.params, inf.fp8_state, inf.moe_state)) == layout(planned.shapes())
    ahead.result()
    compiles = []

    def listener(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)

    stream = generate.TextStream(inf.tokenizer, len(texts), [])
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        args = (inf.model, inf.params, inf.fp8_state, inf.tokenizer, texts, 5)
        generate.generate(*args, stream=stream, moe_state=inf.moe_state)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert not compiles, f"the call compiled {len(compiles)} programs again"
    assert all(len(ids) == 5 for ids in stream.ids)


def hf_with_template(workdir, tmp_path, template):
    """The work dir exported to a Hugging Face dir whose tokenizer has chat ``template``."""
    from fp8jax.hf import io as hf_io

    wd, _, _ = workdir
    out = tmp_path / "hf"
    if not out.exists():
        hf_io.export(str(wd), str(out), "float32", 2**30)
    config = out / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "chat_template": template}))
    return out


CHAT = (  # short role tags: the work dir's context is 32 tokens of a 320-token vocabulary
    "{% for m in messages %}{{ m.role[0] }}:{{ m.content }}"
    "{% if m.role == 'assistant' %}END{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


def jsonl(out):
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


def test_chat_renders_the_template_and_its_end_of_turn_ends_the_reply(workdir, tmp_path):
    """``--chat`` feeds the template's rendering (system turn, user turn, the assistant's
    opening): the same reply and prompt length as transformers' rendering given raw; the text
    the template writes after an assistant turn ends the reply, like a ``--stop`` string."""
    hf = hf_with_template(workdir, tmp_path, CHAT)
    common = (f"--ckpt={hf}", "--output=jsonl", "--max_new_tokens=10")
    (chat,) = jsonl(run_cli("fp8jax.generate", *common, "--chat", "--system=Be", "--prompt=Hi"))
    from transformers import AutoTokenizer  # the reference rendering of the template

    turns = [{"role": "system", "content": "Be"}, {"role": "user", "content": "Hi"}]
    raw = AutoTokenizer.from_pretrained(hf).apply_chat_template(
        turns, tokenize=False, add_generation_prompt=True
    )
    (plain,) = jsonl(run_cli("fp8jax.generate", *common, f"--prompt={raw}"))
    assert chat["completion"] == plain["completion"] and chat["tokens"] == 10
    assert chat["prompt_tokens"] == plain["prompt_tokens"] and chat["prompt"] == "Hi"
    reply = chat["completion"]
    end = reply.strip()[:1]  # a non-blank piece of the reply becomes the end of turn
    assert end, reply
    hf_with_template(workdir, tmp_path, CHAT.replace("END", end))
    (ended,) = jsonl(run_cli("fp8jax.generate", *common, "--chat", "--system=Be", "--prompt=Hi"))
    assert ended["completion"] == reply[: reply.find(end)]
    assert ended["tokens"] < 10
    timings = ended["timings"]
    assert timings["first_token_s"] >= 0 and timings["total_s"] >= timings["first_token_s"]


@pytest.mark.parametrize("rows", [1, 4])
def test_verbose_weight_bytes_count_the_experts_a_steps_rows_reach(rows):
    """--verbose's bytes a decode step reads: every weight once as the compute dtype holds it,
    less an MoE model's routed experts that none of the step's rows reaches (moe_tiny: 8
    experts, top-2; one row reaches 2 of each block's 8, four rows can reach all 8)."""
    import types

    from fp8jax import generate as cli

    config = train_lib.load_config("moe_tiny")
    config.model.dtype = "bfloat16"
    cfg = spec.parse(config).model
    params = models.abstract_variables(cfg)["params"]
    inf = types.SimpleNamespace(model=types.SimpleNamespace(cfg=cfg), params=params)
    stream = types.SimpleNamespace(first_token_at=1.0, last_token_at=2.0, ids=[[5, 6]] * rows)
    t = cli.timings(inf, stream, 0.0, 2.0, [])
    every = sum(x.size * 2 for x in jax.tree.leaves(params))  # f32 params read as bf16
    e = cfg.moe
    unread = e.num_experts - min(e.num_experts, rows * e.top_k)
    idle = cfg.num_layers * 3 * cfg.d_model * e.d_ff * unread * 2
    assert (rows == 1) == (idle > 0)
    assert t["rows"] == rows and t["weight_bytes"] == every - idle


def test_verbose_bound_share_is_the_bound_over_a_steps_time():
    """--verbose's share of the weight-bandwidth bound: a step reads the weights once and makes
    one token per row, so 4 rows at 1000 tokens/s take 4 ms a step; a 1 ms bound is 25% of it."""
    from fp8jax import generate as cli

    assert cli.bound_share(1e-3, 1000.0, 4) == pytest.approx(0.25)
    t = dict(
        compile_s=1.0,
        total_s=2.0,
        first_token_s=0.1,
        decode_tokens_per_s=1000.0,
        rows=4,
        weight_bytes=2**30,
        bound_s_per_token=1e-3,
    )
    assert "decode steps at 25% of it" in cli.report(t, 0.5, "O0", "bfloat16")
