"""The fine-tuning result one can measure: which novel a passage comes from, by exact match.

1. Pre-trains a small GPT on the shipped corpus (``train_and_evaluate``, level O0).
2. Fine-tunes it (``init_from`` the pre-training work dir) on the novel task at each of
   ``--levels`` from the same start, the same examples and the same data order; the training
   and test passages come from disjoint parts of each novel (``fp8jax.trainer.tasks``).
3. Preference-tunes (DPO, ``init_from``) the SFT work dir of each of ``--dpo-levels`` at its
   level, on pairs of the same training examples (``tasks.preference_pairs``: the true title
   chosen, another rejected); the held-out pairs are those of the test examples. Before and
   after, on the held-out pairs: DPO's reward accuracy and margin (policy against the frozen
   SFT reference: 0 at the start, where the two are equal) and the preference accuracy of the
   policy's own log-probs (the share of pairs with log p(chosen) > log p(rejected)).
4. Scores the pre-trained, each fine-tuned and each preference-tuned work dir on the held-out
   passages: the completion is decoded greedily (``trainer.generate``) and counts when it is
   the true title exactly; chance is 1/6.
5. The downstream table: after every training run, scores the pre-trained and each fine-tuned
   work dir through lm-evaluation-harness with the ``fp8jax`` backend (``fp8jax.lm_eval``, at the
   level it picks: an O1+ work dir at O1 with its trained FP8 scales, an O0 one at O0; in its
   default dtype: bfloat16 on a GPU, float32 on a CPU) on the local tasks
   ``fp8jax_novel_choice`` (multiple choice over the six titles: ``acc``) and
   ``fp8jax_novel_title`` (the title generated: ``exact_match``), their passages as long as the
   fine-tuning's (the tasks' ``passage_words``), beside each task's chance from its own
   documents (``chance``). ``--downstream-limit`` documents per task (0: all; ``--size
   tiny``: 12), ``--no-downstream`` skips it; without lm-eval one line says what to install and
   the rest runs.

Each stage is a ``train_and_evaluate`` run in its own work dir under ``<out>/finetune_work``;
each writes ``<out>/finetune_<stage>.json`` (the downstream scores under ``downstream``) and the
tables are printed at the end.

    PYTHONUNBUFFERED=1 XLA_FLAGS=--xla_gpu_enable_triton_gemm=false \\
        python -m benchmarks.finetune --out "$OUT"

``--size tiny`` is the CPU run of the same path (a few minutes on 2 cores); ``--pretrain-steps``,
``--sft-steps`` and ``--dpo-steps`` shorten a stage, ``--set key=value`` overrides every run and
a level its fine-tuning and preference-tuning runs (``--levels O0,O1:model.fp8_lm_head=True``).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from benchmarks import runner

if TYPE_CHECKING:  # lm-eval is optional: its types only where it is installed
    from lm_eval.api.task import Task
    from lm_eval.tasks import TaskManager


@dataclasses.dataclass(frozen=True)
class Size:
    """One benchmark size: the pre-training run spec and settings, the fine-tuning and the
    preference-tuning configs and settings, the task's passage length and example counts, and
    the documents per task of the downstream table (0: all)."""

    pretrain: str  # run spec of the pre-training (config:level[:options])
    pretrain_settings: dict
    sft: str  # config name of the fine-tuning runs (the level is --levels')
    sft_settings: dict
    dpo: str  # config name of the preference-tuning runs (the level is the SFT run's)
    dpo_settings: dict
    passage_words: int
    num_train: int
    num_test: int
    downstream_limit: int


SIZES = {
    # CPU: configs/tiny.py's model, a few dozen steps of each stage.
    "tiny": Size(
        pretrain="tiny:O0",
        pretrain_settings={"num_train_steps": 200, "warmup_steps": 20, "log_every_steps": 50},
        sft="sft_tiny",
        sft_settings={
            "seq_len": 64,
            "batch_size": 8,
            "num_train_steps": 150,
            "warmup_steps": 15,
            "learning_rate": 1e-3,
        },
        dpo="dpo_tiny",
        dpo_settings={
            "seq_len": 64,
            "batch_size": 16,
            "num_train_steps": 60,
            "warmup_steps": 6,
            "learning_rate": 1e-4,
            "eval_batches": 2,
        },
        passage_words=12,
        num_train=192,
        num_test=48,
        downstream_limit=12,
    ),
    # One GPU: a 34M-parameter GPT (8 x 512, 8k BPE), ~8M tokens of pre-training.
    "gpu": Size(
        pretrain="gpt2_125m:O0",
        pretrain_settings={
            "model.num_layers": 8,
            "model.d_model": 512,
            "model.num_heads": 8,
            "model.num_kv_heads": 8,
            "model.d_ff": 2048,
            "model.vocab_size": 8192,
            "model.max_len": 256,
            "seq_len": 256,
            "batch_size": 32,
            "num_train_steps": 1000,
            "warmup_steps": 100,
            "learning_rate": 1e-3,
            "log_every_steps": 100,
        },
        sft="sft_tiny",
        sft_settings={
            "model.dtype": "bfloat16",
            "seq_len": 256,
            "batch_size": 32,
            "num_train_steps": 300,
            "warmup_steps": 30,
            "learning_rate": 3e-4,
            "log_every_steps": 50,
            "eval_batches": 8,
        },
        # Short: policy and reference start at the SFT model, which already ranks most pairs
        # right; beta 0.1 and a small rate move it without undoing the fine-tuning.
        dpo="dpo_tiny",
        dpo_settings={
            "model.dtype": "bfloat16",
            "seq_len": 256,
            "batch_size": 32,
            "num_train_steps": 150,
            "warmup_steps": 15,
            "learning_rate": 2e-5,
            "dpo.beta": 0.1,
            "log_every_steps": 25,
            "eval_batches": 4,
        },
        passage_words=48,
        num_train=6000,
        num_test=600,
        downstream_limit=0,
    ),
}
STAGE_FIELDS = ("val_loss", "train_loss", "train_tokens_per_s")
# The DPO run's last logs: its training pairs' and its own validation split's (of the training
# examples) statistics; the test examples' pairs are in 'held_out'.
DPO_FIELDS = (
    "train_reward_accuracy",
    "train_reward_margin",
    "val_reward_accuracy",
    "val_reward_margin",
)
# The local lm-eval tasks of the downstream table (fp8jax/trainer/lm_eval_tasks).
DOWNSTREAM_TASKS = ("fp8jax_novel_choice", "fp8jax_novel_title")
DOWNSTREAM_EXAMPLES = 6  # documents per task whose answers a stage's JSON keeps


def stage_settings(steps: int, extra: dict) -> dict:
    """One evaluation and one checkpoint, at the end; no end-of-run sample."""
    return {"eval_every_steps": steps, "checkpoint_every_steps": steps, "sample_tokens": 0, **extra}


def with_steps(settings: dict, steps: int) -> dict:
    """``settings`` with ``num_train_steps`` (0: theirs) and a warm-up of at most a tenth."""
    if not steps:
        return settings
    return {
        **settings,
        "num_train_steps": steps,
        "warmup_steps": min(settings["warmup_steps"], max(1, steps // 10)),
    }


def pretrain_config(size: Size, steps: int = 0, sets=()):
    """The pre-training ConfigDict of ``size`` (``steps``: 0 for the size's)."""
    settings = with_steps(size.pretrain_settings, steps)
    return runner.load(size.pretrain, sets, stage_settings(settings["num_train_steps"], settings))


def sft_config(size: Size, level: str, init_from: str, train_path: str, steps=0, sets=()):
    """The fine-tuning ConfigDict at ``level`` ('O1' or 'O1:key=value+...') from ``init_from``."""
    settings = with_steps(size.sft_settings, steps)
    steps = settings["num_train_steps"]
    extra = {**settings, "init_from": init_from, "data.path": train_path, "data.val_fraction": 0.05}
    return runner.load(f"{size.sft}:{level}", sets, stage_settings(steps, extra))


def dpo_config(size: Size, level: str, init_from: str, train_path: str, steps=0, sets=()):
    """The preference-tuning ConfigDict at ``level`` from the SFT work dir ``init_from``."""
    settings = with_steps(size.dpo_settings, steps)
    steps = settings["num_train_steps"]
    extra = {**settings, "init_from": init_from, "data.path": train_path, "data.val_fraction": 0.05}
    return runner.load(f"{size.dpo}:{level}", sets, stage_settings(steps, extra))


def held_out_preferences(config, workdir: str, pairs: list[dict]) -> dict:
    """DPO statistics of the held-out ``pairs`` at the start of the DPO run ``config`` (policy
    and reference its init_from checkpoint, as the trainer starts) and at its end (the latest
    state in ``workdir``): reward accuracy and margin, mean log-probs, and the preference
    accuracy of the policy alone (log p(chosen) > log p(rejected))."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from fp8jax import spec
    from fp8jax.optim import adam
    from fp8jax.parallel import sharding
    from fp8jax.trainer import checkpoint, dpo_data, loop, loss
    from fp8jax.trainer import step as step_lib
    from fp8jax.trainer.objectives import dpo

    run = spec.parse(config)
    with tempfile.TemporaryDirectory() as empty:  # not a resume: the init_from weights
        run, tok, params = loop.from_checkpoint(run, empty)
    env = loop.setup(run, donate=False)
    encoded = [
        tuple(
            dpo_data.encode_response(tok, p, k, f"held-out pair {i}")
            for k in ("chosen", "rejected")
        )
        for i, p in enumerate(pairs, 1)
    ]
    rows, dropped = dpo_data.fit_pairs(encoded, run.optim.seq_len, "drop")
    data = dpo_data.DpoDataset(
        tok, [], rows, seed=run.seed, batch_size=run.optim.batch_size, seq_len=run.optim.seq_len
    )
    batches = data.eval_batches(len(rows))
    coll = step_lib.state_collection(env.model)

    @jax.jit
    def policy_wins(state, batch):  # pairs whose chosen row the policy prefers, real pairs
        with sharding.activation_sharding(env.mesh):
            variables = {"params": adam.materialize(state.params), coll: state.fp8}
            logits = env.model.apply(variables, batch["inputs"], **loss.model_kwargs(batch))
        logps_Px2 = loss.sequence_logps(logits, batch["targets"], batch[loss.WEIGHTS])
        mask_P = dpo.pair_mask(batch[loss.WEIGHTS])
        wins_P = (logps_Px2.reshape(-1, 2)[:, 0] > logps_Px2.reshape(-1, 2)[:, 1]) * mask_P
        return jnp.sum(wins_P), jnp.sum(mask_P)

    def stats(state) -> dict:
        out = env.objective.evaluate(env.eval_step, state, batches, env.batch_sharding)
        out = {k.removeprefix("val_"): v for k, v in out.items()}
        counts = [policy_wins(state, sharding.put_batch(b, env.batch_sharding)) for b in batches]
        wins, real = np.sum(jax.device_get(counts), axis=0)
        return {**out, "preference_accuracy": float(wins / max(real, 1))}

    before = stats(env.init(jax.random.PRNGKey(run.seed), params))
    ckpt = checkpoint.Checkpointer(workdir)
    try:
        end, _ = ckpt.restore(checkpoint.abstract_like(env.abstract, env.state_shardings))
    finally:
        ckpt.close()
    return {
        "before": before,
        "after": stats(end),
        "num_pairs": len(rows) // 2,
        "dropped_pairs": dropped,
    }


def score(workdir: str, test: list[dict]) -> dict:
    """Exact match of the work dir's greedy completions on the ``test`` examples, decoded as
    ``python -m fp8jax.generate`` does (``trainer.inference.load``: an O1+ work dir at O1 with
    its trained FP8 scales, an O0 one at O0) and cut at EOS."""
    from fp8jax.trainer import generate, inference, tasks

    inf = inference.load(workdir)
    titles = tasks.novel_titles()
    max_new = max(len(inf.tokenizer.encode(f" {t}")) for t in titles) + 1  # the title, EOS
    t0 = time.perf_counter()
    prompts = [r["prompt"] for r in test]
    predictions = generate.generate(
        inf.model,
        inf.params,
        inf.fp8_state,
        inf.tokenizer,
        prompts,
        max_new,
        moe_state=inf.moe_state,
    )
    answers = [tasks.title_in(r) for r in test]
    return {
        "exact_match": tasks.exact_match(predictions, answers),
        "chance": tasks.chance(),
        "valid_title": sum(p.strip() in titles for p in predictions) / len(predictions),
        "num_test": len(test),
        "decode_level": inf.level,
        "decode_s": time.perf_counter() - t0,
        "examples": [
            {"expected": a, "predicted": p}
            for a, p in zip(answers[:6], predictions[:6], strict=True)
        ],
    }


def downstream_unavailable() -> str | None:
    """None when lm-eval can score the work dirs, else the one line saying what to install."""
    from fp8jax import errors
    from fp8jax import lm_eval as backend

    try:
        backend.model_class()
    except errors.ConfigError:
        return f"no downstream table: it needs lm-eval ({backend.INSTALL_FIX})"
    return None


def task_manager(passage_words: int) -> TaskManager:
    """lm-eval's task index of the local tasks only (``fp8jax.lm_eval.TASKS_DIR``: indexing
    lm-eval's own thousands of tasks takes seconds and none is scored here), their passages
    ``passage_words`` long: the length the fine-tuning trained on (the tasks' metadata)."""
    from lm_eval.tasks import TaskManager

    from fp8jax import lm_eval as backend

    return TaskManager(
        include_path=str(backend.TASKS_DIR),
        include_defaults=False,
        metadata={"passage_words": passage_words},
    )


def chance(task: Task, num_docs: int) -> float:
    """The expected score of a uniform guess on the first ``num_docs`` documents of the lm-eval
    ``task``, from the task's own documents: the mean of 1/(number of choices) for multiple
    choice; for generation (exact match), 1/(number of distinct targets of the task), a guess
    among its answers."""
    docs = list(task.eval_docs)
    scored = docs[:num_docs]
    if not scored:
        raise ValueError(f"{task.config.task}: no documents to score")
    if task.OUTPUT_TYPE == "multiple_choice":
        return sum(1 / len(task.doc_to_choice(d)) for d in scored) / len(scored)
    if task.OUTPUT_TYPE == "generate_until":
        return 1 / len({str(task.doc_to_target(d)) for d in docs})
    raise ValueError(f"{task.config.task}: no chance for output type {task.OUTPUT_TYPE!r}")


def downstream_example(task: Task, sample: dict) -> dict:
    """One logged lm-eval sample as expected and predicted answer (multiple choice: with each
    choice's log-likelihood)."""
    if task.OUTPUT_TYPE == "multiple_choice":
        choices = task.doc_to_choice(sample["doc"])
        lls = [float(r[0]) for r in sample["filtered_resps"]]
        return {
            "expected": choices[sample["target"]],
            "predicted": choices[max(range(len(lls)), key=lls.__getitem__)],
            "loglikelihoods": lls,
        }
    (predicted,) = sample["filtered_resps"]
    return {"expected": str(sample["target"]), "predicted": predicted}


def downstream(
    workdir: str, limit: int, manager: TaskManager, tasks: Sequence[str] = DOWNSTREAM_TASKS
) -> dict:
    """The work dir scored by lm-eval through the ``fp8jax`` backend on the local ``tasks``
    (their first ``limit`` documents; 0: all) at the level the backend picks (an O1+ work dir at
    O1 with its trained FP8 scales, an O0 one at O0): each task's metrics as lm-eval reports
    them (``metric,filter``: score), chance beside them and the first documents' answers."""
    import lm_eval

    from fp8jax import lm_eval as backend
    from fp8jax.trainer import inference

    dtype = inference.default_dtype()
    t0 = time.perf_counter()
    model = backend.FP8JaxLM(ckpt=workdir, dtype=dtype)
    out = lm_eval.simple_evaluate(
        model=model,
        tasks=list(tasks),
        task_manager=manager,
        limit=limit or None,
        log_samples=True,
    )
    defs = manager.load(list(tasks))["tasks"]
    scores = {}
    for name in tasks:
        task, n = defs[name], out["n-samples"][name]["effective"]
        samples = sorted(out["samples"][name], key=lambda s: s["doc_id"])
        scores[name] = {
            "metrics": {
                k: float(v)
                for k, v in out["results"][name].items()
                if "," in k and "_stderr," not in k
            },
            "chance": chance(task, n),
            "num_docs": n,
            "examples": [downstream_example(task, s) for s in samples[:DOWNSTREAM_EXAMPLES]],
        }
    return {
        "level": model.backend_.inf.level,
        "dtype": dtype,
        "limit": limit,
        "passage_words": int(manager.metadata["passage_words"]),
        "eval_s": time.perf_counter() - t0,
        "tasks": scores,
    }


def downstream_rows(rows: list[dict]) -> list[dict]:
    """A row per stage, task and metric of the stages scored downstream."""
    out = []
    for r in rows:
        d = r.get("downstream")
        for task, t in (d or {}).get("tasks", {}).items():
            for key, value in t["metrics"].items():
                metric, filt = key.split(",", 1)
                out.append(
                    {
                        "stage": r["stage"],
                        "level": d["level"],
                        "task": task,
                        "metric": metric if filt == "none" else f"{metric} ({filt})",
                        "score": value,
                        "chance": t["chance"],
                        "docs": t["num_docs"],
                    }
                )
    return out


def fresh(path: str) -> str:
    """``path`` emptied (a rerun starts its stage over)."""
    shutil.rmtree(path, ignore_errors=True)
    return path


def main(argv=None):
    p = runner.parser(__doc__, child=False, sets=True)
    p.add_argument("--size", default="gpu", choices=sorted(SIZES))
    p.add_argument("--levels", default="O0,O1,O2", help="fine-tuning levels (options as --runs)")
    p.add_argument("--pretrain-steps", type=int, default=0, help="0: the size's")
    p.add_argument("--sft-steps", type=int, default=0, help="0: the size's")
    p.add_argument(
        "--dpo-levels",
        default=None,
        help="SFT levels (of --levels) to preference-tune from, at that level; "
        "default: those of O0 and O1 in --levels; '' for none",
    )
    p.add_argument("--dpo-steps", type=int, default=0, help="0: the size's")
    p.add_argument(
        "--downstream-limit",
        type=int,
        default=None,
        help="documents per lm-eval task of the downstream table; 0: all; default: the size's "
        "(gpu: all, tiny: 12)",
    )
    p.add_argument(
        "--no-downstream",
        action="store_true",
        help="no downstream table (the pre-trained and SFT work dirs scored through lm-eval)",
    )
    a = runner.parse_args(p, argv)
    size = SIZES[a.size]
    limit = size.downstream_limit if a.downstream_limit is None else a.downstream_limit
    if limit < 0:
        raise SystemExit(f"error: --downstream-limit {limit}: use 0 (all documents) or more")
    levels = a.levels.split(",")
    if a.dpo_levels is None:
        dpo_levels = [lv for lv in levels if lv in ("O0", "O1")]
    else:
        dpo_levels = [lv for lv in a.dpo_levels.split(",") if lv]
    if set(dpo_levels) - set(levels):
        raise SystemExit(
            f"error: --dpo-levels {','.join(dpo_levels)}: each must be one of "
            f"--levels {a.levels} (DPO starts from that SFT run)"
        )
    work = os.path.join(a.out, "finetune_work")
    data_dir = os.path.join(work, "data")
    pre_dir = os.path.join(work, "pretrain")
    train_path = os.path.join(data_dir, "train.jsonl")
    pairs_path = os.path.join(data_dir, "dpo_train.jsonl")
    sft_dir = lambda lv: os.path.join(work, runner.safe_name(f"sft_{lv}"))  # noqa: E731
    try:  # every config before the first run: a typo stops the benchmark at once
        pre_cfg = pretrain_config(size, a.pretrain_steps, a.set)
        sft_cfgs = {
            lv: sft_config(size, lv, pre_dir, train_path, a.sft_steps, a.set) for lv in levels
        }
        dpo_cfgs = {
            lv: dpo_config(size, lv, sft_dir(lv), pairs_path, a.dpo_steps, a.set)
            for lv in dpo_levels
        }
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise SystemExit(f"error: {' '.join(str(e).split())}") from None
    from fp8jax.trainer import loop, tasks

    unavailable = None if a.no_downstream else downstream_unavailable()
    if unavailable:
        print(unavailable, flush=True)  # the rest of the benchmark runs without it
    os.makedirs(data_dir, exist_ok=True)
    train, test = tasks.novel_split(size.num_train, size.num_test, size.passage_words)
    tasks.write_jsonl(train_path, train)
    tasks.write_jsonl(os.path.join(data_dir, "test.jsonl"), test)
    tasks.write_jsonl(pairs_path, tasks.preference_pairs(train, seed=0))
    test_pairs = tasks.preference_pairs(test, seed=1)
    tasks.write_jsonl(os.path.join(data_dir, "dpo_test.jsonl"), test_pairs)

    rows, stems = [], {}  # stems: JSON name of each stage scored downstream
    t0 = time.perf_counter()
    summary = loop.train_and_evaluate(pre_cfg, fresh(pre_dir))
    row = {
        "stage": "pretrain",
        "level": pre_cfg.fp8.level,
        "run_s": time.perf_counter() - t0,
        **{k: summary.get(k) for k in STAGE_FIELDS},
    }
    row.update(score(pre_dir, test))  # before fine-tuning: the baseline beside chance
    runner.write_json(a.out, "finetune_pretrain", row)
    stems[pre_dir] = ("finetune_pretrain", row)
    rows.append(row)
    print(row, flush=True)
    for level, c in sft_cfgs.items():
        t0 = time.perf_counter()
        summary = loop.train_and_evaluate(c, fresh(sft_dir(level)))
        row = {
            "stage": f"sft {level}",
            "level": c.fp8.level,
            "run_s": time.perf_counter() - t0,
            **{k: summary.get(k) for k in STAGE_FIELDS},
            **score(sft_dir(level), test),
        }
        runner.write_json(a.out, runner.safe_name(f"finetune_sft_{level}"), row)
        stems[sft_dir(level)] = (runner.safe_name(f"finetune_sft_{level}"), row)
        rows.append(row)
        print(row, flush=True)
    for level, c in dpo_cfgs.items():
        dpo_dir = fresh(os.path.join(work, runner.safe_name(f"dpo_{level}")))
        t0 = time.perf_counter()
        summary = loop.train_and_evaluate(c, dpo_dir)
        row = {
            "stage": f"dpo {level}",
            "level": c.fp8.level,
            "run_s": time.perf_counter() - t0,
            "beta": c.dpo.beta,
            **{k: summary.get(k) for k in (*STAGE_FIELDS, *DPO_FIELDS)},
            "held_out": held_out_preferences(c, dpo_dir, test_pairs),
            **score(dpo_dir, test),
        }
        runner.write_json(a.out, runner.safe_name(f"finetune_dpo_{level}"), row)
        rows.append(row)
        print(row, flush=True)
    columns = {
        "val_loss": lambda r: f"{r['val_loss']:.4f}",
        "exact": lambda r: f"{r['exact_match']:.3f}",
        "chance": lambda r: f"{r['chance']:.3f}",
        "valid": lambda r: f"{r['valid_title']:.2f}",
        "pref acc": lambda r: "{before:.2f}->{after:.2f}".format(
            **{k: r["held_out"][k]["preference_accuracy"] for k in ("before", "after")}
        ),
        "reward acc": lambda r: f"{r['held_out']['after']['reward_accuracy']:.2f}",
        "margin": lambda r: f"{r['held_out']['after']['reward_margin']:.3f}",
        "tok/s": lambda r: f"{r['train_tokens_per_s']:.0f}",
        "s": lambda r: f"{r['run_s']:.0f}",
    }
    print("\n" + runner.table(rows, columns, "stage"))
    # After every training run (lm-eval seeds the global random generators), so the
    # training runs are those of a call without it.
    if not (a.no_downstream or unavailable):
        manager = task_manager(size.passage_words)
        for workdir, (stem, row) in stems.items():
            row["downstream"] = downstream(workdir, limit, manager)
            runner.write_json(a.out, stem, row)
            print({"stage": row["stage"], "downstream": row["downstream"]}, flush=True)
        down = {
            "scored at": lambda r: r["level"],
            "task": lambda r: r["task"],
            "metric": lambda r: r["metric"],
            "score": lambda r: f"{r['score']:.3f}",
            "chance": lambda r: f"{r['chance']:.3f}",
            "docs": lambda r: r["docs"],
        }
        print("\n" + runner.table(downstream_rows(rows), down, "stage"))


if __name__ == "__main__":
    sys.exit(main())
