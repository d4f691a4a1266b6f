"""Train state, optimizer and the pure train / eval steps, built from a ``spec.RunSpec``.

Levels (FP8-LM; what each runs and stores: ``optim.levels.LEVELS``): O0 f32 params + f32 Adam;
O1 adds FP8 GEMMs (with their scale state), params and Adam still f32; O2 adds FP8/FP16 Adam
moments and FP16 master weights for the matmul kernels; O3 shards those over ``fsdp``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax
from absl import logging
from flax import struct

from fp8jax import provenance
from fp8jax.models import moe
from fp8jax.models.layers import FLAX_FP8
from fp8jax.nn import state as fp8_state
from fp8jax.nn.state import FP8, FP8_STATS
from fp8jax.optim import adam as optim
from fp8jax.optim.fused import FusedAdamW
from fp8jax.parallel import comm
from fp8jax.parallel import sharding as sharding_lib
from fp8jax.spec import OptimSpec, RunSpec
from fp8jax.trainer import objectives, replicas
from fp8jax.trainer.loss import loss_kwargs, model_kwargs
from fp8jax.trainer.objectives import Objective

__all__ = [
    "LANGUAGE_MODEL",
    "TrainState",
    "batch_gradients",
    "fused_adamw",
    "init_state",
    "learning_rate_schedule",
    "make_eval_step",
    "make_optimizer",
    "make_stats_step",
    "make_train_step",
    "model_variables",
    "record_schedule",
    "splits_pallas_casts",
    "stacked_leaves",
    "state_collection",
]


@struct.dataclass
class TrainState:
    """Everything a step reads and writes; checkpointed as one pytree."""

    step: jax.Array  # [] int32, optimizer steps taken
    params: Any  # model params (O2+: matmul kernels as FP16 master + scale)
    opt_state: Any  # optax state
    fp8: Any  # the fp8_state collection (empty at O0)
    bad_steps: jax.Array  # [] int32, consecutive non-finite steps (update skipped)
    skipped: jax.Array  # [] int32, total skipped steps
    comm: Any = struct.field(default_factory=dict)  # O1+: {'mu': f32[]} FP8 grad pre-scale
    # The objective's own state (``Objective.init_state``): {} for the language-model loss,
    # DPO's frozen reference {'params', 'fp8'} (and 'moe_state', an MoE model's router biases).
    objective: Any = struct.field(default_factory=dict)
    # The model's MOE_STATE collection (a sigmoid router's balancing bias per MoE layer), {}
    # for others; updated by the step from the expert loads (``moe.update_bias``).
    moe_state: Any = struct.field(default_factory=dict)


LANGUAGE_MODEL = objectives.lm.LanguageModel()  # the objective of a step built without one


def _kernel_mask(params):
    return jax.tree_util.tree_map_with_path(optim.is_matmul_weight, params)


def learning_rate_schedule(o: OptimSpec) -> optax.Schedule:
    """Rate of the update that step ``count`` (0-based) applies: warm-up, then cosine decay.

    Linear warm-up reaching ``learning_rate`` at update ``warmup_steps`` (the first update
    already applies ``learning_rate / warmup_steps``), then cosine decay to ``min_lr_ratio``
    of the peak at update ``num_train_steps``.
    """
    warmup = max(1, o.warmup_steps)
    base = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=o.learning_rate,
        warmup_steps=warmup,
        decay_steps=max(o.num_train_steps, warmup + 1),
        end_value=o.learning_rate * o.min_lr_ratio,
    )
    # optax counts from 0 and its warm-up starts at init_value: evaluated at count + 1, update
    # k (1-based) gets k / warmup of the peak, so no step is spent at a zero rate.
    return lambda count: base(count + 1)


# Fields that define the learning-rate schedule (learning_rate_schedule).
_SCHEDULE_FIELDS = ("learning_rate", "warmup_steps", "num_train_steps", "min_lr_ratio")


def record_schedule(workdir: str, o: OptimSpec, step: int) -> None:
    """Keep the schedule's fields in ``<workdir>/schedule.json``; warn when a resume changes them.

    The schedule is a function of the step and these fields, so a resumed run with another
    ``num_train_steps`` follows another curve from the restored step on (cosine re-stretched).
    """
    path = os.path.join(workdir, "schedule.json")
    now = {k: getattr(o, k) for k in _SCHEDULE_FIELDS}
    before = provenance.read_json(pathlib.Path(path)) or {}
    changed = {k: (before[k], v) for k, v in now.items() if k in before and before[k] != v}
    if step > 0 and changed:
        old = dataclasses.replace(o, **{k: v for k, (v, _) in changed.items()})
        lr_old = float(learning_rate_schedule(old)(step))
        lr_new = float(learning_rate_schedule(o)(step))
        logging.warning(
            "resuming at step %d with a changed learning-rate schedule (%s): from here the "
            "rate follows the new one (%.4g at this step, %.4g under the old), its cosine "
            "decaying until step %d",
            step,
            ", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items()),
            lr_new,
            lr_old,
            o.num_train_steps,
        )
    if now != before:
        provenance.write_json(pathlib.Path(path), now)


def fused_adamw(run: RunSpec) -> FusedAdamW | None:
    """O2+'s optimizer (FP8/FP16 moments with scales) as ``FusedAdamW``; None below O2."""
    o, storage = run.optim, run.fp8.storage
    if not storage.fp8_adam:
        return None
    return FusedAdamW(
        learning_rate_schedule(o),
        b1=o.b1,
        b2=o.b2,
        eps=o.eps,
        weight_decay=o.weight_decay,
        weight_decay_mask=_kernel_mask,  # as at O0/O1: no decay on embeddings/norms/biases
        m_format=storage.m_format,
        v_format=storage.v_format,
        grad_clip=o.grad_clip,
        slice_bytes=int(o.update_slice_mib * 2**20),
    )


