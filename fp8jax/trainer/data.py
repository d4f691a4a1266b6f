"""The text format: local BPE, memory-mapped token cache, grain batch streams (files: corpus.py).

``build(run, workdir)`` (the ``text`` format over ``data_format.build``) trains (or reuses)
``<workdir>/tokenizer.json``, encodes the corpus once into ``<workdir>/tokens/{train,val}.bin``
and returns a :class:`Dataset` whose training iterator is infinite, seed-deterministic, sharded
by process and resumable from a JSON state. Both caches are keyed on the corpus bytes and every
setting that shapes them, and are written only once the build has succeeded
(fp8jax.provenance has the rules for reuse on resume).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from absl import logging

from fp8jax import checksums, errors, provenance
from fp8jax import tokenizer as tokenizer_lib
from fp8jax.errors import DataError
from fp8jax.tokenizer import Tokenizer
from fp8jax.trainer import corpus as corpus_lib
from fp8jax.trainer import data_format
from fp8jax.trainer import encode as encode_lib
from fp8jax.trainer.stream import TrainIterator, process_rows, seed32
from fp8jax.trainer.stream import state_to_bytes as state_to_bytes  # the iterator's JSON

if TYPE_CHECKING:
    from fp8jax.spec import RunSpec

__all__ = [
    "Batch",
    "Dataset",
    "Text",
    "TrainIterator",
    "build",
    "first_outside",
    "state_to_bytes",
]

_CACHE_VERSION = 3  # format of the token cache and its key; bumping it rebuilds old caches
_TOKENIZER_VERSION = 3  # how the learned BPE is trained; bumping it retrains old ones
_TOKENIZER_TRAIN_CHARS = 8 << 20  # BPE statistics settle long before this; keeps training fast
_SAMPLE_WINDOW = 1 << 18  # characters of a large text file read at one place for the BPE
# Train/val split unit: the token stream is cut into blocks of this many tokens and each block
# goes wholly to one split, so validation text is spread over the corpus yet never trained on.
_SPLIT_BLOCK = 1024
# pre-tokenized files (data.format='tokens'), never text
_TOKEN_SHARDS = (".npy", ".bin", ".array_record")

Batch = dict[str, np.ndarray]


def _tokenizer_texts(files: list[Path]) -> Iterator[str]:
    """About ``_TOKENIZER_TRAIN_CHARS`` characters of the corpus for BPE training: all of it
    when it is no larger, else a share of each file by its size (:func:`_file_sample`)."""
    sizes = [corpus_lib.text_size([f]) for f in files]
    total = sum(sizes)
    for f, size in zip(files, sizes, strict=True):
        if total <= _TOKENIZER_TRAIN_CHARS:
            budget = _TOKENIZER_TRAIN_CHARS
        else:
            budget = max(1, _TOKENIZER_TRAIN_CHARS * size // total)
        yield from _file_sample(f, size, budget)


def _file_sample(f: Path, size: int, budget: int) -> Iterator[str]:
    """About ``budget`` characters of ``f``: a plain text file larger than that in windows
    spread evenly over it (each from a line start), any other file from its start."""
    if f.name.endswith(".txt") and size > budget:
        k = -(-budget // _SAMPLE_WINDOW)
        width = -(-budget // k)
        with open(f, "rb") as fh:
            for i in range(k):
                fh.seek(i * size // k)
                text = fh.read(4 * width).decode("utf-8", errors="replace")
                start = text.find("\n") + 1 if i else 0
                yield text[start : start + width]
        return
    for text, _ in corpus_lib.pieces([f]):
        yield text[:budget]
        budget -= len(text)
        if budget <= 0:
            return


class _Splitter:
    """Streams token ids into train/val files, one ``_SPLIT_BLOCK``-token block at a time."""

    def __init__(self, train_fh, val_fh, val_fraction: float, dtype: np.dtype):
        self.fhs, self.val_fraction, self.dtype = (train_fh, val_fh), val_fraction, dtype
        self.counts = [0, 0]  # tokens written to train, val
        self.max_ids = [-1, -1]  # the largest id written to train, val (-1: none)
        self.pending: list[np.ndarray] = []
        self.pending_len = 0

    def add(self, ids: np.ndarray) -> None:
        self.pending.append(np.asarray(ids, self.dtype))
        self.pending_len += len(ids)
        if self.pending_len < _SPLIT_BLOCK:
            return
        flat = np.concatenate(self.pending)
        full = len(flat) - len(flat) % _SPLIT_BLOCK
        for start in range(0, full, _SPLIT_BLOCK):
            self._emit(flat[start : start + _SPLIT_BLOCK])
        self.pending, self.pending_len = [flat[full:]], len(flat) - full

    def _emit(self, block: np.ndarray) -> None:
        total = sum(self.counts) + len(block)
        # Deterministic and evenly spread: a block goes to val whenever val would still stay
        # within its share of everything emitted so far (so the first block is always train).
        to_val = self.counts[1] + len(block) <= self.val_fraction * total
        self.fhs[to_val].write(block.tobytes())
        self.counts[to_val] += len(block)
        if len(block):
            self.max_ids[to_val] = max(self.max_ids[to_val], int(block.max()))

    def close(self) -> None:
        if self.pending_len:
            self._emit(np.concatenate(self.pending))


def _encode_corpus(
    files: list[Path],
    tok: Tokenizer,
    out_dir: Path,
    val_fraction: float,
    dtype,
    done: dict,
    workers: int = 0,
):
    """Encode every document (framed by ``encode.encode``) into ``out_dir`` with ``workers``
    processes; returns (num_train, num_val) and the largest id of each split (-1: empty).
    ``done`` counts the characters and tokens encoded so far (``chars``, ``tokens``)."""
    with open(out_dir / "train.bin", "wb") as train_fh, open(out_dir / "val.bin", "wb") as val_fh:
        splitter = _Splitter(train_fh, val_fh, val_fraction, dtype)
        for ids, chars in encode_lib.encode(files, tok, dtype, workers):
            done["chars"] += chars
            done["tokens"] += len(ids)
            splitter.add(ids)
        splitter.close()
    return tuple(splitter.counts), tuple(splitter.max_ids)


# A reused token cache's ids are checked against the vocabulary at every start: all of a
# shard up to _CHECK_ALL_BYTES (_CHECK_IDS at a time), else _CHECK_BLOCKS blocks of
# _CHECK_BLOCK_IDS spread over it (32 MiB of uint16).
_CHECK_ALL_BYTES = 1 << 28
_CHECK_IDS = 1 << 24
_CHECK_BLOCKS = 512
_CHECK_BLOCK_IDS = 1 << 15
_BYTES_PER_TOKEN = 4  # a BPE's usual text bytes per token: the estimate before any is encoded


def _cache_bytes(files: list[Path], done: dict, itemsize: int) -> int:
    """The token cache's estimated size: the corpus' text size times the tokens per character
    encoded so far (before any: ``_BYTES_PER_TOKEN``), times the bytes of an id."""
    per_char = done["tokens"] / done["chars"] if done["chars"] else 1 / _BYTES_PER_TOKEN
    return int(corpus_lib.text_size(files) * per_char * itemsize)


_IN_WORKDIR = "pass a --workdir on a disk with room (the token cache lives in the work dir)"
_SHARED_FIX = "set config.data.cache_dir to a folder on a disk with room"


def _rebuild_fix(out_dir: Path) -> str:
    """What to do about a token cache in ``out_dir`` whose shards changed after the build."""
    return f"it changed after it was built; delete {out_dir} so that it is rebuilt, then rerun"


def _out_of_vocab(shard: Path, bad: int, where: str, vocab: int) -> DataError:
    """The error of a reused token cache's ``shard`` that holds id ``bad`` (``where``)."""
    return DataError(
        f"the token cache shard {shard} holds id {bad} {where}, outside the tokenizer's "
        f"{vocab} ids: {_rebuild_fix(shard.parent)}"
    )


