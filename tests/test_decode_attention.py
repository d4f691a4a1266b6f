"""A decode step's attention through the Pallas decode kernel (Pallas' interpreter on CPU)
against the XLA attention over every slot of the cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax.models import decode
from fp8jax.ops import decode_attention

B, K, G, M, H = 4, 2, 2, 64, 16
# Rows at the first slot, inside the first split, across splits, at the last slot and past
# the cache (a finished row, whose write was dropped).
POSITIONS_B = np.array([0, 5, 37, M - 1], np.int32)


def bound(splits: int, v) -> float:
    """The kernel's rounding against the reference, both with bf16 outputs: each split's
    partial output is stored in bf16 (unit roundoff 2**-8 of max |v| times its weight), its
    correction and the sum over splits round once per split, the normalization once."""
    return (2 * splits + 2) * 2.0**-8 * float(jnp.abs(v.astype(jnp.float32)).max())


def qkv(dtype=jnp.bfloat16, seed=0):
    key_q, key_k, key_v = jax.random.split(jax.random.PRNGKey(seed), 3)
    q_BxNxH = jax.random.normal(key_q, (B, K * G, H), jnp.float32).astype(dtype)
    k_BxKxMxH = jax.random.normal(key_k, (B, K, M, H), jnp.float32).astype(dtype)
    v_BxKxMxH = jax.random.normal(key_v, (B, K, M, H), jnp.float32).astype(dtype)
    return q_BxNxH, k_BxKxMxH, v_BxKxMxH


def reference(window):
    """The attention the model runs without the kernel: ``KVCache``'s XLA path."""
    cache = decode.KVCache(window, "xla")
    return lambda q, k, v, pos: cache._attend_one(q, k, v, pos)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="the Triton kernel needs a CUDA GPU")
@pytest.mark.parametrize("window", [0, 8])
def test_the_triton_kernel_equals_xla_attention_on_the_gpu(window):
    """The compiled kernel ('pallas' lowers to it on CUDA) as the interpreter runs it."""
    q, k, v = qkv()
    ref = reference(window)
    got = jax.jit(lambda *a: decode_attention.attend_filled(*a, window, "pallas", ref))(
        q, k, v, POSITIONS_B
    )
    want = jax.jit(ref)(q, k, v, POSITIONS_B)
    err = np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32)).max()
    assert err <= bound(decode_attention.tiling(M)[0], v), err


@pytest.mark.parametrize("window", [0, 8])
def test_kernel_equals_xla_attention_over_the_filled_slots(window):
    """Each row attends to its own slots (position + 1, or its window) whatever the others'."""
    q, k, v = qkv()
    ref = reference(window)
    want = ref(q, k, v, POSITIONS_B)
    got = decode_attention.attend_filled(q, k, v, POSITIONS_B, window, "interpret", ref)
    assert got.shape == want.shape == (B, K * G, H) and got.dtype == want.dtype
    splits, _ = decode_attention.tiling(M)
    err = np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32)).max()
    assert err <= bound(splits, v), err
    # Row 0 sees its one slot: its output is that slot's value for every query head.
    np.testing.assert_array_equal(
        np.asarray(got[0], np.float32), np.repeat(np.asarray(v[0, :, 0], np.float32), G, 0)
    )


def test_rows_past_the_cache_see_every_slot():
    q, k, v = qkv(seed=1)
    ref = reference(0)
    past_B = np.full((B,), M + 3, np.int32)
    got = decode_attention.attend_filled(q, k, v, past_B, 0, "interpret", ref)
    want = ref(q, k, v, np.full((B,), M - 1, np.int32))
    err = np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32)).max()
    assert err <= bound(decode_attention.tiling(M)[0], v), err


def test_kv_cache_decode_step_runs_the_kernel_where_it_applies():
    """KVCache's decode step (one token per row) goes through the kernel with its impl, the
    prompt's several tokens and an f32 cache through XLA; both give the XLA attention's values."""
    q, k, v = qkv()
    cache = {"cache": {"k": k, "v": v}}

    def run(impl, length=1, dtype=jnp.bfloat16):
        """The module's output and jaxpr for ``length`` new tokens per row."""
        module = decode.KVCache(0, impl)
        variables = jax.tree.map(lambda a: a.astype(dtype), cache)
        q_BxLxNxH = jnp.repeat(q[:, None], length, 1).astype(dtype)
        kv_BxLxKxH = k[:, :, :length].swapaxes(1, 2).astype(dtype)
        positions_BxL = np.minimum(POSITIONS_B[:, None] + np.arange(length), M - 1)

        def fn(q_BxLxNxH):
            out, _ = module.apply(
                variables, q_BxLxNxH, kv_BxLxKxH, kv_BxLxKxH, positions_BxL, mutable=["cache"]
            )
            return out

        return fn(q_BxLxNxH), str(jax.make_jaxpr(fn)(q_BxLxNxH))

    got, jaxpr = run("interpret")
    want, xla_jaxpr = run("xla")
    assert "pallas_call" in jaxpr and "pallas_call" not in xla_jaxpr
    err = np.abs(np.asarray(got, np.float32) - np.asarray(want, np.float32)).max()
    assert err <= bound(decode_attention.tiling(M)[0], v), err
    # Several tokens per row (a prompt) and an f32 cache keep XLA's attention.
    assert "pallas_call" not in run("interpret", length=2)[1]
    assert "pallas_call" not in run("interpret", dtype=jnp.float32)[1]


@pytest.mark.parametrize("head_dim", [48, 8])
def test_head_widths_triton_cannot_block_keep_xla_attention(head_dim):
    q = jnp.ones((B, K * G, head_dim), jnp.bfloat16)
    k = v = jnp.ones((B, K, M, head_dim), jnp.bfloat16)
    traced = jax.make_jaxpr(
        lambda *a: decode_attention.attend_filled(*a, 0, "interpret", reference(0))
    )(q, k, v, POSITIONS_B)
    assert "pallas_call" not in str(traced)


TILINGS = [(512, (16, 32)), (64, (4, 16)), (48, (1, 16)), (96, (2, 16)), (16, (1, 16)), (40, None)]


@pytest.mark.parametrize(("slots", "want"), TILINGS)
def test_tiling_splits_the_cache_into_whole_blocks(slots, want):
    assert decode_attention.tiling(slots) == want


def test_tiling_takes_the_first_split_count_that_works():
    assert decode_attention.tiling(512, (8,)) == (8, 64)
    assert decode_attention.tiling(64, (8, 2)) == (2, 32)  # 8 splits of 64: under 16 slots
    assert decode_attention.tiling(64, (8,)) is None
