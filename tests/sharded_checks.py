"""Sharded-training checks on 8 simulated CPU devices, run once in a subprocess.

``tests/test_sharding.py`` runs this file (so the 8-device XLA flag never touches the main
pytest process) and asserts on the JSON it prints last. Standalone, it also prints the table of
bytes communicated per step:

    python tests/sharded_checks.py

Checks: two train steps of a shrunk configs/tiny.py under DP, FSDP, TP, DP x TP, O2 DP and O3
against the single-device steps (and the Pallas cast kernel inside the replicas against XLA's
casts, with GPT's fused MLP and one Q/K/V GEMM's fused backward); FP8 element
types in the collectives; bytes per step from the compiled HLO; the activation constraints in
the lowered step; an FP8 gradient sum that would overflow naively; the mu auto-scaling rule.
"""

from __future__ import annotations

import os

import xla_cpu

if __name__ == "__main__":
    # 8 host devices: must be set before JAX initialises its CPU backend (not on import: the
    # multi-process test imports tiny_config from here with its own device count).
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    # XLA:CPU's older elemental emitters: the same HLO and collectives, compiled in under half
    # the time of the fusion emitters (compiles dominate here, not run time).
    xla_cpu.add_emitter_flag()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import concurrent.futures  # noqa: E402
import copy  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fp8jax import spec  # noqa: E402
from fp8jax.diagnostics import hlo  # noqa: E402
from fp8jax.ops import formats  # noqa: E402
from fp8jax.optim import adam as optim  # noqa: E402
from fp8jax.parallel import comm, sharding  # noqa: E402
from fp8jax.trainer import loop as train_lib  # noqa: E402

STEPS = 2  # both move the parameters (a one-step warm-up: both at about the peak rate)


def tiny_config(level: str, data=-1, fsdp=1, tensor=1, **comm_fields) -> ml_collections.ConfigDict:
    """configs/tiny.py, shrunk (width 64, 16 tokens) so the many compiles stay quick."""
    c = train_lib.load_config("tiny")
    c.fp8.level = level
    c.model.update(d_model=64, d_ff=256, vocab_size=256, max_len=16)
    c.seq_len, c.batch_size, c.warmup_steps = 16, 16, 1
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = data, fsdp, tensor
    c.comm.update(comm_fields)
    return c


def abstract_batch(config) -> dict:
    spec = jax.ShapeDtypeStruct((config.batch_size, config.seq_len), jnp.int32)
    return {"inputs": spec, "targets": spec}


def batches(config) -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(STEPS):
        t = rng.integers(0, config.model.vocab_size, (config.batch_size, config.seq_len + 1))
        t = t.astype(np.int32)
        out.append({"inputs": t[:, :-1], "targets": t[:, 1:]})
    return out


def build(config, devices):
    """(mesh, jitted init, jitted step, state shardings, batch sharding) as loop.setup does."""
    env = train_lib.setup(spec.parse(config), devices, donate=False)  # states are reused
    return env.mesh, env.init, env.train_step, env.state_shardings, env.batch_sharding


_INITIAL: dict = {}


def initial_state(config):
    """The initial train state on the host: one init compile per model and FP8 setting, not per
    mesh or cast kernel (XLA's casts and the Pallas kernel start from the same state)."""
    fp8 = {k: v for k, v in config.fp8.to_dict().items() if k != "cast_kernel"}
    key = json.dumps([config.model.to_dict(), fp8], sort_keys=True)
    if key not in _INITIAL:
        one = copy.deepcopy(config)
        one.mesh.data, one.mesh.fsdp, one.mesh.tensor, one.mesh.expert = -1, 1, 1, 1
        _, init, _, _, _ = build(one, jax.devices()[:1])
        _INITIAL[key] = jax.device_get(init(jax.random.PRNGKey(config.seed)))
    return _INITIAL[key]


def prepare(config, devices) -> dict:
    """Trace and compile the train step (thread-safe: nothing runs on the devices); the jitted
    init and the lowered step come along for the checks that read them."""
    t0 = time.perf_counter()
    mesh, init, train_step, state_sh, batch_sh = build(config, devices)
    abstract = jax.eval_shape(init, jax.random.PRNGKey(config.seed))
    lowered = train_step.lower(abstract, abstract_batch(config))
    return dict(
        config=config,
        mesh=mesh,
        init=init,
        state_sharding=state_sh,
        lowered=lowered,
        step=lowered.compile(),
        batch_sharding=batch_sh,
        seconds=time.perf_counter() - t0,
    )


