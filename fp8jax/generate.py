"""Generate text from a checkpoint (an fp8jax work dir or a Hugging Face model dir).

    python -m fp8jax.generate --ckpt /tmp/fp8jax_tiny --prompt "It is a truth" --max_new_tokens 32
    python -m fp8jax.generate --ckpt DIR --prompts_file prompts.txt --temperature 0.8 --top_p 0.9

One prompt per ``--prompt`` flag (repeatable) or per line of ``--prompts_file``; each completion
is printed after its prompt. Greedy unless ``--temperature`` > 0. ``--level O1`` runs the FP8
matmuls with the checkpoint's trained scales (the default when it has them). Nothing is
written. Bad input exits 2 with one line on stderr (FP8JAX_DEBUG=1 shows the traceback).
"""

from __future__ import annotations

import sys

from absl import flags

from fp8jax import cli

__all__ = [
    "main",
    "prompts",
]

_CKPT = flags.DEFINE_string("ckpt", None, "Work dir or Hugging Face model dir.")
_PROMPT = flags.DEFINE_multi_string("prompt", [], "A prompt (repeat the flag for a batch).")
_PROMPTS_FILE = flags.DEFINE_string("prompts_file", None, "A text file of prompts, one a line.")
_MAX_NEW = flags.DEFINE_integer(
    "max_new_tokens",
    64,
    "Tokens to generate per prompt, at most (left unset: also at most what the context leaves).",
)
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "Sampling temperature (0 = greedy).")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens (0 = all).")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Keep the nucleus of this probability (1 = all).")
_SEED = flags.DEFINE_integer("seed", 0, "PRNG seed of the sampling.")
_LEVEL = flags.DEFINE_enum("level", None, ["O0", "O1"], "O0 plain matmuls, O1 FP8 matmuls.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"], "Compute dtype.")
flags.mark_flag_as_required("ckpt")


def prompts() -> list[str]:
    """The prompts of ``--prompt`` and ``--prompts_file``, in that order."""
    from fp8jax import errors

    found = list(_PROMPT.value)
    if _PROMPTS_FILE.value:
        try:
            with open(_PROMPTS_FILE.value, encoding="utf-8") as f:
                found += [line.rstrip("\n") for line in f if line.strip()]
        except OSError as e:
            raise errors.ConfigError(f"--prompts_file: {e.strerror}: {e.filename}") from None
    if not found:
        raise errors.ConfigError("no prompt: pass --prompt TEXT or --prompts_file FILE")
    return found


def main(argv):
    if len(argv) > 1:
        cli.fail(f"unexpected arguments {argv[1:]}; pass prompts as --prompt TEXT")
    with cli.user_errors():
        from fp8jax.trainer import generate, inference

        texts = prompts()
        inf = inference.load(_CKPT.value, _LEVEL.value, _DTYPE.value)
        max_new = _MAX_NEW.value
        if not flags.FLAGS["max_new_tokens"].present:  # the default fits the model's context
            longest = max(len(inf.tokenizer.encode(t)) or 1 for t in texts)
            max_new = max(min(max_new, inf.model.cfg.max_len - longest), 1)
        out = generate.generate(
            inf.model,
            inf.params,
            inf.fp8_state,
            inf.tokenizer,
            texts,
            max_new,
            temperature=_TEMPERATURE.value,
            top_k=_TOP_K.value,
            top_p=_TOP_P.value,
            seed=_SEED.value,
        )
    for prompt, completion in zip(texts, out, strict=True):
        sys.stdout.write(f"{prompt}{completion}\n")


if __name__ == "__main__":
    cli.run(main)
