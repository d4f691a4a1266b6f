"""FSDP weight gathers: parameters sharded over ``fsdp`` are all-gathered before the forward pass,
kernels and embeddings in the model's compute dtype (the layers' own first cast, moved before
the gather), the rest in their stored dtype. At O3 the matmul kernels of FP8 layers are
quantized to E4M3 with the layer's own weight scale on their shard first, so only FP8 bytes
move (in ``fp8jax.parallel.comm``'s wire format); under the rowwise and block recipes, whose
scales come from the gathered weight, they move in the compute dtype here (the per-layer gather,
``parallel.layerwise``, moves block-recipe kernels as E4M3 tiles). The gathered FP8
weight is handed to the model dequantized; the FP8 matmul re-quantizes it with the same scale,
which lands exactly on the gathered FP8 values (the round trip's error is far below half an
E4M3 step), so the GEMM sees the gathered bytes.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from fp8jax._tree import path_key
from fp8jax.ops import formats, scaling
from fp8jax.optim.master import F32_LAYERS, fp8_op_name
from fp8jax.parallel import sharding as sharding_lib
from fp8jax.parallel.comm import Plan, amax_stacked, from_wire, per_layer, to_wire, wire_format
from fp8jax.parallel.sharding import MESH_AXES

P = PartitionSpec
# Parameters the model uses only cast to its compute dtype (flax's Dense and Embed promote
# kernel and table to ``dtype``); norm scales, biases and the rest keep their own dtype, and so
# do the kernels of ``optim.master.F32_LAYERS`` (an MoE router and shared gate compute in f32).
COMPUTE_DTYPE_LEAVES = ("kernel", "embedding")


def moves_in_compute_dtype(path: tuple[str, ...]) -> bool:
    """Whether the leaf at ``path`` is gathered in the compute dtype (else in its own)."""
    return path[-1] in COMPUTE_DTYPE_LEAVES and not set(path) & set(F32_LAYERS)


def find_meta(fp8_state, path: tuple[str, ...]):
    """The ``Fp8Meta`` of the FP8 matmul owning kernel ``path`` (None if it is not FP8)."""
    op = fp8_op_name(fp8_state, path[:-1])
    if op is None:
        return None
    node = fp8_state
    for k in (*path[:-1], op):
        node = node[k]
    return node["meta"]


def gather_params(params, fp8_state, plan: Plan):
    """(fsdp-gathered params, {kernel path: global amax}); O3's FP8 kernels move as E4M3, the
    other kernels and embeddings in the compute dtype."""
    # FP8-gathered kernels come back in the model's compute dtype, the rest in their own. Their
    # true amax (per layer) replaces the one the matmul records from the gathered copy, so the
    # weight scales evolve exactly as on one device.
    mesh = plan.mesh
    f = int(mesh.shape["fsdp"])
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    specs = treedef.flatten_up_to(plan.specs)
    stacks = treedef.flatten_up_to(plan.stack_ndims)
    todo = [
        i for i, s in enumerate(specs) if f > 1 and sharding_lib.axis_dim(s, "fsdp") is not None
    ]
    if not todo:
        return params, {}
    wire = wire_format(mesh, plan.cfg)
    paths = [path_key(p) for p, _ in flat]
    metas = {}
    if plan.level >= 3:
        for i in todo:
            if paths[i][-1] == "kernel":
                meta = find_meta(fp8_state, paths[i])
                # Fine-grained recipes scale each tile from the gathered weight itself: their
                # kernels travel in the compute dtype, exactly what the matmul then quantizes.
                if meta is not None and meta.w.recipe.per_tensor:
                    metas[i] = meta.w  # the weight's ScaleState

    def body(*args):
        ws, meta_list = args[: len(todo)], args[len(todo) :]
        meta_of = dict(zip(sorted(metas), meta_list, strict=True))
        outs, amaxes = [], []
        for i, w in zip(todo, ws, strict=True):
            dim = sharding_lib.axis_dim(specs[i], "fsdp")
            if i not in meta_of:
                if moves_in_compute_dtype(paths[i]):
                    # The layer casts this leaf to the compute dtype first thing, so gathering
                    # the cast shard moves the same values in half the bytes of f32 (O1's f32
                    # params; O2+ hands over compute-dtype views already).
                    w = w.astype(plan.compute_dtype)
                outs.append(lax.all_gather(w, "fsdp", axis=dim, tiled=True))
                continue
            meta = meta_of[i]
            w_c = w.astype(plan.compute_dtype)  # what the layer hands its FP8 matmul
            amax = lax.pmax(amax_stacked(w_c, stacks[i]), MESH_AXES)  # global, per layer
            s = per_layer(scaling.use_scale(meta, amax), w.ndim)
            # E4M3 (the FP8 matmul's weight format), with the scale that matmul will use,
            # from the compute dtype exactly as the matmul quantizes it.
            q = formats.quantize(w_c, s, formats.E4M3)
            got = lax.all_gather(to_wire(q, wire), "fsdp", axis=dim, tiled=True)
            # Handed over in the compute dtype (what the layer casts its kernel to anyway): the
            # FP8 matmul's re-quantization with scale s then lands exactly on the gathered bytes.
            w_full = from_wire(got, formats.E4M3, wire).astype(jnp.float32) / s
            outs.append(w_full.astype(plan.compute_dtype))
            amaxes.append(amax)
        return *outs, *amaxes

    leaves = [flat[i][1] for i in todo]
    meta_args = [metas[i] for i in sorted(metas)]
    in_specs = (*[specs[i] for i in todo], *[jax.tree.map(lambda _: P(), m) for m in meta_args])
    out_specs = (
        *[sharding_lib.drop_axis(specs[i], "fsdp") for i in todo],
        *[P() for _ in metas],
    )
    fn = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    res = fn(*leaves, *meta_args)
    full = [x for _, x in flat]
    for i, x in zip(todo, res[: len(todo)], strict=True):
        full[i] = x
    w_amax = {paths[i]: am for i, am in zip(sorted(metas), res[len(todo) :], strict=True)}
    return treedef.unflatten(full), w_amax


def set_weight_amax(fp8_state, w_amax: dict):
    """Put the true global weight amaxes into the FP8 state's pending slots."""
    if not w_amax:
        return fp8_state

    def rebuild(node, prefix):
        if not isinstance(node, Mapping):
            return node
        out = {}
        for k, v in node.items():
            out[k] = rebuild(v, prefix + (k,))
        for kernel_path, amax in w_amax.items():
            # w_amax holds only kernels find_meta found an FP8 matmul for, so name is set.
            name = fp8_op_name(out, ()) if kernel_path[:-1] == prefix else None
            if name is not None:
                meta = out[name]["meta"]
                hist = meta.w.amax_history.at[..., 0].set(amax)
                w = meta.w.replace(amax_history=hist)
                out[name] = {**out[name], "meta": meta.replace(w=w)}
        return out

    return rebuild(fp8_state, ())


__all__ = [
    "COMPUTE_DTYPE_LEAVES",
    "find_meta",
    "gather_params",
    "moves_in_compute_dtype",
    "set_weight_amax",
]
