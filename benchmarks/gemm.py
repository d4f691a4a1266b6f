"""GEMM benchmark: bf16 vs fp8jax (delayed, current scaling) vs flax's ``Fp8DirectDotGeneralOp``.

For LLM shapes M x K x N it measures, through ``jax.jit`` and ``nn.Dense(dot_general_cls=...)``:

* ``fwd``    forward of one linear layer y = x @ w                      (2*M*K*N flop)
* ``linear`` forward + backward of that layer: y, dx, dw and, for FP8,
             the scale-state update (fp8jax: ``fp8jax.update_state``;
             flax: the new ``_overwrite_with_gradient`` collection)     (6*M*K*N flop)
* ``mlp``    forward + backward of Dense(N) -> gelu -> Dense(K)         (12*M*K*N flop)

Inputs, weights and cotangents are bf16 (``param_dtype=dtype=bfloat16``, no bias), so every
variant multiplies the same bf16 tensors. For each program it reports the median time over
several timed repetitions (after warm-up, ``block_until_ready``), TFLOP/s, the number of
``__cublas$lt$matmul$f8`` custom calls in the compiled HLO and the compiled program's transient
memory (``memory_analysis().temp_size_in_bytes``). A separate probe measures compile time and
runtime with and without ``--xla_gpu_enable_triton_gemm=false`` (each in a fresh process, since
XLA_FLAGS is read once at start-up).

Run from the repository root (GPU)::

    PYTHONUNBUFFERED=1 python -m benchmarks.gemm --out "$OUT"

``--quick`` uses tiny shapes (CPU smoke test). JSON goes to ``<out>/gemm.json`` (every record,
rewritten after each one).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

from benchmarks import common, runner

SHAPES = [(16384, 4096, 16384), (16384, 16384, 4096), (8192, 8192, 8192), (4096, 4096, 4096)]
QUICK_SHAPES = [(64, 32, 48), (32, 64, 16)]
VARIANTS = ["bf16", "fp8jax-delayed", "fp8jax-current", "flax-direct"]
FWD_EXTRA = ["fp8jax-delayed-eval"]  # forward without recording amax (what flax's fwd computes)
MODES = {"fwd": 2, "linear": 6, "mlp": 12}  # flop = factor * M * K * N
TRITON_FLAG = "--xla_gpu_enable_triton_gemm"


def _set_triton_flag(flags: str, value: str | None) -> str:
    flags = " ".join(f for f in flags.split() if not f.startswith(TRITON_FLAG))
    return f"{flags} {TRITON_FLAG}={value}".strip() if value else flags


# --------------------------------------------------------------------------------------------
# Child process: everything that imports jax lives below this line's functions.
# --------------------------------------------------------------------------------------------


_TRIVIAL = {
    "parameter",
    "tuple",
    "get-tuple-element",
    "bitcast",
    "constant",
    "copy-start",
    "copy-done",
}
# (mode, variant) whose compiled HLO --dump-hlo writes, for the first shape.
DUMPED = {
    ("linear", "fp8jax-delayed"),
    ("linear", "flax-direct"),
    ("linear", "fp8jax-current"),
    ("mlp", "fp8jax-delayed"),
    ("mlp", "flax-direct"),
}


def _hlo_stats(text: str) -> dict:
    """Count GEMM kinds and top-level kernels of a compiled HLO module."""
    targets = re.findall(r'custom_call_target="([^"]+)"', text)
    entry = text[text.find("\nENTRY ") :] if "\nENTRY " in text else ""
    entry = entry[: entry.find("\n}")] if entry else ""
    ops = re.findall(r"=\s*[^=]*?\s([a-z][a-z0-9-]*)\(", entry)
    kernels = [o for o in ops if o not in _TRIVIAL]
    return {
        "f8_gemms": sum(t == "__cublas$lt$matmul$f8" for t in targets),
        "cublas_gemms": sum(t in ("__cublas$lt$matmul", "__cublas$gemm") for t in targets),
        "triton_gemms": text.count('"kind":"__triton_gemm"'),
        "entry_kernels": len(kernels),
        "entry_copies": sum(o in ("copy", "transpose") for o in kernels),
        # module-wide, fused computations included: layout changes XLA had to materialize
        "transpose_ops": len(re.findall(r"\stranspose\(", text)),
        "copy_ops": len(re.findall(r"\scopy\(", text)),
    }


class _Bench:
    """Builds the models and step functions of one (variant, mode, shape)."""

    def __init__(self):
        import jax
        import jax.numpy as jnp
        from flax import linen as nn

        import fp8jax

        self.jax, self.jnp, self.nn, self.fp8jax = jax, jnp, nn, fp8jax
        self.owg = "_overwrite_with_gradient"

    def dot_cls(self, variant: str):
        fp8jax, nn = self.fp8jax, self.nn
        if variant == "bf16":
            return None
        if variant.startswith("fp8jax-delayed"):
            return fp8jax.fp8_dot_general_cls(fp8jax.DelayedScaling())
        if variant == "fp8jax-current":
            return fp8jax.fp8_dot_general_cls(fp8jax.CurrentScaling())
        if variant == "flax-direct":
            return nn.Fp8DirectDotGeneralOp
        raise ValueError(variant)

    def model(self, variant: str, mode: str, k: int, n: int):
        nn, jnp = self.nn, self.jnp
        cls = self.dot_cls(variant)
        kw = dict(use_bias=False, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
        if cls is not None:
            kw["dot_general_cls"] = cls

        class Linear(nn.Module):
            @nn.compact
            def __call__(self, x):
                return nn.Dense(n, name="dense", **kw)(x)

        class Mlp(nn.Module):
            @nn.compact
            def __call__(self, x):
                h = nn.gelu(nn.Dense(n, name="up", **kw)(x))
                return nn.Dense(k, name="down", **kw)(h)

        return Mlp() if mode == "mlp" else Linear()

    def step(self, variant: str, mode: str, model):
        """(fn, takes_state): fn(params, state, x, dy) -> outputs (+ new state last)."""
        jax, fp8jax = self.jax, self.fp8jax
        fp8 = variant.startswith("fp8jax")
        coll = fp8jax.FP8 if fp8 else self.owg

        if mode == "fwd":
            if variant == "bf16":
                return lambda p, s, x, dy: model.apply({"params": p}, x)
            if variant == "fp8jax-delayed-eval" or variant == "flax-direct":
                return lambda p, s, x, dy: model.apply({"params": p, coll: s}, x)
            return lambda p, s, x, dy: model.apply({"params": p, coll: s}, x, mutable=[coll])

        if variant == "bf16":

            def f(p, s, x, dy):
                y, vjp = jax.vjp(lambda p, x: model.apply({"params": p}, x), p, x)
                gp, gx = vjp(dy)
                return y, gx, gp

            return f

        if fp8:

            def f(p, s, x, dy):
                def fwd(p, s, x):
                    y, mut = model.apply({"params": p, coll: s}, x, mutable=[coll])
                    return y, mut[coll]

                y, vjp, s_fwd = jax.vjp(fwd, p, s, x, has_aux=True)
                gp, gs, gx = vjp(dy)
                return y, gx, gp, fp8jax.update_state(s_fwd, gs)

            return f

        def f(p, s, x, dy):  # flax: the state's 'gradient' is its new value
            y, vjp = jax.vjp(lambda p, s, x: model.apply({"params": p, coll: s}, x), p, s, x)
            gp, gs, gx = vjp(dy)
            return y, gx, gp, gs

        return f

    def inputs(self, shape, mode, seed=0):
        jax, jnp = self.jax, self.jnp
        m, k, n = shape
        kx, kd = jax.random.split(jax.random.PRNGKey(seed))
        x = jax.random.normal(kx, (m, k), jnp.bfloat16)
        out_dim = k if mode == "mlp" else n
        dy = (jax.random.normal(kd, (m, out_dim), jnp.float32) * 1e-2).astype(jnp.bfloat16)
        return x, dy

    def init(self, variant, mode, shape):
        """Params (same values for every variant: same rng, same paths) and FP8 state."""
        jax, jnp = self.jax, self.jnp
        m, k, n = shape
        model = self.model(variant, mode, k, n)
        vs = model.init(jax.random.PRNGKey(1), jnp.zeros((1, k), jnp.bfloat16))
        params = vs["params"]
        state = {c: v for c, v in vs.items() if c != "params"}
        state = next(iter(state.values()), {})
        return model, params, state


def _rel(a, b) -> float:
    import jax.numpy as jnp

    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def _compile(fn, args):
    import jax

    t0 = time.perf_counter()
    lowered = jax.jit(fn).lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    return compiled, t1 - t0, t2 - t1


def run_one(b: _Bench, variant, mode, shape, args, dump_dir=None, keep=False):
    """Compile, warm (two steps, so delayed scales come from a real amax) and time one program."""
    model, params, state = b.init(variant, mode, shape)
    fn = b.step(variant, mode, model)
    x, dy = b.inputs(shape, mode)
    compiled, lower_s, compile_s = _compile(fn, (params, state, x, dy))
    text = compiled.as_text()
    rec = {
        "variant": variant,
        "mode": mode,
        "shape": list(shape),
        "lower_s": round(lower_s, 3),
        "compile_s": round(compile_s, 3),
        **_hlo_stats(text),
        **common.memory_analysis(compiled),
    }
    if dump_dir:
        name = f"hlo_{variant}_{mode}_{'x'.join(map(str, shape))}.txt"
        with open(os.path.join(dump_dir, name), "w") as f:
            f.write(text)
    # Two warm-up steps threading the state: the second uses scales from the first's amax.
    for _ in range(2):
        outs = compiled(params, state, x, dy)
        if mode != "fwd" and variant != "bf16":
            state = outs[-1]
    timing = (args.reps, args.min_rep_s, args.max_iters)
    med, times = common.time_calls(compiled, (params, state, x, dy), *timing)
    m, k, n = shape
    flop = MODES[mode] * m * k * n
    rec.update(ms=med * 1e3, tflops=flop / med / 1e12, rep_ms=[t * 1e3 for t in times])
    return rec, (outs if keep else None)


def child_main(args) -> None:
    import jax

    info = common.versions()
    runner.emit({"kind": "versions", **info})
    print(f"# versions: {info}", flush=True)
    b = _Bench()
    shapes = QUICK_SHAPES if args.quick else SHAPES
    dump_dir = args.out if args.dump_hlo else None
    for shape in shapes:
        for mode in MODES:
            variants = VARIANTS + (FWD_EXTRA if mode == "fwd" else [])
            ref = None
            for variant in variants:
                dump = dump_dir if shape == shapes[0] and (mode, variant) in DUMPED else None
                try:
                    rec, outs = run_one(b, variant, mode, shape, args, dump, keep=mode == "linear")
                except Exception as e:  # keep going: one broken variant must not hide the rest
                    rec = {"variant": variant, "mode": mode, "shape": list(shape)}
                    rec["error"] = f"{type(e).__name__}: {e}"[:2000]
                    outs = None
                if mode == "linear" and outs is not None:
                    y, gx, gp = outs[0], outs[1], outs[2]
                    gw = jax.tree.leaves(gp)[0]
                    if variant == "bf16":
                        ref = (y, gx, gw)
                    elif ref is not None:
                        rec["rel_err_vs_bf16"] = {
                            "y": _rel(y, ref[0]),
                            "dx": _rel(gx, ref[1]),
                            "dw": _rel(gw, ref[2]),
                        }
                del outs
                rec["kind"] = "main"
                runner.emit(rec)
                head = f"  {mode:6s} {'x'.join(map(str, shape)):18s} {variant:20s}"
                if "error" in rec:
                    print(f"{head} ERROR {rec['error'][:300]}", flush=True)
                    continue
                print(
                    f"{head} {rec['ms']:8.3f} ms {rec['tflops']:7.1f} TF/s  f8={rec['f8_gemms']} "
                    f"cublas={rec['cublas_gemms']} triton={rec['triton_gemms']} "
                    f"tr={rec['transpose_ops']} "
                    f"temp={rec.get('temp_size_in_bytes', -1) / 2**20:8.1f} MiB  "
                    f"compile={rec['compile_s']:.1f}s err={rec.get('rel_err_vs_bf16', '')}",
                    flush=True,
                )
            ref = None


def child_probe(args) -> None:
    """One fresh process: compile + time the linear fwd+bwd of the given variants."""
    info = common.versions()
    print(f"# probe triton={args.triton} versions: {info}", flush=True)
    b = _Bench()
    shape = QUICK_SHAPES[0] if args.quick else SHAPES[0]
    for variant in args.variants.split(","):
        rec, _ = run_one(b, variant, "linear", shape, args)
        rec.update(kind="probe", triton=args.triton, XLA_FLAGS=info["XLA_FLAGS"])
        runner.emit(rec)
        print(
            f"  probe triton={args.triton} {variant:16s} compile {rec['compile_s']:.1f} s, "
            f"{rec['ms']:.3f} ms, {rec['tflops']:.1f} TF/s, f8={rec['f8_gemms']} "
            f"triton_gemms={rec['triton_gemms']}",
            flush=True,
        )


# --------------------------------------------------------------------------------------------
# Driver (no jax import: the GPU is the children's): runs them, collects records, prints.
# --------------------------------------------------------------------------------------------


def _run_child(argv: list[str], env: dict, timeout: float, records: list, save) -> str:
    """Run a child, echo its output, collect its records; kill it at ``timeout`` seconds."""
    t0 = time.perf_counter()

    def keep(rec):
        records.append(rec)
        save()

    status = runner.spawn(runner.command("gemm", *argv), env, timeout, True, keep).status
    print(f"# child {argv} -> {status} ({time.perf_counter() - t0:.1f} s)", flush=True)
    return status


def _table(records: list) -> str:
    main = [r for r in records if r.get("kind") == "main"]
    by = {(r["mode"], tuple(r["shape"]), r["variant"]): r for r in main}
    shapes = list(dict.fromkeys(tuple(r["shape"]) for r in main))
    cols = VARIANTS
    lines = [
        "TFLOP/s (x bf16) | FP8 GEMMs | transient MiB   (bf16 inputs/weights, median of reps)",
        f"{'mode':6s} {'MxKxN':18s} " + " ".join(f"{c:>26s}" for c in cols),
    ]
    for mode in MODES:
        for shape in shapes:
            base = by.get((mode, shape, "bf16"))
            cells = []
            for c in cols:
                r = by.get((mode, shape, c))
                if r is None or "error" in r:
                    cells.append(f"{'ERR' if r else '-':>26s}")
                    continue
                sp = f"{r['tflops'] / base['tflops']:.2f}x" if base and "tflops" in base else "-"
                mib = r.get("temp_size_in_bytes", -1) / 2**20
                cells.append(f"{r['tflops']:7.1f} {sp:>6s} {r['f8_gemms']:2d} {mib:8.0f}")
            lines.append(f"{mode:6s} {'x'.join(map(str, shape)):18s} " + " ".join(cells))
    for r in (r for r in main if r["variant"] in FWD_EXTRA and "tflops" in r):
        lines.append(
            f"fwd    {'x'.join(map(str, r['shape'])):18s} {r['variant']}: {r['tflops']:.1f} TF/s, "
            f"{r['f8_gemms']} FP8 GEMMs, {r.get('temp_size_in_bytes', -1) / 2**20:.0f} MiB"
        )
    probes = [r for r in records if r.get("kind") == "probe"]
    if probes:
        lines.append("triton-gemm probe (linear fwd+bwd, fresh process each):")
        for r in probes:
            lines.append(
                f"  triton_gemm={r['triton']:5s} {r['variant']:16s} compile {r['compile_s']:6.1f} s"
                f"  {r['ms']:7.3f} ms  {r['tflops']:7.1f} TF/s  f8={r['f8_gemms']} "
                f"triton_gemms={r['triton_gemms']}"
            )
    for r in records:
        if r.get("kind") == "probe_status":
            lines.append(f"  probe {r['name']}: {r['status']}")
    return "\n".join(lines)


def driver(args) -> None:
    t_start = time.perf_counter()
    out = args.out
    records: list = []

    def save():
        return runner.write_json(out, "gemm", {"records": records})

    common = ["--out", out, "--reps", str(args.reps), "--min-rep-s", str(args.min_rep_s)]
    common += ["--max-iters", str(args.max_iters)] + (["--quick"] if args.quick else [])
    base_flags = os.environ.get("XLA_FLAGS", "")
    env = dict(os.environ)
    if TRITON_FLAG not in base_flags:  # default: the flag fp8jax is deciding whether to recommend
        env["XLA_FLAGS"] = _set_triton_flag(base_flags, "false")
    print(f"# main child XLA_FLAGS={env['XLA_FLAGS']!r}", flush=True)
    left = args.budget_s - (time.perf_counter() - t_start)
    dump = [] if args.no_dump else ["--dump-hlo"]
    _run_child(["--child", "main", *common, *dump], env, left, records, save)
    probes = [
        ("off", "fp8jax-delayed,bf16", "false"),
        ("on", "bf16", "true"),
        ("on", "fp8jax-delayed", "true"),  # last: it may need minutes (then it is killed)
    ]
    for name, variants, value in [] if args.no_probe else probes:
        left = args.budget_s - (time.perf_counter() - t_start)
        status = {"kind": "probe_status", "name": f"{name}:{variants}"}
        if left < 20:
            records.append({**status, "status": "skipped: budget"})
            continue
        penv = dict(os.environ, XLA_FLAGS=_set_triton_flag(base_flags, value))
        cap = min(left - 5, args.probe_cap_s)
        argv = ["--child", "probe", "--triton", name, "--variants", variants, *common]
        done = _run_child(argv, penv, cap, records, save)
        records.append({**status, "status": done, "timeout_s": round(cap, 1)})
        save()
    path = save()
    print("\n" + _table(records), flush=True)
    print(f"# wrote {path}; total {time.perf_counter() - t_start:.1f} s", flush=True)


def main(argv=None) -> None:
    p = runner.parser(__doc__, child=False)
    p.add_argument(
        "--quick",
        action="store_true",
        default=bool(os.environ.get("GEMM_QUICK")),
        help="tiny shapes (CPU smoke test); also env GEMM_QUICK=1",
    )
    p.add_argument("--reps", type=int, default=5, help="timed repetitions (median reported)")
    p.add_argument("--min-rep-s", type=float, default=0.03, help="min seconds per repetition")
    p.add_argument("--max-iters", type=int, default=50, help="max calls per repetition")
    p.add_argument("--budget-s", type=float, default=280.0, help="driver wall-clock budget")
    p.add_argument("--probe-cap-s", type=float, default=150.0, help="max seconds per probe")
    p.add_argument("--no-probe", action="store_true", help="skip the triton-gemm probes")
    p.add_argument("--no-dump", action="store_true", help="do not dump compiled HLO")
    p.add_argument("--child", choices=["main", "probe"], help=argparse.SUPPRESS)
    p.add_argument("--triton", default="default", help=argparse.SUPPRESS)
    p.add_argument("--variants", default="bf16", help=argparse.SUPPRESS)
    p.add_argument("--dump-hlo", action="store_true", help=argparse.SUPPRESS)
    args = runner.parse_args(p, argv)
    if args.child == "main":
        child_main(args)
    elif args.child == "probe":
        child_probe(args)
    else:
        driver(args)


if __name__ == "__main__":
    sys.exit(main())
