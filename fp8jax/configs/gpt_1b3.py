"""python train.py --config configs/gpt_1b3.py --workdir /tmp/gpt_1b3

GPT 1.3B: d_model 2048, 24 layers, 16 heads, GELU MLP 4x, seq 2048, batch 8 (16384 tokens per
step), vocabulary 32768, untied LM head: 1.35B parameters. FP8 level O1, bf16 compute, one GPU:
the shape the step benchmarks and the PyTorch reference compare (measured:
docs/performance.md). ``--config.model.fp8_lm_head=True`` runs the LM head in FP8 too, a little
faster for a little more loss. Set ``--config.data.path`` to a large corpus.
"""

import ml_collections

from fp8jax.configs import base  # every config starts from its fields

__all__ = ["get_config"]


def get_config() -> ml_collections.ConfigDict:
    """GPT 1.3B on one GPU, the shape of the performance reference."""
    c = base.get_config()  # every field; the lines below override the tiny defaults
    m = c.model
    m.style = "gpt"  # learned positions, LayerNorm, GELU, biases
    m.vocab_size = 32768  # BPE vocabulary
    m.d_model = 2048  # residual width
    m.num_layers = 24  # transformer blocks
    m.num_heads = 16  # 128-wide heads (cuDNN flash attention's best case)
    m.num_kv_heads = 16  # plain multi-head attention
    m.d_ff = 8192  # 4 x d_model
    m.max_len = 2048  # learned position table, tokens
    m.dtype = "bfloat16"  # compute dtype
    m.scan_layers = False  # unrolled blocks: nn.scan's stacked buffers cost copies
    # One FP8 GEMM for Q, K and V: one quantization of x, 288 FP8 GEMMs instead of 360, a
    # faster O1 step (measured: docs/performance.md).
    m.fused_qkv = True  # kernel [embed, kv_heads, group + 2, head_dim]
    m.remat_policy = "none"  # no recompute: 16k tokens x 24 layers of activations fit one GPU
    m.attention_impl = "cudnn"  # flash attention (GPU only; 'xla' to run on CPU)

    c.batch_size = 8  # sequences per step: 16384 tokens
    c.seq_len = 2048  # tokens per sequence
    c.num_train_steps = 50_000  # optimizer steps (~820M tokens)
    c.learning_rate = 2e-4  # GPT-3 1.3B peak
    c.warmup_steps = 2000  # linear warm-up steps
    c.eval_every_steps = 1000  # validate every N steps
    c.eval_batches = 20  # validation batches per evaluation
    c.log_every_steps = 50  # scalars every N steps
    c.fp8_stats_every_steps = 1000  # FP8 health every N steps
    c.checkpoint_every_steps = 2000  # save every N steps
    c.sample_tokens = 64  # tokens sampled at the end
    return c
