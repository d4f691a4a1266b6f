"""Device mesh and the one rules table mapping logical axis names to mesh axes."""

from __future__ import annotations

import jax
import numpy as np
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# Logical axis -> mesh axis (None = replicated). Parameters: 'embed' is sharded over fsdp
# (ZeRO-3 style, O3), 'mlp'/'heads'/'kv_heads'/'vocab' over tensor (Megatron column/row).
RULES = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("vocab", "tensor"),
    ("layers", None),
    ("norm", None),
)


def make_mesh(mesh_config, devices=None) -> Mesh:
    """Mesh ('data', 'fsdp', 'tensor') from config sizes; -1 takes the remaining devices."""
    devices = list(devices if devices is not None else jax.devices())
    sizes = [int(mesh_config.data), int(mesh_config.fsdp), int(mesh_config.tensor)]
    if sizes.count(-1) > 1:
        raise ValueError(f"mesh sizes {sizes}: at most one of data/fsdp/tensor may be -1")
    known = int(np.prod([s for s in sizes if s != -1]))
    if -1 in sizes:
        if known <= 0 or len(devices) % known:
            raise ValueError(
                f"mesh {dict(zip(MESH_AXES, sizes))} does not divide {len(devices)} devices; "
                f"set config.mesh sizes whose product divides the device count"
            )
        sizes[sizes.index(-1)] = len(devices) // known
    if int(np.prod(sizes)) != len(devices):
        raise ValueError(
            f"mesh {dict(zip(MESH_AXES, sizes))} needs {int(np.prod(sizes))} devices but "
            f"{len(devices)} are available; fix config.mesh (use -1 for 'the rest')"
        )
    return Mesh(np.array(devices).reshape(sizes), MESH_AXES)


def logical_shardings(abstract_boxed, mesh: Mesh, rules=RULES):
    """NamedShardings for a tree whose leaves may carry logical partitioning metadata."""
    specs = nn.get_partition_spec(abstract_boxed)
    return nn.logical_to_mesh_sharding(specs, mesh, rules)


def replicated(mesh: Mesh) -> NamedSharding:
    """Sharding that keeps a full copy on every device."""
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batch dimension split over the data-parallel axes (data x fsdp)."""
    return NamedSharding(mesh, PartitionSpec(("data", "fsdp")))


def state_shardings(model, config, abstract_state, mesh: Mesh):
    """Shardings for a TrainState: params from their logical names, the rest replicated.

    Only plain parameter arrays take logical shardings here; scaled (O2+) masters, optimizer
    moments and FP8 scale state are replicated.
    """
    import jax.numpy as jnp

    tokens_BxL = jax.ShapeDtypeStruct((1, config.seq_len), jnp.int32)
    boxed = jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens_BxL)["params"]
    param_sh = logical_shardings(boxed, mesh)
    rep = replicated(mesh)
    params = abstract_state.params
    same = jax.tree.structure(params) == jax.tree.structure(param_sh)
    return abstract_state.replace(
        step=rep,
        params=param_sh if same else jax.tree.map(lambda _: rep, params),
        opt_state=jax.tree.map(lambda _: rep, abstract_state.opt_state),
        fp8=jax.tree.map(lambda _: rep, abstract_state.fp8),
        bad_steps=rep,
        skipped=rep,
    )
