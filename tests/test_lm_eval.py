"""The lm-evaluation-harness backend: the local tasks scored by ``fp8jax`` and by lm-eval's own
Hugging Face backend on the exported checkpoint (the independent reference), O1 scoring against
the model's own forward pass, the command line and its bad input."""

import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from fp8jax import errors
from fp8jax.trainer import corpus as corpus_lib
from fp8jax.trainer import loop as train_lib
from fp8jax.trainer import step as step_lib

from fp8_testing import ROOT, TINY_RUN, with_overrides

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is in the test extra")
from lm_eval.tasks import TaskManager  # noqa: E402

from fp8jax import lm_eval as backend  # noqa: E402

TASKS = ["fp8jax_novel_choice", "fp8jax_novel_title", "fp8jax_novel_text"]
LIMIT = 6  # documents per task


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A 2-step O1 GPT run of configs/tiny.py (context 64) and its float32 Hugging Face export."""
    from fp8jax.hf import io as hf_io

    root = tmp_path_factory.mktemp("lm_eval")
    corpus = root / "corpus.txt"
    text = gzip.open(corpus_lib.SHIPPED_DIR / "pride-and-prejudice.txt.gz", "rt").read()
    corpus.write_text(text[:60_000])
    small = {
        **TINY_RUN,
        "model.max_len": 64,
        "seq_len": 64,
        "num_train_steps": 2,
        "warmup_steps": 1,
        "compilation_cache_dir": "",
        "data.path": str(corpus),
    }
    train_lib.train_and_evaluate(
        with_overrides(train_lib.load_config("tiny"), small), str(root / "wd")
    )
    hf_io.export(str(root / "wd"), str(root / "hf"), "float32", 2**30)
    return root / "wd", root / "hf"


def evaluate(model):
    """lm-eval's results and logged samples of the local tasks (LIMIT documents each)."""
    return lm_eval.simple_evaluate(
        model=model,
        tasks=TASKS,
        task_manager=TaskManager(include_path=str(backend.TASKS_DIR)),
        limit=LIMIT,
        log_samples=True,
    )


def responses(samples):
    """Every sample's raw responses, in document order: loglikelihoods, texts, rolling sums."""
    return [s["resps"] for s in sorted(samples, key=lambda s: s["doc_id"])]


def test_same_scores_as_lm_evals_hugging_face_backend(checkpoints):
    """At O0 in float32 the fp8jax backend (batched, right-padded buckets) and lm-eval's ``hf``
    backend on the exported checkpoint agree: the same accuracy and exact match, the same
    greedy flags and generated texts, log-likelihoods and rolling sums within float32 rounding.
    The contexts are longer than the model's 64 tokens, so both truncate them from the left."""
    from lm_eval.models.huggingface import HFLM

    wd, hf = checkpoints
    ours = evaluate(backend.FP8JaxLM(ckpt=str(wd), level="O0", dtype="float32", batch_size=4))
    ref = evaluate(HFLM(pretrained=str(hf), dtype="float32", batch_size=4, device="cpu"))
    for task in TASKS:
        got, want = ours["results"][task], ref["results"][task]
        metrics = [k for k in want if "," in k and "stderr" not in k]
        assert metrics and {k: got[k] for k in metrics} == pytest.approx(
            {k: want[k] for k in metrics}, rel=1e-5
        ), task
        a, b = responses(ours["samples"][task]), responses(ref["samples"][task])
        assert len(a) == len(b) == LIMIT
        if task == "fp8jax_novel_title":
            assert a == b  # greedy generations, cut at the stop string
            continue
        flat = lambda rs: [x for r in rs for x in np.ravel(r)]  # noqa: E731
        scores_a, scores_b = np.asarray(flat(a), float), np.asarray(flat(b), float)
        # A log-likelihood sums ~10-60 f32 log-probs of magnitude ~6: rounding stays below
        # 1e-5 of it; one token more or less moves it by a token's log-prob (~6).
        np.testing.assert_allclose(scores_a, scores_b, rtol=1e-5, atol=1e-4)


def direct_loglikelihood(inf, context, continuation):
    """The continuation's log-likelihood from one unpadded forward pass of the model (f64
    log-softmax), the sequence cut to the model's context from the left."""
    seq = [*context, *continuation][-(inf.model.cfg.max_len + 1) :]
    n = min(len(continuation), len(seq) - 1)
    variables = {"params": inf.params, step_lib.state_collection(inf.model): inf.fp8_state}
    logits = inf.model.apply(variables, np.asarray([seq[:-1]]))
    x = np.asarray(logits[0], np.float64)
    top = x.max(-1, keepdims=True)
    logp = x - top - np.log(np.exp(x - top).sum(-1, keepdims=True))
    targets = seq[1:]
    return float(sum(logp[i, targets[i]] for i in range(len(targets) - n, len(targets))))


