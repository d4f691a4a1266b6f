"""Objectives and data formats as registered extensions: what every one of them must do.

Objectives (``fp8jax.trainer.objectives``): the loss of a micro-batch equals a plain-JAX
formula, is finite, and micro-batches or replicas add up to the global batch's loss. Data
formats (``fp8jax.trainer.formats``): batches hold only data, a bad source is one DataError
with nothing written, a resume on changed data is refused, a rebuild gives the same batches.
Train states of either objective restore from checkpoints that name the objective's state
``ref``.
"""

import ast
import dataclasses
import functools
import gzip
import hashlib
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct

from fp8jax import data_spec, errors, spec, tokenizer
from fp8jax.trainer import corpus, formats, loop, objectives, sft_data
from fp8jax.trainer import step as step_lib
from fp8jax.trainer.checkpoint import Checkpointer, abstract_like

from fp8_testing import data_run, with_overrides

# What a batch may hold: token ids, targets, loss weights, positions, segment ids.
DATA_KEYS = {"inputs", "targets", "weights", "positions", "segment_ids"}
VOCAB = 300
B, L, V = 8, 6, 11  # rows (4 pairs), targets per row, vocabulary of the tiny logits


# --- objectives ------------------------------------------------------------------------------


class LogitsModel:
    """Stands in for the transformer: its params are the logits ``{'logits': [B, L, V]}``; it
    returns what the model returns for ``targets_BxL`` (token CE, or with
    ``loss_weights_BxL`` their weighted sum) and, with ``mutable``, an empty FP8 state."""

    cfg = None

    def apply(self, variables, inputs, targets_BxL, loss_weights_BxL=None, mutable=None, **kw):
        del inputs, kw
        logits = variables["params"]["logits"]
        ce = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets_BxL[..., None], -1)[..., 0]
        out = ce if loss_weights_BxL is None else (None, jnp.sum(ce * loss_weights_BxL))
        return (out, {}) if mutable is not None else out


def plain_logps(logits, batch):
    """Each row's summed log-probability of its weighted targets, plain JAX."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32))
    tok = jnp.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
    return jnp.sum(tok * batch["weights"], axis=-1)


def reference_lm(obj, policy, initial, batch):
    """Mean token CE, or ``sum(w * ce) / sum(w)``."""
    del obj, initial
    logp = jax.nn.log_softmax(policy)
    ce = -jnp.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
    w = batch.get("weights", jnp.ones_like(ce))
    return jnp.sum(ce * w) / jnp.sum(w)


def reference_dpo(obj, policy, initial, batch):
    """DPO's loss, the mean over the pairs with a response token."""
    pi, ref = plain_logps(policy, batch), plain_logps(initial, batch)
    d = obj.beta * ((pi[0::2] - ref[0::2]) - (pi[1::2] - ref[1::2]))
    e = obj.label_smoothing
    loss = -(1 - e) * jax.nn.log_sigmoid(d) - e * jax.nn.log_sigmoid(-d)
    real = batch["weights"].reshape(-1, 2 * L)[:, :L].sum(-1) > 0
    return jnp.sum(loss * real) / jnp.sum(real)


REFERENCES = {"lm": reference_lm, "dpo": reference_dpo}


def tiny_batches(name):
    """Batches each objective trains on: LM a text and a weighted batch, DPO row pairs."""
    rng = np.random.default_rng(1)
    inputs = rng.integers(0, V, (B, L)).astype(np.int32)
    targets = rng.integers(0, V, (B, L)).astype(np.int32)
    weights = (rng.random((B, L)) < 0.6).astype(np.float32)
    if name == "dpo":
        weights[:, :2] = 0.0  # the prompt
        weights[6:8] = 0.0  # the last pair is padding
    weighted = dict(inputs=inputs, targets=targets, weights=weights)
    return [weighted] if name == "dpo" else [dict(inputs=inputs, targets=targets), weighted]