def run(prepared: dict) -> dict:
    """Train ``STEPS`` steps; keep metrics, params before/after and the FP8 state after step 0."""
    config = prepared["config"]
    # The same initial values on every mesh (sharding-invariant RNG would give them too).
    state = jax.device_put(initial_state(config), prepared["state_sharding"])
    params0 = jax.device_get(optim.materialize(state.params))
    metrics, fp8_after_0, params_after_0 = [], None, None
    for i, b in enumerate(batches(config)):
        state, m = prepared["step"](state, sharding.put_batch(b, prepared["batch_sharding"]))
        metrics.append({k: float(v) for k, v in jax.device_get(m).items()})
        if i == 0:
            fp8_after_0 = jax.device_get(state.fp8)
            params_after_0 = jax.device_get(optim.materialize(state.params))
    identical = all(
        all(
            np.array_equal(np.asarray(s.data), np.asarray(x.addressable_shards[0].data))
            for s in x.addressable_shards
        )
        for x in jax.tree.leaves(state.fp8)
    )
    return dict(
        mesh=dict(prepared["mesh"].shape),
        metrics=metrics,
        params0=params0,
        params=jax.device_get(optim.materialize(state.params)),
        fp8_after_0=fp8_after_0,
        params_after_0=params_after_0,
        scales_identical_across_devices=bool(identical),
        hlo=prepared["step"].as_text(),
        seconds=prepared["seconds"],
    )


def _flat(tree) -> np.ndarray:
    return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])


def _max_rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b) / np.maximum(np.abs(b), 1e-30)))


def _fwd_states(fp8_state) -> list:
    """The FP8 state's x and w leaves (its dy states dropped)."""
    pairs = jax.tree_util.tree_leaves_with_path(fp8_state)
    return [v for path, v in pairs if ".dy" not in jax.tree_util.keystr(path)]


def compare(base: dict, other: dict) -> dict:
    """Differences of a sharded run from the single-device run."""
    rel = lambda a, b: abs(a - b) / max(abs(a), 1e-30)
    u_base = _flat(base["params"]) - _flat(base["params0"])
    u_other = _flat(other["params"]) - _flat(other["params0"])
    fp8_b, fp8_o = _flat(base["fp8_after_0"]), _flat(other["fp8_after_0"])
    fwd_b, fwd_o = (_flat(_fwd_states(r["fp8_after_0"])) for r in (base, other))
    return dict(
        mesh=other["mesh"],
        loss_rel=[
            rel(a["loss"], b["loss"])
            for a, b in zip(base["metrics"], other["metrics"], strict=True)
        ],
        grad_norm_rel=[
            rel(a["grad_norm"], b["grad_norm"])
            for a, b in zip(base["metrics"], other["metrics"], strict=True)
        ],
        update_rel_l2=float(np.linalg.norm(u_other - u_base) / np.linalg.norm(u_base)),
        # The share of parameters whose update moved by more than a tenth of its own size.
        update_frac_off=float(np.mean(np.abs(u_other - u_base) > 0.1 * np.abs(u_base))),
        # Step 1's gradient norm after the first update. The base run's gradient moved by at
        # most |g0| + |g1| over its own first update u0; the runs' first updates differ by dp,
        # so to first order (the curvature along u0) their step-1 gradients differ by
        # (|g0| + |g1|) dp / |u0|.
        grad1_first_order=float(
            (base["metrics"][0]["grad_norm"] + base["metrics"][1]["grad_norm"])
            * np.linalg.norm(_flat(other["params_after_0"]) - _flat(base["params_after_0"]))
            / np.linalg.norm(_flat(base["params_after_0"]) - _flat(base["params0"]))
        ),
        grad1_diff=abs(other["metrics"][1]["grad_norm"] - base["metrics"][1]["grad_norm"]),
        grad1_scale=base["metrics"][1]["grad_norm"],
        # Step 1's loss is taken after the first update: to first order the runs' losses differ
        # by g . (u_other - u_base), at most |g| |u_other - u_base| (Cauchy-Schwarz).
        loss1_diff=abs(other["metrics"][1]["loss"] - base["metrics"][1]["loss"]),
        loss1_first_order=float(
            base["metrics"][0]["grad_norm"]
            * np.linalg.norm(_flat(other["params_after_0"]) - _flat(base["params_after_0"]))
        ),
        loss1_scale=abs(base["metrics"][1]["loss"]),
        fp8_state_step0_rel=_max_rel(fp8_o, fp8_b),
        # The same, over the x and w states alone (the forward's amaxes and scales).
        fp8_state_step0_fwd_rel=_max_rel(fwd_o, fwd_b),
        scales_identical_across_devices=other["scales_identical_across_devices"],
        comm=[{k: v for k, v in m.items() if k.startswith("comm_")} for m in other["metrics"]],
        seconds=round(other["seconds"], 1),
    )


