"""ZeRO-3 in time: each layer's fsdp-sharded weights are gathered just before the layer runs and
its weight gradients reduce-scattered as soon as the backward pass has made them.

The train step's per-device replicas (``trainer.replicas``) get the params still sharded. The
model's blocks and the leaves outside them (embedding, final norm, head) each pass their
params through a custom VJP whose forward all-gathers the layer's shards (at O3
an FP8 layer's kernel as E4M3 with the layer's weight scale, as ``gather.gather_params`` moves
it; under the block recipe as E4M3 tiles with their scales, ``block_gather``; the other kernels
and embeddings in the compute dtype) and whose backward sums every
replica's gradient of that layer into this device's shard (``comm.reduce_fp8``: E5M2 with a
shared scale and f32 accumulation; small gradients in f32). Under remat the gather sits inside
the remat region, so the backward pass gathers the layer again instead of keeping it; a remat
policy saving ``ops.remat.GATHERED`` keeps it (``model.remat_policy='full_keep_gathered'``).
At most the layers in flight hold full weights, and no full-size gradient outlives its layer's
backward. On a mesh with an 'expert' axis a block's routed experts stay split over it: each
device gathers its own experts over fsdp only, and their gradients sum over the devices holding
the same experts ('data' x fsdp) while the block's other weights sum over every replica.

The custom VJP needs per-layer inputs the model does not have: the weight scales and FP8-LM's
``mu``. They travel as extra params under ``GATHER_KEY`` of each group (sliced per layer by the
model's ``nn.scan`` like any other param); a zero ``stats`` entry among them receives the layer's
clipped-value count as its gradient, so the step reads the saturation of the reduction from
the gradients.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
import re
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from fp8jax._tree import path_key
from fp8jax.ops import block_cast, formats, scaling
from fp8jax.ops.remat import GATHERED
from fp8jax.parallel import comm
from fp8jax.parallel import sharding as sharding_lib
from fp8jax.parallel.gather import find_meta, moves_in_compute_dtype

GATHER_KEY = "fp8jax_gather"  # a group's extra params: {'mu', 'stats', 'scales'}
ROOT = ""  # the group of the leaves outside the blocks
_BLOCK = re.compile(r"blocks|block_\d+")  # the model's block scopes (scanned or unrolled)


@dataclasses.dataclass(frozen=True)
class LeafInfo:
    """How one parameter of a group is gathered and its gradient reduced (static)."""

    path: tuple[str, ...]  # within the group's params
    fsdp_dim: int | None  # dimension of the per-layer tensor sharded over fsdp (None: whole)
    fp8: bool  # O3 FP8 kernel: moves as E4M3 with its layer's weight scale
    cast: bool  # moves in the compute dtype (the layer's first cast, moved before the gather)
    fp8_grad: bool  # its gradient is reduced in FP8 (comm.min_fp8_size elements or more)
    # The data-parallel axes whose devices hold the same values of it besides fsdp's: 'data' x
    # 'expert', or 'data' alone for routed experts split over 'expert' (``Plan.replica_axes``).
    replica_axes: tuple[str, ...] = sharding_lib.REPLICA_AXES
    # O3 block-recipe kernel sharded on its first or last axis at tile boundaries: moves as E4M3
    # tiles with their inverse scales and amaxes (``block_gather``); None otherwise.
    blocks: scaling.Recipe | None = None


@dataclasses.dataclass(frozen=True)
class Group:
    """A layer's parameters and the mesh they are gathered over (static, hashable)."""

    leaves: tuple[LeafInfo, ...]
    mesh_shape: tuple[int, int]  # (data, fsdp)
    expert: int  # the 'expert' axis's size (its shards hold other experts, the same rest)
    cfg: comm.CommConfig
    wire: str
    compute_dtype: str


_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("fp8jax_layerwise", default=None)


@contextlib.contextmanager
def active(groups: dict[str, Group]) -> Iterator[None]:
    """Within it, the model gathers each group (a block scope, or ``ROOT``) where it runs."""
    token = _ACTIVE.set(groups)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def block_view(name: str):
    """The ``nn.map_variables`` input function gathering block ``name``'s params, or None."""
    groups = _ACTIVE.get()
    if not groups or name not in groups:
        return None
    return functools.partial(_view, groups[name])


