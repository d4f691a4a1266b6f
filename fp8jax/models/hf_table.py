"""What a model family's Hugging Face side is built from: tensor-table rows and config.json reads.

Each HF tensor is described by its name, its shape and the *pieces* it maps to: a piece is a
numpy view of the HF tensor (reshape / transpose / index, never a copy) that equals one slice
of one fp8jax leaf. A family (``fp8jax.models.families``) lists its state dict as ``HfTensor``
rows; ``fp8jax.hf.weights`` runs the table in both directions, so import and export cannot
disagree.

Layouts: torch ``Linear`` weights are ``[out, in]``, GPT-2's ``Conv1D`` kernels ``[in, out]``;
fp8jax's kernels are ``[in..., out...]`` (``q [D, N, H]``, ``kv [D, 2, K, H]``, fused
``qkv [D, K, G+2, H]`` with query head ``kv * G + j``, ``o [N, H, D]``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from fp8jax.errors import CheckpointError

__all__ = [
    "ALL",
    "DEFAULT_ROPE_THETA",
    "HfTensor",
    "Piece",
    "attn_pieces",
    "one",
    "reject",
    "require",
    "same",
    "transpose",
]

ALL = slice(None)
DEFAULT_ROPE_THETA = 10_000.0  # transformers' default when a config names none


@dataclasses.dataclass(frozen=True)
class Piece:
    """``view(hf_tensor)`` equals ``leaf[index]`` of one block (or of the top level)."""

    leaf: tuple[str, ...]  # path inside a block's params, or from the top for non-block leaves
    index: tuple  # basic index into the leaf (per layer); () = all of it
    view: Callable[[np.ndarray], np.ndarray]


@dataclasses.dataclass(frozen=True)
class HfTensor:
    """One tensor of the HF state dict and where its values live in the fp8jax tree."""

    name: str
    shape: tuple[int, ...]
    layer: int | None  # block index, None for embeddings, final norm and head
    pieces: tuple[Piece, ...]


def same(x: np.ndarray) -> np.ndarray:
    """The identity view."""
    return x


def transpose(x: np.ndarray) -> np.ndarray:
    """The transposed view of a matrix (torch ``Linear [out, in]`` <-> ``[in, out]``)."""
    return x.T


def one(name: str, shape, layer: int | None, leaf, index=(), view=None) -> HfTensor:
    """A HF tensor that is one slice of one fp8jax leaf (``view`` default: as it is)."""
    return HfTensor(name, tuple(shape), layer, (Piece(tuple(leaf), index, view or same),))


def attn_pieces(
    fused_qkv: bool, group: int, qkv: str, part: str, views: Callable[[int], Callable]
) -> tuple[Piece, ...]:
    """Pieces of the q, k or v part (``qkv``) of a projection's kernel or bias (``part``).

    ``fused_qkv``: the model's ``qkv`` kernel holds all three (else ``q`` and ``kv``);
    ``group``: query heads per key/value head. ``views(rank)`` gives the HF view whose trailing
    axes are [K, G, H] (rank 3: queries, grouped as the fused kernel holds them) or [N or K, H]
    (rank 2).
    """
    lead = (ALL,) if part == "kernel" else ()  # the kernel's input axis D
    if fused_qkv:
        slot = {"q": slice(0, group), "k": group, "v": group + 1}[qkv]
        return (Piece(("attn", "qkv", part), (*lead, ALL, slot), views(3 if qkv == "q" else 2)),)
    if qkv == "q":
        return (Piece(("attn", "q", part), (), views(2)),)
    return (Piece(("attn", "kv", part), (*lead, "kv".index(qkv)), views(2)),)


def require(hfc: dict[str, Any], key: str, where: str) -> Any:
    """``hfc[key]``; a one-line CheckpointError if the config.json at ``where`` lacks it."""
    if hfc.get(key) is None:
        raise CheckpointError(f"{where} lacks {key!r}; it is not a complete config.json")
    return hfc[key]


def reject(where: str, name: str, problem: str) -> None:
    """Raise the one-line CheckpointError of a config.json feature the import does not support."""
    raise CheckpointError(f"{where}: {problem}, which fp8jax's {name} import does not support")