def make_optimizer(run: RunSpec) -> optax.GradientTransformation:
    """AdamW with clipping; O2+ keeps the matmul kernels' moments in FP8/FP16 with scales."""
    fused = fused_adamw(run)
    if fused is not None:  # the train step itself skips a step with a non-finite gradient
        return fused.transform()
    o = run.optim
    clip = [optax.clip_by_global_norm(o.grad_clip)] if o.grad_clip > 0 else []
    adam = optax.adamw(
        learning_rate_schedule(o),
        b1=o.b1,
        b2=o.b2,
        eps=o.eps,
        weight_decay=o.weight_decay,
        mask=_kernel_mask,
    )
    return optax.chain(*clip, adam)


def stacked_leaves(model):
    """Tree of bools like the params: leaves whose leading axis is ``nn.scan``'s layers axis
    (None for a model without the trainer's partitioning names)."""
    if not hasattr(getattr(model, "cfg", None), "max_len"):
        return None
    names = sharding_lib.param_logical_names(model)
    return jax.tree.map(
        lambda n: bool(n) and n[0] == "layers", names, is_leaf=lambda x: isinstance(x, tuple)
    )


def state_collection(model) -> str:
    """The variable collection holding the model's FP8 scale state (flax's op: its own)."""
    return FLAX_FP8 if getattr(getattr(model, "cfg", None), "fp8_impl", "") == "flax" else FP8