def first_outside(ids: np.ndarray, vocab: int) -> tuple[int, int] | None:
    """``(position, id)`` of the first id of ``ids`` outside ``[0, vocab)``, or None."""
    if not len(ids) or (int(ids.min()) >= 0 and int(ids.max()) < vocab):
        return None
    k = int(np.argmax((ids < 0) | (ids >= vocab)))
    return k, int(ids[k])


def _check_reused(out_dir: Path, meta: dict, vocab: int) -> None:
    """A DataError naming the shard when a reused token cache holds an id outside ``vocab``:
    its recorded largest ids, then its ids, all of a shard up to ``_CHECK_ALL_BYTES``, else
    ``_CHECK_BLOCKS`` blocks spread over it (the training stream checks every window it
    reads: :meth:`Dataset.windows`)."""
    for s in ("train", "val"):
        shard, recorded = out_dir / f"{s}.bin", meta.get(f"max_{s}", -1)
        if recorded >= vocab:
            raise _out_of_vocab(shard, recorded, "(its recorded largest id)", vocab)
        ids = _memmap(shard, meta["dtype"], meta[f"num_{s}"])
        if ids.nbytes <= _CHECK_ALL_BYTES:
            starts, width = range(0, len(ids), _CHECK_IDS), _CHECK_IDS
        else:
            width, last = _CHECK_BLOCK_IDS, max(len(ids) - _CHECK_BLOCK_IDS, 0)
            starts = corpus_lib.spread_starts(last, _CHECK_BLOCKS)
        for start in starts:
            if bad := first_outside(np.asarray(ids[start : start + width]), vocab):
                raise _out_of_vocab(shard, bad[1], f"at token {start + bad[0]}", vocab)


