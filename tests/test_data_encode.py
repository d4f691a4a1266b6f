"""The corpus encoder: ranges cut at safe line starts, worker processes, an existing tokenizer.

The ids of the ranged, multi-process encoder must equal those of each whole document encoded at
once (plus EOS): a range boundary that drops or repeats a token, or a cut that changes a merge,
fails here. An existing tokenizer (``config.data.tokenizer``) sets the model's vocabulary and
travels with the work dir; one that does not load is refused before anything is written.
"""

import gzip
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import regex
import tokenizers

from fp8jax import errors, tokenizer
from fp8jax.trainer import bpe_words, corpus, data, encode, loop

from fp8_testing import data_run

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOVELS = ("northanger-abbey", "persuasion")  # in file order


def _text(name: str, num_chars: int | None = None) -> str:
    with gzip.open(corpus.SHIPPED_DIR / f"{name}.txt.gz", "rt", encoding="utf-8") as f:
        return f.read()[:num_chars]


@pytest.fixture(scope="module")
def tok():
    """A BPE that has merged runs of blanks (so a cut inside one changes its ids)."""
    text = _text("emma", 100_000)
    return tokenizer.train([text, _spaced(text.split(". "))], vocab_size=512)


def _spaced(paragraphs: list[str]) -> str:
    """``paragraphs`` joined by line starts where a cut would change a byte-level BPE's ids:
    after blank runs, before indents."""
    seps = ["\n\n\n", "\n  ", " \n", "\n\t", "\n\n", "\n"]
    return "".join(p + seps[k % len(seps)] for k, p in enumerate(paragraphs))


def _reference(tok, docs: list[str]) -> np.ndarray:
    """Each document encoded whole, in one call, then its EOS: the encoder's contract."""
    return np.concatenate([np.asarray([*tok.encode_batch([d])[0], tok.eos_id]) for d in docs])


def _encoded(files, tok, workers: int) -> np.ndarray:
    return np.concatenate([ids for ids, _ in encode.encode(files, tok, "uint16", workers)])


def test_safe_cuts_and_ranges_tile_the_file(tmp_path):
    text = "a b\n  indented\nx\n\nnext\r\nwindows\ndonnées\n数据\n\tt\nend\n"
    lines = encode.Cuts(paragraphs=False)
    cuts = encode.safe_cuts(text, 1, lines)
    assert cuts and all(text[c - 1] == "\n" for c in cuts)
    assert all(not text[c - 2].isspace() and not text[c].isspace() for c in cuts)
    assert "next\r\nwindows" in text and text.index("windows") not in cuts  # \r is blank
    paragraphs = encode.safe_cuts(text, 1, encode.Cuts())
    assert set(paragraphs) - set(cuts) == {text.index("\nnext")}  # 'x\n|\nnext'
    path = tmp_path / "t.txt"
    path.write_bytes((text * 400).encode())
    tasks = encode.plan([path], range_bytes=300, cuts=lines)
    assert len(tasks) > 10 and tasks[0].start == 0 and tasks[-1].end == -1
    raw = path.read_bytes()
    for a, b in zip(tasks, tasks[1:], strict=False):
        assert a.end == b.start and not a.last  # contiguous: no byte dropped or repeated
        before, after = raw[: b.start].decode()[-2:], raw[b.start :].decode()[:1]
        assert before[-1] == "\n" and not before[0].isspace() and not after.isspace()


def test_ranged_processes_equal_whole_documents(tok, tmp_path, monkeypatch):
    docs = [_text(name) for name in NOVELS]
    folder = tmp_path / "plain"
    folder.mkdir()
    for name, doc in zip(NOVELS, docs, strict=True):
        (folder / f"{name}.txt").write_text(doc, encoding="utf-8")
    paragraphs = [p for p in docs[0].split("\n\n") if p.strip()][:300]
    (tmp_path / "docs.jsonl").write_text(
        "".join(json.dumps({"text": p}) + "\n" for p in paragraphs)
    )
    spaced = _spaced(paragraphs[:200])
    (folder / "z-spaced.txt").write_text(spaced, encoding="utf-8")
    files = sorted(folder.glob("*.txt"))
    reference = _reference(tok, [*docs, spaced])
    # The shipped .gz files (one task each), this process with the tokenizer's own threads.
    shipped = [corpus.SHIPPED_DIR / f"{n}.txt.gz" for n in NOVELS]
    np.testing.assert_array_equal(_encoded(shipped, tok, 1), _reference(tok, docs))
    # Plain copies cut into ~25 ranges each, encoded by two processes, in pieces of ~2k chars.
    monkeypatch.setattr(encode, "RANGE_BYTES", 1 << 14)
    monkeypatch.setattr(encode, "PIECE_CHARS", 1 << 11)
    tasks = encode.plan(files, encode.RANGE_BYTES)
    assert len(tasks) > 40 and encode.workers_for(2, tasks) == 2
    np.testing.assert_array_equal(_encoded(files, tok, 2), reference)
    # .jsonl ranges cut at line starts: each line one document.
    jsonl = _encoded([tmp_path / "docs.jsonl"], tok, 2)
    np.testing.assert_array_equal(jsonl, _reference(tok, paragraphs))


