"""The resumable training stream of every data format: batch ``t`` of the run is a pure
function of ``t`` (and the data, seed and batch shape), so a checkpoint stores only ``t``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from absl import logging

__all__ = [
    "Batch",
    "TrainIterator",
    "process_rows",
    "seed32",
    "state_from_bytes",
    "state_to_bytes",
]

Batch = dict  # batch key -> np.ndarray [rows, seq_len]


def process_rows(batch_size: int, index: int | None, count: int | None) -> tuple[int, int, int]:
    """(process index, process count, rows of each global batch that this process gets)."""
    if index is None or count is None:
        import jax  # only here: building the token cache needs no accelerator runtime

        index = jax.process_index() if index is None else index
        count = jax.process_count() if count is None else count
    if batch_size % count:
        raise ValueError(f"batch_size {batch_size} is not divisible by {count} processes")
    return index, count, batch_size // count


def seed32(*parts: Any) -> int:
    """A 32-bit seed mixed from ``parts``, so that nearby seeds give unrelated streams."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:4], "little")


def state_to_bytes(state: dict[str, Any]) -> bytes:
    """Serialise a :meth:`TrainIterator.get_state` dict to JSON bytes."""
    return json.dumps(state, sort_keys=True).encode()


def state_from_bytes(data: bytes | str) -> dict[str, Any]:
    """Inverse of :func:`state_to_bytes`."""
    return json.loads(data)


class TrainIterator:
    """Infinite iterator of training batches; ``get_state``/``set_state`` resume it exactly."""

    def __init__(self, batches: Sequence[Batch], identity: dict[str, Any]):
        self._batches = batches  # indexed by global step (a grain.MapDataset, or any sequence)
        self._identity = identity  # what a saved state must match to mean the same samples
        self.step = 0

    def __iter__(self) -> TrainIterator:
        return self

    def __next__(self) -> Batch:
        batch = self._batches[self.step]
        self.step += 1
        return batch

    def get_state(self) -> dict[str, Any]:
        """JSON-able position (store it next to the model checkpoint)."""
        return dict(self._identity, step=self.step)

    def set_state(self, state: dict[str, Any] | bytes | str) -> None:
        """Resume from :meth:`get_state` output (a dict, or its JSON bytes/str)."""
        if not isinstance(state, dict):
            state = state_from_bytes(state)
        step = int(state["step"])
        old_batch, new_batch = state.get("batch_size"), self._identity["batch_size"]
        if old_batch and old_batch != new_batch:
            step = step * old_batch // new_batch  # keep the number of samples already seen
        changed = [k for k, v in self._identity.items() if state.get(k, v) != v]
        if changed:
            logging.warning("data state was saved with other %s; now at step %d", changed, step)
        self.step = step
