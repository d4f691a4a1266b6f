"""Kernel launches shared by the Mosaic GPU kernels: one launch per batch element under vmap."""

from __future__ import annotations

from collections.abc import Callable

import jax

__all__ = ["unbatched"]


def unbatched(launch: Callable) -> Callable:
    """``launch`` that, vmapped, runs once per batch element in a loop (``lax.map``), each the
    unbatched launch, rather than a batched grid for a persistent kernel (batched replicas under
    tensor parallelism). Unbatched operands pass to every launch as they are."""

    @jax.custom_batching.custom_vmap
    def run(*operands):
        return launch(*operands)

    @run.def_vmap
    def _batched(axis_size, in_batched, *operands):
        del axis_size

        def one(batched):
            it = iter(batched)
            return run(*(next(it) if b else x for x, b in zip(operands, in_batched, strict=True)))

        picked = tuple(x for x, b in zip(operands, in_batched, strict=True) if b)
        return jax.lax.map(one, picked), True

    return run
