"""Weighted mixtures of sources (``data.format='mix'``): shares, determinism, resume, config.

Each source's ids lie in its own range, so every training window names its source: the
realized shares must match the weights within the binomial spread, a resumed iterator must give
exactly the batches the first one gave, and ``data.sources``/``data.weights`` parse to typed
sources or a one-line ConfigError.
"""

import dataclasses
import math

import numpy as np
import pytest

from fp8jax import data_spec, errors, tokenizer
from fp8jax.trainer import formats, loop

from fp8_testing import data_run, novel

VOCAB = 400
BAND = 100  # source k's ids lie in [k * BAND + 1, (k + 1) * BAND)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tokenizer of VOCAB ids and three sources of two .npy shards each, ids in bands."""
    root = tmp_path_factory.mktemp("mix")
    tok = tokenizer.train([novel("persuasion", 60_000)], vocab_size=VOCAB)
    assert tok.vocab_size == VOCAB and tok.eos_id < BAND
    tok.save(root / "tokenizer.json")
    rng = np.random.default_rng(0)
    for k in range(3):
        folder = root / f"s{k}"
        folder.mkdir()
        for j in range(2):
            ids = rng.integers(k * BAND + BAND // 2, (k + 1) * BAND, 4000, dtype=np.uint16)
            np.save(folder / f"{j}.npy", ids)
    return root


def _run(root, weights, seed=0):
    sources = tuple(
        data_spec.SourceSpec("tokens", str(root / f"s{k}"), w) for k, w in enumerate(weights)
    )
    run = data_run(
        "", VOCAB, seed, 0.5, format="mix", sources=sources, tokenizer=str(root / "tokenizer.json")
    )
    return run


def _build(root, weights, work, seed=0):
    run, tok = loop.data_tokenizer(_run(root, weights, seed), str(work), None)
    return formats.build(run, work, tok)


def test_realized_shares_follow_the_weights(setup, tmp_path):
    weights = [0.5, 0.3, 0.2]
    ds = _build(setup, weights, tmp_path / "work")
    it = ds.train_iter(process_index=0, process_count=1)
    rows = np.concatenate([next(it)["inputs"] for _ in range(200)])  # 800 windows
    bands = rows // BAND
    assert (bands == bands[:, :1]).all()  # every window is one source's
    counts = np.bincount(bands[:, 0], minlength=3)
    n = len(rows)
    for k, w in enumerate(weights):
        p = w / sum(weights)
        std = math.sqrt(n * p * (1 - p))
        assert abs(counts[k] - n * p) <= 3 * std, (counts, n * p, std)


def test_mix_is_deterministic_and_resumes_exactly(setup, tmp_path):
    ds = _build(setup, [2, 1, 1], tmp_path / "work")
    it = ds.train_iter(process_index=0, process_count=1)
    first = [next(it) for _ in range(9)]
    state = it.get_state()
    again = _build(setup, [2, 1, 1], tmp_path / "work").train_iter(process_index=0, process_count=1)
    for batch in first:
        np.testing.assert_array_equal(next(again)["inputs"], batch["inputs"])
    resumed = ds.train_iter(process_index=0, process_count=1)
    resumed.set_state(state)
    want = next(it)
    got = next(resumed)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])
    # Two processes share each global batch; another seed draws other windows.
    halves = [ds.train_iter(process_index=p, process_count=2) for p in (0, 1)]
    np.testing.assert_array_equal(
        np.concatenate([next(h)["inputs"] for h in halves]), first[0]["inputs"]
    )
    other = next(
        _build(setup, [2, 1, 1], tmp_path / "w2", seed=1).train_iter(
            process_index=0, process_count=1
        )
    )
    assert not np.array_equal(other["inputs"], first[0]["inputs"])


def test_validation_reads_every_source_and_no_training_shard(setup, tmp_path):
    ds = _build(setup, [1, 1, 1], tmp_path / "work")
    val = np.asarray(ds.val_tokens)
    train = np.asarray(ds.train_tokens)
    for k in range(3):  # the second shard of each source is its validation split
        held = np.load(setup / f"s{k}" / "1.npy")
        assert val[k * len(held) : (k + 1) * len(held)].tolist() == held.tolist()
    assert set(np.unique(val // BAND)) == {0, 1, 2} and len(train) == len(val)
    batch = ds.eval_batches(2, process_index=0, process_count=1)[0]
    assert batch["inputs"].shape == (4, 16)


def test_text_sources_share_one_learned_bpe(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(novel("persuasion", 40_000))
    b.write_text(novel("pride-and-prejudice", 40_000))
    sources = (data_spec.SourceSpec("text", str(a), 1.0), data_spec.SourceSpec("text", str(b), 3.0))
    run = data_run("", 300, format="mix", sources=sources)
    ds = formats.build(run, tmp_path / "work")
    assert (tmp_path / "work" / "tokenizer.json").exists()
    assert (tmp_path / "work" / "sources" / "1" / "tokens" / "train.bin").exists()
    text = ds.tokenizer.decode(next(ds.train_iter(process_index=0, process_count=1))["inputs"][0])
    assert text in a.read_text() or text in b.read_text()


@pytest.mark.parametrize(
    "sources, weights, match",
    [
        ("a,b", "1", r"1 weights for 2 data.sources"),
        ("a,b", "1,0", r"entry 1 .*weight > 0"),
        ("a,tokens:", "", r"entry 1 .*'\[text:\|tokens:\]path'"),
        ("a", "x", r"entry 0 .*finite weight > 0"),
        ("a/, text:a/", "", r"entry 1 \('text:a/'\) repeats entry 0: .*larger weight"),
    ],
)
def test_bad_sources_are_one_line_config_errors(sources, weights, match):
    with pytest.raises(errors.ConfigError, match=match):
        data_spec.parse_sources(sources, weights)


def test_sources_parse_to_typed_specs_and_need_the_mix_format():
    specs = data_spec.parse_sources(" books/ , tokens:web/,text:c.txt", "3,1,0.5")
    assert specs == (
        data_spec.SourceSpec("text", "books/", 3.0),
        data_spec.SourceSpec("tokens", "web/", 1.0),
        data_spec.SourceSpec("text", "c.txt", 0.5),
    )
    assert [s.weight for s in data_spec.parse_sources("a,b", "")] == [1.0, 1.0]
    config = loop.load_config("tiny")
    config.data.sources = "a.txt,b.txt"
    with pytest.raises(errors.ConfigError, match=r"sets data.format='mix'"):
        data_spec.parse_data(config.data)
    config.data.format = "mix"
    assert len(data_spec.parse_data(config.data).sources) == 2


def test_a_bad_source_is_named_by_its_sources_entry(setup, tmp_path):
    """A source's error names its data.sources entry (what the user sets), not data.path."""
    run = _run(setup, [1.0, 1.0])
    specs = list(run.data.sources)
    specs[1] = data_spec.SourceSpec("tokens", str(tmp_path / "nope"), 1.0)
    data = dataclasses.replace(run.data, sources=tuple(specs))
    run = dataclasses.replace(run, data=data)
    with pytest.raises(errors.DataError) as info:
        formats.build(run, tmp_path / "work")
    msg = str(info.value)
    assert "config.data.sources entry 1" in msg and "nope" in msg, msg
    assert "config.data.path" not in msg and "\n" not in msg, msg
    assert not (tmp_path / "work").exists()
