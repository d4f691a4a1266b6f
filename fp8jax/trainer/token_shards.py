"""Pre-tokenized corpora (``data.format='tokens'``): token shards, memory-mapped as they are.

``config.data.path`` names a shard or a folder of them: ``.npy`` files (a 1-D integer array) or
``.bin`` files of :data:`MAGIC` format, each a stream of token ids whose documents end with the
tokenizer's EOS (as nanoGPT- and Megatron-style preparation writes them), or a kind of shard
another module registers a reader for (:func:`register_reader`: ``.array_record`` files,
``fp8jax.trainer.array_records``). The ids are those of
``config.data.tokenizer``, which must be given: every shard is checked to hold only its ids, in
a dtype that can hold them all, and shards that ``fp8jax.prepare`` wrote with another
tokenizer (its :data:`MANIFEST` records which) are refused. Nothing is encoded or copied: the
shards are memory-mapped and the training stream reads windows across them. The validation
split is whole shards (spread over the folder) or, with one shard, its last whole documents
(cut at an EOS).

``.bin`` layout (little-endian): 8 bytes :data:`MAGIC`, uint32 format version (1), uint32 bytes
per id (1, 2, 4 or 8; unsigned ids), uint64 number of ids, 8 zero bytes, then the ids.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from absl import logging

from fp8jax import provenance
from fp8jax import tokenizer as tokenizer_lib
from fp8jax.errors import DataError
from fp8jax.trainer import corpus as corpus_lib
from fp8jax.trainer import data, data_format

if TYPE_CHECKING:
    from fp8jax.spec import RunSpec

__all__ = [
    "HEADER_BYTES",
    "MAGIC",
    "MANIFEST",
    "SUFFIXES",
    "Concat",
    "Tokens",
    "check_prepared_with",
    "read_shard",
    "readers",
    "register_reader",
    "split",
    "write_bin",
]

MAGIC = b"FP8JTOK\0"  # the first bytes of a .bin token shard
MANIFEST = "prepare.json"  # what fp8jax.prepare writes beside its shards: their tokenizer's hash
HEADER_BYTES = 32  # magic, version, bytes per id, number of ids, reserved
_VERSION = 1  # the .bin layout; also part of the data key
SUFFIXES = (".npy", ".bin")  # the shards read here; registered readers add theirs
_SCAN = 1 << 24  # ids checked at a time against the vocabulary
FIX = (
    "set config.data.path to a .npy or .bin token shard or a folder of them, and "
    "config.data.tokenizer to the tokenizer that wrote them"
)
# suffix -> reader of a shard kind that is not .npy or .bin: the shard's ids as an array-like
# (len, dtype, contiguous slices as numpy arrays); a DataError naming it when it is malformed
_READERS: dict[str, Callable[[Path], object]] = {}


def register_reader(suffix: str) -> Callable:
    """Decorator: read token shards ending in ``suffix`` with the decorated function."""

    def add(read: Callable[[Path], object]) -> Callable[[Path], object]:
        if suffix in _READERS or suffix in SUFFIXES:
            raise ValueError(f"a token-shard reader for {suffix!r} is registered twice")
        _READERS[suffix] = read
        return read

    return add


def readers() -> tuple[str, ...]:
    """Every token-shard suffix: ``.npy``, ``.bin`` and the registered readers'."""
    return (*SUFFIXES, *_READERS)


def write_bin(path: str | os.PathLike, ids: np.ndarray) -> None:
    """Write ``ids`` (a 1-D unsigned integer array) as a ``.bin`` token shard."""
    ids = np.ascontiguousarray(ids)
    if ids.ndim != 1 or ids.dtype.kind != "u":
        raise ValueError(f"a token shard is a 1-D unsigned integer array, not {ids.dtype}")
    header = MAGIC + np.array([_VERSION, ids.dtype.itemsize], "<u4").tobytes()
    header += np.array([len(ids), 0], "<u8").tobytes()
    with open(path, "wb") as fh:
        fh.write(header)
        fh.write(memoryview(ids.astype(ids.dtype.newbyteorder("<"), copy=False)).cast("B"))


