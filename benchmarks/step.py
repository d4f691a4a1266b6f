"""Full train step (fwd + bwd + optimizer + FP8 state update) throughput and memory per level.

Each run spec (``benchmarks.runner``) runs in a fresh process so the peak device memory is its
own. Per run: median step time over timed steps after warm-up, tokens/s, model FLOPs
utilisation (against 989 TFLOP/s dense bf16), peak device memory, compiled temp memory, and
the number of FP8 GEMMs in the compiled step (``__cublas$lt$matmul$f8`` calls and fp8jax's
block-scaled GEMM kernels).

    PYTHONUNBUFFERED=1 python -m benchmarks.step --out "$OUT" \
        --runs gpt_1b3:O0,gpt_1b3:O1,gpt_1b3:O2,llama_1b:O0,llama_1b:O1

A run is ``config:level[:options]``, options joined by ``+``: ``key=value`` config overrides
(``gpt_1b3:O0:model.scan_layers=False``) and ``plain``, which jits the same pure step without
shardings or mesh (the unsharded reference for the sharded path's overhead). ``--set
key=value`` overrides every run. ``--quick`` shrinks every model to a CPU smoke test.

``--torch RUNS`` also times ``benchmarks.torch_reference`` runs (``config:bf16`` or
``config:float8``, with the optimizer; each at its config's batch) in the same call, after
the JAX runs and in fresh processes of their own, into the same table: the MoE step against
PyTorch's on one GPU,

    python -m benchmarks.step --out "$OUT" --runs olmoe_1b7b:O0,olmoe_1b7b:O1,olmoe_1b7b:O2 \
        --torch olmoe_1b7b:bf16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from benchmarks import common, runner

FLAGS = {"plain"}  # the bare run options this benchmark reads


def config_for(run: str, quick: bool, batch: int = 0, mesh="-1,1,1", sets=()):
    """The ConfigDict of one run: ``--mesh``, ``--batch``, ``--quick``, then the run's options."""
    return runner.load(run, sets, runner.step_settings(quick, batch, mesh), FLAGS)


def child(
    run: str,
    quick: bool,
    steps: int,
    batch: int = 0,
    mesh="-1,1,1",
    profile: int = 0,
    hlo_dir: str | None = None,
    sets=(),
) -> dict:
    """Compile and time one run (config:level[:options]) inside the child process.

    ``profile`` > 0 also traces that many steps after the timed ones and adds the kernel
    summary of ``benchmarks.kernel_profile`` (one build and compile serve both).
    """
    import jax

    from fp8jax import models
    from fp8jax.diagnostics import coverage
    from fp8jax.diagnostics import hlo as hlo_lib

    t_build = time.perf_counter()
    c = config_for(run, quick, batch, mesh, sets)
    p = common.prepare(c, run, plain="plain" in runner.parse_run(run)[2])
    s, state, batch = p.setup, p.state, p.batch
    build_s = time.perf_counter() - t_build  # imports excluded: setup, init compile, init
    # The process-wide peak is max(init, step): these two tell the step's share apart.
    dev = jax.devices()[0]
    init_peak = common.peak_bytes(dev)
    state_bytes = sum(
        s.data.nbytes
        for leaf in jax.tree.leaves(state)
        for s in leaf.addressable_shards
        if s.device == dev
    )
    # Progress on stderr: a run cut by --timeout still says which stage it reached.
    print(f"{run}: built in {build_s:.1f} s, compiling", file=sys.stderr, flush=True)
    name, level, _ = runner.parse_run(run)
    with common.mesh_context(c, s):
        t0 = time.perf_counter()
        compiled = s.train_step.lower(state, batch).compile()
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
            common.save_hlo(hlo_dir, run, hlo)
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
        with common.GpuPower() as power:  # the GPU's draw and clock while the steps run
            state, ms_pipe, dispatch_ms = common.pipelined(
                compiled, state, [batch], steps, keep=True
            )
        # Whether moved buffers cost time: XLA re-records a CUDA graph whose buffers moved
        # (openxla/xla, command_buffer_thunk.cc). Kept metrics move every step's outputs,
        # fresh batches its input.
        state, ms_drop, dispatch_drop = common.pipelined(
            compiled, state, [batch], steps, keep=False
        )
        batch2 = jax.tree.map(lambda a: a + 0, batch)  # same values, another buffer
        two = [batch, batch2]
        state, ms_two, dispatch_two = common.pipelined(compiled, state, two, steps, keep=False)
        kernels = common.trace_steps(compiled, state, batch, profile, 10) if profile else None
    # A GPU at its power cap runs NaN and Inf faster than numbers: no timing of such a step.
    loss = common.finite_loss(run, metrics["loss"])
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
        # energy of one step (a GPU at its power cap trades clock for power).
        "power": power.summary(ms_pipe),
        # Pipelined again with each step's metrics dropped at once, then also alternating two
        # batch buffers: [step ms, host dispatch ms].
        "pipelined_metrics_dropped": [ms_drop, dispatch_drop],
        "pipelined_two_batches": [ms_two, dispatch_two],
        "tokens_per_s_pipelined": tokens / (ms_pipe / 1e3),
        "devices": s.mesh.size,
        "tokens_per_s_per_device": tokens / (ms / 1e3) / s.mesh.size,
        # Against the peak of every device the step runs on.
        "mfu": models.flops_per_token(s.run.model, s.run.optim.seq_len)
        * tokens
        / (ms / 1e3)
        / common.PEAK_BF16
        / s.mesh.size,
        "peak_gib": common.peak_bytes(dev) / 2**30,
        "temp_gib": temp / 2**30,
        "init_peak_gib": init_peak / 2**30,
        "state_gib": state_bytes / 2**30,  # the train state's bytes on device 0
        "fp8_gemms": coverage.gemm_counts(hlo).get(coverage.CUBLAS_FP8, 0),
        "block_gemms": coverage.gemm_counts(hlo).get(coverage.BLOCK_GEMM, 0),
        "scaled_gemms": coverage.gemm_counts(hlo).get(coverage.SCALED_GEMM, 0),
        "hlo_ops_and_small": common.launches(hlo),
        # Bytes each device sends per step under ring costs, by collective and element type.
        "comm_bytes": hlo_lib.bytes_summary(hlo_lib.collectives(hlo, s.mesh.size)),
        "compile_s": compile_s,
        "build_s": build_s,
        **p.times,
        "loss": loss,
        "jax": jax.__version__,
        "device": str(dev.device_kind),
        "profile": kernels,
    }


