"""python train.py --config configs/gpt_1b3.py --workdir /tmp/gpt_1b3

GPT 1.3B: d_model 2048, 24 layers, 16 heads, GELU MLP 4x, seq 2048, batch 8 (16384 tokens per
step), vocabulary 32768, untied LM head: 1.35B parameters. FP8 level O1, bf16 compute, one GPU.
The shape of the whole-model reference in docs h200-measured.md (one H200, forward + backward
only: PyTorch bf16 68.0k tokens/s, torchao float8 76.5k, Flax bf16 50.7k). Full train step
with AdamW on one H200 (benchmarks/RESULTS.md, 2026-11-30 seventh, jax 0.11.2,
XLA_FLAGS=--xla_gpu_enable_triton_gemm=false, pipelined steps): O0 256.9 ms/step (63.8k
tokens/s, 50.6 GiB peak), O1 186.1 ms (88.0k, 39.7 GiB); O2 ran 1% behind O1 with 7 GiB
less (2026-11-30 day); PyTorch compiled bf16 61.4k, torchao float8 67.1k (2026-11-29 night).
``--config.model.fp8_lm_head=True`` runs the LM head in FP8 too: 184 ms (89.0k tokens/s,
1.40x O0), with a gpt2_125m loss 0.24% above O0's against O1's 0.09% (2026-11-30 tenth).
Compiles in ~25 s (O0) / ~55 s (O1) / ~90 s (O2). Run time and loss of a full training run:
not measured yet. Set ``--config.data.path`` to a large corpus.
"""

import importlib.util
import pathlib

import ml_collections


def _base():
    """configs/base.py, loaded by path because train.py loads configs as files."""
    spec = importlib.util.spec_from_file_location(
        "fp8jax_configs_base", pathlib.Path(__file__).with_name("base.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def get_config() -> ml_collections.ConfigDict:
    """GPT 1.3B on one GPU, the shape of the measured H200 reference."""
    c = _base().get_config()  # every field; the lines below override the tiny defaults
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
    m.scan_layers = False  # unrolled: nn.scan's stacked buffers cost copies (benchmarks/RESULTS.md)
    # One FP8 GEMM for Q, K and V: one quantization of x, 288 FP8 GEMMs instead of 360; on an
    # H200 the O1 step ran 1.9% faster pipelined (benchmarks/RESULTS.md, 2026-11-30, sixth).
    m.fused_qkv = True  # kernel [embed, kv_heads, group + 2, head_dim]
    m.remat_policy = "none"  # 16k tokens x 24 layers of activations fit in 141 GB
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
