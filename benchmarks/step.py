"""Full train step (fwd + bwd + optimizer + FP8 state update) throughput and memory per level.

Each (config, level) runs in a fresh process so the peak device memory is its own. Per run:
median step time over timed steps after warm-up, tokens/s, model FLOPs utilisation (against
989 TFLOP/s dense bf16), peak device memory, compiled temp memory, and the number of
``__cublas$lt$matmul$f8`` GEMMs in the compiled step.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/step.py --out "$OUT" \
        --runs gpt_1b3:O0,gpt_1b3:O1,gpt_1b3:O2,llama_1b:O0,llama_1b:O1

A run is ``config:level[:options]``, options joined by ``+``: ``key=value`` config overrides
(``gpt_1b3:O0:model.scan_layers=False``) and ``plain``, which jits the same pure step without
shardings or mesh (the unsharded reference for the sharded path's overhead).
``--quick`` shrinks every model to a CPU smoke test.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time

MARK = "@@STEP "
PEAK_BF16 = 989e12  # H100/H200 SXM dense bf16 datasheet FLOP/s, the usual MFU denominator


def parse_run(run: str) -> tuple[str, str, list[str]]:
    """'gpt_1b3:O1[:model.scan_layers=False+plain]' -> (config, level, options)."""
    name, level, *rest = run.split(":", 2)  # option values may hold ':' (paths)
    return name, level, (rest[0].split("+") if rest else [])


def apply_overrides(c, options) -> None:
    """Set ``key=value`` options on the config (values parsed as Python literals if they can)."""
    import ast

    for opt in options:
        if "=" not in opt:
            continue
        key, value = opt.split("=", 1)
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            pass  # a bare string such as bfloat16
        *parents, leaf = key.split(".")
        node = c
        for part in parents:
            if part not in node:
                raise KeyError(f"unknown config field {key!r} in run option {opt!r}")
            node = node[part]
        if leaf not in node:
            raise KeyError(f"unknown config field {key!r} in run option {opt!r}")
        node[leaf] = value


def build(run: str, quick: bool, batch: int = 0, mesh="-1,1,1"):
    """(config, compiled-ready env, state, batch) for one run string, as the trainer builds them."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from fp8jax.trainer import loop as train_lib
    from fp8jax.trainer import step as step_lib

    name, level, options = parse_run(run)
    c = train_lib.load_config(name)
    c.fp8.level = level
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = (int(v) for v in mesh.split(","))
    if batch:
        c.batch_size = batch
    if quick:
        m = c.model
        m.num_layers, m.d_model, m.num_heads, m.num_kv_heads, m.d_ff = 2, 64, 2, 2, 128
        m.vocab_size, m.max_len, c.seq_len, c.batch_size = 256, 32, 32, 4
        m.dtype, m.attention_impl = "float32", "xla"
    apply_overrides(c, options)
    # The trainer's own jitted init and step: explicit shardings over the mesh and donation.
    t0 = time.perf_counter()
    env = train_lib.setup(c)
    setup_s = time.perf_counter() - t0
    print(f"{run}: setup (trace) {setup_s:.1f} s", file=sys.stderr, flush=True)
    if "plain" in options:
        # The unsharded reference: the same pure step under a bare jit (no shardings, no mesh).
        env["train_step"] = jax.jit(
            step_lib.make_train_step(env["model"], env["tx"], c, mesh=None), donate_argnums=0
        )
    t0 = time.perf_counter()
    key = jax.random.PRNGKey(0)
    init = env["init"].lower(key).compile()
    init_compile_s = time.perf_counter() - t0
    state = init(key)
    jax.block_until_ready(state)
    init_s = time.perf_counter() - t0
    print(
        f"{run}: init {init_s:.1f} s (compile {init_compile_s:.1f} s)", file=sys.stderr, flush=True
    )
    # Where GPU minutes go before the step compiles.
    env["build_times"] = dict(setup_s=setup_s, init_s=init_s, init_compile_s=init_compile_s)
    tok = np.random.default_rng(0).integers(0, c.model.vocab_size, (c.batch_size, c.seq_len))
    tok = jnp.asarray(tok, jnp.int32)
    batch = jax.device_put({"inputs": tok, "targets": tok}, env["batch_sharding"])
    return c, env, state, batch


class _GpuPower:
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


