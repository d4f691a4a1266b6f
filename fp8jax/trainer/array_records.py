"""ArrayRecord token shards (``.array_record`` files in ``data.format='tokens'``), read through
grain's ``ArrayRecordDataSource``.

Each record is one document's token ids as a ``.npy`` array (1-D, an integer dtype, the same in
every record of a file), its last id the tokenizer's EOS, as :func:`write` stores them. A file
reads as the stream of its records' ids in record order (:class:`RecordIds`): the training
stream and the validation split treat it as any other shard, a window that spans records reads
each of them, and nothing is copied. The first open of a file reads every record once, for
their lengths, and keeps them beside it in ``.<file name>.lengths.npz`` (:func:`lengths_path`;
next to the data, never in a work dir, which bad input leaves unchanged), keyed by the file's
size and mtime: later opens read no record. A stale or unreadable one is rebuilt; where the
folder is read-only the lengths are measured at every open and nothing is written.
Needs the ``array_record`` package (``pip install 'fp8jax[arrayrecord]'``).
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import tempfile
import zipfile
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from absl import logging

from fp8jax.errors import DataError
from fp8jax.trainer import token_shards

__all__ = ["SUFFIX", "RecordIds", "lengths_path", "read", "write"]

SUFFIX = ".array_record"
_BATCH = 4096  # records read at a time while measuring a file
_CACHED = 64  # records kept decoded (a window reads one or a few)


def _source(path: Path):
    try:
        import grain
    except ImportError:  # grain ships ArrayRecord support where array_record installs
        raise DataError(
            f"reading {path} needs grain's ArrayRecord support: pip install 'fp8jax[arrayrecord]'"
        ) from None
    try:
        return grain.sources.ArrayRecordDataSource([str(path)])
    except (ImportError, AttributeError):
        raise DataError(
            f"reading {path} needs the array_record package: pip install 'fp8jax[arrayrecord]'"
        ) from None
    except (RuntimeError, ValueError, OSError) as e:  # array_record's reader on a bad file
        raise DataError(
            f"{path} is not a readable ArrayRecord file ({e}): rewrite it or remove it from "
            "the data folder"
        ) from None


def _decode(path: Path, k: int, record: bytes) -> np.ndarray:
    try:
        ids = np.load(io.BytesIO(record), allow_pickle=False)
    except (ValueError, OSError, EOFError):
        ids = None
    if not isinstance(ids, np.ndarray) or ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise DataError(
            f"{path}: record {k} is not a 1-D integer .npy array of token ids; write the "
            "file with fp8jax.trainer.array_records.write (one document's ids per record)"
        )
    return ids


def lengths_path(path: Path) -> Path:
    """The file beside the ArrayRecord file ``path`` that keeps its records' lengths."""
    return path.with_name(f".{path.name}.lengths.npz")


def _stat_key(path: Path) -> np.ndarray:
    stat = path.stat()
    return np.asarray([stat.st_size, stat.st_mtime_ns], np.int64)


def _kept_lengths(path: Path, key: np.ndarray, count: int) -> tuple[np.ndarray, np.dtype] | None:
    """``(lengths, dtype)`` kept beside ``path`` for the file as ``key`` describes it, or None
    where there are none, they describe another version of the file, or do not read."""
    try:
        with np.load(lengths_path(path), allow_pickle=False) as kept:
            lengths, dtype = kept["lengths"], np.dtype(str(kept["dtype"]))
            fresh = np.array_equal(kept["key"], key)
    except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile):
        return None
    if (
        not fresh
        or lengths.shape != (count,)
        or lengths.dtype != np.int64
        or dtype.kind not in "iu"
    ):
        return None
    return lengths, dtype


def _keep_lengths(path: Path, key: np.ndarray, lengths: np.ndarray, dtype: np.dtype) -> None:
    """Write ``lengths`` and ``dtype`` beside ``path`` (a temporary file renamed into place);
    nothing where the folder is not writable."""
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            np.savez(f, key=key, lengths=lengths, dtype=np.asarray(dtype.str))
        os.replace(tmp, lengths_path(path))
    except OSError as e:  # a read-only or full folder: the next open measures again
        logging.info("not keeping the record lengths of %s beside it (%s)", path, e)
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.remove(tmp)


class RecordIds:
    """The ids of an ArrayRecord file's records, read as one stream (``len``, ``dtype``,
    contiguous slices as numpy arrays)."""

    def __init__(self, path: Path):
        self.path, self.source = path, _source(path)
        key = _stat_key(path)  # before the records are read: a file changed meanwhile is stale
        kept = _kept_lengths(path, key, len(self.source))
        if kept is None:
            kept = self._measure()
            _keep_lengths(path, key, *kept)
        lengths, self.dtype = kept
        self.starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        self.record = functools.lru_cache(maxsize=_CACHED)(self._record)

    def _measure(self) -> tuple[np.ndarray, np.dtype]:
        """Every record's length and the records' one dtype, each record read once."""
        lengths, dtypes = [], set()
        for start in range(0, len(self.source), _BATCH):
            keys = range(start, min(start + _BATCH, len(self.source)))
            for k, record in zip(keys, self.source.__getitems__(list(keys)), strict=True):
                ids = _decode(self.path, k, record)
                lengths.append(len(ids))
                dtypes.add(ids.dtype.newbyteorder("="))
        if len(dtypes) > 1:
            raise DataError(
                f"{self.path} mixes id dtypes {sorted(map(str, dtypes))} across records: "
                "rewrite it with one dtype"
            )
        dtype = dtypes.pop() if dtypes else np.dtype(np.uint32)
        return np.asarray(lengths, np.int64), dtype

    def _record(self, k: int) -> np.ndarray:
        return _decode(self.path, k, self.source[k]).astype(self.dtype, copy=False)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index: slice) -> np.ndarray:
        start, stop, step = index.indices(len(self))
        if step != 1:
            raise IndexError("token streams are read in contiguous slices")
        out = []
        k = int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < stop:
            offset = start - int(self.starts[k])
            take = min(stop - start, int(self.starts[k + 1]) - start)
            out.append(self.record(k)[offset : offset + take])
            start, k = start + take, k + 1
        return np.concatenate(out) if out else np.zeros(0, self.dtype)


@token_shards.register_reader(SUFFIX)
def read(path: Path) -> RecordIds:
    """The ids of the ArrayRecord file ``path``; a one-line DataError when a record is not
    a 1-D integer ``.npy`` array, or the records' dtypes differ. Opened once while its size
    and mtime stay (the format's check and its split both read it); its record lengths are
    kept beside it (:func:`lengths_path`) for the next process."""
    stat = path.stat()
    return _opened(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=_CACHED)
def _opened(path: Path, size: int, mtime_ns: int) -> RecordIds:
    del size, mtime_ns  # part of the cache key only
    return RecordIds(path)


def write(path: str | os.PathLike, documents: Iterable[np.ndarray]) -> None:
    """Write ``documents`` (1-D integer id arrays, each ending with its EOS) as the records
    of the ArrayRecord file ``path``."""
    from array_record.python.array_record_module import ArrayRecordWriter

    writer = ArrayRecordWriter(str(path), "group_size:1")
    try:
        for ids in documents:
            buffer = io.BytesIO()
            np.save(buffer, np.ascontiguousarray(ids), allow_pickle=False)
            writer.write(buffer.getvalue())
    finally:
        writer.close()
