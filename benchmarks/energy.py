"""Energy per step of the pieces of a gpt_1b3 train step, under the GPU's power cap.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/energy.py --out "$OUT"

An H200 runs an O0 or O1 step at its 700 W software cap (benchmarks/RESULTS.md, 2026-11-30,
eighth), so a step takes about its energy over 700 W, and O1/O0 in time is about O1/O0 in
joules. This script runs, apart, the linear layers' work of one gpt_1b3 step (24 layers; the
qkv, o, wi and wo linears; M = 16384 tokens) and reports ms, mean W, SM clock and joules per
step for each:

* ``gemm_bf16``: the 288 bf16 GEMMs (forward, dgrad, wgrad) of O0's linears;
* ``gemm_fp8``: the same 288 GEMMs on FP8 operands (E4M3 x E4M3, E5M2 x E4M3, E4M3 x E5M2);
* ``casts``: O1's FP8 cast kernels (``fp8jax.ops.kernels``): per layer four activations (wo's
  with the GELU and wi's unscale and bias), four f32 weights, three output gradients and the
  GELU' + E5M2 cast of wi's;
* ``gemm_fp8+casts``: both in one program.

Each program chains its layers through ``optimization_barrier`` so XLA neither merges nor
hoists them. The difference between a whole step's joules (``benchmarks/step.py``, J/step)
and a piece's bounds what that piece can still give. ``--quick`` runs tiny shapes (CPU check).

``--step gpt_1b3:O1 --extra-gb 6.5,13,26`` asks the converse: what a memory-bound pass of that
many GB costs when it runs after each train step, against the pass alone (``step_with_pass``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax.ops import kernels

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import step as step_bench  # noqa: E402  (a script beside this one, as kernel_profile.py does)

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
DIMS = {"m": 16384, "d": 2048, "f": 8192, "qkv": 6144, "layers": 24}
QUICK = {"m": 64, "d": 32, "f": 64, "qkv": 48, "layers": 2}


def _linears(s):
    """(name, K, N) of one block's linears."""
    return [("qkv", s["d"], s["qkv"]), ("o", s["d"], s["d"]), ("wi", s["d"], s["f"]),
            ("wo", s["f"], s["d"])]  # fmt: skip


def _mm(a, b, out):
    # Both operands with the contracting axis innermost, as fp8jax hands them to cuBLASLt.
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=out)


def _operands(s, fp8: bool):
    """Per linear: x [M, K], x.T [K, M], w.T [N, K], w [K, N]... in the GEMMs' layouts."""
    rng = np.random.default_rng(0)
    m, ops = s["m"], {}

    def arr(shape, dtype, std=1.0):
        return jnp.asarray(rng.standard_normal(shape, np.float32) * std, jnp.bfloat16).astype(dtype)

    fx, fg = (E4M3, E5M2) if fp8 else (jnp.bfloat16, jnp.bfloat16)
    for name, k, n in _linears(s):
        ops[name] = dict(
            x=arr((m, k), fx, 8), x_t=arr((k, m), fx, 8), w_t=arr((n, k), fx, 8),
            w=arr((k, n), fx, 8), g=arr((m, n), fg, 4), g_t=arr((n, m), fg, 4),
        )  # fmt: skip
    return ops


def gemms(s, fp8: bool):
    """One step's linear GEMMs: per layer and linear, forward, dgrad and wgrad."""
    ops = _operands(s, fp8)

    def step(ops):
        tok = jnp.zeros((), jnp.float32)
        for _ in range(s["layers"]):
            for name, _, _ in _linears(s):
                o = jax.lax.optimization_barrier((ops[name], tok))[0]  # no CSE, no hoisting
                y = _mm(o["x"], o["w_t"], jnp.bfloat16)  # [M, N] forward
                dx = _mm(o["g"], o["w"], jnp.bfloat16)  # [M, K] dgrad
                dw = _mm(o["x_t"], o["g_t"], jnp.bfloat16)  # [K, N] wgrad
                tok = tok + (y[0, 0] + dx[0, 0] + dw[0, 0]).astype(jnp.float32)
        return tok

    return jax.jit(step), (ops,)


