"""Train step and loop: golden losses, level parity, accumulation, coverage, end to end."""

import copy
import dataclasses
import functools
import json
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax import spec
from fp8jax.diagnostics import inspect as inspect_lib
from fp8jax.trainer import loop as train_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Losses of the first three steps of `_micro_config()` on `_batch()`, on CPU: each
# step after the first follows a real update (learning rates 1e-4 and 2e-4 of the warm-up).
# `test_o0_step_matches_plain_jax_gpt` checks O0's first loss and gradients against a plain-JAX
# GPT, so the tables start from an independently computed point. If a deliberate numerical
# change moves them, regenerate with
#   python -c "from tests.test_train import print_golden; print_golden()"
# and say in the commit why the numbers moved.
GOLDEN = {
    "O0": [4.857769966125488, 4.836912155151367, 4.795428276062012],
    "O1": [4.8574442863464355, 4.8369574546813965, 4.795938014984131],
    "O2": [4.8571672439575195, 4.8372111320495605, 4.795944690704346],
}

# The same with bf16 activations, as on GPUs (model.dtype='bfloat16'): the f32 table above
# cannot see changes that only touch bf16 paths (such as how a bf16 GEMM output is unscaled).
GOLDEN_BF16 = {
    "O0": [4.857767105102539, 4.83690881729126, 4.7954888343811035],
    "O1": [4.857421875, 4.836047649383545, 4.7962212562561035],
    "O2": [4.857402324676514, 4.836765289306641, 4.796097278594971],
}
# bf16 O2 after an update: XLA:CPU's bf16 arithmetic differs between CPUs (native on avx512_bf16,
# via f32 elsewhere), and one flipped bf16 rounding moves an E4M3 Adam moment a whole grid step
# (2**-3), about 2e-5 relative in the next loss: twice that is allowed.
O2_BF16_LATER_RTOL = 4e-5


def load_config(name="tiny", arg=None):
    """Load ``configs/<name>.py`` by path, as train.py does."""
    return train_lib.load_config(name, arg)


def _micro_config(level="O1", **overrides):
    c = load_config()
    c.fp8.level = level
    m = c.model
    m.num_layers, m.d_model, m.num_heads, m.num_kv_heads, m.d_ff = 1, 64, 2, 2, 128
    m.vocab_size, m.max_len = 128, 16
    c.seq_len, c.batch_size = 16, 4
    for k, v in overrides.items():
        c[k] = v
    return c


def _batch(c, seed=0):
    tok = np.random.default_rng(seed).integers(0, c.model.vocab_size, (c.batch_size, c.seq_len + 1))
    tok = tok.astype(np.int32)
    return {"inputs": tok[:, :-1], "targets": tok[:, 1:]}


def _setup(c, **kwargs):
    """``loop.setup`` of config ``c``."""
    return train_lib.setup(spec.parse(c), **kwargs)


def _run(c, steps):
    """(env, final state, losses, metrics) of ``steps`` train steps on ``_batch(c)``."""
    env = _setup(c)
    state = env.init(jax.random.PRNGKey(c.seed))
    metrics = []
    for _ in range(steps):
        state, m = env.train_step(state, _batch(c))
        metrics.append(jax.tree.map(float, m))
    return env, state, [m["loss"] for m in metrics], metrics


def _bf16_config(level):
    c = _micro_config(level)
    c.model.dtype = "bfloat16"
    return c


def print_golden():
    """Print the GOLDEN and GOLDEN_BF16 tables for the current code."""
    for level in GOLDEN:
        print(level, _golden_run(level)[1])
    for level in GOLDEN_BF16:
        print("bf16", level, _golden_run(level, bf16=True)[1])


@functools.cache
def _golden_run(level, bf16=False):
    """(train step, losses, learning rates, final_norm's bias moves) of three steps."""
    c = _bf16_config(level) if bf16 else _micro_config(level)
    env = _setup(c)
    state = env.init(jax.random.PRNGKey(c.seed))
    losses, rates, moves = [], [], []
    for _ in range(3):
        before = np.asarray(state.params["final_norm"]["bias"])
        state, m = env.train_step(state, _batch(c))
        moves.append(np.asarray(state.params["final_norm"]["bias"]) - before)
        losses.append(float(m["loss"]))
        rates.append(float(m["learning_rate"]))
    return env.train_step, losses, rates, moves