def bytes_rows(name: str, r: dict, num_devices: int) -> dict:
    rows = hlo.collectives(r["hlo"], num_devices)
    out: dict = {"run": name, "mesh": r["mesh"], "by_op": {}}
    for row in rows:
        key = f"{row['op']} {row['dtype']} x{row['group']}"
        out["by_op"][key] = out["by_op"].get(key, 0.0) + row["sent"]
    out["total"] = sum(row["sent"] for row in rows)
    return out


def block_gather_check(devices) -> dict:
    """O3's per-layer gather of block-recipe kernels on a (2, 4) mesh, sharded on the first and
    on the last axis: does the gathered weight quantize to the unsharded weight's E4M3 tiles and
    inverse scales bit for bit, and which element types did the all-gathers move?"""
    from jax.sharding import Mesh

    from fp8jax.ops import block_cast, scaling
    from fp8jax.parallel import layerwise

    mesh = Mesh(np.array(devices).reshape(2, 1, 4, 1), sharding.MESH_AXES)
    recipe = scaling.BlockScaling(block_size=16)
    out = {}
    for name, shape, dim in (("first", (256, 8, 64), 0), ("last", (8, 64, 256), 2)):
        rng = np.random.default_rng(len(shape) + dim)
        w = rng.standard_normal(shape) * np.logspace(-2, 2, shape[-1])
        w = jnp.asarray(w, jnp.float32)
        leaf = layerwise.LeafInfo(("kernel",), dim, False, True, True, blocks=recipe)
        group = layerwise.Group((leaf,), (2, 4), 1, comm.CommConfig(), "uint8", "bfloat16")
        spec = [None] * len(shape)
        spec[dim] = "fsdp"
        fn = jax.jit(
            jax.shard_map(
                lambda w, g=group: layerwise.gathered(g, (w,), ())[0],
                mesh=mesh,
                in_specs=P(*spec),
                out_specs=P(),
                check_vma=False,
            )
        )
        got = fn(w)
        matrix = lambda x, d=dim: layerwise.kernel_matrix(x, d)  # noqa: E731
        # One program per side, as a step compiles it (not one per operation, run eagerly).
        quant = jax.jit(lambda x: block_cast.quantize_blocks(matrix(x), "e4m3", 16, recipe))
        want = quant(w.astype(jnp.bfloat16))  # what one device's matmul quantizes
        bits = lambda t: np.atleast_1d(np.asarray(t)).view(np.uint8)  # noqa: E731
        out[f"{name}_same_bits"] = all(
            np.array_equal(bits(a), bits(b)) for a, b in zip(quant(got), want, strict=True)
        )
        rows = hlo.collectives(fn.lower(w).compile().as_text(), len(devices))
        out[f"{name}_gather_dtypes"] = sorted({r["dtype"] for r in rows})
    return out


