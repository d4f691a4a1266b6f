"""Expert-parallel checks on 8 simulated CPU devices, run once in a subprocess.

``tests/test_expert_parallel.py`` runs this file (the 8-device XLA flag never reaches the main
pytest process) and asserts on the JSON it prints last:

- the sharded dispatch + experts + combine (``parallel.expert.expert_parallel``) against a
  plain per-token reference (each token through its k experts, weighted and summed), forward
  and gradients, for expert axes of 2, 4 and 8 and with data and fsdp axes carrying tokens too,
  dropless and with a capacity; E4M3 dispatch against its error bound;
- a train step with tokens over data x expert against the one-device step (the expert axis as
  a data-parallel axis: gradients reduced and FP8 amaxes merged over it); MoE train steps with
  the experts split over 'expert' against it, and the expert kernels their layers see (each
  device's own experts only);
- an FP8 grouped GEMM on a weight stack split over 'expert' (current scaling) against the one
  GEMM on the whole stack: one scale from the whole stack's amax; the block recipe's on its
  padded layout likewise (forward and both gradients);
- the dtype of each kernel an MoE model's layers see in an fsdp-sharded bf16 step at O2 and O3
  (per-layer and upfront gathers), and how the per-layer gathers move and reduce the router.
"""

from __future__ import annotations

import os

import xla_cpu

if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    # XLA:CPU's older elemental emitters: the same HLO and collectives, compiled in under half
    # the time of the fusion emitters (compiles dominate here, not run time).
    xla_cpu.add_emitter_flag()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import contextlib  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import linen as nn  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import sharded_checks as sc  # noqa: E402

from fp8jax import spec  # noqa: E402
from fp8jax.ops import formats, grouped, scaling  # noqa: E402
from fp8jax.parallel import expert, layerwise, sharding  # noqa: E402
from fp8jax.recipes import RECIPES  # noqa: E402

from fp8_testing import scatter_results  # noqa: E402

TOKENS, D, F, E, K = 64, 16, 32, 8, 2  # global tokens, width, expert width, experts, top-k
CAPACITY_FACTOR = 1.0  # with the skewed router below, some experts overflow

# name -> (data, expert, fsdp): the mesh; tokens split over all three, experts over 'expert'
MESHES = {
    "ep2": (1, 2, 1),
    "ep4": (1, 4, 1),
    "ep8": (1, 8, 1),
    "data2 x ep4": (2, 4, 1),
    "data2 x ep2 x fsdp2": (2, 2, 2),
}


def inputs(seed: int = 0) -> dict:
    """Tokens, a top-k routing skewed towards low expert ids, weights, an output cotangent."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((TOKENS, E)) - 0.4 * np.arange(E)
    idx = np.argsort(-logits, axis=1)[:, :K].astype(np.int32)
    p = np.exp(np.take_along_axis(logits, idx, 1))
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    return dict(
        x=f32(rng.standard_normal((TOKENS, D))),
        idx=jnp.asarray(idx),
        p=f32(p / p.sum(1, keepdims=True)),
        w1=f32(rng.standard_normal((E, D, F)) / np.sqrt(D)),
        w2=f32(rng.standard_normal((E, F, D)) / np.sqrt(F)),
        ct=f32(rng.standard_normal((TOKENS, D))),
    )


def swiglu_free_experts(params, x_MxD, sizes_G):
    """Two grouped GEMMs with a SiLU between (rows past sum(sizes) give 0)."""
    w1, w2 = params
    h = jax.nn.silu(jax.lax.ragged_dot(x_MxD, w1, sizes_G))
    return jax.lax.ragged_dot(h, w2, sizes_G)


def linear_experts(params, x_MxD, sizes_G):
    """One grouped GEMM: its error is linear in the input's (the E4M3 dispatch bound)."""
    return jax.lax.ragged_dot(x_MxD, params[0], sizes_G)


def keep_mask(idx: np.ndarray, capacity_factor: float | None) -> np.ndarray:
    """[T, k]: which pairs an expert keeps (its first C pairs in token order)."""
    keep = np.ones(idx.shape, bool)
    if capacity_factor is None:
        return keep
    c = expert.capacity(capacity_factor, idx.shape[0], idx.shape[1], E)
    seen = np.zeros(E, int)
    for t in range(idx.shape[0]):
        for j in range(idx.shape[1]):
            keep[t, j] = seen[idx[t, j]] < c
            seen[idx[t, j]] += 1
    return keep


