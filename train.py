"""Train a decoder-only LM with FP8 mixed precision.

    python train.py --config configs/tiny.py --workdir /tmp/fp8jax_tiny
    python train.py --config configs/tiny.py --config.fp8.level=O0 --config.num_train_steps=50

This file is intentionally short: the logic lives in ``fp8jax.trainer.loop`` so notebooks and tests
call the same ``train_and_evaluate``. Rerunning with the same ``--workdir`` resumes; SIGTERM
checkpoints and exits 0. Bad flags, config, data or checkpoints exit 2 with one line on stderr
(FP8JAX_DEBUG=1 shows the traceback instead), as does a run stopped by repeated NaN/Inf.
"""

import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (get_config()).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, logs and caches.")
flags.mark_flags_as_required(["config", "workdir"])


def _fail(message) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def _parse_flags(argv):
    """absl's parsing, but a bad flag, config file or config key is one line, not a traceback."""
    try:
        args = flags.FLAGS(argv)
        _CONFIG.value.keys()  # ml_collections defers config-file errors to the first field read
        return args
    except Exception as e:  # absl, ml_collections and the config file itself raise many kinds
        if os.environ.get("FP8JAX_DEBUG"):
            raise
        from fp8jax.errors import describe_flag_error

        _fail(describe_flag_error(e, argv, flags.FLAGS["config"].value))


def _default_xla_flags() -> None:
    """Turn XLA:GPU's Triton GEMMs off unless the user chose: FP8 layers compile far faster.

    With Triton GEMM autotuning FP8 linear layers still ran cuBLASLt FP8 GEMMs but compiled
    much longer (measured: docs/performance.md). Set before jax is imported; harmless on CPU.
    """
    flags_now = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_enable_triton_gemm" not in flags_now:
        os.environ["XLA_FLAGS"] = f"{flags_now} --xla_gpu_enable_triton_gemm=false".strip()


def main(argv):
    if len(argv) > 1:
        _fail(f"unexpected arguments {argv[1:]}; set fields as --config.<field>=<value>")
    _default_xla_flags()
    # Imported after flag parsing so `--help` and config errors are fast.
    from fp8jax import cli, errors
    from fp8jax.trainer.loop import train_and_evaluate

    logging.set_verbosity(logging.INFO)
    cli.quiet_jax_backend_probe()
    cli.drop_closed_event_loop_errors()
    try:
        summary = train_and_evaluate(_CONFIG.value, _WORKDIR.value)
    except errors.USER_ERRORS as e:
        if os.environ.get("FP8JAX_DEBUG"):
            raise
        _fail(e)
    logging.info("done: %s", {k: v for k, v in summary.items() if k != "sample"})


if __name__ == "__main__":
    app.run(main, flags_parser=_parse_flags)
