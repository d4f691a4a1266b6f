"""Per-device memory and communication of a sharded train step, compiled on simulated devices.

    python -m benchmarks.memory_sim --out "$OUT" --devices 8 \\
        --runs llama_7b:O2:mesh.data=8+mesh.fsdp=1,llama_7b:O3,llama_70b:O3

Each run builds the trainer's step in a fresh process on ``--devices`` simulated CPU devices
(``--xla_force_host_platform_device_count``), lowers it with abstract state and batch (nothing
is allocated) and compiles it. Per run: XLA's per-device argument, output, alias and temp
bytes, the train state's bytes per device counted from its shardings, and the bytes each device
sends per step by collective and element type (compiled HLO, ring costs; FP8 travels as uint8
on CPU). CPU fusion and scheduling differ from a GPU's: a compile-time proxy for the memory a
GPU run needs, available without the GPUs. ``model.attention_impl`` is set to 'xla' (cuDNN's
attention does not lower for CPU); runs that name no mesh shard over ``fsdp`` = ``--devices``
(over the devices the config's ``mesh.expert`` leaves: an MoE config keeps its expert axis).
``--quick`` compiles a shrunk model (a CPU smoke test).

    python -m benchmarks.memory_sim --out "$OUT" --devices 8 --runs qwen3_30b_a3b:O3
    python -m benchmarks.memory_sim --out "$OUT" --devices 1 \
        --runs qwen3_30b_a3b@1gpu:O2,olmoe_1b7b:O0,olmoe_1b7b:O1,olmoe_1b7b:O2
"""

from __future__ import annotations

import glob
import math
import os
import shutil
import sys
import tempfile

from benchmarks import common, runner

GIB = 2**30
MESH_AXES = ("data", "expert", "fsdp", "tensor")
QUICK = {
    "model.num_layers": 2,
    "model.d_model": 128,
    "model.num_heads": 4,
    "model.num_kv_heads": 4,
    "model.d_ff": 256,
    "model.vocab_size": 512,
    "model.max_len": 64,
    "seq_len": 64,
}


