"""Device mesh, the one rules table mapping logical axis names to mesh axes, state shardings.

Mesh axes: ``data`` (pure data parallel: params replicated), ``expert`` (expert parallel: the
routed experts of MoE layers split over it, tokens sent to their experts' shard by all-to-all,
``fp8jax.parallel.expert``), ``fsdp`` (data parallel with params, master weights and optimizer
state sharded, ZeRO-3 style) and ``tensor`` (Megatron tensor parallel). The batch is split over
``data`` x ``expert`` x ``fsdp`` (the expert axis carries tokens too, as in GShard); these are the
data-parallel axes over which gradients are reduced (in FP8 at O1+, see ``fp8jax.parallel.comm``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from fp8jax._tree import path_key
from fp8jax.optim import master

__all__ = [
    "ACTIVATION_RULES",
    "DP_AXES",
    "MESH_AXES",
    "REPLICA_AXES",
    "RULES",
    "activation_sharding",
    "axis_dim",
    "batch_sharding",
    "boxed_params",
    "constrain",
    "dp_size",
    "drop_axis",
    "expert_axis_size",
    "expert_shards",
    "fit_spec",
    "keep_axis",
    "initialize_distributed",
    "logical_shardings",
    "make_mesh",
    "param_logical_names",
    "param_specs",
    "put_batch",
    "replicated",
    "state_shardings",
    "within_replica",
]

MESH_AXES = ("data", "expert", "fsdp", "tensor")
DP_AXES = ("data", "expert", "fsdp")  # the batch is split over these; gradients reduced over them
# The data-parallel axes that hold parameters whole (but for the experts, see RULES): replica
# r = (data, expert) index a, fsdp index b, in the order a * fsdp + b of DP_AXES.
REPLICA_AXES = ("data", "expert")

# Logical axis -> mesh axis (None = replicated). Parameters: 'embed' is sharded over fsdp
# (ZeRO-3 style), 'mlp'/'heads'/'kv_heads'/'vocab' over tensor: column-parallel q/kv/wi split
# their output features, row-parallel o/wo their input features (Megatron), so each shard runs
# its own FP8 GEMM and only the row-parallel outputs are summed across 'tensor'. 'expert' (the
# stacked routed experts of an MoE layer) over expert.
RULES = (
    ("batch", DP_AXES),
    ("length", None),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("vocab", "tensor"),
    ("layers", None),
    ("norm", None),
    ("expert", "expert"),
)


# Activations: the batch is split over data x fsdp, and 'embed' (fsdp for parameters) is not
# split again: fsdp already splits the rows.
ACTIVATION_RULES = tuple((name, None if name == "embed" else axes) for name, axes in RULES)

# The mesh and rules the model's activation constraints bind to while a step is traced; None
# (the default: init, sampling, tests of the bare model) leaves them inert.
_ACTIVATIONS: contextvars.ContextVar = contextvars.ContextVar("fp8jax_activations", default=None)


@contextlib.contextmanager
def activation_sharding(mesh: Mesh | None, rules=ACTIVATION_RULES):
    """Bind the model's activation constraints (``constrain``) to ``mesh`` with ``rules``."""
    token = _ACTIVATIONS.set(None if mesh is None or mesh.size == 1 else (mesh, tuple(rules)))
    try:
        yield
    finally:
        _ACTIVATIONS.reset(token)


# The size of the mesh's 'expert' axis while the model runs per device inside a manual region
# (the train step's per-device replicas) whose collectives may name that axis; 1 elsewhere.
_EXPERT_SHARDS: contextvars.ContextVar = contextvars.ContextVar("fp8jax_expert", default=1)


@contextlib.contextmanager
def expert_shards(mesh: Mesh | None):
    """Let MoE layers dispatch over ``mesh``'s 'expert' axis (inside a fully manual region)."""
    size = 1 if mesh is None else int(dict(mesh.shape).get("expert", 1))
    token = _EXPERT_SHARDS.set(size)
    try:
        yield
    finally:
        _EXPERT_SHARDS.reset(token)


def expert_axis_size() -> int:
    """Shards of the 'expert' axis the model's MoE layers dispatch over here (1: none)."""
    return _EXPERT_SHARDS.get()


def within_replica(rules=ACTIVATION_RULES):
    """``rules`` for inside a vmapped replica: its own batch rows are not split again."""
    return tuple((name, None if name == "batch" else axes) for name, axes in rules)