def test_o1_scores_with_the_stored_fp8_scales(checkpoints):
    """At O1 (the run's stored delayed scales) the batched scores equal one unpadded forward
    pass per request of the same O1 model, for short, exact-fit and over-long requests, at
    batch sizes 1 and 3; they differ from O0's (FP8 matmuls really ran)."""
    wd, _ = checkpoints
    o1 = backend.Backend(str(wd), "O1", "float32", batch_size=3)
    assert o1.inf.level == "O1"
    rng = np.random.default_rng(0)
    lengths = [(3, 2), (20, 5), (40, 24), (70, 9), (1, 1)]  # 40 + 24 = 64 + 0; 79 > 65
    requests = [
        (rng.integers(0, 300, c).tolist(), rng.integers(0, 300, t).tolist()) for c, t in lengths
    ]
    got = o1.loglikelihoods(requests)
    want = [direct_loglikelihood(o1.inf, c, t) for c, t in requests]
    np.testing.assert_allclose([g for g, _ in got], want, rtol=1e-5, atol=1e-4)
    one = backend.Backend(str(wd), "O1", "float32", batch_size=1)
    assert [g for g, _ in one.loglikelihoods(requests)] == pytest.approx([g for g, _ in got])
    o0 = backend.Backend(str(wd), "O0", "float32", batch_size=3).loglikelihoods(requests)
    assert max(abs(a - b) for (a, _), (b, _) in zip(o0, got, strict=True)) > 1e-3


def run_cli(*args):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_DATASETS_OFFLINE": "1"}
    command = [sys.executable, "-m", "fp8jax.lm_eval", *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)


def test_command_line_runs_the_local_tasks(checkpoints, tmp_path):
    """``python -m fp8jax.lm_eval --model fp8jax`` finds the backend and the local tasks and
    writes lm-eval's results."""
    wd, _ = checkpoints
    out = run_cli(
        "--model",
        "fp8jax",
        "--model_args",
        f"ckpt={wd},level=O1,batch_size=2",
        "--tasks",
        "fp8jax_novel_choice",
        "--limit",
        "3",
        "--output_path",
        str(tmp_path / "out"),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (results,) = list((tmp_path / "out").rglob("results_*.json"))
    scores = json.loads(results.read_text())["results"]["fp8jax_novel_choice"]
    assert 0.0 <= scores["acc,none"] <= 1.0


@pytest.mark.parametrize(
    "args,message",
    [
        (["--tasks", "no_such_task"], "lm-eval knows no task no_such_task"),
        (["--tasks", "fp8jax_novel_choice", "--model_args", "level=O1"], "ckpt=DIR"),
        (["--tasks", "fp8jax_novel_choice", "--limit", "0"], "--limit 0: evaluates no document"),
        (["--tasks", "fp8jax_novel_choice", "--limit=-2"], "--limit -2: evaluates no document"),
    ],
)
def test_command_line_bad_input_is_one_line(args, message):
    out = run_cli("--model", "fp8jax", *args)
    assert out.returncode == 2, out.stderr[-3000:]
    lines = [line for line in out.stderr.strip().splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and message in lines[0], out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]


def test_an_unknown_model_arg_is_refused():
    """A misspelt --model_args key is named (lm-eval's own flags still pass through)."""
    lm = backend.model_class()
    with pytest.raises(errors.ConfigError, match=r"unknown --model_args levle of fp8jax"):
        lm.create_from_arg_string("ckpt=/nowhere,levle=O1", {"device": "cuda"})
    with pytest.raises(errors.USER_ERRORS, match=r"^--model_args ckpt='/nowhere' is not a dir"):
        lm.create_from_arg_string("ckpt=/nowhere,level=O1", {"device": "cuda"})  # past the keys


@pytest.mark.parametrize(
    "args,message",
    [
        ("level=O9", "unknown --model_args level 'O9': use one of ['O0', 'O1']"),
        ("dtype=float8", "unknown --model_args dtype 'float8'"),
        ("batch_size=0", "--model_args batch_size=0: use an integer >= 1"),
        ("batch_size=2.5", "--model_args batch_size=2.5: use an integer >= 1"),
        ("max_gen_toks=abc", "--model_args max_gen_toks='abc': use an integer >= 1"),
    ],
)
def test_a_bad_model_arg_is_named_as_given(args, message):
    """A bad --model_args value is named as the user wrote it (not as a config field or a flag
    of another command), before the checkpoint is read."""
    lm = backend.model_class()
    with pytest.raises(errors.ConfigError) as info:
        lm.create_from_arg_string(f"ckpt=/nowhere,{args}", {})
    assert message in str(info.value), info.value


def test_without_lm_eval_the_backend_says_how_to_install(monkeypatch):
    """The module imports without lm-eval; asking for the lm-eval class names the extra."""
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    monkeypatch.setitem(sys.modules, "lm_eval.api", None)
    monkeypatch.setitem(sys.modules, "lm_eval.api.model", None)
    backend.model_class.cache_clear()
    try:
        with pytest.raises(errors.ConfigError, match=r"pip install 'fp8jax\[lm-eval\]'"):
            backend.model_class()
    finally:
        monkeypatch.undo()
        backend.model_class.cache_clear()
    assert backend.model_class() is backend.FP8JaxLM
