"""Measurement helpers the benchmarks share: HLO text, profiler traces, GPU power samples.

jax and fp8jax are imported inside the functions that use them.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import glob
import gzip
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from benchmarks import runner

PEAK_BF16 = 989e12  # H100/H200 SXM dense bf16 datasheet FLOP/s, the usual MFU denominator


@dataclasses.dataclass
class Prepared:
    """One run ready to time: its config, the trainer's setup, an initial state and a batch."""

    config: Any
    setup: Any
    state: Any
    batch: Any
    times: dict  # setup_s, init_s, init_compile_s: where the minutes go before the step compiles


def prepare(config, label: str, plain: bool = False) -> Prepared:
    """``build``, then compile and run the jitted init and put a random batch on the mesh."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    t0 = time.perf_counter()
    s = runner.build(config, plain)
    setup_s = time.perf_counter() - t0
    print(f"{label}: setup (trace) {setup_s:.1f} s", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    key = jax.random.PRNGKey(0)
    init = s.init.lower(key).compile()
    init_compile_s = time.perf_counter() - t0
    state = init(key)
    jax.block_until_ready(state)
    init_s = time.perf_counter() - t0
    msg = f"{label}: init {init_s:.1f} s (compile {init_compile_s:.1f} s)"
    print(msg, file=sys.stderr, flush=True)
    tok = np.random.default_rng(0).integers(
        0, config.model.vocab_size, (config.batch_size, config.seq_len)
    )
    tok = jnp.asarray(tok, jnp.int32)
    batch = jax.device_put({"inputs": tok, "targets": tok}, s.batch_sharding)
    times = dict(setup_s=setup_s, init_s=init_s, init_compile_s=init_compile_s)
    return Prepared(config, s, state, batch, times)


def pipelined(compiled, state, batches, steps: int, keep: bool) -> tuple[Any, float, float]:
    """``steps`` steps dispatched back to back, one wait at the end: ``(state, ms per step,
    host ms per step until the last dispatch returned)``. ``keep``: hold each step's metrics
    until the next step returns, as the trainer's loop does (it reads them one step late)."""
    import jax

    t = time.perf_counter()
    held = []  # the previous step's metrics, alive while the next step is dispatched
    for i in range(steps):
        state, out = compiled(state, batches[i % len(batches)])
        held = [out] if keep else []
        del out
    del held
    dispatch_ms = (time.perf_counter() - t) * 1e3 / steps
    jax.block_until_ready(state)
    return state, (time.perf_counter() - t) * 1e3 / steps, dispatch_ms


def mesh_context(config, setup):
    """The legacy ``with mesh:`` only where flax's FP8 op needs it; shardings are explicit."""
    return setup.mesh if setup.run.model.fp8_impl == "flax" else contextlib.nullcontext()


def peak_bytes(dev) -> int:
    """The process's peak device memory so far (0 where the backend keeps no statistics)."""
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    return (stats or {}).get("peak_bytes_in_use", 0)


def memory_analysis(compiled) -> dict:
    """XLA's temp, argument, output (and peak, where known) bytes of a compiled program."""
    ma = compiled.memory_analysis()
    keys = ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes")
    out = {k: int(getattr(ma, k, -1)) for k in keys} if ma is not None else {}
    if getattr(ma, "peak_memory_in_bytes", None) is not None:
        out["peak_memory_in_bytes"] = int(ma.peak_memory_in_bytes)
    return out


def versions() -> dict:
    """jax, jaxlib and flax versions, backend, device kind, XLA_FLAGS and Python."""
    import flax
    import jax
    import jaxlib

    dev = jax.devices()[0]
    return {
        "jax": jax.__version__,
        "jaxlib": getattr(jaxlib, "__version__", None) or jaxlib.version.__version__,
        "flax": flax.__version__,
        "backend": jax.default_backend(),
        "device": getattr(dev, "device_kind", str(dev)),
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
        "python": sys.version.split()[0],
    }