def dpo_run():
    c = loop.load_config("dpo_tiny")
    with_overrides(c, {"dpo.beta": 0.5, "dpo.label_smoothing": 0.2})  # every term counts
    return spec.parse(c)


def test_every_objective_has_a_reference():
    assert set(REFERENCES) == set(objectives.names())


@pytest.mark.parametrize("name", objectives.names())
def test_loss_equals_plain_jax_and_adds_up_over_replicas(name):
    """The train step's loss (micro-batch sums times the replica scale) equals the formula;
    two replicas' halves add up to it; the eval metrics give it too; the state declared at
    init survives ``prepare`` and ``keep``."""
    obj = objectives.get(name).from_run(dpo_run())
    rng = np.random.default_rng(0)
    policy = jnp.asarray(rng.normal(0, 2, (B, L, V)), jnp.float32)
    initial = jnp.asarray(rng.normal(0, 2, (B, L, V)), jnp.float32)
    model = LogitsModel()
    state = obj.init_state({"logits": initial}, {})
    prepare = obj.make_prepare(model, None)
    for batch in tiny_batches(name):
        batch = jax.tree.map(jnp.asarray, batch)
        want = float(REFERENCES[name](obj, policy, initial, batch))
        rows, after = prepare(state, batch)
        apply = functools.partial(model.apply, {"params": {"logits": policy}}, mutable=["fp8"])
        sums, _ = obj.micro_batch_loss(apply, batch, rows)
        assert set(sums) == set(obj.loss_keys)
        got = float(sums["loss"] * obj.scale(batch, 1))
        assert np.isfinite(got) and got == pytest.approx(want, rel=1e-5)
        halves = 0.0
        for part in (slice(0, B // 2), slice(B // 2, B)):
            split = lambda tree, part=part: jax.tree.map(lambda x: x[part], tree)
            half = {"logits": policy[part]}
            apply = functools.partial(model.apply, {"params": half}, mutable=["fp8"])
            part_sums, _ = obj.micro_batch_loss(apply, split(batch), split(rows))
            halves += part_sums["loss"] * obj.scale(batch, 2)  # of the global batch
        assert float(halves) == pytest.approx(want, rel=1e-5)
        kept = obj.keep(after, state, jnp.bool_(True))
        assert jax.tree.structure(kept) == jax.tree.structure(state)
        ce = model.apply({"params": {"logits": policy}}, None, batch["targets"])
        metrics = obj.make_eval(model, None)(state, batch, ce)
        evaluated = obj.evaluate(lambda s, b, m=metrics: m, state, [batch], None)
        assert evaluated["val_loss"] == pytest.approx(want, rel=1e-5)


def test_dpo_hyper_parameters_are_the_objectives():
    """beta and label smoothing come from config.dpo into the objective, not into batches."""
    run = dpo_run()
    obj = loop.objective_of(run)
    assert isinstance(obj, objectives.dpo.Dpo)
    assert (obj.beta, obj.label_smoothing) == (0.5, 0.2)
    assert loop.objective_of(data_run("", VOCAB)) == objectives.lm.LanguageModel()


# --- data formats ----------------------------------------------------------------------------


def _words(n: int, seed: int = 0) -> list[str]:
    with gzip.open(corpus.SHIPPED_DIR / "persuasion.txt.gz", "rt", encoding="utf-8") as f:
        words = f.read(200_000).split()
    return [" ".join(words[i : i + 6]) for i in range(seed, seed + 6 * n, 6)]


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _shard(path, seed):
    """A .npy token shard of 6-word documents, and its tokenizer beside it."""
    tok = tokenizer.train(_words(500), VOCAB)
    tok.save(path.parent / "tokenizer.json")
    np.save(path, np.asarray([i for w in _words(4000, seed) for i in [*tok.encode(w), tok.eos_id]]))


SAMPLES = {  # format -> (file name, writer of a small valid source)
    "text": ("book.txt", lambda p, s: p.write_text("\n".join(_words(4000, s)))),
    "tokens": ("shard.npy", _shard),
    "mix": ("book.txt", lambda p, s: p.write_text("\n".join(_words(4000, s)))),
    "sft": (
        "examples.jsonl",
        lambda p, s: _jsonl(p, [dict(prompt=w, completion=" yes") for w in _words(40, s)]),
    ),
    "dpo": (
        "pairs.jsonl",
        lambda p, s: _jsonl(
            p, [dict(prompt=w, chosen=" yes", rejected=" no") for w in _words(40, s)]
        ),
    ),
}


def format_run(name, path, **changes):
    # A pre-tokenized source is read with the tokenizer that wrote it (beside it).
    tok = str(pathlib.Path(path).parent / "tokenizer.json") if name == "tokens" else ""
    # A mixture of the one sample (a source may be named once; test_data_mix mixes several).
    mixed = data_spec.parse_sources(f"text:{path}", "3") if name == "mix" else ()
    run = data_run(
        path, VOCAB, seq_len=48, format=name, packing=False, tokenizer=tok, sources=mixed
    )
    return dataclasses.replace(run, **changes)


def sample(name, folder, seed=0) -> pathlib.Path:
    file_name, write = SAMPLES[name]
    folder.mkdir(parents=True, exist_ok=True)
    write(folder / file_name, seed)
    return folder / file_name


def snapshot(workdir) -> dict:
    return {
        str(p.relative_to(workdir)): hashlib.sha256(p.read_bytes()).hexdigest()
        if p.is_file()
        else "dir"
        for p in sorted(pathlib.Path(workdir).rglob("*"))
    }


def test_every_format_has_a_sample_a_config_name_and_a_registered_objective():
    assert set(SAMPLES) == set(formats.names()) == set(data_spec.DATA_FORMATS)
    assert {formats.get(n).objective for n in formats.names()} <= set(objectives.names())
    for name in formats.names():  # the run spec's checks know what the objective trains
        trains = objectives.get(formats.get(name).objective)
        assert data_spec.FORMATS[name].pairs == trains.pairs, name


def format_tests(tree: ast.AST) -> list[int]:
    """Lines of every comparison that reads a ``format`` (``x.format == ...``, ``format in``)."""

    def is_format(node):
        return (isinstance(node, ast.Attribute) and node.attr == "format") or (
            isinstance(node, ast.Name) and node.id == "format"
        )

    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Compare) and any(map(is_format, [node.left, *node.comparators]))
    ]


