"""What the command lines (train.py, ``python -m fp8jax.diagnostics.inspect``) set up for the
process they own, and the library leaves alone."""

from __future__ import annotations

import logging
import sys


def quiet_jax_backend_probe() -> None:
    """Drop JAX's INFO lines about backends it could not load ('Unable to initialize backend
    'tpu'' on every CPU run); its warnings and errors still show."""
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)


def drop_closed_event_loop_errors() -> None:
    """From now on, drop asyncio's 'Event loop is closed' errors from ``sys.unraisablehook``.

    A failed checkpoint restore leaves orbax's reads in flight; when they finish, at any time
    up to interpreter exit, each reports that error from orbax's closed event loop, after the
    command line's one-line error. Every other unraisable error still reaches the previous hook.
    """
    previous = sys.unraisablehook
    if getattr(previous, "drops_closed_loop", False):
        return

    def hook(args):
        exc = args.exc_value
        if not (isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"):
            previous(args)

    hook.drops_closed_loop = True
    sys.unraisablehook = hook
