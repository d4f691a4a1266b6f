"""The corpus encoder: files cut into ranges at line starts, encoded by a pool of processes.

A plain ``.txt`` or ``.jsonl`` file is cut into ranges of about ``RANGE_BYTES``, a ``.parquet``
file at its row groups (a ``.gz`` file is one range: it cannot be entered midway); each range
is one task of a worker process. A
worker reads its range's text, cuts it into pieces of about ``PIECE_CHARS`` characters and
hands them to the tokenizer's batch encoder (many short strings encode faster than one long
one). Text files are cut only where the tokenizer's pre-tokenizer splits anyway
(:class:`Cuts`: a line break with a non-blank character on each side, or the middle of a blank
line between two), so the ids equal those of the whole document encoded at once; a tokenizer
that adds a prefix to each piece (SentencePiece ``Metaspace``, ``add_prefix_space``) fails the
probes of :func:`cuts_for` and is given pieces of
``COARSE_PIECE_CHARS``. ``.jsonl`` ranges are cut at any line start (a document boundary).
A byte-level BPE's (fp8jax's learned one, GPT-2's, Llama 3's, Qwen2's) text skips the pieces:
its worker encodes it with :class:`bpe_words.WordEncoder`, each distinct word tokenized once,
except a text that the word encoder refuses (an added token in it, a character its probes reject).

:func:`encode` yields each range's ids in corpus order: a text file is one document, a
``.jsonl`` line is one; a document with tokens starts with the tokenizer's BOS (when it has
one other than its EOS) and ends with its EOS.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import gzip
import io
import itertools
import json
import multiprocessing
import os
import time
import zlib
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import numpy as np
import tokenizers
from absl import logging
from tqdm import tqdm

from fp8jax.tokenizer import Tokenizer
from fp8jax.trainer import bpe_words
from fp8jax.trainer import corpus as corpus_lib

__all__ = [
    "COARSE_PIECE_CHARS",
    "PIECE_CHARS",
    "PROGRESS_BYTES",
    "RANGE_BYTES",
    "Cuts",
    "Task",
    "cuts_for",
    "encode",
    "plan",
    "safe_cuts",
    "workers_for",
]

RANGE_BYTES = 16 << 20  # bytes of a plain file in one worker task
PIECE_CHARS = 1 << 14  # characters per piece handed to the batch encoder
COARSE_PIECE_CHARS = 1 << 22  # the pieces of a tokenizer whose ids change at a cut
PROGRESS_BYTES = 64 << 20  # corpora from this size show a progress bar
_BLOCK_CHARS = 1 << 22  # text read at a time from a range (bounds a worker's memory)
_MAX_CARRY = 4 * _BLOCK_CHARS  # text held while looking for a safe cut
_WINDOW = 1 << 16  # bytes read at a time while searching for a range's safe line start
_SEARCH = 1 << 20  # past this, a range starts at any line start (ids may differ there)
_START = "forkserver"  # how worker processes start (multiprocessing's start method)
_LINE_PROBES = ("Hello world.\nThe end", "a\nb c\n1 2\nx y.\nZ", "données,\n«x» 12\n数据\nok")
_PARAGRAPH_PROBES = ("One.\n\nTwo words\n\nthree", "a b\n\nc\n\n数据")


@dataclasses.dataclass(frozen=True)
class Task:
    """A range of one corpus file: what one worker encodes."""

    file: str
    start: int  # byte offset of a line start (0: the file's start, which is sniffed); parquet:
    # the row group
    end: int  # byte offset where the next range starts; -1: the end of the file
    last: bool  # the file's last range: its (text) document ends here
    size: int  # bytes of the file it spans (a .gz file: its compressed size)

    @property
    def kind(self) -> str:
        """'jsonl' or 'parquet' (a document a line or a row), or 'text' (one document)."""
        if self.file.endswith(corpus_lib.JSONL):
            return "jsonl"
        return "parquet" if self.file.endswith(corpus_lib.PARQUET) else "text"


def _blank(text: str) -> bool:
    return not text or text.isspace()


@dataclasses.dataclass(frozen=True)
class Cuts:
    """Where a tokenizer's text is cut (keeping its ids) and into pieces of what size."""

    piece_chars: int = PIECE_CHARS
    paragraphs: bool = True  # also between the two line breaks of a blank line

    def ok(self, before: str, after: str) -> bool:
        """Whether a cut just after a line break is safe: ``before`` the character before the
        break, ``after`` (up to) the two characters after it."""
        if _blank(before) or not after:
            return False
        if not _blank(after[0]):
            return True  # 'x\n|y'
        return self.paragraphs and after[0] == "\n" and len(after) > 1 and not _blank(after[1])