def read_shard(path: Path) -> np.ndarray:
    """The ids of a ``.npy`` or ``.bin`` shard, memory-mapped (of another kind, its registered
    reader's); a one-line DataError naming it when it is not a 1-D integer array or not a
    complete ``.bin`` shard."""
    for suffix, read in _READERS.items():
        if path.name.endswith(suffix):
            return read(path)
    if path.name.endswith(".npy"):
        try:
            ids = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as e:
            raise DataError(f"{path} is not a .npy array ({e}); {FIX}") from None
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise DataError(
                f"{path} holds a {ids.dtype} array of shape {ids.shape}, not a 1-D integer "
                f"array of token ids; {FIX}"
            )
        return ids
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(HEADER_BYTES)
    if len(head) < HEADER_BYTES or head[:8] != MAGIC:
        raise DataError(
            f"{path} has no fp8jax token-shard header ({MAGIC!r}, see "
            f"fp8jax.trainer.token_shards); write it with token_shards.write_bin or as .npy"
        )
    version, itemsize = np.frombuffer(head[8:16], "<u4")
    (count,) = np.frombuffer(head[16:24], "<u8")[:1]
    if version != _VERSION or itemsize not in (1, 2, 4, 8):
        raise DataError(
            f"{path}: token shard version {version}, {itemsize} bytes per id: "
            f"unsupported; rewrite it with token_shards.write_bin"
        )
    if size != HEADER_BYTES + int(count) * int(itemsize):
        raise DataError(
            f"{path} is {size} bytes but its header promises {count} ids of {itemsize} bytes: "
            "it is truncated; rewrite it"
        )
    dtype = np.dtype(f"<u{itemsize}")
    if not count:
        return np.zeros(0, dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(int(count),))


def _check_ids(path: Path, ids: np.ndarray, vocab: int) -> None:
    """A DataError unless ``ids`` can hold and holds only ids in ``[0, vocab)``."""
    info = np.iinfo(ids.dtype)
    if info.max < vocab - 1:
        raise DataError(
            f"{path} stores ids as {ids.dtype} (at most {info.max}) but the tokenizer has {vocab} "
            f"ids: rewrite the shards with a wider dtype (uint32), or name their tokenizer in "
            "config.data.tokenizer"
        )
    for start in range(0, len(ids), _SCAN):
        if bad := data.first_outside(np.asarray(ids[start : start + _SCAN]), vocab):
            raise DataError(
                f"{path} holds id {bad[1]} at position {start + bad[0]}, outside the tokenizer's "
                f"{vocab} ids [0, vocab): set config.data.tokenizer to the tokenizer that wrote "
                "these shards"
            )


def check_prepared_with(path: str, tokenizer) -> None:
    """A DataError when the shards ``path`` names (a shard or a folder) lie beside a
    :data:`MANIFEST` recording another tokenizer than ``tokenizer`` (ids of one read as
    another's train without an error, whenever they fit its vocabulary)."""
    p = Path(path).expanduser()
    folder = p if p.is_dir() else p.parent
    record = provenance.read_json(folder / MANIFEST) or {}
    recorded = record.get("tokenizer_sha256")
    if recorded and recorded != tokenizer_lib.sha256(tokenizer.to_str()):
        raise DataError(
            f"{path} holds ids of the tokenizer {record.get('tokenizer')!r} ({folder / MANIFEST}), "
            f"not of the run's: set config.data.tokenizer to {folder / 'tokenizer'} (the copy "
            "prepare kept), or prepare the corpus again with the run's tokenizer"
        )


class Concat:
    """Several id arrays read as one (``len``, slices, ``np.asarray``), without a copy."""

    def __init__(self, parts: list[np.ndarray]):
        self.parts = [p for p in parts if len(p)]
        self.starts = np.cumsum([0, *map(len, self.parts)])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, index: slice) -> np.ndarray:
        start, stop, step = index.indices(len(self))
        if step != 1:
            raise IndexError("token streams are read in contiguous slices")
        out = []
        k = int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < stop and k < len(self.parts):
            part, offset = self.parts[k], start - int(self.starts[k])
            take = min(stop - start, len(part) - offset)
            out.append(np.asarray(part[offset : offset + take]))
            start, k = start + take, k + 1
        if not out:
            return np.zeros(0, self.parts[0].dtype if self.parts else np.int32)
        return out[0] if len(out) == 1 else np.concatenate(out)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        whole = self[0 : len(self)]
        return whole if dtype is None else whole.astype(dtype)


def _last_eos_before(ids: np.ndarray, limit: int, eos: int) -> int | None:
    """The index of the last ``eos`` in ``ids[:limit]``, or None."""
    end = limit
    while end > 0:
        start = max(0, end - _SCAN)
        hits = np.flatnonzero(np.asarray(ids[start:end]) == eos)
        if len(hits):
            return start + int(hits[-1])
        end = start
    return None


