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

    python -m benchmarks.parity --config moe_tiny --levels O0,O1,O2 --steps 400 --vocab 512 \
        --out "$OUT"
    python -m benchmarks.parity --config olmoe_1b7b --levels O0,O1,O2 --steps 300 --out "$OUT"

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


def main(argv=None):
    p = runner.parser(__doc__, child=False, sets=True)
    p.add_argument("--config", default="gpt2_125m")
    p.add_argument("--levels", default="O0,O1")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--vocab", type=int, default=8192, help="BPE size (the corpus is ~4 MB)")
    p.add_argument("--mesh", default="-1,1,1", help="data,fsdp,tensor sizes (-1: the rest)")
    a = runner.parse_args(p, argv)
    levels = a.levels.split(",")
    try:  # every level's config before the first trains: a typo stops the run at once
        configs = [level_config(a.config, lv, a.steps, a.vocab, a.mesh, a.set) for lv in levels]
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise SystemExit(f"error: {' '.join(str(e).split())}") from None
    from fp8jax.trainer import loop

    rows = {}
    first_dir = None
    for level, c in zip(levels, configs, strict=True):
        workdir = os.path.join(a.out, runner.safe_name(f"{a.config}_{level}"))
        shutil.rmtree(workdir, ignore_errors=True)
        if first_dir is not None:  # same tokenizer and token ids for every level
            skip = shutil.ignore_patterns("checkpoints", "tensorboard", "*.jsonl", "summary.json")
            shutil.copytree(first_dir, workdir, ignore=skip)
        summary = loop.train_and_evaluate(c, workdir)
        first_dir = first_dir or workdir
        rows[level] = {k: summary.get(k) for k in ("val_loss", "train_loss", "train_tokens_per_s")}
        if "preempted_at" not in summary:
            rows[level].update(moe_balance(c, workdir))
        print(level, rows[level], flush=True)
    base = rows[levels[0]]["val_loss"]
    balance = rows[levels[0]].get("val_load_max_over_mean")
    for r in rows.values():  # a run stopped early (SIGTERM) has no final validation loss
        ok = r["val_loss"] is not None and base is not None
        r["rel_diff_vs_first"] = (r["val_loss"] - base) / base if ok else math.nan
        if balance is not None:
            r["balance_vs_first"] = r.get("val_load_max_over_mean", math.nan) / balance
    runner.write_json(a.out, "parity", rows)
    columns = {
        "val_loss": lambda r: f"{r['val_loss']:.4f}",
        "rel diff": lambda r: f"{r['rel_diff_vs_first']:.3%}",
        "tok/s": lambda r: f"{r['train_tokens_per_s']:.0f}",
    }
    if balance is not None:  # an MoE config: the experts' load balance on the validation set
        columns["load max/mean"] = lambda r: f"{r.get('val_load_max_over_mean', math.nan):.4f}"
        columns["vs first"] = lambda r: f"{r['balance_vs_first']:.4f}"
    print("\n" + runner.table([{"level": k, **r} for k, r in rows.items()], columns, "level"))


if __name__ == "__main__":
    sys.exit(main())
