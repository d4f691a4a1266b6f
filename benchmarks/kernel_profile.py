"""Where a train step's time goes: a ``jax.profiler`` trace summarised to its top GPU kernels.

    PYTHONUNBUFFERED=1 XLA_FLAGS=--xla_gpu_enable_triton_gemm=false \\
        python -m benchmarks.kernel_profile --out "$OUT" --runs gpt_1b3:O0,gpt_1b3:O1

Each run spec (as in ``benchmarks.step``: ``config:level[:options]``, plus ``--set``) builds
the trainer's jitted step in a fresh process, warms it up, traces ``--steps`` steps, and reads
the trace's device events back (``*.trace.json.gz``, Chrome trace format): kernel time per
step by kernel name and by category (FP8 GEMM, bf16 GEMM, attention, fusions, copies,
collectives), the top ``--top`` kernels, and how busy the GPU was. Writes
``kernel_profile_<run>.json`` per run (and, with ``--keep-hlo``, the optimised HLO of each
step, gzipped, so that fusion names in the table can be looked up).
"""

from __future__ import annotations

import argparse
import sys

from benchmarks import common, runner


def config_for(run: str, quick: bool, sets=()):
    """The ConfigDict of one run (``--quick``: the CPU smoke-test shapes)."""
    return runner.load(run, sets, runner.step_settings(quick))


def child(run: str, steps: int, top: int, out: str, keep_hlo: bool, quick: bool, sets=()) -> dict:
    """Build, warm up, trace ``steps`` steps and summarise (inside the child process)."""
    import jax

    c = config_for(run, quick, sets)
    p = common.prepare(c, run)
    state = p.state
    with common.mesh_context(c, p.setup):
        compiled = p.setup.train_step.lower(state, p.batch).compile()
        for _ in range(3):  # warm-up: autotuning and allocation outside the trace
            state, metrics = compiled(state, p.batch)
        jax.block_until_ready(metrics)
        summary = common.trace_steps(compiled, state, p.batch, steps, top)
    if keep_hlo:
        common.save_hlo(out, run, compiled.as_text())
    return {"run": run, **summary}


def main(argv=None):
    p = runner.parser(__doc__, sets=True)
    p.add_argument("--runs", default="gpt_1b3:O0,gpt_1b3:O1")
    p.add_argument("--steps", type=int, default=3, help="traced steps per run")
    p.add_argument("--top", type=int, default=15, help="kernels listed per run")
    p.add_argument("--keep-hlo", action="store_true", help="also write each step's HLO (gz)")
    p.add_argument("--quick", action="store_true", help="tiny shapes: a CPU smoke test")
    a = runner.parse_args(p, argv)

    def measure(run: str, a: argparse.Namespace) -> dict:
        return child(run, a.steps, a.top, a.out, a.keep_hlo, a.quick, a.set)

    check = lambda run: config_for(run, a.quick, a.set)  # noqa: E731
    rows = runner.drive("kernel_profile", a, measure, a.runs.split(","), check=check)
    if rows is None:
        return
    columns = {
        "wall ms": lambda r: f"{r['traced_wall_ms_per_step']:.1f}",
        "busy ms": lambda r: f"{r['busy_ms_per_step']:.1f}",
        "kernel ms": lambda r: f"{r['kernel_ms_per_step']:.1f}",
    }
    print("\n" + runner.table(rows, columns))
    for r in rows:
        if "error" in r:
            continue
        print(f"\n=== {r['run']}")
        print("  " + ", ".join(f"{k} {v:.1f}" for k, v in r["categories"].items()))
        for k in r["top"]:
            print(
                f"  {k['ms_per_step']:7.2f} ms {k['share']:6.1%} x{k['calls_per_step']:<5g} "
                f"{k['category']:<18} {k['name'][:90]}"
            )


if __name__ == "__main__":
    sys.exit(main())
