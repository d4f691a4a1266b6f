"""Console and TensorBoard metrics, compiled-memory logging and FP8 health summaries."""

from __future__ import annotations

import os

import jax
import numpy as np
from absl import logging

from fp8jax.diagnostics import memory
from fp8jax.nn import state as fp8_state


class _QuietLibraries:
    """Drop INFO records from orbax/grain (they log every save and read at INFO)."""

    def filter(self, record) -> bool:
        noisy = any(n in record.pathname for n in ("/orbax/", "/grain/"))
        return record.levelno >= 30 or not noisy


def quiet_library_logs():
    """Keep the console readable: our INFO lines, libraries' warnings only."""
    from absl import logging as absl_logging

    handler = absl_logging.get_absl_handler()
    if not any(isinstance(f, _QuietLibraries) for f in handler.filters):
        handler.addFilter(_QuietLibraries())


class Writer:
    """TensorBoard scalars (tensorboardX) under ``<workdir>/tensorboard``; no-op if disabled."""

    def __init__(self, workdir: str, enabled: bool = True):
        self._w = None
        if enabled:
            from tensorboardX import SummaryWriter

            self._w = SummaryWriter(os.path.join(workdir, "tensorboard"))

    def scalars(self, step: int, values: dict):
        """Write a dict of scalars at ``step``."""
        if self._w is None:
            return
        for k, v in values.items():
            v = np.asarray(jax.device_get(v))
            if v.size == 1 and np.issubdtype(v.dtype, np.number) and np.isfinite(v):
                self._w.add_scalar(k, float(v), step)
        self._w.flush()

    def close(self):
        """Flush and close the event file."""
        if self._w is not None:
            self._w.close()


def fmt(values: dict) -> str:
    """``k=v`` pairs with 4 significant digits for floats; strings as they are."""
    parts = []
    for k, v in values.items():
        if isinstance(v, str):
            parts.append(f"{k}={v}")
            continue
        v = np.asarray(jax.device_get(v))
        parts.append(f"{k}={float(v):.4g}" if v.size == 1 else f"{k}={v.tolist()}")
    return " ".join(parts)


def log_memory(compiled):
    """Log the compiled train step's memory analysis before step 0."""
    mem = memory.compiled_memory(compiled)
    if mem:
        parts = ", ".join(f"{k}={v / 2**20:.1f}MiB" for k, v in mem.items())
        logging.info("train step memory: %s", parts)


def _stat_leaves(stats):
    """``(name, kind, values[layers])`` per sown health leaf; ``kind`` 'saturated' or 'flushed'.

    ``sow`` stores each value as a one-element tuple, so a leaf's path ends in that tuple's
    index; stacked (``nn.scan``) layers give one value per layer.
    """
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(stats)[0]:
        keys = [k for k in path if hasattr(k, "key")]
        kind = next(
            (s for s in ("saturated", "flushed") if keys and str(keys[-1].key).endswith(f"_{s}")),
            None,
        )
        name = "/".join(str(k.key) for k in keys)
        out.append((name, kind, np.asarray(jax.device_get(leaf), np.float64).reshape(-1)))
    return out


def fp8_health(state, stats) -> dict:
    """Per-layer amax, scale and saturation / flush-to-zero shares as flat scalars.

    Stacked layers get a ``_<layer>`` suffix: ``fp8_stats/blocks/mlp/wi/x_saturated_1``.
    """
    out = {f"fp8/{k}": float(v) for k, v in jax.device_get(fp8_state.summarize(state.fp8)).items()}
    for name, _, values in _stat_leaves(stats):
        if values.size == 1:
            out[f"fp8_stats/{name}"] = float(values[0])
        else:
            out.update({f"fp8_stats/{name}_{i}": float(v) for i, v in enumerate(values)})
    return out


def fp8_worst(stats) -> dict:
    """The largest saturated and flushed shares over every FP8 operand, and where they are.

    ``{'fp8_max_saturated': share, 'fp8_max_saturated_at': 'blocks/mlp/.../x_saturated_1',
    'fp8_max_flushed': ..., 'fp8_max_flushed_at': ...}``; a NaN share stays NaN (it wins).
    """
    leaves = _stat_leaves(stats)
    out = {}
    for kind in ("saturated", "flushed"):
        shares = [
            (float(v), name if values.size == 1 else f"{name}_{i}")
            for name, k, values in leaves
            if k == kind
            for i, v in enumerate(values)
        ]
        nan = [s for s in shares if np.isnan(s[0])]
        worst, where = nan[0] if nan else max(shares, default=(0.0, ""))
        out[f"fp8_max_{kind}"], out[f"fp8_max_{kind}_at"] = worst, where
    return out
