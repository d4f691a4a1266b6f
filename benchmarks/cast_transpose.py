"""FP8 quantize in both GEMM layouts plus amax: XLA's fusions vs fp8jax's Pallas kernel.

    PYTHONUNBUFFERED=1 python -m benchmarks.cast_transpose --out "$OUT"

For each tensor that gpt_1b3's train step quantizes (the x and dy of its linears, the f32
weights at O1), times ``fp8jax.ops.kernels.cast_transpose`` with ``impl='xla'`` and ``'pallas'``
under jit (median of ``--iters`` calls after a warm-up), checks that both give the same bits,
and reports the effective bandwidth: bytes read once plus both FP8 layouts written, over time.
``--quick`` uses small shapes (a CPU smoke test, where 'pallas' is XLA ops too).

``--sweep`` also times the kernel's tunings (block rows x columns, Triton warps and stages) on
each shape, checks each against XLA's bits, and names the fastest (on CPUs through Pallas'
interpreter: a check of the sweep, not a timing). Writes ``cast_transpose.json``.

``--rowwise`` times the rowwise recipe's cast instead, ``fp8jax.ops.block_cast.
cast_transpose_rows`` (x per row and x.T per row, with their inverse scales and amaxes), on
gpt_1b3's operands: XLA's references against the two-pass kernels (``'interpret'`` on CPUs,
so ``--quick`` checks the kernels' bits there), calls queued back to back; with ``--sweep``
the kernels' tunings, each pass timed alone too. Writes ``cast_transpose_rows.json``:

    PYTHONUNBUFFERED=1 python -m benchmarks.cast_transpose --rowwise --sweep --out "$OUT"
"""

from __future__ import annotations

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common, runner
from fp8jax.ops import block_cast, cast_source, formats, kernels, row_cast_kernels, scaling

# (name, [M, K], input dtype, format): gpt_1b3 at batch 8 x 2048 (M = 16384 tokens).
SHAPES = [
    ("x of q/kv/o/wi (bf16)", (16384, 2048), jnp.bfloat16, "e4m3"),
    ("x of mlp wo (bf16)", (16384, 8192), jnp.bfloat16, "e4m3"),
    ("dy of mlp wi (bf16)", (16384, 8192), jnp.bfloat16, "e5m2"),
    ("dy of kv (bf16)", (16384, 4096), jnp.bfloat16, "e5m2"),
    ("w of mlp wi (f32, O1)", (2048, 8192), jnp.float32, "e4m3"),
]


# (block rows, block columns, warps, stages, transpose the FP8 block instead of the f32 one);
# the kernel's default is (64, 128, 4, 1, False).
TUNINGS = [
    (bm, bk, w, 1, cast_first)
    for bm, bk in ((64, 128), (128, 64), (128, 128), (64, 256), (256, 64), (128, 256))
    for w in (4, 8)
    for cast_first in (False, True)
] + [(128, 128, 8, 2, False), (128, 128, 8, 2, True), (256, 128, 8, 1, True)]


def _same(a, b) -> bool:
    """Both FP8 layouts bit-identical and the same amax."""
    layouts = all(
        np.array_equal(common.bits(u), common.bits(v)) for u, v in zip(a[:2], b[:2], strict=True)
    )
    return bool(layouts and float(a[2]) == float(b[2]))


def sweep(x, scale, fmt, ref, moved: int, iters: int, interpret: bool, reps=20) -> list[dict]:
    """One row per tuning that fits the shape: microseconds per call (``reps`` calls in one
    program), GB/s, bits equal to ``ref``."""
    dtype = formats.as_dtype(fmt)
    rows = []
    for bm, bk, warps, stages, cast_first in TUNINGS:
        if x.shape[0] % bm or x.shape[1] % bk:
            continue
        row = {"bm": bm, "bk": bk, "warps": warps, "stages": stages, "cast_first": cast_first}

        def cast(x, s, bm=bm, bk=bk, w=warps, st=stages, cf=cast_first):
            return kernels.pallas_cast_transpose(
                x, s, dtype, bm, bk, interpret, num_warps=w, num_stages=st, cast_first=cf
            )

        try:
            loop = common.in_loop(cast, reps)  # its result is the last call's: one compile for both
            row["same_bits"] = _same(jax.device_get(loop(x, scale)), ref)
            sec = common.median_s(loop, (x, scale), iters) / reps
            row.update(us=sec * 1e6, gb_s=moved / sec / 1e9)
        except Exception as e:  # a tuning that does not compile (registers, shared memory)
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
    return rows


