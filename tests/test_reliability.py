"""Reliability: injected NaN/Inf, FP8 overflow, SIGTERM and kill -9, bad input, determinism.

Every test says in its docstring what it injects. All run on CPU with configs/tiny.py shrunk to
one 64-wide layer (``SMALL``) on a 200 kB slice of the shipped corpus. Subprocess runs of
train.py share a JAX compilation cache and one uninterrupted reference run (``baseline``)
across pytest-xdist workers.
"""

import asyncio
import contextlib
import fcntl
import functools
import gc
import hashlib
import json
import logging
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import linen as nn

import fp8jax
from fp8jax import checksums, errors, models, spec
from fp8jax.models import layers
from fp8jax.ops import formats
from fp8jax.ops.scaling import ScaleState
from fp8jax.trainer import data as data_lib
from fp8jax.trainer import loop as train_lib
from fp8jax.trainer import step as step_lib
from fp8jax.trainer.checkpoint import Checkpointer, abstract_like

from fp8_testing import TINY_RUN, novel, with_overrides

ROOT = pathlib.Path(__file__).resolve().parents[1]
NAN, INF = float("nan"), float("inf")
STEPS = 40  # length of every run compared with the baseline (the LR schedule depends on it)
SMALL = {**TINY_RUN, "num_train_steps": STEPS, "warmup_steps": 5, "checkpoint_every_steps": 1}


# --- shared fixtures: corpus, compilation cache, reference run ------------------------------