def split(shards: list[np.ndarray], val_fraction: float, eos: int, desc: str):
    """(train parts, val parts): whole shards spread over the list, or one shard's last whole
    documents; DataError when one shard holds no EOS to cut at."""
    if val_fraction <= 0:
        return shards, []
    if len(shards) > 1:
        num_val = min(max(1, round(len(shards) * val_fraction)), len(shards) - 1)
        step = len(shards) / num_val
        val = {int(step * (k + 1)) - 1 for k in range(num_val)}  # the last of each stride
        return [s for i, s in enumerate(shards) if i not in val], [shards[i] for i in sorted(val)]
    (ids,) = shards
    cut = _last_eos_before(ids, int(len(ids) * (1 - val_fraction)), eos)
    if cut is None:
        raise DataError(
            f"{desc}: its single shard has no EOS (id {eos}) in its first {1 - val_fraction:.0%} "
            "to split whole documents into a validation split at; add document ends, or give "
            "several shards"
        )
    if isinstance(ids, np.ndarray):
        return [ids[: cut + 1]], [ids[cut + 1 :]]
    return [_Slice(ids, 0, cut + 1)], [_Slice(ids, cut + 1, len(ids))]


class _Slice:
    """``ids[start:stop]`` of an array-like shard, read only when sliced (as :class:`Concat`)."""

    def __init__(self, ids, start: int, stop: int):
        self.ids, self.start, self.stop, self.dtype = ids, start, stop, ids.dtype

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, index: slice) -> np.ndarray:
        start, stop, _ = index.indices(len(self))
        return self.ids[self.start + start : self.start + max(start, stop)]


@data_format.register
class Tokens(data_format.DataFormat):
    """``data.format='tokens'``: a corpus already encoded into token shards."""

    name = "tokens"
    dtypes = {"inputs": np.int32, "targets": np.int32}
    path_fix = FIX
    tokenizer_fields = dict(tokens=_VERSION)

    def source(self, run: RunSpec) -> data_format.Source:
        """The shard files, each opened and checked; their fingerprint."""
        val_fraction = float(run.data.val_fraction)
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"config.data.val_fraction must be in [0, 1), got {val_fraction}")
        if not run.data.path:
            raise DataError(f"config.data.format='tokens' needs config.data.path: {FIX}")
        files, desc = corpus_lib.source_files(run.data.path, readers(), FIX)
        for f in files:
            read_shard(f)
        logging.info("data source: token shards, %s", desc)
        return data_format.Source(desc, corpus_lib.fingerprint(files), files)

    def texts(self, source: data_format.Source):
        """Token shards have no text to learn a BPE on: a DataError naming the fix."""
        raise DataError(
            f"{source.desc} holds token ids, not text: set config.data.tokenizer to the "
            "tokenizer that wrote them"
        )

    def encode(self, run: RunSpec, source, tokenizer, workdir: Path) -> data_format.Encoded:
        """The shards checked against the tokenizer and split; nothing is written."""
        check_prepared_with(run.data.path, tokenizer)
        shards = [read_shard(f) for f in source.content]
        for f, ids in zip(source.content, shards, strict=True):
            _check_ids(f, ids, tokenizer.vocab_size)
        val_fraction = float(run.data.val_fraction)
        train, val = split(shards, val_fraction, tokenizer.eos_id, source.desc)
        train_tokens, val_tokens = Concat(train), Concat(val)
        optim = run.optim
        if len(train_tokens) < optim.seq_len + 1:
            raise DataError(
                f"{source.desc}: training split has {len(train_tokens)} ids, fewer than "
                f"seq_len+1 = {optim.seq_len + 1}; use more shards or a shorter seq_len"
            )
        if val_fraction > 0 and len(val_tokens) < optim.batch_size * (optim.seq_len + 1):
            raise DataError(
                f"{source.desc}: validation split has {len(val_tokens)} ids, less than one "
                f"batch of {optim.batch_size} x {optim.seq_len + 1}; raise "
                "config.data.val_fraction or add shards"
            )
        key = data_format.cache_key(
            version=_VERSION,
            corpus=source.corpus,
            tokenizer=tokenizer_lib.sha256(tokenizer.to_str()),
            val_fraction=val_fraction,
        )
        sizes = dict(seed=run.seed, batch_size=optim.batch_size, seq_len=optim.seq_len)
        shards = (f"the token shards of {source.desc}",) * 2
        fix = "a shard changed after the run checked it; rewrite it with config.data.tokenizer"
        make = functools.partial(data.Dataset, tokenizer, key=key, shards=shards, fix=fix, **sizes)
        return data_format.Encoded(make(train_tokens, val_tokens))
