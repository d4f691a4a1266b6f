"""Decoding speed of ``fp8jax.trainer.generate`` per level and batch: time to the first token,
decode tokens/s, and the bound that reading the weights once per token sets.

Random params of the run's config (``model.init``; at O1 the FP8 scales of one forward pass,
as a trained run leaves them), ``--prompt`` tokens per row and ``--new`` generated tokens,
greedy, no EOS (every row runs to the end). Per batch size of ``--batches``: the prefill's
time to the first token (the prefill program, from the call to its tokens on the host), the
decode program's tokens/s over the remaining ``--new`` - 1 steps, and their share of the
weight-bandwidth bound: every decode step reads each weight once, so a step takes at least
(parameters x 2 bytes, their bf16 size) / the HBM bandwidth (``--bandwidth``, by default the
GPU's data sheet figure, ``fp8jax.trainer.generate.BANDWIDTH``); at O1 the FP8 matmuls' weights are
read as E4M3 (1 byte), whose bound is the ``fp8 bound`` column. ``e2e s``: one whole
``generate_ids`` call, compiled.

    PYTHONUNBUFFERED=1 XLA_FLAGS=--xla_gpu_enable_triton_gemm=false python -m benchmarks.decode \
        --out "$OUT" --runs gpt_1b3:O0,gpt_1b3:O1 --batches 1,32 --prompt 128 --new 256

Runs are ``config:level[:options]`` (``benchmarks.runner``), each in a fresh process; ``--set
key=value`` overrides every run; ``--quick`` shrinks the model to a CPU smoke test.
``--profile`` also traces one decode call per batch size with ``jax.profiler`` and reports where
a step's device time goes (``benchmarks.common.summarize_trace``: kernel time per token by
category and the top kernels, after the table).
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time

from benchmarks import common, runner


def device_bandwidth() -> float:
    """This GPU's HBM bandwidth (``fp8jax.trainer.generate.BANDWIDTH``, the data sheets');
    pass ``--bandwidth`` for a GPU it does not know."""
    from fp8jax.trainer import generate

    if bandwidth := generate.device_bandwidth():
        return bandwidth
    raise SystemExit("benchmarks.decode: no HBM bandwidth known for this device: pass --bandwidth")


def config_for(run: str, quick: bool, sets=()):
    """The ConfigDict of one run: ``--quick``'s shapes, then the run's options and ``--set``."""
    return runner.load(run, sets, runner.QUICK if quick else {})


def _trained_state(model, params, tokens_BxL):
    """The FP8 state after one forward pass's amax was committed (empty at O0)."""
    import functools

    import jax

    from fp8jax.nn.state import FP8
    from fp8jax.ops import scaling
    from fp8jax.trainer import inference

    fp8 = inference.fresh_fp8_state(model.cfg) if model.cfg.recipe else {}
    if not fp8:
        return {}
    apply = jax.jit(functools.partial(model.apply, mutable=[FP8]))
    _, mutated = apply({"params": params, FP8: fp8}, tokens_BxL)
    commit = lambda m: m.replace(x=scaling.commit(m.x), w=scaling.commit(m.w))  # noqa: E731
    return jax.tree.map(commit, mutated[FP8], is_leaf=lambda m: isinstance(m, scaling.Fp8Meta))