@pytest.fixture(scope="session")
def shared(tmp_path_factory):
    """A directory shared by every xdist worker of this session."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    path = base / "reliability"
    path.mkdir(exist_ok=True)
    return path


@contextlib.contextmanager
def _locked(path: pathlib.Path):
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="session")
def corpus(shared):
    """The first 200 kB of Pride and Prejudice: tokenizes in well under a second."""
    path = shared / "corpus.txt"
    with _locked(shared / "corpus.lock"):
        if not path.exists():
            path.with_suffix(".tmp").write_text(novel("pride-and-prejudice", 200_000))
            path.with_suffix(".tmp").replace(path)
    return path


@pytest.fixture(scope="session")
def env(shared):
    """Environment of train.py subprocesses: CPU, and one compilation cache for all of them."""
    e = {k: v for k, v in os.environ.items() if k != "FP8JAX_DEBUG"}
    e.update(
        JAX_PLATFORMS="cpu",
        JAX_COMPILATION_CACHE_DIR=str(shared / "jax_cache"),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )
    return e


@pytest.fixture(scope="session")
def baseline(shared, corpus, env):
    """An uninterrupted train.py run of ``STEPS`` steps: ``(workdir, {step: record})``."""
    workdir = shared / "baseline"
    with _locked(shared / "baseline.lock"):
        if not (workdir / "summary.json").exists():
            shutil.rmtree(workdir, ignore_errors=True)
            proc = run_cli(cli(workdir, corpus), env)
            assert proc.returncode == 0, proc.stderr[-3000:]
    records = train_records(workdir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    return workdir, {r["step"]: r for r in records}


def load_config(corpus, **overrides):
    """configs/tiny.py with ``SMALL`` and ``overrides`` (dotted keys) applied."""
    overrides = {**SMALL, "data.path": str(corpus), **overrides}
    return with_overrides(train_lib.load_config("tiny"), overrides)


def cli(workdir, corpus, *extra, **overrides) -> list[str]:
    """The train.py command line for ``SMALL`` plus ``overrides`` and ``extra`` flags."""
    values = {**SMALL, "data.path": str(corpus), **overrides}
    return [
        sys.executable,
        "train.py",
        "--config",
        "configs/tiny.py",
        f"--workdir={workdir}",
        *[f"--config.{k}={v}" for k, v in values.items()],
        *extra,
    ]


def run_cli(args, env, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def read_jsonl(workdir) -> list[dict]:
    path = pathlib.Path(workdir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def train_records(workdir) -> list[dict]:
    """Per-step training records of ``<workdir>/metrics.jsonl``, in the order written."""
    return [r for r in read_jsonl(workdir) if "loss" in r]


def assert_same_losses(records, reference):
    """Every record (killed or resumed runs included) equals the reference bit for bit."""
    for r in records:
        ref = reference[r["step"]]
        assert (r["loss"], r["grad_norm"]) == (ref["loss"], ref["grad_norm"]), r["step"]
    assert {r["step"] for r in records} == set(reference)


def restore_latest(workdir, corpus, step=None):
    """Restore the latest (or ``step``'s) checkpoint of ``workdir``: (step, state, data state)."""
    env = train_lib.setup(spec.parse(load_config(corpus)))
    ckpt = Checkpointer(str(workdir))
    try:
        step = ckpt.latest_step() if step is None else step
        state, data = ckpt.restore(abstract_like(env.abstract, env.state_shardings), step)
    finally:
        ckpt.close()
    return step, state, data


def checkpoint_steps(workdir) -> list[int]:
    d = pathlib.Path(workdir) / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.exists() else []


# --- fault injection: a wrapped train step ---------------------------------------------------

KINDS = ("activation", "gradient", "weight", "loss")


def _select(hits, default):
    """The value of the first ``(condition, value)`` hit that holds, else ``default``."""
    out = default
    for cond, value in reversed(hits):
        out = jnp.where(cond, value, out)
    return out


@jax.custom_vjp
def _poison_cotangent(x, on, value):
    return x


def _poison_fwd(x, on, value):
    return x, (on, value)


def _poison_bwd(res, g):
    on, value = res
    return jnp.where(on > 0, value, g).astype(g.dtype), jnp.zeros_like(on), jnp.zeros_like(value)


_poison_cotangent.defvjp(_poison_fwd, _poison_bwd)


class _Faulty:
    """``model`` whose ``apply`` writes NaN/Inf into one place when a traced condition holds.

    activation: the attention output (the residual stream, so the next FP8 GEMM sees it);
    gradient: the cotangent of the block output (FP8 dgrad/wgrad and the residual path);
    weight: column 0 of the token embedding as the forward pass reads it.
    """

    def __init__(self, model, hits):
        self.model, self.hits = model, hits

    def __getattr__(self, name):
        return getattr(self.model, name)

    def apply(self, variables, *args, **kwargs):
        if self.hits["weight"]:
            params = variables["params"]
            emb = params["embed"]["embedding"]
            emb = emb.at[:, 0].set(_select(self.hits["weight"], emb[:, 0]))
            params = {**params, "embed": {**params["embed"], "embedding": emb}}
            variables = {**variables, "params": params}
        with nn.intercept_methods(self._intercept):
            out = self.model.apply(variables, *args, **kwargs)
        if self.hits["loss"]:  # the train step's loss: the weighted sum the model returns
            (ce_BxL, total), mutated = out
            out = (ce_BxL, total + _select(self.hits["loss"], 0.0)), mutated
        return out

    def _intercept(self, next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        if context.method_name != "__call__":
            return out
        if isinstance(context.module, layers.Attention) and self.hits["activation"]:
            out = _select(self.hits["activation"], out).astype(out.dtype)
        if isinstance(context.module, layers.Block) and self.hits["gradient"]:
            on = jnp.any(jnp.stack([c for c, _ in self.hits["gradient"]])).astype(jnp.float32)
            value = jnp.asarray(_select(self.hits["gradient"], 0.0), jnp.float32)
            out = (_poison_cotangent(out[0], on, value), *out[1:])
        return out


def faulty_steps(schedule, corrupt_state_from=None):
    """A ``step.make_train_step`` that injects faults.

    ``schedule``: ``(first, stop, kind, value)`` entries; attempts ``first <= a < stop`` (steps
    tried so far, skipped ones included) get ``value`` in ``kind`` (see ``_Faulty``; 'loss'
    adds it to the loss the model returns, whose gradient stays finite).
    ``corrupt_state_from``: from that attempt on, write NaN into the state's first FP8 kernel (a
    persistent corruption).
    """
    make = step_lib.make_train_step

    def make_faulty(model, tx, run, *args, **kwargs):
        def train_step(state, batch):
            attempt = state.step + state.skipped
            hits = {k: [] for k in KINDS}
            for first, stop, kind, value in schedule:
                hits[kind].append(((attempt >= first) & (attempt < stop), value))
            if corrupt_state_from is not None:
                kernel = state.params["blocks"]["mlp"]["wi"]["kernel"]
                bad = jnp.where(attempt == corrupt_state_from, NAN, kernel[..., 0, 0])
                params = jax.tree.map(lambda x: x, state.params)  # a copy we may edit
                params["blocks"]["mlp"]["wi"]["kernel"] = kernel.at[..., 0, 0].set(bad)
                state = state.replace(params=params)
            step = make(_Faulty(model, hits), tx, run, *args, **kwargs)
            return step(state, batch)

        return train_step

    return make_faulty


def _scale_states(fp8):
    return jax.tree.leaves(fp8, is_leaf=lambda x: isinstance(x, ScaleState))


def assert_scales_good(fp8):
    """Every FP8 scale finite and > 0, every amax history finite and >= 0."""
    states = _scale_states(fp8)
    assert states
    for s in states:
        scale, hist = np.asarray(s.scale), np.asarray(s.amax_history)
        assert np.all(np.isfinite(scale)) and np.all(scale > 0), scale
        assert np.all(np.isfinite(hist)) and np.all(hist >= 0), hist


def trees_equal(a, b) -> bool:
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return all(np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True) for x, y in pairs)


def assert_trees_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# --- non-finite values ---------------------------------------------------------------------


# Attempt 2 + 4k gets NaN and 4 + 4k gets +Inf in KINDS[k]; the attempts between are clean.
FAULTS = [
    (2 + 4 * k + 2 * i, 3 + 4 * k + 2 * i, kind, value)
    for k, kind in enumerate(KINDS)
    for i, value in enumerate((NAN, INF))
]


@pytest.fixture(scope="module")
def fault_run(corpus):
    """One compiled step injecting every ``FAULTS`` entry: per attempt (before, after, metrics)."""
    run = spec.parse(load_config(corpus))
    model = models.build_model(run.model)
    tx = step_lib.make_optimizer(run)
    state = jax.jit(functools.partial(step_lib.init_state, model, tx, run))(jax.random.PRNGKey(0))
    train_step = jax.jit(faulty_steps(FAULTS)(model, tx, run))
    rng = np.random.default_rng(0)
    out = []
    shape = (run.optim.batch_size, run.optim.seq_len + 1)
    for _ in range(FAULTS[-1][1] + 1):
        tokens = rng.integers(0, run.model.vocab_size, shape, np.int32)
        new, m = train_step(state, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
        out.append(jax.device_get((state, new, m)))
        state = new
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_nonfinite_step_is_skipped_and_fp8_scales_keep_last_good(kind, fault_run):
    """Injects NaN, then +Inf, into the activation / gradient / weight / loss of one step each.

    Those steps are skipped and counted (skipped_steps, bad_steps); params, optimizer and FP8
    state come out bit-identical to before the step, every FP8 scale stays finite and > 0, and
    the next step trains normally again.
    """
    poisoned = {first for first, _, k, _ in FAULTS if k == kind}
    for attempt in sorted(poisoned | {a + 1 for a in poisoned}):
        before, after, m = fault_run[attempt]
        bad = attempt in poisoned
        skipped = sum(first <= attempt for first, *_ in FAULTS)
        assert (int(m["skipped_steps"]), int(m["bad_steps"])) == (skipped, int(bad))
        assert_scales_good(after.fp8)
        finite = bool(np.isfinite(m["loss"]) and np.isfinite(m["grad_norm"]))
        assert finite != bad, (attempt, m)
        if bad:
            assert int(after.step) == int(before.step)
            for part in ("params", "opt_state", "fp8"):
                assert_trees_equal(getattr(after, part), getattr(before, part))
        else:
            assert int(after.step) == int(before.step) + 1
            assert not trees_equal(after.params, before.params)


@pytest.mark.slow
def test_loop_skips_transient_nan_then_stops_after_k_bad_steps(corpus, tmp_path, monkeypatch):
    """Injects NaN into the activations of steps 4-5, then of every step from 9 on (K=3).

    The loop logs the skipped steps and goes on after 4-5 (metrics.jsonl: NaN loss, bad_steps,
    skipped_steps), then stops on reading step 11's metrics with a one-line NonFiniteLossError
    naming the steps, the checkpoint and the fix. The loop reads a step's metrics once the next
    is dispatched, so step 12 (also skipped) has run: the checkpoint is step 12's, the last good
    state (6 updates, 6 skipped).
    """
    schedule = [(3, 5, "activation", NAN), (8, 99, "activation", NAN)]
    monkeypatch.setattr(step_lib, "make_train_step", faulty_steps(schedule))
    c = load_config(corpus, max_bad_steps=3, checkpoint_every_steps=0)
    with pytest.raises(errors.NonFiniteLossError) as info:
        train_lib.train_and_evaluate(c, str(tmp_path))
    msg = str(info.value)
    assert "\n" not in msg and "3 consecutive non-finite steps (9..11" in msg
    assert "the last good state is checkpointed at step 12 in" in msg and "max_bad_steps" in msg
    records = train_records(tmp_path)
    assert [r["bad_steps"] for r in records] == [0, 0, 0, 1, 2, 0, 0, 0, 1, 2, 3]
    assert [r["skipped_steps"] for r in records] == [0, 0, 0, 1, 2, 2, 2, 2, 3, 4, 5]
    assert [bool(np.isfinite(r["loss"])) for r in records] == [1, 1, 1, 0, 0, 1, 1, 1, 0, 0, 0]
    step, state, data = restore_latest(tmp_path, corpus)
    assert step == data["step"] == 12 and (int(state.step), int(state.skipped)) == (6, 6)
    assert_scales_good(state.fp8)


@pytest.mark.slow
def test_loop_never_checkpoints_a_corrupted_weight(corpus, tmp_path, monkeypatch):
    """Injects NaN into an FP8 kernel of the train state itself at step 4 (it persists).

    Every later step is skipped; no checkpoint after step 3 is written (the saves are refused),
    the run stops after max_bad_steps and names step 3 as the last good checkpoint.
    """
    monkeypatch.setattr(step_lib, "make_train_step", faulty_steps([], corrupt_state_from=3))
    c = load_config(corpus, max_bad_steps=3, checkpoint_every_steps=1)
    with pytest.raises(errors.NonFiniteLossError, match="checkpointed at step 3 in"):
        train_lib.train_and_evaluate(c, str(tmp_path))
    assert checkpoint_steps(tmp_path) == [2, 3]
    step, state, _ = restore_latest(tmp_path, corpus)
    assert step == 3 and int(state.step) == 3
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(state.params))


@pytest.mark.slow
def test_run_whose_state_cannot_be_saved_does_not_end_as_a_success(corpus, tmp_path, monkeypatch):
    """Injects NaN into an FP8 kernel of the train state at step 4 with max_bad_steps above the
    run's length, so the loop never stops on its own: every save after step 3 is refused, and
    instead of ending as a success the run raises a one-line NonFiniteLossError naming the
    step, the leaf and the last good checkpoint (step 3)."""
    monkeypatch.setattr(step_lib, "make_train_step", faulty_steps([], corrupt_state_from=3))
    c = load_config(corpus, max_bad_steps=100, num_train_steps=6, checkpoint_every_steps=1)
    with pytest.raises(errors.NonFiniteLossError) as info:
        train_lib.train_and_evaluate(c, str(tmp_path))
    msg = str(info.value)
    assert "\n" not in msg and "the train state of step 6 holds NaN/Inf in" in msg, msg
    assert "the last good state is step 3 in" in msg, msg
    assert checkpoint_steps(tmp_path) == [2, 3]
    assert not (tmp_path / "summary.json").exists()


# --- overflow --------------------------------------------------------------------------------


def _fp8_dense(recipe):
    return nn.Dense(16, dot_general_cls=fp8jax.fp8_dot_general_cls(recipe))


def _stat(stats, name) -> float:
    flat = jax.tree_util.tree_flatten_with_path(stats)[0]
    return float(next(v for p, v in flat if name in jax.tree_util.keystr(p)))


def test_overflow_saturates_never_inf_and_reports_share():
    """Injects values past both FP8 ranges: activations 1e6 (E4M3 max 448) in a quarter of the
    rows, and output gradients 1e9 (E5M2 max 57344).

    A plain cast would give NaN (E4M3) or Inf (E5M2); the FP8 GEMM saturates instead, forward and
    backward stay finite, and FP8_STATS / saturation_stats report the saturated share.
    """
    assert np.isnan(np.float32(jnp.float32(1e6).astype(formats.E4M3)))
    assert np.isinf(np.float32(jnp.float32(1e9).astype(formats.E5M2)))
    x = np.random.default_rng(0).normal(size=(8, 32)).astype(np.float32)
    x[:2] = 1e6
    dense = _fp8_dense(fp8jax.DelayedScaling(history_len=4))
    variables = dense.init(jax.random.PRNGKey(0), x)
    forward = jax.jit(lambda v, x: dense.apply(v, x, mutable=[fp8jax.FP8, fp8jax.FP8_STATS]))
    y, mutated = forward(variables, x)
    assert np.all(np.isfinite(y))
    assert _stat(mutated[fp8jax.FP8_STATS], "x_saturated") == 0.25

    def backward(v, x, g):
        _, vjp = jax.vjp(lambda x, p: dense.apply({**v, "params": p}, x), x, v["params"])
        return vjp(g)

    g = jnp.full(y.shape, 1e9, jnp.float32)
    grads = jax.jit(backward)(variables, x, g)
    assert all(np.all(np.isfinite(t)) for t in jax.tree.leaves(grads))
    sat, _ = fp8jax.ops.formats.saturation_stats(g, jnp.float32(1.0), "e5m2")
    assert float(sat) == 1.0


def test_delayed_scaling_recovers_within_history_window():
    """Injects one step whose activations are 1e4 x the usual ones (history_len=4).

    That step saturates (share reported, output finite); the next step's scale already fits
    the spike (no saturation), and once the spike leaves the window the scale is exactly the
    pre-spike one. Current scaling never saturates at all.
    """
    x = np.random.default_rng(0).normal(size=(8, 32)).astype(np.float32)
    H, spike = 4, 3
    dense = _fp8_dense(fp8jax.DelayedScaling(history_len=H))
    variables = dense.init(jax.random.PRNGKey(0), x)
    params, fp8 = variables["params"], variables[fp8jax.FP8]
    forward = jax.jit(lambda v, x: dense.apply(v, x, mutable=[fp8jax.FP8, fp8jax.FP8_STATS]))
    scales, saturated = [], []
    for t in range(spike + H + 2):
        y, mut = forward({"params": params, fp8jax.FP8: fp8}, x * 1e4 if t == spike else x)
        assert np.all(np.isfinite(y))
        saturated.append(_stat(mut[fp8jax.FP8_STATS], "x_saturated"))
        scales.append(float(_scale_states(fp8)[0].scale))
        fp8 = fp8jax.commit(mut[fp8jax.FP8])
    # Elsewhere at most the amax element itself, which lands on the format max (not beyond).
    assert saturated[spike] > 0.99 and saturated[spike + 1] == 0.0
    assert max(saturated[:spike] + saturated[spike + 1 :]) <= 1 / x.size
    assert scales[spike + 1] < scales[spike] / 1e3  # the spike's amax is in the window
    assert scales[spike + H] == scales[spike + 1]  # ... for H steps
    assert scales[spike + H + 1] == scales[spike]  # then gone: back to the pre-spike scale

    current = _fp8_dense(fp8jax.CurrentScaling())
    v = current.init(jax.random.PRNGKey(0), x)
    _, mut = current.apply(v, x * 1e4, mutable=[fp8jax.FP8, fp8jax.FP8_STATS])
    assert _stat(mut[fp8jax.FP8_STATS], "x_saturated") <= 1 / x.size


# --- pre-emption -----------------------------------------------------------------------------


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.slow
def test_sigterm_mid_run_checkpoints_and_exits_0(corpus, env, tmp_path):
    """Injects SIGTERM into a train.py subprocess once it has logged 3 steps.

    It exits 0 with a checkpoint of the step it reached (no periodic checkpoints are due, so
    the SIGTERM path wrote it) and says so in the log.
    """
    args = cli(tmp_path, corpus, num_train_steps=10**6, checkpoint_every_steps=0)
    with open(tmp_path / "log.txt", "w") as log:
        proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=log)
        try:
            _wait_for(lambda: len(train_records(tmp_path)) >= 3, 180, "3 logged steps")
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=120) == 0
        finally:
            proc.kill()
    summary = json.loads((tmp_path / "summary.json").read_text())
    stopped = train_records(tmp_path)[-1]["step"]  # the last step the loop logged
    assert stopped >= 3 and summary["preempted_at"] == summary["step"] == stopped
    assert checkpoint_steps(tmp_path) == [stopped]
    assert "SIGTERM: checkpointing step" in (tmp_path / "log.txt").read_text()


