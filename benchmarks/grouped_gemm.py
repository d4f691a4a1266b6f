"""The expert GEMM pair of an MoE layer, forward and backward: FP8 grouped GEMMs against bf16.

    PYTHONUNBUFFERED=1 python -m benchmarks.grouped_gemm --out "$OUT"

For each expert shape (d_model D, experts E, top-k k, expert width F) and ``--tokens`` T tokens,
the M = T * k routed rows, sorted by expert (``--routing``: 'balanced' M / E rows each, or
'random' top-k picks), run the SwiGLU experts' two grouped GEMMs (``fp8jax.ops.grouped``):

* gate/up  h [M, 2F] = x [M, D] . w1[e] [D, 2F]
* down     y [M, D]  = (silu(gate) * up) [M, F] . w2[e] [F, D]

forward and backward (dx, dw1, dw2: 18 * M * D * F FLOPs in all), in one jitted step with the
FP8 scale-state update (``fp8jax.update_state``). ``--rows dispatched`` (the default) hands the
rows over as the MoE layer's dispatch writes them: in the padded layout for a recipe whose
grouped GEMMs run on it (``ops.grouped.dispatch_layout``; the padding rows are computed, not
counted), sorted for the others; ``--rows sorted`` gives every variant the sorted rows, and
each FP8 GEMM pads and unpads its own. Variants: 'bf16' (level O0: on a Hopper GPU
JAX's Mosaic GPU ragged-dot kernels, f32 accumulation), the FP8 recipes ('delayed', 'current'
on ``ops.grouped_mgpu``'s kernels; 'block' on ``ops.block_gemm_mgpu``'s grouped kernels; 'rowwise'
runs its plain-JAX reference), and
any of them with '-xla' appended: the same step with the kernels off
(``grouped_mgpu.reference_only``: XLA's ``ragged_dot``). ``--variants`` picks. The compiled
GEMM kernels per variant (``gemm_kernels``) say what ran. Timing: jit, warm-up,
``block_until_ready``, median of ``--reps`` repetitions. Columns: ms, TFLOP/s, FP8 / bf16, and
dx's and dw1's relative error against bf16's. ``--quick``: a tiny shape (a CPU smoke test, not
a timing). Writes ``grouped_gemm.json``.
"""

from __future__ import annotations

import sys

from benchmarks import common, runner

# name -> (D, E, k, F): the expert shapes of OLMoE-1B-7B, Qwen3-30B-A3B and Mixtral-8x7B.
SHAPES = {
    "olmoe": (2048, 64, 8, 1024),
    "qwen3-30b-a3b": (2048, 128, 8, 768),
    "mixtral-8x7b": (4096, 8, 2, 14336),
}
QUICK_SHAPES = {"tiny": (64, 4, 2, 32)}
VARIANTS = ("bf16", "delayed", "current")
BASELINES = ("bf16", "bf16-xla")  # O0: no FP8 state
XLA = "-xla"  # a variant's suffix: the grouped kernels off
ROUTINGS = ("balanced", "random")
# How the routed rows reach the pair: 'dispatched' as the MoE layer's dispatch writes them (in
# the padded layout of a recipe that pads, sorted otherwise: no GEMM pads or unpads), 'sorted'
# (each FP8 GEMM pads its operands and unpads its output itself).
ROWS = ("dispatched", "sorted")


def flops(m: int, d: int, f: int) -> int:
    """FLOPs of the pair's forward and backward: 3 x (2 M D 2F + 2 M F D)."""
    return 18 * m * d * f


def group_sizes(tokens: int, e: int, k: int, routing: str, seed: int = 0):
    """Rows per expert (int32 [E]) of ``tokens`` tokens routed to ``k`` experts each."""
    import numpy as np

    if routing == "balanced":
        base, extra = divmod(tokens * k, e)
        return np.array([base + (i < extra) for i in range(e)], np.int32)
    rng = np.random.default_rng(seed)
    picks = np.argsort(rng.random((tokens, e)), axis=1)[:, :k]  # k distinct experts per token
    return np.bincount(picks.ravel(), minlength=e).astype(np.int32)


