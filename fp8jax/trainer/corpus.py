"""Corpus files: which files ``config.data.path`` names, their documents, their fingerprint."""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import zlib
from collections.abc import Iterator
from pathlib import Path

from absl import logging

from fp8jax import provenance
from fp8jax.errors import DataError

__all__ = [
    "FIX",
    "FULL_HASH_BYTES",
    "SAMPLE_BLOCK",
    "SAMPLE_BYTES",
    "SHIPPED_DIR",
    "JSONL",
    "PARQUET",
    "TEXT_SUFFIXES",
    "check_file_start",
    "check_not_empty",
    "check_text",
    "fingerprint",
    "is_pattern",
    "names_files",
    "not_text",
    "parquet_file",
    "parquet_texts",
    "pieces",
    "sample_offsets",
    "sampled_digest",
    "source_files",
    "spread_starts",
    "text_size",
]

SHIPPED_DIR = Path(__file__).resolve().parents[1] / "data"
_HASH_CHUNK = 1 << 22  # bytes read per step while fingerprinting the corpus
FULL_HASH_BYTES = 1 << 28  # corpora up to this size are fingerprinted by every byte
SAMPLE_BYTES = 1 << 26  # bytes a larger corpus' fingerprint reads, spread over its files
SAMPLE_BLOCK = 1 << 16  # bytes of one sampled block
_READ_CHARS = 1 << 22  # text read and encoded per piece, so huge files never sit in memory whole
# a text corpus folder's files
TEXT_SUFFIXES = (".txt", ".txt.gz", ".jsonl", ".jsonl.gz", ".parquet")
JSONL = (".jsonl", ".jsonl.gz")  # files of one JSON document per line
PARQUET = ".parquet"  # files of one document per row, in a 'text' column
FIX = (
    "set config.data.path to a text file, a folder of .txt files, a .jsonl or .parquet file "
    "with a 'text' field per line or row, or a glob pattern of them ('' = the shipped corpus)"
)


def source_files(
    path: str, suffixes: tuple[str, ...] = TEXT_SUFFIXES, fix: str = FIX
) -> tuple[list[Path], str]:
    """Files of the source named by ``config.data.path`` (a file, or a folder's files ending in
    one of ``suffixes``, or a glob pattern such as ``shards/*.parquet`` or ``web/**/*.txt``
    whose matches are such files and folders; '' = the shipped corpus) and a description for
    logs. DataError, whose message ends in ``fix``, when there are none."""
    if not path:
        files = sorted(SHIPPED_DIR.glob("*.txt.gz"))
        if not files:
            raise DataError(f"no corpus in {SHIPPED_DIR}; reinstall fp8jax or {fix}")
        return files, f"shipped corpus ({len(files)} Jane Austen novels in {SHIPPED_DIR})"
    p = Path(path).expanduser()
    if is_pattern(path):
        return _glob_files(str(p), suffixes, fix)
    if not p.exists():
        raise DataError(f"data path {str(p)!r} does not exist; {fix}")
    p = p.resolve()  # messages and the data record name the file, whatever the cwd was
    if p.is_file():
        return [p], f"file {p}"
    if _is_workdir(p):  # its text is orbax's markers and the run's metrics
        raise DataError(f"data folder {str(p)!r} is an fp8jax work dir, not a corpus; {fix}")
    found = [f for f in p.rglob("*") if f.is_file()]
    # A work dir inside the corpus folder (a run's --workdir there) is not part of the corpus:
    # its files would change the corpus under the run at each resume.
    runs = {f.parent for f in found if f.name == provenance.MODEL_RECORD and _is_workdir(f.parent)}
    if runs:
        logging.warning("data folder %s: not reading the fp8jax work dirs %s", p, sorted(runs))
    files = sorted(
        f for f in found if f.name.endswith(suffixes) and not runs.intersection(f.parents)
    )
    if not files:
        kinds = " or ".join(sorted({s.removesuffix(".gz") for s in suffixes}, reverse=True))
        raise DataError(f"data folder {str(p)!r} has no {kinds} files; {fix}")
    return files, f"folder {p} ({len(files)} files)"


def names_files(path: str) -> bool:
    """Whether ``config.data.path`` names something: a file or folder that exists, or a glob
    pattern that matches one (``source_files`` then says whether it holds a corpus)."""
    p = Path(path).expanduser()
    return p.exists() or (is_pattern(path) and bool(glob.glob(str(p), recursive=True)))


def is_pattern(path: str) -> bool:
    """Whether ``config.data.path`` is read as a glob pattern: no such file or folder, and it
    holds ``*``, ``?`` or ``[``."""
    p = Path(path).expanduser()
    return not p.exists() and glob.has_magic(str(p))