@pytest.mark.slow
def test_sigterm_resume_is_bit_exact(corpus, tmp_path, baseline, monkeypatch):
    """Injects SIGTERM into this process while the loop reads the batch of step 6.

    train_and_evaluate finishes step 6, checkpoints it and returns; rerunning resumes there
    and every loss equals the uninterrupted baseline run's bit for bit (same data order).
    """
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers need the main thread")
    c = load_config(corpus, checkpoint_every_steps=0)
    read = data_lib.TrainIterator.__next__

    def read_and_signal(self):
        if self.step == 5:
            os.kill(os.getpid(), signal.SIGTERM)
        return read(self)

    monkeypatch.setattr(data_lib.TrainIterator, "__next__", read_and_signal)
    first = train_lib.train_and_evaluate(c, str(tmp_path))
    assert first["preempted_at"] == 6 and checkpoint_steps(tmp_path) == [6]
    monkeypatch.undo()
    assert train_lib.train_and_evaluate(c, str(tmp_path))["step"] == STEPS
    assert_same_losses(train_records(tmp_path), baseline[1])


@pytest.mark.slow
def test_ctrl_c_checkpoints_the_step_and_resume_is_bit_exact(
    corpus, tmp_path, baseline, monkeypatch
):
    """Injects a Ctrl-C (SIGINT) into this process while the loop reads the batch of step 6.

    train_and_evaluate finishes step 6, checkpoints it and raises KeyboardInterrupt naming the
    step and how to resume; from the first Ctrl-C on, a second one would raise at once (the
    handler is Python's again). The rerun resumes there and every loss equals the
    uninterrupted baseline run's bit for bit.
    """
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers need the main thread")
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("Ctrl-C does not raise KeyboardInterrupt here")
    c = load_config(corpus, checkpoint_every_steps=0)
    read = data_lib.TrainIterator.__next__
    handlers = []

    def read_and_interrupt(self):
        if self.step == 5:
            os.kill(os.getpid(), signal.SIGINT)
            handlers.append(signal.getsignal(signal.SIGINT))
        return read(self)

    monkeypatch.setattr(data_lib.TrainIterator, "__next__", read_and_interrupt)
    with pytest.raises(KeyboardInterrupt) as info:
        train_lib.train_and_evaluate(c, str(tmp_path))
    assert str(info.value) == (
        f"Ctrl-C at step 6, checkpointed in {tmp_path / 'checkpoints'}; rerun the same command "
        "to resume"
    )
    assert handlers == [signal.default_int_handler]
    assert checkpoint_steps(tmp_path) == [6]
    assert json.loads((tmp_path / "summary.json").read_text())["preempted_at"] == 6
    monkeypatch.undo()
    assert train_lib.train_and_evaluate(c, str(tmp_path))["step"] == STEPS
    assert_same_losses(train_records(tmp_path), baseline[1])
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