# Beyond ASCII: accents, guillemets, CJK, an emoji, Unicode blanks, C0 separators (blank to
# Python's str.isspace, not to the tokenizer), NEL, Arabic-Indic digits, a Roman numeral, a
# fraction, a titlecase letter, combining marks, a zero-width space, a BOM.
_UNICODE = (
    "données «x» 12 数据 😀 a\u00a0b x\u2003y\u3000z p\x1cq\x1d r\x85s \u0660\u0661 Ⅻ ½ ǅ "
    "e\u0301\u0301 \u0e01\u0e33 zero\u200bwidth \ufeffbom 'ñ' ñ's"
)


def test_word_encoder_equals_the_tokenizer(tok, tmp_path, monkeypatch):
    """The word encoder (each distinct word tokenized once) gives the tokenizer's own ids; a
    text it does not accept (an added token, a character its probes reject) is encoded by the
    tokenizer, and a tokenizer of another pipeline gets none."""
    words = bpe_words.WordEncoder.of(tok, "uint16")
    assert words is not None
    monkeypatch.setattr(bpe_words, "SLICE_CHARS", 50)  # many slices, cut between two words
    monkeypatch.setattr(bpe_words, "MAX_WORDS", 100)  # the dict starts over several times
    paragraphs = _text("emma", 20_000).split("\n\n")
    texts = [_text("emma", 20_000), _spaced(paragraphs), _UNICODE, "don't  I'll 'S\n\n  12345"]
    for text in texts:
        assert words.accepts(text)
        np.testing.assert_array_equal(np.frombuffer(words.encode(text), "uint16"), tok.encode(text))
    assert not words.accepts("a <|endoftext|> b")
    # A character whose probes the two regex engines cut differently is rejected, and the
    # encoder hands the documents holding it to the tokenizer.
    agrees = bpe_words.WordEncoder._agrees
    unlike = lambda self, text, theirs=None: "ж" not in text and agrees(self, text, theirs)  # noqa: E731
    monkeypatch.setattr(bpe_words.WordEncoder, "_agrees", unlike)
    docs = ["ёж и жук", "plain text", "a <|endoftext|> b", _UNICODE]
    (path := tmp_path / "docs.jsonl").write_text(
        "".join(json.dumps({"text": d}) + "\n" for d in docs)
    )
    assert not bpe_words.WordEncoder.of(tok, "uint16").accepts(docs[0])
    np.testing.assert_array_equal(_encoded([path], tok, 1), _reference(tok, docs))
    # Another pre-tokenizer, or a prefix space: the tokenizer encodes everything.
    spm = tokenizers.Tokenizer.from_str(tok.to_str())
    spm.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    prefixed = tokenizers.Tokenizer.from_str(tok.to_str())
    prefixed.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=True)
    for other in (spm, prefixed):
        assert bpe_words.WordEncoder.of(tokenizer.Tokenizer(other), "uint16") is None


# The word patterns of Llama 3's and Qwen2's tokenizer.json (a Split before a ByteLevel without
# its regex): digits in groups of up to three, or one at a time.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")
# Contractions in any case, digit runs, blank runs and line breaks, CJK next to Latin, emoji with
# a skin tone, accents decomposed (NFD: the NFC normalizer composes them), singletons that NFC
# replaces (Kelvin, Ohm, Angstrom signs), the long s, Arabic-Indic digits, a fraction.
_SPLIT_TEXTS = (
    "He'S DON'T we'Ve I'M they're 'll 'D o'clock",
    "1 12 123 1234 12345 1234567890 x1234y 3.14159 1,000,000 ٣٤٥٦٧ ½12 Ⅻ",
    "a  b   c\t\td \n e\n\n\nf  \n  g\r\n\r\n  x \n",
    "数据abc 数据 日本語のテキスト。 😀👍🏽 ¿qué? «x»",
    "e\u0301cole cafe\u0301 A\u030angstro\u0308m \u212a \u2126 \u212b ſ's ñ's naïve",
)