def test_no_format_tests_outside_the_format_modules():
    """What differs between data formats is asked of the format (``data_spec.FORMATS``, the
    registered ``DataFormat``, its objective), never read off ``data.format``'s name."""
    root = pathlib.Path(__file__).resolve().parents[1]
    format_modules = {type(formats.get(n)).__module__ for n in formats.names()}
    format_modules |= {formats.__name__, formats.data_format.__name__}
    found = {}
    for path in sorted([*(root / "fp8jax").rglob("*.py"), *(root / "benchmarks").rglob("*.py")]):
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        if module in format_modules:
            continue
        lines = format_tests(ast.parse(path.read_text(), str(path)))
        if lines:
            found[str(path.relative_to(root))] = lines
    assert not found, f"ask the data format instead of testing data.format: {found}"


def test_the_format_check_finds_each_form():
    source = "a = d.format == 'dpo'\nb = 'x' != run.data.format\nc = format in F\nd = x.fmt == 1\n"
    assert format_tests(ast.parse(source)) == [1, 2, 3]


@pytest.mark.parametrize("name", formats.names())
def test_batches_hold_data_only(name, tmp_path):
    """Train and eval batches of every format hold data keys only, with the dtypes the
    compiled step is given (``loop.abstract_batch``); no objective constant rides along."""
    run = format_run(name, sample(name, tmp_path / "data"))
    ds = formats.build(run, tmp_path / "work")
    abstract = loop.abstract_batch(run)
    for batch in (next(ds.train_iter()), ds.eval_batches(1)[0]):
        assert set(batch) <= DATA_KEYS, set(batch) - DATA_KEYS
        assert set(batch) == set(abstract) == set(formats.get(name).dtypes)
        for k, x in batch.items():
            assert x.dtype == abstract[k].dtype and x.shape == abstract[k].shape, k
    if formats.get(name).objective == "dpo":
        assert set(batch) == set(sft_data.KEYS)


