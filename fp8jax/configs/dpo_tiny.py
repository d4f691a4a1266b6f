"""python train.py --config configs/dpo_tiny.py --workdir /tmp/fp8jax_dpo_tiny

CPU preference-tuning (DPO) demo on the novel task built from the shipped corpus: a passage of
seq_len/4 words as the prompt, its novel's title as the chosen response and another novel's
title as the rejected one. From scratch by default (the reference is then the random init);
``--config configs/dpo_tiny.py:/tmp/fp8jax_sft_tiny`` starts policy and reference from the work
dir that ``configs/sft_tiny.py`` fine-tuned there (its architecture and tokenizer). The held-out
reward accuracy climbs from 0 (policy == reference) towards 1 and the reward margin grows
within a hundred steps, a minute or so on 2 CPU cores.
"""

import ml_collections

from fp8jax.configs import base  # every config starts from its fields

__all__ = ["get_config"]


def get_config(init_from: str = "") -> ml_collections.ConfigDict:
    """Tiny DPO config; ``init_from``: a work dir fine-tuned by configs/sft_tiny.py, or ''."""
    c = base.get_config()  # every field, with the tiny CPU model of configs/tiny.py
    c.init_from = init_from  # '' = random init; else the checkpoint policy and reference start from
    c.data.format = "dpo"  # {"prompt", "chosen", "rejected"} pairs, DPO loss
    c.data.path = ""  # '' = the novel preference pairs of the shipped corpus (dpo_data.novel_pairs)
    c.data.val_fraction = 0.1  # share of the pairs held out for validation
    c.data.packing = False  # one (chosen, rejected) row pair per pair, padded
    c.data.overlong = "drop"  # pairs with a row over seq_len + 1 tokens are left out (counted)
    c.dpo.beta = 0.1  # implicit reward scale beta * (log pi - log pi_ref)
    c.dpo.label_smoothing = 0.0  # standard DPO
    c.model.max_len = 64  # longest sequence, tokens (from scratch; a checkpoint's otherwise)
    c.seq_len = 64  # tokens per row: a 16-word passage and a title
    c.batch_size = 16  # rows per optimizer step: 8 pairs
    c.num_train_steps = 100  # optimizer steps
    c.learning_rate = 1e-3  # peak learning rate
    c.warmup_steps = 10  # linear warm-up steps
    c.weight_decay = 0.0  # no decay: the reference anchors the policy
    c.eval_every_steps = 25  # validate every N steps
    c.eval_batches = 4  # validation batches (of 8 pairs) per evaluation
    c.log_every_steps = 10  # console/TensorBoard scalars every N steps
    c.checkpoint_every_steps = 50  # save every N steps (and at the end)
    c.sample_tokens = 0  # no free-running sample at the end (a title is a few tokens)
    return c