@pytest.mark.parametrize("level", ["O0", "O1", "O2"])
def test_golden_losses(level):
    train_step, losses, rates, moves = _golden_run(level)
    np.testing.assert_allclose(
        losses, GOLDEN[level], rtol=2e-6, err_msg="golden losses moved: see GOLDEN's comment"
    )
    # Every step applies a real update: the warm-up's k-th update at k / warmup_steps of the peak.
    c = _micro_config(level)
    expect = [c.learning_rate * k / c.warmup_steps for k in (1, 2, 3)]
    np.testing.assert_allclose(rates, expect, rtol=2**-20)
    assert losses[0] != losses[1] != losses[2]
    # The metric is the rate the step applied: Adam's first update of a parameter without weight
    # decay is -lr * g / (|g| + eps), lr to 1e-4 where |g| >> eps = 1e-8 (final_norm's bias
    # starts at 0, so its move is the update itself).
    np.testing.assert_allclose(np.abs(moves[0]).max(), rates[0], rtol=1e-4)
    # One compile for all three steps: the step is traced once per shape.
    assert train_step._cache_size() == 1


@pytest.mark.parametrize("level", ["O0", "O1", "O2"])
def test_golden_losses_bf16(level):
    _, losses, _, _ = _golden_run(level, bf16=True)
    msg = "golden losses moved: see GOLDEN's comment"
    rtol = [2e-6] + 2 * [O2_BF16_LATER_RTOL if level == "O2" else 2e-6]
    for loss, golden, tol in zip(losses, GOLDEN_BF16[level], rtol, strict=True):
        np.testing.assert_allclose(loss, golden, rtol=tol, err_msg=msg)


def _layer_norm(x, p):
    mean = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), -1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + 1e-5) * p["scale"] + p["bias"]


def plain_gpt_loss(params, inputs_BxL, targets_BxL):
    """GPT-2's loss in jnp ops alone, on fp8jax's f32 params tree (scanned blocks)."""
    length = inputs_BxL.shape[1]
    x = params["embed"]["embedding"][inputs_BxL] + params["pos_embed"][:length]
    causal_LxL = jnp.tril(jnp.ones((length, length), bool))
    num_layers = params["blocks"]["attn"]["q"]["kernel"].shape[0]
    for i in range(num_layers):
        b = jax.tree.map(lambda a, i=i: a[i], params["blocks"])
        a, m = b["attn"], b["mlp"]
        h = _layer_norm(x, b["attn_norm"])
        q = jnp.einsum("bld,dnh->blnh", h, a["q"]["kernel"]) + a["q"]["bias"]
        kv = jnp.einsum("bld,dtkh->bltkh", h, a["kv"]["kernel"]) + a["kv"]["bias"]
        s = jnp.einsum("blnh,bmnh->bnlm", q, kv[:, :, 0]) / np.sqrt(q.shape[-1])
        w = jax.nn.softmax(jnp.where(causal_LxL, s, -jnp.inf), axis=-1)
        o = jnp.einsum("bnlm,bmnh->blnh", w, kv[:, :, 1])
        x = x + jnp.einsum("blnh,nhd->bld", o, a["o"]["kernel"]) + a["o"]["bias"]
        h = _layer_norm(x, b["mlp_norm"]) @ m["wi"]["kernel"] + m["wi"]["bias"]
        x = x + jax.nn.gelu(h, approximate=True) @ m["wo"]["kernel"] + m["wo"]["bias"]
    logits = _layer_norm(x, params["final_norm"]) @ params["head"]["kernel"]
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets_BxL[..., None], axis=-1))


