"""Loss parity: the same config and seed trained at two FP8 levels on the shipped corpus.

Runs ``fp8jax.trainer.loop.train_and_evaluate`` once per level in its own work dir (sharing the
tokenizer and token cache) and compares the final validation losses; the target is a relative
difference under 0.5% for gpt2_125m over a few hundred steps at O0 vs O1.

    PYTHONUNBUFFERED=1 XLA_FLAGS=--xla_gpu_enable_triton_gemm=false \\
        python -m benchmarks.parity --config gpt2_125m --steps 300 --out "$OUT"

An MoE config also reports each level's expert load balance: the experts' loads (each one's
share of the token-expert assignments) on the validation batches at the final state, max over
mean per layer, averaged over the layers (``val_load_max_over_mean``; 1 is perfectly even),
and its ratio to the first level's. The MoE targets: O1 and O2 within 0.25% of O0's validation
loss, and a balance no worse than O0's by more than 5%:

    python -m benchmarks.parity --config moe_tiny --levels O0,O1,O2 --seeds 0,1,2,3,4 \
        --steps 2000 --vocab 512 --out "$OUT"
    python -m benchmarks.parity --config olmoe_1b7b --levels O0,O1,O2 --steps 200 \
        --set model.num_layers=4 --set warmup_steps=20 --seeds 0 --out "$OUT"

``--seeds 0,1,2`` trains every level at each seed (``config.seed``: the initial parameters
and the data order) and compares each run with the first level's at the same seed; the table
ends with each level's mean over the seeds, its mean difference's standard error (± in the
table: the seeds' standard deviation over the square root of their count) and the first
level's own spread between seeds (max - min over the mean), the noise a single seed's
difference has to clear. At small sizes it exceeds the 0.25% target: ``moe_tiny``'s O0 moves
by about 1.4% at 2000 steps, the 4-block OLMoE's by about 1% at 200.

``--config tiny --steps 60`` is a CPU smoke run (a couple of minutes). On several GPUs,
``--levels O0,O3 --mesh 1,-1,1 --steps 200`` compares O3 (FP8 Adam and masters sharded over
``fsdp``, FP8 weight all-gather) with O0 on the same mesh. A level may carry config overrides
as ``benchmarks.step``'s runs do: ``--levels O0,O1,O1:model.fp8_lm_head=True``; ``--set
key=value`` overrides every level. Writes ``parity.json``.
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import sys

from benchmarks import runner


def level_config(name: str, level: str, steps: int, vocab: int, mesh: str, sets=()):
    """The config one parity run trains: ``level`` is 'O1' or 'O1:key=value+key=value'."""
    settings = runner.step_settings(mesh=mesh)
    settings.update({"model.vocab_size": vocab, "num_train_steps": steps, "sample_tokens": 0})
    settings.update({"eval_every_steps": steps, "checkpoint_every_steps": steps})
    return runner.load(f"{name}:{level}", sets, settings)


def moe_balance(config, workdir: str) -> dict:
    """An MoE run's expert loads on its validation batches at its final checkpoint: each layer's
    max over mean and their mean over the layers (``{}`` for a dense model)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from fp8jax import spec
    from fp8jax.models import moe
    from fp8jax.optim import master
    from fp8jax.trainer import checkpoint, data, loop
    from fp8jax.trainer import step as step_lib

    run = spec.parse(config)
    if run.model.moe is None:
        return {}
    env = loop.setup(run)
    ckpt = checkpoint.Checkpointer(workdir)
    try:
        state, _ = ckpt.restore(checkpoint.abstract_like(env.abstract, env.state_shardings))
    finally:
        ckpt.close()
    batches = data.build(run, workdir).eval_batches(run.loop.eval_batches)
    scanned = run.model.scan_layers

    @jax.jit
    def loads(state, inputs):  # [layers, experts]: each expert's share of the assignments
        params = master.materialize(state.params)
        variables = step_lib.model_variables(env.model, params, state)
        _, sown = env.model.apply(variables, inputs, mutable=[moe.MOE_METRICS])
        return moe.layer_metrics(sown[moe.MOE_METRICS], scanned)[moe.LOAD]

    total = sum(np.asarray(loads(state, jnp.asarray(b["inputs"])), np.float64) for b in batches)
    per_layer = total.max(axis=-1) / total.mean(axis=-1)
    return {
        "val_load_max_over_mean": float(per_layer.mean()),
        "val_load_max_over_mean_per_layer": [float(x) for x in per_layer],
    }