def init_state(
    model,
    tx,
    run: RunSpec,
    rng: jax.Array,
    params=None,
    objective: Objective | None = None,
    moe_state=None,
) -> TrainState:
    """Initialise params (or start from ``params``, a checkpoint's), FP8 and optimizer state,
    the MoE router biases (zeros, or ``moe_state``, a checkpoint's, in this model's layout) and
    the state ``objective`` declares (default: the language-model loss, none)."""
    tokens_BxL = jnp.zeros((1, run.optim.seq_len), jnp.int32)  # under jit with out_shardings
    variables = flax.linen.meta.unbox(model.init(rng, tokens_BxL))
    given, params = params, variables["params"]
    if given is not None:  # jit drops the random init that these weights replace
        params = jax.tree.map(lambda g, p: jnp.asarray(g, p.dtype), given, params)
    opt_state = tx.init(params)
    master_format = run.fp8.storage.master_format
    params = optim.to_master(params, master_format=master_format)  # f32: unchanged
    zero = jnp.zeros((), jnp.int32)
    comm_state = comm.init_state(run.fp8.level, run.comm)
    fp8 = variables.get(state_collection(model), {})
    given, moe_state = moe_state, variables.get(moe.MOE_STATE, {})
    if given is not None:
        moe_state = jax.tree.map(lambda g, z: jnp.asarray(g, z.dtype), given, moe_state)
    objective_state = (objective or LANGUAGE_MODEL).init_state(params, fp8, moe_state)
    return TrainState(
        zero, params, opt_state, fp8, zero, zero, comm_state, objective_state, moe_state
    )


def model_variables(model, params, state: TrainState) -> dict:
    """The variables ``model.apply`` takes beside the step's: params, FP8 state, MoE state."""
    variables = {"params": params, state_collection(model): state.fp8}
    if state.moe_state:
        variables[moe.MOE_STATE] = state.moe_state
    return variables


def _moe_sums(model, mutated: dict, weight) -> tuple[jax.Array, dict]:
    """``(weighted auxiliary loss, {'moe/<metric>': [layers, ...]})`` that an MoE model sowed
    (0 and {} for a dense one), each times ``weight``."""
    scanned = bool(getattr(getattr(model, "cfg", None), "scan_layers", False))
    losses = mutated.get(moe.MOE_LOSSES, {})
    aux = sum((jnp.sum(v) for v in jax.tree.leaves(losses)), jnp.zeros((), jnp.float32))
    metrics = moe.layer_metrics(mutated.get(moe.MOE_METRICS, {}), scanned)
    return weight * aux, {f"moe/{k}": weight * v for k, v in metrics.items()}


def _moe_report(model, run: RunSpec, metrics: dict, moe_state, ok):
    """``(metrics, moe_state)``: the per-layer ``moe/<metric>`` arrays as scalars (``moe_<metric>``
    the layers' mean, ``moe_<metric>_<layer>`` each layer's), the expert loads dropped; the
    balancing bias stepped from those loads (kept as it was where not ``ok``)."""
    layer = {k.removeprefix("moe/"): v for k, v in metrics.items() if k.startswith("moe/")}
    out = {k: v for k, v in metrics.items() if not k.startswith("moe/")}
    loads = layer.pop(moe.LOAD, None)
    if loads is not None:
        # From the batch's loads (each a mean over micro-batches and replicas), not the mean of
        # each micro-batch's maximum: the same value however the batch is split.
        layer["load_max_over_mean"] = jnp.max(loads, axis=-1) / jnp.mean(loads, axis=-1)
    if moe_state and loads is not None:
        rate = run.model.moe.bias_update_rate
        scanned = bool(getattr(getattr(model, "cfg", None), "scan_layers", False))
        stepped = moe.update_bias(moe_state, loads, rate, scanned)
        moe_state = jax.tree.map(lambda a, b: jnp.where(ok, a, b), stepped, moe_state)
    for name, values in layer.items():
        out[f"moe_{name}"] = jnp.mean(values)
        out.update({f"moe_{name}_{i}": v for i, v in enumerate(values)})
    return out, moe_state


