"""Time the stages of ``python train.py`` as a user runs it: a run, a rerun, and a resume.

Three runs of ``train.py`` in one work dir (fresh process each): a first run of ``--steps``
steps with evaluation, periodic checkpoints, FP8 health and the end sample; the same command
again (the run is finished: nothing to train); and a resume to ``--steps + --more`` steps,
which reloads the checkpoint and, with JAX's persistent cache, the compiled step. Each stage's
wall time is taken from when its log line reaches this process. Prints a table and writes
``<out>/user_path.json``. Extra ``--config.<field>=<value>`` flags (or ``--set field=value``)
go to every ``train.py`` command.

    python -m benchmarks.user_path --config configs/gpt_1b3.py --out "$OUT"
    python -m benchmarks.user_path --config configs/tiny.py --steps 6 --more 2 \\
        --out /tmp/user_path   # CPU smoke test
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import time

from benchmarks import runner

ROOT = pathlib.Path(__file__).resolve().parents[1]

# (stage name, regex of the log line that ends it), in the order the trainer logs them.
MARKS = (
    ("start", r"fp8jax: level"),
    ("restore", r"resuming from checkpoint step|already reached step"),
    ("compile", r"train step compiled in"),
    ("step_1", r"step \d+: .*\bloss="),
    ("eval", r"step \d+: val_loss="),
    ("done", r"done: "),
)
STEP = re.compile(r"step (\d+): .*\bloss=")
SAMPLE = re.compile(r"sample \(([\d.]+) s\)")
COMPILED = re.compile(r"train step compiled in ([\d.]+) s")


def run(cmd: list[str], log_path: pathlib.Path, env: dict) -> dict:
    """Run ``cmd``; return the time of each first mark, per-step times and the exit code."""
    t0 = time.perf_counter()
    marks, steps, lines = {}, {}, []
    with subprocess.Popen(
        cmd,
        stderr=subprocess.STDOUT,
        stdout=subprocess.PIPE,
        text=True,
        errors="replace",
        env=env,
        cwd=ROOT,
    ) as proc:
        for line in proc.stdout:
            t = time.perf_counter() - t0
            lines.append(f"{t:9.3f} {line}")
            for name, pattern in MARKS:
                if name not in marks and re.search(pattern, line):
                    marks[name] = t
            if m := STEP.search(line):
                steps.setdefault(int(m.group(1)), t)
            if m := SAMPLE.search(line):
                marks["sample_s"] = float(m.group(1))
            if m := COMPILED.search(line):
                marks["compile_s"] = float(m.group(1))
    log_path.write_text("".join(lines))
    return {
        "rc": proc.returncode,
        "wall_s": time.perf_counter() - t0,
        "marks": marks,
        "steps": steps,
    }


def step_gaps(steps: dict, every: int) -> dict:
    """Median gap between logged steps, and the gaps after each checkpoint step."""
    ordered = sorted(steps)
    gaps = {b: steps[b] - steps[a] for a, b in zip(ordered, ordered[1:], strict=False)}
    plain = sorted(g for s, g in gaps.items() if (s - 1) % every)
    after_save = {s - 1: round(g, 3) for s, g in gaps.items() if (s - 1) % every == 0}
    return {"median_step_s": plain[len(plain) // 2] if plain else None, "after_save_s": after_save}


def main(argv=None) -> int:
    p = runner.parser(__doc__, child=False, sets=True)
    p.add_argument("--config", default="configs/gpt_1b3.py")
    p.add_argument("--steps", type=int, default=30, help="steps of the first run")
    p.add_argument("--more", type=int, default=10, help="steps the resume adds")
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--workdir", default="")
    p.add_argument("overrides", nargs="*", help="extra --config.<field>=<value> flags")
    args = runner.parse_args(p, argv)
    out = pathlib.Path(args.out)
    workdir = pathlib.Path(args.workdir or out / "workdir")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(workdir.parent / "jax_cache"))
    every = args.checkpoint_every
    common = [
        sys.executable,
        "train.py",
        f"--config={args.config}",
        f"--workdir={workdir}",
        f"--config.checkpoint_every_steps={every}",
        "--config.log_every_steps=1",
        f"--config.eval_every_steps={args.steps // 2}",
        "--config.eval_batches=4",
        f"--config.fp8_stats_every_steps={args.steps // 2}",
        *args.overrides,
        *(f"--config.{kv}" for kv in args.set),
    ]
    runs = {}
    for name, steps in (
        ("first", args.steps),
        ("rerun", args.steps),
        ("resume", args.steps + args.more),
    ):
        cmd = [*common, f"--config.num_train_steps={steps}"]
        r = run(cmd, out / f"log_{name}.txt", env)
        r.update(step_gaps(r.pop("steps"), every))
        runs[name] = r
        summary = {k: r[k] for k in ("rc", "wall_s", "marks", "median_step_s", "after_save_s")}
        print(name, json.dumps(summary), flush=True)
        if r["rc"] != 0:
            break
    runner.write_json(args.out, "user_path", {"command": common, "runs": runs})
    columns = {
        "rc": lambda r: r["rc"],
        "wall s": lambda r: f"{r['wall_s']:.1f}",
        "compile s": lambda r: f"{r['marks']['compile_s']:.1f}",
        "median step s": lambda r: f"{r['median_step_s']:.3f}",
    }
    print("\n" + runner.table([{"stage": k, **r} for k, r in runs.items()], columns, "stage"))
    return 0 if all(r["rc"] == 0 for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
