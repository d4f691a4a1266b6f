"""python train.py --config configs/gpt2_125m.py --workdir /tmp/gpt2_125m

GPT-2 small shape (12 layers, d_model 768, 12 heads, GELU MLP 4x, learned positions, LayerNorm)
with a 32768-token vocabulary and an untied LM head: 136M parameters (GPT-2 ties the head; tied,
this vocabulary gives 111M). FP8 level O1, bf16 compute, one GPU, 32k tokens per step. At
this width FP8's quantize passes cost about what its GEMMs save, and O1's loss tracks O0's
(measured: docs/performance.md). Point ``--config.data.path`` at a few GB of text; the shipped
corpus is far too small for this model and vocabulary.
"""

import ml_collections

from fp8jax.configs import base  # every config starts from its fields

__all__ = ["get_config"]


def get_config() -> ml_collections.ConfigDict:
    """GPT-2 small (125M class) on one GPU."""
    c = base.get_config()  # every field; the lines below override the tiny defaults
    m = c.model
    m.style = "gpt"  # learned positions, LayerNorm, GELU, biases
    m.vocab_size = 32768  # BPE vocabulary (multiple of 128 keeps the LM head GEMM aligned)
    m.d_model = 768  # residual width
    m.num_layers = 12  # transformer blocks
    m.num_heads = 12  # 64-wide heads
    m.num_kv_heads = 12  # plain multi-head attention
    m.d_ff = 3072  # 4 x d_model
    m.max_len = 1024  # learned position table, tokens
    m.dtype = "bfloat16"  # compute dtype
    m.scan_layers = False  # unrolled blocks: nn.scan's stacked buffers cost copies
    m.remat_policy = "none"  # no recompute: 12 small layers' activations fit one GPU
    m.attention_impl = "cudnn"  # flash attention (GPU only; 'xla' to run on CPU)

    c.batch_size = 32  # sequences per step: 32k tokens
    c.seq_len = 1024  # tokens per sequence
    c.num_train_steps = 20_000  # optimizer steps (~655M tokens)
    c.learning_rate = 6e-4  # GPT-2 small / nanoGPT peak
    c.warmup_steps = 700  # linear warm-up steps
    c.eval_every_steps = 1000  # validate every N steps
    c.eval_batches = 20  # validation batches per evaluation
    c.log_every_steps = 50  # scalars every N steps
    c.fp8_stats_every_steps = 1000  # FP8 health every N steps
    c.checkpoint_every_steps = 2000  # save every N steps
    c.sample_tokens = 64  # tokens sampled at the end
    return c
