"""Where a train step's time goes: a ``jax.profiler`` trace summarised to its top GPU kernels.

    PYTHONUNBUFFERED=1 PYTHONPATH=. XLA_FLAGS=--xla_gpu_enable_triton_gemm=false \\
        python3 benchmarks/kernel_profile.py --out "$OUT" --runs gpt_1b3:O0,gpt_1b3:O1

Each run (same syntax as ``benchmarks/step.py``: ``config:level[:options]``) builds the
trainer's jitted step in a fresh process, warms it up, traces ``--steps`` steps, and reads the
trace's device events back (``*.trace.json.gz``, Chrome trace format): kernel time per step
by kernel name and by category (FP8 GEMM, bf16 GEMM, attention, fusions, copies,
collectives), the top ``--top`` kernels, and how busy the GPU was. Writes
``kernel_profile.json`` (and, with ``--keep-hlo``, the optimised HLO of each step, gzipped, so that
fusion names in the table can be looked up).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import step as step_bench  # noqa: E402

MARK = "@@PROFILE "


def category(name: str) -> str:
    """Coarse class of a GPU kernel from its name (cuBLAS/cuDNN/XLA naming conventions)."""
    n = name.lower()
    if "nccl" in n:
        return "collective"
    # cuBLASLt's nvjet kernels spell operand types first: 'tst' bf16, 'qqtst' E4M3 x E4M3,
    # 'rqtst'/'qrtst' with an E5M2 ('r') operand.
    nvjet = re.match(r"nvjet_sm\d+_([a-z]+)_", n)
    if nvjet:
        return "gemm_fp8" if set(nvjet.group(1)[:2]) & set("qr") else "gemm_other"
    if any(t in n for t in ("e4m3", "e5m2", "f8f8", "qqtst", "_f8", "fp8")) and (
        "gemm" in n or "nvjet" in n or "xmma" in n or "cutlass" in n
    ):
        return "gemm_fp8"
    if "gemm" in n or "nvjet" in n or "xmma" in n or "cutlass" in n or "cublas" in n:
        return "gemm_other"
    if "flash" in n or "fmha" in n or "cudnn" in n or "sdpa" in n or "attention" in n:
        return "attention"
    if "memcpy" in n or "memset" in n or n.startswith("copy") or "transpose" in n:
        return "copy/transpose"
    if "reduce" in n or "reduction" in n:
        return "reduction fusion"
    if "fusion" in n or "loop_" in n or "input_" in n or "wrapped" in n:
        return "elementwise fusion"
    return "other"


def summarize_trace(trace_dir: str, steps: int, top: int) -> dict:
    """Kernel totals per step from the newest ``*.trace.json.gz`` under ``trace_dir``."""
    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))
    if not files:
        raise FileNotFoundError(f"no *.trace.json.gz under {trace_dir}")
    with gzip.open(files[-1], "rt") as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    pids, tids = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            pids[e["pid"]] = e["args"]["name"]
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            tids[(e["pid"], e["tid"])] = e["args"]["name"]
    # Device timelines: XLA names them '/device:GPU:0' (streams are their threads). On CPU
    # (smoke tests) the ops run on XLA's Eigen worker threads instead.
    gpu = {p for p, n in pids.items() if "/device:GPU" in n or "/device:TPU" in n}
    on_device = lambda e: e.get("pid") in gpu  # noqa: E731
    if not gpu:
        on_device = lambda e: tids.get((e.get("pid"), e.get("tid")), "").startswith("tf_XLAEigen")  # noqa: E731
    by_name, by_cat = collections.Counter(), collections.Counter()
    count = collections.Counter()
    spans = []
    for e in events:
        if e.get("ph") != "X" or not on_device(e) or "dur" not in e:
            continue
        # One fusion per unrolled layer ('loop_add_fusion_17'): group them by their kind.
        name = re.sub(r"(fusion|copy|transpose)[._]\d+$", r"\1", e.get("name", "?"))
        dur = float(e["dur"])  # microseconds
        by_name[name] += dur
        count[name] += 1
        by_cat[category(name)] += dur
        spans.append((float(e["ts"]), float(e["ts"]) + dur))
    busy = 0.0
    end = -1.0
    for s, t in sorted(spans):  # union of kernel intervals: time the GPU had work
        if t > end:
            busy += t - max(s, end)
            end = t
    wall = (max(t for _, t in spans) - min(s for s, _ in spans)) if spans else 0.0
    total = sum(by_name.values())
    per = lambda us: us / steps / 1e3  # noqa: E731  (ms per step)
    return {
        "timeline": "gpu" if gpu else "cpu threads",
        "kernel_ms_per_step": per(total),
        "busy_ms_per_step": per(busy),
        "span_ms_per_step": per(wall),
        "categories": {k: per(v) for k, v in by_cat.most_common()},
        "top": [
            {
                "name": n,
                "ms_per_step": per(v),
                "share": v / total if total else 0.0,
                "calls_per_step": count[n] / steps,
                "category": category(n),
            }
            for n, v in by_name.most_common(top)
        ],
    }


def child(run: str, steps: int, top: int, out: str, keep_hlo: bool, quick: bool) -> dict:
    """Build, warm up, trace ``steps`` steps and summarise (inside the child process)."""
    import jax

    c, env, state, batch = step_bench.build(run, quick)
    with step_bench.mesh_context(c, env):
        compiled = env["train_step"].lower(state, batch).compile()
        for _ in range(3):  # warm-up: autotuning and allocation outside the trace
            state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        summary = trace_steps(compiled, state, batch, steps, top)
    if keep_hlo:
        step_bench.save_hlo(out, run, compiled.as_text())
    return {"run": run, **summary}


def trace_steps(compiled, state, batch, steps: int, top: int) -> dict:
    """Run ``steps`` more steps under ``jax.profiler`` and summarise their device kernels."""
    import jax

    trace_dir = tempfile.mkdtemp(prefix="fp8jax_trace_")
    t0 = time.perf_counter()
    with jax.profiler.trace(trace_dir):
        for _ in range(steps):
            state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
    wall_ms = (time.perf_counter() - t0) * 1e3 / steps
    return {"traced_wall_ms_per_step": wall_ms, **summarize_trace(trace_dir, steps, top)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--runs", default="gpt_1b3:O0,gpt_1b3:O1")
    p.add_argument("--steps", type=int, default=3, help="traced steps per run")
    p.add_argument("--top", type=int, default=15, help="kernels listed per run")
    p.add_argument("--keep-hlo", action="store_true", help="also write each step's HLO (gz)")
    p.add_argument("--quick", action="store_true", help="tiny shapes: a CPU smoke test")
    a = step_bench.parse_bench_args(p)
    if a.child:
        rec = child(a.child, a.steps, a.top, a.out, a.keep_hlo, a.quick)
        print(MARK + json.dumps(rec), flush=True)
        return
    rows = []
    for run in a.runs.split(","):
        cmd = [sys.executable, __file__, "--child", run, "--steps", str(a.steps)]
        cmd += ["--top", str(a.top), "--out", a.out]
        cmd += ["--keep-hlo"] if a.keep_hlo else []
        cmd += ["--quick"] if a.quick else []
        rows.append(step_bench.run_child(cmd, MARK, run))
        with open(os.path.join(a.out, "kernel_profile.json"), "w") as f:
            json.dump(rows, f, indent=1)
    for r in rows:
        print(f"\n=== {r['run']}")
        if "error" in r:
            print("ERROR", r["error"])
            continue
        print(
            f"step wall {r['traced_wall_ms_per_step']:.1f} ms, GPU busy {r['busy_ms_per_step']:.1f}"
            f" ms, kernel sum {r['kernel_ms_per_step']:.1f} ms"
        )
        print("  " + ", ".join(f"{k} {v:.1f}" for k, v in r["categories"].items()))
        for k in r["top"]:
            print(
                f"  {k['ms_per_step']:7.2f} ms {k['share']:6.1%} x{k['calls_per_step']:<5g} "
                f"{k['category']:<18} {k['name'][:90]}"
            )


if __name__ == "__main__":
    main()