def _pipelined(compiled, state, batches, steps: int, keep: bool):
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


def child(
    run: str,
    quick: bool,
    steps: int,
    batch: int = 0,
    mesh="-1,1,1",
    profile: int = 0,
    hlo_dir: str | None = None,
) -> dict:
    """Compile and time one run (config:level[:options]) inside the child process.

    ``profile`` > 0 also traces that many steps after the timed ones and adds the kernel
    summary of ``kernel_profile.py`` (one build and compile serve both).
    """
    import jax

    from fp8jax import models
    from fp8jax.parallel import comm

    t_build = time.perf_counter()
    c, env, state, batch = build(run, quick, batch, mesh)
    build_s = time.perf_counter() - t_build  # imports excluded: setup, init compile, init
    # The process-wide peak is max(init, step): these two tell the step's share apart.
    dev = jax.devices()[0]
    init_peak = _peak_bytes(dev)
    state_bytes = sum(
        s.data.nbytes
        for leaf in jax.tree.leaves(state)
        for s in leaf.addressable_shards
        if s.device == dev
    )
    # Progress on stderr: a run cut by --timeout still says which stage it reached.
    print(f"{run}: built in {build_s:.1f} s, compiling", file=sys.stderr, flush=True)
    name, level, _ = parse_run(run)
    with mesh_context(c, env):
        t0 = time.perf_counter()
        compiled = env["train_step"].lower(state, batch).compile()
        compile_s = time.perf_counter() - t0
        ma = compiled.memory_analysis()
        # XLA's memory needs, known before a step runs: an out-of-memory row still shows them.
        temp, args = (
            getattr(ma, k, 0) or 0 for k in ("temp_size_in_bytes", "argument_size_in_bytes")
        )
        print(
            f"{run}: compiled in {compile_s:.1f} s; XLA temp {temp / 2**30:.2f} GiB, "
            f"arguments {args / 2**30:.2f} GiB",
            file=sys.stderr,
            flush=True,
        )
        hlo = compiled.as_text()
        if hlo_dir:  # to look up fusions and collectives of the table later
            save_hlo(hlo_dir, run, hlo)
        for _ in range(2):  # warm-up
            state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        times, enqueue = [], []
        for _ in range(steps):
            t = time.perf_counter()
            state, metrics = compiled(state, batch)
            # The call returns once the host has enqueued the step's work on an idle GPU: at
            # or above the GPU's time per step, the step is host-bound.
            enqueue.append(time.perf_counter() - t)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - t)
        # Pipelined: steps dispatched back to back, one wait at the end. The trainer's loop
        # reads each step's metrics one step late, so this is the rate training runs at; the
        # per-step figure above also counts the host's dispatch gap after every wait.
        with _GpuPower() as power:  # the GPU's draw and clock while the steps run
            state, ms_pipe, dispatch_ms = _pipelined(compiled, state, [batch], steps, keep=True)
        # Whether moved buffers cost time: XLA re-records a CUDA graph whose buffers moved
        # (openxla/xla, command_buffer_thunk.cc). Kept metrics move every step's outputs,
        # fresh batches its input. On an H200 neither changed the step (RESULTS.md,
        # 2026-11-30, eighth).
        state, ms_drop, dispatch_drop = _pipelined(compiled, state, [batch], steps, keep=False)
        batch2 = jax.tree.map(lambda a: a + 0, batch)  # same values, another buffer
        two = [batch, batch2]
        state, ms_two, dispatch_two = _pipelined(compiled, state, two, steps, keep=False)
        kernels = _profile(compiled, state, batch, profile) if profile else None
    ms = statistics.median(times) * 1e3
    tokens = c.batch_size * c.seq_len
    return {
        "run": run,
        "config": name,
        "level": level,
        "batch": c.batch_size,
        "seq": c.seq_len,
        "step_ms": ms,
        "tokens_per_s": tokens / (ms / 1e3),
        "step_ms_pipelined": ms_pipe,
        "host_ms_per_step": statistics.median(enqueue) * 1e3,
        "dispatch_ms_pipelined": dispatch_ms,
        # nvidia-smi during the pipelined steps (None without it): mean W and SM MHz, and the
        # energy of one step. An H200 at its 700 W cap trades clock for power.
        "power": power.summary(ms_pipe),
        # Pipelined again with each step's metrics dropped at once, then also alternating two
        # batch buffers: [step ms, host dispatch ms].
        "pipelined_metrics_dropped": [ms_drop, dispatch_drop],
        "pipelined_two_batches": [ms_two, dispatch_two],
        "tokens_per_s_pipelined": tokens / (ms_pipe / 1e3),
        "devices": env["mesh"].size,
        "tokens_per_s_per_device": tokens / (ms / 1e3) / env["mesh"].size,
        # Against the peak of every device the step runs on.
        "mfu": models.flops_per_token(c) * tokens / (ms / 1e3) / PEAK_BF16 / env["mesh"].size,
        "peak_gib": _peak_bytes(dev) / 2**30,
        "temp_gib": temp / 2**30,
        "init_peak_gib": init_peak / 2**30,
        "state_gib": state_bytes / 2**30,  # the train state's bytes on device 0
        "fp8_gemms": hlo.count("__cublas$lt$matmul$f8"),
        # gpt_1b3 O1 at data=2 (2026-11-30, second, call 1): 7,118 ops, 5,471 of them tiny.
        "hlo_ops_and_small": launches(hlo),
        # Bytes each device sends per step under ring costs, by collective and element type.
        "comm_bytes": comm.bytes_summary(comm.collectives(hlo, env["mesh"].size)),
        "compile_s": compile_s,
        "build_s": build_s,
        **env["build_times"],
        "loss": float(metrics["loss"]),
        "jax": jax.__version__,
        "device": str(dev.device_kind),
        "profile": kernels,
    }