def _split_tok(pattern: str, nfc: bool) -> tokenizer.Tokenizer:
    """A BPE trained here in Llama 3's (``nfc``: Qwen2's) pipeline around ``pattern``."""
    raw = tokenizers.Tokenizer(tokenizers.models.BPE(ignore_merges=not nfc))
    split = tokenizers.pre_tokenizers.Split(tokenizers.Regex(pattern), behavior="isolated")
    byte_level = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    raw.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([split, byte_level])
    raw.normalizer = tokenizers.normalizers.NFC() if nfc else None
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=700,
        special_tokens=["<|end_of_text|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator([_text("emma", 60_000), *_SPLIT_TEXTS * 20], trainer)
    return tokenizer.Tokenizer(raw, eos_id=raw.token_to_id("<|end_of_text|>"))


# A pattern that leaves stretches unmatched (the Split keeps each as a word of its own).
_GAPS_PATTERN = r"\p{L}+|\p{N}{1,3}"


class _ZheIsADigit:
    """The ``regex`` module, its patterns reading "ж" as "1"."""

    error = regex.error

    def __init__(self, pattern: regex.Pattern):
        self.pattern = pattern

    @classmethod
    def compile(cls, pattern: str) -> "_ZheIsADigit":
        return cls(regex.compile(pattern))

    def __getattr__(self, name: str):
        attr = getattr(self.pattern, name)
        return (lambda text, *a: attr(text.replace("ж", "1"), *a)) if callable(attr) else attr


@pytest.mark.parametrize(
    ("pattern", "nfc"), [(LLAMA3_PATTERN, False), (QWEN2_PATTERN, True), (_GAPS_PATTERN, False)]
)
def test_split_word_encoder_equals_the_tokenizer(pattern, nfc, tmp_path, monkeypatch):
    """A Split pipeline (Llama 3's, Qwen2's, one leaving stretches unmatched) gets the Split
    word encoder, whose ids are the tokenizer's (NFC applied, texts cut into slices); a text
    with an added token or a rejected character is encoded by the tokenizer; another Split or
    normalizer gets no word encoder."""
    tok = _split_tok(pattern, nfc)
    words = bpe_words.WordEncoder.of(tok, "uint16")
    assert isinstance(words, bpe_words.SplitWordEncoder)
    monkeypatch.setattr(bpe_words, "SLICE_CHARS", 50)  # many slices, cut between two words
    monkeypatch.setattr(bpe_words, "MAX_WORDS", 100)  # the dict starts over several times
    texts = [_text("persuasion", 20_000), *_SPLIT_TEXTS, "".join(_SPLIT_TEXTS), _UNICODE]
    for text, ids in zip(texts, tok.encode_plain(texts), strict=True):
        assert words.accepts(text)
        np.testing.assert_array_equal(np.frombuffer(words.encode(text), "uint16"), ids)
    assert not words.accepts("a <|end_of_text|> b")
    # Under NFC a character that Python's Unicode does not know (a noncharacter) is refused.
    assert words.accepts("a\ufdd0b") != nfc
    # A token added with its accent decomposed, found in the normalized text (NFC composes it).
    tok.backend.add_tokens([tokenizers.AddedToken("[y\u0301]", normalized=True)])
    # A character that the regex module classes otherwise than the tokenizer ("ж" read as a
    # digit) is rejected, and the encoder hands the documents holding it to the tokenizer.
    monkeypatch.setattr(bpe_words, "regex", _ZheIsADigit)
    docs = [
        "ёж и жук 123",
        "plain text",
        "a <|end_of_text|> b",
        "a [\u00fd] b",
        "a\ufdd0b",
        *_SPLIT_TEXTS,
    ]
    (path := tmp_path / "docs.jsonl").write_text(
        "".join(json.dumps({"text": d}) + "\n" for d in docs)
    )
    words = bpe_words.WordEncoder.of(tok, "uint16")
    assert not words.accepts(docs[0]) and words.accepts("ёи и ук 123")
    np.testing.assert_array_equal(_encoded([path], tok, 1), _reference(tok, docs))
    monkeypatch.undo()
    # A Split that removes its matches, two Splits, another normalizer: the tokenizer encodes.
    pre = tokenizers.pre_tokenizers
    byte_level = pre.ByteLevel(add_prefix_space=False, use_regex=False)
    split, removed = (pre.Split(tokenizers.Regex(pattern), b) for b in ("isolated", "removed"))
    others = [tokenizers.Tokenizer.from_str(tok.to_str()) for _ in range(3)]
    others[0].pre_tokenizer = pre.Sequence([removed, byte_level])
    others[1].pre_tokenizer = pre.Sequence([split, split, byte_level])
    others[2].normalizer = tokenizers.normalizers.NFKC()
    for other in others:
        wrapped = tokenizer.Tokenizer(other, eos_id=tok.eos_id)
        assert bpe_words.WordEncoder.of(wrapped, "uint16") is None


def test_tokenizer_that_changes_ids_at_cuts_gets_coarse_pieces(tok):
    assert encode.cuts_for(tok) == encode.Cuts(encode.PIECE_CHARS, paragraphs=True)
    spm = tokenizers.Tokenizer(tokenizers.models.BPE())
    spm.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace(prepend_scheme="always")
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=120, special_tokens=["</s>"])
    spm.train_from_iterator([_text("emma", 2_000)], trainer)
    spm_cuts = encode.cuts_for(tokenizer.Tokenizer(spm, eos_id=0))
    assert spm_cuts.piece_chars == encode.COARSE_PIECE_CHARS


