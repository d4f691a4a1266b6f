"""python train.py --config configs/tiny.py --workdir /tmp/fp8jax_tiny

CPU demo: a 2-layer, 128-wide GPT trained at FP8 level O1 on the shipped corpus, in about a
minute on 2 CPU cores. The validation loss falls from ~6.2 (ln of the vocab) to ~3.6 by step
300; a checkpoint and TensorBoard logs land in the work dir and a rerun resumes from them.
Variants: ``--config configs/tiny.py:llama`` switches to the LLaMA-style block.
"""

import ml_collections

from fp8jax.configs import base  # every config starts from its fields

__all__ = ["get_config"]


def get_config(variant: str = "gpt") -> ml_collections.ConfigDict:
    """Tiny CPU config; ``variant`` is 'gpt' or 'llama'."""
    c = base.get_config()  # every field, with this run's CPU-sized defaults
    c.model.style = variant  # which block: see base.py
    if variant == "llama":
        c.model.num_kv_heads = 2  # grouped-query: 2 query heads per key/value head
        c.model.d_ff = 344  # SwiGLU's 3 matrices at ~2/3 x 4 x d_model keep the MLP size
    return c