def test_o0_step_matches_plain_jax_gpt():
    """O0's first loss and gradients are GPT-2's, computed here without fp8jax's modules."""
    from fp8jax.trainer import step as step_lib

    c = _micro_config("O0")
    env = _setup(c)
    state = env.init(jax.random.PRNGKey(c.seed))
    batch = _batch(c)
    loss, _, grads = jax.jit(lambda p: step_lib.batch_gradients(env.model, p, state.fp8, batch))(
        state.params
    )
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(plain_gpt_loss))(
        state.params, batch["inputs"], batch["targets"]
    )
    # Both are f32 sums of at most 128 terms (vocab, d_ff, batch x length) in some order: two
    # orders differ by at most 128 ulps (2**-24) of the sum of magnitudes, so of the leaf's max.
    tol = 128 * 2.0**-24
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=tol)
    np.testing.assert_allclose(GOLDEN["O0"][0], float(ref_loss), rtol=tol)
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    assert len(flat) == len(jax.tree.leaves(ref_grads)) == 19
    for (path, g), r in zip(flat, jax.tree.leaves(ref_grads), strict=True):
        g, r = np.asarray(g), np.asarray(r)
        scale = np.abs(r).max()
        assert scale > 0, jax.tree_util.keystr(path)
        np.testing.assert_allclose(
            g, r, rtol=0, atol=tol * scale, err_msg=jax.tree_util.keystr(path)
        )


@functools.cache
def _track_run(level, steps=4, recipe="delayed"):
    """Losses of ``steps`` steps at the peak learning rate (warm-up of one step)."""
    c = _micro_config(level, warmup_steps=1)
    c.fp8.recipe = recipe
    return _run(c, steps)[2]


def test_fp8_levels_track_o0():
    """O1 (FP8 GEMMs) and O2 (+ FP8/FP16 Adam) learn what O0 learns over a few real steps."""
    o0 = np.array(_track_run("O0"))
    learned = o0[0] - o0[1:]  # the loss O0 has shed after each update
    assert (learned > 0.4).all(), o0  # it really trains: the first update alone sheds ~0.48
    for level in ("O1", "O2"):
        got = np.array(_track_run(level))
        # E4M3 keeps 3 mantissa bits: each FP8 GEMM operand (and O2's m) is off by at most
        # 2**-4 relative, so what the model learned may be off by that share of it (GEMMs
        # returning zeros miss by more than 2**-3).
        np.testing.assert_array_less(np.abs(got[1:] - o0[1:]), 2**-4 * learned, err_msg=level)


@pytest.mark.parametrize("recipe", ["rowwise", "block"])
def test_fine_recipes_track_o0(recipe):
    """O1 under rowwise and block scales (E4M3 x, w and dy) learns what O0 learns, to the same
    2**-4 share of E4M3's rounding as the per-tensor recipes."""
    o0 = np.array(_track_run("O0"))
    learned = o0[0] - o0[1:]
    got = np.array(_track_run("O1", recipe=recipe))
    assert got[0] != o0[0]  # the FP8 forward really ran
    np.testing.assert_array_less(np.abs(got[1:] - o0[1:]), 2**-4 * learned, err_msg=recipe)


