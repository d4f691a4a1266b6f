"""python -m fp8jax.hf.export_cli SRC OUT [--dtype bfloat16] [--max_shard_gb 5]

Exports an fp8jax work dir (its latest checkpoint, any level) or a Hugging Face model dir to the
Hugging Face dir OUT: safetensors, config.json, generation_config.json and the tokenizer. OUT
must be new or empty and is written atomically. Bad input: one line on stderr, exit code 2,
OUT untouched.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

__all__ = [
    "main",
]


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line (the UserError path), not usage + message
        from fp8jax import errors

        raise errors.ConfigError(f"{message}; see {self.prog} --help")


def main(argv: list[str] | None = None) -> int:
    """The command line; a bad input is one stderr line and exit code 2."""
    parser = _Parser(prog="python -m fp8jax.hf.export_cli", description=__doc__)
    parser.add_argument("src", help="fp8jax work dir or Hugging Face model dir")
    parser.add_argument("out", help="new (or empty) output folder")
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16, float16 or float32")
    parser.add_argument("--max_shard_gb", type=float, default=5.0, help="shard size limit, GiB")
    from fp8jax import cli, errors
    from fp8jax.hf import io

    cli.quiet_jax_backend_probe()
    cli.drop_closed_event_loop_errors()
    try:
        args = parser.parse_args(argv)
        if not (math.isfinite(args.max_shard_gb) and args.max_shard_gb > 0):
            raise errors.CheckpointError(
                f"--max_shard_gb={args.max_shard_gb}: use a finite size > 0"
            )
        out = io.export(args.src, args.out, args.dtype, int(args.max_shard_gb * 2**30))
    except errors.USER_ERRORS as e:
        if os.environ.get("FP8JAX_DEBUG"):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {args.src} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
