"""python train.py --config configs/olmoe_1b7b.py --workdir /tmp/olmoe_1b7b

OLMoE-1B-7B shape on one GPU: d_model 2048, 16 blocks of 16-head attention (q/k RMSNorm over
the whole projection) with 64 routed SwiGLU experts each (top-8, 1024 wide, top-k weights not
renormalised), vocabulary 50304: 6.9B parameters, 1.3B active per token. FP8 level O2 (FP8
expert GEMMs, FP8/FP16 Adam moments, FP16 masters), bf16 compute, unrolled blocks with full
remat, 8k tokens per step. Set ``--config.data.path`` to a large corpus.
"""

import ml_collections

from fp8jax.configs import base  # every config starts from its fields

__all__ = ["get_config"]


def get_config() -> ml_collections.ConfigDict:
    """OLMoE-1B-7B-shaped MoE on one GPU."""
    c = base.get_config()  # every field; the lines below override the tiny defaults
    m = c.model
    m.style = "moe"  # LLaMA attention, routed experts in place of the MLP
    m.vocab_size = 50304  # BPE vocabulary
    m.d_model = 2048  # residual width
    m.num_layers = 16  # transformer blocks
    m.num_heads = 16  # 128-wide heads
    m.num_kv_heads = 16  # no grouped-query attention
    m.qk_norm = "full"  # RMSNorm over all heads' q and k (OLMoE)
    m.max_len = 4096  # longest sequence, tokens
    m.dtype = "bfloat16"  # compute dtype
    m.remat_policy = "full"  # recompute each block in the backward pass
    # Unrolled blocks: under nn.scan XLA copies each block's f32 expert stacks out of the
    # stacked params before the FP8 cast kernel reads them (longer compile, faster step).
    m.scan_layers = False
    m.attention_impl = "cudnn"  # flash attention (GPU only; 'xla' to run on CPU)
    e = m.moe
    e.num_experts = 64  # routed experts per block
    e.top_k = 8  # experts each token goes to
    e.d_ff = 1024  # each expert's SwiGLU width
    e.normalize_top_k = False  # OLMoE weights the top-k by their softmax probabilities as they are
    e.aux_loss_coef = 0.01  # load-balancing loss weight
    e.z_loss_coef = 1e-3  # router z-loss weight
    c.fp8.level = "O2"  # FP8 GEMMs, FP8/FP16 Adam moments, FP16 masters

    c.batch_size = 4  # sequences per step: 8192 tokens
    c.seq_len = 2048  # tokens per sequence
    c.num_train_steps = 50_000  # optimizer steps
    c.learning_rate = 4e-4  # peak learning rate
    c.warmup_steps = 2000  # linear warm-up steps
    c.eval_every_steps = 1000  # validate every N steps
    c.eval_batches = 20  # validation batches per evaluation
    c.log_every_steps = 50  # scalars every N steps
    c.fp8_stats_every_steps = 1000  # FP8 health every N steps
    c.checkpoint_every_steps = 2000  # save every N steps
    c.sample_tokens = 64  # tokens sampled at the end
    return c
