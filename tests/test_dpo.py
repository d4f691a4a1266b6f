"""Preference tuning (DPO): the loss and sequence log-probs against numpy, log 2 at step 0, a
frozen reference, pair rows (strings and chat), file:line errors, learning at O0 and O1 on the
novel pairs, and an exact resume."""

import gzip
import json
import logging
import math
import os
import signal
import threading

import hf_testing
import jax
import numpy as np
import pytest

from fp8jax import errors, models, spec
from fp8jax import tokenizer as tokenizer_lib
from fp8jax.trainer import dpo_data, loop, stream
from fp8jax.trainer import loss as loss_lib
from fp8jax.trainer.checkpoint import Checkpointer, abstract_like
from fp8jax.trainer.objectives import dpo

from fp8_testing import with_overrides

CHATML = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
STEPS, EVAL_EVERY = 40, 4  # of the learning runs


def dpo_run(path="", level="O0", **changes):
    """configs/dpo_tiny.py with a one-layer model (fast), ``changes`` as dotted keys."""
    c = loop.load_config("dpo_tiny")
    c.model.update(num_layers=1, d_model=64, num_heads=2, num_kv_heads=2, d_ff=128)
    c.fp8.level, c.data.path = level, str(path)
    c.compilation_cache_dir = ""
    with_overrides(c, changes)
    return spec.parse(c)


def numpy_dpo(pi_c, pi_r, ref_c, ref_r, beta, smoothing):
    """DPO's per-pair loss in float64."""
    d = beta * ((pi_c - ref_c) - (pi_r - ref_r))
    log_sig = lambda x: -np.logaddexp(0.0, -x)
    return -(1 - smoothing) * log_sig(d) - smoothing * log_sig(-d), d


def test_dpo_loss_equals_numpy():
    rng = np.random.default_rng(0)
    policy, ref = rng.normal(-20, 5, 16), rng.normal(-20, 5, 16)  # rows: c0, r0, c1, r1 ...
    mask = np.array([1, 1, 1, 1, 1, 1, 0, 1], np.float32)  # pair 6 is padding
    for beta, smoothing in ((0.1, 0.0), (0.5, 0.2)):
        got = dpo.dpo_sums(policy.astype(np.float32), ref.astype(np.float32), mask, beta, smoothing)
        loss_P, d_P = numpy_dpo(policy[0::2], policy[1::2], ref[0::2], ref[1::2], beta, smoothing)
        m = mask.astype(bool)
        assert float(got["loss"]) == pytest.approx(loss_P[m].sum(), rel=1e-5)
        assert float(got["reward_margin"]) == pytest.approx(d_P[m].sum(), rel=1e-4, abs=1e-5)
        assert float(got["reward_accuracy"]) == (d_P[m] > 0).sum()
        assert float(got["chosen_logp"]) == pytest.approx(policy[0::2][m].sum(), rel=1e-6)
        assert float(got["rejected_logp"]) == pytest.approx(policy[1::2][m].sum(), rel=1e-6)