def compare(rows: dict, levels: list[str], seeds: list[int]) -> dict:
    """``rows[(level, seed)]`` with each run's differences from the first level's run at its
    seed (``rel_diff_vs_first``; ``balance_vs_first`` for an MoE config), and, for several
    seeds, a ``(level, 'mean')`` row per level: the mean of its seeds' values and differences,
    the standard error of that mean difference (``rel_diff_sem``), and for the first level the
    spread of its validation loss between seeds."""
    out = {}
    for (level, seed), r in rows.items():
        first = rows[(levels[0], seed)]
        base, balance = first["val_loss"], first.get("val_load_max_over_mean")
        ok = r["val_loss"] is not None and base is not None  # a run stopped early has none
        r = {**r, "rel_diff_vs_first": (r["val_loss"] - base) / base if ok else math.nan}
        if balance is not None:
            r["balance_vs_first"] = r.get("val_load_max_over_mean", math.nan) / balance
        out[(level, seed)] = r
    if len(seeds) < 2:
        return out
    for level in levels:
        runs = [out[(level, seed)] for seed in seeds]
        mean = {
            k: statistics.fmean(math.nan if r.get(k) is None else r[k] for r in runs)
            for k in runs[0]
            if isinstance(runs[0][k], (int, float))
        }
        diffs = [r["rel_diff_vs_first"] for r in runs]
        # How far the mean difference may sit from the one more seeds would give.
        mean["rel_diff_sem"] = statistics.stdev(diffs) / math.sqrt(len(diffs))
        if level == levels[0]:
            losses = [r["val_loss"] for r in runs]
            if None not in losses:
                mean["seed_spread"] = (max(losses) - min(losses)) / statistics.fmean(losses)
        out[(level, "mean")] = mean
    return out


def _row_name(level: str, seed) -> str:
    """A row's name in the table and JSON: the level, then its seed or 'mean' if any."""
    return level if seed is None else f"{level} ({'mean' if seed == 'mean' else f'seed {seed}'})"


def main(argv=None):
    p = runner.parser(__doc__, child=False, sets=True)
    p.add_argument("--config", default="gpt2_125m")
    p.add_argument("--levels", default="O0,O1")
    p.add_argument(
        "--seeds", default="", help="seeds to train every level at (default: the config's)"
    )
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--vocab", type=int, default=8192, help="BPE size (the corpus is ~4 MB)")
    p.add_argument("--mesh", default="-1,1,1", help="data,fsdp,tensor sizes (-1: the rest)")
    a = runner.parse_args(p, argv)
    levels = a.levels.split(",")
    try:
        seeds = [int(x) for x in a.seeds.split(",")] if a.seeds else [None]
    except ValueError:
        raise SystemExit(f"error: --seeds={a.seeds!r}: give integers, comma-separated") from None
    runs = [(lv, seed) for seed in seeds for lv in levels]
    try:  # every run's config before the first trains: a typo stops the run at once
        configs = []
        for level, seed in runs:
            sets = [*a.set, f"seed={seed}"] if seed is not None else a.set
            configs.append(level_config(a.config, level, a.steps, a.vocab, a.mesh, sets))
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise SystemExit(f"error: {' '.join(str(e).split())}") from None
    from fp8jax.trainer import loop

    rows = {}
    first_dir = None
    for (level, seed), c in zip(runs, configs, strict=True):
        name = f"{a.config}_{level}" + ("" if seed is None else f"_seed{seed}")
        workdir = os.path.join(a.out, runner.safe_name(name))
        shutil.rmtree(workdir, ignore_errors=True)
        if first_dir is not None:  # same tokenizer and token ids for every run
            skip = shutil.ignore_patterns("checkpoints", "tensorboard", "*.jsonl", "summary.json")
            shutil.copytree(first_dir, workdir, ignore=skip)
        summary = loop.train_and_evaluate(c, workdir)
        first_dir = first_dir or workdir
        row = {k: summary.get(k) for k in ("val_loss", "train_loss", "train_tokens_per_s")}
        if "preempted_at" not in summary:
            row.update(moe_balance(c, workdir))
        rows[(level, seed)] = row
        print(level, "" if seed is None else f"seed {seed}", row, flush=True)
    rows = compare(rows, levels, seeds)
    named = {_row_name(level, seed): r for (level, seed), r in rows.items()}
    runner.write_json(a.out, "parity", named)
    balance = next(iter(rows.values())).get("val_load_max_over_mean")
    columns = {
        "val_loss": lambda r: f"{r['val_loss']:.4f}",
        "rel diff": lambda r: (
            f"{r['rel_diff_vs_first']:.3%}"
            + (f" ± {r['rel_diff_sem']:.3%}" if "rel_diff_sem" in r else "")
        ),
        "tok/s": lambda r: f"{r['train_tokens_per_s']:.0f}",
    }
    if balance is not None:  # an MoE config: the experts' load balance on the validation set
        columns["load max/mean"] = lambda r: f"{r.get('val_load_max_over_mean', math.nan):.4f}"
        columns["vs first"] = lambda r: f"{r['balance_vs_first']:.4f}"
    if len(seeds) > 1:
        columns["seed spread"] = lambda r: f"{r['seed_spread']:.3%}" if "seed_spread" in r else ""
    print("\n" + runner.table([{"level": k, **r} for k, r in named.items()], columns, "level"))


if __name__ == "__main__":
    sys.exit(main())
