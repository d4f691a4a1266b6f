"""What the loop reports: FP8 health summary, the end sample, summary.json, schedule changes."""

import dataclasses
import json
import logging
import threading
import warnings

import jax
import numpy as np
import pytest

from fp8jax import spec
from fp8jax.trainer import data as data_lib
from fp8jax.trainer import generate
from fp8jax.trainer import loop as train_lib
from fp8jax.trainer import metrics as metrics_lib

from fp8_testing import (
    with_overrides,
)

SMALL = {
    "model.num_layers": 2,
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
    "log_every_steps": 1,
    "eval_every_steps": 1000,
    "eval_batches": 1,
    "fp8_stats_every_steps": 1,
    "sample_tokens": 4,
    "checkpoint_every_steps": 1000,
    "compilation_cache_dir": "",
}


@pytest.fixture(scope="module")
def corpus(novel_file):
    """The first 100 kB of Pride and Prejudice."""
    return novel_file("pride-and-prejudice", 100_000)


def small_config(corpus, **overrides):
    overrides = {**SMALL, "data.path": str(corpus), **overrides}
    return with_overrides(train_lib.load_config("tiny"), overrides)


def records(workdir):
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def test_fp8_worst_reads_flax_sow_layout():
    """The summary finds every share in the layout flax's ``sow`` writes (tuples, stacks)."""
    stats = {
        "blocks": {
            "mlp": {"x_saturated": (np.array([0.1, 0.7]),), "x_flushed": (np.array([0.0, 0.2]),)}
        },
        "head": {"w_saturated": (np.float32(0.3),), "w_flushed": (np.float32(0.05),)},
    }
    worst = metrics_lib.fp8_worst(stats)
    assert worst == {
        "fp8_max_saturated": pytest.approx(0.7),
        "fp8_max_saturated_at": "blocks/mlp/x_saturated_1",
        "fp8_max_flushed": pytest.approx(0.2),
        "fp8_max_flushed_at": "blocks/mlp/x_flushed_1",
    }
    stats["head"]["w_flushed"] = (np.float32("nan"),)  # a NaN share is reported, not hidden
    assert np.isnan(metrics_lib.fp8_worst(stats)["fp8_max_flushed"])


@pytest.mark.parametrize(
    "saturated, flushed, warned",
    [
        (0.0, 0.0018, ()),  # SwiGLU's down projection at a healthy scale (moe_tiny, O1)
        (0.002, 0.0018, ("clip at the format max",)),
        (0.0, 0.014, ("flush to zero",)),  # fp8.margin=4: scales 16x too small
        (float("nan"), float("nan"), ("clip at the format max", "flush to zero")),
    ],
)
def test_health_warns_past_each_kinds_share(tmp_path, caplog, saturated, flushed, warned):
    """Clipping warns past 0.1%, flushing past 1%: the flush share of SwiGLU's product at a
    healthy scale stays quiet, a scale 16x too small does not, and NaN always warns."""
    caplog.set_level(logging.WARNING)
    log = metrics_lib.RunLog(str(tmp_path), num_steps=1, tokens_per_step=1, step=0)
    try:
        log.fp8(
            1,
            {},
            {
                "fp8_max_saturated": saturated,
                "fp8_max_saturated_at": "blocks/mlp/wi/x_saturated_0",
                "fp8_max_flushed": flushed,
                "fp8_max_flushed_at": "blocks/mlp/experts_wo/x_flushed_0",
            },
        )
    finally:
        log.close()
    said = tuple(k for k in ("clip at the format max", "flush to zero") if k in caplog.text)
    assert said == warned, caplog.text


def test_health_summary_reports_saturation_of_a_bad_margin(corpus, tmp_path, caplog):
    """``fp8.margin=-4`` makes every scale 16x too large: the summary must show it.

    With scale = fmax / (amax * 2**-4), every value above amax / 16 clips. A Gaussian weight
    matrix of a few thousand entries has amax near 4 sigma, so about 80% of it (|z| > 0.25)
    clips: the worst share is far above 0.5 (a healthy run's, below the warning threshold, is
    checked in the next test's first run).
    """
    caplog.set_level(logging.INFO)
    bad = tmp_path / "bad"
    train_lib.train_and_evaluate(small_config(corpus, **{"fp8.margin": -4}), str(bad))
    health = [r for r in records(bad) if "fp8_max_saturated" in r]
    assert [r["step"] for r in health] == [1, 2, 3]
    assert all(r["fp8_max_saturated"] > 0.5 for r in health), health
    assert health[-1]["fp8_max_saturated_at"].rsplit("/", 1)[-1] in {
        f"{t}_saturated_{layer}" for t in ("x", "w") for layer in (0, 1)
    }
    assert "FP8 values clip at the format max" in caplog.text


