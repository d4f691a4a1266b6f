"""Preference tuning (DPO): the frozen reference policy and the DPO train and eval steps.

The policy is the trained model (``TrainState.params``, every FP8 level as in pre-training and
SFT). The reference is a frozen copy of the initial policy (the ``init_from`` checkpoint, or
the random init) kept in ``TrainState.ref`` as ``{'params', 'fp8'}``: checkpointed with the
state, so a resume is exact, but not in the optimizer and never differentiated. Each step
first runs the reference on the batch (its sequence log-probs under ``stop_gradient``), then
hands them to the ordinary train step (``step.make_train_step``) inside the batch, whose loss
(``loss.micro_batch_loss``) is then DPO's; micro-batches, data-parallel replicas, FP8 gradient
communication, O2's masters and O3's gathers all apply to the policy unchanged.

Reference storage: its weight matrices (kernels, embeddings) in the compute dtype (bf16 on
GPU: 2 bytes/param, half of an f32 copy; what the forward casts them to anyway), vectors
(norm scales, biases) as the policy stores them.

Reference FP8 (O1+): its matmuls run in FP8 like the policy's, with their own scale state
(``ref['fp8']``, a copy of the policy's initial one) under the run's recipe, its amaxes
recorded and committed every step. That costs no extra pass over the operands (current
scaling would add an amax reduction of each operand before its cast), and the frozen weights'
scales settle after the first step; the activations' scales follow the data, so a pair's
reference log-prob can move by FP8 rounding from step to step (a constant offset per pair
cancels in the loss; what remains is noise of FP8's precision). At O0 it is a plain forward.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax import models
from fp8jax._tree import leaf_name
from fp8jax.data_spec import DpoSpec
from fp8jax.nn import state as fp8_state
from fp8jax.nn.state import FP8
from fp8jax.optim import adam as optim
from fp8jax.parallel import sharding as sharding_lib
from fp8jax.spec import RunSpec
from fp8jax.trainer import loss as loss_lib
from fp8jax.trainer import step as step_lib

_MATRICES = ("kernel", "embedding")  # reference leaves stored in the compute dtype


def reference_params(params, dtype):
    """The reference's copy of ``params`` (plain arrays, masters dequantized): weight matrices
    in ``dtype``, the other leaves as they are."""
    view = optim.materialize(params)

    def one(path, p):
        keep = leaf_name(path) not in _MATRICES or p.ndim < 2
        return jnp.array(p, dtype=p.dtype if keep else dtype, copy=True)  # never the policy's

    return jax.tree_util.tree_map_with_path(one, view)


def init_state(model, tx, run: RunSpec, rng: jax.Array, params=None) -> step_lib.TrainState:
    """``step.init_state`` plus the frozen reference: the initial policy's weights and FP8 state."""
    state = step_lib.init_state(model, tx, run, rng, params)
    ref_fp8 = jax.tree.map(lambda x: jnp.array(x, copy=True), state.fp8)
    return state.replace(ref=dict(params=reference_params(state.params, run.model.dtype),
                                  fp8=ref_fp8))  # fmt: skip


def reference_model(model, mesh=None):
    """The module the reference runs: ``model``, with XLA's FP8 casts on several devices.

    The reference runs on the global batch under XLA's partitioner (not per device, as the
    policy's replicas may), which would all-gather the operands of the Pallas cast kernel.
    """
    cfg = model.cfg
    if mesh is None or mesh.size <= 1 or cfg.cast_kernel != "pallas":
        return model
    return models.build_model(dataclasses.replace(cfg, cast_kernel="xla"))


def reference_logps(ref_model, ref, batch, update: bool):
    """``(logps [B], fp8)``: each row's summed response log-probability under the reference
    (``stop_gradient``), and its FP8 state (``update``: this batch's amaxes committed)."""
    variables = {"params": ref["params"], FP8: ref["fp8"]}
    kwargs = loss_lib.loss_kwargs(batch)  # the model returns token CE, not logits
    if update:
        losses, mutated = ref_model.apply(variables, batch["inputs"], **kwargs, mutable=[FP8])
        fp8 = fp8_state.commit(mutated.get(FP8, {}))
    else:
        losses, fp8 = ref_model.apply(variables, batch["inputs"], **kwargs), ref["fp8"]
    logps_B = loss_lib.response_logps(losses, batch[loss_lib.WEIGHTS])
    return jax.lax.stop_gradient(logps_B), fp8


def preference_batch(batch, ref_logps_B, dpo: DpoSpec) -> dict:
    """``batch`` with what ``loss.micro_batch_loss`` needs for DPO: reference log-probs, beta and
    label smoothing (per row, so micro-batches and replicas split them with the rows)."""
    rows = batch["inputs"].shape[0]
    full = lambda v: jnp.full((rows,), v, jnp.float32)
    return {**batch, loss_lib.REF_LOGPS: ref_logps_B, loss_lib.BETA: full(dpo.beta),
            loss_lib.SMOOTHING: full(dpo.label_smoothing)}  # fmt: skip


def make_train_step(model, tx, run: RunSpec, mesh=None):
    """Build the pure DPO ``train_step(state, batch) -> (state, metrics)``: the reference's
    forward, then ``step.make_train_step``'s step of the policy on the DPO loss.

    Metrics: the train step's, with 'loss' DPO's and the ``loss.PAIR_STATS`` (means over
    the batch's pairs).
    """
    policy_step = step_lib.make_train_step(model, tx, run, mesh)
    ref_model = reference_model(model, mesh)

    def train_step(state: step_lib.TrainState, batch):
        with sharding_lib.activation_sharding(mesh):
            ref_logps_B, ref_fp8 = reference_logps(ref_model, state.ref, batch, update=True)
        new, metrics = policy_step(state, preference_batch(batch, ref_logps_B, run.dpo))
        ok = new.bad_steps == 0  # a skipped step commits no FP8 state, the reference's neither
        ref_fp8 = fp8_state.keep_if_finite(ref_fp8, state.ref["fp8"], ok)
        return new.replace(ref=dict(params=state.ref["params"], fp8=ref_fp8)), metrics

    return train_step


def make_eval_step(model, mesh, dpo: DpoSpec):
    """``eval_step(state, batch) -> dict``: DPO's loss and ``PAIR_STATS`` summed over the
    batch's real pairs, and their number ('pairs'); no FP8 state changes."""
    ref_model = reference_model(model, mesh)
    coll = step_lib.state_collection(model)

    def eval_step(state: step_lib.TrainState, batch):
        weights = batch[loss_lib.WEIGHTS]
        with sharding_lib.activation_sharding(mesh):
            ref_B, _ = reference_logps(ref_model, state.ref, batch, update=False)
            variables = {"params": optim.materialize(state.params), coll: state.fp8}
            losses = model.apply(variables, batch["inputs"], **loss_lib.loss_kwargs(batch))
        policy_B = loss_lib.response_logps(losses, weights)
        mask_P = loss_lib.pair_mask(weights)
        sums = loss_lib.dpo_sums(policy_B, ref_B, mask_P, dpo.beta, dpo.label_smoothing)
        return {**sums, "pairs": jnp.sum(mask_P)}

    return eval_step


def evaluate(eval_step, state, batches, sharding) -> dict:
    """Validation DPO loss and pair statistics, means over every held-out pair."""
    sums = [eval_step(state, sharding_lib.put_batch(b, sharding)) for b in batches]
    total = {k: float(np.sum([s[k] for s in jax.device_get(sums)])) for k in sums[0]}
    pairs = max(total.pop("pairs"), 1.0)
    return {f"val_{k}": v / pairs for k, v in total.items()}
