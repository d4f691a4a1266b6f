"""Config field declarations: a field's default with its valid values, checked in one place.

``fp8jax/configs/base.py`` declares every config field once, as ``section.name = Kind(default,
range)  # meaning, unit``. ``defaults`` turns those declarations into the plain ConfigDict that
config files override; ``validate`` checks a config's value of each declared field against its
declaration, raising the one-line ``fp8jax.errors.ConfigError`` that names the field and the fix.
A ``Field`` declares a default only: what it configures validates it (the scaling recipes'
fields: the recipes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import ml_collections

from fp8jax.errors import ConfigError, check_bool, check_choice, check_int, check_number

__all__ = ["Bool", "Choice", "Field", "Int", "Real", "Text", "declared", "defaults", "validate"]


@dataclasses.dataclass(frozen=True)
class Field:
    """A field with a default; what it configures checks its values."""

    default: Any

    def check(self, value: Any, name: str) -> None:
        """Raise a one-line ConfigError naming ``name`` unless ``value`` is valid (here: any)."""
        del value, name


@dataclasses.dataclass(frozen=True)
class Int(Field):
    """An integer in [low, high] (no upper bound if ``high`` is None), or one of ``also``."""

    low: int = 0
    high: int | None = None
    also: tuple[int, ...] = ()

    def check(self, value: Any, name: str) -> None:
        """Raise a one-line ConfigError unless ``value`` is such an integer (not a bool)."""
        check_int(value, name, self.low, self.high, also=self.also)


@dataclasses.dataclass(frozen=True)
class Real(Field):
    """A finite number in ``interval``, written as in mathematics: '(0, inf)', '[0, 1)'."""

    interval: str = "(-inf, inf)"

    def check(self, value: Any, name: str) -> None:
        """Raise a one-line ConfigError unless ``value`` is a finite number in the interval."""
        check_number(value, name, self.interval)


@dataclasses.dataclass(frozen=True)
class Bool(Field):
    """True or False."""

    def check(self, value: Any, name: str) -> None:
        """Raise a one-line ConfigError unless ``value`` is True or False."""
        check_bool(value, name)


@dataclasses.dataclass(frozen=True)
class Choice(Field):
    """One of ``choices`` (also accepted: ``also``, spellings of a choice such as None)."""

    choices: tuple[Any, ...] = ()
    also: tuple[Any, ...] = ()
    fix: str = ""  # the error's fix, in place of listing the choices

    def check(self, value: Any, name: str) -> None:
        """Raise a one-line ConfigError unless ``value`` is one of the choices."""
        if value in self.also:
            return
        if self.fix and value not in self.choices:
            raise ConfigError(f"config.{name}={value!r}: {self.fix}")
        check_choice(value, tuple(self.choices), name)


@dataclasses.dataclass(frozen=True)
class Text(Field):
    """A string (a path, or '' for the field's documented absence)."""

    fix: str = "use a string"

    def check(self, value: Any, name: str) -> None:
        """Raise a one-line ConfigError with the fix unless ``value`` is a string."""
        if not isinstance(value, str):
            raise ConfigError(f"config.{name}={value!r}: {self.fix}")


def _walk(section: ml_collections.ConfigDict, prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in section.items():
        if isinstance(value, ml_collections.ConfigDict):
            yield from _walk(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def declared(declarations: ml_collections.ConfigDict) -> dict[str, Field]:
    """Dotted field name -> its declaration, in declaration order."""
    out = dict(_walk(declarations))
    bad = [name for name, decl in out.items() if not isinstance(decl, Field)]
    if bad:
        raise TypeError(f"config fields {bad} are not declared as fp8jax.configs.fields kinds")
    return out


def defaults(declarations: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The ConfigDict of every declared field at its default (what config files override)."""
    out = ml_collections.ConfigDict()
    for key, value in declarations.items():
        out[key] = (
            defaults(value) if isinstance(value, ml_collections.ConfigDict) else value.default
        )
    return out


def validate(config: ml_collections.ConfigDict, declarations: ml_collections.ConfigDict) -> None:
    """Check each declared field's value in ``config``: a one-line ConfigError for a bad one.

    A missing field raises ml_collections' KeyError/AttributeError naming it.
    """
    for name, decl in declared(declarations).items():
        value = config
        for part in name.split("."):
            value = value[part]
        decl.check(value, name)