def _micro_grads(
    model,
    params,
    fp8,
    micro,
    weight=1.0,
    masters=None,
    objective: Objective = LANGUAGE_MODEL,
    moe_weight=1.0,
    moe_state=None,
):
    """Loss (``objective.micro_batch_loss``'s dict, with an MoE model's ``moe/<metric>``
    per-layer sums), FP8 state after the forward, grads of params and FP8 state. ``micro``:
    ``(batch, rows)``, the data and the objective's per-row inputs. ``masters``: what
    ``master.carry_masters`` returns beside the params (O2+), if any.
    """
    # ``weight`` scales the loss: 1/N for one of N replicas (their gradients sum to the global
    # batch's; dy's FP8 amax equals the unsharded one); weighted: 1/sum(w) of the global batch.
    # ``moe_weight`` scales the MoE auxiliary losses and metrics (means over this micro-batch's
    # tokens) so that they sum, or average as the objective's sums do, to the batch's mean.
    coll = state_collection(model)
    batch, rows = micro

    def loss_fn(p, s):
        variables = {"params": p, coll: s}
        if moe_state:
            variables[moe.MOE_STATE] = moe_state
        sown = [FP8, moe.MOE_LOSSES, moe.MOE_METRICS]
        apply = functools.partial(model.apply, variables, mutable=sown)
        with optim.dequantize_carried(masters):
            sums, mutated = objective.micro_batch_loss(apply, batch, rows)
        sums = {k: weight * v for k, v in sums.items()}
        aux, moe_metrics = _moe_sums(model, mutated, moe_weight)
        # The auxiliary losses train the router; the logged loss stays the objective's.
        return sums["loss"] + aux, ({**sums, **moe_metrics}, mutated.get(FP8, {}))

    grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)
    (_, (loss, fp8_fwd)), (g_params, g_fp8) = grad_fn(params, fp8)
    if coll == FLAX_FP8:  # flax's convention: the "gradient" is the updated scale state
        return loss, g_fp8, g_params
    return loss, fp8_state.merge_grads(fp8_fwd, g_fp8), g_params


def _accumulate(
    model,
    params,
    fp8,
    micro,
    accum: int,
    weight=1.0,
    masters=None,
    sum_dtypes=None,
    wide=None,
    objective: Objective = LANGUAGE_MODEL,
    replicas: int = 1,
    moe_state=None,
):
    """(loss dict, fp8 state, grads) of one batch, summed over ``accum`` micro-batches.

    ``micro``: ``(batch, rows)``, the data and the objective's per-row inputs, split together.

    ``sum_dtypes``: a tree like ``params`` of the gradients' dtypes (default: the params' own);
    fsdp's gathers hand kernels over in the compute dtype, whose gradients still come out in
    the stored params' dtype (f32 at O1). ``wide`` (e.g. float32): the running sum's dtype
    where it is wider (config.grad_accum_dtype); the result is cast back to ``sum_dtypes``.
    """
    batch = micro[0]
    # MoE auxiliary losses and metrics, each a mean over a micro-batch: 1/N of each replica's
    # (the replicas' sums add up), and 1/accum of each micro-batch's where the objective's sums
    # add up (else the micro-batches' sums are averaged below, these with them).
    adds_up = objective.adds_up(batch)
    moe_weight = 1.0 / (replicas * (accum if adds_up else 1))
    micro_grads = functools.partial(
        _micro_grads, objective=objective, moe_weight=moe_weight, moe_state=moe_state
    )
    if accum == 1:
        return micro_grads(model, params, fp8, micro, weight, masters)
    micro = jax.tree.map(lambda x: x.reshape(accum, -1, *x.shape[1:]), micro)
    if sum_dtypes is None:
        sum_dtypes = jax.tree.map(lambda p: p.dtype, params)
    # At O2+ the gradients are bf16: a bf16 running sum rounds to 8 bits at every add; a wide
    # one rounds once, when it is cast back.
    carry_dtypes = (
        sum_dtypes
        if wide is None
        else jax.tree.map(lambda d: jnp.promote_types(d, wide), sum_dtypes)
    )

    def body(carry, mb):
        loss_sum, g_sum, fp8 = carry
        loss, fp8, g = micro_grads(model, params, fp8, mb, weight, masters)
        g_sum = jax.tree.map(lambda a, b: a + b.astype(a.dtype), g_sum, g)
        return (jax.tree.map(jnp.add, loss_sum, loss), g_sum, fp8), None

    zeros = jax.tree.map(lambda p, d: jnp.zeros(p.shape, d), params, carry_dtypes)
    loss0 = {k: jnp.zeros((), jnp.float32) for k in objective.loss_keys}
    if getattr(getattr(model, "cfg", None), "moe", None) is not None:
        # An MoE model's loss dict holds its per-layer metrics too: shapes from a trace.
        first = jax.tree.map(lambda x: x[0], micro)
        grads_of = lambda f: micro_grads(model, params, f, first, weight, masters)[0]
        loss0 = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(grads_of, fp8))
    (loss, grads, fp8), _ = jax.lax.scan(body, (loss0, zeros, fp8), micro)
    # Sums already scaled to the global batch (weighted: 1/sum(w); DPO: 1/pairs) only add up.
    n = 1 if adds_up else accum
    grads = jax.tree.map(lambda g, d: (g / n).astype(d), grads, sum_dtypes)
    return jax.tree.map(lambda x: x / n, loss), fp8, grads