def reference(x, idx, p, w1, w2, keep, linear=False):
    """Each token through its k experts (one at a time), weighted by its router weights."""
    y = jnp.zeros_like(x)
    for j in range(idx.shape[1]):
        e = idx[:, j]
        if linear:
            out = jnp.einsum("td,tdf->tf", x, w1[e])
        else:
            h = jax.nn.silu(jnp.einsum("td,tdf->tf", x, w1[e]))
            out = jnp.einsum("tf,tfd->td", h, w2[e])
        y = y + jnp.where(keep[:, j], p[:, j], 0.0)[:, None] * out
    return y


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def dispatch_case(sizes, capacity_factor, data) -> dict:
    """Sharded forward and gradients (x, p, both expert weights) against the reference."""
    mesh = sharding.make_mesh(
        spec.MeshSpec(data=sizes[0], fsdp=sizes[2], tensor=1, expert=sizes[1]),
        jax.devices()[: int(np.prod(sizes))],
    )
    axes = tuple(a for a, n in zip(("data", "expert", "fsdp"), sizes, strict=True) if n > 1)
    rows = NamedSharding(mesh, P(axes))
    by_expert = NamedSharding(mesh, P("expert"))
    keep = keep_mask(np.asarray(data["idx"]), capacity_factor)

    def sharded(x, p, w1, w2):
        y = expert.expert_parallel(
            mesh,
            x,
            data["idx"],
            p,
            (w1, w2),
            swiglu_free_experts,
            num_experts=E,
            capacity_factor=capacity_factor,
            token_axes=axes,
        )
        return jnp.sum(y * data["ct"]), y

    def ref(x, p, w1, w2):
        y = reference(x, data["idx"], p, w1, w2, keep)
        return jnp.sum(y * data["ct"]), y

    args = (
        jax.device_put(data["x"], rows),
        jax.device_put(data["p"], rows),
        jax.device_put(data["w1"], by_expert),
        jax.device_put(data["w2"], by_expert),
    )
    grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True))  # noqa: E731
    (_, y), g = grad(sharded)(*args)
    (_, y_ref), g_ref = grad(ref)(data["x"], data["p"], data["w1"], data["w2"])
    out = {"fwd": _rel(y, y_ref), "dropped": int((~keep).sum())}
    for name, a, b in zip(("x", "p", "w1", "w2"), g, g_ref, strict=True):
        out[f"grad_{name}"] = _rel(a, b)
    out["w1_grad_sharded"] = g[2].sharding.spec == P("expert")
    # Row moves gather both ways (ops.rows): the only scatters left write ids, not rows.
    text = grad(sharded).lower(*args).as_text()
    out["row_scatters"] = [r for r in scatter_results(text) if re.search(rf"tensor<\d+x{D}x", r)]
    if capacity_factor is not None:  # the capacity changed the result (pairs were dropped)
        every = np.ones_like(keep)
        dropless = reference(data["x"], data["idx"], data["p"], data["w1"], data["w2"], every)
        out["capacity_changes_output"] = _rel(y_ref, dropless) > 1e-3
    return out


def fp8_dispatch_case(data) -> dict:
    """E4M3 dispatch (data2 x ep4, linear experts): error against its elementwise bound."""
    mesh = sharding.make_mesh(spec.MeshSpec(data=2, fsdp=1, tensor=1, expert=4))
    axes = ("data", "expert")
    rows = NamedSharding(mesh, P(axes))
    keep = keep_mask(np.asarray(data["idx"]), None)
    w_ExDxD = data["w1"][:, :, :D]  # square: the output meets the cotangent

    def run(fp8):
        def f(x, p, w):
            y = expert.expert_parallel(
                mesh,
                x,
                data["idx"],
                p,
                (w,),
                linear_experts,
                num_experts=E,
                fp8_dispatch=fp8,
                token_axes=axes,
            )
            return jnp.sum(y * data["ct"]), y

        g = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))
        w = jax.device_put(w_ExDxD, NamedSharding(mesh, P("expert")))
        return g(jax.device_put(data["x"], rows), jax.device_put(data["p"], rows), w)

    (_, y8), (gx8, _) = run(True)
    (_, y), (gx, _) = run(False)
    x, idx, p = (np.asarray(data[k], np.float64) for k in ("x", "idx", "p"))
    w = np.asarray(w_ExDxD, np.float64)
    # E4M3 with the row's amax on 448: |x' - x| <= eps/2 |x| (normals) + half the smallest
    # subnormal step in the row's scale (values near zero); through expert e's weights and the
    # router weight, elementwise.
    fi = jnp.finfo(formats.E4M3)
    amax_T = np.max(np.abs(x), axis=1, keepdims=True)
    dx = float(fi.eps) / 2 * np.abs(x) + float(fi.smallest_subnormal) / 2 * amax_T / float(fi.max)
    bound = sum(
        np.abs(p[:, j : j + 1]) * np.einsum("td,tdf->tf", dx, np.abs(w[idx[:, j].astype(int)]))
        for j in range(K)
    )
    y_ref = np.asarray(reference(data["x"], data["idx"], data["p"], w_ExDxD, None, keep, True))
    err = np.abs(np.asarray(y8, np.float64) - y_ref)
    slack = 1e-6 * np.max(np.abs(y_ref))  # f32 GEMM rounding
    return dict(
        within_bound=bool(np.all(err <= bound + slack)),
        max_err_over_bound=float(np.max(err / (bound + slack))),
        fp8_err=float(np.max(err)),
        exact_err=_rel(y, y_ref),
        # The gradient goes back in the compute dtype, straight through the quantization: for
        # linear experts dx does not depend on x, so it equals the exact dispatch's.
        grad_x=_rel(gx8, gx),
    )