def pair_step(recipe, f: int):
    """The jitted step: loss, dx, dw1, dw2 and the committed FP8 state (None at O0).

    ``lay``: the rows already in that padded layout (``ops.grouped.dispatch_layout``'s, as the
    MoE layer's dispatch writes them; x and r padded, dx returned padded), or None: sorted rows,
    each GEMM pads and unpads its own where its recipe runs on the padded layout.
    """
    import jax
    import jax.numpy as jnp

    import fp8jax
    from fp8jax.ops import grouped

    def loss(x, w1, w2, state, gs, r, lay):
        m1, m2 = state if state is not None else (None, None)
        if lay is not None:
            gs = grouped.padded_sizes(lay)
        h, m1 = grouped.grouped_matmul(x, w1, gs, recipe, m1, out_dtype=jnp.bfloat16, layout=lay)
        gate, up = h[:, :f].astype(jnp.float32), h[:, f:].astype(jnp.float32)
        a = (jax.nn.silu(gate) * up).astype(jnp.bfloat16)  # 0 in padding rows: silu(0) * 0
        y, m2 = grouped.grouped_matmul(a, w2, gs, recipe, m2, out_dtype=jnp.bfloat16, layout=lay)
        metas = None if state is None else (m1, m2)
        return jnp.sum(y.astype(jnp.float32) * r), metas

    def step(x, w1, w2, state, gs, r, lay):
        grad = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)
        (value, metas), (dx, dw1, dw2, dstate) = grad(x, w1, w2, state, gs, r, lay)
        new_state = None if state is None else fp8jax.update_state(metas, dstate)
        return value, dx, dw1, dw2, new_state

    return jax.jit(step)


def operands(m: int, d: int, e: int, f: int, seed: int = 0):
    """bf16 x [M, D], w1 [E, D, 2F], w2 [E, F, D] and the output cotangent r [M, D]."""
    import jax
    import jax.numpy as jnp

    kx, k1, k2, kr = jax.random.split(jax.random.key(seed), 4)
    bf = jnp.bfloat16
    x = jax.random.normal(kx, (m, d), bf)
    w1 = (jax.random.normal(k1, (e, d, 2 * f), jnp.float32) * d**-0.5).astype(bf)
    w2 = (jax.random.normal(k2, (e, f, d), jnp.float32) * f**-0.5).astype(bf)
    r = jax.random.normal(kr, (m, d), bf)
    return x, w1, w2, r


