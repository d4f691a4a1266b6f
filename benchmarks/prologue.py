"""The GELU prologue of the FP8 cast kernel: formulas and tunings, against GELU then cast.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/prologue.py --out "$OUT"

On gpt_1b3's MLP activation ([16384, 8192] bf16, E4M3), times per call (20 calls inside one
program, median of ``--iters`` programs): the plain cast kernel (no GELU), XLA's GELU followed
by the cast kernel (what ``fp8.fuse_activation=False`` runs), and the kernel with the GELU
inside for each formula and tuning. Each is checked against XLA's f32 GELU quantized: the
share of FP8 codes that differ. ``--quick`` uses a small shape (a CPU smoke test, where the
kernel runs through Pallas' interpreter).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cast_transpose import _in_loop, _time  # noqa: E402

from fp8jax.ops import (
    formats,  # noqa: E402
    kernels,
)

C = 0.7978845608028654  # sqrt(2 / pi)


def _gelu_exact(x, tanh):
    return kernels._gelu_tanh(x)  # libdevice's tanh, not the kernel's tanh.approx.f32


def _gelu_exp(x, tanh):
    # The same function: 0.5 (1 + tanh(u)) = 1 / (1 + exp(-2u)).
    return x / (1.0 + jnp.exp(-2.0 * C * (x + 0.044715 * (x * x * x))))


# What the kernel runs (tanh.approx.f32 on GPUs), and two exact formulas.
FORMULAS = {"approx": kernels._gelu_tanh, "tanh": _gelu_exact, "exp": _gelu_exp}
# (block rows, block columns, warps): the plain kernel's default first.
TUNINGS = [(64, 128, 4), (64, 128, 8), (32, 128, 4), (32, 128, 8), (128, 64, 8), (32, 256, 8)]


def measure(h, scale, interpret: bool, reps: int, iters: int, tunings=TUNINGS) -> list[dict]:
    """One row per variant: microseconds per call and the share of FP8 codes unlike the
    E4M3 cast of XLA's f32 GELU (``differ``); a tuning that fails to compile is an error row."""
    e4m3 = formats.E4M3
    ref = formats.quantize(jax.nn.gelu(h.astype(jnp.float32), approximate=True), scale, e4m3)
    ref_bits = np.asarray(jax.lax.bitcast_convert_type(ref, jnp.uint8))

    def row(name, cast, check=True, **extra):
        r = {"variant": name, **extra}
        try:
            loop = _in_loop(cast, reps)
            if check:
                q = jax.device_get(cast(h, scale)[0])
                bits = np.asarray(jax.lax.bitcast_convert_type(q, jnp.uint8))
                r["differ"] = float(np.mean(bits != ref_bits))
            r["us"] = _time(loop, (h, scale), iters) / reps * 1e6
        except Exception as e:  # a tuning that does not compile
            r["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        print(json.dumps(r), flush=True)
        return r

    bm, bk, _ = tunings[0]
    rows = [
        row(
            "cast only (no GELU)",
            lambda x, s: kernels._pallas(x, s, e4m3, bm, bk, interpret),
            check=False,
        ),
        row(
            "XLA GELU (bf16) then cast",
            lambda x, s: kernels._pallas(
                jax.nn.gelu(x, approximate=True), s, e4m3, bm, bk, interpret
            ),
        ),
    ]
    for formula, fn in FORMULAS.items():
        kernels.ACTIVATIONS["_bench"] = fn
        for bm, bk, warps in tunings:
            if h.shape[0] % bm or h.shape[1] % bk:
                continue

            def cast(x, s, bm=bm, bk=bk, w=warps):
                return kernels._pallas(
                    x, s, e4m3, bm, bk, interpret, num_warps=w, prologue="_bench"
                )

            rows.append(row(f"kernel GELU {formula}", cast, bm=bm, bk=bk, warps=warps))
        del kernels.ACTIVATIONS["_bench"]
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    on_gpu = jax.devices()[0].platform == "gpu"
    shape = (128, 256) if a.quick else (16384, 8192)  # [tokens, d_ff]
    h = jnp.asarray(np.random.default_rng(0).standard_normal(shape) * 2, jnp.bfloat16)
    rows = measure(h, jnp.float32(64.0), not on_gpu, 20 if on_gpu else 2, a.iters)
    with open(os.path.join(a.out, "prologue.json"), "w") as f:
        json.dump({"jax": jax.__version__, "device": str(jax.devices()[0]), "rows": rows}, f)
    print(f"\n{'variant':28} {'tuning':>12} {'us':>8} {'differ':>8}")
    for r in rows:
        tuning = f"{r['bm']}x{r['bk']}/{r['warps']}w" if "bm" in r else ""
        us = f"{r['us']:.1f}" if "us" in r else r.get("error", "")[:30]
        print(f"{r['variant']:28} {tuning:>12} {us:>8} {r.get('differ', float('nan')):8.5f}")


if __name__ == "__main__":
    main()
