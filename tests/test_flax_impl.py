"""fp8.impl='flax': flax's Fp8DirectDotGeneralOp in the same model and step (benchmarks only)."""

import re

import jax
import numpy as np
import pytest

from fp8jax import spec
from fp8jax.models.layers import FLAX_FP8
from fp8jax.trainer import environment
from fp8jax.trainer import loop as train_lib

OP = "Fp8DirectDotGeneralOp_0"
HISTORY = ("input_amax_history", "kernel_amax_history", "output_grad_amax_history")
SCALES = ("input_scale", "kernel_scale", "output_grad_scale")
LINEARS = 5  # per GPT block: q, kv, o, mlp wi, mlp wo
E4M3_MAX, E5M2_MAX = 448.0, 57344.0

# benchmarks/step.py, the one user of impl='flax', runs the step under `with mesh:`.
pytestmark = pytest.mark.filterwarnings("ignore:.*with mesh.*:DeprecationWarning")


def _config(impl="flax", scan=True):
    """The tiny GPT at O1, shrunk further (2 layers of width 64, 16 tokens, batch 4)."""
    c = train_lib.load_config("tiny")
    c.fp8.level, c.fp8.impl = "O1", impl
    m = c.model
    m.scan_layers = scan
    m.num_layers, m.d_model, m.num_heads, m.num_kv_heads, m.d_ff = 2, 64, 2, 2, 128
    m.vocab_size, m.max_len = 128, 16
    c.seq_len, c.batch_size = 16, 4
    return c


def _two_steps(c, params=None):
    """(StableHLO of the step, states before/after each step, the two losses)."""
    env = train_lib.setup(spec.parse(c), donate=False)  # states are inspected after the steps
    state = env.init(jax.random.PRNGKey(c.seed))
    if params is not None:
        state = state.replace(params=params)
    tok = np.random.default_rng(0).integers(0, c.model.vocab_size, (c.batch_size, c.seq_len + 1))
    tok = tok.astype(np.int32)
    batch = jax.device_put({"inputs": tok[:, :-1], "targets": tok[:, 1:]}, env.batch_sharding)
    states, losses = [state], []
    with env.mesh:
        lowered = env.train_step.lower(state, batch)
        step = lowered.compile()  # the lowering above, compiled once (no second trace)
        for _ in range(2):
            state, metrics = step(state, batch)
            states.append(state)
            losses.append(float(metrics["loss"]))
    return lowered.as_text(), states, losses


def _linears(fp8, params, op=OP):
    """(path, the op's FP8 state, the linear's kernel) of every FP8 linear, in path order."""
    out = []

    def walk(node, path):
        if op in node:
            kernel = params
            for k in path:
                kernel = kernel[k]
            out.append(("/".join(path), node[op], np.asarray(kernel["kernel"])))
            return
        for k in sorted(node):
            walk(node[k], (*path, k))

    walk(fp8, ())
    return out


def _dot_types(hlo: str) -> list[tuple[str, str]]:
    """Element types of both operands of every stablehlo.dot_general."""
    pat = r"stablehlo\.dot_general .* : \(tensor<(?:\d+x)*(\w+)>, tensor<(?:\d+x)*(\w+)>\)"
    return [m.groups() for m in re.finditer(pat, hlo)]