def time_calls(fn, args, reps: int, min_rep_s: float, max_iters: int) -> tuple[float, list]:
    """Median seconds per call of ``fn(*args)`` over ``reps`` repetitions (after a warm-up call)
    of enough back-to-back calls to last ``min_rep_s`` (at most ``max_iters``), and every one."""
    import jax

    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    one = max(time.perf_counter() - t0, 1e-6)
    iters = max(2, min(max_iters, math.ceil(min_rep_s / one)))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times), times


def bits(x):
    """The bit patterns of ``x`` (at least 1-d) as unsigned integers of its width (FP8: uint8),
    for bit-for-bit comparisons of kernel outputs."""
    import numpy as np

    x = np.atleast_1d(np.asarray(x))
    return x.view(f"u{x.dtype.itemsize}")


def median_s(fn, args, iters: int) -> float:
    """Median seconds of one blocked call of ``fn(*args)`` over ``iters`` calls, after a
    warm-up call (the compile)."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def in_loop(fn, reps: int, vary_input: bool = False):
    """``fn`` called ``reps`` times inside one jitted program, each call depending on the last;
    its result is the last call's. A per-call time from it has no host dispatch in it.

    Each call's last argument (a scale) is the given one, selected by a test on the previous
    call's third output (an amax or amax history, never negative) that XLA cannot prove, so XLA
    neither hoists nor merges the calls. ``vary_input`` also multiplies the first argument by a
    sign that is always +1 but not provably so: XLA's own cast needs it, since its amax depends
    on x alone and XLA would hoist that reduction out of the loop (seen in the CPU's HLO). The
    multiply fuses into XLA's cast and amax; the Pallas kernels' amax depends on the scale and
    is not hoisted, and an extra op before them would be an extra pass, so they run without.
    """
    import jax
    import jax.numpy as jnp

    def many(*args):
        zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(fn, *args))

        def body(_, carry):
            ok = jnp.ravel(carry[2])[0] >= 0
            s = jnp.where(ok, args[-1], -args[-1])  # always args[-1], but not provably
            first = args[0] * jnp.where(ok, 1, -1).astype(args[0].dtype) if vary_input else args[0]
            return fn(first, *args[1:-1], s)

        return jax.lax.fori_loop(0, reps, body, zeros)

    return jax.jit(many)


def per_call_us(fn, args, iters: int, reps: int = 10) -> float:
    """Microseconds per call of ``fn(*args)`` run ``reps`` times in one program (``in_loop``),
    median of ``iters`` runs."""
    return median_s(in_loop(fn, reps), args, iters) / reps * 1e6


def save_hlo(out: str, run: str, text: str) -> str:
    """Write a compiled step's HLO, gzipped, as ``<out>/hlo_<run>.txt.gz``; return the path."""
    path = os.path.join(out, f"hlo_{runner.safe_name(run)}.txt.gz")
    with gzip.open(path, "wt") as f:
        f.write(text)
    return path


# Instructions that launch nothing: views, tuples, constants, and the second half of async pairs.
_NO_LAUNCH = {"parameter", "get-tuple-element", "bitcast", "tuple", "constant", "after-all"}
SMALL = 4096  # elements: the scale states' histories, scalars, norms' vectors


def launches(hlo: str) -> tuple[int, int]:
    """``(ops, small)``: instructions of the compiled step's entry computation that run on the
    device (an upper bound on kernel launches per step outside loops), and how many of them
    write at most ``SMALL`` elements (the tiny kernels of the FP8 scale state)."""
    from fp8jax.diagnostics import hlo as hlo_lib

    comps, entry = hlo_lib.computations(hlo)
    ops = small = 0
    for line in comps[entry]:
        m = re.match(r"\s*(?:ROOT )?%\S+ = (.+?) ([\w-]+)\(", line)
        if not m or m.group(2) in _NO_LAUNCH or m.group(2).endswith("-done"):
            continue
        ops += 1
        sizes = [
            math.prod(int(d) for d in dims.split(",") if d)
            for dims in re.findall(r"\[([\d,]*)\]", m.group(1))
        ]
        small += max(sizes, default=0) <= SMALL
    return ops, small


class GpuPower:
    """Samples ``nvidia-smi`` (power draw, SM clock) every 100 ms inside a ``with`` block."""

    QUERY = ["nvidia-smi", "--query-gpu=power.draw,clocks.sm", "--format=csv,noheader,nounits"]

    def __enter__(self):
        self.samples, self.proc = [], None
        # nvidia-smi ignores CUDA_VISIBLE_DEVICES: ask for the first GPU this process sees.
        gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
        cmd = self.QUERY + ["-i", gpu, "-lms", "100"]
        with contextlib.suppress(OSError):  # no nvidia-smi (CPU): no samples
            self.proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
            )
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.terminate()
            out, _ = self.proc.communicate(timeout=10)
            self.samples = parse_power(out)
        return False

    def summary(self, ms_per_step: float) -> dict | None:
        """Mean W and MHz over the samples (first GPU) and joules per step; None if none."""
        if not self.samples:
            return None
        watts = statistics.mean(w for w, _ in self.samples)
        return {
            "watts": watts,
            "sm_mhz": statistics.mean(mhz for _, mhz in self.samples),
            "joules_per_step": watts * ms_per_step / 1e3,
            "samples": len(self.samples),
        }