def wrap_model(model: nn.Module) -> nn.Module:
    """``model`` with its ``ROOT`` group gathered when it is applied (blocks gather their own)."""
    groups = _ACTIVE.get()
    if not groups or ROOT not in groups:
        return model
    cls = nn.map_variables(type(model), "params", functools.partial(_view, groups[ROOT]))
    return cls(
        **{
            f.name: getattr(model, f.name)
            for f in dataclasses.fields(model)
            if f.init and f.name not in ("parent", "name")
        }
    )


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def _set(tree, path, value):
    """A copy of nested dict ``tree`` with ``path`` set to ``value``."""
    if not path:
        return value
    out = dict(tree)
    out[path[0]] = _set(tree[path[0]], path[1:], value)
    return out


def _view(group: Group, variables):
    """The group's variables with its params gathered (and ``GATHER_KEY`` removed)."""
    variables = dict(variables)
    params = dict(variables["params"])
    extra = params.pop(GATHER_KEY)
    leaves = tuple(_get(params, li.path) for li in group.leaves)
    scales = tuple(extra["scales"][_scale_key(li.path)] for li in group.leaves if li.fp8)
    dtypes = tuple(jnp.dtype(x.dtype).name for x in leaves)
    full = _gather_fn(group, dtypes)(leaves, scales, extra["mu"], extra["stats"])
    for li, x in zip(group.leaves, full, strict=True):
        if li.fsdp_dim is not None:
            x = checkpoint_name(x, GATHERED)
        params = _set(params, li.path, x)
    variables["params"] = params
    return variables


def _scale_key(path: tuple[str, ...]) -> str:
    return "/".join(path)


