"""What a work dir's data caches were built from, and when a run may reuse or rebuild them.

``<workdir>/data.json`` records the data a run trains on: the corpus (SHA-256 of its bytes),
its description and ``data.val_fraction``. Without a checkpoint every cache is simply rebuilt
when it was built from something else. Once the work dir holds a checkpoint its weights depend
on that data and its embeddings on the tokenizer's ids: a change of corpus or validation split
is refused unless ``config.data.allow_corpus_change``, and the tokenizer is never replaced.

A work dir's run also manages some of its folders as a whole (``MANAGED``): no other work dir,
export or prepared shards may go inside one (``check_outside_managed``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
from absl import logging

from fp8jax import tokenizer as tokenizer_lib
from fp8jax.errors import ConfigError, DataError
from fp8jax.ops import scaling
from fp8jax.tokenizer import Tokenizer

__all__ = [
    "MANAGED",
    "MANIFEST",
    "MODEL_RECORD",
    "check_new_output",
    "check_outside_managed",
    "check_resume",
    "has_checkpoint",
    "read_json",
    "record_model",
    "tokenizer_for",
    "write_json",
]

MANIFEST = "data.json"
# The model a work dir's checkpoints hold (ModelConfig fields as JSON), for import/export.
MODEL_RECORD = "model.json"
# A work dir's folders that its run replaces or deletes as a whole: orbax's steps, the token
# cache (rebuilt when the corpus or the tokenizer changes), TensorBoard's event files.
MANAGED = ("checkpoints", "tokens", "tensorboard")
# Tokenizer settings a user chose, by config field: a checkpoint's tokenizer keeps them.
_SETTINGS = {"vocab_size": "model.vocab_size", "min_frequency": "data.tokenizer_min_frequency"}


def has_checkpoint(workdir: str | os.PathLike) -> bool:
    """Whether ``workdir`` holds a finished checkpoint (``checkpoints/<step>`` of Checkpointer).

    Orbax writes a step into ``<step>.orbax-checkpoint-tmp-*`` and renames it to ``<step>`` when
    complete, so only all-digit folder names count. Read from the file system: no orbax import.
    """
    folder = Path(workdir) / "checkpoints"
    return folder.is_dir() and any(p.name.isdigit() and p.is_dir() for p in folder.iterdir())


def check_outside_managed(path: str | os.PathLike, name: str) -> None:
    """A one-line ConfigError if ``path`` (given as ``name``, e.g. '--workdir') lies inside a
    ``MANAGED`` folder of a work dir (one holding ``MODEL_RECORD``), whose run would overwrite
    or delete it with its own files."""
    folder = os.path.abspath(os.path.expanduser(path))
    while (parent := os.path.dirname(folder)) != folder:
        managed = os.path.basename(folder)
        if managed in MANAGED and os.path.isfile(os.path.join(parent, MODEL_RECORD)):
            raise ConfigError(
                f"{name} {path} is inside {folder}, the {managed}/ folder that the run in "
                f"{parent} manages (and may replace or delete); pass a folder outside it"
            )
        folder = parent


def check_new_output(
    path: str | os.PathLike, name: str, error: type[Exception] = ConfigError
) -> None:
    """A one-line ``error`` unless ``path`` (given as ``name``, e.g. '--out') can be a command's
    new output folder: outside every work dir's ``MANAGED`` folders, new or empty, its parent
    an existing folder (the output is written beside it, then renamed into place)."""
    check_outside_managed(path, name)
    target = Path(path).expanduser()
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise error(f"{name} {path} exists and is not empty: name a new or empty folder")
    if not target.parent.is_dir():
        raise error(f"{name} {path}: its parent folder does not exist; create it first")


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``, or None if it is missing or unreadable."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def write_json(path: Path, value: dict[str, Any]) -> None:
    """Write ``value`` to ``path`` atomically (a temp file, then os.replace)."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(value, indent=1, sort_keys=True))
    os.replace(tmp, path)


def record_model(workdir: str | os.PathLike, model_cfg) -> None:
    """Write ``<workdir>/model.json``: the ``ModelConfig``'s fields as JSON (dtypes by name,
    ``rope_scaling`` and the FP8 recipe as dicts, the recipe's with its ``name``), rewritten only
    when they change. Inference reads the recipe back: fine-grained scales store no scale."""
    value = {}
    for field in dataclasses.fields(model_cfg):
        x = getattr(model_cfg, field.name)
        if dataclasses.is_dataclass(x) and field.name in ("rope_scaling", "moe"):
            x = dataclasses.asdict(x)
        elif field.name == "recipe":
            x = None if x is None else {"name": scaling.recipe_name(x), **dataclasses.asdict(x)}
        elif field.name in ("dtype", "param_dtype"):
            x = np.dtype(x).name
        elif not isinstance(x, (str, int, float, bool, type(None))):
            continue
        value[field.name] = x
    path = Path(workdir) / MODEL_RECORD
    if read_json(path) != value:
        write_json(path, value)


