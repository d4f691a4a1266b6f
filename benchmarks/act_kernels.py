"""GPT's MLP activation passes at each kernel tuning: the GELU prologue cast and the GELU' pass.

    PYTHONUNBUFFERED=1 python -m benchmarks.act_kernels --out "$OUT"

On gpt_1b3's MLP tensors ([16384, 8192] bf16, batch 8 x 2048), times three Pallas kernels at
each tuning (block rows and columns, warps, stages, which block is transposed), 10 calls inside
one program (no dispatch):
``fwd`` the forward's cast of wo's input (``kernels.cast_transpose`` with the GELU prologue
and the affine unscale and bias, both E4M3 layouts and the amax); ``grad`` the backward's
``act_kernels.act_grad_cast_transpose`` (GELU', wi's E5M2 gradient in both layouts, amax and
bias gradient); ``grad+act`` the same pass also writing wo's E4M3 input again, transposed
(``act_scale=``). Checks every tuning's bits against the default tuning's, and ``grad+act``'s
rebuilt input against ``fwd``'s. ``--quick``: small shapes through Pallas' interpreter (a CPU
check, not a timing). Writes ``act_kernels.json``.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common, runner
from fp8jax.ops import act_kernels, formats, kernels

SHAPE = (16384, 8192)  # gpt_1b3's [tokens, d_ff]
# (block rows, block columns, warps, stages, transpose the FP8 block instead of the f32 one):
# the defaults (64 x 64 for these passes, 64 x 128 for the others; 1 stage, f32 transposed)
# first.
TUNINGS = [
    (64, 64, 4, 1, False),
    (64, 128, 4, 1, False),
    (64, 64, 8, 1, False),
    (64, 128, 8, 1, False),
    (32, 64, 4, 1, False),
    (32, 128, 4, 1, False),
    (128, 64, 4, 1, False),
    (128, 64, 8, 1, False),
    (64, 32, 4, 1, False),
    (64, 64, 2, 1, False),
    (64, 64, 4, 1, True),
    (64, 64, 4, 2, False),
    (64, 64, 4, 2, True),
    (128, 64, 8, 1, True),
]
REPS = 10


def measure(shape, iters: int, interpret: bool, tunings) -> list[dict]:
    """One row per (kernel, tuning): microseconds per call, bits equal to the reference."""
    rng = np.random.default_rng(0)
    pre = jnp.asarray(rng.standard_normal(shape) * 2, jnp.bfloat16)  # wi's raw output
    da = jnp.asarray(rng.standard_normal(shape) * 100, jnp.bfloat16)  # wo's raw dgrad output
    bias = jnp.asarray(rng.standard_normal(shape[1]) * 0.1, jnp.float32)
    affine, inv, s_act = (jnp.float32(0.9), bias), jnp.float32(0.01), jnp.float32(64.0)
    e4m3, e5m2 = formats.as_dtype("e4m3"), formats.as_dtype("e5m2")
    pending = jnp.zeros((4,), jnp.float32)
    rows, refs = [], {}
    for kernel in ("fwd", "grad", "grad+act"):
        for bm, bk, warps, stages, cast_first in tunings:
            knobs = dict(num_warps=warps, num_stages=stages, cast_first=cast_first)
            if kernel == "fwd":

                def fn(pre, da, s, bm=bm, bk=bk, knobs=knobs):
                    return kernels.pallas_cast_transpose(
                        pre,
                        s,
                        e4m3,
                        bm,
                        bk,
                        interpret,
                        prologue="gelu_tanh",
                        affine=affine,
                        **knobs,
                    )

                scale = s_act
            else:

                def fn(pre, da, s, bm=bm, bk=bk, knobs=knobs, act=kernel == "grad+act"):
                    return act_kernels.pallas_act_grad_cast_transpose(
                        pre,
                        da,
                        inv,
                        s,
                        e5m2,
                        "gelu_tanh",
                        bm,
                        bk,
                        interpret,
                        pending,
                        affine,
                        s_act if act else None,
                        **knobs,
                    )

                scale = jnp.float32(4.0)
            tuning = f"{bm}x{bk}, {warps} warps, {stages} stage{'s' * (stages > 1)}"
            row = {"kernel": kernel, "tuning": tuning + (", FP8 transposed" if cast_first else "")}
            try:
                out = [
                    common.bits(o) if o.dtype.itemsize == 1 else None
                    for o in jax.jit(fn)(pre, da, scale)
                ]
                ref = refs.setdefault(kernel, out)
                row["same_bits"] = all(
                    a is None or np.array_equal(a, b) for a, b in zip(out, ref, strict=True)
                )
                if kernel == "grad+act":  # the rebuilt wo input against the forward's
                    row["same_as_fwd"] = bool(np.array_equal(out[-1], refs["fwd"][1]))
                row["us"] = common.per_call_us(fn, (pre, da, scale), iters, REPS)
            except Exception as e:  # a tuning that does not compile (registers, shared memory)
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            print(row, flush=True)
            rows.append(row)
    return rows


COLUMNS = {
    "tuning": lambda r: r["tuning"],
    "us": lambda r: f"{r['us']:.1f}",
    "same bits": lambda r: r["same_bits"],
    "= fwd's": lambda r: r.get("same_as_fwd", ""),
    "error": lambda r: r["error"][:60],
}


def main(argv=None):
    p = runner.parser(__doc__, child=False)
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--quick", action="store_true", help="small shapes, interpreted (CPU check)")
    a = runner.parse_args(p, argv)
    shape, tunings = ((128, 128), TUNINGS[:3]) if a.quick else (SHAPE, TUNINGS)
    rows = measure(shape, 1 if a.quick else a.iters, a.quick, tunings)
    info = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "shape": shape}
    runner.write_json(a.out, "act_kernels", {**info, "rows": rows})
    print("\n" + runner.table(rows, COLUMNS, "kernel"))


if __name__ == "__main__":
    sys.exit(main())
