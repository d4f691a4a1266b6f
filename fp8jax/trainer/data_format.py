"""The build every data format shares, and the registry of data formats by name.

A data format (:class:`DataFormat`: text corpus, fine-tuning examples, preference pairs) says
what its source is, how it encodes and splits it, and what its batches hold; :func:`build`
runs every format through the same steps, in one order:

1. the source (:meth:`DataFormat.source`): its files or records, their fingerprint and a
   description; a bad ``config.data.path`` is a ``DataError`` (:func:`corpus.source_files`);
2. the resume check: a run resumed from a checkpoint must read the data it was trained on
   (``provenance.check_resume``);
3. the tokenizer: the given one (an ``init_from`` checkpoint's), else a byte-level BPE learned
   on the source's texts, reused while its record (the format's ``tokenizer_fields``, the
   corpus, vocab size and minimum frequency) matches;
4. the format's encoding, train/validation split and checks (:meth:`DataFormat.encode`), which
   stages any cache it writes;
5. only then the writes to the work dir: the work dir itself, the tokenizer, the format's
   caches (:meth:`Encoded.commit`), the data record.

So a bad source or data that does not fit the run raises before anything in the work dir
changes. Cache keys are :func:`cache_key` of what shaped the cached data. A format registers
itself by name (:func:`register`); ``fp8jax.trainer.formats`` imports the built-in ones and
picks a run's by ``config.data.format``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import gzip
import hashlib
import json
import os
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from fp8jax import provenance
from fp8jax import tokenizer as tokenizer_lib
from fp8jax.errors import DataError
from fp8jax.trainer import corpus as corpus_lib
from fp8jax.trainer.stream import seed32

if TYPE_CHECKING:
    from fp8jax.spec import RunSpec

TOKENIZER_FILE = "tokenizer.json"  # the learned BPE in the work dir
JSONL = (".jsonl", ".jsonl.gz")  # the files of the .jsonl formats
Record = tuple[dict, str]  # a parsed .jsonl line and where it is ('file:line')

_REGISTRY: dict[str, DataFormat] = {}


@dataclasses.dataclass(frozen=True)
class Source:
    """What a data format reads: its files or records, their fingerprint and description."""

    desc: str  # for logs, messages and the data record
    corpus: str  # fingerprint of the content (the data record's identity)
    content: Any  # the format's own: files (text) or (record, where) pairs (.jsonl formats)


class Encoded:
    """A format's encoded data: the dataset, and any cache it staged for the work dir."""

    def __init__(self, dataset):
        self.dataset = dataset

    def commit(self, workdir: Path) -> None:
        """Move the staged caches into ``workdir`` (none by default)."""
        del workdir

    def discard(self) -> None:
        """Remove whatever is still staged (after commit, or when the build failed)."""


class DataFormat:
    """A data format: its source, encoding, split and batch keys (subclass and register)."""

    name: ClassVar[str]  # config.data.format
    objective: ClassVar[str] = "lm"  # the objective its batches train (fp8jax.trainer.objectives)
    dtypes: ClassVar[dict[str, Any]]  # batch key -> dtype of a training batch's array
    tokenizer_fields: ClassVar[dict]  # what else built a BPE learned on it: format, version
    # What config.data.path may name for it, as a message's fix ('' = it reads no path)
    path_fix: ClassVar[str] = ""

    def source(self, run: RunSpec) -> Source:
        """The source ``run.data`` names; DataError if it is missing, malformed or empty."""
        raise NotImplementedError

    def texts(self, source: Source) -> Iterable[str]:
        """Every text of the source (what a learned BPE is trained on)."""
        raise NotImplementedError

    def encode(self, run: RunSpec, source: Source, tokenizer, workdir: Path) -> Encoded:
        """The encoded, split data; DataError if it does not fit the run. Writes nothing in
        ``workdir`` but staged caches, which ``Encoded.commit`` moves in place."""
        raise NotImplementedError


def register(cls: type[DataFormat]) -> type[DataFormat]:
    """Class decorator: make the format buildable by its ``name``."""
    if cls.name in _REGISTRY:
        raise ValueError(f"data format {cls.name!r} is registered twice")
    _REGISTRY[cls.name] = cls()
    return cls