@pytest.mark.parametrize("level", ["O0", "O1"])
def test_grad_accumulation_matches_one_batch(level):
    """Two micro-batches give the full batch's mean gradients, in the step and out of it."""
    from fp8jax.trainer import step as step_lib

    c1 = _micro_config(level)
    c2 = _micro_config(level, grad_accum_steps=2)
    # A power-of-two margin of 2 over the history's amax: a step whose dy outgrows the previous
    # step's would saturate E5M2 in the micro-batches (which have half the full batch's headroom).
    c1.fp8.margin = c2.fp8.margin = 1
    env, s1, _, m1 = _run(c1, 2)
    _, s2, _, m2 = _run(c2, 2)
    # Same math up to f32 summation order (sums of at most 128 terms: 128 ulps of their
    # magnitude). At O1 too, from the accumulating run's state: with delayed scaling both
    # quantize with its scales, and a micro-batch's dy is exactly twice the full batch's per
    # token (a power of two: the same E5M2 rounding; the history holds the micro-batches' dy
    # amax, so neither saturates).
    tol = 128 * 2.0**-24
    state, batch = s2, _batch(c1)
    grads = jax.jit(
        lambda p, accum: step_lib.batch_gradients(env.model, p, state.fp8, batch, accum)[2],
        static_argnums=1,
    )
    full, accumulated = grads(state.params, 1), grads(state.params, 2)
    for (path, a), b in zip(
        jax.tree_util.tree_flatten_with_path(full)[0], jax.tree.leaves(accumulated), strict=True
    ):
        a, b = np.asarray(a), np.asarray(b)
        assert np.abs(a).max() > 0, jax.tree_util.keystr(path)
        np.testing.assert_allclose(b, a, rtol=0, atol=tol * np.abs(a).max(), err_msg=str(path))
    # The train step reports (and clips) the norm of those mean gradients. At O1 the runs'
    # first steps quantize dy with the empty history's scales, where E5M2 rounds by up to 2**-3.
    rtol = tol if level == "O0" else 2**-3
    for a, b in zip(m1, m2, strict=True):
        np.testing.assert_allclose(b["grad_norm"], a["grad_norm"], rtol=rtol)
        np.testing.assert_allclose(b["loss"], a["loss"], rtol=rtol)
    if level == "O0":  # after two real updates the params agree as well
        for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s2.params), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    else:
        # Params are not compared at O1: after the first update the two runs' amax histories
        # differ (below), so their scales and FP8 roundings do, and Adam turns a near-zero
        # gradient's rounding into a +-lr step.
        # Amax over two micro-batches is the max of both halves: the full batch's amax for x
        # and w. A micro-batch's loss averages over half the tokens, so its dy is exactly twice
        # the full batch's per token: max gives 2x the full-batch amax (a sum would give ~4x).
        q = lambda s: s.fp8["blocks"]["attn"]["q"]["Fp8DotGeneral_0"]["meta"]
        for t, factor in (("x", 1.0), ("w", 1.0), ("dy", 2.0)):
            h1 = np.asarray(getattr(q(s1), t).amax_history)
            h2 = np.asarray(getattr(q(s2), t).amax_history)
            assert (h1[..., 1] > 0).all()  # [layers, history]: a real amax was recorded
            np.testing.assert_allclose(h2, factor * h1, rtol=1e-2)


@pytest.mark.parametrize("level,share", [("O0", 0.0), ("O1", 1.0)])
def test_coverage_of_block_linears(level, share):
    report = inspect_lib.coverage_of(spec.parse(_micro_config(level)), compile_step=False)
    linears = [
        e
        for e in report.entries
        if "Fp8DotGeneral" in e.name
        or "/mlp/" in e.name
        or any(f"/attn/{n}" in e.name for n in ("q", "kv", "o"))
    ]
    linears = [e for e in linears if "dot_product_attention" not in e.name and "vmap" not in e.name]
    assert len(linears) == 3 * 5, [e.name for e in report.entries]  # 5 linears, fwd+dgrad+wgrad
    assert np.mean([e.fp8 for e in linears]) == share
    # Each named by its layer, the fused MLP's too ('mlp._fused/wi'): fwd, dgrad and wgrad.
    layer = lambda e: next(n for n in ("q", "kv", "o", "wi", "wo") if f"/{n}/" in f"{e.name}/")  # noqa: E731
    assert sorted(map(layer, linears)) == sorted(3 * ["q", "kv", "o", "wi", "wo"])


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="cuDNN attention is valid on a GPU")
def test_inspect_cli_names_the_fix_for_a_gpu_config_on_cpu():
    """``python -m fp8jax.diagnostics.inspect`` on a GPU config without a GPU: exit 2, the fix."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "fp8jax.diagnostics.inspect", "--config", "configs/gpt2_125m.py"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert lines[-1].startswith("error: model.attention_impl='cudnn'"), lines[-3:]
    assert "--config.model.attention_impl=xla" in lines[-1]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--config", "/nonexistent.py"], "cannot load the --config file: "),
        ([], "Flag --config must have a value other than None; see python -m fp8jax.diagnostics"),
        (["--config", "tiny", "--config.model.d_modl=3"], "unknown config key 'd_modl'"),
    ],
)
def test_inspect_cli_bad_flags_are_one_line(args, message):
    """``inspect`` parses its flags as train.py does: a missing or unknown config file, no
    --config, a misspelt key: exit 2, one line (it was a multi-line absl error, exit 1)."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "fp8jax.diagnostics.inspect", *args]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("error: ") and message in lines[0], lines