def config_for(run: str, devices: int, quick: bool, sets=()):
    """The run's config: its options, then CPU attention, a batch of one sequence per device
    unless the run sets one, and fsdp over every device unless it names a mesh."""
    from fp8jax import errors

    _, _, options = runner.parse_run(run)
    named = {o.split("=", 1)[0] for o in options}
    settings = {"model.attention_impl": "xla", **(QUICK if quick else {})}
    if not named & {f"mesh.{axis}" for axis in MESH_AXES}:
        expert = runner.load(run, sets, settings).mesh.expert  # the config's, if it splits experts
        if devices % expert:
            raise errors.ConfigError(
                f"run {run!r}: mesh.expert={expert} does not divide --devices {devices}; pass "
                "--devices a multiple of it or name the mesh (mesh.expert=...)"
            )
        settings.update({"mesh.data": 1, "mesh.fsdp": devices // expert, "mesh.tensor": 1})
    config = runner.load(run, sets, settings)
    if quick and "batch_size" not in named:
        config.batch_size = devices
    return config


def state_bytes_per_device(abstract) -> int:
    """Bytes of one device's shards of ``abstract`` (ShapeDtypeStructs with shardings)."""
    import jax
    import numpy as np

    total = 0
    for leaf in jax.tree.leaves(abstract):
        shape = leaf.sharding.shard_shape(leaf.shape)
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return total


def grouped_loop(
    lhs,
    rhs,
    group_sizes,
    ragged_dot_dimension_numbers,
    precision=None,
    preferred_element_type=None,
    **unused,
):
    """``ragged_dot_general`` one group at a time: the GPU kernels' memory, not XLA:CPU's.

    XLA:CPU has no grouped GEMM: JAX lowers ``ragged_dot_general`` there to dense products over
    every group at once ([G, M, K] and [G, M, N] temporaries, gigabytes at an MoE model's
    shapes) where a GPU's grouped kernel holds the operands and the result only. This gives the
    same values with a loop over the groups, whose temporaries are one group's product.
    """
    import jax
    import jax.numpy as jnp
    from jax import lax

    del unused
    dn = ragged_dot_dimension_numbers
    (l_con, r_con), (l_bat, r_bat) = dn.dot_dimension_numbers
    (ragged,) = dn.lhs_ragged_dimensions
    if group_sizes.ndim != 1:
        raise NotImplementedError("grouped_loop: batched group sizes")
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    dot = lambda a, b, dims: lax.dot_general(  # noqa: E731
        a, b, dims, precision=precision, preferred_element_type=preferred_element_type
    )

    def rows_of(g, shape, dim):  # the mask of group g's rows along ``dim`` of ``shape``
        iota = lax.broadcasted_iota(jnp.int32, shape, dim)
        return (iota >= starts[g]) & (iota < ends[g])

    if ragged in l_bat:  # ragged batch: a plain batched product
        return dot(lhs, rhs, dn.dot_dimension_numbers)
    if ragged in l_con:  # ragged contraction (a weight gradient): out[g] from g's rows
        dims = ((l_con, r_con), (l_bat, r_bat))
        out_shape = jax.eval_shape(lambda a, b: dot(a, b, dims), lhs, rhs)

        def body(g, out):
            masked = jnp.where(rows_of(g, lhs.shape, ragged), lhs, jnp.zeros((), lhs.dtype))
            return lax.dynamic_update_index_in_dim(out, dot(masked, rhs, dims), g, 0)

        out = jnp.zeros((group_sizes.shape[0], *out_shape.shape), out_shape.dtype)
        return lax.fori_loop(0, group_sizes.shape[0], body, out)
    (group,) = dn.rhs_group_dimensions  # ragged rows (forward, data gradient): rhs[g] each
    shift = lambda dims: [d - (d > group) for d in dims]  # noqa: E731
    dims = ((l_con, shift(r_con)), (l_bat, shift(r_bat)))
    take = lambda g: lax.dynamic_index_in_dim(rhs, g, group, keepdims=False)  # noqa: E731
    out_shape = jax.eval_shape(lambda a, b: dot(a, b, dims), lhs, take(0))
    free = [d for d in range(lhs.ndim) if d not in (*l_con, *l_bat)]
    out_dim = len(l_bat) + free.index(ragged)

    def body(g, out):
        y = dot(lhs, take(g), dims)
        return jnp.where(rows_of(g, y.shape, out_dim), y, out)

    return lax.fori_loop(0, group_sizes.shape[0], body, jnp.zeros(out_shape.shape, out_shape.dtype))


def install_grouped_loop() -> None:
    """Lower ``ragged_dot_general`` on CPU with ``grouped_loop`` (in this process)."""
    import jax
    import jax.numpy as jnp
    from jax.interpreters import mlir

    x = jax.ShapeDtypeStruct((2, 2), jnp.float32)
    w = jax.ShapeDtypeStruct((1, 2, 2), jnp.float32)
    sizes = jax.ShapeDtypeStruct((1,), jnp.int32)
    (eqn,) = jax.make_jaxpr(jax.lax.ragged_dot)(x, w, sizes).eqns  # the primitive, publicly
    lowering = mlir.lower_fun(grouped_loop, multiple_results=False)
    mlir.register_lowering(eqn.primitive, lowering, platform="cpu")


def child(run: str, devices: int, quick: bool, sets=()) -> dict:
    """Lower and compile one run on the simulated devices (inside the child process)."""
    import time

    import jax
    import jax.numpy as jnp

    from fp8jax.diagnostics import hlo as hlo_lib
    from fp8jax.trainer import checkpoint

    if len(jax.devices()) != devices:
        raise RuntimeError(f"expected {devices} simulated devices, got {len(jax.devices())}")
    install_grouped_loop()  # an MoE model's experts as a GPU holds them
    c = config_for(run, devices, quick, sets)
    s = runner.build(c)
    state = checkpoint.abstract_like(s.abstract, s.state_shardings)
    tokens = jax.ShapeDtypeStruct((c.batch_size, c.seq_len), jnp.int32, sharding=s.batch_sharding)
    t0 = time.perf_counter()
    compiled = s.train_step.lower(state, {"inputs": tokens, "targets": tokens}).compile()
    compile_s = time.perf_counter() - t0
    ma = compiled.memory_analysis()
    sent = hlo_lib.bytes_summary(hlo_lib.collectives(compiled.as_text(), devices))
    mesh = {k: int(v) for k, v in s.mesh.shape.items()} if s.mesh is not None else {}
    rec = {
        "run": run,
        "devices": devices,
        "mesh": mesh,
        "params_b": sum(math.prod(x.shape) for x in jax.tree.leaves(s.abstract.params)) / 1e9,
        "tokens_per_device": c.batch_size * c.seq_len / devices,
        "state_gib": state_bytes_per_device(state) / GIB,
        "argument_gib": ma.argument_size_in_bytes / GIB,
        "output_gib": ma.output_size_in_bytes / GIB,
        "alias_gib": ma.alias_size_in_bytes / GIB,
        "temp_gib": ma.temp_size_in_bytes / GIB,
        "sent_gb": {k: v / 1e9 for k, v in sent.items()},
        "compile_s": compile_s,
    }
    # What a device holds at once: its arguments (the state it keeps, donated into the
    # outputs) plus the step's temporaries.
    held = rec["argument_gib"] + rec["output_gib"] - rec["alias_gib"]
    rec["total_gib"] = held + rec["temp_gib"]
    if os.environ.get(common.XLA_DUMP):  # --live-range: what is alive at the peak
        files = glob.glob(os.path.join(os.environ[common.XLA_DUMP], "*train_step*live-range.txt"))
        if files:
            with open(max(files, key=os.path.getsize)) as f:
                rec.update(common.parse_live_range(f.read(), 12))
    return rec


COLUMNS = {
    "devices": lambda r: r["devices"],
    "mesh (d,e,f,t)": lambda r: ",".join(str(r["mesh"].get(k, 1)) for k in MESH_AXES),
    "params B": lambda r: f"{r['params_b']:.2f}",
    "state GiB": lambda r: f"{r['state_gib']:.2f}",
    "args GiB": lambda r: f"{r['argument_gib']:.2f}",
    "temp GiB": lambda r: f"{r['temp_gib']:.2f}",
    "total GiB": lambda r: f"{r['total_gib']:.2f}",
    "sent GB": lambda r: f"{r['sent_gb'].get('total', 0.0):.2f}",
    "compile s": lambda r: f"{r['compile_s']:.0f}",
}


def main(argv=None):
    p = runner.parser(__doc__, sets=True)
    p.add_argument("--runs", default="llama_7b:O2:mesh.data=8+mesh.fsdp=1,llama_7b:O3")
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    p.add_argument("--quick", action="store_true", help="a shrunk model (CPU smoke test)")
    p.add_argument("--timeout", type=int, default=0, help="seconds per run (0: none)")
    p.add_argument("--live-range", action="store_true", help="also the buffers live at the peak")
    a = runner.parse_args(p, argv)
    os.makedirs(a.out, exist_ok=True)
    flag = f"--xla_force_host_platform_device_count={a.devices}"
    dumps = tempfile.mkdtemp(prefix="fp8jax_xla_dump_") if a.live_range else ""

    def env(run: str) -> dict:
        kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
        flags = " ".join(kept)
        extra = {}
        if dumps:  # XLA's buffer assignment, parsed as benchmarks.memory_peak does
            dump = os.path.join(dumps, runner.safe_name(run))
            flags += f" --xla_dump_to={dump} --xla_dump_hlo_module_re=.*train_step.*"
            extra = common.dump_env(dump)
        return {
            **os.environ,
            **extra,
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"{flags} {flag}".strip(),
        }

    rows = runner.drive(
        "memory_sim",
        a,
        lambda run, a: child(run, a.devices, a.quick, a.set),
        a.runs.split(","),
        check=lambda run: config_for(run, a.devices, a.quick, a.set),
        env=env,
        timeout=a.timeout or None,
    )
    if rows is None:  # the child
        return 0
    ok = [r for r in rows if "error" not in r]
    print("\n" + runner.table(ok, COLUMNS))
    for r in ok:
        print(r["run"], {k: round(v, 3) for k, v in r["sent_gb"].items()})
        for b in r.get("peak_buffers", [])[:8]:
            print("   ", b)
        for b in r.get("breakdown", [])[:8]:
            print("   ", b)
    if dumps:
        shutil.rmtree(dumps, ignore_errors=True)
    return 0 if len(ok) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
