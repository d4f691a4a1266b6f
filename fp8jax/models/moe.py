"""The Mixture-of-Experts feed-forward layer (``MoeMlp``): a router and routed SwiGLU experts.

Shape suffixes: T tokens (batch x length, flattened), D d_model, E experts, k experts per token
(top_k), N = T * k token-expert pairs, F an expert's hidden width, 2 SwiGLU's gate/up pair.

Routing (``route``) runs in f32 and never in FP8: softmax scores (Mixtral, Qwen-MoE, OLMoE) or
sigmoid scores (DeepSeek-V3) whose selection adds a balancing bias. The N pairs are sorted by
expert (stable, so each expert sees its tokens in token order) and the experts run as two
grouped GEMMs (``fp8jax.nn.grouped.GroupedLinear``: gate/up, then down; FP8 at O1+) over the
sorted rows; their outputs are unsorted and summed with the router's weights. 'capacity'
dispatch moves each expert's pairs past its capacity behind the last group, where the grouped
GEMM gives 0.

Besides its output the layer sows, per call, the weighted auxiliary losses into ``MOE_LOSSES``
(the train step adds them to the objective's loss) and its routing metrics into ``MOE_METRICS``
(``layer_metrics`` stacks them per layer); a sigmoid router with ``bias_update_rate`` > 0 keeps
its bias in ``MOE_STATE``, which ``update_bias`` steps from the expert loads.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import traverse_util

from fp8jax.models import layers
from fp8jax.models.config import ModelConfig, MoeSpec
from fp8jax.models.params import INIT_STD, normal_init
from fp8jax.nn.grouped import GroupedLinear
from fp8jax.ops import grouped, grouped_mgpu, rows
from fp8jax.parallel import expert

__all__ = [
    "LOAD",
    "MOE_LOSSES",
    "MOE_METRICS",
    "MOE_STATE",
    "MoeMlp",
    "Router",
    "Routing",
    "aux_losses",
    "dispatch_keys",
    "layer_metrics",
    "route",
    "stacked_bias",
    "unstacked_bias",
    "update_bias",
]

MOE_LOSSES = "moe_losses"  # sown: each layer's weighted auxiliary loss (added to the loss)
MOE_METRICS = "moe_metrics"  # sown: each layer's routing metrics (logged)
MOE_STATE = "moe_state"  # variables: the sigmoid router's balancing bias (updated by the step)
LOAD = "load"  # the metric holding each expert's share of the assignments [E]


@dataclasses.dataclass(frozen=True)
class Routing:
    """Which experts each token goes to and with what weight, and the scores behind it."""

    idx_Txk: jax.Array  # int32 experts of each token, best first
    weights_Txk: jax.Array  # f32 weights of their outputs
    probs_TxE: jax.Array  # f32 router probabilities (sigmoid: scores over their sum)


def route(logits_TxE: jax.Array, spec: MoeSpec, bias_E: jax.Array | None = None) -> Routing:
    """Top-k routing of f32 logits: softmax, or sigmoid scores selected with ``bias_E`` added.

    The bias only picks the experts (DeepSeek-V3's auxiliary-loss-free balancing); the weights
    are the scores themselves, renormalised over the k where ``spec.normalize_top_k``.
    """
    logits_TxE = logits_TxE.astype(jnp.float32)
    if spec.router == "softmax":
        scores_TxE = jax.nn.softmax(logits_TxE, axis=-1)
        weights_Txk, idx_Txk = jax.lax.top_k(scores_TxE, spec.top_k)
        probs_TxE = scores_TxE
    else:
        scores_TxE = jax.nn.sigmoid(logits_TxE)
        select_TxE = scores_TxE if bias_E is None else scores_TxE + bias_E
        _, idx_Txk = jax.lax.top_k(select_TxE, spec.top_k)
        weights_Txk = jnp.take_along_axis(scores_TxE, idx_Txk, axis=-1)
        probs_TxE = scores_TxE / jnp.sum(scores_TxE, axis=-1, keepdims=True)
    if spec.normalize_top_k:
        weights_Txk = weights_Txk / jnp.sum(weights_Txk, axis=-1, keepdims=True)
    return Routing(idx_Txk.astype(jnp.int32), weights_Txk, probs_TxE)


def aux_losses(logits_TxE: jax.Array, r: Routing, num_experts: int) -> dict[str, jax.Array]:
    """Unweighted auxiliary losses and routing metrics of one layer (f32 scalars, load [E]).

    ``balance``: E * sum_e f_e * P_e (Switch/Mixtral), f_e the share of the T*k assignments
    that go to e, P_e the mean router probability of e; 1 when perfectly balanced. ``z``: the
    mean over tokens of logsumexp(logits)^2. ``load`` is f [E]; ``load_max_over_mean`` its
    max over its mean; ``router_entropy`` the mean entropy of the tokens' probabilities (nats).
    """
    onehot_NxE = jax.nn.one_hot(r.idx_Txk.reshape(-1), num_experts, dtype=jnp.float32)
    load_E = jnp.mean(onehot_NxE, axis=0)  # f_e: sums to 1 over the experts
    mean_prob_E = jnp.mean(r.probs_TxE, axis=0)
    lse_T = jax.nn.logsumexp(logits_TxE.astype(jnp.float32), axis=-1)
    p_TxE = r.probs_TxE
    entropy_T = -jnp.sum(jnp.where(p_TxE > 0, p_TxE * jnp.log(p_TxE), 0.0), axis=-1)
    return {
        "balance_loss": num_experts * jnp.sum(jax.lax.stop_gradient(load_E) * mean_prob_E),
        "z_loss": jnp.mean(lse_T**2),
        LOAD: load_E,
        "load_max_over_mean": jnp.max(load_E) * num_experts,  # the mean share is 1/E
        "router_entropy": jnp.mean(entropy_T),
    }


def dispatch_keys(idx_Txk: jax.Array, spec: MoeSpec) -> tuple[jax.Array, jax.Array]:
    """``(key_N, kept_N)``: each pair's group for the sort and whether it reaches its expert.

    Pair n = t * k + j (token t's j-th expert). Dropless: the key is the expert and every pair
    is kept. Capacity: an expert keeps its first C = ceil(capacity_factor * T * k / E) pairs in
    token order; the others get key E, sorted behind every group (the grouped GEMM gives 0).
    """
    e = spec.num_experts
    expert_N = idx_Txk.reshape(-1)
    if spec.dispatch == "dropless":
        return expert_N, jnp.ones(expert_N.shape, bool)
    capacity = math.ceil(spec.capacity_factor * expert_N.shape[0] / e)
    onehot_NxE = jax.nn.one_hot(expert_N, e, dtype=jnp.int32)
    # Each pair's place among its expert's pairs, in token order (0-based).
    rank_N = jnp.sum(jnp.cumsum(onehot_NxE, axis=0) * onehot_NxE, axis=-1) - 1
    kept_N = rank_N < capacity
    return jnp.where(kept_N, expert_N, e), kept_N


class Router(nn.Module):
    """The router's f32 kernel [D, E] (no FP8 ever) and, for the balancing bias, its bias [E]."""

    spec: MoeSpec
    d_model: int

    @nn.compact
    def __call__(self, x_TxD: jax.Array) -> tuple[jax.Array, Routing]:
        """``(logits_TxE, routing)`` of ``x_TxD``, in f32."""
        e = self.spec.num_experts
        init = normal_init(("embed", None))
        kernel_DxE = self.param("kernel", init, (self.d_model, e), jnp.float32)
        # HIGHEST: a full f32 product on GPUs too, which would otherwise take TF32 inputs.
        logits_TxE = jnp.dot(
            x_TxD.astype(jnp.float32), kernel_DxE, precision=jax.lax.Precision.HIGHEST
        )
        bias_E = None
        if self.spec.router == "sigmoid" and self.spec.bias_update_rate > 0:
            bias_E = self.variable(MOE_STATE, "bias", jnp.zeros, (e,), jnp.float32).value
        return logits_TxE, route(logits_TxE, self.spec, bias_E)


class MoeMlp(nn.Module):
    """Routed SwiGLU experts (and an optional shared expert) in place of the block's MLP.

    Params at ``mlp/``: ``router/kernel`` [D, E] f32, ``experts_wi/kernel`` [E, D, 2, F] (gate
    then up), ``experts_wo/kernel`` [E, F, D]; with ``shared_d_ff`` > 0 the dense SwiGLU
    ``shared`` (``layers.Mlp`` of that width) and with ``shared_gate`` its f32 gate
    ``shared_gate/kernel`` [D, 1].
    """

    cfg: ModelConfig

    @nn.compact
    def __call__(self, x_BxLxD: jax.Array, ln=None) -> jax.Array:
        """The layer's output for ``x``; ``ln`` must be None (no norm folds into it)."""
        del ln  # only GPT's fused LayerNorm folds, and no MoE family runs LayerNorm
        c, spec = self.cfg, self.cfg.moe
        e, k, f = spec.num_experts, spec.top_k, spec.d_ff
        b, length, d = x_BxLxD.shape
        x_TxD = x_BxLxD.reshape(b * length, d).astype(c.dtype)
        logits_TxE, r = Router(spec, d, name="router")(x_TxD)
        stats = aux_losses(logits_TxE, r, e)

        key_N, kept_N = dispatch_keys(r.idx_Txk, spec)
        order_N = jnp.argsort(key_N, stable=True)  # pairs grouped by expert, in token order
        inv_N = jnp.argsort(order_N)  # where each pair sits among the sorted ones
        sizes_E = jnp.bincount(key_N, length=e + 1)[:e].astype(jnp.int32)  # without dropped
        # Under expert parallelism the kernels are this device's own experts (expert.split_axis).
        common = dict(
            recipe=c.recipe,
            dtype=c.dtype,
            param_dtype=c.param_dtype,
            split_axis=expert.split_axis(),
        )
        wi = GroupedLinear(
            e,
            d,
            (2, f),
            names=("expert", "embed", None, "mlp"),
            name="experts_wi",
            **common,
        )
        wo = GroupedLinear(
            e,
            f,
            (d,),
            names=("expert", "mlp", "embed"),
            std=INIT_STD / math.sqrt(2 * c.num_layers),  # as the dense MLP's wo
            name="experts_wo",
            **common,
        )

        def experts(xs_NxD, sizes_E, lay=None):
            # On a padded layout the GEMMs leave its padding rows 0, and silu(0) * 0 is 0.
            gu_Nx2xF = wi(xs_NxD, sizes_E, lay)
            return wo(nn.silu(gu_Nx2xF[:, 0]) * gu_Nx2xF[:, 1], sizes_E, lay)

        # Expert parallelism (an 'expert' mesh axis the step runs this layer over): the pairs
        # go to their experts' devices by all-to-all and come back weighted and summed.
        y_TxD = expert.routed(
            x_TxD,
            r.idx_Txk,
            r.weights_Txk,
            experts,
            num_experts=e,
            capacity_factor=spec.capacity_factor if spec.dispatch == "capacity" else None,
            fp8_dispatch=spec.fp8_dispatch,
        )
        if y_TxD is None:
            y_TxkxD = _dispatched(x_TxD, order_N, inv_N, sizes_E, k, experts, c.recipe, f)
            y_TxD = rows.combine(y_TxkxD, r.weights_Txk)
        if spec.shared_d_ff:
            shared_cfg = dataclasses.replace(c, d_ff=spec.shared_d_ff)
            s_TxD = layers.Mlp(shared_cfg, name="shared")(x_TxD[None])[0].astype(jnp.float32)
            if spec.shared_gate:
                gate = nn.Dense(
                    1,
                    use_bias=False,
                    dtype=jnp.float32,
                    param_dtype=jnp.float32,
                    kernel_init=normal_init(("embed", None)),
                    precision=jax.lax.Precision.HIGHEST,
                    name="shared_gate",
                )
                s_TxD = s_TxD * jax.nn.sigmoid(gate(x_TxD.astype(jnp.float32)))
            y_TxD = y_TxD + s_TxD

        aux = spec.aux_loss_coef * stats["balance_loss"] + spec.z_loss_coef * stats["z_loss"]
        self.sow(MOE_LOSSES, "aux_loss", aux)
        metrics = {name: jax.lax.stop_gradient(v) for name, v in stats.items()}
        if spec.dispatch == "capacity":
            metrics["dropped"] = 1.0 - jnp.mean(kept_N.astype(jnp.float32))  # share of pairs
        for name, value in metrics.items():
            self.sow(MOE_METRICS, name, value)
        return y_TxD.astype(c.dtype).reshape(b, length, d)


def _dispatched(x_TxD, order_N, inv_N, sizes_E, k: int, experts, recipe, f: int) -> jax.Array:
    """``y_TxkxD``: each token's k pairs through their experts (``experts(rows, sizes,
    layout)``), their outputs back in pair order (a dropped pair's row 0).

    The pairs' rows are gathered straight into the places the expert GEMMs read: the sorted
    rows, or the padded layout that the recipe's grouped GEMMs run on
    (``ops.grouped.dispatch_layout``), so no GEMM pads or unpads them again. ``ops.rows``: the
    gradients gather too.
    """
    t, d = x_TxD.shape
    n = order_N.shape[0]
    lay = grouped.dispatch_layout(recipe, sizes_E, n, (d, 2 * f), (f, d))
    if lay is None:
        xs_NxD = rows.repeat_rows(x_TxD, order_N // k, inv_N.reshape(t, k))
        ys_NxD = experts(xs_NxD, sizes_E)
        return rows.take_rows(ys_NxD, inv_N, order_N).reshape(t, k, d)
    # Padded row r holds sorted pair src_R[r] (n: a padding row, read as 0); pair p sits at
    # padded row dst_M[inv_N[p]] (R and up: dropped, past every group).
    pair_R = order_N[jnp.minimum(lay.src_R, n - 1)]
    filled_R = grouped_mgpu.layout_rows(lay)
    tok_R = jnp.where(filled_R, pair_R // k, t)
    row_N = lay.dst_M[inv_N]
    xs_RxD = rows.repeat_rows(x_TxD, tok_R, row_N.reshape(t, k))
    ys_RxD = experts(xs_RxD, grouped.padded_sizes(lay), lay)
    return rows.take_rows(ys_RxD, row_N, jnp.where(filled_R, pair_R, n)).reshape(t, k, d)


def _layer_order(path: tuple[str, ...]) -> tuple:
    """Sort key of a flattened path: block_2 before block_10."""
    return tuple(int(p) if p.isdigit() else p for k in path for p in re.split(r"(\d+)", k))


def layer_metrics(tree, scanned: bool) -> dict[str, jax.Array]:
    """A sown ``MOE_METRICS`` (or ``MOE_LOSSES``) tree as ``{name: [layers, ...]}``.

    ``scanned``: the layers are stacked by ``nn.scan`` (each value already has the layer axis);
    otherwise each block's value is one layer, in block order.
    """
    flat = traverse_util.flatten_dict(dict(tree))
    out: dict[str, list] = {}
    for path in sorted(flat, key=_layer_order):
        (value,) = flat[path]  # sow's one-element tuple
        out.setdefault(path[-1], []).append(value if scanned else value[None])
    return {name: jnp.concatenate(values) for name, values in out.items()}


def update_bias(moe_state, loads_LxE: jax.Array, rate: float, scanned: bool):
    """DeepSeek-V3's balancing step: each bias += rate * sign(mean load - its expert's load).

    ``moe_state``: the ``MOE_STATE`` tree (each MoE layer's ``router/bias``); ``loads_LxE``:
    the layers' expert loads in layer order (``layer_metrics``' ``LOAD``); ``scanned`` as there.
    """
    bias_LxE = stacked_bias(moe_state, scanned)
    loads_LxE = loads_LxE.astype(jnp.float32)
    mean_Lx1 = jnp.mean(loads_LxE, axis=-1, keepdims=True)
    bias_LxE = bias_LxE + rate * jnp.sign(mean_Lx1 - loads_LxE)
    return unstacked_bias(bias_LxE, moe_state, scanned)


def stacked_bias(moe_state, scanned: bool) -> jax.Array:
    """The ``MOE_STATE`` tree's biases as one [layers, experts] array, in layer order
    (``scanned``: the tree holds one [layers, experts] leaf, else one [experts] per block)."""
    flat = traverse_util.flatten_dict(dict(moe_state))
    paths = sorted(flat, key=_layer_order)
    return jnp.concatenate([flat[p] if scanned else flat[p][None] for p in paths])


def unstacked_bias(bias_LxE: jax.Array, like, scanned: bool) -> dict:
    """``bias_LxE`` ([layers, experts], layer order) as a ``MOE_STATE`` tree of the paths of
    ``like`` (a tree of that layout; ``scanned`` as in :func:`stacked_bias`)."""
    paths = sorted(traverse_util.flatten_dict(dict(like)), key=_layer_order)
    new = {paths[0]: bias_LxE} if scanned else {p: bias_LxE[i] for i, p in enumerate(paths)}
    return traverse_util.unflatten_dict(new)


layers.MLP_MODULES["moe"] = MoeMlp  # the block kind 'moe' (models.config.MLPS)