def casts(s, impl: str):
    """One step's O1 cast kernels (fused MLP, delayed scaling)."""
    rng = np.random.default_rng(1)
    m, d, f = s["m"], s["d"], s["f"]
    bf = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32), jnp.bfloat16)  # noqa: E731
    xs = {"d": bf(m, d), "f": bf(m, f), "qkv": bf(m, s["qkv"])}
    ws = [jnp.asarray(rng.standard_normal((k, n), np.float32) * 0.02) for _, k, n in _linears(s)]
    bias = jnp.zeros((f,), jnp.float32)
    hist = jnp.zeros((16,), jnp.float32)

    def step(xs, ws, bias, hist):
        tok = jnp.zeros((), jnp.float32)
        for _ in range(s["layers"]):
            xs_l, ws_l, _ = jax.lax.optimization_barrier((xs, ws, tok))
            # Distinct scales: XLA would merge identical calls on the same input into one.
            outs = [
                kernels.cast_transpose(xs_l["d"], 2.0, "e4m3", impl, pending=hist),  # qkv x
                kernels.cast_transpose(xs_l["d"], 2.5, "e4m3", impl, pending=hist),  # o x
                kernels.cast_transpose(xs_l["d"], 3.0, "e4m3", impl, pending=hist),  # wi x
                kernels.cast_transpose(  # wo x: GELU(h_raw * inv + b)
                    xs_l["f"], 2.0, "e4m3", impl, "gelu_tanh", hist, (jnp.float32(0.5), bias)
                ),
                *[kernels.cast_transpose(w, 64.0, "e4m3", impl, pending=hist) for w in ws_l],
                kernels.cast_transpose(xs_l["qkv"], 1e3, "e5m2", impl, pending=hist),  # qkv dy
                kernels.cast_transpose(xs_l["d"], 1e3, "e5m2", impl, pending=hist),  # o dy
                kernels.cast_transpose(xs_l["d"], 2e3, "e5m2", impl, pending=hist),  # wo dy
            ]
            g = kernels.act_grad_cast_transpose(  # wi dy: GELU' and E5M2
                xs_l["f"], xs_l["f"], 0.5, 1e3, "e5m2", impl, pending=hist,
                affine=(jnp.float32(0.5), bias),
            )  # fmt: skip
            for q in [*outs, g]:
                tok = tok + q[0][0, 0].astype(jnp.float32) + q[1][0, 0].astype(jnp.float32)
        return tok

    return jax.jit(step), (xs, ws, bias, hist)


def both(s, impl: str):
    """The FP8 GEMMs and the casts in one program."""
    g, g_args = gemms(s, True)
    c, c_args = casts(s, impl)
    return jax.jit(lambda a, b: g(*a) + c(*b)), (g_args, c_args)


def measure(fn, args, seconds: float) -> dict:
    """ms per call (calls back to back), the GPU's W, MHz and joules per call, and the
    compiled program's FP8 GEMMs and Triton kernels (proof that no layer was merged away)."""
    text = fn.lower(*args).compile().as_text()
    counts = {k: text.count(v) for k, v in (("f8_gemms", "__cublas$lt$matmul$f8"),
                                            ("triton", "__gpu$xla.gpu.triton"))}  # fmt: skip
    jax.block_until_ready(fn(*args))  # compile and warm up
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    n = max(3, int(seconds / max(time.perf_counter() - t, 1e-4)))
    return {**_timed(lambda: fn(*args), n), "calls": n, **counts}


def _timed(call, n: int) -> dict:
    """``call()`` ``n`` times back to back, one wait at the end: ms per call, and the GPU's
    power over them (``step.py``'s sampler; None without nvidia-smi)."""
    with step_bench._GpuPower() as power:
        t = time.perf_counter()
        out = None
        for _ in range(n):
            out = call()
        jax.block_until_ready(out)
        ms = (time.perf_counter() - t) * 1e3 / n
    return {"ms": ms, "power": power.summary(ms)}


