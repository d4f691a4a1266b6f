"""Work-dir caches are keyed on what built them: corpus contents, tokenizer settings, format.

A tokenizer or token cache is reused only when it was built from the same corpus bytes with
the same settings; otherwise it is rebuilt, or, when a checkpoint in the work dir was trained
with it, the run is refused (``data.allow_corpus_change`` lets a resume move to a new corpus
while keeping the checkpoint's tokenizer). A refused or failed build changes nothing.
"""

import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from fp8jax import checksums, errors, tokenizer
from fp8jax.trainer import corpus, data

from fp8_testing import data_run, novel

ROOT = pathlib.Path(__file__).resolve().parents[1]
VOCAB = 300


def _config(path, vocab=VOCAB, min_frequency=2, val_fraction=0.2, allow=False):
    return data_run(
        path,
        vocab,
        0,
        val_fraction,
        4,
        16,
        tokenizer_min_frequency=min_frequency,
        allow_corpus_change=allow,
    )


def _reference(text: str, vocab=VOCAB, min_frequency=2) -> tokenizer.Tokenizer:
    """The tokenizer a fresh work dir learns from ``text`` (one document, < 4M chars)."""
    return tokenizer.train([text], vocab, min_frequency)


def _num_tokens(ds) -> int:
    return ds.num_train_tokens + ds.num_val_tokens


def _snapshot(workdir) -> dict:
    """Every path under ``workdir``: files by size, mtime and content hash; folders by name."""
    out = {}
    for p in sorted(pathlib.Path(workdir).rglob("*")):
        rel = str(p.relative_to(workdir))
        if p.is_file():
            digest = hashlib.sha256(p.read_bytes()).hexdigest()
            out[rel] = (p.stat().st_size, p.stat().st_mtime_ns, digest)
        else:
            out[rel] = "dir"
    return out


@pytest.fixture(scope="module")
def corpora(novel_file):
    """Two different 20k-char passages of the novel, as two files."""
    return novel_file("persuasion", 20_000), novel_file("persuasion", 20_000, start=60_000)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A real (tiny) checkpoints/ folder written by fp8jax's Checkpointer."""
    from fp8jax.trainer.checkpoint import Checkpointer

    root = tmp_path_factory.mktemp("ckpt")
    ckpt = Checkpointer(str(root), keep=1)
    assert ckpt.save(1, {"w": np.zeros(2, np.float32)}, {"step": 1}, force=True)
    ckpt.close()
    return root / "checkpoints"


def _trained(workdir, checkpoint, config):
    """A work dir as a run on ``config`` leaves it: caches plus a checkpoint."""
    data.build(config, workdir)
    shutil.copytree(checkpoint, workdir / "checkpoints")


def test_failed_tiny_run_leaves_nothing_and_its_tokenizer_is_not_reused(corpora, tmp_path):
    """A 28-char corpus fails validation: no cache may survive to serve the next corpus."""
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("Call me Ishmael. Some years.")
    wd = tmp_path / "work"
    wd.mkdir()
    with pytest.raises(ValueError, match="validation split has 0 tokens"):
        data.build(_config(tiny), wd).eval_batches(1, process_index=0, process_count=1)
    assert _snapshot(wd) == {}  # the failed run wrote nothing
    ds = data.build(_config(corpora[0]), wd)
    ref = _reference(corpora[0].read_text())
    assert ds.tokenizer.to_str() == ref.to_str()
    assert _num_tokens(ds) == len(ref.encode(corpora[0].read_text())) + 1


def test_tiny_corpus_tokenizer_not_reused_for_another_path(corpora, tmp_path):
    """A cache from an earlier data.path (no checkpoint) is rebuilt for the new corpus."""
    tiny = tmp_path / "tiny.txt"
    tiny.write_text(novel("persuasion", 300))
    wd = tmp_path / "work"
    data.build(_config(tiny, val_fraction=0.0), wd)  # succeeds: 300 chars > seq_len tokens
    ds = data.build(_config(corpora[0]), wd)
    ref = _reference(corpora[0].read_text())
    assert ds.tokenizer.to_str() == ref.to_str()
    assert _num_tokens(ds) == len(ref.encode(corpora[0].read_text())) + 1


def test_failed_encode_leaves_previous_caches_untouched(corpora, tmp_path, monkeypatch):
    """An encode that dies half-way leaves neither temp files nor a half cache behind."""
    wd = tmp_path / "work"
    data.build(_config(corpora[0]), wd)
    before = _snapshot(wd)
    calls = []

    def dying(self, texts):
        calls.append(len(texts))
        raise OSError("disk full")

    monkeypatch.setattr(tokenizer.Tokenizer, "encode_plain", dying)
    with pytest.raises(OSError, match="disk full"):
        data.build(_config(corpora[1]), wd)
    assert calls and _snapshot(wd) == before