# train.py whose run is stopped by a Ctrl-C (after checkpointing, or before any step).
INTERRUPTED = """
import sys
from fp8jax.trainer import loop
message = sys.argv.pop()
def interrupted(config, workdir):
    raise KeyboardInterrupt(message)
loop.train_and_evaluate = interrupted
from fp8jax import train
sys.argv[0] = "train.py"
train.run()
"""


@pytest.mark.parametrize(
    "message,line",
    [
        ("Ctrl-C at step 6, checkpointed", "interrupted: Ctrl-C at step 6, checkpointed"),
        ("", "interrupted: Ctrl-C; rerun the same command to resume from the last checkpoint"),
    ],
)
def test_ctrl_c_ends_train_py_with_one_line_and_status_130(tmp_path, env, message, line):
    """train.py stopped by a Ctrl-C says so in one line (no traceback) and exits 130, as a
    shell reports a Ctrl-C, so `train.py && next` does not go on."""
    args = [sys.executable, "-c", INTERRUPTED, "--config", "tiny", f"--workdir={tmp_path}"]
    proc = subprocess.run([*args, message], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [line], proc.stderr[-3000:]


@pytest.mark.slow
def test_kill9_never_corrupts_latest_checkpoint_and_resume_is_exact(
    corpus, env, tmp_path, baseline
):
    """Injects SIGKILL at 4 random moments (seeded) into train.py runs that checkpoint every step.

    After each kill the latest checkpoint restores whole (its data position equals its step);
    the final resumed run completes, and every logged loss of every run equals the
    uninterrupted baseline's bit for bit (same data order).
    """
    rng = random.Random(6)
    args = cli(tmp_path, corpus)
    kills = []
    for i in range(4):
        seen = len(train_records(tmp_path))
        with open(tmp_path / f"log{i}.txt", "w") as log:
            proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=log)
            try:
                _wait_for(
                    lambda: len(train_records(tmp_path)) > seen or proc.poll() is not None,
                    180,
                    "a new step",
                )
                time.sleep(rng.uniform(0.0, 1.5))
            finally:
                proc.kill()
                proc.wait()
        ckpts = tmp_path / "checkpoints"
        mid_save = any("tmp" in p.name for p in ckpts.iterdir()) if ckpts.exists() else False
        step = None
        if checkpoint_steps(tmp_path):  # none yet if killed during the very first save
            step, state, data = restore_latest(tmp_path, corpus)
            assert data["step"] == step == int(state.step)
        kills.append((train_records(tmp_path)[-1]["step"], step, mid_save))
    print("kills (last logged step, latest checkpoint, killed mid-save):", kills)
    proc = run_cli(args, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_losses(train_records(tmp_path), baseline[1])


@pytest.mark.slow
def test_loop_trains_on_while_a_checkpoint_is_written(corpus, tmp_path, monkeypatch):
    """Holds back the write of the step-2 checkpoint (its data-state file) until the loop has
    logged step 3, for at most 60 s.

    The loop trains on while the write is in flight, so step 3 is logged before the write goes
    on; the run completes and both checkpoints restore whole.
    """
    write = ocp.handlers.JsonCheckpointHandler._save_fn
    held = []  # (step of the held write, whether step 3 was logged before it went on)

    async def held_back(self, item, directory):
        if not held:
            deadline = time.monotonic() + 60
            while not train_records(tmp_path)[2:] and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            held.append((item["step"], [r["step"] for r in train_records(tmp_path)][2:3]))
        await write(self, item, directory)

    monkeypatch.setattr(ocp.handlers.JsonCheckpointHandler, "_save_fn", held_back)
    c = load_config(corpus, num_train_steps=4, checkpoint_every_steps=2)
    assert train_lib.train_and_evaluate(c, str(tmp_path))["step"] == 4
    assert held == [(2, [3])]
    assert checkpoint_steps(tmp_path) == [2, 4]
    for step in (2, 4):
        _, state, data = restore_latest(tmp_path, corpus, step)
        assert int(state.step) == data["step"] == step


# --- bad input -------------------------------------------------------------------------------


def _snapshot(workdir) -> dict:
    """Every file under ``workdir``: size, mtime and content hash."""
    out = {}
    for p in sorted(pathlib.Path(workdir).rglob("*")):
        if p.is_file():
            digest = hashlib.sha256(p.read_bytes()).hexdigest()
            out[str(p.relative_to(workdir))] = (p.stat().st_size, p.stat().st_mtime_ns, digest)
    return out


def _corrupt_latest(workdir):
    """Truncate the biggest array file of the latest checkpoint (a torn or partial write)."""
    latest = pathlib.Path(workdir) / "checkpoints" / str(checkpoint_steps(workdir)[-1])
    biggest = max(
        (latest / "state").rglob("*"), key=lambda p: p.stat().st_size if p.is_file() else 0
    )
    os.truncate(biggest, biggest.stat().st_size // 2)


def _corrupt_latest_unchecked(workdir):
    """``_corrupt_latest`` in a step without checksums (saved by an older fp8jax, or killed
    before they were written): orbax's read fails instead."""
    _corrupt_latest(workdir)
    (pathlib.Path(workdir) / "checkpoints" / "40" / checksums.CHECKSUMS).unlink()


def _edit_data_state(workdir, old: str, new: str):
    """Replace ``old`` by ``new`` in the saved data state of checkpoint 40."""
    path = pathlib.Path(workdir) / "checkpoints" / "40" / "data" / "metadata"
    text = path.read_text()
    assert old in text, text
    path.write_text(text.replace(old, new))


BAD_INPUT = {
    # case: (flags, prepare the copied workdir, fragments the one-line error must contain)
    "unknown config key": (["--config.model.d_modle=64"], None,
                           ["unknown config key 'd_modle'", "did you mean 'd_model'", "base.py"]),
    "wrong type": (["--config.batch_size=four"], None,
                   ["--config.batch_size=four", "takes", "int", "base.py"]),
    "invalid FP8 level": (["--config.fp8.level=O9"], None, ["fp8.level 'O9'", "'O1'"]),
    "invalid FP8 recipe": (["--config.fp8.recipe=instant"], None, ["fp8.recipe", "'delayed'"]),
    "invalid FP8 format": (["--config.fp8.m_format=e3m4"], None, ["fp8.m_format", "'e4m3'"]),
    "heads not dividing width": (["--config.model.num_heads=3"], None,
                                 ["num_heads=3 does not divide", "d_model % num_heads == 0"]),
    "mesh not matching devices": (["--config.mesh.data=2"], None,
                                  ["mesh", "devices", "config.mesh"]),
    "batch not splitting": (["--config.grad_accum_steps=3"], None,
                            ["grad_accum_steps=3", "change one of them"]),
    "missing corpus": (["--config.data.path=/nonexistent/corpus.txt"], None,
                       ["does not exist", "set config.data.path"]),
    "empty corpus": (["--config.data.path={workdir}/empty.txt"],
                     lambda w: (w / "empty.txt").write_text("\n  \n"),
                     ["no text found", "set config.data.path"]),
    "checkpoint of another model": (["--config.model.d_model=32"], None,
                                    ["written by another model", "there but", "here",
                                     "fresh --workdir"]),
    "GPU-only attention on CPU": (["--config.model.attention_impl=cudnn"], None,
                                  ["attention_impl='cudnn'", "--config.model.attention_impl=xla"]),
    "corrupt checkpoint": ([], _corrupt_latest,
                           ["changed on disk since it was saved", "to resume from step 39"]),
    "corrupt unchecked checkpoint": ([], _corrupt_latest_unchecked,
                                     ["is corrupt or incomplete", "to resume from step 39"]),
    "renamed checkpoint": ([], lambda w: (w / "checkpoints/40").rename(w / "checkpoints/45"),
                           ["checkpoints/45 is named step 45", "has run 40 steps",
                            "rename it to", "checkpoints/40"]),
    "edited data position": ([], lambda w: _edit_data_state(w, '"step": 40', '"step": 35'),
                             ["puts the data at step 35, not 40", "back to 40"]),
    "malformed data state": ([], lambda w: _edit_data_state(w, '"step": 40', '"step": "40"'),
                             ["malformed data state", "'step' must be an integer >= 0"]),
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_one_line_error_and_overwrites_nothing(case, corpus, env, tmp_path, baseline):
    """Injects one bad input per case (a bad flag, config value, corpus or checkpoint) into
    train.py resuming a trained workdir.

    It exits 2 with no traceback and one stderr line 'error: ...' naming the problem and fix,
    and every file in the workdir (checkpoints included) is byte-for-byte untouched.
    """
    flags, prepare, fragments = BAD_INPUT[case]
    if case == "GPU-only attention on CPU" and jax.default_backend() == "gpu":
        pytest.skip("cuDNN attention is valid on a GPU")
    workdir = tmp_path / "work"
    shutil.copytree(baseline[0], workdir)
    if prepare:
        prepare(workdir)
    before = _snapshot(workdir)
    # A resume to step 50 (a finished run's rerun reads no checkpoint array: nothing to refuse).
    more = "--config.num_train_steps=50"
    args = cli(workdir, corpus, more, *[f.format(workdir=workdir) for f in flags])
    proc = run_cli(args, env)
    lines = proc.stderr.strip().splitlines()
    errors_ = [line for line in lines if line.startswith("error: ")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(errors_) == 1 and lines[-1] == errors_[0], lines[-5:]
    for fragment in fragments:
        assert fragment in errors_[0], errors_[0]
    assert _snapshot(workdir) == before


def test_failed_restore_drops_only_the_closed_loop_errors_after_it(monkeypatch):
    """Injects a failure inside the restore's muted hooks, then three late background errors.

    TensorStore reads a failed restore left in flight report 'Event loop is closed' up to
    interpreter exit (CI once saw them after the one-line error). The restore mutes the
    background hooks only while it runs and gives them back as they were, failed or not; the
    command line's filter drops exactly those late errors, and any other still reaches the
    user's hook.
    """
    from types import SimpleNamespace

    from fp8jax import cli
    from fp8jax.trainer import checkpoint

    late = [RuntimeError("Event loop is closed"), RuntimeError("other"), ValueError("x")]
    for how in ("succeeds", "caught, as restore does", "raised through"):
        seen = []
        monkeypatch.setattr(sys, "unraisablehook", seen.append)
        monkeypatch.setattr(threading, "excepthook", seen.append)
        if how == "raised through":
            with pytest.raises(OSError), checkpoint._muted_background_errors():
                sys.unraisablehook(SimpleNamespace(exc_value=late[1]))  # muted
                raise OSError("torn file")
        else:
            with checkpoint._muted_background_errors() as failed:
                threading.excepthook(SimpleNamespace(exc_value=late[2]))  # muted
                if how != "succeeds":
                    failed()
        assert sys.unraisablehook == threading.excepthook == seen.append, how
        assert seen == [], how
    cli.drop_closed_event_loop_errors()
    cli.drop_closed_event_loop_errors()  # once is enough: not wrapped twice
    assert sys.unraisablehook.drops_closed_loop
    for exc in late:
        sys.unraisablehook(SimpleNamespace(exc_value=exc))
    assert [a.exc_value for a in seen] == late[1:]


def test_unretrieved_orbax_write_errors_are_dropped_and_others_kept(caplog, monkeypatch):
    """Injects a write error inside a file under an ``orbax`` folder, gathered and never retrieved.

    A failed save's sibling writes gather into a future whose exception nothing retrieves;
    freeing it, at any time up to exit, made asyncio log a traceback after the one-line error
    (CI saw it). The command line's asyncio filter drops that record and keeps the same report
    of an error raised outside orbax.
    """
    from fp8jax import cli

    def raised_in(path: str):
        code = compile("async def write():\n    raise OSError(28, 'No space left')\n", path, "exec")
        scope = {}
        exec(code, scope)
        return scope["write"]

    asyncio_log = logging.getLogger("asyncio")
    monkeypatch.setattr(asyncio_log, "filters", [])  # another test may have installed it
    records = {}
    for name, path in (("orbax", "/site/orbax/checkpoint/ser.py"), ("user", "/site/mine/io.py")):
        loop = asyncio.new_event_loop()
        try:
            caplog.clear()
            with caplog.at_level(logging.ERROR, logger="asyncio"):
                fut = loop.run_until_complete(_gathered_quietly(raised_in(path)))
                del fut
                gc.collect()
            (records[name],) = [r for r in caplog.records if "never retrieved" in str(r.msg)]
        finally:
            loop.close()
    asyncio_log.addFilter(cli._not_an_orbax_task)
    assert not asyncio_log.filter(records["orbax"])
    assert asyncio_log.filter(records["user"])
    assert asyncio_log.filter(logging.makeLogRecord({"msg": "Event loop stopped"}))


async def _gathered_quietly(write):
    """A gathered future of ``write()`` that failed and whose exception nobody retrieved."""
    fut = asyncio.gather(write())
    await asyncio.wait([fut])
    return fut


@pytest.mark.parametrize("dtype", [np.int32, np.float64])
def test_fp8_dot_rejects_int_and_float64_with_the_fix(dtype):
    """Injects an int32 / float64 operand into fp8jax.dot_general."""
    x, w = np.ones((4, 8), dtype), np.ones((8, 4), np.float32)
    with pytest.raises(TypeError) as info:
        fp8jax.dot_general(x, w, (((1,), (0,)), ((), ())), fp8jax.init_meta())
    msg = str(info.value)
    assert "\n" not in msg and np.dtype(dtype).name in msg and "astype" in msg


# --- determinism ---------------------------------------------------------------------------


@pytest.mark.slow
def test_same_config_and_seed_give_identical_losses(corpus, tmp_path, baseline):
    """Injects nothing: an in-process run repeats the baseline subprocess run's config and seed.

    Every step's loss and gradient norm, and the final validation loss, are identical.
    """
    c = load_config(corpus, checkpoint_every_steps=0)
    summary = train_lib.train_and_evaluate(c, str(tmp_path))
    assert_same_losses(train_records(tmp_path), baseline[1])
    ref = json.loads((baseline[0] / "summary.json").read_text())
    assert summary["val_loss"] == ref["val_loss"]