def step_with_pass(run: str, gbs, steps: int, quick: bool = False) -> dict:
    """What ``gb`` GB more memory traffic per step costs a whole train step, for each of ``gbs``.

    Times, pipelined, ``steps`` train steps of ``run`` (``step.py``'s run strings); then per
    size as many calls of a pass that reads and writes a bf16 buffer of ``gb`` GB in all, both
    interleaved, and the steps alone again (drift). Alone, the pass runs at full clock; after
    each step, under the power cap (on an H200), its cost is ``with_pass - step``.
    """
    c, env, state, batch = step_bench.build(run, quick)
    compiled = env["train_step"].lower(state, batch).compile()
    bump = jax.jit(jnp.negative, donate_argnums=0)  # nothing XLA can fold away

    live = {}  # the pass's buffer: each call donates it and gets the next one

    def timed(do_step: bool, do_pass: bool):
        def call():
            nonlocal state
            if do_step:
                state, _ = compiled(state, batch)
            if do_pass:
                live["buf"] = bump(live["buf"])
            return state, live.get("buf")

        return _timed(call, steps)

    out = {"run": run, "steps": steps, "step": None, "passes": []}
    for gb in gbs:
        live["buf"] = jnp.ones((max(1, int(gb * 1e9 / 4)),), jnp.bfloat16)  # read + write: gb
        timed(True, True)  # warm-up: both programs compiled and run once
        out["step"] = out["step"] or timed(True, False)
        row = {"gb": gb, "pass": timed(False, True), "with_pass": timed(True, True)}
        row["step_after"] = timed(True, False)
        row["cost_ms"] = row["with_pass"]["ms"] - (out["step"]["ms"] + row["step_after"]["ms"]) / 2
        out["passes"].append(row)
        del live["buf"]
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--seconds", type=float, default=4.0, help="timed seconds per piece")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    p.add_argument("--pieces", default="", help="comma-separated subset (default: all)")
    p.add_argument("--step", default="", help="a step.py run, e.g. gpt_1b3:O1: time it with "
                   "and without --extra-gb of memory traffic per step instead")  # fmt: skip
    p.add_argument("--extra-gb", default="13", help="GB read+written by the pass (a,b,...)")
    p.add_argument("--steps", type=int, default=16)
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if a.step:
        gbs = [float(g) for g in a.extra_gb.split(",")]
        rec = step_with_pass(a.step, gbs, a.steps, quick=a.quick)
        with open(os.path.join(a.out, "step_with_pass.json"), "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, **rec}, f, indent=1)
        print(f"\n{a.step}: {'':30} {'ms':>8} {'W':>6} {'MHz':>6} {'cost ms':>8} {'ms/GB':>6}")
        rows = [("step", rec["step"], None, None)]
        for r in rec["passes"]:
            g, per = r["gb"], r["cost_ms"] / r["gb"]
            rows += [(f"{g:g} GB pass alone", r["pass"], None, None),
                     (f"step + {g:g} GB pass", r["with_pass"], r["cost_ms"], per),
                     ("step again", r["step_after"], None, None)]  # fmt: skip
        for name, t, cost, per in rows:
            pw = t["power"] or {}
            w, mhz = pw.get("watts", float("nan")), pw.get("sm_mhz", float("nan"))
            extra = f" {cost:8.2f} {per:6.3f}" if cost is not None else ""
            print(f"{name:40} {t['ms']:8.2f} {w:6.0f} {mhz:6.0f}{extra}")
        return
    on_gpu = jax.devices()[0].platform == "gpu"
    s = QUICK if a.quick or not on_gpu else DIMS
    impl = "pallas" if on_gpu else "interpret"
    pieces = {
        "gemm_bf16": lambda: gemms(s, False),
        "gemm_fp8": lambda: gemms(s, True),
        "casts": lambda: casts(s, impl),
        "gemm_fp8+casts": lambda: both(s, impl),
    }
    if a.pieces:
        unknown = set(a.pieces.split(",")) - set(pieces)
        if unknown:
            raise SystemExit(f"unknown --pieces {sorted(unknown)}: use some of {list(pieces)}")
        pieces = {k: v for k, v in pieces.items() if k in a.pieces.split(",")}
    rows = {}
    for name, build in pieces.items():
        fn, args = build()
        rows[name] = measure(fn, args, a.seconds if on_gpu else 0.0)
        print(name, json.dumps(rows[name]), flush=True)
    with open(os.path.join(a.out, "energy.json"), "w") as f:
        json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "dims": s,
                   "rows": rows}, f, indent=1)  # fmt: skip
    print(f"\n{'piece':16} {'ms':>8} {'W':>6} {'MHz':>6} {'J/step':>7}")
    for name, r in rows.items():
        pw = r["power"] or {}
        w, mhz, j = (pw.get(k, float("nan")) for k in ("watts", "sm_mhz", "joules_per_step"))
        print(f"{name:16} {r['ms']:8.2f} {w:6.0f} {mhz:6.0f} {j:7.1f}")


if __name__ == "__main__":
    main()