def constrain(x: jax.Array, names: tuple) -> jax.Array:
    """Constrain an activation's layout by logical axis names (inert outside a bound step).

    Without it XLA propagates the weights' fsdp shardings into activations as it likes: on
    GPUs q, k and v then reach cuDNN attention with different shardings, which its partitioner
    rejects.
    """
    bound = _ACTIVATIONS.get()
    if bound is None:
        return x
    mesh, rules = bound
    spec = fit_spec(nn.logical_to_mesh_axes(names, rules), x.shape, mesh)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def make_mesh(mesh_spec, devices=None) -> Mesh:
    """Mesh ('data', 'expert', 'fsdp', 'tensor') from axis sizes (a ``spec.MeshSpec``:
    ``.data``, ``.expert``, ``.fsdp``, ``.tensor``); -1 takes the remaining devices."""
    devices = list(devices if devices is not None else jax.devices())
    sizes = [int(getattr(mesh_spec, axis)) for axis in MESH_AXES]
    named = dict(zip(MESH_AXES, sizes, strict=True))
    if sizes.count(-1) > 1:
        raise ValueError(f"mesh sizes {named}: at most one of data/fsdp/tensor may be -1")
    known = int(np.prod([s for s in sizes if s != -1]))
    if -1 in sizes:
        if known <= 0 or len(devices) % known:
            raise ValueError(
                f"mesh {named} does not divide {len(devices)} devices; "
                f"set config.mesh sizes whose product divides the device count"
            )
        sizes[sizes.index(-1)] = len(devices) // known
    if int(np.prod(sizes)) != len(devices):
        named = dict(zip(MESH_AXES, sizes, strict=True))
        raise ValueError(
            f"mesh {named} needs {int(np.prod(sizes))} devices but "
            f"{len(devices)} are available; fix config.mesh (use -1 for 'the rest')"
        )
    return Mesh(np.array(devices).reshape(sizes), MESH_AXES)


def initialize_distributed() -> None:
    """``jax.distributed.initialize`` from the cluster (Slurm, MPI, k8s, TPU) or JAX_* vars."""
    # Without a cluster manager set JAX_COORDINATOR_ADDRESS (host:port of process 0),
    # JAX_NUM_PROCESSES and JAX_PROCESS_ID on every process; JAX reads only the first itself.
    # On CPU hosts the cross-process collectives go through gloo.
    if jax.config.values.get("jax_cpu_collectives_implementation", "gloo") in (None, "none"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs = {}
    if "JAX_NUM_PROCESSES" in os.environ:
        kwargs["num_processes"] = int(os.environ["JAX_NUM_PROCESSES"])
    if "JAX_PROCESS_ID" in os.environ:
        kwargs["process_id"] = int(os.environ["JAX_PROCESS_ID"])
    jax.distributed.initialize(**kwargs)


def dp_size(mesh: Mesh) -> int:
    """Number of data-parallel replicas (data x expert x fsdp)."""
    return int(np.prod([mesh.shape[a] for a in DP_AXES]))


def logical_shardings(abstract_boxed, mesh: Mesh, rules=RULES):
    """NamedShardings for a tree whose leaves may carry logical partitioning metadata."""
    specs = nn.get_partition_spec(abstract_boxed)
    return nn.logical_to_mesh_sharding(specs, mesh, rules)


def replicated(mesh: Mesh) -> NamedSharding:
    """Sharding that keeps a full copy on every device."""
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batch dimension split over the data-parallel axes (data x expert x fsdp)."""
    return NamedSharding(mesh, PartitionSpec(DP_AXES))


def put_batch(batch, sharding: NamedSharding):
    """Place a host batch on the mesh; with several processes ``batch`` is this process's rows."""
    # fp8jax.trainer.data yields each process its own rows of the global batch; the global array is
    # assembled from every process's rows.
    if jax.process_count() == 1:
        return jax.device_put(batch, sharding)
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x)), batch
    )


def _mesh_axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple | list) else (entry,)


def fit_spec(spec: PartitionSpec, shape, mesh: Mesh) -> PartitionSpec:
    """``spec`` without mesh axes that do not divide their dimension (or have size 1)."""
    # e.g. 2 key/value heads on a 4-way 'tensor' axis stay replicated instead of failing.
    entries = list(spec) + [None] * (len(shape) - len(spec))
    out = []
    for dim, entry in zip(shape, entries, strict=True):
        axes = tuple(a for a in _mesh_axes(entry) if mesh.shape[a] > 1)
        size = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
        if not axes or dim % size:
            out.append(None)
        else:
            out.append(axes[0] if len(axes) == 1 else axes)
    while out and out[-1] is None:
        out.pop()
    return PartitionSpec(*out)


