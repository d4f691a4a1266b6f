"""``python -m fp8jax.diagnostics.inspect --config configs/tiny.py``: FP8 coverage and memory.

Lowers (and on GPU compiles) the real train step of a config with abstract inputs, so no
parameters are allocated, and prints every matmul with its operand formats. ``--memory`` adds
bytes per parameter at O0/O1/O2 and the compiled step's memory analysis.
"""

from __future__ import annotations

import os
import sys

import jax
from absl import app, flags
from ml_collections import config_flags

from fp8jax import errors, spec
from fp8jax.diagnostics import coverage, memory
from fp8jax.optim.levels import Level
from fp8jax.trainer import environment
from fp8jax.trainer import loop as train_lib

__all__ = [
    "coverage_of",
    "lower_train_step",
    "main",
    "memory_rows",
]

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file (get_config()).")
_MEMORY = flags.DEFINE_bool("memory", False, "Also report bytes/param at O0/O1/O2.")
_COMPILE = flags.DEFINE_bool(
    "compile", None, "Compile the step too (default: on GPU only; slow for big models on CPU)."
)


def lower_train_step(run: spec.RunSpec):
    """``(setup, lowered train step)`` of ``run`` (abstract state and batch: nothing allocated)."""
    env = train_lib.setup(run)
    abstract_state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        env.abstract,
        env.state_shardings,
    )
    return env, env.train_step.lower(abstract_state, train_lib.abstract_batch(run))


def coverage_of(run: spec.RunSpec, compile_step: bool | None = None) -> coverage.CoverageReport:
    """Coverage report of ``run``'s train step."""
    _, lowered = lower_train_step(run)
    if compile_step is None:
        compile_step = jax.default_backend() == "gpu"
    return coverage.coverage_report(lowered, compile=compile_step)


def memory_rows(run: spec.RunSpec) -> list[dict]:
    """Bytes per parameter of params / grads / optimizer state at O0, O1 and O2."""
    rows = []
    for level in (Level.O0, Level.O1, Level.O2):
        abstract = train_lib.setup(spec.with_level(run, level)).abstract
        rows.append(memory.bytes_per_param(abstract.params, abstract.opt_state, level=level))
    return rows


def main(argv):
    del argv
    from fp8jax import cli

    cli.quiet_jax_backend_probe()
    cli.drop_closed_event_loop_errors()
    try:
        run = spec.parse(_CONFIG.value)
        environment.check_environment(run, training=False)
        return _report(run)
    except errors.USER_ERRORS as e:  # a bad config is one line, as in train.py
        if os.environ.get("FP8JAX_DEBUG"):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2


def _report(run: spec.RunSpec) -> int:
    """Print the coverage report (and memory tables) of ``run``."""
    report = coverage_of(run, _COMPILE.value)
    print(f"FP8 coverage of the train step ({run.fp8.level}, backend {jax.default_backend()}):")
    print(report)
    if _MEMORY.value:
        print(memory.memory_table(memory_rows(run)))
        _, lowered = lower_train_step(run)
        print(memory.format_compiled_memory(memory.compiled_memory(lowered.compile())))
    return 0


def _parse_flags(argv: list[str]) -> list[str]:
    from fp8jax import cli

    return cli.parse_config_flags(argv, _CONFIG, "python -m fp8jax.diagnostics.inspect")


if __name__ == "__main__":
    flags.mark_flags_as_required(["config"])
    sys.exit(app.run(main, flags_parser=_parse_flags))