def parse_power(text: str) -> list[tuple[float, float]]:
    """``(watts, sm_mhz)`` per ``nvidia-smi`` csv line; lines that are not numbers are skipped."""
    rows = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        with contextlib.suppress(ValueError, IndexError):
            rows.append((float(fields[0]), float(fields[1])))
    return rows


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
    gemm = "gemm" in n or "nvjet" in n or "xmma" in n or "cutlass" in n
    if gemm and any(t in n for t in ("e4m3", "e5m2", "f8f8", "qqtst", "_f8", "fp8")):
        return "gemm_fp8"
    if gemm or "cublas" in n:
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


def trace_steps(compiled, state, batch, steps: int, top: int) -> dict:
    """Run ``steps`` more steps under ``jax.profiler`` and summarise their device kernels."""
    import jax

    with tempfile.TemporaryDirectory(prefix="fp8jax_trace_") as trace_dir:
        t0 = time.perf_counter()
        with jax.profiler.trace(trace_dir):
            for _ in range(steps):
                state, metrics = compiled(state, batch)
            jax.block_until_ready(metrics)
        wall_ms = (time.perf_counter() - t0) * 1e3 / steps
        return {"traced_wall_ms_per_step": wall_ms, **summarize_trace(trace_dir, steps, top)}


XLA_DUMP = "FP8JAX_DUMP"  # env var: the XLA dump folder a memory report parses


def dump_env(dump: str) -> dict:
    """The env vars of a child whose XLA dump in ``dump`` a memory report parses. No JAX
    compilation cache: a cached executable skips XLA's compile, and its dump."""
    return {XLA_DUMP: dump, "JAX_ENABLE_COMPILATION_CACHE": "false"}


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
    # The same breakdown summed over layers: 'block_3/mlp/...' counts as 'block_*/mlp/...'.
    folded: dict[str, int] = {}
    for b in out["breakdown"]:
        op = re.sub(r"block_\d+", "block_*", b["op"])
        folded[op] = folded.get(op, 0) + b["bytes"]
    out["by_op_over_layers"] = [
        {"op": op, "bytes": n} for op, n in sorted(folded.items(), key=lambda kv: -kv[1])
    ][:top]
    out["peak_buffers"] = sorted(out["peak_buffers"], key=lambda r: -r["bytes"])[:top]
    out["breakdown"] = sorted(out["breakdown"], key=lambda r: -r["bytes"])[:top]
    return out


def finite_loss(run: str, loss) -> float:
    """``loss`` as a float; an error naming ``run`` if it is NaN or infinite (its step times
    would time non-finite arithmetic, not training)."""
    value = float(loss)
    if not math.isfinite(value):
        raise FloatingPointError(f"{run}: the loss is {value} after the timed steps; no timing")
    return value