def batch_gradients(
    model,
    params,
    fp8,
    batch,
    accum: int = 1,
    wide=None,
    objective: Objective | None = None,
    rows=None,
):
    """Mean loss, FP8 state and mean gradients of one batch, as the one-device train step.

    ``objective`` (default: the language-model loss) with ``rows``, the per-row inputs its
    ``make_prepare`` gives (default: none).
    """
    objective = objective or LANGUAGE_MODEL
    micro = (batch, {} if rows is None else rows)
    scale = objective.scale(batch, 1)
    out = _accumulate(model, params, fp8, micro, accum, scale, wide=wide, objective=objective)
    return out[0]["loss"], *out[1:]


def splits_pallas_casts(run: RunSpec, mesh, cast_kernel: str | None = None) -> bool:
    """Whether XLA's SPMD partitioner would split the Pallas FP8 cast kernel over ``mesh``.

    It cannot split a custom call, so it all-gathers the operands and every device casts the
    global tensor (measured: docs/performance.md). Per-device replicas keep local arrays.
    ``cast_kernel``: the one the model runs (default: ``run.model``'s).
    """
    level = run.fp8.level
    kernel = cast_kernel or run.model.cast_kernel
    if mesh is None or mesh.size <= 1 or not level.fp8_gemms or kernel != "pallas":
        return False
    return not comm.per_device(level, run.comm, mesh)


def _on_gpu(mesh) -> bool:
    return getattr(mesh.devices.flat[0], "platform", "") == "gpu"  # elsewhere 'pallas' is XLA