def block_gather(layer_shape: tuple[int, ...], fsdp_dim: int, fsdp: int, recipe) -> bool:
    """Whether an O3 kernel of ``layer_shape`` (one layer's), sharded ``fsdp`` ways on
    ``fsdp_dim``, can move as its block recipe's E4M3 tiles.

    The FP8 matmul tiles a kernel as [contracted axes, free axes]. A kernel sharded on its first
    axis is taken to contract that axis alone (a projection from the residual stream, as
    fp8jax's models' q/kv and MLP-in kernels do) and one sharded on its last axis to keep that
    axis alone free (a projection into it: o, MLP-out), so a shard is whole rows or columns of
    that matrix; with a shard a whole number of tiles wide, the shard's tiles are the weight's.
    """
    tile = recipe.weight_tile
    if tile is None or len(layer_shape) < 2:
        return False
    if fsdp_dim not in (0, len(layer_shape) - 1):
        return False
    return (layer_shape[fsdp_dim] // fsdp) % tile == 0


def kernel_matrix(w: jax.Array, fsdp_dim: int) -> jax.Array:
    """One layer's kernel sharded on ``fsdp_dim`` (its first or last axis) as the FP8 matmul's
    [K, N] matrix, as ``block_gather`` takes it."""
    return w.reshape(w.shape[0], -1) if fsdp_dim == 0 else w.reshape(-1, w.shape[-1])


def _gathered_blocks(group: Group, li: LeafInfo, w):
    """A block-recipe kernel gathered as E4M3 tiles; handed over in f32 so that the matmul's
    quantization gives back the gathered tiles and their scales bit for bit."""
    recipe, axis = li.blocks, 0 if li.fsdp_dim == 0 else 1
    b = recipe.weight_tile
    w_KxN = kernel_matrix(w.astype(jnp.dtype(group.compute_dtype)), li.fsdp_dim)
    # E4M3 (the block recipe's weight format) per T x T tile, as the matmul quantizes it: the
    # shard's tiles are whole tiles of the weight, so these are the weight's own.
    q, inv, _ = block_cast.quantize_blocks(w_KxN, formats.E4M3, b, recipe)
    amax = block_cast.block_amaxes(w_KxN, b)
    got = lax.all_gather(comm.to_wire(q, group.wire), "fsdp", axis=axis, tiled=True)
    inv, amax = (lax.all_gather(t, "fsdp", axis=axis, tiled=True) for t in (inv, amax))
    q = comm.from_wire(got, formats.E4M3, group.wire)
    w_full = block_cast.requantizable_blocks(q, inv, amax, b)
    shape = list(w.shape)
    shape[li.fsdp_dim] *= group.mesh_shape[1]
    return w_full.reshape(shape)


def gathered(group: Group, leaves, scales):
    """One layer's ``leaves`` whole on this device, its fsdp shards all-gathered (inside a
    ``shard_map`` over the mesh; ``scales``: the weight scales of its per-tensor FP8 kernels)."""
    compute = jnp.dtype(group.compute_dtype)
    scales = iter(scales)
    out = []
    for li, w in zip(group.leaves, leaves, strict=True):
        if li.fsdp_dim is None:
            out.append(w)
            continue
        if li.blocks is not None:
            out.append(_gathered_blocks(group, li, w))
            continue
        if li.fp8:
            s = next(scales)
            w_c = w.astype(compute)  # what the layer hands its FP8 matmul
            # E4M3 (the FP8 matmul's weight format) with the scale that matmul will use: its
            # re-quantization of the gathered weight lands exactly on the gathered bytes.
            q = formats.quantize(w_c, s, formats.E4M3)
            got = lax.all_gather(comm.to_wire(q, group.wire), "fsdp", axis=li.fsdp_dim, tiled=True)
            w_full = comm.from_wire(got, formats.E4M3, group.wire).astype(jnp.float32) / s
            out.append(w_full.astype(compute))
            continue
        w = w.astype(compute) if li.cast else w
        out.append(lax.all_gather(w, "fsdp", axis=li.fsdp_dim, tiled=True))
    return tuple(out)


def _replicas(group: Group, axes: tuple[str, ...]) -> int:
    """How many devices the replica ``axes`` span (fsdp aside)."""
    sizes = {"data": group.mesh_shape[0], "expert": group.expert}
    return math.prod(sizes[a] for a in axes)


def _reduced(group: Group, cts, mu):
    """Backward: each leaf's gradient summed over the replicas, this device's shard of it.

    One FP8 reduction per set of replica axes: a layer's routed experts split over 'expert'
    sum over 'data' x fsdp (the devices holding the same experts), the rest over every replica.
    """
    out = [None] * len(cts)
    clipped = jnp.zeros((), jnp.float32)
    fp8_ids = [i for i, li in enumerate(group.leaves) if li.fp8_grad]
    for axes in dict.fromkeys(group.leaves[i].replica_axes for i in fp8_ids):
        ids = [i for i in fp8_ids if group.leaves[i].replica_axes == axes]
        got, c = comm.reduce_fp8(
            [cts[i] for i in ids],
            [group.leaves[i].fsdp_dim for i in ids],
            [0] * len(ids),  # one layer: one scale per tensor
            mu,
            group.cfg,
            (_replicas(group, axes), group.mesh_shape[1]),
            group.wire,
            axes,
        )
        for i, g in zip(ids, got, strict=True):
            out[i] = g
        clipped = clipped + c.astype(jnp.float32)
    for i, li in enumerate(group.leaves):
        if not li.fp8_grad:
            out[i] = comm.reduce_f32(cts[i], li.fsdp_dim, li.replica_axes)
    return out, clipped


@functools.cache
def _gather_fn(group: Group, dtypes: tuple[str, ...]):
    """``gather(leaves, scales, mu, stats) -> full leaves``: all-gather forward, reduce-scatter
    backward (``stats``' cotangent: the clipped-value count)."""

    @jax.custom_vjp
    def gather(leaves, scales, mu, stats):
        return gathered(group, leaves, scales)

    def fwd(leaves, scales, mu, stats):
        return gathered(group, leaves, scales), (scales, mu, stats)

    def bwd(res, cts):
        scales, mu, stats = res
        grads, clipped = _reduced(group, cts, mu)
        grads = tuple(g.astype(d) for g, d in zip(grads, dtypes, strict=True))
        zeros = tuple(jnp.zeros_like(s) for s in scales)
        return grads, zeros, jnp.zeros_like(mu), clipped.astype(stats.dtype)

    gather.defvjp(fwd, bwd)
    return gather


def group_of(path: tuple[str, ...]) -> str:
    """The group a param path belongs to: its block scope, or ``ROOT``."""
    return path[0] if path and _BLOCK.fullmatch(path[0]) else ROOT


def prepare(params, fp8_state, plan: comm.Plan, mu: jax.Array):
    """``(params with GATHER_KEY extras, their PartitionSpecs, groups, {kernel path: global
    weight amax}, FP8-reduced gradient elements per replica)`` for the per-layer step."""
    cfg, mesh = plan.cfg, plan.mesh
    mesh_shape = (int(mesh.shape["data"]), int(mesh.shape["fsdp"]))
    shards = int(mesh.shape["expert"])
    wire = comm.wire_format(mesh, cfg)
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    specs = treedef.flatten_up_to(plan.specs)
    stacks = treedef.flatten_up_to(plan.stack_ndims)
    members: dict[str, list] = {}
    scales: dict[str, dict] = {}
    stack_of: dict[str, int] = {}
    w_amax, count = {}, 0
    for (p, w), spec, stack in zip(flat, specs, stacks, strict=True):
        path = path_key(p)
        g = group_of(path)
        rel = path[1:] if g != ROOT else path
        stack_of[g] = max(stack_of.get(g, 0), stack if g != ROOT else 0)
        dim = sharding_lib.axis_dim(spec, "fsdp")
        per_layer = math.prod(w.shape[stack:]) if g != ROOT else w.size
        fp8_grad = comm.reduces_in_fp8(path, per_layer, cfg)
        # Elements each replica quantizes: its own experts only where they stay split.
        count += w.size // (shards if plan.splits_experts(spec) else 1) if fp8_grad else 0
        fp8, blocks = False, None
        layer_dim = None if dim is None else dim - (stack if g != ROOT else 0)
        if plan.level >= 3 and dim is not None and path[-1] == "kernel":
            meta = find_meta(fp8_state, path)
            layer_shape = w.shape[stack:] if g != ROOT else w.shape
            if meta is not None and block_gather(
                layer_shape, layer_dim, mesh_shape[1], meta.w.recipe
            ):
                blocks = meta.w.recipe
            # Rowwise scales, and tiles a shard would cut, come from the gathered weight itself:
            # those kernels move in the compute dtype.
            elif meta is not None and meta.w.recipe.per_tensor:
                fp8 = True
                w_c = w.astype(plan.compute_dtype)
                amax = comm.amax_stacked(w_c, stack)  # global: over every shard
                w_amax[path] = amax
                scales.setdefault(g, {})[_scale_key(rel)] = scaling.use_scale(meta.w, amax)
        cast = moves_in_compute_dtype(path)
        axes = plan.replica_axes(spec)
        leaf = LeafInfo(rel, layer_dim, fp8, cast, fp8_grad, axes, blocks)
        members.setdefault(g, []).append(leaf)
    groups = {
        g: Group(tuple(ls), mesh_shape, shards, cfg, wire, jnp.dtype(plan.compute_dtype).name)
        for g, ls in members.items()
    }
    out = dict(params)
    out_specs = plan.specs  # extended below without mutating it
    rep = jax.sharding.PartitionSpec()
    for g in groups:
        lead = () if g == ROOT else _lead_shape(params[g], stack_of[g])
        mu_g = jnp.broadcast_to(jnp.asarray(mu, jnp.float32), lead)
        extra = {"mu": mu_g, "stats": jnp.zeros(lead, jnp.float32), "scales": scales.get(g, {})}
        extra_specs = jax.tree.map(lambda _: rep, extra)
        if g == ROOT:
            out[GATHER_KEY] = extra
            out_specs = {**out_specs, GATHER_KEY: extra_specs}
        else:
            out[g] = {**params[g], GATHER_KEY: extra}
            out_specs = {**out_specs, g: {**out_specs[g], GATHER_KEY: extra_specs}}
    return out, out_specs, groups, w_amax, count


def _lead_shape(tree, stack: int) -> tuple[int, ...]:
    return tuple(jax.tree.leaves(tree)[0].shape[:stack])


def split_grads(grads) -> tuple[dict, jax.Array]:
    """``(grads without the GATHER_KEY extras, clipped values summed over the groups)``."""
    grads = dict(grads)
    clipped = [jnp.sum(grads.pop(GATHER_KEY)["stats"])] if GATHER_KEY in grads else []
    for k, v in list(grads.items()):
        if isinstance(v, dict) and GATHER_KEY in v:
            v = dict(v)
            clipped.append(jnp.sum(v.pop(GATHER_KEY)["stats"]))
            grads[k] = v
    return grads, sum(clipped) if clipped else jnp.zeros((), jnp.float32)


__all__ = [
    "GATHER_KEY",
    "Group",
    "LeafInfo",
    "ROOT",
    "active",
    "block_gather",
    "block_view",
    "gathered",
    "group_of",
    "kernel_matrix",
    "prepare",
    "split_grads",
    "wrap_model",
]
