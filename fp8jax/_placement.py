"""Where a run's files may go: not inside the folders another work dir's run manages.

A work dir (its record ``model.json``) holds folders that its run replaces or deletes as a
whole: orbax's steps (``checkpoints/``), the token cache (``tokens/``, rebuilt when the corpus
or the tokenizer changes) and TensorBoard's event files (``tensorboard/``). A work dir, an
export or prepared shards written inside one of them would be overwritten or deleted with it.
"""

from __future__ import annotations

import os

from fp8jax.errors import ConfigError

__all__ = ["MANAGED", "WORKDIR_RECORD", "check_outside_managed"]

MANAGED = ("checkpoints", "tokens", "tensorboard")
WORKDIR_RECORD = "model.json"  # every work dir's record of its model


def check_outside_managed(path: str | os.PathLike, name: str) -> None:
    """A one-line ConfigError if ``path`` (given as ``name``, e.g. '--workdir') lies inside a
    ``MANAGED`` folder of a work dir."""
    folder = os.path.abspath(os.path.expanduser(path))
    while (parent := os.path.dirname(folder)) != folder:
        managed = os.path.basename(folder)
        if managed in MANAGED and os.path.isfile(os.path.join(parent, WORKDIR_RECORD)):
            raise ConfigError(
                f"{name} {path} is inside {folder}, the {managed}/ folder that the run in "
                f"{parent} manages (and may replace or delete); pass a folder outside it"
            )
        folder = parent
