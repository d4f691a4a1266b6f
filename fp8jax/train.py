"""Train a decoder-only LM with FP8 mixed precision: the ``fp8jax-train`` command.

    fp8jax-train --config tiny --workdir /tmp/fp8jax_tiny
    python -m fp8jax.train --config tiny --config.fp8.level=O0 --config.num_train_steps=50
    python train.py --config configs/tiny.py --workdir /tmp/fp8jax_tiny   # from a checkout

``--config`` takes a config file's path or a shipped config's name (``tiny``, ``gpt_1b3``, ...:
fp8jax/configs/), each with an optional ``:argument`` for its ``get_config``. The logic lives in
``fp8jax.trainer.loop`` so notebooks and tests call the same ``train_and_evaluate``. Rerunning
with the same ``--workdir`` resumes; SIGTERM checkpoints and exits 0, a Ctrl-C while steps run
checkpoints and exits 130 (a second Ctrl-C stops at once). Bad flags, config, data or
checkpoints exit 2 with one line on stderr (FP8JAX_DEBUG=1 shows the traceback instead), as does
a run stopped by repeated NaN/Inf.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from typing import NoReturn

from absl import app, flags, logging
from ml_collections import config_flags

from fp8jax import cli

__all__ = ["main", "run"]

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Config file (get_config()) or a shipped config's name: tiny, gpt_1b3, ..."
)
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, logs and caches.")
flags.mark_flags_as_required(["config", "workdir"])


# A Ctrl-C outside the steps (while the data is encoded, the step compiles, the run saves).
_INTERRUPTED = "Ctrl-C; rerun the same command to resume from the last checkpoint"


def _fail(message) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def _parse_flags(argv: list[str]) -> list[str]:
    """absl's parsing, but a bad flag, config file or config key is one line, not a traceback."""
    return cli.parse_config_flags(argv, _CONFIG, "python train.py")


def _default_xla_flags() -> None:
    """Turn XLA:GPU's Triton GEMMs off unless the user chose: FP8 layers compile far faster.

    With Triton GEMM autotuning FP8 linear layers still ran cuBLASLt FP8 GEMMs but compiled
    much longer (measured: docs/performance.md). Set before jax starts a backend; harmless on
    CPU.
    """
    flags_now = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_enable_triton_gemm" not in flags_now:
        os.environ["XLA_FLAGS"] = f"{flags_now} --xla_gpu_enable_triton_gemm=false".strip()


@contextlib.contextmanager
def _ends_without_the_sample_compile():
    """A run that ends while its end sample still compiles in the background (it failed, or
    SIGTERM stopped it) ends the process at once, with the status it would have had: the
    interpreter's exit would wait for that compile, or abort when it returns mid-exit
    (``generate.compile_sample``)."""
    from fp8jax.trainer import generate

    try:
        yield
    except BaseException as e:
        if not generate.compiling_ahead():
            raise
        if isinstance(e, SystemExit):  # _fail's: its line is printed
            code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
        else:
            traceback.print_exception(e)
            code = 130 if isinstance(e, KeyboardInterrupt) else 1  # what Python exits with
        _exit_now(code)
    if generate.compiling_ahead():
        _exit_now(0)


def _exit_now(code: int) -> NoReturn:
    """End the process with ``code`` after flushing the logs, skipping the interpreter's exit."""
    logging.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str]) -> None:
    """Train the ``--config`` run in ``--workdir`` (absl's main, after flag parsing)."""
    if len(argv) > 1:
        _fail(f"unexpected arguments {argv[1:]}; set fields as --config.<field>=<value>")
    _default_xla_flags()
    # Imported after flag parsing so `--help` and config errors are fast.
    from fp8jax.trainer.loop import train_and_evaluate

    logging.set_verbosity(logging.INFO)
    cli.quiet_jax_backend_probe()
    cli.drop_closed_event_loop_errors()
    # Bad input: one line, exit 2; Ctrl-C: one line and the shell's status; no traceback.
    with _ends_without_the_sample_compile():
        with cli.user_errors(_INTERRUPTED):
            summary = train_and_evaluate(_CONFIG.value, _WORKDIR.value)
        logging.info("done: %s", {k: v for k, v in summary.items() if k != "sample"})


def run() -> None:
    """The console entry point: parse the command line and train."""
    app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
    run()
