"""The train step's data-parallel replicas and their gradient reduction (FP8 at O1+).

The batch is viewed as ``[N, B/N, ...]`` with N split over data x expert x fsdp, and each replica
computes its own gradients. Without tensor parallelism they run one per device under shard_map
(the routed experts of MoE layers split over 'expert' stay split: each device holds and
differentiates its own); with it they are vmapped under XLA's SPMD partitioner. Two ways to
move fsdp weights (``comm.gather``):

- up front: ``gather.gather_params`` all-gathers every weight before the forward pass, each
  replica keeps full-size gradients, and ``comm.reduce_gradients`` sums them after the backward;
- per layer (``parallel.layerwise``, ZeRO-3 in time): the replicas get the shards, each layer
  gathers its own weights where it runs and reduce-scatters its gradients in its backward.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from fp8jax.nn import state as fp8_state
from fp8jax.parallel import comm, gather, layerwise
from fp8jax.parallel import sharding as sharding_lib

P = PartitionSpec
# (model, params, fp8, rows, loss weight, masters, gradient dtypes) -> (loss dict, fp8, grads):
# one replica's gradients of its rows, micro-batches accumulated (the train step's). ``rows``:
# the step's per-row inputs (the batch and its objective's), each leaf's leading axis the rows.
GradsFn = Callable


def _per_device(
    grads_fn: GradsFn,
    model,
    params,
    fp8,
    batch_N,
    plan,
    masters,
    scale,
    adds_up,
    sum_dtypes,
    param_specs=None,
    groups=None,
):
    """``(loss_N, fp8_N, grads)`` with one replica per device, written per device (shard_map).

    Each device runs the unpartitioned model on its own rows, so nothing depends on how XLA's
    SPMD partitioner would split the model's ops: custom calls such as the Pallas FP8 cast or
    cuDNN attention run as on one device (partitioned, the cast kernel's operands were
    all-gathered; cuDNN attention rejected q, k and v with different shardings). ``groups``
    (per-layer gathers): ``params`` come sharded as ``param_specs`` say and ``grads`` are
    already reduced, laid out the same; otherwise ``params`` are whole (routed experts split
    over 'expert', ``Plan.local_spec``) and ``grads`` are each replica's own, laid out as
    ``Plan.replica_spec`` says.
    """
    n, dp = plan.num_replicas, sharding_lib.DP_AXES

    def local(params, fp8, masters, scale, b_1xBxL):
        b = jax.tree.map(lambda x: x[0], b_1xBxL)  # this device's rows
        w = scale if adds_up else 1.0 / n  # a mean: the constant
        # Local arrays: nothing to constrain; MoE layers send tokens to their experts' devices
        # over the 'expert' axis (parallel.expert).
        with (
            sharding_lib.activation_sharding(None),
            sharding_lib.expert_shards(plan.mesh),
            layerwise.active(groups),
        ):
            m = layerwise.wrap_model(model)
            loss, fp8, g = grads_fn(m, params, fp8, b, w, masters, sum_dtypes)
        if groups:
            return jax.tree.map(lambda x: x[None], (loss, fp8)) + (g,)
        return jax.tree.map(lambda x: x[None], (loss, fp8, g))  # [1, ...] per device

    rep = P()
    if param_specs is None:
        # Whole weights, but for routed experts split over 'expert' (``Plan.local_spec``): each
        # device holds and differentiates only its own experts. Gradients: one per replica.
        p_spec = jax.tree.map(plan.local_spec, plan.specs)
        g_spec = jax.tree.map(plan.replica_spec, plan.specs)
    else:
        p_spec = g_spec = param_specs
    fn = jax.shard_map(
        local,
        mesh=plan.mesh,
        in_specs=(p_spec, rep, rep, rep, P(dp)),
        out_specs=(P(dp), P(dp), g_spec),
        # Manual over every mesh axis (tensor is 1 here), not just data x fsdp: inside a partly
        # manual region JAX still hands custom-partitioned ops (cuDNN attention) to their
        # partitioner, which fails on the manual axes; fully manual, they lower as on one device.
        axis_names=frozenset(plan.mesh.axis_names),
        check_vma=False,
    )
    return fn(params, fp8, masters, jnp.asarray(scale, jnp.float32), batch_N)


def reduced_grads(
    model,
    params,
    fp8,
    batch,
    plan,
    mu,
    grads_fn: GradsFn,
    accum: int = 1,
    masters=None,
    *,
    scale,
    adds_up: bool,
):
    """``(loss dict, FP8 state, gradients summed over the replicas, clipped share)``.

    ``batch``: the step's per-row inputs; ``scale``: each replica's loss scale (the objective's,
    of the global batch); ``adds_up``: whether the scaled sums are shares of the global loss
    (``Objective.adds_up``; else each replica takes the constant 1/N).
    """
    mesh, n = plan.mesh, plan.num_replicas
    batch_size = jax.tree.leaves(batch)[0].shape[0]
    if batch_size % (n * accum):
        raise ValueError(
            f"batch_size={batch_size} must be divisible by data-parallel replicas ({n}) x "
            f"grad_accum_steps ({accum}); change batch_size or config.mesh"
        )
    dp = NamedSharding(mesh, P(sharding_lib.DP_AXES))
    batch_N = jax.tree.map(
        lambda x: jax.lax.with_sharding_constraint(x.reshape(n, -1, *x.shape[1:]), dp), batch
    )
    sum_dtypes = jax.tree.map(lambda p: p.dtype, params)  # not the gathered compute dtype
    if plan.layerwise:
        extended, specs, groups, w_amax, count = layerwise.prepare(params, fp8, plan, mu)
        dtypes = jax.tree.map(lambda p: p.dtype, extended)
        loss_N, fp8_N, grads = _per_device(
            grads_fn,
            model,
            extended,
            fp8,
            batch_N,
            plan,
            masters,
            scale,
            adds_up,
            dtypes,
            specs,
            groups,
        )
        grads, clipped = layerwise.split_grads(grads)
        # Every device's clipped count over every replica's FP8-quantized values (the micro-
        # batches' gradients are averaged, their counts with them).
        saturated = clipped / float(max(count * n, 1))
    else:
        full, w_amax = gather.gather_params(params, fp8, plan)
        if plan.per_device:
            loss_N, fp8_N, grads_N = _per_device(
                grads_fn, model, full, fp8, batch_N, plan, masters, scale, adds_up, sum_dtypes
            )
        else:

            def one(b):
                return grads_fn(model, full, fp8, b, scale, masters, sum_dtypes)

            # Tensor parallelism stays with XLA's SPMD partitioner. Inside a replica the
            # activation constraints keep its rows whole; spmd_axis_name splits the replica
            # axis itself over data x fsdp, as batch_N is.
            with sharding_lib.activation_sharding(mesh, sharding_lib.within_replica()):
                loss_N, fp8_N, grads_N = jax.vmap(one, spmd_axis_name=sharding_lib.DP_AXES)(batch_N)
        grads_N = jax.tree.map(
            lambda g, spec: jax.lax.with_sharding_constraint(
                g, NamedSharding(mesh, plan.replica_spec(spec))
            ),
            grads_N,
            plan.specs,
        )
        grads, saturated = comm.reduce_gradients(grads_N, mu, plan)
    # Amaxes are maxima over every replica's data (the global amax); scales are identical.
    fp8 = fp8_state.max_over_replicas(fp8_N, fp8)
    fp8 = gather.set_weight_amax(fp8, w_amax)
    # Summed over the replicas (axis 0); an MoE model's per-layer metrics keep their layers.
    return jax.tree.map(lambda x: jnp.sum(x, axis=0), loss_N), fp8, grads, saturated


__all__ = ["reduced_grads"]
