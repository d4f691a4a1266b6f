"""What the command lines (train.py, ``python -m fp8jax.diagnostics.inspect``) set up for the
process they own, and the library leaves alone."""

from __future__ import annotations

import logging


def quiet_jax_backend_probe() -> None:
    """Drop JAX's INFO lines about backends it could not load ('Unable to initialize backend
    'tpu'' on every CPU run); its warnings and errors still show."""
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
