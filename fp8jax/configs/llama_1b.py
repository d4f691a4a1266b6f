"""python train.py --config configs/llama_1b.py --workdir /tmp/llama_1b

LLaMA-style 1.1B (TinyLlama shape): d_model 2048, 22 layers, 32 heads sharing 4 key/value
heads, SwiGLU d_ff 5632, RoPE, RMSNorm, no biases, seq 2048, vocabulary 32768, untied head:
1.10B parameters. FP8 level O1, bf16 compute, one GPU, 16k tokens per step; O1's step is
faster than O0's (measured: docs/performance.md). Set ``--config.data.path`` to a large corpus.
"""

import ml_collections

from fp8jax.configs import base  # every config starts from its fields

__all__ = ["get_config"]


def get_config() -> ml_collections.ConfigDict:
    """LLaMA-style 1.1B on one GPU."""
    c = base.get_config()  # every field; the lines below override the tiny defaults
    m = c.model
    m.style = "llama"  # RoPE, RMSNorm, SwiGLU, no biases
    m.vocab_size = 32768  # BPE vocabulary
    m.d_model = 2048  # residual width
    m.num_layers = 22  # transformer blocks
    m.num_heads = 32  # 64-wide query heads
    m.num_kv_heads = 4  # grouped-query attention: 8 query heads per key/value head
    m.d_ff = 5632  # SwiGLU hidden width (~2.75 x d_model)
    m.max_len = 2048  # longest sequence, tokens (RoPE has no table; checked against seq_len)
    m.dtype = "bfloat16"  # compute dtype
    m.scan_layers = False  # unrolled blocks: nn.scan's stacked buffers cost copies
    m.remat_policy = "none"  # no recompute: 16k tokens x 22 layers of activations fit one GPU
    m.attention_impl = "cudnn"  # flash attention (GPU only; 'xla' to run on CPU)

    c.batch_size = 8  # sequences per step: 16384 tokens
    c.seq_len = 2048  # tokens per sequence
    c.num_train_steps = 50_000  # optimizer steps (~820M tokens)
    c.learning_rate = 4e-4  # TinyLlama peak
    c.warmup_steps = 2000  # linear warm-up steps
    c.eval_every_steps = 1000  # validate every N steps
    c.eval_batches = 20  # validation batches per evaluation
    c.log_every_steps = 50  # scalars every N steps
    c.fp8_stats_every_steps = 1000  # FP8 health every N steps
    c.checkpoint_every_steps = 2000  # save every N steps
    c.sample_tokens = 64  # tokens sampled at the end
    return c