def cuts_for(tok: Tokenizer) -> Cuts:
    """The cuts that keep ``tok``'s ids: at line starts between non-blank characters (a
    byte-level BPE splits there anyway), also inside blank lines where its pre-tokenizer
    splits a line-break run; a tokenizer that adds a prefix to each piece gets coarse pieces
    (its ids differ from the whole text's at each cut)."""
    if not _keeps_ids(tok, _LINE_PROBES, Cuts(paragraphs=False)):
        return Cuts(COARSE_PIECE_CHARS, paragraphs=True)
    return Cuts(PIECE_CHARS, _keeps_ids(tok, _PARAGRAPH_PROBES, Cuts()))


def _keeps_ids(tok: Tokenizer, probes: tuple[str, ...], cuts: Cuts) -> bool:
    for text in probes:
        bounds = [0, *safe_cuts(text, 1, cuts), len(text)]
        pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
        if len(pieces) < 2:
            raise AssertionError(f"probe {text!r} has no cut")  # the probes test the cuts
        if [i for ids in tok.encode_plain(pieces) for i in ids] != tok.encode_plain([text])[0]:
            return False
    return True


def safe_cuts(text: str, step: int, cuts: Cuts) -> list[int]:
    """Offsets of the safe cuts in ``text`` (``Cuts.ok``), the first at least ``step``
    characters in and each at least ``step`` past the last."""
    out, i = [], step
    while (j := text.find("\n", i)) >= 0:
        if j > 0 and cuts.ok(text[j - 1], text[j + 1 : j + 3]):
            out.append(j + 1)
            i = j + 1 + step
        else:
            i = j + 1
    return out


def _last_safe_cut(text: str, cuts: Cuts) -> int:
    """The offset of the last safe cut in ``text``; 0 when there is none."""
    end = len(text)
    while (j := text.rfind("\n", 0, end)) > 0:
        if cuts.ok(text[j - 1], text[j + 1 : j + 3]):
            return j + 1
        end = j
    return 0


def _safe_offset(fh, offset: int, jsonl: bool, cuts: Cuts) -> int | None:
    """The byte offset of the first safe cut (``jsonl``: line start) at or past ``offset``
    (> 0) in the binary file ``fh``, any line start past ``_SEARCH`` bytes without one; None
    if there is none before its end."""
    pos = offset
    while True:
        base = max(pos - 5, 0)  # 4 bytes before the line break: the character before it
        fh.seek(base)
        want = pos - base + _WINDOW + 8  # 8 bytes past the window: two characters after
        window = fh.read(want)
        j, stop = pos - base - 1, pos - base - 1 + _WINDOW
        while (j := window.find(b"\n", j, stop)) >= 0:
            after = window[j + 1 : j + 9].decode("utf-8", "ignore")[:2]
            before = window[max(j - 4, 0) : j].decode("utf-8", "ignore")[-1:]
            if after and (jsonl or pos - offset >= _SEARCH or cuts.ok(before, after)):
                return base + j + 1
            j += 1
        if len(window) < want:
            return None
        pos += _WINDOW