def _hf_dir(tmp_path, tok, bos: bool = True) -> pathlib.Path:
    """A Hugging Face tokenizer dir: ``tok`` plus a BOS, its config naming EOS and BOS."""
    out = tmp_path / "hf_tok"
    out.mkdir(parents=True)
    raw = tokenizers.Tokenizer.from_str(tok.to_str())
    if bos:
        raw.add_special_tokens(["<s>"])
    raw.save(str(out / "tokenizer.json"))
    config = dict(eos_token=tokenizer.EOS, bos_token="<s>" if bos else None)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def test_existing_tokenizer_sets_vocab_and_frames_documents(tok, tmp_path):
    hf = _hf_dir(tmp_path, tok)
    path = tmp_path / "book.txt"
    path.write_text(_text("persuasion", 30_000), encoding="utf-8")
    for name in (hf, hf / "tokenizer.json"):  # a model dir, or its tokenizer.json
        run = data_run(path, 300, val_fraction=0.0, tokenizer=str(name))
        run, given = loop.data_tokenizer(run, str(tmp_path / "work"), None)
        assert given.vocab_size == tok.vocab_size + 1 and given.bos_id == tok.vocab_size
        assert run.model.vocab_size == 640  # 513 ids rounded up to a multiple of 128
    ds = data.build(run, tmp_path / "work", given)
    tokens = np.asarray(ds.train_tokens)
    assert tokens[0] == given.bos_id and np.count_nonzero(tokens == given.bos_id) == 1
    assert tokens[-1] == given.eos_id and np.count_nonzero(tokens == given.eos_id) == 1
    assert not (tmp_path / "work" / "tokenizer.meta.json").exists()  # nothing was learned
    # .jsonl documents: each framed by BOS and EOS.
    (jsonl := tmp_path / "docs.jsonl").write_text('{"text": "a b"}\n{"text": ""}\n{"text": "c"}\n')
    ids = np.concatenate([i for i, _ in encode.encode([jsonl], given, "uint16", 1)])
    bos, eos = given.bos_id, given.eos_id
    assert ids.tolist() == [bos, *given.encode("a b"), eos, bos, *given.encode("c"), eos]


def _bad_tokenizer(tmp_path, kind: str) -> pathlib.Path:
    if kind == "missing":
        return tmp_path / "nope"
    if kind == "not_json":
        (name := tmp_path / "tokenizer.json").write_text("{not json")
        return name
    raw = tokenizers.Tokenizer(tokenizers.models.BPE())  # no EOS token, no config naming one
    raw.add_special_tokens(["<unk>"])
    raw.save(str(name := tmp_path / "bare.json"))
    return name


@pytest.mark.parametrize("kind", ["missing", "not_json", "no_eos"])
def test_a_tokenizer_that_does_not_load_is_a_config_error(tmp_path, kind):
    name = _bad_tokenizer(tmp_path, kind)
    with pytest.raises(errors.ConfigError, match=rf"config.data.tokenizer=.*{name.name}"):
        loop.data_tokenizer(data_run("", 300, tokenizer=str(name)), str(tmp_path / "w"), None)


