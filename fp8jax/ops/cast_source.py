"""What a fine-grained FP8 cast quantizes: an f32 function of [M, K] tensors and row and column
vectors, evaluated elementwise where the cast reads them.

A plain cast quantizes x itself. The fine recipes' MLP hands the casts more: wo's input cast
computes ``gelu(h * inv_r + b)`` from wi's GEMM output ``h`` (its row and column unscale ``inv_r
= inv_M[m] * inv_F[f]`` and the bias ``b``), and wi's output-gradient cast computes ``gelu'(pre) *
da`` from the same ``h`` and wo's dgrad output ``da``. Neither the pre-activation, the activation
nor its gradient is written out: each kernel block (``row_cast_kernels``, ``block_cast_kernels``)
evaluates ``fn`` on the blocks it reads, and the XLA references evaluate it on whole arrays with
the same f32 operations.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct

from fp8jax.ops import activations

__all__ = [
    "Source",
    "activated",
    "activation_grad",
    "block_specs",
    "check",
    "evaluate",
    "evaluate_block",
    "identity",
    "plain",
    "vector_specs",
]


@struct.dataclass
class Source:
    """``fn(mats, rows, cols, tanh)``: f32, elementwise over ``mats`` ([M, K] each) with ``rows``
    ([M] each) broadcast along K and ``cols`` ([K] each) along M. A pytree of its arrays;
    ``fn`` is static."""

    mats: tuple[jax.Array, ...]
    rows: tuple[jax.Array, ...]
    cols: tuple[jax.Array, ...]
    fn: Callable = struct.field(pytree_node=False)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.mats[0].shape

    @property
    def operands(self) -> tuple[jax.Array, ...]:
        """Every array a kernel reads, in order: ``mats``, ``rows``, ``cols``."""
        return (*self.mats, *self.rows, *self.cols)


def identity(mats, rows, cols, tanh):
    """A plain cast's ``fn``: the tensor itself, in f32."""
    return mats[0].astype(jnp.float32)


def plain(x_MxK: jax.Array, prologue: str | None = None) -> Source:
    """``act(x)`` in f32 (``act`` the ``prologue``; x itself for None)."""
    if prologue is None:
        return Source((x_MxK,), (), (), identity)
    activations.activation(prologue)  # a clear error for an unknown name

    def fn(mats, rows, cols, tanh):
        return activations.activation(prologue, tanh)(mats[0].astype(jnp.float32))

    return Source((x_MxK,), (), (), fn)


def _pre(h, row_inv, col_inv, bias):
    """``h * row_inv * col_inv + bias`` in f32; a None inverse is 1 (h already unscaled), a None
    bias 0 (h the pre-activation itself)."""
    pre = h.astype(jnp.float32)
    if row_inv is not None:
        pre = pre * row_inv
    if col_inv is not None:
        pre = pre * col_inv
    return pre if bias is None else pre + bias.astype(jnp.float32)


def _split(rows, cols, scaled: bool, biased: bool):
    """``(row_inv, col_inv, bias)`` from the front of ``rows`` and ``cols`` (None where unscaled
    or unbiased) and what is left of each."""
    r, c = (rows[0], cols[0]) if scaled else (None, None)
    rows, cols = (rows[1:], cols[1:]) if scaled else (rows, cols)
    b, cols = (cols[0], cols[1:]) if biased else (None, cols)
    return r, c, b, rows, cols


def _front(inv_M, inv_K, bias_K) -> tuple[tuple, tuple]:
    """The leading row and column vectors ``_split`` takes apart."""
    scaled = ((inv_M,), (inv_K,)) if inv_M is not None else ((), ())
    return scaled[0], (*scaled[1], *(() if bias_K is None else (bias_K,)))


def activated(
    h_MxK: jax.Array,
    inv_M: jax.Array | None,
    inv_K: jax.Array | None,
    bias_K: jax.Array | None,
    act: str,
) -> Source:
    """``act(h * inv_M[:, None] * inv_K[None, :] + bias_K)`` in f32: a layer's activation from its
    GEMM output (``inv_M, inv_K`` None for an output already unscaled, ``bias_K`` None for
    none)."""
    activations.activation(act)
    scaled, biased = inv_M is not None, bias_K is not None

    def fn(mats, rows, cols, tanh):
        r, c, b, _, _ = _split(rows, cols, scaled, biased)
        return activations.activation(act, tanh)(_pre(mats[0], r, c, b))

    return Source((h_MxK,), *_front(inv_M, inv_K, bias_K), fn)