def _unigram_entropy(dataset, vocab: int) -> float:
    """Validation cross-entropy of the training split's token frequencies (add-one smoothed)."""
    counts = np.bincount(np.asarray(dataset.train_tokens), minlength=vocab) + 1.0
    return float(-np.mean(np.log(counts / counts.sum())[np.asarray(dataset.val_tokens)]))


@pytest.mark.slow
def test_train_and_evaluate_end_to_end(tmp_path):
    from fp8jax.trainer import data as data_lib

    c = load_config()
    c.num_train_steps, c.eval_every_steps, c.log_every_steps = 40, 20, 10
    c.checkpoint_every_steps, c.fp8_stats_every_steps, c.sample_tokens = 20, 20, 8
    c.eval_batches = 4
    assert c.fp8.level == "O1"
    first = train_lib.train_and_evaluate(c, str(tmp_path))
    assert first["step"] == 40
    # What a working model reaches: the same run with f32 GEMMs (O0). It must have learned more
    # than token frequencies, and O1 must land within 3% of it (with every FP8 GEMM returning
    # zeros O1 lands well above).
    c0 = copy.deepcopy(c)
    c0.fp8.level = "O0"
    base = train_lib.train_and_evaluate(c0, str(tmp_path / "o0"))
    unigram = _unigram_entropy(data_lib.build(spec.parse(c), tmp_path), c.model.vocab_size)
    print(f"val loss: O1 {first['val_loss']:.4f}, O0 {base['val_loss']:.4f}, unigram {unigram:.4f}")
    assert base["val_loss"] < unigram - 0.3, (base["val_loss"], unigram)
    assert abs(first["val_loss"] / base["val_loss"] - 1) < 0.03, (first, base)
    assert (tmp_path / "checkpoints" / "40").is_dir()
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert json.loads((tmp_path / "summary.json").read_text())["step"] == 40
    c.num_train_steps = 50
    second = train_lib.train_and_evaluate(c, str(tmp_path))
    assert second["step"] == 50 and second["val_loss"] < first["val_loss"] + 0.05


def test_memory_rows_per_level():
    rows = {r["label"]: r for r in inspect_lib.memory_rows(spec.parse(_micro_config()))}
    assert rows["O0"]["matmul_total"] == 16.0  # f32 weight + f32 grad + f32 m and v
    # FP16 master + FP8 grad + E4M3 m + FP16 v = 6, plus three f32 scales per (tiny) tensor.
    assert rows["O2"]["matmul_total"] <= 6.0 + 0.01
    assert rows["O1"]["matmul_total"] < rows["O0"]["matmul_total"]


