"""Exact scale-state updates: history roll, scale formula, recipes, bad amax, tree helpers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax.ops import formats, scaling
from fp8jax.ops.scaling import CurrentScaling, DelayedScaling

E4M3_MAX, E5M2_MAX = 448.0, 57344.0
DIV_RTOL = 2.5e-7  # 2 ulp of f32: XLA:GPU divides through a reciprocal, CPU rounds exactly


def _state(fmt="e4m3", **kw):
    return scaling.init_scale_state(fmt, DelayedScaling(**kw))


def _step(s, amax):
    """One training step that saw this amax."""
    return scaling.commit(scaling.record(s, jnp.float32(amax)))


def test_history_rolls_and_pending_slot_clears():
    s = _state(history_len=4)
    assert s.amax_history.shape == (5,)
    for a in (3.0, 5.0, 2.0):
        s = _step(s, a)
    # Slot 0 is the (empty) pending amax of the next step, then newest to oldest.
    np.testing.assert_array_equal(np.asarray(s.amax_history), [0.0, 2.0, 5.0, 3.0, 0.0])
    assert float(s.last_amax) == 2.0


def test_scale_formula_exact_with_margin():
    for fmt, fmax in (("e4m3", E4M3_MAX), ("e5m2", E5M2_MAX)):
        for margin in (0, 2):
            s = _step(_state(fmt, margin=margin), 3.7)
            expected = np.float32(fmax) / (np.float32(3.7) * np.float32(2.0**margin))
            assert float(s.scale) == pytest.approx(float(expected), rel=DIV_RTOL)


def test_power_of_two_rounds_down():
    s = _step(_state(power_of_two=True), 3.7)  # 448 / 3.7 = 121.08 -> 64
    assert float(s.scale) == 64.0
    s = _step(_state(power_of_two=True), 0.01)  # 44800 -> 32768
    assert float(s.scale) == 32768.0
    s = _step(_state(power_of_two=True), 3.5)  # 448 / 3.5 = 128 exactly: stays 128
    assert float(s.scale) == 128.0
    for a in np.geomspace(1e-6, 1e4, 37, dtype=np.float32):  # always exact and <= the raw scale
        sc = float(_step(_state(power_of_two=True), a).scale)
        assert sc == 2.0 ** np.floor(np.log2(sc)) and sc <= E4M3_MAX / a < 2 * sc


def test_max_vs_most_recent_and_window():
    mx, mr = _state(history_len=2), _state(history_len=2, amax_compute_algo="most_recent")
    for a in (8.0, 1.0):
        mx, mr = _step(mx, a), _step(mr, a)
    assert float(mx.scale) == E4M3_MAX / 8.0  # window still holds 8
    assert float(mr.scale) == E4M3_MAX / 1.0
    mx = _step(mx, 1.0)  # 8 has left the 2-step window
    assert float(mx.scale) == E4M3_MAX / 1.0


@pytest.mark.parametrize("history_len", [16, 1024])  # elementwise maxima / one reduce
def test_window_max_over_every_slot(history_len):
    """The scale comes from the largest amax anywhere in the window, newest or oldest."""
    for peak_at in (0, history_len // 2, history_len - 1):
        s = _state(history_len=history_len)
        for i in range(history_len):
            hist = s.amax_history.at[i + 1].set(8.0 if i == peak_at else 1.0 + i % 3)
            s = s.replace(amax_history=hist)
        s = scaling.commit(s)  # the pending slot is empty: the window is the history
        assert float(s.scale) == E4M3_MAX / 8.0 or peak_at == history_len - 1
    # The oldest slot leaves the window at this commit: its 8 no longer counts.
    assert float(s.scale) == pytest.approx(E4M3_MAX / 3.0, rel=DIV_RTOL)


@pytest.mark.parametrize("bad", [0.0, np.nan, np.inf, -np.inf, 1e-40])
@pytest.mark.parametrize("pow2", [False, True])
def test_unusable_amax_keeps_the_old_scale(bad, pow2):
    # 1e-40: 448 / 1e-40 overflows f32; that scale must not be used (nor rounded to 0.5).
    s = _step(_state(history_len=1, power_of_two=pow2), 2.0)
    good = 128.0 if pow2 else 224.0
    assert float(s.scale) == good
    s2 = _step(s, np.float32(bad))
    assert float(s2.scale) == good
    # NaN/Inf never enter the history (they would poison the window max for history_len steps).
    assert np.all(np.isfinite(np.asarray(s2.amax_history)))


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_commit_sanitizes_a_pending_amax_written_without_record(bad):
    """A pending slot written directly (a kernel, a cotangent, a restored state) with Inf/NaN
    commits as 0: the scale stays and the history stays finite."""
    s = _step(_state(history_len=2, amax_compute_algo="most_recent"), 2.0)
    s2 = scaling.commit(s.replace(amax_history=s.amax_history.at[0].set(bad)))
    assert float(s2.scale) == float(s.scale) == E4M3_MAX / 2.0
    np.testing.assert_array_equal(np.asarray(s2.amax_history), [0.0, 0.0, 2.0])


def test_record_merges_by_max_not_sum():
    s = _state()
    for a in (2.0, 7.0, 3.0):
        s = scaling.record(s, jnp.float32(a))
    assert float(s.amax_history[0]) == 7.0
    assert float(scaling.commit(s).scale) == E4M3_MAX / 7.0


def test_stacked_states_commit_per_layer():
    s = jax.vmap(lambda _: _state(history_len=2))(jnp.arange(3))  # scan-style [L] states
    s = scaling.record(s, jnp.array([1.0, 2.0, 4.0]))
    s = scaling.commit(s)
    np.testing.assert_array_equal(np.asarray(s.scale), E4M3_MAX / np.array([1.0, 2.0, 4.0]))
    assert s.amax_history.shape == (3, 3)


def test_current_scaling_scale_from_own_amax():
    m = fp8jax.init_meta(CurrentScaling())
    x = jnp.array([[0.5, -2.0]])
    scale = scaling.use_scale(m.x, formats.amax(x))
    assert float(scale) == E4M3_MAX / 2.0


def test_make_recipe_and_errors():
    r = fp8jax.make_recipe("delayed", history_len=4, margin=1, unrelated_key=3)
    assert r == DelayedScaling(history_len=4, margin=1)
    assert isinstance(fp8jax.make_recipe("current"), CurrentScaling)
    with pytest.raises(ValueError, match="unknown FP8 scaling recipe 'tensorwise'"):
        fp8jax.make_recipe("tensorwise")
    with pytest.raises(ValueError, match="unknown amax_compute_algo 'mean'"):
        DelayedScaling(amax_compute_algo="mean")
    with pytest.raises(ValueError, match="history_len must be >= 1"):
        DelayedScaling(history_len=0)
    with pytest.raises(ValueError, match="unknown FP8 format 'e2m1'"):
        scaling.init_scale_state("e2m1", DelayedScaling())


def test_tree_helpers_merge_commit_keep_summarize():
    meta = fp8jax.init_meta(DelayedScaling(history_len=2))
    tree = {"a": meta, "b": meta}
    grads = jax.tree.map(jnp.zeros_like, tree)
    grads["a"] = grads["a"].replace(dy=scaling.record(grads["a"].dy, jnp.float32(6.0)))
    merged = fp8jax.merge_grads(tree, grads)
    merged = fp8jax.merge_grads(merged, jax.tree.map(lambda g: g * 0.5, grads))  # 2nd micro-batch
    assert float(merged["a"].dy.amax_history[0]) == 6.0  # max(6, 3), not 9
    new = fp8jax.commit(merged)
    assert float(new["a"].dy.scale) == pytest.approx(E5M2_MAX / 6.0, rel=DIV_RTOL)
    assert float(new["b"].dy.scale) == 1.0  # no amax seen: scale kept
    kept = fp8jax.keep_if_finite(new, tree, jnp.array(False))
    assert float(kept["a"].dy.scale) == 1.0
    stats = fp8jax.summarize(new)
    assert float(stats["a/dy/amax"]) == 6.0
    assert float(stats["a/dy/scale"]) == float(new["a"].dy.scale)