def _verify_corpus(files: list[Path], meta: dict, out_dir: Path) -> None:
    """A DataError naming the first corpus file whose bytes differ from the CRC-32s the token
    cache in ``out_dir`` recorded at its build (``meta['corpus_crc32']``)."""
    record = meta.get("corpus_crc32")
    if not record or len(record.get("files", ())) != len(files):
        raise DataError(
            f"the token cache {out_dir} has no record of its corpus' bytes to verify against "
            f"(built by an older fp8jax): delete {out_dir} so that it is rebuilt, or set "
            "config.data.verify_corpus=False"
        )
    t0 = time.perf_counter()
    actual = checksums.file_digests([str(f) for f in files], record["block_bytes"])
    for f, got, want in zip(files, actual, record["files"], strict=True):
        if got != want:
            changed = [k for k, (a, b) in enumerate(zip(got, want, strict=False)) if a != b]
            where = f"block {changed[0]} of {len(want)}" if changed else "its size"
            raise DataError(
                f"corpus file {f} differs from the one the token cache {out_dir} was built from "
                f"({where}): restore the file, or delete {out_dir} so that it is rebuilt"
            )
    logging.info("corpus verified against %s in %.1f s", out_dir, time.perf_counter() - t0)


def _memmap(path: Path, dtype: str, n: int) -> np.ndarray:
    # np.memmap refuses empty files; an empty split is legal (val_fraction=0).
    return np.memmap(path, dtype=dtype, mode="r", shape=(n,)) if n else np.zeros(0, dtype)


def _cache_key(tok: Tokenizer, identity: dict) -> tuple[str, str]:
    """The token cache's key (corpus bytes, tokenizer, split, format) and its ids' dtype."""
    dtype = "uint16" if tok.vocab_size <= 1 << 16 else "uint32"
    key = data_format.cache_key(
        version=_CACHE_VERSION,
        corpus=identity["corpus"],
        tokenizer=tokenizer_lib.sha256(tok.to_str()),
        val_fraction=identity["val_fraction"],
        block=_SPLIT_BLOCK,
        dtype=dtype,
    )
    return key, dtype