def _glob_files(pattern: str, suffixes: tuple[str, ...], fix: str) -> tuple[list[Path], str]:
    """``source_files`` of a glob pattern (``**`` spans folders): the matched files ending in
    one of ``suffixes`` and those of the matched folders, each once, in path order."""
    matches = [Path(m).resolve() for m in glob.glob(pattern, recursive=True)]
    files = {f for f in matches if f.is_file() and f.name.endswith(suffixes)}
    for folder in (m for m in matches if m.is_dir()):
        try:
            files.update(source_files(str(folder), suffixes, fix)[0])
        except DataError:  # a matched folder without such files (or a work dir) adds none
            continue
    if not files:
        kinds = " or ".join(sorted({s.removesuffix(".gz") for s in suffixes}, reverse=True))
        raise DataError(f"data path pattern {pattern!r} matches no {kinds} files; {fix}")
    return sorted(files), f"pattern {pattern} ({len(files)} files)"


def _is_workdir(folder: Path) -> bool:
    """Whether ``folder`` is an fp8jax work dir that has trained (its model record, and
    checkpoints or metrics)."""
    run = (folder / "checkpoints").is_dir() or (folder / "metrics.jsonl").is_file()
    return run and (folder / provenance.MODEL_RECORD).is_file()


def _is_jsonl(f: Path) -> bool:
    return f.name.endswith(JSONL)


