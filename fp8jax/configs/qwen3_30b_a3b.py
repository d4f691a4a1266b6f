"""python train.py --config configs/qwen3_30b_a3b.py --workdir /tmp/qwen3_30b_a3b

Qwen3-30B-A3B shape: d_model 2048, 48 blocks of grouped-query attention (32 query heads, 4
key/value heads, each 128 wide, q/k RMSNorm per head) with 128 routed SwiGLU experts each
(top-8, 768 wide, top-k weights renormalised), vocabulary 151936: 30.5B parameters, 3.3B active
per token. FP8 level O3 on 8 GPUs: the experts split over 4 ``expert`` shards and every weight
over 2 ``fsdp`` shards, gathered per block as it runs (68.8 GiB per device by
``benchmarks.memory_sim``, against 81.9 with the experts split 8 ways), bf16 compute, full
block remat. ``:1gpu`` is the same blocks at a depth of 6 for one GPU at O2 (the
benchmarks' variant). Set ``--config.data.path`` to a large corpus.
"""

import ml_collections

from fp8jax.configs import base  # every config starts from its fields
from fp8jax.errors import ConfigError

__all__ = ["get_config"]


def get_config(variant: str = "8gpu") -> ml_collections.ConfigDict:
    """Qwen3-30B-A3B-shaped MoE; ``variant`` '8gpu' (the whole depth) or '1gpu' (6 blocks)."""
    c = base.get_config()  # every field; the lines below override the tiny defaults
    m = c.model
    m.style = "moe"  # LLaMA attention, routed experts in place of the MLP
    m.vocab_size = 151936  # Qwen's vocabulary
    m.d_model = 2048  # residual width
    m.num_layers = 48  # transformer blocks
    m.num_heads = 32  # query heads
    m.num_kv_heads = 4  # grouped-query attention: 8 query heads per key/value head
    m.head_width = 128  # wider than d_model / num_heads (64), as Qwen3's
    m.qk_norm = "head"  # RMSNorm over each head of q and k (Qwen3)
    m.max_len = 4096  # longest sequence, tokens
    m.rope_theta = 1_000_000.0  # RoPE base
    m.norm_eps = 1e-6  # RMSNorm epsilon
    m.dtype = "bfloat16"  # compute dtype
    m.remat_policy = "full"  # recompute each block in the backward pass
    m.attention_impl = "cudnn"  # flash attention (GPU only; 'xla' to run on CPU)
    e = m.moe
    e.num_experts = 128  # routed experts per block
    e.top_k = 8  # experts each token goes to
    e.d_ff = 768  # each expert's SwiGLU width
    e.normalize_top_k = True  # the top-8 weights renormalised to sum to 1 (norm_topk_prob)
    e.aux_loss_coef = 0.001  # load-balancing loss weight (Qwen3-MoE's router_aux_loss_coef)
    c.fp8.level = "O3"  # FP8 GEMMs, FP8 Adam, FP16 masters, sharded with FP8 weight gathers
    c.mesh.expert = 4  # experts split over 4 devices, tokens dispatched by all-to-all
    c.mesh.fsdp = 2  # every weight sharded over 2 devices, gathered per block (O3)
    c.batch_size = 16  # sequences per step: 32k tokens over 8 devices
    if variant == "1gpu":
        m.num_layers = 6  # 6 of the 48 blocks: 4.4B parameters fit one H200 at O2
        c.fp8.level = "O2"  # no sharding on one device
        c.mesh.expert = c.mesh.fsdp = 1  # one device
        c.batch_size = 4  # sequences per step: 8192 tokens
    elif variant != "8gpu":
        raise ConfigError(f"unknown qwen3_30b_a3b variant {variant!r}: use '8gpu' or '1gpu'")

    c.seq_len = 2048  # tokens per sequence
    c.num_train_steps = 50_000  # optimizer steps
    c.learning_rate = 3e-4  # peak learning rate
    c.warmup_steps = 2000  # linear warm-up steps
    c.eval_every_steps = 1000  # validate every N steps
    c.eval_batches = 20  # validation batches per evaluation
    c.log_every_steps = 50  # scalars every N steps
    c.fp8_stats_every_steps = 1000  # FP8 health every N steps
    c.checkpoint_every_steps = 2000  # save every N steps
    c.sample_tokens = 64  # tokens sampled at the end
    return c
