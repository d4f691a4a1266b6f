"""Orbax checkpointing of the train state together with the data iterator position.

Orbax writes each step into a temporary directory and renames it when complete, so a crash
mid-save never leaves a half-written *latest* checkpoint; restore always picks a finished one.
"""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp
from absl import logging

from fp8jax.errors import CheckpointMismatchError


class Checkpointer:
    """Save/restore ``(state, data_state)`` under ``<workdir>/checkpoints``, keeping the last K."""

    def __init__(self, workdir: str, keep: int = 2, every: int = 0):
        self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
        self.manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=("state", "data")
        )
        self.every = every

    def latest_step(self) -> int | None:
        """Newest complete checkpoint step, or None."""
        return self.manager.latest_step()

    def save(self, step: int, state, data_state: dict, force: bool = False) -> bool:
        """Save if ``step`` is due (or ``force``); blocks until it is on disk."""
        if not force and (self.every <= 0 or step % self.every != 0):
            return False
        if step in self.manager.all_steps():
            return False
        saved = self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)
            ),
            force=True,
        )
        self.manager.wait_until_finished()
        if saved:
            logging.info("saved checkpoint step %d to %s", step, self.directory)
        return saved

    def restore(self, abstract_state, step: int | None = None):
        """Restore ``(state, data_state)`` of ``step`` (default latest) into the abstract target."""
        step = self.latest_step() if step is None else step
        try:
            restored = self.manager.restore(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()
                ),
            )
        except Exception as e:  # orbax raises many types: shape, tree, missing-file errors
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointMismatchError(
                f"checkpoint {self.directory}/{step} does not match this config or is corrupt "
                f"({type(e).__name__}: {first[:200]}); use a fresh --workdir or the config that "
                f"wrote it"
            ) from e
        return restored["state"], restored["data"]

    def close(self):
        """Flush pending saves."""
        self.manager.wait_until_finished()
        self.manager.close()


def abstract_like(tree, shardings=None):
    """ShapeDtypeStructs (with shardings) describing ``tree``, for restore targets."""
    if shardings is None:
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )
