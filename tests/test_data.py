"""Data pipeline: tokenizer, token cache, sources, resumable training stream, validation split."""

import gzip
import json

import numpy as np
import pytest

from fp8jax import errors, tokenizer
from fp8jax.trainer import corpus as corpus_lib
from fp8jax.trainer import data

from fp8_testing import data_run, novel

VOCAB = 300


def _config(path="", vocab=VOCAB, seed=0, val_fraction=0.2, batch_size=4, seq_len=16):
    return data_run(path, vocab, seed, val_fraction, batch_size, seq_len, tokenizer_min_frequency=2)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, novel_file):
    """A ~40 kB text file, its work dir and the built dataset (shared by read-only tests)."""
    root = tmp_path_factory.mktemp("corpus")
    path = novel_file("persuasion", 40_000)
    return path, root / "work", data.build(_config(path), root / "work")


def _find(tokens, seq):
    """Start of ``seq`` in ``tokens`` (the first match)."""
    for s in np.flatnonzero(tokens[: len(tokens) - len(seq) + 1] == seq[0]):
        if np.array_equal(tokens[s : s + len(seq)], seq):
            return s
    raise AssertionError("window not found in the training tokens")


def _take(it, n):
    return [next(it) for _ in range(n)]


def _same(batches_a, batches_b):
    return all(
        np.array_equal(a[k], b[k]) for a, b in zip(batches_a, batches_b, strict=True) for k in a
    )


def test_tokenizer_round_trip_and_exact_vocab():
    tok = tokenizer.train([novel("persuasion", 20_000)], vocab_size=VOCAB)
    assert tok.vocab_size == VOCAB
    for text in ["Anne Elliot, said he.\n\n  x", "héllo wörld ✓ 数据 \t\r\n", ""]:
        assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode("a") + [tok.eos_id]) == "a" + tokenizer.EOS
    # Too little text for all merges: padded so the id range still equals the model's vocab.
    assert tokenizer.train(["tiny text"], vocab_size=400).vocab_size == 400
    with pytest.raises(ValueError, match="vocab_size"):
        tokenizer.train(["x"], vocab_size=100)


def test_batches_are_shifted_windows_of_train_tokens(corpus):
    *_, ds = corpus
    batch = next(ds.train_iter(process_index=0, process_count=1))
    inputs_BxL, targets_BxL = batch["inputs"], batch["targets"]
    assert inputs_BxL.shape == targets_BxL.shape == (4, 16)
    assert inputs_BxL.dtype == targets_BxL.dtype == np.int32
    np.testing.assert_array_equal(inputs_BxL[:, 1:], targets_BxL[:, :-1])
    train = np.asarray(ds.train_tokens, np.int32)
    for row_inputs, row_targets in zip(inputs_BxL, targets_BxL, strict=True):
        _find(train, np.concatenate([row_inputs, row_targets[-1:]]))
    assert inputs_BxL.max() < ds.tokenizer.vocab_size


def test_cache_reused_and_refreshed_on_change(corpus, tmp_path, monkeypatch):
    path, work, ds = corpus
    src, wd = tmp_path / "book.txt", tmp_path / "work"
    src.write_text(path.read_text())
    data.build(_config(src), wd)
    tok_mtime = (wd / "tokenizer.json").stat().st_mtime_ns

    def fail(*args, **kwargs):
        raise AssertionError("rebuilt although the cache matches")

    with monkeypatch.context() as m:
        m.setattr(data, "_encode_corpus", fail)
        m.setattr(tokenizer, "train", fail)
        again = data.build(_config(src), wd)
    assert again.num_train_tokens == ds.num_train_tokens
    assert isinstance(again.train_tokens, np.memmap) and again.train_tokens.dtype == np.uint16

    src.write_text(path.read_text() + "\n\nA new closing paragraph.\n")
    changed = data.build(_config(src), wd)  # no checkpoint: both caches follow the new text
    ref = tokenizer.train([src.read_text()], VOCAB)
    assert (wd / "tokenizer.json").stat().st_mtime_ns != tok_mtime
    assert changed.tokenizer.to_str() == ref.to_str()
    assert changed.num_train_tokens + changed.num_val_tokens == len(ref.encode(src.read_text())) + 1


def test_batches_deterministic_per_seed(corpus):
    path, work, ds = corpus
    first = _take(ds.train_iter(process_index=0, process_count=1), 3)
    assert _same(first, _take(ds.train_iter(process_index=0, process_count=1), 3))
    other = data.build(_config(path, seed=1), work)
    assert not _same(first, _take(other.train_iter(process_index=0, process_count=1), 3))


