"""Loss and perplexity of a checkpoint on a dataset, without training.

    python -m fp8jax.evaluate --ckpt /tmp/fp8jax_tiny --data corpus.txt --num_batches 8

``--data``: a text file, a folder of .txt files or a .jsonl file with a 'text' field per line,
tokenized as the trainer tokenizes its corpus (EOS after each document) and cut into the
trainer's validation batches (consecutive windows of ``seq_len + 1`` tokens). Prints one JSON
line. Nothing is written, in the checkpoint's dir or anywhere. Bad input exits 2 with one line
on stderr (FP8JAX_DEBUG=1 shows the traceback).
"""

from __future__ import annotations

import json
import sys

from absl import flags

from fp8jax import cli

__all__ = [
    "main",
]

_CKPT = flags.DEFINE_string("ckpt", None, "Work dir or Hugging Face model dir.")
flags.DEFINE_alias("workdir", "ckpt")  # train.py's name for a work dir
_DATA = flags.DEFINE_string(
    "data", None, "Text file, folder of .txt files, .jsonl file, or a glob pattern of them."
)
_BATCH = flags.DEFINE_integer("batch_size", 8, "Sequences per batch.")
_SEQ_LEN = flags.DEFINE_integer(
    "seq_len",
    None,
    "Tokens per sequence (default: the seq_len the work dir trained with, else 1024; at most "
    "the model's context).",
)
_NUM_BATCHES = flags.DEFINE_integer("num_batches", 8, "Batches to evaluate, at most.")
_LEVEL = flags.DEFINE_enum("level", None, ["O0", "O1"], "O0 plain matmuls, O1 FP8 matmuls.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"], "Compute dtype.")
flags.mark_flags_as_required(["ckpt", "data"])


def main(argv):
    if len(argv) > 1:
        cli.fail(f"unexpected arguments {argv[1:]}")
    with cli.user_errors():
        from fp8jax import errors
        from fp8jax.trainer import environment, inference

        environment.check_compute_dtype(_DTYPE.value, "--dtype")
        inf = inference.load(_CKPT.value, _LEVEL.value, _DTYPE.value)
        seq_len = _SEQ_LEN.value
        if seq_len is None:
            seq_len = inference.default_seq_len(_CKPT.value, inf.model.cfg.max_len)
        errors.check_int(_BATCH.value, "--batch_size", 1)
        errors.check_int(seq_len, "--seq_len", 1, inf.model.cfg.max_len)
        errors.check_int(_NUM_BATCHES.value, "--num_batches", 1)
        need = _BATCH.value * _NUM_BATCHES.value * (seq_len + 1)
        tokens = inference.text_tokens(inf.tokenizer, _DATA.value, need)
        result = inference.evaluate(inf, tokens, _BATCH.value, seq_len, _NUM_BATCHES.value)
    sys.stdout.write(json.dumps({"level": inf.level, **result}) + "\n")


if __name__ == "__main__":
    cli.run(main)