def test_content_changed_in_place_is_detected(corpora, tmp_path):
    """Same path, same size, same mtime, other text: both caches are rebuilt."""
    src, wd = tmp_path / "book.txt", tmp_path / "work"
    src.write_text(corpora[0].read_text())
    data.build(_config(src), wd)
    stat = src.stat()
    new_text = corpora[1].read_text()[: stat.st_size]
    src.write_text(new_text)
    os.utime(src, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert src.stat().st_size == stat.st_size and src.stat().st_mtime_ns == stat.st_mtime_ns
    ds = data.build(_config(src), wd)
    ref = _reference(new_text)
    assert ds.tokenizer.to_str() == ref.to_str()
    assert _num_tokens(ds) == len(ref.encode(new_text)) + 1
    val = np.asarray(ds.val_tokens)
    assert ds.tokenizer.decode(val[:200]) in new_text


def test_content_changed_in_place_on_resume_is_refused(corpora, tmp_path, checkpoint):
    src, wd = tmp_path / "book.txt", tmp_path / "work"
    src.write_text(corpora[0].read_text())
    _trained(wd, checkpoint, _config(src))
    stat = src.stat()
    src.write_text(corpora[1].read_text()[: stat.st_size])  # same size and mtime, other text
    os.utime(src, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    before = _snapshot(wd)
    with pytest.raises(errors.DataError, match=r"contents of file .*book.txt changed"):
        data.build(_config(src), wd)
    assert _snapshot(wd) == before


def _poke(shard: pathlib.Path, position: int | slice, value: int) -> None:
    """Write id ``value`` at ``position`` (or over a slice) of a uint16 token cache shard, in
    place."""
    ids = np.memmap(shard, dtype="uint16", mode="r+")
    ids[position] = value
    ids.flush()
    del ids


def test_token_cache_edited_in_place_is_refused_naming_its_shard(corpora, tmp_path, monkeypatch):
    """A reused token cache whose shard holds an id past the tokenizer's (edited in place, its
    size kept) is refused naming the shard and the fix, the work dir unchanged: by its recorded
    largest id, by reading its ids (all of a small cache, sampled blocks of a large one), and
    by the stream's check of every window it reads; a cache of another size is rebuilt."""
    wd = tmp_path / "work"
    ds = data.build(_config(corpora[0]), wd)
    vocab, tokens = ds.tokenizer.vocab_size, wd / "tokens"
    meta = json.loads((tokens / "meta.json").read_text())
    train = np.fromfile(tokens / "train.bin", "uint16")
    assert meta["max_train"] == train.max() < vocab and meta["num_train"] == len(train)
    middle = len(train) // 2
    _poke(tokens / "train.bin", middle, vocab)
    before = _snapshot(wd)
    shard = f"shard {tokens / 'train.bin'} holds id {vocab} at token {middle}"
    with pytest.raises(errors.DataError, match=f"{re.escape(shard)}, .* delete {tokens}"):
        data.build(_config(corpora[0]), wd)
    assert _snapshot(wd) == before
    # A large cache is sampled: the stream still refuses the window that holds the id.
    monkeypatch.setattr(data, "_CHECK_ALL_BYTES", 0)
    monkeypatch.setattr(data, "_CHECK_BLOCKS", 2)  # 32 ids at the start, 32 at the end
    monkeypatch.setattr(data, "_CHECK_BLOCK_IDS", 32)
    stream = data.build(_config(corpora[0]), wd).train_iter(4, 16)
    with pytest.raises(errors.DataError, match=re.escape(str(tokens / "train.bin"))):
        for _ in range(len(train) // 17):  # an epoch of 17-token windows, 4 a batch
            next(stream)
    _poke(tokens / "train.bin", middle, train[middle])
    # Past the sampled blocks: the validation batches are read (and checked) at once.
    _poke(tokens / "val.bin", slice(32, meta["num_val"] - 32), vocab + 1)
    with pytest.raises(errors.DataError, match=re.escape(str(tokens / "val.bin"))):
        data.build(_config(corpora[0]), wd).eval_batches(1)
    (tokens / "val.bin").write_bytes(b"")  # another size: rebuilt as it was
    np.testing.assert_array_equal(data.build(_config(corpora[0]), wd).train_tokens, train)
    meta["max_val"] = vocab  # a cache recording an id past the tokenizer's
    (tokens / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(errors.DataError, match=r"val.bin holds id \d+ \(its recorded largest"):
        data.build(_config(corpora[0]), wd)


def test_verify_corpus_reads_every_byte_against_the_caches_record(corpora, tmp_path, monkeypatch):
    """A large corpus' key samples it, so a same-size edit between the sampled blocks reuses
    the token cache; ``data.verify_corpus`` reads every byte against the CRC-32s the cache
    recorded at its build and refuses it in one line naming the file, the work dir unchanged."""
    monkeypatch.setattr(corpus, "FULL_HASH_BYTES", 1 << 10)  # sampled fingerprints
    monkeypatch.setattr(corpus, "SAMPLE_BYTES", 1 << 10)
    monkeypatch.setattr(corpus, "SAMPLE_BLOCK", 1 << 8)
    crc_block = 1 << 12
    monkeypatch.setattr(checksums, "BLOCK_BYTES", crc_block)  # several CRC blocks per file
    text, wd = tmp_path / "corpus.txt", tmp_path / "work"
    shutil.copy(corpora[0], text)
    plain = _config(text)
    checked = dataclasses.replace(plain, data=dataclasses.replace(plain.data, verify_corpus=True))
    data.build(plain, wd)
    record = json.loads((wd / "tokens" / "meta.json").read_text())["corpus_crc32"]
    blocks = len(record["files"][0])
    assert record["block_bytes"] == crc_block and blocks > 3
    data.build(checked, wd)  # the corpus as it was: verified and reused
    # A byte in the third CRC block that no sampled block of the key covers.
    sampled = corpus.sample_offsets(text.stat().st_size, corpus.SAMPLE_BYTES)
    offset = next(
        o
        for o in range(2 * crc_block, 3 * crc_block)
        if not any(s <= o < s + corpus.SAMPLE_BLOCK for s in sampled)
    )
    raw = bytearray(text.read_bytes())
    raw[offset] = ord("#") if raw[offset] != ord("#") else ord("%")
    text.write_bytes(bytes(raw))
    before = _snapshot(wd)
    data.build(plain, wd)  # unseen by the sampled key: reused as it is
    assert _snapshot(wd) == before
    fragment = rf"corpus file {re.escape(str(text))} differs .*\(block 2 of {blocks}\)"
    with pytest.raises(errors.DataError, match=fragment) as e:
        data.build(checked, wd)
    assert "\n" not in str(e.value) and _snapshot(wd) == before


def test_tokenizer_settings_change_retrains_or_is_refused(corpora, tmp_path, checkpoint):
    text = corpora[0].read_text()
    wd = tmp_path / "work"
    data.build(_config(corpora[0]), wd)
    ds = data.build(_config(corpora[0], min_frequency=100), wd)  # no checkpoint: retrain
    ref = _reference(text, min_frequency=100)
    assert ds.tokenizer.to_str() == ref.to_str() != _reference(text).to_str()
    assert _num_tokens(ds) == len(ref.encode(text)) + 1
    ds = data.build(_config(corpora[0], vocab=320), wd)
    assert ds.tokenizer.to_str() == _reference(text, vocab=320).to_str()

    shutil.copytree(checkpoint, wd / "checkpoints")  # now its ids are in a checkpoint
    before = _snapshot(wd)
    with pytest.raises(errors.DataError, match=r"tokenizer_min_frequency=2.*100.*fresh --workdir"):
        data.build(_config(corpora[0], vocab=320, min_frequency=100), wd)
    with pytest.raises(errors.DataError, match=r"vocab_size 320 .* asks for 300"):
        data.build(_config(corpora[0], vocab=300), wd)
    assert _snapshot(wd) == before


def test_data_path_change_on_resume_is_refused(corpora, tmp_path, checkpoint):
    a, b = corpora
    wd = tmp_path / "work"
    _trained(wd, checkpoint, _config(a))
    before = _snapshot(wd)
    pattern = rf"{a}.* {b}.*--config.data.allow_corpus_change=True"
    with pytest.raises(errors.DataError, match=pattern):
        data.build(_config(b), wd)
    with pytest.raises(errors.DataError, match=r"val_fraction .*0.2.*0.1"):
        data.build(_config(a, val_fraction=0.1), wd)
    assert _snapshot(wd) == before


def test_allowed_corpus_change_keeps_the_checkpoint_tokenizer(
    corpora, tmp_path, checkpoint, monkeypatch, caplog
):
    a, b = corpora
    wd = tmp_path / "work"
    _trained(wd, checkpoint, _config(a))
    tok_bytes = (wd / "tokenizer.json").read_bytes()
    old = tokenizer.Tokenizer.load(wd / "tokenizer.json")
    with caplog.at_level(logging.INFO):
        ds = data.build(_config(b, allow=True), wd)
    assert "tokenizer" in caplog.text and "allow_corpus_change" in caplog.text
    assert (wd / "tokenizer.json").read_bytes() == tok_bytes
    assert ds.tokenizer.to_str() == old.to_str() != _reference(b.read_text()).to_str()
    assert _num_tokens(ds) == len(old.encode(b.read_text())) + 1  # tokens are of b now

    def fail(*args, **kwargs):
        raise AssertionError("rebuilt although the cache matches")

    with monkeypatch.context() as m:  # the run is on b now: no flag needed, nothing rebuilt
        m.setattr(data, "_encode_corpus", fail)
        m.setattr(tokenizer, "train", fail)
        assert _num_tokens(data.build(_config(b), wd)) == _num_tokens(ds)
    with pytest.raises(errors.DataError, match=rf" {a}"):  # and going back needs the flag too
        data.build(_config(a), wd)


def test_train_py_refuses_a_corpus_change_on_resume(corpora, tmp_path, checkpoint):
    """The command line: exit 2, one stderr line naming both corpora, work dir untouched."""
    a, b = corpora
    wd = tmp_path / "work"
    sizes = {"model.vocab_size": VOCAB, "seq_len": 16, "batch_size": 4, "model.max_len": 16}
    sizes["data.val_fraction"] = 0.2
    _trained(wd, checkpoint, _config(a, val_fraction=0.2))
    before = _snapshot(wd)
    args = [sys.executable, "train.py", "--config", "configs/tiny.py", f"--workdir={wd}"]
    args += [f"--config.{k}={v}" for k, v in {**sizes, "data.path": b}.items()]
    env = {k: v for k, v in os.environ.items() if k != "FP8JAX_DEBUG"}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert lines[-1].startswith("error: ") and "Traceback" not in proc.stderr
    assert sum(line.startswith("error: ") for line in lines) == 1
    for fragment in (str(a), str(b), "allow_corpus_change"):
        assert fragment in lines[-1], lines[-1]
    assert _snapshot(wd) == before


def test_shared_cache_dir_serves_new_work_dirs_and_only_its_own_tokenizer(
    corpora, tmp_path, monkeypatch
):
    """data.cache_dir: a new work dir on the same corpus and tokenizer encodes nothing; another
    tokenizer gets its own cache; concurrent builders of one cache build it once; a killed
    build's staging folder is removed by the next run on that cache."""
    import dataclasses
    import threading

    caches = tmp_path / "caches"

    def shared(vocab=VOCAB):
        run = _config(corpora[0], vocab=vocab)
        return dataclasses.replace(run, data=dataclasses.replace(run.data, cache_dir=str(caches)))

    encodes = []
    encode_corpus = data._encode_corpus

    def counted(*args, **kwargs):
        encodes.append(threading.get_ident())
        return encode_corpus(*args, **kwargs)

    monkeypatch.setattr(data, "_encode_corpus", counted)
    # Two builders at once (threads: the lock is per open file, as between processes).
    results = {}
    threads = [
        threading.Thread(target=lambda k=k: results.update({k: data.build(shared(), tmp_path / k)}))
        for k in ("w1", "w2")
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(encodes) == 1 and set(results) == {"w1", "w2"}
    (entry,) = [p for p in caches.iterdir() if p.is_dir()]
    assert not (tmp_path / "w1" / "tokens").exists() and not list(caches.glob("*.tmp*"))
    stale = caches / f"{entry.name}.tmp999999"  # a killed build's staging
    stale.mkdir()
    (stale / "train.bin").write_bytes(b"\0" * 64)
    ds = data.build(shared(), tmp_path / "w3")  # a third run: reuses it, encodes nothing
    assert len(encodes) == 1 and not stale.exists()
    np.testing.assert_array_equal(ds.train_tokens, results["w1"].train_tokens)
    data.build(shared(vocab=VOCAB + 20), tmp_path / "w4")  # another tokenizer: its own cache
    assert len(encodes) == 2 and len([p for p in caches.iterdir() if p.is_dir()]) == 2


def test_unreadable_tokenizer_or_cache_dir_is_one_line(corpora, tmp_path, checkpoint):
    """A tokenizer.json that is not UTF-8 text is a cache without a checkpoint (relearned) and
    refused in one line naming it beside one (its ids are in the embeddings), the work dir
    unchanged; a data.cache_dir naming a file, or inside a work dir's tokens/, is refused naming
    the field."""
    import dataclasses

    wd, path = tmp_path / "work", tmp_path / "work" / "tokenizer.json"
    data.build(_config(corpora[0]), wd)
    path.write_bytes(b"\xff\xfe" + path.read_bytes())
    ds = data.build(_config(corpora[0]), wd)
    assert ds.tokenizer.to_str() == _reference(corpora[0].read_text()).to_str()
    assert path.read_bytes() == ds.tokenizer.to_str().encode()
    path.write_bytes(b"\xff\xfe" + path.read_bytes())
    shutil.copytree(checkpoint, wd / "checkpoints")
    before = _snapshot(wd)
    with pytest.raises(errors.DataError) as info:
        data.build(_config(corpora[0]), wd)
    msg = str(info.value)
    assert msg.startswith(f"{path} is unreadable (") and "restore it or start a fresh" in msg
    assert _snapshot(wd) == before
    run, file = _config(corpora[0]), tmp_path / "caches"
    file.write_text("mine")
    run = dataclasses.replace(run, data=dataclasses.replace(run.data, cache_dir=str(file)))
    with pytest.raises(errors.DataError) as info:
        data.build(run, tmp_path / "w2")
    assert str(info.value).startswith(f"config.data.cache_dir={str(file)!r} cannot hold the token")
    assert "(a file, not a folder); name a folder you can write" in str(info.value)
    assert file.read_text() == "mine"
    # Inside the token cache folder of a work dir (its model record beside), which that run
    # rebuilds: refused.
    (wd / "model.json").write_text("{}")
    inside = wd / "tokens" / "shared"
    run = dataclasses.replace(run, data=dataclasses.replace(run.data, cache_dir=str(inside)))
    with pytest.raises(errors.ConfigError, match="the tokens/ folder that the run in"):
        data.build(run, tmp_path / "w3")
    assert not inside.exists()


def test_large_corpus_fingerprint_reads_samples_yet_sees_size_and_sampled_edits(
    tmp_path, monkeypatch
):
    """Past FULL_HASH_BYTES the key reads sampled blocks only: a changed size or a changed byte
    in a sampled block changes it; a same-size edit between blocks does not (the trade-off)."""
    monkeypatch.setattr(corpus, "FULL_HASH_BYTES", 1 << 16)
    monkeypatch.setattr(corpus, "SAMPLE_BYTES", 1 << 14)
    monkeypatch.setattr(corpus, "SAMPLE_BLOCK", 1 << 10)
    rng = np.random.default_rng(0)
    files = [tmp_path / "a.txt", tmp_path / "b.txt"]
    files[0].write_bytes(rng.integers(97, 123, 300_000, dtype=np.uint8).tobytes())
    files[1].write_bytes(b"z" * 100_000)  # every block alike: only its size tells a change
    read = []

    def counting_open(path, mode="r", *args, **kwargs):
        fh = open(path, mode, *args, **kwargs)
        real = fh.read
        fh.read = lambda n=-1: read.append(len(chunk := real(n))) or chunk
        return fh

    monkeypatch.setattr(corpus, "open", counting_open, raising=False)
    key = corpus.fingerprint(files)
    total = sum(f.stat().st_size for f in files)
    assert 0 < sum(read) <= 2 * corpus.SAMPLE_BYTES < total // 10  # a sample, not the corpus

    def edited(f, offset, value=None) -> str:
        raw = bytearray(f.read_bytes())
        before = raw[offset]
        raw[offset] = value if value is not None else (before - 97 + 1) % 26 + 97
        f.write_bytes(bytes(raw))
        try:
            return corpus.fingerprint(files)
        finally:
            raw[offset] = before
            f.write_bytes(bytes(raw))

    size = files[0].stat().st_size
    offsets = corpus.sample_offsets(size, corpus.SAMPLE_BYTES * size // total)
    inside = offsets[1] + 7  # a byte of a sampled block
    outside = corpus.SAMPLE_BLOCK + 3  # past the first block, before the second
    assert offsets[0] == 0 and offsets[1] > outside
    assert edited(files[0], inside) != key
    assert edited(files[0], outside) == key  # unseen: same size, between sampled blocks
    assert corpus.fingerprint(files) == key
    with open(files[1], "ab") as fh:
        fh.write(b"z")
    assert corpus.fingerprint(files) != key  # a size change, the same blocks
    monkeypatch.setattr(corpus, "FULL_HASH_BYTES", 1 << 30)  # a small corpus: every byte
    key = corpus.fingerprint(files)
    assert edited(files[0], outside) != key