def step_case() -> dict:
    """A dense tiny O1 step on data2 x expert4 against one device (sharded_checks' compare)."""
    one = sc.tiny_config("O1", data=1)
    cfg = sc.tiny_config("O1", data=2)
    cfg.mesh.expert = 4
    base = sc.run(sc.prepare(one, jax.devices()[:1]))
    other = sc.run(sc.prepare(cfg, jax.devices()))
    return sc.compare(base, other)


@contextlib.contextmanager
def recorded_groups():
    """Within it, each traced step's per-layer gather groups (``layerwise.prepare``'s) are
    appended to the list it gives."""
    groups, prepare = [], layerwise.prepare

    def keep(*args):
        out = prepare(*args)
        groups.append(out[2])
        return out

    layerwise.prepare = keep
    try:
        yield groups
    finally:
        layerwise.prepare = prepare


def moe_config(dispatch: str, data=1, expert=1, fsdp=1):
    """configs/moe_tiny.py at O1, shrunk as sharded_checks' tiny config (16 tokens a row).

    No load-balancing loss: E * sum_e f_e P_e over one replica's tokens is not that replica's
    share of the global batch's, so replicas change it by design; the z-loss (a mean over
    tokens) and everything else add up.
    """
    c = sc.train_lib.load_config("moe_tiny")
    c.fp8.level = "O1"
    c.model.update(vocab_size=256, max_len=16)
    c.model.moe.update(dispatch=dispatch, aux_loss_coef=0.0)
    c.seq_len, c.batch_size, c.warmup_steps = 16, 16, 1
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor, c.mesh.expert = data, fsdp, 1, expert
    return c


# name -> (dispatch, level, comm.gather, data, expert, fsdp) of the sharded MoE steps; each
# against one device at its level (O3's: O2, which O3 shards)
MOE_STEPS = {
    "data2 x ep4": ("dropless", "O1", "auto", 2, 4, 1),
    # encoded masters, E4M3-gathered kernels: per layer (each block's experts gathered over
    # fsdp only, their gradients reduced over the devices holding them) and all before the step
    "ep4 x fsdp2 O3": ("dropless", "O3", "layer", 1, 4, 2),
    "ep4 x fsdp2 O3 upfront": ("dropless", "O3", "upfront", 1, 4, 2),
    "data2 x ep4 capacity": ("capacity", "O1", "auto", 2, 4, 1),
}


def moe_step_cases() -> dict:
    """MoE train steps with the experts split over 'expert' against one device, and the number
    of experts in the kernels their GroupedLinear layers see while the step is traced."""
    base, out = {}, {}
    for name, (dispatch, level, gather, *sizes) in MOE_STEPS.items():
        one_level = "O2" if level == "O3" else level
        if (dispatch, one_level) not in base:
            one = moe_config(dispatch)
            one.fp8.level = one_level
            base[dispatch, one_level] = sc.run(sc.prepare(one, jax.devices()[:1]))
        seen = set()

        def record(next_fun, args, kwargs, context, seen=seen):
            kernel = context.module.variables.get("params", {}).get("kernel")
            if type(context.module).__name__ == "GroupedLinear" and kernel is not None:
                seen.add(int(kernel.shape[0]))
            return next_fun(*args, **kwargs)

        config = moe_config(dispatch, *sizes)
        config.fp8.level, config.comm.gather = level, gather
        with nn.intercept_methods(record), recorded_groups() as groups:
            prepared = sc.prepare(config, jax.devices())
        # Each per-layer group's leaves and the replica axes their gradients are reduced over.
        out_layers = {
            f"{g}/{'/'.join(li.path)}": li.replica_axes
            for grouping in groups
            for g, group in grouping.items()
            for li in group.leaves
        }
        out[name] = sc.compare(base[dispatch, one_level], sc.run(prepared))
        out[name]["kernel_experts_seen"] = sorted(seen)
        out[name]["layer_replica_axes"] = out_layers
        # The dispatch's all-to-alls, told from the gradient reduction's (FP8 bytes) by the
        # expert ids they carry (s32) and the tokens (f32 at O1).
        out[name]["all_to_all_dtypes"] = sorted(
            {
                m.group(1)
                for line in prepared["step"].as_text().splitlines()
                if " all-to-all(" in line and (m := re.search(r"= \(?(\w+)\[", line))
            }
        )
        kernel = prepared["state_sharding"].params["blocks"]["mlp"]["experts_wi"]["kernel"]
        # O2+ keeps an encoded master (a ScaledTensor): its data's layout
        out[name]["experts_sharded"] = str(getattr(kernel, "data", kernel).spec)
    return out


