"""Corpus sources beyond text files: token shards (``data.format='tokens'``), parquet, .jsonl.gz.

Token shards are read as they are: the training stream must be exactly the training shards'
ids (a shard boundary that drops or repeats an id fails here), the validation split whole
shards or whole documents that training never sees, and bad shards a one-line DataError.
"""

import gzip
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fp8jax import errors, tokenizer
from fp8jax.trainer import corpus, encode, environment, formats, loop, token_shards

from fp8_testing import data_run


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tokenizer (saved as a HF dir) and documents of the shipped corpus."""
    root = tmp_path_factory.mktemp("sources")
    with gzip.open(corpus.SHIPPED_DIR / "persuasion.txt.gz", "rt", encoding="utf-8") as f:
        paragraphs = [p for p in f.read().split("\n\n") if p.strip()][:400]
    tok = tokenizer.train(paragraphs[:100], vocab_size=400)
    (root / "tok").mkdir()
    tok.save(root / "tok" / "tokenizer.json")
    return root, tok, paragraphs


def _ids(tok, docs) -> np.ndarray:
    return np.concatenate([np.asarray([*tok.encode(d), tok.eos_id]) for d in docs])


def _build(setup, path, work, val_fraction=0.25, **data):
    root, *_ = setup
    run = data_run(path, 300, val_fraction=val_fraction, tokenizer=str(root / "tok"), **data)
    run, tok = loop.data_tokenizer(run, str(work), None)
    return formats.build(run, work, tok)


def test_token_shards_are_read_exactly_and_split_by_shard(setup, tmp_path):
    _, tok, docs = setup
    streams = [_ids(tok, docs[k::4]) for k in range(4)]
    folder = tmp_path / "shards"
    folder.mkdir()
    np.save(folder / "0.npy", streams[0].astype(np.uint16))
    token_shards.write_bin(folder / "1.bin", streams[1].astype(np.uint32))
    np.save(folder / "2.npy", streams[2].astype(np.int32))
    token_shards.write_bin(folder / "3.bin", streams[3].astype(np.uint16))
    ds = _build(setup, folder, tmp_path / "work", format="tokens")
    # val: one whole shard of four (the last of its stride), train: the others, in order.
    np.testing.assert_array_equal(np.asarray(ds.val_tokens), streams[3])
    np.testing.assert_array_equal(np.asarray(ds.train_tokens), np.concatenate(streams[:3]))
    # Windows that straddle shard boundaries read the concatenated stream.
    whole = np.concatenate(streams[:3])
    for edge in np.cumsum([len(s) for s in streams[:2]]):
        for a, b in ((edge - 5, edge + 7), (edge, edge + 1), (edge - 1, edge)):
            np.testing.assert_array_equal(ds.train_tokens[a:b], whole[a:b])
    batch = next(ds.train_iter(process_index=0, process_count=1))
    assert batch["inputs"].shape == (4, 16) and batch["inputs"].max() < tok.vocab_size
    assert not (tmp_path / "work" / "tokens").exists()  # nothing encoded or copied
    # A shard changed after its check: the stream refuses the window, naming the shards.
    edited = np.load(folder / "2.npy", mmap_mode="r+")
    edited[:] = tok.vocab_size
    edited.flush()
    stream = ds.train_iter(process_index=0, process_count=1)
    with pytest.raises(errors.DataError, match=rf"token shards of folder {folder} .* holds id"):
        for _ in range(len(whole) // 17 // 4 + 1):  # an epoch
            next(stream)


def test_a_glob_names_the_files_it_matches_and_those_of_its_folders(setup, tmp_path):
    """``data.path`` as a glob pattern: the matched files of the format's kinds and the
    matched folders' files, once each in path order (``**`` spans folders); shards named by a
    glob train as the same shards named one folder does; no match is a one-line DataError."""
    _, tok, docs = setup
    root = tmp_path / "corpus"
    (root / "a" / "deep").mkdir(parents=True)
    (root / "b").mkdir()
    for rel in ("a/1.txt", "a/deep/2.txt", "b/3.txt", "b/4.txt"):
        (root / rel).write_text("text\n")
    (root / "a" / "notes.md").write_text("not a corpus file\n")
    got, desc = corpus.source_files(str(root / "**" / "*.txt"))
    assert got == sorted(root / r for r in ("a/1.txt", "a/deep/2.txt", "b/3.txt", "b/4.txt"))
    assert desc.startswith("pattern ")
    got, _ = corpus.source_files(str(root / "?" / "*"))  # matches folder 'deep' and notes.md
    assert got == sorted(root / r for r in ("a/1.txt", "a/deep/2.txt", "b/3.txt", "b/4.txt"))
    assert corpus.source_files(str(root / "b" / "[3]*"))[0] == [root / "b" / "3.txt"]
    with pytest.raises(errors.DataError, match=r"pattern .*\*\.parquet' matches no") as e:
        corpus.source_files(str(root / "*.parquet"))
    assert "\n" not in str(e.value)
    # train.py's config check passes a pattern that matches and refuses one that does not.
    environment.check_corpus(data_run(root / "**" / "*.txt", 300))
    with pytest.raises(errors.ConfigError, match=r"\*\.parquet' is a glob pattern that matches no"):
        environment.check_corpus(data_run(root / "*.parquet", 300))
    with pytest.raises(errors.ConfigError, match=r"nope\.txt' does not exist"):
        environment.check_corpus(data_run(root / "nope.txt", 300))
    # Each format's own fix: a missing path of token shards names shards, not text files.
    with pytest.raises(errors.ConfigError, match=r"does not exist: .* a \.npy or \.bin token"):
        environment.check_corpus(data_run(root / "nope", 300, format="tokens", tokenizer="t"))
    shards = tmp_path / "shards"
    shards.mkdir()
    streams = [_ids(tok, docs[k::4]) for k in range(4)]
    for k, stream in enumerate(streams):
        np.save(shards / f"{k}.npy", stream.astype(np.uint16))
    (shards / "README").write_text("shards of the test\n")
    by_glob = _build(setup, str(shards / "*.npy"), tmp_path / "w1", format="tokens")
    by_folder = _build(setup, shards, tmp_path / "w2", format="tokens")
    for split in ("train_tokens", "val_tokens"):
        got, want = getattr(by_glob, split), getattr(by_folder, split)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_one_shard_splits_at_a_document_end(setup, tmp_path):
    _, tok, docs = setup
    ids = _ids(tok, docs)
    np.save(tmp_path / "all.npy", ids.astype(np.uint16))
    ds = _build(setup, tmp_path / "all.npy", tmp_path / "work", format="tokens")
    train, val = np.asarray(ds.train_tokens), np.asarray(ds.val_tokens)
    np.testing.assert_array_equal(np.concatenate([train, val]), ids)
    assert train[-1] == tok.eos_id and val[-1] == tok.eos_id  # whole documents on each side
    val_docs = tok.decode(val).split(tokenizer.EOS)[:-1]
    assert val_docs == docs[len(docs) - len(val_docs) :]  # the last documents, none cut
    assert 0.2 < len(val) / len(ids) <= 0.3


@pytest.mark.parametrize(
    "kind, match",
    [
        ("beyond_vocab", r"holds id 400 at position 3, outside the tokenizer's 400 ids"),
        ("uint8", r"uint8 \(at most 255\) but the tokenizer has 400 ids"),
        ("no_header", r"no fp8jax token-shard header"),
        ("truncated", r"truncated"),
        ("as_text", r"is a token shard, not text: set config.data.format='tokens'"),
        ("no_tokenizer", r"holds token ids, not text: set config.data.tokenizer"),
    ],
)
def test_bad_token_shards_are_one_line_errors(setup, tmp_path, kind, match):
    _, tok, docs = setup
    ids = _ids(tok, docs[:50]).astype(np.uint16)
    path = tmp_path / ("s.bin" if kind in ("no_header", "truncated") else "s.npy")
    if kind == "beyond_vocab":
        ids[3] = tok.vocab_size
    if path.suffix == ".npy":
        np.save(path, ids.astype(np.uint8) if kind == "uint8" else ids)
    if kind == "no_header":
        ids.tofile(path)  # nanoGPT's raw layout
    if kind == "truncated":
        token_shards.write_bin(path, ids)
        path.write_bytes(path.read_bytes()[:-2])
    work = tmp_path / "work"
    with pytest.raises(errors.DataError, match=match):
        if kind == "no_tokenizer":
            run = data_run(path, 300, format="tokens")
            formats.build(run, work)
        else:
            _build(setup, path, work, format="text" if kind == "as_text" else "tokens")
    assert not work.exists()


def test_array_record_shards_read_records_as_one_stream(setup, tmp_path):
    pytest.importorskip("array_record")
    from fp8jax.trainer import array_records

    _, tok, docs = setup
    folder = tmp_path / "records"
    folder.mkdir()
    documents = [[np.asarray([*tok.encode(d), tok.eos_id]) for d in docs[k::3]] for k in range(3)]
    dtypes = (np.uint16, np.int32, np.uint32)
    for k, (part, dtype) in enumerate(zip(documents, dtypes, strict=True)):
        array_records.write(folder / f"{k}.array_record", (ids.astype(dtype) for ids in part))
    np.save(folder / "3.npy", _ids(tok, docs[:40]).astype(np.uint16))  # kinds mix in a folder
    streams = [np.concatenate(part) for part in documents] + [_ids(tok, docs[:40])]
    ds = _build(setup, folder, tmp_path / "work", format="tokens")
    # val: the last of four shards; train: the three ArrayRecord files' records, in order.
    np.testing.assert_array_equal(np.asarray(ds.val_tokens), streams[3])
    whole = np.concatenate(streams[:3])
    np.testing.assert_array_equal(np.asarray(ds.train_tokens), whole)
    ends = np.cumsum([len(ids) for ids in documents[0]])[:50]  # record boundaries of file 0
    for edge in [*ends, *np.cumsum([len(s) for s in streams[:2]])]:
        for a, b in ((edge - 5, edge + 7), (edge, edge + 1), (edge - 1, edge)):
            np.testing.assert_array_equal(ds.train_tokens[a:b], whole[a:b])
    batch = next(ds.train_iter(process_index=0, process_count=1))
    assert batch["inputs"].shape == (4, 16)
    # One file alone splits at a document end, lazily; a record that is not ids is refused.
    one = _build(setup, folder / "1.array_record", tmp_path / "w1", format="tokens")
    train, val = np.asarray(one.train_tokens), np.asarray(one.val_tokens)
    np.testing.assert_array_equal(np.concatenate([train, val]), streams[1])
    assert train[-1] == tok.eos_id and val[-1] == tok.eos_id and 0.2 < len(val) / len(streams[1])
    from array_record.python.array_record_module import ArrayRecordWriter

    writer = ArrayRecordWriter(str(tmp_path / "bad.array_record"), "group_size:1")
    writer.write(b"not an array")
    writer.close()
    with pytest.raises(errors.DataError, match=r"bad.array_record: record 0 is not a 1-D"):
        _build(setup, tmp_path / "bad.array_record", tmp_path / "w2", format="tokens")
    # A file array_record cannot read (cut short, or not ArrayRecord at all): one line too.
    whole_file = (folder / "0.array_record").read_bytes()
    for name, data in (("cut", whole_file[: len(whole_file) // 2]), ("junk", b"not records")):
        (tmp_path / f"{name}.array_record").write_bytes(data)
        with pytest.raises(errors.DataError, match=rf"{name}.array_record is not a readable"):
            _build(setup, tmp_path / f"{name}.array_record", tmp_path / "w2", format="tokens")
    beyond = [ids.astype(np.uint16) for ids in documents[0][:20]]
    beyond[3][2] = tok.vocab_size
    array_records.write(tmp_path / "beyond.array_record", beyond)
    at = sum(len(ids) for ids in beyond[:3]) + 2  # its position in the file's stream
    with pytest.raises(errors.DataError, match=rf"holds id {tok.vocab_size} at position {at},"):
        _build(setup, tmp_path / "beyond.array_record", tmp_path / "w2", format="tokens")
    assert not (tmp_path / "w2").exists()


def test_array_record_lengths_are_kept_beside_the_file(tmp_path, monkeypatch):
    """The first open of an ArrayRecord file reads each record once and keeps their lengths
    beside it, so a second open reads none; a rewritten or touched file's, or unreadable ones,
    are rebuilt; a read-only folder is measured at every open and gets nothing written."""
    pytest.importorskip("array_record")
    import grain

    from fp8jax.trainer import array_records

    reads = []

    class Counted(grain.sources.ArrayRecordDataSource):  # counts the records read
        def __getitem__(self, k):
            reads.append(k)
            return super().__getitem__(k)

        def __getitems__(self, keys):
            reads.extend(keys)
            return super().__getitems__(keys)

    monkeypatch.setattr(grain.sources, "ArrayRecordDataSource", Counted)

    def opened(path, docs):  # a new process's open: the records it read, its ids checked
        reads.clear()
        ids = array_records.RecordIds(path)
        count = len(reads)
        np.testing.assert_array_equal(ids[0 : len(ids)], np.concatenate(docs))
        assert ids.dtype == docs[0].dtype
        return count

    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 300, n, dtype=np.uint16) for n in rng.integers(1, 20, 50)]
    folder = tmp_path / "data"
    folder.mkdir()
    path = folder / "docs.array_record"
    array_records.write(path, docs)
    kept = array_records.lengths_path(path)
    assert opened(path, docs) == len(docs) and kept.is_file()
    assert opened(path, docs) == 0
    assert kept.parent == folder
    other = [d.astype(np.int32) for d in docs[:20]]  # rewritten: other records, another dtype
    array_records.write(path, other)
    assert opened(path, other) == len(other)
    assert opened(path, other) == 0
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # same bytes, touched
    assert opened(path, other) == len(other)
    kept.write_bytes(b"not an npz")
    assert opened(path, other) == len(other)
    assert opened(path, other) == 0

    read_only = tmp_path / "read_only"
    read_only.mkdir()
    array_records.write(read_only / "docs.array_record", docs)

    def refused(*args, **kwargs):  # what a read-only folder answers (also to root)
        raise PermissionError(13, "Permission denied", str(read_only))

    monkeypatch.setattr(array_records.tempfile, "mkstemp", refused)
    read_only.chmod(0o555)
    try:
        assert opened(read_only / "docs.array_record", docs) == len(docs)
        assert opened(read_only / "docs.array_record", docs) == len(docs)
        assert sorted(p.name for p in read_only.iterdir()) == ["docs.array_record"]
    finally:
        read_only.chmod(0o755)


def test_parquet_and_jsonl_gz_encode_each_row_or_line_as_a_document(setup, tmp_path, monkeypatch):
    _, tok, docs = setup
    table = pa.table({"id": list(range(len(docs))), "text": docs})
    pq.write_table(table, tmp_path / "docs.parquet", row_group_size=64)
    with gzip.open(tmp_path / "docs.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    reference = _ids(tok, docs)
    monkeypatch.setattr(encode, "RANGE_BYTES", 1 << 10)  # small enough for worker processes
    for name in ("docs.parquet", "docs.jsonl.gz"):
        tasks = encode.plan([tmp_path / name])
        assert len(tasks) == (7 if name.endswith("parquet") else 1)  # a task per row group
        got = np.concatenate([i for i, _ in encode.encode([tmp_path / name], tok, "uint16", 2)])
        np.testing.assert_array_equal(got, reference)
    pq.write_table(pa.table({"body": docs[:3]}), tmp_path / "bad.parquet")
    with pytest.raises(errors.DataError, match=r"bad.parquet has no 'text' column.*body"):
        with errors.reraise_as(errors.DataError, ValueError):
            _build(setup, tmp_path / "bad.parquet", tmp_path / "work")
    assert not (tmp_path / "work").exists()