def measure(name, shape, dtype, fmt, iters: int, sweep_too: bool, on_gpu: bool) -> dict:
    """One tensor's row: XLA's and the kernel's time and bandwidth, same bits, the sweep."""
    reps = 20 if on_gpu else 2  # calls per in-loop program (CPU: a check, not a timing)
    x = jnp.asarray(np.random.default_rng(0).standard_normal(shape), dtype)
    scale = jnp.float32(8.0)
    moved = x.size * jnp.dtype(dtype).itemsize + 2 * x.size  # read once, two FP8 writes
    row = {"tensor": name, "shape": list(shape), "dtype": jnp.dtype(dtype).name, "fmt": fmt}
    outs = {}
    for impl in ("xla", "pallas"):
        cast = lambda x, s, impl=impl: kernels.cast_transpose(x, s, fmt, impl)  # noqa: E731
        fn = jax.jit(cast)
        try:
            outs[impl] = jax.device_get(fn(x, scale))
            sec = common.median_s(fn, (x, scale), iters)
            row[f"{impl}_us"] = sec * 1e6
            row[f"{impl}_gb_s"] = moved / sec / 1e9
            if sweep_too:  # the same without host dispatch, as the sweep times its tunings
                loop = common.in_loop(cast, reps, vary_input=impl == "xla")
                sec = common.median_s(loop, (x, scale), iters) / reps
                row[f"{impl}_loop_us"] = sec * 1e6
                row[f"{impl}_loop_gb_s"] = moved / sec / 1e9
        except Exception as e:  # a kernel that does not compile here is a result too
            row[f"{impl}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    if len(outs) == 2:
        row["same_bits"] = _same(outs["xla"], outs["pallas"])
    if sweep_too and "xla" in outs:
        sweep_iters = iters if on_gpu else 1
        row["sweep"] = sweep(x, scale, fmt, outs["xla"], moved, sweep_iters, not on_gpu, reps)
        timed = [t for t in row["sweep"] if "us" in t]
        row["best"] = min(timed, key=lambda t: t["us"]) if timed else None
    return row


def _tuning(b: dict) -> str:
    return str((b["bm"], b["bk"], b["warps"], b["stages"], b["cast_first"]))


COLUMNS = {
    "shape": lambda r: "x".join(map(str, r["shape"])),
    "xla us": lambda r: f"{r['xla_us']:.1f}",
    "GB/s": lambda r: f"{r['xla_gb_s']:.0f}",
    "pallas us": lambda r: f"{r['pallas_us']:.1f}",
    "pallas GB/s": lambda r: f"{r['pallas_gb_s']:.0f}",
    "same": lambda r: r["same_bits"],
    "error": lambda r: (r.get("xla_error") or r["pallas_error"])[:60],
}
LOOP_COLUMNS = {
    "in one program: xla us": lambda r: f"{r['xla_loop_us']:.1f}",
    "GB/s": lambda r: f"{r['xla_loop_gb_s']:.0f}",
    "pallas us": lambda r: f"{r['pallas_loop_us']:.1f}",
    "pallas GB/s": lambda r: f"{r['pallas_loop_gb_s']:.0f}",
}
BEST_COLUMNS = {
    "best (bm, bk, warps, stages, cast first)": lambda r: _tuning(r["best"]),
    "us": lambda r: f"{r['best']['us']:.1f}",
    "GB/s": lambda r: f"{r['best']['gb_s']:.0f}",
    "same": lambda r: r["best"]["same_bits"],
    "errors": lambda r: sum("error" in t for t in r["sweep"]),
}


# The rowwise recipe's operands in gpt_1b3's step (batch 8 x 2048): x and dy (E4M3, the recipe's
# default grad format) and the f32 weights at O1.
ROWWISE_SHAPES = [
    ("x of q/kv/o/wi (bf16)", (16384, 2048), jnp.bfloat16, "e4m3"),
    ("x of mlp wo, dy of wi (bf16)", (16384, 8192), jnp.bfloat16, "e4m3"),
    ("w of mlp wi (f32, O1)", (2048, 8192), jnp.float32, "e4m3"),
]
# (bm, bk, warps of the amax pass, warps of the cast pass); the kernels' default first.
ROW_TUNINGS = [
    (64, 128, 4, 4),
    (32, 128, 4, 4),
    (64, 128, 8, 8),
    (128, 64, 4, 4),
    (128, 128, 4, 4),
    (128, 128, 8, 8),
    (64, 256, 4, 8),
    (128, 256, 8, 8),
]


def _time_queued(fn, args, iters: int) -> float:
    """Seconds per call of ``iters`` calls queued back to back with one wait at the end: the
    device's time per call once dispatch runs ahead of it."""
    jax.block_until_ready(fn(*args))
    t = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / iters


def _same_rows(a, b) -> bool:
    """All of ``cast_transpose_rows``' outputs bit-identical (no NaN in the benchmark's data)."""
    return all(np.array_equal(common.bits(u), common.bits(v)) for u, v in zip(a, b, strict=True))


def sweep_rows(x, fmt, recipe, ref, moved: int, iters: int, interpret: bool) -> list[dict]:
    """One row per tuning that fits x: microseconds of both passes and of each alone, GB/s,
    bits equal to ``ref``."""
    rows = []
    ones_M, ones_K = jnp.ones(x.shape[:1], jnp.float32), jnp.ones(x.shape[1:], jnp.float32)
    for bm, bk, amax_warps, cast_warps in ROW_TUNINGS:
        if x.shape[0] % bm or x.shape[1] % bk:
            continue
        row = {"bm": bm, "bk": bk, "amax_warps": amax_warps, "cast_warps": cast_warps}
        tuning = (bm, bk, amax_warps, cast_warps)
        src = cast_source.plain
        both = jax.jit(
            lambda x, t=tuning: row_cast_kernels.pallas_cast_transpose_rows(
                src(x), fmt, recipe, interpret, t
            )
        )
        amax = jax.jit(
            lambda x, t=tuning: row_cast_kernels.pallas_row_col_amax(
                src(x), *t[:2], interpret, t[2]
            )
        )
        cast = jax.jit(
            lambda x, a, at, t=tuning: row_cast_kernels.pallas_cast_rows_cols(
                src(x), a, at, fmt, recipe, *t[:2], interpret, t[3]
            )
        )
        try:
            row["same_bits"] = _same_rows(jax.device_get(both(x)), ref)
            sec = _time_queued(both, (x,), iters)
            row.update(us=sec * 1e6, gb_s=moved / sec / 1e9)
            row["amax_us"] = _time_queued(amax, (x,), iters) * 1e6
            row["cast_us"] = _time_queued(cast, (x, ones_M, ones_K), iters) * 1e6
        except Exception as e:  # a tuning that does not compile (registers, shared memory)
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
    return rows


def measure_rows(name, shape, dtype, fmt, iters: int, sweep_too: bool, on_gpu: bool) -> dict:
    """One tensor's row of ``--rowwise``: XLA's and the kernels' time and bandwidth (bytes read
    once plus both FP8 layouts written), same bits, the sweep."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal(shape), dtype)
    recipe = scaling.RowwiseScaling()
    moved = x.size * jnp.dtype(dtype).itemsize + 2 * x.size
    row = {"tensor": name, "shape": list(shape), "dtype": jnp.dtype(dtype).name, "fmt": fmt}
    outs = {}
    # On CPUs 'pallas' is XLA's ops: the interpreter runs the kernels there instead.
    for label, impl in (("xla", "xla"), ("kernel", "pallas" if on_gpu else "interpret")):
        fn = jax.jit(lambda x, impl=impl: block_cast.cast_transpose_rows(x, fmt, recipe, impl))
        try:
            outs[label] = jax.device_get(fn(x))
            sec = _time_queued(fn, (x,), iters)
            row.update({f"{label}_us": sec * 1e6, f"{label}_gb_s": moved / sec / 1e9})
        except Exception as e:  # a kernel that does not compile here is a result too
            row[f"{label}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    if len(outs) == 2:
        row["same_bits"] = _same_rows(outs["xla"], outs["kernel"])
        row["speedup"] = row["xla_us"] / row["kernel_us"]
    if sweep_too and "xla" in outs:
        row["sweep"] = sweep_rows(x, fmt, recipe, outs["xla"], moved, iters, not on_gpu)
        timed = [t for t in row["sweep"] if "us" in t]
        row["best"] = min(timed, key=lambda t: t["us"]) if timed else None
    return row


ROW_COLUMNS = {
    "shape": lambda r: "x".join(map(str, r["shape"])),
    "dtype": lambda r: r["dtype"],
    "xla us": lambda r: f"{r['xla_us']:.1f}",
    "GB/s": lambda r: f"{r['xla_gb_s']:.0f}",
    "kernel us": lambda r: f"{r['kernel_us']:.1f}",
    "kernel GB/s": lambda r: f"{r['kernel_gb_s']:.0f}",
    "speedup": lambda r: f"{r['speedup']:.2f}x",
    "same": lambda r: r["same_bits"],
    "error": lambda r: (r.get("xla_error") or r["kernel_error"])[:60],
}
ROW_BEST_COLUMNS = {
    "best (bm, bk, amax warps, cast warps)": lambda r: str(
        tuple(r["best"][k] for k in ("bm", "bk", "amax_warps", "cast_warps"))
    ),
    "us": lambda r: f"{r['best']['us']:.1f}",
    "amax pass us": lambda r: f"{r['best']['amax_us']:.1f}",
    "cast pass us": lambda r: f"{r['best']['cast_us']:.1f}",
    "GB/s": lambda r: f"{r['best']['gb_s']:.0f}",
    "same": lambda r: r["best"]["same_bits"],
    "errors": lambda r: sum("error" in t for t in r["sweep"]),
}


def main_rows(a, on_gpu: bool) -> None:
    """``--rowwise``: the table and ``cast_transpose_rows.json``."""
    rows = []
    for name, shape, dtype, fmt in ROWWISE_SHAPES:
        if a.quick:  # sides stay multiples of the kernels' blocks
            shape = (shape[0] // 64, shape[1] // 16)
        rows.append(measure_rows(name, shape, dtype, fmt, a.iters, a.sweep, on_gpu))
        print(json.dumps(rows[-1]), flush=True)
    info = {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
    runner.write_json(a.out, "cast_transpose_rows", {**info, "rows": rows})
    print("\n" + runner.table(rows, ROW_COLUMNS, "tensor"))
    if a.sweep:
        print("\n" + runner.table(rows, ROW_BEST_COLUMNS, "tensor"))


def main(argv=None):
    p = runner.parser(__doc__, child=False)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--sweep", action="store_true", help="also time the kernel's tunings")
    p.add_argument("--rowwise", action="store_true", help="the rowwise recipe's cast instead")
    a = runner.parse_args(p, argv)
    on_gpu = jax.devices()[0].platform == "gpu"
    if a.rowwise:
        return main_rows(a, on_gpu)
    rows = []
    for name, shape, dtype, fmt in SHAPES:
        if a.quick:
            shape = (shape[0] // 128, shape[1] // 64)
        rows.append(measure(name, shape, dtype, fmt, a.iters, a.sweep, on_gpu))
        print(json.dumps(rows[-1]), flush=True)
    info = {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
    runner.write_json(a.out, "cast_transpose", {**info, "rows": rows})
    print("\n" + runner.table(rows, COLUMNS, "tensor"))
    if a.sweep:
        print("\n" + runner.table(rows, LOOP_COLUMNS, "tensor"))
        print("\n" + runner.table(rows, BEST_COLUMNS, "tensor"))


if __name__ == "__main__":
    sys.exit(main())
