"""The block-scaled FP8 GEMM (``fp8jax.ops.block_gemm``) against cuBLASLt's FP8 and bf16 GEMMs.

    XLA_FLAGS=--xla_gpu_enable_triton_gemm=false PYTHONUNBUFFERED=1 \\
        python -m benchmarks.block_gemm --out "$OUT"

For each shape M x K x N of a linear layer y[M, N] = x[M, K] w[K, N], the three GEMMs of its
training step, each in the "NT" layout the FP8 tensor cores take (contraction innermost):

* ``fwd``   y = x . w:       a = x [M, K] (1 x 128 tiles), b = w^T [N, K] (128 x 128 blocks)
* ``dgrad`` dx = dy . w^T:   a = dy [M, N] (1 x 128 tiles), b = w [K, N] (blocks); contraction N
* ``wgrad`` dw = x^T . dy:   a = x^T [K, M], b = dy^T [N, M], both 1 x 128 tiles along M

Columns: cuBLASLt's own block-scaled GEMM's TFLOP/s (``ops.cublaslt.block_dot``, the kernel
CUDA runs where it is available), the Mosaic GPU kernel's
(``block_gemm.mosaic_block_scaled_dot``, the kernel CUDA runs for whole tiles otherwise: the best
of ``MOSAIC_SWEEP``, the layout's default tuning first),
the Triton kernel's (its default tuning; ``--triton-sweep``: the best of a sweep, the whole
sweep on the first GEMM, its fastest ``--keep`` tunings on the others), cuBLASLt's tensorwise
FP8 GEMM (``lax.dot_general`` of the same FP8 operands, bf16 out: ``__cublas$lt$matmul$f8``,
counted in the compiled HLO), bf16 (the same GEMM on bf16 operands) and Mosaic / bf16. Timing:
jit, warm-up, ``block_until_ready``, median of ``--reps`` repetitions; FLOPs = 2 M N K. A check
runs ``block_scaled_dot`` (the Mosaic kernel on a GPU) and the Triton kernel against the
reference (``impl='xla'``) on ``CHECK`` in f32 and reports the largest difference relative to
the largest output. ``--quick``: tiny shapes, the Triton kernel in
Pallas' interpreter (a CPU smoke test, not a timing). Writes ``block_gemm.json``.
"""

from __future__ import annotations

import itertools
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common, runner
from fp8jax.ops import block_gemm, block_gemm_mgpu, cublaslt

SHAPES = [(8192, 8192, 8192), (16384, 4096, 16384), (16384, 16384, 4096)]  # M x K x N
QUICK_SHAPES = [(64, 256, 160)]
LAYOUTS = ("fwd", "dgrad", "wgrad")
# (bm, bn, num_warps, num_stages, prefetch, fast_acc): the grid of tunings, then a few around
# the kernel's default (smaller tiles leave room for two programs per SM, whose dots and
# rescales overlap), and the default without fast accumulation (Triton promoting after every
# WGMMA instruction) for comparison.
SWEEP = [(*c, True, True) for c in itertools.product((64, 128), (128, 256), (4, 8), (3, 4))] + [
    (64, 128, 4, 4, False, True),
    (64, 128, 4, 2, True, True),
    (64, 64, 4, 4, True, True),
    (128, 64, 4, 4, True, True),
    (128, 128, 4, 2, True, True),
    (64, 256, 4, 2, True, True),
    (128, 64, 4, 4, True, False),
    (128, 128, 8, 4, True, False),
]
QUICK_SWEEP = [(64, 128, 4, 3, True, True), (128, 128, 8, 4, False, False)]
TRITON_DEFAULT = (
    block_gemm.BM,
    block_gemm.BN,
    block_gemm.WARPS,
    block_gemm.STAGES,
    block_gemm.PREFETCH,
    True,
)
_T = block_gemm_mgpu.Tuning
# The Mosaic kernel's tunings: CTAs of 128 x 128 (two 64-row warpgroups) and 128 x 256 or
# 256 x 128 (two 128 x 128 warpgroups), with and without two-CTA clusters sharing an operand.
MOSAIC_SWEEP = [
    block_gemm_mgpu.BLOCKS,
    block_gemm_mgpu.ROWS,
    _T(tile_m=128, wg_dim="m", stages=3, cluster="n", grid_width=16),
    _T(tile_m=128, wg_dim="n", stages=3, cluster="m", grid_width=16),
]
KEYS = ("bm", "bn", "warps", "stages", "prefetch", "fast_acc")
CHECK = (2048, 4096, 2048)  # M x K x N of the kernel-vs-reference check
F8_GEMM, TRITON = "__cublas$lt$matmul$f8", "__gpu$xla.gpu.triton"
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


