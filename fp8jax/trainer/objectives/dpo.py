"""Preference tuning (DPO): the loss, the frozen reference policy it keeps, its eval metrics.

The policy is the trained model (``TrainState.params``, every FP8 level as in pre-training and
SFT). The reference is a frozen copy of the initial policy (the ``init_from`` checkpoint, or
the random init), the objective's train state ``{'params', 'fp8'}`` (``TrainState.objective``;
with ``'moe_state'``, a copy of the initial router biases, for an MoE model that keeps them):
checkpointed with the state, so a resume is exact, but not in the optimizer and never
differentiated. Each step first runs the reference on the global batch (its sequence
log-probs under ``stop_gradient``: :meth:`Dpo.make_prepare`); the step splits those per-row
log-probs with the rows, so micro-batches, data-parallel replicas, FP8 gradient communication,
O2's masters and O3's gathers all apply to the policy unchanged.

A preference batch is a fine-tuning batch whose rows are pairs (chosen, rejected) of one
prompt, weights on the response tokens only (``dpo_data``). The loss is DPO's, summed over the
pairs; each replica's scale is 1/pairs of the global batch, so micro-batches and replicas add
up to the global mean. Beta and label smoothing are the objective's fields (``config.dpo``).

Reference storage: its weight matrices (kernels, embeddings) in the compute dtype (bf16 on
GPU: 2 bytes/param, half of an f32 copy; what the forward casts them to anyway), vectors
(norm scales, biases) and an MoE router's and shared gate's f32 kernels as the policy stores
them.

Reference FP8 (O1+): its matmuls run in FP8 like the policy's, with their own scale state
(``['fp8']``, a copy of the policy's initial one) under the run's recipe, its amaxes recorded
and committed every step. That costs no extra pass over the operands (current scaling would
add an amax reduction of each operand before its cast), and the frozen weights' scales settle
after the first step; the activations' scales follow the data, so a pair's reference log-prob
can move by FP8 rounding from step to step (a constant offset per pair cancels in the loss;
what remains is noise of FP8's precision). At O0 it is a plain forward.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax import models
from fp8jax._tree import leaf_name, path_key
from fp8jax.models import moe
from fp8jax.nn import state as fp8_state
from fp8jax.nn.state import FP8
from fp8jax.optim import adam as optim
from fp8jax.optim.master import F32_LAYERS
from fp8jax.parallel import sharding as sharding_lib
from fp8jax.trainer import loss as loss_lib
from fp8jax.trainer.objectives.base import Objective, register

PAIR_STATS = ("reward_accuracy", "reward_margin", "chosen_logp", "rejected_logp")  # pair sums
REF_LOGPS = "ref_logps"  # the per-row input of the loss: the reference's log-probs [B]
_MATRICES = ("kernel", "embedding")  # reference leaves stored in the compute dtype


def pair_mask(weights_BxL) -> jax.Array:
    """1.0 for each (chosen, rejected) row pair with a response token, 0.0 for padding [B/2]."""
    has_tokens_B = jnp.sum(weights_BxL.astype(jnp.float32), axis=-1) > 0
    return has_tokens_B.reshape(-1, 2)[:, 0].astype(jnp.float32)


def dpo_sums(policy_B, ref_B, mask_P, beta, label_smoothing=0.0) -> dict:
    """DPO's loss and pair statistics, each summed over the real pairs (``mask_P``).

    Rows alternate chosen, rejected. Implicit reward r = beta * (log pi - log pi_ref) of a
    response; per pair the loss is -log sigmoid(r_c - r_r) (with label smoothing e:
    -(1 - e) log sigmoid(d) - e log sigmoid(-d), the loss for labels flipped with chance e).
    """
    pi_Px2 = policy_B.astype(jnp.float32).reshape(-1, 2)
    reward_Px2 = beta * (pi_Px2 - jax.lax.stop_gradient(ref_B).astype(jnp.float32).reshape(-1, 2))
    d_P = reward_Px2[:, 0] - reward_Px2[:, 1]
    loss_P = -(1.0 - label_smoothing) * jax.nn.log_sigmoid(d_P)
    loss_P -= label_smoothing * jax.nn.log_sigmoid(-d_P)
    terms = dict(
        loss=loss_P,
        reward_accuracy=(d_P > 0).astype(jnp.float32),
        reward_margin=d_P,
        chosen_logp=pi_Px2[:, 0],
        rejected_logp=pi_Px2[:, 1],
    )
    return {k: jnp.sum(v * mask_P) for k, v in terms.items()}


def reference_params(params, dtype):
    """The reference's copy of ``params`` (plain arrays, masters dequantized): weight matrices
    in ``dtype`` (not the f32 kernels of ``F32_LAYERS``), the other leaves as they are."""
    view = optim.materialize(params)

    def one(path, p):
        keep = leaf_name(path) not in _MATRICES or p.ndim < 2
        keep = keep or bool(set(path_key(path)) & set(F32_LAYERS))  # computed in f32
        return jnp.array(p, dtype=p.dtype if keep else dtype, copy=True)  # never the policy's

    return jax.tree_util.tree_map_with_path(one, view)


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
    if ref.get(moe.MOE_STATE):  # an MoE reference's router biases, frozen with its weights
        variables[moe.MOE_STATE] = ref[moe.MOE_STATE]
    kwargs = loss_lib.loss_kwargs(batch)  # the model returns token CE, not logits
    if update:
        losses, mutated = ref_model.apply(variables, batch["inputs"], **kwargs, mutable=[FP8])
        fp8 = fp8_state.commit(mutated.get(FP8, {}))
    else:
        losses, fp8 = ref_model.apply(variables, batch["inputs"], **kwargs), ref["fp8"]
    logps_B = loss_lib.response_logps(losses, batch[loss_lib.WEIGHTS])
    return jax.lax.stop_gradient(logps_B), fp8


@register
@dataclasses.dataclass(frozen=True)
class Dpo(Objective):
    """Direct preference optimisation against the frozen initial policy."""

    name = "dpo"
    loss_keys = ("loss", *PAIR_STATS)
    pairs = True

    beta: float = 0.1  # scale of the implicit reward beta * (log pi - log pi_ref)
    label_smoothing: float = 0.0  # share of pairs assumed mislabelled (0: standard DPO)
    dtype: Any = jnp.float32  # the reference's weight matrices (the run's compute dtype)

    @classmethod
    def from_run(cls, run) -> Dpo:
        """``config.dpo``'s beta and label smoothing, the model's compute dtype."""
        return cls(run.dpo.beta, run.dpo.label_smoothing, run.model.dtype)

    def init_state(self, params, fp8, moe_state=None) -> dict:
        """The frozen reference: the initial policy's weights and a copy of its FP8 state (and
        of its MoE router biases, if it keeps any)."""
        copy = lambda tree: jax.tree.map(lambda x: jnp.array(x, copy=True), tree)
        ref = dict(params=reference_params(params, self.dtype), fp8=copy(fp8))
        if moe_state:
            ref[moe.MOE_STATE] = copy(moe_state)
        return ref

    def keep(self, new, old, ok):
        """The reference's FP8 state of a finite step (a skipped one commits none); its
        params (and router biases) as they were."""
        fp8 = fp8_state.keep_if_finite(new["fp8"], old["fp8"], ok)
        return {**old, "fp8": fp8}

    def make_prepare(self, model, mesh=None):
        """The reference's log-probs of every row, its amaxes recorded and committed."""
        ref_model = reference_model(model, mesh)

        def prepare(ref, batch):
            logps_B, ref_fp8 = reference_logps(ref_model, ref, batch, update=True)
            return {REF_LOGPS: logps_B}, {**ref, "fp8": ref_fp8}

        return prepare

    def scale(self, batch, replicas: int):
        """1/pairs of the global batch, whatever the replicas."""
        del replicas
        return 1.0 / jnp.maximum(jnp.sum(pair_mask(batch[loss_lib.WEIGHTS])), 1.0)

    def adds_up(self, batch) -> bool:
        """Pair sums, each a share of the global mean over the pairs."""
        del batch
        return True

    def micro_batch_loss(self, apply, batch, rows):
        """DPO's pair sums from each row's token CEs and the reference's log-probs."""
        losses_BxL, aux = apply(batch["inputs"], **loss_lib.loss_kwargs(batch))
        logps_B = loss_lib.response_logps(losses_BxL, batch[loss_lib.WEIGHTS])
        mask_P = pair_mask(batch[loss_lib.WEIGHTS])
        # beta and smoothing as f32 scalars, as a traced hyper-parameter: (1 - e) rounds in f32.
        beta, smoothing = jnp.float32(self.beta), jnp.float32(self.label_smoothing)
        return dpo_sums(logps_B, rows[REF_LOGPS], mask_P, beta, smoothing), aux

    def make_eval(self, model, mesh=None):
        """DPO's loss and ``PAIR_STATS`` summed over the batch's real pairs, and their number
        ('pairs'); the reference's FP8 state unchanged."""
        ref_model = reference_model(model, mesh)

        def metrics(ref, batch, losses_BxL):
            weights = batch[loss_lib.WEIGHTS]
            ref_B, _ = reference_logps(ref_model, ref, batch, update=False)
            policy_B = loss_lib.response_logps(losses_BxL, weights)
            mask_P = pair_mask(weights)
            sums = dpo_sums(policy_B, ref_B, mask_P, self.beta, self.label_smoothing)
            return {**sums, "pairs": jnp.sum(mask_P)}

        return metrics

    def evaluate(self, eval_step, state, batches, sharding) -> dict:
        """Validation DPO loss and pair statistics, means over every held-out pair."""
        sums = [eval_step(state, sharding_lib.put_batch(b, sharding)) for b in batches]
        total = {k: float(np.sum([s[k] for s in jax.device_get(sums)])) for k in sums[0]}
        pairs = max(total.pop("pairs"), 1.0)
        return {f"val_{k}": v / pairs for k, v in total.items()}


__all__ = [
    "PAIR_STATS",
    "REF_LOGPS",
    "Dpo",
    "dpo_sums",
    "pair_mask",
    "reference_logps",
    "reference_model",
    "reference_params",
]
