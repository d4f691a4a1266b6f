"""python train.py --config configs/moe_tiny.py --workdir /tmp/fp8jax_moe_tiny

CPU demo of a Mixture-of-Experts model: 2 blocks of LLaMA attention, each with 8 routed SwiGLU
experts (top-2, 64 wide) in place of the MLP, trained at FP8 level O1 on the shipped corpus
(the experts' grouped GEMMs in FP8, the router in f32). The log line carries each layer's
routing metrics (``moe_load_max_over_mean``, ``moe_router_entropy``, ``moe_balance_loss``,
``moe_z_loss``); docs/moe.md walks through a run. Variants: ``:sigmoid`` routes with sigmoid
scores and DeepSeek-V3's balancing bias, ``:capacity`` caps each expert's tokens.
"""

import ml_collections

from fp8jax.configs import base  # every config starts from its fields

__all__ = ["get_config"]


def get_config(variant: str = "softmax") -> ml_collections.ConfigDict:
    """Tiny MoE config; ``variant`` is 'softmax', 'sigmoid' or 'capacity'."""
    c = base.get_config()  # every field, with the tiny CPU run's defaults
    c.model.style = "moe"  # LLaMA attention, routed experts in place of the MLP
    c.model.d_model = 64  # residual width
    c.model.num_heads = 4  # attention heads
    c.model.num_kv_heads = 2  # grouped-query: 2 query heads per key/value head
    c.model.max_len = 32  # longest sequence, tokens
    e = c.model.moe
    e.num_experts = 8  # routed experts per block
    e.top_k = 2  # experts each token goes to
    e.d_ff = 64  # each expert's SwiGLU width
    e.aux_loss_coef = 0.01  # load-balancing loss weight (Switch/Mixtral)
    e.z_loss_coef = 1e-3  # router z-loss weight
    if variant == "sigmoid":
        e.router = "sigmoid"  # DeepSeek-V3's sigmoid scores
        e.bias_update_rate = 1e-3  # its auxiliary-loss-free balancing bias, step per update
        e.aux_loss_coef = 0.0  # the bias balances instead of the auxiliary loss
    elif variant == "capacity":
        e.dispatch = "capacity"  # each expert takes at most its capacity, the rest dropped
        e.capacity_factor = 1.25  # slots per expert over its even share
    c.seq_len = 32  # tokens per sequence
    c.batch_size = 16  # sequences per optimizer step
    c.num_train_steps = 200  # optimizer steps
    c.eval_every_steps = 100  # validate every N steps
    c.checkpoint_every_steps = 100  # save every N steps (and at the end)
    return c