def overflow_check() -> dict:
    """Gradients whose FP8 sum overflows naively: FP8 psum vs ``comm.reduce_gradients``."""
    mesh = sharding.make_mesh(spec.MeshSpec(data=8, fsdp=1, tensor=1, expert=1))
    specs, stacks = {"w": P()}, {"w": 0}
    plan = comm.Plan(mesh, comm.CommConfig(), 1, specs, stacks, jnp.float32)
    fmt = formats.E5M2
    fmax = formats.fmax(fmt)
    # Every replica holds values at 90-100% of the shared amax: 8 of them sum to ~8x fmax.
    g_Nx4096 = np.full((8, 4096), 0.9, np.float32) * np.linspace(1.0, 1.1, 4096, dtype=np.float32)
    g_Nx4096[:, 0] = 1.0
    sh = NamedSharding(mesh, P(sharding.DP_AXES))
    g = jax.device_put(g_Nx4096, sh)

    def naive(x):  # shared scale from the global amax, then the sum itself in FP8
        s = fmax / jax.lax.pmax(jnp.max(jnp.abs(x)), sharding.DP_AXES)
        q = jnp.clip(x * s, -fmax, fmax).astype(fmt)  # E5M2 with the shared max scale
        return (jax.lax.psum(q, sharding.DP_AXES).astype(jnp.float32) / s)[None]

    naive_fn = jax.jit(
        jax.shard_map(
            naive,
            mesh=mesh,
            in_specs=P(sharding.DP_AXES),
            out_specs=P(sharding.DP_AXES),
            check_vma=False,
        )
    )
    naive_out = np.asarray(naive_fn(g))[0]
    reduce = jax.jit(lambda x, mu: comm.reduce_gradients({"w": x}, mu, plan))
    exact = g_Nx4096.sum(0)
    ours, sat1 = reduce(g, 1.0)
    ours = np.asarray(ours["w"])
    _, sat_big = reduce(g, 64.0)  # mu = 64: most values clip
    g_nan = g_Nx4096.copy()
    g_nan[3, 7] = np.nan  # one replica's bad value must reach the step's finiteness check
    with_nan, _ = reduce(jax.device_put(g_nan, sh), 1.0)
    cfg = plan.cfg
    return dict(
        naive_nonfinite=int(np.sum(~np.isfinite(naive_out))),
        ours_nonfinite=int(np.sum(~np.isfinite(ours))),
        ours_max_rel_err=float(np.max(np.abs(ours - exact) / np.abs(exact))),
        nan_propagates=bool(np.isnan(np.asarray(with_nan["w"])).any()),
        saturated_mu1=float(sat1),
        saturated_mu64=float(sat_big),
        next_mu_after_mu1=float(comm.next_mu(jnp.float32(1.0), sat1, cfg)),
        next_mu_after_mu64=float(comm.next_mu(jnp.float32(64.0), sat_big, cfg)),
    )


def lowered_step(config):
    """The step as train.setup jits it on all devices, lowered for abstract state and batch."""
    _, init, train_step, _, _ = build(config, jax.devices())
    abstract = jax.eval_shape(init, jax.random.PRNGKey(0))
    return train_step.lower(abstract, abstract_batch(config))


def stablehlo_fp8(config) -> dict:
    """Element types of all_to_all / all_gather in the lowered step with ``wire='fp8'``."""
    c = copy.deepcopy(config)
    c.comm.wire = "fp8"
    return hlo.fp8_collectives_in_stablehlo(lowered_step(c).as_text())


def activation_constraints(config) -> int:
    """Sharding constraints in the lowered step (the model's ``constrain`` calls, if bound)."""
    text = lowered_step(config).as_text()
    return text.count("sdy.sharding_constraint") + text.count("@Sharding")  # Shardy / GSPMD


def custom_partitioned_attention(config) -> str:
    """How the step compiles with attention as a custom-partitioned op, as cuDNN's is."""
    from jax.experimental.custom_partitioning import custom_partitioning

    xla_attention = jax.nn.dot_product_attention

    def causal(q, k, v):
        return xla_attention(q, k, v, is_causal=True, implementation="xla")

    def shardings(mesh, arg_shapes, result_shape):
        return arg_shapes[0].sharding

    def partition(mesh, arg_shapes, result_shape):
        # Every operand as q is split (batch only here): each shard attends over its own rows.
        return mesh, causal, arg_shapes[0].sharding, (arg_shapes[0].sharding,) * 3

    attention = custom_partitioning(causal)
    attention.def_partition(
        infer_sharding_from_operands=shardings,
        partition=partition,
        sharding_rule="b l n h, b l k h, b l k h -> b l n h",
    )

    @jax.custom_vjp
    def forward_custom(q, k, v):  # custom partitioning has no autodiff rule, as with cuDNN
        return attention(q, k, v)

    def backward(res, g):
        return jax.vjp(causal, *res)[1](g)

    forward_custom.defvjp(lambda q, k, v: (attention(q, k, v), (q, k, v)), backward)
    jax.nn.dot_product_attention = lambda q, k, v, **_: forward_custom(q, k, v)
    try:
        lowered_step(config).compile()
        return "compiled"
    except Exception as e:  # noqa: BLE001 (the test shows what failed)
        return f"{type(e).__name__}: {e}"[:2000]
    finally:
        jax.nn.dot_product_attention = xla_attention