# The comparison with fp8jax's op costs one more compile (~6 s): done once, with the default
# stacked layers, since the op's numerics do not depend on how the layers are stacked.
@pytest.mark.parametrize("scan,compare", [(True, True), (False, False)], ids=["scan", "unrolled"])
def test_flax_op_trains_like_fp8jax(scan, compare):
    c = _config("flax", scan)
    hlo, (s0, s1, s2), losses = _two_steps(c)

    # flax's own collection, not fp8jax's ScaleStates: the model really uses flax's op.
    ops = _linears(s0.fp8, s0.params)
    traced = LINEARS * (1 if scan else c.model.num_layers)  # scan: one block, state stacked
    assert len(ops) == traced, [p for p, _, _ in ops]
    layers = (c.model.num_layers,) if scan else ()
    for path, fresh, _ in ops:
        assert set(fresh) == set(HISTORY + SCALES), path
        assert fresh["input_amax_history"].shape == (*layers, 1024), path  # flax's default
        assert not any(np.asarray(fresh[t]).any() for t in HISTORY), path
        assert all((np.asarray(fresh[t]) == 1).all() for t in SCALES), path

    # The step quantizes: E4M3 x E4M3 forward; dgrad and wgrad take the E5M2 dy first.
    kinds = _dot_types(hlo)
    assert kinds.count(("f8E4M3FN", "f8E4M3FN")) == traced, kinds
    assert kinds.count(("f8E5M2", "f8E4M3FN")) == 2 * traced, kinds

    assert np.isfinite(losses).all()
    steps = zip(ops, _linears(s1.fp8, s1.params), _linears(s2.fp8, s2.params), strict=True)
    for (path, _, w0), (_, after1, w1), (_, after2, _) in steps:
        h1 = {t: np.asarray(after1[t]) for t in HISTORY + SCALES}
        h2 = {t: np.asarray(after2[t]) for t in HISTORY + SCALES}
        for t in HISTORY + SCALES:
            assert np.isfinite(h1[t]).all() and np.isfinite(h2[t]).all(), (path, t)
        # Step 1 wrote its amaxes into slot 0: the "gradient" of flax's variables is their
        # new value, which the step must store (summed or fed to Adam, this would fail).
        w_amax = np.abs(w0).reshape(*layers, -1).max(-1)
        np.testing.assert_array_equal(h1["kernel_amax_history"][..., 0], w_amax, err_msg=path)
        for t in HISTORY:
            assert (h1[t][..., 0] > 0).all() and not h1[t][..., 1:].any(), (path, t)
        # flax derives a step's scale from the history before that step: still 1 after step 1
        # (empty history), amax(step 1) / fmax after step 2. Its history rolls left, then
        # slot 0 is written; step 2 saw the kernel step 1 updated.
        for t in SCALES:
            np.testing.assert_array_equal(h1[t], 1.0, err_msg=f"{path} {t}")
        for hist, scale, fmax in zip(HISTORY, SCALES, (E4M3_MAX, E4M3_MAX, E5M2_MAX), strict=True):
            np.testing.assert_array_equal(h2[hist][..., -1], h1[hist][..., 0], err_msg=path)
            assert (h2[hist][..., 0] > 0).all() and not h2[hist][..., 1:-1].any(), (path, hist)
            np.testing.assert_allclose(
                h2[scale][..., 0], h1[hist][..., 0] / fmax, rtol=1e-6, err_msg=f"{path} {scale}"
            )
        w1_amax = np.abs(w1).reshape(*layers, -1).max(-1)
        np.testing.assert_array_equal(h2["kernel_amax_history"][..., 0], w1_amax, err_msg=path)

    if not compare:
        return
    # fp8jax's op from the same params on the same batch. Both are delayed scaling with
    # amax = max over the history: step 1 quantizes with scale 1 (empty history), step 2 with
    # fmax / amax(step 1); the history lengths (1024 vs 16) only matter from step 17. So both
    # quantize identically here and the losses agree to a few f32 ulp (bitwise on CPU). For
    # scale: O1 vs O0 differ by ~1e-4 here, and scales off by 2x (fp8.margin=1 or
    # power_of_two) move step 2's loss by 4e-6 to 6e-6, ten times this tolerance.
    _, (_, r1, _), ref = _two_steps(_config("fp8jax", scan), params=s0.params)
    np.testing.assert_allclose(losses, ref, rtol=5e-7)
    # Both recorded the same x, w and dy amaxes in step 1 (fp8jax: slot 1 after its commit).
    theirs = _linears(r1.fp8, r1.params, op="Fp8DotGeneral_0")
    for (path, flax1, _), (_, ours, _) in zip(_linears(s1.fp8, s1.params), theirs, strict=True):
        for hist, t in zip(HISTORY, ("x", "w", "dy"), strict=True):
            np.testing.assert_allclose(
                flax1[hist][..., 0],
                getattr(ours["meta"], t).amax_history[..., 1],
                rtol=1e-6,
                err_msg=f"{path} {hist}",
            )


def test_flax_state_collection_name():
    # The step passes the state under flax's collection name, which its op hard-codes.
    from flax.linen import fp8_ops

    assert FLAX_FP8 == fp8_ops.OVERWRITE_WITH_GRADIENT


def test_training_with_flax_op_is_refused():
    c = _config("flax")
    run = spec.parse(c)  # a valid run spec: the step benchmark builds it
    with pytest.raises(ValueError, match=r"fp8\.impl='flax'.*train with fp8\.impl='fp8jax'"):
        environment.check_environment(run)
    environment.check_environment(
        run, training=False
    )  # diagnostics.inspect reports on flax's op too
    c.fp8.impl = "foo"
    with pytest.raises(ValueError, match=r"unknown fp8\.impl 'foo'.*'fp8jax', 'flax'"):
        spec.parse(c)
    c.fp8.impl = "fp8jax"
    environment.check_environment(spec.parse(c))
