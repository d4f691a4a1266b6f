"""python train.py --config configs/llama_7b.py --workdir /tmp/llama_7b

LLaMA-2-7B shapes: d_model 4096, 32 layers, 32 heads (no grouping), SwiGLU d_ff 11008, seq
4096, vocabulary 32000, untied head: 6.74B parameters. Meant for 8 GPUs at FP8 level O3 (FP8
Adam, optimizer state and master weights sharded over an fsdp axis of 8, weights all-gathered
in FP8), full block remat, 64k tokens per step (one-GPU figures at this batch: measured:
docs/performance.md). Set ``--config.data.path`` to a large corpus.
"""

import ml_collections

from fp8jax.configs import base  # every config starts from its fields

__all__ = ["get_config"]


def get_config() -> ml_collections.ConfigDict:
    """LLaMA-2-7B shapes on 8 GPUs, FP8-LM level O3."""
    c = base.get_config()  # every field; the lines below override the tiny defaults
    m = c.model
    m.style = "llama"  # RoPE, RMSNorm, SwiGLU, no biases
    m.vocab_size = 32000  # LLaMA-2's SentencePiece vocabulary size
    m.d_model = 4096  # residual width
    m.num_layers = 32  # transformer blocks
    m.num_heads = 32  # 128-wide heads
    m.num_kv_heads = 32  # LLaMA-2-7B uses plain multi-head attention
    m.d_ff = 11008  # SwiGLU hidden width
    m.max_len = 4096  # longest sequence, tokens (RoPE has no table; checked against seq_len)
    m.dtype = "bfloat16"  # compute dtype
    m.scan_layers = False  # unrolled blocks: nn.scan's stacked buffers cost copies
    m.remat_policy = "full"  # recompute each block in the backward pass: 4k-token activations
    m.attention_impl = "cudnn"  # flash attention (GPU only; 'xla' to run on CPU)

    c.fp8.level = "O3"  # FP8 GEMMs + FP8 Adam + sharded state: 6 bytes/param before sharding

    c.batch_size = 16  # sequences per step: 65536 tokens
    c.seq_len = 4096  # tokens per sequence
    c.num_train_steps = 20_000  # optimizer steps (~1.3B tokens)
    c.learning_rate = 3e-4  # LLaMA-2 7B peak
    c.warmup_steps = 2000  # linear warm-up steps
    c.eval_every_steps = 1000  # validate every N steps
    c.eval_batches = 10  # validation batches per evaluation
    c.log_every_steps = 20  # scalars every N steps
    c.fp8_stats_every_steps = 1000  # FP8 health every N steps
    c.checkpoint_every_steps = 1000  # save every N steps
    c.sample_tokens = 64  # tokens sampled at the end

    c.mesh.fsdp = 8  # shard params and optimizer state over 8 GPUs (data = the rest: 1)
    return c