# name -> (level, comm.gather) of the fsdp-sharded bf16 MoE steps whose kernels are checked
GATHER_CASES = {"O3 layer": ("O3", "layer"), "O3 upfront": ("O3", "upfront"), "O2": ("O2", "auto")}


def gathered_dtypes(level: str, gather: str) -> dict:
    """The dtype of the kernel each layer of a bf16 MoE model (with a gated shared expert) sees
    in a train step on data2 x fsdp4, traced (``Module scope/name: dtype``); for the per-layer
    gathers also how each router and shared-gate kernel moves (cast) and reduces (FP8)."""
    c = moe_config("dropless", data=2, fsdp=4)
    c.fp8.level, c.comm.gather, c.model.dtype = level, gather, "bfloat16"
    c.comm.min_fp8_size = 32  # every kernel's gradient large enough for an FP8 reduction
    c.model.moe.update(shared_d_ff=16, shared_gate=True)
    env = sc.train_lib.setup(spec.parse(c), jax.devices(), donate=False)
    seen: dict[str, set] = {}

    def record(next_fun, args, kwargs, context):
        kernel = context.module.variables.get("params", {}).get("kernel")
        if context.method_name == "__call__" and kernel is not None:
            name = f"{type(context.module).__name__} {context.module.name}"
            seen.setdefault(name, set()).add(jnp.dtype(kernel.dtype).name)
        return next_fun(*args, **kwargs)

    abstract = jax.eval_shape(env.init, jax.random.PRNGKey(0))
    with nn.intercept_methods(record), recorded_groups() as groups:
        jax.eval_shape(env.train_step, abstract, sc.abstract_batch(c))
    out = {"kernels": {k: sorted(v) for k, v in seen.items()}}
    if groups:
        out["leaves"] = {
            "/".join(li.path): {"cast": li.cast, "fp8_grad": li.fp8_grad, "fsdp": li.fsdp_dim}
            for li in groups[0]["blocks"].leaves
            if {"router", "shared_gate", "experts_wi"} & set(li.path)
        }
    return out


def split_stack_case() -> dict:
    """The current-scaling FP8 grouped GEMM on a weight stack split over 'expert' (4 shards of
    2 groups, magnitudes 0.1 to 10 apart), each shard on the same rows, against the GEMM of
    one device on the whole stack with every shard's rows: the same outputs exactly when each
    shard's weights take the whole stack's scale; and the w amax each shard records."""
    rng = np.random.default_rng(3)
    shards, g, m = 4, 2, 16
    x_MxD = jnp.asarray(rng.standard_normal((m, D)), jnp.float32)
    mags = np.array([0.1, 10.0, 0.3, 1.0, 2.5, 0.05, 7.0, 0.6])[:, None, None]
    w_ExDxD = jnp.asarray(rng.standard_normal((shards * g, D, D)) * mags, jnp.float32)
    sizes_G = jnp.asarray([5, 11], jnp.int32)  # every row, so the shards' rows line up below
    recipe = RECIPES["current"]()
    meta = scaling.init_meta(recipe)
    mesh = sharding.make_mesh(
        spec.MeshSpec(data=1, fsdp=1, tensor=1, expert=shards), jax.devices()[:shards]
    )

    def shard(x, w):
        y, new = grouped.grouped_matmul(
            x, w, sizes_G, recipe, meta, out_dtype=jnp.float32, w_split_axis="expert"
        )
        return y[None], new.w.amax_history[..., 0][None]

    fn = jax.shard_map(
        shard,
        mesh=mesh,
        in_specs=(P(), P("expert")),
        out_specs=(P("expert"), P("expert")),
        check_vma=False,
    )
    y_SxMxD, amax_S = jax.jit(fn)(x_MxD, jax.device_put(w_ExDxD, NamedSharding(mesh, P("expert"))))
    # One device: every shard's rows back to back, each shard's sizes in turn.
    y_ref, _ = grouped.grouped_matmul(
        jnp.tile(x_MxD, (shards, 1)),
        w_ExDxD,
        jnp.tile(sizes_G, shards),
        recipe,
        meta,
        out_dtype=jnp.float32,
    )
    return dict(
        max_rel=_rel(y_SxMxD, y_ref.reshape(shards, m, D)),
        amax_recorded=np.asarray(amax_S).reshape(-1).tolist(),
        amax_whole=float(jnp.max(jnp.abs(w_ExDxD))),
        amax_shards=[float(jnp.max(jnp.abs(w_ExDxD[i * g : (i + 1) * g]))) for i in range(shards)],
    )