def test_sample_passes_parameters_as_arguments(corpus, tmp_path):
    """Sampling must not bake the parameters into its program as constants.

    JAX warns when a lowering captures more constant bytes than
    ``jax_captured_constants_warn_bytes``; with the threshold at half the parameters' bytes, a
    sampler closing over the parameters warns, one passing them as arguments does not.
    """
    run = spec.parse(small_config(corpus))
    env = train_lib.setup(run)
    state = env.init(jax.random.PRNGKey(0))
    dataset = data_lib.build(run, str(tmp_path))
    param_bytes = sum(x.nbytes for x in jax.tree.leaves(state.params))
    before = jax.config.jax_captured_constants_warn_bytes
    jax.config.update("jax_captured_constants_warn_bytes", param_bytes // 2)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*constants were captured.*")
            (text,) = generate.generate(
                env.model, state.params, state.fp8, dataset.tokenizer, ["The "], 3, temperature=0.8
            )
    finally:
        jax.config.update("jax_captured_constants_warn_bytes", before)
    assert text


def test_rerun_of_finished_run_keeps_summary_and_resume_notes_schedule(corpus, tmp_path, caplog):
    """A rerun of a finished run keeps summary.json whole; a longer resume says the schedule
    changed, naming the learning rate at the resumed step before and after."""
    caplog.set_level(logging.INFO)
    config = small_config(corpus)
    first = train_lib.train_and_evaluate(config, str(tmp_path))
    assert {"sample", "val_loss", "train_loss"} <= set(first)
    # A healthy run: its worst share stays under the warning threshold, and nothing warns.
    health = [r for r in records(tmp_path) if "fp8_max_saturated" in r]
    assert len(health) == 3, health
    for kind in ("saturated", "flushed"):
        limit = metrics_lib.HEALTH_WARN_SHARE[kind]
        assert all(r[f"fp8_max_{kind}"] <= limit for r in health), health
    assert "clip at the format max" not in caplog.text
    assert "flush to zero" not in caplog.text
    # The rerun reads no array (its step is checked from the metadata), and a config of
    # another model is still refused, leaving the work dir as it was.
    from fp8jax import errors
    from fp8jax.trainer import checkpoint

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(checkpoint.Checkpointer, "restore", lambda *a: pytest.fail("arrays read"))
        again = train_lib.train_and_evaluate(config, str(tmp_path))
        assert again == first
        assert json.loads((tmp_path / "summary.json").read_text()) == first
        assert "already reached step 3" in caplog.text
        model_json = (tmp_path / "model.json").read_text()
        wider = small_config(corpus, **{"model.d_ff": 2 * config.model.d_ff})
        with pytest.raises(errors.CheckpointMismatchError, match="another model or config"):
            train_lib.train_and_evaluate(wider, str(tmp_path))
        assert (tmp_path / "model.json").read_text() == model_json

    caplog.clear()
    longer = small_config(corpus, num_train_steps=5)
    summary = train_lib.train_and_evaluate(longer, str(tmp_path))
    assert summary["step"] == 5
    assert "changed learning-rate schedule (num_train_steps 3 -> 5)" in caplog.text
    assert [r["step"] for r in records(tmp_path) if "loss" in r] == [1, 2, 3, 4, 5]


def test_loop_reads_a_step_after_dispatching_the_next(corpus, tmp_path, monkeypatch):
    """With metrics logged every step, step N's are read (logged, checked for non-finite
    values) only after step N + 1 is dispatched, so the device never idles on the host; a step
    that waits for the device anyway (here the checkpoint at step 3) reports before the next."""
    events = []
    put = train_lib.sharding_lib.put_batch

    def recorded(read):  # a method that reads a step's metrics, noting the read first
        def wrapped(self, step, metrics):
            events.append(("read", step))
            return read(self, step, metrics)

        return wrapped

    monkeypatch.setattr(
        train_lib.sharding_lib, "put_batch", lambda *a: events.append(("put",)) or put(*a)
    )
    monkeypatch.setattr(metrics_lib.RunLog, "train", recorded(metrics_lib.RunLog.train))
    monkeypatch.setattr(
        metrics_lib.NonFiniteGuard, "check", recorded(metrics_lib.NonFiniteGuard.check)
    )
    steps = 6
    config = small_config(
        corpus,
        num_train_steps=steps,
        checkpoint_every_steps=3,
        fp8_stats_every_steps=1000,
        sample_tokens=0,
    )
    train_lib.train_and_evaluate(config, str(tmp_path))
    assert [r["step"] for r in records(tmp_path) if "loss" in r] == list(range(1, steps + 1))
    for n in range(1, steps):
        first_read = events.index(("read", n))
        dispatched = events[:first_read].count(("put",))
        assert dispatched == (n if n == 3 else n + 1), (n, events)


def test_a_failing_run_does_not_wait_for_the_sample_compile(corpus, tmp_path, monkeypatch):
    """A run that fails after starting its end sample's compile raises while that compile still
    runs, in a daemon thread, which the interpreter's exit does not wait for either."""
    started, never = threading.Event(), threading.Event()
    threads = []

    class Blocked:  # the sample's decoder: its compile does not finish while the test runs
        def compile(self, *args, **kwargs):
            threads.append(threading.current_thread())
            started.set()
            never.wait(timeout=120)

    class OutOfMemory:  # the train step's compile fails, as on a device too small for it
        def lower(self, *args):
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory while compiling the step")

    built = train_lib.setup
    monkeypatch.setattr(generate, "decoder_for", lambda *args: Blocked())
    monkeypatch.setattr(
        train_lib, "setup", lambda run: dataclasses.replace(built(run), train_step=OutOfMemory())
    )
    try:
        with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
            train_lib.train_and_evaluate(small_config(corpus), str(tmp_path))
        assert started.wait(timeout=30)  # the run did start the compile
        (thread,) = threads
        assert thread.is_alive() and thread.daemon
    finally:
        never.set()