def plan(files: list[Path], range_bytes: int = RANGE_BYTES, cuts: Cuts = Cuts()) -> list[Task]:
    """The tasks encoding ``files`` in order: each plain file cut at safe cuts (a .jsonl file
    at line starts) into ranges of about ``range_bytes``, each .gz file whole."""
    tasks = []
    for f in files:
        size = f.stat().st_size
        if f.name.endswith(corpus_lib.PARQUET):
            groups = corpus_lib.parquet_file(f).num_row_groups
            tasks += [Task(str(f), g, -1, True, size // max(groups, 1)) for g in range(groups)]
            continue
        if f.name.endswith(".gz") or size <= range_bytes:
            tasks.append(Task(str(f), 0, -1, True, size))
            continue
        starts = [0]
        with open(f, "rb") as fh:
            while (nxt := starts[-1] + range_bytes) < size:
                cut = _safe_offset(fh, nxt, f.name.endswith(corpus_lib.JSONL), cuts)
                if cut is None or cut >= size:
                    break
                starts.append(cut)
        bounds = [*starts, size]
        for k, (a, b) in enumerate(itertools.pairwise(bounds)):
            last = k == len(starts) - 1
            tasks.append(Task(str(f), a, -1 if last else b, last, b - a))
    return tasks


class _Range(io.RawIOBase):
    """The bytes ``[start, end)`` of a binary file (``end`` -1: to its end)."""

    def __init__(self, fh, start: int, end: int):
        fh.seek(start)
        self.fh, self.left = fh, (end - start if end >= 0 else None)

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self.fh.close()
        super().close()

    def readinto(self, buffer) -> int:
        n = len(buffer) if self.left is None else min(len(buffer), self.left)
        data = self.fh.read(n)
        buffer[: len(data)] = data
        if self.left is not None:
            self.left -= len(data)
        return len(data)


def _open_range(task: Task):
    """The task's text, as ``open(..., 'rt', errors='replace')`` reads it (newlines
    translated), so a range reads exactly as the same bytes of the whole file."""
    if task.file.endswith(".gz"):
        raw = gzip.open(task.file, "rb")
    else:
        raw = io.BufferedReader(_Range(open(task.file, "rb"), task.start, task.end))
    return io.TextIOWrapper(raw, encoding="utf-8", errors="replace")


def _encode_texts(tok: Tokenizer, texts: list[str], cuts: Cuts) -> list[list[int]]:
    """The ids of each of ``texts``, each cut into pieces at safe cuts and all the pieces
    handed to the batch encoder at once."""
    pieces, owner = [], []
    for k, text in enumerate(texts):
        step = cuts.piece_chars
        bounds = [0, *safe_cuts(text, step, cuts), len(text)] if len(text) > step else None
        for a, b in itertools.pairwise(bounds) if bounds else [(0, len(text))]:
            pieces.append(text[a:b])
            owner.append(k)
    out: list[list[int]] = [[] for _ in texts]
    for k, ids in zip(owner, tok.encode_plain(pieces), strict=True):
        out[k] += ids
    return out


def _text_blocks(task: Task, source: str, cuts: Cuts) -> Iterator[str]:
    """The task's text in blocks that end at safe cuts (the last at the range's end; a text
    without one for ``_MAX_CARRY`` characters at its last line start); the file's first block
    is checked to be text."""
    with _open_range(task) as fh:
        carry, first = "", task.start == 0
        while chunk := fh.read(_BLOCK_CHARS):
            if first:
                first = False
                corpus_lib.check_text(Path(task.file), chunk, source)
            chunk = carry + chunk
            cut = _last_safe_cut(chunk, cuts)
            if not cut and len(chunk) > _MAX_CARRY:
                cut = chunk.rfind("\n") + 1  # bounded memory before identical ids
            carry = chunk[cut:]
            if cut:
                yield chunk[:cut]
        yield carry


def _jsonl_docs(task: Task, source: str) -> Iterator[str]:
    """The ``text`` of each non-blank line of a .jsonl task's range; the file's start is
    checked to be text."""
    if task.start == 0:
        corpus_lib.check_file_start(Path(task.file), source)
    with _open_range(task) as fh:
        for local, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line).get("text")
            except (json.JSONDecodeError, AttributeError):
                text = None
            if not isinstance(text, str):
                where = f"{task.file}:{_line_of(task, local)}"
                raise ValueError(f"{where}: expected a JSON object with 'text'")
            yield text


def _line_of(task: Task, local: int) -> int:
    """The file line number of line ``local`` (1-based) of the task's range."""
    if task.start == 0:
        return local
    before, left = 0, task.start
    with open(task.file, "rb") as fh:
        while left > 0 and (block := fh.read(min(left, 1 << 24))):
            before, left = before + block.count(b"\n"), left - len(block)
    return before + local


class _Worker:
    """What one encoding process holds: the tokenizer, its framing, the cache dtype and the word
    encoder of a byte-level BPE (None for another tokenizer)."""

    def __init__(self, tok: Tokenizer, dtype: str, cuts: Cuts, source: str):
        self.tok, self.dtype, self.cuts, self.source = tok, dtype, cuts, source
        bos = tok.bos_id
        self.bos = b"" if bos is None or bos == tok.eos_id else _bytes([bos], dtype)
        self.eos = _bytes([tok.eos_id], dtype)
        self.words = bpe_words.WordEncoder.of(tok, dtype)

    def __call__(self, task: Task) -> tuple[bytes, int]:
        """The task's ids as bytes of the dtype (a .jsonl range's documents framed; a text
        range's bare) and the characters they encode. Bytes pass between processes with a
        copy less than an array."""
        try:
            if task.kind == "jsonl":
                return self._documents(_jsonl_docs(task, self.source))
            if task.kind == "parquet":
                return self._documents(corpus_lib.parquet_texts(Path(task.file), task.start))
            return self._text(task)
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:
            raise ValueError(
                f"{task.file} is not a complete gzip file ({e}); re-download or re-compress "
                f"it, or remove it from {self.source}"
            ) from None

    # Each block's ids become bytes of the cache dtype at once: a range's ids as one Python
    # list of ints would take about 36 bytes an id (a pointer and an int object) in every
    # worker, against the dtype's 2 or 4.

    def _ids(self, texts: list[str]) -> list[bytes]:
        """The ids of each of ``texts`` (bytes of the dtype): by the word encoder where it
        accepts the text, the others by the tokenizer's batch encoder in pieces."""
        out, rest = [b""] * len(texts), []
        if self.words is not None:
            self.words.learn(texts)
        for k, text in enumerate(texts):
            if self.words is not None and self.words.accepts(text):
                out[k] = self.words.encode(text)
            else:
                rest.append(k)
        if rest:
            encoded = _encode_texts(self.tok, [texts[k] for k in rest], self.cuts)
            for k, ids in zip(rest, encoded, strict=True):
                out[k] = _bytes(ids, self.dtype)
        return out

    def _text(self, task: Task) -> tuple[bytes, int]:
        parts, chars = [], 0
        for block in _text_blocks(task, self.source, self.cuts):
            chars += len(block)
            parts.append(self._ids([block])[0])
        return b"".join(parts), chars

    def _documents(self, docs: Iterator[str]) -> tuple[bytes, int]:
        parts, chars, batch, batch_chars = [], 0, [], 0

        def flush() -> None:
            for ids in self._ids(batch):
                if ids:  # an empty document gets no BOS or EOS either
                    parts.extend((self.bos, ids, self.eos))
            batch.clear()

        for text in docs:
            batch.append(text)
            batch_chars += len(text)
            chars += len(text)
            if batch_chars >= _BLOCK_CHARS:
                flush()
                batch_chars = 0
        flush()
        return b"".join(parts), chars


def _bytes(ids: list[int], dtype: str) -> bytes:
    """``ids`` as the bytes of ``dtype`` items."""
    return np.asarray(ids, dtype).tobytes()


_WORKER: _Worker | None = None  # the encoding process's own (set by _init)


def _init(tok_json: str, eos: int, bos: int | None, dtype: str, cuts: Cuts, source: str) -> None:
    global _WORKER
    # One thread per process: the processes are the parallelism.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tok = Tokenizer(tokenizers.Tokenizer.from_str(tok_json), eos_id=eos, bos_id=bos)
    _WORKER = _Worker(tok, dtype, cuts, source)


def _run(task: Task) -> tuple[bytes, int]:
    assert _WORKER is not None
    return _WORKER(task)


@contextlib.contextmanager
def _pool(n: int, tok: Tokenizer, dtype: str, cuts: Cuts, source: str):
    """``n`` encoding processes (None for ``n`` 1: encode in this one)."""
    if n == 1:
        yield None
        return
    # Workers fork from a fork server, a fresh single-threaded process (a plain fork would copy
    # the trainer's threads) that imported this module once: each spawned worker would import
    # fp8jax and jax again (about 1.5 CPU-seconds a worker). The server stays for the process'
    # later encodes (a mix's other sources), idle, about 200 MB resident.
    ctx = multiprocessing.get_context(_START)
    if _START == "forkserver":
        ctx.set_forkserver_preload([__name__])
    args = (tok.to_str(), tok.eos_id, tok.bos_id, dtype, cuts, source)
    pool = futures.ProcessPoolExecutor(n, mp_context=ctx, initializer=_init, initargs=args)
    try:
        yield pool
    except (futures.process.BrokenProcessPool, BrokenPipeError) as e:  # a worker died starting
        raise RuntimeError(
            f"the corpus encoding processes died ({e}): a script that starts training must do so "
            "under `if __name__ == '__main__':` (they import it), or set "
            "config.data.encode_workers=1"
        ) from e
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _in_order(pool: futures.Executor, tasks: list[Task], depth: int):
    """The results of ``tasks`` run by ``pool``, in order, with at most ``depth`` in flight
    (results waiting for an earlier one stay bounded in memory)."""
    rest, pending = iter(tasks), collections.deque()
    for task in itertools.islice(rest, depth):
        pending.append(pool.submit(_run, task))
    while pending:
        result = pending.popleft().result()
        if (task := next(rest, None)) is not None:
            pending.append(pool.submit(_run, task))
        yield result


def workers_for(requested: int, tasks: list[Task]) -> int:
    """Processes to encode ``tasks`` with: ``requested`` (0: one per CPU core), at most one
    per task; 1 (the calling process encodes them itself, the tokenizer's threads over its
    pieces) for a corpus of one range's size, where starting processes would cost more."""
    if sum(t.size for t in tasks) <= RANGE_BYTES:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(requested or cores or 1, len(tasks)))


