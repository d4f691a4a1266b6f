"""Pytree helpers every layer shares: a tree path as plain names."""

from __future__ import annotations

import jax

__all__ = ["leaf_name", "path_key"]


def path_key(path) -> tuple[str, ...]:
    """A tree path as a tuple of plain names, e.g. ('blocks', 'mlp', 'wi', 'kernel')."""
    return tuple(jax.tree_util.keystr((k,), simple=True) for k in path)


def leaf_name(path) -> str:
    """Last meaningful key of a tree path (skipping the ``.value`` of flax Partitioned boxes)."""
    names = list(path_key(path))
    while names and names[-1] == "value":
        names.pop()
    return names[-1] if names else ""
