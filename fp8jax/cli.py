"""What the command lines (train.py, ``python -m fp8jax.diagnostics.inspect``) set up for the
process they own, and the library leaves alone."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

__all__ = [
    "drop_closed_event_loop_errors",
    "fail",
    "parse_config_flags",
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
    """False for asyncio's report of an orbax task's or future's exception that nothing
    retrieved: a task names its orbax coroutine in the message, a gathered future's exception
    was raised inside orbax (a failed save's sibling writes gather one)."""
    text = str(record.msg)
    if "exception was never retrieved" not in text.partition("\n")[0]:
        return True
    orbax = f"{os.sep}orbax{os.sep}"
    tb = record.exc_info[2] if record.exc_info else None
    files = [frame.f_code.co_filename for frame, _ in traceback.walk_tb(tb)]
    return not (orbax in text or any(orbax in f for f in files))


def _shipped_config_paths(argv: list[str]) -> list[str]:
    """``argv`` with ``--config NAME[:arg]`` of a shipped config replaced by its file's path."""
    from fp8jax import configs

    def resolve(value: str) -> str:
        name, sep, arg = value.partition(":")
        return f"{configs.CONFIG_DIR / name}.py{sep}{arg}" if name in configs.names() else value

    out = list(argv)
    for i, a in enumerate(out):
        if a in ("--config", "-config") and i + 1 < len(out):
            out[i + 1] = resolve(out[i + 1])
        elif a.startswith(("--config=", "-config=")):
            flag, _, value = a.partition("=")
            out[i] = f"{flag}={resolve(value)}"
    return out


def parse_config_flags(argv: list[str], config, program: str) -> list[str]:
    """absl's parsing of a command line whose ``--config`` flag is ``config`` (an
    ml_collections config flag): a shipped config's name stands for its file; a bad flag,
    config file or config key is one line naming ``program``'s help, exit 2 (FP8JAX_DEBUG=1:
    the traceback)."""
    from absl import flags

    from fp8jax import configs
    from fp8jax.errors import describe_flag_error

    argv = _shipped_config_paths(argv)
    try:
        args = flags.FLAGS(argv)
        config.value.keys()  # ml_collections defers config-file errors to the first field read
        return args
    except Exception as e:  # absl, ml_collections and the config file itself raise many kinds
        if os.environ.get("FP8JAX_DEBUG"):
            raise
        loaded = flags.FLAGS[config.name].value  # what parsed of it (the holder refuses)
        fail(describe_flag_error(e, argv, loaded, tuple(configs.names()), program))


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
