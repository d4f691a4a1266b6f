"""python train.py --config configs/llama_70b.py --workdir /tmp/llama_70b

A 70B-class LLaMA shape (Llama-2/3-70B's: d_model 8192, 80 layers, 64 query and 8 key/value
heads, SwiGLU d_ff 28672, vocabulary 32000, untied head: 68.98B parameters), meant only to run
sharded: FP8 level O3 over an fsdp axis (FP8 Adam, masters and optimizer state sharded), full
block remat, one 4096-token sequence per device. ``benchmarks.memory_sim`` compiles its step on
simulated CPU devices without allocating it. Set ``--config.data.path`` to a large corpus.
"""

import ml_collections

from fp8jax.configs import base  # every config starts from its fields

__all__ = ["get_config"]


def get_config() -> ml_collections.ConfigDict:
    """A 70B-class LLaMA shape at FP8-LM level O3, sharded over 8 devices."""
    c = base.get_config()  # every field; the lines below override the tiny defaults
    m = c.model
    m.style = "llama"  # RoPE, RMSNorm, SwiGLU, no biases
    m.vocab_size = 32000  # LLaMA-2's SentencePiece vocabulary size
    m.d_model = 8192  # residual width
    m.num_layers = 80  # transformer blocks
    m.num_heads = 64  # 128-wide heads
    m.num_kv_heads = 8  # grouped-query attention: 8 query heads per key/value head
    m.d_ff = 28672  # SwiGLU hidden width
    m.max_len = 4096  # longest sequence, tokens
    m.dtype = "bfloat16"  # compute dtype
    m.scan_layers = True  # one compiled block: 80 unrolled blocks would compile for long
    m.remat_policy = "full"  # recompute each block in the backward pass
    m.attention_impl = "cudnn"  # flash attention (GPU only; 'xla' to run on CPU)

    c.fp8.level = "O3"  # FP8 GEMMs + FP8 Adam + sharded state

    c.batch_size = 8  # sequences per step: one per device at fsdp=8
    c.seq_len = 4096  # tokens per sequence
    c.num_train_steps = 20_000  # optimizer steps
    c.learning_rate = 1.5e-4  # Llama-2 70B's peak
    c.warmup_steps = 2000  # linear warm-up steps
    c.eval_every_steps = 1000  # validate every N steps
    c.eval_batches = 10  # validation batches per evaluation
    c.log_every_steps = 20  # scalars every N steps
    c.fp8_stats_every_steps = 1000  # FP8 health every N steps
    c.checkpoint_every_steps = 1000  # save every N steps
    c.sample_tokens = 64  # tokens sampled at the end

    # The optimizer updates the stacked kernels' shards about a layer at a time: a whole
    # shard's f32 working values (4.7B elements of wi per device) would not fit.
    c.update_slice_mib = 256.0  # MiB of f32 per value updated at a time
    c.mesh.fsdp = 8  # shard params and optimizer state over 8 devices (data = the rest)
    return c