def block_split_stack_case() -> dict:
    """The block recipe's grouped GEMM (128-wide tiles: ``ops.grouped_block`` on the padded
    layout) inside the expert axis's manual region, a stack split over 'expert' (4 shards of
    2 groups, magnitudes 0.1 to 10 apart): y, dx and each shard's dw against one device's
    GEMM on the whole stack with every shard's rows. Per-tile scales need no merged amax."""
    rng = np.random.default_rng(4)
    shards, g, m, d = 4, 2, 24, 128
    x_MxD = jnp.asarray(rng.standard_normal((m, d)), jnp.float32)
    dy_MxD = jnp.asarray(rng.standard_normal((m, d)), jnp.float32)
    mags = np.array([0.1, 10.0, 0.3, 1.0, 2.5, 0.05, 7.0, 0.6])[:, None, None]
    w_ExDxD = jnp.asarray(rng.standard_normal((shards * g, d, d)) * mags, jnp.float32)
    sizes_G = jnp.asarray([9, 15], jnp.int32)
    recipe = RECIPES["block"]()
    meta = scaling.init_meta(recipe)
    mesh = sharding.make_mesh(
        spec.MeshSpec(data=1, fsdp=1, tensor=1, expert=shards), jax.devices()[:shards]
    )

    def vjp(x, w, dy, sizes):
        f = lambda x, w: grouped.grouped_matmul(  # noqa: E731
            x, w, sizes, recipe, meta, out_dtype=jnp.float32, w_split_axis="expert"
        )[0]
        y, back = jax.vjp(f, x, w)
        return y, *back(dy)

    def shard(x, w, dy):
        y, dx, dw = vjp(x, w, dy, sizes_G)
        return y[None], dx[None], dw

    fn = jax.shard_map(
        shard,
        mesh=mesh,
        in_specs=(P(), P("expert"), P()),
        out_specs=(P("expert"), P("expert"), P("expert")),
        check_vma=False,
    )
    w_sharded = jax.device_put(w_ExDxD, NamedSharding(mesh, P("expert")))
    y_S, dx_S, dw = jax.jit(fn)(x_MxD, w_sharded, dy_MxD)
    tile = lambda a: jnp.tile(a, (shards, 1))  # noqa: E731
    y_ref, dx_ref, dw_ref = jax.jit(vjp)(
        tile(x_MxD), w_ExDxD, tile(dy_MxD), jnp.tile(sizes_G, shards)
    )
    return dict(
        padded=grouped.dispatch_layout(recipe, sizes_G, m, (d, d)) is not None,
        y=_rel(y_S, y_ref.reshape(shards, m, d)),
        dx=_rel(dx_S, dx_ref.reshape(shards, m, d)),
        dw=_rel(dw, dw_ref),
    )


def main() -> None:
    jax.config.update("jax_disable_most_optimizations", True)  # compiles dominate; numerics don't
    data = inputs()
    out = {"dispatch": {}}
    for name, sizes in MESHES.items():
        for mode, cf in (("dropless", None), ("capacity", CAPACITY_FACTOR)):
            out["dispatch"][f"{name} {mode}"] = dispatch_case(sizes, cf, data)
    out["fp8_dispatch"] = fp8_dispatch_case(data)
    out["split_stack"] = split_stack_case()
    out["block_split_stack"] = block_split_stack_case()
    out["step"] = step_case()
    out["moe_steps"] = moe_step_cases()
    out["gathers"] = {name: gathered_dtypes(*case) for name, case in GATHER_CASES.items()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
