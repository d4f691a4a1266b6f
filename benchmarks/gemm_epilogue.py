"""Which way of writing an FP8 matmul's unscale lets XLA fold it (and a bias) into the GEMM?

One linear layer's forward, ``y = (x @ w) / (sx * sw) + b`` with x, w already E4M3, written
several ways. For each it compiles, counts the FP8 GEMMs and the other kernels of the program,
reads the GEMM's epilogue and whether its scale operands are runtime values, and times it.
A form that folds both the unscale and the bias into cuBLASLt saves one read and one write of
the output (gpt_1b3's wi: [16384, 8192] bf16, 24 times a step).

    PYTHONPATH=. python3 benchmarks/gemm_epilogue.py --out "$OUT"    # GPU
    PYTHONPATH=. python3 benchmarks/gemm_epilogue.py --quick          # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time

import gemm  # benchmarks/gemm.py: the same timing loop
import jax
import jax.numpy as jnp
from jax import lax

DN = (((1,), (0,)), ((), ()))


def _direct(xq, wq, wqt, inv, b):  # today's fp8jax form: FP8 operands, unscale after
    y = lax.dot_general(xq, wq, DN, preferred_element_type=jnp.bfloat16)
    return (y.astype(jnp.float32) * (inv[0] * inv[1])).astype(jnp.bfloat16) + b


def _direct_f32(xq, wq, wqt, inv, b):  # f32 GEMM output, unscale, then bf16
    y = lax.dot_general(xq, wq, DN, preferred_element_type=jnp.float32)
    return (y * (inv[0] * inv[1])).astype(jnp.bfloat16) + b


def _dequant_f32(xq, wq, wqt, inv, b):  # operands dequantized in f32: XLA's scaled-FP8 pattern
    ix, iw = inv[0], inv[1]
    y = lax.dot_general(xq.astype(jnp.float32) * ix, wq.astype(jnp.float32) * iw, DN)
    return y.astype(jnp.bfloat16) + b


def _dequant_bf16(xq, wq, wqt, inv, b):  # the same in bf16 (what flax's FP8 op writes)
    ix, iw = inv[0].astype(jnp.bfloat16), inv[1].astype(jnp.bfloat16)
    y = lax.dot_general(xq.astype(jnp.bfloat16) * ix, wq.astype(jnp.bfloat16) * iw, DN)
    return y + b


def _dequant_f32_out_bf16(xq, wq, wqt, inv, b):  # f32 dequantization, bf16 GEMM output
    ix, iw = inv[0], inv[1]
    y = lax.dot_general(
        xq.astype(jnp.float32) * ix,
        wq.astype(jnp.float32) * iw,
        DN,
        preferred_element_type=jnp.bfloat16,
    )
    return y + b


def _dequant_bf16_wt(xq, wq, wqt, inv, b):  # bf16 form, w as [N, K] (the cast kernel's 2nd output)
    ix, iw = inv[0].astype(jnp.bfloat16), inv[1].astype(jnp.bfloat16)
    y = lax.dot_general(
        xq.astype(jnp.bfloat16) * ix,
        wqt.astype(jnp.bfloat16) * iw,
        (((1,), (1,)), ((), ())),
    )
    return y + b


FORMS = {
    "direct": _direct,
    "direct_f32": _direct_f32,
    "dequant_f32": _dequant_f32,
    "dequant_bf16": _dequant_bf16,
    "dequant_f32_out_bf16": _dequant_f32_out_bf16,
    "dequant_bf16_wt": _dequant_bf16_wt,
}


def _stats(text: str) -> dict:
    entry = text[text.find("\nENTRY ") :]
    entry = entry[: entry.find("\n}")]
    ops = re.findall(r"=\s*[^=]*?\s([a-z][a-z0-9-]*)\(", entry)
    trivial = {"parameter", "tuple", "get-tuple-element", "bitcast", "constant"}
    gemms = [ln for ln in entry.split("\n") if "__cublas$lt$matmul$f8" in ln]
    return {
        "f8_gemms": len(gemms),
        "gemm_hlo": [re.sub(r", metadata=\{[^}]*\}", "", ln.strip()) for ln in gemms],
        "kernels": sum(o not in trivial for o in ops),
        "epilogue": re.findall(r'"epilogue":"(\w+)"', "\n".join(gemms)),
        # Runtime scales reach cuBLASLt as operands other than constants.
        "gemm_operands": [
            re.sub(r"\.\d+", "", o)
            for ln in gemms
            for o in re.findall(r"(%[\w.-]+)", ln.split("custom-call(")[1].split(")")[0])
        ],
    }


def measure(m: int, k: int, n: int, reps: int = 5, iters: int = 20) -> list[dict]:
    """One row per form: time, kernels, epilogue, and the largest difference from ``direct``."""
    kx, kw, kb = jax.random.split(jax.random.key(0), 3)
    xq = (jax.random.normal(kx, (m, k)) * 64).astype(jnp.float8_e4m3fn)
    wq = (jax.random.normal(kw, (k, n)) * 64).astype(jnp.float8_e4m3fn)
    b = jax.random.normal(kb, (n,), jnp.bfloat16)
    # Powers of two, exact in bf16: any difference between forms is rounding order, not scale.
    inv = jnp.array([1.0 / 64.0, 1.0 / 64.0], jnp.float32)  # 1/sx, 1/sw
    args = (xq, wq, jnp.asarray(wq.T), inv, b)
    rows, ref = [], None
    for name, fn in FORMS.items():
        t0 = time.perf_counter()
        try:
            compiled = jax.jit(fn).lower(*args).compile()
            compile_s = time.perf_counter() - t0
            out = jax.block_until_ready(compiled(*args))
        except Exception as e:  # noqa: BLE001  (a form XLA cannot run is a result too)
            rows.append({"form": name, "error": str(e).splitlines()[0][:200]})
            continue
        ref = out if ref is None else ref
        sec, _ = gemm._bench(compiled, args, reps, min_rep_s=0.05, max_iters=iters)
        err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
        rows.append(
            {
                "form": name,
                "ms": sec * 1e3,
                "compile_s": compile_s,
                "max_abs_diff_vs_direct": err,
                "max_abs_out": float(jnp.max(jnp.abs(ref.astype(jnp.float32)))),
                **_stats(compiled.as_text()),
            }
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    m, k, n = (64, 32, 48) if a.quick else (16384, 2048, 8192)
    rows = measure(m, k, n)
    with open(os.path.join(a.out, "gemm_epilogue.json"), "w") as fh:
        json.dump(
            {
                "shape": [m, k, n],
                "device": str(jax.devices()[0]),
                "jax": jax.__version__,
                "rows": rows,
            },
            fh,
            indent=1,
        )
    print(f"{'form':20} {'ms':>8} {'f8':>3} {'kernels':>7} {'diff':>9}  epilogue / operands")
    for r in rows:
        if "error" in r:
            print(f"{r['form']:20} ERROR {r['error'][:100]}")
            continue
        print(
            f"{r['form']:20} {r['ms']:8.3f} {r['f8_gemms']:3d} {r['kernels']:7d} "
            f"{r['max_abs_diff_vs_direct']:9.2e}  {r['epilogue']} {r['gemm_operands']}"
        )


if __name__ == "__main__":
    main()