def activation_grad(
    h_MxK: jax.Array,
    inv_M: jax.Array | None,
    inv_K: jax.Array | None,
    bias_K: jax.Array | None,
    da_MxK: jax.Array,
    da_inv_M: jax.Array | None,
    da_inv_K: jax.Array | None,
    act: str,
) -> Source:
    """``act'(pre) * da * da_inv_M[:, None] * da_inv_K[None, :]`` in f32, ``pre`` as in
    ``activated``: the gradient at the pre-activation from the activation's (a dgrad output)."""
    activations.check_activation(act, activations.ACTIVATION_GRADS)
    scaled, biased = inv_M is not None, bias_K is not None
    da_scaled = da_inv_M is not None

    def fn(mats, rows, cols, tanh):
        r, c, b, rows, cols = _split(rows, cols, scaled, biased)
        pre = _pre(mats[0], r, c, b)
        da = mats[1].astype(jnp.float32)
        if da_scaled:
            da = da * rows[0] * cols[0]
        return activations.ACTIVATION_GRADS[act](pre, tanh) * da

    rows, cols = _front(inv_M, inv_K, bias_K)
    if da_scaled:
        rows, cols = (*rows, da_inv_M), (*cols, da_inv_K)
    return Source((h_MxK, da_MxK), rows, cols, fn)


def evaluate(src: Source, tanh=jnp.tanh) -> jax.Array:
    """``src`` on whole arrays, f32 [M, K] (the references')."""
    rows = tuple(r.astype(jnp.float32)[:, None] for r in src.rows)
    cols = tuple(c.astype(jnp.float32)[None, :] for c in src.cols)
    return src.fn(src.mats, rows, cols, tanh)


def vector_specs(bm: int, bk: int) -> tuple:
    """Pallas block specs of a row vector [M] and a column vector [K] (a source's ``rows`` and
    ``cols``, a kernel's amaxes or inverse scales) for the [bm, bk] block (i, j)."""
    from jax.experimental import pallas as pl

    return pl.BlockSpec((bm,), lambda i, j: (i,)), pl.BlockSpec((bk,), lambda i, j: (j,))


def block_specs(src: Source, bm: int, bk: int) -> list:
    """Pallas block specs of ``src.operands`` for a kernel over its [bm, bk] blocks (i, j)."""
    from jax.experimental import pallas as pl

    mat = pl.BlockSpec((bm, bk), lambda i, j: (i, j))
    row, col = vector_specs(bm, bk)
    return [mat] * len(src.mats) + [row] * len(src.rows) + [col] * len(src.cols)


def evaluate_block(src: Source, refs, tanh) -> tuple[jax.Array, tuple]:
    """``src`` on one kernel block (f32 [bm, bk]) from the kernel's refs, which start with its
    operands' (as ``block_specs`` lays them out), and the refs after those."""
    n_m, n_r = len(src.mats), len(src.rows)
    n = len(src.operands)
    mats = tuple(r[...] for r in refs[:n_m])
    rows = tuple(r[...].astype(jnp.float32)[:, None] for r in refs[n_m : n_m + n_r])
    cols = tuple(c[...].astype(jnp.float32)[None, :] for c in refs[n_m + n_r : n])
    return src.fn(mats, rows, cols, tanh), refs[n:]


def check(src: Source) -> None:
    """One-line errors for operands that do not line up."""
    m, k = src.shape
    for a in src.mats:
        if a.shape != (m, k):
            raise ValueError(f"cast source tensors must share one [M, K] shape, got {a.shape}")
    for name, vecs, n in (("row", src.rows, m), ("column", src.cols, k)):
        for v in vecs:
            if v.shape != (n,):
                raise ValueError(f"cast source {name} vectors must be [{n}], got {v.shape}")
