"""python train.py --config configs/sft_llama_1b.py --workdir /tmp/sft_1b

with --config.init_from=/path/to/hf_model --config.data.path=/path/to/train.jsonl (or the
checkpoint as the config's argument: --config configs/sft_llama_1b.py:/path/to/hf_model).

Supervised fine-tuning of an imported Hugging Face checkpoint: TinyLlama-1.1B-Chat or another
Llama-style ~1B HF dir.
The architecture and tokenizer come from the checkpoint (init_from); the lines below set only
the training fields. Data: .jsonl lines of {"messages": [...]} (rendered with the checkpoint's
chat template, loss on the assistant turns) or {"prompt", "completion"}. FP8 level O1, bf16
compute, packed rows of 2048 tokens, on one GPU.
"""

import ml_collections

from fp8jax.configs import base  # every config starts from its fields

__all__ = ["get_config"]


def get_config(init_from: str = "") -> ml_collections.ConfigDict:
    """Fine-tune the HF checkpoint in ``init_from`` (a directory; required)."""
    c = base.get_config()  # every field; the model's sizes are replaced by the checkpoint's
    c.init_from = init_from  # HF model dir (config.json, *.safetensors, tokenizer.json)
    m = c.model
    m.style = "llama"  # the checkpoint's architecture replaces this and the sizes
    m.max_len = 2048  # longest sequence, tokens (the checkpoint's replaces it)
    m.dtype = "bfloat16"  # compute dtype
    m.scan_layers = False  # unrolled blocks: nn.scan's stacked buffers cost copies
    m.remat_policy = "none"  # block recompute ('full': activations of one block at a time)
    m.attention_impl = "cudnn"  # flash attention with segment ids (GPU only; 'xla' elsewhere)
    c.fp8.level = "O1"  # FP8-LM level (see base.py)

    c.data.format = "sft"  # fine-tuning examples
    c.data.val_fraction = 0.02  # share of the examples held out for validation
    c.data.packing = True  # several examples per row, attention kept within each
    c.data.overlong = "drop"  # examples longer than seq_len + 1 tokens are left out (counted)
    c.batch_size = 16  # rows per optimizer step
    c.seq_len = 2048  # tokens per row
    c.num_train_steps = 2000  # optimizer steps
    c.learning_rate = 2e-5  # peak learning rate (fine-tuning: small)
    c.warmup_steps = 50  # linear warm-up steps
    c.min_lr_ratio = 0.1  # cosine decays to this fraction of the peak
    c.weight_decay = 0.0  # no decay of the pre-trained weights
    c.eval_every_steps = 200  # validate every N steps
    c.eval_batches = 16  # validation batches per evaluation
    c.log_every_steps = 10  # scalars every N steps
    c.fp8_stats_every_steps = 200  # FP8 health every N steps
    c.checkpoint_every_steps = 500  # save every N steps
    c.sample_tokens = 0  # no free-running sample at the end
    return c