def get(name: str) -> DataFormat:
    """The data format registered as ``name``."""
    if name not in _REGISTRY:
        raise DataError(f"unknown config.data.format {name!r}: use one of {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def names() -> list[str]:
    """The registered formats' names."""
    return sorted(_REGISTRY)


def cache_key(**fields) -> str:
    """The SHA-256 of ``fields`` (what shaped a cache: format version, corpus, tokenizer...)."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)  # the errors of a full disk, of a full quota


@contextlib.contextmanager
def disk_space(
    workdir: Path,
    what: str,
    needed: Callable[[], int],
    fix: str = "pass a --workdir on a disk with room",
):
    """A full disk (or quota) while writing ``what`` into ``workdir`` (or a shared cache
    folder): a one-line DataError naming the folder, the space ``what`` needs (``needed()``
    bytes, an estimate) and ``fix``. The caller removes what it staged."""
    try:
        yield
    except OSError as e:
        if e.errno not in _NO_SPACE:
            raise
        n = needed()
        size = f"{n / 1e9:.3g} GB" if n >= 1e9 else f"{n / 1e6:.3g} MB"
        raise DataError(
            f"no space left on the device of {workdir} while writing {what}: it needs about "
            f"{size}; free that much space there or {fix}, then rerun"
        ) from e


def build(fmt: DataFormat, run: RunSpec, workdir: str | os.PathLike, tokenizer=None):
    """The dataset of ``run`` in format ``fmt`` (``tokenizer``: an init_from checkpoint's or
    ``config.data.tokenizer``; None: that one if set, else learn a BPE into
    ``<workdir>/tokenizer.json``). DataError on bad data, before anything in ``workdir``
    changes."""
    workdir, data = Path(workdir), run.data
    source = fmt.source(run)
    identity = dict(corpus=source.corpus, source=source.desc, val_fraction=float(data.val_fraction))
    resumed = provenance.has_checkpoint(workdir)
    record_data = provenance.check_resume(workdir, identity, resumed, data.allow_corpus_change)
    tok_path, new_tok, built_from = workdir / TOKENIZER_FILE, False, None
    if tokenizer is None and data.tokenizer:  # the trainer passes it; library use names it
        try:
            tokenizer = tokenizer_lib.load(data.tokenizer)
        except ValueError as e:
            raise DataError(f"config.data.tokenizer={data.tokenizer!r}: {e}") from None
    if tokenizer is None:
        built_from = dict(
            fmt.tokenizer_fields,
            corpus=source.corpus,
            vocab_size=int(run.model.vocab_size),
            min_frequency=int(data.tokenizer_min_frequency),
        )
        tokenizer, new_tok = provenance.tokenizer_for(
            tok_path, built_from, lambda: fmt.texts(source), resumed
        )
    encoded = fmt.encode(run, source, tokenizer, workdir)
    records = "the tokenizer and the data record" if new_tok else "the data record"

    def records_bytes() -> int:
        return len(tokenizer.to_str()) * new_tok + len(json.dumps(identity))

    try:
        with disk_space(workdir, records, records_bytes):
            workdir.mkdir(parents=True, exist_ok=True)  # every check passed: the work dir changes
            if new_tok:
                tokenizer_lib.save_cached(tokenizer, tok_path, built_from)
            encoded.commit(workdir)
            if record_data:
                provenance.write_json(workdir / provenance.MANIFEST, identity)
    finally:
        encoded.discard()
    return encoded.dataset


def read_records(files: list[Path], check: Callable[[Any, str], Any]) -> list[Record]:
    """``(record, 'file:line')`` of every non-blank line; a malformed line (not UTF-8, not
    JSON) or a ``.gz`` file cut short is a DataError naming it (``check(record, where)``
    raises one for a well-formed JSON line of the wrong shape)."""
    out = []
    for f in files:
        opener = gzip.open if f.name.endswith(".gz") else open
        try:
            with opener(f, "rb") as fh:
                for lineno, raw in enumerate(fh, 1):
                    where = f"{f}:{lineno}"
                    try:
                        line = raw.decode("utf-8")
                    except UnicodeDecodeError as e:
                        raise DataError(
                            f"{where}: not UTF-8 text (byte {e.start} of the line); save the "
                            "file as UTF-8"
                        ) from None
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(f"{where}: not valid JSON ({e.msg})") from e
                    check(record, where)
                    out.append((record, where))
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:
            raise DataError(
                f"{f} is not a complete gzip file ({e}); re-download or re-compress it, or "
                "remove it from config.data.path"
            ) from None
    return out


def jsonl_source(
    path: str,
    check: Callable[[Any, str], Any],
    shipped: Callable[[], tuple[list[dict], str, str]],
    noun: str,
    fix: str,
) -> Source:
    """The records of a .jsonl format: the .jsonl files ``path`` names (each line checked), or
    with ``path`` '' the records of ``shipped() -> (records, what one is, what they are)``;
    ``noun`` names them in messages ('examples', 'pairs'), ``fix`` says what ``path`` names."""
    if path:
        files, desc = corpus_lib.source_files(path, JSONL, fix)
        records, corpus = read_records(files, check), corpus_lib.fingerprint(files)
    else:
        shipped_records, one, name = shipped()
        records = [(r, f"{one} {i}") for i, r in enumerate(shipped_records, 1)]
        corpus = tokenizer_lib.sha256(json.dumps(shipped_records, sort_keys=True))
        desc = f"{name} ({len(records)} passages of the shipped corpus)"
    if not records:
        raise DataError(f"no {noun} in {desc}: add .jsonl lines or fix config.data.path")
    return Source(desc, corpus, records)


def split(n: int, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) record indices: a fixed share, spread over the file by a fixed shuffle."""
    num_val = min(int(round(n * val_fraction)), n - 1) if val_fraction > 0 else 0
    if val_fraction > 0 and n > 1:
        num_val = max(num_val, 1)
    order = np.random.default_rng(seed32("sft-split")).permutation(n)
    return np.sort(order[num_val:]), np.sort(order[:num_val])


__all__ = [
    "JSONL",
    "TOKENIZER_FILE",
    "DataFormat",
    "Encoded",
    "Record",
    "Source",
    "build",
    "cache_key",
    "disk_space",
    "get",
    "jsonl_source",
    "names",
    "read_records",
    "register",
    "split",
]