def _load_or_encode(
    files,
    desc,
    tok: Tokenizer,
    out_dir: Path,
    stage: Path,
    identity: dict,
    workers: int = 0,
    fix: str = _IN_WORKDIR,
    verify: bool = False,
):
    """Token cache metadata and whether it was just encoded (into ``stage``, not yet committed).

    The cache in ``out_dir`` is reused only if its key (corpus bytes, tokenizer, split, format)
    matches and its files have the recorded sizes; a reused one holding an id outside the
    tokenizer's is refused (:func:`_check_reused`), and with ``verify`` one whose corpus files
    differ from the CRC-32s recorded at its build (:func:`_verify_corpus`).
    """
    key, dtype = _cache_key(tok, identity)
    meta = provenance.read_json(out_dir / "meta.json") or {}
    itemsize = np.dtype(dtype).itemsize
    sizes_ok = all(
        (out_dir / f"{s}.bin").exists()
        and (out_dir / f"{s}.bin").stat().st_size == meta.get(f"num_{s}", -1) * itemsize
        for s in ("train", "val")
    )
    if meta.get("key") == key and sizes_ok:
        logging.info("reusing token cache %s (%d train tokens)", out_dir, meta["num_train"])
        _check_reused(out_dir, meta, tok.vocab_size)
        if verify:
            _verify_corpus(files, meta, out_dir)
        return meta, False
    if meta.get("key") == key:
        logging.warning("the token cache %s is not the size it recorded: rebuilding it", out_dir)
    logging.info("encoding %s -> %s", desc, out_dir)
    t0 = time.perf_counter()
    done = dict(chars=0, tokens=0)
    what = f"the token cache ({stage.name}, removed)"  # Text.encode removes the stage
    needed = lambda: _cache_bytes(files, done, itemsize)  # noqa: E731
    with data_format.disk_space(stage.parent, what, needed, fix):
        stage.mkdir()
        (num_train, num_val), (max_train, max_val) = _encode_corpus(
            files, tok, stage, identity["val_fraction"], dtype, done, workers
        )
        if num_train + num_val == 0:
            raise DataError(f"no text found in {desc}; {corpus_lib.FIX}")
        meta = dict(key=key, source=desc, dtype=dtype, num_train=num_train, num_val=num_val)
        meta.update(max_train=max_train, max_val=max_val)
        # Every corpus byte, for data.verify_corpus (the key samples a large corpus).
        digests = checksums.file_digests([str(f) for f in files], checksums.BLOCK_BYTES)
        meta["corpus_crc32"] = dict(block_bytes=checksums.BLOCK_BYTES, files=digests)
        provenance.write_json(stage / "meta.json", meta)
    secs = time.perf_counter() - t0
    logging.info("encoded %d train + %d val tokens in %.1fs", num_train, num_val, secs)
    return meta, True


def _commit_tokens(stage: Path, out_dir: Path) -> None:
    """Move a staged token cache into ``out_dir``, each file atomically, its key last."""
    out_dir.mkdir(exist_ok=True)
    # No key while the arrays are swapped: a kill in between leaves a cache that is rebuilt.
    (out_dir / "meta.json").unlink(missing_ok=True)
    for name in ("train.bin", "val.bin", "meta.json"):
        os.replace(stage / name, out_dir / name)