def make_train_step(
    model, tx, run: RunSpec, mesh=None, fused: bool = True, objective: Objective | None = None
):
    """Build the pure ``train_step(state, batch) -> (state, metrics)`` (``mesh``: run's) of
    ``objective`` (default: the language-model loss).

    At O2+ ``tx`` must be ``make_optimizer(run)``: with ``fused`` the step runs it as
    ``fused_adamw(run).apply`` (the same arithmetic, one pass per leaf, in place: less memory);
    otherwise as ``tx.update`` and ``optim.apply_updates``. Metrics: the objective's loss sums
    (means over the batch; DPO: also its pair statistics), the gradient norm, the rate and
    the skipped-step counts.
    """
    # Several data-parallel replicas at O1+: gradients reduced in FP8 (parallel.comm), at O3 FP8
    # kernels all-gathered (parallel.gather), over the mesh the step is jitted over.
    accum = run.optim.grad_accum_steps
    wide = jnp.dtype(run.optim.grad_accum_dtype) if run.optim.grad_accum_dtype else None
    level = run.fp8.level
    if mesh is None and level.fp8_grad_comm and run.comm.enabled:
        mesh = sharding_lib.make_mesh(run.mesh)
    kernel = getattr(getattr(model, "cfg", None), "cast_kernel", None)  # what the model runs
    if splits_pallas_casts(run, mesh, kernel) and _on_gpu(mesh):
        raise ValueError(
            f"fp8.cast_kernel='pallas' on mesh {dict(mesh.shape)}: XLA's partitioner cannot split "
            "the Pallas cast kernel and would all-gather every operand. Build the model from "
            "fp8jax.trainer.loop.partitionable(run, mesh) (as loop.setup does) or set "
            "fp8.cast_kernel='xla'"
        )
    plan = comm.make_plan(model, run.comm, mesh, level) if mesh is not None else None
    if plan is not None and state_collection(model) != FP8:
        raise ValueError("fp8.impl='flax' runs on one data-parallel replica only (benchmarks)")

    carry = level.fp8_adam and state_collection(model) == FP8
    adamw = fused_adamw(run) if fused else None
    # Which leaves are stacked matters only when the update slices them.
    slicing = adamw is not None and adamw.slice_bytes > 0
    stacked = stacked_leaves(model) if slicing else None
    stochastic = run.fp8.master_rounding == "stochastic"
    seed, dtype, schedule = run.seed, run.model.dtype, learning_rate_schedule(run.optim)
    objective = objective or LANGUAGE_MODEL
    prepare = objective.make_prepare(model, mesh)

    replica_count = 1 if plan is None else plan.num_replicas

    def grads_fn(model, params, fp8, micro, weight, masters, sum_dtypes, moe_state=None):
        return _accumulate(
            model,
            params,
            fp8,
            micro,
            accum,
            weight,
            masters,
            sum_dtypes,
            wide=wide,
            objective=objective,
            replicas=replica_count,
            moe_state=moe_state,
        )

    def master_seed(step):
        # Fixed by (seed, step): a resumed run rounds exactly as an uninterrupted one.
        return step.astype(jnp.uint32) * jnp.uint32(0x85EBCA6B) + seed if stochastic else None

    def train_step(state: TrainState, batch):
        with sharding_lib.activation_sharding(mesh):
            return _train_step(state, batch)

    def _train_step(state: TrainState, batch):
        # What the objective computes once on the global batch (DPO: the reference's log-probs),
        # split with the rows over micro-batches and replicas.
        rows, objective_state = prepare(state.objective, batch)
        micro = (batch, rows)
        # O2+: FP16 masters dequantized straight to the compute dtype (bf16 on GPU): an f32
        # view of every weight would cost 4 bytes/param of transient memory (OOM at 7B). The
        # FP8 layers' masters go in still encoded and are dequantized inside each layer, so no
        # bf16 copy lives across remat (unless fsdp gathers them: gather.py wants weights).
        view = optim.materialize(state.params, dtype=dtype)  # also the weights decay reads
        params, masters = view, None
        if carry and (plan is None or int(plan.mesh.shape["fsdp"]) == 1):
            params, masters = optim.carry_masters(state.params, state.fp8, dtype)
        comm_state, comm_metrics = state.comm, {}
        step_grads = functools.partial(grads_fn, moe_state=state.moe_state)
        if plan is None:
            scale = objective.scale(batch, 1)
            loss, fp8, grads = step_grads(model, params, state.fp8, micro, scale, masters, None)
        else:
            mu = state.comm["mu"]
            scale = objective.scale(batch, plan.num_replicas)  # of the global batch
            loss, fp8, grads, saturated = replicas.reduced_grads(
                model,
                params,
                state.fp8,
                micro,
                plan,
                mu,
                step_grads,
                accum,
                masters,
                scale=scale,
                adds_up=objective.adds_up(batch),
            )
            comm_state = {"mu": comm.next_mu(mu, saturated, plan.cfg)}
            comm_metrics = {"comm_mu": mu, "comm_saturated": saturated}
        if state_collection(model) == FP8:
            fp8 = fp8_state.commit(fp8)  # once per step: amaxes merged over all uses by max

        grad_norm = optax.tree.norm(grads)
        # A finite norm means every gradient is finite. With finite weights and moments (a
        # skipped step commits nothing) and eps > 0 (validated), AdamW's update is then finite
        # exactly when its learning rate is, so that scalar is checked rather than the norm of
        # every update (a second pass over the updates, which costs step time).
        # FP16/FP8 masters guard their own re-quantization (optim.apply_updates).
        lr = schedule(state.step)
        ok = jnp.isfinite(loss["loss"]) & jnp.isfinite(grad_norm) & jnp.isfinite(lr)
        loss, moe_state = _moe_report(model, run, loss, state.moe_state, ok)
        keep = lambda new, old: fp8_state.keep_if_finite(new, old, ok)
        rounding_seed = master_seed(state.step)
        if adamw is not None:
            # Masters through a barrier with the gradients: weight decay dequantizes them
            # again after the backward pass instead of keeping the forward's view alive
            # across it. The step writes the old values itself where not ``ok``, so nothing
            # reads the old state afterwards and its donated buffers are updated in place.
            masters, grads = jax.lax.optimization_barrier((state.params, grads))
            new_params, opt_state = adamw.apply(
                grads, state.opt_state, masters, ok, dtype, rounding_seed, stacked
            )
        else:
            # Decay reads the compute-dtype view even when the model got carried masters (the
            # same updates either way); XLA fuses each leaf's dequantization into its update.
            updates, opt_state = tx.update(grads, state.opt_state, view)
            new_params = optim.apply_updates(state.params, updates, rounding_seed)
            new_params = keep(new_params, state.params)
            opt_state = keep(opt_state, state.opt_state)
        new_state = state.replace(
            step=state.step + jnp.where(ok, 1, 0),
            params=new_params,
            opt_state=opt_state,
            fp8=keep(fp8, state.fp8),
            comm=keep(comm_state, state.comm),
            objective=objective.keep(objective_state, state.objective, ok),
            moe_state=moe_state,
            bad_steps=jnp.where(ok, 0, state.bad_steps + 1),
            skipped=state.skipped + jnp.where(ok, 0, 1),
        )
        metrics = {
            # 'loss' (DPO: also its pair statistics, means over the pairs); an MoE model's
            # routing metrics, per layer and their mean (moe_<metric>[_<layer>])
            **loss,
            "grad_norm": grad_norm,
            "learning_rate": lr,
            "skipped_steps": new_state.skipped,
            "bad_steps": new_state.bad_steps,
            **comm_metrics,
        }
        return new_state, metrics

    return train_step


def make_eval_step(model, mesh=None, objective: Objective | None = None):
    """``eval_step(state, batch) -> metrics`` of ``objective`` (default: the language-model
    loss, the mean loss; weighted mean if weighted) from the policy's token losses; no FP8
    update."""
    metrics = (objective or LANGUAGE_MODEL).make_eval(model, mesh)

    def eval_step(state: TrainState, batch):
        params = optim.materialize(state.params)
        variables = model_variables(model, params, state)
        with sharding_lib.activation_sharding(mesh):
            losses = model.apply(variables, batch["inputs"], **loss_kwargs(batch))
            return metrics(state.objective, batch, losses)

    return eval_step


def make_stats_step(model, mesh=None):
    """Per-layer FP8 health on one batch: saturation / flush shares under the current scales."""

    def stats_step(state: TrainState, batch):
        params = optim.materialize(state.params)
        variables = model_variables(model, params, state)
        with sharding_lib.activation_sharding(mesh):
            _, mutated = model.apply(
                variables, batch["inputs"], **model_kwargs(batch), mutable=[FP8_STATS]
            )
        return mutated.get(FP8_STATS, {})

    return stats_step
