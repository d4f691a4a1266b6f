"""Errors the command line reports as one line: bad config, data, checkpoint, non-finite run.

Only ``UserError`` subclasses are reported as one line; anything else is a bug and keeps its
traceback. ``reraise_as`` turns the ValueError/TypeError that validation code raises (with a
message naming the fix) into one of these, for the phases where the input is to blame.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import os
import re

from absl import flags

__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointSaveError",
    "ConfigError",
    "DataError",
    "NonFiniteLossError",
    "NonFiniteOutputError",
    "USER_ERRORS",
    "UserError",
    "check_bool",
    "check_choice",
    "check_int",
    "check_number",
    "describe_flag_error",
    "field_name",
    "folder_failure",
    "one_line",
    "output_beside",
    "reraise_as",
]


class UserError(Exception):
    """A problem with the run's inputs or its numerics, fixable by the user; one line."""

    def __init__(self, message: str):
        super().__init__(one_line(message))


class ConfigError(UserError, ValueError):
    """The config is invalid or inconsistent (fields, shapes, mesh vs devices)."""


class DataError(UserError, ValueError):
    """The corpus is missing, empty or too small for the config."""


class CheckpointMismatchError(UserError, ValueError):
    """The checkpoint in the work dir does not fit this config's model (or is corrupt)."""


class CheckpointError(UserError, ValueError):
    """A checkpoint to import or export (Hugging Face or work dir) is unsupported or malformed."""


class CheckpointSaveError(UserError, OSError):
    """A checkpoint could not be written (disk full, no permission): the run stops there."""


class NonFiniteLossError(UserError, RuntimeError):
    """Raised after ``max_bad_steps`` consecutive non-finite steps."""


class NonFiniteOutputError(UserError, RuntimeError):
    """A model's output (generation logits, evaluation loss) holds NaN/Inf: bad weights."""


# What train.py prints as one line (FP8JAX_DEBUG=1 shows the traceback instead).
USER_ERRORS = (UserError,)


def folder_failure(path, e: OSError) -> str:
    """Why the folder ``path`` could not be made (``e``): a file holds its name, else the
    system's reason (a read-only mount, another user's folder)."""
    return "a file, not a folder" if os.path.isfile(path) else str(e.strerror or e)


def output_beside(out, e: OSError) -> str:
    """The one line for an output whose staging folder beside ``out`` could not be made."""
    return (
        f"cannot create a folder beside {out} ({e.strerror or e}); pass an output folder in a "
        f"folder you can write to"
    )


def one_line(text) -> str:
    """``text`` with its lines and runs of blanks joined by single spaces."""
    return " ".join(str(text).split())


@contextlib.contextmanager
def reraise_as(cls: type[UserError], *types: type[Exception]):
    """Turn ``types`` (default ValueError, TypeError, OSError) raised inside into ``cls``."""
    types = types or (ValueError, TypeError, OSError)
    try:
        yield
    except UserError:
        raise
    except types as e:
        raise cls(str(e) or type(e).__name__) from e


def check_choice(value, choices, field: str) -> None:
    """Raise a one-line ConfigError unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ConfigError(f"unknown {field} {value!r}: use one of {list(choices)}")


def check_int(value, field: str, low: int, high: int | None = None, also=()) -> None:
    """Raise a one-line ConfigError unless ``value`` is an int in [low, high] or in ``also``.

    ``field`` names a config field ('seq_len': ``config.seq_len``) or a flag ('--seq_len').
    """
    is_int = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if is_int and (value in also or (value >= low and (high is None or value <= high))):
        return
    span = f">= {low}" if high is None else f"in [{low}, {high}]"
    extra = "".join(f" (or {a})" for a in also)
    name = field if field.startswith("-") else f"config.{field}"
    raise ConfigError(f"{name}={value!r}: use an integer {span}{extra}")


def check_number(value, field: str, interval: str) -> None:
    """Raise a one-line ConfigError unless ``value`` is a finite number in ``interval``.

    ``interval`` reads as in mathematics: '(0, inf)', '[0, 1)', '[1, inf)' ...
    """
    lo, hi = (float(x) for x in interval[1:-1].split(","))
    is_real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if is_real and math.isfinite(value):
        above = value > lo if interval[0] == "(" else value >= lo
        below = value < hi if interval[-1] == ")" else value <= hi
        if above and below:
            return
    op = ">" if interval[0] == "(" else ">="
    span = f"{op} {interval[1:-1].split(',')[0]}" if math.isinf(hi) else f"in {interval}"
    raise ConfigError(f"config.{field}={value!r}: use a finite number {span}")


def check_bool(value, field: str) -> None:
    """Raise a one-line ConfigError unless ``value`` is True or False."""
    if not isinstance(value, bool):
        raise ConfigError(f"config.{field}={value!r}: use True or False")


_FIELDS = "fp8jax/configs/base.py lists every field with its type"


def describe_flag_error(
    error: Exception,
    argv: list[str],
    config=None,
    shipped: tuple[str, ...] = (),
    program: str = "python train.py",
) -> str:
    """One line for a bad command line: the flag, what is wrong and how to fix it.

    ``shipped``: the names ``--config`` also takes (the configs that ship with fp8jax);
    ``program``: the command whose ``--helpshort`` the line points to.
    """
    text = one_line(error)
    if isinstance(error, (KeyError, AttributeError)):  # ml_collections: no such config field
        key = field_name(error)
        hint = re.search(r'Did you mean "([^"]+)"', text)
        hint = f" (did you mean {hint.group(1)!r}?)" if hint else ""
        flag = next((a.split("=")[0] for a in argv[1:] if _names_key(a, key)), "--config.*")
        return f"unknown config key {key!r} in {flag}{hint}; {_FIELDS}"
    if isinstance(error, OSError) and "config file" in text:  # ml_collections: --config failed
        reason = str(error).strip().splitlines()[-1].strip()
        names = f" or the name of a shipped config ({', '.join(shipped)})" if shipped else ""
        return f"cannot load the --config file: {reason}; pass --config=<file.py>{names}"
    match = re.match(r"flag (--config\.([\w.]+))=", text)
    if match:  # a value that does not parse as the field's type
        try:
            kind = f"a value of type {type(_get(config, match.group(2))).__name__}"
        except Exception:  # config not loaded: name no type
            kind = "a value of the field's type"
        return f"{text}; {match.group(1)} takes {kind} ({_FIELDS})"
    if "Traceback (most recent call last)" in str(error):  # the config file raised, absl says
        reason = str(error).strip().splitlines()[-1].strip()
        return f"the --config file raised {reason}; FP8JAX_DEBUG=1 shows the traceback"
    if isinstance(error, flags.Error):
        return f"{text.rstrip('.')}; see {program} --helpshort"
    # Anything else came from running the config file itself.
    name = type(error).__name__
    return f"the --config file raised {name}: {text}; FP8JAX_DEBUG=1 shows the traceback"


def field_name(error: Exception) -> str:
    """The config field an ml_collections KeyError/AttributeError names ('foo' of "'foo'")."""
    match = re.search(r"'([^'\\]+)", str(error))
    return match.group(1) if match else one_line(error)


def _names_key(arg: str, key: str) -> bool:
    return arg.startswith("--config.") and key in arg.split("=")[0].split(".")


def _get(config, dotted: str):
    for part in dotted.split("."):
        config = config[part]
    return config