def test_resume_exact_including_json_and_epoch_wrap(corpus):
    *_, ds = corpus
    # Long windows so an epoch is only a few batches and the restore crosses epoch boundaries.
    make = lambda: ds.train_iter(batch_size=8, seq_len=255, process_index=0, process_count=1)
    it = make()
    _take(it, 5)
    state = it.get_state()
    expected = _take(it, 6)
    for saved in (state, data.state_to_bytes(state), json.loads(json.dumps(state))):
        resumed = make()
        resumed.set_state(saved)
        assert _same(_take(resumed, 6), expected)
    # Changing the global batch size keeps the sample position.
    bigger = ds.train_iter(batch_size=16, seq_len=255, process_index=0, process_count=1)
    bigger.set_state(state)
    assert bigger.step == 5 * 8 // 16


def test_epochs_cover_disjoint_windows_and_reshuffle(corpus):
    *_, ds = corpus
    W = 64
    num_windows = ds.num_train_tokens // W - 1
    it = ds.train_iter(batch_size=num_windows, seq_len=W - 1, process_index=0, process_count=1)
    train = np.asarray(ds.train_tokens, np.int32)
    orders = []
    for _ in range(2):  # one batch == one epoch here
        inputs_BxL = next(it)["inputs"]
        starts = np.array([_find(train, row) for row in inputs_BxL])
        # Non-overlapping: one shared offset, every window start distinct and W apart.
        assert len(set(starts % W)) == 1 and len(set(starts)) == num_windows
        orders.append(np.argsort(starts))
    assert not np.array_equal(orders[0], orders[1])  # each epoch has its own order


def test_processes_share_the_global_batch(corpus):
    *_, ds = corpus
    global_its = _take(ds.train_iter(batch_size=8, process_index=0, process_count=1), 3)
    shard_its = [ds.train_iter(batch_size=8, process_index=p, process_count=2) for p in (0, 1)]
    shards = [_take(it, 3) for it in shard_its]
    for t, batch in enumerate(global_its):
        joined = np.concatenate([shards[0][t]["inputs"], shards[1][t]["inputs"]])
        np.testing.assert_array_equal(joined, batch["inputs"])
    evals = [ds.eval_batches(2, 8, process_index=p, process_count=2) for p in (0, 1)]
    whole = ds.eval_batches(2, 8, process_index=0, process_count=1)
    np.testing.assert_array_equal(
        np.concatenate([evals[0][1]["targets"], evals[1][1]["targets"]]), whole[1]["targets"]
    )
    with pytest.raises(ValueError, match="not divisible"):
        ds.train_iter(batch_size=5, process_index=0, process_count=2)