def _peak_bytes(dev) -> int:
    """The process's peak device memory so far (0 where the backend keeps no statistics)."""
    stats = dev.memory_stats() if hasattr(dev, "memory_stats") else None
    return (stats or {}).get("peak_bytes_in_use", 0)


def _profile(compiled, state, batch, steps: int, top: int = 10) -> dict:
    """Trace ``steps`` more steps and summarise the device kernels (``kernel_profile.py``)."""
    import kernel_profile  # beside this file; imported late, it imports this module

    return kernel_profile.trace_steps(compiled, state, batch, steps, top)


# Instructions that launch nothing: views, tuples, constants, and the second half of async pairs.
_NO_LAUNCH = {"parameter", "get-tuple-element", "bitcast", "tuple", "constant", "after-all"}
_SMALL = 4096  # elements: the scale states' histories, scalars, norms' vectors


def launches(hlo: str) -> tuple[int, int]:
    """``(ops, small)``: instructions of the compiled step's entry computation that run on the
    device (an upper bound on kernel launches per step outside loops), and how many of them
    write at most ``_SMALL`` elements (the tiny kernels of the FP8 scale state)."""
    from fp8jax.parallel import comm

    comps, entry = comm._computations(hlo)
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
        small += max(sizes, default=0) <= _SMALL
    return ops, small


def run_child(cmd, mark: str, run: str, env=None, timeout=None) -> dict:
    """Run one benchmark child process: its ``mark``-prefixed JSON record, or an error row.

    A failed child reports the exception, its last lines on stderr (its progress; a child cut by
    ``timeout`` has no exception) and, first, its compile line with XLA's memory needs.
    """
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        out, err = proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        as_text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else b or ""  # noqa: E731
        out, err = "", f"{as_text(e.stderr)}\ntimed out after {timeout} s"
    recs = [json.loads(ln[len(mark) :]) for ln in out.splitlines() if ln.startswith(mark)]
    if recs:
        return recs[0]
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    # The exception's own line (XLA appends stack locations after it), then the last lines.
    raised = [ln for ln in lines if ln.split(":")[0].rsplit(".", 1)[-1].endswith("Error")][:1]
    compiled = [ln for ln in lines if "compiled in" in ln and "XLA temp" in ln][-1:]
    tail = raised + [ln for ln in lines[-2:] if ln not in raised + compiled]
    return {"run": run, "error": " | ".join(compiled + tail or ["?"])[:600]}


def mesh_context(c, env):
    """The legacy ``with mesh:`` only where flax's FP8 op needs it; shardings are explicit."""
    return env["mesh"] if c.fp8.get("impl") == "flax" else contextlib.nullcontext()


