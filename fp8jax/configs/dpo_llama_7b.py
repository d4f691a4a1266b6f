"""python train.py --config configs/dpo_llama_7b.py --workdir /tmp/dpo_7b

with --config.init_from=/path/to/checkpoint --config.data.path=/path/to/pairs.jsonl (or the
checkpoint as the config's argument: --config configs/dpo_llama_7b.py:/path/to/checkpoint).

Preference tuning (DPO) of a Llama-style 7B checkpoint: a Hugging Face dir (Llama-2-7b-chat,
Mistral-7B-Instruct) or the work dir of an SFT run (configs/sft_llama_7b.py). Policy and frozen
reference both start from it; its architecture and tokenizer are used, the lines below set the
training fields. Data: .jsonl lines of {"prompt", "chosen", "rejected"} (strings, or lists of
messages rendered with the checkpoint's chat template). FP8 level O2 (FP8/FP16 Adam, FP16
masters; the reference's weight matrices in bf16, 2 bytes/param more), bf16 compute, padded rows
of 2048 tokens, on every visible GPU (data-parallel; O3 with mesh.fsdp > 1 shards the state,
the reference's weights with it).
"""

import ml_collections

from fp8jax.configs import base  # every config starts from its fields

__all__ = ["get_config"]


def get_config(init_from: str = "") -> ml_collections.ConfigDict:
    """Preference-tune the checkpoint in ``init_from`` (a directory; required)."""
    c = base.get_config()  # every field; the model's sizes are replaced by the checkpoint's
    c.init_from = init_from  # HF model dir or fp8jax (SFT) work dir
    m = c.model
    m.style = "llama"  # the checkpoint's architecture replaces this and the sizes
    m.max_len = 4096  # longest sequence, tokens (the checkpoint's replaces it)
    m.dtype = "bfloat16"  # compute dtype (and the reference's weight matrices)
    m.scan_layers = False  # unrolled blocks: nn.scan's stacked buffers cost copies
    m.remat_policy = "full"  # block recompute ('full': activations of one block at a time)
    m.attention_impl = "cudnn"  # flash attention (GPU only; 'xla' elsewhere)
    c.fp8.level = "O2"  # FP8-LM level (see base.py); the reference's matmuls run in FP8 too

    c.data.format = "dpo"  # preference pairs
    c.data.val_fraction = 0.02  # share of the pairs held out for validation
    c.data.packing = False  # one (chosen, rejected) row pair per pair, padded
    c.data.overlong = "drop"  # pairs with a row over seq_len + 1 tokens are left out (counted)
    c.dpo.beta = 0.1  # implicit reward scale beta * (log pi - log pi_ref)
    c.dpo.label_smoothing = 0.0  # standard DPO
    c.batch_size = 64  # rows per optimizer step: 32 pairs (a multiple of 2 x data-parallel GPUs)
    c.seq_len = 2048  # tokens per row (prompt and one response)
    c.num_train_steps = 1000  # optimizer steps
    c.learning_rate = 5e-7  # peak learning rate (DPO: smaller still than SFT's)
    c.warmup_steps = 50  # linear warm-up steps
    c.min_lr_ratio = 0.1  # cosine decays to this fraction of the peak
    c.weight_decay = 0.0  # no decay of the pre-trained weights
    c.eval_every_steps = 100  # validate every N steps
    c.eval_batches = 8  # validation batches per evaluation
    c.log_every_steps = 10  # scalars every N steps
    c.fp8_stats_every_steps = 200  # FP8 health every N steps
    c.checkpoint_every_steps = 250  # save every N steps
    c.sample_tokens = 0  # no free-running sample at the end
    return c