def test_validation_disjoint_from_train_and_deterministic(corpus):
    *_, ds = corpus
    total = ds.num_train_tokens + ds.num_val_tokens
    assert 0.1 * total < ds.num_val_tokens <= 0.2 * total
    batches = ds.eval_batches(3, process_index=0, process_count=1)
    assert _same(batches, ds.eval_batches(3, process_index=0, process_count=1))
    inputs_NxL = np.concatenate([b["inputs"] for b in batches])
    targets_NxL = np.concatenate([b["targets"] for b in batches])
    windows = list(np.concatenate([inputs_NxL, targets_NxL[:, -1:]], axis=1))
    # 12 windows spread evenly over the whole split, from its start to its last twelfth.
    num = len(ds.val_tokens) // 17
    starts = [k * num // 12 * 17 for k in range(12)]
    assert starts[-1] >= (num - num // 12 - 1) * 17 > 0
    np.testing.assert_array_equal(windows, [ds.val_tokens[s : s + 17] for s in starts])
    train_bytes = np.asarray(ds.train_tokens).tobytes()
    for window in windows:  # a 17-token passage of the novel never recurs by chance
        assert window.astype(np.uint16).tobytes() not in train_bytes
    with pytest.raises(ValueError, match="val_fraction"):
        ds.eval_batches(1, batch_size=64, seq_len=1024, process_index=0, process_count=1)


def test_jsonl_folder_and_file_sources(tmp_path):
    docs = [novel("persuasion", 6_000, start) for start in (0, 7_000, 14_000, 21_000)]

    jsonl = tmp_path / "docs.jsonl"
    lines = [json.dumps({"text": d, "id": i}) for i, d in enumerate(docs)]
    jsonl.write_text("\n".join(lines) + "\n\n")  # a trailing blank line is skipped
    folder = tmp_path / "folder"
    (folder / "sub").mkdir(parents=True)
    for i, d in enumerate(docs[:3]):
        (folder / f"{i}.txt").write_text(d)
    with gzip.open(folder / "sub" / "3.txt.gz", "wt") as f:
        f.write(docs[3])
    (folder / "notes.md").write_text("ignored")
    single = tmp_path / "all.txt"
    single.write_text("".join(docs))

    for source in (jsonl, folder, single):
        ds = data.build(_config(source, val_fraction=0.1), tmp_path / f"work_{source.name}")
        n = ds.num_train_tokens + ds.num_val_tokens
        expected = sum(len(ds.tokenizer.encode(d)) + 1 for d in docs)  # + EOS after each one
        if source is single:
            assert abs(n - (expected - 3)) <= 8  # one document; merges may differ at the joins
        else:
            assert n == expected
        assert ds.tokenizer.decode(ds.train_tokens[:50]).startswith(docs[0][:20])

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: .*'text'"):
        data.build(_config(bad), tmp_path / "work_bad")


def test_missing_or_empty_corpus_errors(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(ValueError, match=r"nope.txt.*does not exist.*config.data.path"):
        data.build(_config(missing), tmp_path / "w1")
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n\n")
    with pytest.raises(ValueError, match=r"no text found in file .*empty.txt.*config.data.path"):
        data.build(_config(empty), tmp_path / "w2")
    assert not (tmp_path / "w2" / "tokenizer.json").exists()  # nothing trained on nothing
    (tmp_path / "no_txt").mkdir()
    with pytest.raises(ValueError, match=r"no_txt.*no .txt"):
        data.build(_config(tmp_path / "no_txt"), tmp_path / "w3")
    with pytest.raises(ValueError, match="val_fraction"):
        data.build(_config(empty, val_fraction=1.0), tmp_path / "w4")
    # A work dir named as the corpus (its orbax markers are .txt files) is not read as one; a
    # work dir inside a corpus folder is left out of it.
    corpus = tmp_path / "corpus"
    workdir = corpus / "run"
    (workdir / "checkpoints" / "4").mkdir(parents=True)
    (workdir / "checkpoints" / "4" / "commit_success.txt").write_text(novel("emma", 20_000))
    (workdir / "metrics.jsonl").write_text('{"step": 4}\n')
    (workdir / "model.json").write_text("{}")
    with pytest.raises(errors.DataError, match=r"run' is an fp8jax work dir.*config.data.path"):
        data.build(_config(workdir), tmp_path / "w6")
    (corpus / "book.txt").write_text(novel("emma", 20_000))
    assert corpus_lib.source_files(str(corpus))[0] == [corpus / "book.txt"]
    (workdir / "model.json").unlink()  # a folder of the corpus, whatever its names
    assert len(corpus_lib.source_files(str(corpus))[0]) == 3


def test_jsonl_that_is_not_utf8_is_refused_naming_it(tmp_path):
    """A .jsonl corpus in Latin-1 (its accents undecodable) is refused as a text file would
    be, whether its texts are read (a BPE's sample, evaluate) or encoded into the token
    cache, not trained on as replacement characters."""
    from fp8jax.trainer import encode

    text = novel("emma", 12_000).replace("e", "é")
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps({"text": text}, ensure_ascii=False).encode("latin-1") * 3)
    path.write_bytes(path.read_bytes().replace(b"}{", b"}\n{"))
    with pytest.raises(ValueError, match=r"latin1.jsonl is not a text file: .* not UTF-8"):
        next(corpus_lib.pieces([path], "--data"))  # the BPE's sample, evaluate's text
    tok = tokenizer.train([novel("emma", 4_000)], VOCAB)
    with pytest.raises(ValueError, match=r"latin1.jsonl is not a text file: .* not UTF-8"):
        list(encode.encode([path], tok, "uint16", 1))
    path.write_text(f"{json.dumps({'text': text})}\n" * 3)  # the same text as JSON escapes
    assert len(data.build(_config(path), tmp_path / "w").tokenizer.encode("é")) == 1


@pytest.mark.slow
def test_shipped_corpus(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "_TOKENIZER_TRAIN_CHARS", 1 << 20)  # the encode pass is the test
    ds = data.build(_config("", vocab=512, val_fraction=0.05), tmp_path)
    assert ds.num_train_tokens > 1_000_000 and ds.num_val_tokens > 50_000
    assert ds.tokenizer.decode(ds.train_tokens[:8]).startswith("EMMA")
    assert sum(f.stat().st_size for f in corpus_lib.SHIPPED_DIR.glob("*.gz")) < 5 << 20


def test_bpe_sample_is_drawn_across_every_file_and_a_large_file(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "_TOKENIZER_TRAIN_CHARS", 8_000)
    monkeypatch.setattr(data, "_SAMPLE_WINDOW", 500)
    parts = [novel("persuasion", 10_000, start) for start in range(0, 120_000, 10_000)]
    for k, part in enumerate(parts):
        (tmp_path / f"{k:02d}.txt").write_text(part)
    sample = list(data._tokenizer_texts(sorted(tmp_path.glob("*.txt"))))
    assert 7_000 <= sum(map(len, sample)) <= 8_000
    for part in parts:  # every file gives its share, not only the first ones
        assert any(text and text in part for text in sample)
    (big := tmp_path / "big.txt").write_text("".join(parts))
    sample = list(data._tokenizer_texts([big]))
    assert len(sample) == 16 and 7_000 <= sum(map(len, sample)) <= 8_000
    assert sample[0] == parts[0][:500] and sample[-1] in parts[-1]  # from start to end
    (small := tmp_path / "small.txt").write_text(parts[0][:6_000])
    assert "".join(data._tokenizer_texts([small])) == parts[0][:6_000]  # within budget: whole