def fingerprint(files: list[Path]) -> str:
    """SHA-256 over each file's content digest and how it is parsed, in order: the corpus
    identity (the data record's and every cache key's).

    A corpus of up to ``FULL_HASH_BYTES`` is hashed whole, so any edit is seen even if size and
    mtime are kept. A larger one is hashed by sample (:func:`sampled_digest`): each file's size
    and about ``SAMPLE_BYTES`` of blocks spread over the corpus, so a start reads at most that
    much whatever the corpus' size. The trade-off: an edit that keeps every file's size and
    touches no sampled block is not seen (the cache and resume check treat the corpus as the
    same); a file that grows or shrinks, or changes in a sampled block, is. mtimes are not part
    of it, so a copied or touched corpus keeps its caches and resumes.
    """
    total = sum(f.stat().st_size for f in files)
    full = total <= FULL_HASH_BYTES
    outer = hashlib.sha256()
    for f in files:
        if full:
            inner = hashlib.sha256()
            with open(f, "rb") as fh:
                while chunk := fh.read(_HASH_CHUNK):
                    inner.update(chunk)
            digest = inner.hexdigest()
        else:
            digest = "sampled " + sampled_digest(f, SAMPLE_BYTES * f.stat().st_size // total)
        kind = "jsonl" if _is_jsonl(f) else "parquet" if f.name.endswith(PARQUET) else "text"
        outer.update(f"{kind} {digest}\n".encode())
    return outer.hexdigest()


def sample_offsets(size: int, budget: int) -> list[int]:
    """Start offsets of the ``SAMPLE_BLOCK``-byte blocks a sampled digest reads in a file of
    ``size`` bytes: its first and last block and evenly spaced ones, about ``budget`` bytes."""
    if size <= 2 * SAMPLE_BLOCK:
        return [0]  # the whole file is its first block and the tail
    return spread_starts(size - SAMPLE_BLOCK, max(2, -(-budget // SAMPLE_BLOCK)))


def spread_starts(last: int, count: int) -> list[int]:
    """``count`` (at least 2) start offsets spaced evenly from 0 to ``last``, both included,
    sorted (fewer where they coincide): where a sampled check reads its blocks."""
    return sorted({i * last // (count - 1) for i in range(count)})


def sampled_digest(f: Path, budget: int) -> str:
    """SHA-256 of ``f``'s size and the blocks at :func:`sample_offsets` (about ``budget``
    bytes, never less than its first and last block)."""
    size = f.stat().st_size
    h = hashlib.sha256(f"{size}\n".encode())
    block = size if size <= 2 * SAMPLE_BLOCK else SAMPLE_BLOCK  # a small file: all of it
    with open(f, "rb") as fh:
        for offset in sample_offsets(size, budget):
            fh.seek(offset)
            h.update(fh.read(block))
    return h.hexdigest()


def text_size(files: list[Path]) -> int:
    """The bytes of text ``files`` hold: a file's size, a .gz file's uncompressed size (its
    gzip trailer's, which counts modulo 4 GiB: at least the compressed size)."""
    total = 0
    for f in files:
        size = f.stat().st_size
        if f.name.endswith(".gz") and size >= 4:
            with open(f, "rb") as fh:
                fh.seek(-4, 2)
                size = max(size, int.from_bytes(fh.read(4), "little"))
        total += size
    return total


def _open_text(f: Path):
    opener = gzip.open if f.name.endswith(".gz") else open
    return opener(f, "rt", encoding="utf-8", errors="replace")


_SNIFF_CHARS = 1 << 16  # characters of each text file checked for being text
_TEXT_CONTROLS = frozenset("\t\n\r\f\v\x1b")  # control characters that text may hold


def not_text(sample: str) -> str | None:
    """Why ``sample`` (the start of a file, decoded with errors='replace') is not text, or None.

    NUL characters, or more than 1% of characters that are undecodable bytes or control
    characters, mark a binary file (an executable, an image, a compressed file named .txt).
    """
    if "\x00" in sample:
        return f"it holds NUL bytes (at character {sample.index(chr(0))})"
    if not sample:
        return None
    bad = sample.count("\ufffd")
    controls = sum(1 for c in sample if c < " " and c not in _TEXT_CONTROLS)
    if bad > len(sample) // 100:
        return f"{bad} of its first {len(sample)} characters are not UTF-8"
    if controls > len(sample) // 100:
        return f"{controls} of its first {len(sample)} characters are control characters"
    return None


def check_text(f: Path, start: str, source: str) -> None:
    """A one-line ValueError naming ``f`` and ``source`` (the setting that named it) when the
    ``start`` of its text is not text (:func:`not_text`)."""
    reason = not_text(start[:_SNIFF_CHARS])
    if reason:
        raise ValueError(
            f"{f} is not a text file: {reason}; remove it from "
            f"{source}, or decompress or convert it to UTF-8 text"
        )


def check_file_start(f: Path, source: str) -> None:
    """:func:`check_text` on the start of the file ``f`` (a .jsonl file, whose lines are read
    one by one)."""
    with _open_text(f) as fh:
        check_text(f, fh.read(_SNIFF_CHARS), source)


def pieces(files: list[Path], source: str = "config.data.path") -> Iterator[tuple[str, bool]]:
    """Yield ``(text, ends_document)``: a text file is one document, a .jsonl line is one.

    A file that is not text (``not_text``), or a .gz that is not a complete gzip file, raises a
    one-line ValueError naming it and ``source``, the setting that named the files.
    """
    for f in files:
        try:
            yield from _file_pieces(f, source)
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:
            raise ValueError(
                f"{f} is not a complete gzip file ({e}); re-download or re-compress it, or "
                f"remove it from {source}"
            ) from None


def parquet_file(f: Path, source: str = "config.data.path"):
    """``f`` opened as a ``pyarrow.parquet.ParquetFile`` with a ``text`` column of strings; a
    one-line ValueError naming it and ``source`` otherwise (or without pyarrow)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"reading {f} needs pyarrow: pip install 'fp8jax[parquet]'") from None
    try:
        pf = pq.ParquetFile(f)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"{f} is not a parquet file ({e}); remove it from {source}") from None
    schema = pf.schema_arrow
    field = schema.field("text") if "text" in schema.names else None
    if field is None or not (
        pa.types.is_string(field.type) or pa.types.is_large_string(field.type)
    ):
        raise ValueError(
            f"{f} has no 'text' column of strings (its columns: {', '.join(schema.names)}); "
            f"rename the column that holds the documents to 'text', or remove it from {source}"
        )
    return pf


def parquet_texts(f: Path, row_group: int | None = None) -> Iterator[str]:
    """The ``text`` of each row of a parquet file (null: an empty document), read one row group
    at a time (``row_group``: only that one)."""
    pf = parquet_file(f)
    groups = range(pf.num_row_groups) if row_group is None else [row_group]
    for g in groups:
        for text in pf.read_row_group(g, columns=["text"]).column("text").to_pylist():
            yield text or ""


def _file_pieces(f: Path, source: str) -> Iterator[tuple[str, bool]]:
    if f.name.endswith(PARQUET):
        parquet_file(f, source)
        for text in parquet_texts(f):
            yield text, True
        return
    with _open_text(f) as fh:
        if _is_jsonl(f):
            check_file_start(f, source)
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line).get("text")
                except (json.JSONDecodeError, AttributeError):
                    text = None
                if not isinstance(text, str):
                    raise ValueError(f"{f}:{lineno}: expected a JSON object with 'text'")
                yield text, True
            return
        carry, first = "", True
        while chunk := fh.read(_READ_CHARS):
            if first:
                first = False
                check_text(f, chunk, source)
            chunk = carry + chunk
            # Cut at a line break so no word is split between two encode calls.
            cut = chunk.rfind("\n") + 1 or len(chunk)
            carry = chunk[cut:]
            yield chunk[:cut], False
        yield carry, True


def check_not_empty(files: list[Path], desc: str) -> None:
    """Raise DataError if no file holds any non-blank text."""
    # Before any tokenizer is trained: one trained on nothing would be cached and reused.
    if not any(text.strip() for text, _ in pieces(files)):
        raise DataError(f"no text found in {desc}; {FIX}")
