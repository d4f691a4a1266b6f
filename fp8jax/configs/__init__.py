"""The run configs that ship with fp8jax: ``base`` (every field and its default) and presets.

``base`` declares each field once with the kinds of ``fields``. Each preset is an
ml_collections config file whose ``get_config()`` starts from ``base.get_config()`` and
overrides what differs; its docstring's first line is its command.
A checkout's ``configs/`` is this folder, so ``--config configs/tiny.py`` and ``--config tiny``
name the same file; ``load`` takes either a name or a path.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib

import ml_collections

__all__ = ["CONFIG_DIR", "NOT_CONFIGS", "load", "names", "path"]

CONFIG_DIR = pathlib.Path(__file__).resolve().parent  # the shipped config files
NOT_CONFIGS = ("__init__", "fields")  # the modules here that are not config files


def names() -> list[str]:
    """The shipped configs' names ('base' and the presets), sorted."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.py") if p.stem not in NOT_CONFIGS)


def path(name: str | os.PathLike) -> pathlib.Path:
    """The file of a config: a shipped config's name ('tiny') or a path to a ``.py`` file."""
    if pathlib.Path(name).suffix == ".py":
        return pathlib.Path(name)
    if str(name) not in names():
        raise FileNotFoundError(
            f"no config named {str(name)!r}: use one of {names()} or a path to a .py config file"
        )
    return CONFIG_DIR / f"{name}.py"


def load(name: str | os.PathLike, arg: str | None = None) -> ml_collections.ConfigDict:
    """``get_config(arg)`` of a config file, given its path or a shipped config's name."""
    file = path(name)
    if not file.is_file():
        raise FileNotFoundError(f"no config file {file}: pass a path or one of {names()}")
    # Loaded by path, as ml_collections' --config flag does.
    module_spec = importlib.util.spec_from_file_location(f"fp8jax_config_{file.stem}", file)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config() if arg is None else module.get_config(arg)
