"""ArrayRecord token shards (``.array_record`` files in ``data.format='tokens'``), read through
grain's ``ArrayRecordDataSource``.

Each record is one document's token ids as a ``.npy`` array (1-D, an integer dtype, the same in
every record of a file), its last id the tokenizer's EOS, as :func:`write` stores them. A file
reads as the stream of its records' ids in record order (:class:`RecordIds`): the training
stream and the validation split treat it as any other shard, a window that spans records reads
each of them, and nothing is copied. Opening a file reads every record once, for their lengths.
Needs the ``array_record`` package (``pip install 'fp8jax[arrayrecord]'``).
"""

from __future__ import annotations

import functools
import io
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from fp8jax.errors import DataError
from fp8jax.trainer import token_shards

__all__ = ["SUFFIX", "RecordIds", "read", "write"]

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


class RecordIds:
    """The ids of an ArrayRecord file's records, read as one stream (``len``, ``dtype``,
    contiguous slices as numpy arrays)."""

    def __init__(self, path: Path):
        self.path, self.source = path, _source(path)
        lengths, dtypes = [], set()
        for start in range(0, len(self.source), _BATCH):
            keys = range(start, min(start + _BATCH, len(self.source)))
            for k, record in zip(keys, self.source.__getitems__(list(keys)), strict=True):
                ids = _decode(path, k, record)
                lengths.append(len(ids))
                dtypes.add(ids.dtype.newbyteorder("="))
        if len(dtypes) > 1:
            raise DataError(
                f"{path} mixes id dtypes {sorted(map(str, dtypes))} across records: rewrite it "
                "with one dtype"
            )
        self.dtype = dtypes.pop() if dtypes else np.dtype(np.uint32)
        self.starts = np.cumsum([0, *lengths])
        self.record = functools.lru_cache(maxsize=_CACHED)(self._record)

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
    and mtime stay (the format's check and its split both read it)."""
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