def safe_name(run: str) -> str:
    """A run string as a file name: 'gpt_1b3:O1:model.x=True' -> 'gpt_1b3_O1_model-x-True'."""
    return run.replace(":", "_").replace("=", "-").replace("+", "_").replace(".", "-")


def save_hlo(out: str, run: str, text: str) -> str:
    """Write a compiled step's HLO, gzipped, as ``<out>/hlo_<run>.txt.gz``; return the path."""
    import gzip

    path = os.path.join(out, f"hlo_{safe_name(run)}.txt.gz")
    with gzip.open(path, "wt") as f:
        f.write(text)
    return path


def parse_bench_args(p: argparse.ArgumentParser, child: bool = True) -> argparse.Namespace:
    """Add the flags every benchmark shares (``--out``, ``--child``), parse, create ``--out``."""
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    if child:  # set by the parent on the child processes it starts
        p.add_argument("--child", default=None)
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)  # a fresh $OUT subfolder is fine
    return a


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--runs", default="gpt_1b3:O0,gpt_1b3:O1,gpt_1b3:O2,llama_1b:O0,llama_1b:O1")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--batch", type=int, default=0, help="override batch_size (0: config's)")
    p.add_argument("--mesh", default="-1,1,1", help="data,fsdp,tensor sizes (-1: the rest)")
    p.add_argument("--timeout", type=int, default=0, help="seconds per run (0: none)")
    p.add_argument("--profile", type=int, default=0, help="also trace N steps: top kernels")
    p.add_argument("--keep-hlo", action="store_true", help="also write each step's HLO (gz)")
    a = parse_bench_args(p)
    if a.child:
        hlo_dir = a.out if a.keep_hlo else None
        rec = child(a.child, a.quick, a.steps, a.batch, a.mesh, a.profile, hlo_dir)
        print(MARK + json.dumps(rec), flush=True)
        return
    rows = []
    for run in a.runs.split(","):
        cmd = [sys.executable, __file__, "--child", run, "--steps", str(a.steps)]
        cmd += ["--batch", str(a.batch), f"--mesh={a.mesh}", "--profile", str(a.profile)]
        cmd += ["--out", a.out] + (["--keep-hlo"] if a.keep_hlo else [])
        cmd += ["--quick"] if a.quick else []
        rows.append(run_child(cmd, MARK, run, timeout=a.timeout or None))
        print(json.dumps(rows[-1]), flush=True)
        with open(os.path.join(a.out, "step.json"), "w") as f:
            json.dump(rows, f, indent=1)
    head = ("run", "ms", "tok/s", "pipe ms", "pipe tok/s", "MFU", "peak GiB", "temp GiB", "f8")
    head += ("ops/tiny", "host ms", "disp ms", "W", "J/step")
    row = "\n{:40} {:>8} {:>9} {:>8} {:>10} {:>6} {:>9} {:>9} {:>4} {:>11} {:>7} {:>7} {:>5} {:>6}"
    print(row.format(*head))
    for r in rows:
        if "error" in r:
            print(f"{r['run']:40} ERROR {r['error'][:80]}")
            continue
        print(
            f"{r['run'][:40]:40} {r['step_ms']:8.1f} {r['tokens_per_s']:9.0f} "
            f"{r['step_ms_pipelined']:8.1f} {r['tokens_per_s_pipelined']:10.0f} {r['mfu']:6.1%} "
            f"{r['peak_gib']:9.2f} {r['temp_gib']:9.2f} {r['fp8_gemms']:4d} "
            f"{'/'.join(map(str, r.get('hlo_ops_and_small', ()))):>11} "
            f"{r.get('host_ms_per_step', float('nan')):7.1f} "
            f"{r.get('dispatch_ms_pipelined', float('nan')):7.1f} "
            f"{(r.get('power') or {}).get('watts', float('nan')):5.0f} "
            f"{(r.get('power') or {}).get('joules_per_step', float('nan')):6.1f}"
        )
    for r in rows:
        prof = r.get("profile")
        if prof:
            cats = ", ".join(f"{k} {v:.1f}" for k, v in prof["categories"].items())
            print(f"\n{r['run']}: GPU busy {prof['busy_ms_per_step']:.1f} ms/step; {cats}")
            for k in prof["top"]:
                print(f"  {k['ms_per_step']:7.2f} ms x{k['calls_per_step']:<5g} {k['name'][:80]}")


if __name__ == "__main__":
    main()