@pytest.mark.parametrize("scan", [True, False])
def test_o2_masters_dequantized_inside_layers_match_outside(scan):
    """O2 in bf16: masters handed to the FP8 layers still encoded give bit-identical grads."""
    import jax.numpy as jnp

    from fp8jax.optim import adam as optim
    from fp8jax.trainer import step as step_lib

    c = _bf16_config("O2")
    c.model.num_layers, c.model.remat_policy, c.model.scan_layers = 2, "full", scan
    env = _setup(c)
    state = env.init(jax.random.PRNGKey(c.seed))
    model, batch = env.model, _batch(c)

    def grads(carry):
        if carry:
            params, masters = optim.carry_masters(state.params, state.fp8, jnp.bfloat16)
        else:
            params, masters = optim.materialize(state.params, dtype=jnp.bfloat16), None
        return step_lib._accumulate(model, params, state.fp8, (batch, {}), 1, masters=masters)

    carried = jax.jit(lambda: grads(True))
    # Every block kernel (q, kv, o, wi, wo; per layer unless scan stacks them) crosses as its
    # FP16 bits, no copy.
    hlo = carried.lower().as_text()
    found = re.findall(r"bitcast_convert.*xf16>\) -> tensor<[0-9x]*xbf16>", hlo)
    assert len(found) == (5 if scan else 10)
    outside = jax.jit(lambda: grads(False))()
    for a, b in zip(jax.tree.leaves(carried()), jax.tree.leaves(outside), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_o2_sums_bf16_micro_batch_gradients_in_f32(monkeypatch):
    """O2 in bf16, 8 micro-batches: the f32 running sum (config.grad_accum_dtype) returns the
    exact mean of the micro-batch gradients rounded once to bf16; the bf16 sum ('') is worse."""
    import jax.numpy as jnp

    from fp8jax.optim import adam as optim
    from fp8jax.trainer import step as step_lib

    c = _bf16_config("O2")
    c.batch_size, accum = 16, 8
    env = _setup(c)
    state = env.init(jax.random.PRNGKey(c.seed))
    model, batch = env.model, _batch(c)
    params = optim.materialize(state.params, dtype=jnp.bfloat16)

    @functools.partial(jax.jit, static_argnums=(1, 2))
    def accumulate(batch, accum, wide):
        return step_lib._accumulate(model, params, state.fp8, (batch, {}), accum, wide=wide)[2]

    # The scales are the state's (delayed scaling), so each micro-batch's gradient is the same
    # alone as inside the sum: the float64 mean of the eight is the reference.
    micro = [
        accumulate(jax.tree.map(lambda x: x[i * 2 : i * 2 + 2], batch), 1, None)
        for i in range(accum)
    ]
    ref = jax.tree.map(lambda *g: np.mean([np.asarray(x, np.float64) for x in g], 0), *micro)
    wide = accumulate(batch, accum, jnp.dtype(jnp.float32))
    narrow = accumulate(batch, accum, None)
    dtypes = [p.dtype for p in jax.tree.leaves(params)]
    assert jnp.bfloat16 in dtypes  # the FP8 layers' kernels (norms and embeddings stay f32)
    err = lambda g: sum(
        np.abs(np.asarray(a, np.float64) - r).sum()
        for a, r in zip(jax.tree.leaves(g), jax.tree.leaves(ref), strict=True)
    )
    for a, r, d in zip(jax.tree.leaves(wide), jax.tree.leaves(ref), dtypes, strict=True):
        assert a.dtype == d  # handed on in the gradients' own dtype
        # One rounding to bf16 (an f32 sum of eight bf16 values is exact to ~2**-21).
        rtol = 2**-8 if d == jnp.bfloat16 else 1e-5
        # f32 leaves: a sum whose terms cancel to near 0 (a bias gradient element 1000x below
        # its neighbours) differs by f32 summation order, so its floor is the leaf's scale.
        atol = 1e-30 if d == jnp.bfloat16 else 1e-6 * np.abs(r).max()
        np.testing.assert_allclose(np.asarray(a, np.float64), r, rtol=rtol, atol=atol)
    # The sum of absolute errors over all leaves: the f32 sum's is well below the bf16 sum's.
    assert err(wide) < 0.7 * err(narrow), (err(wide), err(narrow))
    # The train step passes config.grad_accum_dtype on.
    seen, real = [], step_lib._accumulate
    monkeypatch.setattr(
        step_lib, "_accumulate", lambda *a, **k: seen.append(k.get("wide")) or real(*a, **k)
    )
    for dtype in ("float32", ""):
        o = dataclasses.replace(env.run.optim, grad_accum_steps=accum, grad_accum_dtype=dtype)
        run = dataclasses.replace(env.run, optim=o)
        jax.eval_shape(step_lib.make_train_step(model, env.tx, run), state, batch)
    assert seen == [jnp.float32, None]


def test_bad_grad_accum_dtype_names_the_choices():
    c = _micro_config(grad_accum_dtype="bfloat16")
    with pytest.raises(ValueError, match=r"grad_accum_dtype='bfloat16': use 'float32' or ''"):
        spec.parse(c)


def test_setup_lowers_threefry_to_its_gpu_kernel_unless_the_user_chose(monkeypatch):
    # The init compiles much faster on GPUs with threefry's kernel than unrolled into XLA ops.
    flag = "jax_threefry_gpu_kernel_lowering"
    before = jax.config.values[flag]
    try:
        monkeypatch.delenv("JAX_THREEFRY_GPU_KERNEL_LOWERING", raising=False)
        jax.config.update(flag, False)
        _setup(_micro_config("O0"))
        assert jax.config.values[flag] is True
        monkeypatch.setenv("JAX_THREEFRY_GPU_KERNEL_LOWERING", "false")
        jax.config.update(flag, False)
        _setup(_micro_config("O0"))
        assert jax.config.values[flag] is False
    finally:
        jax.config.update(flag, before)