@contextlib.contextmanager
def _exclusive(lock: Path):
    """Hold an exclusive lock on the file ``lock`` (other builders of that cache wait)."""
    with open(lock, "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logging.info("waiting for another run building the token cache %s", lock.stem)
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _remove_dead_stages(root: Path, name: str) -> None:
    """Remove the ``<name>.tmp<pid>`` folders of the shared cache folder ``root``: builds of
    that cache killed before they published it (a build stages only while it holds the cache's
    lock, which the caller holds), each as large as the cache."""
    for stale in root.glob(f"{name}.tmp*"):
        shutil.rmtree(stale, ignore_errors=True)
        logging.info("removed %s, left by a killed build of the token cache", stale)


def _publish(stage: Path, out_dir: Path) -> None:
    """Move a staged shared cache to ``out_dir`` in one rename (replacing a broken one)."""
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.rename(stage, out_dir)


def _too_short_for_train(num_tokens: int, seq_len: int) -> str | None:
    if num_tokens >= seq_len + 1:
        return None
    return (
        f"training split has {num_tokens} tokens, fewer than seq_len+1 = {seq_len + 1}; "
        "use a larger corpus or a shorter seq_len"
    )


def _too_short_for_eval(num_tokens: int, batch_size: int, seq_len: int) -> str | None:
    if num_tokens // (seq_len + 1) // batch_size:
        return None
    return (
        f"validation split has {num_tokens} tokens, less than one batch of "
        f"{batch_size} x {seq_len + 1}; raise config.data.val_fraction or use a larger corpus"
    )


def _split(window_W: np.ndarray) -> Batch:
    inputs, targets = window_W[..., :-1], window_W[..., 1:]
    return {"inputs": np.ascontiguousarray(inputs), "targets": np.ascontiguousarray(targets)}


class Dataset:
    """Tokenized corpus: a checkpointable training stream and fixed validation batches.

    Every window read is checked against ``tokenizer``'s vocabulary (None: ids from elsewhere,
    with no vocabulary to check against)."""

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        train_tokens: np.ndarray,
        val_tokens: np.ndarray,
        *,
        seed: int = 0,
        batch_size: int = 8,
        seq_len: int = 64,
        key: str = "",
        shards: tuple[str, str] = ("the training tokens", "the validation tokens"),
        fix: str = "rebuild them with the run's tokenizer",
    ):
        self.tokenizer = tokenizer
        self.train_tokens, self.val_tokens = train_tokens, val_tokens
        self.seed, self.batch_size, self.seq_len, self.key = seed, batch_size, seq_len, key
        self.shards, self.fix = shards, fix
        # Without a tokenizer (ids from elsewhere) there is no vocabulary to check ids against.
        self.vocab_size = None if tokenizer is None else tokenizer.vocab_size

    def _checked(self, ids: np.ndarray, split: int, start: int) -> np.ndarray:
        """``ids`` (int32, read from ``start`` of the training (0) or validation (1) split);
        a DataError naming the split's shards and ``fix`` when one is outside the vocabulary
        (a shard changed after its checks: the embedding lookup would clamp it)."""
        if self.vocab_size is not None and (bad := first_outside(ids, self.vocab_size)):
            raise DataError(
                f"{self.shards[split]} holds id {bad[1]} at token {start + bad[0]}, outside "
                f"the tokenizer's {self.vocab_size} ids: {self.fix}"
            )
        return ids

    @property
    def num_train_tokens(self) -> int:
        """Tokens in the training split."""
        return len(self.train_tokens)

    @property
    def num_val_tokens(self) -> int:
        """Tokens in the validation split."""
        return len(self.val_tokens)

    def train_iter(
        self,
        batch_size: int | None = None,
        seq_len: int | None = None,
        *,
        process_index: int | None = None,
        process_count: int | None = None,
    ) -> TrainIterator:
        """Batches ``{'inputs', 'targets'}`` int32 [batch_size / processes, seq_len]."""
        batch_size = batch_size or self.batch_size
        seq_len = seq_len or self.seq_len
        p, num_p, rows = process_rows(batch_size, process_index, process_count)
        ds = self.windows(seq_len).batch(rows, drop_remainder=True)
        # Global batch t is mini-batches t*P .. t*P+P-1; this process owns the p-th of them, so
        # every process count sees the same global batches.
        ds = ds[p::num_p]
        identity = dict(batch_size=batch_size, seq_len=seq_len, seed=self.seed, data=self.key[:16])
        return TrainIterator(ds, identity)

    def windows(self, seq_len: int, salt: tuple = ()):
        """The infinite ``grain.MapDataset`` of training windows ``{'inputs', 'targets'}``
        [seq_len], window ``i`` a pure function of ``i`` (``salt``: more of the shuffle's seed,
        so several datasets of one seed shuffle differently)."""
        tokens, W = self.train_tokens, seq_len + 1
        if problem := _too_short_for_train(len(tokens), seq_len):
            raise ValueError(problem)
        # Each epoch: non-overlapping windows in shuffled order, all shifted by a fresh random
        # offset (one window of slack) so window boundaries move between epochs.
        num_windows = max(len(tokens) // W - 1, 1)
        max_offset = min(W - 1, len(tokens) - num_windows * W)
        shuffle_seed = seed32("train", self.seed, *salt)

        @functools.lru_cache(maxsize=4)
        def epoch_offset(epoch: int) -> int:
            return int(np.random.default_rng([shuffle_seed, epoch]).integers(max_offset + 1))

        def window(k: int, j: int) -> Batch:
            start = epoch_offset(k // num_windows) + j * W
            ids = np.asarray(tokens[start : start + W], dtype=np.int32)
            return _split(self._checked(ids, 0, start))

        import grain  # only here: the format registry (loop.setup reads it) needs no grain

        # The grain shuffle re-permutes each epoch (its seed is folded with the epoch number).
        ds = grain.MapDataset.range(num_windows).shuffle(seed=shuffle_seed).repeat(None)
        return ds.map_with_index(window)

    def eval_batches(
        self,
        num_batches: int,
        batch_size: int | None = None,
        seq_len: int | None = None,
        *,
        process_index: int | None = None,
        process_count: int | None = None,
    ) -> list[Batch]:
        """``num_batches`` batches of non-overlapping validation windows spread evenly over the
        whole split (all of its windows when they make only that many batches), the same at
        every call."""
        batch_size = batch_size or self.batch_size
        seq_len = seq_len or self.seq_len
        p, _, rows = process_rows(batch_size, process_index, process_count)
        W = seq_len + 1
        available = len(self.val_tokens) // W // batch_size
        if problem := _too_short_for_eval(len(self.val_tokens), batch_size, seq_len):
            raise ValueError(problem)
        if available < num_batches:
            logging.warning("validation split holds only %d of %d batches", available, num_batches)
        n = min(num_batches, available)
        windows, taken = len(self.val_tokens) // W, n * batch_size
        out = []
        for b in range(n):
            rows_RxW = []
            for j in range(b * batch_size + p * rows, b * batch_size + (p + 1) * rows):
                start = j * windows // taken * W  # window j of the taken ones, spread evenly
                ids = np.asarray(self.val_tokens[start : start + W], dtype=np.int32)
                rows_RxW.append(self._checked(ids, 1, start))
            out.append(_split(np.stack(rows_RxW)))
        return out


class _Tokens(data_format.Encoded):
    """The token cache: reused from ``tokens/``, or staged and moved there on commit."""

    def __init__(self, make, meta: dict, out_dir: Path, stage: Path, encoded: bool):
        self.make, self.meta, self.out_dir = make, meta, out_dir
        self.stage, self.encoded = stage, encoded

    @property
    def dataset(self) -> Dataset:
        """The :class:`Dataset` over the committed cache."""
        train = _memmap(self.out_dir / "train.bin", self.meta["dtype"], self.meta["num_train"])
        val = _memmap(self.out_dir / "val.bin", self.meta["dtype"], self.meta["num_val"])
        return self.make(train, val)

    def commit(self, workdir: Path) -> None:
        if self.encoded:
            _commit_tokens(self.stage, self.out_dir)

    def discard(self) -> None:
        shutil.rmtree(self.stage, ignore_errors=True)


@data_format.register
class Text(data_format.DataFormat):
    """``data.format='text'``: a corpus of text files or .jsonl ``text`` lines, as token windows."""

    name = "text"
    dtypes = {"inputs": np.int32, "targets": np.int32}
    path_fix = corpus_lib.FIX
    tokenizer_fields = dict(version=_TOKENIZER_VERSION, train_chars=_TOKENIZER_TRAIN_CHARS)

    def source(self, run: RunSpec) -> data_format.Source:
        """The corpus files, checked to hold text; their fingerprint."""
        val_fraction = float(run.data.val_fraction)
        if not 0.0 <= val_fraction < 1.0:  # 0: no validation split (library use; configs need > 0)
            raise ValueError(f"config.data.val_fraction must be in [0, 1), got {val_fraction}")
        files, desc = corpus_lib.source_files(run.data.path)
        if files[0].name.endswith(_TOKEN_SHARDS):
            raise DataError(
                f"{files[0]} is a token shard, not text: set config.data.format='tokens' and "
                "config.data.tokenizer to the tokenizer that wrote it"
            )
        logging.info("data source: %s", desc)
        corpus_lib.check_not_empty(files, desc)
        return data_format.Source(desc, corpus_lib.fingerprint(files), files)

    def texts(self, source: data_format.Source) -> Iterator[str]:
        """About ``_TOKENIZER_TRAIN_CHARS`` characters drawn across the corpus' files."""
        return _tokenizer_texts(source.content)

    def encode(self, run: RunSpec, source, tokenizer, workdir: Path) -> _Tokens:
        """The token cache (reused, or encoded into a staging folder of ``workdir``), checked to
        hold a training window and, with a validation split, an eval batch."""
        optim = run.optim
        identity = dict(corpus=source.corpus, val_fraction=float(run.data.val_fraction))
        shared = run.data.cache_dir
        if shared:  # one folder per key, published by a rename while its builders hold a lock
            root = Path(shared).expanduser()
            provenance.check_outside_managed(root, "config.data.cache_dir")
            try:
                root.mkdir(parents=True, exist_ok=True)
            except OSError as e:  # a file of that name, a read-only mount
                why = errors.folder_failure(root, e)
                raise DataError(
                    f"config.data.cache_dir={shared!r} cannot hold the token caches ({why}); "
                    "name a folder you can write, or '' for the work dir's tokens/"
                ) from None
            name = _cache_key(tokenizer, identity)[0][:32]
            out_dir, stage = root / name, root / f"{name}.tmp{os.getpid()}"
            lock, fix = _exclusive(root / f"{name}.lock"), _SHARED_FIX
        else:
            # Everything is built in a staging folder and checked before it replaces the caches,
            # so a failed or refused build leaves the work dir as it was.
            workdir.mkdir(parents=True, exist_ok=True)
            out_dir, stage = workdir / "tokens", workdir / f"tokens.tmp{os.getpid()}"
            lock, fix = contextlib.nullcontext(), _IN_WORKDIR
        try:
            with lock:
                if shared:
                    _remove_dead_stages(root, name)
                meta, encoded = _load_or_encode(
                    source.content,
                    source.desc,
                    tokenizer,
                    out_dir,
                    stage,
                    identity,
                    run.data.encode_workers,
                    fix,
                    run.data.verify_corpus,
                )
                if shared and encoded:  # a shared cache holds for any run: published now
                    _publish(stage, out_dir)
                    encoded = False
            problem = _too_short_for_train(meta["num_train"], optim.seq_len)
            if not problem and identity["val_fraction"] > 0:
                problem = _too_short_for_eval(meta["num_val"], optim.batch_size, optim.seq_len)
            if problem:
                raise DataError(f"{source.desc}: {problem}")
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise
        sizes = dict(seed=run.seed, batch_size=optim.batch_size, seq_len=optim.seq_len)
        shards = tuple(f"the token cache shard {out_dir / f'{s}.bin'}" for s in ("train", "val"))
        make = functools.partial(
            Dataset, tokenizer, key=meta["key"], shards=shards, fix=_rebuild_fix(out_dir), **sizes
        )
        return _Tokens(make, meta, out_dir, stage, encoded)


def build(run: RunSpec, workdir: str | os.PathLike, tokenizer: Tokenizer | None = None) -> Dataset:
    """Tokenizer + token cache in ``workdir`` for ``run.data``; returns the :class:`Dataset`.

    ``tokenizer``: encode with this one (an ``init_from`` checkpoint's), not a learned BPE.

    Raises :class:`~fp8jax.errors.DataError` (or ValueError) for bad data, a corpus too small
    for the run's ``seq_len``/``batch_size``, or a resume on data other than the checkpoint's;
    then nothing in ``workdir`` has changed.
    """
    return data_format.build(data_format.get(Text.name), run, workdir, tokenizer)
