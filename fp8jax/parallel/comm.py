"""FP8 data-parallel communication (FP8-LM): gradient reduction (weight gathers: gather.py).

Gradient reduction (O1+), over the data-parallel mesh axes ``data`` x ``expert`` x ``fsdp`` (N
replicas):

1. Each replica holds its own gradient ``g_i`` (its loss carries a 1/N weight, so the reduced
   gradient is the sum ``sum_i g_i``).
2. A ``pmax`` gives every tensor's global amax (one per layer for ``nn.scan`` stacks) and the
   shared scale ``s = mu * fmax / amax``; every replica quantizes ``g_i * s`` with it (E5M2 by
   default). ``mu`` is FP8-LM's automatic pre-scale factor (below).
3. The FP8 bytes travel in one ``all_to_all`` per bucket (per layer with unrolled layers,
   ``bucket_by_layer``; one for all otherwise): replica r receives every replica's r-th chunk
   and adds them in f32. An FP8 sum of N full-range values could overflow; the f32 sum
   cannot, and ``sum / N`` is again within the format's range.
4. ``sum / N`` is re-quantized to FP8 with the same scale and ``all_gather``-ed (over ``data`` x
   ``expert`` only for parameters sharded over ``fsdp``, which keep just their shard: a
   reduce-scatter). The N goes back into the inverse scale: ``g = q * (N / s)``.

Routed experts split over ``expert``: where the replicas run one per device, each device keeps
only its own experts' weights and computes only their gradients (the tokens came to them by
all-to-all), so those gradients are summed over the devices holding the same experts, data x
fsdp, in buckets of their own. Replicas that hold every expert (tensor parallelism) keep their
own experts' slice of the sum.

So each device sends about 2 bytes per gradient element (all-to-all + all-gather) where an f32
ring all-reduce sends 8. Gradients smaller than ``min_fp8_size`` elements (norms, biases) are
reduced in f32: their bytes are negligible and their precision is not. So are the gradients of
``optim.master.F32_LAYERS`` (an MoE router and shared gate), kept out of FP8 throughout.

Automatic scaling (FP8-LM): if more than ``saturation_limit`` (0.001%) of the quantized values
exceed the format max (they are clipped), ``mu`` halves for the next step; otherwise it grows by
``mu_growth`` (2**(1/1000)). With ``mu <= 1`` nothing clips (the amax is this step's global
one), so ``mu`` creeps above 1, trading the rare largest values for resolution of small ones.

Wire format: XLA:GPU keeps FP8 element types in collectives (NCCL moves the bytes); XLA:CPU
upcasts FP8 collectives to f16. ``wire='auto'`` therefore sends FP8 as FP8 on accelerators and
as its uint8 bit pattern (``bitcast_convert_type``, free) on CPU: one byte per element either way.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from fp8jax._tree import path_key
from fp8jax.errors import ConfigError, check_bool, check_int, check_number
from fp8jax.ops import formats
from fp8jax.optim.master import F32_LAYERS
from fp8jax.parallel import sharding as sharding_lib
from fp8jax.parallel.sharding import DP_AXES, MESH_AXES, REPLICA_AXES

P = PartitionSpec
# The replicas of a routed expert's gradient when each device keeps only its own experts: the
# devices with the same 'expert' index (the expert axis splits the experts, not their rows).
EXPERT_REPLICA_AXES = ("data", "fsdp")


# Valid values of CommConfig's fields (configs/base.py declares config.comm with these).
GRAD_FORMATS = ("e5m2", "e4m3")  # comm.grad_format: 'e5m2' (range) or 'e4m3' (precision)
WIRES = ("auto", "fp8", "uint8")  # comm.wire: how FP8 payloads travel
GATHERS = ("auto", "layer", "upfront")  # comm.gather: where fsdp weights are gathered
INTERVALS = {  # the real-valued fields
    "mu_init": "(0, inf)",
    "mu_growth": "[1, inf)",  # < 1 would only shrink mu
    "saturation_limit": "[0, 1]",  # a share of the values
}


@dataclasses.dataclass(frozen=True)
class CommConfig:
    """Settings of FP8 gradient communication, checked when built (a config's ``comm``; its
    defaults are configs/base.py's)."""

    enabled: bool = True  # FP8 gradient reduction at O1+ (False: XLA's own f32 all-reduce)
    grad_format: str = "e5m2"  # 'e5m2' (range) or 'e4m3' (precision) for gradients on the wire
    wire: str = "auto"  # 'auto', 'fp8' (FP8 dtype collectives) or 'uint8' (FP8 bit patterns)
    min_fp8_size: int = 4096  # gradients with fewer elements are reduced in f32
    mu_init: float = 1.0  # FP8-LM auto-scaling factor at step 0
    mu_growth: float = 2.0 ** (1.0 / 1000)  # growth per step without saturation
    saturation_limit: float = 1e-5  # halve mu when more than this share of values clips
    bucket_by_layer: bool = True  # one collective per layer (overlaps the backward) or one in all
    # 'layer': fsdp weights gathered per layer inside the model, gradients reduce-scattered per
    # layer in its backward (parallel.layerwise); 'upfront': all weights gathered before the
    # forward pass, gradients reduced after the backward; 'auto': 'layer' at O3, else 'upfront'.
    gather: str = "auto"

    def __post_init__(self):
        for name in ("enabled", "bucket_by_layer"):
            check_bool(getattr(self, name), f"comm.{name}")
        if self.grad_format not in GRAD_FORMATS:
            raise ConfigError(
                f"unknown FP8 format {self.grad_format!r} in comm.grad_format: use 'e5m2' "
                f"(range) or 'e4m3' (precision)"
            )
        if self.wire not in WIRES:
            raise ConfigError(f"unknown comm.wire {self.wire!r}: use 'auto', 'fp8' or 'uint8'")
        if self.gather not in GATHERS:
            raise ConfigError(f"unknown comm.gather {self.gather!r}: use one of {GATHERS}")
        check_int(self.min_fp8_size, "comm.min_fp8_size", 0)
        for name, interval in INTERVALS.items():
            check_number(getattr(self, name), f"comm.{name}", interval)


def init_state(level: int, cfg: CommConfig) -> dict:
    """The train state's ``comm`` entry: ``{'mu': f32[]}`` at O1+, empty at O0."""
    return {"mu": jnp.asarray(cfg.mu_init, jnp.float32)} if level >= 1 else {}


def next_mu(mu: jax.Array, saturated: jax.Array, cfg: CommConfig) -> jax.Array:
    """FP8-LM auto-scaling: halve when too many values clipped, otherwise grow slowly."""
    return jnp.where(saturated > cfg.saturation_limit, mu * 0.5, mu * cfg.mu_growth).astype(
        jnp.float32
    )


def wire_format(mesh: Mesh, cfg: CommConfig) -> str:
    """'fp8' or 'uint8': how FP8 payloads travel on this mesh's platform."""
    if cfg.wire != "auto":
        return cfg.wire
    return "uint8" if mesh.devices.flat[0].platform == "cpu" else "fp8"


def to_wire(x_f8: jax.Array, wire: str) -> jax.Array:
    """FP8 payload as it goes on the wire (same bytes; uint8 view where FP8 would be upcast)."""
    return lax.bitcast_convert_type(x_f8, jnp.uint8) if wire == "uint8" else x_f8


def from_wire(x: jax.Array, dtype, wire: str) -> jax.Array:
    """The FP8 array (E4M3 or E5M2, as sent) back from its wire form."""
    return lax.bitcast_convert_type(x, dtype) if wire == "uint8" else x


def per_layer(s: jax.Array, ndim: int) -> jax.Array:
    """Per-layer scale ``[L]`` (or ``[]``) broadcast against a ``[L, ...]`` tensor."""
    return s.reshape(s.shape + (1,) * (ndim - s.ndim))


def amax_stacked(x: jax.Array, stack_ndim: int) -> jax.Array:
    """Amax over all but the leading ``stack_ndim`` (layer) axes, f32."""
    axes = tuple(range(stack_ndim, x.ndim))
    return jnp.max(jnp.abs(x.astype(jnp.float32)), axis=axes)


@dataclasses.dataclass
class Plan:
    """What the sharded step needs to know about every parameter (static, built once)."""

    mesh: Mesh
    cfg: CommConfig
    level: int  # 0..3
    specs: Any  # tree of PartitionSpec: each parameter's layout on the mesh
    stack_ndims: Any  # tree of int: leading 'layers' axes (one FP8 scale per layer)
    compute_dtype: Any  # the model's dtype (what the FP8 matmul quantizes from)

    @property
    def num_replicas(self) -> int:
        return sharding_lib.dp_size(self.mesh)

    @property
    def experts_local(self) -> bool:
        """Whether each device holds only its own routed experts' weights and gradients in the
        step: the replicas run per device and an 'expert' axis splits the experts."""
        return self.per_device and int(self.mesh.shape["expert"]) > 1

    def splits_experts(self, spec: PartitionSpec) -> bool:
        """Whether the parameter laid out as ``spec`` stays split over 'expert' in the step."""
        return self.experts_local and sharding_lib.axis_dim(spec, "expert") is not None

    def local_spec(self, spec: PartitionSpec) -> PartitionSpec:
        """Layout of an (fsdp-gathered) parameter handed to the per-device replicas: whole, but
        for routed experts, which stay split over 'expert' (``splits_experts``)."""
        return sharding_lib.keep_axis(spec, "expert") if self.splits_experts(spec) else P()

    def replica_spec(self, spec: PartitionSpec) -> PartitionSpec:
        """Layout of the per-replica gradients of the parameter laid out as ``spec``.

        ``[N, *param]`` (full along fsdp and expert, split over the N replicas); for experts
        that stay split (``splits_experts``) ``[data x fsdp, *param]``: each device's gradient
        of its own experts, so the replicas holding the same experts are data x fsdp.
        """
        if self.splits_experts(spec):
            return P(EXPERT_REPLICA_AXES, *sharding_lib.keep_axis(spec, "expert"))
        return P(DP_AXES, *sharding_lib.drop_axis(sharding_lib.drop_axis(spec, "fsdp"), "expert"))

    def replica_axes(self, spec: PartitionSpec) -> tuple[str, ...]:
        """The data-parallel axes that hold the parameter laid out as ``spec`` whole (fsdp
        aside): its gradient's replicas are these x fsdp."""
        return ("data",) if self.splits_experts(spec) else REPLICA_AXES

    @property
    def layerwise(self) -> bool:
        """Whether fsdp weights are gathered per layer inside the model (``comm.gather``)."""
        if int(self.mesh.shape["fsdp"]) == 1 or not self.per_device:
            return False
        return self.cfg.gather == "layer" or (self.cfg.gather == "auto" and self.level >= 3)

    @property
    def per_device(self) -> bool:
        """Whether the replicas run one per device under shard_map (see ``per_device``)."""
        return per_device(self.level, self.cfg, self.mesh)


def has_replicas(level: int, cfg: CommConfig, mesh: Mesh) -> bool:
    """Whether the step reduces several data-parallel replicas' gradients itself (in FP8)."""
    return level >= 1 and cfg.enabled and sharding_lib.dp_size(mesh) > 1


def per_device(level: int, cfg: CommConfig, mesh: Mesh) -> bool:
    """Whether those replicas run one per device under shard_map: no tensor parallelism, so
    the model needs no partitioning (the train step's ``_manual_replicas``)."""
    return has_replicas(level, cfg, mesh) and int(mesh.shape["tensor"]) == 1


def make_plan(model, cfg: CommConfig, mesh: Mesh, level: int) -> Plan | None:
    """The plan of FP8 communication, or None when there is none (O0, one replica, disabled)."""
    if not has_replicas(level, cfg, mesh):
        return None
    specs = sharding_lib.param_specs(model, mesh)
    names = sharding_lib.param_logical_names(model)
    stack = jax.tree.map(
        lambda n: next((i for i, a in enumerate(n) if a != "layers"), len(n)),
        names,
        is_leaf=lambda x: isinstance(x, tuple),
    )
    return Plan(mesh, cfg, level, specs, stack, jnp.dtype(model.cfg.dtype))


# --------------------------------------------------------------------------------------------
# Gradient reduction


def _arrange(y: jax.Array, fsdp_dim: int | None, a: int, f: int) -> tuple[jax.Array, int]:
    """(``[N, k]`` rows for replica ``a*F + b`` = (data x expert a, fsdp b), unpadded length
    covered)."""
    # Sharded over fsdp: row (a, b) is the a-th piece of fsdp-slice b, so replica (a, b) ends up
    # owning a piece of its own slice. Replicated: the flat tensor cut into N chunks.
    n = a * f
    if fsdp_dim is None:
        flat = y.reshape(-1)
        k = -(-flat.size // n)
        return jnp.pad(flat, (0, k * n - flat.size)).reshape(n, k), flat.size
    rows_FxM = jnp.moveaxis(y, fsdp_dim, 0).reshape(f, -1)
    m = rows_FxM.shape[1]
    k = -(-m // a)
    rows_FxAxK = jnp.pad(rows_FxM, ((0, 0), (0, k * a - m))).reshape(f, a, k)
    return jnp.transpose(rows_FxAxK, (1, 0, 2)).reshape(n, k), m


def _unarrange_sharded(rows_AxK, m: int, local_shape, fsdp_dim: int, f: int):
    """Inverse of ``_arrange`` for this replica's fsdp slice, from the data-gathered pieces."""
    moved = list(local_shape)
    moved.insert(0, moved.pop(fsdp_dim))
    flat = rows_AxK.reshape(-1)[:m]
    return jnp.moveaxis(flat.reshape(moved), 0, fsdp_dim)


def _layer_groups(tree) -> list[list[int]]:
    """Leaf indices grouped by layer: the first ``<name>_<int>`` key of each leaf's path (one
    group for leaves without one: embeddings, final norm, head; and nn.scan's stacked layers)."""
    groups: dict[str, list[int]] = {}
    for i, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(tree)[0]):
        layer = next((k for k in path_key(path) if re.fullmatch(r".+_\d+", k)), "")
        groups.setdefault(layer, []).append(i)
    return list(groups.values())


def reduce_fp8(
    g_leaves,
    fsdp_dims,
    stacks,
    mu: jax.Array,
    cfg: CommConfig,
    mesh_shape,
    wire: str,
    replica_axes: tuple[str, ...] = REPLICA_AXES,
):
    """Sum this replica's gradients ``g_leaves`` over the data-parallel axes in FP8 (one bucket,
    inside a fully manual shard_map): (f32 reduced leaves, clipped values of this replica).

    ``fsdp_dims``: each leaf's dimension sharded over fsdp (None: replicated), whose result is
    only this device's shard; ``stacks``: its leading layer axes (one scale per layer);
    ``replica_axes``: the axes whose devices hold the same parameters (data x expert; 'data'
    alone for experts each device keeps its own of) and ``mesh_shape`` their and fsdp's sizes.
    """
    a, f = mesh_shape
    n = a * f
    dp_axes = (*replica_axes, "fsdp")
    fmt = formats.as_dtype(cfg.grad_format)
    fmax = formats.fmax(fmt)
    ids = range(len(g_leaves))
    # Shared per-tensor (per-layer) scale from the global amax: one pmax per bucket.
    amaxes = [amax_stacked(g, st) for g, st in zip(g_leaves, stacks, strict=True)]
    flat = lax.pmax(jnp.concatenate([x.reshape(-1) for x in amaxes]), MESH_AXES)
    splits = np.cumsum([x.size for x in amaxes])[:-1].tolist()
    amaxes = [x.reshape(s.shape) for x, s in zip(jnp.split(flat, splits), amaxes, strict=True)]
    scales = [jnp.where(am > 0, mu * fmax / am, 1.0) for am in amaxes]
    # Clipped values: beyond fmax by more than half a step, since anything closer would
    # round to fmax anyway (and amax * (fmax / amax) lands a hair above fmax in f32).
    limit = fmax * (1.0 + 2.0 ** -(jnp.finfo(fmt).nmant + 1))
    # Parameters sharded over fsdp first (gathered over 'data' only), then the rest.
    order = sorted(ids, key=lambda i: fsdp_dims[i] is None)
    rows, meta, clipped = [], [], []
    for i in order:
        g = g_leaves[i].astype(jnp.float32)
        y = g * per_layer(scales[i], g.ndim)
        clipped.append(jnp.sum(jnp.abs(y) > limit))
        # Gradient format (E5M2 default: range over precision), shared scale, saturating
        # (values past fmax only occur when mu > 1 and are counted above). Cast per leaf,
        # before the bucket: one read of the gradient, no f32 copy of all of them.
        q = jnp.clip(y, -fmax, fmax).astype(fmt)
        r, m = _arrange(q, fsdp_dims[i], a, f)
        rows.append(r)
        meta.append((i, r.shape[1], m))
    q_NxC = jnp.concatenate(rows, axis=1)
    recv_NxC = lax.all_to_all(to_wire(q_NxC, wire), dp_axes, 0, 0, tiled=True)
    # Add the N replicas' FP8 values in f32: no overflow, no FP8 rounding per addition.
    acc_C = from_wire(recv_NxC, fmt, wire).astype(jnp.float32).sum(axis=0)
    # |acc / N| <= fmax, so the sum re-quantizes (same format and scale) without clipping;
    # N moves into the inverse scale below.
    q_C = jnp.clip(acc_C / n, -fmax, fmax).astype(fmt)
    n_sharded = sum(1 for i, _, _ in meta if fsdp_dims[i] is not None)
    c_sharded = sum(k for _, k, _ in meta[:n_sharded])
    parts = {}
    if n_sharded:
        part = q_C[:c_sharded]
        if a > 1:
            got = lax.all_gather(to_wire(part, wire), replica_axes, axis=0, tiled=False)
            parts["sharded"] = from_wire(got, fmt, wire)  # [A, c_sharded]
        else:
            parts["sharded"] = part[None]
    if n_sharded < len(meta):
        got = lax.all_gather(to_wire(q_C[c_sharded:], wire), dp_axes, axis=0, tiled=False)
        parts["replicated"] = from_wire(got, fmt, wire)  # [N, c_replicated]
    off = {"sharded": 0, "replicated": 0}
    out = [None] * len(g_leaves)
    for i, k, m in meta:
        key = "sharded" if fsdp_dims[i] is not None else "replicated"
        piece = parts[key][:, off[key] : off[key] + k]
        off[key] += k
        g = g_leaves[i]
        if fsdp_dims[i] is None:
            q = piece.reshape(-1)[:m].reshape(g.shape)
        else:
            local = list(g.shape)
            local[fsdp_dims[i]] //= f
            q = _unarrange_sharded(piece, m, local, fsdp_dims[i], f)
        out[i] = q.astype(jnp.float32) * per_layer(n / scales[i], q.ndim)
    return out, sum(clipped)


def reduces_in_fp8(path: tuple[str, ...], elements: int, cfg: CommConfig) -> bool:
    """Whether the gradient of the param at ``path`` (``elements`` per layer) is reduced in FP8:
    ``cfg.min_fp8_size`` elements or more, and not of an ``optim.master.F32_LAYERS`` layer."""
    return elements >= cfg.min_fp8_size and not set(path) & set(F32_LAYERS)


def reduce_f32(
    g: jax.Array, fsdp_dim: int | None, replica_axes: tuple[str, ...] = REPLICA_AXES
) -> jax.Array:
    """Sum this replica's gradient over the data-parallel axes in f32 (a small one: norms,
    biases), keeping only this device's fsdp shard of a sharded parameter (``replica_axes``
    as for ``reduce_fp8``)."""
    g = g.astype(jnp.float32)
    if fsdp_dim is None:
        return lax.psum(g, (*replica_axes, "fsdp"))
    g = lax.psum_scatter(g, "fsdp", scatter_dimension=fsdp_dim, tiled=True)
    return lax.psum(g, replica_axes)


def expert_slice(g: jax.Array, expert_dim: int | None, shards: int) -> jax.Array:
    """This device's experts of a reduced gradient whose ``expert_dim`` is split over 'expert'."""
    if expert_dim is None or shards == 1:
        return g
    size = g.shape[expert_dim] // shards
    return lax.dynamic_slice_in_dim(g, lax.axis_index("expert") * size, size, expert_dim)


def reduce_gradients(grads_N, mu: jax.Array, plan: Plan):
    """Sum replica gradients ``[N, *param]`` in FP8: (f32 grads like the params, clipped share)."""
    # fsdp-sharded parameters get only their shard back (a reduce-scatter). A non-finite
    # gradient anywhere stays non-finite (NaN), so the train step skips the update as usual.
    mesh, cfg = plan.mesh, plan.cfg
    wire = wire_format(mesh, cfg)
    flat, treedef = jax.tree_util.tree_flatten_with_path(grads_N)
    leaves = [x for _, x in flat]
    specs = treedef.flatten_up_to(plan.specs)
    stacks = treedef.flatten_up_to(plan.stack_ndims)
    fsdp_dims = [sharding_lib.axis_dim(s, "fsdp") for s in specs]
    # Experts split over 'expert' in the step come as each device's own (reduced over the
    # devices holding the same experts); replicas holding every expert keep their slice after.
    axes_of = [plan.replica_axes(s) for s in specs]
    expert_dims = [
        None if plan.splits_experts(s) else sharding_lib.axis_dim(s, "expert") for s in specs
    ]
    shards = int(mesh.shape["expert"])
    # Full (global) element counts decide FP8 vs f32 identically on every device.
    use_fp8 = [reduces_in_fp8(path_key(p), math.prod(x.shape[1:]), cfg) for p, x in flat]
    groups = _layer_groups(grads_N) if cfg.bucket_by_layer else [list(range(len(leaves)))]
    # One bucket per layer (cfg.bucket_by_layer): a layer's gradients can travel while the
    # backward pass still works on the layers below it; the scales are per tensor either way.
    # A bucket's leaves share their replicas: a layer's own experts travel in a bucket of theirs.
    fp8_buckets = [
        b
        for ids in groups
        for axes in dict.fromkeys(axes_of[i] for i in ids)
        if (b := [i for i in ids if use_fp8[i] and axes_of[i] == axes])
    ]

    def body(mu, *g_leaves):
        g_leaves = [x[0] for x in g_leaves]  # this replica's gradient (local tensor shard)
        out = [None] * len(g_leaves)
        clipped = []
        for ids in fp8_buckets:
            pick = lambda xs, ids=ids: [xs[i] for i in ids]
            axes = axes_of[ids[0]]
            mesh_shape = (math.prod(int(mesh.shape[a]) for a in axes), int(mesh.shape["fsdp"]))
            got, c = reduce_fp8(
                pick(g_leaves), pick(fsdp_dims), pick(stacks), mu, cfg, mesh_shape, wire, axes
            )
            for i, x in zip(ids, got, strict=True):
                out[i] = x
            clipped.append(c)
        saturated = sum(clipped).astype(jnp.float32) if clipped else jnp.zeros((), jnp.float32)
        count = jnp.asarray(sum(g_leaves[i].size for i, u in enumerate(use_fp8) if u), jnp.float32)
        for i, g in enumerate(g_leaves):  # small gradients (norms, biases) in f32
            if not use_fp8[i]:
                out[i] = reduce_f32(g, fsdp_dims[i], axes_of[i])
        out = [expert_slice(x, d, shards) for x, d in zip(out, expert_dims, strict=True)]
        saturated = lax.psum(saturated, MESH_AXES) / jnp.maximum(lax.psum(count, MESH_AXES), 1.0)
        return saturated, *out

    in_specs = (P(), *[plan.replica_spec(s) for s in specs])
    out_specs = (P(), *specs)
    fn = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    saturated, *reduced = fn(jnp.asarray(mu, jnp.float32), *leaves)
    return treedef.unflatten(reduced), saturated


__all__ = [
    "EXPERT_REPLICA_AXES",
    "GATHERS",
    "GRAD_FORMATS",
    "INTERVALS",
    "WIRES",
    "CommConfig",
    "Plan",
    "amax_stacked",
    "expert_slice",
    "from_wire",
    "has_replicas",
    "init_state",
    "make_plan",
    "next_mu",
    "per_device",
    "per_layer",
    "reduce_f32",
    "reduce_fp8",
    "reduce_gradients",
    "reduces_in_fp8",
    "to_wire",
    "wire_format",
]
