"""``python -m fp8jax.prepare``: a corpus encoded ahead of training into token shards that
``data.format='tokens'`` reads as the trainer would have encoded it; bad input is one line on
stderr, exit 2, and nothing written."""

import errno
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from fp8jax import errors, prepare, tokenizer
from fp8jax.trainer import encode, formats, loop, token_shards

from fp8_testing import ROOT, data_run, novel


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    """A novel's start as a .txt file, another's paragraphs as .jsonl documents, and a
    tokenizer of them."""
    root = tmp_path_factory.mktemp("prepare")
    (root / "src").mkdir()
    (root / "src" / "a.txt").write_text(novel("persuasion", 3_000))
    paragraphs = [p for p in novel("pride-and-prejudice", 60_000).split("\n\n") if p.strip()]
    lines = "".join(json.dumps({"text": p}) + "\n" for p in paragraphs)
    (root / "src" / "b.jsonl").write_text(lines)
    tok = tokenizer.train([novel("persuasion", 30_000)], vocab_size=300)
    tok.save(root / "tokenizer.json")
    return root


def _prepare(*args, cwd=None):
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, "-m", "fp8jax.prepare", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=300,
    )


def test_prepared_shards_hold_the_trainers_ids_cut_at_documents(corpus_dir, tmp_path):
    out = tmp_path / "shards"
    tok_file = corpus_dir / "tokenizer.json"
    r = _prepare(corpus_dir / "src", "--tokenizer", tok_file, "--out", out, "--shard_tokens", 4000)
    assert r.returncode == 0, r.stderr
    assert "MB/s" in r.stdout and "MB/s" in r.stderr  # the last line, and the progress bar
    tok = tokenizer.Tokenizer.load(tok_file)
    files = sorted((corpus_dir / "src").iterdir())
    want = np.concatenate([ids for ids, _ in encode.encode(files, tok, "uint16", 1)])
    shards = sorted(out.glob("*.bin"))
    got = [np.asarray(token_shards.read_shard(f)) for f in shards]
    np.testing.assert_array_equal(np.concatenate(got), want)
    assert len(shards) > 2 and all(g[-1] == tok.eos_id for g in got)  # cut after an EOS
    manifest = json.loads((out / "prepare.json").read_text())
    assert manifest["tokens"] == len(want) and manifest["shards"] == len(shards)
    # Training reads them with the copied tokenizer: the same ids, split by whole shards.
    run = data_run(out, 300, format="tokens", tokenizer=str(out / "tokenizer"))
    run, tok2 = loop.data_tokenizer(run, str(tmp_path / "work"), None)
    ds = formats.build(run, tmp_path / "work", tok2)
    assert ds.num_train_tokens + ds.num_val_tokens == len(want) and ds.num_val_tokens > 0
    # Another tokenizer of the same size would read the ids without an error: refused, the
    # folder or one of its shards named, by the manifest's record of the tokenizer.
    assert prepare.MANIFEST == token_shards.MANIFEST
    other = tokenizer.train([novel("emma", 30_000)], vocab_size=300)
    assert other.vocab_size == tok.vocab_size and other.to_str() != tok.to_str()
    other.save(tmp_path / "other.json")
    for path in (out, shards[0]):
        run = data_run(path, 300, format="tokens", tokenizer=str(tmp_path / "other.json"))
        with pytest.raises(errors.DataError, match=rf"prepare.json\), .* {out / 'tokenizer'} "):
            formats.build(run, tmp_path / "work2")
    assert not (tmp_path / "work2").exists()


@pytest.mark.parametrize(
    "kind",
    ["missing", "pattern", "shard", "tokenizer", "out_used", "out_in_run", "binary", "flag"],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(corpus_dir, tmp_path, kind):
    src, tok, out = corpus_dir / "src", corpus_dir / "tokenizer.json", tmp_path / "shards"
    match = {
        "missing": "does not exist",
        "pattern": "matches no .txt or .parquet or .jsonl files; name a text file, a folder of "
        "them or a glob pattern of them as SRC",
        "shard": "is a token shard, not text",
        "tokenizer": "is not a tokenizers tokenizer.json",
        "out_used": "exists and is not empty",
        "out_in_run": "the tokens/ folder that the run in",
        "binary": "is not a text file: it holds NUL bytes",  # found while encoding
        "flag": "flag --workers=many: invalid literal for int()",  # absl's, as one line
    }[kind]
    if kind == "missing":
        src = tmp_path / "nope.txt"
    if kind == "pattern":
        src = corpus_dir / "src" / "*.parquet"
    if kind == "shard":
        src = tmp_path / "ids.npy"
        np.save(src, np.arange(10, dtype=np.uint16))
    if kind == "tokenizer":
        tok = tmp_path / "broken.json"
        tok.write_text("{not json")
    if kind == "binary":
        src = tmp_path / "data.txt"
        src.write_bytes(b"text\x00\x01" * 100)
    if kind == "out_used":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    if kind == "out_in_run":  # inside another work dir's token cache, which its run rebuilds
        (tmp_path / "model.json").write_text("{}")
        out = tmp_path / "tokens" / "shards"
    before = sorted(p.name for p in tmp_path.iterdir())
    flags = ["--workers", "many"] if kind == "flag" else []
    r = _prepare(src, "--tokenizer", tok, "--out", out, *flags)
    assert r.returncode == 2, r.stderr
    progress = "encoding:"  # the progress bar's lines, when the error came while encoding
    lines = [x for x in r.stderr.strip().splitlines() if not x.lstrip("\r").startswith(progress)]
    assert len(lines) == 1 and match in lines[0], r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    if kind == "out_used":
        assert [p.name for p in out.iterdir()] == ["keep.txt"]


@pytest.mark.parametrize("failure", ["no_space", "cannot_create"])
def test_a_write_failure_is_one_line_and_leaves_nothing(corpus_dir, tmp_path, monkeypatch, failure):
    """A full disk while the shards are written, or a folder beside --out that cannot be
    created: one DataError line naming the folder and the fix, and nothing left behind."""
    work = tmp_path / "parent"
    work.mkdir()
    if failure == "no_space":

        def full(path, ids):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

        monkeypatch.setattr(token_shards, "write_bin", full)
        match = f"no space left on the device of {work} while writing the token shards"
    else:
        real_mkdir = pathlib.Path.mkdir

        def refuse(self, *args, **kwargs):
            if self.parent == work:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
            return real_mkdir(self, *args, **kwargs)

        monkeypatch.setattr(pathlib.Path, "mkdir", refuse)
        match = "cannot create a folder beside it"
    src, tok = corpus_dir / "src", corpus_dir / "tokenizer.json"
    with pytest.raises(errors.DataError, match=match) as info:
        prepare.prepare(str(src), str(tok), str(work / "shards"), workers=1, shard_tokens=4000)
    assert "\n" not in str(info.value) and "--out" in str(info.value)
    assert list(work.iterdir()) == []
