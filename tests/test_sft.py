"""Supervised fine-tuning: masked loss, token-weighted accumulation, chat templates, packing,
the resumable example stream, file:line errors, init_from, and a short sft_tiny run."""

import dataclasses
import json

import hf_testing
import jax
import numpy as np
import pytest
from flax import linen as nn

from fp8jax import errors, models, spec
from fp8jax import tokenizer as tokenizer_lib
from fp8jax.optim.levels import Level
from fp8jax.trainer import chat, loop, sft_data
from fp8jax.trainer import step as step_lib

from fp8_testing import with_overrides

CHATML = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "Who wrote Emma?"},
    {"role": "assistant", "content": "Jane Austen."},
    {"role": "user", "content": "And Persuasion? ¿Sí?"},
    {"role": "assistant", "content": "Also Jane Austen, 1817."},
]


def sft_run(path="", **changes):
    """configs/sft_tiny.py at O0 with a one-layer model (fast), ``changes`` as dotted keys."""
    c = loop.load_config("sft_tiny")
    c.model.update(num_layers=1, d_model=32, num_heads=2, num_kv_heads=2, d_ff=64)
    c.model.vocab_size, c.fp8.level, c.data.path = 300, "O0", str(path)
    c.compilation_cache_dir = ""
    with_overrides(c, changes)
    return spec.parse(c)


@pytest.fixture(scope="module")
def tiny():
    """(model, params) of the one-layer O0 model and a weighted batch of 4 rows."""
    run = sft_run(seq_len=16)
    model = models.build_model(run.model)
    rng = np.random.default_rng(0)
    inputs = rng.integers(0, 300, (4, 16)).astype(np.int32)
    targets = rng.integers(0, 300, (4, 16)).astype(np.int32)
    weights = np.zeros((4, 16), np.float32)
    weights[0, 15] = 1.0  # row 0: one loss token; the others: many
    weights[1:, 4:] = 1.0
    params = model.init(jax.random.PRNGKey(0), inputs)["params"]
    batch = dict(inputs=inputs, targets=targets, weights=weights)
    return model, jax.tree.map(np.asarray, params), batch


def numpy_weighted_ce(logits, targets, weights):
    logits = np.asarray(logits, np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    ce = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
    return float((ce * weights).sum() / weights.sum())


def test_loss_is_the_weighted_ce_over_completion_tokens(tiny):
    model, params, batch = tiny
    loss, _, grads = step_lib.batch_gradients(model, params, {}, batch)
    logits = model.apply({"params": params}, batch["inputs"])
    want = numpy_weighted_ce(logits, batch["targets"], batch["weights"])
    assert float(loss) == pytest.approx(want, rel=1e-5)
    # A prompt token's target (weight 0) changes nothing: loss and gradients alike.
    other = dict(batch, targets=batch["targets"].copy())
    other["targets"][1, 0] = (other["targets"][1, 0] + 1) % 300
    loss2, _, grads2 = step_lib.batch_gradients(model, params, {}, other)
    assert float(loss2) == float(loss)
    jax.tree.map(np.testing.assert_array_equal, grads2, grads)
    # The eval step gives the same masked mean.
    state = step_lib.TrainState(0, params, None, {}, 0, 0)
    assert float(step_lib.make_eval_step(model)(state, batch)) == pytest.approx(want, rel=1e-5)


def test_accumulation_weights_micro_batches_by_their_loss_tokens(tiny):
    """Micro-batches of 1 + 12 and 24 loss tokens: the step equals the one big batch, where a
    mean of per-micro-batch means would count row 0's single token 12x too much."""
    model, params, batch = tiny
    loss1, _, grads1 = step_lib.batch_gradients(model, params, {}, batch, accum=1)
    loss2, _, grads2 = step_lib.batch_gradients(model, params, {}, batch, accum=2)
    assert float(loss2) == pytest.approx(float(loss1), rel=1e-5)
    for a, b in zip(jax.tree.leaves(grads2), jax.tree.leaves(grads1), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)
    logits = model.apply({"params": params}, batch["inputs"])
    halves = [slice(0, 2), slice(2, 4)]
    mean_of_means = np.mean(
        [numpy_weighted_ce(logits[h], batch["targets"][h], batch["weights"][h]) for h in halves]
    )
    assert abs(float(loss2) - mean_of_means) > 1e-3 * abs(mean_of_means)


def test_chat_template_renders_as_transformers(tmp_path):
    texts = [m["content"] for m in CONVERSATION] * 20 + ["<|im_start|> <|im_end|> assistant"]
    raw = hf_testing.byte_bpe(texts, bos=True)
    raw.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    fast = hf_testing.save_hf_tokenizer(raw, tmp_path, chat_template=CHATML)
    tok = tokenizer_lib.load_hf(tmp_path)
    assert tok.chat_template == CHATML
    for gen in (False, True):
        want = fast.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=gen)
        got = chat.render(CHATML, CONVERSATION, gen, tok.bos_token, tok.eos_token)
        assert got == want
    ids, trained = chat.encode(tok, {"messages": CONVERSATION}, "x")
    want = fast.apply_chat_template(CONVERSATION, tokenize=True)
    assert ids.tolist() == list(want["input_ids"] if hasattr(want, "keys") else want)
    assert ids.tolist().count(tok.bos_id) == 1  # the template's BOS, none added per part
    turns = tok.decode(ids[trained].tolist())
    assert turns == "Jane Austen.<|im_end|>\nAlso Jane Austen, 1817.<|im_end|>\n"
    # Prompt/completion: the tokenizer's BOS, loss on the completion and EOS only.
    ids, trained = chat.encode(tok, {"prompt": "Who wrote Emma?", "completion": " Jane"}, "x")
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.decode(ids[trained].tolist()) == " Jane</s>"