def measure(
    run: str,
    quick: bool,
    batches: list[int],
    prompt: int,
    new: int,
    bandwidth: float,
    reps: int = 3,
    sets=(),
    profile: bool = False,
) -> dict:
    """Build one run's model and time its prefill and decode programs per batch size
    (``profile``: and trace one decode call per batch size, its kernels per token)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from fp8jax import models, spec
    from fp8jax.ops import scaling
    from fp8jax.trainer import generate, sampling
    from fp8jax.trainer import step as step_lib

    t0 = time.perf_counter()
    cfg = spec.parse(config_for(run, quick, sets)).model
    model = models.build_model(cfg)
    init = jax.jit(model.init)(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))
    params = init["params"]
    tokens = jax.random.randint(jax.random.PRNGKey(1), (1, prompt), 0, cfg.vocab_size)
    fp8 = _trained_state(model, params, tokens)
    build_s = time.perf_counter() - t0
    decoder = generate.decoder_for(cfg, step_lib.state_collection(model))
    n_params = sum(x.size for x in jax.tree.leaves(params))
    bandwidth = bandwidth or device_bandwidth()
    bound_s = 2 * n_params / bandwidth  # the bf16 weights, once per step
    rows = []
    for batch in batches:
        prompts = np.asarray(
            jax.random.randint(jax.random.PRNGKey(batch), (batch, prompt), 0, cfg.vocab_size)
        )
        b = generate.buckets_for([prompt] * batch, new, cfg.max_len)
        tokens_BxP = np.zeros((b.batch, b.prompt), np.int32)
        tokens_BxP[:batch, :prompt] = prompts
        lengths_B = np.zeros((b.batch,), np.int32)
        lengths_B[:batch] = prompt
        knobs = (jnp.float32(0.0), jnp.int32(0), jnp.float32(1.0))
        pick = (jax.random.PRNGKey(0), *knobs, np.asarray([-1], np.int32))
        pick = (*pick, np.ones((cfg.vocab_size,), bool))
        fixed = (params, fp8, {})

        def prefill():
            out = decoder.prefill(
                *fixed, tokens_BxP, jnp.asarray(lengths_B), *pick, cache_len=b.cache
            )
            np.asarray(out[4])  # the first tokens, on the host
            return out

        def decode(out):
            loop = (jnp.asarray(lengths_B), jnp.int32(new), *pick)
            res = decoder.decode(*decoder.decode_args(fixed, out), *loop, watch=False)
            return int(res[1])  # steps run, on the host

        t = time.perf_counter()
        generate.generate_ids(model, params, fp8, prompts.tolist(), new, sampling.GREEDY)
        first_call_s = time.perf_counter() - t  # both programs compiled in it
        t = time.perf_counter()
        generate.generate_ids(model, params, fp8, prompts.tolist(), new, sampling.GREEDY)
        e2e_s = time.perf_counter() - t
        decode(prefill())  # these calls' own first dispatch
        ttft, step = [], []
        for _ in range(reps):
            t = time.perf_counter()
            out = prefill()
            ttft.append(time.perf_counter() - t)
            t = time.perf_counter()
            steps = decode(out)
            step.append((time.perf_counter() - t) / max(steps - 1, 1))
        step_s = statistics.median(step)
        traced = None
        if profile:
            out = prefill()
            with tempfile.TemporaryDirectory(prefix="fp8jax_decode_") as trace_dir:
                with jax.profiler.trace(trace_dir):
                    traced_steps = decode(out)
                traced = common.summarize_trace(trace_dir, max(traced_steps - 1, 1), 12)
        copies = []
        if cfg.recipe and cfg.recipe.quantizes_weights_once:
            is_copy = lambda w: isinstance(w, scaling.QuantizedWeight)  # noqa: E731
            copies = jax.tree.leaves(prefill()[1], is_leaf=is_copy)
        fp8_elems = sum(w.q.size for w in copies)
        fp8_bound_s = (fp8_elems + 2 * (n_params - fp8_elems)) / bandwidth
        rows.append(
            {
                "batch": batch,
                "ttft_ms": statistics.median(ttft) * 1e3,
                "step_ms": step_s * 1e3,
                "decode_tokens_per_s": batch / step_s,
                "bound_ms": bound_s * 1e3,
                "bound_share": bound_s / step_s,
                "fp8_bound_ms": fp8_bound_s * 1e3 if copies else None,
                "fp8_weights": len(copies),
                "steps": steps,
                "e2e_s": e2e_s,
                "first_call_s": first_call_s,
                **({"profile": traced} if traced is not None else {}),
            }
        )
    return {
        "run": run,
        "params": n_params,
        "dtype": str(cfg.dtype),
        "prompt": prompt,
        "new": new,
        "bandwidth": bandwidth,
        "build_s": build_s,
        "batches": rows,
        "jax": jax.__version__,
        "device": str(jax.devices()[0].device_kind),
    }


def table(records: list[dict]) -> str:
    """One line per run and batch size."""
    rows = []
    for r in records:
        if "error" in r:
            rows.append(r)
            continue
        for b in r["batches"]:
            rows.append({"run": r["run"], **b})
    fmt = lambda k, f: lambda r: f.format(r[k])  # noqa: E731
    columns = {
        "batch": fmt("batch", "{}"),
        "TTFT ms": fmt("ttft_ms", "{:.1f}"),
        "step ms": fmt("step_ms", "{:.2f}"),
        "tok/s": fmt("decode_tokens_per_s", "{:.0f}"),
        "bound ms": fmt("bound_ms", "{:.3f}"),
        "of bound": fmt("bound_share", "{:.0%}"),
        "fp8 bound ms": fmt("fp8_bound_ms", "{:.3f}"),
        "e2e s": fmt("e2e_s", "{:.2f}"),
        "1st call s": fmt("first_call_s", "{:.1f}"),
    }
    return runner.table(rows, columns)


def profile_lines(records: list[dict]) -> str:
    """Per profiled run and batch size: kernel time per token by category, then the top
    kernels."""
    lines = []
    for r in records:
        for b in r.get("batches", ()):
            t = b.get("profile")
            if t is None:
                continue
            cats = ", ".join(f"{k} {v:.3f}" for k, v in t["categories"].items())
            lines.append(
                f"{r['run']} batch {b['batch']}: {t['kernel_ms_per_step']:.3f} ms of kernels "
                f"per token ({t['timeline']}): {cats}"
            )
            for k in t["top"]:
                lines.append(
                    f"  {k['ms_per_step']:.4f} ms  x{k['calls_per_step']:.1f}  "
                    f"{k['category']:<18} {k['name'][:80]}"
                )
    return "\n".join(lines)


def main(argv=None):
    p = runner.parser(__doc__, sets=True)
    p.add_argument("--runs", default="gpt_1b3:O0,gpt_1b3:O1")
    p.add_argument("--batches", default="1,32", help="batch sizes, comma-separated")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens per row")
    p.add_argument("--new", type=int, default=256, help="tokens generated per row")
    p.add_argument(
        "--bandwidth", type=float, default=0.0, help="HBM bytes/s (0: the GPU's data sheet's)"
    )
    p.add_argument("--reps", type=int, default=3, help="timed prefill + decode calls")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--profile", action="store_true", help="trace one decode call per batch")
    p.add_argument("--timeout", type=int, default=0, help="seconds per run (0: none)")
    a = runner.parse_args(p, argv)
    batches = [int(b) for b in a.batches.split(",")]

    def child(run, a):
        return measure(
            run, a.quick, batches, a.prompt, a.new, a.bandwidth, a.reps, a.set, a.profile
        )

    check = lambda run: config_for(run, a.quick, a.set)  # noqa: E731
    rows = runner.drive(
        "decode", a, child, a.runs.split(","), check=check, timeout=a.timeout or None
    )
    if rows is not None:
        print("\n" + table(rows))
        if a.profile:
            print("\n" + profile_lines(rows))


if __name__ == "__main__":
    sys.exit(main())