@pytest.mark.parametrize("name", formats.names())
def test_bad_source_is_one_data_error_and_writes_nothing(name, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.md").write_text("not a source file")
    # The field to fix: a mixture's source is its data.sources entry.
    field = r"config.data.sources entry 0" if name == "mix" else r"config.data.path"
    for path, pattern in (
        (tmp_path / "nope.jsonl", rf"nope.jsonl.*does not exist.*{field}"),
        (tmp_path / "empty", rf"empty.*has no .* files.*{field}"),
    ):
        with pytest.raises(errors.DataError, match=pattern):
            formats.build(format_run(name, path), tmp_path / "work")
        assert not (tmp_path / "work").exists()


@pytest.mark.parametrize("name", formats.names())
def test_resume_reads_the_same_data_or_refuses(name, tmp_path):
    """With a checkpoint in the work dir, a rebuild on the same source gives the same
    batches; on changed content it raises a DataError and leaves the work dir as it was."""
    path = sample(name, tmp_path / "data")
    run, work = format_run(name, path), tmp_path / "work"
    first = next(formats.build(run, work).train_iter())
    (work / "checkpoints" / "5").mkdir(parents=True)  # a finished checkpoint of the run
    again = next(formats.build(run, work).train_iter())
    for k in first:
        np.testing.assert_array_equal(again[k], first[k])
    before = snapshot(work)
    sample(name, tmp_path / "data", seed=1)  # other content, same file
    with pytest.raises(errors.DataError, match="changed"):
        formats.build(run, work)
    assert snapshot(work) == before


# --- checkpoints -----------------------------------------------------------------------------


@struct.dataclass
class SavedAsRef:
    """A train state whose objective state is named ``ref`` (DPO's reference; {} otherwise)."""

    step: jax.Array
    params: dict
    opt_state: dict
    fp8: dict
    bad_steps: jax.Array
    skipped: jax.Array
    comm: dict = struct.field(default_factory=dict)
    ref: dict = struct.field(default_factory=dict)


@pytest.mark.parametrize("objective_state", [{}, {"params": {"w": 1.5}, "fp8": {"s": 2.0}}])
def test_train_states_saved_with_ref_restore(objective_state, tmp_path):
    as_arrays = lambda tree: jax.tree.map(lambda x: jnp.full((2, 2), x, jnp.float32), tree)
    zero, w = jnp.int32(0), jnp.arange(4.0).reshape(2, 2)
    saved = SavedAsRef(jnp.int32(3), {"w": w}, {}, {}, zero, zero, ref=as_arrays(objective_state))
    ckpt = Checkpointer(str(tmp_path))
    try:
        ckpt.save(3, saved, {"step": 3, "batch_size": 8}, force=True, wait=True)
        want = step_lib.TrainState(
            jnp.int32(0), {"w": w}, {}, {}, zero, zero, objective=as_arrays(objective_state)
        )
        state, data_state = ckpt.restore(abstract_like(want), 3)
    finally:
        ckpt.close()
    assert isinstance(state, step_lib.TrainState) and int(state.step) == 3
    assert data_state["step"] == 3
    np.testing.assert_array_equal(state.params["w"], w)
    assert jax.tree.structure(state.objective) == jax.tree.structure(want.objective)
    for a, b in zip(jax.tree.leaves(state.objective), jax.tree.leaves(saved.ref), strict=True):
        np.testing.assert_array_equal(a, b)