def test_packed_examples_see_only_themselves():
    """Each example's logits in a packed row equal the example run alone (positions restart,
    attention stays within its segment)."""
    run = sft_run(**{"model.style": "llama", "seq_len": 32})
    model = models.build_model(run.model)
    rng = np.random.default_rng(1)
    examples = [(rng.integers(1, 300, n).astype(np.int32), np.ones(n, bool)) for n in (9, 12, 7)]
    row = sft_data.make_row(examples, [0, 1, 2], 32)
    batch = sft_data.stack([row])
    params = model.init(jax.random.PRNGKey(0), batch["inputs"])["params"]
    packed = model.apply(
        {"params": params},
        batch["inputs"],
        positions_BxL=batch["positions"],
        segment_ids_BxL=batch["segment_ids"],
    )
    at = 0
    for ids, _ in examples:
        alone = model.apply({"params": params}, ids[None, :-1])
        n = len(ids) - 1
        np.testing.assert_allclose(packed[0, at : at + n], alone[0], rtol=2e-5, atol=2e-5)
        at += n
    assert row["segment_ids"].tolist() == [1] * 8 + [2] * 11 + [3] * 6 + [0] * 7
    assert row["positions"][8:19].tolist() == list(range(11))


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_stream_is_seeded_resumable_and_split_over_processes(tmp_path):
    records = [{"prompt": f"p{i} " * (i % 5 + 1), "completion": f" c{i}"} for i in range(60)]
    run = sft_run(write_jsonl(tmp_path / "d.jsonl", records), seq_len=24, batch_size=4)
    ds = sft_data.build(run, tmp_path / "work")
    it = ds.train_iter(process_index=0, process_count=1)
    batches = [next(it) for _ in range(30)]  # several epochs
    for b in batches:
        assert set(b) == set(sft_data.KEYS) and b["weights"].dtype == np.float32
        assert np.all(b["weights"][b["segment_ids"] == 0] == 0)
    again = ds.train_iter(process_index=0, process_count=1)
    again.set_state(json.loads(json.dumps(batches and it.get_state())))
    resumed = ds.train_iter(process_index=0, process_count=1)
    resumed.set_state({**it.get_state(), "step": 11})
    for want in batches[11:]:
        got = next(resumed)
        for k in sft_data.KEYS:
            np.testing.assert_array_equal(got[k], want[k])
    halves = [ds.train_iter(process_index=p, process_count=2) for p in (0, 1)]
    for want in batches[:5]:
        got = [next(h) for h in halves]
        np.testing.assert_array_equal(np.concatenate([g["inputs"] for g in got]), want["inputs"])
    other_seed = sft_data.build(dataclasses.replace(run, seed=1), tmp_path / "work2")
    first = next(other_seed.train_iter(process_index=0, process_count=1))
    assert not np.array_equal(first["inputs"], batches[0]["inputs"])
    # Padded rows: one example each.
    padded = sft_data.build(
        dataclasses.replace(run, data=dataclasses.replace(run.data, packing=False)),
        tmp_path / "work3",
    )
    b = next(padded.train_iter(process_index=0, process_count=1))
    assert b["segment_ids"].max() == 1