def encode(
    files: list[Path],
    tok: Tokenizer,
    dtype: str,
    workers: int = 0,
    source: str = "config.data.path",
    progress: bool | None = None,
) -> Iterator[tuple[np.ndarray, int]]:
    """Yield ``(ids, chars)`` of the corpus in order: every document framed (BOS when the
    tokenizer has its own, ids, EOS; a text file's BOS and EOS as arrays of their own, with
    ``chars`` 0), ``chars`` the characters just encoded; ``ids`` are read-only. ``workers``:
    processes (0: one per CPU core); ``progress``: show a progress bar in MB/s with the time
    left (None: for corpora from ``PROGRESS_BYTES``). A file that is not text or not a
    complete gzip, or a malformed .jsonl line, raises a one-line ValueError naming it and
    ``source``."""
    cuts = cuts_for(tok)
    if cuts.piece_chars == COARSE_PIECE_CHARS:
        logging.warning(
            "the tokenizer encodes text cut at a line start differently from the whole text "
            "(it adds a prefix to each piece): encoding in pieces of %d characters",
            cuts.piece_chars,
        )
    tasks = plan(files, RANGE_BYTES, cuts)
    n = workers_for(workers, tasks)
    total = sum(t.size for t in tasks)
    hidden = total < PROGRESS_BYTES if progress is None else not progress
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="encoding", disable=hidden)
    t0, doc_tokens, eos = time.perf_counter(), 0, tok.eos_id
    bos = [] if tok.bos_id is None or tok.bos_id == eos else [tok.bos_id]
    try:
        with _pool(n, tok, dtype, cuts, source) as pool:
            results = (
                _in_order(pool, tasks, 2 * n)
                if pool
                else map(_Worker(tok, dtype, cuts, source), tasks)
            )
            for task, (raw, chars) in zip(tasks, results, strict=True):
                bar.update(task.size)
                ids = np.frombuffer(raw, dtype)
                if task.kind != "text":
                    yield ids, chars
                    continue
                # BOS and EOS come as arrays of their own (joined to the range's ids, they
                # would copy them).
                if len(ids) and not doc_tokens and bos:
                    yield np.asarray(bos, dtype), 0
                doc_tokens += len(ids)
                yield ids, chars
                if task.last and doc_tokens:  # empty documents get no separator either
                    yield np.asarray([eos], dtype), 0
                if task.last:
                    doc_tokens = 0
    finally:
        bar.close()  # a failure's one-line error starts on a line of its own
    secs = time.perf_counter() - t0
    logging.info(
        "encoded %.1f MB in %.1fs (%.2f MB/s, %d process%s)",
        total / 1e6,
        secs,
        total / 1e6 / max(secs, 1e-9),
        n,
        "es" if n > 1 else "",
    )
