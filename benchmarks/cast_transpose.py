"""FP8 quantize in both GEMM layouts plus amax: XLA's fusions vs fp8jax's Pallas kernel.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/cast_transpose.py --out "$OUT"

For each tensor that gpt_1b3's train step quantizes (the x and dy of its linears, the f32
weights at O1), times ``fp8jax.ops.kernels.cast_transpose`` with ``impl='xla'`` and ``'pallas'``
under jit (median of ``--iters`` calls after a warm-up), checks that both give the same bits,
and reports the effective bandwidth: bytes read once plus both FP8 layouts written, over time.
``--quick`` uses small shapes (a CPU smoke test, where 'pallas' is XLA ops too).

``--sweep`` also times the kernel's tunings (block rows x columns, Triton warps and stages) on
each shape, checks each against XLA's bits, and names the fastest (on CPUs through Pallas'
interpreter: a check of the sweep, not a timing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax.ops import formats, kernels

# (name, [M, K], input dtype, format): gpt_1b3 at batch 8 x 2048 (M = 16384 tokens).
SHAPES = [
    ("x of q/kv/o/wi (bf16)", (16384, 2048), jnp.bfloat16, "e4m3"),
    ("x of mlp wo (bf16)", (16384, 8192), jnp.bfloat16, "e4m3"),
    ("dy of mlp wi (bf16)", (16384, 8192), jnp.bfloat16, "e5m2"),
    ("dy of kv (bf16)", (16384, 4096), jnp.bfloat16, "e5m2"),
    ("w of mlp wi (f32, O1)", (2048, 8192), jnp.float32, "e4m3"),
]


def _time(fn, args, iters: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _in_loop(cast, reps: int, vary_input: bool = False):
    """``cast`` called ``reps`` times inside one program, each call depending on the last (a
    per-call timing from it has no host dispatch in it, unlike ``_time`` of one call).

    ``vary_input`` multiplies x by a sign that is always +1 but not provably so. XLA's cast
    needs it: its amax depends on x alone, so XLA hoists that reduction out of the loop
    (seen in the CPU's HLO) and the loop would time the cast without it. The multiply fuses
    into XLA's cast and amax; the Pallas kernel's amax depends on the scale and is not
    hoisted, and an extra op before it would be an extra pass, so it runs without.
    """

    def many(x, s):
        def body(_, carry):
            ok = carry[2] >= 0
            s_i = jnp.where(ok, s, -s)  # always s, but not provably: no hoisting
            x_i = x * jnp.where(ok, 1, -1).astype(x.dtype) if vary_input else x
            return cast(x_i, s_i)

        q, qt, amax = jax.eval_shape(cast, x, s)
        zeros = tuple(jnp.zeros(a.shape, a.dtype) for a in (q, qt, amax))
        return jax.lax.fori_loop(0, reps, body, zeros)

    return jax.jit(many)


# (block rows, block columns, warps, stages, transpose the FP8 block instead of the f32 one);
# the kernel's default is (64, 128, 4, 1, False) (before 2026-11-30: (128, 128, 8, 1, False)).
TUNINGS = [
    (bm, bk, w, 1, cast_first)
    for bm, bk in ((64, 128), (128, 64), (128, 128), (64, 256), (256, 64), (128, 256))
    for w in (4, 8)
    for cast_first in (False, True)
] + [(128, 128, 8, 2, False), (128, 128, 8, 2, True), (256, 128, 8, 1, True)]


def _same(a, b) -> bool:
    """Both FP8 layouts bit-identical and the same amax."""
    bits = lambda t: np.asarray(jax.lax.bitcast_convert_type(t, jnp.uint8))  # noqa: E731
    layouts = all(np.array_equal(bits(u), bits(v)) for u, v in zip(a[:2], b[:2], strict=True))
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
            return kernels._pallas(
                x, s, dtype, bm, bk, interpret, num_warps=w, num_stages=st, cast_first=cf
            )

        try:
            loop = _in_loop(cast, reps)  # its result is the last call's: one compile for both
            row["same_bits"] = _same(jax.device_get(loop(x, scale)), ref)
            sec = _time(loop, (x, scale), iters) / reps
            row.update(us=sec * 1e6, gb_s=moved / sec / 1e9)
        except Exception as e:  # a tuning that does not compile (registers, shared memory)
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    p.add_argument("--sweep", action="store_true", help="also time the kernel's tunings")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)  # a fresh $OUT subfolder is fine
    on_gpu = jax.devices()[0].platform == "gpu"
    reps = 20 if on_gpu else 2  # calls per in-loop program (CPU: a check, not a timing)
    rows = []
    for name, shape, dtype, fmt in SHAPES:
        if a.quick:
            shape = (shape[0] // 128, shape[1] // 64)
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
                sec = _time(fn, (x, scale), a.iters)
                row[f"{impl}_us"] = sec * 1e6
                row[f"{impl}_gb_s"] = moved / sec / 1e9
                if a.sweep:  # the same without host dispatch, as the sweep times its tunings
                    loop = _in_loop(cast, reps, vary_input=impl == "xla")
                    sec = _time(loop, (x, scale), a.iters) / reps
                    row[f"{impl}_loop_us"] = sec * 1e6
                    row[f"{impl}_loop_gb_s"] = moved / sec / 1e9
            except Exception as e:  # a kernel that does not compile here is a result too
                row[f"{impl}_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        if len(outs) == 2:
            row["same_bits"] = _same(outs["xla"], outs["pallas"])
        if a.sweep and "xla" in outs:
            iters = a.iters if on_gpu else 1
            row["sweep"] = sweep(x, scale, fmt, outs["xla"], moved, iters, not on_gpu, reps)
            timed = [t for t in row["sweep"] if "us" in t]
            row["best"] = min(timed, key=lambda t: t["us"]) if timed else None
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(os.path.join(a.out, "cast_transpose.json"), "w") as f:
        json.dump(
            {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows},
            f,
            indent=1,
        )
    print(
        f"\n{'tensor':24} {'shape':>13} {'xla us':>8} {'GB/s':>6} {'pallas us':>9} {'GB/s':>6} same"
    )
    for r in rows:
        shape = "x".join(map(str, r["shape"]))
        if "pallas_us" not in r or "xla_us" not in r:
            err = r.get("pallas_error", r.get("xla_error", "?"))
            print(f"{r['tensor']:24} {shape:>13} ERROR {err[:80]}")
            continue
        print(
            f"{r['tensor']:24} {shape:>13} {r['xla_us']:8.1f} {r['xla_gb_s']:6.0f} "
            f"{r['pallas_us']:9.1f} {r['pallas_gb_s']:6.0f} {r['same_bits']}"
        )
    if a.sweep:
        print(f"\n{'tensor':24} in one program: xla us  GB/s  pallas us  GB/s")
        for r in rows:
            if "pallas_loop_us" in r and "xla_loop_us" in r:
                print(
                    f"{r['tensor']:24} {r['xla_loop_us']:22.1f} {r['xla_loop_gb_s']:5.0f} "
                    f"{r['pallas_loop_us']:10.1f} {r['pallas_loop_gb_s']:5.0f}"
                )
        print(f"\n{'tensor':24} best (bm, bk, warps, stages, cast first)  us   GB/s  same  errors")
        for r in rows:
            b, errors = r.get("best"), sum("error" in t for t in r.get("sweep", []))
            if b:
                tuning = (b["bm"], b["bk"], b["warps"], b["stages"], b["cast_first"])
                print(
                    f"{r['tensor']:24} {str(tuning):34} {b['us']:7.1f} {b['gb_s']:6.0f} "
                    f"{str(b['same_bits']):5} {errors}"
                )


if __name__ == "__main__":
    main()
