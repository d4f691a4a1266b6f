"""What the command lines (train.py, ``python -m fp8jax.diagnostics.inspect``) set up for the
process they own, and the library leaves alone."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable
from typing import NoReturn

__all__ = [
    "drop_closed_event_loop_errors",
    "fail",
    "quiet_jax_backend_probe",
    "run",
    "user_errors",
]


def quiet_jax_backend_probe() -> None:
    """Drop JAX's INFO lines about backends it could not load ('Unable to initialize backend
    'tpu'' on every CPU run); its warnings and errors still show."""
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)


def drop_closed_event_loop_errors() -> None:
    """From now on, drop asyncio's 'Event loop is closed' errors from ``sys.unraisablehook``.

    A failed checkpoint restore leaves orbax's reads in flight; when they finish, at any time
    up to interpreter exit, each reports that error from orbax's closed event loop, after the
    command line's one-line error; its read coroutines and tasks, collected unfinished, report
    the read's failure that the error line already names (an unraisable error, asyncio's 'Task
    exception was never retrieved'). Every other unraisable error still reaches the previous
    hook, every other asyncio record its logger.
    """
    previous = sys.unraisablehook
    if getattr(previous, "drops_closed_loop", False):
        return
    logging.getLogger("asyncio").addFilter(_not_an_orbax_task)

    def hook(args):
        exc = args.exc_value
        if isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed":
            return
        code = getattr(getattr(args, "object", None), "cr_code", None)  # a coroutine's
        if code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename:
            return
        previous(args)

    hook.drops_closed_loop = True
    sys.unraisablehook = hook


def _not_an_orbax_task(record: logging.LogRecord) -> bool:
    """False for asyncio's report of an orbax task's exception that nothing retrieved."""
    text = str(record.msg)
    orbax = f"{os.sep}orbax{os.sep}" in text
    return not (text.startswith("Task exception was never retrieved") and orbax)


def fail(message) -> NoReturn:
    """End a command line with ``error: <message>`` on stderr and exit status 2."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


@contextlib.contextmanager
def user_errors(interrupted: str = "Ctrl-C"):
    """Report a ``UserError`` raised inside as one stderr line, exit 2, and a Ctrl-C as one
    line, exit 130 (as a shell reports it): ``interrupted: <its message, else interrupted>``
    (FP8JAX_DEBUG=1: the traceback instead)."""
    from fp8jax import errors

    try:
        yield
    except errors.USER_ERRORS as e:
        if os.environ.get("FP8JAX_DEBUG"):
            raise
        fail(e)
    except KeyboardInterrupt as e:
        if os.environ.get("FP8JAX_DEBUG"):
            raise
        print(f"interrupted: {str(e) or interrupted}", file=sys.stderr)
        sys.exit(130)


def run(main: Callable[[list[str]], None]) -> None:
    """``absl.app.run(main)`` for the library's command lines: a bad flag is one stderr line
    (exit 2), JAX's backend probe is quiet, orbax's late closed-loop errors are dropped."""
    from absl import app, flags

    def parse(argv):
        try:
            args = flags.FLAGS(argv)
            if not flags.FLAGS["verbosity"].present:  # orbax's INFO lines bury the output
                flags.FLAGS.verbosity = 1 - 2  # absl's WARNING level
            return args
        except flags.Error as e:
            if os.environ.get("FP8JAX_DEBUG"):
                raise
            fail(f"{e}; see {os.path.basename(argv[0])} --helpshort")

    quiet_jax_backend_probe()
    drop_closed_event_loop_errors()
    app.run(main, flags_parser=parse)