def test_bad_lines_name_file_and_line(tmp_path):
    good = json.dumps({"prompt": "a", "completion": "b"})
    cases = {
        "not valid JSON": [good, good, "{oops"],
        "'prompt' and 'completion'": [good, json.dumps({"prompt": "a"}), good],
        "'role' and 'content'": [good, good, json.dumps({"messages": [{"role": "user"}]})],
    }
    for message, lines in cases.items():
        path = tmp_path / "bad.jsonl"
        path.write_text("\n".join(lines) + "\n")
        bad = 3 if lines[2] != good else 2
        with pytest.raises(errors.DataError, match=rf"bad.jsonl:{bad}: .*{message}"):
            sft_data.build(sft_run(path), tmp_path / "work")
        assert not (tmp_path / "work").exists()
    chat_line = json.dumps({"messages": CONVERSATION})
    path = write_jsonl(tmp_path / "chat.jsonl", [json.loads(chat_line)] * 4)
    with pytest.raises(errors.DataError, match="chat.jsonl:1: the tokenizer has no chat template"):
        sft_data.build(sft_run(path), tmp_path / "work")


def test_overlong_examples_are_dropped_or_truncated():
    long_, short = (
        (np.arange(40, dtype=np.int32), np.ones(40, bool)),
        (np.arange(5, dtype=np.int32), np.ones(5, bool)),
    )
    kept, counts = sft_data.fit([long_, short], 16, "drop")
    assert len(kept) == 1 and counts["overlong"] == 1
    kept, _ = sft_data.fit([long_, short], 16, "truncate")
    assert [len(ids) for ids, _ in kept] == [17, 5]
    # Row layout: targets shift by one; a target's weight is whether it is a completion token.
    ids, trained = np.array([5, 6, 7, 8, 9], np.int32), np.array([0, 0, 0, 1, 1], bool)
    row = sft_data.make_row([(ids, trained)], [0], 6)
    assert row["inputs"].tolist() == [5, 6, 7, 8, 0, 0]
    assert row["targets"].tolist() == [6, 7, 8, 9, 0, 0]
    assert row["weights"].tolist() == [0, 0, 1, 1, 0, 0]


def test_init_state_starts_from_given_params_and_bad_init_from_is_one_line(tmp_path):
    run = spec.with_level(sft_run(seq_len=16), Level.O2)
    model = models.build_model(run.model)
    tx = step_lib.make_optimizer(run)
    given = nn.unbox(model.init(jax.random.PRNGKey(7), np.zeros((1, 16), np.int32))["params"])
    state = step_lib.init_state(model, tx, run, jax.random.PRNGKey(0), params=given)
    from fp8jax.optim import adam

    for a, b in zip(
        jax.tree.leaves(adam.materialize(state.params)), jax.tree.leaves(given), strict=True
    ):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-6)  # O2: FP16 masters
    bad = dataclasses.replace(run, init_from=str(tmp_path / "missing"))
    with pytest.raises(errors.ConfigError, match="init_from=.*missing.*not a directory"):
        loop.train_and_evaluate(bad, str(tmp_path / "work"))
    assert not (tmp_path / "work").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(errors.UserError, match="neither a Hugging Face model dir"):
        loop.from_checkpoint(
            dataclasses.replace(run, init_from=str(tmp_path / "empty")), str(tmp_path / "work")
        )


def test_sft_tiny_learns_the_titles(tmp_path):
    run = sft_run(
        num_train_steps=60,
        eval_every_steps=20,
        checkpoint_every_steps=0,
        **{"model.d_model": 64, "model.d_ff": 128},
    )
    summary = loop.train_and_evaluate(run, str(tmp_path / "work"))
    evals = [json.loads(line) for line in open(tmp_path / "work" / "metrics.jsonl")]
    losses = [e["val_loss"] for e in evals if "val_loss" in e]
    assert summary["step"] == 60 and len(losses) == 3
    assert losses[-1] < 0.8 * losses[0], losses