def measure(name: str, shape, variants, a) -> list[dict]:
    """One shape's rows: each variant's time, TFLOP/s, compiled GEMM kernels, dx and dw error."""
    import contextlib

    import jax.numpy as jnp
    import numpy as np

    import fp8jax
    from fp8jax.diagnostics import coverage
    from fp8jax.ops import grouped, grouped_mgpu

    d, e, k, f = shape
    gs = group_sizes(a.tokens, e, k, a.routing)
    m = int(gs.sum())
    x, w1, w2, r = operands(m, d, e, f)
    flop = flops(m, d, f)
    rows, ref = [], None
    for variant in variants:
        row = {"shape": name, "variant": variant, "D": d, "E": e, "k": k, "F": f, "M": m}
        row.update(tokens=a.tokens, routing=a.routing, max_group=int(gs.max()))
        base = variant.removesuffix(XLA)
        recipe = None if variant in BASELINES else fp8jax.make_recipe(base)
        state = None if recipe is None else (fp8jax.init_meta(recipe), fp8jax.init_meta(recipe))
        off = grouped_mgpu.reference_only() if variant.endswith(XLA) else contextlib.nullcontext()
        try:
            with off:
                lay = None
                if a.rows == "dispatched":
                    lay = grouped.dispatch_layout(recipe, jnp.asarray(gs), m, (d, 2 * f), (f, d))
                row["padded_rows"] = None if lay is None else lay.rows
                rows_in = (x, r) if lay is None else [grouped_mgpu.pad_rows(v, lay) for v in (x, r)]
                step = pair_step(recipe, f)
                if state is not None:  # a step's committed scales: delayed scaling's steady state
                    state = step(rows_in[0], w1, w2, state, gs, rows_in[1], lay)[4]
                args = (rows_in[0], w1, w2, state, gs, rows_in[1], lay)
                row["gemm_kernels"] = coverage.gemm_counts(step.lower(*args).compile().as_text())
            s = common.time_calls(step, args, a.reps, a.min_rep_s, a.max_iters)[0]
            row.update(ms=s * 1e3, tflops=flop / s / 1e12)
            out = step(*args)
            dx = out[1] if lay is None else grouped_mgpu.unpad_rows(out[1], lay)
            dx, dw1 = np.asarray(dx, np.float32), np.asarray(out[2], np.float32)
            if ref is None and recipe is None:
                ref = (dx, dw1)
            elif ref is not None:
                row["dx_rel_err"] = float(np.linalg.norm(dx - ref[0]) / np.linalg.norm(ref[0]))
                row["dw_rel_err"] = float(np.linalg.norm(dw1 - ref[1]) / np.linalg.norm(ref[1]))
        except Exception as err:  # a lowering the backend lacks is this variant's result
            row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
        rows.append(row)
    baselines = [r["tflops"] for r in rows if r["variant"] in BASELINES and "tflops" in r]
    best = max(baselines, default=0)
    for row in rows:
        if best and "tflops" in row:
            row["over_bf16"] = row["tflops"] / best
    return rows


COLUMNS = {  # rows named by their variant
    "M": lambda r: r["M"],
    "ms": lambda r: f"{r['ms']:.2f}",
    "TF/s": lambda r: f"{r['tflops']:.0f}",
    "/bf16": lambda r: f"{r['over_bf16']:.2f}",
    "dx err": lambda r: f"{r['dx_rel_err']:.3f}",
    "dw1 err": lambda r: f"{r['dw_rel_err']:.3f}",
}


def main(argv=None):
    p = runner.parser(__doc__, child=False)
    p.add_argument("--quick", action="store_true", help="a tiny shape (CPU smoke test)")
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated SHAPES names")
    p.add_argument("--variants", default=",".join(VARIANTS), help="bf16, recipes; '-xla' suffix")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per step (rows: tokens * k)")
    p.add_argument("--routing", choices=ROUTINGS, default="balanced", help="rows per expert")
    p.add_argument("--rows", choices=ROWS, default="dispatched", help="how the rows arrive")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions (median reported)")
    p.add_argument("--min-rep-s", type=float, default=0.2, help="min seconds per repetition")
    p.add_argument("--max-iters", type=int, default=50, help="max calls per repetition")
    a = runner.parse_args(p, argv)
    shapes = QUICK_SHAPES if a.quick else {n: SHAPES[n] for n in a.shapes.split(",")}
    if a.quick:
        a.tokens, a.reps, a.min_rep_s, a.max_iters = 16, 1, 0.0, 2
    data = {**common.versions(), "argv": a.argv, "rows": []}
    for name, shape in shapes.items():
        data["rows"] += measure(name, shape, a.variants.split(","), a)
        print(f"\n{name} {dict(zip('DEkF', shape, strict=True))}", flush=True)
        print(runner.table([r for r in data["rows"] if r["shape"] == name], COLUMNS, "variant"))
        runner.write_json(a.out, "grouped_gemm", data)
    print(f"# wrote {runner.write_json(a.out, 'grouped_gemm', data)}")


if __name__ == "__main__":
    sys.exit(main())