def gemm_dims(layout: str, shape) -> tuple[int, int, int]:
    """(rows of a, rows of b, contraction) of one of a training step's GEMMs."""
    m, k, n = shape
    return {"fwd": (m, n, k), "dgrad": (m, k, n), "wgrad": (k, n, m)}[layout]


def operands(layout: str, shape, b_fmt=E4M3, seed=0):
    """FP8 ``(a, a_inv, b, b_inv)`` of a layout: random values, multipliers in [2**-4, 2**4)."""
    rows, cols, c = gemm_dims(layout, shape)
    block = block_gemm.BLOCK
    t = -(-c // block)
    ka, kb, ks, kt = jax.random.split(jax.random.PRNGKey(seed), 4)
    # E4M3 operand (a; b unless b_fmt says otherwise): N(0, 1) * 16 uses most of its range.
    a = (jax.random.normal(ka, (rows, c), jnp.float32) * 16).astype(E4M3)
    b = (jax.random.normal(kb, (cols, c), jnp.float32) * 16).astype(b_fmt)
    b_rows = cols if layout == "wgrad" else -(-cols // block)  # per row, or 128 x 128 blocks
    inv = lambda k, s: jnp.exp2(jax.random.uniform(k, s, jnp.float32, -4, 4))  # noqa: E731
    return a, inv(ks, (rows, t)), b, inv(kt, (b_rows, t))


def _time(fn, args, a) -> float:
    return common.time_calls(fn, args, a.reps, a.min_rep_s, a.max_iters)[0]


def _count(fn, args, target: str) -> int:
    return fn.lower(*args).compile().as_text().count(target)


def kernel_fn(tuning, interpret: bool):
    """The jitted kernel with one tuning (bm, bn, num_warps, num_stages, prefetch, fast_acc),
    bf16 out."""
    bm, bn, warps, stages, prefetch, fast_acc = tuning
    tune = dict(bm=bm, bn=bn, num_warps=warps, num_stages=stages, prefetch=prefetch)
    tune["fast_acc"] = fast_acc
    return jax.jit(
        lambda a, ai, b, bi: block_gemm.pallas_block_scaled_dot(
            a, ai, b, bi, **tune, interpret=interpret
        )
    )


def sweep(args, tunings, a, interpret: bool) -> list[dict]:
    """Seconds per call of each tuning (a tuning that fails to compile keeps its error)."""
    rows = []
    for tuning in tunings:
        row = dict(zip(KEYS, tuning, strict=True))
        try:
            row["s"] = _time(kernel_fn(tuning, interpret), args, a)
        except Exception as e:  # registers or shared memory: a result of the sweep too
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
    return rows


def mosaic_sweep(layout: str, args, a) -> list[dict]:
    """Seconds per call of the Mosaic kernel under each tuning, the layout's default first."""
    default = block_gemm_mgpu.BLOCKS if layout != "wgrad" else block_gemm_mgpu.ROWS
    tunings = [default] + [t for t in MOSAIC_SWEEP if t != default]
    rows = []
    for tuning in tunings:
        row = {"tuning": str(tuning).removeprefix("Tuning")}
        fn = jax.jit(lambda *x, t=tuning: block_gemm.mosaic_block_scaled_dot(*x, tuning=t))
        try:
            row["s"] = _time(fn, args, a)
        except Exception as e:  # shared memory or a shape it does not tile: a result too
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
    return rows


def measure(layout: str, shape, tunings, a, interpret: bool) -> dict:
    """One GEMM's row: each kernel's best tuning, cuBLASLt FP8, bf16 (TFLOP/s) and the ratio."""
    rows, cols, c = gemm_dims(layout, shape)
    flop = 2 * rows * cols * c
    args = operands(layout, shape)
    rec = {"gemm": f"{layout} {'x'.join(map(str, shape))}", "layout": layout}
    rec.update(shape=list(shape), dims=[rows, cols, c])
    if not interpret and cublaslt.available():
        lt = jax.jit(lambda *x: cublaslt.block_dot(*x, layout != "wgrad", jnp.bfloat16))
        rec["cublaslt_tflops"] = flop / _time(lt, args, a) / 1e12
    if not interpret:
        rec["mosaic_sweep"] = mosaic_sweep(layout, args, a)
        timed = [r for r in rec["mosaic_sweep"] if "s" in r]
        if timed:
            best = min(timed, key=lambda r: r["s"])
            rec["mosaic_best"], rec["mosaic_tflops"] = best["tuning"], flop / best["s"] / 1e12
            rec["mosaic_default_tflops"] = flop / rec["mosaic_sweep"][0].get("s", math.inf) / 1e12
    t0 = time.perf_counter()
    rec["sweep"] = sweep(args, tunings, a, interpret)
    rec["sweep_s"] = time.perf_counter() - t0
    timed = [r for r in rec["sweep"] if "s" in r]
    if timed:
        best = min(timed, key=lambda r: r["s"])
        rec["best"] = {k: best[k] for k in KEYS}
        rec["block_tflops"] = flop / best["s"] / 1e12
        best_fn = kernel_fn(tuple(rec["best"].values()), interpret)
        rec["triton_calls"] = _count(best_fn, args, TRITON)
    q_a, _, q_b, _ = args
    nt = (((1,), (1,)), ((), ()))
    f8 = jax.jit(lambda x, y: jax.lax.dot_general(x, y, nt, preferred_element_type=jnp.bfloat16))
    rec["f8_gemms"] = _count(f8, (q_a, q_b), F8_GEMM)
    rec["cublas_f8_tflops"] = flop / _time(f8, (q_a, q_b), a) / 1e12
    bf = (q_a.astype(jnp.bfloat16), q_b.astype(jnp.bfloat16))
    bf16 = jax.jit(lambda x, y: jax.lax.dot_general(x, y, nt))
    rec["bf16_tflops"] = flop / _time(bf16, bf, a) / 1e12
    if "block_tflops" in rec:
        rec["block_over_bf16"] = rec["block_tflops"] / rec["bf16_tflops"]
    for kernel in ("mosaic", "cublaslt"):
        if f"{kernel}_tflops" in rec:
            rec[f"{kernel}_over_bf16"] = rec[f"{kernel}_tflops"] / rec["bf16_tflops"]
    return rec


def _f64(a, a_inv, b, b_inv) -> np.ndarray:
    """a . b^T of the dequantized operands in f64 on the host."""
    block, k, n = block_gemm.BLOCK, a.shape[1], b.shape[0]
    a_inv, b_inv = np.asarray(a_inv, np.float64), np.asarray(b_inv, np.float64)
    b_full = np.repeat(b_inv, block, 1)[:, :k]
    if b_inv.shape[0] != n:  # block x block tiles
        b_full = np.repeat(b_full, block, 0)[:n]
    a64 = np.asarray(a.astype(jnp.float32), np.float64) * np.repeat(a_inv, block, 1)[:, :k]
    return a64 @ (np.asarray(b.astype(jnp.float32), np.float64) * b_full).T


CHECK_CASES = (("fwd", E4M3), ("wgrad", E4M3), ("dgrad", E5M2))  # (layout, b's format)


def check(shape, interpret: bool, cases=CHECK_CASES) -> list[dict]:
    """The default kernel against the reference, f32 out: max |difference| / max |reference|;
    and each against the f64 product of the dequantized operands (host), the same way."""
    out = []
    for layout, b_fmt in cases:
        args = operands(layout, shape, b_fmt, seed=1)
        impl = "interpret" if interpret else "pallas"
        run = lambda impl: jax.jit(  # noqa: E731
            lambda *x: block_gemm.block_scaled_dot(*x, out_dtype=jnp.float32, impl=impl)
        )(*args)
        triton = jax.jit(
            lambda *x: block_gemm.pallas_block_scaled_dot(
                *x, out_dtype=jnp.float32, interpret=interpret
            )
        )
        row = {"layout": layout, "b": jnp.dtype(b_fmt).name}
        dims, dtypes = gemm_dims(layout, shape), (E4M3, b_fmt, jnp.float32)
        row["kernel"] = block_gemm.kernel_for(*dims, 128, layout != "wgrad", dtypes)
        try:
            y, ref = np.asarray(run(impl), np.float64), np.asarray(run("xla"), np.float64)
            tri = np.asarray(triton(*args), np.float64)
            row["max_rel_diff"] = float(np.max(np.abs(y - ref)) / np.max(np.abs(ref)))
            exact = _f64(*args)
            others = [("kernel", y), ("triton", tri), ("reference", ref)]
            if row["kernel"] == "cublaslt":  # the kernel it stands in front of, the same way
                mosaic = jax.jit(
                    lambda *x: block_gemm.mosaic_block_scaled_dot(*x, out_dtype=jnp.float32)
                )
                others.append(("mosaic", np.asarray(mosaic(*args), np.float64)))
            for name, v in others:
                row[f"{name}_vs_f64"] = float(np.max(np.abs(v - exact)) / np.max(np.abs(exact)))
        except Exception as e:  # a kernel that does not compile is this check's result
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        out.append(row)
    return out


COLUMNS = {
    "cuBLASLt block TF/s": lambda r: (
        f"{r['cublaslt_tflops']:.0f}" if "cublaslt_tflops" in r else "-"
    ),
    "mosaic TF/s": lambda r: f"{r['mosaic_tflops']:.0f}" if "mosaic_tflops" in r else "-",
    "mosaic best": lambda r: r.get("mosaic_best", "-"),
    "triton TF/s": lambda r: f"{r['block_tflops']:.0f}",
    "triton (bm, bn, warps, stages, prefetch, fast_acc)": lambda r: str(tuple(r["best"].values())),
    "cuBLASLt f8 TF/s": lambda r: f"{r['cublas_f8_tflops']:.0f}",
    "f8 gemms": lambda r: r["f8_gemms"],
    "bf16 TF/s": lambda r: f"{r['bf16_tflops']:.0f}",
    "mosaic/bf16": lambda r: f"{r['mosaic_over_bf16']:.2f}" if "mosaic_over_bf16" in r else "-",
    "cuBLASLt/bf16": lambda r: (
        f"{r['cublaslt_over_bf16']:.2f}" if "cublaslt_over_bf16" in r else "-"
    ),
}


SWEEP_COLUMNS = {
    "bn": lambda r: r["bn"],
    "warps": lambda r: r["warps"],
    "stages": lambda r: r["stages"],
    "prefetch": lambda r: r["prefetch"],
    "fast_acc": lambda r: r["fast_acc"],
    "ms": lambda r: f"{r['s'] * 1e3:.3f}",
}


def main(argv=None):
    p = runner.parser(__doc__, child=False)
    p.add_argument("--quick", action="store_true", help="tiny shapes, interpreter (CPU)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions (median reported)")
    p.add_argument("--min-rep-s", type=float, default=0.05, help="min seconds per repetition")
    p.add_argument("--max-iters", type=int, default=50, help="max calls per repetition")
    p.add_argument("--keep", type=int, default=4, help="tunings of the first sweep kept")
    p.add_argument("--triton-sweep", action="store_true", help="sweep the Triton kernel's tuning")
    a = runner.parse_args(p, argv)
    interpret = a.quick or jax.devices()[0].platform != "gpu"
    if a.quick:
        a.reps, a.min_rep_s, a.max_iters = 1, 0.0, 1
    shapes, tunings = (QUICK_SHAPES, QUICK_SWEEP) if a.quick else (SHAPES, SWEEP)
    if not a.quick and not a.triton_sweep:
        tunings = [TRITON_DEFAULT]
    info = {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
    rows: list[dict] = []
    data = {**info, "rows": rows}
    for shape, layout in itertools.product(shapes, LAYOUTS):
        rows.append(measure(layout, shape, tunings, a, interpret))
        if len(rows) == 1:  # the first GEMM's fastest tunings serve the others
            print(runner.table(rows[0]["sweep"], SWEEP_COLUMNS, "bm"), flush=True)
            timed = sorted((r for r in rows[0]["sweep"] if "s" in r), key=lambda r: r["s"])
            tunings = [tuple(r[k] for k in KEYS) for r in timed[: a.keep]]
        print(runner.table(rows[-1:], COLUMNS, "gemm").splitlines()[1], flush=True)
        runner.write_json(a.out, "block_gemm", data)
    data["check"] = {"shape": list(QUICK_SHAPES[0] if a.quick else CHECK)}
    data["check"]["results"] = check(data["check"]["shape"], interpret)
    path = runner.write_json(a.out, "block_gemm", data)
    print("\n" + runner.table(rows, COLUMNS, "gemm"))
    print(f"kernel vs reference {data['check']}")
    print(f"# wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
