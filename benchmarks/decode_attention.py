"""One decode step's attention over a KV cache: the Pallas decode kernel against XLA's.

    PYTHONUNBUFFERED=1 python -m benchmarks.decode_attention --out "$OUT"

One layer's call of ``fp8jax.ops.decode_attention.attend_filled`` (impl 'pallas') against
``KVCache``'s XLA attention over the whole cache, on gpt_1b3's heads (16 key/value heads of 128)
and a 512-slot bf16 cache, per batch size (``--batches``) and fill (``--fills``: every row's
position, so ``fill + 1`` slots hold keys), at each number of slot splits per row and head
(``--splits``; the code's default is ``ops.decode_attention.tiling``'s, up to 16): microseconds
per call (the mean over ``--iters`` calls), the largest difference from XLA's result (beside the
largest |v|: the scale of one bf16 rounding), and the bandwidth of the filled key/value bytes
the kernel reads. ``--quick``: small shapes through
Pallas' interpreter (a CPU check, not a timing). Writes ``decode_attention.json``.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import runner
from fp8jax.models import decode
from fp8jax.ops import decode_attention

HEADS, HEAD_DIM, SLOTS = 16, 128, 512  # gpt_1b3's key/value heads, their width; the bucket


def _us(fn, args, iters: int) -> float:
    """Mean microseconds per call of ``fn(*args)`` over ``iters`` calls, after one warm call."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / iters * 1e6


def measure(
    batches, fills, splits, iters: int, interpret: bool, heads=HEADS, head_dim=HEAD_DIM, slots=SLOTS
) -> list[dict]:
    """A row per (batch, fill): XLA's microseconds and, per split count, the kernel's."""
    module = decode.KVCache(0, "xla")
    reference = lambda *a: module._attend_one(*a)  # noqa: E731
    impl = "interpret" if interpret else "pallas"
    xla = jax.jit(reference)
    rows = []
    for batch in batches:
        key_q, key_k, key_v = jax.random.split(jax.random.PRNGKey(batch), 3)
        q = jax.random.normal(key_q, (batch, heads, head_dim), jnp.bfloat16)
        k = jax.random.normal(key_k, (batch, heads, slots, head_dim), jnp.bfloat16)
        v = jax.random.normal(key_v, (batch, heads, slots, head_dim), jnp.bfloat16)
        for fill in fills:
            positions = jnp.full((batch,), fill, jnp.int32)
            want = np.asarray(xla(q, k, v, positions), np.float32)
            row = {
                "batch": batch,
                "slots_filled": fill + 1,
                "v_max": float(jnp.abs(v.astype(jnp.float32)).max()),
                "xla_us": _us(xla, (q, k, v, positions), iters),
            }
            for n in splits:
                shape = decode_attention.tiling(slots, (n,))
                fn = jax.jit(
                    lambda q, k, v, p, shape=shape: decode_attention.attend_filled(
                        q, k, v, p, 0, impl, reference, shape
                    )
                )
                got = np.asarray(fn(q, k, v, positions), np.float32)
                row[f"s{n}_us"] = _us(fn, (q, k, v, positions), iters)
                row[f"s{n}_err"] = float(np.abs(got - want).max())
            best = min(row[f"s{n}_us"] for n in splits)
            filled_bytes = 2 * batch * heads * (fill + 1) * head_dim * 2  # K and V, bf16
            row["best_GBps"] = filled_bytes / best / 1e3
            rows.append(row)
    return rows


def _cell(key: str):
    """A table cell of ``key``: errors to 4 decimals, times and bandwidths to 1."""
    digits = 4 if key.endswith("_err") else 1
    return lambda r: f"{r[key]:.{digits}f}" if isinstance(r[key], float) else r[key]


def main(argv=None):
    p = runner.parser(__doc__, child=False)
    p.add_argument("--batches", default="1,32", help="batch sizes, comma-separated")
    p.add_argument("--fills", default="128,255,383", help="each row's position, comma-separated")
    p.add_argument("--splits", default="16,8,4,2", help="slot splits per row and head")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--quick", action="store_true", help="small shapes, interpreted (CPU check)")
    a = runner.parse_args(p, argv)
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    if a.quick:
        rows = measure([2], [5, 40], [4, 2], 1, True, heads=2, head_dim=16, slots=64)
    else:
        rows = measure(ints(a.batches), ints(a.fills), ints(a.splits), a.iters, False)
    info = {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
    runner.write_json(a.out, "decode_attention", {**info, "rows": rows})
    columns = {k: _cell(k) for k in rows[0] if k != "batch"}
    print("\n" + runner.table(rows, columns, "batch"))


if __name__ == "__main__":
    sys.exit(main())