def _changes(recorded: dict[str, Any], identity: dict[str, Any]) -> list[str]:
    """How ``identity`` (corpus, source, val_fraction) differs from the recorded data."""
    changes = []
    old, new = str(recorded.get("corpus", "")), identity["corpus"]
    if old != new:
        if recorded.get("source") == identity["source"]:
            changes.append(
                f"the contents of {identity['source']} changed (sha256 {old[:12]} -> {new[:12]})"
            )
        else:
            changes.append(f"config.data.path now names {identity['source']} (sha256 {new[:12]})")
    if recorded.get("val_fraction") != identity["val_fraction"]:
        changes.append(
            f"config.data.val_fraction changed from {recorded.get('val_fraction')} to "
            f"{identity['val_fraction']}"
        )
    return changes


def check_resume(workdir: Path, identity: dict[str, Any], resumed: bool, allow: bool) -> bool:
    """Refuse a resume on other data than the checkpoint's (unless ``allow``); True: record it.

    ``identity`` is ``dict(corpus=sha256, source=description, val_fraction=float)``. Raises
    :class:`DataError` naming the old and new data and the fix; reads, never writes.
    """
    recorded = read_json(workdir / MANIFEST)
    if not resumed or recorded == identity:
        return recorded != identity
    if recorded is None:
        logging.warning(
            "no record (%s) of the data the checkpoint in %s was trained on; recording %s",
            MANIFEST,
            workdir,
            identity["source"],
        )
        return True
    changes = _changes(recorded, identity)
    if not changes:  # same bytes under another name: only the description changes
        return True
    if not allow:
        raise DataError(
            f"{workdir / 'checkpoints'} holds a checkpoint trained on {recorded.get('source')} "
            f"(sha256 {str(recorded.get('corpus'))[:12]}, data.val_fraction="
            f"{recorded.get('val_fraction')}), but {'; '.join(changes)}: resuming would change "
            "the token stream and the validation split under the run. Restore that data, start "
            "a fresh --workdir, or pass --config.data.allow_corpus_change=True to continue on "
            "the new data with the checkpoint's tokenizer"
        )
    logging.warning(
        "data.allow_corpus_change: %s; the token cache and validation split are rebuilt for %s, "
        "and the tokenizer stays the one the checkpoint was trained with (its ids are in the "
        "embeddings)",
        "; ".join(changes),
        identity["source"],
    )
    return True


def tokenizer_for(
    path: Path, built_from: dict[str, Any], texts: Callable[[], Iterable[str]], resumed: bool
) -> tuple[Tokenizer, bool]:
    """The tokenizer for a build and whether it is new (saved only once the build succeeds).

    The cached one is reused when its record equals ``built_from`` (corpus, settings, format
    version); otherwise it is retrained from ``texts()``, unless ``resumed``: then the
    checkpoint's tokenizer is kept, or the run refused if the user's settings changed.
    """
    fresh = "or start a fresh --workdir"
    try:
        cached, recorded = tokenizer_lib.load_cached(path)
    except (OSError, ValueError) as e:  # not UTF-8 text, not a file
        if resumed:
            raise DataError(f"{path} is unreadable ({e}); restore it {fresh}") from None
        cached, recorded = None, None  # a cache without a checkpoint: rebuilt
    if cached is not None and recorded == built_from:
        logging.info("reusing tokenizer %s (vocab %d)", path, built_from["vocab_size"])
        return tokenizer_lib.from_str(cached), False
    vocab_size = built_from["vocab_size"]
    if not resumed:
        if cached is not None:
            differ = sorted(k for k in built_from if (recorded or {}).get(k) != built_from[k])
            logging.warning("tokenizer %s was built from other %s; retraining it", path, differ)
        logging.info("training byte-level BPE tokenizer (vocab %d) -> %s", vocab_size, path)
        return tokenizer_lib.train(texts(), vocab_size, built_from["min_frequency"]), True
    ckpt = path.parent / "checkpoints"
    if cached is None:
        raise DataError(
            f"{ckpt} holds a checkpoint but {path} is missing; restore the tokenizer the "
            f"checkpoint was trained with (its ids are in the embeddings) {fresh}"
        )
    try:
        tok = tokenizer_lib.from_str(cached)
    except Exception as e:  # tokenizers raises its own exception types for bad JSON
        raise DataError(f"{path} is unreadable ({e}); restore it {fresh}") from e
    if tok.vocab_size != vocab_size:
        raise DataError(
            f"cached tokenizer {path} has vocab_size {tok.vocab_size} but the config asks for "
            f"{vocab_size}; the checkpoint in {ckpt} was trained with it: set "
            f"config.model.vocab_size={tok.vocab_size} {fresh}"
        )
    if recorded is None:
        logging.warning(
            "no record of what built tokenizer %s; keeping it: the checkpoint in %s was trained "
            "with it",
            path,
            ckpt,
        )
        return tok, False
    changed = [k for k in _SETTINGS if recorded.get(k) != built_from[k]]
    if changed:
        was = ", ".join(f"{_SETTINGS[k]}={recorded.get(k)}" for k in changed)
        now = ", ".join(f"{_SETTINGS[k]}={built_from[k]}" for k in changed)
        raise DataError(
            f"tokenizer {path} was learned with {was} but the config asks for {now}; the "
            f"checkpoint in {ckpt} uses its ids: set {was} {fresh}"
        )
    differ = sorted(k for k in built_from if recorded.get(k) != built_from[k])
    logging.warning(
        "keeping tokenizer %s although it was built from other %s: the checkpoint in %s was "
        "trained with its ids",
        path,
        differ,
        ckpt,
    )
    return tok, False