def test_train_py_refuses_a_tokenizer_that_does_not_load(tmp_path):
    """Exit 2, one stderr line naming config.data.tokenizer, no work dir written."""
    name = _bad_tokenizer(tmp_path, "not_json")
    wd = tmp_path / "work"
    args = [sys.executable, "train.py", "--config", "configs/tiny.py", f"--workdir={wd}"]
    args += [f"--config.data.tokenizer={name}"]
    env = {k: v for k, v in os.environ.items() if k != "FP8JAX_DEBUG"}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert lines[-1].startswith("error: ") and "Traceback" not in proc.stderr
    assert "config.data.tokenizer" in lines[-1] and str(name) in lines[-1], lines[-1]
    assert not wd.exists()


def test_token_cache_is_not_reused_for_another_tokenizer(tok, tmp_path):
    """Same corpus, same work dir, another data.tokenizer: the cache is encoded again."""
    path = tmp_path / "book.txt"
    path.write_text(_text("persuasion", 20_000), encoding="utf-8")
    other = tokenizer.train([_text("emma", 50_000)], vocab_size=300)
    work = tmp_path / "work"
    for k, t in enumerate((tok, other)):
        (folder := tmp_path / f"tok{k}").mkdir()
        t.save(folder / "tokenizer.json")
        run, given = loop.data_tokenizer(data_run(path, 300, tokenizer=str(folder)), "w", None)
        ds = data.build(run, work, given)
        tokens = np.concatenate([ds.train_tokens, ds.val_tokens])  # blocks of both splits
        reference = _reference(t, [path.read_text(encoding="utf-8")])
        np.testing.assert_array_equal(np.sort(tokens), np.sort(reference))


def test_a_run_with_an_existing_tokenizer_keeps_and_exports_it(tok, tmp_path):
    """Train 2 steps with data.tokenizer: the work dir and its HF export carry the tokenizer
    (EOS, BOS), the model's vocabulary is its size rounded up; a resume with another tokenizer
    is refused before anything changes."""
    from fp8jax.hf import io as hf_io

    hf_dir = _hf_dir(tmp_path, tok)
    path = tmp_path / "book.txt"
    path.write_text(_text("persuasion", 30_000), encoding="utf-8")
    c = loop.load_config("tiny")
    m = c.model
    m.num_layers, m.d_model, m.num_heads, m.num_kv_heads, m.d_ff, m.max_len = 1, 32, 2, 2, 64, 16
    c.seq_len, c.batch_size, c.num_train_steps, c.eval_every_steps = 16, 4, 2, 2
    c.fp8.level, c.sample_tokens = "O0", 0
    c.data.path, c.data.tokenizer = str(path), str(hf_dir)
    work = tmp_path / "work"
    loop.train_and_evaluate(c, str(work))
    kept = tokenizer.load(work)
    assert kept.to_str() == tokenizer.load(hf_dir).to_str()
    assert (kept.eos_id, kept.bos_id) == (tok.eos_id, tok.vocab_size)
    assert json.loads((work / "model.json").read_text())["vocab_size"] == 640
    out = hf_io.export(str(work), str(tmp_path / "export"), "float32")
    assert (out / "tokenizer.json").read_text() == kept.to_str()
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 640
    assert tokenizer.load(out).bos_id == kept.bos_id
    before = sorted(p.name for p in work.iterdir())
    c.data.tokenizer, c.num_train_steps = str(_hf_dir(tmp_path / "other", tok, bos=False)), 4
    with pytest.raises(errors.DataError, match=r"is not the tokenizer .* the checkpoint"):
        loop.train_and_evaluate(c, str(work))
    assert sorted(p.name for p in work.iterdir()) == before


def test_a_bad_jsonl_line_in_a_later_range_names_its_file_line(tok, tmp_path, monkeypatch):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": "x" * 50}) + "\n" for _ in range(100)) + "{}\n")
    monkeypatch.setattr(encode, "RANGE_BYTES", 1000)
    assert len(encode.plan([path], encode.RANGE_BYTES)) > 5
    with pytest.raises(ValueError, match=r"docs.jsonl:101: expected a JSON object with 'text'"):
        _encoded([path], tok, 1)