def _gib(v) -> str:
    return f"{v:.2f}"


COLUMNS = {
    **runner.STEP_COLUMNS,
    "peak GiB": lambda r: _gib(r["peak_gib"]),
    "temp GiB": lambda r: _gib(r["temp_gib"]),
    "f8": lambda r: r["fp8_gemms"] + r.get("block_gemms", 0) + r.get("scaled_gemms", 0),
    "ops/tiny": lambda r: "/".join(map(str, r["hlo_ops_and_small"])),
    "host ms": lambda r: f"{r['host_ms_per_step']:.1f}",
    "disp ms": lambda r: f"{r['dispatch_ms_pipelined']:.1f}",
    "W": lambda r: f"{r['power']['watts']:.0f}",
    "J/step": lambda r: f"{r['power']['joules_per_step']:.1f}",
}


def torch_rows(a: argparse.Namespace) -> list[dict]:
    """The ``--torch`` runs' records (or error rows), each measured by a ``torch_reference``
    child process and written as that benchmark writes it."""
    rows = []
    for run in filter(None, a.torch.split(",")):
        run = f"{run}:optim"  # the whole step, as this benchmark's
        quick = ["--quick", "--no-compile"] if a.quick else []  # the CPU smoke test: eager
        # The same depth as the JAX runs when --set reduces it (the only shape torch takes).
        layers = [v for k, v in (s.split("=", 1) for s in a.set) if k == "model.num_layers"]
        depth = ["--layers", layers[-1]] if layers else []
        args = ("--out", a.out, "--steps", str(a.steps), *quick, *depth, f"--child={run}")
        cmd = runner.command("torch_reference", *args)
        rows.append(runner.run_child(cmd, run, timeout=a.timeout or None))
        runner.write_json(a.out, f"torch_reference_{runner.safe_name(run)}", rows[-1])
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None):
    p = runner.parser(__doc__, sets=True)
    p.add_argument("--runs", default="gpt_1b3:O0,gpt_1b3:O1,gpt_1b3:O2,llama_1b:O0,llama_1b:O1")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--batch", type=int, default=0, help="override batch_size (0: config's)")
    p.add_argument("--mesh", default="-1,1,1", help="data,fsdp,tensor sizes (-1: the rest)")
    p.add_argument("--timeout", type=int, default=0, help="seconds per run (0: none)")
    p.add_argument("--profile", type=int, default=0, help="also trace N steps: top kernels")
    p.add_argument("--keep-hlo", action="store_true", help="also write each step's HLO (gz)")
    p.add_argument("--torch", default="", help="also these torch_reference runs (config:bf16)")
    a = runner.parse_args(p, argv)

    def measure(run: str, a: argparse.Namespace) -> dict:
        hlo_dir = a.out if a.keep_hlo else None
        return child(run, a.quick, a.steps, a.batch, a.mesh, a.profile, hlo_dir, a.set)

    check = lambda run: config_for(run, a.quick, a.batch, a.mesh, a.set)  # noqa: E731
    rows = runner.drive(
        "step", a, measure, a.runs.split(","), check=check, timeout=a.timeout or None
    )
    if rows is None:
        return
    rows += torch_rows(a)
    print("\n" + runner.table(rows, COLUMNS))
    for r in rows:
        prof = r.get("profile")
        if prof:
            cats = ", ".join(f"{k} {v:.1f}" for k, v in prof["categories"].items())
            print(f"\n{r['run']}: GPU busy {prof['busy_ms_per_step']:.1f} ms/step; {cats}")
            for k in prof["top"]:
                print(f"  {k['ms_per_step']:7.2f} ms x{k['calls_per_step']:<5g} {k['name'][:80]}")


if __name__ == "__main__":
    sys.exit(main())
