"""Loss parity: the same config and seed trained at two FP8 levels on the shipped corpus.

Runs ``fp8jax.trainer.loop.train_and_evaluate`` once per level in its own work dir (sharing the
tokenizer and token cache) and compares the final validation losses; the issue's target is a
relative difference under 0.5% for gpt2_125m over a few hundred steps at O0 vs O1.

    PYTHONUNBUFFERED=1 XLA_FLAGS=--xla_gpu_enable_triton_gemm=false PYTHONPATH=. \
        python3 benchmarks/parity.py --config gpt2_125m --steps 300 --out "$OUT"

``--config tiny --steps 60`` is a CPU smoke run (a couple of minutes). On several GPUs,
``--levels O0,O3 --mesh 1,-1,1 --steps 200`` compares O3 (FP8 Adam and masters sharded over
``fsdp``, FP8 weight all-gather) with O0 on the same mesh. A level may carry config overrides
as ``benchmarks/step.py``'s runs do: ``--levels O0,O1,O1:model.fp8_lm_head=True``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import step as step_bench  # noqa: E402  (a script beside this one: its run-option parser)


def level_config(name: str, level: str, steps: int, vocab: int, mesh: str):
    """The config one parity run trains: ``level`` is 'O1' or 'O1:key=value+key=value'."""
    from fp8jax.trainer import loop as train_lib

    c = train_lib.load_config(name)
    _, c.fp8.level, options = step_bench.parse_run(f"{name}:{level}")
    step_bench.apply_overrides(c, options)
    c.model.vocab_size = vocab
    c.num_train_steps = steps
    c.eval_every_steps = c.checkpoint_every_steps = steps
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = (int(v) for v in mesh.split(","))
    c.sample_tokens = 0
    return c


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="gpt2_125m")
    p.add_argument("--levels", default="O0,O1")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--vocab", type=int, default=8192, help="BPE size (the corpus is ~4 MB)")
    p.add_argument("--mesh", default="-1,1,1", help="data,fsdp,tensor sizes (-1: the rest)")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/fp8jax_parity"))
    a = p.parse_args()
    from fp8jax.trainer import loop as train_lib

    os.makedirs(a.out, exist_ok=True)
    rows = {}
    first_dir = None
    for level in a.levels.split(","):
        c = level_config(a.config, level, a.steps, a.vocab, a.mesh)
        workdir = os.path.join(a.out, step_bench.safe_name(f"{a.config}_{level}"))
        shutil.rmtree(workdir, ignore_errors=True)
        if first_dir is not None:  # same tokenizer and token ids for every level
            skip = shutil.ignore_patterns("checkpoints", "tensorboard", "*.jsonl", "summary.json")
            shutil.copytree(first_dir, workdir, ignore=skip)
        summary = train_lib.train_and_evaluate(c, workdir)
        first_dir = first_dir or workdir
        rows[level] = {k: summary.get(k) for k in ("val_loss", "train_loss", "train_tokens_per_s")}
        print(level, rows[level], flush=True)
    base = rows[a.levels.split(",")[0]]["val_loss"]
    for r in rows.values():  # a run stopped early (SIGTERM) has no final validation loss
        ok = r["val_loss"] is not None and base is not None
        r["rel_diff_vs_first"] = (r["val_loss"] - base) / base if ok else float("nan")
    with open(os.path.join(a.out, "parity.json"), "w") as f:
        json.dump(rows, f, indent=1)
    width = max(6, *map(len, rows))
    print(f"\n{'level':{width}} {'val_loss':>9} {'rel diff':>9} {'tok/s':>9}")
    for level, r in rows.items():
        tps = r["train_tokens_per_s"] or 0.0
        val = r["val_loss"] if r["val_loss"] is not None else float("nan")
        print(f"{level:{width}} {val:9.4f} {r['rel_diff_vs_first']:9.3%} {tps:9.0f}")


if __name__ == "__main__":
    main()
