"""Train a decoder-only LM with FP8 mixed precision.

    python train.py --config configs/tiny.py --workdir /tmp/fp8jax_tiny
    python train.py --config configs/tiny.py --config.fp8.level=O0 --config.num_train_steps=50

This file is intentionally short: the logic lives in ``fp8jax.train`` so notebooks and tests
call the same ``train_and_evaluate``. Rerunning with the same ``--workdir`` resumes.
"""

import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (get_config()).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, logs and caches.")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    # Imported after flag parsing so `--help` and config errors are fast.
    from fp8jax import errors
    from fp8jax.train import train_and_evaluate

    logging.set_verbosity(logging.INFO)
    try:
        summary = train_and_evaluate(_CONFIG.value, _WORKDIR.value)
    except errors.USER_ERRORS as e:
        if os.environ.get("FP8JAX_DEBUG"):
            raise
        logging.error("%s", e)
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    logging.info("done: %s", {k: v for k, v in summary.items() if k != "sample"})


if __name__ == "__main__":
    app.run(main)
