"""The data formats by name: ``text`` (a corpus), ``tokens`` (a pre-tokenized corpus), ``mix``
(a weighted mixture of those), ``sft`` (.jsonl examples), ``dpo`` (.jsonl preference pairs),
each registered by its module over the shared build (``data_format``).

A new format is one module with a registered ``data_format.DataFormat`` subclass, imported
below; ``config.data.format`` picks it, and its ``objective`` the objective the step trains.
"""

from __future__ import annotations

import os

# The built-in formats (and token-shard readers), registered by importing them.
from fp8jax.trainer import (  # noqa: F401
    array_records,
    data,
    data_format,
    dpo_data,
    mix,
    sft_data,
    token_shards,
)
from fp8jax.trainer.data_format import DataFormat, get, names


def build(run, workdir: str | os.PathLike, tokenizer=None):
    """The dataset of ``run`` in its format (``config.data.format``): tokenizer, encoding and
    split, the work dir written only once every check passed (``data_format.build``)."""
    return data_format.build(get(run.data.format), run, workdir, tokenizer)


__all__ = ["DataFormat", "build", "get", "names"]
