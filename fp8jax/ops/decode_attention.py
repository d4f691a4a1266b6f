"""A decode step's attention that reads only the filled slots of the key/value cache.

Generation compiles its decode loop once per cache bucket of M slots, and a step at position p
needs the p + 1 slots at or before it. XLA's attention over the cache (``decode.attend``) reads
all M slots of every row and masks the rest away, so a batch whose rows are half-way through
a bucket reads twice the key/value bytes it uses. On CUDA GPUs this op runs JAX's Pallas
decode-attention kernel (``jax.experimental.pallas.ops.gpu.decode_attention``, Triton
backend) instead: one program per (row, key/value head, split of the slots) that skips its
split when the row's last filled slot lies before it, then a flash-decoding merge of the
splits' partial softmaxes. Where the kernel does not apply (prompts of several tokens, an
f32 cache, a bucket that is not a multiple of 16 slots, a head width that is not a power of two
of at least 16 (Triton's blocks), other platforms) it is the XLA reference, which the caller
passes.

Shape suffixes: B batch, N query heads, K key/value heads, M cache slots, H head dim.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from fp8jax.ops import kernels

__all__ = ["DTYPES", "attend_filled", "tiling"]

# The kernel's dots take 16-bit operands (f32 accumulation); an f32 cache keeps XLA's exact f32
# attention, which generation's token-for-token checks against transformers rely on.
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Slot splits per (row, head), most first: at batch 1 the rows and heads alone are too few
# programs for the GPU's SMs, and a split past the row's filled slots costs one branch.
_SPLITS = (16, 8, 4, 2, 1)
_BLOCKS = (128, 64, 32, 16)  # slots a program's loop reads at a time (Triton: >= 16)


def tiling(slots: int, choices: tuple[int, ...] = _SPLITS) -> tuple[int, int] | None:
    """``(splits, block)`` of the kernel for a cache of ``slots`` (each split whole blocks of
    at least 16 slots), the first of ``choices`` split counts that works; None where none does
    (the XLA reference runs)."""
    for splits in choices:
        per_split = slots // splits
        if slots % splits or per_split < 16:
            continue
        block = next((b for b in _BLOCKS if per_split % b == 0), None)
        if block is not None:
            return splits, block
    return None


def attend_filled(
    q_BxNxH: jax.Array,
    k_BxKxMxH: jax.Array,
    v_BxKxMxH: jax.Array,
    positions_B: jax.Array,
    window: int,
    impl: str,
    reference: Callable[..., jax.Array],
    shape: tuple[int, int] | None = None,
) -> jax.Array:
    """One query per row attending to the slots ``positions_B - window < slot <= positions_B``
    (``window`` 0: every slot up to its position), [B, N, H] in the cache's dtype.

    ``impl``: ``kernels.AUTO`` or one of ``kernels.IMPLS``, as the FP8 casts take it ('pallas'
    lowers to the kernel on CUDA only, 'interpret' runs it through Pallas' interpreter);
    ``reference(q, k, v, positions)``: the same attention in XLA ops. ``shape``: the kernel's
    ``(splits, block)`` (default: ``tiling``'s for the cache's slots).
    """
    impl = kernels.resolve_impl(impl)
    shape = shape or tiling(k_BxKxMxH.shape[2])
    h = k_BxKxMxH.shape[3]
    blocks_h = h >= 16 and h & (h - 1) == 0  # a Triton block's sides are powers of two
    if impl == "xla" or shape is None or not blocks_h or jnp.dtype(k_BxKxMxH.dtype) not in DTYPES:
        return reference(q_BxNxH, k_BxKxMxH, v_BxKxMxH, positions_B)
    splits, block = shape

    def kernel(q_BxNxH, k_BxKxMxH, v_BxKxMxH, positions_B, interpret=False):
        from jax.experimental.pallas.ops.gpu import decode_attention as pallas_decode

        # gqa takes [B, M, K, H] and swaps it to the [B, K, M, H] its programs read: the swap
        # of the cache's own layout cancels, so the kernel reads the cache in place.
        return pallas_decode.gqa(
            q_BxNxH.astype(k_BxKxMxH.dtype),
            jnp.swapaxes(k_BxKxMxH, 1, 2),
            jnp.swapaxes(v_BxKxMxH, 1, 2),
            start_idx=positions_B - window + 1 if window else None,
            kv_seq_len=positions_B + 1,  # the slots at or before the row's position
            k_splits=splits,
            block_k=block,
            interpret=interpret,
        ).astype(k_BxKxMxH.dtype)  # its normalization promotes to f32

    if impl == "interpret":
        return kernel(q_BxNxH, k_BxKxMxH, v_BxKxMxH, positions_B, interpret=True)
    return jax.lax.platform_dependent(
        q_BxNxH, k_BxKxMxH, v_BxKxMxH, positions_B, cuda=kernel, default=reference
    )
