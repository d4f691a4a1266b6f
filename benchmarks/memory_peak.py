"""What is alive at a train step's memory peak: XLA's own live-range report, summarised.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/memory_peak.py --out "$OUT" \\
        --runs llama_7b:O0,llama_7b:O2

Each run (``config:level[:options]``, as in ``step.py``) builds the trainer's jitted step in a
fresh process and compiles it, without running it, with XLA dumping the step's buffer
assignment. XLA's ``*-live-range.txt`` names the buffers live at the peak and breaks the peak
down by the JAX operation that made each buffer (``jit(train_step)/transpose(jvp(...))/...``).
Printed per run: compiled temp/argument bytes, the peak's top buffers and the top of that
breakdown. Writes ``memory_peak.json``. Works on CPU too (a proxy: CPU fusion differs).

``--program init`` does the same for the jitted init: llama_7b O3 at fsdp=2 peaked at
54.45 GiB per H200 while making 16.12 GiB of state, above the step's 48.5 (RESULTS.md,
2026-11-30 fifth): ``--program init --runs llama_7b:O3:mesh.data=1+mesh.fsdp=2``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import step as step_bench  # noqa: E402

MARK = "@@MEMPEAK "
MODULES = {"step": "train_step", "init": "init_state"}  # --program: the jitted function's name


def parse_live_range(text: str, top: int) -> dict:
    """Peak buffers and the per-operation breakdown from XLA's live-range dump."""
    out = {"peak_buffers": [], "breakdown": []}
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if re.match(r"\s*Live ranges at \d+ \(peak\):", line):
            for ln in lines[i + 1 :]:
                m = re.match(r"\s+(\S+?)(\{[^}]*\})?: (\d+) bytes", ln)
                if not m:
                    break
                out["peak_buffers"].append({"buffer": m.group(1), "bytes": int(m.group(3))})
        m = re.match(r"\s*Stack trace breakdown for peak usage: ([\d ]+) bytes", line)
        if m:
            out["peak_bytes"] = int(m.group(1).replace(" ", ""))
            for ln in lines[i + 2 :]:
                # First-level children of the root only: '├── name (p%, total: N bytes, ...'
                c = re.match(r"\s{6}[├└]── (.+?) \(([\d.]+)%, total: ([\d ]+) bytes", ln)
                if c:
                    total = int(c.group(3).replace(" ", ""))
                    out["breakdown"].append({"op": c.group(1), "bytes": total})
                elif not re.match(r"\s{6}[│ ]", ln):
                    break
    out["peak_buffers"] = sorted(out["peak_buffers"], key=lambda r: -r["bytes"])[:top]
    out["breakdown"] = sorted(out["breakdown"], key=lambda r: -r["bytes"])[:top]
    return out


def child(run: str, quick: bool, top: int, program: str = "step") -> dict:
    """Build and compile one run with XLA dumping its buffer assignment (child process).

    ``program``: 'step' (the train step) or 'init' (the jitted init that makes the state).
    """
    import jax

    c, env, state, batch = step_bench.build(run, quick)
    with step_bench.mesh_context(c, env):
        if program == "init":
            compiled = env["init"].lower(jax.random.PRNGKey(0)).compile()
        else:
            compiled = env["train_step"].lower(state, batch).compile()
    ma = compiled.memory_analysis()
    name = MODULES[program]
    files = glob.glob(os.path.join(os.environ["FP8JAX_DUMP"], f"*{name}*live-range.txt"))
    rec = {
        "run": run,
        "program": program,
        "temp_gib": (getattr(ma, "temp_size_in_bytes", 0) or 0) / 2**30,
        "argument_gib": (getattr(ma, "argument_size_in_bytes", 0) or 0) / 2**30,
    }
    if files:
        with open(max(files, key=os.path.getsize)) as f:
            rec.update(parse_live_range(f.read(), top))
    else:
        rec["error"] = "XLA wrote no live-range file (this jaxlib may not dump it)"
    return rec


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--runs", default="llama_7b:O0,llama_7b:O2")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--quick", action="store_true", help="tiny shapes: a CPU smoke test")
    p.add_argument("--program", choices=sorted(MODULES), default="step", help="which to analyse")
    a = step_bench.parse_bench_args(p)
    if a.child:
        print(MARK + json.dumps(child(a.child, a.quick, a.top, a.program)), flush=True)
        return
    rows = []
    for run in a.runs.split(","):
        dump = tempfile.mkdtemp(prefix="fp8jax_xla_dump_")
        env = dict(os.environ, FP8JAX_DUMP=dump)
        flags = f"--xla_dump_to={dump} --xla_dump_hlo_module_re=.*{MODULES[a.program]}.*"
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flags}".strip()
        cmd = [sys.executable, __file__, "--child", run, "--top", str(a.top)]
        cmd += ["--program", a.program]
        cmd += ["--quick"] if a.quick else []
        rows.append(step_bench.run_child(cmd, MARK, run, env=env))
        shutil.rmtree(dump, ignore_errors=True)
        with open(os.path.join(a.out, "memory_peak.json"), "w") as f:
            json.dump(rows, f, indent=1)
    for r in rows:
        print(f"\n=== {r['run']} ({a.program})")
        if "temp_gib" not in r:
            print("ERROR", r.get("error"))
            continue
        peak = r.get("peak_bytes", 0) / 2**30
        head = f"temp {r['temp_gib']:.2f} GiB, arguments {r['argument_gib']:.2f} GiB"
        print(f"{head}, peak {peak:.2f} GiB")
        for b in r.get("breakdown", []):
            print(f"  {b['bytes'] / 2**30:8.2f} GiB  {b['op'][:110]}")
        print("  largest buffers live at the peak:")
        for b in r.get("peak_buffers", []):
            print(f"  {b['bytes'] / 2**30:8.2f} GiB  {b['buffer']}")


if __name__ == "__main__":
    main()
