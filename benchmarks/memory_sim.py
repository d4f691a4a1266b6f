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
attention does not lower for CPU); runs that name no mesh shard over ``fsdp`` = ``--devices``.
``--quick`` compiles a shrunk model (a CPU smoke test).
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
MESH_AXES = ("data", "fsdp", "tensor")
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
    _, _, options = runner.parse_run(run)
    named = {o.split("=", 1)[0] for o in options}
    settings = {"model.attention_impl": "xla", **(QUICK if quick else {})}
    if not named & {"mesh.data", "mesh.fsdp", "mesh.tensor"}:
        settings.update({"mesh.data": 1, "mesh.fsdp": devices, "mesh.tensor": 1})
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


def child(run: str, devices: int, quick: bool, sets=()) -> dict:
    """Lower and compile one run on the simulated devices (inside the child process)."""
    import time

    import jax
    import jax.numpy as jnp

    from fp8jax.diagnostics import hlo as hlo_lib
    from fp8jax.trainer import checkpoint

    if len(jax.devices()) != devices:
        raise RuntimeError(f"expected {devices} simulated devices, got {len(jax.devices())}")
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
    "mesh (d,f,t)": lambda r: ",".join(str(r["mesh"].get(k, 1)) for k in MESH_AXES),
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