def test_sequence_logps_sum_the_response_tokens_only():
    """The numpy sum of the weighted targets' log-probs; prompt targets and padding changed ->
    the same log-probs."""
    run = dpo_run(seq_len=16, **{"model.max_len": 16})
    model = models.build_model(run.model)
    prompt, chosen, rejected = [5, 6, 7, 8], [9, 10, 11], [12, 13]
    trained = lambda r: np.array([0] * len(prompt) + [1] * len(r), bool)
    examples = [(np.array(prompt + r, np.int32), trained(r)) for r in (chosen, rejected)]
    batch = dpo_data.stack([dpo_data.make_row(examples, [i], 16) for i in (0, 1)])
    assert batch["weights"].sum(1).tolist() == [3, 2]  # targets of the response tokens only
    params = model.init(jax.random.PRNGKey(0), batch["inputs"])["params"]
    logits = np.asarray(model.apply({"params": params}, batch["inputs"]), np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    tok = np.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
    want = [tok[0, 3:6].sum(), tok[1, 3:5].sum()]  # target k is token k + 1
    got = loss_lib.sequence_logps(logits.astype(np.float32), batch["targets"], batch["weights"])
    np.testing.assert_allclose(got, want, rtol=1e-5)
    other = {k: v.copy() for k, v in batch.items()}
    other["targets"][:, :3] = 1  # prompt targets
    other["inputs"][0, 6:], other["inputs"][1, 5:] = 2, 3  # padding after each response
    logits2 = model.apply({"params": params}, other["inputs"])
    got2 = loss_lib.sequence_logps(logits2, other["targets"], other["weights"])
    np.testing.assert_array_equal(np.asarray(got2), np.asarray(got))


def test_pairs_share_their_prompt_and_chat_pairs_train_the_response_turns_only(tmp_path):
    raw = hf_testing.byte_bpe(["Who wrote Emma? Jane Austen. Brontë"] * 20, bos=True)
    raw.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    hf_testing.save_hf_tokenizer(raw, tmp_path, chat_template=CHATML)
    tok = tokenizer_lib.load_hf(tmp_path)
    text = dict(prompt="Who wrote Emma?", chosen=" Jane Austen.", rejected=" Brontë")
    rows = [dpo_data.encode_response(tok, text, k, "x") for k in ("chosen", "rejected")]
    (c_ids, c_w), (r_ids, r_w) = rows
    assert c_ids[: (~c_w).sum()].tolist() == r_ids[: (~r_w).sum()].tolist()  # the same prompt
    assert tok.decode(c_ids[c_w].tolist()) == " Jane Austen.</s>"
    assert tok.decode(r_ids[r_w].tolist()) == " Brontë</s>"
    prompt = [
        {"role": "user", "content": "Who wrote Emma?"},
        {"role": "assistant", "content": "Jane Austen."},
        {"role": "user", "content": "Sure?"},
    ]
    chat = dict(
        prompt=prompt,
        chosen=[{"role": "assistant", "content": "Yes."}],
        rejected=[{"role": "assistant", "content": "Brontë."}],
    )
    ids, trained = dpo_data.encode_response(tok, chat, "chosen", "x")
    assert tok.decode(ids[trained].tolist()) == "Yes.<|im_end|>\n"  # not the prompt's turn
    ids, trained = dpo_data.encode_response(tok, chat, "rejected", "x")
    assert tok.decode(ids[trained].tolist()) == "Brontë.<|im_end|>\n"


def test_bad_lines_name_file_and_line(tmp_path):
    good = json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"})
    cases = {
        "not valid JSON": [good, good, "{oops"],
        "missing 'rejected'": [good, json.dumps({"prompt": "a", "chosen": "b"}), good],
        "must all be strings, or all lists": [
            good,
            good,
            json.dumps({"prompt": "a", "chosen": "b", "rejected": [{"role": "assistant"}]}),
        ],
    }
    for message, lines in cases.items():
        path = tmp_path / "bad.jsonl"
        path.write_text("\n".join(lines) + "\n")
        bad = 3 if lines[2] != good else 2
        with pytest.raises(errors.DataError, match=rf"bad.jsonl:{bad}: .*{message}"):
            dpo_data.build(dpo_run(path), tmp_path / "work")
        assert not (tmp_path / "work").exists()
    # A line that is not UTF-8 is named; a .jsonl.gz cut short is one line, not an EOFError.
    path.write_bytes(f"{good}\n".encode() + b'{"prompt": "\xff", "chosen": "b"}\n')
    with pytest.raises(errors.DataError, match=r"bad.jsonl:2: not UTF-8 text"):
        dpo_data.build(dpo_run(path), tmp_path / "work")
    whole = gzip.compress(f"{good}\n".encode() * 500)
    (tmp_path / "cut.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(errors.DataError, match=r"cut.jsonl.gz is not a complete gzip file"):
        dpo_data.build(dpo_run(tmp_path / "cut.jsonl.gz"), tmp_path / "work")
    assert not (tmp_path / "work").exists()
    with pytest.raises(errors.ConfigError, match="data.packing=True with data.format='dpo'"):
        dpo_run(**{"data.packing": True})
    with pytest.raises(errors.ConfigError, match="multiple of 2 x grad_accum_steps"):
        dpo_run(batch_size=6, grad_accum_steps=2)


def test_pairs_whose_chosen_is_their_rejected_are_refused_or_counted(tmp_path, caplog):
    """Every pair's chosen response equal to its rejected one (the loss stays log 2) is refused
    naming the file, its first such line and the fix, before the work dir exists; some such
    pairs are counted in a warning; so are pairs that truncation makes one."""
    path, work = tmp_path / "pairs.jsonl", tmp_path / "work"
    pairs = [dict(prompt=f"question {i}", chosen=f"yes {i}", rejected=f"yes {i}") for i in range(8)]
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    run = dpo_run(path, **{"data.val_fraction": 0.25})  # 6 training, 2 validation pairs
    with pytest.raises(errors.DataError, match=r"pairs.jsonl: every one of its 6 training pairs "):
        dpo_data.build(run, work)
    with pytest.raises(errors.DataError, match=r"first at .*pairs.jsonl:1\).* differs from"):
        dpo_data.build(run, work)
    assert not work.exists()
    for p in pairs[:5]:
        p["rejected"] = "no"
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    with caplog.at_level(logging.WARNING):
        ds = dpo_data.build(run, work)
    same = sum(np.array_equal(*ds.train[k : k + 2]) for k in range(0, len(ds.train), 2))
    val_same = sum(np.array_equal(*ds.val[k : k + 2]) for k in range(0, len(ds.val), 2))
    assert 0 < same < len(ds.train) // 2 and same + val_same == len(pairs) - 5
    assert f"{same} of 6 training and {val_same} of 2 validation pairs" in caplog.text
    assert "pairs.jsonl:6" in caplog.text
    # Responses that differ only past seq_len are one row once truncated.
    long = [dict(prompt="q", chosen="word " * 99 + w, rejected="word " * 99 + "no") for w in "ab"]
    path.write_text("".join(json.dumps(p) + "\n" for p in long * 4))
    with pytest.raises(errors.DataError, match=r"training pairs .* once cut to seq_len=64, so"):
        dpo_data.build(dpo_run(path, **{"data.overlong": "truncate"}), tmp_path / "work2")


def test_step_zero_is_log_2_and_only_the_policy_trains(tmp_path):
    """Reference == policy at step 0: loss log 2, no pair ahead, zero margin. After steps the
    policy has moved and the reference is bit for bit the initial weights."""
    run = dpo_run(batch_size=8)
    ds = dpo_data.build(run, tmp_path)
    env = loop.setup(run, donate=False)
    state = env.init(jax.random.PRNGKey(0))
    initial = jax.device_get(state.params)
    it = ds.train_iter()
    batch = next(it)
    at_zero = env.objective.evaluate(env.eval_step, state, [batch], env.batch_sharding)
    assert at_zero["val_loss"] == pytest.approx(math.log(2), rel=1e-7)
    assert at_zero["val_reward_accuracy"] == 0.0 and at_zero["val_reward_margin"] == 0.0
    assert at_zero["val_chosen_logp"] < 0 and at_zero["val_rejected_logp"] < 0
    # The train step's policy forward runs under autodiff (other fusions): equal to rounding.
    _, first = env.train_step(state, batch)
    assert float(first["loss"]) == pytest.approx(math.log(2), abs=1e-6)
    assert abs(float(first["reward_margin"])) < 1e-6
    assert float(first["chosen_logp"]) == pytest.approx(at_zero["val_chosen_logp"], rel=1e-6)
    for _ in range(3):
        state, metrics = env.train_step(state, next(it))
    leaves = lambda tree: jax.tree.leaves(jax.device_get(tree))
    pairs = zip(leaves(state.params), leaves(initial), strict=True)
    moved = [np.abs(a - b).max() for a, b in pairs]
    assert max(moved) > 0  # the policy trained
    for a, b in zip(leaves(state.objective["params"]), leaves(initial), strict=True):
        np.testing.assert_array_equal(a, b)
    assert float(metrics["reward_margin"]) != 0.0
    assert jax.tree.structure(env.state_shardings.objective["params"]) == jax.tree.structure(
        env.state_shardings.params
    )  # sharded like the policy


def evals(workdir):
    records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    return [r for r in records if "val_reward_accuracy" in r]


def final_state(run, workdir):
    env = loop.setup(run, donate=False)
    ckpt = Checkpointer(str(workdir))
    try:
        state, _ = ckpt.restore(abstract_like(env.abstract, env.state_shardings))
    finally:
        ckpt.close()
    return jax.device_get(state)


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory):
    """dpo_tiny's novel pairs with the passage replaced by the novel's name: 30 (title, other
    title) pairs that held-out pairs repeat, so a short run can learn them; telling the novels
    apart by their passages takes a model and a run larger than a test affords."""
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    pairs = [dict(p, prompt=f"Book:{p['chosen']}\nNovel:") for p in dpo_data.novel_pairs(256)]
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    return path


def learning_run(level, path):
    more = {"data.val_fraction": 0.2, "eval_batches": 8}  # every held-out pair
    return dpo_run(
        path,
        level,
        num_train_steps=STEPS,
        eval_every_steps=EVAL_EVERY,
        learning_rate=3e-3,
        checkpoint_every_steps=0,
        **more,
    )


@pytest.fixture(scope="module")
def learned_o0(tmp_path_factory, pairs_file):
    workdir = tmp_path_factory.mktemp("dpo") / "o0"
    loop.train_and_evaluate(learning_run("O0", pairs_file), str(workdir))
    return workdir


def assert_learned(workdir):
    """The held-out reward accuracy and margin end above the first evaluation's."""
    e = evals(workdir)
    assert len(e) == STEPS // EVAL_EVERY, e
    assert e[-1]["val_reward_accuracy"] > e[0]["val_reward_accuracy"], e
    assert e[-1]["val_reward_margin"] > e[0]["val_reward_margin"], e
    assert e[-1]["val_loss"] < e[0]["val_loss"], e
    # The policy's own log-probs, apart from the rewards: the chosen titles gained on the others.
    gap = lambda r: r["val_chosen_logp"] - r["val_rejected_logp"]
    assert gap(e[-1]) > gap(e[0]) + 1.0, e


def test_dpo_tiny_raises_reward_accuracy_and_margin_at_o0(learned_o0):
    assert_learned(learned_o0)


def test_dpo_tiny_raises_reward_accuracy_and_margin_at_o1(tmp_path, pairs_file):
    loop.train_and_evaluate(learning_run("O1", pairs_file), str(tmp_path / "o1"))
    assert_learned(tmp_path / "o1")


def test_resume_is_exact(learned_o0, pairs_file, tmp_path, monkeypatch):
    """SIGTERM while step 16's batch is read: the run checkpoints and returns; the rerun ends
    with the uninterrupted run's state (policy, optimizer, reference) bit for bit."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers need the main thread")
    run, read = learning_run("O0", pairs_file), stream.TrainIterator.__next__

    def read_and_signal(self):
        if self.step == 15:
            os.kill(os.getpid(), signal.SIGTERM)
        return read(self)

    monkeypatch.setattr(stream.TrainIterator, "__next__", read_and_signal)
    first = loop.train_and_evaluate(run, str(tmp_path))
    assert first["preempted_at"] == 16
    monkeypatch.undo()
    assert loop.train_and_evaluate(run, str(tmp_path))["step"] == STEPS
    want, got = final_state(run, learned_o0), final_state(run, tmp_path)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)
    assert got.objective and jax.tree.leaves(got.objective["params"])
    assert evals(tmp_path)[-1] == evals(learned_o0)[-1]