def drop_axis(spec: PartitionSpec, axis: str) -> PartitionSpec:
    """``spec`` with mesh ``axis`` removed (e.g. the full-weight layout after an fsdp gather)."""
    out = []
    for entry in spec:
        kept = tuple(a for a in _mesh_axes(entry) if a != axis)
        out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return PartitionSpec(*out)


def keep_axis(spec: PartitionSpec, axis: str) -> PartitionSpec:
    """``spec`` with every mesh axis but ``axis`` removed (e.g. the experts' split alone)."""
    out = [axis if axis in _mesh_axes(entry) else None for entry in spec]
    while out and out[-1] is None:
        out.pop()
    return PartitionSpec(*out)


def axis_dim(spec: PartitionSpec, axis: str) -> int | None:
    """The dimension that ``spec`` shards over mesh ``axis`` (None if it does not)."""
    for d, entry in enumerate(spec):
        if axis in _mesh_axes(entry):
            return d
    return None


@functools.lru_cache(maxsize=8)
def boxed_params(model):
    """Abstract params of a transformer (``model.cfg``) with their logical-axis boxes.

    Traced on one sequence of ``max_len`` tokens; nothing is allocated.
    """
    # Tracing a 1B model's init takes seconds; setup and the step's plan ask for it 4 times.
    tokens_BxL = jax.ShapeDtypeStruct((1, model.cfg.max_len), jnp.int32)
    return jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens_BxL)["params"]


def param_specs(model, mesh: Mesh):
    """Mesh PartitionSpec of every (plain, unboxed) parameter, fitted to its shape."""
    boxed = boxed_params(model)
    logical = nn.get_partition_spec(boxed)
    abstract = nn.unbox(boxed)

    def one(names, leaf):
        spec = nn.logical_to_mesh_axes(tuple(names), RULES)
        return fit_spec(spec, leaf.shape, mesh)

    return jax.tree.map(one, logical, abstract, is_leaf=lambda x: isinstance(x, PartitionSpec))


def param_logical_names(model):
    """Logical axis names of every parameter (tuples, e.g. ('layers', 'embed', 'mlp'))."""
    logical = nn.get_partition_spec(boxed_params(model))
    return jax.tree.map(lambda s: tuple(s), logical, is_leaf=lambda x: isinstance(x, PartitionSpec))


def _shard_like_params(tree, spec_by_path: dict, mesh: Mesh):
    """Shardings for a tree of parameter-shaped leaves (params, optimizer moments)."""
    # A leaf (or ScaledTensor) whose path ends with a parameter's path and has its shape takes
    # that parameter's sharding (a ScaledTensor's per-tensor scale stays replicated); anything
    # else (step counters, scalars) is replicated.
    rep = replicated(mesh)

    def one(path, leaf):
        key = path_key(path)
        for i in range(len(key)):
            spec = spec_by_path.get(key[i:])
            if spec is None:
                continue
            if tuple(spec[1]) != tuple(leaf.shape):
                continue
            sh = NamedSharding(mesh, spec[0])
            return master.ScaledTensor(sh, rep) if master.is_scaled(leaf) else sh
        return master.ScaledTensor(rep, rep) if master.is_scaled(leaf) else rep

    return jax.tree_util.tree_map_with_path(one, tree, is_leaf=master.is_scaled)


def state_shardings(model, abstract_state, mesh: Mesh):
    """TrainState shardings: params and moments by logical names, everything else replicated."""
    # FP8/FP16 ScaledTensor data is sharded like its parameter, its scale replicated; FP8 scale
    # state, the gradient-communication state and counters are replicated.
    specs = param_specs(model, mesh)
    shapes = nn.unbox(boxed_params(model))
    flat_specs = jax.tree_util.tree_flatten_with_path(
        specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )[0]
    flat_shapes = jax.tree.leaves(shapes)
    spec_by_path = {
        path_key(p): (s, tuple(x.shape)) for (p, s), x in zip(flat_specs, flat_shapes, strict=True)
    }
    rep = replicated(mesh)
    return abstract_state.replace(
        step=rep,
        params=_shard_like_params(abstract_state.params, spec_by_path, mesh),
        opt_state=_shard_like_params(abstract_state.opt_state, spec_by_path, mesh),
        fp8=jax.tree.map(lambda _: rep, abstract_state.fp8),
        bad_steps=rep,
        skipped=rep,
        comm=jax.tree.map(lambda _: rep, getattr(abstract_state, "comm", {})),
        # The objective's state (DPO's frozen reference): leaves at a param's path sharded like
        # it, the others (the reference's FP8 state) replicated.
        objective=_shard_like_params(getattr(abstract_state, "objective", {}), spec_by_path, mesh),
        moe_state=jax.tree.map(lambda _: rep, getattr(abstract_state, "moe_state", {})),
    )