def _unrolled(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    c.model.scan_layers = False
    return c


def _fused_qkv(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    c.model.fused_qkv = True
    return c


def _remat(c: ml_collections.ConfigDict, policy: str = "full") -> ml_collections.ConfigDict:
    c.model.remat_policy = policy
    return c


def _bf16(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    c.model.dtype = "bfloat16"  # the GPU configs' compute dtype
    return c


def _with(c: ml_collections.ConfigDict, **fp8_fields) -> ml_collections.ConfigDict:
    c.fp8.update(fp8_fields)
    return c


def main() -> dict:
    jax.config.update("jax_disable_most_optimizations", True)  # compiles dominate; numerics don't
    devs = jax.devices()
    assert len(devs) == 8, devs
    one = devs[:1]
    t0 = time.perf_counter()

    def o1(**mesh_and_comm):
        c = tiny_config("O1", **mesh_and_comm)
        c.grad_accum_steps = 2  # O1 runs also cover micro-batches (inside each replica)
        return c

    runs = {
        "base O1": (o1(), one, None),
        "base O3": (tiny_config("O3"), one, None),
        "base O2": (tiny_config("O2"), one, None),
        "O0 DP": (tiny_config("O0", data=8), devs, None),
        "O1 DP": (o1(data=8), devs, "base O1"),
        "O1 FSDP": (o1(data=2, fsdp=4), devs, "base O1"),
        "O1 TP": (o1(data=1, tensor=4), devs[:4], "base O1"),
        "O1 DPxTP": (o1(data=2, tensor=4), devs, "base O1"),
        "O3 FSDP": (tiny_config("O3", data=2, fsdp=4), devs, "base O3"),
        # O3 gathers per layer (comm.gather='auto'); all weights up front is the same arithmetic
        # in another order of collectives, so the same bits. Unrolled remat'd blocks gather
        # inside their remat region (and again for the backward pass), against up front too.
        "O3 FSDP upfront": (tiny_config("O3", data=2, fsdp=4, gather="upfront"), devs, "O3 FSDP"),
        "O3 FSDP unrolled upfront": (
            _remat(_unrolled(tiny_config("O3", data=2, fsdp=4, gather="upfront"))),
            devs,
            None,
        ),
        "O3 FSDP unrolled layer": (
            _remat(_unrolled(tiny_config("O3", data=2, fsdp=4))),
            devs,
            "O3 FSDP unrolled upfront",
        ),
        # Per-layer gathers at O1 (an option there): each micro-batch's gradients are reduced
        # in FP8 in its own backward pass, then averaged.
        "O1 FSDP layer": (o1(data=2, fsdp=4, gather="layer"), devs, "base O1"),
        # The block recipe: per-tile scales from the replicas' own activations, the kernels
        # gathered as E4M3 tiles (16 x 16: a 64-wide model's shards are whole tiles), the FP8
        # gradient reduction as under per-tensor scales.
        "base O3 block": (_with(tiny_config("O3"), recipe="block", block_size=16), one, None),
        "O3 FSDP block": (
            _with(tiny_config("O3", data=2, fsdp=4), recipe="block", block_size=16),
            devs,
            "base O3 block",
        ),
        # O2's masters reach the per-device replicas still encoded (master.carry_masters).
        "O2 DP": (tiny_config("O2", data=8), devs, "base O2"),
        # The fused cast kernel (through Pallas' interpreter) inside the per-device replicas,
        # against XLA's casts on the same mesh: the same arithmetic, so the same numbers (but
        # for the fused MLP's and Q/K/V's bias-gradient sum orders; test_sharding says how
        # much). One run covers the Pallas paths: the attention output GEMM takes the Pallas
        # casts of every unfused GEMM, GPT's MLP the fused MLP (fp8.fuse_mlp), and one Q/K/V
        # GEMM (model.fused_qkv) the fused Q/K/V backward, which writes dq, dk and dv into the
        # E5M2 operands in place (fp8.fuse_qkv, ops.qkv); with XLA's casts the same model
        # slices one dot_general's output.
        "O1 DP qkv": (_fused_qkv(o1(data=8)), devs, None),
        "O1 DP Pallas qkv": (
            _with(_fused_qkv(o1(data=8)), cast_kernel="interpret"),
            devs,
            "O1 DP qkv",
        ),
        # Unrolled layers: one FP8 gradient bucket per layer (the default) against one bucket
        # for all; per-tensor scales either way, so the same bits, in 3 all-to-alls against 1.
        "O1 DP one bucket": (_unrolled(o1(data=8, bucket_by_layer=False)), devs, None),
        "O1 DP by layer": (_unrolled(o1(data=8)), devs, "O1 DP one bucket"),
    }
    # Other programs, same math (or, for the block recipe, the same layout as O3 FSDP's).
    variants = {
        "O1 DP qkv",
        "O1 DP Pallas qkv",
        "O1 DP one bucket",
        "O1 DP by layer",
        "O3 FSDP block",
        "O3 FSDP upfront",
        "O3 FSDP unrolled upfront",
        "O3 FSDP unrolled layer",
        "O1 FSDP layer",
    }
    # Compiles dominate: run them on two threads (XLA compiles outside the GIL); then execute
    # one program at a time, so no two programs' collectives interleave on the devices.
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(prepare, c, d) for name, (c, d, _) in runs.items()}
        prepared = {name: f.result() for name, f in futures.items()}
    results = {name: run(p) for name, p in prepared.items()}
    compared, table = {}, []
    for name, (_, devices, base_name) in runs.items():
        if base_name:
            compared[name] = compare(results[base_name], results[name])
        if not name.startswith("base") and name not in variants:  # one column per layout
            table.append(bytes_rows(name, results[name], len(devices)))
    # train.setup initialises directly into the shardings: same values as on one device?
    o3 = runs["O3 FSDP"][0]
    sharded_init = prepared["O3 FSDP"]["init"](jax.random.PRNGKey(o3.seed))
    out = dict(
        sharded_init_equal=bool(
            np.array_equal(_flat(jax.device_get(sharded_init)), _flat(initial_state(o3)))
        ),
        compare=compared,
        bytes=table,
        overflow=overflow_check(),
        block_gather=block_gather_check(devs),
        o3_block_all_gathers=sorted(
            {
                r["dtype"]
                for r in hlo.collectives(results["O3 FSDP block"]["hlo"], len(devs))
                if r["op"] == "all-gather"
            }
        ),
        stablehlo_O1=stablehlo_fp8(tiny_config("O1", data=8)),
        stablehlo_O3=stablehlo_fp8(tiny_config("O3", data=2, fsdp=4)),
        stablehlo_O1_FSDP_bf16=stablehlo_fp8(_bf16(tiny_config("O1", data=2, fsdp=4))),
        custom_partitioned_attention_O1_FSDP=custom_partitioned_attention(
            tiny_config("O1", data=2, fsdp=4)
        ),
        constraints_O0_FSDP=activation_constraints(tiny_config("O0", data=2, fsdp=4)),
        all_to_alls={
            name: results[name]["hlo"].count("all-to-all-start")
            + results[name]["hlo"].count(" all-to-all(")
            for name in ("O1 DP one bucket", "O1 DP by layer")
        },
        # XLA's temp bytes per device: per-layer gathers hold one layer's weights and
        # gradients at a time, up front all of them (the tiny model's weights dominate).
        temp_bytes={
            name: prepared[name]["step"].memory_analysis().temp_size_in_bytes
            for name in ("O3 FSDP", "O3 FSDP upfront")
        },
        block_param_elems=int(
            sum(
                np.size(x)
                for x in jax.tree.leaves(optim.materialize(initial_state(o3).params)["blocks"])
            )
        ),
        # All-gathers in the lowered step of unrolled blocks with per-layer gathers: 'full'
        # remat gathers each block again for its backward; keeping the gathered weights or no
        # remat gathers once.
        all_gathers_by_remat={
            policy: (
                prepared["O3 FSDP unrolled layer"]["lowered"]  # 'full' remat
                if policy == "full"
                else lowered_step(_remat(_unrolled(tiny_config("O3", data=2, fsdp=4)), policy))
            )
            .as_text()
            .count("all_gather")
            for policy in ("none", "full", "full_keep_gathered")
        },
        compiled_O1_has_u8=[
            k for k in next(t for t in table if t["run"] == "O1 DP")["by_op"] if " u8 " in k
        ],
        seconds=round(time.perf_counter() - t0, 1),
    )
    return out


def print_table(table: list[dict]) -> None:
    """Bytes sent per device per step, by collective, element type and group size."""
    keys = sorted({k for t in table for k in t["by_op"]})
    print(f"{'bytes sent per device per step':40s}" + "".join(f"{t['run']:>12s}" for t in table))
    for k in keys:
        print(f"{k:40s}" + "".join(f"{t['by_op'].get(k, 0):12.0f}" for t in table))
    print(f"{'total':40s}" + "".join(f"{t['total']:12.0f}" for t in table))


if __name__ == "__main__":
    result = main()
    print_table(result["bytes"])
    if "--json" not in sys.argv:  # readable summary; the tests read only the last line
        print(json.dumps({k: v for k, v in result.items() if k != "bytes"}, indent=1))
    print(json.dumps(result))
