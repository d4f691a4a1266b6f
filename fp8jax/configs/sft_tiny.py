"""python train.py --config configs/sft_tiny.py --workdir /tmp/fp8jax_sft_tiny

CPU fine-tuning demo: the novel task built from the shipped corpus (a passage of seq_len/4 words as
the prompt, its novel's title as the completion; loss on the title and EOS only), packed into rows
of 128 tokens. From scratch by default; ``--config configs/sft_tiny.py:/tmp/fp8jax_tiny``
fine-tunes the work dir that ``configs/tiny.py`` pre-trained there (its architecture and
tokenizer; seq_len 64, the length its model was trained on, with shorter passages).
The validation loss (per completion token) falls from ~6 to below ln(6) ~ 1.8 within about a
hundred steps, a minute or two on 2 CPU cores.
"""

import ml_collections

from fp8jax.configs import base  # every config starts from its fields

__all__ = ["get_config"]


def get_config(init_from: str = "") -> ml_collections.ConfigDict:
    """Tiny SFT config; ``init_from``: a work dir pre-trained by configs/tiny.py, or ''."""
    c = base.get_config()  # every field, with the tiny CPU model of configs/tiny.py
    c.init_from = init_from  # '' = random init; else the checkpoint to fine-tune
    c.data.format = "sft"  # prompt/completion examples, loss on completions
    c.data.path = ""  # '' = the novel task of the shipped corpus (sft_data.novel_task)
    c.data.val_fraction = 0.1  # share of the examples held out for validation
    c.data.packing = True  # several examples per row, attention kept within each
    c.data.overlong = "drop"  # examples over seq_len + 1 tokens are left out (counted)
    c.model.max_len = 128  # longest sequence, tokens (from scratch; a checkpoint's otherwise)
    c.seq_len = 128 if not init_from else 64  # tokens per row (tiny.py's model holds 64)
    c.batch_size = 8  # rows per optimizer step
    c.num_train_steps = 150  # optimizer steps
    c.learning_rate = 3e-3 if not init_from else 1e-3  # peak learning rate
    c.warmup_steps = 15  # linear warm-up steps
    c.eval_every_steps = 50  # validate every N steps
    c.eval_batches = 4  # validation batches per evaluation
    c.log_every_steps = 10  # console/TensorBoard scalars every N steps
    c.checkpoint_every_steps = 50  # save every N steps (and at the end)
    c.sample_tokens = 0  # no free-running sample at the end (a title is a few tokens)
    return c
