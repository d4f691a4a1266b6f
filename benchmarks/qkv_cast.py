"""The fused Q/K/V projection's backward cast: three parts in place against concatenate + cast.

    PYTHONUNBUFFERED=1 python -m benchmarks.qkv_cast --out "$OUT"

On gpt_1b3's attention gradients (dq, dk, dv [16384, 2048] bf16 each: 16 heads of 128, batch
8 x 2048), times ``fp8jax.ops.qkv.cast_transpose_parts`` (E5M2 in both layouts, the amax and
the bias gradient's column sums, each part cast into its columns) against what the sliced
``dot_general`` runs: the bf16 concatenation, ``kernels.cast_transpose`` and XLA's column sum.
Both on the Pallas kernels, 10 calls inside one program, each call's scale depending on the
last call's amax. Checks that both give the same FP8 bits and amax. ``--heads K,G,H`` sets
the head layout (key/value heads, query heads per key/value head, head dim); ``--quick``:
small shapes through Pallas' interpreter (a CPU check, not a timing). Writes ``qkv_cast.json``.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common, runner
from fp8jax.ops import kernels, qkv

TOKENS, HEADS = 16384, (16, 1, 128)  # gpt_1b3: batch 8 x 2048; 16 heads of 128 (MHA)
REPS = 10


def _casts(heads, impl: str):
    """``{name: fn(parts, pending, scale) -> (q, q.T, history, column sums)}``."""
    kv, g, h = heads

    def parts(p, pending, s):
        return qkv.cast_transpose_parts(p, heads, s, "e5m2", impl, pending, sums=True)

    def concatenated(p, pending, s):
        m = p[0].shape[0]
        g_MxC = jnp.concatenate([x.reshape(m, kv, -1, h) for x in p], axis=2).reshape(m, -1)
        q, q_t, hist = kernels.cast_transpose(g_MxC, s, "e5m2", impl, pending=pending)
        return q, q_t, hist, jnp.sum(g_MxC.astype(jnp.float32), axis=0)

    return {"parts in place": parts, "concatenate + cast": concatenated}


def measure(tokens: int, heads, iters: int, interpret: bool) -> list[dict]:
    """One row per way of casting: microseconds per call, bits equal to the other's."""
    kv, g, h = heads
    rng = np.random.default_rng(0)
    parts = [
        jnp.asarray(rng.standard_normal((tokens, kv * n * h)) * (i + 1), jnp.bfloat16)
        for i, n in enumerate((g, 1, 1))
    ]
    args = (parts, jnp.zeros((16,), jnp.float32), jnp.float32(2.0**10))
    rows, ref = [], None
    for name, fn in _casts(heads, "interpret" if interpret else "pallas").items():
        out = jax.jit(fn)(*args)
        ref = out if ref is None else ref
        same = all(
            np.array_equal(common.bits(a), common.bits(b))
            for a, b in zip(out[:2], ref[:2], strict=True)
        )
        rows.append(
            {
                "cast": name,
                "same_bits": bool(same and float(out[2][0]) == float(ref[2][0])),
                "sums_rel": float(jnp.max(jnp.abs(out[3] - ref[3])) / jnp.max(jnp.abs(ref[3]))),
                "us": common.per_call_us(fn, args, iters, REPS),
            }
        )
        print(rows[-1], flush=True)
    return rows


COLUMNS = {
    "us": lambda r: f"{r['us']:.1f}",
    "same bits": lambda r: r["same_bits"],
    "sums vs first": lambda r: f"{r['sums_rel']:.1e}",
}


def main(argv=None):
    p = runner.parser(__doc__, child=False)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--heads", default=",".join(map(str, HEADS)), help="K,G,H")
    p.add_argument("--quick", action="store_true", help="small shapes, interpreted (CPU check)")
    a = runner.parse_args(p, argv)
    heads = tuple(int(v) for v in a.heads.split(","))
    tokens, heads = (64, (2, 2, 32)) if a.quick else (TOKENS, heads)
    rows = measure(tokens, heads, 1 if a.quick else a.iters, a.quick)
    info = {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
    runner.write_json(a.out, "qkv_cast", {**info, "tokens": tokens, "heads": heads, "rows": rows})
    print("\n" + runner.table(rows, COLUMNS, "cast"))


if __name__ == "__main__":
    sys.exit(main())
