"""What is alive at a train step's memory peak: XLA's own live-range report, summarised.

    PYTHONUNBUFFERED=1 python -m benchmarks.memory_peak --out "$OUT" \
        --runs llama_7b:O0,llama_7b:O2

Each run spec (``config:level[:options]`` plus ``--set``, as in ``benchmarks.step``) builds
the trainer's jitted step in a fresh process and compiles it, without running it, with XLA
dumping the step's buffer assignment. XLA's ``*-live-range.txt`` names the buffers live at the
peak and breaks the peak down by the JAX operation that made each buffer
(``jit(train_step)/transpose(jvp(...))/...``). Printed per run: compiled temp/argument bytes,
the peak's top buffers and the top of that breakdown, summed over layers
(``block_3/...`` counted as ``block_*/...``). Writes ``memory_peak_<program>_<run>.json``
per run. Works on CPU too (a proxy: CPU fusion differs).

Beside the report's peak: the program's compiled allocation (``diagnostics.compiled_memory``:
argument + output - alias + temp) and the share of it the report accounts for. On CPU the
share was 89-100% in the runs measured. On an H200, gpt_1b3's O1 step under
``activations_saveable`` reported a 19.9 GiB peak (state and weight gradients) of a 31.2 GiB
allocation: the saved activations were missing. A low share means the report's peak is not the
process peak, and its buffers are a partial list.

``--program init`` does the same for the jitted init, whose transient can exceed the step's
(an O3 init at fsdp=2): ``--program init --runs llama_7b:O3:mesh.data=1+mesh.fsdp=2``.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import tempfile

from benchmarks import common, runner

MODULES = {"step": "train_step", "init": "init_state"}  # --program: the jitted function's name
DUMP = common.XLA_DUMP  # the child's XLA dump folder (the parent sets XLA_FLAGS to match)


def config_for(run: str, quick: bool, sets=()):
    """The ConfigDict of one run (``--quick``: the CPU smoke-test shapes)."""
    return runner.load(run, sets, runner.step_settings(quick))


def child(run: str, quick: bool, top: int, program: str = "step", sets=()) -> dict:
    """Build and compile one run with XLA dumping its buffer assignment (child process).

    ``program``: 'step' (the train step) or 'init' (the jitted init that makes the state).
    """
    import jax

    from fp8jax.diagnostics.memory import compiled_memory

    c = config_for(run, quick, sets)
    p = common.prepare(c, run)
    with common.mesh_context(c, p.setup):
        if program == "init":
            compiled = p.setup.init.lower(jax.random.PRNGKey(0)).compile()
        else:
            compiled = p.setup.train_step.lower(p.state, p.batch).compile()
    allocated = compiled_memory(compiled)  # None where the backend reports nothing
    name = MODULES[program]
    files = glob.glob(os.path.join(os.environ[DUMP], f"*{name}*live-range.txt"))
    rec = {
        "run": run,
        "program": program,
        "temp_gib": allocated["temp"] / 2**30 if allocated else 0.0,
        "argument_gib": allocated["argument"] / 2**30 if allocated else 0.0,
        "allocated_gib": allocated["peak"] / 2**30 if allocated else None,
    }
    if files:
        with open(max(files, key=os.path.getsize)) as f:
            rec.update(common.parse_live_range(f.read(), top))
        if allocated and allocated["peak"] and "peak_bytes" in rec:
            rec["report_share"] = rec["peak_bytes"] / allocated["peak"]
    else:
        rec["error"] = "XLA wrote no live-range file (this jaxlib may not dump it)"
    return rec


def main(argv=None):
    p = runner.parser(__doc__, sets=True)
    p.add_argument("--runs", default="llama_7b:O0,llama_7b:O2")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--quick", action="store_true", help="tiny shapes: a CPU smoke test")
    p.add_argument("--program", choices=sorted(MODULES), default="step", help="which to analyse")
    a = runner.parse_args(p, argv)

    def measure(run: str, a: argparse.Namespace) -> dict:
        return child(run, a.quick, a.top, a.program, a.set)

    with tempfile.TemporaryDirectory(prefix="fp8jax_xla_dump_") as dumps:

        def env(run: str) -> dict:
            dump = os.path.join(dumps, runner.safe_name(run))
            flags = f"--xla_dump_to={dump} --xla_dump_hlo_module_re=.*{MODULES[a.program]}.*"
            xla_flags = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()
            return dict(os.environ, XLA_FLAGS=xla_flags, **common.dump_env(dump))

        check = lambda run: config_for(run, a.quick, a.set)  # noqa: E731
        stem = f"memory_peak_{a.program}"
        rows = runner.drive(
            "memory_peak", a, measure, a.runs.split(","), check=check, env=env, stem=stem
        )
    if rows is None:
        return
    columns = {
        "temp GiB": lambda r: f"{r['temp_gib']:.2f}",
        "arguments GiB": lambda r: f"{r['argument_gib']:.2f}",
        "allocated GiB": lambda r: f"{r['allocated_gib']:.2f}",
        "report's peak GiB": lambda r: f"{r['peak_bytes'] / 2**30:.2f}",
        "share": lambda r: f"{r['report_share']:.0%}",
    }
    print(f"\n{a.program}:\n" + runner.table(rows, columns))
    for r in rows:
        if "error" in r:
            continue
        print(f"\n=== {r['run']} ({a.program})")
        for b in r.get("by_op_over_layers", []):
            print(f"  {b['bytes'] / 2**30:8.2f} GiB  {b['op'][:110]}")
        print("  largest buffers live at the peak:")
        for b in r.get("peak_buffers", []):
            print(f"  {b['bytes'] / 2**30:8.2f} GiB  {b['buffer']}")


if __name__ == "__main__":
    sys.exit(main())
